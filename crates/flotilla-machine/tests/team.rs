//! Team changes in the run machine, without I/O: recruits added to a running plan (and
//! refused when they no longer fit), retirements reassigning or failing a member's tasks,
//! restores that rebuild the amended plan from the stored state alone, and led runs (the
//! `supervisor` strategy: tasks held until the lead assigns them, the run ended by the lead's
//! finish or its deadline).

use std::sync::Arc;

use flotilla_machine::{Action, Input, RunMachine};
use flotilla_model::event::WorkflowPhase;
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::plan::{Plan, PlanConfig, Strategy, StrategyChoice, Subtask};
use flotilla_model::recruit::{RetirePolicy, TeamChangeKind};
use flotilla_model::run::{EndCause, RunStatus, TaskStatus};
use flotilla_model::runlog::{Assigned, Finished, Recruited, Retired, Submitted};
use flotilla_model::task::{TaskErrorKind, TaskResult};

mod common;

use common::{dispatched, phases};

fn plan(tasks: Vec<Subtask>) -> Arc<Plan> {
    common::plan(
        tasks,
        PlanConfig {
            failure_ratio: 1.0,
            max_retries: 0,
            ..PlanConfig::default()
        },
    )
}

/// A submission of `p` in a deployment whose roles make anycast tasks.
fn submitted(p: &Plan) -> Submitted {
    Submitted {
        anycast: true,
        ..common::submitted(p)
    }
}

fn recruit(id: &str, task: &str, deps: &[&str]) -> Recruited {
    let mut subtask = Subtask::new(task, "help with the analysis").after(deps);
    subtask.role = Some("patents".into());
    subtask.required = false;
    Recruited {
        recruit_id: id.into(),
        subtask,
        by: "task:a".into(),
        reason: "the analysis needs a patent analyst".into(),
    }
}

fn finish(m: &mut RunMachine, task: &str, attempt: u32, seq: u64, success: bool) -> Vec<Action> {
    let id = TaskId::new(task);
    let result = if success {
        TaskResult::success(format!("{task} done"))
    } else {
        TaskResult::failure(TaskErrorKind::AgentFailed, "boom")
    };
    m.apply(
        Input::Result {
            task: &id,
            attempt,
            result: &result,
            seq,
            worker: None,
            started_at: None,
            agent: None,
        },
        seq as i64 * 10,
    )
}

#[test]
fn a_recruit_joins_the_running_plan_and_the_run_waits_for_it() {
    let p = plan(vec![
        Subtask::new("a", ""),
        Subtask::new("b", "").after(&["a"]),
    ]);
    let (mut m, actions) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    assert_eq!(dispatched(&actions), vec![(0, 1)]);

    let r = recruit("r1", "patents", &["a"]);
    let actions = m.apply(
        Input::Recruited {
            recruited: &r,
            seq: 5,
        },
        50,
    );
    assert_eq!(phases(&actions), vec![WorkflowPhase::MemberRecruited]);
    assert!(dispatched(&actions).is_empty(), "it waits for a");
    assert_eq!(m.plan().subtasks.len(), 3);
    assert_eq!(m.state().tasks.len(), 3);
    let change = &m.state().team[0];
    assert_eq!(change.kind, TeamChangeKind::Recruited);
    assert_eq!(change.member, "role:patents");
    assert_eq!(change.task_id, Some(TaskId::new("patents")));
    assert_eq!(change.seq, 5);

    // The same recruit again (a redelivery, or an append outside the dedup window) changes
    // nothing.
    let before = m.state().clone();
    assert!(
        m.apply(
            Input::Recruited {
                recruited: &r,
                seq: 6
            },
            60
        )
        .is_empty()
    );
    assert_eq!(m.state(), &before);

    // A restore from the stored state rebuilds the amended plan from the base plan.
    let bytes = rmp_serde::to_vec_named(m.state()).expect("encode");
    let state: flotilla_machine::RunState = rmp_serde::from_slice(&bytes).expect("decode");
    let amended = state.amend((*p).clone());
    assert_eq!(&amended, m.plan().as_ref());
    let mut restored = RunMachine::restore(Arc::new(amended), state);

    for machine in [&mut m, &mut restored] {
        let actions = finish(machine, "a", 1, 10, true);
        assert_eq!(dispatched(&actions), vec![(1, 1), (2, 1)]);
        finish(machine, "b", 1, 11, true);
        assert_eq!(
            machine.state().status,
            RunStatus::Running,
            "the recruit runs"
        );
        let actions = finish(machine, "patents", 1, 12, true);
        assert!(actions.contains(&Action::Finish));
        assert_eq!(machine.state().status, RunStatus::Succeeded);
    }
    assert_eq!(m.state(), restored.state());
}

#[test]
fn a_recruit_that_no_longer_fits_is_refused_and_kept() {
    let p = plan(vec![Subtask::new("a", ""), Subtask::new("b", "")]);
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p, 0);
    // Its task id was taken.
    let taken = recruit("r1", "b", &[]);
    let actions = m.apply(
        Input::Recruited {
            recruited: &taken,
            seq: 3,
        },
        30,
    );
    assert_eq!(phases(&actions), vec![WorkflowPhase::RecruitRefused]);
    // It waits for a task that does not exist.
    let dangling = recruit("r2", "c", &["nope"]);
    let actions = m.apply(
        Input::Recruited {
            recruited: &dangling,
            seq: 4,
        },
        40,
    );
    assert_eq!(phases(&actions), vec![WorkflowPhase::RecruitRefused]);
    assert_eq!(m.plan().subtasks.len(), 2, "the plan is unchanged");
    assert_eq!(m.state().tasks.len(), 2);
    assert!(m.state().recruited.is_empty());
    let refusals: Vec<_> = m
        .state()
        .team
        .iter()
        .map(|c| (c.kind, c.id.as_str(), c.refusal.is_some()))
        .collect();
    assert_eq!(
        refusals,
        vec![
            (TeamChangeKind::Refused, "r1", true),
            (TeamChangeKind::Refused, "r2", true)
        ]
    );
    assert!(
        m.state().team[1]
            .refusal
            .as_deref()
            .is_some_and(|r| r.contains("nope")),
        "{:?}",
        m.state().team[1]
    );
}

#[test]
fn a_recruit_after_its_dependency_failed_is_skipped_and_an_ended_run_takes_none() {
    let p = plan(vec![Subtask::new("a", ""), Subtask::new("b", "")]);
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p, 0);
    finish(&mut m, "a", 1, 2, false);
    assert_eq!(m.state().tasks[0].status, TaskStatus::Failed);
    let r = recruit("r1", "after-a", &["a"]);
    let actions = m.apply(
        Input::Recruited {
            recruited: &r,
            seq: 6,
        },
        60,
    );
    assert_eq!(
        phases(&actions),
        vec![WorkflowPhase::MemberRecruited, WorkflowPhase::TaskSkipped]
    );
    assert_eq!(m.state().tasks[2].status, TaskStatus::Skipped);
    finish(&mut m, "b", 1, 7, true);
    assert!(m.state().status.is_terminal());
    let before = m.state().clone();
    let late = recruit("r2", "late", &[]);
    assert!(
        m.apply(
            Input::Recruited {
                recruited: &late,
                seq: 8
            },
            80
        )
        .is_empty()
    );
    assert_eq!(m.state(), &before, "an ended run does not change");
}

#[test]
fn retiring_a_member_reassigns_or_fails_its_tasks_that_have_not_started() {
    let with_role = |id: &str, deps: &[&str]| {
        let mut t = Subtask::new(id, "").after(deps).with_agent("alice");
        t.role = Some("writer".into());
        t
    };
    let tasks = vec![
        with_role("running", &[]),
        with_role("later", &["running"]),
        Subtask::new("no-role", "")
            .with_agent("alice")
            .after(&["running"]),
        Subtask::new("other", "").with_agent("bob"),
    ];
    let p = plan(tasks.clone());
    let (mut m, actions) = RunMachine::start(RunId::new(), &submitted(&p), p.clone(), 0);
    assert_eq!(dispatched(&actions), vec![(0, 1), (3, 1)]);
    let retire = Retired {
        member: "alice".into(),
        policy: RetirePolicy::Reassign,
        by: "operator".into(),
        reason: "alice is overloaded".into(),
    };
    let actions = m.apply(
        Input::Retired {
            retired: &retire,
            seq: 9,
        },
        90,
    );
    assert_eq!(
        phases(&actions),
        vec![WorkflowPhase::MemberRetired, WorkflowPhase::TaskFailed]
    );
    let change = &m.state().team[0];
    assert_eq!(change.reassigned, vec![TaskId::new("later")]);
    assert_eq!(change.failed, vec![TaskId::new("no-role")]);
    assert_eq!(m.plan().subtasks[1].agent, None, "later goes to its role");
    assert_eq!(
        m.plan().subtasks[0].agent.as_deref(),
        Some("alice"),
        "the running attempt keeps its member"
    );
    assert_eq!(
        m.state().tasks[2].error.as_ref().map(|e| e.kind),
        Some(TaskErrorKind::MemberRetired)
    );
    assert_eq!(m.anycast_role(1), Some("writer"));
    // Retiring again changes nothing; the restore sees the same plan.
    let before = m.state().clone();
    assert!(
        m.apply(
            Input::Retired {
                retired: &retire,
                seq: 10
            },
            100
        )
        .is_empty()
    );
    assert_eq!(m.state(), &before);
    assert_eq!(&m.state().amend((*p).clone()), m.plan().as_ref());

    // Policy `fail`: every task of the member that has not started fails.
    let p = plan(tasks);
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p, 0);
    let fail = Retired {
        policy: RetirePolicy::Fail,
        ..retire
    };
    m.apply(
        Input::Retired {
            retired: &fail,
            seq: 9,
        },
        90,
    );
    assert_eq!(
        m.state().team[0].failed,
        vec![TaskId::new("later"), TaskId::new("no-role")]
    );
    assert_eq!(m.state().tasks[0].status, TaskStatus::Dispatched);
}

fn led(mut p: Plan) -> (Arc<Plan>, Submitted) {
    p.config.strategy = Strategy::Supervisor;
    let p = Arc::new(p);
    let mut s = submitted(&p);
    s.lead = Some("lead".into());
    (p, s)
}

fn assign(task: &str) -> Assigned {
    Assigned {
        task_id: TaskId::new(task),
        by: "lead".into(),
        reason: "its turn".into(),
    }
}

#[test]
fn a_led_run_runs_only_what_its_lead_assigns_and_ends_with_the_leads_result() {
    let (p, s) = led((*plan(vec![
        Subtask::new("a", ""),
        Subtask::new("b", "").after(&["a"]),
        Subtask::new("c", ""),
    ]))
    .clone());
    let (mut m, actions) = RunMachine::start(RunId::new(), &s, p, 0);
    assert!(dispatched(&actions).is_empty(), "nothing runs unassigned");
    assert_eq!(
        m.state().strategy.as_ref().map(|c| c.strategy),
        Some(Strategy::Supervisor)
    );
    assert!(m.state().tasks.iter().all(|t| t.held));

    // b is assigned first: it waits for a, which is not assigned.
    let actions = m.apply(
        Input::Assigned {
            assigned: &assign("b"),
        },
        10,
    );
    assert_eq!(phases(&actions), vec![WorkflowPhase::TaskAssigned]);
    assert!(dispatched(&actions).is_empty());
    let actions = m.apply(
        Input::Assigned {
            assigned: &assign("a"),
        },
        20,
    );
    assert_eq!(dispatched(&actions), vec![(0, 1)]);
    // A repeated assignment changes nothing.
    assert!(
        m.apply(
            Input::Assigned {
                assigned: &assign("a")
            },
            21
        )
        .is_empty()
    );
    // An unknown task changes nothing.
    assert!(
        m.apply(
            Input::Assigned {
                assigned: &assign("zz")
            },
            22
        )
        .is_empty()
    );

    let actions = finish(&mut m, "a", 1, 3, true);
    assert_eq!(dispatched(&actions), vec![(1, 1)]);
    let actions = finish(&mut m, "b", 1, 4, true);
    assert!(
        !actions.iter().any(|a| matches!(a, Action::Finish)),
        "a led run waits for its lead even when its assigned tasks are done"
    );
    assert_eq!(m.state().status, RunStatus::Running);

    let f = Finished {
        result: "the answer is 42".into(),
        by: "lead".into(),
    };
    let actions = m.apply(Input::Finished { finished: &f }, 100);
    assert!(actions.iter().any(|a| matches!(a, Action::Finish)));
    assert_eq!(m.state().status, RunStatus::Succeeded);
    let outcome = m
        .state()
        .outcome
        .clone()
        .unwrap_or_else(|| panic!("no outcome"));
    assert_eq!(outcome.cause, Some(EndCause::LeadFinished));
    let fr = outcome
        .final_result
        .unwrap_or_else(|| panic!("no final result"));
    assert_eq!(fr.response, "the answer is 42");
    assert_eq!(fr.numeric_value, Some(42.0));
    // c was never assigned: listed as skipped, not failed.
    assert_eq!(outcome.skipped.len(), 1);
    assert_eq!(m.state().tasks[2].status, TaskStatus::Cancelled);
    // A second finish changes nothing.
    assert!(m.apply(Input::Finished { finished: &f }, 101).is_empty());
}

#[test]
fn a_led_run_fails_when_its_lead_does_not_finish_in_time() {
    let mut base = (*plan(vec![Subtask::new("a", "")])).clone();
    base.config.lead_timeout = flotilla_model::time::Secs::from_secs(60);
    let (p, s) = led(base);
    let (mut m, actions) = RunMachine::start(RunId::new(), &s, p, 0);
    let due = actions
        .iter()
        .find_map(|a| match a {
            Action::ArmTimer { generation, due_ms } => Some((*generation, *due_ms)),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no timer armed: {actions:?}"));
    assert_eq!(due.1, 60_000);
    let actions = m.apply(Input::Timer { generation: due.0 }, 60_000);
    assert!(actions.iter().any(|a| matches!(a, Action::Finish)));
    assert_eq!(m.state().status, RunStatus::Failed);
    assert_eq!(
        m.state().outcome.as_ref().and_then(|o| o.cause),
        Some(EndCause::LeadTimeout)
    );
}

#[test]
fn a_led_run_still_aborts_at_the_failure_ratio_and_restores_its_holds() {
    let mut base = (*plan(vec![
        Subtask::new("a", ""),
        Subtask::new("b", ""),
        Subtask::new("c", ""),
    ]))
    .clone();
    base.config.failure_ratio = 0.0;
    let (p, s) = led(base);
    let (mut m, _) = RunMachine::start(RunId::new(), &s, p.clone(), 0);
    m.apply(
        Input::Assigned {
            assigned: &assign("a"),
        },
        10,
    );
    // A restore keeps b and c held.
    let restored = RunMachine::restore(p, m.state().clone());
    assert!(restored.state().tasks[1].held && restored.state().tasks[2].held);
    assert!(!restored.state().tasks[0].held);
    let actions = finish(&mut m, "a", 1, 3, false);
    assert!(actions.iter().any(|a| matches!(a, Action::Finish)));
    assert_eq!(m.state().status, RunStatus::Failed);
    assert_eq!(
        m.state().outcome.as_ref().and_then(|o| o.cause),
        Some(EndCause::FailureThreshold)
    );
}

#[test]
fn assignments_and_finishes_change_nothing_in_a_run_that_is_not_led() {
    let p = plan(vec![Subtask::new("a", ""), Subtask::new("b", "")]);
    let (mut m, _) = RunMachine::start(RunId::new(), &submitted(&p), p, 0);
    assert!(
        m.apply(
            Input::Assigned {
                assigned: &assign("a")
            },
            10
        )
        .is_empty()
    );
    let f = Finished {
        result: "x".into(),
        by: "lead".into(),
    };
    assert!(m.apply(Input::Finished { finished: &f }, 11).is_empty());
    assert_eq!(m.state().status, RunStatus::Running);
}

#[test]
fn auto_picks_the_supervisor_strategy_only_where_a_lead_exists() {
    let many: Vec<Subtask> = (0..6).map(|i| Subtask::new(&format!("t{i}"), "")).collect();
    let p = plan(many);
    assert_eq!(
        StrategyChoice::resolve(&p, true).strategy,
        Strategy::Supervisor
    );
    assert_eq!(StrategyChoice::resolve(&p, false).strategy, Strategy::Dag);
    let mut small = (*plan(vec![Subtask::new("a", ""), Subtask::new("b", "")])).clone();
    assert_eq!(
        StrategyChoice::resolve(&small, true).strategy,
        Strategy::Dag
    );
    small.config.recruit_roles = Some(vec!["patents".into()]);
    let c = StrategyChoice::resolve(&small, true);
    assert_eq!(c.strategy, Strategy::Supervisor);
    assert!(c.reason.contains("recruit"), "{}", c.reason);
    let one = plan(vec![Subtask::new("a", "")]);
    assert_eq!(
        StrategyChoice::resolve(&one, true).strategy,
        Strategy::Simple
    );
}
