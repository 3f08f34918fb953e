//! A person's hold on a run — pause, takeover, resume — and tasks completed by hand.
//!
//! A hold is a status ([`RunStatus::Paused`], [`RunStatus::HumanControl`]) and a deadline on
//! the run's one durable timer: while it lasts nothing is dispatched (attempts already running
//! finish and their results apply), and no wait times out — dependency, topic and claim
//! clocks stand still, and on resume each gives at least its full timeout again. Approvals
//! and retry backoffs keep their own clocks. At the hold's deadline its default applies: a
//! pause resumes, a takeover cancels the run.
//!
//! ```text
//! running ──pause──► paused ──takeover──► human_control
//!    ▲ ▲               │ deadline / resume      │ resume
//!    │ └───────────────┘                        │
//!    └──────────────────────────────────────────┘
//!                        human_control ──deadline──► cancelled
//! ```
//!
//! Whether a pause, resume or takeover changes the run is decided here alone
//! ([`RunMachine::check_control`]): the API appends every control of a run that has not
//! ended, and answers with what the machine made of it — a control that changes nothing (a
//! second pause right after the first) says why ([`Unchanged`]).

use flotilla_model::control::{
    Completed, DEFAULT_PAUSE_TIMEOUT, DEFAULT_TAKEOVER_TIMEOUT, MAX_HOLD_TIMEOUT, MIN_HOLD_TIMEOUT,
};
use flotilla_model::event::{WorkflowEvent, WorkflowPhase};
use flotilla_model::ids::TaskId;
use flotilla_model::lead::LEAD_NAME;
use flotilla_model::run::{EndCause, RunStatus, TaskStatus};
use flotilla_model::runlog::ControlAction;
use flotilla_model::time::Timestamp;

use crate::{Action, Hold, RunMachine};

/// How long a hold lasts, in ms: the entry's `timeout_ms`, or `default`. The API checks the
/// range; an entry from elsewhere is brought into it.
fn hold_ms(timeout_ms: Option<u64>, default: std::time::Duration) -> i64 {
    timeout_ms.map_or(default.as_millis() as i64, |ms| {
        (ms as i64).clamp(
            MIN_HOLD_TIMEOUT.as_millis() as i64,
            MAX_HOLD_TIMEOUT.as_millis() as i64,
        )
    })
}

/// Why a pause, resume or takeover changes nothing, in words for the person who asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unchanged {
    /// The run has ended.
    Ended(RunStatus),
    /// The run is already as asked (a pause of a paused run, a takeover of a run under human
    /// control), holds nothing to resume, or is under human control (a pause does not apply):
    /// its status, and who holds it until when.
    Run {
        /// What was asked.
        action: ControlAction,
        /// The run's status.
        status: RunStatus,
        /// Who holds the run.
        by: Option<String>,
        /// Until when (Unix ms), when held.
        until_ms: Option<i64>,
    },
    /// The run's plan has no such task.
    NoSuchTask(TaskId),
    /// The task has ended.
    TaskEnded(TaskId, TaskStatus),
    /// A pause of a paused task (until when), or a resume of one that is not paused.
    Task {
        /// What was asked.
        action: ControlAction,
        /// The task.
        task: TaskId,
        /// Until when the task is paused (Unix ms), when it is.
        until_ms: Option<i64>,
    },
    /// The lead resuming a task a person paused: only a person (or the pause's deadline)
    /// lifts it.
    PausedByPerson(TaskId),
    /// Not a pause, resume or takeover (a cancel is not decided here).
    NotAHold(ControlAction),
}

impl std::fmt::Display for Unchanged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let until = |ms: &Option<i64>| {
            ms.map_or_else(String::new, |ms| {
                format!(" until {}", Timestamp::from_unix_ms(ms))
            })
        };
        match self {
            Self::Ended(status) => write!(f, "the run has ended ({status})"),
            Self::Run {
                action,
                status,
                by,
                until_ms,
            } => {
                let who = by
                    .as_deref()
                    .map_or_else(String::new, |b| format!(" by {b}"));
                let until = until(until_ms);
                match (action, status) {
                    (ControlAction::Pause, RunStatus::Paused) => {
                        write!(f, "the run is already paused{who}{until}")
                    }
                    (ControlAction::Pause, RunStatus::HumanControl) => write!(
                        f,
                        "the run is under human control{who}{until}: a pause does not apply (resume or cancel it)"
                    ),
                    (ControlAction::Takeover, RunStatus::HumanControl) => {
                        write!(f, "the run is already under human control{who}{until}")
                    }
                    (ControlAction::Resume, status) => {
                        write!(f, "the run is {status}: nothing holds it to resume")
                    }
                    (_, status) => write!(f, "the run is {status}"),
                }
            }
            Self::NoSuchTask(task) => write!(f, "the run has no task {task}"),
            Self::TaskEnded(task, status) => {
                write!(f, "task {task} has ended ({})", status.as_str())
            }
            Self::Task {
                action: ControlAction::Pause,
                task,
                until_ms,
            } => write!(f, "task {task} is already paused{}", until(until_ms)),
            Self::Task { task, .. } => write!(f, "task {task} is not paused"),
            Self::PausedByPerson(task) => write!(
                f,
                "task {task} was paused by a person: only a person (or the pause's deadline) resumes it"
            ),
            Self::NotAHold(action) => write!(f, "{} is not a hold", action.as_str()),
        }
    }
}

impl RunMachine {
    /// Whether a person holds the run (nothing is dispatched, no wait times out).
    pub fn held(&self) -> bool {
        self.state.status.is_held()
    }

    /// Whether a pause, resume or takeover — of the run, or of its task `task` — asked `by`
    /// someone would change the run now, and if not why: the rule
    /// `on_control` and `on_task_control`
    /// apply. A pause applies to a running run, a takeover to one not under human control
    /// already, a resume to a held one; a task's pause to a task not paused, its resume to a
    /// paused one (the lead does not lift a person's pause); nothing to an ended run or task.
    pub fn check_control(
        &self,
        action: ControlAction,
        task: Option<&TaskId>,
        by: Option<&str>,
    ) -> Result<(), Unchanged> {
        let status = self.state.status;
        if status.is_terminal() {
            return Err(Unchanged::Ended(status));
        }
        if let Some(task) = task {
            return self.check_task_control(action, task, by);
        }
        let applies = match action {
            ControlAction::Pause => status == RunStatus::Running,
            ControlAction::Takeover => status != RunStatus::HumanControl,
            ControlAction::Resume => self.held(),
            ControlAction::Cancel => return Err(Unchanged::NotAHold(action)),
        };
        if applies {
            return Ok(());
        }
        let hold = self.state.hold.as_ref().filter(|_| self.held());
        Err(Unchanged::Run {
            action,
            status,
            by: hold.and_then(|h| h.by.clone()),
            until_ms: hold.map(|h| h.deadline_ms),
        })
    }

    /// [`check_control`](Self::check_control) of a task's pause or resume, the run not ended.
    fn check_task_control(
        &self,
        action: ControlAction,
        task: &TaskId,
        by: Option<&str>,
    ) -> Result<(), Unchanged> {
        let Some(i) = self.graph.index_of(task) else {
            return Err(Unchanged::NoSuchTask(task.clone()));
        };
        let t = &self.state.tasks[i as usize];
        if t.status.is_terminal() {
            return Err(Unchanged::TaskEnded(task.clone(), t.status));
        }
        let unchanged = |until_ms: Option<i64>| Unchanged::Task {
            action,
            task: task.clone(),
            until_ms,
        };
        match action {
            ControlAction::Pause if t.paused() => Err(unchanged(Some(t.paused_until_ms))),
            ControlAction::Pause => Ok(()),
            ControlAction::Resume if !t.paused() => Err(unchanged(None)),
            // The lead does not lift a person's pause.
            ControlAction::Resume if !crate::policy::control::may_resume_task(t, by) => {
                Err(Unchanged::PausedByPerson(task.clone()))
            }
            ControlAction::Resume => Ok(()),
            ControlAction::Takeover | ControlAction::Cancel => Err(Unchanged::NotAHold(action)),
        }
    }

    /// Applies a pause, takeover or resume. False when it changes nothing
    /// ([`check_control`](Self::check_control) says why).
    pub(crate) fn on_control(
        &mut self,
        action: ControlAction,
        by: Option<&str>,
        reason: Option<&str>,
        timeout_ms: Option<u64>,
        now_ms: i64,
        actions: &mut Vec<Action>,
    ) -> bool {
        if self.check_control(action, None, by).is_err() {
            return false;
        }
        match action {
            ControlAction::Pause => {
                self.state.applied += 1;
                self.hold(RunStatus::Paused, by, reason, timeout_ms, now_ms, actions);
            }
            ControlAction::Takeover => {
                self.state.applied += 1;
                self.hold(
                    RunStatus::HumanControl,
                    by,
                    reason,
                    timeout_ms,
                    now_ms,
                    actions,
                );
            }
            ControlAction::Resume => {
                self.state.applied += 1;
                let who = by.map_or_else(String::new, |b| format!(" by {b}"));
                let why = reason.map_or_else(String::new, |r| format!(": {r}"));
                self.resume(format!("resumed{who}{why}"), now_ms, actions);
            }
            ControlAction::Cancel => return false,
        }
        true
    }

    /// Applies a pause or resume of one task (a member) of the run: a paused task is not
    /// dispatched and its running LLM attempt stops at its next step boundary, while the rest
    /// of the run goes on; the pause lasts until resumed or its deadline (then it resumes).
    /// False when it changes nothing ([`check_control`](Self::check_control) says why: no
    /// such task, the task has ended, already in that state, the run has ended, the lead
    /// resuming a person's pause, or another action).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on_task_control(
        &mut self,
        action: ControlAction,
        task: &TaskId,
        by: Option<&str>,
        reason: Option<&str>,
        timeout_ms: Option<u64>,
        now_ms: i64,
        actions: &mut Vec<Action>,
    ) -> bool {
        if self.check_control(action, Some(task), by).is_err() {
            return false;
        }
        let Some(i) = self.graph.index_of(task) else {
            return false;
        };
        let t = &self.state.tasks[i as usize];
        let who = by.map_or_else(String::new, |b| format!(" by {b}"));
        let why = reason.map_or_else(String::new, |r| format!(": {r}"));
        match action {
            ControlAction::Pause => {
                let deadline_ms = now_ms + hold_ms(timeout_ms, DEFAULT_PAUSE_TIMEOUT);
                self.state.applied += 1;
                let dispatched = t.status == TaskStatus::Dispatched;
                let t = &mut self.state.tasks[i as usize];
                t.paused_until_ms = deadline_ms;
                t.paused_by_lead = by == Some(LEAD_NAME);
                self.ready.remove(&i);
                if dispatched {
                    actions.push(Action::HoldTask {
                        task: i,
                        held: true,
                    });
                }
                let running = if dispatched {
                    "; its running attempt stops at its next step boundary"
                } else {
                    ""
                };
                self.emit(
                    Some(i),
                    None,
                    now_ms,
                    WorkflowEvent {
                        detail: Some(format!(
                            "paused{who}{why}{running}; resumes at {} unless resumed first",
                            Timestamp::from_unix_ms(deadline_ms)
                        )),
                        ..WorkflowEvent::phase(WorkflowPhase::TaskPaused)
                    },
                    actions,
                );
                self.arm_if_earlier(deadline_ms, actions);
                true
            }
            ControlAction::Resume => {
                self.state.applied += 1;
                self.resume_task(i, format!("resumed{who}{why}"), now_ms, actions);
                true
            }
            ControlAction::Takeover | ControlAction::Cancel => false,
        }
    }

    /// Ends task `i`'s own pause: it runs once its dependencies are met (a suspended attempt
    /// continues from its journal).
    fn resume_task(&mut self, i: u32, detail: String, now_ms: i64, actions: &mut Vec<Action>) {
        let t = &mut self.state.tasks[i as usize];
        t.paused_until_ms = 0;
        t.paused_by_lead = false;
        t.resumed_ms = now_ms;
        if t.attempt > 0 {
            // It ran before: a hold key may be there for it.
            actions.push(Action::HoldTask {
                task: i,
                held: false,
            });
        }
        self.emit(
            Some(i),
            None,
            now_ms,
            WorkflowEvent {
                detail: Some(detail),
                ..WorkflowEvent::phase(WorkflowPhase::TaskResumed)
            },
            actions,
        );
        self.release(i, now_ms, actions);
        self.rescan_deadlines = true;
    }

    /// The timer fired: tasks whose own pause's deadline passed resume.
    pub(crate) fn task_pauses_overdue(&mut self, now_ms: i64, actions: &mut Vec<Action>) {
        for i in 0..self.state.tasks.len() as u32 {
            let t = &self.state.tasks[i as usize];
            if t.paused() && !t.status.is_terminal() && t.paused_until_ms <= now_ms {
                self.resume_task(
                    i,
                    "resumed: the pause's deadline passed".into(),
                    now_ms,
                    actions,
                );
            }
        }
    }

    fn hold(
        &mut self,
        status: RunStatus,
        by: Option<&str>,
        reason: Option<&str>,
        timeout_ms: Option<u64>,
        now_ms: i64,
        actions: &mut Vec<Action>,
    ) {
        let default = match status {
            RunStatus::Paused => DEFAULT_PAUSE_TIMEOUT,
            _ => DEFAULT_TAKEOVER_TIMEOUT,
        };
        let deadline_ms = now_ms + hold_ms(timeout_ms, default);
        let since_ms = match (&self.state.hold, self.state.status) {
            // A takeover of a paused run: the clocks stopped at the pause.
            (Some(h), RunStatus::Paused) => h.since_ms,
            _ => now_ms,
        };
        if self.state.status == RunStatus::Running {
            actions.push(Action::HoldAttempts { held: true });
        }
        self.state.status = status;
        self.state.hold = Some(Hold {
            since_ms,
            deadline_ms,
            by: by.map(str::to_owned),
            reason: reason.map(str::to_owned),
            approval: None,
        });
        let (phase, what, then) = match status {
            RunStatus::Paused => (WorkflowPhase::RunPaused, "paused", "resumes"),
            _ => (WorkflowPhase::RunTakenOver, "taken over", "is cancelled"),
        };
        let who = by.map_or_else(String::new, |b| format!(" by {b}"));
        let why = reason.map_or_else(String::new, |r| format!(": {r}"));
        self.emit(
            None,
            None,
            now_ms,
            WorkflowEvent {
                detail: Some(format!(
                    "{what}{who}{why}; {then} at {} unless resumed or cancelled first",
                    Timestamp::from_unix_ms(deadline_ms)
                )),
                ..WorkflowEvent::phase(phase)
            },
            actions,
        );
        self.arm_if_earlier(deadline_ms, actions);
    }

    /// Task `i` waits for a person to extend the run's budget: the run is paused until that
    /// request is decided (the pause's deadline is the request's; its default decides then),
    /// so that its other attempts do not run into the same budget meanwhile. A run already
    /// held stays as it is.
    pub(crate) fn pause_for_budget(&mut self, i: u32, now_ms: i64, actions: &mut Vec<Action>) {
        let Some(pending) = self.state.tasks[i as usize].approval else {
            return;
        };
        if self.state.status != RunStatus::Running {
            return;
        }
        let id = pending.id(i);
        let timeout = (pending.deadline_ms - now_ms).max(MIN_HOLD_TIMEOUT.as_millis() as i64);
        self.hold(
            RunStatus::Paused,
            Some("flotilla"),
            Some(&format!(
                "the run's budget is spent; approval {id} asks a person to extend it"
            )),
            Some(timeout as u64),
            now_ms,
            actions,
        );
        if let Some(h) = self.state.hold.as_mut() {
            h.approval = Some(id);
        }
    }

    /// Approval `id` was decided: a pause Flotilla made for it ends.
    pub(crate) fn end_budget_pause(&mut self, id: &str, now_ms: i64, actions: &mut Vec<Action>) {
        let ours = self.state.status == RunStatus::Paused
            && self
                .state
                .hold
                .as_ref()
                .is_some_and(|h| h.approval.as_deref() == Some(id));
        if ours {
            self.resume(
                format!("resumed: the budget request {id} was decided"),
                now_ms,
                actions,
            );
        }
    }

    fn resume(&mut self, detail: String, now_ms: i64, actions: &mut Vec<Action>) {
        let hold = self.state.hold.take();
        actions.push(Action::HoldAttempts { held: false });
        self.state.status = RunStatus::Running;
        self.state.resumed_ms = now_ms;
        if let Some(h) = hold
            && self.state.lead_deadline_ms > 0
        {
            // The lead's clock stood still too.
            self.state.lead_deadline_ms += (now_ms - h.since_ms).max(0);
        }
        // Deadlines skipped while held are armed again.
        self.rescan_deadlines = true;
        self.emit(
            None,
            None,
            now_ms,
            WorkflowEvent {
                detail: Some(detail),
                ..WorkflowEvent::phase(WorkflowPhase::RunResumed)
            },
            actions,
        );
    }

    /// When the hold's default applies.
    pub(crate) fn hold_deadline(&self) -> Option<i64> {
        self.state
            .hold
            .as_ref()
            .filter(|_| self.held())
            .map(|h| h.deadline_ms)
    }

    /// The timer fired while held: at the hold's deadline, its default. True when the run is
    /// still held (the caller then handles only approvals and retries).
    pub(crate) fn hold_overdue(&mut self, now_ms: i64, actions: &mut Vec<Action>) -> bool {
        if !self.held() {
            return false;
        }
        if self.hold_deadline().is_some_and(|d| d <= now_ms) {
            if self.state.status == RunStatus::Paused {
                self.resume(
                    "resumed: the pause's deadline passed".into(),
                    now_ms,
                    actions,
                );
                return false;
            }
            self.stop(
                RunStatus::Cancelled,
                "cancelled: the takeover's deadline passed with nobody resuming or cancelling the run"
                    .into(),
                EndCause::Cancelled,
                now_ms,
                actions,
            );
        }
        true
    }

    /// Whether task `i` has started: dispatched at least once, waiting for a person, or
    /// ended — what a plan edit may not change.
    pub(crate) fn started(&self, i: usize) -> bool {
        self.state.tasks[i].started()
    }

    /// Applies a person's edit of the plan (the run under human control): the run follows the
    /// edited plan from here — waiting tasks as edited, new tasks appended. Refused (an event
    /// says why, nothing changes) when the run is not under human control, or the edit changes
    /// a task that started meanwhile, or its structure does not hold.
    pub(crate) fn on_plan_edited(
        &mut self,
        e: &flotilla_model::control::PlanEdited,
        seq: u64,
        now_ms: i64,
        actions: &mut Vec<Action>,
    ) {
        if seq <= self.state.plan_seq {
            // This edit (or an older one) is already the run's plan: a redelivery.
            return;
        }
        self.state.applied += 1;
        let mut problems: Vec<String> = Vec::new();
        if self.state.status != RunStatus::HumanControl || self.unplanned() {
            problems.push(format!(
                "the run is {}, not under human control",
                self.state.status
            ));
        } else {
            problems.extend(
                flotilla_model::control::edit_problems(&self.plan, &e.plan, |i| self.started(i))
                    .iter()
                    .map(ToString::to_string),
            );
            // Structure only: what the deployment allows was checked by the API, and must
            // not make replays differ.
            let report = flotilla_model::validate::validate_plan(
                &e.plan,
                &flotilla_model::validate::ValidationContext::default(),
            );
            problems.extend(report.errors.iter().map(ToString::to_string));
        }
        if !problems.is_empty() {
            problems.truncate(5);
            self.emit(
                None,
                None,
                now_ms,
                WorkflowEvent {
                    detail: Some(format!(
                        "plan edit by {} refused: {}",
                        e.by,
                        problems.join("; ")
                    )),
                    ..WorkflowEvent::phase(WorkflowPhase::PlanEditRefused)
                },
                actions,
            );
            return;
        }
        let before = self.plan.subtasks.len();
        let changed: Vec<String> = flotilla_model::control::changed_tasks(&self.plan, &e.plan)
            .iter()
            .map(ToString::to_string)
            .collect();
        let led = self
            .state
            .strategy
            .as_ref()
            .is_some_and(|s| s.strategy == flotilla_model::plan::Strategy::Supervisor);
        let plan = std::sync::Arc::new(e.plan.clone());
        let graph = std::sync::Arc::new(crate::RunGraph::new(&plan));
        let mut state = self.state.clone();
        state
            .tasks
            .resize(plan.subtasks.len(), crate::TaskState::held(led));
        // Topic indexes are the graph's: the topics with an entry are carried over by name
        // (an edit uses no new topic).
        let ready: Vec<&str> = self
            .state
            .topics_ready
            .iter()
            .map(|&t| self.graph.topic_name(t))
            .collect();
        state.topics_ready = ready.iter().filter_map(|n| graph.topic_of(n)).collect();
        state.topics_ready.sort_unstable();
        state.plan_seq = seq;
        state.edit_mark = Some((state.recruited.len() as u32, state.team.len() as u32));
        *self = Self::restore_with_graph(plan, graph, state);
        self.rescan_deadlines = true;
        let added = self.graph.len() - before;
        self.emit(
            None,
            None,
            now_ms,
            WorkflowEvent {
                tasks_total: Some(self.graph.len() as u32),
                detail: Some(format!(
                    "plan edited by {}{}: {added} task(s) added{}",
                    e.by,
                    e.reason
                        .as_deref()
                        .map_or_else(String::new, |r| format!(" ({r})")),
                    if changed.is_empty() {
                        String::new()
                    } else {
                        format!(", changed: {}", changed.join(", "))
                    }
                )),
                ..WorkflowEvent::phase(WorkflowPhase::PlanEdited)
            },
            actions,
        );
        // A waiting task whose (new) dependency already ended without succeeding is skipped
        // now, as it would have been had the dependency been there from the start.
        for i in 0..self.graph.len() as u32 {
            if self.state.tasks[i as usize].status == TaskStatus::Waiting {
                self.skip_if_dependency_ended(i, now_ms, actions);
            }
        }
    }

    /// Applies a task a person completed by hand. False when it changes nothing: no such
    /// task, or it runs or has ended.
    pub(crate) fn on_completed(
        &mut self,
        completed: &Completed,
        seq: u64,
        now_ms: i64,
        actions: &mut Vec<Action>,
    ) -> bool {
        let Some(i) = self.graph.index_of(&completed.task_id) else {
            return false;
        };
        let t = &mut self.state.tasks[i as usize];
        if !matches!(
            t.status,
            TaskStatus::Waiting | TaskStatus::Retrying | TaskStatus::AwaitingApproval
        ) {
            return false;
        }
        self.state.applied += 1;
        let withdrawn = t.approval.take();
        if let Some(p) = withdrawn {
            actions.push(Action::WithdrawApproval {
                task: i,
                attempt: p.attempt,
                call: p.call,
            });
        }
        let t = &mut self.state.tasks[i as usize];
        t.resume = false;
        t.held = false;
        t.dispatched_ms = now_ms;
        self.ready.remove(&i);
        if let Some(p) =
            withdrawn.filter(|p| p.trigger == flotilla_model::approval::Trigger::Budget)
        {
            // Settled by hand: a pause made for its budget request ends with it.
            self.end_budget_pause(&p.id(i), now_ms, actions);
        }
        let comment = completed
            .comment
            .as_deref()
            .map_or_else(String::new, |c| format!(": {c}"));
        self.succeed(
            i,
            seq,
            now_ms,
            WorkflowEvent {
                worker: Some(format!("human:{}", completed.by)),
                detail: Some(format!("completed by hand by {}{comment}", completed.by)),
                ..WorkflowEvent::phase(WorkflowPhase::TaskSucceeded)
            },
            actions,
        );
        true
    }
}
