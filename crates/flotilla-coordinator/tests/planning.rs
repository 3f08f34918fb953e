//! Bare queries: the planning phase (planner task, review, repair, planned plan) driven
//! through the machine with scripted planner outcomes.
//!
//! The run machine's own tests are in `crates/flotilla-machine/tests`; these drive it with the
//! coordinator's planner tasks (`planner::planning_plan`).

use std::collections::BTreeMap;
use std::sync::Arc;

use flotilla_coordinator::planner::{PlannerOptions, planning_plan};
use flotilla_machine::{Action, Input, RunMachine};
use flotilla_model::event::WorkflowPhase;
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::plan::StrategyChoice;
use flotilla_model::plan::{Plan, PlanConfig, Strategy, Subtask};
use flotilla_model::run::PlanningStatus;
use flotilla_model::run::RunStatus;
use flotilla_model::runlog::Submitted;
use flotilla_model::runlog::{PlanDecision, PlanningSpec};
use flotilla_model::task::{TaskErrorKind, TaskResult};
use flotilla_model::validate::{Problem, ProblemCode, ValidationContext};
use proptest::prelude::{Just, TestCaseError, prop_assert, prop_assert_eq, prop_oneof, proptest};
use proptest::test_runner::Config as ProptestConfig;

fn plan(tasks: Vec<Subtask>, config: PlanConfig) -> Arc<Plan> {
    Arc::new(Plan {
        fork: None,
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
        fork: None,
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
