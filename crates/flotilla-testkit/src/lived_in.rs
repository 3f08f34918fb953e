//! A lived-in deployment: history built through a running Flotilla deployment's own API, and
//! every read the deployment answers about it, so a test (or a bench) can restart a service
//! onto that history and check that it answers the same and still works.
//!
//! A fresh deployment hides the faults of a restart: a mirror that waits for a write only its
//! own process makes, a consumer that starts at "now", a cache that is never filled. So the
//! deployment is given what a platform team's has after a while:
//!
//! - runs that succeeded (a DAG, with workspace entries, mailbox messages and session state),
//!   failed (a failure record), were cancelled (an approval withdrawn) and rolled back (a
//!   compensation run as a child), a workflow with child runs, and `bulk` more small runs;
//! - approvals pending (a seven-day deadline), approved, rejected; a grant for the session
//!   (an LLM attempt's tool call approved "always");
//! - trust: enabled, an agent pinned expert (its sensitive tasks need no approval), an
//!   incident recorded against another;
//! - remembered runs (the supervisor's memory), failure records;
//! - teammates: one idle after a turn, one never woken, one shut down;
//! - a recruit accepted into a run held by an approval;
//! - a run paused, a run taken over, a task paused — each for seven days;
//! - webhook deliveries pending (an endpoint that refuses every POST).
//!
//! [`LivedIn::build`] makes it (the services must be running with [`config`]); [`LivedIn::reads`]
//! reads everything back, with the fields that move by themselves (presence, sliding windows,
//! a running run's duration) left out, so two reads of a quiescent deployment compare equal;
//! [`LivedIn::exercise`] runs one new run of every kind and checks each ends as it should.
//!
//! The agents are deterministic: `scripted` and `exec` agents, workflow agents, and one LLM
//! agent on the test kit's scripted OpenAI-compatible server ([`crate::openai`], a test
//! double, not a model).

use std::collections::BTreeMap;
use std::time::Duration;

use flotilla_client::{Client, ClientError};
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::api::{
    MboxReadRequest, MboxSendRequest, StateGetRequest, StateListRequest, StateSetRequest,
    WsAppendRequest, WsReadRequest,
};
use flotilla_model::approval::{
    ApprovalAnswerRequest, ApprovalListRequest, ApprovalStatus, Decision, GrantListRequest,
    PlanHitl,
};
use flotilla_model::control::{PauseRunRequest, TakeoverRunRequest};
use flotilla_model::ids::{RunId, SessionId, TaskId};
use flotilla_model::memory::{MemoryGetRequest, MemoryListRequest};
use flotilla_model::plan::{Plan, PlanConfig, Subtask};
use flotilla_model::recruit::{RecruitRequest, RecruitStatusRequest};
use flotilla_model::run::RunStatus;
use flotilla_model::submit::SubmitRequest;
use flotilla_model::team::{RecordScope, TeamListRequest, TeamStatsRequest};
use flotilla_model::teammate::{
    TeamMatesRequest, TeamSendRequest, TeamShutdownRequest, TeamSpawnRequest, TeammateStatus,
};
use flotilla_model::time::Secs;
use flotilla_model::tree::RunTreeRequest;
use flotilla_model::trust::{TrustIncidentRequest, TrustLevel, TrustListRequest, TrustSetRequest};
use serde_json::{Value, json};

use crate::openai::{OpenAiServer, Reply};

/// Why building, reading or exercising the deployment failed.
#[derive(Debug, thiserror::Error)]
pub enum LivedInError {
    /// A request or read failed.
    #[error("{what}: {source}")]
    Client {
        /// What was being done.
        what: String,
        /// The client's error.
        #[source]
        source: ClientError,
    },
    /// Something did not happen in time.
    #[error("{0}")]
    Timeout(String),
    /// Something happened that should not have.
    #[error("{0}")]
    Unexpected(String),
}

fn client_err(what: impl Into<String>) -> impl FnOnce(ClientError) -> LivedInError {
    let what = what.into();
    move |source| LivedInError::Client { what, source }
}

/// How long one request may take.
const ASK: Duration = Duration::from_secs(10);

/// How long a run or a change may take to show.
const WAIT: Duration = Duration::from_secs(60);

/// Bulk runs read back by [`LivedIn::reads`] at most (the first ones).
const MAX_BULK_READS: usize = 200;

/// Bulk runs submitted and waited for at once.
const BULK_BATCH: usize = 256;

/// Seven days: every hold and deadline of the history outlives any test.
const WEEK_MS: u64 = 7 * 24 * 3600 * 1000;

/// Who the person answering is.
const PERSON: &str = "alice";

/// The deployment's agents and policies (without `[nats]`, `[coordinator]` and `[worker]`,
/// which the caller's harness writes): `model` is the base URL of the scripted
/// OpenAI-compatible server the `mailer` agent talks to.
pub fn config(model: &str) -> String {
    let mut agents = String::new();
    // Every agent but `vetted` gets its mode from `[hitl.agents]`; `vetted` takes the level
    // it is pinned at.
    for a in [
        "echo", "slow", "broken", "work", "undo", "review", "drafter", "critic", "mailer",
    ] {
        agents.push_str(&format!("{a} = \"human_in_the_loop\"\n"));
    }
    format!(
        r#"
default-agent = "echo"

[agents.echo]
kind = "scripted"
reply = "{{task_id}} done 42"
roles = ["analyst"]

[agents.slow]
kind = "scripted"
reply = "{{task_id}} done slowly"
delay = "2s"

[agents.broken]
kind = "scripted"
reply = "never"
fail-first = 1000
failure = "scripted failure"

[agents.vetted]
kind = "scripted"
reply = "{{task_id}} vetted"

[agents.work]
kind = "exec"
command = "sh"
args = ["-c", "cat >/dev/null; echo $FLOTILLA_TASK_ID done"]
compensate = "undo"

[agents.undo]
kind = "exec"
command = "sh"
args = ["-c", "cat >/dev/null; echo undone"]

[agents.review]
kind = "sequential"
sub-agents = ["drafter", "critic"]

[agents.drafter]
kind = "scripted"
reply = "draft of: {{description}}"

[agents.critic]
kind = "scripted"
reply = "critique"

[agents.mailer]
kind = "llm"
base-url = "{model}"
model = "scripted-model"

[agents.mailer.exec-tools.send_email]
command = "sh"
args = ["-c", "cat >/dev/null; echo sent"]
description = "Sends an email"
parameters = {{ type = "object", properties = {{ to = {{ type = "string" }} }}, required = ["to"] }}

[hitl]
sensitive-actions = ["publish", "send_email"]
approval-timeout = "7days"

[hitl.agents]
{agents}
[hitl.roles]
analyst = "human_in_the_loop"

[hitl.trust]
enabled = true

[[supervisor.webhooks]]
name = "ops"
url = "http://127.0.0.1:9/flotilla"
timeout = "1s"
backoff = "1s"
max-backoff = "5m"
max-attempts = 100
"#
    )
}

/// What [`LivedIn::build`] made: the runs and names the reads and the exercise look at.
#[derive(Debug, Clone)]
pub struct LivedIn {
    /// The session the collaboration runs and the grant belong to.
    pub session: SessionId,
    /// Runs by what they are (`succeeded`, `failed`, `cancelled`, `rolled_back`, `workflow`,
    /// `approved`, `rejected`, `granted`, `pending`, `paused`, `taken_over`, `task_paused`).
    pub runs: BTreeMap<&'static str, RunId>,
    /// The bulk runs.
    pub bulk: Vec<RunId>,
    /// The teammates' team.
    pub team: String,
}

fn sensitive(id: &str, agent: &str) -> Subtask {
    let mut s = Subtask::new(id, "publish the report").with_agent(agent);
    s.action = Some("publish".into());
    s
}

fn plan_of(name: &str, subtasks: Vec<Subtask>) -> Plan {
    Plan {
        fork: None,
        name: Some(name.into()),
        query: Some(format!("lived-in: {name}")),
        subtasks,
        config: PlanConfig {
            hitl: Some(PlanHitl {
                approval_timeout: Some(Secs::from_secs(WEEK_MS / 1000)),
                ..PlanHitl::default()
            }),
            ..PlanConfig::default()
        },
    }
}

impl LivedIn {
    /// Builds the history through `client` on a deployment running [`config`]`(model's URL)`
    /// with at least one coordinator, worker and supervisor; `bulk` more one-task runs.
    pub async fn build(
        client: &Client,
        model: &OpenAiServer,
        bulk: usize,
    ) -> Result<Self, LivedInError> {
        let session = SessionId::new();
        let mut runs = BTreeMap::new();
        // Pins first: an admission reads the levels as of its submission.
        trust_set(client, "vetted", TrustLevel::Expert).await?;
        request(
            client,
            &TrustIncidentRequest {
                protocol: PROTOCOL_VERSION,
                scope: RecordScope::Agent,
                name: "broken".into(),
                reason: "published a draft".into(),
                by: PERSON.into(),
            },
            "recording an incident",
        )
        .await?;

        // Succeeded, with collaboration state.
        let mut dag = plan_of(
            "succeeded",
            vec![
                Subtask::new("a", "first"),
                Subtask::new("b", "left").after(&["a"]),
                Subtask::new("c", "right").after(&["a"]),
            ],
        );
        dag.subtasks[1].role = Some("analyst".into());
        let ok = submit(client, dag, Some(session)).await?;
        runs.insert("succeeded", ok);
        // Failed: a required task with no retries.
        let mut failing = plan_of(
            "failed",
            vec![Subtask::new("x", "fails").with_agent("broken")],
        );
        failing.config.max_retries = 0;
        runs.insert("failed", submit(client, failing, None).await?);
        // A workflow: two child runs.
        runs.insert(
            "workflow",
            submit(
                client,
                plan_of(
                    "workflow",
                    vec![Subtask::new("main", "the launch plan").with_agent("review")],
                ),
                Some(session),
            )
            .await?,
        );
        // Vetted: an expert's sensitive task needs no approval.
        runs.insert(
            "vetted",
            submit(
                client,
                plan_of("vetted", vec![sensitive("ship", "vetted")]),
                None,
            )
            .await?,
        );
        for (name, want) in [
            ("succeeded", RunStatus::Succeeded),
            ("failed", RunStatus::Failed),
            ("workflow", RunStatus::Succeeded),
            ("vetted", RunStatus::Succeeded),
        ] {
            ends(client, runs[name], want).await?;
        }

        // Approvals: one approved, one rejected, and holds of every kind.
        for name in [
            "approved",
            "rejected",
            "cancelled",
            "pending",
            "paused",
            "taken_over",
        ] {
            let run = submit(
                client,
                plan_of(
                    name,
                    vec![
                        sensitive("gate", "echo"),
                        Subtask::new("after", "announce").after(&["gate"]),
                    ],
                ),
                None,
            )
            .await?;
            awaiting(client, run, "t0a1").await?;
            runs.insert(name, run);
        }
        answer(client, runs["approved"], "t0a1", Decision::Approve).await?;
        answer(
            client,
            runs["rejected"],
            "t0a1",
            Decision::Reject {
                message: "not this week".into(),
            },
        )
        .await?;
        client
            .cancel(runs["cancelled"], Some("changed our minds".into()))
            .await
            .map_err(client_err("cancelling a run"))?;
        ends(client, runs["approved"], RunStatus::Succeeded).await?;
        ends(client, runs["rejected"], RunStatus::Failed).await?;
        ends(client, runs["cancelled"], RunStatus::Cancelled).await?;

        // Rolled back: `work` succeeded, then the run is cancelled with its compensation.
        let mut undoable = plan_of(
            "rolled_back",
            vec![
                Subtask::new("work", "do it").with_agent("work"),
                sensitive("gate", "echo").after(&["work"]),
            ],
        );
        undoable.config.max_retries = 0;
        let rb = submit(client, undoable, None).await?;
        awaiting(client, rb, "t1a1").await?;
        client
            .cancel_and_roll_back(rb, Some("wrong figures".into()))
            .await
            .map_err(client_err("rolling a run back"))?;
        ends(client, rb, RunStatus::Cancelled).await?;
        ends(
            client,
            flotilla_model::rollback::rollback_run_id(rb),
            RunStatus::Succeeded,
        )
        .await?;
        runs.insert("rolled_back", rb);

        // A grant: the mailer's tool call approved for the session.
        model.push_all([
            Reply::tool_call("send_email", json!({"to": "ana@example.com"})),
            Reply::text("mailed ana"),
        ]);
        let granted = submit(
            client,
            plan_of(
                "granted",
                vec![Subtask::new("mail", "mail ana").with_agent("mailer")],
            ),
            Some(session),
        )
        .await?;
        awaiting(client, granted, "t0a1c1").await?;
        request(
            client,
            &ApprovalAnswerRequest {
                always: true,
                ..answer_request(granted, "t0a1c1", Decision::Approve)
            },
            "approving for the session",
        )
        .await?;
        ends(client, granted, RunStatus::Succeeded).await?;
        runs.insert("granted", granted);

        // Holds: a recruit joins the pending run; a pause, a takeover, a task pause.
        let pending = runs["pending"];
        let recruit: flotilla_model::recruit::RecruitReply = request(
            client,
            &RecruitRequest {
                protocol: PROTOCOL_VERSION,
                run_id: pending,
                recruit_id: "r1".into(),
                role: "analyst".into(),
                description: "check the figures".into(),
                reason: "the team needs it".into(),
                task_id: None,
                dependencies: Vec::new(),
                produces: Vec::new(),
                consumes: Vec::new(),
                required: false,
                by_task: None,
            },
            "recruiting",
        )
        .await?;
        if recruit.status != flotilla_model::recruit::RecruitStatus::Accepted {
            return Err(LivedInError::Unexpected(format!(
                "the recruit was not accepted: {recruit:?}"
            )));
        }
        until(client, "the recruit's task to succeed", || async {
            Ok(client
                .run(pending)
                .await
                .map_err(client_err("reading a run"))?
                .is_some_and(|v| {
                    v.tasks.iter().any(|t| {
                        t.task_id.as_str() == "recruit-r1"
                            && t.status == flotilla_model::run::TaskStatus::Succeeded
                    })
                }))
        })
        .await?;
        let paused: flotilla_model::control::ControlRunReply = request(
            client,
            &PauseRunRequest {
                protocol: PROTOCOL_VERSION,
                run_id: runs["paused"],
                reason: Some("legal review".into()),
                by: Some(PERSON.into()),
                timeout_ms: Some(WEEK_MS),
                children: true,
                task_id: None,
            },
            "pausing a run",
        )
        .await?;
        expect(paused.applied, "the pause was not applied")?;
        let taken: flotilla_model::control::ControlRunReply = request(
            client,
            &TakeoverRunRequest {
                protocol: PROTOCOL_VERSION,
                run_id: runs["taken_over"],
                reason: Some("the agents are stuck".into()),
                by: Some(PERSON.into()),
                timeout_ms: Some(WEEK_MS),
                children: true,
            },
            "taking a run over",
        )
        .await?;
        expect(taken.applied, "the takeover was not applied")?;
        status_becomes(client, runs["paused"], RunStatus::Paused).await?;
        status_becomes(client, runs["taken_over"], RunStatus::HumanControl).await?;
        let task_paused = submit(
            client,
            plan_of(
                "task_paused",
                vec![
                    sensitive("gate", "echo"),
                    Subtask::new("later", "afterwards").after(&["gate"]),
                ],
            ),
            None,
        )
        .await?;
        awaiting(client, task_paused, "t0a1").await?;
        let held: flotilla_model::control::ControlRunReply = request(
            client,
            &PauseRunRequest {
                protocol: PROTOCOL_VERSION,
                run_id: task_paused,
                reason: Some("wait for the figures".into()),
                by: Some(PERSON.into()),
                timeout_ms: Some(WEEK_MS),
                children: false,
                task_id: Some(TaskId::new("later")),
            },
            "pausing a task",
        )
        .await?;
        expect(held.applied, "the task pause was not applied")?;
        runs.insert("task_paused", task_paused);

        // Collaboration state of the succeeded run and the session.
        request(
            client,
            &WsAppendRequest {
                protocol: PROTOCOL_VERSION,
                run_id: ok,
                topic: "Notes".into(),
                entry: json_map(json!({"text": "hello", "n": 1})),
                task_id: None,
                attempt: None,
                by: Some("client".into()),
                idempotency_key: Some("note-1".into()),
            },
            "writing a workspace entry",
        )
        .await?;
        request(
            client,
            &MboxSendRequest {
                protocol: PROTOCOL_VERSION,
                run_id: ok,
                from: "dashboard".into(),
                to: "b".into(),
                kind: flotilla_model::mailbox::MailboxKind::Info,
                payload: json!({"hint": 1}),
                correlation_id: None,
                attempt: None,
                idempotency_key: Some("hint-1".into()),
            },
            "sending mail",
        )
        .await?;
        request(
            client,
            &StateSetRequest {
                protocol: PROTOCOL_VERSION,
                run_id: None,
                session_id: Some(session),
                key: "plan".into(),
                value: json!({"step": 1}),
                expected_revision: None,
            },
            "setting session state",
        )
        .await?;

        // Teammates: idle after a turn, never woken, shut down.
        let team = format!("crew-{}", &session.to_string()[..8]);
        for name in ["ann", "bob", "cy"] {
            request(
                client,
                &TeamSpawnRequest {
                    protocol: PROTOCOL_VERSION,
                    team: Some(team.clone()),
                    name: name.into(),
                    role: "analyst".into(),
                    instructions: "answer briefly".into(),
                    agent: Some("echo".into()),
                    pool: None,
                    by: Some(PERSON.into()),
                    expose: false,
                },
                "spawning a teammate",
            )
            .await?;
        }
        send(client, &team, "ann", "hello").await?;
        mate_becomes(client, &team, "ann", |m| {
            m.status == TeammateStatus::Idle && m.turns == 1
        })
        .await?;
        request(
            client,
            &TeamShutdownRequest {
                protocol: PROTOCOL_VERSION,
                team: Some(team.clone()),
                name: "cy".into(),
            },
            "shutting a teammate down",
        )
        .await?;
        mate_becomes(client, &team, "cy", |m| {
            m.status == TeammateStatus::Shutdown
        })
        .await?;

        // Bulk runs, a batch at a time.
        let mut bulk_runs = Vec::with_capacity(bulk);
        for chunk in (0..bulk).collect::<Vec<_>>().chunks(BULK_BATCH) {
            let ids = futures::future::try_join_all(chunk.iter().map(|i| {
                submit(
                    client,
                    plan_of(&format!("bulk-{i}"), vec![Subtask::new("t", "one task")]),
                    None,
                )
            }))
            .await?;
            futures::future::try_join_all(
                ids.iter().map(|id| ends(client, *id, RunStatus::Succeeded)),
            )
            .await?;
            bulk_runs.extend(ids);
        }

        // Remembered: every terminal root run (the supervisor writes them as they end).
        for name in [
            "succeeded",
            "failed",
            "workflow",
            "approved",
            "rejected",
            "cancelled",
            "rolled_back",
            "granted",
        ] {
            remembered(client, runs[name]).await?;
        }
        let this = Self {
            session,
            runs,
            bulk: bulk_runs,
            team,
        };
        this.settled(client).await?;
        Ok(this)
    }

    /// Waits until nothing of the history moves any more: no attempt in flight, no teammate
    /// in a turn, every remembered run written.
    pub async fn settled(&self, client: &Client) -> Result<(), LivedInError> {
        until(
            client,
            "the roster to have no attempt in flight",
            || async {
                let list: flotilla_model::team::TeamList = request(
                    client,
                    &TeamListRequest {
                        protocol: PROTOCOL_VERSION,
                        role: None,
                    },
                    "listing the team",
                )
                .await?;
                Ok(list.members.iter().all(|m| m.tasks.is_empty())
                    && list
                        .teammates
                        .iter()
                        .all(|t| t.status != TeammateStatus::Working))
            },
        )
        .await
    }

    /// Every read the deployment answers about the history, as comparable JSON: what moves by
    /// itself (heartbeats, sliding windows, a held run's growing duration) is left out; the
    /// members' presence is kept (see [`Reads::without_presence`]). Two reads of a quiescent deployment are equal; a read after a
    /// restart must equal the read before it.
    pub async fn reads(&self, client: &Client) -> Result<Reads, LivedInError> {
        let mut out = BTreeMap::new();
        let store = flotilla_client::open_store(client.bus())
            .await
            .map_err(client_err("opening the run store"))?;
        let mut all_runs: Vec<(String, RunId)> = self
            .runs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), *v))
            .collect();
        all_runs.push((
            "rollback".into(),
            flotilla_model::rollback::rollback_run_id(self.runs["rolled_back"]),
        ));
        for (name, run) in &all_runs {
            let view = client
                .run(*run)
                .await
                .map_err(client_err("reading a run"))?;
            out.insert(format!("run.{name}"), to_value(&view));
            let tree: flotilla_model::tree::RunTree =
                request(client, &RunTreeRequest::new(*run), "reading a run tree").await?;
            out.insert(format!("tree.{name}"), to_value(&tree));
            let history = store
                .history(*run)
                .await
                .map_err(|e| LivedInError::Unexpected(format!("reading a run log: {e}")))?;
            out.insert(format!("runlog.{name}"), json!(history.len()));
        }
        out.insert(
            "runs.bulk".into(),
            json!(
                futures::future::try_join_all(self.bulk.iter().take(MAX_BULK_READS).map(
                    |r| async move {
                        client
                            .run(*r)
                            .await
                            .map(|v| v.map(|v| v.record.status))
                            .map_err(client_err("reading a bulk run"))
                    }
                ))
                .await?
            ),
        );
        let approvals: flotilla_model::approval::ApprovalList = request(
            client,
            &ApprovalListRequest {
                protocol: PROTOCOL_VERSION,
                run_id: None,
                all: true,
                limit: None,
            },
            "listing approvals",
        )
        .await?;
        out.insert("approvals".into(), to_value(&approvals));
        let grants: flotilla_model::approval::GrantList = request(
            client,
            &GrantListRequest {
                protocol: PROTOCOL_VERSION,
                run_id: None,
                session_id: Some(self.session),
            },
            "listing grants",
        )
        .await?;
        out.insert("grants".into(), to_value(&grants));
        let trust: flotilla_model::trust::TrustList = request(
            client,
            &TrustListRequest {
                protocol: PROTOCOL_VERSION,
            },
            "listing trust",
        )
        .await?;
        out.insert("trust".into(), to_value(&trust));
        let memory: flotilla_model::memory::MemoryList = request(
            client,
            &MemoryListRequest {
                protocol: PROTOCOL_VERSION,
                session_id: None,
                limit: Some(1000),
            },
            "listing memory",
        )
        .await?;
        out.insert("memory".into(), to_value(&memory));
        let stats: flotilla_model::team::TeamStats = request(
            client,
            &TeamStatsRequest {
                protocol: PROTOCOL_VERSION,
                name: None,
                scope: None,
            },
            "reading failure records",
        )
        .await?;
        out.insert("stats".into(), to_value(&stats));
        let team: flotilla_model::team::TeamList = request(
            client,
            &TeamListRequest {
                protocol: PROTOCOL_VERSION,
                role: None,
            },
            "listing the team",
        )
        .await?;
        out.insert("team".into(), to_value(&team));
        let mates: flotilla_model::teammate::TeamMates = request(
            client,
            &TeamMatesRequest {
                protocol: PROTOCOL_VERSION,
                team: Some(self.team.clone()),
            },
            "listing teammates",
        )
        .await?;
        out.insert("mates".into(), to_value(&mates));
        let recruit: flotilla_model::recruit::RecruitReply = request(
            client,
            &RecruitStatusRequest {
                protocol: PROTOCOL_VERSION,
                run_id: self.runs["pending"],
                recruit_id: "r1".into(),
            },
            "reading a recruit",
        )
        .await?;
        out.insert("recruit".into(), to_value(&recruit));
        let ok = self.runs["succeeded"];
        let ws: flotilla_model::workspace::WorkspacePage = request(
            client,
            &WsReadRequest {
                protocol: PROTOCOL_VERSION,
                run_id: ok,
                topic: None,
                since_seq: 0,
                limit: None,
            },
            "reading the workspace",
        )
        .await?;
        out.insert("workspace".into(), to_value(&ws));
        let mbox: flotilla_model::mailbox::MailboxPage = request(
            client,
            &MboxReadRequest {
                protocol: PROTOCOL_VERSION,
                run_id: ok,
                reader: "b".into(),
                since_seq: Some(0),
                limit: None,
                wait_ms: None,
                commit: false,
            },
            "reading a mailbox",
        )
        .await?;
        out.insert("mailbox".into(), to_value(&mbox));
        let keys: flotilla_model::api::StateKeys = request(
            client,
            &StateListRequest {
                protocol: PROTOCOL_VERSION,
                run_id: None,
                session_id: Some(self.session),
                after: None,
                limit: None,
            },
            "listing session state",
        )
        .await?;
        out.insert("state.keys".into(), to_value(&keys));
        let value: flotilla_model::state::StateValue = request(
            client,
            &StateGetRequest {
                protocol: PROTOCOL_VERSION,
                run_id: None,
                session_id: Some(self.session),
                key: "plan".into(),
            },
            "reading session state",
        )
        .await?;
        out.insert("state.plan".into(), to_value(&value));
        let mut reads = Reads(out);
        reads.strip(VOLATILE);
        Ok(reads)
    }

    /// One new run of every kind, each checked to end as it should: a DAG, a failing run, a
    /// workflow with child runs, an approval answered, a vetted agent's sensitive task with no
    /// approval (its pin read after a restart), the mailer under its session's grant (no
    /// approval, one model call per step), a message that wakes a teammate, collaboration
    /// writes and reads, a remembered run.
    pub async fn exercise(
        &self,
        client: &Client,
        model: &OpenAiServer,
    ) -> Result<(), LivedInError> {
        // The coordinators know the live workers (from the registry's history, not from the
        // heartbeats since they started).
        let checked = client
            .validate(&plan_of("new-check", vec![Subtask::new("a", "first")]))
            .await
            .map_err(client_err("validating a plan"))?;
        expect(
            checked.errors.is_empty() && checked.warnings.is_empty(),
            &format!("a plan for a live pool was not clean: {checked:?}"),
        )?;
        let dag = submit(
            client,
            plan_of(
                "new-dag",
                vec![
                    Subtask::new("a", "first"),
                    Subtask::new("b", "next").after(&["a"]),
                ],
            ),
            Some(self.session),
        )
        .await?;
        let mut failing = plan_of(
            "new-failed",
            vec![Subtask::new("x", "fails").with_agent("broken")],
        );
        failing.config.max_retries = 0;
        let failed = submit(client, failing, None).await?;
        let workflow = submit(
            client,
            plan_of(
                "new-workflow",
                vec![Subtask::new("main", "another plan").with_agent("review")],
            ),
            None,
        )
        .await?;
        let vetted = submit(
            client,
            plan_of("new-vetted", vec![sensitive("ship", "vetted")]),
            None,
        )
        .await?;
        let gated = submit(
            client,
            plan_of("new-approval", vec![sensitive("gate", "echo")]),
            None,
        )
        .await?;
        model.push_all([
            Reply::tool_call("send_email", json!({"to": "bo@example.com"})),
            Reply::text("mailed bo"),
        ]);
        let mailed = submit(
            client,
            plan_of(
                "new-granted",
                vec![Subtask::new("mail", "mail bo").with_agent("mailer")],
            ),
            Some(self.session),
        )
        .await?;
        awaiting(client, gated, "t0a1").await?;
        answer(client, gated, "t0a1", Decision::Approve).await?;
        for (run, want) in [
            (dag, RunStatus::Succeeded),
            (failed, RunStatus::Failed),
            (workflow, RunStatus::Succeeded),
            (vetted, RunStatus::Succeeded),
            (gated, RunStatus::Succeeded),
            (mailed, RunStatus::Succeeded),
        ] {
            ends(client, run, want).await?;
        }
        let asked: flotilla_model::approval::ApprovalList = request(
            client,
            &ApprovalListRequest {
                protocol: PROTOCOL_VERSION,
                run_id: Some(vetted),
                all: true,
                limit: None,
            },
            "listing the vetted run's approvals",
        )
        .await?;
        expect(
            asked.approvals.is_empty(),
            "the vetted agent's task waited for approval: its pin was not read",
        )?;
        let asked: flotilla_model::approval::ApprovalList = request(
            client,
            &ApprovalListRequest {
                protocol: PROTOCOL_VERSION,
                run_id: Some(mailed),
                all: true,
                limit: None,
            },
            "listing the granted run's approvals",
        )
        .await?;
        expect(
            asked
                .approvals
                .iter()
                .all(|a| a.status != ApprovalStatus::Pending),
            "the mailer waited for approval despite its session's grant",
        )?;
        let tree = client
            .tree(workflow, 100)
            .await
            .map_err(client_err("reading a tree"))?
            .ok_or_else(|| LivedInError::Unexpected("the workflow has no tree".into()))?;
        expect(
            tree.runs >= 3,
            "the workflow's child runs are not in its tree",
        )?;
        // A teammate woken by a message takes one more turn.
        let before = mate(client, &self.team, "ann").await?.turns;
        send(client, &self.team, "ann", "again").await?;
        mate_becomes(client, &self.team, "ann", |m| {
            m.status == TeammateStatus::Idle && m.turns == before + 1
        })
        .await?;
        // Collaboration: a write is read back.
        let appended: flotilla_model::api::WsAppendReply = request(
            client,
            &WsAppendRequest {
                protocol: PROTOCOL_VERSION,
                run_id: dag,
                topic: "checks".into(),
                entry: json_map(json!({"ok": true})),
                task_id: None,
                attempt: None,
                by: Some("client".into()),
                idempotency_key: None,
            },
            "writing a workspace entry",
        )
        .await?;
        let page: flotilla_model::workspace::WorkspacePage = request(
            client,
            &WsReadRequest {
                protocol: PROTOCOL_VERSION,
                run_id: dag,
                topic: Some("checks".into()),
                since_seq: 0,
                limit: None,
            },
            "reading the workspace",
        )
        .await?;
        expect(
            page.entries.iter().any(|e| e.seq == appended.seq),
            "a workspace entry written was not read back",
        )?;
        remembered(client, dag).await?;
        Ok(())
    }
}

/// Keys left out of every read: they move by themselves (heartbeats, sliding time windows,
/// the duration of a run still going).
const VOLATILE: &[&str] = &[
    "last_heartbeat",
    "last_hour",
    "last_day",
    "last_30_days",
    "turns_last_hour",
    "duration_ms",
    "scanned",
];

/// Every read of a deployment, by name, as JSON.
#[derive(Debug, Clone, PartialEq)]
pub struct Reads(pub BTreeMap<String, Value>);

impl Reads {
    fn strip(&mut self, keys: &[&str]) {
        fn walk(v: &mut Value, keys: &[&str]) {
            match v {
                Value::Object(m) => {
                    m.retain(|k, _| !keys.contains(&k.as_str()));
                    m.values_mut().for_each(|v| walk(v, keys));
                }
                Value::Array(a) => a.iter_mut().for_each(|v| walk(v, keys)),
                _ => {}
            }
        }
        self.0.values_mut().for_each(|v| walk(v, keys));
    }

    /// These reads without the members' presence (status, hosting workers and their pools),
    /// for comparing across a worker's restart: a restarted worker is another worker.
    pub fn without_presence(mut self) -> Self {
        if let Some(Value::Object(team)) = self.0.get_mut("team")
            && let Some(Value::Array(members)) = team.get_mut("members")
        {
            for m in members.iter_mut().filter_map(Value::as_object_mut) {
                for k in ["status", "workers", "pools"] {
                    m.remove(k);
                }
            }
        }
        self
    }

    /// An error naming every path where `after` differs from these reads (`what` says when
    /// they were taken), or `Ok` when they are the same.
    pub fn ensure_same(&self, after: &Reads, what: &str) -> Result<(), LivedInError> {
        let diff = self.differences(after);
        if diff.is_empty() {
            return Ok(());
        }
        let shown: Vec<String> = diff
            .iter()
            .map(|(name, b, a)| format!("- {name}\n  before: {b}\n  after:  {a}"))
            .collect();
        Err(LivedInError::Unexpected(format!(
            "{what}: {} read(s) changed:\n{}",
            diff.len(),
            shown.join("\n")
        )))
    }

    /// Where these reads differ from `other`'s: the read's name with the path inside it
    /// (`team/members/5/workers`), this value and the other's (`(missing)` where one has
    /// none).
    pub fn differences(&self, other: &Reads) -> Vec<(String, String, String)> {
        fn show(v: Option<&Value>) -> String {
            v.map(|v| serde_json::to_string(v).unwrap_or_default())
                .unwrap_or_else(|| "(missing)".into())
        }
        fn walk(
            path: String,
            a: Option<&Value>,
            b: Option<&Value>,
            out: &mut Vec<(String, String, String)>,
        ) {
            if a == b {
                return;
            }
            match (a, b) {
                (Some(Value::Object(x)), Some(Value::Object(y))) => {
                    let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
                    keys.sort();
                    keys.dedup();
                    for k in keys {
                        walk(format!("{path}/{k}"), x.get(k), y.get(k), out);
                    }
                }
                (Some(Value::Array(x)), Some(Value::Array(y))) if x.len() == y.len() => {
                    for (i, (p, q)) in x.iter().zip(y).enumerate() {
                        walk(format!("{path}/{i}"), Some(p), Some(q), out);
                    }
                }
                _ => out.push((path, show(a), show(b))),
            }
        }
        let mut names: Vec<&String> = self.0.keys().chain(other.0.keys()).collect();
        names.sort();
        names.dedup();
        let mut out = Vec::new();
        for n in names {
            walk(n.clone(), self.0.get(n), other.0.get(n), &mut out);
        }
        out
    }
}

fn to_value<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

fn json_map(v: Value) -> serde_json::Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => serde_json::Map::new(),
    }
}

fn expect(ok: bool, what: &str) -> Result<(), LivedInError> {
    if ok {
        Ok(())
    } else {
        Err(LivedInError::Unexpected(what.to_owned()))
    }
}

async fn request<R: flotilla_model::api::ApiRequest>(
    client: &Client,
    req: &R,
    what: &str,
) -> Result<R::Reply, LivedInError> {
    client.request(req, ASK).await.map_err(client_err(what))
}

async fn submit(
    client: &Client,
    plan: Plan,
    session: Option<SessionId>,
) -> Result<RunId, LivedInError> {
    let mut req = SubmitRequest::new(plan);
    req.session_id = session;
    client.submit(req).await.map_err(client_err("submitting"))
}

/// Polls `check` every 50 ms until it says yes, for up to [`WAIT`].
async fn until<F, Fut>(_client: &Client, what: &str, check: F) -> Result<(), LivedInError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<bool, LivedInError>>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut last = None;
    loop {
        match check().await {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => last = Some(e.to_string()),
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(LivedInError::Timeout(match last {
                Some(e) => format!("waited {WAIT:?} for {what}; last error: {e}"),
                None => format!("waited {WAIT:?} for {what}"),
            }));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn ends(client: &Client, run: RunId, want: RunStatus) -> Result<(), LivedInError> {
    let outcome = client
        .wait(run, WAIT)
        .await
        .map_err(client_err(format!("waiting for run {run}")))?;
    if outcome.status != want {
        return Err(LivedInError::Unexpected(format!(
            "run {run} ended {:?}, not {want:?}: {:?}",
            outcome.status, outcome.reason
        )));
    }
    Ok(())
}

async fn status_becomes(client: &Client, run: RunId, want: RunStatus) -> Result<(), LivedInError> {
    until(client, &format!("run {run} to be {want:?}"), || async {
        Ok(client
            .run(run)
            .await
            .map_err(client_err("reading a run"))?
            .is_some_and(|v| v.record.status == want))
    })
    .await
}

async fn awaiting(client: &Client, run: RunId, id: &str) -> Result<(), LivedInError> {
    until(
        client,
        &format!("approval {id} of run {run} to be asked"),
        || async {
            let list: flotilla_model::approval::ApprovalList = request(
                client,
                &ApprovalListRequest {
                    protocol: PROTOCOL_VERSION,
                    run_id: Some(run),
                    all: false,
                    limit: None,
                },
                "listing approvals",
            )
            .await?;
            Ok(list.approvals.iter().any(|a| a.request.approval_id == id))
        },
    )
    .await
}

fn answer_request(run: RunId, id: &str, decision: Decision) -> ApprovalAnswerRequest {
    ApprovalAnswerRequest {
        protocol: PROTOCOL_VERSION,
        run_id: run,
        approval_id: id.into(),
        decision,
        by: PERSON.into(),
        comment: Some("looked at it".into()),
        digest: None,
        always: false,
        incident: false,
    }
}

async fn answer(
    client: &Client,
    run: RunId,
    id: &str,
    decision: Decision,
) -> Result<(), LivedInError> {
    request(
        client,
        &answer_request(run, id, decision),
        "answering an approval",
    )
    .await
    .map(|_| ())
}

async fn trust_set(client: &Client, name: &str, level: TrustLevel) -> Result<(), LivedInError> {
    request(
        client,
        &TrustSetRequest {
            protocol: PROTOCOL_VERSION,
            scope: RecordScope::Agent,
            name: name.into(),
            level: Some(level),
            reason: "vendor certified".into(),
            by: PERSON.into(),
        },
        "pinning a trust level",
    )
    .await?;
    // Admissions read levels from the coordinators' mirrors of the bucket: give them the
    // write before the first run that depends on it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok(())
}

async fn send(client: &Client, team: &str, to: &str, text: &str) -> Result<(), LivedInError> {
    request(
        client,
        &TeamSendRequest {
            protocol: PROTOCOL_VERSION,
            team: Some(team.to_owned()),
            to: to.to_owned(),
            from: Some(PERSON.into()),
            text: text.to_owned(),
        },
        "messaging a teammate",
    )
    .await
    .map(|_| ())
}

async fn mate(
    client: &Client,
    team: &str,
    name: &str,
) -> Result<flotilla_model::teammate::TeammateView, LivedInError> {
    let mates: flotilla_model::teammate::TeamMates = request(
        client,
        &TeamMatesRequest {
            protocol: PROTOCOL_VERSION,
            team: Some(team.to_owned()),
        },
        "listing teammates",
    )
    .await?;
    mates
        .teammates
        .into_iter()
        .find(|m| m.name == name)
        .ok_or_else(|| LivedInError::Unexpected(format!("no teammate {name} in {team}")))
}

async fn mate_becomes(
    client: &Client,
    team: &str,
    name: &str,
    pred: impl Fn(&flotilla_model::teammate::TeammateView) -> bool,
) -> Result<(), LivedInError> {
    until(client, &format!("teammate {name}'s turn"), || async {
        Ok(pred(&mate(client, team, name).await?))
    })
    .await
}

async fn remembered(client: &Client, run: RunId) -> Result<(), LivedInError> {
    until(client, &format!("run {run} to be remembered"), || async {
        Ok(client
            .request(
                &MemoryGetRequest {
                    protocol: PROTOCOL_VERSION,
                    run_id: run,
                },
                ASK,
            )
            .await
            .is_ok())
    })
    .await
}
