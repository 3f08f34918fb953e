//! Faults with real processes: kill -9 a worker or the coordinator, restart nats-server,
//! SIGTERM a worker. Nothing accepted is lost and no result is applied twice.
//! Agents are the deterministic `scripted` agent with delays.

mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use flotilla_model::ids::RunId;
use flotilla_model::plan::Subtask;
use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::submit::SubmitRequest;
use support::*;

const SLOW: &str = r#"
default-agent = "slow"
[agents.slow]
kind = "scripted"
reply = "{task_id} ok"
delay = "1500ms"
"#;

const STEP: &str = r#"
default-agent = "step"
[agents.step]
kind = "scripted"
reply = "{task_id} ok"
delay = "150ms"
"#;

fn chain(n: usize) -> flotilla_model::Plan {
    plan(
        (0..n)
            .map(|i| {
                let t = Subtask::new(&format!("s{i}"), "step");
                if i == 0 {
                    t
                } else {
                    t.after(&[&format!("s{}", i - 1)])
                }
            })
            .collect(),
    )
}

/// Every task succeeded, on its first attempt, with exactly one stored result.
async fn assert_exactly_once(p: &Processes, run: RunId, tasks: usize) -> anyhow::Result<()> {
    let view = p.client.run(run).await?.expect("run exists");
    assert_eq!(view.record.status, RunStatus::Succeeded, "{view:#?}");
    assert_eq!(view.tasks.len(), tasks);
    let results = results_of(&p.bus, run).await?;
    let mut per_attempt: HashMap<(String, u32), usize> = HashMap::new();
    for (task, attempt, _) in &results {
        *per_attempt.entry((task.clone(), *attempt)).or_default() += 1;
    }
    assert!(
        per_attempt.values().all(|&n| n == 1),
        "a result was stored twice: {per_attempt:?}"
    );
    for t in &view.tasks {
        assert_eq!(t.status, TaskStatus::Succeeded);
        assert!(per_attempt.contains_key(&(t.task_id.to_string(), t.attempts)));
    }
    let store = flotilla_coordinator::store::RunStore::open(&p.bus).await?;
    let state = store.load(run).await?.expect("snapshot").snapshot.state;
    // One input per effective change: the submission plus one result per task attempt.
    let attempts: u32 = state.tasks.iter().map(|t| t.attempt).sum();
    assert_eq!(
        state.applied,
        1 + u64::from(attempts),
        "an input was applied twice"
    );
    Ok(())
}

#[tokio::test]
async fn killed_worker_task_completes_on_another_worker() -> anyhow::Result<()> {
    let mut p = Processes::start(SLOW).await?;
    p.coordinator().await?;
    let first = p.worker(&["--concurrency", "1"]).await?;
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![Subtask::new(
            "only",
            "slow work",
        )])))
        .await?;
    let victim = task_started(&p.client, run, "only").await?;
    p.worker(&["--concurrency", "1"]).await?;
    p.kill(first);
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded);
    let view = p.client.run(run).await?.expect("run");
    assert_eq!(
        view.tasks[0].attempts, 1,
        "the same attempt was redelivered, not retried"
    );
    assert_exactly_once(&p, run, 1).await?;
    let results = results_of(&p.bus, run).await?;
    assert_eq!(results.len(), 1);
    let history = flotilla_coordinator::store::RunStore::open(&p.bus)
        .await?
        .history(run)
        .await?;
    let worker = history
        .iter()
        .find_map(|(_, _, e)| match &e.input {
            flotilla_model::runlog::RunInput::TaskResult(r) => Some(r.worker.clone()),
            _ => None,
        })
        .expect("a result");
    assert_ne!(worker, victim, "the surviving worker produced the result");
    Ok(())
}

#[tokio::test]
async fn killed_coordinator_runs_complete_with_a_new_one() -> anyhow::Result<()> {
    let mut p = Processes::start(STEP).await?;
    let c1 = p.coordinator().await?;
    p.worker(&["--concurrency", "8"]).await?;
    let mut runs = Vec::new();
    for _ in 0..10 {
        runs.push(p.client.submit(SubmitRequest::new(chain(6))).await?);
    }
    // Let the runs get under way, then crash the coordinator.
    task_started(&p.client, runs[9], "s1").await?;
    p.kill(c1);
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Submissions while no coordinator runs are kept in the intake stream.
    let late = p.client.submit(SubmitRequest::new(chain(3))).await?;
    p.coordinator().await?;
    for run in runs.iter().chain([&late]) {
        let outcome = p.client.wait(*run, WAIT).await?;
        assert_eq!(outcome.status, RunStatus::Succeeded, "{run}");
    }
    for run in &runs {
        assert_exactly_once(&p, *run, 6).await?;
    }
    assert_exactly_once(&p, late, 3).await?;
    Ok(())
}

#[tokio::test]
async fn nats_restart_mid_run_loses_nothing() -> anyhow::Result<()> {
    let mut p = Processes::start(STEP).await?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "8"]).await?;
    p.worker(&["--concurrency", "8"]).await?;
    let mut runs = Vec::new();
    for _ in 0..8 {
        runs.push(p.client.submit(SubmitRequest::new(chain(8))).await?);
    }
    task_started(&p.client, runs[7], "s1").await?;
    p.server.restart().await?;
    for run in &runs {
        let outcome = p.client.wait(*run, WAIT).await?;
        assert_eq!(outcome.status, RunStatus::Succeeded, "{run}");
    }
    for run in &runs {
        assert_exactly_once(&p, *run, 8).await?;
    }
    Ok(())
}

#[tokio::test]
async fn sigterm_lets_in_flight_tasks_finish() -> anyhow::Result<()> {
    let mut p = Processes::start(SLOW).await?;
    p.coordinator().await?;
    let w = p.worker(&["--concurrency", "2"]).await?;
    let mut req_plan = plan(vec![Subtask::new("a", ""), Subtask::new("b", "")]);
    req_plan.config.max_concurrency = 2;
    let run = p.client.submit(SubmitRequest::new(req_plan)).await?;
    task_started(&p.client, run, "a").await?;
    task_started(&p.client, run, "b").await?;
    p.terminate(w);
    let code = p.wait_exit(w, Duration::from_secs(20)).await?;
    assert_eq!(code, Some(0), "graceful exit: {}", p.log(w));
    // Both tasks finished on the stopping worker before it exited.
    let outcome = p.client.wait(run, Duration::from_secs(5)).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded);
    assert_exactly_once(&p, run, 2).await?;
    Ok(())
}

#[tokio::test]
async fn sigterm_hands_back_tasks_that_outlive_the_grace_period() -> anyhow::Result<()> {
    let long = r#"
default-agent = "long"
[agents.long]
kind = "scripted"
reply = "done"
delay = "4s"
"#;
    let mut p = Processes::start(long).await?;
    p.coordinator().await?;
    // A grace period shorter than the task: it is handed back, not waited out.
    let w = p.spawn_env(
        &["worker", "--concurrency", "1"],
        &[("FLOTILLA_WORKER__SHUTDOWN_GRACE", "200ms")],
    )?;
    p.wait_registered(w).await?;
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![Subtask::new("long", "")])))
        .await?;
    task_started(&p.client, run, "long").await?;
    let stopping_at = Instant::now();
    p.terminate(w);
    assert_eq!(
        p.wait_exit(w, Duration::from_secs(5)).await?,
        Some(0),
        "{}",
        p.log(w)
    );
    assert!(
        stopping_at.elapsed() < Duration::from_secs(3),
        "the worker waited out the task"
    );
    p.worker(&["--concurrency", "1"]).await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded);
    // Handed back with a NAK: the new worker starts it at once instead of after the ack wait,
    // so the run ends about one task length after the hand-back.
    assert!(
        stopping_at.elapsed() < Duration::from_secs(12),
        "took {:?}",
        stopping_at.elapsed()
    );
    assert_exactly_once(&p, run, 1).await?;
    Ok(())
}

#[tokio::test]
async fn a_retry_timer_survives_a_coordinator_crash() -> anyhow::Result<()> {
    // The first attempt fails; its retry is a durable timer in JetStream. The coordinator
    // that armed it dies before it fires; a new one must still run attempt 2.
    let flaky = r#"
default-agent = "flaky"
[agents.flaky]
kind = "scripted"
reply = "ok on attempt {attempt}"
fail-first = 1
"#;
    let mut p = Processes::start(flaky).await?;
    let c1 = p.coordinator().await?;
    p.worker(&["--concurrency", "1"]).await?;
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![Subtask::new("t", "")])))
        .await?;
    // Wait for the retry to be scheduled, then crash the coordinator.
    {
        use flotilla_model::event::{Event, WorkflowPhase};
        use futures::StreamExt;
        let events = p.client.events(run).await?;
        futures::pin_mut!(events);
        tokio::time::timeout(WAIT, async {
            while let Some(e) = events.next().await {
                if matches!(e?.event, Event::Workflow(w) if w.phase == WorkflowPhase::TaskRetrying)
                {
                    return Ok::<_, anyhow::Error>(());
                }
            }
            anyhow::bail!("no retry scheduled")
        })
        .await??;
    }
    p.kill(c1);
    p.coordinator().await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded);
    assert_eq!(
        outcome.final_result.expect("result").response,
        "ok on attempt 2"
    );
    let history = flotilla_coordinator::store::RunStore::open(&p.bus)
        .await?
        .history(run)
        .await?;
    assert!(
        history.iter().any(|(_, _, e)| matches!(
            e.input,
            flotilla_model::runlog::RunInput::TimerFired { .. }
        )),
        "the retry came from the durable timer"
    );
    Ok(())
}

#[tokio::test]
async fn exhausted_redeliveries_become_a_failed_attempt() -> anyhow::Result<()> {
    // Workers that keep dying on a task must not loop forever: past the delivery limit the
    // next worker reports `redeliveries_exhausted`, and the coordinator's retry policy
    // takes over.
    let mut p = Processes::start(SLOW).await?;
    p.coordinator().await?;
    let env = [("FLOTILLA_WORKER__MAX_DELIVERIES", "1")];
    let first = p.spawn_env(&["worker", "--concurrency", "1"], &env)?;
    p.wait_registered(first).await?;
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![Subtask::new("t", "")])))
        .await?;
    task_started(&p.client, run, "t").await?;
    p.kill(first);
    let second = p.spawn_env(&["worker", "--concurrency", "1"], &env)?;
    p.wait_registered(second).await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded);
    let results = results_of(&p.bus, run).await?;
    assert_eq!(
        results,
        vec![("t".to_string(), 1, false), ("t".to_string(), 2, true)]
    );
    let history = flotilla_coordinator::store::RunStore::open(&p.bus)
        .await?
        .history(run)
        .await?;
    let first_error = history.iter().find_map(|(_, _, e)| match &e.input {
        flotilla_model::runlog::RunInput::TaskResult(r) if r.attempt == 1 => r.result.error.clone(),
        _ => None,
    });
    assert_eq!(
        first_error.map(|e| e.kind),
        Some(flotilla_model::task::TaskErrorKind::RedeliveriesExhausted)
    );
    Ok(())
}
