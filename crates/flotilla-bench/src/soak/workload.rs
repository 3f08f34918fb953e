//! The soak's workload: a new scenario at a steady rate (`--every`), in a fixed cycle, with
//! at most `--max-in-flight` at once. Each scenario is a *driver* — a task of the bench that
//! submits one root run (or, for a teammate, spawns one), then plays the person, the client
//! or the operator the scenario needs: it answers approvals (approve, reject, two answers at
//! once), pauses and resumes, assigns and finishes a led run, messages a teammate. A driver
//! learns where its run stands from the [ledger](super::ledger) (what the installation
//! stored), never from its own requests' answers, and retries every request until its
//! deadline — services restart under it. What it could not do by then is a driver error in
//! the report, apart from what Flotilla lost.
//!
//! | Scenario | Plan | The driver |
//! |---|---|---|
//! | `single` | one exec task | — |
//! | `chain` | exec → scripted → exec → scripted | — |
//! | `fan` | exec → 6 scripted → exec (fan-out, fan-in) | — |
//! | `diamond` | a → b ∥ c → d (exec) | — |
//! | `topics` | an exec writer of topic `figures` (two entries), two readers consuming it, a join | — |
//! | `child` | an exec agent running `flotilla call` (agent-as-tool: a child run) | — |
//! | `workflow` | a sequential workflow whose first step is a parallel one (child runs) | — |
//! | `llm` | two LLM tasks on the simulated provider, one tool round each | — |
//! | `approve` | a task whose action is `publish`, after another | approves (API or console) |
//! | `reject` | the same, optional | rejects (every fourth as an incident) |
//! | `conflict` | a `publish` task, optional | approve and reject sent at once |
//! | `expire` | a `publish` task, optional, a 4 s deadline | nothing: the deadline decides |
//! | `apprentice` | two tasks of the novice `apprentice` (every dispatch asks) | approves each |
//! | `pause` | six slow tasks in a chain | pauses the run after two, resumes 2 s later |
//! | `task_pause` | five slow tasks in a chain | pauses the fourth task at once, resumes it after the third |
//! | `led` | a two-task chain under the `supervisor` strategy | assigns both, then finishes the run |
//! | `teammate` | — | spawns a teammate, sends three messages one after the other, shuts it down |
//!
//! Every scenario's right outcome is `succeeded`: the tasks a person rejects, or whose
//! deadline passes, are optional.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use async_nats::jetstream::kv;
use flotilla_client::Client;
use flotilla_model::approval::{AnswerOutcome, ApprovalAnswerRequest, Decision};
use flotilla_model::control::{PauseRunRequest, ResumeRunRequest};
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::lead::{AssignRequest, FinishRequest};
use flotilla_model::plan::Plan;
use flotilla_model::submit::SubmitRequest;
use flotilla_model::teammate::{
    Conversation, Speaker, TeamSendRequest, TeamShutdownRequest, TeamSpawnRequest, conversation_key,
};
use flotilla_model::{ErrorCode, PROTOCOL_VERSION};
use serde_json::json;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::config::{CONSOLE_TOKEN, LLM_POOL, MATE};
use super::deployment::{http, unix_ms};
use super::ledger::{ConflictRec, DriverError, Shared, Submission, TeammateRec, lock};
use super::scenario::Scenario;

/// A plan from its JSON form (the wire's). A plan larger than `auto` leaves to the
/// deployment's lead (an agent with the role `supervisor`) says `dag`, unless `config` names
/// a strategy: only the `led` scenario's runs wait for a lead.
fn plan(
    name: &str,
    subtasks: serde_json::Value,
    mut config: serde_json::Value,
) -> anyhow::Result<Plan> {
    let large = subtasks
        .as_array()
        .is_some_and(|t| t.len() > flotilla_model::plan::LEAD_ABOVE_SUBTASKS);
    if large && config.get("strategy").is_none() {
        config["strategy"] = json!("dag");
    }
    serde_json::from_value(json!({"name": name, "subtasks": subtasks, "config": config}))
        .with_context(|| format!("the soak's {name} plan does not decode"))
}

/// A chain `s0 → … → s<n−1>` of `agent` tasks.
fn chain(n: usize, agent: &str) -> serde_json::Value {
    (0..n)
        .map(|i| {
            let mut t = json!({"id": format!("s{i}"), "agent": agent, "description": "a step"});
            if i > 0 {
                t["dependencies"] = json!([format!("s{}", i - 1)]);
            }
            t
        })
        .collect()
}

/// The plan of one scenario.
pub(crate) fn plan_of(s: Scenario) -> anyhow::Result<Plan> {
    let name = format!("soak-{}", s.name());
    let none = json!({});
    match s {
        Scenario::Single => plan(&name, json!([{"id": "t", "agent": "effect"}]), none),
        Scenario::Chain => plan(
            &name,
            json!([
                {"id": "a", "agent": "effect"},
                {"id": "b", "agent": "noop", "dependencies": ["a"]},
                {"id": "c", "agent": "effect", "dependencies": ["b"]},
                {"id": "d", "agent": "noop", "dependencies": ["c"]}
            ]),
            none,
        ),
        Scenario::Fan => {
            let mut tasks = vec![json!({"id": "split", "agent": "effect"})];
            let branches: Vec<String> = (0..6).map(|i| format!("b{i}")).collect();
            for b in &branches {
                tasks.push(json!({"id": b, "agent": "noop", "dependencies": ["split"]}));
            }
            tasks.push(json!({"id": "join", "agent": "effect", "dependencies": branches}));
            plan(&name, json!(tasks), json!({"max_concurrency": 8}))
        }
        Scenario::Diamond => plan(
            &name,
            json!([
                {"id": "a", "agent": "effect"},
                {"id": "b", "agent": "effect", "dependencies": ["a"]},
                {"id": "c", "agent": "effect", "dependencies": ["a"]},
                {"id": "d", "agent": "effect", "dependencies": ["b", "c"]}
            ]),
            none,
        ),
        Scenario::Topics => plan(
            &name,
            json!([
                {"id": "writer", "agent": "writer", "produces": ["figures"]},
                {"id": "growth", "agent": "noop", "consumes": ["figures"]},
                {"id": "margin", "agent": "noop", "consumes": ["figures"]},
                {"id": "report", "agent": "effect", "dependencies": ["growth", "margin"]}
            ]),
            none,
        ),
        Scenario::Child => plan(&name, json!([{"id": "ask", "agent": "caller"}]), none),
        Scenario::Workflow => plan(&name, json!([{"id": "flow", "agent": "pipeline"}]), none),
        Scenario::Llm => plan(
            &name,
            json!([
                {"id": "research", "agent": "assistant", "pool": LLM_POOL,
                 "description": "Report the quarter's figure in one sentence."},
                {"id": "summary", "agent": "assistant", "pool": LLM_POOL,
                 "description": "Summarise the research.", "dependencies": ["research"]}
            ]),
            none,
        ),
        Scenario::Approve => plan(
            &name,
            json!([
                {"id": "draft", "agent": "noop"},
                {"id": "publish", "agent": "noop", "action": "publish", "dependencies": ["draft"]}
            ]),
            none,
        ),
        Scenario::Reject => plan(
            &name,
            json!([
                {"id": "draft", "agent": "noop"},
                {"id": "publish", "agent": "noop", "action": "publish", "required": false,
                 "dependencies": ["draft"]}
            ]),
            none,
        ),
        Scenario::Conflict => plan(
            &name,
            json!([{"id": "publish", "agent": "noop", "action": "publish", "required": false}]),
            none,
        ),
        Scenario::Expire => plan(
            &name,
            json!([
                {"id": "draft", "agent": "noop"},
                {"id": "publish", "agent": "noop", "action": "publish", "required": false}
            ]),
            json!({"hitl": {"approval_timeout": 4}}),
        ),
        Scenario::Apprentice => plan(&name, chain(2, "apprentice"), none),
        Scenario::Pause => plan(&name, chain(6, "slow"), none),
        Scenario::TaskPause => plan(&name, chain(5, "slow"), none),
        Scenario::Led => plan(&name, chain(2, "noop"), json!({"strategy": "supervisor"})),
        // Not a run: the driver spawns a teammate.
        Scenario::Teammate => plan(&name, json!([{"id": "t"}]), none),
    }
}

/// What the drivers share.
pub(crate) struct Workload {
    pub(crate) client: Client,
    pub(crate) ledger: Shared,
    /// The console's listener.
    pub(crate) console: SocketAddr,
    pub(crate) team: kv::Store,
    /// How long one scenario may take, its run's end included.
    pub(crate) deadline: Duration,
    /// Scenarios started so far.
    pub(crate) started: AtomicU64,
    /// Ticks of `--every` at which `--max-in-flight` scenarios were running already.
    pub(crate) saturated: AtomicU64,
    /// Most scenarios running at once.
    pub(crate) peak_in_flight: AtomicU64,
    /// Requests the bench sent the console, and those that failed.
    pub(crate) console_requests: AtomicU64,
    pub(crate) console_failures: AtomicU64,
}

/// How long one request may wait for an answer.
const ASK: Duration = Duration::from_secs(10);
/// Pause between two tries of a request, and between two looks at the ledger.
const AGAIN: Duration = Duration::from_millis(500);
const LOOK: Duration = Duration::from_millis(200);
/// The bench's name as a person and an operator.
const BY: &str = "soak";

/// Starts a scenario every `every` (in `cycle`'s order) while fewer than `max` run, until
/// `stop`; returns the drivers still running.
pub(crate) async fn schedule(
    w: Arc<Workload>,
    cycle: Vec<Scenario>,
    every: Duration,
    max: usize,
    stop: CancellationToken,
) -> JoinSet<()> {
    let mut drivers = JoinSet::new();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut next = 0usize;
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        while drivers.try_join_next().is_some() {}
        if drivers.len() >= max {
            w.saturated.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let Some(&s) = cycle.get(next % cycle.len().max(1)) else {
            break;
        };
        next += 1;
        let k = w.started.fetch_add(1, Ordering::Relaxed);
        drivers.spawn(drive(Arc::clone(&w), s, k));
        w.peak_in_flight
            .fetch_max(drivers.len() as u64, Ordering::Relaxed);
    }
    drivers
}

/// Runs one scenario; what the bench could not do goes to the ledger's driver errors.
async fn drive(w: Arc<Workload>, s: Scenario, k: u64) {
    let deadline = Instant::now() + w.deadline;
    let mut run = None;
    let result = if s == Scenario::Teammate {
        teammate(&w, k, deadline).await
    } else {
        scenario(&w, s, k, deadline, &mut run).await
    };
    if let Err(e) = result {
        lock(&w.ledger).driver_errors.push(DriverError {
            scenario: s,
            run,
            what: format!("{e:#}"),
            at_ms: unix_ms(),
        });
    }
}

async fn scenario(
    w: &Workload,
    s: Scenario,
    k: u64,
    deadline: Instant,
    run_out: &mut Option<RunId>,
) -> anyhow::Result<()> {
    let run = w.submit(s, plan_of(s)?, deadline).await?;
    *run_out = Some(run);
    let console = k % 2 == 1;
    match s {
        Scenario::Approve | Scenario::Apprentice => {
            w.answer_all(run, deadline, console, |_| Decision::Approve, false)
                .await?;
        }
        Scenario::Reject => {
            let reject = |_: &str| Decision::Reject {
                message: "not this one".into(),
            };
            w.answer_all(run, deadline, console, reject, k % 4 == 1)
                .await?;
        }
        Scenario::Conflict => w.conflict(run, deadline, console).await?,
        Scenario::Pause => {
            w.until(run, deadline, "s1 succeeded", |o| o.succeeded("s1"))
                .await?;
            if w.control(run, None, true, console, deadline).await? {
                tokio::time::sleep(Duration::from_secs(2)).await;
                w.control(run, None, false, console, deadline).await?;
            }
        }
        Scenario::TaskPause => {
            let task = TaskId::from("s3");
            w.until(run, deadline, "the run started", |o| o.started)
                .await?;
            if w.control(run, Some(&task), true, console, deadline).await? {
                w.until(run, deadline, "s2 succeeded", |o| o.succeeded("s2"))
                    .await?;
                tokio::time::sleep(Duration::from_secs(1)).await;
                w.control(run, Some(&task), false, console, deadline)
                    .await?;
            }
        }
        Scenario::Led => w.lead(run, deadline).await?,
        _ => {}
    }
    // The run's end is the report's business (a run that never ends is lost); the driver
    // keeps its place in flight until then.
    let _ = w.until(run, deadline, "the run ended", |o| o.ended()).await;
    Ok(())
}

impl Workload {
    /// Submits until JetStream acknowledges (the same run id every time: a repeat is a
    /// no-op), and records the submission.
    async fn submit(&self, s: Scenario, plan: Plan, deadline: Instant) -> anyhow::Result<RunId> {
        let run = RunId::new();
        let mut request = SubmitRequest::new(plan);
        request.run_id = Some(run);
        request.labels.insert("soak".into(), s.name().into());
        loop {
            let at = unix_ms();
            match self.client.submit(request.clone()).await {
                Ok(_) => {
                    lock(&self.ledger).submitted.insert(
                        run,
                        Submission {
                            scenario: s,
                            submitted_ms: at,
                        },
                    );
                    return Ok(run);
                }
                // No leader, no connection for a moment: the same submission again.
                Err(_) if Instant::now() < deadline => tokio::time::sleep(AGAIN).await,
                Err(e) => return Err(e).context("submitting"),
            }
        }
    }

    /// Waits until what is stored about `run` satisfies `ok`.
    async fn until(
        &self,
        run: RunId,
        deadline: Instant,
        what: &str,
        ok: impl Fn(&super::ledger::Observed) -> bool,
    ) -> anyhow::Result<()> {
        loop {
            if lock(&self.ledger).runs.get(&run).is_some_and(&ok) {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "run {run}: waited in vain for: {what}"
            );
            tokio::time::sleep(LOOK).await;
        }
    }

    fn ended(&self, run: RunId) -> bool {
        lock(&self.ledger)
            .runs
            .get(&run)
            .is_some_and(super::ledger::Observed::ended)
    }

    /// Answers every approval `run` asks until it ends: through the console when `console`
    /// (the API when the console does not answer), else the API. An approval still
    /// undecided 20 s after its answer is answered again (the first answer wins).
    async fn answer_all(
        &self,
        run: RunId,
        deadline: Instant,
        console: bool,
        decide: impl Fn(&str) -> Decision,
        incident: bool,
    ) -> anyhow::Result<()> {
        let mut answered: HashMap<String, Instant> = HashMap::new();
        while !self.ended(run) {
            anyhow::ensure!(
                Instant::now() < deadline,
                "run {run}: still asking when the scenario's time ran out"
            );
            let pending = lock(&self.ledger)
                .runs
                .get(&run)
                .map(super::ledger::Observed::pending_approvals)
                .unwrap_or_default();
            for id in pending {
                if answered
                    .get(&id)
                    .is_some_and(|t| t.elapsed() < Duration::from_secs(20))
                {
                    continue;
                }
                let decision = decide(&id);
                if self
                    .answer(run, &id, decision, incident, console)
                    .await
                    .is_ok()
                {
                    answered.insert(id, Instant::now());
                }
            }
            tokio::time::sleep(LOOK).await;
        }
        Ok(())
    }

    /// One answer: what it was told (`decided` or `already_decided`).
    async fn answer(
        &self,
        run: RunId,
        approval: &str,
        decision: Decision,
        incident: bool,
        console: bool,
    ) -> anyhow::Result<String> {
        if console {
            let mut body = json!({"decision": decision.as_str(), "comment": BY});
            if let Decision::Reject { message } = &decision {
                body["message"] = json!(message);
                body["incident"] = json!(incident);
            }
            // The console down or refusing: the same answer through the API, below.
            if let Ok((200, reply)) = self
                .console_call(
                    "POST",
                    &format!("/api/approvals/{run}/{approval}"),
                    Some(&body.to_string()),
                )
                .await
            {
                return Ok(if reply.contains("\"already_decided\"") {
                    "already_decided".into()
                } else {
                    "decided".into()
                });
            }
        }
        let request = ApprovalAnswerRequest {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            approval_id: approval.into(),
            decision,
            by: BY.into(),
            comment: None,
            digest: None,
            always: false,
            incident,
        };
        match self.client.call(&request, ASK).await? {
            Ok(reply) => Ok(match reply.outcome {
                AnswerOutcome::Decided => "decided".into(),
                AnswerOutcome::AlreadyDecided => "already_decided".into(),
            }),
            Err(refused) => {
                anyhow::bail!("{} ({}): {}", refused.code, refused.status, refused.message)
            }
        }
    }

    /// Two answers to the run's approval at once — approve and reject — through the API
    /// twice, or the API and the console; records what each was told.
    async fn conflict(&self, run: RunId, deadline: Instant, console: bool) -> anyhow::Result<()> {
        let approval = loop {
            let pending = lock(&self.ledger)
                .runs
                .get(&run)
                .map(super::ledger::Observed::pending_approvals)
                .unwrap_or_default();
            if let Some(id) = pending.into_iter().next() {
                break id;
            }
            anyhow::ensure!(!self.ended(run), "run {run} ended without asking");
            anyhow::ensure!(
                Instant::now() < deadline,
                "run {run}: its approval was never requested"
            );
            tokio::time::sleep(LOOK).await;
        };
        let reject = Decision::Reject {
            message: "conflicting answer".into(),
        };
        let (a, b) = tokio::join!(
            self.answer(run, &approval, Decision::Approve, false, false),
            self.answer(run, &approval, reject, false, console),
        );
        let replies = [a, b]
            .into_iter()
            .map(|r| r.unwrap_or_else(|e| format!("error: {e:#}")))
            .collect::<Vec<_>>();
        let unanswered = replies.iter().all(|r| r.starts_with("error"));
        lock(&self.ledger).conflicts.push(ConflictRec {
            run,
            approval: approval.clone(),
            replies,
        });
        if unanswered {
            // Neither reached a coordinator: settle it as a person would, again.
            self.answer_all(run, deadline, false, |_| Decision::Approve, false)
                .await?;
        }
        Ok(())
    }

    /// Pauses (`pause`) or resumes the run, or one task of it, through the console or the
    /// API, until a coordinator answers. `false` when the run had ended already (nothing to
    /// pause).
    async fn control(
        &self,
        run: RunId,
        task: Option<&TaskId>,
        pause: bool,
        console: bool,
        deadline: Instant,
    ) -> anyhow::Result<bool> {
        let what = if pause { "pause" } else { "resume" };
        loop {
            if pause && self.ended(run) {
                return Ok(false);
            }
            if console {
                let body = match task {
                    Some(t) => json!({"reason": BY, "task": t}),
                    None => json!({"reason": BY}),
                };
                if let Ok((200, _)) = self
                    .console_call(
                        "POST",
                        &format!("/api/runs/{run}/{what}"),
                        Some(&body.to_string()),
                    )
                    .await
                {
                    return Ok(true);
                }
            }
            let answer = if pause {
                self.client
                    .call(
                        &PauseRunRequest {
                            protocol: PROTOCOL_VERSION,
                            run_id: run,
                            reason: Some(BY.into()),
                            by: Some(BY.into()),
                            timeout_ms: None,
                            children: task.is_none(),
                            task_id: task.cloned(),
                        },
                        ASK,
                    )
                    .await
            } else {
                self.client
                    .call(
                        &ResumeRunRequest {
                            protocol: PROTOCOL_VERSION,
                            run_id: run,
                            reason: Some(BY.into()),
                            by: Some(BY.into()),
                            children: task.is_none(),
                            task_id: task.cloned(),
                        },
                        ASK,
                    )
                    .await
            };
            match answer {
                Ok(Ok(_)) => return Ok(true),
                // Ended meanwhile: nothing to hold.
                Ok(Err(refused)) if pause && refused.status == 409 && self.ended(run) => {
                    return Ok(false);
                }
                _ => {}
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "run {run}: no coordinator took its {what}"
            );
            tokio::time::sleep(AGAIN).await;
        }
    }

    /// A led run: assigns `s1`, then `s0` (`team.assign`), waits for both, finishes the run.
    async fn lead(&self, run: RunId, deadline: Instant) -> anyhow::Result<()> {
        self.until(run, deadline, "the run started", |o| o.started)
            .await?;
        for task in ["s1", "s0"] {
            let request = AssignRequest {
                protocol: PROTOCOL_VERSION,
                run_id: run,
                task_id: TaskId::from(task),
                reason: BY.into(),
                by: None,
            };
            self.until_answered(&request, deadline, &format!("team.assign {task}"))
                .await?;
        }
        self.until(run, deadline, "s0 and s1 succeeded", |o| {
            o.succeeded("s0") && o.succeeded("s1")
        })
        .await?;
        let finish = FinishRequest {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            result: "done".into(),
            by: None,
        };
        self.until_answered(&finish, deadline, "team.finish")
            .await?;
        Ok(())
    }

    /// Sends `request` until a service answers it without refusing.
    async fn until_answered<R: flotilla_model::api::ApiRequest>(
        &self,
        request: &R,
        deadline: Instant,
        what: &str,
    ) -> anyhow::Result<R::Reply> {
        loop {
            let last = match self.client.call(request, ASK).await {
                Ok(Ok(reply)) => return Ok(reply),
                Ok(Err(refused)) => {
                    format!("{} ({}): {}", refused.code, refused.status, refused.message)
                }
                Err(e) => e.to_string(),
            };
            anyhow::ensure!(Instant::now() < deadline, "{what}: {last}");
            tokio::time::sleep(AGAIN).await;
        }
    }

    /// One request to the console as its operator.
    async fn console_call(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> anyhow::Result<(u16, String)> {
        self.console_requests.fetch_add(1, Ordering::Relaxed);
        let auth = format!("Bearer {CONSOLE_TOKEN}");
        let r = http(
            self.console,
            method,
            path,
            &[("Authorization", &auth), ("X-Flotilla-Console", "1")],
            body,
            ASK,
        )
        .await;
        if !matches!(r, Ok((200, _))) {
            self.console_failures.fetch_add(1, Ordering::Relaxed);
        }
        r
    }
}

/// A teammate: spawned, three messages each waited for (its conversation has read past the
/// message), shut down. Only messages `team.send` confirmed are recorded: a send whose answer
/// was lost may or may not have been stored, and is not sent again (that would be a second
/// message), so the next one gets a new text.
async fn teammate(w: &Workload, k: u64, deadline: Instant) -> anyhow::Result<()> {
    let team = "soak".to_owned();
    let name = format!("tm{k}");
    let spawn = TeamSpawnRequest {
        protocol: PROTOCOL_VERSION,
        team: Some(team.clone()),
        name: name.clone(),
        role: MATE.into(),
        instructions: "answer briefly".into(),
        agent: Some(MATE.into()),
        pool: None,
        by: Some(BY.into()),
        expose: false,
    };
    // A retry after a lost answer finds the teammate it spawned.
    loop {
        let last = match w.client.call(&spawn, ASK).await {
            Ok(Ok(_)) => break,
            Ok(Err(refused)) if refused.is(ErrorCode::DuplicateName) => break,
            Ok(Err(refused)) => {
                format!("{} ({}): {}", refused.code, refused.status, refused.message)
            }
            Err(e) => e.to_string(),
        };
        anyhow::ensure!(Instant::now() < deadline, "team.spawn: {last}");
        tokio::time::sleep(AGAIN).await;
    }
    let index = {
        let mut l = lock(&w.ledger);
        l.teammates.push(TeammateRec {
            team: team.clone(),
            name: name.clone(),
            messages: Vec::new(),
        });
        l.teammates.len() - 1
    };
    let mut attempt = 0;
    let mut confirmed = 0;
    while confirmed < 3 {
        anyhow::ensure!(
            Instant::now() < deadline,
            "teammate {name}: {confirmed} of 3 messages confirmed in time"
        );
        attempt += 1;
        let text = format!("soak message {k}.{attempt}");
        let send = TeamSendRequest {
            protocol: PROTOCOL_VERSION,
            team: Some(team.clone()),
            to: name.clone(),
            from: Some(BY.into()),
            text: text.clone(),
        };
        let seq = match w.client.call(&send, ASK).await {
            Ok(Ok(sent)) => sent.seqs.first().copied(),
            _ => None,
        };
        let Some(seq) = seq else {
            tokio::time::sleep(AGAIN).await;
            continue;
        };
        lock(&w.ledger).teammates[index]
            .messages
            .push((text.clone(), seq));
        confirmed += 1;
        // Its turn read past the message.
        loop {
            if let Ok(c) = conversation(&w.team, &team, &name).await
                && c.cursor >= seq
            {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "teammate {name}: message {seq} never read"
            );
            tokio::time::sleep(AGAIN).await;
        }
    }
    let shutdown = TeamShutdownRequest {
        protocol: PROTOCOL_VERSION,
        team: Some(team.clone()),
        name: name.clone(),
    };
    w.until_answered(&shutdown, deadline, "team.shutdown")
        .await?;
    Ok(())
}

/// A teammate's conversation as stored (empty before its first turn).
pub(crate) async fn conversation(
    team_kv: &kv::Store,
    team: &str,
    name: &str,
) -> anyhow::Result<Conversation> {
    Ok(match team_kv.get(conversation_key(team, name)).await? {
        Some(v) => serde_json::from_slice(&v)?,
        None => Conversation::default(),
    })
}

/// How many times each of `texts` is among the conversation's received lines.
pub(crate) fn received_counts(c: &Conversation, texts: &[String]) -> Vec<usize> {
    texts
        .iter()
        .map(|t| {
            c.lines
                .iter()
                .filter(|l| l.speaker == Speaker::User && &l.text == t)
                .count()
        })
        .collect()
}

/// Keeps a page's worth of the console busy for the soak: the runs stream held open (opened
/// again whenever it drops — the console restarts), and the runs list read every 30 s.
pub(crate) async fn console_reader(w: Arc<Workload>, stop: CancellationToken) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let auth = format!("Bearer {CONSOLE_TOKEN}");
    let list = {
        let w = Arc::clone(&w);
        let stop = stop.clone();
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                let _ = w.console_call("GET", "/api/runs?limit=50", None).await;
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(Duration::from_secs(30)) => {}
                }
            }
        })
    };
    while !stop.is_cancelled() {
        let held = async {
            let mut s = tokio::net::TcpStream::connect(w.console).await?;
            let req = format!(
                "GET /api/runs/stream HTTP/1.1\r\nHost: {}\r\nAuthorization: {auth}\r\n\r\n",
                w.console
            );
            s.write_all(req.as_bytes()).await?;
            w.console_requests.fetch_add(1, Ordering::Relaxed);
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                if s.read(&mut buf).await? == 0 {
                    return anyhow::Ok(());
                }
            }
        };
        tokio::select! {
            () = stop.cancelled() => break,
            _ = held => {
                w.console_failures.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
    list.abort();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every scenario's plan decodes (they are built from JSON literals).
    #[test]
    fn every_plan_decodes() {
        for s in Scenario::CYCLE {
            let p = plan_of(s).expect("decodes");
            assert!(!p.subtasks.is_empty(), "{s:?}");
            let led = p.config.strategy == flotilla_model::plan::Strategy::Supervisor;
            assert_eq!(led, s == Scenario::Led, "{s:?}");
        }
        assert_eq!(Scenario::CYCLE.len(), 17);
    }
}
