//! Forks inside an LLM agent's conversation (`runs fork --at TASK:STEP`) and with another
//! model (`--model`), across real coordinator and worker processes on a real nats-server.
//!
//! The model is the test kit's scripted OpenAI-compatible server — a test double whose
//! answers are scripted here, not a model — which records every request, so the test counts
//! exactly which model calls a fork made and what each carried.

mod support;

use flotilla_model::ErrorCode;
use flotilla_model::event::{Event, StepEntry};
use flotilla_model::fork::RunForkRequest;
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::plan::Subtask;
use flotilla_model::run::RunStatus;
use flotilla_model::subjects::Bucket;
use flotilla_model::subjects::StreamKind;
use flotilla_model::submit::SubmitRequest;
use flotilla_testkit::openai::{OpenAiServer, Reply};
use futures::StreamExt;
use serde_json::{Value, json};
use support::*;

fn agents(base_url: &str) -> String {
    format!(
        r#"
[agents.researcher]
kind = "llm"
base-url = "{base_url}"
model = "scripted-model"
tools = ["workspace_write"]

[agents.writer]
kind = "llm"
base-url = "{base_url}"
model = "scripted-model"

[agents.plain]
kind = "exec"
command = "echo"
args = ["plain answer"]
"#
    )
}

/// The `agent_step` events of `run`: (attempt id, step, whether it is a model reply).
async fn steps(p: &Processes, run: RunId) -> anyhow::Result<Vec<(String, u32, bool)>> {
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    let mut out = Vec::new();
    while let Ok(Some(e)) = tokio::time::timeout(SHORT, events.next()).await {
        if let Event::AgentStep {
            attempt_id,
            step,
            entry,
        } = e?.event
        {
            out.push((
                attempt_id.to_string(),
                step,
                matches!(entry, StepEntry::ModelReply { .. }),
            ));
        }
    }
    Ok(out)
}

const SHORT: std::time::Duration = std::time::Duration::from_secs(2);

// Multi-threaded: the scripted model server runs on the test's runtime while the test waits
// for a CLI process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_at_a_step_keeps_the_conversation_before_it_and_calls_another_model_after()
-> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    // The original: research writes a note (steps 0 and 1), reads on (steps 2 and 3) and
    // answers (step 4); the report answers from it.
    let research = "Your task (research)";
    llm.push(
        Reply::tool_call(
            "workspace_write",
            json!({"topic": "notes", "entry": {"first": 1}}),
        )
        .usage(100, 10)
        .when(research),
    );
    llm.push(
        Reply::tool_call(
            "workspace_write",
            json!({"topic": "notes", "entry": {"second": 2}}),
        )
        .usage(110, 10)
        .when(research),
    );
    llm.push(
        Reply::text("Revenue was 1250.")
            .usage(120, 10)
            .when(research),
    );
    llm.push(
        Reply::text("Report: revenue 1250.")
            .usage(200, 20)
            .when("Your task (report)"),
    );

    let mut p = Processes::start(&agents(&llm.base_url())).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let mut first = Subtask::new("research", "Find the revenue.").with_agent("researcher");
    first.produces = vec!["notes".into()];
    first.role = Some("research".into());
    let mut report = Subtask::new("report", "Write the report.")
        .with_agent("writer")
        .after(&["research"]);
    report.role = Some("report".into());
    let plain = Subtask::new("plain", "Say something.").with_agent("plain");
    let original = p
        .client
        .submit(SubmitRequest::new(plan(vec![first, report, plain])))
        .await?;
    let o = p.client.wait(original, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}\n{}", p.log(1));
    assert_eq!(llm.requests().len(), 4);
    let recorded = steps(&p, original).await?;
    let research_steps: Vec<u32> = recorded
        .iter()
        .filter(|(a, _, _)| recorded.iter().filter(|(b, _, _)| a == b).count() == 5)
        .map(|(_, s, _)| *s)
        .collect();
    assert_eq!(research_steps, [0, 1, 2, 3, 4], "{recorded:?}");

    // Fork inside research's conversation at step 2 with another model, through the CLI:
    // steps 0 and 1 (the first model reply and its tool round) are kept; the model is called
    // from step 2 on, with the other model; the report runs again; plain keeps its result.
    llm.push(
        Reply::text("Revenue was 1300, on a second look.")
            .usage(130, 12)
            .when(research),
    );
    llm.push(
        Reply::text("Report: revenue 1300.")
            .usage(210, 20)
            .when("Your task (report)"),
    );
    let out = p.cli(&[
        "runs",
        "fork",
        &original.to_string(),
        "--at",
        "research:2",
        "--model",
        "other-model",
        "--wait",
        "--json",
    ])?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}\n{}\n{:#?}",
        String::from_utf8_lossy(&out.stderr),
        p.log(1),
        llm.requests()
            .iter()
            .skip(4)
            .map(|r| (r.model().to_owned(), r.user()))
            .collect::<Vec<_>>()
    );
    let reply: Value = serde_json::from_str(&stdout)?;
    assert_eq!(reply["outcome"]["status"], "succeeded", "{reply}");
    let answer = reply["outcome"]["final_result"]["response"]
        .as_str()
        .unwrap_or_default();
    assert!(
        answer.contains("Report: revenue 1300.") && answer.contains("plain answer"),
        "{answer}"
    );
    assert_eq!(reply["reused"], json!(["plain"]), "{reply}");
    let fork: RunId = reply["run_id"].as_str().unwrap_or_default().parse()?;

    let requests = llm.requests();
    assert_eq!(
        requests.len(),
        6,
        "the fork made two model calls: research from step 2, and the report"
    );
    let resumed = &requests[4];
    assert_eq!(resumed.model(), "other-model", "the fork point's model");
    assert_eq!(
        requests[5].model(),
        "scripted-model",
        "a task downstream keeps its agent's model"
    );
    let tool_messages: Vec<&Value> = resumed
        .messages()
        .iter()
        .filter(|m| m["role"] == "tool")
        .collect();
    assert_eq!(
        tool_messages.len(),
        1,
        "the kept conversation carries the kept tool round: {:#?}",
        resumed.messages()
    );
    // The kept step's tool did not run again, yet the fork sees what it wrote: the entry of
    // step 0's write is copied into the fork's workspace once; the write the original made
    // after step 2 (the step the fork makes afresh) is not.
    let store = flotilla_coordinator::store::RunStore::open(&p.bus).await?;
    let (entries, _, _) = store
        .topic_entries(fork, "notes", 0, usize::MAX, 100)
        .await?;
    let count = |key: &str| entries.iter().filter(|e| e.entry.contains_key(key)).count();
    assert_eq!((count("first"), count("second")), (1, 0), "{entries:#?}");
    // The fork's own journal of research starts at the first step it made: the kept steps
    // are not journaled again (the report's attempt has its own step 0).
    let forked = steps(&p, fork).await?;
    let research_attempt = forked
        .iter()
        .find(|(_, s, _)| *s == 2)
        .map(|(a, _, _)| a.clone())
        .expect("research's step 2 is journaled");
    let research_steps: Vec<u32> = forked
        .iter()
        .filter(|(a, _, _)| *a == research_attempt)
        .map(|(_, s, _)| *s)
        .collect();
    assert_eq!(research_steps, [2], "{forked:?}");
    // Its events say which model it called.
    let view = p.client.run(fork).await?.expect("the fork");
    let research_view = view
        .tasks
        .iter()
        .find(|t| t.task_id.as_str() == "research")
        .expect("research");
    assert_eq!(research_view.attempts, 1);
    // Both replay from their journals without a model call: the original's research (three
    // replies, two tool rounds) and report; the fork's research with its kept steps read from
    // the original (two replies, one round) and report.
    for (run, replies, rounds) in [(original, 4, 2), (fork, 3, 1)] {
        let out = p.cli(&["runs", "replay", &run.to_string(), "--json"])?;
        let report: Value = serde_json::from_slice(&out.stdout)?;
        assert_eq!(out.status.code(), Some(0), "{report:#}");
        assert_eq!(
            (
                &report["conversations"],
                &report["model_replies"],
                &report["tool_rounds"]
            ),
            (&json!(2), &json!(replies), &json!(rounds)),
            "{report:#}"
        );
    }
    assert_eq!(llm.requests().len(), 6, "a replay calls no model");
    // A fork at a step is not forked at a step of the same task again: its earlier steps are
    // the original's. Refused, naming the run to fork instead.
    let mut again = RunForkRequest::new(fork, TaskId::new("research"));
    again.step = Some(2);
    let e = p.client.call(&again, WAIT).await?.expect_err("refused");
    assert_eq!(e.status, 400, "{e:?}");
    assert!(e.message.contains(&original.to_string()), "{}", e.message);
    eprintln!(
        "fork at research:2 with another model: 2 model calls instead of 4, 1 kept tool round not run again"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_at_a_step_is_refused_naming_what_is_wrong_and_changes_nothing() -> anyhow::Result<()>
{
    let llm = OpenAiServer::start().await?;
    llm.push(Reply::tool_call(
        "workspace_write",
        json!({"topic": "notes", "entry": {"first": 1}}),
    ));
    llm.push(Reply::text("Done."));
    let mut p = Processes::start(&agents(&llm.base_url())).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let mut research = Subtask::new("research", "Find.").with_agent("researcher");
    research.produces = vec!["notes".into()];
    let plain = Subtask::new("plain", "Say.").with_agent("plain");
    let original = p
        .client
        .submit(SubmitRequest::new(plan(vec![research, plain])))
        .await?;
    let o = p.client.wait(original, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    let calls = llm.requests().len();

    let refused = |at: &str, step: u32, model: Option<&str>| {
        let client = p.client.clone();
        let mut r = RunForkRequest::new(original, TaskId::new(at));
        r.step = Some(step);
        r.model = model.map(str::to_owned);
        async move {
            client
                .call(&r, WAIT)
                .await?
                .err()
                .ok_or_else(|| anyhow::anyhow!("a bad fork was accepted"))
        }
    };
    // A round of tool results is no place to go on from; a step the conversation never had;
    // a task that has no conversation (an exec agent journals none).
    for (task, step, says) in [
        ("research", 1, "round of tool results"),
        ("research", 7, "steps 0..=2"),
        ("plain", 0, "only LLM agents"),
    ] {
        let e = refused(task, step, None).await?;
        assert_eq!(
            (e.status, e.code.as_str()),
            (400, ErrorCode::InvalidRequest.as_str()),
            "{e:?}"
        );
        assert!(e.message.contains(says), "{}", e.message);
    }
    // A model that is no model name.
    let mut r = RunForkRequest::new(original, TaskId::new("research"));
    r.model = Some("two words".into());
    let reply = p.client.call(&r, WAIT).await?;
    let e = reply.expect_err("refused");
    assert_eq!(
        (e.status, e.code.as_str()),
        (400, ErrorCode::InvalidPlan.as_str()),
        "{e:?}"
    );
    assert_eq!(e.problems[0].code.as_str(), "invalid_model", "{e:?}");
    // The CLI says what is wrong with a fork point before asking anything.
    let out = p.cli(&["runs", "fork", &original.to_string(), "--at", ":3"])?;
    assert_eq!(out.status.code(), Some(2), "a usage error");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("names no task"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A journal that lost a step it would keep: refused, naming the step.
    let recorded = steps(&p, original).await?;
    let attempt = recorded
        .first()
        .map(|(a, _, _)| a.clone())
        .unwrap_or_default();
    let stream = p
        .bus
        .js()
        .get_stream(p.bus.names().stream(StreamKind::Events))
        .await?;
    let lost = {
        let consumer = stream
            .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
                filter_subject: p.bus.names().event(original),
                ..Default::default()
            })
            .await?;
        let mut messages = consumer.messages().await?;
        let mut lost = None;
        while let Ok(Some(m)) = tokio::time::timeout(SHORT, messages.next()).await {
            let m = m?;
            let seq = m
                .info()
                .map_err(|e| anyhow::anyhow!("{e}"))?
                .stream_sequence;
            let text = String::from_utf8_lossy(&m.payload);
            if text.contains("agent_step") && text.contains("\"step\":1") {
                lost = Some(seq);
                break;
            }
        }
        lost.ok_or_else(|| anyhow::anyhow!("step 1 of {attempt} not found"))?
    };
    stream.delete_message(lost).await?;
    // The replay of that run says where its journal fell short, and calls no model.
    let out = p.cli(&["runs", "replay", &original.to_string()])?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("task      research")
            && text.contains("step      1")
            && text.contains("missing from the journal"),
        "{text}"
    );
    let e = refused("research", 2, None).await?;
    assert_eq!(
        (e.status, e.code.as_str()),
        (409, ErrorCode::JournalIncomplete.as_str()),
        "{e:?}"
    );
    assert!(
        e.message.contains("has no step 1") && e.message.contains("holds steps 0, 2"),
        "{}",
        e.message
    );

    // A live worker of the pool that does not know a task's model (an older version, as its
    // registry entry shows: no `features`) would ignore it: refused, naming the worker.
    let workers = p.bus.kv(Bucket::Workers).await?;
    let old = json!({
        "id": "old-worker", "pool": "default", "host": "h", "pid": 1, "concurrency": 1,
        "in_flight": 0, "agents": ["researcher"], "started_at": "2026-01-01T00:00:00Z",
        "version": "0.2.0"
    });
    workers
        .put("old-worker", serde_json::to_vec(&old)?.into())
        .await?;
    // Until the coordinator's registry mirror has the entry, the request is refused for its
    // unknown agent (checked after the workers), so nothing runs meanwhile.
    let mut r = RunForkRequest::new(original, TaskId::new("research"));
    r.model = Some("other-model".into());
    r.agent = Some("ghost".into());
    let mut e = p.client.call(&r, WAIT).await?.expect_err("refused");
    for _ in 0..50 {
        if e.code != ErrorCode::InvalidPlan.as_str() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        e = p.client.call(&r, WAIT).await?.expect_err("refused");
    }
    assert_eq!(
        (e.status, e.code.as_str()),
        (409, ErrorCode::WorkersOutdated.as_str()),
        "{e:?}"
    );
    assert!(
        e.message.contains("old-worker (0.2.0)") && e.message.contains("task_model"),
        "{}",
        e.message
    );
    assert_eq!(
        llm.requests().len(),
        calls,
        "no refused fork called the model"
    );
    Ok(())
}

/// A fork sees what the kept tasks' agents left: their workspace entries, their mailbox
/// posts and the session state as it stood when the fork point was dispatched — copied into
/// the fork's own workspace, mailboxes and session; the original is not written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_sees_the_kept_tasks_workspace_mailbox_and_state_in_its_own_copy()
-> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    let research = "Your task (research)";
    llm.push(
        Reply::tool_calls([
            (
                "workspace_write",
                json!({"topic": "notes", "entry": {"found": 1250}}),
            ),
            (
                "mailbox_send",
                json!({"to": "report", "payload": {"hint": "use 1250"}}),
            ),
            (
                "state_set",
                json!({"key": "audience", "value": "the board"}),
            ),
        ])
        .when(research),
    );
    llm.push(Reply::text("Revenue was 1250.").when(research));
    llm.push(Reply::text("Report for the board.").when("Your task (report)"));
    let config = agents(&llm.base_url()).replace(
        "tools = [\"workspace_write\"]",
        "tools = [\"workspace_write\", \"mailbox_send\", \"state_set\"]",
    );
    let mut p = Processes::start(&config).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let mut first = Subtask::new("research", "Find the revenue.").with_agent("researcher");
    first.role = Some("research".into());
    first.produces = vec!["notes".into()];
    let mut report = Subtask::new("report", "Write the report.")
        .with_agent("writer")
        .after(&["research"]);
    report.role = Some("report".into());
    let original = p
        .client
        .submit(SubmitRequest::new(plan(vec![first, report])))
        .await?;
    let o = p.client.wait(original, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}\n{}", p.log(1));

    llm.push(Reply::text("Report for the board, again.").when("Your task (report)"));
    let mut r = RunForkRequest::new(original, TaskId::new("report"));
    r.wait = true;
    let reply = p.client.request(&r, WAIT).await?;
    let fork = reply.run_id.expect("the fork's id");
    assert_eq!(
        reply.outcome.as_ref().map(|o| o.status),
        Some(RunStatus::Succeeded),
        "{reply:?}"
    );
    let store = flotilla_coordinator::store::RunStore::open(&p.bus).await?;
    // The workspace: the agent's entry, copied once, and the kept result's produce.
    let (entries, _, _) = store
        .topic_entries(fork, "notes", 0, usize::MAX, 100)
        .await?;
    let found: Vec<&Value> = entries
        .iter()
        .filter_map(|e| e.entry.get("found"))
        .collect();
    assert_eq!(found, [&json!(1250)], "{entries:#?}");
    assert!(
        entries
            .iter()
            .any(|e| e.writer.as_ref().and_then(|w| w.by.as_deref()) == Some("coordinator")),
        "the kept result's produce: {entries:#?}"
    );
    // The mailbox: the report's request shows the kept post, in the fork's own tree.
    let posts = p
        .bus
        .js()
        .get_stream(p.bus.names().stream(StreamKind::Mailbox))
        .await?
        .get_last_raw_message_by_subject(&p.bus.names().mailbox(fork, "report", "research"))
        .await?;
    assert!(
        String::from_utf8_lossy(&posts.payload).contains("use 1250"),
        "{posts:?}"
    );
    // The session state: the fork's own session holds the value research set.
    assert_eq!(
        store.state_value(&fork.to_string(), "audience").await?,
        Some(json!("the board"))
    );
    // The original's workspace is unchanged: one agent entry.
    let (entries, _, _) = store
        .topic_entries(original, "notes", 0, usize::MAX, 100)
        .await?;
    assert_eq!(
        entries
            .iter()
            .filter(|e| e.entry.contains_key("found"))
            .count(),
        1
    );
    // A repeated fork with the same id copies nothing again.
    let mut again = RunForkRequest::new(original, TaskId::new("report"));
    again.fork_run_id = Some(fork);
    let reply = p.client.request(&again, WAIT).await?;
    assert_eq!(
        reply.status,
        flotilla_model::submit::SubmitStatus::Duplicate
    );
    let (entries, _, _) = store
        .topic_entries(fork, "notes", 0, usize::MAX, 100)
        .await?;
    assert_eq!(
        entries
            .iter()
            .filter(|e| e.entry.contains_key("found"))
            .count(),
        1
    );
    Ok(())
}
