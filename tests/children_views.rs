//! Child runs seen from outside, end to end against a real nats-server: a watch that flattens
//! a tree interleaves concurrent children live and deterministically; `runs tree` and
//! `sessions show` give a tree's usage per run and per subtree and a session's runs, from the
//! client library, the API and the CLI; every projection shows a run's `run_started` first
//! and a watch resumed after any event gets exactly the events after it. The trees are made
//! by the Rust agents of `children/common.rs`, calling the deterministic `scripted` agent.

mod support;

#[path = "children/common.rs"]
mod common;

use flotilla_coordinator::watch::WatchOptions;
use flotilla_model::event::Event;
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::plan::Subtask;
use flotilla_model::run::{RunHandle, RunStatus};
use flotilla_model::submit::SubmitRequest;
use flotilla_model::watch::{ChildPolicy, Profile, ProjectedEvent};
use futures::StreamExt;
use serde_json::json;
use support::*;

use common::{api, services};

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
