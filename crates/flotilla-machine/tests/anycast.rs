//! The run machine, driven without any I/O: anycast role tasks — an attempt waits for a
//! member's claim within its bound, fails `role_unclaimed` and is withdrawn without one, and a
//! restore keeps the claims.

mod common;

use std::sync::Arc;

use flotilla_machine::{Action, Input, RunMachine};
use flotilla_model::event::WorkflowPhase;
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::plan::{Plan, PlanConfig, Subtask};
use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::runlog::Submitted;
use flotilla_model::task::TaskErrorKind;
use flotilla_model::time::Secs;

use common::{diamond, dispatched, fail, ok, plan, result, submitted};

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
