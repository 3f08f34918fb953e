//! Child runs (agent-as-tool), end to end against a real nats-server: an agent starts a run of
//! another agent that is a child in the run tree, shares its root's workspace and session,
//! re-attaches instead of starting a second child, and is cancelled when the parent attempt
//! fails. The called agents are the deterministic `scripted` agent, standing in for models;
//! the caller is a small Rust agent of this test.

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use flotilla_context::{Agent, AgentContext, AgentError, AgentReply, ChildCall, Clients, Scope};
use flotilla_coordinator::store::RunStore;
use flotilla_coordinator::watch::WatchOptions;
use flotilla_model::event::Event;
use flotilla_model::ids::{AttemptId, RunId, TaskId};
use flotilla_model::plan::{DataflowValidation, Subtask};
use flotilla_model::run::{RunHandle, RunStatus};
use flotilla_model::submit::{SubmitRequest, SubmitStatus};
use flotilla_model::watch::{ChildPolicy, Profile, ProjectedEvent};
use flotilla_worker::{AgentRegistry, WorkerOptions};
use futures::StreamExt;
use futures::future::BoxFuture;
use serde_json::json;
use support::*;

/// Calls the agent named in its input (`{"agent", "produces"}`) as a child run and answers
/// with the child's final response.
#[derive(Debug)]
struct Caller;

impl Agent for Caller {
    fn run<'a>(
        &'a self,
        task: &'a flotilla_model::task::TaskEnvelope,
        ctx: AgentContext,
    ) -> BoxFuture<'a, Result<AgentReply, AgentError>> {
        Box::pin(async move {
            let call = ChildCall {
                agent: task.input["agent"].as_str().unwrap_or("echo").to_owned(),
                description: "look it up".into(),
                input: json!({"q": task.description}),
                produces: task.input["produces"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|v| v.as_str())
                            .map(str::to_owned)
                            .collect()
                    })
                    .unwrap_or_default(),
                ..ChildCall::default()
            };
            let (child, outcome) = ctx
                .call_agent(&call)
                .await
                .map_err(|e| AgentError::failed(e.to_string()))?;
            if outcome.status != RunStatus::Succeeded {
                return Err(AgentError::failed(format!(
                    "child {} ended {}",
                    child.handle.run_id,
                    outcome.status.as_str()
                )));
            }
            let answer = outcome.final_result.map(|r| r.response).unwrap_or_default();
            Ok(AgentReply::text(format!("child said: {answer}")))
        })
    }
}

/// Starts a slow child (`pause`), then a quick one (`echo`), and waits for both: the quick
/// child ends while the slow one still runs.
#[derive(Debug)]
struct SlowThenQuick;

impl Agent for SlowThenQuick {
    fn run<'a>(
        &'a self,
        _task: &'a flotilla_model::task::TaskEnvelope,
        ctx: AgentContext,
    ) -> BoxFuture<'a, Result<AgentReply, AgentError>> {
        Box::pin(async move {
            let failed = |e: flotilla_context::ContextError| AgentError::failed(e.to_string());
            let mut started = Vec::new();
            for agent in ["pause", "echo"] {
                let call = ChildCall {
                    agent: agent.into(),
                    call_id: Some(agent.into()),
                    ..ChildCall::default()
                };
                let child = ctx.clients().start_child(&call).await.map_err(failed)?;
                ctx.clients().announce_child(&child.handle, agent).await;
                started.push(child.handle.run_id);
            }
            let until = tokio::time::Instant::now() + WAIT;
            for child in started {
                ctx.clients()
                    .wait_child(child, until)
                    .await
                    .map_err(failed)?;
            }
            Ok(AgentReply::text("both done"))
        })
    }
}

/// Reports model usage (a deterministic stand-in for a model call: no model is called), then,
/// while `input.depth` > 0, calls itself one level deeper and answers with the child's answer.
#[derive(Debug)]
struct Nested;

impl Agent for Nested {
    fn run<'a>(
        &'a self,
        task: &'a flotilla_model::task::TaskEnvelope,
        ctx: AgentContext,
    ) -> BoxFuture<'a, Result<AgentReply, AgentError>> {
        Box::pin(async move {
            let depth = task.input["depth"].as_u64().unwrap_or(0);
            ctx.events
                .emit(Event::Usage {
                    prompt_tokens: 100 * (depth + 1),
                    completion_tokens: 10,
                    model: Some("stand-in".into()),
                    latency_ms: None,
                    cost_usd: Some(0.5),
                })
                .await;
            if depth == 0 {
                return Ok(AgentReply::text("leaf"));
            }
            let call = ChildCall {
                agent: "nested".into(),
                input: json!({ "depth": depth - 1 }),
                call_id: Some(format!("level{depth}")),
                ..ChildCall::default()
            };
            let (_, outcome) = ctx
                .call_agent(&call)
                .await
                .map_err(|e| AgentError::failed(e.to_string()))?;
            let answer = outcome.final_result.map(|r| r.response).unwrap_or_default();
            Ok(AgentReply::text(format!("{depth}/{answer}")))
        })
    }
}

async fn services() -> anyhow::Result<InProcess> {
    services_with(4).await
}

/// The services with one worker of `concurrency` slots running the agents of this file.
async fn services_with(concurrency: usize) -> anyhow::Result<InProcess> {
    let mut defs = BTreeMap::new();
    defs.insert("echo".to_string(), scripted("{task_id}: found it"));
    let mut pause = scripted("{task_id}: paused");
    if let flotilla_worker::AgentDefinition::Scripted(c) = &mut pause {
        c.delay = Duration::from_secs(3);
    }
    defs.insert("pause".to_string(), pause);
    defs.insert("slow_then_quick".to_string(), scripted("unused"));
    defs.insert("nested".to_string(), scripted("unused"));
    let mut slow = scripted("{task_id}: slow");
    if let flotilla_worker::AgentDefinition::Scripted(c) = &mut slow {
        c.delay = Duration::from_secs(30);
    }
    defs.insert("slow".to_string(), slow);
    // Named here for validation; the worker below runs the Rust agent.
    defs.insert("caller".to_string(), scripted("unused"));
    let mut f = InProcess::start(0, defs).await?;
    let mut registry = AgentRegistry::from_definitions(&f.agents, None, &root().join("config"))
        .map_err(anyhow::Error::msg)?;
    registry.insert("caller", Arc::new(Caller));
    registry.insert("slow_then_quick", Arc::new(SlowThenQuick));
    registry.insert("nested", Arc::new(Nested));
    let opts = WorkerOptions {
        started_event_delay: Duration::ZERO,
        concurrency,
        ..WorkerOptions::default()
    };
    f.add_worker_with_registry(opts, registry).await?;
    Ok(f)
}

/// The child runs a parent announced on its event stream, in order.
async fn children_of(f: &InProcess, run: RunId) -> anyhow::Result<Vec<RunHandle>> {
    let events = f.client.events(run).await?;
    futures::pin_mut!(events);
    let mut out = Vec::new();
    while let Ok(Some(e)) = tokio::time::timeout(Duration::from_millis(500), events.next()).await {
        if let Event::AgentRunStarted { child, .. } = e?.event {
            out.push(child);
        }
    }
    Ok(out)
}

#[tokio::test]
async fn an_agent_calls_another_as_a_child_run_sharing_the_roots_workspace() -> anyhow::Result<()> {
    let f = services().await?;
    let mut ask = Subtask::new("ask", "what was Q3 revenue").with_agent("caller");
    ask.input = json!({"agent": "echo", "produces": ["findings"]});
    let run = f.client.submit(SubmitRequest::new(plan(vec![ask]))).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let response = &outcome.final_result.as_ref().expect("result").response;
    assert_eq!(response, "child said: echo: found it");

    // The parent's stream announces the child; the child's record links back.
    let children = children_of(&f, run).await?;
    assert_eq!(children.len(), 1, "{children:?}");
    let child = &children[0];
    assert_eq!(child.parent_run_id, Some(run));
    assert_eq!(
        child.parent_task_id.as_ref().map(TaskId::as_str),
        Some("ask")
    );
    assert_eq!(child.root_run(), run);
    let view = f.client.run(child.run_id).await?.expect("child record");
    assert_eq!(view.record.handle.parent_run_id, Some(run));
    assert_eq!(view.record.handle.root_run(), run);
    assert_eq!(view.record.status, RunStatus::Succeeded);

    // The child's automatic produce went to the root's workspace.
    let store = RunStore::open(&f.bus).await?;
    let (entries, _, _) = store
        .topic_entries(run, "findings", 0, usize::MAX, 100)
        .await?;
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(entries[0].entry["summary"], "echo: found it");
    assert_eq!(
        entries[0].writer.as_ref().map(|w| w.run_id),
        Some(child.run_id)
    );
    f.stop().await;
    Ok(())
}

/// An attempt scope as a worker builds it, for driving the context directly.
fn attempt_scope(f: &InProcess, run: RunId, attempt: AttemptId, delivery: i64) -> Scope {
    let mut scope = Scope::operator(f.bus.names().clone(), run, run, run.to_string())
        .with_task(TaskId::new("ask"));
    scope.attempt = Some(1);
    scope.attempt_id = Some(attempt);
    scope.delivery = Some(delivery);
    scope.produces = Some(Vec::new());
    scope.dataflow = DataflowValidation::Strict;
    scope.by = None;
    scope
}

#[tokio::test]
async fn a_redelivered_attempt_reattaches_and_a_failed_one_cancels_its_children()
-> anyhow::Result<()> {
    let f = services().await?;
    // A parent run whose task waits, so the scope below belongs to a real run.
    let mut hold = Subtask::new("ask", "hold").with_agent("slow");
    hold.timeout = Some(Duration::from_secs(60).into());
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![hold])))
        .await?;
    let attempt = AttemptId::new();
    let call = ChildCall {
        agent: "echo".into(),
        ..ChildCall::default()
    };

    // Delivery 1 starts the child; delivery 2 (a fresh process after a crash) makes the same
    // first call and re-attaches to it.
    let first = Clients::new(f.bus.clone(), attempt_scope(&f, run, attempt, 1))?;
    let a = first.start_child(&call).await?;
    assert!(a.created);
    let second = Clients::new(f.bus.clone(), attempt_scope(&f, run, attempt, 2))?;
    let b = second.start_child(&call).await?;
    assert!(!b.created, "the redelivery re-attached");
    assert_eq!(a.handle.run_id, b.handle.run_id);
    let until = tokio::time::Instant::now() + WAIT;
    let outcome = second.wait_child(b.handle.run_id, until).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    // Waiting again (after the end) finds the outcome at once.
    let again = first.wait_child(a.handle.run_id, until).await?;
    assert_eq!(again.status, RunStatus::Succeeded);

    // A slow child, then the attempt fails: its children are cancelled.
    let slow = first
        .start_child(&ChildCall {
            agent: "slow".into(),
            ..ChildCall::default()
        })
        .await?;
    assert_ne!(slow.handle.run_id, a.handle.run_id);
    let cancelled = second.cancel_children("the parent attempt failed").await?;
    assert_eq!(cancelled, 2, "both children are known to every delivery");
    let outcome = first.wait_child(slow.handle.run_id, until).await?;
    assert_eq!(outcome.status, RunStatus::Cancelled, "{outcome:?}");
    f.client.cancel(run, Some("test over".into())).await.ok();
    f.stop().await;
    Ok(())
}

/// A coordinator restarting (no responder on `child.start` for a moment) does not fail the
/// call: the child's start is asked again until the request timeout, and goes through once a
/// coordinator serves the API.
#[tokio::test]
async fn a_child_start_waits_out_a_moment_without_a_coordinator() -> anyhow::Result<()> {
    let mut defs = BTreeMap::new();
    defs.insert("echo".to_string(), scripted("{task_id}: found it"));
    let mut f = InProcess::without_services(defs, Default::default()).await?;
    // The parent is stored on its run's submission subject (the client's fast path): it
    // exists before any coordinator does.
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("ask", "hold").with_agent("echo"),
        ])))
        .await?;

    let clients = Clients::new(f.bus.clone(), attempt_scope(&f, run, AttemptId::new(), 1))?;
    let call = ChildCall {
        agent: "echo".into(),
        ..ChildCall::default()
    };
    let started = tokio::spawn(async move { clients.start_child(&call).await });
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !started.is_finished(),
        "asked again while nothing serves child.start"
    );
    f.add_coordinator().await?;
    let child = tokio::time::timeout(WAIT, started).await???;
    assert!(child.created);
    assert!(
        f.client.exists(child.handle.run_id).await?,
        "the child's submission is stored"
    );
    f.stop().await;
    Ok(())
}

/// A child the coordinator rejects (here: its agent is not defined) never runs: waiting for
/// it is the error `child_rejected`, final, with the rejection's problems, and it is recorded
/// for the attempt, so every delivery and process of the attempt (an exec agent's command
/// deciding to give up) finds it.
#[tokio::test]
async fn a_rejected_child_is_an_error_carrying_its_problems() -> anyhow::Result<()> {
    let f = services().await?;
    let mut hold = Subtask::new("ask", "hold").with_agent("slow");
    hold.timeout = Some(Duration::from_secs(60).into());
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![hold])))
        .await?;
    let attempt = AttemptId::new();
    let first = Clients::new(f.bus.clone(), attempt_scope(&f, run, attempt, 1))?;
    assert_eq!(first.rejected_child().await?, None);
    let child = first
        .start_child(&ChildCall {
            agent: "ghost".into(),
            call_id: Some("c1".into()),
            ..ChildCall::default()
        })
        .await?;
    let until = tokio::time::Instant::now() + WAIT;
    let e = first
        .wait_child(child.handle.run_id, until)
        .await
        .expect_err("rejected");
    assert_eq!(e.kind(), flotilla_context::ErrorKind::ChildRejected, "{e}");
    assert_eq!(e.kind().retry(), flotilla_bus::Retry::Terminal);
    let codes: Vec<&str> = e.problems().iter().map(|p| p.code.as_str()).collect();
    assert_eq!(codes, vec!["unknown_agent"], "{e}");
    assert!(e.message().contains("[unknown_agent]"), "{e}");
    assert_eq!(
        e.rejected_child().map(|c| c.run_id),
        Some(child.handle.run_id)
    );
    // The child's record says so too.
    let view = f.client.run(child.handle.run_id).await?.expect("record");
    assert_eq!(view.record.status, RunStatus::Rejected);

    // Another delivery of the attempt sees the rejection; another attempt does not.
    let second = Clients::new(f.bus.clone(), attempt_scope(&f, run, attempt, 2))?;
    let recorded = second.rejected_child().await?.expect("recorded");
    assert_eq!(recorded.child, child.handle.run_id);
    assert_eq!(recorded.codes(), "unknown_agent");
    let other = Clients::new(f.bus.clone(), attempt_scope(&f, run, AttemptId::new(), 1))?;
    assert_eq!(other.rejected_child().await?, None);
    f.client.cancel(run, Some("test over".into())).await.ok();
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_parent_attempt_that_times_out_takes_its_child_with_it() -> anyhow::Result<()> {
    let f = services().await?;
    let mut ask = Subtask::new("ask", "wait for a slow helper").with_agent("caller");
    ask.input = json!({"agent": "slow"});
    ask.timeout = Some(Duration::from_secs(1).into());
    let mut p = plan(vec![ask]);
    p.config.max_retries = 0;
    let run = f.client.submit(SubmitRequest::new(p)).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed, "{outcome:?}");
    let children = children_of(&f, run).await?;
    assert_eq!(children.len(), 1, "{children:?}");
    let child = f.client.wait(children[0].run_id, WAIT).await?;
    assert_eq!(child.status, RunStatus::Cancelled, "{child:?}");
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_parent_link_naming_the_run_itself_is_refused() -> anyhow::Result<()> {
    let f = services().await?;
    let run = RunId::new();
    let mut request = SubmitRequest::new(plan(vec![Subtask::new("t", "x").with_agent("echo")]));
    request.run_id = Some(run);
    let mut parent = RunHandle::root(run);
    parent.parent_tool_call_id = Some("bad call id".into());
    request.parent = Some(parent);
    let reply = f.client.submit_request(&request, WAIT).await?;
    assert_eq!(reply.status, SubmitStatus::Rejected, "{reply:?}");
    let codes: Vec<(&str, &str)> = reply
        .errors
        .iter()
        .map(|p| (p.code.as_str(), p.path.as_str()))
        .collect();
    assert!(
        codes.contains(&("invalid_parent", "parent.run_id")),
        "{codes:?}"
    );
    assert!(
        codes.contains(&("invalid_parent", "parent.parent_tool_call_id")),
        "{codes:?}"
    );
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn cancelling_a_parent_run_cancels_the_child_it_waits_for() -> anyhow::Result<()> {
    let f = services().await?;
    let mut ask = Subtask::new("ask", "wait for a slow helper").with_agent("caller");
    ask.input = json!({"agent": "slow"});
    let run = f.client.submit(SubmitRequest::new(plan(vec![ask]))).await?;
    // Wait until the child exists, then cancel the parent run.
    let child = loop {
        let children = children_of(&f, run).await?;
        if let Some(c) = children.first() {
            break c.run_id;
        }
    };
    f.client.cancel(run, Some("operator stop".into())).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Cancelled, "{outcome:?}");
    let child = f.client.wait(child, WAIT).await?;
    assert_eq!(child.status, RunStatus::Cancelled, "{child:?}");
    f.stop().await;
    Ok(())
}

/// Runs `flotilla --nats-url URL ARGS…` and returns its stdout; fails unless it exits 0. The
/// services of these tests run in the test's runtime, so the command is awaited, not blocked
/// on.
async fn flotilla(url: &str, args: Vec<String>) -> anyhow::Result<String> {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["--nats-url", url])
        .args(&args)
        .output()
        .await?;
    anyhow::ensure!(
        out.status.success(),
        "flotilla {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// Collects a projection until it ends.
async fn collect(
    f: &InProcess,
    run: RunId,
    children: ChildPolicy,
) -> anyhow::Result<Vec<ProjectedEvent>> {
    collect_since(f, run, children, (0, None)).await
}

/// Collects a projection resumed after the event at `since` (`seq`, `index`) until it ends.
async fn collect_since(
    f: &InProcess,
    run: RunId,
    children: ChildPolicy,
    since: (u64, Option<u32>),
) -> anyhow::Result<Vec<ProjectedEvent>> {
    let opts = WatchOptions {
        profile: Profile::Debug,
        children,
        since: since.0,
        since_index: since.1,
    };
    projection(&f.client, run, opts).await
}

fn ends(e: &ProjectedEvent) -> bool {
    matches!(&e.event.event, Event::Workflow(w) if w.phase.ends_run())
}

/// Flatten interleaves children that run side by side, live: a watch that follows the tree
/// while it runs shows the quick child's end before the slow child's, although the slow one
/// was linked first — and gives exactly what a watch started after the end gives.
#[tokio::test]
async fn flatten_interleaves_concurrent_children_live_and_deterministically() -> anyhow::Result<()>
{
    let f = services().await?;
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("ask", "two helpers").with_agent("slow_then_quick"),
        ])))
        .await?;
    let live = collect(&f, run, ChildPolicy::Flatten).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let after = collect(&f, run, ChildPolicy::Flatten).await?;
    let key = |e: &ProjectedEvent| (e.run_id, e.depth, e.agent.clone(), e.event.id.clone());
    assert_eq!(
        live.iter().map(key).collect::<Vec<_>>(),
        after.iter().map(key).collect::<Vec<_>>(),
        "a live watch and a later one differ"
    );

    let position = |pred: &dyn Fn(&ProjectedEvent) -> bool| live.iter().position(pred);
    let link = |agent: &str| {
        position(&|e| {
            matches!(&e.event.event, Event::AgentRunStarted { agent: Some(a), .. } if a == agent)
        })
        .expect("a link")
    };
    let end_of = |agent: &str| {
        position(&|e| e.agent.as_deref() == Some(agent) && ends(e)).expect("a child's end")
    };
    assert!(
        link("pause") < link("echo"),
        "the slow child is linked first"
    );
    assert!(
        end_of("echo") < end_of("pause"),
        "the quick child's end is shown while the slow child runs"
    );
    for (i, e) in live.iter().enumerate() {
        if e.depth == 1 {
            let agent = e.agent.as_deref().expect("attributed");
            assert!(link(agent) < i, "an event of {agent} before its link");
            assert_eq!(e.event.run_id, e.run_id);
        }
    }
    assert!(ends(live.last().expect("events")), "the root's end is last");
    assert_eq!(live.last().map(|e| e.depth), Some(0));

    // Resuming after any event (its `seq` and `index`) gives exactly the events after it,
    // although under flatten a child's earlier events come after later ones of its parent.
    for at in [0, live.len() / 3, live.len() / 2, live.len() - 2] {
        let since = (live[at].seq, Some(live[at].index));
        let resumed = collect_since(&f, run, ChildPolicy::Flatten, since).await?;
        assert_eq!(
            resumed.iter().map(key).collect::<Vec<_>>(),
            live[at + 1..].iter().map(key).collect::<Vec<_>>(),
            "resumed after {since:?}"
        );
    }

    // `flotilla watch`: the same events as JSON lines, here and projected by a coordinator;
    // as text, a line per event, children indented and named with their run.
    let url = f.server.url();
    let run_text = run.to_string();
    let watch = |extra: &'static [&'static str]| {
        let args = [
            "watch",
            run_text.as_str(),
            "--profile",
            "debug",
            "--children",
            "flatten",
        ]
        .into_iter()
        .chain(extra.iter().copied())
        .map(str::to_owned)
        .collect::<Vec<_>>();
        flotilla(&url, args)
    };
    for extra in [&["--json"][..], &["--json", "--server"]] {
        let printed = watch(extra)
            .await?
            .lines()
            .map(serde_json::from_str::<ProjectedEvent>)
            .collect::<Result<Vec<_>, _>>()?;
        assert_eq!(
            printed.iter().map(key).collect::<Vec<_>>(),
            live.iter().map(key).collect::<Vec<_>>(),
            "flotilla watch {extra:?}"
        );
    }
    // Resumed by a coordinator too.
    let at = live.len() / 2;
    let args = vec![
        "watch".to_owned(),
        run_text.clone(),
        "--profile".into(),
        "debug".into(),
        "--children".into(),
        "flatten".into(),
        "--json".into(),
        "--server".into(),
        "--since".into(),
        live[at].seq.to_string(),
        "--since-index".into(),
        live[at].index.to_string(),
    ];
    let resumed = flotilla(&url, args)
        .await?
        .lines()
        .map(serde_json::from_str::<ProjectedEvent>)
        .collect::<Result<Vec<_>, _>>()?;
    assert_eq!(
        resumed.iter().map(key).collect::<Vec<_>>(),
        live[at + 1..].iter().map(key).collect::<Vec<_>>(),
        "resumed by a coordinator"
    );
    let text = watch(&[]).await?;
    let child_line = |agent: &str| {
        text.lines()
            .any(|l| l.starts_with(&format!("  [{agent}·")) && l.contains("run_succeeded"))
    };
    assert!(child_line("pause") && child_line("echo"), "{text}");
    assert!(text.lines().any(|l| l.contains("⇢ child run")), "{text}");

    // Linked: the two links, no child event.
    let linked = collect(&f, run, ChildPolicy::Linked).await?;
    assert!(linked.iter().all(|e| e.depth == 0));
    assert_eq!(
        linked
            .iter()
            .filter(|e| matches!(e.event.event, Event::AgentRunStarted { .. }))
            .count(),
        2
    );
    f.stop().await;
    Ok(())
}

/// Asks the API and returns the reply body and the error code (if it is an error).
async fn api(
    f: &InProcess,
    endpoint: &str,
    body: serde_json::Value,
) -> anyhow::Result<(serde_json::Value, Option<String>)> {
    let reply = f
        .bus
        .client()
        .request(
            f.bus.names().api(endpoint),
            serde_json::to_vec(&body)?.into(),
        )
        .await?;
    let value: serde_json::Value = serde_json::from_slice(&reply.payload)?;
    let failed = reply
        .headers
        .as_ref()
        .is_some_and(|h| h.get("Nats-Service-Error-Code").is_some());
    let code = failed.then(|| value["code"].as_str().unwrap_or_default().to_owned());
    Ok((value, code))
}

/// `runs tree` and `sessions show`, from the client library, the API and the CLI: a three-level
/// agent-as-tool tree with its usage per run and per subtree, the session's runs, and bad
/// requests answered by name.
#[tokio::test]
async fn a_tree_shows_usage_per_run_and_a_session_lists_its_runs() -> anyhow::Result<()> {
    let f = services().await?;
    let session = flotilla_model::SessionId::new();
    let mut top = Subtask::new("ask", "go deep").with_agent("nested");
    top.input = json!({ "depth": 2 });
    let mut request = SubmitRequest::new(plan(vec![top]));
    request.session_id = Some(session);
    let run = f.client.submit(request).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    assert_eq!(outcome.final_result.expect("result").response, "2/1/leaf");

    let tree = f.client.tree(run, 1000).await?.expect("the tree");
    assert_eq!((tree.runs, tree.omitted), (3, 0));
    let root = &tree.root;
    let child = &root.children[0];
    let grandchild = &child.children[0];
    assert_eq!(root.children.len(), 1);
    assert_eq!(child.children.len(), 1);
    assert!(grandchild.children.is_empty());
    for node in [root, child, grandchild] {
        assert_eq!(node.status, RunStatus::Succeeded);
        assert_eq!(node.agent.as_deref(), Some("nested"));
        assert_eq!(node.usage.calls, 1);
        assert_eq!(node.usage.completion_tokens, 10);
        assert!((node.usage.cost_usd - 0.5).abs() < 1e-9);
        assert!(node.finished_at.is_some());
    }
    assert_eq!(root.usage.prompt_tokens, 300);
    assert_eq!(child.usage.prompt_tokens, 200);
    assert_eq!(grandchild.usage.prompt_tokens, 100);
    assert_eq!(root.subtree_usage.tokens(), 300 + 200 + 100 + 30);
    assert_eq!(child.subtree_usage.tokens(), 200 + 100 + 20);
    assert!((root.subtree_usage.cost_usd - 1.5).abs() < 1e-9);
    assert_eq!(
        child.parent_task_id.as_ref().map(TaskId::as_str),
        Some("ask")
    );
    assert_eq!(child.parent_tool_call_id.as_deref(), Some("level2"));
    assert_eq!(grandchild.parent_tool_call_id.as_deref(), Some("level1"));
    assert!(root.duration_ms >= child.duration_ms, "{root:?}");

    // The API answers the same tree; a cap leaves the deepest run out and says so.
    let (value, code) = api(&f, "run.tree", json!({ "run_id": run })).await?;
    assert_eq!(code, None, "{value}");
    let from_api: flotilla_model::tree::RunTree = serde_json::from_value(value)?;
    assert_eq!(from_api, tree);
    let (value, _) = api(&f, "run.tree", json!({ "run_id": run, "max_runs": 2 })).await?;
    assert_eq!(
        (value["runs"].as_u64(), value["omitted"].as_u64()),
        (Some(2), Some(1))
    );

    // The session holds the root and its two descendants, oldest first.
    let view = f.client.session(session).await?;
    let runs: Vec<RunId> = view.runs.iter().map(|r| r.handle.run_id).collect();
    assert_eq!(runs, vec![run, child.run_id, grandchild.run_id]);
    let (value, code) = api(&f, "session.get", json!({ "session_id": session })).await?;
    assert_eq!(code, None, "{value}");
    assert_eq!(
        serde_json::from_value::<flotilla_model::tree::SessionView>(value)?,
        view
    );
    let (value, code) = api(
        &f,
        "session.get",
        json!({ "session_id": flotilla_model::SessionId::new() }),
    )
    .await?;
    assert_eq!(
        (code, value["runs"].as_array().map(Vec::len)),
        (None, Some(0))
    );

    // Bad requests are refused by name.
    for (endpoint, body, expected) in [
        ("run.tree", json!({ "run_id": RunId::new() }), "not_found"),
        (
            "run.tree",
            json!({ "run_id": run, "max_runs": 0 }),
            "invalid_max_runs",
        ),
        (
            "run.tree",
            json!({ "run_id": run, "max_runs": 5000 }),
            "invalid_max_runs",
        ),
        ("run.tree", json!({ "run_id": "not-a-run" }), "malformed"),
        (
            "run.tree",
            json!({ "run_id": run, "depth": 1 }),
            "malformed",
        ),
        ("session.get", json!({ "session_id": "x" }), "malformed"),
    ] {
        let (value, code) = api(&f, endpoint, body).await?;
        assert_eq!(code.as_deref(), Some(expected), "{endpoint}: {value}");
    }

    // The CLI prints the same: a line per run with its agent and tokens, the session's runs.
    let url = f.server.url();
    let cli = |args: &[&str]| flotilla(&url, args.iter().map(|a| (*a).to_owned()).collect());
    let text = cli(&["runs", "tree", &run.to_string()]).await?;
    assert_eq!(
        text.lines().filter(|l| l.contains(" nested ")).count(),
        3,
        "{text}"
    );
    assert!(
        text.contains("3 runs, 630 tokens in 3 model calls, $1.5000"),
        "{text}"
    );
    let text = cli(&["runs", "tree", &run.to_string(), "--json"]).await?;
    let printed: flotilla_model::tree::RunTree = serde_json::from_str(&text)?;
    assert_eq!(
        printed.root.children[0].children[0].run_id,
        grandchild.run_id
    );
    let text = cli(&["sessions", "show", &session.to_string()]).await?;
    for r in &runs {
        assert!(text.contains(&r.to_string()), "{text}");
    }
    f.stop().await;
    Ok(())
}

/// A run submitted without a session is its tree's session: its children carry its id. Asked
/// for that session, `session.get` lists the run itself first, then its descendants — from
/// the client library and the API alike; a descendant's id is no session of its own.
#[tokio::test]
async fn the_session_of_a_run_without_one_lists_the_run_and_its_descendants() -> anyhow::Result<()>
{
    let f = services().await?;
    let mut top = Subtask::new("ask", "go deep").with_agent("nested");
    top.input = json!({ "depth": 2 });
    let run = f.client.submit(SubmitRequest::new(plan(vec![top]))).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let tree = f.client.tree(run, 1000).await?.expect("the tree");
    let child = &tree.root.children[0];
    let expected = vec![run, child.run_id, child.children[0].run_id];

    let session = flotilla_model::SessionId::from_uuid(*run.as_uuid());
    let view = f.client.session(session).await?;
    let runs: Vec<RunId> = view.runs.iter().map(|r| r.handle.run_id).collect();
    assert_eq!(runs, expected, "the root first, then its descendants");
    let (value, code) = api(&f, "session.get", json!({ "session_id": run })).await?;
    assert_eq!(code, None, "{value}");
    assert_eq!(
        serde_json::from_value::<flotilla_model::tree::SessionView>(value)?,
        view
    );
    let other = flotilla_model::SessionId::from_uuid(*child.run_id.as_uuid());
    assert!(f.client.session(other).await?.runs.is_empty());
    f.stop().await;
    Ok(())
}

/// A parent waiting for its child gives its worker slot back: on a worker with one slot (and
/// the default prefetch of one, so the child is pulled by the same worker), a chain of three
/// agent-as-tool calls completes instead of the child waiting forever behind its parent.
#[tokio::test]
async fn waiting_parents_give_their_slot_to_their_children() -> anyhow::Result<()> {
    let f = services_with(1).await?;
    let mut top = Subtask::new("ask", "go deep").with_agent("nested");
    top.input = json!({ "depth": 3 });
    let run = f.client.submit(SubmitRequest::new(plan(vec![top]))).await?;
    let outcome = f
        .client
        .wait(run, Duration::from_secs(30))
        .await
        .map_err(|e| anyhow::anyhow!("the chain did not finish on one slot: {e}"))?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    assert_eq!(outcome.final_result.expect("result").response, "3/2/1/leaf");
    let tree = f.client.tree(run, 1000).await?.expect("the tree");
    assert_eq!(tree.runs, 4);
    f.stop().await;
    Ok(())
}

/// Waiting for a run's end creates no consumer on the server: nats-server allows 1,000 per
/// stream by default, and every waiting parent and client used to hold one for 30 s. More
/// waits than that in a row all succeed, and the events stream is left without consumers.
#[tokio::test]
async fn waits_for_a_run_hold_no_consumer() -> anyhow::Result<()> {
    let f = services().await?;
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("t", "x").with_agent("echo"),
        ])))
        .await?;
    for _ in 0..1100 {
        let outcome = f.client.wait(run, WAIT).await?;
        assert_eq!(outcome.status, RunStatus::Succeeded);
    }
    let mut stream = f
        .bus
        .js()
        .get_stream(
            f.bus
                .names()
                .stream(flotilla_model::subjects::StreamKind::Events),
        )
        .await?;
    assert_eq!(stream.info().await?.state.consumer_count, 0);
    f.stop().await;
    Ok(())
}

/// A child started through `child.start` by any client (not a worker's agent) is linked from
/// its parent by the coordinator — it is in the parent's tree, events and session — and
/// shares the parent's session.
#[tokio::test]
async fn a_child_started_through_the_api_is_linked_and_shares_the_session() -> anyhow::Result<()> {
    let f = services().await?;
    let session = flotilla_model::SessionId::new();
    let mut request = SubmitRequest::new(plan(vec![Subtask::new("wait", "").with_agent("slow")]));
    request.session_id = Some(session);
    let parent = f.client.submit(request).await?;
    task_started(&f.client, parent, "wait").await?;
    let child = RunId::new();
    let (reply, code) = api(
        &f,
        "child.start",
        json!({
            "submission": {
                "run_id": child,
                "parent": {"run_id": parent, "parent_task_id": "wait", "parent_tool_call_id": "c1"},
                "plan": {"subtasks": [{"id": "look", "agent": "echo"}]},
            }
        }),
    )
    .await?;
    assert_eq!(code, None, "{reply}");
    assert_eq!(reply["created"], true);
    assert_eq!(
        f.client.wait(child, WAIT).await?.status,
        RunStatus::Succeeded
    );
    let record = f
        .client
        .run(child)
        .await?
        .expect("the child's record")
        .record;
    assert_eq!(
        record.session_id,
        Some(session),
        "the child shares the session"
    );
    let linked = children_of(&f, parent).await?;
    assert_eq!(
        linked.iter().map(|h| h.run_id).collect::<Vec<_>>(),
        vec![child],
        "the parent links the child"
    );
    let tree = f.client.tree(parent, 10).await?.expect("a tree");
    assert_eq!(tree.runs, 2, "{tree:?}");
    let runs: Vec<RunId> = f
        .client
        .session(session)
        .await?
        .runs
        .iter()
        .map(|r| r.handle.run_id)
        .collect();
    assert!(runs.contains(&child), "{runs:?}");
    // Started again (a retry of the same call): re-attached, and still one link.
    let (reply, _) = api(
        &f,
        "child.start",
        json!({
            "submission": {
                "run_id": child,
                "parent": {"run_id": parent, "parent_task_id": "wait", "parent_tool_call_id": "c1"},
                "plan": {"subtasks": [{"id": "look", "agent": "echo"}]},
            }
        }),
    )
    .await?;
    assert_eq!(reply["created"], false);
    assert_eq!(children_of(&f, parent).await?.len(), 1);
    f.client.cancel(parent, None).await?;
    f.stop().await;
    Ok(())
}

/// Submits `plan` on the fast path as a child of `parent` (in the tree of `root`) and waits
/// for its record.
async fn child_run(
    f: &InProcess,
    parent: RunId,
    root: RunId,
    tasks: Vec<Subtask>,
    budget: Option<u64>,
) -> anyhow::Result<(RunId, flotilla_model::run::RunRecord)> {
    let child = RunId::new();
    let mut p = plan(tasks);
    p.config.max_tokens = budget;
    let mut request = SubmitRequest::new(p);
    request.run_id = Some(child);
    request.parent = Some(RunHandle {
        run_id: parent,
        agent_id: None,
        parent_run_id: None,
        parent_tool_call_id: Some("call".into()),
        parent_task_id: Some(TaskId::new("t")),
        root_run_id: Some(root),
    });
    f.client.submit(request).await?;
    let record = tokio::time::timeout(WAIT, async {
        loop {
            if let Some(v) = f.client.run(child).await?
                && v.record.status != RunStatus::Pending
            {
                return Ok::<_, anyhow::Error>(v.record);
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    })
    .await??;
    Ok((child, record))
}

/// A run tree is bounded: a child deeper than `max-depth` or past `max-runs-per-tree` is
/// refused (`tree_too_deep`, `tree_too_large`), a parent that names no run is refused
/// (`invalid_parent`), and every task of a tree carries the tree's budgets, root first (a
/// child may narrow them, never escape them).
#[tokio::test]
async fn trees_are_bounded_and_their_budgets_bind_every_run() -> anyhow::Result<()> {
    let mut defs = BTreeMap::new();
    defs.insert("echo".to_string(), scripted("{task_id}: found it"));
    let opts = flotilla_coordinator::CoordinatorOptions {
        max_depth: 2,
        max_runs_per_tree: 4,
        ..Default::default()
    };
    // No worker: every task stays queued, so its envelope can be read.
    let f = InProcess::start_configured(0, defs, WorkerOptions::default(), opts).await?;
    let queued = |run: RunId| {
        let bus = f.bus.clone();
        async move {
            let stream = bus
                .js()
                .get_stream(
                    bus.names()
                        .stream(flotilla_model::subjects::StreamKind::Tasks),
                )
                .await?;
            let msg = stream
                .direct_get_last_for_subject(bus.names().task("default", run, &TaskId::new("t")))
                .await?;
            Ok::<_, anyhow::Error>(flotilla_bus::wire::decode::<
                flotilla_model::task::TaskEnvelope,
            >(Some(&msg.headers), &msg.payload)?)
        }
    };
    let t = || vec![Subtask::new("t", "")];
    let root = RunId::new();
    let mut request = SubmitRequest::new({
        let mut p = plan(t());
        p.config.max_tokens = Some(1000);
        p
    });
    request.run_id = Some(root);
    f.client.submit(request).await?;

    // Depth: root (0) → c1 (1) → c2 (2) → c3 refused.
    let (c1, r1) = child_run(&f, root, root, t(), Some(500)).await?;
    assert_eq!(r1.status, RunStatus::Running, "{r1:?}");
    let (c2, r2) = child_run(&f, c1, root, t(), None).await?;
    assert_eq!(r2.status, RunStatus::Running, "{r2:?}");
    let (_, r3) = child_run(&f, c2, root, t(), None).await?;
    assert_eq!(r3.status, RunStatus::Rejected);
    assert_eq!(r3.errors[0].code.as_str(), "tree_too_deep", "{r3:?}");

    // Budgets, root first: the root's own, a child's narrower one, and a grandchild under both.
    let scopes = |e: &flotilla_model::task::TaskEnvelope| -> Vec<(RunId, Option<u64>)> {
        e.budget_scopes
            .iter()
            .map(|s| (s.run_id, s.limits.max_tokens))
            .collect()
    };
    assert_eq!(scopes(&queued(root).await?), vec![(root, Some(1000))]);
    assert_eq!(
        scopes(&queued(c1).await?),
        vec![(root, Some(1000)), (c1, Some(500))]
    );
    assert_eq!(
        scopes(&queued(c2).await?),
        vec![(root, Some(1000)), (c1, Some(500))]
    );

    // Size: the root, c1, c2, one more child; the next is refused.
    let (_, r4) = child_run(&f, root, root, t(), None).await?;
    assert_eq!(r4.status, RunStatus::Running, "{r4:?}");
    let (_, r5) = child_run(&f, root, root, t(), None).await?;
    assert_eq!(r5.status, RunStatus::Rejected);
    assert_eq!(r5.errors[0].code.as_str(), "tree_too_large", "{r5:?}");

    // A parent that names no run.
    let nobody = RunId::new();
    let (_, r6) = child_run(&f, nobody, nobody, t(), None).await?;
    assert_eq!(r6.status, RunStatus::Rejected);
    assert_eq!(r6.errors[0].code.as_str(), "invalid_parent", "{r6:?}");
    f.stop().await;
    Ok(())
}

/// One event of a hand-written event message.
fn synthetic(
    run: RunId,
    id: &str,
    source: &str,
    task: Option<&str>,
    event: Event,
) -> flotilla_model::event::EventEnvelope {
    flotilla_model::event::EventEnvelope {
        protocol: 1,
        id: format!("{run}.{id}"),
        run_id: run,
        task_id: task.map(TaskId::new),
        attempt: task.map(|_| 1),
        ts: flotilla_model::time::Timestamp::now(),
        source: source.into(),
        event,
    }
}

fn phase(p: flotilla_model::event::WorkflowPhase) -> Event {
    Event::Workflow(flotilla_model::event::WorkflowEvent::phase(p))
}

fn phase_of(e: &ProjectedEvent) -> Option<flotilla_model::event::WorkflowPhase> {
    match &e.event.event {
        Event::Workflow(w) => Some(w.phase),
        _ => None,
    }
}

/// Lazy start recording stores a run's `run_started` after its workers' first events (and
/// after its children's), and one message carries every event of a step. Written here in
/// that order by hand — no coordinator runs, so the order is exactly this — a projection
/// shows each run's `run_started` before its other events, under every child policy, and a
/// watch resumed after any event (`seq` and `index`) gets exactly the events after it, also
/// after the first of several events sharing a `seq`.
#[tokio::test]
async fn projections_show_run_started_first_and_resume_inside_a_message() -> anyhow::Result<()> {
    use flotilla_model::event::{EventBatch, WorkflowPhase as P};
    let server = flotilla_testkit::NatsServer::start().await?;
    let bus = server.provisioned_bus().await?;
    let client = flotilla_client::Client::new(bus.clone());
    let (run, child) = (RunId::new(), RunId::new());
    // The run's first message exists (nothing reads it: no coordinator runs).
    bus.publish(
        bus.names().submit_run(run),
        &SubmitRequest::new(plan(vec![Subtask::new("t", "x")])),
        None,
    )
    .await?;
    let handle = RunHandle {
        run_id: child,
        agent_id: None,
        parent_run_id: Some(run),
        parent_task_id: Some(TaskId::new("t")),
        parent_tool_call_id: Some("call0".into()),
        root_run_id: Some(run),
    };
    let worker = "worker/w1";
    let messages: Vec<(RunId, Vec<flotilla_model::event::EventEnvelope>)> = vec![
        (
            run,
            vec![synthetic(
                run,
                "w.0",
                worker,
                Some("t"),
                phase(P::TaskStarted),
            )],
        ),
        (
            run,
            vec![synthetic(
                run,
                &format!("child.{child}"),
                "task/t",
                Some("t"),
                Event::AgentRunStarted {
                    child: handle,
                    agent: Some("echo".into()),
                },
            )],
        ),
        (
            child,
            vec![synthetic(
                child,
                "w.0",
                worker,
                Some("c"),
                phase(P::TaskStarted),
            )],
        ),
        (
            child,
            vec![
                synthetic(child, "start", "coordinator", None, phase(P::RunStarted)),
                synthetic(
                    child,
                    "1.0",
                    "coordinator",
                    Some("c"),
                    phase(P::TaskSucceeded),
                ),
                synthetic(child, "1.1", "coordinator", None, phase(P::RunSucceeded)),
            ],
        ),
        (
            run,
            vec![synthetic(
                run,
                "start",
                "coordinator",
                None,
                phase(P::RunStarted),
            )],
        ),
        (
            run,
            vec![
                synthetic(
                    run,
                    "1.0",
                    "coordinator",
                    Some("t"),
                    phase(P::TaskSucceeded),
                ),
                synthetic(run, "1.1", "coordinator", None, phase(P::RunSucceeded)),
            ],
        ),
    ];
    for (r, events) in messages {
        let batch = EventBatch::new(r, events);
        bus.publish(bus.names().event(r), &batch, Some(&batch.msg_id()))
            .await?;
    }
    let watch = |children, since: (u64, Option<u32>)| {
        let opts = WatchOptions {
            profile: Profile::Debug,
            children,
            since: since.0,
            since_index: since.1,
        };
        projection(&client, run, opts)
    };
    let key = |e: &ProjectedEvent| (e.run_id, e.event.id.clone());
    let flat = watch(ChildPolicy::Flatten, (0, None)).await?;
    let ids = |events: &[ProjectedEvent]| -> Vec<String> {
        events
            .iter()
            .map(|e| {
                let who = if e.run_id == run { "run" } else { "child" };
                let id = e.event.id.split_once('.').map_or("", |(_, id)| id);
                format!("{who}:{id}")
            })
            .collect()
    };
    assert_eq!(
        flat.iter()
            .map(|e| (e.run_id == run, phase_of(e)))
            .collect::<Vec<_>>(),
        vec![
            (true, Some(P::RunStarted)),
            (true, Some(P::TaskStarted)),
            (true, None),
            (false, Some(P::RunStarted)),
            (false, Some(P::TaskStarted)),
            (false, Some(P::TaskSucceeded)),
            (false, Some(P::RunSucceeded)),
            (true, Some(P::TaskSucceeded)),
            (true, Some(P::RunSucceeded)),
        ],
        "{:?}",
        ids(&flat)
    );
    let linked = watch(ChildPolicy::Linked, (0, None)).await?;
    assert_eq!(
        phase_of(&linked[0]),
        Some(P::RunStarted),
        "{:?}",
        ids(&linked)
    );
    assert_eq!(linked.len(), 5, "{:?}", ids(&linked));
    let user = projection(
        &client,
        run,
        WatchOptions {
            children: ChildPolicy::Flatten,
            ..WatchOptions::default()
        },
    )
    .await?;
    assert_eq!(
        user.iter().map(phase_of).collect::<Vec<_>>(),
        // The watched run's own tasks start and end; the child shows its phases only.
        vec![
            Some(P::RunStarted),
            Some(P::TaskStarted),
            None,
            Some(P::RunStarted),
            Some(P::RunSucceeded),
            Some(P::TaskSucceeded),
            Some(P::RunSucceeded)
        ]
    );

    // The run's last message holds two events: resuming after the first gives the second.
    let last = flat.len() - 1;
    assert_eq!(flat[last].seq, flat[last - 1].seq);
    assert_eq!((flat[last - 1].index, flat[last].index), (0, 1));
    for (policy, all) in [
        (ChildPolicy::Flatten, &flat),
        (ChildPolicy::Linked, &linked),
    ] {
        for (at, e) in all.iter().enumerate() {
            let resumed = watch(policy, (e.seq, Some(e.index))).await?;
            assert_eq!(
                resumed.iter().map(key).collect::<Vec<_>>(),
                all[at + 1..].iter().map(key).collect::<Vec<_>>(),
                "{policy:?} resumed after event {at} ({}, {})",
                e.seq,
                e.index
            );
        }
    }
    // Without an index (an older client), `since` stands for its message's last event.
    let resumed = watch(ChildPolicy::Flatten, (flat[last - 1].seq, None)).await?;
    assert!(resumed.is_empty(), "{:?}", ids(&resumed));
    let resumed = watch(ChildPolicy::Flatten, (flat[0].seq, None)).await?;
    assert_eq!(resumed.len(), flat.len() - 1);
    // A cursor that names no event of the projection is an error, not silence.
    let stream = client
        .watch(
            run,
            WatchOptions {
                since: flat[last].seq,
                since_index: Some(7),
                ..WatchOptions::default()
            },
        )
        .await?;
    futures::pin_mut!(stream);
    let mut error = None;
    while let Some(item) = stream.next().await {
        if let Err(e) = item {
            error = Some(e.to_string());
        }
    }
    let error = error.expect("an error");
    assert!(error.contains("names no event"), "{error}");

    // A run whose start is recorded with its end (a quick run): its `run_started`, its held
    // events and its end come in one release. A child linked among the held events shows
    // right after its link, before the rest of the parent's message — its end included.
    let (quick, inner) = (RunId::new(), RunId::new());
    bus.publish(
        bus.names().submit_run(quick),
        &SubmitRequest::new(plan(vec![Subtask::new("t", "x")])),
        None,
    )
    .await?;
    let link = Event::AgentRunStarted {
        child: RunHandle {
            run_id: inner,
            agent_id: None,
            parent_run_id: Some(quick),
            parent_task_id: Some(TaskId::new("t")),
            parent_tool_call_id: Some("call0".into()),
            root_run_id: Some(quick),
        },
        agent: Some("echo".into()),
    };
    let start_and_end = |r: RunId, task: &str| {
        vec![
            synthetic(r, "start", "coordinator", None, phase(P::RunStarted)),
            synthetic(r, "1.0", "coordinator", Some(task), phase(P::TaskSucceeded)),
            synthetic(r, "1.1", "coordinator", None, phase(P::RunSucceeded)),
        ]
    };
    for (r, events) in [
        (
            quick,
            vec![synthetic(
                quick,
                "w.0",
                worker,
                Some("t"),
                phase(P::TaskStarted),
            )],
        ),
        (
            quick,
            vec![synthetic(
                quick,
                &format!("child.{inner}"),
                "task/t",
                Some("t"),
                link,
            )],
        ),
        (inner, start_and_end(inner, "c")),
        (quick, start_and_end(quick, "t")),
    ] {
        let batch = EventBatch::new(r, events);
        bus.publish(bus.names().event(r), &batch, Some(&batch.msg_id()))
            .await?;
    }
    let opts = WatchOptions {
        profile: Profile::Debug,
        children: ChildPolicy::Flatten,
        ..WatchOptions::default()
    };
    let flat = projection(&client, quick, opts).await?;
    assert_eq!(
        flat.iter()
            .map(|e| (e.run_id == quick, phase_of(e)))
            .collect::<Vec<_>>(),
        vec![
            (true, Some(P::RunStarted)),
            (true, Some(P::TaskStarted)),
            (true, None),
            (false, Some(P::RunStarted)),
            (false, Some(P::TaskSucceeded)),
            (false, Some(P::RunSucceeded)),
            (true, Some(P::TaskSucceeded)),
            (true, Some(P::RunSucceeded)),
        ],
        "{:?}",
        ids(&flat)
    );
    for (at, e) in flat.iter().enumerate() {
        let opts = WatchOptions {
            since: e.seq,
            since_index: Some(e.index),
            ..opts
        };
        let resumed = projection(&client, quick, opts).await?;
        assert_eq!(
            resumed.iter().map(key).collect::<Vec<_>>(),
            flat[at + 1..].iter().map(key).collect::<Vec<_>>(),
        );
    }
    Ok(())
}

/// A real run: whatever order its events were stored in, every projection — the client
/// library's and `api.watch`'s — starts with `run_started`, and a watch resumed after the
/// first of the several events of a message (its `seq` and `index`) gets the rest, on both
/// paths.
#[tokio::test]
async fn a_real_run_projects_run_started_first_and_resumes_exactly() -> anyhow::Result<()> {
    let f = services().await?;
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("a", "x").with_agent("echo"),
            Subtask::new("b", "y").with_agent("echo").after(&["a"]),
        ])))
        .await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let live = collect(&f, run, ChildPolicy::Linked).await?;
    let phase = |e: &ProjectedEvent| match &e.event.event {
        Event::Workflow(w) => Some(w.phase),
        _ => None,
    };
    assert_eq!(
        phase(&live[0]),
        Some(flotilla_model::event::WorkflowPhase::RunStarted),
        "{live:?}"
    );
    let server = server_watch(&f, run, (0, None)).await?;
    let key = |e: &ProjectedEvent| (e.run_id, e.seq, e.index, e.event.id.clone());
    assert_eq!(
        server.iter().map(key).collect::<Vec<_>>(),
        live.iter().map(key).collect::<Vec<_>>()
    );
    // The last step's message holds the last task's success and the run's end.
    let at = live
        .iter()
        .position(|e| e.seq == live[live.len() - 1].seq)
        .expect("the last message");
    assert!(
        at < live.len() - 1,
        "one message holds several events: {live:?}"
    );
    let since = (live[at].seq, Some(live[at].index));
    let library = collect_since(&f, run, ChildPolicy::Linked, since).await?;
    let server = server_watch(&f, run, since).await?;
    for resumed in [library, server] {
        assert_eq!(
            resumed.iter().map(key).collect::<Vec<_>>(),
            live[at + 1..].iter().map(key).collect::<Vec<_>>()
        );
    }
    f.stop().await;
    Ok(())
}

/// Collects an `api.watch` projection (debug, linked) resumed after `since` until its end.
async fn server_watch(
    f: &InProcess,
    run: RunId,
    since: (u64, Option<u32>),
) -> anyhow::Result<Vec<ProjectedEvent>> {
    use flotilla_model::watch::{WatchEnd, WatchReply};
    let inbox = f.bus.client().new_inbox();
    let mut sub = f.bus.client().subscribe(inbox.clone()).await?;
    let mut request = json!({"run_id": run, "profile": "debug", "deliver_subject": inbox,
        "since": since.0});
    if let Some(i) = since.1 {
        request["since_index"] = json!(i);
    }
    let (value, code) = api(f, "watch", request).await?;
    anyhow::ensure!(code.is_none(), "{value}");
    let _: WatchReply = serde_json::from_value(value)?;
    let mut out = Vec::new();
    tokio::time::timeout(WAIT, async {
        while let Some(m) = sub.next().await {
            if let Ok(end) = serde_json::from_slice::<WatchEnd>(&m.payload) {
                anyhow::ensure!(end.end == "ended", "{end:?}");
                return Ok(());
            }
            out.push(serde_json::from_slice(&m.payload)?);
        }
        anyhow::bail!("the subscription ended")
    })
    .await??;
    Ok(out)
}
