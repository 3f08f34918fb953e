//! The run as a monitor shows it: a per-task timeline (queued, each attempt from its start to
//! its end, the waits for a person, the run's holds) read from the run's own events, and the
//! short run ids a person reads.
//!
//! Nothing here decides anything about a run: the spans are the run's stored events laid out
//! in time, and what a run or task waits for is `flotilla_client::progress`'s (the CLI's).

use std::collections::{HashMap, HashSet};

use flotilla_model::RunId;
use flotilla_model::event::{Event, EventEnvelope, WorkflowPhase};
use flotilla_model::run::{RunView, TaskStatus};
use flotilla_model::time::Timestamp;
use serde::Serialize;

/// Most tasks a timeline lays out (the rest are counted in [`Timeline::omitted`]).
pub(crate) const MAX_TIMELINE_TASKS: usize = 500;

/// The fewest trailing hex digits of a run id the console shows.
pub(crate) const MIN_SHORT: usize = 8;

/// A run's tasks in time.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Timeline {
    /// When the run was accepted.
    pub(crate) start: Timestamp,
    /// When it ended (none while it goes on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) end: Option<Timestamp>,
    /// One line per task, in plan order (at most [`MAX_TIMELINE_TASKS`]).
    pub(crate) tasks: Vec<TaskLine>,
    /// The run's holds: paused or taken over by a person.
    pub(crate) holds: Vec<WaitSpan>,
    /// Tasks not laid out.
    pub(crate) omitted: usize,
}

/// One task in time.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct TaskLine {
    /// The task.
    pub(crate) task_id: String,
    /// The agent that ran it, as its events say.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) agent: Option<String>,
    /// When its latest attempt was dispatched (queued for a worker).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) queued_at: Option<Timestamp>,
    /// Its attempts, each from its start to its end (an attempt continued after a
    /// suspension has one span per stretch).
    pub(crate) attempts: Vec<AttemptSpan>,
    /// What it waited for a person for.
    pub(crate) waits: Vec<WaitSpan>,
    /// When it ended, and how (`succeeded`, `failed`, `skipped`, `cancelled`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) ended_at: Option<Timestamp>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) ended: Option<&'static str>,
}

/// One stretch of an attempt on a worker.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct AttemptSpan {
    /// The attempt number.
    pub(crate) attempt: u32,
    /// The worker that ran it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) worker: Option<String>,
    /// When the worker started it.
    pub(crate) started_at: Timestamp,
    /// When it stopped (none: it runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) ended_at: Option<Timestamp>,
    /// `running`, `succeeded`, `failed`, `retrying` (failed, another attempt follows),
    /// `suspended` (stopped at a tool call or a hold; it continues later) or `cancelled`.
    pub(crate) outcome: &'static str,
}

/// A wait for a person, from its start to its end.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct WaitSpan {
    /// `approval`, `question`, `client tool`, `pause` or `takeover`.
    pub(crate) kind: &'static str,
    /// The approval, when one was asked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) approval_id: Option<String>,
    /// From.
    pub(crate) from: Timestamp,
    /// Until (none: it still waits).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) to: Option<Timestamp>,
    /// What was asked and how it was answered, in words.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) what: String,
}

impl TaskLine {
    fn open_attempt(&mut self) -> Option<&mut AttemptSpan> {
        self.attempts
            .iter_mut()
            .rev()
            .find(|a| a.ended_at.is_none())
    }

    /// Ends what is open (attempts, waits) at `at`.
    fn close(&mut self, at: Timestamp, outcome: &'static str) {
        for a in self.attempts.iter_mut().filter(|a| a.ended_at.is_none()) {
            a.ended_at = Some(at);
            a.outcome = outcome;
        }
        close_waits(&mut self.waits, at, |_| true);
    }
}

fn close_waits(waits: &mut [WaitSpan], at: Timestamp, which: impl Fn(&WaitSpan) -> bool) {
    for w in waits.iter_mut().filter(|w| w.to.is_none() && which(w)) {
        w.to = Some(at);
    }
}

/// `view`'s tasks in time, from the run's `events` (in stored order).
pub(crate) fn timeline(view: &RunView, events: &[EventEnvelope]) -> Timeline {
    let mut tasks: Vec<TaskLine> = view
        .tasks
        .iter()
        .map(|t| TaskLine {
            task_id: t.task_id.as_str().to_owned(),
            queued_at: t.dispatched_at,
            ..TaskLine::default()
        })
        .collect();
    let index: HashMap<String, usize> = tasks
        .iter()
        .enumerate()
        .map(|(i, t)| (t.task_id.clone(), i))
        .collect();
    let mut holds: Vec<WaitSpan> = Vec::new();
    for e in events {
        match &e.task_id {
            Some(task) => {
                if let Some(&i) = index.get(task.as_str()) {
                    task_event(e, &mut tasks[i]);
                }
            }
            None => run_event(e, &mut holds, &mut tasks),
        }
    }
    let omitted = tasks.len().saturating_sub(MAX_TIMELINE_TASKS);
    tasks.truncate(MAX_TIMELINE_TASKS);
    Timeline {
        start: view.record.created_at,
        end: view.record.finished_at,
        tasks,
        holds,
        omitted,
    }
}

/// A run-level event: the run's holds, and its end (which ends what was still open).
fn run_event(e: &EventEnvelope, holds: &mut Vec<WaitSpan>, tasks: &mut [TaskLine]) {
    let Event::Workflow(w) = &e.event else {
        return;
    };
    let what = w.detail.clone().unwrap_or_default();
    match w.phase {
        WorkflowPhase::RunPaused => holds.push(WaitSpan {
            kind: "pause",
            approval_id: None,
            from: e.ts,
            to: None,
            what,
        }),
        WorkflowPhase::RunTakenOver => holds.push(WaitSpan {
            kind: "takeover",
            approval_id: None,
            from: e.ts,
            to: None,
            what,
        }),
        WorkflowPhase::RunResumed => close_waits(holds, e.ts, |_| true),
        p if p.ends_run() => {
            close_waits(holds, e.ts, |_| true);
            for t in tasks {
                t.close(e.ts, "cancelled");
            }
        }
        _ => {}
    }
}

/// One of a task's events.
fn task_event(e: &EventEnvelope, t: &mut TaskLine) {
    let attempt = e.attempt.unwrap_or(0);
    match &e.event {
        Event::AwaitClarification { .. } => t.waits.push(WaitSpan {
            kind: "question",
            approval_id: None,
            from: e.ts,
            to: None,
            what: String::new(),
        }),
        Event::AwaitExternalTools { .. } => t.waits.push(WaitSpan {
            kind: "client tool",
            approval_id: None,
            from: e.ts,
            to: None,
            what: String::new(),
        }),
        Event::Workflow(w) => {
            if t.agent.is_none() {
                t.agent.clone_from(&w.agent);
            }
            let detail = w.detail.clone().unwrap_or_default();
            match w.phase {
                WorkflowPhase::TaskStarted => {
                    // A new stretch: what was open ended (a question answered, a continuation).
                    close_waits(&mut t.waits, e.ts, |w| {
                        matches!(w.kind, "question" | "client tool")
                    });
                    if let Some(open) = t.open_attempt() {
                        open.ended_at = Some(e.ts);
                        open.outcome = "suspended";
                    }
                    t.attempts.push(AttemptSpan {
                        attempt,
                        worker: w.worker.clone(),
                        started_at: e.ts,
                        ended_at: None,
                        outcome: "running",
                    });
                }
                WorkflowPhase::TaskSucceeded
                | WorkflowPhase::TaskFailed
                | WorkflowPhase::TaskRetrying
                | WorkflowPhase::TaskSuspended => {
                    let outcome = match w.phase {
                        WorkflowPhase::TaskSucceeded => "succeeded",
                        WorkflowPhase::TaskFailed => "failed",
                        WorkflowPhase::TaskRetrying => "retrying",
                        _ => "suspended",
                    };
                    match t.open_attempt() {
                        Some(open) => {
                            open.ended_at = Some(e.ts);
                            open.outcome = outcome;
                        }
                        // An attempt too short to announce its start: its outcome says when
                        // it started, and where.
                        None if w.phase != WorkflowPhase::TaskSuspended => {
                            t.attempts.push(AttemptSpan {
                                attempt,
                                worker: w.worker.clone(),
                                started_at: w.started_at.unwrap_or(e.ts),
                                ended_at: Some(e.ts),
                                outcome,
                            });
                        }
                        None => {}
                    }
                    if matches!(
                        w.phase,
                        WorkflowPhase::TaskSucceeded | WorkflowPhase::TaskFailed
                    ) {
                        close_waits(&mut t.waits, e.ts, |_| true);
                        t.ended_at = Some(e.ts);
                        t.ended = Some(outcome);
                    }
                }
                WorkflowPhase::TaskSkipped => {
                    t.close(e.ts, "cancelled");
                    t.ended_at = Some(e.ts);
                    t.ended = Some("skipped");
                }
                WorkflowPhase::ApprovalRequested => t.waits.push(WaitSpan {
                    kind: "approval",
                    approval_id: w.approval_id.clone(),
                    from: e.ts,
                    to: None,
                    what: detail,
                }),
                WorkflowPhase::ApprovalDecided => {
                    // The approval decided; a question or a client tool's call answered with
                    // it. (`human_on_the_loop` decides with a notice: nobody was waited for.)
                    let id = w.approval_id.clone();
                    for wait in t.waits.iter_mut().filter(|x| x.to.is_none()) {
                        if id.is_none() || wait.approval_id == id || wait.kind != "approval" {
                            wait.to = Some(e.ts);
                            if !detail.is_empty() {
                                if !wait.what.is_empty() {
                                    wait.what.push_str(" → ");
                                }
                                wait.what.push_str(&detail);
                            }
                        }
                    }
                }
                WorkflowPhase::TaskPaused => t.waits.push(WaitSpan {
                    kind: "pause",
                    approval_id: None,
                    from: e.ts,
                    to: None,
                    what: detail,
                }),
                WorkflowPhase::TaskResumed => {
                    close_waits(&mut t.waits, e.ts, |w| w.kind == "pause");
                }
                _ => {}
            }
        }
        _ => {}
    }
}

/// Ends a timeline's open spans of tasks the run's state says are over (an event lost or
/// not read: the state wins).
pub(crate) fn settle(timeline: &mut Timeline, view: &RunView) {
    for (line, task) in timeline.tasks.iter_mut().zip(&view.tasks) {
        if task.status.is_terminal() && line.ended.is_none() {
            let at = line
                .attempts
                .last()
                .and_then(|a| a.ended_at)
                .or(view.record.finished_at);
            if let Some(at) = at {
                line.close(at, "cancelled");
                line.ended_at = Some(at);
            }
            line.ended = Some(match task.status {
                TaskStatus::Succeeded => "succeeded",
                TaskStatus::Failed => "failed",
                TaskStatus::Skipped => "skipped",
                _ => "cancelled",
            });
        }
    }
}

/// The trailing hex digits of `run` a person reads: the last `len` of its 32.
pub(crate) fn short_id(run: &RunId, len: usize) -> String {
    let hex: String = run.to_string().chars().filter(|c| *c != '-').collect();
    let len = len.min(hex.len());
    hex[hex.len() - len..].to_owned()
}

/// How many trailing hex digits tell `runs` apart: at least [`MIN_SHORT`], more while two
/// of them share their last digits. (A UUIDv7's first digits are its creation time, which
/// runs started together share; its last are random.)
pub(crate) fn short_len<'a>(runs: impl Iterator<Item = &'a RunId> + Clone) -> usize {
    let mut len = MIN_SHORT;
    while len < 32 {
        let mut seen = HashSet::new();
        if runs.clone().all(|r| seen.insert(short_id(r, len))) {
            return len;
        }
        len += 1;
    }
    32
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_model::event::WorkflowEvent;
    use flotilla_model::ids::TaskId;
    use flotilla_model::run::{RunHandle, RunRecord, RunStatus, TaskCounts, TaskView};

    fn view(tasks: &[&str]) -> RunView {
        let run = RunId::new();
        RunView {
            record: RunRecord {
                fork_of: None,
                handle: RunHandle::root(run),
                name: Some("t".into()),
                status: RunStatus::Running,
                labels: Default::default(),
                session_id: None,
                created_at: Timestamp::from_unix_ms(1_000),
                finished_at: None,
                tasks: TaskCounts::default(),
                outcome: None,
                errors: Vec::new(),
                warnings: Vec::new(),
                strategy: None,
                planning: None,
                memory: None,
            },
            tasks: tasks
                .iter()
                .map(|t| TaskView {
                    task_id: TaskId::new(*t),
                    status: TaskStatus::Dispatched,
                    attempts: 1,
                    error: None,
                    skip_reason: None,
                    dispatched_at: Some(Timestamp::from_unix_ms(1_100)),
                    pool: None,
                    paused_until: None,
                })
                .collect(),
            tasks_offset: 0,
            plan: None,
            team: Vec::new(),
        }
    }

    fn ev(run: RunId, task: Option<&str>, ms: i64, event: Event) -> EventEnvelope {
        EventEnvelope {
            protocol: 1,
            id: format!("{ms}"),
            run_id: run,
            task_id: task.map(TaskId::new),
            attempt: task.map(|_| 1),
            ts: Timestamp::from_unix_ms(ms),
            source: "test".into(),
            event,
        }
    }

    fn wf(phase: WorkflowPhase, f: impl FnOnce(&mut WorkflowEvent)) -> Event {
        let mut w = WorkflowEvent::phase(phase);
        f(&mut w);
        Event::Workflow(w)
    }

    /// Queued, waited for an approval, started on a worker, succeeded; another task still
    /// runs; the run was paused and resumed in between.
    #[test]
    fn a_timeline_lays_out_each_tasks_queue_attempts_and_waits() {
        let v = view(&["a", "b"]);
        let run = v.record.handle.run_id;
        let events = vec![
            ev(
                run,
                Some("a"),
                1_050,
                wf(WorkflowPhase::ApprovalRequested, |w| {
                    w.approval_id = Some("ap1".into());
                    w.detail = Some("sensitive action".into());
                }),
            ),
            ev(
                run,
                Some("a"),
                1_090,
                wf(WorkflowPhase::ApprovalDecided, |w| {
                    w.approval_id = Some("ap1".into());
                    w.detail = Some("approve by alice".into());
                }),
            ),
            ev(run, None, 1_150, wf(WorkflowPhase::RunPaused, |_| {})),
            ev(
                run,
                Some("a"),
                1_200,
                wf(WorkflowPhase::TaskStarted, |w| {
                    w.worker = Some("w1".into());
                    w.agent = Some("writer".into());
                }),
            ),
            ev(run, None, 1_250, wf(WorkflowPhase::RunResumed, |_| {})),
            ev(
                run,
                Some("b"),
                1_300,
                wf(WorkflowPhase::TaskStarted, |w| w.worker = Some("w2".into())),
            ),
            ev(
                run,
                Some("a"),
                1_400,
                wf(WorkflowPhase::TaskSucceeded, |w| {
                    w.worker = Some("w1".into())
                }),
            ),
        ];
        let t = timeline(&v, &events);
        let a = &t.tasks[0];
        assert_eq!(a.agent.as_deref(), Some("writer"));
        assert_eq!(a.queued_at, Some(Timestamp::from_unix_ms(1_100)));
        assert_eq!(
            a.attempts,
            vec![AttemptSpan {
                attempt: 1,
                worker: Some("w1".into()),
                started_at: Timestamp::from_unix_ms(1_200),
                ended_at: Some(Timestamp::from_unix_ms(1_400)),
                outcome: "succeeded",
            }]
        );
        assert_eq!(a.waits.len(), 1);
        assert_eq!(a.waits[0].kind, "approval");
        assert_eq!(a.waits[0].to, Some(Timestamp::from_unix_ms(1_090)));
        assert_eq!(a.waits[0].what, "sensitive action → approve by alice");
        assert_eq!(a.ended, Some("succeeded"));
        let b = &t.tasks[1];
        assert_eq!(b.attempts[0].outcome, "running");
        assert_eq!(b.attempts[0].ended_at, None);
        assert_eq!(t.holds.len(), 1);
        assert_eq!(
            (t.holds[0].kind, t.holds[0].to),
            ("pause", Some(Timestamp::from_unix_ms(1_250)))
        );
    }

    /// An attempt too short to announce its start is laid out from its outcome; a run's end
    /// ends what was still open.
    #[test]
    fn a_timeline_ends_what_the_run_ended() {
        let v = view(&["a", "b"]);
        let run = v.record.handle.run_id;
        let events = vec![
            ev(
                run,
                Some("a"),
                1_400,
                wf(WorkflowPhase::TaskFailed, |w| {
                    w.worker = Some("w1".into());
                    w.started_at = Some(Timestamp::from_unix_ms(1_390));
                }),
            ),
            ev(
                run,
                Some("b"),
                1_300,
                wf(WorkflowPhase::TaskStarted, |_| {}),
            ),
            ev(run, None, 1_500, wf(WorkflowPhase::RunCancelled, |_| {})),
        ];
        let t = timeline(&v, &events);
        assert_eq!(
            (
                t.tasks[0].attempts[0].started_at,
                t.tasks[0].attempts[0].outcome
            ),
            (Timestamp::from_unix_ms(1_390), "failed")
        );
        assert_eq!(
            (
                t.tasks[1].attempts[0].ended_at,
                t.tasks[1].attempts[0].outcome
            ),
            (Some(Timestamp::from_unix_ms(1_500)), "cancelled")
        );
    }

    /// Runs started in the same millisecond share their first digits (a UUIDv7's time): the
    /// short id is their last digits, and longer when two share those.
    #[test]
    fn short_ids_tell_runs_apart() {
        let a: RunId = "01a21f72-0000-7000-8000-00000000abcd"
            .parse()
            .expect("an id");
        let b: RunId = "01a21f72-0000-7000-8000-00010000abcd"
            .parse()
            .expect("an id");
        let c: RunId = "01a21f72-0000-7000-8000-000000001234"
            .parse()
            .expect("an id");
        assert_eq!(short_id(&a, 8), "0000abcd");
        assert_eq!(short_len([a, c].iter()), 8);
        assert_eq!(short_len([a, b, c].iter()), 9);
        assert_eq!(short_id(&b, 9), "10000abcd");
    }
}
