//! One decider for a person's wait: random interleavings of answers, the deadline's timer
//! firing, the default's record, coordinator restarts and duplicate deliveries, all as run-log
//! entries. Exactly one decision applies — the first in log order (an answer before the
//! deadline fired, else the default) — and replaying the log through a fresh machine gives
//! the same state. The runtime's part is played here by the test: it appends the default's
//! record when the machine asks (`ExpireApproval`), as the coordinator does.

mod common;

use flotilla_machine::{Action, Input, RunMachine, RunState};
use flotilla_model::approval::{
    ApprovalDecided, ApprovalStatus, Decision, DefaultDecision, HitlMode, HitlPolicy, OnTimeout,
};
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::plan::{PlanConfig, Subtask};
use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::runlog::RunInput;
use flotilla_model::time::Secs;
use proptest::prelude::{ProptestConfig, prop, prop_assert, prop_assert_eq, proptest};
use proptest::strategy::Strategy as _;

use common::{plan, submitted};

/// The wait's deadline, after the start at `START_MS`.
const TIMEOUT_S: u64 = 60;
const START_MS: i64 = 1_000;

/// What happens next, in log order.
#[derive(Debug, Clone)]
enum Op {
    /// A person answers (approve or reject), by `p<who>`.
    Answer { approve: bool, who: u8 },
    /// The scheduler appends the armed timer's firing (time passes the deadline).
    Fire,
    /// The runtime appends the default's record it was asked for (if any is owed).
    Record,
    /// The coordinator restarts: the machine is rebuilt from its stored state.
    Restart,
    /// An entry already in the log is delivered again, with its sequence.
    Redeliver(usize),
    /// An entry's content is appended again (a second message, a new sequence).
    Reappend(usize),
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    prop::strategy::Union::new_weighted(vec![
        (
            4,
            (prop::bool::ANY, 0u8..4)
                .prop_map(|(approve, who)| Op::Answer { approve, who })
                .boxed(),
        ),
        (2, prop::strategy::Just(Op::Fire).boxed()),
        (2, prop::strategy::Just(Op::Record).boxed()),
        (1, prop::strategy::Just(Op::Restart).boxed()),
        (2, (0usize..64).prop_map(Op::Redeliver).boxed()),
        (1, (0usize..64).prop_map(Op::Reappend).boxed()),
    ])
}

fn policy(default: DefaultDecision) -> HitlPolicy {
    HitlPolicy {
        mode: HitlMode::HumanInCommand,
        sensitive_actions: Vec::new(),
        sensitive_risk: None,
        timeout: Secs::from_secs(TIMEOUT_S),
        on_timeout: OnTimeout {
            human_in_command: default,
            ..OnTimeout::default()
        },
        modes: Default::default(),
        default_agent: None,
        consecutive_failures: 0,
        out_of_scope: false,
        low_confidence: 0.0,
        cost_limit: None,
        budget_ask: false,
    }
}

fn decided(status: ApprovalStatus, decision: Decision, by: &str) -> ApprovalDecided {
    ApprovalDecided {
        approval_id: "t0a1".into(),
        task_id: TaskId::new("gate"),
        attempt: 1,
        status,
        decision,
        by: by.into(),
        tool_call: None,
        digest: None,
        incident: false,
        comment: None,
        at: None,
        always: false,
        reply_to: None,
    }
}

/// The machine's decisions of the wait: the run-log sequences its `ProjectApproval`s name.
fn projected(actions: &[Action]) -> Vec<u64> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::ProjectApproval { task: 0, seq, .. } => Some(*seq),
            _ => None,
        })
        .collect()
}

/// A log entry the test keeps: its sequence, server time and input.
type Entry = (u64, i64, RunInput);

fn apply(m: &mut RunMachine, (seq, at, input): &Entry) -> Vec<Action> {
    Input::from_log(input, *seq).map_or_else(Vec::new, |i| m.apply(i, *at))
}

fn snapshot(m: &RunMachine) -> RunState {
    let bytes = rmp_serde::to_vec_named(m.state()).expect("encode");
    rmp_serde::from_slice(&bytes).expect("decode")
}

/// The first decision in log order, read from the log alone: an answer before the
/// deadline's firing, else the first default's record after it.
fn first_in_log_order(log: &[Entry], deadline_generation: u64) -> Option<(u64, bool)> {
    let mut fired = false;
    for (seq, _, input) in log {
        match input {
            RunInput::TimerFired { generation } if *generation == deadline_generation => {
                fired = true;
            }
            RunInput::ApprovalDecided(d) if !fired && d.status == ApprovalStatus::Decided => {
                return Some((*seq, matches!(d.decision, Decision::Approve)));
            }
            RunInput::ApprovalDecided(d) if fired && d.status == ApprovalStatus::Expired => {
                return Some((*seq, matches!(d.decision, Decision::Approve)));
            }
            _ => {}
        }
    }
    None
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4_000))]

    #[test]
    fn the_first_decision_in_log_order_applies_once_and_replays(
        ops in proptest::collection::vec(op(), 1..24),
        default_approves in prop::bool::ANY,
        required in prop::bool::ANY,
    ) {
        let default = if default_approves { DefaultDecision::Approve } else { DefaultDecision::Reject };
        let mut gate = Subtask::new("gate", "");
        gate.required = required;
        let p = plan(vec![gate], PlanConfig::default());
        let mut sub = submitted(&p);
        sub.hitl = Some(policy(default));
        let run = RunId::new();
        let (mut m, first) = RunMachine::start(run, &sub, p.clone(), START_MS);
        let (deadline_generation, due_ms) = first
            .iter()
            .find_map(|a| match a {
                Action::ArmTimer { generation, due_ms } => Some((*generation, *due_ms)),
                _ => None,
            })
            .expect("the deadline is armed");
        prop_assert_eq!(due_ms, START_MS + (TIMEOUT_S * 1000) as i64);
        prop_assert_eq!(m.state().tasks[0].status, TaskStatus::AwaitingApproval);

        let mut log: Vec<Entry> = Vec::new();
        let mut seq = 1u64; // the submission
        let mut clock = START_MS;
        let mut armed = deadline_generation;
        let mut owed: Vec<Action> = Vec::new();
        let mut decisions: Vec<u64> = Vec::new();
        let take = |actions: Vec<Action>, owed: &mut Vec<Action>, armed: &mut u64, decisions: &mut Vec<u64>| {
            decisions.extend(projected(&actions));
            for a in actions {
                match a {
                    Action::ExpireApproval { .. } => owed.push(a),
                    Action::ArmTimer { generation, .. } => *armed = generation,
                    _ => {}
                }
            }
        };
        for op in ops.iter().chain(std::iter::once(&Op::Record)) {
            let appended = match op {
                Op::Answer { approve, who } => {
                    let decision = if *approve {
                        Decision::Approve
                    } else {
                        Decision::Reject { message: String::new() }
                    };
                    Some(RunInput::ApprovalDecided(Box::new(decided(
                        ApprovalStatus::Decided,
                        decision,
                        &format!("p{who}"),
                    ))))
                }
                Op::Fire => {
                    clock = clock.max(due_ms);
                    Some(RunInput::TimerFired { generation: armed })
                }
                Op::Record => owed.pop().map(|a| {
                    let Action::ExpireApproval { default, .. } = a else { unreachable!() };
                    let default = default.expect("the machine names the default");
                    RunInput::ApprovalDecided(Box::new(decided(
                        ApprovalStatus::Expired,
                        Decision::of_default(default, Secs::from_secs(TIMEOUT_S)),
                        "deadline",
                    )))
                }),
                Op::Restart => {
                    m = RunMachine::restore(p.clone(), snapshot(&m));
                    None
                }
                Op::Redeliver(k) => {
                    if let Some(e) = log.get(k % log.len().max(1)).cloned() {
                        let actions = apply(&mut m, &e);
                        take(actions, &mut owed, &mut armed, &mut decisions);
                    }
                    None
                }
                Op::Reappend(k) => log.get(k % log.len().max(1)).map(|e| e.2.clone()),
            };
            if let Some(input) = appended {
                seq += 1;
                clock += 1;
                let e = (seq, clock, input);
                let actions = apply(&mut m, &e);
                log.push(e);
                take(actions, &mut owed, &mut armed, &mut decisions);
            }
        }

        // Exactly one decision, the first in log order.
        let expected = first_in_log_order(&log, deadline_generation);
        match expected {
            None => {
                prop_assert!(decisions.is_empty(), "decided without a deciding entry: {decisions:?}");
                prop_assert_eq!(m.state().tasks[0].status, TaskStatus::AwaitingApproval);
            }
            Some((winner, approved)) => {
                prop_assert_eq!(&decisions, &vec![winner], "log: {:?}", log);
                if approved {
                    prop_assert_eq!(m.state().tasks[0].status, TaskStatus::Dispatched);
                    prop_assert_eq!(m.state().tasks[0].attempt, 1);
                } else if required {
                    prop_assert_eq!(m.state().status, RunStatus::Failed);
                } else {
                    prop_assert_eq!(m.state().tasks[0].status, TaskStatus::Skipped);
                }
            }
        }

        // The log alone, through a fresh machine, reproduces every decision and the state.
        let (mut replayed, _) = RunMachine::start(run, &sub, p.clone(), START_MS);
        let mut again = Vec::new();
        for e in &log {
            again.extend(projected(&apply(&mut replayed, e)));
        }
        prop_assert_eq!(&again, &decisions);
        prop_assert_eq!(replayed.state(), m.state());
    }
}
