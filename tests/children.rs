//! Child runs (agent-as-tool), end to end against a real nats-server: an agent starts a run of
//! another agent that is a child in the run tree, shares its root's workspace and session,
//! re-attaches instead of starting a second child, and is cancelled when the parent attempt
//! fails. A waiting parent gives its slot to its children, waiting for a run's end holds no
//! consumer, a child started through the API is linked, and a tree is bounded by its limits
//! and budgets. How a tree is seen (watches, `runs tree`, sessions) is in `children_views.rs`.
//! The called agents are the deterministic `scripted` agent, standing in for models; the
//! callers are small Rust agents of these tests (`children/common.rs`).

mod support;

#[path = "children/common.rs"]
mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use flotilla_context::{ChildCall, Clients, Scope};
use flotilla_coordinator::store::RunStore;
use flotilla_model::event::Event;
use flotilla_model::ids::{AttemptId, RunId, TaskId};
use flotilla_model::plan::{DataflowValidation, Subtask};
use flotilla_model::run::{RunHandle, RunStatus};
use flotilla_model::submit::{SubmitRequest, SubmitStatus};
use flotilla_worker::WorkerOptions;
use futures::StreamExt;
use serde_json::json;
use support::*;

use common::{api, services, services_with};

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

#[tokio::test]
async fn a_fork_keeps_a_task_with_its_child_run_and_reruns_one_with_a_new_child()
-> anyhow::Result<()> {
    use flotilla_model::fork::RunForkRequest;
    let f = services().await?;
    let mut ask = Subtask::new("ask", "what was Q3 revenue").with_agent("caller");
    ask.input = json!({"agent": "echo"});
    let sum = Subtask::new("sum", "sum it up")
        .with_agent("echo")
        .after(&["ask"]);
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![ask, sum])))
        .await?;
    assert_eq!(f.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
    assert_eq!(children_of(&f, run).await?.len(), 1);

    // Forked after the caller: its result (the child's answer) is kept, no child starts.
    let mut at_sum = RunForkRequest::new(run, TaskId::new("sum"));
    at_sum.wait = true;
    let kept = f.client.request(&at_sum, WAIT).await?;
    assert_eq!(kept.reused, vec![TaskId::new("ask")]);
    let fork = kept.run_id.expect("the fork");
    assert_eq!(kept.outcome.map(|o| o.status), Some(RunStatus::Succeeded));
    assert!(
        children_of(&f, fork).await?.is_empty(),
        "no child run again"
    );
    let tree = f.client.tree(fork, 100).await?.expect("the fork's tree");
    assert!(tree.root.children.is_empty());
    assert_eq!(tree.root.fork_of.as_ref().map(|o| o.run_id), Some(run));

    // Forked at the caller: it runs again and starts a child of the fork's own tree.
    let mut at_ask = RunForkRequest::new(run, TaskId::new("ask"));
    at_ask.wait = true;
    let again = f.client.request(&at_ask, WAIT).await?;
    assert!(again.reused.is_empty());
    let fork = again.run_id.expect("the fork");
    let outcome = again.outcome.expect("waited");
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let children = children_of(&f, fork).await?;
    assert_eq!(children.len(), 1, "{children:?}");
    assert_eq!(children[0].root_run(), fork);
    assert_eq!(
        children_of(&f, run).await?.len(),
        1,
        "the original's tree is unchanged"
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
