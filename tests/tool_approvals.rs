//! Humans in the loop inside an LLM attempt, across processes against a real nats-server: a
//! tool call that waits for a person (a sensitive tool, a tool the agent does not have, the
//! agent's question to the user) suspends the attempt — its worker slot is given back and no
//! process holds the wait — and the decision continues it on any worker from its step
//! journal: no model call paid twice, no tool run twice, a rejected tool never run.
//!
//! A tool the client runs (the plan's `client_tools`, the agent's `client-tools`) waits the
//! same way for the client's result (`await_external_tools`).
//!
//! Agents are deterministic: the model is the OpenAI-compatible test double
//! (`flotilla_testkit::openai`, scripted replies and tool calls); the `send_email` tool is an
//! exec script (`python3`) that appends each call to a file, so the test counts executions.

mod support;

use std::time::Duration;

use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::approval::{
    AnswerOutcome, ApprovalAnswerReply, ApprovalAnswerRequest, ApprovalRecord, ApprovalStatus,
    Decision, PlanHitl, Trigger,
};
use flotilla_model::event::{Event, EventEnvelope};
use flotilla_model::ids::RunId;
use flotilla_model::plan::Subtask;
use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::submit::SubmitRequest;
use flotilla_model::time::Secs;
use flotilla_testkit::openai::{OpenAiServer, Reply};
use futures::StreamExt;
use serde_json::json;
use support::*;

const ASK: Duration = Duration::from_secs(5);

fn config(base_url: &str, dir: &std::path::Path) -> String {
    let log = dir.join("sent.log");
    let started = dir.join("slow.started");
    let go = dir.join("slow.go");
    format!(
        r#"
[hitl]
sensitive-actions = ["send_email"]
out-of-scope = true

[agents.mailer]
kind = "llm"
base-url = "{base_url}"
model = "scripted-model"
tools = ["ask_user"]

[agents.mailer.exec-tools.send_email]
command = "python3"
args = ["-c", '''
import json, sys
a = json.load(sys.stdin)
open({log:?}, 'a').write(json.dumps(a) + '\n')
print('sent to ' + a['to'])
''']
description = "Sends an email"
parameters = {{ type = "object", properties = {{ to = {{ type = "string" }}, body = {{ type = "string" }} }}, required = ["to"] }}

[agents.mailer.exec-tools.slow_step]
command = "python3"
args = ["-c", '''
import os, time
open({started:?}, 'a').write('started\n')
while not os.path.exists({go:?}):
    time.sleep(0.05)
print('step done')
''']
description = "A step that takes a while"

[agents.mailer.client-tools.pick_colour]
description = "Shows the user a colour picker and returns the colour chosen"
parameters = {{ type = "object", properties = {{ palette = {{ type = "string" }} }} }}

[agents.echo]
kind = "exec"
command = "python3"
args = ["-c", "print('echo')"]
"#
    )
}

/// The emails `send_email` sent.
fn sent(dir: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("sent.log"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Waits until run `run` has the approval `id` and returns it.
async fn approval(p: &Processes, run: RunId, id: &str) -> anyhow::Result<ApprovalRecord> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let l = approvals_of(&p.client, run, true).await?;
        if let Some(r) = l.into_iter().find(|r| r.request.approval_id == id) {
            return Ok(r);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "run {run} never asked {id}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn task_status(p: &Processes, run: RunId, task: &str) -> anyhow::Result<TaskStatus> {
    let view = p.client.run(run).await?.expect("the run exists");
    Ok(view
        .tasks
        .iter()
        .find(|t| t.task_id.as_str() == task)
        .map(|t| t.status)
        .expect("the task exists"))
}

fn answer(run: RunId, id: &str, decision: Decision) -> ApprovalAnswerRequest {
    ApprovalAnswerRequest {
        protocol: PROTOCOL_VERSION,
        run_id: run,
        approval_id: id.into(),
        decision,
        by: "alice".into(),
        comment: None,
        digest: None,
        always: false,
        incident: false,
    }
}

fn mail(description: &str) -> flotilla_model::plan::Plan {
    plan(vec![Subtask::new("mail", description).with_agent("mailer")])
}

/// The tool results the model was given in request `i` (0-based).
fn tool_results(model: &OpenAiServer, i: usize) -> Vec<String> {
    model
        .requests()
        .get(i)
        .map(|r| r.texts("tool"))
        .unwrap_or_default()
}

/// A sensitive tool call waits for a person with the call's arguments; meanwhile the only
/// worker slot runs other work, and the worker that ran the attempt is killed. Approved, the
/// attempt continues on another worker: the model is called once more (its first reply comes
/// from the journal), the tool runs exactly once, and the run succeeds.
#[tokio::test]
async fn a_sensitive_tool_call_waits_without_a_slot_and_runs_once_approved_on_another_worker()
-> anyhow::Result<()> {
    let model = OpenAiServer::start().await?;
    let dir = tempfile::tempdir()?;
    let mut p = Processes::start(&config(&model.base_url(), dir.path())).await?;
    p.coordinator().await?;
    let w1 = p.worker(&["--concurrency", "1"]).await?;
    model.push_all([
        Reply::tool_call(
            "send_email",
            json!({"to": "ana@example.com", "body": "the report is out"}),
        ),
        Reply::text("mailed ana"),
    ]);
    let run = p
        .client
        .submit(SubmitRequest::new(mail("mail ana")))
        .await?;
    let asked = approval(&p, run, "t0a1c1").await?;
    assert_eq!(asked.status, ApprovalStatus::Pending);
    let q = &asked.request;
    assert_eq!(q.trigger, Trigger::SensitiveAction);
    assert_eq!(
        q.tool_call.as_ref().map(|c| c.tool.as_str()),
        Some("send_email")
    );
    assert_eq!(q.input["to"], "ana@example.com", "{q:?}");
    assert_eq!(q.agent.as_deref(), Some("mailer"));
    assert_eq!(
        task_status(&p, run, "mail").await?,
        TaskStatus::AwaitingApproval
    );
    assert!(
        sent(dir.path()).is_empty(),
        "nothing is sent before the approval"
    );
    // The wait holds no slot: the worker's only slot runs another run meanwhile.
    let other = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("ping", "ping").with_agent("echo"),
        ])))
        .await?;
    let o = p.client.wait(other, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    // And no process: the worker that ran the attempt dies; another continues it.
    p.kill(w1);
    p.worker(&["--concurrency", "1"]).await?;
    let out = p.cli(&[
        "approvals",
        "approve",
        &run.to_string(),
        "t0a1c1",
        "--by",
        "carol",
        "--digest",
        &q.digest,
    ])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let o = p.client.wait(run, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    assert_eq!(
        o.final_result.as_ref().map(|f| f.response.as_str()),
        Some("mailed ana"),
        "{o:?}"
    );
    let emails = sent(dir.path());
    assert_eq!(emails.len(), 1, "the tool ran exactly once: {emails:?}");
    assert_eq!(emails[0]["to"], "ana@example.com");
    // Two model calls in all: the first reply was replayed from the journal.
    assert_eq!(model.requests().len(), 2);
    assert!(
        tool_results(&model, 1)
            .iter()
            .any(|t| t.contains("sent to ana@example.com")),
        "{:?}",
        tool_results(&model, 1)
    );
    // The suspension is on the run log, and the decision is in the audit trail.
    let history = p.cli(&["runs", "history", &run.to_string()])?;
    let text = String::from_utf8_lossy(&history.stdout);
    assert!(text.contains("suspended"), "{text}");
    let trail = p.cli(&["approvals", "history", &run.to_string()])?;
    let text = String::from_utf8_lossy(&trail.stdout);
    assert!(text.contains("decided approve by carol"), "{text}");
    Ok(())
}

/// A rejected tool never runs and the model reads why; a question to the user is answered
/// with `runs answer` (a second answer and an unknown token are refused); an out-of-scope
/// tool nobody answers gets its deadline's default.
#[tokio::test]
async fn rejections_questions_and_defaults_reach_the_model_as_tool_results() -> anyhow::Result<()> {
    let model = OpenAiServer::start().await?;
    let dir = tempfile::tempdir()?;
    let mut p = Processes::start(&config(&model.base_url(), dir.path())).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;

    // Rejected: never run; the model gets the rejection as the tool's result.
    model.push_all([
        Reply::tool_call("send_email", json!({"to": "all-customers@example.com"})),
        Reply::text("did not mail"),
    ]);
    let run = p
        .client
        .submit(SubmitRequest::new(mail("mail everyone")))
        .await?;
    approval(&p, run, "t0a1c1").await?;
    let a: ApprovalAnswerReply = p
        .client
        .request(
            &answer(
                run,
                "t0a1c1",
                Decision::Reject {
                    message: "not to customers".into(),
                },
            ),
            ASK,
        )
        .await?;
    assert_eq!(a.outcome, AnswerOutcome::Decided);
    let o = p.client.wait(run, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    assert!(sent(dir.path()).is_empty(), "a rejected tool never runs");
    let results = tool_results(&model, 1);
    assert!(
        results
            .iter()
            .any(|t| t.contains("not to customers") && t.contains("rejected")),
        "{results:?}"
    );
    // A second answer is told what decided.
    let again: ApprovalAnswerReply = p
        .client
        .request(&answer(run, "t0a1c1", Decision::Approve), ASK)
        .await?;
    assert_eq!(again.outcome, AnswerOutcome::AlreadyDecided);
    assert!(sent(dir.path()).is_empty());

    // A question: `await_clarification`, answered through the CLI.
    model.push_all([
        Reply::tool_call("ask_user", json!({"question": "Which colour?"})),
        Reply::text("painted it blue"),
    ]);
    let run = p
        .client
        .submit(SubmitRequest::new(mail("paint the shed")))
        .await?;
    let asked = approval(&p, run, "t0a1c1").await?;
    assert_eq!(asked.request.trigger, Trigger::Question);
    assert_eq!(asked.request.description, "Which colour?");
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    let question = tokio::time::timeout(WAIT, async {
        while let Some(e) = events.next().await {
            let e: EventEnvelope = e?;
            if let Event::AwaitClarification { question, token } = e.event {
                assert_eq!(token, "t0a1c1", "the event names its reply token");
                assert_eq!(e.source, "coordinator");
                return Ok::<_, anyhow::Error>(question);
            }
        }
        anyhow::bail!("the event stream ended")
    })
    .await??;
    assert_eq!(question, "Which colour?");
    let out = p.cli(&[
        "runs",
        "answer",
        &run.to_string(),
        "t0a1c1",
        "--text",
        "blue",
        "--by",
        "dave",
    ])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let o = p.client.wait(run, WAIT).await?;
    assert_eq!(
        o.final_result.as_ref().map(|f| f.response.as_str()),
        Some("painted it blue"),
        "{o:?}"
    );
    assert_eq!(tool_results(&model, 3), vec!["blue".to_string()]);
    // A second answer is refused; so is a token nobody asked.
    let out = p.cli(&[
        "runs",
        "answer",
        &run.to_string(),
        "t0a1c1",
        "--text",
        "red",
        "--by",
        "eve",
    ])?;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("already_decided"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = p.cli(&[
        "runs",
        "answer",
        &run.to_string(),
        "t9a9c9",
        "--text",
        "red",
        "--by",
        "eve",
    ])?;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not_found"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A tool the agent does not have: nobody answers; the default (reject) reaches the model.
    model.push_all([
        Reply::tool_call("launch_rocket", json!({})),
        Reply::text("no rocket"),
    ]);
    let mut rocket = mail("launch");
    rocket.config.hitl = Some(PlanHitl {
        approval_timeout: Some(Secs::from_secs(2)),
        ..Default::default()
    });
    let run = p.client.submit(SubmitRequest::new(rocket)).await?;
    let asked = approval(&p, run, "t0a1c1").await?;
    assert_eq!(asked.request.trigger, Trigger::OutOfScope);
    let o = p.client.wait(run, WAIT).await?;
    assert_eq!(
        o.final_result.as_ref().map(|f| f.response.as_str()),
        Some("no rocket"),
        "{o:?}"
    );
    let results = tool_results(&model, 5);
    assert!(
        results.iter().any(|t| t.contains("nobody answered")),
        "{results:?}"
    );
    let expired = approval(&p, run, "t0a1c1").await?;
    assert_eq!(expired.status, ApprovalStatus::Expired);
    Ok(())
}

/// A tool the client runs: the model's call with bad arguments is answered at once with the
/// schema's complaint (the client never sees it); a valid call suspends the attempt, the
/// coordinator publishes `await_external_tools` with the reply token and a `client_tool`
/// notice once the request is stored, and the client's result (`runs answer`) is the tool's
/// result. The agent's own client tool, unanswered, gets its deadline's default. A plan
/// whose client tools are malformed is refused with a problem per field.
#[tokio::test]
async fn a_client_tool_call_waits_for_the_clients_result() -> anyhow::Result<()> {
    let model = OpenAiServer::start().await?;
    let dir = tempfile::tempdir()?;
    let mut p = Processes::start(&config(&model.base_url(), dir.path())).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let mut notices = p
        .bus
        .client()
        .subscribe(format!("{}.notify.client_tool.*", p.bus.names().prefix()))
        .await?;
    let ticket = flotilla_model::plan::ClientTool {
        name: "open_ticket".into(),
        description: "Opens a ticket in the user's tracker and returns its number".into(),
        parameters: json!({"type": "object", "properties": {"title": {"type": "string"}},
            "required": ["title"], "additionalProperties": false}),
    };
    model.push_all([
        Reply::tool_call("open_ticket", json!({"summary": "disk full"})),
        Reply::tool_call("open_ticket", json!({"title": "disk full"})),
        Reply::text("opened ticket 42"),
    ]);
    let mut with_ticket = mail("file a ticket about the disk");
    with_ticket.config.client_tools = vec![ticket.clone()];
    let run = p.client.submit(SubmitRequest::new(with_ticket)).await?;
    let asked = approval(&p, run, "t0a1c1").await?;
    assert_eq!(asked.request.trigger, Trigger::ClientTool);
    assert_eq!(asked.request.input, json!({"title": "disk full"}));
    // The call with bad arguments never reached the client: the model read why.
    let first = tool_results(&model, 1);
    assert!(
        first.iter().any(|t| t.contains("invalid_arguments")),
        "{first:?}"
    );
    // The event names the call and its token; the notice carries the stored request.
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    let calls = tokio::time::timeout(WAIT, async {
        while let Some(e) = events.next().await {
            let e: EventEnvelope = e?;
            if let Event::AwaitExternalTools { calls } = e.event {
                assert_eq!(e.source, "coordinator");
                return Ok::<_, anyhow::Error>(calls);
            }
        }
        anyhow::bail!("the event stream ended")
    })
    .await??;
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].tool, "open_ticket");
    assert_eq!(calls[0].token, "t0a1c1");
    assert_eq!(calls[0].input, json!({"title": "disk full"}));
    let notice = tokio::time::timeout(WAIT, notices.next())
        .await?
        .ok_or_else(|| anyhow::anyhow!("no notice"))?;
    let notice: flotilla_model::notify::Notification = serde_json::from_slice(&notice.payload)?;
    assert_eq!(notice.kind, flotilla_model::notify::NoticeKind::ClientTool);
    assert_eq!(
        notice.approval.map(|a| a.request.approval_id),
        Some("t0a1c1".to_owned())
    );
    let out = p.cli(&[
        "runs",
        "answer",
        &run.to_string(),
        &calls[0].token,
        "--text",
        r#"{"ticket": 42}"#,
        "--by",
        "tracker",
    ])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let o = p.client.wait(run, WAIT).await?;
    assert_eq!(
        o.final_result.as_ref().map(|f| f.response.as_str()),
        Some("opened ticket 42"),
        "{o:?}"
    );
    let results = tool_results(&model, 2);
    assert_eq!(
        results.last().map(String::as_str),
        Some(r#"{"ticket": 42}"#),
        "{results:?}"
    );
    assert!(sent(dir.path()).is_empty());

    // The agent's own client tool; nobody answers within the plan's deadline.
    model.push_all([
        Reply::tool_call("pick_colour", json!({"palette": "warm"})),
        Reply::text("no colour"),
    ]);
    let mut colour = mail("pick a colour");
    colour.config.hitl = Some(PlanHitl {
        approval_timeout: Some(Secs::from_secs(2)),
        ..Default::default()
    });
    let run = p.client.submit(SubmitRequest::new(colour)).await?;
    let asked = approval(&p, run, "t0a1c1").await?;
    assert_eq!(asked.request.trigger, Trigger::ClientTool);
    let o = p.client.wait(run, WAIT).await?;
    assert_eq!(
        o.final_result.as_ref().map(|f| f.response.as_str()),
        Some("no colour"),
        "{o:?}"
    );
    let results = tool_results(&model, 4);
    assert!(
        results.iter().any(|t| t.contains("nobody answered")),
        "{results:?}"
    );

    // Malformed client tools: every problem named, nothing started.
    let mut bad = mail("never runs");
    bad.config.client_tools = vec![
        flotilla_model::plan::ClientTool {
            name: "ask_user".into(),
            ..ticket.clone()
        },
        flotilla_model::plan::ClientTool {
            name: "bad name".into(),
            ..ticket.clone()
        },
        flotilla_model::plan::ClientTool {
            parameters: json!({"type": "string"}),
            description: String::new(),
            ..ticket.clone()
        },
        flotilla_model::plan::ClientTool {
            name: "broken_schema".into(),
            parameters: json!({"type": "object", "properties": {"a": {"type": "nonsense"}}}),
            ..ticket.clone()
        },
    ];
    let reply = p.client.validate(&bad).await?;
    let paths: Vec<&str> = reply.errors.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(
        paths,
        vec![
            "config.client_tools[0].name",
            "config.client_tools[1].name",
            "config.client_tools[2].description",
            "config.client_tools[2].parameters",
            "config.client_tools[3].parameters",
        ],
        "{:?}",
        reply.errors
    );
    assert!(
        reply.errors[0].message.contains("built-in tool"),
        "{:?}",
        reply.errors
    );
    let requests = model.requests().len();
    let rejected = p.client.submit(SubmitRequest::new(bad)).await?;
    let o = p.client.wait(rejected, WAIT).await?;
    assert_eq!(o.status, RunStatus::Rejected, "{o:?}");
    assert_eq!(model.requests().len(), requests, "no model call was made");
    Ok(())
}

/// `approve --always`: the tool is approved for the rest of the session — its next call in
/// another run of the session runs without asking — until `approvals revoke`, after which it
/// waits again. The grant lives in session state under a key only Flotilla writes: a client's
/// `state.set` of it is refused. `always` with another decision, or on a question, is refused
/// and changes nothing.
#[tokio::test]
async fn a_tool_approved_always_runs_without_asking_in_its_session_until_revoked()
-> anyhow::Result<()> {
    use flotilla_model::api::StateSetRequest;
    use flotilla_model::approval::{GrantList, GrantListRequest};
    use flotilla_model::ids::SessionId;
    let model = OpenAiServer::start().await?;
    let dir = tempfile::tempdir()?;
    let mut p = Processes::start(&config(&model.base_url(), dir.path())).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let session = SessionId::new();
    let in_session = |description: &str| {
        let mut r = SubmitRequest::new(mail(description));
        r.session_id = Some(session);
        r
    };
    let email = |to: &str| Reply::tool_call("send_email", json!({"to": to}));

    // Run 1 asks; `always` with a rejection is refused, then approve --always.
    model.push_all([email("ana@example.com"), Reply::text("mailed ana")]);
    let first = p.client.submit(in_session("mail ana")).await?;
    approval(&p, first, "t0a1c1").await?;
    let refused = p
        .client
        .call(
            &ApprovalAnswerRequest {
                always: true,
                incident: false,
                ..answer(
                    first,
                    "t0a1c1",
                    Decision::Reject {
                        message: String::new(),
                    },
                )
            },
            ASK,
        )
        .await?;
    let e = refused.expect_err("always goes with approve only");
    assert_eq!(e.code, "invalid_answer", "{e:?}");
    let out = p.cli(&[
        "approvals",
        "approve",
        &first.to_string(),
        "t0a1c1",
        "--always",
        "--by",
        "carol",
        "--comment",
        "fine for this session",
    ])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("approved for the session"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let o = p.client.wait(first, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    let grants: GrantList = p
        .client
        .request(
            &GrantListRequest {
                protocol: PROTOCOL_VERSION,
                run_id: None,
                session_id: Some(session),
            },
            ASK,
        )
        .await?;
    assert_eq!(grants.grants.len(), 1, "{grants:?}");
    assert_eq!(grants.grants[0].tool, "send_email");
    assert_eq!(grants.grants[0].by, "carol");
    assert_eq!(grants.grants[0].run_id, first);

    // Run 2 of the session: the call runs without a wait.
    model.push_all([email("bo@example.com"), Reply::text("mailed bo")]);
    let second = p.client.submit(in_session("mail bo")).await?;
    let o = p.client.wait(second, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    let l = approvals_of(&p.client, second, true).await?;
    assert!(l.is_empty(), "{l:?}");
    assert_eq!(sent(dir.path()).len(), 2);

    // Nobody else writes a grant: a client's state.set of the key is refused.
    let forged = p
        .client
        .call(
            &StateSetRequest {
                protocol: PROTOCOL_VERSION,
                run_id: None,
                session_id: Some(SessionId::new()),
                key: "_always_send_email".into(),
                value: json!({"tool": "send_email"}),
                expected_revision: None,
            },
            ASK,
        )
        .await?;
    let e = forged.expect_err("reserved keys are Flotilla's");
    assert_eq!(e.code, "invalid_key", "{e:?}");
    // Nor through a task's output key.
    let mut sneaky = mail("write a grant");
    sneaky.subtasks[0].output_key = Some("_grant".into());
    let reply = p.client.validate(&sneaky).await?;
    assert_eq!(
        reply.errors.first().map(|e| e.path.as_str()),
        Some("subtasks[0].output_key"),
        "{:?}",
        reply.errors
    );

    // Revoked: the next call waits again; revoking twice is refused.
    let out = p.cli(&[
        "approvals",
        "revoke",
        "send_email",
        "--session",
        &session.to_string(),
        "--by",
        "carol",
    ])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = p.cli(&[
        "approvals",
        "revoke",
        "send_email",
        "--run",
        &first.to_string(),
        "--by",
        "carol",
    ])?;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not_found"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    model.push_all([
        email("cy@example.com"),
        Reply::tool_call("ask_user", json!({"question": "Really?"})),
        Reply::text("asked"),
    ]);
    let third = p.client.submit(in_session("mail cy")).await?;
    let asked = approval(&p, third, "t0a1c1").await?;
    assert_eq!(asked.request.trigger, Trigger::SensitiveAction);
    assert_eq!(sent(dir.path()).len(), 2, "the revoked tool waits again");
    p.client
        .request(&answer(third, "t0a1c1", Decision::Approve), ASK)
        .await?;
    // `always` on a question is refused; nothing is granted.
    let asked = approval(&p, third, "t0a1c2").await?;
    assert_eq!(asked.request.trigger, Trigger::Question);
    let refused = p
        .client
        .call(
            &ApprovalAnswerRequest {
                always: true,
                incident: false,
                ..answer(third, "t0a1c2", Decision::Approve)
            },
            ASK,
        )
        .await?;
    let e = refused.expect_err("a question is answered call by call");
    assert_eq!(e.code, "always_not_applicable", "{e:?}");
    assert_eq!(
        approval(&p, third, "t0a1c2").await?.status,
        ApprovalStatus::Pending
    );
    p.client
        .request(&answer(third, "t0a1c2", Decision::Approve), ASK)
        .await?;
    let o = p.client.wait(third, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    let out = p.cli(&["approvals", "grants", "--session", &session.to_string()])?;
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("no tools approved"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(())
}

/// Pause stops a running LLM attempt at its next step boundary: the tool it is running
/// finishes, then — before the next model call — the attempt suspends (`task_suspended`), its
/// slot is free for other work, and nothing runs while the run is paused. Resumed, the same
/// attempt continues from its journal on any worker: the model is not asked again for what it
/// already said and the tool does not run twice.
#[tokio::test]
async fn a_paused_run_stops_its_llm_attempt_at_the_next_step_and_resume_continues_it()
-> anyhow::Result<()> {
    let model = OpenAiServer::start().await?;
    let dir = tempfile::tempdir()?;
    let mut p = Processes::start(&config(&model.base_url(), dir.path())).await?;
    p.coordinator().await?;
    let w1 = p.worker(&["--concurrency", "1"]).await?;
    model.push_all([
        Reply::tool_call("slow_step", json!({})),
        Reply::text("all steps done"),
    ]);
    let run = p
        .client
        .submit(SubmitRequest::new(mail("take the slow step")))
        .await?;
    let started = dir.path().join("slow.started");
    let deadline = tokio::time::Instant::now() + WAIT;
    while !started.exists() {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the tool never started"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = p.cli(&["runs", "pause", &run.to_string(), "--by", "ops"])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Give the worker a moment to hear of the hold, then let the tool finish.
    tokio::time::sleep(Duration::from_millis(500)).await;
    std::fs::write(dir.path().join("slow.go"), "go")?;
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    let suspended = tokio::time::timeout(WAIT, async {
        while let Some(e) = events.next().await {
            let e: EventEnvelope = e?;
            if let Event::Workflow(w) = &e.event
                && w.phase == flotilla_model::event::WorkflowPhase::TaskSuspended
            {
                return Ok::<_, anyhow::Error>(e);
            }
        }
        anyhow::bail!("the event stream ended")
    })
    .await??;
    assert_eq!(suspended.attempt, Some(1));
    assert_eq!(task_status(&p, run, "mail").await?, TaskStatus::Waiting);
    assert_eq!(model.requests().len(), 1, "no model call after the pause");
    // The slot is free: the worker's only slot runs another run meanwhile.
    let other = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("ping", "ping").with_agent("echo"),
        ])))
        .await?;
    let o = p.client.wait(other, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    // Still paused: nothing of the run runs.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(task_status(&p, run, "mail").await?, TaskStatus::Waiting);
    assert_eq!(model.requests().len(), 1);
    // Resumed on another worker: the same attempt continues from its journal.
    p.kill(w1);
    p.worker(&["--concurrency", "1"]).await?;
    let out = p.cli(&["runs", "resume", &run.to_string(), "--by", "ops"])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let o = p.client.wait(run, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    assert_eq!(
        o.final_result.as_ref().map(|f| f.response.as_str()),
        Some("all steps done"),
        "{o:?}"
    );
    assert_eq!(
        model.requests().len(),
        2,
        "the first reply came from the journal"
    );
    assert!(
        tool_results(&model, 1)
            .iter()
            .any(|t| t.contains("step done")),
        "{:?}",
        tool_results(&model, 1)
    );
    let runs_of_tool = std::fs::read_to_string(&started)?;
    assert_eq!(runs_of_tool.lines().count(), 1, "the tool ran once");
    let view = p.client.run(run).await?.expect("exists");
    assert_eq!(view.tasks[0].attempts, 1, "{:?}", view.tasks[0]);
    let history = p.cli(&["runs", "history", &run.to_string()])?;
    let text = String::from_utf8_lossy(&history.stdout);
    assert!(text.contains("at a step boundary"), "{text}");
    Ok(())
}
