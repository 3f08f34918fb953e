//! What a run is doing, as a person reads it: whether it waits for a person (and for what,
//! and the command that answers), and which of its tasks a worker is running (which worker,
//! since when).
//!
//! The run record says `running` for a run that waits for an approval, and a task reads
//! `dispatched` from the moment it is queued until its result is stored. Both are true to the
//! run machine, which decides what runs next, but a person asks another question: is
//! something working, or is someone expected to act? This module answers it from what is
//! already stored — the pending approvals (`approval.list`) and the run's own
//! `task_started` events — so it costs the hot path nothing and reads the same on every
//! version of the services. The CLI (`runs list`, `runs show`) and the console show it.

use std::collections::HashMap;
use std::time::Duration;

use flotilla_model::approval::{ApprovalList, ApprovalListRequest, ApprovalRecord, Trigger};
use flotilla_model::event::{Event, EventEnvelope, WorkflowPhase};
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::run::{RunRecord, RunStatus, TaskStatus, TaskView};
use flotilla_model::time::Timestamp;
use futures::StreamExt;
use serde::Serialize;

use crate::{Client, ClientError};

/// Most event messages read to find which worker runs each task (a run with more — a long
/// LLM run's steps — shows its first tasks' workers only).
const MAX_EVENT_MESSAGES: u64 = 20_000;

/// Why a run or task waits for a person.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WaitKind {
    /// An approval: a task's dispatch, a tool call, a result held for review, a cost.
    Approval,
    /// An agent asked a question (`ask_user`), or called a tool a person answers for.
    Question,
    /// An agent called a tool the client runs (`client_tools`).
    ClientTool,
    /// A person paused the run.
    Pause,
    /// A person took the run over.
    Takeover,
}

impl WaitKind {
    /// The kind in words.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Approval => "approval",
            Self::Question => "question",
            Self::ClientTool => "client tool",
            Self::Pause => "pause",
            Self::Takeover => "takeover",
        }
    }
}

/// One thing a run waits for a person to do.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Wait {
    /// What kind of wait.
    pub kind: WaitKind,
    /// The task that waits (none for a hold of the whole run).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub task_id: Option<TaskId>,
    /// The approval (or question) id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub approval_id: Option<String>,
    /// What is asked, in a line.
    pub what: String,
    /// When the wait's default applies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline: Option<Timestamp>,
    /// The command that answers it.
    pub answer: String,
}

/// What a worker is doing with a task now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Activity {
    /// The attempt that runs.
    pub attempt: u32,
    /// The worker that started it.
    pub worker: String,
    /// When it started (the worker's clock).
    pub started_at: Timestamp,
}

/// A run as a person reads it: its waits and its tasks' activity.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Progress {
    /// What the run waits for a person to do, oldest first.
    pub waiting: Vec<Wait>,
    /// Tasks a worker is running now, by task.
    pub running: HashMap<TaskId, Activity>,
}

impl Progress {
    /// The waits of one task.
    pub fn waits_of<'a>(&'a self, task: &'a TaskId) -> impl Iterator<Item = &'a Wait> + 'a {
        self.waiting
            .iter()
            .filter(move |w| w.task_id.as_ref() == Some(task))
    }
}

/// The status a person reads for a run: `waiting` for a live run some person must act on,
/// else the record's status.
pub fn run_label(status: RunStatus, waiting: &[Wait]) -> &'static str {
    if status.is_held() || (!status.is_terminal() && !waiting.is_empty()) {
        "waiting"
    } else {
        status.as_str()
    }
}

/// The status a person reads for a task: `running` once a worker started its attempt,
/// `awaiting_answer` / `awaiting_approval` while a person is asked, else its status.
pub fn task_label(task: &TaskView, progress: &Progress) -> &'static str {
    if task.status == TaskStatus::Dispatched {
        if let Some(w) = progress.waits_of(&task.task_id).next() {
            return match w.kind {
                WaitKind::Question | WaitKind::ClientTool => "awaiting_answer",
                _ => "awaiting_approval",
            };
        }
        if progress.running.contains_key(&task.task_id) {
            return "running";
        }
    }
    task.status.as_str()
}

/// The waits of a run from its record and its pending approvals (any run's: those of other
/// runs are left out).
pub fn waits(record: &RunRecord, pending: &[ApprovalRecord]) -> Vec<Wait> {
    let run = record.handle.run_id;
    let mut out = Vec::new();
    match record.status {
        RunStatus::Paused => out.push(Wait {
            kind: WaitKind::Pause,
            task_id: None,
            approval_id: None,
            what: "paused by a person".into(),
            deadline: None,
            answer: format!("flotilla runs resume {run}"),
        }),
        RunStatus::HumanControl => out.push(Wait {
            kind: WaitKind::Takeover,
            task_id: None,
            approval_id: None,
            what: "taken over by a person".into(),
            deadline: None,
            answer: format!("flotilla runs resume {run} (or runs complete / runs cancel)"),
        }),
        _ => {}
    }
    if record.status.is_terminal() {
        return out;
    }
    for a in pending.iter().filter(|a| a.request.run_id == run) {
        out.push(wait_of(a));
    }
    out
}

/// The wait one pending approval stands for, with the command that answers it.
pub fn wait_of(a: &ApprovalRecord) -> Wait {
    let r = &a.request;
    let (kind, answer) = match r.trigger {
        Trigger::Question | Trigger::OutOfScope => (
            WaitKind::Question,
            format!(
                "flotilla runs answer {} {} --text …",
                r.run_id, r.approval_id
            ),
        ),
        Trigger::ClientTool => (
            WaitKind::ClientTool,
            format!(
                "the client answers it (or: flotilla approvals respond {} {} --result …)",
                r.run_id, r.approval_id
            ),
        ),
        _ => (
            WaitKind::Approval,
            format!(
                "flotilla approvals approve {} {} (or reject)",
                r.run_id, r.approval_id
            ),
        ),
    };
    let what = match (&r.tool_call, r.trigger) {
        (_, Trigger::Question) => format!("asks: {}", one_line(&r.description, 120)),
        (Some(call), _) => format!("tool {} ({})", call.tool, trigger_words(r.trigger)),
        (None, t) => format!("dispatch of {} ({})", r.task_id, trigger_words(t)),
    };
    Wait {
        kind,
        task_id: Some(r.task_id.clone()),
        approval_id: Some(r.approval_id.clone()),
        what,
        deadline: Some(r.deadline),
        answer,
    }
}

fn trigger_words(t: Trigger) -> String {
    t.as_str().replace('_', " ")
}

fn one_line(s: &str, max: usize) -> String {
    let flat = s.replace('\n', " ");
    if flat.chars().count() <= max {
        return flat;
    }
    let mut cut: String = flat.chars().take(max).collect();
    cut.push('…');
    cut
}

/// Which tasks a worker runs now, from the run's events: the latest attempt of each task
/// that has a `task_started` and no outcome yet, for the tasks the run machine says are
/// dispatched.
pub fn activity(tasks: &[TaskView], events: &[EventEnvelope]) -> HashMap<TaskId, Activity> {
    let dispatched: HashMap<&TaskId, u32> = tasks
        .iter()
        .filter(|t| t.status == TaskStatus::Dispatched)
        .map(|t| (&t.task_id, t.attempts))
        .collect();
    let mut out: HashMap<TaskId, Activity> = HashMap::new();
    for e in events {
        let (Some(task), Event::Workflow(w)) = (&e.task_id, &e.event) else {
            continue;
        };
        let Some(&attempts) = dispatched.get(task) else {
            continue;
        };
        let attempt = e.attempt.unwrap_or(0);
        match w.phase {
            WorkflowPhase::TaskStarted if attempt == attempts || attempts == 0 => {
                out.insert(
                    task.clone(),
                    Activity {
                        attempt,
                        worker: w.worker.clone().unwrap_or_default(),
                        started_at: e.ts,
                    },
                );
            }
            WorkflowPhase::TaskSuspended
            | WorkflowPhase::TaskRetrying
            | WorkflowPhase::TaskFailed
            | WorkflowPhase::TaskSucceeded
                if out.get(task).is_some_and(|a| a.attempt <= attempt) =>
            {
                out.remove(task);
            }
            _ => {}
        }
    }
    out
}

impl Client {
    /// Pending approvals, of one run or of every run (at most 1000, oldest first).
    pub async fn pending_approvals(
        &self,
        run: Option<RunId>,
    ) -> Result<Vec<ApprovalRecord>, ClientError> {
        let request = ApprovalListRequest {
            protocol: flotilla_model::PROTOCOL_VERSION,
            run_id: run,
            all: false,
            limit: None,
        };
        let list: ApprovalList = self.request(&request, Duration::from_secs(5)).await?;
        Ok(list.approvals)
    }

    /// The events `run` has stored so far (at most [`MAX_EVENT_MESSAGES`] messages' worth),
    /// in order: a snapshot, where [`Client::events`] follows live.
    pub async fn events_so_far(&self, run: RunId) -> Result<Vec<EventEnvelope>, ClientError> {
        let consumer = self.event_consumer(run).await?;
        let mut left = consumer.cached_info().num_pending.min(MAX_EVENT_MESSAGES);
        let mut out = Vec::new();
        if left == 0 {
            return Ok(out);
        }
        let mut messages = consumer
            .messages()
            .await
            .map_err(|e| crate::nats("reading events", e))?;
        while left > 0 {
            let next = tokio::time::timeout(Duration::from_secs(5), messages.next()).await;
            let Ok(Some(m)) = next else {
                break;
            };
            let m = m.map_err(|e| crate::nats("reading events", e))?;
            left -= 1;
            out.extend(crate::decode_event_message(&m)?);
        }
        Ok(out)
    }

    /// What `view`'s run waits for and which of its tasks run where. Without a coordinator
    /// to list approvals, the waits are the run's holds only.
    pub async fn progress(
        &self,
        view: &flotilla_model::run::RunView,
    ) -> Result<Progress, ClientError> {
        let run = view.record.handle.run_id;
        if view.record.status.is_terminal() {
            return Ok(Progress::default());
        }
        let pending = self.pending_approvals(Some(run)).await.unwrap_or_default();
        let events = self.events_so_far(run).await?;
        Ok(Progress {
            waiting: waits(&view.record, &pending),
            running: activity(&view.tasks, &events),
        })
    }
}
