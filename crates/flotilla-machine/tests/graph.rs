//! The run machine, driven without any I/O: a plan's graph run in dependency order, the
//! concurrency cap and the `simple` strategy, dependency deadlines, inputs that change nothing,
//! and a restore that rebuilds the same machine.

mod common;

use flotilla_machine::{Action, Input, RunMachine};
use flotilla_model::event::WorkflowPhase;
use flotilla_model::ids::RunId;
use flotilla_model::plan::{PlanConfig, Strategy, Subtask};
use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::task::TaskErrorKind;
use flotilla_model::time::Secs;

use common::{diamond, dispatched, ok, phases, plan, result, submitted};

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
