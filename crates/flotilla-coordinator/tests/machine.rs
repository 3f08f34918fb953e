//! The run machine (`flotilla-machine`), driven without any I/O: alone, and through the
//! coordinator's planning phase of bare queries.

use std::collections::BTreeMap;
use std::sync::Arc;

use flotilla_machine::{Action, Input, RunMachine, retry_backoff_ms};
use flotilla_model::event::WorkflowPhase;
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::plan::{Plan, PlanConfig, Strategy, Subtask};
use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::runlog::Submitted;
use flotilla_model::task::{TaskErrorKind, TaskResult};
use flotilla_model::time::Secs;

fn plan(tasks: Vec<Subtask>, config: PlanConfig) -> Arc<Plan> {
    Arc::new(Plan {
        name: Some("t".into()),
        query: None,
        subtasks: tasks,
        config,
    })
}

fn submitted(p: &Plan) -> Submitted {
    Submitted {
        plan: p.clone(),
        labels: BTreeMap::new(),
        session_id: None,
        parent: None,
        reply_to: None,
        wait_reply_to: None,
        intake_seq: None,
        warnings: Vec::new(),
        trace: None,
        planning: None,
        depth: 0,
        budget_scopes: Vec::new(),
        anycast: false,
        memory: None,
        lead: None,
        hitl: None,
    }
}

fn diamond() -> Vec<Subtask> {
    vec![
        Subtask::new("a", ""),
        Subtask::new("b", "").after(&["a"]),
        Subtask::new("c", "").after(&["a"]),
        Subtask::new("d", "").after(&["b", "c"]),
    ]
}

fn dispatched(actions: &[Action]) -> Vec<(u32, u32)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Dispatch { task, attempt } => Some((*task, *attempt)),
            _ => None,
        })
        .collect()
}

fn phases(actions: &[Action]) -> Vec<WorkflowPhase> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Emit(e) => Some(e.event.phase),
            _ => None,
        })
        .collect()
}

fn ok(id: &str) -> (TaskId, TaskResult) {
    (TaskId::new(id), TaskResult::success(format!("{id} done")))
}

fn result<'a>(t: &'a (TaskId, TaskResult), attempt: u32, seq: u64) -> Input<'a> {
    Input::Result {
        task: &t.0,
        attempt,
        result: &t.1,
        seq,
        worker: None,
        started_at: None,
        agent: None,
    }
}

#[test]
fn diamond_runs_in_dependency_order_and_finishes() {
    let p = plan(diamond(), PlanConfig::default());
    let (mut m, actions) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 1_000);
    assert_eq!(dispatched(&actions), vec![(0, 1)]);
    assert_eq!(phases(&actions)[0], WorkflowPhase::RunStarted);

    let a = ok("a");
    let actions = m.apply(result(&a, 1, 10), 1_100);
    assert_eq!(dispatched(&actions), vec![(1, 1), (2, 1)]);
    let b = ok("b");
    assert!(
        dispatched(&m.apply(result(&b, 1, 11), 1_200)).is_empty(),
        "d still waits for c"
    );
    let c = ok("c");
    assert_eq!(dispatched(&m.apply(result(&c, 1, 12), 1_300)), vec![(3, 1)]);
    let d = ok("d");
    let actions = m.apply(result(&d, 1, 13), 1_400);
    assert!(actions.contains(&Action::Finish));
    assert_eq!(m.state().status, RunStatus::Succeeded);
    assert_eq!(m.state().tasks[3].result_seq, 13);
    assert_eq!(
        m.final_tasks(),
        vec![3],
        "the sink supplies the final result"
    );
}

#[test]
fn duplicates_and_stale_inputs_change_nothing() {
    let p = plan(diamond(), PlanConfig::default());
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    let a = ok("a");
    m.apply(result(&a, 1, 10), 5);
    let before = m.state().clone();
    assert!(
        m.apply(result(&a, 1, 10), 6).is_empty(),
        "same result again"
    );
    assert!(
        m.apply(result(&a, 2, 11), 7).is_empty(),
        "an attempt that never ran"
    );
    let ghost = ok("ghost");
    assert!(m.apply(result(&ghost, 1, 12), 8).is_empty(), "unknown task");
    assert!(
        m.apply(Input::Timer { generation: 999 }, 9).is_empty(),
        "stale timer"
    );
    assert_eq!(m.state(), &before);
}

#[test]
fn max_concurrency_caps_in_flight_tasks() {
    let tasks: Vec<Subtask> = (0..10)
        .map(|i| Subtask::new(&format!("t{i}"), ""))
        .collect();
    let p = plan(
        tasks,
        PlanConfig {
            max_concurrency: 3,
            ..PlanConfig::default()
        },
    );
    let (mut m, actions) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    assert_eq!(dispatched(&actions).len(), 3);
    let t0 = ok("t0");
    assert_eq!(dispatched(&m.apply(result(&t0, 1, 1), 1)), vec![(3, 1)]);
    assert_eq!(m.in_flight(), 3);
}

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
fn dependency_timeout_fails_waiting_tasks_only_after_their_dependencies_were_dispatched() {
    let tasks = vec![
        Subtask::new("slow", ""),
        Subtask::new("next", "").after(&["slow"]),
        Subtask::new("last", "").after(&["next"]),
    ];
    let p = plan(
        tasks,
        PlanConfig {
            dependency_timeout: Secs::from_secs(10),
            ..PlanConfig::default()
        },
    );
    let (mut m, actions) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    let timer = actions
        .iter()
        .find_map(|a| match a {
            Action::ArmTimer { generation, due_ms } => Some((*generation, *due_ms)),
            _ => None,
        })
        .expect("dispatching slow starts next's dependency clock");
    assert_eq!(timer.1, 10_000);
    let actions = m.apply(
        Input::Timer {
            generation: timer.0,
        },
        10_000,
    );
    let s = m.state();
    assert_eq!(s.tasks[1].status, TaskStatus::Failed);
    assert_eq!(
        s.tasks[1].error.as_ref().map(|e| e.kind),
        Some(TaskErrorKind::DependencyTimeout)
    );
    assert_eq!(s.tasks[2].status, TaskStatus::Skipped);
    assert_eq!(
        s.tasks[0].status,
        TaskStatus::Dispatched,
        "the slow task keeps running"
    );
    assert!(!actions.contains(&Action::Finish));
    let slow = ok("slow");
    let actions = m.apply(result(&slow, 1, 5), 12_000);
    assert!(actions.contains(&Action::Finish));
    assert_eq!(m.state().status, RunStatus::Failed);
}

#[test]
fn simple_strategy_runs_one_task_at_a_time_in_order() {
    let tasks = vec![
        Subtask::new("second", "").after(&["first"]),
        Subtask::new("first", ""),
        Subtask::new("third", ""),
    ];
    let p = plan(
        tasks,
        PlanConfig {
            strategy: Strategy::Simple,
            max_concurrency: 5,
            ..PlanConfig::default()
        },
    );
    let (mut m, actions) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    assert_eq!(dispatched(&actions), vec![(1, 1)], "first goes first");
    let first = ok("first");
    assert_eq!(dispatched(&m.apply(result(&first, 1, 1), 1)), vec![(0, 1)]);
    let second = ok("second");
    assert_eq!(dispatched(&m.apply(result(&second, 1, 2), 2)), vec![(2, 1)]);
    assert_eq!(
        m.graph().ancestors(2).len(),
        2,
        "third sees every earlier result"
    );
}

#[test]
fn synthesis_task_is_the_final_result() {
    let mut tasks = diamond();
    tasks[1].role = Some("synthesis".into());
    let p = plan(tasks, PlanConfig::default());
    let (m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    assert_eq!(m.graph().finals(), &[1]);
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

fn fail(id: &str) -> (TaskId, TaskResult) {
    (
        TaskId::new(id),
        TaskResult::failure(TaskErrorKind::AgentFailed, "scripted failure"),
    )
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

#[test]
fn restore_rebuilds_the_same_machine() {
    let p = plan(diamond(), PlanConfig::default());
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    let a = ok("a");
    m.apply(result(&a, 1, 1), 1);
    let bytes = rmp_serde::to_vec_named(m.state()).expect("encode");
    let state = rmp_serde::from_slice(&bytes).expect("decode");
    let mut restored = RunMachine::restore(p.clone(), state);
    let b = ok("b");
    assert_eq!(
        m.apply(result(&b, 1, 2), 2),
        restored.apply(result(&b, 1, 2), 2)
    );
    assert_eq!(m.state(), restored.state());
}

fn earnings(dataflow: flotilla_model::plan::DataflowValidation) -> Arc<Plan> {
    let mut fetch = Subtask::new("fetch", "");
    fetch.produces = vec!["figures".into()];
    let mut growth = Subtask::new("growth", "");
    growth.consumes = vec!["figures".into()];
    growth.output_key = Some("growth".into());
    let mut margin = Subtask::new("margin", "");
    margin.consumes = vec!["figures".into()];
    let report = Subtask::new("report", "").after(&["growth", "margin"]);
    plan(
        vec![fetch, growth, margin, report],
        PlanConfig {
            max_retries: 0,
            dependency_timeout: Secs::from_secs(60),
            dataflow_validation: dataflow,
            ..PlanConfig::default()
        },
    )
}

#[test]
fn consumers_wait_for_the_topic_and_not_for_each_other() {
    let p = earnings(Default::default());
    let (mut m, actions) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    assert_eq!(
        dispatched(&actions),
        vec![(0, 1)],
        "only the producer starts"
    );
    let fetch = ok("fetch");
    let actions = m.apply(result(&fetch, 1, 1), 10);
    // The entry is written before the consumers are dispatched, both at once.
    let produce = actions
        .iter()
        .position(|a| matches!(a, Action::Produce { task: 0 }))
        .expect("automatic produce");
    let first_dispatch = actions
        .iter()
        .position(|a| matches!(a, Action::Dispatch { .. }))
        .expect("dispatch");
    assert!(produce < first_dispatch, "{actions:?}");
    assert_eq!(dispatched(&actions), vec![(1, 1), (2, 1)]);
    let growth = ok("growth");
    let actions = m.apply(result(&growth, 1, 2), 20);
    assert!(
        actions.contains(&Action::StoreOutput { task: 1 }),
        "output_key: {actions:?}"
    );
    assert!(dispatched(&actions).is_empty(), "report waits for margin");
    let margin = ok("margin");
    let actions = m.apply(result(&margin, 1, 3), 30);
    assert_eq!(dispatched(&actions), vec![(3, 1)]);
    // A later announcement of the topic changes nothing.
    let before = m.state().clone();
    assert!(
        m.apply(Input::TopicWritten { topic: "figures" }, 31)
            .is_empty()
    );
    assert_eq!(m.state(), &before);
}

#[test]
fn any_writer_opens_a_topic_and_the_wait_is_bounded() {
    let mut reader = Subtask::new("reader", "");
    reader.consumes = vec!["notes".into()];
    let p = plan(
        vec![reader.clone(), Subtask::new("other", "")],
        PlanConfig {
            dependency_timeout: Secs::from_secs(60),
            dataflow_validation: flotilla_model::plan::DataflowValidation::Lenient,
            ..PlanConfig::default()
        },
    );
    let (mut m, actions) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 1_000);
    assert_eq!(dispatched(&actions), vec![(1, 1)]);
    assert!(
        actions
            .iter()
            .any(|a| matches!(a, Action::ArmTimer { due_ms: 61_000, .. })),
        "the wait is bounded by dependency_timeout: {actions:?}"
    );
    // Topics the plan does not name are ignored.
    assert!(
        m.apply(Input::TopicWritten { topic: "elsewhere" }, 2_000)
            .is_empty()
    );
    let actions = m.apply(Input::TopicWritten { topic: "notes" }, 5_000);
    assert_eq!(dispatched(&actions), vec![(0, 1)]);

    // Without an entry the reader fails when the wait ends, naming the topic.
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 1_000);
    let timer = m.state().timer.expect("armed");
    let actions = m.apply(
        Input::Timer {
            generation: timer.generation,
        },
        timer.due_ms,
    );
    assert!(phases(&actions).contains(&WorkflowPhase::TaskFailed));
    let t = &m.state().tasks[0];
    assert_eq!(t.status, TaskStatus::Failed);
    let e = t.error.as_ref().expect("error");
    assert_eq!(e.kind, TaskErrorKind::DependencyTimeout);
    assert!(e.message.contains("notes"), "{}", e.message);
}

#[test]
fn consumers_of_a_failed_producer_are_skipped_not_left_waiting() {
    let p = earnings(Default::default());
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    let fetch = fail("fetch");
    let actions = m.apply(result(&fetch, 1, 1), 10);
    assert!(actions.iter().all(|a| !matches!(a, Action::Produce { .. })));
    assert!(m.state().status.is_terminal(), "{:?}", m.state());
    for i in [1usize, 2, 3] {
        assert_eq!(m.state().tasks[i].status, TaskStatus::Skipped, "task {i}");
    }
    assert_eq!(
        m.state().skip_reason(1, Some(&p)).as_deref(),
        Some("producer_failed: fetch (consumed topic \"figures\" can get no entry from the plan)")
    );
    assert_eq!(
        m.state().skip_reason(3, Some(&p)).as_deref(),
        Some("dependency_failed: fetch")
    );
}

#[test]
fn restore_keeps_which_topics_have_entries() {
    let mut reader = Subtask::new("reader", "");
    reader.consumes = vec!["notes".into(), "more".into()];
    let p = plan(
        vec![reader],
        PlanConfig {
            dataflow_validation: flotilla_model::plan::DataflowValidation::Lenient,
            ..PlanConfig::default()
        },
    );
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    m.apply(Input::TopicWritten { topic: "more" }, 1);
    let bytes = rmp_serde::to_vec_named(m.state()).expect("encode");
    let mut restored =
        RunMachine::restore(p.clone(), rmp_serde::from_slice(&bytes).expect("decode"));
    let a = m.apply(Input::TopicWritten { topic: "notes" }, 2);
    let b = restored.apply(Input::TopicWritten { topic: "notes" }, 2);
    assert_eq!(dispatched(&a), vec![(0, 1)]);
    assert_eq!(a, b);
    assert_eq!(m.state(), restored.state());
}

/// Anycast: a plan with a role task `r` (role `research`, no agent) and a task `after` that
/// depends on it, in a deployment whose cards define roles; the claim window is 10 s.
fn anycast_plan() -> (Arc<Plan>, Submitted) {
    let mut r = Subtask::new("r", "");
    r.role = Some("research".into());
    let p = plan(
        vec![r, Subtask::new("after", "").after(&["r"])],
        PlanConfig {
            dependency_timeout: Secs::from_secs(10),
            ..PlanConfig::default()
        },
    );
    let mut s = submitted(&p);
    s.anycast = true;
    (p, s)
}

fn timers(actions: &[Action]) -> Vec<(u64, i64)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::ArmTimer { generation, due_ms } => Some((*generation, *due_ms)),
            _ => None,
        })
        .collect()
}

fn claim(task: &TaskId, attempt: u32) -> Input<'_> {
    Input::Claimed { task, attempt }
}

#[test]
fn an_unclaimed_anycast_attempt_fails_role_unclaimed_at_its_bound_and_is_withdrawn() {
    let (p, s) = anycast_plan();
    let (mut m, actions) = RunMachine::start(RunId::new(), &s, p.clone(), 1_000);
    assert_eq!(m.anycast_role(0), Some("research"));
    assert_eq!(m.anycast_role(1), None);
    assert_eq!(dispatched(&actions), vec![(0, 1)]);
    assert_eq!(
        timers(&actions),
        vec![(1, 11_000)],
        "the wait for a member is bounded"
    );
    // A firing of that timer before any claim: the attempt fails, final, and is withdrawn.
    let actions = m.apply(Input::Timer { generation: 1 }, 11_000);
    assert!(
        actions.contains(&Action::Withdraw {
            task: 0,
            attempt: 1
        }),
        "{actions:?}"
    );
    let t = &m.state().tasks[0];
    assert_eq!(t.status, TaskStatus::Failed);
    let error = t.error.as_ref().expect("error");
    assert_eq!(error.kind, TaskErrorKind::RoleUnclaimed);
    assert!(error.message.contains("\"research\""), "{error}");
    assert!(!error.kind.is_retryable());
    assert_eq!(m.state().tasks[1].status, TaskStatus::Skipped);
    assert_eq!(m.state().status, RunStatus::Failed);
    assert_eq!(m.in_flight(), 0);
    // A claim and a result arriving after the decision change nothing.
    let before = m.state().clone();
    let r = TaskId::new("r");
    assert!(m.apply(claim(&r, 1), 11_001).is_empty());
    let late = ok("r");
    assert!(m.apply(result(&late, 1, 9), 11_002).is_empty());
    assert_eq!(m.state(), &before);
}

#[test]
fn a_claim_before_the_bound_ends_the_wait_and_the_attempt_runs_on() {
    let (p, s) = anycast_plan();
    let (mut m, _) = RunMachine::start(RunId::new(), &s, p.clone(), 1_000);
    let r = TaskId::new("r");
    assert!(m.apply(claim(&r, 1), 5_000).is_empty());
    assert_eq!(m.state().tasks[0].claimed, 1);
    assert_eq!(
        m.state().applied,
        2,
        "the claim is an input that changed the run"
    );
    // The same claim again (a redelivered worker's) changes nothing.
    let before = m.state().clone();
    assert!(m.apply(claim(&r, 1), 5_001).is_empty());
    assert_eq!(m.state(), &before);
    // The deadline's firing finds the attempt claimed: it runs on. (Its dependent still
    // counts `dependency_timeout` from the dispatch, queue time included, as for any task
    // whose dependency waits in a queue.)
    let actions = m.apply(Input::Timer { generation: 1 }, 11_000);
    assert!(
        !actions.iter().any(|a| matches!(a, Action::Withdraw { .. })),
        "{actions:?}"
    );
    assert_eq!(m.state().tasks[0].status, TaskStatus::Dispatched);
    assert_eq!(
        m.state().tasks[1].error.as_ref().map(|e| e.kind),
        Some(TaskErrorKind::DependencyTimeout)
    );
    // Its result goes on as any task's, with the member that ran it on the event.
    let done = ok("r");
    let actions = m.apply(
        Input::Result {
            task: &done.0,
            attempt: 1,
            result: &done.1,
            seq: 7,
            worker: Some("w1"),
            started_at: None,
            agent: Some("analyst"),
        },
        12_000,
    );
    let agents: Vec<_> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Emit(e) if e.event.phase == WorkflowPhase::TaskSucceeded => {
                e.event.agent.clone()
            }
            _ => None,
        })
        .collect();
    assert_eq!(agents, vec!["analyst".to_string()]);
}

#[test]
fn a_result_ends_the_wait_too_and_a_retry_waits_again() {
    let (p, s) = anycast_plan();
    let (mut m, _) = RunMachine::start(RunId::new(), &s, p.clone(), 1_000);
    // A failed first attempt whose claim never came (a quick agent, its claim lost): the
    // result ended the wait, and the attempt is retried after its backoff.
    let failed = fail("r");
    let actions = m.apply(result(&failed, 1, 3), 2_000);
    assert_eq!(m.state().tasks[0].status, TaskStatus::Retrying);
    let due = m.state().tasks[0].retry_ms;
    let (generation, at) = timers(&actions)[0];
    assert_eq!(at, due, "the retry is earlier than the old claim bound");
    let actions = m.apply(Input::Timer { generation }, due);
    assert_eq!(dispatched(&actions), vec![(0, 2)]);
    // Attempt 2 waits for a member again, from its own dispatch.
    assert_eq!(timers(&actions).last().map(|t| t.1), Some(due + 10_000));
    let r = TaskId::new("r");
    assert!(
        m.apply(claim(&r, 1), due + 1).is_empty(),
        "a claim of attempt 1 is stale"
    );
    assert_eq!(m.state().tasks[0].claimed, 0);
    m.apply(claim(&r, 2), due + 2);
    assert_eq!(m.state().tasks[0].claimed, 2);
}

#[test]
fn without_roles_a_role_names_a_prompt_and_nothing_waits_for_a_claim() {
    let (p, mut s) = anycast_plan();
    s.anycast = false;
    let (mut m, actions) = RunMachine::start(RunId::new(), &s, p.clone(), 1_000);
    assert_eq!(m.anycast_role(0), None);
    assert_eq!(dispatched(&actions), vec![(0, 1)]);
    let before = m.state().clone();
    assert!(m.apply(claim(&TaskId::new("r"), 1), 2_000).is_empty());
    assert_eq!(m.state(), &before, "only anycast tasks are claimed");
    // The run's timer (the dependent's deadline) fires: the pool task waits on, unbounded.
    let (generation, at) = timers(&actions)[0];
    let actions = m.apply(Input::Timer { generation }, at);
    assert!(
        !actions.iter().any(|a| matches!(a, Action::Withdraw { .. })),
        "{actions:?}"
    );
    assert_eq!(m.state().tasks[0].status, TaskStatus::Dispatched);
}

#[test]
fn restore_keeps_claims_and_the_anycast_flag() {
    let (p, s) = anycast_plan();
    let (mut m, _) = RunMachine::start(RunId::new(), &s, p.clone(), 1_000);
    m.apply(claim(&TaskId::new("r"), 1), 2_000);
    let bytes = rmp_serde::to_vec_named(m.state()).expect("encode");
    let mut restored =
        RunMachine::restore(p.clone(), rmp_serde::from_slice(&bytes).expect("decode"));
    assert_eq!(m.state(), restored.state());
    assert_eq!(restored.anycast_role(0), Some("research"));
    let a = m.apply(Input::Timer { generation: 1 }, 11_000);
    let b = restored.apply(Input::Timer { generation: 1 }, 11_000);
    assert_eq!(a, b);
    assert_eq!(m.state().tasks[0].status, TaskStatus::Dispatched);
    // Plain runs store neither field.
    let plain = plan(diamond(), PlanConfig::default());
    let (m, _) = RunMachine::start(RunId::new(), &submitted(&plain), plain.clone(), 0);
    let json = serde_json::to_value(m.state()).expect("json");
    assert!(json.get("anycast").is_none());
    assert!(json["tasks"][0].get("cl").is_none());
}

mod model {
    //! Random plans, random failures, duplicate deliveries and timer firings, checked against
    //! the invariants a simple model of the scheduler must keep.
    use super::*;
    use proptest::prelude::{ProptestConfig, any, prop, prop_assert, prop_assert_eq, proptest};
    use proptest::strategy::Strategy as _;

    #[derive(Debug, Clone)]
    struct Case {
        deps: Vec<Vec<usize>>,
        required: Vec<bool>,
        /// Attempt outcomes per task: true = success. Missing entries succeed.
        script: Vec<Vec<bool>>,
        max_concurrency: u32,
        max_retries: u32,
        failure_ratio: f64,
        /// Cancel the run at this step (if it is still running then).
        cancel_at: Option<usize>,
        choices: Vec<u32>,
        /// Task i produces topic `p<i>`.
        produces: Vec<bool>,
        /// Topics each task consumes: `p<j>` of earlier producers, and `ext` (no producer in
        /// the plan: only an outside writer opens it).
        consumes: Vec<Vec<usize>>,
        consumes_ext: Vec<bool>,
        /// Announce `ext` at this step (never, if absent).
        ext_written_at: Option<usize>,
        /// Task i names a role and no agent: anycast, claimed by a member (or not in time).
        anycast: Vec<bool>,
    }

    fn case() -> impl proptest::strategy::Strategy<Value = Case> {
        (1usize..14).prop_flat_map(|n| {
            (
                (0..n)
                    .map(|i| proptest::collection::btree_set(0..i.max(1), 0..=i.min(3)))
                    .collect::<Vec<_>>(),
                proptest::collection::vec(any::<bool>(), n),
                proptest::collection::vec(
                    proptest::collection::vec(prop::bool::weighted(0.7), 0..5),
                    n,
                ),
                1u32..4,
                0u32..3,
                prop::sample::select(vec![0.0, 0.25, 0.5, 1.0]),
                proptest::option::weighted(0.2, 0usize..30),
                proptest::collection::vec(any::<u32>(), 200),
                (
                    proptest::collection::vec(prop::bool::weighted(0.4), n),
                    (0..n)
                        .map(|i| proptest::collection::btree_set(0..i.max(1), 0..=i.min(2)))
                        .collect::<Vec<_>>(),
                    proptest::collection::vec(prop::bool::weighted(0.1), n),
                    proptest::option::weighted(0.5, 0usize..40),
                    proptest::collection::vec(prop::bool::weighted(0.3), n),
                ),
            )
                .prop_map(
                    move |(
                        sets,
                        required,
                        script,
                        max_concurrency,
                        max_retries,
                        failure_ratio,
                        cancel_at,
                        choices,
                        (produces, consume_sets, consumes_ext, ext_written_at, anycast),
                    )| Case {
                        anycast,
                        consumes: consume_sets
                            .into_iter()
                            .enumerate()
                            .map(|(i, s)| s.into_iter().filter(|&j| j < i && produces[j]).collect())
                            .collect(),
                        produces,
                        consumes_ext,
                        ext_written_at,
                        deps: sets
                            .into_iter()
                            .enumerate()
                            .map(|(i, s)| s.into_iter().filter(|&d| d < i).collect())
                            .collect(),
                        required,
                        script,
                        max_concurrency,
                        max_retries,
                        failure_ratio,
                        cancel_at,
                        choices,
                    },
                )
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn scheduler_keeps_its_invariants(c in case()) {
            let names: Vec<String> = (0..c.deps.len()).map(|i| format!("t{i}")).collect();
            let tasks: Vec<Subtask> = c.deps.iter().enumerate().map(|(i, ds)| {
                let refs: Vec<&str> = ds.iter().map(|&d| names[d].as_str()).collect();
                let mut t = Subtask::new(&names[i], "").after(&refs);
                t.required = c.required[i];
                if c.produces[i] {
                    t.produces = vec![format!("p{i}")];
                }
                t.consumes = c.consumes[i].iter().map(|j| format!("p{j}")).collect();
                if c.consumes_ext[i] {
                    t.consumes.push("ext".into());
                }
                if c.anycast[i] {
                    t.role = Some("r".into());
                }
                t
            }).collect();
            let p = plan(tasks, PlanConfig {
                max_concurrency: c.max_concurrency,
                max_retries: c.max_retries,
                failure_ratio: c.failure_ratio,
                dependency_timeout: Secs::from_secs(100_000),
                dataflow_validation: flotilla_model::plan::DataflowValidation::Lenient,
                ..PlanConfig::default()
            });
            // Topics with an entry, by the model: a producer succeeded (the machine asked for
            // its entries to be written), or the outside writer wrote `ext`.
            let mut written: std::collections::BTreeSet<String> = Default::default();
            let mut produced_by: Vec<u32> = vec![0; c.deps.len()];
            let mut timed_out: Vec<bool> = vec![false; c.deps.len()];
            let n = c.deps.len();
            let threshold = (n as f64 * c.failure_ratio).floor() as usize + 1;
            let mut cancelled_by_input = false;
            let mut cancel_attempts = 0;
            let mut s = submitted(&p);
            s.anycast = true;
            let (mut m, mut actions) = RunMachine::start(RunId::new(), &s, p.clone(), 0);
            // Anycast attempts a member claimed, and tasks whose attempt nobody claimed in time.
            let mut claimed: std::collections::BTreeSet<(u32, u32)> = Default::default();
            let mut unclaimed: Vec<bool> = vec![false; c.deps.len()];
            let mut now: i64 = 0;
            let mut in_flight: Vec<(u32, u32)> = Vec::new();
            let mut delivered: Vec<(TaskId, u32, TaskResult)> = Vec::new();
            let mut finishes = 0;
            let mut seq = 0u64;
            let mut choice = c.choices.iter().cycle();
            for step in 0..2_000 {
                for a in &actions {
                    match a {
                        Action::Dispatch { task, attempt } => {
                            // Dispatched only once every dependency succeeded.
                            for &d in &c.deps[*task as usize] {
                                prop_assert_eq!(m.state().tasks[d].status, TaskStatus::Succeeded);
                            }
                            // ... and every consumed topic has an entry.
                            for topic in &p.subtasks[*task as usize].consumes {
                                prop_assert!(written.contains(topic), "{} dispatched before {} had an entry", task, topic);
                            }
                            prop_assert!(*attempt <= c.max_retries + 1);
                            in_flight.push((*task, *attempt));
                        }
                        Action::Finish => finishes += 1,
                        Action::Produce { task } => {
                            let i = *task as usize;
                            prop_assert!(c.produces[i]);
                            prop_assert_eq!(m.state().tasks[i].status, TaskStatus::Succeeded);
                            produced_by[i] += 1;
                            written.insert(format!("p{i}"));
                        }
                        Action::CancelAttempts => {
                            cancel_attempts += 1;
                            // Everything in flight is cancelled: results for it are stale.
                            in_flight.clear();
                        }
                        Action::Withdraw { task, attempt } => {
                            // Only an anycast attempt in flight, unclaimed, past its bound.
                            let i = *task as usize;
                            prop_assert!(c.anycast[i]);
                            prop_assert!(!claimed.contains(&(*task, *attempt)));
                            let at = in_flight.iter().position(|x| *x == (*task, *attempt));
                            prop_assert!(at.is_some(), "withdrew {:?}, not in flight", (task, attempt));
                            in_flight.retain(|x| *x != (*task, *attempt));
                            let t = &m.state().tasks[i];
                            prop_assert!(now - t.dispatched_ms >= p.config.dependency_timeout.get().as_millis() as i64);
                            prop_assert_eq!(t.error.as_ref().map(|e| e.kind), Some(TaskErrorKind::RoleUnclaimed));
                            unclaimed[i] = true;
                        }
                        _ => {}
                    }
                }
                prop_assert!(m.in_flight() <= c.max_concurrency);
                prop_assert_eq!(m.in_flight() as usize, in_flight.len());
                // A task that fails without ever starting timed out waiting: a dependency had
                // not succeeded or a consumed topic had no entry when it failed.
                for (i, t) in m.state().tasks.iter().enumerate() {
                    if t.status == TaskStatus::Failed && t.attempt == 0 && !timed_out[i] {
                        timed_out[i] = true;
                        prop_assert_eq!(t.error.as_ref().map(|e| e.kind), Some(TaskErrorKind::DependencyTimeout));
                        let waiting_dep = c.deps[i].iter().any(|&d| m.state().tasks[d].status != TaskStatus::Succeeded);
                        let waiting_topic = p.subtasks[i].consumes.iter().any(|t| !written.contains(t));
                        prop_assert!(waiting_dep || waiting_topic, "t{} timed out with nothing to wait for", i);
                    }
                }
                if m.state().status.is_terminal() {
                    break;
                }
                if c.cancel_at == Some(step) {
                    cancelled_by_input = true;
                    actions = m.apply(Input::Cancel { reason: "test", rollback: false }, now);
                    continue;
                }
                if c.ext_written_at == Some(step) {
                    written.insert("ext".into());
                    actions = m.apply(Input::TopicWritten { topic: "ext" }, now);
                    continue;
                }
                let pick = *choice.next().unwrap_or(&0);
                now += 1 + i64::from(pick % 500);
                // Now and then a member claims an anycast attempt in flight (a claim of an
                // attempt already claimed, or of a pool task, changes nothing).
                if pick % 5 == 1 && !in_flight.is_empty() {
                    let (task, attempt) = in_flight[pick as usize % in_flight.len()];
                    let id = TaskId::new(names[task as usize].as_str());
                    let before = m.state().clone();
                    let a = m.apply(Input::Claimed { task: &id, attempt }, now);
                    prop_assert!(a.is_empty(), "a claim decides nothing: {:?}", a);
                    if c.anycast[task as usize] && claimed.insert((task, attempt)) {
                        prop_assert_eq!(m.state().tasks[task as usize].claimed, attempt);
                    } else {
                        prop_assert_eq!(m.state(), &before);
                    }
                    actions = Vec::new();
                    continue;
                }
                // And now and then the run's timer fires while attempts are in flight.
                if pick % 13 == 0 && let Some(t) = m.state().timer {
                    now = now.max(t.due_ms);
                    actions = m.apply(Input::Timer { generation: t.generation }, now);
                    continue;
                }
                if !in_flight.is_empty() {
                    let (task, attempt) = in_flight.remove(pick as usize % in_flight.len());
                    let success = c.script[task as usize].get(attempt as usize - 1).copied().unwrap_or(true);
                    let r = if success {
                        TaskResult::success("ok")
                    } else {
                        TaskResult::failure(TaskErrorKind::AgentFailed, "scripted failure")
                    };
                    let id = TaskId::new(names[task as usize].as_str());
                    seq += 1;
                    actions = m.apply(Input::Result { task: &id, attempt, result: &r, seq, worker: None, started_at: None, agent: None }, now);
                    delivered.push((id, attempt, r));
                    // Redeliver an old result now and then: it must change nothing.
                    if pick % 3 == 0 {
                        let (id, attempt, r) = &delivered[pick as usize % delivered.len()];
                        let before = m.state().clone();
                        let dup = m.apply(Input::Result { task: id, attempt: *attempt, result: r, seq: 999_999, worker: None, started_at: None, agent: None }, now);
                        prop_assert!(dup.is_empty());
                        prop_assert_eq!(m.state(), &before);
                    }
                } else if let Some(t) = m.state().timer {
                    now = now.max(t.due_ms);
                    actions = m.apply(Input::Timer { generation: t.generation }, now);
                } else {
                    prop_assert!(false, "stuck: nothing in flight, no timer, run not terminal: {:?}", m.state());
                }
            }
            let s = m.state();
            prop_assert!(s.status.is_terminal(), "run ended");
            prop_assert_eq!(finishes, 1);
            prop_assert!(cancel_attempts <= 1);
            let failed = s.tasks.iter().filter(|t| t.status == TaskStatus::Failed).count();
            let cancelled = s.tasks.iter().filter(|t| t.status == TaskStatus::Cancelled).count();
            // Model: the failure policy aborts exactly when failures reach the threshold, and
            // then no more tasks fail.
            let aborted = failed >= threshold;
            prop_assert!(failed <= threshold, "no failure after the abort: {} > {}", failed, threshold);
            if s.status == RunStatus::Cancelled {
                prop_assert!(cancelled_by_input);
                prop_assert!(!aborted);
            } else if aborted {
                prop_assert_eq!(s.status, RunStatus::Failed);
                let reason = s.outcome.as_ref().and_then(|o| o.reason.clone()).unwrap_or_default();
                // Stopped early (tasks were left and got cancelled), or at the very end.
                prop_assert_eq!(reason.starts_with("aborted:"), cancelled > 0, "{}", reason);
                prop_assert!(reason.contains("failure threshold") || s.tasks.iter().zip(&c.required).any(|(t, &r)| r && matches!(t.status, TaskStatus::Failed | TaskStatus::Skipped)), "{}", reason);
            } else {
                // The run fails exactly when a required task failed or was skipped.
                prop_assert_eq!(cancelled, 0, "only cancel and abort cancel tasks");
                let doomed = s.tasks.iter().zip(&c.required).any(|(t, &req)| req && matches!(t.status, TaskStatus::Failed | TaskStatus::Skipped));
                prop_assert_eq!(s.status == RunStatus::Failed, doomed);
            }
            for (i, t) in s.tasks.iter().enumerate() {
                prop_assert!(t.status.is_terminal());
                // Automatic produce happens exactly once per succeeded producer.
                let produced = u32::from(c.produces[i] && t.status == TaskStatus::Succeeded);
                prop_assert_eq!(produced_by[i], produced, "produce count of t{}", i);
                if t.status == TaskStatus::Failed && t.attempt == 0 {
                    // Never started: checked when it timed out (above).
                    prop_assert!(timed_out[i]);
                } else if t.status == TaskStatus::Failed && unclaimed[i] {
                    // No member claimed its last attempt in time (checked when withdrawn).
                    prop_assert_eq!(t.error.as_ref().map(|e| e.kind), Some(TaskErrorKind::RoleUnclaimed));
                } else if t.status == TaskStatus::Failed {
                    // A task fails only after exhausting its script's failures within the retry budget.
                    prop_assert_eq!(t.attempt, c.max_retries + 1);
                    prop_assert!(c.script[i].iter().take(t.attempt as usize).all(|ok| !ok));
                }
                // Skipped tasks depend (transitively, through dependencies or topics) on a
                // failed one and never ran.
                if t.status == TaskStatus::Skipped {
                    prop_assert_eq!(t.attempt, 0);
                    prop_assert!(t.cause.is_some_and(|c| s.tasks[c as usize].status == TaskStatus::Failed));
                }
            }
        }
    }
}

/// Bare queries: the planning phase (planner task, review, repair, planned plan) driven
/// through the machine with scripted planner outcomes.
mod planning {
    use super::*;
    use flotilla_coordinator::planner::{PlannerOptions, planning_plan};
    use flotilla_model::plan::StrategyChoice;
    use flotilla_model::run::PlanningStatus;
    use flotilla_model::runlog::{PlanDecision, PlanningSpec};
    use flotilla_model::validate::{Problem, ProblemCode, ValidationContext};
    use proptest::prelude::{
        Just, TestCaseError, prop_assert, prop_assert_eq, prop_oneof, proptest,
    };
    use proptest::test_runner::Config as ProptestConfig;

    /// What happens to one planner round.
    #[derive(Debug, Clone, Copy)]
    enum Round {
        /// The planner task fails for good.
        TaskFails,
        /// It answers with problems.
        Problems,
        /// It answers with a valid plan.
        Valid,
    }

    fn round() -> impl proptest::strategy::Strategy<Value = Round> {
        prop_oneof![
            1 => Just(Round::TaskFails),
            3 => Just(Round::Problems),
            3 => Just(Round::Valid),
        ]
    }

    fn planned(n: usize) -> Plan {
        let tasks: Vec<Subtask> = (0..n)
            .map(|i| {
                let t = Subtask::new(&format!("s{i}"), "step");
                if i > 0 { t.after(&["s0"]) } else { t }
            })
            .collect();
        Plan {
            name: Some("planned".into()),
            query: Some("q".into()),
            subtasks: tasks,
            config: PlanConfig::default(),
        }
    }

    fn start(max_repairs: u32) -> (RunMachine, Vec<Action>) {
        let opts = PlannerOptions {
            agent: Some("planner".into()),
            ..PlannerOptions::default()
        };
        let p = Arc::new(planning_plan(
            "q",
            &opts,
            &ValidationContext::default(),
            1,
            &[],
            None,
        ));
        let mut s = submitted(&p);
        s.planning = Some(PlanningSpec {
            query: "q".into(),
            max_repairs,
        });
        RunMachine::start(RunId::from_uuid(uuid::Uuid::from_u128(42)), &s, p, 0)
    }

    /// Drives a run through `script`; returns the machine, every input's actions, and the
    /// decisions applied (for replay).
    fn drive(
        script: &[Round],
        max_repairs: u32,
        n: usize,
    ) -> Result<(RunMachine, usize), TestCaseError> {
        let (mut m, actions) = start(max_repairs);
        prop_assert!(m.state().strategy.is_none(), "no strategy before a plan");
        prop_assert_eq!(dispatched(&actions), vec![(0, 1)]);
        let mut finishes = 0;
        let mut seq = 100;
        let problems = vec![Problem::new(
            ProblemCode::UnknownDependency,
            "subtasks[0]",
            "x",
        )];
        for (r, step) in script.iter().enumerate() {
            let round = r as u32 + 1;
            prop_assert_eq!(m.state().planning.as_ref().map(|p| p.round), Some(round));
            let id = m.plan().subtasks[0].id.clone();
            prop_assert_eq!(id.as_str(), format!("_plan-{round}"));
            seq += 1;
            let answer = match step {
                Round::TaskFails => TaskResult::failure(TaskErrorKind::InvalidOutput, "bad"),
                _ => TaskResult::success("{}"),
            };
            let t = (id, answer);
            let actions = m.apply(result_of(&t, seq), seq as i64);
            if let Round::TaskFails = step {
                prop_assert!(actions.contains(&Action::Finish));
                prop_assert_eq!(m.state().status, RunStatus::Failed);
                prop_assert_eq!(
                    m.state().planning.as_ref().map(|p| p.status),
                    Some(PlanningStatus::Failed)
                );
                return Ok((m, 1));
            }
            prop_assert_eq!(
                actions
                    .iter()
                    .filter(|a| matches!(a, Action::ReviewPlan { .. }))
                    .count(),
                1
            );
            let review = Action::ReviewPlan { round };
            prop_assert!(actions.contains(&review));
            prop_assert!(
                !actions.contains(&Action::Finish),
                "the run waits for the review"
            );
            // A stale review (an earlier round) changes nothing.
            if round > 1 {
                let stale = PlanDecision::Failed {
                    problems: problems.clone(),
                };
                let before = m.state().clone();
                let stale_input = Input::Planned {
                    round: round - 1,
                    decision: &stale,
                    seq: 1,
                };
                prop_assert!(m.apply(stale_input, 0).is_empty());
                prop_assert_eq!(m.state(), &before);
            }
            let decision = match step {
                Round::Valid => PlanDecision::Accepted {
                    plan: planned(n),
                    warnings: Vec::new(),
                },
                _ if round > max_repairs => PlanDecision::Failed {
                    problems: problems.clone(),
                },
                _ => {
                    let opts = PlannerOptions {
                        agent: Some("planner".into()),
                        ..PlannerOptions::default()
                    };
                    PlanDecision::Repair {
                        plan: planning_plan(
                            "q",
                            &opts,
                            &ValidationContext::default(),
                            round + 1,
                            &problems,
                            None,
                        ),
                        problems: problems.clone(),
                    }
                }
            };
            seq += 1;
            let plan_seq = seq;
            let actions = m.apply(
                Input::Planned {
                    round,
                    decision: &decision,
                    seq: plan_seq,
                },
                seq as i64,
            );
            // The same review again changes nothing.
            let before = m.state().clone();
            let again = Input::Planned {
                round,
                decision: &decision,
                seq: plan_seq,
            };
            prop_assert!(m.apply(again, 0).is_empty());
            prop_assert_eq!(m.state(), &before);
            // Restoring from the plan at `plan_seq` rebuilds the same machine.
            let restored = RunMachine::restore(Arc::clone(m.plan()), m.state().clone());
            prop_assert_eq!(restored.state(), m.state());
            match decision {
                PlanDecision::Failed { .. } => {
                    prop_assert!(actions.contains(&Action::Finish));
                    prop_assert_eq!(m.state().status, RunStatus::Failed);
                    prop_assert_eq!(&m.state().errors, &problems);
                    let reason = m
                        .state()
                        .outcome
                        .as_ref()
                        .and_then(|o| o.reason.clone())
                        .unwrap_or_default();
                    prop_assert!(reason.starts_with("planning_failed"), "{}", reason);
                    prop_assert!(
                        m.final_tasks().is_empty() && m.succeeded_tasks().is_empty(),
                        "the planner's answer is no result"
                    );
                    return Ok((m, 1));
                }
                PlanDecision::Repair { .. } => {
                    prop_assert_eq!(phases(&actions), vec![WorkflowPhase::PlanRepairing]);
                    prop_assert_eq!(dispatched(&actions), vec![(0, 1)]);
                    prop_assert_eq!(m.state().plan_seq, plan_seq);
                }
                PlanDecision::Accepted { plan, .. } => {
                    prop_assert_eq!(phases(&actions), vec![WorkflowPhase::RunPlanned]);
                    prop_assert_eq!(m.plan().as_ref(), &plan);
                    prop_assert_eq!(m.state().plan_seq, plan_seq);
                    prop_assert_eq!(m.state().strategy.clone(), Some(StrategyChoice::of(&plan)));
                    prop_assert_eq!(m.state().tasks.len(), n);
                    prop_assert_eq!(dispatched(&actions), vec![(0, 1)]);
                    // Run the planned tasks to the end.
                    let mut pending: Vec<(u32, u32)> = dispatched(&actions);
                    while let Some((task, attempt)) = pending.pop() {
                        seq += 1;
                        let t = (
                            plan.subtasks[task as usize].id.clone(),
                            TaskResult::success("done"),
                        );
                        let a = m.apply(result(&t, attempt, seq), seq as i64);
                        finishes += a.iter().filter(|x| **x == Action::Finish).count();
                        let reviews = a
                            .iter()
                            .filter(|x| matches!(x, Action::ReviewPlan { .. }))
                            .count();
                        prop_assert_eq!(reviews, 0);
                        pending.extend(dispatched(&a));
                    }
                    prop_assert_eq!(m.state().status, RunStatus::Succeeded);
                    prop_assert_eq!(
                        m.state().planning.as_ref().map(|p| p.status),
                        Some(PlanningStatus::Planned)
                    );
                    return Ok((m, finishes));
                }
            }
        }
        Ok((m, 0))
    }

    fn result_of(t: &(TaskId, TaskResult), seq: u64) -> Input<'_> {
        result(t, 1, seq)
    }

    #[test]
    fn a_plan_run_records_its_strategy_and_never_reviews() {
        let one = plan(vec![Subtask::new("a", "")], PlanConfig::default());
        let (m, actions) = RunMachine::start(RunId::new(), &submitted(&one), one.clone(), 0);
        assert_eq!(
            m.state().strategy.as_ref().map(|s| s.strategy),
            Some(Strategy::Simple)
        );
        assert!(
            !actions
                .iter()
                .any(|a| matches!(a, Action::ReviewPlan { .. }))
        );
        let many = plan(diamond(), PlanConfig::default());
        let (m, _) = RunMachine::start(RunId::new(), &submitted(&many), many.clone(), 0);
        assert_eq!(
            m.state().strategy.as_ref().map(|s| s.strategy),
            Some(Strategy::Dag)
        );
        let explicit = plan(
            diamond(),
            PlanConfig {
                strategy: Strategy::Simple,
                ..PlanConfig::default()
            },
        );
        let (m, _) = RunMachine::start(RunId::new(), &submitted(&explicit), explicit.clone(), 0);
        let choice = m.state().strategy.clone().expect("recorded");
        assert_eq!(choice.strategy, Strategy::Simple);
        assert_eq!(choice.reason, "requested by the plan");
    }

    #[test]
    fn cancelling_while_reviewing_fails_planning() {
        let (mut m, _) = start(2);
        let t = (TaskId::new("_plan-1"), TaskResult::success("{}"));
        m.apply(result_of(&t, 5), 5);
        let actions = m.apply(
            Input::Cancel {
                reason: "stop",
                rollback: false,
            },
            6,
        );
        assert!(actions.contains(&Action::Finish));
        assert_eq!(m.state().status, RunStatus::Cancelled);
        assert_eq!(
            m.state().planning.as_ref().map(|p| p.status),
            Some(PlanningStatus::Failed)
        );
        let late = PlanDecision::Accepted {
            plan: planned(2),
            warnings: Vec::new(),
        };
        assert!(
            m.apply(
                Input::Planned {
                    round: 1,
                    decision: &late,
                    seq: 9
                },
                7
            )
            .is_empty()
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn planning_reviews_once_per_round_and_finishes_once(
            script in proptest::collection::vec(round(), 1..6),
            max_repairs in 0u32..4,
            n in 1usize..5,
        ) {
            let (m, finishes) = drive(&script, max_repairs, n)?;
            prop_assert!(m.state().status.is_terminal() || m.state().planning.as_ref().is_some_and(|p| p.status == PlanningStatus::Planning));
            if m.state().status.is_terminal() {
                prop_assert_eq!(finishes, 1);
            }
            // Replaying the same script reaches the same state.
            let (again, _) = drive(&script, max_repairs, n)?;
            prop_assert_eq!(again.state(), m.state());
        }
    }
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

fn armed(actions: &[Action]) -> Vec<(u64, i64)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::ArmTimer { generation, due_ms } => Some((*generation, *due_ms)),
            _ => None,
        })
        .collect()
}

/// Whether a pause, resume or takeover changes the run is the machine's decision, and
/// [`RunMachine::check_control`] says it before the input is applied — the same answer
/// `apply` gives (actions or none) — and why not: a second pause right after the first, a
/// takeover twice, a resume of a running run, a pause under human control, a task paused
/// twice or resumed while not paused, the lead lifting a person's pause, no such task, an
/// ended run.
#[test]
fn the_machine_says_why_a_control_changes_nothing() {
    use flotilla_machine::Unchanged;
    use flotilla_model::runlog::ControlAction::{self, Pause, Resume, Takeover};
    let p = plan(
        vec![Subtask::new("a", ""), Subtask::new("b", "").after(&["a"])],
        PlanConfig::default(),
    );
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    let (a, ghost) = (TaskId::new("a"), TaskId::new("ghost"));
    // Checks, then applies: both say the same.
    let step = |m: &mut RunMachine,
                action: ControlAction,
                task: Option<&TaskId>,
                by: &str,
                now_ms: i64|
     -> Result<(), Unchanged> {
        let checked = m.check_control(action, task, Some(by));
        let actions = m.apply(
            Input::Control {
                action,
                by: Some(by),
                reason: None,
                timeout_ms: Some(60_000),
                task,
            },
            now_ms,
        );
        assert_eq!(
            checked.is_ok(),
            !actions.is_empty(),
            "{checked:?} {actions:?}"
        );
        checked
    };
    assert_eq!(step(&mut m, Pause, None, "alice", 1_000), Ok(()));
    let again = step(&mut m, Pause, None, "bob", 1_001).expect_err("already paused");
    assert_eq!(
        again,
        Unchanged::Run {
            action: Pause,
            status: RunStatus::Paused,
            by: Some("alice".into()),
            until_ms: Some(61_000),
        }
    );
    assert!(
        again
            .to_string()
            .starts_with("the run is already paused by alice until"),
        "{again}"
    );
    assert_eq!(step(&mut m, Takeover, None, "alice", 2_000), Ok(()));
    let twice = step(&mut m, Takeover, None, "bob", 2_001).expect_err("already taken over");
    assert!(
        twice
            .to_string()
            .contains("already under human control by alice"),
        "{twice}"
    );
    let pause = step(&mut m, Pause, None, "bob", 2_002).expect_err("a takeover stands");
    assert!(
        pause.to_string().contains("a pause does not apply"),
        "{pause}"
    );
    assert_eq!(step(&mut m, Resume, None, "alice", 3_000), Ok(()));
    let resume = step(&mut m, Resume, None, "alice", 3_001).expect_err("nothing holds it");
    assert_eq!(
        resume,
        Unchanged::Run {
            action: Resume,
            status: RunStatus::Running,
            by: None,
            until_ms: None,
        }
    );
    // One task's pause and resume.
    assert_eq!(step(&mut m, Pause, Some(&a), "alice", 4_000), Ok(()));
    assert_eq!(
        step(&mut m, Pause, Some(&a), "alice", 4_001),
        Err(Unchanged::Task {
            action: Pause,
            task: a.clone(),
            until_ms: Some(64_000),
        })
    );
    assert_eq!(
        step(
            &mut m,
            Resume,
            Some(&a),
            flotilla_model::lead::LEAD_NAME,
            4_002
        ),
        Err(Unchanged::PausedByPerson(a.clone()))
    );
    assert_eq!(step(&mut m, Resume, Some(&a), "alice", 4_003), Ok(()));
    assert_eq!(
        step(&mut m, Resume, Some(&a), "alice", 4_004),
        Err(Unchanged::Task {
            action: Resume,
            task: a.clone(),
            until_ms: None,
        })
    );
    assert_eq!(
        step(&mut m, Pause, Some(&ghost), "alice", 4_005),
        Err(Unchanged::NoSuchTask(ghost.clone()))
    );
    // An ended run changes no more.
    m.apply(
        Input::Cancel {
            reason: "enough",
            rollback: false,
        },
        5_000,
    );
    assert_eq!(
        step(&mut m, Pause, None, "alice", 5_001),
        Err(Unchanged::Ended(RunStatus::Cancelled))
    );
}

/// A hold stops every wait's clock: a dependency deadline that passes while the run is paused
/// fails nothing; on resume the wait gets its full timeout again; a running attempt's result
/// applies while paused but its dependent is dispatched only on resume; a takeover's deadline
/// cancels the run.
#[test]
fn a_hold_stops_the_clocks_and_dispatch_and_its_deadline_applies_its_default() {
    use flotilla_model::runlog::ControlAction;
    let tasks = vec![
        Subtask::new("slow", ""),
        Subtask::new("next", "").after(&["slow"]),
        Subtask::new("last", "").after(&["next"]),
    ];
    let p = plan(
        tasks,
        PlanConfig {
            dependency_timeout: Secs::from_secs(10),
            ..PlanConfig::default()
        },
    );
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    let pause = |timeout_ms| Input::Control {
        action: ControlAction::Pause,
        by: Some("alice"),
        reason: None,
        timeout_ms,
        task: None,
    };
    let actions = m.apply(pause(Some(60_000)), 1_000);
    assert_eq!(m.state().status, RunStatus::Paused);
    assert_eq!(phases(&actions), vec![WorkflowPhase::RunPaused]);
    // A second pause changes nothing.
    assert!(m.apply(pause(None), 1_500).is_empty());
    // next's dependency deadline (10 s) passes while paused: nothing fails.
    let timer = m.state().timer.expect("next's dependency clock is armed");
    assert_eq!(timer.due_ms, 10_000);
    let actions = m.apply(
        Input::Timer {
            generation: timer.generation,
        },
        10_000,
    );
    assert_eq!(
        m.state().tasks[1].status,
        TaskStatus::Waiting,
        "{actions:?}"
    );
    assert_eq!(
        m.state().timer.map(|t| t.due_ms),
        Some(61_000),
        "only the pause's deadline is clocked while held"
    );
    // The running attempt's result applies; its dependent waits for the resume.
    let slow = ok("slow");
    let actions = m.apply(result(&slow, 1, 5), 20_000);
    assert_eq!(m.state().tasks[0].status, TaskStatus::Succeeded);
    assert!(dispatched(&actions).is_empty(), "{actions:?}");
    // Resumed: next is dispatched now, and last's clock gives a full 10 s from the resume.
    let actions = m.apply(
        Input::Control {
            action: ControlAction::Resume,
            by: Some("alice"),
            reason: None,
            timeout_ms: None,
            task: None,
        },
        30_000,
    );
    assert_eq!(m.state().status, RunStatus::Running);
    assert_eq!(dispatched(&actions), vec![(1, 1)]);
    assert!(phases(&actions).contains(&WorkflowPhase::RunResumed));
    assert!(
        armed(&actions).iter().all(|&(_, due)| due >= 40_000),
        "{actions:?}"
    );

    // Taken over with a 5 s deadline: at it the run is cancelled.
    let actions = m.apply(
        Input::Control {
            action: ControlAction::Takeover,
            by: Some("bob"),
            reason: Some("stuck"),
            timeout_ms: Some(5_000),
            task: None,
        },
        31_000,
    );
    assert_eq!(m.state().status, RunStatus::HumanControl);
    assert_eq!(phases(&actions), vec![WorkflowPhase::RunTakenOver]);
    let generation = m.state().timer.map(|t| t.generation).unwrap_or_default();
    assert_eq!(m.state().timer.map(|t| t.due_ms), Some(36_000));
    let actions = m.apply(Input::Timer { generation }, 36_000);
    assert_eq!(m.state().status, RunStatus::Cancelled);
    assert!(actions.contains(&Action::CancelAttempts));
    assert!(actions.contains(&Action::Finish));
}

/// An attempt that suspends at a tool call gives its slot back (the next ready task runs with
/// `max_concurrency` 1), waits as an approval of call 1, ignores a repeated or stale
/// suspension, and any decision dispatches the same attempt again — also after a restore.
#[test]
fn a_suspended_attempt_frees_its_slot_and_continues_the_same_attempt() {
    use flotilla_model::approval::{ApprovalDecided, ApprovalStatus, Decision, Trigger};
    use flotilla_model::ids::AttemptId;
    use flotilla_model::runlog::{Suspended, SuspendedCall};
    let p = plan(
        vec![Subtask::new("mail", ""), Subtask::new("other", "")],
        PlanConfig {
            max_concurrency: 1,
            ..PlanConfig::default()
        },
    );
    let (mut m, actions) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 1_000);
    assert_eq!(dispatched(&actions), vec![(0, 1)]);
    let suspended = |segment: u32| Suspended {
        task_id: TaskId::new("mail"),
        attempt: 1,
        attempt_id: AttemptId::new(),
        worker: "w1".into(),
        segment,
        call: Some(SuspendedCall {
            trigger: Trigger::SensitiveAction,
            call_id: "call_1".into(),
            tool: "send_email".into(),
            arguments: serde_json::json!({"to": "ana"}),
            digest: "ab".into(),
            question: None,
        }),
    };
    let first = suspended(0);
    let actions = m.apply(
        Input::Suspended {
            suspended: &first,
            seq: 7,
        },
        1_100,
    );
    assert_eq!(
        dispatched(&actions),
        vec![(1, 1)],
        "the slot went to the next task"
    );
    assert!(actions.iter().any(|a| matches!(
        a,
        Action::RequestApproval {
            task: 0,
            attempt: 1,
            call: 1,
            from_seq: 7,
            ..
        }
    )));
    assert_eq!(m.state().tasks[0].status, TaskStatus::AwaitingApproval);
    let before = m.state().clone();
    assert!(
        m.apply(
            Input::Suspended {
                suspended: &first,
                seq: 8
            },
            1_150
        )
        .is_empty(),
        "the same suspension again"
    );
    let stale = suspended(3);
    assert!(
        m.apply(
            Input::Suspended {
                suspended: &stale,
                seq: 9
            },
            1_160
        )
        .is_empty(),
        "a segment that is not running"
    );
    assert_eq!(m.state(), &before);
    // Restored from its record, the machine applies the decision alike.
    let bytes = rmp_serde::to_vec_named(m.state()).expect("encode");
    let mut m = RunMachine::restore(p.clone(), rmp_serde::from_slice(&bytes).expect("decode"));
    let other = ok("other");
    m.apply(result(&other, 1, 10), 1_200);
    let decided = ApprovalDecided {
        approval_id: "t0a1c1".into(),
        task_id: TaskId::new("mail"),
        attempt: 1,
        status: ApprovalStatus::Decided,
        decision: Decision::Reject {
            message: "no".into(),
        },
        by: "alice".into(),
        tool_call: None,
        digest: None,
        incident: false,
    };
    let actions = m.apply(
        Input::ApprovalDecided {
            decided: &decided,
            seq: 11,
        },
        1_300,
    );
    assert_eq!(
        dispatched(&actions),
        vec![(0, 1)],
        "a rejection of a call continues the attempt: the model reads it"
    );
    let t = &m.state().tasks[0];
    assert_eq!((t.attempt, t.suspensions, t.attempt_ms), (1, 1, 1_000));
    assert_eq!(t.decisions, vec![11]);
    // The continued attempt's result ends the run.
    let mail = ok("mail");
    let actions = m.apply(result(&mail, 1, 12), 1_400);
    assert!(actions.contains(&Action::Finish));
    assert_eq!(m.state().status, RunStatus::Succeeded);
}

/// A hold tells the workers (`HoldAttempts`); an LLM attempt that stops at a step boundary
/// because its run is held (a `suspended` input without a call) frees its slot, waits without
/// an approval, and the resume dispatches the same attempt again. A suspension that arrives
/// after the resume is dispatched again at once; a repeated one changes nothing; ending the
/// run while held lifts the hold.
#[test]
fn a_held_runs_attempt_stops_at_a_step_and_the_resume_continues_it() {
    use flotilla_model::ids::AttemptId;
    use flotilla_model::runlog::{ControlAction, Suspended};
    let p = plan(
        vec![Subtask::new("write", ""), Subtask::new("other", "")],
        PlanConfig {
            max_concurrency: 1,
            ..PlanConfig::default()
        },
    );
    let (mut m, actions) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 1_000);
    assert_eq!(dispatched(&actions), vec![(0, 1)]);
    let control = |action| Input::Control {
        action,
        by: Some("ops"),
        reason: None,
        timeout_ms: None,
        task: None,
    };
    let actions = m.apply(control(ControlAction::Pause), 1_100);
    assert!(
        actions.contains(&Action::HoldAttempts { held: true }),
        "{actions:?}"
    );
    let held = |segment: u32| Suspended {
        task_id: TaskId::new("write"),
        attempt: 1,
        attempt_id: AttemptId::new(),
        worker: "w1".into(),
        segment,
        call: None,
    };
    let first = held(0);
    let actions = m.apply(
        Input::Suspended {
            suspended: &first,
            seq: 7,
        },
        1_200,
    );
    assert!(phases(&actions).contains(&WorkflowPhase::TaskSuspended));
    assert!(dispatched(&actions).is_empty(), "nothing runs while paused");
    let t = &m.state().tasks[0];
    assert_eq!(t.status, TaskStatus::Waiting);
    assert!(t.approval.is_none(), "a held stop asks nobody");
    assert!(
        m.apply(
            Input::Suspended {
                suspended: &first,
                seq: 8,
            },
            1_300,
        )
        .is_empty(),
        "a repeated suspension changes nothing"
    );
    // Resumed: the same attempt goes out again (its slot was free all along).
    let actions = m.apply(control(ControlAction::Resume), 2_000);
    assert!(actions.contains(&Action::HoldAttempts { held: false }));
    assert_eq!(dispatched(&actions), vec![(0, 1)]);
    assert_eq!(m.state().tasks[0].attempt_started_ms(), 1_000);
    // A stop that reaches the run after it resumed: dispatched again at once.
    let actions = m.apply(
        Input::Suspended {
            suspended: &held(1),
            seq: 9,
        },
        2_100,
    );
    assert_eq!(dispatched(&actions), vec![(0, 1)]);
    // Paused again and cancelled while held: the hold is lifted with the run.
    m.apply(control(ControlAction::Pause), 2_200);
    let actions = m.apply(
        Input::Cancel {
            reason: "enough",
            rollback: false,
        },
        2_300,
    );
    assert!(
        actions.contains(&Action::HoldAttempts { held: false }),
        "{actions:?}"
    );
}

/// One task paused by itself (a lead's `pause_member`, `run.pause` with a task): the rest of
/// the run goes on; the paused task is not dispatched when its dependency succeeds, and its
/// dependency clock stands still; a running paused task's workers are told (`HoldTask`) and
/// its attempt, stopped at a step, waits; resume dispatches the same attempt again; the
/// pause's deadline resumes it; repeats change nothing; the run's end lifts the task's hold.
#[test]
fn a_paused_task_waits_while_the_rest_of_the_run_goes_on() {
    use flotilla_model::ids::AttemptId;
    use flotilla_model::runlog::{ControlAction, Suspended};
    let tasks = vec![
        Subtask::new("a", ""),
        Subtask::new("b", "").after(&["a"]),
        Subtask::new("c", ""),
        Subtask::new("d", "").after(&["c"]),
    ];
    let p = plan(
        tasks,
        PlanConfig {
            dependency_timeout: Secs::from_secs(10),
            ..PlanConfig::default()
        },
    );
    let (mut m, actions) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    assert_eq!(dispatched(&actions), vec![(0, 1), (2, 1)]);
    fn control(action: ControlAction, task: &TaskId, timeout_ms: Option<u64>) -> Input<'_> {
        Input::Control {
            action,
            by: Some("lead"),
            reason: Some("hold on"),
            timeout_ms,
            task: Some(task),
        }
    }
    let (b, c) = (&TaskId::new("b"), &TaskId::new("c"));
    // b waits for a: paused, it is not dispatched when a succeeds; the run runs on.
    let actions = m.apply(control(ControlAction::Pause, b, Some(60_000)), 100);
    assert_eq!(phases(&actions), vec![WorkflowPhase::TaskPaused]);
    assert!(
        !actions.iter().any(|a| matches!(a, Action::HoldTask { .. })),
        "b never ran: no worker to tell {actions:?}"
    );
    assert!(m.state().tasks[1].paused());
    assert_eq!(m.state().status, RunStatus::Running);
    assert!(
        m.apply(control(ControlAction::Pause, b, None), 150)
            .is_empty(),
        "a second pause changes nothing"
    );
    let a = ok("a");
    let actions = m.apply(result(&a, 1, 5), 1_000);
    assert!(dispatched(&actions).is_empty(), "{actions:?}");
    // Its dependency clock stands still: nothing fails at 10 s.
    if let Some(timer) = m.state().timer.filter(|t| t.due_ms <= 20_000) {
        m.apply(
            Input::Timer {
                generation: timer.generation,
            },
            timer.due_ms,
        );
    }
    assert_eq!(m.state().tasks[1].status, TaskStatus::Waiting);
    // c is running: paused, its workers are told; its attempt stops at a step and waits.
    let actions = m.apply(control(ControlAction::Pause, c, Some(5_000)), 2_000);
    assert!(
        actions.contains(&Action::HoldTask {
            task: 2,
            held: true
        }),
        "{actions:?}"
    );
    let stop = Suspended {
        task_id: TaskId::new("c"),
        attempt: 1,
        attempt_id: AttemptId::new(),
        worker: "w1".into(),
        segment: 0,
        call: None,
    };
    let actions = m.apply(
        Input::Suspended {
            suspended: &stop,
            seq: 9,
        },
        2_100,
    );
    assert!(phases(&actions).contains(&WorkflowPhase::TaskSuspended));
    assert!(dispatched(&actions).is_empty());
    assert!(
        !actions.iter().any(|a| matches!(
            a,
            Action::HoldTask { held: false, .. } | Action::HoldAttempts { .. }
        )),
        "the task's hold stays while it is paused {actions:?}"
    );
    // c's pause deadline (5 s) passes: it resumes by itself, the same attempt continues.
    let due = m.state().timer.map(|t| t.due_ms);
    assert_eq!(due, Some(7_000), "the earliest deadline is c's pause");
    let generation = m.state().timer.map(|t| t.generation).unwrap_or_default();
    let actions = m.apply(Input::Timer { generation }, 7_000);
    assert!(phases(&actions).contains(&WorkflowPhase::TaskResumed));
    assert!(actions.contains(&Action::HoldTask {
        task: 2,
        held: false
    }));
    assert_eq!(dispatched(&actions), vec![(2, 1)]);
    // b resumed by hand: dispatched now (its dependency succeeded long ago).
    let actions = m.apply(control(ControlAction::Resume, b, None), 8_000);
    assert!(phases(&actions).contains(&WorkflowPhase::TaskResumed));
    assert_eq!(dispatched(&actions), vec![(1, 1)]);
    assert!(
        m.apply(control(ControlAction::Resume, b, None), 8_100)
            .is_empty(),
        "a second resume changes nothing"
    );
    // Paused while running, then the run is cancelled: the task's hold is lifted with it.
    m.apply(control(ControlAction::Pause, b, None), 8_200);
    let actions = m.apply(
        Input::Cancel {
            reason: "enough",
            rollback: false,
        },
        8_300,
    );
    assert!(
        actions.contains(&Action::HoldTask {
            task: 1,
            held: false
        }),
        "{actions:?}"
    );
    // Unknown and ended tasks change nothing.
    let ghost = TaskId::new("ghost");
    assert!(
        m.apply(control(ControlAction::Pause, &ghost, None), 9_000)
            .is_empty()
    );
}

/// The lead lifts its own pause of a member but not a person's; a person lifts either.
#[test]
fn the_lead_does_not_lift_a_persons_pause() {
    use flotilla_model::runlog::ControlAction;
    let p = plan(
        vec![Subtask::new("a", ""), Subtask::new("b", "").after(&["a"])],
        PlanConfig::default(),
    );
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    let b = TaskId::new("b");
    let control = |action, by| Input::Control {
        action,
        by: Some(by),
        reason: None,
        timeout_ms: None,
        task: Some(&b),
    };
    m.apply(control(ControlAction::Pause, "alice"), 10);
    assert!(
        m.apply(control(ControlAction::Resume, "lead"), 20)
            .is_empty(),
        "the lead may not lift alice's pause"
    );
    assert!(m.state().tasks[1].paused());
    let actions = m.apply(control(ControlAction::Resume, "alice"), 30);
    assert!(phases(&actions).contains(&WorkflowPhase::TaskResumed));
    m.apply(control(ControlAction::Pause, "lead"), 40);
    let actions = m.apply(control(ControlAction::Resume, "lead"), 50);
    assert!(phases(&actions).contains(&WorkflowPhase::TaskResumed));
    m.apply(control(ControlAction::Pause, "lead"), 60);
    let actions = m.apply(control(ControlAction::Resume, "bob"), 70);
    assert!(
        phases(&actions).contains(&WorkflowPhase::TaskResumed),
        "a person lifts the lead's pause"
    );
}

#[test]
fn a_plan_edit_applies_under_human_control_only_and_keeps_started_tasks() {
    use flotilla_model::control::PlanEdited;
    use flotilla_model::runlog::ControlAction;
    let p = plan(diamond(), PlanConfig::default());
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    let edited = |plan: Plan| PlanEdited {
        plan,
        by: "bob".into(),
        reason: None,
    };
    let mut grown = (*p).clone();
    grown.subtasks.push(Subtask::new("e", "").after(&["d"]));
    // Running, not taken over: refused, nothing changes.
    let e = edited(grown.clone());
    let actions = m.apply(Input::PlanEdited { edited: &e, seq: 7 }, 1);
    assert_eq!(phases(&actions), vec![WorkflowPhase::PlanEditRefused]);
    assert_eq!(m.graph().len(), 4);
    let a = ok("a");
    m.apply(result(&a, 1, 2), 2);
    m.apply(
        Input::Control {
            action: ControlAction::Takeover,
            by: Some("bob"),
            reason: None,
            timeout_ms: None,
            task: None,
        },
        3,
    );
    // A started task changed: refused.
    let mut changed = grown.clone();
    changed.subtasks[0].description = "other".into();
    let e = edited(changed);
    let actions = m.apply(Input::PlanEdited { edited: &e, seq: 8 }, 4);
    assert_eq!(phases(&actions), vec![WorkflowPhase::PlanEditRefused]);
    // Applied: the new task waits, the plan's entry is where a restore reads it.
    let e = edited(grown);
    let actions = m.apply(Input::PlanEdited { edited: &e, seq: 9 }, 5);
    assert_eq!(phases(&actions), vec![WorkflowPhase::PlanEdited]);
    assert_eq!(m.graph().len(), 5);
    assert_eq!(m.state().plan_seq, 9);
    assert_eq!(m.state().tasks[0].status, TaskStatus::Succeeded);
    assert_eq!(m.state().tasks[4].status, TaskStatus::Waiting);
    assert!(dispatched(&actions).is_empty(), "held: nothing dispatched");
    // Replayed from its state, the machine is the same.
    let bytes = rmp_serde::to_vec_named(m.state()).expect("encode");
    let restored = RunMachine::restore(
        Arc::new(e.plan.clone()),
        rmp_serde::from_slice(&bytes).expect("decode"),
    );
    assert_eq!(restored.state(), m.state());
    assert_eq!(restored.state().amend(e.plan.clone()), e.plan);
}
