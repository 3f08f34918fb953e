//! The run machine, driven without any I/O: workspace topics as dependencies — consumers
//! wait for a topic's first entry, not for each other; any writer opens a topic, the wait is
//! bounded; consumers of a failed producer are skipped.

mod common;

use std::sync::Arc;

use flotilla_machine::{Action, Input, RunMachine};
use flotilla_model::event::WorkflowPhase;
use flotilla_model::ids::RunId;
use flotilla_model::plan::{Plan, PlanConfig, Subtask};
use flotilla_model::run::TaskStatus;
use flotilla_model::task::TaskErrorKind;
use flotilla_model::time::Secs;

use common::{dispatched, fail, ok, phases, plan, result, submitted};

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
