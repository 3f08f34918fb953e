//! The NATS Agent Protocol the other way round, across processes on a real nats-server: plans
//! (an exec agent's `flotilla call`, an LLM agent's `call_agent`) call external agents written
//! from the protocol's documentation (`agents_protocol/agent.py`, plain `nats-py`, nothing of
//! Flotilla), including one that asks permission mid-call (a `query`), which becomes a
//! Flotilla approval a person answers; external agents are members of the team roster.
//! Flotilla's own exposed agents are in `agents_protocol.rs`.
//!
//! Agents are deterministic: the LLM agent's model is the OpenAI-compatible test double
//! (`flotilla_testkit::openai`, scripted replies); the others are `scripted` agents.
//!
//! Needs `python3` with `nats-py` (`scripts/test` installs it: `scripts/ensure-nats-py.sh`);
//! without it the test says so and skips.

mod support;

#[path = "agents_protocol/common.rs"]
mod common;

use std::time::Duration;

use flotilla_model::run::RunStatus;
use flotilla_testkit::openai::{OpenAiServer, Reply};
use serde_json::{Value, json};
use support::*;

use common::{client_script, member, roster};

/// An external agent (`agents_protocol/agent.py`, written from the protocol's documentation)
/// running as its own process; killed when dropped.
struct ExternalAgent(std::process::Child);

impl ExternalAgent {
    async fn start(p: &Processes, agent: &str, extra: &[&str]) -> anyhow::Result<Self> {
        let ready = p.dir().join(format!("{agent}.ready"));
        let child = std::process::Command::new("python3")
            .arg(root().join("tests/agents_protocol/agent.py"))
            .arg(p.server.url())
            .args([agent, "ext"])
            .args(extra)
            .arg("--ready-file")
            .arg(&ready)
            .spawn()?;
        let this = Self(child);
        let deadline = tokio::time::Instant::now() + WAIT;
        while !ready.exists() {
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "agent {agent} never started"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(this)
    }
}

impl Drop for ExternalAgent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn plans_call_external_agents() -> anyhow::Result<()> {
    use flotilla_model::event::Event;
    use flotilla_model::plan::Subtask;
    use flotilla_model::submit::SubmitRequest;
    use futures::StreamExt;
    if let Err(why) = client_script() {
        eprintln!("SKIPPED: the external agent cannot run: {why}");
        return Ok(());
    }
    let mut p = Processes::start(
        r#"
[agents.ask_helper]
kind = "exec"
command = "sh"
args = ["-c", '"$FLOTILLA_BIN" call agents:helper "hello from flotilla" --wait 30s']

[agents.ask_zombie]
kind = "exec"
command = "sh"
args = ["-c", '"$FLOTILLA_BIN" call agents:zombie.ext "are you there" --wait 5m']
"#,
    )
    .await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let _helper = ExternalAgent::start(&p, "helper", &[]).await?;
    let _zombie = ExternalAgent::start(&p, "zombie", &["--die-after-first-chunk"]).await?;
    let once = |agent: &str| {
        let mut plan = plan(vec![Subtask::new("ask", "ask").with_agent(agent)]);
        plan.config.max_retries = 0;
        SubmitRequest::new(plan)
    };

    // A plan's exec agent calls the external agent; its replies stream into the run's events.
    let run = p.client.submit(once("ask_helper")).await?;
    let o = match p.client.wait(run, WAIT).await {
        Ok(o) => o,
        Err(e) => anyhow::bail!("{e}: worker log:\n{}", p.log(1)),
    };
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    assert_eq!(
        o.final_result.as_ref().map(|f| f.response.as_str()),
        Some("helper says: hello from flotilla"),
        "{o:?}"
    );
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    let mut seen = Vec::new();
    tokio::time::timeout(WAIT, async {
        while let Some(e) = events.next().await {
            match e?.event {
                Event::ToolStart { tool, input, .. } => {
                    assert_eq!(tool, "call_agent");
                    assert_eq!(input["agent"], "agents:helper/ext/default");
                    seen.push("start".to_string());
                }
                Event::ToolUpdate { output, .. } => {
                    seen.push(format!("update {}", output["text"].as_str().unwrap_or("")))
                }
                Event::ToolEnd { ok, output, .. } => {
                    assert!(ok, "{output}");
                    seen.push("end".into());
                    return anyhow::Ok(());
                }
                _ => {}
            }
        }
        anyhow::bail!("no tool_end")
    })
    .await??;
    assert_eq!(
        seen,
        [
            "start",
            "update helper says: ",
            "update hello from flotilla",
            "end"
        ]
    );

    // The external agent dies mid-call (its heartbeat stops): a structured error, no hang.
    let started = std::time::Instant::now();
    let run = p.client.submit(once("ask_zombie")).await?;
    let o = p.client.wait(run, WAIT).await?;
    assert_eq!(o.status, RunStatus::Failed, "{o:?}");
    let failure = o
        .failed
        .first()
        .map(|f| f.error.message.clone())
        .unwrap_or_default();
    assert!(failure.contains("agent_dead"), "{failure}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "three missed heartbeats of 1 s end the call, not --wait: {:?}",
        started.elapsed()
    );

    // No such agent: a structured error at once.
    let out = p.cli(&["call", "agents:nobody", "hello"])?;
    assert_eq!(out.status.code(), Some(1));
    let err: Value = serde_json::from_slice(&out.stderr)?;
    assert_eq!(err["error"]["code"], "unknown_agent", "{err}");
    let out = p.cli(&["call", "agents:Bad Name", "hello"])?;
    assert_eq!(out.status.code(), Some(2));
    Ok(())
}

/// The pending `external_agent` approvals of `run`, once there is one.
async fn asked_of_a_person(
    p: &Processes,
    run: flotilla_model::ids::RunId,
) -> anyhow::Result<Vec<flotilla_model::approval::ApprovalRecord>> {
    use flotilla_model::approval::{ApprovalListRequest, Trigger};
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let list = p
            .client
            .call(
                &ApprovalListRequest {
                    protocol: 1,
                    run_id: Some(run),
                    all: false,
                    limit: None,
                },
                WAIT,
            )
            .await?
            .map_err(|e| anyhow::anyhow!("approval.list: {e:?}"))?;
        let mine: Vec<_> = list
            .approvals
            .into_iter()
            .filter(|a| a.request.trigger == Trigger::ExternalAgent)
            .collect();
        if !mine.is_empty() {
            return Ok(mine);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "run {run} never asked a person: worker log:\n{}",
            p.log(1)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The current attempt id of task `index` of `run`, as its envelope carries it.
async fn attempt_id_of(
    p: &Processes,
    run: flotilla_model::ids::RunId,
    index: u32,
) -> anyhow::Result<flotilla_model::ids::AttemptId> {
    let reader = flotilla_runs::RunReader::open(&p.bus).await?;
    let state = reader
        .state(run)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no run {run}"))?;
    let t = state
        .tasks
        .get(index as usize)
        .ok_or_else(|| anyhow::anyhow!("no task {index}"))?;
    Ok(flotilla_machine::attempt_id(
        run,
        index,
        t.attempt,
        t.attempt_started_ms(),
    ))
}

/// The approval events of `approval` on `run`'s events (phase, task, attempt), read until
/// the stream has nothing more for a moment.
async fn approval_phases(
    p: &Processes,
    run: flotilla_model::ids::RunId,
    approval: &str,
) -> anyhow::Result<Vec<(String, String, u32)>> {
    use flotilla_model::event::Event;
    use futures::StreamExt;
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    let mut out = Vec::new();
    while let Ok(Some(e)) = tokio::time::timeout(Duration::from_millis(500), events.next()).await {
        let e = e?;
        if let Event::Workflow(w) = &e.event
            && w.approval_id.as_deref() == Some(approval)
        {
            out.push((
                serde_json::to_value(w.phase)?
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                e.task_id
                    .as_ref()
                    .map(|t| t.to_string())
                    .unwrap_or_default(),
                e.attempt.unwrap_or(0),
            ));
        }
    }
    Ok(out)
}

fn answer(
    record: &flotilla_model::approval::ApprovalRecord,
    decision: flotilla_model::approval::Decision,
) -> flotilla_model::approval::ApprovalAnswerRequest {
    flotilla_model::approval::ApprovalAnswerRequest {
        protocol: 1,
        run_id: record.request.run_id,
        approval_id: record.request.approval_id.clone(),
        decision,
        by: "alice".into(),
        comment: None,
        digest: None,
        always: false,
        incident: false,
    }
}

/// A permission request of an external agent (its `query`) becomes a Flotilla approval of
/// the calling attempt: listed with trigger `external_agent`, answered by a person with
/// `approval.answer` — approve is the agent's `yes`, reject its `no` —; past its deadline it
/// is settled `expired` (reject), and once its run has ended `withdrawn`. `approval.ask` with
/// bad input, for no run, or for a task not running is a structured error and stores nothing.
#[tokio::test(flavor = "multi_thread")]
async fn external_permission_requests_become_approvals() -> anyhow::Result<()> {
    use flotilla_model::approval::{
        AnswerOutcome, ApprovalAskRequest, ApprovalListRequest, ApprovalStatus, Decision,
    };
    use flotilla_model::event::Event;
    use flotilla_model::plan::Subtask;
    use flotilla_model::submit::SubmitRequest;
    use futures::StreamExt;
    if let Err(why) = client_script() {
        eprintln!("SKIPPED: the external agent cannot run: {why}");
        return Ok(());
    }
    let mut p = Processes::start(
        r#"
[agents.ask_gate]
kind = "exec"
command = "sh"
args = ["-c", '"$FLOTILLA_BIN" call agents:gate "clean up the stale files" --wait 60s']
"#,
    )
    .await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let _gate = ExternalAgent::start(&p, "gate", &["--ask-permission"]).await?;
    let once = || {
        let mut plan = plan(vec![Subtask::new("ask", "ask").with_agent("ask_gate")]);
        plan.config.max_retries = 0;
        SubmitRequest::new(plan)
    };

    // Approved by a person: the agent hears yes.
    let run = p.client.submit(once()).await?;
    let pending = asked_of_a_person(&p, run).await?;
    assert_eq!(pending.len(), 1, "{pending:?}");
    let r = &pending[0].request;
    assert_eq!((r.task_id.as_str(), r.attempt), ("ask", 1));
    assert!(
        r.description
            .contains("agents:gate.ext.default asks: May I delete /tmp/stale?"),
        "{}",
        r.description
    );
    assert_eq!(r.input["context"], "clean up the stale files");
    assert!(r.deadline > r.requested_at);
    // Edit means nothing to an agent's question: refused, nothing settled.
    let e = p
        .client
        .call(
            &answer(&pending[0], Decision::Edit { input: json!({}) }),
            WAIT,
        )
        .await?
        .expect_err("edit refused");
    assert_eq!(
        (e.status, e.code.as_str()),
        (400, "decision_not_applicable"),
        "{e:?}"
    );
    // Nor is an external agent's question an incident of this deployment's agents.
    let mut incident = answer(
        &pending[0],
        Decision::Reject {
            message: "no".into(),
        },
    );
    incident.incident = true;
    let e = p
        .client
        .call(&incident, WAIT)
        .await?
        .expect_err("incident refused");
    assert_eq!(
        (e.status, e.code.as_str()),
        (400, "incident_not_applicable"),
        "{e:?}"
    );
    let reply = p
        .client
        .call(&answer(&pending[0], Decision::Approve), WAIT)
        .await?
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    assert_eq!(reply.outcome, AnswerOutcome::Decided);
    let o = p.client.wait(run, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    assert_eq!(
        o.final_result.as_ref().map(|f| f.response.as_str()),
        Some("gate says: permission yes"),
        "{o:?}"
    );
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    let update = tokio::time::timeout(WAIT, async {
        while let Some(e) = events.next().await {
            if let Event::ToolUpdate { output, .. } = e?.event
                && output.get("query").is_some()
            {
                return anyhow::Ok(output);
            }
        }
        anyhow::bail!("no query update")
    })
    .await??;
    assert_eq!(update["answered"], true, "{update}");
    assert_eq!(update["reply"], "yes", "{update}");
    assert_eq!(update["status"], "decided", "{update}");
    // The run's events say a person was asked and how it was decided, once each.
    let phases = approval_phases(&p, run, &pending[0].request.approval_id).await?;
    assert_eq!(
        phases,
        [
            ("approval_requested".to_owned(), "ask".to_owned(), 1),
            ("approval_decided".to_owned(), "ask".to_owned(), 1)
        ],
        "{phases:?}"
    );

    // Rejected: the agent hears no.
    let run = p.client.submit(once()).await?;
    let pending = asked_of_a_person(&p, run).await?;
    p.client
        .call(
            &answer(
                &pending[0],
                Decision::Reject {
                    message: "not today".into(),
                },
            ),
            WAIT,
        )
        .await?
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let o = p.client.wait(run, WAIT).await?;
    assert_eq!(
        o.final_result.as_ref().map(|f| f.response.as_str()),
        Some("gate says: permission no"),
        "{o:?}"
    );

    // Bad input and callers that are not running attempts: structured errors, nothing stored.
    let ask = |run, task: &str, attempt, question: &str, timeout_s| ApprovalAskRequest {
        protocol: 1,
        run_id: run,
        task_id: task.into(),
        attempt,
        attempt_id: flotilla_model::ids::AttemptId::new(),
        agent: "agents:gate.ext.default".into(),
        query_id: "q-test".into(),
        question: question.into(),
        context: String::new(),
        timeout_s,
    };
    let refused = |r: Result<_, flotilla_model::api::ApiError>| match r {
        Ok(ok) => panic!("accepted: {ok:?}"),
        Err(e) => (e.status, e.code),
    };
    let mut bad = ask(run, "ask", 1, " ", Some(0));
    bad.agent = "gate".into();
    let e = p.client.call(&bad, WAIT).await?.expect_err("invalid");
    assert_eq!(
        (e.status, e.code.as_str()),
        (400, "invalid_request"),
        "{e:?}"
    );
    let paths: Vec<&str> = e.problems.iter().map(|p| p.path.as_str()).collect();
    assert_eq!(paths, ["agent", "question", "timeout_s"], "{e:?}");
    let raw = p
        .client
        .bus()
        .client()
        .request(
            format!("{}.api.approval.ask", p.client.bus().names().prefix()),
            r#"{"run_id": 1}"#.into(),
        )
        .await?;
    let body: Value = serde_json::from_slice(&raw.payload)?;
    assert_eq!(body["status"], 400, "{body}");
    assert_eq!(
        refused(
            p.client
                .call(
                    &ask(flotilla_model::ids::RunId::new(), "ask", 1, "?", None),
                    WAIT
                )
                .await?
        ),
        (404, "not_found".into())
    );
    assert_eq!(
        refused(p.client.call(&ask(run, "nope", 1, "?", None), WAIT).await?),
        (404, "unknown_task".into())
    );
    // Another attempt's id: not the attempt that runs (or ran) the task.
    assert_eq!(
        refused(p.client.call(&ask(run, "ask", 1, "?", None), WAIT).await?),
        (409, "not_the_attempt".into())
    );
    let mut ended = ask(run, "ask", 1, "?", None);
    ended.attempt_id = attempt_id_of(&p, run, 0).await?;
    assert_eq!(
        refused(p.client.call(&ended, WAIT).await?),
        (409, "run_ended".into())
    );
    let all = p
        .client
        .call(
            &ApprovalListRequest {
                protocol: 1,
                run_id: Some(run),
                all: true,
                limit: None,
            },
            WAIT,
        )
        .await?
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    assert_eq!(all.approvals.len(), 1, "only the agent's question: {all:?}");

    // Past its deadline an unanswered question is settled expired (reject); a late answer
    // finds it so. Once the run ends (cancelled) a pending one is withdrawn.
    let run = p.client.submit(once()).await?;
    let pending = asked_of_a_person(&p, run).await?;
    let e = p
        .client
        .call(&ask(run, "ask", 2, "?", None), WAIT)
        .await?
        .expect_err("attempt 2");
    assert_eq!((e.status, e.code.as_str()), (409, "not_running"), "{e:?}");
    let current = attempt_id_of(&p, run, 0).await?;
    let asked = |question: &str, query: &str, timeout_s| {
        let mut a = ask(run, "ask", 1, question, timeout_s);
        a.attempt_id = current;
        a.query_id = query.into();
        a
    };
    let short = p
        .client
        .call(&asked("Quick: may I?", "q-test", Some(1)), WAIT)
        .await?
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    assert_eq!(short.record.status, ApprovalStatus::Pending);
    // One asked once and never again (its asker gone): the coordinators' sweep settles it.
    let orphan = p
        .client
        .call(&asked("Anyone there?", "q-orphan", Some(1)), WAIT)
        .await?
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let again = p
        .client
        .call(&asked("Quick: may I?", "q-test", Some(1)), WAIT)
        .await?
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    assert_eq!(
        again.record.request.approval_id,
        short.record.request.approval_id
    );
    assert_eq!(again.record.status, ApprovalStatus::Expired, "{again:?}");
    assert_eq!(
        again
            .record
            .answer
            .as_ref()
            .map(|a| (a.decision.as_str(), a.by.as_str())),
        Some(("reject", "deadline"))
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    loop {
        let got = p
            .client
            .call(
                &flotilla_model::approval::ApprovalGetRequest {
                    protocol: 1,
                    run_id: run,
                    approval_id: orphan.record.request.approval_id.clone(),
                },
                WAIT,
            )
            .await?
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        if got.record.status == ApprovalStatus::Expired {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the orphaned question was never settled: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let phases = approval_phases(&p, run, &orphan.record.request.approval_id).await?;
    assert_eq!(
        phases
            .iter()
            .map(|(p, _, _)| p.as_str())
            .collect::<Vec<_>>(),
        ["approval_requested", "approval_decided"],
        "{phases:?}"
    );
    p.client.cancel(run, Some("test".into())).await?;
    p.client.wait(run, WAIT).await?;
    let late = p
        .client
        .call(&answer(&pending[0], Decision::Approve), WAIT)
        .await?
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    assert_eq!(late.outcome, AnswerOutcome::AlreadyDecided);
    assert_eq!(late.record.status, ApprovalStatus::Withdrawn, "{late:?}");
    Ok(())
}

/// Agents of the protocol on the same NATS (written from its documentation, in Python) are
/// external members of the team roster — this deployment's own exposed agents are not —
/// with their presence from their heartbeats: alive, registered but silent, gone.
#[tokio::test(flavor = "multi_thread")]
async fn external_agents_join_the_team_roster() -> anyhow::Result<()> {
    if let Err(why) = client_script() {
        eprintln!("SKIPPED: the external agents cannot run: {why}");
        return Ok(());
    }
    let mut p = Processes::start(
        r#"
[supervisor]
agents-discovery = "1s"

[agents-protocol]
heartbeat = "1s"

[agents.own]
kind = "scripted"
expose = true
roles = ["mine"]
"#,
    )
    .await?;
    p.coordinator().await?;
    p.supervisor().await?;
    let _helper = ExternalAgent::start(&p, "helper", &["--capabilities", "echo,review"]).await?;
    let _silent = ExternalAgent::start(&p, "silent", &["--no-heartbeat"]).await?;
    let zombie = ExternalAgent::start(&p, "zombie", &["--die-after-first-chunk"]).await?;

    // The roster lists them (from discovery and heartbeats), not this deployment's own.
    let deadline = tokio::time::Instant::now() + WAIT;
    let list = loop {
        let list = roster(&p, None).await?;
        let ready = member(&list, "agents:helper.ext.default")
            .is_some_and(|m| m["status"] == "idle")
            && member(&list, "agents:silent.ext.default").is_some_and(|m| m["status"] == "stale")
            && member(&list, "agents:zombie.ext.default").is_some_and(|m| m["status"] == "idle");
        if ready {
            break list;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the external agents never showed up as expected: {list}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let helper = member(&list, "agents:helper.ext.default").expect("listed");
    assert_eq!(
        helper["card"]["roles"],
        json!(["echo", "review"]),
        "{helper}"
    );
    assert_eq!(
        helper["card"]["description"],
        "A test agent that repeats the prompt"
    );
    assert_eq!(helper["external"]["owner"], "ext", "{helper}");
    assert_eq!(helper["external"]["interval_s"], 1, "{helper}");
    assert!(helper["last_heartbeat"].is_string(), "{helper}");
    assert!(
        member(&list, "own").is_some(),
        "the definition is a member: {list}"
    );
    assert!(
        !list["members"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|m| m["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("agents:own"))),
        "this deployment's exposed agent is not an external member: {list}"
    );
    assert!(
        list["roles"]
            .as_array()
            .is_some_and(|r| r.contains(&json!("review")))
    );
    // By role: team.list --role and team.find (alive before stuck).
    let reviewers = roster(&p, Some("review")).await?;
    let names: Vec<&str> = reviewers["members"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["name"].as_str())
        .collect();
    assert_eq!(names, ["agents:helper.ext.default"], "{reviewers}");
    let found = p
        .client
        .request(
            &flotilla_model::team::TeamFindRequest {
                protocol: 1,
                role: "echo".into(),
            },
            Duration::from_secs(5),
        )
        .await?;
    let names: Vec<&str> = found.members.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "agents:helper.ext.default",
            "agents:zombie.ext.default",
            "agents:silent.ext.default"
        ]
    );
    // team.get takes the name or the target `flotilla call` takes.
    let get = |name: &str| flotilla_model::team::TeamGetRequest {
        protocol: 1,
        name: name.into(),
    };
    let m = p.client.request(&get("agents:helper"), WAIT).await?;
    assert_eq!(m.name, "agents:helper.ext.default");
    let e = p
        .client
        .request(&get("agents:nobody"), WAIT)
        .await
        .expect_err("no such member");
    assert!(e.to_string().contains("not_found"), "{e}");

    // The zombie dies (killed): offline once neither discovered nor beating.
    drop(zombie);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let list = roster(&p, None).await?;
        if member(&list, "agents:zombie.ext.default").is_some_and(|m| m["status"] == "offline") {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "zombie not offline: {list}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// An LLM agent calls agents of the protocol with `call_agent` (an `agents:` entry of its
/// `agent-tools`): their answer streams into its run's events as `tool_update`s, and a dead
/// one (heartbeat stopped mid-call) or an unknown one is an error for the model, not a hang.
#[tokio::test(flavor = "multi_thread")]
async fn llm_agents_call_external_agents() -> anyhow::Result<()> {
    use flotilla_model::event::Event;
    use flotilla_model::plan::Subtask;
    use flotilla_model::submit::SubmitRequest;
    use futures::StreamExt;
    if let Err(why) = client_script() {
        eprintln!("SKIPPED: the external agents cannot run: {why}");
        return Ok(());
    }
    let model = OpenAiServer::start().await?;
    let mut p = Processes::start(&format!(
        r#"
[agents.caller]
kind = "llm"
base-url = "{}"
model = "scripted-model"
agent-tools = ["agents:helper", "agents:zombie.ext", "agents:nobody", "agents:gate"]
"#,
        model.base_url()
    ))
    .await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let _helper = ExternalAgent::start(&p, "helper", &[]).await?;
    let _zombie = ExternalAgent::start(&p, "zombie", &["--die-after-first-chunk"]).await?;
    let _gate = ExternalAgent::start(&p, "gate", &["--ask-permission"]).await?;

    // An LLM agent calls the external agent: the answer streams into its run's events.
    let once = |request: &str| {
        let mut plan = plan(vec![Subtask::new("ask", request).with_agent("caller")]);
        plan.config.max_retries = 0;
        SubmitRequest::new(plan)
    };
    model.push(Reply::tool_call(
        "call_agent",
        json!({"agent": "agents:helper", "request": "hello from the model", "timeout_s": 30}),
    ));
    model.push(Reply::text("The helper answered."));
    let run = p.client.submit(once("ask the helper")).await?;
    let o = p.client.wait(run, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    let tool_events = |run| {
        let client = p.client.clone();
        async move {
            let events = client.events(run).await?;
            futures::pin_mut!(events);
            let mut seen = Vec::new();
            tokio::time::timeout(WAIT, async {
                while let Some(e) = events.next().await {
                    match e?.event {
                        Event::ToolUpdate { output, .. } => seen.push(output),
                        Event::ToolEnd { ok, output, .. } => {
                            seen.push(json!({"end": ok, "output": output}));
                            return anyhow::Ok(seen);
                        }
                        _ => {}
                    }
                }
                anyhow::bail!("no tool_end")
            })
            .await?
        }
    };
    let seen = tool_events(run).await?;
    assert_eq!(
        seen,
        [
            json!({"text": "helper says: "}),
            json!({"text": "hello from the model"}),
            json!({"end": true, "output": {"agent": "agents:helper.ext.default", "response": "helper says: hello from the model"}}),
        ]
    );
    let asked = model.requests();
    assert!(
        asked.last().is_some_and(|r| r
            .texts("tool")
            .iter()
            .any(|t| t.contains("helper says: hello from the model"))),
        "the model read the answer"
    );

    // The external agent dies mid-call: the model gets agent_dead within seconds.
    model.push(Reply::tool_call(
        "call_agent",
        json!({"agent": "agents:zombie.ext", "request": "are you there"}),
    ));
    model.push(Reply::text("The zombie is gone."));
    let started = std::time::Instant::now();
    let run = p.client.submit(once("ask the zombie")).await?;
    let o = p.client.wait(run, WAIT).await?;
    assert_eq!(
        o.status,
        RunStatus::Succeeded,
        "the model carries on: {o:?}"
    );
    let seen = tool_events(run).await?;
    let end = seen.last().expect("tool_end");
    assert_eq!(end["end"], false, "{seen:?}");
    assert_eq!(end["output"]["error"]["code"], "agent_dead", "{seen:?}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );

    // The external agent asks permission: a person's answer (here `respond` with text) is
    // what the agent hears, and the call's events say so.
    model.push(Reply::tool_call(
        "call_agent",
        json!({"agent": "agents:gate", "request": "clean up", "timeout_s": 60}),
    ));
    model.push(Reply::text("Cleaned."));
    let run = p.client.submit(once("ask the gate")).await?;
    let pending = asked_of_a_person(&p, run).await?;
    assert_eq!(pending[0].request.input["context"], "clean up");
    p.client
        .call(
            &answer(
                &pending[0],
                flotilla_model::approval::Decision::Respond {
                    result: "only the .tmp files".into(),
                },
            ),
            WAIT,
        )
        .await?
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let o = p.client.wait(run, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    let seen = tool_events(run).await?;
    let query = seen
        .iter()
        .find(|u| u.get("query").is_some())
        .expect("the query's update");
    assert_eq!(query["answered"], true, "{seen:?}");
    assert_eq!(query["reply"], "only the .tmp files", "{seen:?}");
    assert_eq!(
        seen.last().expect("end")["output"]["response"],
        "gate says: permission only the .tmp files",
        "{seen:?}"
    );

    // No such agent: a structured error for the model, at once.
    model.push(Reply::tool_call(
        "call_agent",
        json!({"agent": "agents:nobody", "request": "hello"}),
    ));
    model.push(Reply::text("Nobody there."));
    let run = p.client.submit(once("ask nobody")).await?;
    let o = p.client.wait(run, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    let seen = tool_events(run).await?;
    assert_eq!(
        seen.last().expect("end")["output"]["error"]["code"],
        "unknown_agent"
    );
    Ok(())
}
