//! The run machine, driven without any I/O: a fork's start — the tasks it keeps succeed with
//! the original's results (their run-log sequences) without a dispatch, write what a result
//! writes, and release their dependents; the fork point and what follows run as in any run.

mod common;

use std::sync::Arc;

use flotilla_machine::{Action, RunMachine};
use flotilla_model::event::WorkflowPhase;
use flotilla_model::fork::{ForkOrigin, ReusedResult};
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::plan::{Plan, PlanConfig, Subtask};
use flotilla_model::run::{RunStatus, TaskStatus};

use common::{dispatched, ok, plan, result, submitted};

fn forked(tasks: Vec<Subtask>, at: &str, kept: &[(&str, u64)]) -> (RunId, Arc<Plan>) {
    let original = RunId::new();
    let mut p = (*plan(tasks, PlanConfig::default())).clone();
    p.fork = Some(ForkOrigin {
        run_id: original,
        task_id: TaskId::new(at),
        reused: kept
            .iter()
            .map(|(t, seq)| ReusedResult {
                task_id: TaskId::new(*t),
                seq: *seq,
            })
            .collect(),
        conversation: None,
    });
    (original, Arc::new(p))
}

#[test]
fn kept_tasks_succeed_at_the_start_and_only_the_fork_point_is_dispatched() {
    let mut a = Subtask::new("a", "");
    a.produces = vec!["notes".into()];
    a.output_key = Some("a_out".into());
    let mut b = Subtask::new("b", "").after(&["a"]);
    b.consumes = vec!["notes".into()];
    let c = Subtask::new("c", "").after(&["b"]);
    let d = Subtask::new("d", "").after(&["c"]);
    let (original, p) = forked(vec![a, b, c, d], "d", &[("a", 11), ("b", 12), ("c", 13)]);
    let (mut m, actions) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 5);
    assert_eq!(dispatched(&actions), vec![(3, 1)], "only the fork point");
    let s = m.state();
    let seqs: Vec<(TaskStatus, u64, u32)> = s
        .tasks
        .iter()
        .map(|t| (t.status, t.result_seq, t.attempt))
        .collect();
    assert_eq!(
        seqs,
        [
            (TaskStatus::Succeeded, 11, 0),
            (TaskStatus::Succeeded, 12, 0),
            (TaskStatus::Succeeded, 13, 0),
            (TaskStatus::Dispatched, 0, 1),
        ]
    );
    let origin = s.fork_of.as_ref().expect("fork_of");
    assert_eq!(
        (origin.run_id, origin.task_id.as_str(), origin.reused),
        (original, "d", 3)
    );
    // A kept result writes what a result writes: its topic and its output.
    assert!(actions.contains(&Action::Produce { task: 0 }));
    assert!(actions.contains(&Action::StoreOutput { task: 0 }));
    let kept: Vec<String> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Emit(e) if e.event.phase == WorkflowPhase::TaskSucceeded => {
                e.event.detail.clone()
            }
            _ => None,
        })
        .collect();
    assert_eq!(kept, vec![format!("reused from run {original}"); 3]);
    // The fork point's result ends the run as any result does.
    let d = ok("d");
    let end = m.apply(result(&d, 1, 20), 10);
    assert!(end.contains(&Action::Finish), "{end:?}");
    assert_eq!(m.state().status, RunStatus::Succeeded);
}

#[test]
fn a_task_the_fork_does_not_keep_runs_again_even_upstream() {
    // The original's b failed: the fork keeps a only, and runs b and the fork point c.
    let tasks = vec![
        Subtask::new("a", ""),
        Subtask::new("b", ""),
        Subtask::new("c", "").after(&["a", "b"]),
    ];
    let (_, p) = forked(tasks, "c", &[("a", 7)]);
    let (mut m, actions) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    assert_eq!(dispatched(&actions), vec![(1, 1)]);
    let b = ok("b");
    assert_eq!(dispatched(&m.apply(result(&b, 1, 8), 1)), vec![(2, 1)]);
}

#[test]
fn a_plan_without_fork_starts_as_before() {
    let p = plan(common::diamond(), PlanConfig::default());
    let (m, actions) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    assert_eq!(dispatched(&actions), vec![(0, 1)]);
    assert!(m.state().fork_of.is_none());
}

#[test]
fn a_cancelled_fork_rolls_back_only_what_it_ran() {
    use flotilla_machine::Input;
    let mut a = Subtask::new("a", "");
    a.compensate = Some("undo".into());
    let mut b = Subtask::new("b", "").after(&["a"]);
    b.compensate = Some("undo".into());
    let c = Subtask::new("c", "").after(&["b"]);
    // Kept: a. Run again: b (succeeds), then c (cancelled while it runs).
    let (_, p) = forked(vec![a, b, c], "b", &[("a", 3)]);
    let (mut m, actions) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    assert_eq!(dispatched(&actions), vec![(1, 1)]);
    let b = ok("b");
    assert_eq!(dispatched(&m.apply(result(&b, 1, 9), 1)), vec![(2, 1)]);
    m.apply(
        Input::Cancel {
            reason: "enough",
            rollback: true,
        },
        2,
    );
    let o = m.state().outcome.as_ref().expect("an outcome");
    assert!(o.rollback_run_id.is_some(), "b is undone: {o:?}");
    let reason = o.reason.as_deref().unwrap_or_default();
    assert!(reason.contains("rolling back 1 succeeded task"), "{reason}");
}
