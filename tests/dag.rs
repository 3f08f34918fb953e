//! DAG execution end to end against a real nats-server: ordering, injected results, final
//! results. Services run in-process; agents are deterministic (`scripted`, `exec`).

mod support;

use std::collections::BTreeMap;

use flotilla_model::event::{Event, WorkflowPhase};
use flotilla_model::plan::Subtask;
use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::submit::SubmitRequest;
use futures::StreamExt;
use support::*;

#[tokio::test]
async fn diamond_runs_in_order_with_injected_results() -> anyhow::Result<()> {
    let mut agents = BTreeMap::new();
    agents.insert(
        "echo".to_string(),
        scripted("{task_id} saw [{dependencies}] prev [{previous}] 7%"),
    );
    let f = InProcess::start(2, agents).await?;
    let p = plan(vec![
        Subtask::new("a", "first"),
        Subtask::new("b", "left").after(&["a"]),
        Subtask::new("c", "right").after(&["a"]),
        Subtask::new("d", "join").after(&["b", "c"]),
    ]);
    let run = f.client.submit(SubmitRequest::new(p)).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let fr = outcome.final_result.expect("final result");
    assert_eq!(fr.response, "d saw [b,c] prev [a,b,c] 7%");
    assert_eq!(fr.numeric_value, Some(7.0));

    // Order: every task started after all its dependencies succeeded (per the event stream).
    let events = f.client.events(run).await?;
    let mut seen = Vec::new();
    futures::pin_mut!(events);
    while let Some(e) = events.next().await {
        let e = e?;
        if let Event::Workflow(w) = &e.event {
            seen.push((
                w.phase,
                e.task_id
                    .as_ref()
                    .map(|t| t.to_string())
                    .unwrap_or_default(),
            ));
            if w.phase.ends_run() {
                break;
            }
        }
    }
    let pos = |phase: WorkflowPhase, t: &str| {
        seen.iter()
            .position(|(p, id)| *p == phase && id == t)
            .expect("event present")
    };
    assert!(pos(WorkflowPhase::TaskSucceeded, "a") < pos(WorkflowPhase::TaskStarted, "b"));
    assert!(pos(WorkflowPhase::TaskSucceeded, "b") < pos(WorkflowPhase::TaskStarted, "d"));
    assert!(pos(WorkflowPhase::TaskSucceeded, "c") < pos(WorkflowPhase::TaskStarted, "d"));
    let view = f.client.run(run).await?.expect("run exists");
    assert!(
        view.tasks
            .iter()
            .all(|t| t.status == TaskStatus::Succeeded && t.attempts == 1)
    );
    f.stop().await;
    Ok(())
}
