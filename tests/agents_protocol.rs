//! The NATS Agent Protocol across processes on a real nats-server: Flotilla's exposed agents
//! driven by a caller written from the protocol's documentation (`agents_protocol/client.py`,
//! plain `nats-py`, nothing of Flotilla) — discovery, heartbeats, status, a prompt with
//! streamed replies and the end of the stream, a question (`query`) answered by the caller,
//! a caller that goes away (its run is cancelled), and bad input: malformed prompts,
//! attachments, an unknown agent, a failing run — each a structured error frame followed by
//! the end of the stream. Persistent teammates spawned with `expose` speak it too, and only a
//! coordinator that has started answers prompts. The other way round (plans calling external
//! agents) is in `agents_protocol_external.rs`.
//!
//! Agents are deterministic: the LLM agent's model is the OpenAI-compatible test double
//! (`flotilla_testkit::openai`, scripted replies); the others are `scripted` agents.
//!
//! Needs `python3` with `nats-py` (`scripts/test` installs it: `scripts/ensure-nats-py.sh`);
//! without it the test says so and skips.

mod support;

#[path = "agents_protocol/common.rs"]
mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use flotilla_model::run::RunStatus;
use flotilla_testkit::openai::{OpenAiServer, Reply};
use futures::StreamExt as _;
use serde_json::{Value, json};
use support::*;

use common::{client_script, member, roster};

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
