//! Failure policy: retries with backoff, dependent skipping, dependency timeout, task
//! timeout, concurrency caps, exec agent failures. Services run in-process; agents are the
//! deterministic `scripted` and `exec` agents.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use flotilla_model::event::{Event, EventEnvelope, WorkflowPhase};
use flotilla_model::plan::{Strategy, Subtask};
use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::submit::SubmitRequest;
use flotilla_model::task::TaskErrorKind;
use flotilla_model::time::Secs;
use flotilla_worker::agents::{AgentDefinition, ExecConfig, ScriptedConfig};
use futures::StreamExt;
use support::*;

fn agent(delay_ms: u64, fail_first: u32) -> AgentDefinition {
    AgentDefinition::Scripted(ScriptedConfig {
        reply: "{task_id} ok after {attempt}".into(),
        delay: Duration::from_millis(delay_ms),
        fail_first,
        ..ScriptedConfig::default()
    })
}

async fn all_events(
    f: &InProcess,
    run: flotilla_model::RunId,
) -> anyhow::Result<Vec<EventEnvelope>> {
    let events = f.client.events(run).await?;
    futures::pin_mut!(events);
    let mut out = Vec::new();
    while let Some(e) = events.next().await {
        let e = e?;
        let end = matches!(&e.event, Event::Workflow(w) if w.phase.ends_run());
        out.push(e);
        if end {
            break;
        }
    }
    Ok(out)
}

fn phase_of(e: &EventEnvelope) -> Option<WorkflowPhase> {
    match &e.event {
        Event::Workflow(w) => Some(w.phase),
        _ => None,
    }
}

#[tokio::test]
async fn failed_attempts_retry_with_exponential_backoff() -> anyhow::Result<()> {
    let mut agents = BTreeMap::new();
    agents.insert("flaky".to_string(), agent(0, 2));
    let f = InProcess::start(1, agents).await?;
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![Subtask::new("t", "")])))
        .await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded);
    assert_eq!(
        outcome.final_result.expect("result").response,
        "t ok after 3"
    );
    let events = all_events(&f, run).await?;
    let retries: Vec<&EventEnvelope> = events
        .iter()
        .filter(|e| phase_of(e) == Some(WorkflowPhase::TaskRetrying))
        .collect();
    assert_eq!(retries.len(), 2);
    let starts: Vec<&EventEnvelope> = events
        .iter()
        .filter(|e| phase_of(e) == Some(WorkflowPhase::TaskStarted))
        .collect();
    assert_eq!(starts.len(), 3);
    // Attempt n+1 starts no earlier than half the 1 s·2^(n-1) backoff after failure n.
    for (n, (failed, next)) in retries.iter().zip(&starts[1..]).enumerate() {
        let gap = next.ts.unix_ms() - failed.ts.unix_ms();
        let base = 1000i64 << n;
        assert!(gap >= base / 2, "attempt {} retried after {gap} ms", n + 2);
        // Generous upper bound: only proves the durable timer fired, on a loaded machine too.
        assert!(
            gap <= base + 5000,
            "attempt {} retried after {gap} ms",
            n + 2
        );
        if let Event::Workflow(w) = &failed.event {
            assert_eq!(
                w.error.as_ref().map(|e| e.kind),
                Some(TaskErrorKind::AgentFailed)
            );
            assert!(w.retry_at.is_some());
        }
    }
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_final_failure_skips_every_dependent_with_the_reason() -> anyhow::Result<()> {
    let mut agents = BTreeMap::new();
    agents.insert("ok".to_string(), agent(0, 0));
    agents.insert("broken".to_string(), agent(0, 99));
    let f = InProcess::start(2, agents).await?;
    let mut p = plan(vec![
        Subtask::new("fetch_data", "").with_agent("broken"),
        Subtask::new("calc", "")
            .after(&["fetch_data"])
            .with_agent("ok"),
        Subtask::new("report", "").after(&["calc"]).with_agent("ok"),
        Subtask::new("independent", "").with_agent("ok"),
    ]);
    p.config.max_retries = 1;
    let run = f.client.submit(SubmitRequest::new(p)).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed);
    assert_eq!(outcome.failed.len(), 1);
    assert_eq!(outcome.failed[0].task_id.as_str(), "fetch_data");
    assert_eq!(outcome.failed[0].attempts, 2);
    let skipped: Vec<(&str, &str)> = outcome
        .skipped
        .iter()
        .map(|s| (s.task_id.as_str(), s.reason.as_str()))
        .collect();
    assert!(
        skipped.contains(&("calc", "dependency_failed: fetch_data")),
        "{skipped:?}"
    );
    assert!(
        skipped.contains(&("report", "dependency_failed: fetch_data")),
        "{skipped:?}"
    );
    let view = f.client.run(run).await?.expect("run");
    let independent = view
        .tasks
        .iter()
        .find(|t| t.task_id.as_str() == "independent")
        .expect("task");
    assert_eq!(
        independent.status,
        TaskStatus::Succeeded,
        "other branches still run"
    );
    let results = results_of(&f.bus, run).await?;
    assert!(
        results.iter().all(|(t, _, _)| t != "calc" && t != "report"),
        "skipped tasks never ran"
    );
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn an_optional_failure_leaves_a_partial_success() -> anyhow::Result<()> {
    let mut agents = BTreeMap::new();
    agents.insert("ok".to_string(), agent(0, 0));
    agents.insert("broken".to_string(), agent(0, 99));
    let f = InProcess::start(1, agents).await?;
    let mut extra = Subtask::new("extra", "").with_agent("broken");
    extra.required = false;
    let mut p = plan(vec![Subtask::new("main", "").with_agent("ok"), extra]);
    p.config.max_retries = 0;
    let run = f.client.submit(SubmitRequest::new(p)).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded);
    assert_eq!(outcome.failed[0].task_id.as_str(), "extra");
    assert_eq!(
        outcome.final_result.expect("result").response,
        "main ok after 1"
    );
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn dependency_timeout_fails_the_waiting_task() -> anyhow::Result<()> {
    let mut agents = BTreeMap::new();
    agents.insert("slow".to_string(), agent(5000, 0));
    agents.insert("fast".to_string(), agent(0, 0));
    let f = InProcess::start(1, agents).await?;
    let mut p = plan(vec![
        Subtask::new("slow", "").with_agent("slow"),
        Subtask::new("next", "").after(&["slow"]).with_agent("fast"),
    ]);
    p.config.dependency_timeout = Secs::from_millis(800);
    let run = f.client.submit(SubmitRequest::new(p)).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed);
    let next = &outcome.failed[0];
    assert_eq!(next.task_id.as_str(), "next");
    assert_eq!(next.error.kind, TaskErrorKind::DependencyTimeout);
    assert_eq!(next.attempts, 0, "it never ran");
    let events = all_events(&f, run).await?;
    // The clock starts when `slow` is dispatched: at the run's start (both server time).
    let started = events
        .iter()
        .find(|e| phase_of(e) == Some(WorkflowPhase::RunStarted))
        .expect("run started");
    let failed = events
        .iter()
        .find(|e| phase_of(e) == Some(WorkflowPhase::TaskFailed))
        .expect("next failed");
    let waited = failed.ts.unix_ms() - started.ts.unix_ms();
    assert!(
        (800..4500).contains(&waited),
        "timed out after {waited} ms (durable timer, not the slow task's end)"
    );
    let view = f.client.run(run).await?.expect("run");
    assert_eq!(
        view.tasks[0].status,
        TaskStatus::Succeeded,
        "the slow task still finished"
    );
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_task_over_its_timeout_is_cancelled_and_retried() -> anyhow::Result<()> {
    let mut agents = BTreeMap::new();
    agents.insert("hang".to_string(), agent(30_000, 0));
    let f = InProcess::start(1, agents).await?;
    let mut t = Subtask::new("hang", "");
    t.timeout = Some(Secs::from_millis(300));
    let mut p = plan(vec![t]);
    p.config.max_retries = 1;
    let started = std::time::Instant::now();
    let run = f.client.submit(SubmitRequest::new(p)).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the agent was cancelled, not waited out"
    );
    assert_eq!(outcome.status, RunStatus::Failed);
    assert_eq!(outcome.failed[0].error.kind, TaskErrorKind::Timeout);
    assert_eq!(outcome.failed[0].attempts, 2, "timeouts are retried");
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn max_concurrency_caps_tasks_in_flight() -> anyhow::Result<()> {
    let mut agents = BTreeMap::new();
    agents.insert("work".to_string(), agent(150, 0));
    let f = InProcess::start(2, agents).await?;
    let mut p = plan((0..8).map(|i| Subtask::new(&format!("t{i}"), "")).collect());
    p.config.max_concurrency = 2;
    let run = f.client.submit(SubmitRequest::new(p)).await?;
    assert_eq!(f.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
    // Each attempt ran from its worker's `started_at` to its result being stored (server
    // time, same host clock). The event stream's order cannot be used: a worker may publish
    // `task_started` of a task dispatched in the step that recorded another's success before
    // the coordinator publishes that step's `task_succeeded`.
    let store = flotilla_coordinator::store::RunStore::open(&f.bus).await?;
    let mut edges = Vec::new();
    for (_, stored, entry) in store.history(run).await? {
        if let flotilla_model::runlog::RunInput::TaskResult(r) = entry.input {
            let started = r.started_at.expect("workers report their start").unix_ms();
            edges.push((started, 1i32));
            edges.push((stored.unix_ms(), -1));
        }
    }
    assert_eq!(edges.len(), 16, "eight attempts");
    // Ends before starts at the same millisecond.
    edges.sort();
    let (mut running, mut peak) = (0, 0);
    for (_, d) in edges {
        running += d;
        peak = peak.max(running);
    }
    assert_eq!(peak, 2);
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn simple_strategy_runs_tasks_one_by_one_with_all_earlier_results() -> anyhow::Result<()> {
    let mut agents = BTreeMap::new();
    agents.insert("echo".to_string(), scripted("{task_id} after [{previous}]"));
    let f = InProcess::start(2, agents).await?;
    let mut p = plan(vec![
        Subtask::new("a", ""),
        Subtask::new("b", ""),
        Subtask::new("c", ""),
    ]);
    p.config.strategy = Strategy::Simple;
    let run = f.client.submit(SubmitRequest::new(p)).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    let fr = outcome.final_result.expect("result");
    assert_eq!(
        fr.response,
        "## a\na after []\n\n## b\nb after [a]\n\n## c\nc after [a,b]"
    );
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn exec_agent_failure_carries_stderr() -> anyhow::Result<()> {
    let mut agents = BTreeMap::new();
    agents.insert(
        "sh".to_string(),
        AgentDefinition::Exec(ExecConfig {
            command: "sh".into(),
            args: vec![
                "-c".into(),
                "cat > /dev/null; echo 'quota exceeded' >&2; exit 3".into(),
            ],
            env: BTreeMap::new(),
            cwd: None,
        }),
    );
    let f = InProcess::start(1, agents).await?;
    let mut p = plan(vec![Subtask::new("t", "")]);
    p.config.max_retries = 0;
    let run = f.client.submit(SubmitRequest::new(p)).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    let err = &outcome.failed[0].error;
    assert_eq!(err.kind, TaskErrorKind::AgentFailed);
    assert!(
        err.message.contains("quota exceeded") && err.message.contains("exit status: 3"),
        "{}",
        err.message
    );
    f.stop().await;
    Ok(())
}
