//! The run machine, driven without any I/O: pause, resume and takeover of a run and of one
//! task (what changes nothing, and why), held runs' attempts stopped at a step, the lead's
//! pauses against a person's, and plan edits under human control.

mod common;

use std::sync::Arc;

use flotilla_machine::{Action, Input, RunMachine};
use flotilla_model::event::WorkflowPhase;
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::plan::{Plan, PlanConfig, Subtask};
use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::time::Secs;

use common::{diamond, dispatched, ok, phases, plan, result, submitted};

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

/// A run log reaches the machine through one mapping, `Input::from_log`: each entry steps a
/// run exactly as the input it stands for (the same actions and the same state) — results,
/// a person's pause and resume, a timer and a cancel — and the entries that start or refuse
/// a run step none.
#[test]
fn a_run_log_steps_the_machine_through_one_mapping() {
    use flotilla_model::ids::AttemptId;
    use flotilla_model::runlog::{Control, ControlAction, RunInput, TaskResultInput};
    let p = plan(diamond(), PlanConfig::default());
    let run = RunId::new();
    let (mut by_log, _) = RunMachine::start(run, &submitted(&p), p.clone(), 0);
    let (mut by_hand, _) = RunMachine::start(run, &submitted(&p), p.clone(), 0);
    let done = |id: &str| {
        let (task_id, result) = ok(id);
        RunInput::TaskResult(Box::new(TaskResultInput {
            task_id,
            attempt: 1,
            attempt_id: AttemptId::new(),
            worker: "w".into(),
            started_at: None,
            agent: None,
            result,
            answered: false,
        }))
    };
    let control = |action, reason: Option<&str>| {
        RunInput::Control(Control {
            action,
            reason: reason.map(str::to_owned),
            by: Some("alice".into()),
            timeout_ms: Some(60_000),
            rollback: false,
            task_id: None,
            reply_to: None,
        })
    };
    let log = [
        done("a"),
        control(ControlAction::Pause, Some("look")),
        RunInput::TimerFired { generation: 1 },
        control(ControlAction::Resume, None),
        done("b"),
        control(ControlAction::Cancel, Some("enough")),
    ];
    let (a, b) = (ok("a"), ok("b"));
    for (k, entry) in log.iter().enumerate() {
        let (seq, now_ms) = (k as u64 + 2, 1_000 * (k as i64 + 1));
        let hand = match k {
            0 => Input::Result {
                task: &a.0,
                attempt: 1,
                result: &a.1,
                seq,
                worker: Some("w"),
                started_at: None,
                agent: None,
            },
            1 => Input::Control {
                action: ControlAction::Pause,
                by: Some("alice"),
                reason: Some("look"),
                timeout_ms: Some(60_000),
                task: None,
            },
            2 => Input::Timer { generation: 1 },
            3 => Input::Control {
                action: ControlAction::Resume,
                by: Some("alice"),
                reason: None,
                timeout_ms: Some(60_000),
                task: None,
            },
            4 => Input::Result {
                task: &b.0,
                attempt: 1,
                result: &b.1,
                seq,
                worker: Some("w"),
                started_at: None,
                agent: None,
            },
            _ => Input::Cancel {
                reason: "enough",
                rollback: false,
            },
        };
        let input = Input::from_log(entry, seq).expect("a step");
        assert_eq!(
            by_log.apply(input, now_ms),
            by_hand.apply(hand, now_ms),
            "entry {k}"
        );
        assert_eq!(by_log.state(), by_hand.state(), "entry {k}");
    }
    assert_eq!(by_log.state().status, RunStatus::Cancelled);
    let first = RunInput::Submitted(Box::new(submitted(&p)));
    assert!(Input::from_log(&first, 1).is_none());
}
