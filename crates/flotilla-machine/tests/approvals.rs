//! The run machine, driven without any I/O: an attempt suspended at a tool call waits for an
//! approval with its slot given back, and a decision continues the same attempt.

mod common;

use flotilla_machine::{Action, Input, RunMachine};
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::plan::{PlanConfig, Subtask};
use flotilla_model::run::{RunStatus, TaskStatus};

use common::{dispatched, ok, plan, result, submitted};

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
        comment: None,
        at: None,
        always: false,
        reply_to: None,
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
