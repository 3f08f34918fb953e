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

/// Whether a process is gone (or a zombie waiting to be reaped).
fn process_gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

#[tokio::test]
async fn a_killed_worker_takes_its_exec_agent_processes_with_it() -> anyhow::Result<()> {
    // An exec agent whose command forks: a shell that starts a background sleep and waits.
    let pids = tempfile::NamedTempFile::new()?;
    let path = pids.path().display().to_string();
    let forker = format!(
        r#"
default-agent = "forker"
[agents.forker]
kind = "exec"
command = "sh"
args = ["-c", "echo $$ >> {path}; sleep 30 & echo $! >> {path}; wait"]
"#
    );
    let mut p = Processes::start(&forker).await?;
    p.coordinator().await?;
    let w = p.worker(&["--concurrency", "1"]).await?;
    p.client
        .submit(SubmitRequest::new(plan(vec![Subtask::new("fork", "")])))
        .await?;
    let deadline = Instant::now() + WAIT;
    let agent_pids: Vec<i32> = loop {
        let text = std::fs::read_to_string(pids.path())?;
        let found: Vec<i32> = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
        if found.len() == 2 {
            break found;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the agent never started: {}",
            p.log(w)
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    assert!(agent_pids.iter().all(|&pid| !process_gone(pid)));
    p.kill(w);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !agent_pids.iter().all(|&pid| process_gone(pid)) {
        anyhow::ensure!(
            Instant::now() < deadline,
            "agent processes {agent_pids:?} outlived their killed worker"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    Ok(())
}

#[tokio::test]
async fn recovery_after_a_worker_kill_takes_under_two_heartbeats() -> anyhow::Result<()> {
    // Heartbeat 1 s (the default is 5 s): the pool consumer's ack wait is 1.5 heartbeats.
    let mut p = Processes::start(SLOW).await?;
    p.coordinator().await?;
    let env = [("FLOTILLA_WORKER__HEARTBEAT", "1s")];
    let first = p.spawn_env(&["worker", "--concurrency", "1"], &env)?;
    p.wait_registered(first).await?;
    let info = p
        .bus
        .js()
        .get_stream(
            p.bus
                .names()
                .stream(flotilla_model::subjects::StreamKind::Tasks),
        )
        .await?
        .get_consumer::<async_nats::jetstream::consumer::pull::Config>("pool-default")
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .cached_info()
        .config
        .ack_wait;
    assert_eq!(
        info,
        Duration::from_millis(1_500),
        "ack wait = 1.5 heartbeats"
    );
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![Subtask::new("t", "")])))
        .await?;
    let victim = task_started(&p.client, run, "t").await?;
    let second = p.spawn_env(&["worker", "--concurrency", "1"], &env)?;
    p.wait_registered(second).await?;
    // Watch for the second start, then kill the first worker.
    let events = p.client.events(run).await?;
    p.kill(first);
    let killed_at = Instant::now();
    futures::pin_mut!(events);
    let restarted = tokio::time::timeout(WAIT, async {
        use flotilla_model::event::{Event, WorkflowPhase};
        use futures::StreamExt;
        while let Some(e) = events.next().await {
            if let Event::Workflow(w) = e?.event
                && w.phase == WorkflowPhase::TaskStarted
                && w.worker.as_deref() != Some(victim.as_str())
            {
                return Ok::<_, anyhow::Error>(killed_at.elapsed());
            }
        }
        anyhow::bail!("event stream ended")
    })
    .await??;
    eprintln!("recovery after kill -9 with a 1 s heartbeat: {restarted:?}");
    assert!(
        restarted < Duration::from_millis(2_500),
        "took {restarted:?}; the ack wait bounds it at 1.5 s plus a pull"
    );
    assert_eq!(p.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
    Ok(())
}

const LONG_AND_FAILING: &str = r#"
default-agent = "long"
[agents.long]
kind = "scripted"
reply = "done"
delay = "30s"
[agents.failing]
kind = "scripted"
fail-first = 100
delay = "300ms"
"#;

/// Waits until every started attempt of `run` has a stored result, all failed with `kind`.
async fn attempts_end_with(
    p: &Processes,
    run: RunId,
    expected: usize,
    within: Duration,
) -> anyhow::Result<Vec<(String, u32, bool)>> {
    let deadline = Instant::now() + within;
    loop {
        let results = results_of(&p.bus, run).await?;
        if results.len() >= expected {
            return Ok(results);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {results:?} after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn cancel_stops_attempts_running_on_worker_processes() -> anyhow::Result<()> {
    let mut p = Processes::start(LONG_AND_FAILING).await?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "1"]).await?;
    p.worker(&["--concurrency", "1"]).await?;
    let mut pl = plan(vec![Subtask::new("a", ""), Subtask::new("b", "")]);
    pl.config.max_concurrency = 2;
    let run = p.client.submit(SubmitRequest::new(pl)).await?;
    task_started(&p.client, run, "a").await?;
    task_started(&p.client, run, "b").await?;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["--config", &p.config.display().to_string()])
        .args(["runs", "cancel", &run.to_string(), "--reason", "test"])
        .output()?;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("cancelled"));
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Cancelled);
    // Both workers cancel their attempt at once (not after 30 s).
    let results = attempts_end_with(&p, run, 2, Duration::from_secs(5)).await?;
    assert!(results.iter().all(|(_, _, ok)| !ok), "{results:?}");
    Ok(())
}

#[tokio::test]
async fn failure_ratio_abort_cancels_attempts_on_other_workers() -> anyhow::Result<()> {
    let mut p = Processes::start(LONG_AND_FAILING).await?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "1"]).await?;
    p.worker(&["--concurrency", "1"]).await?;
    let mut pl = plan(vec![
        Subtask::new("long", ""),
        Subtask::new("bad", "").with_agent("failing"),
    ]);
    pl.config.failure_ratio = 0.0;
    pl.config.max_retries = 0;
    pl.config.max_concurrency = 2;
    let run = p.client.submit(SubmitRequest::new(pl)).await?;
    let started = Instant::now();
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed);
    assert!(
        outcome
            .reason
            .as_deref()
            .unwrap_or_default()
            .starts_with("aborted"),
        "{outcome:?}"
    );
    let results = attempts_end_with(&p, run, 2, Duration::from_secs(5)).await?;
    let long = results
        .iter()
        .find(|(t, _, _)| t == "long")
        .expect("long's attempt ended");
    assert!(!long.2, "the long attempt was cancelled, not completed");
    assert!(started.elapsed() < Duration::from_secs(20));
    Ok(())
}

#[tokio::test]
async fn acknowledged_keyed_submissions_survive_coordinator_kills() -> anyhow::Result<()> {
    // Submissions keyed by an idempotency key only: the key is claimed before the run's first
    // entry is appended. Kill the coordinator in the middle of bursts, repeatedly.
    let mut p = Processes::start(STEP).await?;
    let mut coordinator = p.coordinator().await?;
    p.worker(&["--concurrency", "32"]).await?;
    let mut keys = Vec::new();
    for round in 0..3 {
        let mut acks = Vec::new();
        for i in 0..150 {
            let key = format!("burst-{round}-{i}");
            let mut req = SubmitRequest::new(plan(vec![Subtask::new("t", "")]));
            req.idempotency_key = Some(key.clone());
            let out =
                flotilla_bus::wire::encode(&req, flotilla_model::codec::Codec::Json, Some(&key))?;
            acks.push(
                p.bus
                    .js()
                    .publish_with_headers(p.bus.names().submit(), out.headers, out.payload)
                    .await?,
            );
            keys.push(key);
        }
        for a in acks {
            a.await?;
        }
        tokio::time::sleep(Duration::from_millis(10 + 30 * round)).await;
        p.kill(coordinator);
        coordinator = p.coordinator().await?;
    }
    let store = flotilla_coordinator::store::RunStore::open(&p.bus).await?;
    let deadline = Instant::now() + Duration::from_secs(90);
    for key in &keys {
        let run = loop {
            if let Some(run) = store.idempotency_run(key).await? {
                break run;
            }
            anyhow::ensure!(Instant::now() < deadline, "{key} was never claimed");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let outcome = p.client.wait(run, WAIT).await?;
        assert_eq!(outcome.status, RunStatus::Succeeded, "{key}");
    }
    Ok(())
}

#[tokio::test]
async fn a_coordinator_killed_before_recording_a_start_loses_nothing() -> anyhow::Result<()> {
    // A run's start is recorded with its next step (or after the flush delay): kill the
    // coordinator right after the start was performed, before anything was recorded.
    let mut p = Processes::start(SLOW).await?;
    let c1 = p.coordinator().await?;
    p.worker(&["--concurrency", "2"]).await?;
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("a", ""),
            Subtask::new("b", "").after(&["a"]),
        ])))
        .await?;
    task_started(&p.client, run, "a").await?;
    p.kill(c1);
    // Nothing recorded yet: the run exists, and its fate is not read from an unvalidated
    // submission (it is `pending` until a coordinator records its first step).
    let view = p.client.run(run).await?.expect("a view before any record");
    assert_eq!(view.record.status, RunStatus::Pending);
    assert!(view.tasks.is_empty());
    p.coordinator().await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded);
    assert_exactly_once(&p, run, 2).await?;
    Ok(())
}

#[tokio::test]
async fn a_prefetched_task_waiting_for_a_slot_is_not_redelivered() -> anyhow::Result<()> {
    // Worker A has one slot and prefetches one task; each task runs 1.5 s, more than three
    // times the ack wait of the test heartbeat (300 ms → 450 ms). Worker B is idle: had the
    // waiting task's message expired, B would run it too. Every execution is logged.
    let log = ExecutionLog::new()?;
    let mut p = Processes::start(&log.agent_config("1.5")).await?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "1"]).await?;
    let mut pl = plan(vec![Subtask::new("x", ""), Subtask::new("y", "")]);
    pl.config.max_concurrency = 2;
    let run = p.client.submit(SubmitRequest::new(pl)).await?;
    // Both tasks are with worker A (one running, one waiting) before B starts.
    task_started(&p.client, run, "x").await?;
    p.worker(&["--concurrency", "1"]).await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded);
    assert_exactly_once(&p, run, 2).await?;
    let mut lines = log.executions()?;
    lines.sort_unstable();
    assert_eq!(lines, vec!["x", "y"], "each task ran exactly once");
    Ok(())
}
