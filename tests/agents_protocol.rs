//! The NATS Agent Protocol across processes on a real nats-server: Flotilla's exposed agents
//! driven by a caller written from the protocol's documentation (`agents_protocol/client.py`,
//! plain `nats-py`, nothing of Flotilla) — discovery, heartbeats, status, a prompt with
//! streamed replies and the end of the stream, a question (`query`) answered by the caller,
//! a caller that goes away (its run is cancelled), and bad input: malformed prompts,
//! attachments, an unknown agent, a failing run — each a structured error frame followed by
//! the end of the stream. The other way round: plans (an exec agent's `flotilla call`, an LLM
//! agent's `call_agent`) call external agents written from the protocol's documentation
//! (`agents_protocol/agent.py`), including one that asks permission mid-call (a `query`),
//! which becomes a Flotilla approval a person answers.
//!
//! Agents are deterministic: the LLM agent's model is the OpenAI-compatible test double
//! (`flotilla_testkit::openai`, scripted replies); the others are `scripted` agents.
//!
//! Needs `python3` with `nats-py` (`scripts/test` installs it: `scripts/ensure-nats-py.sh`);
//! without it the test says so and skips.

mod support;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use flotilla_model::run::RunStatus;
use flotilla_testkit::openai::{OpenAiServer, Reply};
use futures::StreamExt as _;
use serde_json::{Value, json};
use support::*;

/// The protocol client, or why it cannot run here.
fn client_script() -> Result<PathBuf, String> {
    let ok = std::process::Command::new("python3")
        .args(["-c", "import nats"])
        .output()
        .map_err(|e| format!("python3 is not available ({e})"))?;
    if !ok.status.success() {
        return Err(
            "python3 has no nats-py (pip install nats-py, or run scripts/ensure-nats-py.sh)".into(),
        );
    }
    Ok(root().join("tests/agents_protocol/client.py"))
}

/// Runs the protocol client with `args` against `p`'s server and returns its JSON answer.
fn call(script: &PathBuf, p: &Processes, args: &[&str]) -> anyhow::Result<Value> {
    let out = std::process::Command::new("python3")
        .arg(script)
        .arg(p.server.url())
        .args(args)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "client.py {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn config(base_url: &str) -> String {
    format!(
        r#"
[agents-protocol]
heartbeat = "1s"
keepalive = "300ms"

[agents.writer]
kind = "llm"
base-url = "{base_url}"
model = "scripted-model"
tools = ["ask_user"]
expose = true
description = "Writes short answers"
roles = ["writer"]
capabilities = ["prose"]

[agents.echo]
kind = "scripted"
reply = "echo: {{description}}"
expose = true

[agents.broken]
kind = "scripted"
fail-first = 99
failure = "it always breaks"
expose = true

[agents.hidden]
kind = "scripted"
"#
    )
}

/// The texts of a stream's response chunks, joined.
fn said(stream: &Value) -> String {
    stream["chunks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["type"] == "response")
        .filter_map(|c| c["data"].as_str())
        .collect()
}

/// Asserts a stream that ended with one error frame of `status` and `code`.
fn assert_error(stream: &Value, status: u64, code: &str) {
    assert_eq!(stream["terminated"], true, "the stream ends: {stream}");
    let errors = stream["errors"].as_array().expect("errors");
    assert_eq!(errors.len(), 1, "{stream}");
    assert_eq!(errors[0]["code"], status, "{stream}");
    assert_eq!(errors[0]["body"]["code"], code, "{stream}");
    assert!(
        !errors[0]["description"].as_str().unwrap_or("").is_empty(),
        "{stream}"
    );
}

/// The runs whose label says they answered a prompt for `agent`.
async fn prompt_runs(
    p: &Processes,
    agent: &str,
) -> anyhow::Result<Vec<flotilla_model::run::RunRecord>> {
    let store = flotilla_client::open_store(&p.bus).await?;
    Ok(store
        .recent(200)
        .await?
        .into_iter()
        .filter(|r| r.labels.get("agents-protocol.agent").map(String::as_str) == Some(agent))
        .collect())
}

#[tokio::test(flavor = "multi_thread")]
async fn exposed_agents_speak_the_protocol() -> anyhow::Result<()> {
    let script = match client_script() {
        Ok(s) => s,
        Err(why) => {
            eprintln!("SKIPPED: the protocol client cannot run: {why}");
            return Ok(());
        }
    };
    let model = OpenAiServer::start().await?;
    let mut p = Processes::start(&config(&model.base_url())).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;

    // Discovery: one instance of `agents` per exposed agent, with the protocol's metadata.
    let deadline = tokio::time::Instant::now() + WAIT;
    let found = loop {
        let found = call(&script, &p, &["discover"])?;
        if found.as_array().map_or(0, Vec::len) >= 3 {
            break found;
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "discovered {found}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let found = found.as_array().expect("a list");
    let agents: BTreeSet<&str> = found
        .iter()
        .filter_map(|i| i["metadata"]["agent"].as_str())
        .collect();
    assert_eq!(
        agents,
        BTreeSet::from(["broken", "echo", "writer"]),
        "only agents that opt in"
    );
    let writer = found
        .iter()
        .find(|i| i["metadata"]["agent"] == "writer")
        .expect("writer");
    assert_eq!(writer["description"], "Writes short answers");
    assert_eq!(writer["metadata"]["owner"], "flotilla");
    assert_eq!(writer["metadata"]["session"], "default");
    assert_eq!(writer["metadata"]["protocol_version"], "0.3");
    assert_eq!(writer["metadata"]["capabilities"], "writer,prose");
    let endpoint = |name: &str| {
        writer["endpoints"]
            .as_array()
            .and_then(|e| e.iter().find(|e| e["name"] == name))
            .cloned()
            .unwrap_or(Value::Null)
    };
    let prompt_ep = endpoint("prompt");
    assert_eq!(
        prompt_ep["subject"],
        "agents.prompt.writer.flotilla.default"
    );
    assert_eq!(prompt_ep["queue_group"], "agents");
    assert_eq!(prompt_ep["metadata"]["attachments_ok"], "false");
    assert!(prompt_ep["metadata"]["max_payload"].as_str().is_some());
    assert_eq!(endpoint("status")["queue_group"], "agents");

    // Heartbeats and status: the instance that registered, its interval.
    let hb = call(&script, &p, &["heartbeat", "writer", "5"])?;
    assert_eq!(hb["subject"], "agents.hb.writer.flotilla.default");
    assert_eq!(hb["payload"]["instance_id"], writer["id"]);
    assert_eq!(hb["payload"]["interval_s"], 1);
    assert_eq!(hb["payload"]["owner"], "flotilla");
    assert!(hb["payload"]["ts"].as_str().is_some());
    let status = call(
        &script,
        &p,
        &["status", "agents.status.writer.flotilla.default"],
    )?;
    assert_eq!(status["agent"], "writer");
    assert_eq!(status["interval_s"], 1);

    // A prompt: the ack first, the model's reply streamed, the end of the stream.
    model.push(Reply::text("Hello there, friend").chunk_delay(Duration::from_millis(150)));
    let s = call(
        &script,
        &p,
        &[
            "prompt",
            "agents.prompt.writer.flotilla.default",
            "Say hello",
        ],
    )?;
    assert_eq!(
        s["chunks"][0],
        json!({"type": "status", "data": "ack"}),
        "{s}"
    );
    assert_eq!(said(&s), "Hello there, friend", "{s}");
    assert_eq!(s["terminated"], true, "{s}");
    assert!(s["errors"].as_array().is_some_and(Vec::is_empty), "{s}");
    assert!(
        model.requests()[0].user().contains("Say hello"),
        "the prompt is the task"
    );
    // A JSON envelope; an agent that does not stream: its answer once, at the end.
    let s = call(
        &script,
        &p,
        &[
            "prompt",
            "agents.prompt.echo.flotilla.default",
            r#"{"prompt": "ping", "note": "kept"}"#,
        ],
    )?;
    assert_eq!(said(&s), "echo: ping", "{s}");
    assert_eq!(s["terminated"], true);

    // A question: the agent's ask_user is a query; the caller's answer reaches the model.
    model.push_all([
        Reply::tool_call("ask_user", json!({"question": "Which colour?"})),
        Reply::text("painted it blue"),
    ]);
    let s = call(
        &script,
        &p,
        &[
            "prompt",
            "agents.prompt.writer.flotilla.default",
            "Paint the shed",
            "--answer",
            "blue",
        ],
    )?;
    let queries = s["queries"].as_array().expect("queries");
    assert_eq!(queries.len(), 1, "{s}");
    assert_eq!(queries[0]["prompt"], "Which colour?");
    assert!(queries[0]["id"].as_str().is_some_and(|id| !id.is_empty()));
    assert!(
        queries[0]["reply_subject"]
            .as_str()
            .is_some_and(|r| !r.is_empty())
    );
    assert_eq!(said(&s), "painted it blue", "{s}");
    assert_eq!(s["terminated"], true);
    let last = model.requests().pop().expect("the second call");
    assert!(
        last.messages()
            .iter()
            .any(|m| m["role"] == "tool"
                && m["content"].as_str().is_some_and(|c| c.contains("blue"))),
        "the answer is the tool's result: {:?}",
        last.messages()
    );

    // Bad input: a structured error frame, then the end; nothing runs.
    let before = prompt_runs(&p, "writer").await?.len();
    let bad = [
        ("raw", "fffe00", 400, "malformed_prompt"),
        ("prompt", r#"{"prompt": 3}"#, 400, "malformed_prompt"),
        ("prompt", "   ", 400, "malformed_prompt"),
        (
            "prompt",
            r#"{"prompt": "look", "attachments": [{"filename": "a.txt", "content": "aGk="}]}"#,
            400,
            "attachments_unsupported",
        ),
    ];
    for (how, body, status, code) in bad {
        let s = call(
            &script,
            &p,
            &[how, "agents.prompt.writer.flotilla.default", body],
        )?;
        assert_error(&s, status, code);
    }
    assert_eq!(
        prompt_runs(&p, "writer").await?.len(),
        before,
        "bad prompts start no run"
    );
    // An agent this deployment does not expose, under its owner.
    for subject in [
        "agents.prompt.hidden.flotilla.default",
        "agents.prompt.writer.flotilla.other-session",
    ] {
        let s = call(&script, &p, &["prompt", subject, "hello"])?;
        assert_error(&s, 404, "unknown_agent");
    }
    // A run that fails: its error, with the run it was.
    let s = call(
        &script,
        &p,
        &[
            "prompt",
            "agents.prompt.broken.flotilla.default",
            "try",
            "--timeout",
            "60",
        ],
    )?;
    assert_error(&s, 500, "run_failed");
    assert!(s["errors"][0]["body"]["run_id"].as_str().is_some(), "{s}");
    assert!(
        s["errors"][0]["body"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("it always breaks")),
        "{s}"
    );

    // The caller goes away mid-stream: its run is cancelled.
    let before: BTreeSet<_> = prompt_runs(&p, "writer")
        .await?
        .into_iter()
        .map(|r| r.handle.run_id)
        .collect();
    model.push(Reply::hang_mid_stream("partial answer"));
    let s = call(
        &script,
        &p,
        &[
            "cancel",
            "agents.prompt.writer.flotilla.default",
            "Take your time",
        ],
    )?;
    assert_eq!(s["cancelled"], true, "{s}");
    assert_eq!(said(&s), "partial answer");
    let run = prompt_runs(&p, "writer")
        .await?
        .into_iter()
        .map(|r| r.handle.run_id)
        .find(|r| !before.contains(r))
        .expect("the cancelled prompt's run");
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Cancelled, "{outcome:?}");
    assert!(
        outcome
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("went away")),
        "{outcome:?}"
    );
    Ok(())
}

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

/// The team roster for `role` (all of it without), as `team.list` answers it.
async fn roster(p: &Processes, role: Option<&str>) -> anyhow::Result<Value> {
    let list = p
        .client
        .request(
            &flotilla_model::team::TeamListRequest {
                protocol: 1,
                role: role.map(str::to_owned),
            },
            Duration::from_secs(5),
        )
        .await?;
    Ok(serde_json::to_value(list)?)
}

/// The roster entry named `name` in `list`, if listed.
fn member<'a>(list: &'a Value, name: &str) -> Option<&'a Value> {
    list["members"]
        .as_array()?
        .iter()
        .find(|m| m["name"] == name)
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

/// Persistent teammates spawned with `expose` are agents of the protocol, served by the
/// supervisor: discovered with their metadata, a prompt is a message to the teammate and the
/// reply of the turn that reads it comes back; a second prompt is the next turn of the same
/// conversation; a failed turn, caps and bad input are error frames; a teammate without
/// `expose` is not discoverable, and one shut down leaves discovery (a prompt then gets
/// `unknown_agent`). The roster does not list them as external members.
///
/// The teammates' agents are `scripted` (deterministic): `mate` answers `<name> turn <n>`,
/// the turn number being the conversation's (1 + the turns it recorded), which shows the
/// second prompt continued the first one's conversation; `breaks` always fails.
#[tokio::test(flavor = "multi_thread")]
async fn exposed_teammates_speak_the_protocol() -> anyhow::Result<()> {
    use flotilla_model::teammate::{
        TeamMates, TeamMatesRequest, TeamShutdownRequest, TeamSpawnRequest,
    };
    let script = match client_script() {
        Ok(s) => s,
        Err(why) => {
            eprintln!("SKIPPED: the protocol client cannot run: {why}");
            return Ok(());
        }
    };
    let mut p = Processes::start(
        r#"
[supervisor]
agents-discovery = "1s"
max-message-bytes = 200

[agents-protocol]
heartbeat = "1s"
keepalive = "300ms"

[agents.echo]
kind = "scripted"
reply = "echo: {description}"
expose = true

[agents.mate]
kind = "scripted"
reply = "{task_id} turn {attempt}"
roles = ["analyst"]

[agents.breaks]
kind = "scripted"
fail-first = 99
failure = "it always breaks"
"#,
    )
    .await?;
    p.coordinator().await?;
    p.supervisor().await?;
    p.worker(&[]).await?;
    let ask = Duration::from_secs(10);
    let spawn = |team: &str, name: &str, agent: &str, expose: bool| TeamSpawnRequest {
        protocol: 1,
        team: Some(team.into()),
        name: name.into(),
        role: "analyst".into(),
        instructions: "Answers questions about the crew.\nSecond line.".into(),
        agent: Some(agent.into()),
        pool: None,
        by: None,
        expose,
    };
    let ann = p
        .client
        .request(&spawn("crew", "ann", "mate", true), ask)
        .await?;
    assert!(ann.expose, "{ann:?}");
    p.client
        .request(&spawn("crew", "bob", "mate", false), ask)
        .await?;
    p.client
        .request(&spawn("crew", "cy", "breaks", true), ask)
        .await?;
    // As an operator does it: `flotilla team spawn --expose`.
    let out = p.cli(&[
        "team",
        "spawn",
        "dee",
        "--role",
        "analyst",
        "--instructions",
        "Spawned from the CLI.",
        "--agent",
        "mate",
        "--team",
        "crew",
        "--expose",
    ])?;
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("exposed on the NATS Agent Protocol"),
        "{out:?}"
    );

    // Bad input: an address that is an exposed definition's, or another exposed teammate's.
    for (req, code) in [
        (spawn("default", "echo", "mate", true), "address_taken"),
        (spawn("crew", "Ann", "mate", true), "address_taken"),
    ] {
        let err = p.client.call(&req, ask).await?.expect_err("refused");
        assert_eq!((err.status, err.code.as_str()), (409, code), "{err:?}");
    }

    // Discovery: one instance per exposed teammate, with the protocol's metadata.
    let deadline = tokio::time::Instant::now() + WAIT;
    let found = loop {
        let found = call(&script, &p, &["discover"])?;
        let agents: BTreeSet<String> = found
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|i| i["metadata"]["agent"].as_str().map(str::to_owned))
            .collect();
        if agents.contains("ann") && agents.contains("cy") && agents.contains("dee") {
            assert!(
                !agents.contains("bob"),
                "only teammates that opt in: {found}"
            );
            break found;
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "discovered {found}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let ann_info = found
        .as_array()
        .and_then(|f| f.iter().find(|i| i["metadata"]["agent"] == "ann"))
        .cloned()
        .unwrap_or(Value::Null);
    assert_eq!(ann_info["description"], "Answers questions about the crew.");
    let meta = &ann_info["metadata"];
    assert_eq!(meta["owner"], "flotilla", "{meta}");
    assert_eq!(meta["session"], "crew", "{meta}");
    assert_eq!(meta["protocol_version"], "0.3", "{meta}");
    assert_eq!(meta["capabilities"], "analyst", "{meta}");
    assert_eq!(meta["flotilla_teammate"], "ann", "{meta}");
    assert_eq!(meta["flotilla_team"], "crew", "{meta}");
    assert_eq!(meta["flotilla_prefix"], "flotilla", "{meta}");
    let prompt_ep = ann_info["endpoints"]
        .as_array()
        .and_then(|e| e.iter().find(|e| e["name"] == "prompt"))
        .cloned()
        .unwrap_or(Value::Null);
    assert_eq!(prompt_ep["subject"], "agents.prompt.ann.flotilla.crew");
    assert_eq!(prompt_ep["queue_group"], "agents");
    let hb = call(&script, &p, &["heartbeat", "ann", "5"])?;
    assert_eq!(hb["subject"], "agents.hb.ann.flotilla.crew");
    assert_eq!(hb["payload"]["instance_id"], ann_info["id"]);

    // A prompt: ack, the turn's reply, the end; the next prompt is the next turn.
    let subject = "agents.prompt.ann.flotilla.crew";
    for turn in [1, 2] {
        let s = call(&script, &p, &["prompt", subject, "How are we doing?"])?;
        assert_eq!(
            s["chunks"][0],
            json!({"type": "status", "data": "ack"}),
            "{s}"
        );
        assert_eq!(said(&s), format!("ann turn {turn}"), "{s}");
        assert_eq!(s["terminated"], true, "{s}");
        assert!(s["errors"].as_array().is_some_and(Vec::is_empty), "{s}");
    }
    let mates: TeamMates = p
        .client
        .request(
            &TeamMatesRequest {
                protocol: 1,
                team: Some("crew".into()),
            },
            ask,
        )
        .await?;
    let view = mates
        .teammates
        .iter()
        .find(|m| m.name == "ann")
        .expect("ann");
    assert_eq!((view.turns, view.expose), (2, true), "{view:?}");

    // A failed turn, caps and bad frames: an error frame, then the end.
    let s = call(
        &script,
        &p,
        &["prompt", "agents.prompt.cy.flotilla.crew", "go"],
    )?;
    assert_error(&s, 500, "turn_failed");
    assert!(
        s["errors"][0]["body"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("it always breaks")),
        "{s}"
    );
    let big = "x".repeat(201);
    let s = call(&script, &p, &["prompt", subject, &big])?;
    assert_error(&s, 413, "message_too_large");
    let s = call(&script, &p, &["raw", subject, "fffe00"])?;
    assert_error(&s, 400, "malformed_prompt");
    let s = call(
        &script,
        &p,
        &[
            "prompt",
            subject,
            r#"{"prompt": "look", "attachments": [{"filename": "a.txt", "content": "aGk="}]}"#,
        ],
    )?;
    assert_error(&s, 400, "attachments_unsupported");

    // The roster: exposed teammates are this deployment's own, not external members.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let list = roster(&p, None).await?;
    assert!(
        member(&list, "agents:ann.flotilla.crew").is_none()
            && member(&list, "agents:echo.flotilla.default").is_none(),
        "{list}"
    );

    // Shut down: it leaves discovery, and a prompt is answered unknown_agent.
    p.client
        .request(
            &TeamShutdownRequest {
                protocol: 1,
                team: Some("crew".into()),
                name: "ann".into(),
            },
            ask,
        )
        .await?;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let found = call(&script, &p, &["discover"])?;
        let listed = found
            .as_array()
            .into_iter()
            .flatten()
            .any(|i| i["metadata"]["agent"] == "ann");
        if !listed {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "still discovered {found}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let s = call(&script, &p, &["prompt", subject, "still there?"])?;
    assert_error(&s, 404, "unknown_agent");
    Ok(())
}

/// The prompt subject of the exposed `echo` agent of the tests below.
const ECHO_PROMPT: &str = "agents.prompt.echo.flotilla.default";

/// An exposed scripted agent, short keep-alives.
const ECHO: &str = r#"
[agents-protocol]
heartbeat = "1s"
keepalive = "300ms"

[agents.echo]
kind = "scripted"
reply = "echo: {description}"
expose = true
"#;

/// Waits until process `i`'s log holds `line`.
async fn logged(p: &Processes, i: usize, line: &str) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !p.log(i).contains(line) {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "process {i} never logged {line:?}: {}",
            p.log(i)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// A coordinator process answers prompts of the NATS Agent Protocol only once its coordinator
/// has started: one that cannot finish starting (here its user may not read the trust bucket,
/// so it never has the earned levels it admits runs with) registers no agent, and a prompt
/// finds nobody (NATS says "no responders") rather than a process that would start a run it
/// could not cancel; once a ready coordinator runs, it answers.
#[tokio::test(flavor = "multi_thread")]
async fn only_a_started_coordinator_answers_prompts() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let conf = dir.path().join("users.conf");
    std::fs::write(
        &conf,
        r#"
authorization {
  users = [
    { user: admin, password: admin-password }
    { user: stuck, password: stuck-password, permissions: {
        publish: { allow: [">"], deny: ["$JS.API.CONSUMER.CREATE.KV_flotilla-trust", "$JS.API.CONSUMER.CREATE.KV_flotilla-trust.>"] }
        subscribe: { allow: [">"] }
    } }
  ]
}
"#,
    )?;
    let server = flotilla_testkit::NatsServer::builder()
        .config_file(&conf)
        .connect_as("admin", "admin-password")
        .start()
        .await?;
    let mut p =
        Processes::with_server(server, &format!("{ECHO}\n[hitl.trust]\nenabled = true\n")).await?;
    let as_user = |user: &'static str, password: &'static str| {
        [
            ("FLOTILLA_NATS__AUTH__KIND", "user-password"),
            ("FLOTILLA_NATS__AUTH__USER", user),
            ("FLOTILLA_NATS__AUTH__PASSWORD", password),
        ]
    };
    let stuck = p.spawn_env(&["coordinator"], &as_user("stuck", "stuck-password"))?;
    // Past connecting, provisioning and its consumers: waiting for what it cannot read.
    logged(&p, stuck, "Reading the earned trust levels before starting").await?;
    let nc = p.bus.client().clone();
    let asked = nc.request(ECHO_PROMPT, "hello".into()).await;
    assert!(
        asked
            .as_ref()
            .is_err_and(|e| e.kind() == async_nats::RequestErrorKind::NoResponders),
        "a half-started process answered: {:?}\n{}",
        asked.map(|m| m.payload),
        p.log(stuck)
    );

    // A coordinator that starts answers.
    p.spawn_env(&["coordinator"], &as_user("admin", "admin-password"))?;
    wait_for_api(&p.bus).await?;
    let deadline = tokio::time::Instant::now() + WAIT;
    let ack = loop {
        match nc.request(ECHO_PROMPT, "hello".into()).await {
            Ok(m) => break m,
            Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
                anyhow::ensure!(tokio::time::Instant::now() < deadline, "nobody answered");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
    let ack: Value = serde_json::from_slice(&ack.payload)?;
    assert_eq!(ack, json!({"type": "status", "data": "ack"}));
    let log = p.log(stuck);
    assert!(
        !log.contains("Coordinator started") && !log.contains("Agents exposed"),
        "the stuck process started after all: {log}"
    );
    Ok(())
}

/// A caller that goes away gets its run cancelled even when no coordinator answers the first
/// cancel: here the only coordinator serves no API (`coordinator.api = false`), so the exposed
/// agent's cancel is tried again until one that does is started.
#[tokio::test(flavor = "multi_thread")]
async fn an_abandoned_prompts_run_is_cancelled_once_a_coordinator_answers() -> anyhow::Result<()> {
    let mut p = Processes::start(ECHO).await?;
    let first = p.spawn_env(&["coordinator"], &[("FLOTILLA_COORDINATOR__API", "false")])?;
    logged(&p, first, "Agents exposed on the NATS Agent Protocol").await?;
    // No worker: the run waits for one. The caller takes the ack and goes away.
    let nc = p.bus.client().clone();
    let inbox = nc.new_inbox();
    let mut stream = nc.subscribe(inbox.clone()).await?;
    nc.publish_with_reply(ECHO_PROMPT, inbox, "hello".into())
        .await?;
    let ack = tokio::time::timeout(WAIT, stream.next())
        .await?
        .ok_or_else(|| anyhow::anyhow!("no ack"))?;
    assert_eq!(
        serde_json::from_slice::<Value>(&ack.payload)?,
        json!({"type": "status", "data": "ack"})
    );
    stream.unsubscribe().await?;
    nc.flush().await?;
    // Its cancel found no coordinator.
    logged(&p, first, "could not be cancelled").await?;
    let run = prompt_runs(&p, "echo")
        .await?
        .first()
        .map(|r| r.handle.run_id)
        .ok_or_else(|| anyhow::anyhow!("no prompt run"))?;
    assert!(p.log(first).contains(&run.to_string()), "{}", p.log(first));
    // One that answers: the cancel is tried again and goes through.
    p.coordinator().await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Cancelled, "{outcome:?}");
    assert!(
        outcome
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("went away")),
        "{outcome:?}"
    );
    logged(&p, first, "cancelled after all").await?;
    Ok(())
}
