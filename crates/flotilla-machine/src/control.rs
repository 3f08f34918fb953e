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

use flotilla_model::control::{
    Completed, DEFAULT_PAUSE_TIMEOUT, DEFAULT_TAKEOVER_TIMEOUT, MAX_HOLD_TIMEOUT, MIN_HOLD_TIMEOUT,
};
use flotilla_model::event::{WorkflowEvent, WorkflowPhase};
use flotilla_model::run::{EndCause, RunStatus, TaskStatus};
use flotilla_model::runlog::ControlAction;
use flotilla_model::time::Timestamp;

use crate::{Action, Hold, RunMachine};

impl RunMachine {
    /// Whether a person holds the run (nothing is dispatched, no wait times out).
    pub fn held(&self) -> bool {
        self.state.status.is_held()
    }

    /// Applies a pause, takeover or resume. False when it changes nothing (the run is
    /// already in that state; a pause of a run under human control).
    pub(crate) fn on_control(
        &mut self,
        action: ControlAction,
        by: Option<&str>,
        reason: Option<&str>,
        timeout_ms: Option<u64>,
        now_ms: i64,
        actions: &mut Vec<Action>,
    ) -> bool {
        match action {
            ControlAction::Pause if self.state.status == RunStatus::Running => {
                self.state.applied += 1;
                self.hold(RunStatus::Paused, by, reason, timeout_ms, now_ms, actions);
                true
            }
            ControlAction::Takeover if self.state.status != RunStatus::HumanControl => {
                self.state.applied += 1;
                self.hold(
                    RunStatus::HumanControl,
                    by,
                    reason,
                    timeout_ms,
                    now_ms,
                    actions,
                );
                true
            }
            ControlAction::Resume if self.held() => {
                self.state.applied += 1;
                let who = by.map_or_else(String::new, |b| format!(" by {b}"));
                let why = reason.map_or_else(String::new, |r| format!(": {r}"));
                self.resume(format!("resumed{who}{why}"), now_ms, actions);
                true
            }
            _ => false,
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
        // The API checks the range; an entry from elsewhere is brought into it.
        let timeout = timeout_ms.map_or(default.as_millis() as i64, |ms| {
            (ms as i64).clamp(
                MIN_HOLD_TIMEOUT.as_millis() as i64,
                MAX_HOLD_TIMEOUT.as_millis() as i64,
            )
        });
        let deadline_ms = now_ms + timeout;
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
        if let Some(p) = t.approval.take() {
            actions.push(Action::WithdrawApproval {
                task: i,
                attempt: p.attempt,
                call: p.call,
            });
        }
        t.resume = false;
        t.held = false;
        t.dispatched_ms = now_ms;
        self.ready.remove(&i);
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
