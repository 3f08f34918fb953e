//! `RunMachine::success_ends_run`: when the success of a dispatched attempt would end its run
//! with nothing more to do (its worker then answers the run's submitters itself).

mod common;

use common::*;
use flotilla_machine::{Input, RunMachine};
use flotilla_model::ids::RunId;
use flotilla_model::plan::{PlanConfig, Subtask};

#[test]
fn a_one_task_run_ends_with_its_success() {
    let p = plan(vec![Subtask::new("only", "Only.")], PlanConfig::default());
    let (m, actions) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    assert_eq!(dispatched(&actions), [(0, 1)]);
    assert!(m.success_ends_run(0, 1, 1));
    assert!(!m.success_ends_run(0, 2, 1), "another attempt");
}

#[test]
fn only_a_diamonds_last_task_ends_it() {
    let p = plan(diamond(), PlanConfig::default());
    let (mut m, actions) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    assert_eq!(dispatched(&actions), [(0, 1)]);
    assert!(!m.success_ends_run(0, 1, 1));
    let a = ok("a");
    let next = m.apply(result(&a, 1, 10), 1);
    assert_eq!(dispatched(&next), [(1, 1), (2, 1)]);
    assert!(!m.success_ends_run(1, 1, 2), "c is still running");
    let (b, c) = (ok("b"), ok("c"));
    m.apply(result(&b, 1, 11), 2);
    let next = m.apply(result(&c, 1, 12), 3);
    assert_eq!(dispatched(&next), [(3, 1)]);
    assert!(m.success_ends_run(3, 1, 4));
}

#[test]
fn work_after_the_success_keeps_the_answer_with_the_coordinator() {
    let mut w = Subtask::new("w", "Write.");
    w.produces = vec!["notes".into()];
    let p = plan(vec![w], PlanConfig::default());
    let (m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    assert!(
        !m.success_ends_run(0, 1, 1),
        "its topic is written after it"
    );
    // Two sinks: the final result is made of both.
    let p = plan(
        vec![Subtask::new("x", "X."), Subtask::new("y", "Y.")],
        PlanConfig::default(),
    );
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    let x = ok("x");
    m.apply(result(&x, 1, 5), 1);
    assert!(!m.success_ends_run(1, 1, 2));
    let _ = Input::Timer { generation: 0 };
}
