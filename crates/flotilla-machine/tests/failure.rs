//! The run machine, driven without any I/O: failures retried with backoff, optional tasks,
//! the failure ratio, cancel (with or without a rollback) and abort, bounded cascades, and the
//! cause an outcome names.

mod common;

use flotilla_machine::{Action, Input, RunMachine, retry_backoff_ms};
use flotilla_model::event::WorkflowPhase;
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::plan::{PlanConfig, Subtask};
use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::task::{TaskErrorKind, TaskResult};

use common::{diamond, dispatched, fail, ok, phases, plan, result, submitted};

#[test]
fn failures_retry_with_backoff_then_skip_dependents() {
    let p = plan(
        diamond(),
        PlanConfig {
            max_retries: 2,
            ..PlanConfig::default()
        },
    );
    let run = RunId::new();
    let (mut m, _) = RunMachine::start(run, &submitted(&p), p.clone(), 0);
    let bad = (
        TaskId::new("a"),
        TaskResult::failure(TaskErrorKind::AgentFailed, "boom"),
    );
    let mut now = 0;
    for attempt in 1..=2 {
        let actions = m.apply(result(&bad, attempt, 10 + u64::from(attempt)), now);
        assert_eq!(phases(&actions), vec![WorkflowPhase::TaskRetrying]);
        let Some(Action::ArmTimer { generation, due_ms }) = actions
            .iter()
            .find(|a| matches!(a, Action::ArmTimer { .. }))
            .cloned()
        else {
            panic!("a retry arms a timer: {actions:?}");
        };
        let backoff = due_ms - now;
        assert_eq!(backoff, retry_backoff_ms(run, 0, attempt));
        let base = 1_000i64 << (attempt - 1);
        assert!(
            (base / 2..=base).contains(&backoff),
            "attempt {attempt}: {backoff} ms"
        );
        assert_eq!(m.state().tasks[0].status, TaskStatus::Retrying);
        now = due_ms;
        let actions = m.apply(Input::Timer { generation }, now);
        assert_eq!(dispatched(&actions), vec![(0, attempt + 1)]);
    }
    let actions = m.apply(result(&bad, 3, 20), now + 1);
    let ph = phases(&actions);
    assert_eq!(
        &ph[..3],
        &[
            WorkflowPhase::TaskFailed,
            WorkflowPhase::TaskSkipped,
            WorkflowPhase::TaskSkipped
        ]
    );
    assert!(actions.contains(&Action::Finish));
    let s = m.state();
    assert_eq!(s.status, RunStatus::Failed);
    assert_eq!(s.tasks[0].attempt, 3, "max_retries 2 means 3 attempts");
    for t in &s.tasks[1..] {
        assert_eq!(t.status, TaskStatus::Skipped);
        assert_eq!(t.cause, Some(0), "skipped because a failed");
    }
    let outcome = s.outcome.as_ref().expect("outcome");
    assert_eq!(outcome.failed[0].task_id.as_str(), "a");
    assert_eq!(outcome.skipped.len(), 3);
    assert!(
        outcome
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("required task a failed"))
    );
}

#[test]
fn backoff_doubles_and_caps() {
    let run = RunId::new();
    for attempt in 1..12 {
        let b = retry_backoff_ms(run, 3, attempt);
        let base = (1_000i64 << (attempt - 1).min(20)).min(30_000);
        assert!(b >= base / 2 && b <= base, "attempt {attempt}: {b}");
    }
}

#[test]
fn optional_failure_leaves_a_partial_success() {
    let mut tasks = diamond();
    tasks[2].required = false; // c
    tasks.push(Subtask::new("e", "").after(&["c"]));
    tasks[4].required = false;
    let p = plan(
        tasks,
        PlanConfig {
            max_retries: 0,
            ..PlanConfig::default()
        },
    );
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    let a = ok("a");
    m.apply(result(&a, 1, 1), 1);
    let c = (
        TaskId::new("c"),
        TaskResult::failure(TaskErrorKind::AgentFailed, "no"),
    );
    m.apply(result(&c, 1, 2), 2);
    assert_eq!(
        m.state().tasks[3].status,
        TaskStatus::Skipped,
        "d depends on c"
    );
    let b = ok("b");
    m.apply(result(&b, 1, 3), 3);
    // d is required and was skipped: the run fails.
    assert_eq!(m.state().status, RunStatus::Failed);

    // Without the required dependent, the run succeeds partially.
    let mut tasks = diamond();
    tasks[2].required = false;
    tasks[3].dependencies = vec![TaskId::new("b")];
    let p = plan(
        tasks,
        PlanConfig {
            max_retries: 0,
            ..PlanConfig::default()
        },
    );
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    m.apply(result(&a, 1, 1), 1);
    m.apply(result(&c, 1, 2), 2);
    m.apply(result(&b, 1, 3), 3);
    let d = ok("d");
    m.apply(result(&d, 1, 4), 4);
    assert_eq!(m.state().status, RunStatus::Succeeded);
    assert_eq!(m.state().outcome.as_ref().expect("outcome").failed.len(), 1);
}

#[test]
fn non_retryable_errors_fail_at_once() {
    let p = plan(vec![Subtask::new("a", "")], PlanConfig::default());
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    let cancelled = (
        TaskId::new("a"),
        TaskResult::failure(TaskErrorKind::Cancelled, "stop"),
    );
    let actions = m.apply(result(&cancelled, 1, 1), 1);
    assert!(actions.contains(&Action::Finish));
    assert_eq!(m.state().tasks[0].attempt, 1);
}

#[test]
fn failure_ratio_zero_aborts_at_the_first_failure() {
    let tasks: Vec<Subtask> = (0..6)
        .map(|i| {
            let mut t = Subtask::new(&format!("t{i}"), "");
            t.required = false;
            t
        })
        .collect();
    let p = plan(
        tasks,
        PlanConfig {
            max_retries: 0,
            failure_ratio: 0.0,
            max_concurrency: 3,
            ..PlanConfig::default()
        },
    );
    let (mut m, actions) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    assert_eq!(dispatched(&actions).len(), 3);
    let t1 = ok("t1");
    m.apply(result(&t1, 1, 1), 1);
    let t0 = fail("t0");
    let actions = m.apply(result(&t0, 1, 2), 2);
    assert!(
        actions.contains(&Action::CancelAttempts),
        "t2 and t3 were running: {actions:?}"
    );
    assert!(actions.contains(&Action::Finish));
    assert!(dispatched(&actions).is_empty(), "dispatch stops");
    let s = m.state();
    assert_eq!(
        s.status,
        RunStatus::Failed,
        "even though every task is optional"
    );
    assert_eq!(
        s.tasks[1].status,
        TaskStatus::Succeeded,
        "partial results stay"
    );
    for i in 2..6 {
        assert_eq!(s.tasks[i].status, TaskStatus::Cancelled);
    }
    let outcome = s.outcome.as_ref().expect("outcome");
    let reason = outcome.reason.as_deref().unwrap_or_default();
    assert!(reason.contains("aborted: 1 of 6 tasks failed"), "{reason}");
    assert!(reason.contains("failure_ratio 0"), "{reason}");
    assert!(m.stopped_early());
    assert_eq!(m.succeeded_tasks(), vec![1]);
    // Results of the cancelled attempts change nothing.
    let t2 = ok("t2");
    assert!(m.apply(result(&t2, 1, 3), 3).is_empty());
}

#[test]
fn failure_ratio_counts_failed_tasks_against_the_threshold() {
    // 6 tasks × 0.5 → abort at floor(3) + 1 = 4 failures: three failures keep the run going.
    let tasks: Vec<Subtask> = (0..6)
        .map(|i| {
            let mut t = Subtask::new(&format!("t{i}"), "");
            t.required = false;
            t
        })
        .collect();
    let p = plan(
        tasks,
        PlanConfig {
            max_retries: 0,
            max_concurrency: 6,
            ..PlanConfig::default()
        },
    );
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    assert_eq!(m.abort_threshold(), 4);
    for (i, id) in ["t0", "t1", "t2"].iter().enumerate() {
        let r = fail(id);
        m.apply(result(&r, 1, i as u64 + 1), 1);
    }
    assert_eq!(m.state().status, RunStatus::Running);
    let r = fail("t3");
    let actions = m.apply(result(&r, 1, 4), 2);
    assert!(actions.contains(&Action::CancelAttempts));
    assert_eq!(m.state().status, RunStatus::Failed);
    assert_eq!(m.state().tasks[4].status, TaskStatus::Cancelled);
}

#[test]
fn cancel_with_rollback_undoes_the_succeeded_tasks_that_declare_a_compensation() {
    let mut tasks = diamond();
    for t in &mut tasks[..3] {
        t.compensate = Some("undo".into());
    }
    let p = plan(tasks, PlanConfig::default());
    let run = RunId::new();
    let (mut m, _) = RunMachine::start(run, &submitted(&p), p.clone(), 0);
    let (a, b) = (ok("a"), ok("b"));
    m.apply(result(&a, 1, 1), 1);
    m.apply(result(&b, 1, 2), 2);
    // a and b succeeded, c is running, d waits: only a and b are undone.
    let actions = m.apply(
        Input::Cancel {
            reason: "wrong data",
            rollback: true,
        },
        3,
    );
    assert!(actions.contains(&Action::CancelAttempts));
    assert!(actions.contains(&Action::Rollback { tasks: vec![0, 1] }));
    let o = m.state().outcome.as_ref().expect("outcome");
    assert_eq!(
        o.rollback_run_id,
        Some(flotilla_model::rollback::rollback_run_id(run))
    );
    assert_eq!(
        o.reason.as_deref(),
        Some("cancelled: wrong data; rolling back 2 succeeded tasks")
    );
    // Nothing to undo (no compensation declared, or nothing succeeded): no rollback run.
    let p = plan(diamond(), PlanConfig::default());
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    m.apply(result(&a, 1, 1), 1);
    let actions = m.apply(
        Input::Cancel {
            reason: "",
            rollback: true,
        },
        2,
    );
    assert!(!actions.iter().any(|a| matches!(a, Action::Rollback { .. })));
    let o = m.state().outcome.as_ref().expect("outcome");
    assert_eq!(o.rollback_run_id, None);
    assert_eq!(o.reason.as_deref(), Some("cancelled"));
}

#[test]
fn cancel_stops_the_run_and_cancels_running_attempts() {
    let p = plan(diamond(), PlanConfig::default());
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    let a = ok("a");
    m.apply(result(&a, 1, 1), 1);
    let actions = m.apply(
        Input::Cancel {
            reason: "not needed",
            rollback: false,
        },
        2,
    );
    assert!(actions.contains(&Action::CancelAttempts));
    assert!(actions.contains(&Action::Finish));
    let s = m.state();
    assert_eq!(s.status, RunStatus::Cancelled);
    assert_eq!(s.tasks[0].status, TaskStatus::Succeeded);
    for t in &s.tasks[1..] {
        assert_eq!(t.status, TaskStatus::Cancelled);
    }
    let o = s.outcome.as_ref().expect("outcome");
    assert_eq!(o.reason.as_deref(), Some("cancelled: not needed"));
    assert_eq!(o.skipped.len(), 3);
    assert_eq!(s.counts().cancelled, 3);
    // A second cancel, or anything else, changes nothing.
    let before = m.state().clone();
    assert!(
        m.apply(
            Input::Cancel {
                reason: "again",
                rollback: false
            },
            3
        )
        .is_empty()
    );
    assert_eq!(m.state(), &before);
}

#[test]
fn abort_ends_the_run_failed_with_the_reason() {
    let p = plan(diamond(), PlanConfig::default());
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    let actions = m.apply(
        Input::Abort {
            reason: "entry 7 unreadable",
        },
        1,
    );
    assert!(actions.contains(&Action::Finish));
    assert_eq!(m.state().status, RunStatus::Failed);
    assert_eq!(
        m.state().outcome.as_ref().and_then(|o| o.reason.as_deref()),
        Some("entry 7 unreadable")
    );
}

#[test]
fn huge_cascades_keep_events_and_outcome_lists_bounded() {
    use flotilla_machine::MAX_LISTED;
    let mut tasks = vec![Subtask::new("root", "")];
    for i in 0..500 {
        tasks.push(Subtask::new(&format!("dep{i}"), "").after(&["root"]));
    }
    let p = plan(
        tasks,
        PlanConfig {
            max_retries: 0,
            failure_ratio: 1.0,
            ..PlanConfig::default()
        },
    );
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    let root = fail("root");
    let actions = m.apply(result(&root, 1, 1), 1);
    let skipped_events = phases(&actions)
        .iter()
        .filter(|p| **p == WorkflowPhase::TaskSkipped)
        .count();
    assert_eq!(skipped_events, MAX_LISTED + 1, "100 events and one summary");
    let o = m.state().outcome.as_ref().expect("outcome");
    assert_eq!(o.skipped.len(), MAX_LISTED);
    assert_eq!(o.skipped_omitted as usize, 500 - MAX_LISTED);
    assert_eq!(
        m.state().skip_reason(7, Some(&p)).as_deref(),
        Some("dependency_failed: root")
    );
}

/// An outcome says why a run did not succeed as a code clients branch on, and a run whose
/// model calls were refused for its budget says `budget_exhausted` first.
#[test]
fn outcomes_name_their_cause_and_a_spent_budget_comes_first() {
    use flotilla_model::run::EndCause;
    use flotilla_model::task::TaskError;
    let failing = |kind: TaskErrorKind| {
        let mut r = TaskResult::success(String::new());
        r.success = false;
        r.error = Some(TaskError {
            kind,
            message: "no".into(),
        });
        (TaskId::new("a"), r)
    };
    let two = || vec![Subtask::new("a", ""), Subtask::new("b", "").after(&["a"])];
    let cfg = PlanConfig {
        max_retries: 0,
        ..PlanConfig::default()
    };

    // A spent budget: the required task's failure is budget_exhausted.
    let p = plan(two(), cfg.clone());
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    let a = failing(TaskErrorKind::BudgetExhausted);
    m.apply(result(&a, 1, 10), 5);
    let o = m.state().outcome.clone().expect("ended");
    assert_eq!(o.status, RunStatus::Failed);
    assert_eq!(o.cause, Some(EndCause::BudgetExhausted));
    assert!(
        o.reason
            .as_deref()
            .is_some_and(|r| r.starts_with("budget_exhausted: ")),
        "{:?}",
        o.reason
    );

    // Any other failure of a required task.
    let p = plan(two(), cfg.clone());
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    let a = failing(TaskErrorKind::AgentFailed);
    m.apply(result(&a, 1, 10), 5);
    let o = m.state().outcome.clone().expect("ended");
    assert_eq!(o.cause, Some(EndCause::TaskFailed), "{o:?}");

    // Cancelled, and succeeded (no cause).
    let p = plan(two(), cfg.clone());
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    m.apply(
        Input::Cancel {
            reason: "stop",
            rollback: false,
        },
        5,
    );
    assert_eq!(
        m.state().outcome.as_ref().and_then(|o| o.cause),
        Some(EndCause::Cancelled)
    );
    let p = plan(vec![Subtask::new("a", "")], cfg);
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    let a = ok("a");
    m.apply(result(&a, 1, 10), 5);
    assert_eq!(m.state().outcome.as_ref().and_then(|o| o.cause), None);
}
