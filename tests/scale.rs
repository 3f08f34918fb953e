//! Two coordinators and three workers (separate processes) share the work of 200 diamond
//! runs: all succeed, and every task attempt's result is stored and applied exactly once —
//! checked in the run logs and run state, not in process logs. The agent is the
//! deterministic `scripted` agent.

mod support;

use std::collections::HashMap;

use flotilla_coordinator::store::RunStore;
use flotilla_model::plan::Subtask;
use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::runlog::RunInput;
use flotilla_model::submit::SubmitRequest;
use support::*;

#[tokio::test]
async fn two_coordinators_three_workers_two_hundred_diamonds() -> anyhow::Result<()> {
    let mut p = Processes::start(
        r#"
default-agent = "echo"
[agents.echo]
kind = "scripted"
reply = "{task_id} <- [{dependencies}]"
"#,
    )
    .await?;
    p.coordinator().await?;
    p.coordinator().await?;
    for _ in 0..3 {
        p.worker(&["--concurrency", "16"]).await?;
    }
    let diamond = plan(vec![
        Subtask::new("a", ""),
        Subtask::new("b", "").after(&["a"]),
        Subtask::new("c", "").after(&["a"]),
        Subtask::new("d", "").after(&["b", "c"]),
    ]);
    let mut runs = Vec::new();
    for _ in 0..200 {
        runs.push(p.client.submit(SubmitRequest::new(diamond.clone())).await?);
    }
    for (i, run) in runs.iter().enumerate() {
        let outcome = match p.client.wait(*run, WAIT).await {
            Ok(o) => o,
            Err(e) => {
                let results = results_of(&p.bus, *run).await?;
                let warns: Vec<String> = (0..5)
                    .flat_map(|k| {
                        p.log(k)
                            .lines()
                            .filter(|l| l.contains("WARN") || l.contains("ERROR"))
                            .map(|l| format!("p{k}: {l}"))
                            .collect::<Vec<_>>()
                    })
                    .collect();
                panic!(
                    "run #{i} {run}: {e}\nresults: {results:?}\nwarnings:\n{}",
                    warns.join("\n")
                );
            }
        };
        assert_eq!(outcome.status, RunStatus::Succeeded, "{run}");
        assert_eq!(outcome.final_result.expect("result").response, "d <- [b,c]");
    }
    let store = RunStore::open(&p.bus).await?;
    let mut coordinators_seen = std::collections::BTreeSet::new();
    for run in &runs {
        let history = store.history(*run).await?;
        let mut per_attempt: HashMap<(String, u32), usize> = HashMap::new();
        let mut submitted = 0;
        for (_, _, e) in &history {
            match &e.input {
                RunInput::Submitted(_) => submitted += 1,
                RunInput::TaskResult(r) => {
                    coordinators_seen.insert(r.worker.clone());
                    *per_attempt
                        .entry((r.task_id.to_string(), r.attempt))
                        .or_default() += 1;
                }
                RunInput::TimerFired { .. }
                | RunInput::Control(_)
                | RunInput::TopicWritten { .. }
                | RunInput::Planned(_)
                | RunInput::Claimed(_)
                | RunInput::Recruited(_)
                | RunInput::Retired(_)
                | RunInput::Assigned(_)
                | RunInput::Finished(_)
                | RunInput::ApprovalDecided(_)
                | RunInput::Completed(_)
                | RunInput::Suspended(_)
                | RunInput::PlanEdited(_) => {}
                RunInput::Rejected(_) => panic!("{run} was rejected"),
            }
        }
        assert_eq!(submitted, 1, "{run}");
        assert_eq!(per_attempt.len(), 4, "{run}: {per_attempt:?}");
        assert!(
            per_attempt.values().all(|&n| n == 1),
            "{run}: {per_attempt:?}"
        );
        let state = store.load(*run).await?.expect("snapshot").snapshot.state;
        assert!(
            state
                .tasks
                .iter()
                .all(|t| t.status == TaskStatus::Succeeded && t.attempt == 1),
            "{run}"
        );
        assert_eq!(
            state.applied, 5,
            "{run}: submission + 4 results, each applied once"
        );
    }
    assert!(
        coordinators_seen.len() > 1,
        "the work spread over several workers"
    );
    Ok(())
}

/// With the default `worker.prefetch`, a worker busy with a long attempt does not hold the
/// pool's next task while another worker has a free slot: the slow task goes to the worker
/// that can start it. (Prefetching behind a model call cost a fifth of a pool's throughput.)
#[tokio::test]
async fn a_worker_busy_with_a_long_attempt_holds_no_task_another_could_start() -> anyhow::Result<()>
{
    use std::time::{Duration, Instant};

    use flotilla_worker::WorkerOptions;
    use flotilla_worker::agents::{AgentDefinition, ScriptedConfig};

    let agents = [(
        "slow".to_owned(),
        AgentDefinition::Scripted(ScriptedConfig {
            reply: "{task_id} done".into(),
            delay: Duration::from_secs(4),
            ..ScriptedConfig::default()
        }),
    )]
    .into();
    let opts = WorkerOptions {
        concurrency: 1,
        started_event_delay: Duration::ZERO,
        ..WorkerOptions::default()
    };
    assert_eq!(opts.prefetch, 1, "the default");
    let mut f = InProcess::start_with(
        0,
        agents,
        WorkerOptions {
            id: Some("busy".into()),
            ..opts.clone()
        },
    )
    .await?;
    f.add_worker(WorkerOptions {
        id: Some("busy".into()),
        ..opts.clone()
    })
    .await?;
    let one = plan(vec![Subtask::new("t", "slow")]);
    let first = f.client.submit(SubmitRequest::new(one.clone())).await?;
    assert_eq!(task_started(&f.client, first, "t").await?, "busy");
    let busy_since = Instant::now();
    let second = f.client.submit(SubmitRequest::new(one)).await?;
    // Time for the busy worker to take the task, as a prefetching worker does.
    tokio::time::sleep(Duration::from_millis(700)).await;
    f.add_worker(WorkerOptions {
        id: Some("free".into()),
        ..opts
    })
    .await?;
    assert_eq!(task_started(&f.client, second, "t").await?, "free");
    assert!(
        busy_since.elapsed() < Duration::from_secs(3),
        "the second task waited for the first: {:?}",
        busy_since.elapsed()
    );
    for run in [first, second] {
        assert_eq!(f.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
    }
    f.stop().await;
    Ok(())
}
