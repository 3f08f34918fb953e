//! Workflow agents (`sequential`, `parallel`, `loop`) end to end: `flotilla coordinator`
//! processes drive them (their embedded worker of the `_workflow` pool), every sub-agent
//! execution is a child run on `flotilla worker` processes. The sub-agents are deterministic
//! test agents — `scripted` replies and small Python `exec` agents — not models.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use flotilla_client::Client;
use flotilla_context::{Clients, Scope};
use flotilla_coordinator::watch::WatchOptions;
use flotilla_model::RunId;
use flotilla_model::event::{Event, WorkflowPhase};
use flotilla_model::plan::Subtask;
use flotilla_model::run::{RunOutcome, RunStatus};
use flotilla_model::submit::SubmitRequest;
use flotilla_model::watch::{ChildPolicy, Profile, ProjectedEvent, WatchEnd, WatchReply};
use futures::StreamExt;
use serde_json::{Value, json};
use support::*;

/// Prints a JSON reply computed from the task envelope on stdin.
fn py(expr: &str) -> String {
    let code = format!(
        "import json, sys; t = json.load(sys.stdin); i = t.get('input') or {{}}; prev = i.get('previous_results') or []; print({expr})"
    );
    format!(
        "kind = \"exec\"\ncommand = \"python3\"\nargs = [\"-c\", {}]\n",
        serde_json::to_string(&code).expect("json string")
    )
}

fn agents() -> String {
    format!(
        r#"
# Generator–critic as a sequential pipeline; the draft also goes to session state.
[agents.review]
kind = "sequential"
sub-agents = ["drafter", "critic"]
output-keys = {{ drafter = "draft" }}

[agents.drafter]
kind = "scripted"
reply = "draft of: {{description}}"

[agents.critic]
{critic}
# Fan-out / gather.
[agents.survey]
kind = "parallel"
sub-agents = ["web", "papers"]

[agents.web]
kind = "scripted"
reply = "web says yes"

[agents.papers]
kind = "scripted"
reply = "papers say maybe"
delay = "200ms"

# Iterative refinement: writer, then judge, until the judge escalates.
[agents.refine]
kind = "loop"
sub-agents = ["writer", "judge"]
max-iterations = 5

[agents.writer]
{writer}
[agents.judge]
{judge}
# Hierarchical: a sequential whose first step is itself a parallel workflow.
[agents.study]
kind = "sequential"
sub-agents = ["sources", "summarizer"]

[agents.sources]
kind = "parallel"
sub-agents = ["source_a", "source_b"]

[agents.source_a]
kind = "scripted"
reply = "fact A"

[agents.source_b]
kind = "scripted"
reply = "fact B"

[agents.summarizer]
{summarizer}
"#,
        critic = py("'critique of [' + prev[-1]['response'] + ']'"),
        writer = py("'version %d' % i['iteration']"),
        judge = py("json.dumps({'escalate': i['iteration'] >= 2, 'judged': prev[-1]['response']})"),
        summarizer = py("'summary of ' + prev[-1]['response']"),
    )
}

/// The runs `run`'s tasks started (from its `agent_run_started` events), recursively.
async fn descendants(client: &Client, run: RunId) -> anyhow::Result<Vec<RunId>> {
    let mut found = Vec::new();
    let mut queue = vec![run];
    while let Some(r) = queue.pop() {
        let mut seen = BTreeSet::new();
        let events = client.events(r).await?;
        futures::pin_mut!(events);
        // The run has ended: read what its stream holds, then stop at the end event.
        let read = async {
            while let Some(e) = events.next().await {
                match e?.event {
                    Event::AgentRunStarted { child, .. } if seen.insert(child.run_id) => {
                        found.push(child.run_id);
                        queue.push(child.run_id);
                    }
                    Event::Workflow(w) if w.phase.ends_run() => break,
                    _ => {}
                }
            }
            Ok::<_, anyhow::Error>(())
        };
        tokio::time::timeout(WAIT, read).await??;
    }
    Ok(found)
}

async fn run_one(
    p: &Processes,
    agent: &str,
    description: &str,
) -> anyhow::Result<(RunId, RunOutcome)> {
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("main", description).with_agent(agent),
        ])))
        .await?;
    let outcome = p.client.wait(run, WAIT).await?;
    Ok((run, outcome))
}

fn response(outcome: &RunOutcome) -> String {
    outcome
        .final_result
        .as_ref()
        .map(|f| f.response.clone())
        .unwrap_or_default()
}

/// One worker with a single slot runs every pattern: the workflows themselves wait on the
/// coordinator, so they never take the slot their children need.
#[tokio::test]
async fn sequential_parallel_loop_and_nested_workflows_run_as_child_runs() -> anyhow::Result<()> {
    let mut p = Processes::start(&agents()).await?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "1"]).await?;

    // Generator–critic (sequential): the critic sees the draft; the draft is in state.
    let (run, outcome) = run_one(&p, "review", "the launch plan").await?;
    assert_eq!(
        outcome.status,
        RunStatus::Succeeded,
        "{outcome:?}\n{}",
        p.log(0)
    );
    assert_eq!(
        response(&outcome),
        "critique of [draft of: the launch plan]"
    );
    assert_eq!(descendants(&p.client, run).await?.len(), 2);
    let operator = Clients::new(
        p.bus.clone(),
        Scope::operator(p.bus.names().clone(), run, run, run.to_string()),
    )?;
    let draft = operator
        .state()
        .get("draft")
        .await?
        .expect("output key written");
    assert_eq!(draft.value, json!("draft of: the launch plan"));

    // Fan-out / gather (parallel): both branches, by sub-agent.
    let (run, outcome) = run_one(&p, "survey", "is it true?").await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let gathered: Value = serde_json::from_str(&response(&outcome))?;
    assert_eq!(
        gathered,
        json!({"web": "web says yes", "papers": "papers say maybe"})
    );
    assert_eq!(descendants(&p.client, run).await?.len(), 2);

    // Iterative refinement (loop): the judge escalates in iteration 2 of 5.
    let (run, outcome) = run_one(&p, "refine", "improve the text").await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let last: Value = serde_json::from_str(&response(&outcome))?;
    assert_eq!(last, json!({"escalate": true, "judged": "version 2"}));
    assert_eq!(
        descendants(&p.client, run).await?.len(),
        4,
        "two iterations of writer and judge, then the loop stopped"
    );

    // Hierarchical (nested workflows): a parallel step inside a sequential one.
    let (run, outcome) = run_one(&p, "study", "the market").await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let summary = response(&outcome);
    assert!(
        summary.starts_with("summary of ")
            && summary.contains("fact A")
            && summary.contains("fact B"),
        "{summary}"
    );
    assert_eq!(
        descendants(&p.client, run).await?.len(),
        4,
        "sources and summarizer, and the two sources' children"
    );
    Ok(())
}

/// Slow loop steps; the coordinator driving the loop is killed after the first child started
/// and a new coordinator takes over: the loop finishes, and no step ran twice.
#[tokio::test]
async fn a_loop_survives_its_coordinator_being_killed() -> anyhow::Result<()> {
    let slow = agents().replace(
        "[agents.writer]\n",
        "[agents.writer]\n# slow: the coordinator dies while it runs\n",
    );
    let slow = slow.replace(
        "print('version %d' % i['iteration'])",
        "__import__('time').sleep(1); print('version %d' % i['iteration'])",
    );
    let mut p = Processes::start(&slow).await?;
    let first = p.coordinator().await?;
    p.worker(&["--concurrency", "2"]).await?;
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("main", "improve").with_agent("refine"),
        ])))
        .await?;
    // Wait for the first child run, then kill the coordinator.
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    tokio::time::timeout(WAIT, async {
        while let Some(e) = events.next().await {
            if matches!(e?.event, Event::AgentRunStarted { .. }) {
                return Ok::<_, anyhow::Error>(());
            }
        }
        anyhow::bail!("event stream ended")
    })
    .await??;
    p.kill(first);
    p.coordinator().await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let last: Value = serde_json::from_str(&response(&outcome))?;
    assert_eq!(last["judged"], json!("version 2"));
    assert_eq!(
        descendants(&p.client, run).await?.len(),
        4,
        "the redelivered workflow re-attached to its children instead of starting them again"
    );
    // The workflow task started twice, on the two coordinators' embedded workers.
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    let mut starters = BTreeSet::new();
    tokio::time::timeout(WAIT, async {
        while let Some(e) = events.next().await {
            match e?.event {
                Event::Workflow(w) if w.phase == WorkflowPhase::TaskStarted => {
                    starters.insert(w.worker.unwrap_or_default());
                }
                Event::Workflow(w) if w.phase.ends_run() => break,
                _ => {}
            }
        }
        Ok::<_, anyhow::Error>(())
    })
    .await??;
    assert_eq!(starters.len(), 2, "{starters:?}");
    Ok(())
}

#[tokio::test]
async fn a_workflow_tree_with_problems_stops_the_coordinator_naming_them() -> anyhow::Result<()> {
    let extra = r#"
[agents.one]
kind = "sequential"
sub-agents = ["two", "leaf"]

[agents.two]
kind = "loop"
sub-agents = ["one"]
max-iterations = 0

[agents.other]
kind = "parallel"
sub-agents = ["leaf", "ghost"]

[agents.leaf]
kind = "scripted"
"#;
    let mut p = Processes::start(extra).await?;
    let i = p.spawn(&["coordinator"])?;
    let code = p.wait_exit(i, Duration::from_secs(20)).await?;
    assert_ne!(code, Some(0));
    let log = p.log(i);
    for needle in [
        "agents.one: workflows contain each other: one → two → one",
        "agents.two.max-iterations: must be at least 1",
        "agents.other.sub-agents: \"leaf\" already belongs to workflow \"one\"",
        "agents.other.sub-agents: \"ghost\" is not defined under [agents]",
    ] {
        assert!(log.contains(needle), "{needle:?} not in:\n{log}");
    }
    Ok(())
}

#[tokio::test]
async fn a_failing_sub_agent_fails_the_workflow_with_its_child_named() -> anyhow::Result<()> {
    let extra = r#"
[agents.pipeline]
kind = "sequential"
sub-agents = ["ok_step", "bad_step"]

[agents.ok_step]
kind = "scripted"

[agents.bad_step]
kind = "exec"
command = "sh"
args = ["-c", "echo broken >&2; exit 3"]
"#;
    let mut p = Processes::start(extra).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let mut plan = plan(vec![Subtask::new("main", "x").with_agent("pipeline")]);
    plan.config.max_retries = 0;
    let run = p.client.submit(SubmitRequest::new(plan)).await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed, "{outcome:?}");
    let message = &outcome.failed[0].error.message;
    assert!(
        message.contains("sub-agent bad_step (child run") && message.contains("broken"),
        "{message}"
    );
    Ok(())
}

/// A step whose own child run is rejected (its `flotilla call` names an agent that is not
/// defined) fails with `child_rejected`, and that fails the workflow for good: one attempt,
/// although the plan allows retries — a retry would run the steps again and be refused alike.
#[tokio::test]
async fn a_step_refused_a_child_fails_the_workflow_without_retries() -> anyhow::Result<()> {
    let extra = r#"
[agents.pipeline]
kind = "sequential"
sub-agents = ["asker"]

[agents.asker]
kind = "exec"
command = "sh"
args = ["-c", "\"$FLOTILLA_BIN\" call ghost"]
"#;
    let mut p = Processes::start(extra).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let mut plan = plan(vec![Subtask::new("main", "x").with_agent("pipeline")]);
    plan.config.max_retries = 3;
    let run = p.client.submit(SubmitRequest::new(plan)).await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed, "{outcome:?}");
    let failed = &outcome.failed[0];
    assert_eq!(
        failed.error.kind,
        flotilla_model::task::TaskErrorKind::ChildRejected,
        "{failed:?}"
    );
    assert_eq!(failed.attempts, 1, "not retried: {failed:?}");
    assert!(
        failed.error.message.contains("sub-agent asker"),
        "{failed:?}"
    );
    Ok(())
}

/// Collects a server-side projection (`api.watch`) until its end message.
async fn server_watch(
    p: &Processes,
    run: RunId,
    profile: Profile,
    children: ChildPolicy,
) -> anyhow::Result<Vec<ProjectedEvent>> {
    let inbox = p.bus.client().new_inbox();
    let mut sub = p.bus.client().subscribe(inbox.clone()).await?;
    let request =
        json!({"run_id": run, "profile": profile, "children": children, "deliver_subject": inbox});
    let answer = p
        .bus
        .client()
        .request(
            p.bus.names().api("watch"),
            serde_json::to_vec(&request)?.into(),
        )
        .await?;
    let reply: WatchReply = serde_json::from_slice(&answer.payload)
        .map_err(|e| anyhow::anyhow!("{e}: {}", String::from_utf8_lossy(&answer.payload)))?;
    assert!(reply.renew_subject.ends_with(".renew"));
    let mut out = Vec::new();
    tokio::time::timeout(WAIT, async {
        while let Some(m) = sub.next().await {
            if let Ok(end) = serde_json::from_slice::<WatchEnd>(&m.payload) {
                assert_eq!(end.end, "ended", "{end:?}");
                return Ok::<_, anyhow::Error>(());
            }
            out.push(serde_json::from_slice(&m.payload)?);
        }
        anyhow::bail!("the subscription ended")
    })
    .await??;
    Ok(out)
}

async fn library_watch(
    p: &Processes,
    run: RunId,
    profile: Profile,
    children: ChildPolicy,
) -> anyhow::Result<Vec<ProjectedEvent>> {
    let opts = WatchOptions {
        profile,
        children,
        ..WatchOptions::default()
    };
    projection(&p.client, run, opts).await
}

fn key(e: &ProjectedEvent) -> (RunId, u32, Option<String>, String) {
    (e.run_id, e.depth, e.agent.clone(), e.event.id.clone())
}

/// Projections of a three-level tree (sequential → parallel → leaves): flatten shows every
/// descendant after its link, attributed, in stream order; the client library and `api.watch`
/// give the same events in the same order; profiles and the other policies filter.
#[tokio::test]
async fn projections_flatten_grandchildren_the_same_in_library_and_server() -> anyhow::Result<()> {
    let mut p = Processes::start(&agents()).await?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "2"]).await?;
    let (run, outcome) = run_one(&p, "study", "the market").await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");

    let lib = library_watch(&p, run, Profile::Debug, ChildPolicy::Flatten).await?;
    let srv = server_watch(&p, run, Profile::Debug, ChildPolicy::Flatten).await?;
    assert_eq!(
        lib.iter().map(key).collect::<Vec<_>>(),
        srv.iter().map(key).collect::<Vec<_>>(),
        "library and server projections differ"
    );
    // Attribution: children are the workflow's steps, grandchildren the parallel's branches.
    let agents_at = |depth: u32| -> BTreeSet<String> {
        lib.iter()
            .filter(|e| e.depth == depth)
            .filter_map(|e| e.agent.clone())
            .collect()
    };
    assert_eq!(
        agents_at(1),
        BTreeSet::from(["sources".into(), "summarizer".into()])
    );
    assert_eq!(
        agents_at(2),
        BTreeSet::from(["source_a".into(), "source_b".into()])
    );
    // Causal order: each run's events come after its link and before its parent's end.
    let mut linked_at = std::collections::BTreeMap::new();
    for (i, e) in lib.iter().enumerate() {
        if let Event::AgentRunStarted { child, .. } = &e.event.event {
            linked_at.insert(child.run_id, i);
        }
    }
    assert_eq!(linked_at.len(), 4, "two children, two grandchildren");
    for (i, e) in lib.iter().enumerate() {
        if e.depth > 0 {
            assert!(
                linked_at[&e.run_id] < i,
                "an event of {} before its link",
                e.run_id
            );
        }
    }
    let root_end = lib
        .iter()
        .position(|e| {
            e.depth == 0 && matches!(&e.event.event, Event::Workflow(w) if w.phase.ends_run())
        })
        .expect("root end");
    assert_eq!(root_end, lib.len() - 1, "the watched run's end is last");

    // Profiles and policies.
    let user = library_watch(&p, run, Profile::User, ChildPolicy::Flatten).await?;
    assert!(user.iter().all(|e| match &e.event.event {
        Event::Workflow(w) => match w.phase {
            WorkflowPhase::RunStarted
            | WorkflowPhase::ApprovalRequested
            | WorkflowPhase::ApprovalDecided => true,
            p if p.ends_run() => true,
            WorkflowPhase::TaskStarted
            | WorkflowPhase::TaskSucceeded
            | WorkflowPhase::TaskFailed
            | WorkflowPhase::TaskRetrying
            | WorkflowPhase::TaskSkipped => e.depth == 0,
            _ => false,
        },
        Event::ToolStart { .. } | Event::ToolEnd { .. } => e.depth == 0,
        Event::Usage { .. } | Event::AgentStep { .. } => false,
        _ => true,
    }));
    assert!(
        user.iter().any(|e| e.depth == 2),
        "flatten reaches the grandchildren"
    );
    // A person sees the watched run's tasks start and end, not the children's.
    for phase in [WorkflowPhase::TaskStarted, WorkflowPhase::TaskSucceeded] {
        assert!(
            user.iter().any(|e| e.depth == 0
                && matches!(&e.event.event, Event::Workflow(w) if w.phase == phase)),
            "the user profile shows {phase:?} of the watched run"
        );
    }
    let metrics = library_watch(&p, run, Profile::Metrics, ChildPolicy::Linked).await?;
    assert!(
        metrics
            .iter()
            .all(|e| e.depth == 0
                && matches!(e.event.event, Event::Workflow(_) | Event::Usage { .. }))
    );
    let linked = library_watch(&p, run, Profile::User, ChildPolicy::Linked).await?;
    assert!(linked.iter().all(|e| e.depth == 0));
    assert_eq!(
        linked
            .iter()
            .filter(|e| matches!(e.event.event, Event::AgentRunStarted { .. }))
            .count(),
        2
    );
    let off = server_watch(&p, run, Profile::User, ChildPolicy::Off).await?;
    assert!(
        off.iter()
            .all(|e| e.depth == 0 && !matches!(e.event.event, Event::AgentRunStarted { .. }))
    );

    // Bad input is refused by name; nothing is started.
    for (request, code) in [
        (
            json!({"run_id": run, "deliver_subject": "a.*.b"}),
            "invalid_deliver_subject",
        ),
        (
            json!({"run_id": run, "deliver_subject": "x", "lease_ms": 5}),
            "invalid_lease",
        ),
        (
            json!({"run_id": RunId::new(), "deliver_subject": "x"}),
            "not_found",
        ),
        (
            json!({"run_id": run, "deliver_subject": "x", "profile": "everyone"}),
            "malformed",
        ),
    ] {
        let answer = p
            .bus
            .client()
            .request(
                p.bus.names().api("watch"),
                serde_json::to_vec(&request)?.into(),
            )
            .await?;
        let body = String::from_utf8_lossy(&answer.payload).into_owned();
        let header = answer
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Service-Error-Code"))
            .map(|v| v.to_string())
            .unwrap_or_default();
        assert!(
            body.contains(code) || header.contains(code),
            "{code}: {body} {header}"
        );
    }
    Ok(())
}
