//! Tasks that wait for a person: asking before a dispatch, the deadline, and applying the
//! decision. A waiting task is only a state ([`TaskStatus::AwaitingApproval`] with its
//! [`PendingApproval`]) and a deadline on the run's one durable timer: it holds no slot.
//!
//! ```text
//! ready ──gated by the run's policy──► awaiting_approval ──approve / edit──► waiting (runs next)
//!                                            │  │
//!                                            │  └──respond──► succeeded (the person's result)
//!                                            └──reject──► required: the run fails
//!                                                         optional: skipped (dependents too)
//! ```
//!
//! Every answer is its own run-log entry ([`Input::ApprovalDecided`], appended by the API),
//! and so is the deadline's timer firing: the first of them in log order decides, once. An
//! answer applies while the task waits for it; once the deadline has fired, the wait takes
//! only its default, which the runtime appends as the record of that decision
//! ([`Action::ExpireApproval`]) — what a resumed attempt and a replay read. Each decision is
//! then written to the escalations bucket ([`Action::ProjectApproval`]): the bucket is a
//! projection of the log, not an arbiter.

use flotilla_model::approval::{ApprovalDecided, ApprovalStatus, Decision, Trigger, approval_id};
use flotilla_model::event::{WorkflowEvent, WorkflowPhase};
use flotilla_model::run::{EndCause, RunStatus, TaskStatus};
use flotilla_model::runlog::Suspended;
use flotilla_model::task::{TaskError, TaskErrorKind};
use flotilla_model::time::Timestamp;

use crate::{Action, PendingApproval, RunMachine};

impl RunMachine {
    /// Before ready task `i` is dispatched: when the run's policy gates it and its next
    /// attempt is not approved yet, it starts waiting for a person (true: do not dispatch).
    /// Under `human_on_the_loop` the person is only notified, once per attempt.
    pub(crate) fn ask_first(&mut self, i: u32, now_ms: i64, actions: &mut Vec<Action>) -> bool {
        let Some(policy) = self.state.hitl.as_ref() else {
            return false;
        };
        if self.state.tasks[i as usize].resume {
            // A suspended attempt continuing: its dispatch was decided long ago.
            return false;
        }
        let next = self.state.tasks[i as usize].attempt + 1;
        if self.state.tasks[i as usize].approved == next {
            return false;
        }
        // Every attempt before the next one failed: a task that succeeded is not retried.
        let failed = next - 1;
        let Some(gate) = crate::policy::hitl::gate(policy, &self.plan.subtasks[i as usize], failed)
        else {
            return false;
        };
        let trigger = gate.trigger;
        if gate.notify_only {
            let deadline_ms = now_ms + policy.timeout.get().as_millis() as i64;
            actions.push(Action::RequestApproval {
                task: i,
                attempt: next,
                trigger,
                deadline_ms,
                notify_only: true,
                call: 0,
                from_seq: 0,
            });
            self.state.tasks[i as usize].approved = next;
            self.emit(
                Some(i),
                None,
                now_ms,
                WorkflowEvent {
                    detail: Some(format!(
                        "{}: notified (human_on_the_loop), dispatched without waiting",
                        trigger.as_str()
                    )),
                    approval_id: Some(approval_id(i, next)),
                    ..WorkflowEvent::phase(WorkflowPhase::ApprovalDecided)
                },
                actions,
            );
            return false;
        }
        self.wait_for_person(
            i,
            PendingApproval::new(next, trigger, 0, 0),
            WorkflowEvent::phase(WorkflowPhase::ApprovalRequested),
            |until| format!("{}: waiting for approval until {until}", trigger.as_str()),
            now_ms,
            actions,
        );
        true
    }

    /// Task `i` starts waiting for a person: `pending` gets its deadline (the run's approval
    /// timeout from now), the task is `awaiting_approval` (no slot), the runtime is asked to
    /// store the request, `event` goes out as `approval_requested` with the approval id and
    /// `detail(deadline)`, and the deadline joins the run's timer. Every wait — a dispatch, a
    /// suspended tool call, a result's review — starts here.
    fn wait_for_person(
        &mut self,
        i: u32,
        mut pending: PendingApproval,
        mut event: WorkflowEvent,
        detail: impl FnOnce(Timestamp) -> String,
        now_ms: i64,
        actions: &mut Vec<Action>,
    ) {
        let timeout = self
            .state
            .hitl
            .as_ref()
            .map_or(flotilla_model::approval::DEFAULT_APPROVAL_TIMEOUT, |p| {
                p.timeout
            });
        pending.deadline_ms = now_ms + timeout.get().as_millis() as i64;
        let t = &mut self.state.tasks[i as usize];
        t.status = TaskStatus::AwaitingApproval;
        t.approval = Some(pending);
        actions.push(Action::RequestApproval {
            task: i,
            attempt: pending.attempt,
            trigger: pending.trigger,
            deadline_ms: pending.deadline_ms,
            notify_only: false,
            call: pending.call,
            from_seq: pending.from_seq,
        });
        event.detail = Some(detail(Timestamp::from_unix_ms(pending.deadline_ms)));
        event.approval_id = Some(pending.id(i));
        // A dispatch's wait is before its attempt exists; a tool call's or a review's is of a
        // running or finished attempt.
        let attempt = (pending.call != 0).then_some(pending.attempt);
        self.emit(Some(i), attempt, now_ms, event, actions);
        self.arm_if_earlier(pending.deadline_ms, actions);
    }

    /// The confidence and the threshold when task `i`'s result, stating `confidence`, is
    /// held for review (trigger `low_confidence`): below the run's threshold, and the task
    /// not overseen `human_on_the_loop` (notified only: nothing waits).
    pub(crate) fn review_threshold(&self, i: u32, confidence: Option<f64>) -> Option<(f64, f64)> {
        let policy = self.state.hitl.as_ref()?;
        crate::policy::hitl::review(policy, &self.plan.subtasks[i as usize], confidence?)
    }

    /// Task `i`'s successful result (at run-log `seq`) is held for review: the task waits
    /// for a person (approval `t<i>a<attempt>r`) with the result as what is asked about,
    /// holding no slot; its dependents wait.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ask_review(
        &mut self,
        i: u32,
        attempt: u32,
        (confidence, threshold): (f64, f64),
        seq: u64,
        now_ms: i64,
        worker: Option<&str>,
        actions: &mut Vec<Action>,
    ) {
        let pending = PendingApproval::new(
            attempt,
            Trigger::LowConfidence,
            flotilla_model::approval::REVIEW_CALL,
            seq,
        );
        self.wait_for_person(
            i,
            pending,
            WorkflowEvent {
                worker: worker.map(str::to_owned),
                ..WorkflowEvent::phase(WorkflowPhase::ApprovalRequested)
            },
            |until| {
                format!(
                    "low_confidence: result confidence {confidence:.2} is below {threshold:.2}; held for review until {until}"
                )
            },
            now_ms,
            actions,
        );
    }

    /// When task `i`'s wait for a person ends by its default (once: not while it is being
    /// settled).
    pub(crate) fn approval_deadline(&self, i: u32) -> Option<i64> {
        let t = &self.state.tasks[i as usize];
        t.approval
            .filter(|p| t.status == TaskStatus::AwaitingApproval && !p.expiring)
            .map(|p| p.deadline_ms)
    }

    /// Task `i`'s deadline fired before any answer in log order: its default decides. From
    /// here the wait takes no answer, only the default's record, which the runtime appends.
    pub(crate) fn expire_approval(&mut self, i: u32, actions: &mut Vec<Action>) {
        let default = self
            .state
            .hitl
            .as_ref()
            .zip(self.state.tasks[i as usize].approval)
            .map(|(policy, p)| policy.on_timeout.of(p.trigger));
        if let Some(p) = self.state.tasks[i as usize].approval.as_mut() {
            p.expiring = true;
            actions.push(Action::ExpireApproval {
                task: i,
                attempt: p.attempt,
                call: p.call,
                default: Some(default.unwrap_or_default()),
            });
        }
    }

    /// Applies a decided approval. False when it changes nothing: the task does not wait for
    /// this approval (decided already, another attempt, the run moved on).
    pub(crate) fn on_approval_decided(
        &mut self,
        decided: &ApprovalDecided,
        seq: u64,
        now_ms: i64,
        actions: &mut Vec<Action>,
    ) -> bool {
        let Some(i) = self.graph.index_of(&decided.task_id) else {
            return false;
        };
        let t = &self.state.tasks[i as usize];
        let Some(pending) = t.approval else {
            return false;
        };
        if t.status != TaskStatus::AwaitingApproval
            || pending.attempt != decided.attempt
            || pending.id(i) != decided.approval_id
            || decided.status == ApprovalStatus::Pending
            // The deadline fired first: only its default's record applies.
            || (pending.expiring && decided.status != ApprovalStatus::Expired)
        {
            return false;
        }
        self.state.applied += 1;
        actions.push(Action::ProjectApproval {
            task: i,
            attempt: pending.attempt,
            call: pending.call,
            from_seq: pending.from_seq,
            trigger: pending.trigger,
            deadline_ms: pending.deadline_ms,
            seq,
        });
        let attempt = pending.attempt;
        if pending.trigger == Trigger::Budget {
            self.end_budget_pause(&decided.approval_id, now_ms, actions);
        }
        let t = &mut self.state.tasks[i as usize];
        t.approval = None;
        let how = match decided.status {
            ApprovalStatus::Expired => "by its deadline's default",
            _ => "by",
        };
        let who = if decided.status == ApprovalStatus::Expired {
            String::new()
        } else {
            format!(" {}", decided.by)
        };
        let detail = format!("{} {how}{who}", decided.decision.as_str());
        let incident = match &decided.decision {
            Decision::Reject { message } if decided.incident => Some(format!(
                "approval {} of run {} rejected by {} as an incident{}",
                decided.approval_id,
                self.state.run_id,
                decided.by,
                if message.is_empty() {
                    String::new()
                } else {
                    format!(": {message}")
                }
            )),
            _ => None,
        };
        self.emit(
            Some(i),
            Some(attempt),
            now_ms,
            WorkflowEvent {
                detail: Some(detail),
                approval_id: Some(decided.approval_id.clone()),
                incident,
                ..WorkflowEvent::phase(WorkflowPhase::ApprovalDecided)
            },
            actions,
        );
        let id = self.plan.subtasks[i as usize].id.clone();
        if pending.call == flotilla_model::approval::REVIEW_CALL {
            // A held result's review: approve keeps the worker's result, respond and edit
            // replace it with the person's (the decision's entry is read as the result);
            // reject is a rejection like any other (below).
            let (result_seq, detail) = match &decided.decision {
                Decision::Approve => (
                    pending.from_seq,
                    format!("result approved on review {how}{who}"),
                ),
                Decision::Respond { .. } | Decision::Edit { .. } => {
                    (seq, format!("result replaced on review {how}{who}"))
                }
                Decision::Reject { .. } => (0, String::new()),
            };
            if result_seq != 0 {
                let t = &mut self.state.tasks[i as usize];
                t.attempt = attempt;
                self.succeed(
                    i,
                    result_seq,
                    now_ms,
                    WorkflowEvent {
                        detail: Some(detail),
                        ..WorkflowEvent::phase(WorkflowPhase::TaskSucceeded)
                    },
                    actions,
                );
                return true;
            }
        } else if pending.call > 0 {
            // A tool call's decision, whatever it is, goes to the suspended attempt: it
            // continues on some worker, which runs the call or hands the model the person's
            // answer (a rejection's message, a supplied result).
            let t = &mut self.state.tasks[i as usize];
            t.decisions.push(seq);
            t.resume = true;
            t.status = TaskStatus::Waiting;
            self.release(i, now_ms, actions);
            return true;
        }
        match &decided.decision {
            Decision::Approve | Decision::Edit { .. } => {
                let t = &mut self.state.tasks[i as usize];
                t.approved = attempt;
                t.edit_seq = match decided.decision {
                    Decision::Edit { .. } => seq,
                    _ => 0,
                };
                t.status = TaskStatus::Waiting;
                self.release(i, now_ms, actions);
            }
            Decision::Respond { .. } => {
                // The person's result stands for the attempt: it succeeds as if a worker had
                // answered (the run log's entry at `seq` is read as its result).
                let t = &mut self.state.tasks[i as usize];
                t.attempt = attempt;
                t.dispatched_ms = now_ms;
                self.succeed(
                    i,
                    seq,
                    now_ms,
                    WorkflowEvent {
                        detail: Some(format!("result supplied by {}", decided.by)),
                        ..WorkflowEvent::phase(WorkflowPhase::TaskSucceeded)
                    },
                    actions,
                );
            }
            Decision::Reject { message } => {
                let why = if message.is_empty() {
                    format!("approval rejected {how}{who}")
                } else {
                    format!("approval rejected {how}{who}: {message}")
                };
                if self.plan.subtasks[i as usize].required {
                    self.state.tasks[i as usize].status = TaskStatus::Waiting;
                    self.stop(
                        RunStatus::Failed,
                        format!("required task {id}: {why}"),
                        EndCause::ApprovalRejected,
                        now_ms,
                        actions,
                    );
                } else {
                    let t = &mut self.state.tasks[i as usize];
                    t.status = TaskStatus::Skipped;
                    t.skip_reason = Some(why.clone());
                    self.terminal += 1;
                    self.emit(
                        Some(i),
                        None,
                        now_ms,
                        WorkflowEvent {
                            detail: Some(why),
                            ..WorkflowEvent::phase(WorkflowPhase::TaskSkipped)
                        },
                        actions,
                    );
                    self.skip_dependents(i, now_ms, actions);
                }
            }
        }
        true
    }

    /// Dispatched task `i`'s attempt stopped at a tool call that waits for a person: it gives
    /// its slot back and waits like a task before its dispatch, until the decision (or the
    /// deadline's default) continues it. False when it changes nothing (another attempt, a
    /// segment already applied, the task no longer running).
    pub(crate) fn on_suspended(
        &mut self,
        s: &Suspended,
        seq: u64,
        now_ms: i64,
        actions: &mut Vec<Action>,
    ) -> bool {
        let Some(i) = self.graph.index_of(&s.task_id) else {
            return false;
        };
        let t = &self.state.tasks[i as usize];
        if t.status != TaskStatus::Dispatched
            || t.attempt != s.attempt
            || t.suspensions != s.segment
        {
            return false;
        }
        let held_stops = t.held_stops + u32::from(s.call.is_none());
        self.state.applied += 1;
        self.in_flight -= 1;
        let attempt = s.attempt;
        let call = s.segment + 1;
        let too_many = if s.call.is_some() {
            (call - held_stops > crate::MAX_SUSPENSIONS).then(|| {
                format!(
                    "the attempt waited for a person at more than {} tool calls",
                    crate::MAX_SUSPENSIONS
                )
            })
        } else {
            (held_stops > crate::MAX_HELD_STOPS).then(|| {
                format!(
                    "the attempt stopped for its run's holds more than {} times",
                    crate::MAX_HELD_STOPS
                )
            })
        };
        if let Some(message) = too_many {
            let error = TaskError {
                kind: TaskErrorKind::AgentFailed,
                message,
            };
            self.attempt_failed(
                i,
                error,
                now_ms,
                WorkflowEvent::phase(WorkflowPhase::TaskFailed),
                actions,
            );
            return true;
        }
        let Some(stopped_at) = &s.call else {
            // Stopped because the run is held: it waits like a task not yet dispatched, and
            // the same attempt continues from its journal once the run is resumed (at once,
            // if it already was).
            let t = &mut self.state.tasks[i as usize];
            t.suspensions = call;
            t.held_stops = held_stops;
            if t.attempt_ms == 0 {
                t.attempt_ms = t.dispatched_ms;
            }
            t.status = TaskStatus::Waiting;
            t.resume = true;
            let paused = t.paused();
            if !self.held() && !paused {
                // Neither the run nor the task is held (any more): a hold key left behind (a
                // coordinator that knew no holds applied the resume) is lifted, or the attempt
                // would stop again.
                actions.push(Action::HoldAttempts { held: false });
                actions.push(Action::HoldTask {
                    task: i,
                    held: false,
                });
            }
            let what = if paused && !self.held() {
                "the task is paused"
            } else {
                "the run is held"
            };
            self.emit(
                Some(i),
                Some(attempt),
                now_ms,
                WorkflowEvent {
                    detail: Some(format!(
                        "stopped at a step boundary: {what}; continues from its journal when resumed"
                    )),
                    worker: Some(s.worker.clone()),
                    ..WorkflowEvent::phase(WorkflowPhase::TaskSuspended)
                },
                actions,
            );
            self.release(i, now_ms, actions);
            return true;
        };
        let t = &mut self.state.tasks[i as usize];
        t.suspensions = call;
        if t.attempt_ms == 0 {
            t.attempt_ms = t.dispatched_ms;
        }
        let (trigger, tool) = (stopped_at.trigger, &stopped_at.tool);
        self.wait_for_person(
            i,
            PendingApproval::new(attempt, trigger, call, seq),
            WorkflowEvent {
                worker: Some(s.worker.clone()),
                ..WorkflowEvent::phase(WorkflowPhase::ApprovalRequested)
            },
            |until| {
                format!(
                    "{}: tool {tool} waits for a person until {until}",
                    trigger.as_str()
                )
            },
            now_ms,
            actions,
        );
        if trigger == Trigger::Budget {
            self.pause_for_budget(i, now_ms, actions);
        }
        true
    }
}
