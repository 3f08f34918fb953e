//! The scheduling state machine of one run — pure, no I/O: the only place a run's decisions
//! are made. The coordinator (`flotilla-coordinator`) applies inputs through it and performs
//! its actions; the read model (`flotilla-runs`) reads the [`RunState`] it leaves.
//!
//! The coordinator folds a run's log into a [`RunState`]: [`RunMachine::start`] turns an
//! accepted plan into the first state, and [`RunMachine::apply`] takes one input (a task
//! result, a timer firing) and returns the [`Action`]s the runtime must perform (publish a
//! task, emit an event, arm a durable timer, finish the run). Time is an argument — the
//! JetStream server timestamp of the input — so replaying the same inputs always yields the
//! same state and the same actions.
//!
//! Every input is idempotent: a result for an attempt that is not in flight, or a timer of a
//! superseded generation, changes nothing and returns no actions. That is what makes
//! at-least-once delivery safe.
//!
//! ```text
//!            all dependencies succeeded, slot free
//! waiting ───────────────────────────────────────► dispatched ──success──► succeeded
//!   │  ▲                                            │     │
//!   │  └──────── retry due (timer) ◄── retrying ◄──┘     └──failure, no retries left──► failed
//!   │                                                                                      │
//!   ├──dependencies dispatched but unfinished for dependency_timeout──► failed             │
//!   └──a dependency failed or was skipped──────────────────────────────► skipped ◄─────────┘
//!
//! any unfinished task ──run cancelled, or aborted by failure_ratio──► cancelled
//! ```
//!
//! **Anycast tasks** (a `role` and no `agent`, in a run whose deployment defines roles:
//! [`RunState::anycast`]) are dispatched to their role's queue, where one free member claims
//! each attempt ([`Input::Claimed`], appended by the member's worker before its agent runs).
//! The wait for a claim is bounded: an attempt neither claimed nor finished within
//! `dependency_timeout` of its dispatch fails `role_unclaimed` (not retried), and its queued
//! message is withdrawn ([`Action::Withdraw`]). A claim or a result that reaches the run log
//! before the timer's firing wins; one after it changes nothing. The claim only ends the
//! wait: how long the claimed attempt runs is bounded by its timeout, as for any task.
//!
//! **Failure policy.** A run aborts once its failed tasks reach
//! `floor(len × failure_ratio) + 1` (0 aborts at the first failure, 1 never aborts):
//! dispatch stops, running attempts are cancelled on their workers
//! ([`Action::CancelAttempts`]), and the run ends `failed` with the partial results and the
//! reason. A cancel control ends the run `cancelled` the same way.

mod approval;
mod control;
mod finish;
mod fork;
mod graph;
mod lead;
mod planning;
pub mod policy;
mod replay;
mod state;
mod team;

pub use control::Unchanged;
pub use graph::RunGraph;
pub use replay::{LoggedInput, rejected_reason, replay};
pub use state::{
    Action, ArmedTimer, Emission, Hold, MAX_ERROR_MESSAGE, MAX_ERROR_MESSAGES_KEPT, MAX_HELD_STOPS,
    MAX_LISTED, MAX_SUSPENSIONS, PendingApproval, PlanningState, RunState, TaskState,
    truncate_message,
};

use std::collections::BTreeSet;
use std::sync::Arc;

use flotilla_model::event::{WorkflowEvent, WorkflowPhase};
use flotilla_model::ids::{AttemptId, RunId, TaskId};
use flotilla_model::plan::{Plan, Strategy, StrategyChoice};
use flotilla_model::run::PlanningStatus;
use flotilla_model::run::{EndCause, RunOutcome, RunStatus, TaskStatus};
use flotilla_model::runlog::{
    Assigned, ControlAction, Finished, PlanDecision, Recruited, Retired, RunInput, Submitted,
};
use flotilla_model::task::{TaskError, TaskErrorKind, TaskResult};
use flotilla_model::time::Timestamp;

/// First retry backoff; it doubles per attempt.
pub const RETRY_BASE_MS: i64 = 1_000;
/// Longest retry backoff.
pub const RETRY_CAP_MS: i64 = 30_000;

/// An input to [`RunMachine::apply`].
#[derive(Debug, Clone, Copy)]
pub enum Input<'a> {
    /// A worker's result for one attempt, at run-log sequence `seq`.
    Result {
        /// Task.
        task: &'a TaskId,
        /// Attempt number.
        attempt: u32,
        /// The result.
        result: &'a TaskResult,
        /// Its run-log sequence.
        seq: u64,
        /// The worker that ran it.
        worker: Option<&'a str>,
        /// When the worker started it (worker clock).
        started_at: Option<Timestamp>,
        /// The member that ran it, for anycast tasks.
        agent: Option<&'a str>,
    },
    /// A member claimed an attempt of an anycast task: its wait for a member is over.
    Claimed {
        /// Task.
        task: &'a TaskId,
        /// Attempt number.
        attempt: u32,
    },
    /// A durable timer fired.
    Timer {
        /// Its generation.
        generation: u64,
    },
    /// Cancel the run.
    Cancel {
        /// Why, in words.
        reason: &'a str,
        /// Undo its succeeded tasks that declare a compensation ([`Action::Rollback`]).
        rollback: bool,
    },
    /// A workspace topic of the run got an entry from some writer.
    TopicWritten {
        /// The normalised topic.
        topic: &'a str,
    },
    /// The run cannot continue (e.g. one of its run-log entries is unreadable): end it
    /// `failed` with this reason.
    Abort {
        /// Why, in words.
        reason: &'a str,
    },
    /// The review of planner round `round`, at run-log sequence `seq`.
    Planned {
        /// The round reviewed.
        round: u32,
        /// What was decided.
        decision: &'a PlanDecision,
        /// Its run-log sequence (where a restore finds the plan).
        seq: u64,
    },
    /// The supervisor recruited a member: one subtask to add to the running plan.
    Recruited {
        /// The recruit.
        recruited: &'a Recruited,
        /// Its run-log sequence.
        seq: u64,
    },
    /// The supervisor retired a member from the run's team.
    Retired {
        /// The retirement.
        retired: &'a Retired,
        /// Its run-log sequence.
        seq: u64,
    },
    /// The run's lead assigned a task (the `supervisor` strategy).
    Assigned {
        /// The assignment.
        assigned: &'a Assigned,
    },
    /// The run's lead finished the run with its result (the `supervisor` strategy).
    Finished {
        /// The end.
        finished: &'a Finished,
    },
    /// A person paused, took over or resumed the run ([`ControlAction::Cancel`] is
    /// [`Input::Cancel`]).
    Control {
        /// Pause, takeover or resume.
        action: ControlAction,
        /// Who.
        by: Option<&'a str>,
        /// Why.
        reason: Option<&'a str>,
        /// How long a hold lasts (ms; absent: the default).
        timeout_ms: Option<u64>,
        /// A pause or resume of this one task (absent: the whole run).
        task: Option<&'a TaskId>,
    },
    /// A person completed a task by hand, at run-log sequence `seq` (where its result is
    /// read).
    Completed {
        /// The completion.
        completed: &'a flotilla_model::control::Completed,
        /// Its run-log sequence.
        seq: u64,
    },
    /// A dispatched LLM attempt stopped at a tool call that waits for a person.
    Suspended {
        /// The suspension.
        suspended: &'a flotilla_model::runlog::Suspended,
        /// Its run-log sequence (where the call is read).
        seq: u64,
    },
    /// A person edited the plan of the run under human control, at run-log sequence `seq`
    /// (where a restore reads the plan).
    PlanEdited {
        /// The edit.
        edited: &'a flotilla_model::control::PlanEdited,
        /// Its run-log sequence.
        seq: u64,
    },
    /// A waiting task's approval was decided.
    ApprovalDecided {
        /// The decision.
        decided: &'a flotilla_model::approval::ApprovalDecided,
        /// Its run-log sequence (where an edited input or a supplied result is read).
        seq: u64,
    },
}

impl<'a> Input<'a> {
    /// The machine's input for run-log entry `input` at sequence `seq`: the one mapping from
    /// the log to the machine, so a run replayed from its log is stepped exactly as it was.
    /// `None` for the entries that start or refuse a run instead of stepping it
    /// ([`RunInput::Submitted`], [`RunInput::Rejected`]).
    pub fn from_log(input: &'a RunInput, seq: u64) -> Option<Self> {
        Some(match input {
            RunInput::Submitted(_) | RunInput::Rejected(_) => return None,
            RunInput::TaskResult(r) => Self::Result {
                task: &r.task_id,
                attempt: r.attempt,
                result: &r.result,
                seq,
                worker: Some(&r.worker),
                started_at: r.started_at,
                agent: r.agent.as_deref(),
            },
            RunInput::TimerFired { generation } => Self::Timer {
                generation: *generation,
            },
            RunInput::Control(c) => match c.action {
                ControlAction::Cancel => Self::Cancel {
                    reason: c.reason.as_deref().unwrap_or_default(),
                    rollback: c.rollback,
                },
                action => Self::Control {
                    action,
                    by: c.by.as_deref(),
                    reason: c.reason.as_deref(),
                    timeout_ms: c.timeout_ms,
                    task: c.task_id.as_ref(),
                },
            },
            RunInput::Planned(p) => Self::Planned {
                round: p.round,
                decision: &p.decision,
                seq,
            },
            RunInput::TopicWritten { topic, .. } => Self::TopicWritten { topic },
            RunInput::Claimed(c) => Self::Claimed {
                task: &c.task_id,
                attempt: c.attempt,
            },
            RunInput::Recruited(recruited) => Self::Recruited { recruited, seq },
            RunInput::Retired(retired) => Self::Retired { retired, seq },
            RunInput::Assigned(assigned) => Self::Assigned { assigned },
            RunInput::Finished(finished) => Self::Finished { finished },
            RunInput::ApprovalDecided(decided) => Self::ApprovalDecided { decided, seq },
            RunInput::Completed(completed) => Self::Completed { completed, seq },
            RunInput::Suspended(suspended) => Self::Suspended { suspended, seq },
            RunInput::PlanEdited(edited) => Self::PlanEdited { edited, seq },
        })
    }
}

/// A run's state with the indexes derived from it, ready to apply inputs.
#[derive(Debug, Clone)]
pub struct RunMachine {
    plan: Arc<Plan>,
    graph: Arc<RunGraph>,
    state: RunState,
    /// Dependencies not yet succeeded, per task.
    remaining: Vec<u32>,
    /// Waiting tasks whose dependencies all succeeded and whose consumed topics all have an
    /// entry, in plan order.
    ready: BTreeSet<u32>,
    /// Consumed topics without an entry yet, per task.
    missing: Vec<u32>,
    /// Whether each topic has an entry.
    topic_ready: Vec<bool>,
    in_flight: u32,
    terminal: u32,
    /// Set when the timer fired: the next deadline must be found by a scan.
    rescan_deadlines: bool,
}

fn humantime_duration(d: std::time::Duration) -> String {
    let secs = d.as_secs_f64();
    if secs.fract() == 0.0 {
        format!("{secs:.0} s")
    } else {
        format!("{secs} s")
    }
}

/// A deterministic attempt id: UUIDv7 with the dispatch time and bits hashed from the run, task
/// and attempt, so replaying a run log yields the same ids.
pub fn attempt_id(run: RunId, task: u32, attempt: u32, dispatched_ms: i64) -> AttemptId {
    let mut h = mix(u64::from_le_bytes(
        run.as_uuid().as_bytes()[..8].try_into().unwrap_or([0; 8]),
    ));
    h = mix(h ^ u64::from(task) ^ (u64::from(attempt) << 32));
    let lo =
        mix(h ^ u64::from_le_bytes(run.as_uuid().as_bytes()[8..].try_into().unwrap_or([0; 8])));
    let mut bytes = [0u8; 10];
    bytes[..8].copy_from_slice(&h.to_le_bytes());
    bytes[8..].copy_from_slice(&lo.to_le_bytes()[..2]);
    let uuid =
        uuid::Builder::from_unix_timestamp_millis(dispatched_ms.max(0) as u64, &bytes).into_uuid();
    AttemptId::from_uuid(uuid)
}

use flotilla_model::ids::splitmix64 as mix;

/// Backoff before attempt `attempt + 1`: 1 s doubling per attempt, capped at 30 s, with
/// "equal jitter" (half fixed, half pseudo-random) derived from the run, task and attempt so
/// it is deterministic.
pub fn retry_backoff_ms(run: RunId, task: u32, attempt: u32) -> i64 {
    let exp = attempt.saturating_sub(1).min(20);
    let base = (RETRY_BASE_MS << exp).min(RETRY_CAP_MS);
    let h = mix(
        u64::from_le_bytes(run.as_uuid().as_bytes()[8..].try_into().unwrap_or([0; 8]))
            ^ (u64::from(task) << 20)
            ^ u64::from(attempt),
    );
    let half = base / 2;
    half + (h % (half as u64 + 1)) as i64
}

impl RunMachine {
    /// Starts an accepted run at `now_ms`: dispatches the tasks without dependencies.
    pub fn start(
        run_id: RunId,
        submitted: &Submitted,
        plan: Arc<Plan>,
        now_ms: i64,
    ) -> (Self, Vec<Action>) {
        let graph = Arc::new(RunGraph::new(&plan));
        let planning = submitted.planning.as_ref().map(|p| PlanningState {
            round: 1,
            max_repairs: p.max_repairs,
            status: PlanningStatus::Planning,
        });
        // A bare query's strategy is chosen for the plan its planner writes.
        let strategy = planning
            .is_none()
            .then(|| StrategyChoice::resolve(&plan, submitted.lead.is_some()));
        let led = strategy
            .as_ref()
            .is_some_and(|s| s.strategy == Strategy::Supervisor);
        let state = RunState {
            run_id,
            status: RunStatus::Running,
            created_ms: now_ms,
            finished_ms: None,
            name: plan.name.clone(),
            labels: submitted.labels.clone(),
            session_id: submitted.session_id,
            parent: submitted.parent.clone(),
            reply_to: submitted.reply_to.clone(),
            wait_reply_to: submitted.wait_reply_to.clone(),
            trace: submitted.trace.clone(),
            warnings: submitted.warnings.clone(),
            errors: Vec::new(),
            tasks: vec![TaskState::held(led); plan.subtasks.len()],
            timer: None,
            next_generation: 1,
            applied: 1,
            failed: 0,
            stop_reason: None,
            first_seq: 0,
            topics_ready: Vec::new(),
            outcome: None,
            plan_seq: 0,
            planning,
            strategy: strategy.clone(),
            depth: submitted.depth,
            budget_scopes: submitted.budget_scopes.clone(),
            anycast: submitted.anycast,
            team: Vec::new(),
            recruited: Vec::new(),
            memory: submitted.memory.clone(),
            lead: submitted.lead.clone(),
            lead_deadline_ms: 0,
            hitl: submitted.hitl.clone(),
            hold: None,
            resumed_ms: 0,
            edit_mark: None,
            fork_of: plan.fork.as_ref().map(|f| flotilla_model::fork::ForkRef {
                run_id: f.run_id,
                task_id: f.task_id.clone(),
                reused: f.reused.len() as u32,
            }),
        };
        let mut m = Self::restore_with_graph(plan, graph, state);
        let mut actions = vec![Action::Emit(Box::new(Emission {
            id: format!("{run_id}.start"),
            task: None,
            attempt: None,
            at_ms: now_ms,
            event: WorkflowEvent {
                tasks_total: Some(m.graph.len() as u32),
                strategy,
                memory: submitted.memory.clone().map(Box::new),
                ..WorkflowEvent::phase(WorkflowPhase::RunStarted)
            },
        }))];
        m.reuse(now_ms, &mut actions);
        for i in 0..m.graph.len() as u32 {
            if m.remaining[i as usize] == 0
                && m.missing[i as usize] > 0
                && !led
                && m.state.tasks[i as usize].status == TaskStatus::Waiting
            {
                m.gate(i, now_ms, &mut actions);
            }
        }
        if led {
            m.await_lead(now_ms, &mut actions);
        }
        m.after(now_ms, &mut actions);
        (m, actions)
    }

    /// Rebuilds a machine from a stored state.
    pub fn restore(plan: Arc<Plan>, state: RunState) -> Self {
        let graph = Arc::new(RunGraph::new(&plan));
        Self::restore_with_graph(plan, graph, state)
    }

    fn restore_with_graph(plan: Arc<Plan>, graph: Arc<RunGraph>, state: RunState) -> Self {
        let n = graph.len();
        let mut remaining = vec![0u32; n];
        let mut ready = BTreeSet::new();
        let mut in_flight = 0;
        let mut terminal = 0;
        let mut topic_ready = vec![false; graph.topics.len()];
        for &t in &state.topics_ready {
            if let Some(r) = topic_ready.get_mut(t as usize) {
                *r = true;
            }
        }
        let missing: Vec<u32> = graph
            .consumes
            .iter()
            .map(|ts| ts.iter().filter(|&&t| !topic_ready[t as usize]).count() as u32)
            .collect();
        for (i, left) in remaining.iter_mut().enumerate() {
            *left = graph.deps[i]
                .iter()
                .filter(|&&d| state.tasks[d as usize].status != TaskStatus::Succeeded)
                .count() as u32;
            match state.tasks[i].status {
                TaskStatus::Waiting
                    if *left == 0 && missing[i] == 0 && !state.tasks[i].blocked() =>
                {
                    ready.insert(i as u32);
                }
                TaskStatus::Dispatched => in_flight += 1,
                s if s.is_terminal() => terminal += 1,
                _ => {}
            }
        }
        Self {
            plan,
            graph,
            state,
            remaining,
            ready,
            missing,
            topic_ready,
            in_flight,
            terminal,
            rescan_deadlines: false,
        }
    }

    /// The state.
    pub fn state(&self) -> &RunState {
        &self.state
    }

    /// Records which stream message started the run.
    pub fn set_first_seq(&mut self, seq: u64) {
        self.state.first_seq = seq;
    }

    /// Replaces the outcome (the runtime adds the final result on [`Action::Finish`]).
    pub fn set_outcome(&mut self, outcome: RunOutcome) {
        self.state.outcome = Some(outcome);
    }

    /// The plan.
    pub fn plan(&self) -> &Arc<Plan> {
        &self.plan
    }

    /// The graph.
    pub fn graph(&self) -> &Arc<RunGraph> {
        &self.graph
    }

    /// Tasks in flight.
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// The role whose member claims task `i`, when it is an anycast task.
    pub fn anycast_role(&self, i: u32) -> Option<&str> {
        self.plan
            .subtasks
            .get(i as usize)
            .and_then(|s| s.anycast_role(self.state.anycast))
    }

    /// Applies one input at server time `now_ms`. Returns no actions, and changes nothing,
    /// when the input is a duplicate, stale, or the run has ended.
    pub fn apply(&mut self, input: Input<'_>, now_ms: i64) -> Vec<Action> {
        let mut actions = Vec::new();
        if self.state.status.is_terminal() {
            return actions;
        }
        match input {
            Input::Result {
                task,
                attempt,
                result,
                seq,
                worker,
                started_at,
                agent,
            } => {
                let Some(i) = self.graph.index_of(task) else {
                    return actions;
                };
                let t = &self.state.tasks[i as usize];
                if t.status != TaskStatus::Dispatched || t.attempt != attempt {
                    return actions;
                }
                self.state.applied += 1;
                self.in_flight -= 1;
                let by = WorkflowEvent {
                    worker: worker.map(str::to_owned),
                    started_at,
                    agent: agent.map(str::to_owned),
                    ..WorkflowEvent::phase(WorkflowPhase::TaskSucceeded)
                };
                if result.success {
                    match self.review_threshold(i, result.confidence) {
                        Some((confidence, threshold)) => self.ask_review(
                            i,
                            attempt,
                            (confidence, threshold),
                            seq,
                            now_ms,
                            worker,
                            &mut actions,
                        ),
                        None => self.succeed(i, seq, now_ms, by, &mut actions),
                    }
                } else {
                    let error = result.error.clone().unwrap_or_else(|| TaskError {
                        kind: TaskErrorKind::AgentFailed,
                        message: "the agent reported failure without an error".into(),
                    });
                    self.attempt_failed(i, error, now_ms, by, &mut actions);
                }
            }
            Input::Claimed { task, attempt } => {
                let Some(i) = self.graph.index_of(task) else {
                    return actions;
                };
                if self.anycast_role(i).is_none() {
                    return actions;
                }
                let t = &mut self.state.tasks[i as usize];
                if t.status != TaskStatus::Dispatched
                    || t.attempt != attempt
                    || t.claimed == attempt
                {
                    return actions;
                }
                t.claimed = attempt;
                self.state.applied += 1;
                // The armed timer may be this claim's deadline: it fires and finds nothing due,
                // then is re-armed for what remains (cheaper than a scan per claim).
            }
            Input::Timer { generation } => {
                if self.state.timer.map(|t| t.generation) != Some(generation) {
                    return actions;
                }
                self.state.applied += 1;
                self.state.timer = None;
                self.rescan_deadlines = true;
                self.on_timer(now_ms, &mut actions);
            }
            Input::Cancel { reason, rollback } => {
                self.state.applied += 1;
                let reason = if reason.is_empty() {
                    "cancelled".to_owned()
                } else {
                    format!("cancelled: {reason}")
                };
                self.stop(
                    RunStatus::Cancelled,
                    reason,
                    EndCause::Cancelled,
                    now_ms,
                    &mut actions,
                );
                if rollback {
                    self.roll_back(&mut actions);
                }
                return actions;
            }
            Input::Abort { reason } => {
                self.state.applied += 1;
                self.stop(
                    RunStatus::Failed,
                    reason.to_owned(),
                    EndCause::Aborted,
                    now_ms,
                    &mut actions,
                );
                return actions;
            }
            Input::Planned {
                round,
                decision,
                seq,
            } => {
                let reviewing = self
                    .state
                    .planning
                    .as_ref()
                    .is_some_and(|p| p.status == PlanningStatus::Reviewing && p.round == round);
                if !reviewing {
                    return actions;
                }
                self.state.applied += 1;
                self.on_planned(decision, seq, now_ms, &mut actions);
            }
            Input::Recruited { recruited, seq } => {
                if !self.on_recruited(recruited, seq, now_ms, &mut actions) {
                    return actions;
                }
            }
            Input::Retired { retired, seq } => {
                if !self.on_retired(retired, seq, now_ms, &mut actions) {
                    return actions;
                }
            }
            Input::Assigned { assigned } => {
                if !self.on_assigned(assigned, now_ms, &mut actions) {
                    return actions;
                }
            }
            Input::ApprovalDecided { decided, seq } => {
                if !self.on_approval_decided(decided, seq, now_ms, &mut actions) {
                    return actions;
                }
            }
            Input::Suspended { suspended, seq } => {
                if !self.on_suspended(suspended, seq, now_ms, &mut actions) {
                    return actions;
                }
            }
            Input::Control {
                action: ControlAction::Cancel,
                reason,
                ..
            } => {
                return self.apply(
                    Input::Cancel {
                        reason: reason.unwrap_or_default(),
                        rollback: false,
                    },
                    now_ms,
                );
            }
            Input::Control {
                action,
                by,
                reason,
                timeout_ms,
                task: Some(task),
            } => {
                if !self.on_task_control(action, task, by, reason, timeout_ms, now_ms, &mut actions)
                {
                    return actions;
                }
            }
            Input::Control {
                action,
                by,
                reason,
                timeout_ms,
                task: None,
            } => {
                if !self.on_control(action, by, reason, timeout_ms, now_ms, &mut actions) {
                    return actions;
                }
            }
            Input::PlanEdited { edited, seq } => {
                self.on_plan_edited(edited, seq, now_ms, &mut actions);
            }
            Input::Completed { completed, seq } => {
                if !self.on_completed(completed, seq, now_ms, &mut actions) {
                    return actions;
                }
            }
            Input::Finished { finished } => {
                // Applied or not, nothing follows: the run ended, or nothing changed.
                self.on_finished(finished, now_ms, &mut actions);
                return actions;
            }
            Input::TopicWritten { topic } => {
                let Some(t) = self.graph.topic_of(topic) else {
                    return actions;
                };
                if self.topic_ready[t as usize] {
                    return actions;
                }
                self.state.applied += 1;
                self.topic_has_entry(t);
            }
        }
        if self.state.status.is_terminal() {
            // Aborted by the failure policy while applying the input.
            return actions;
        }
        self.after(now_ms, &mut actions);
        if actions
            .iter()
            .any(|a| matches!(a, Action::ProjectApproval { .. }))
        {
            // An approval's record is written after the step's dispatches: the person's
            // answer reaches the task first, the bucket's projection follows.
            let (project, mut rest): (Vec<Action>, Vec<Action>) = actions
                .into_iter()
                .partition(|a| matches!(a, Action::ProjectApproval { .. }));
            rest.extend(project);
            return rest;
        }
        actions
    }

    /// Failed tasks that abort the run: `floor(len × failure_ratio) + 1`.
    pub fn abort_threshold(&self) -> u32 {
        let n = self.graph.len() as f64;
        (n * self.plan.config.failure_ratio).floor() as u32 + 1
    }

    /// Ends the run early: every unfinished task is cancelled (running attempts on their
    /// workers too), and the run finishes with `status` and `reason`.
    fn stop(
        &mut self,
        status: RunStatus,
        reason: String,
        cause: EndCause,
        now_ms: i64,
        actions: &mut Vec<Action>,
    ) {
        let mut running = false;
        for (i, t) in self.state.tasks.iter_mut().enumerate() {
            if t.status.is_terminal() {
                continue;
            }
            running |= t.status == TaskStatus::Dispatched;
            if let Some(p) = t.approval.take() {
                actions.push(Action::WithdrawApproval {
                    task: i as u32,
                    attempt: p.attempt,
                    call: p.call,
                });
            }
            t.status = TaskStatus::Cancelled;
            self.terminal += 1;
        }
        self.state.stop_reason = Some(reason.clone());
        if self.state.hold.take().is_some() {
            // Stopped while held: the workers' hold on its attempts is lifted with it.
            actions.push(Action::HoldAttempts { held: false });
        }
        self.in_flight = 0;
        self.ready.clear();
        if running {
            actions.push(Action::CancelAttempts);
        }
        self.finish_with(Some((status, reason, cause)), now_ms, actions);
    }

    /// The run was just cancelled with `rollback`: when some of its succeeded tasks declare
    /// a compensation, their rollback run is started and named in the outcome.
    fn roll_back(&mut self, actions: &mut Vec<Action>) {
        // A fork's kept tasks did nothing in this run (the original did it): not undone here.
        let done: Vec<usize> = self
            .succeeded_tasks_all()
            .into_iter()
            .filter(|&i| {
                self.plan
                    .fork
                    .as_ref()
                    .is_none_or(|f| f.reused_seq(&self.plan.subtasks[i].id).is_none())
            })
            .collect();
        let undo = flotilla_model::rollback::compensated_tasks(&self.plan, &done);
        if undo.is_empty() {
            return;
        }
        if let Some(o) = self.state.outcome.as_mut() {
            o.rollback_run_id = Some(flotilla_model::rollback::rollback_run_id(self.state.run_id));
            let n = undo.len();
            o.reason = o.reason.take().map(|r| {
                format!(
                    "{r}; rolling back {n} succeeded task{}",
                    if n == 1 { "" } else { "s" }
                )
            });
        }
        actions.push(Action::Rollback {
            tasks: undo.into_iter().map(|i| i as u32).collect(),
        });
    }

    fn emit(
        &mut self,
        task: Option<u32>,
        attempt: Option<u32>,
        at_ms: i64,
        event: WorkflowEvent,
        actions: &mut Vec<Action>,
    ) {
        let k = actions.len();
        actions.push(Action::Emit(Box::new(Emission {
            id: format!("{}.{}.{k}", self.state.run_id, self.state.applied),
            task,
            attempt,
            at_ms,
            event,
        })));
    }

    fn succeed(
        &mut self,
        i: u32,
        seq: u64,
        now_ms: i64,
        by: WorkflowEvent,
        actions: &mut Vec<Action>,
    ) {
        let t = &mut self.state.tasks[i as usize];
        t.status = TaskStatus::Succeeded;
        t.result_seq = seq;
        t.error = None;
        let attempt = t.attempt;
        self.terminal += 1;
        self.emit(Some(i), Some(attempt), now_ms, by, actions);
        let graph = Arc::clone(&self.graph);
        if !graph.produces[i as usize].is_empty() {
            // The entries are appended before this step's dispatches, so the topics count
            // as written now.
            actions.push(Action::Produce { task: i });
            for &t in &graph.produces[i as usize] {
                self.topic_has_entry(t);
            }
        }
        if self.plan.subtasks[i as usize].output_key.is_some() {
            actions.push(Action::StoreOutput { task: i });
        }
        for &d in &graph.dependents[i as usize] {
            self.remaining[d as usize] -= 1;
            self.release(d, now_ms, actions);
        }
    }

    /// Task `i`'s dependencies may all have succeeded: a waiting task that is not held then
    /// starts, or (a consumed topic without an entry yet) starts its wait for the topic.
    pub(crate) fn release(&mut self, i: u32, now_ms: i64, actions: &mut Vec<Action>) {
        let t = &self.state.tasks[i as usize];
        if self.remaining[i as usize] != 0 || t.status != TaskStatus::Waiting || t.blocked() {
            return;
        }
        if self.missing[i as usize] == 0 {
            self.ready.insert(i);
        } else {
            self.gate(i, now_ms, actions);
        }
    }

    /// Records that topic `t` has an entry: its consumers whose dependencies are met may
    /// start.
    fn topic_has_entry(&mut self, t: u32) {
        if std::mem::replace(&mut self.topic_ready[t as usize], true) {
            return;
        }
        let at = self.state.topics_ready.partition_point(|&x| x < t);
        self.state.topics_ready.insert(at, t);
        let graph = Arc::clone(&self.graph);
        for &c in &graph.consumers[t as usize] {
            self.missing[c as usize] -= 1;
            if self.missing[c as usize] == 0
                && self.remaining[c as usize] == 0
                && self.state.tasks[c as usize].status == TaskStatus::Waiting
                && !self.state.tasks[c as usize].blocked()
            {
                self.ready.insert(c);
            }
        }
    }

    /// Task `i` has its dependencies but waits for a consumed topic: its wait starts now and
    /// is bounded by `dependency_timeout`.
    fn gate(&mut self, i: u32, now_ms: i64, actions: &mut Vec<Action>) {
        self.state.tasks[i as usize].gated_ms = now_ms;
        let due = now_ms + self.plan.config.dependency_timeout.get().as_millis() as i64;
        self.arm_if_earlier(due, actions);
    }

    /// Consumers left without any way to get an entry on a topic `task` produces: the topic
    /// has none, and every producer of it has ended without succeeding. Returns each such
    /// waiting consumer with the topic's position in its `consumes`.
    fn orphaned_consumers(&self, task: u32) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        for &t in &self.graph.produces[task as usize] {
            if self.topic_ready[t as usize] {
                continue;
            }
            let dead = self.graph.producers[t as usize].iter().all(|&p| {
                matches!(
                    self.state.tasks[p as usize].status,
                    TaskStatus::Failed | TaskStatus::Skipped | TaskStatus::Cancelled
                )
            });
            if !dead {
                continue;
            }
            for &c in &self.graph.consumers[t as usize] {
                let pos = self.graph.consumes[c as usize]
                    .iter()
                    .position(|&x| x == t)
                    .unwrap_or_default();
                // The plan's own order of the task's consumed topics (the graph's is sorted
                // by topic index).
                let name = self.graph.topic_name(t);
                let pos = self.plan.subtasks[c as usize]
                    .consumes
                    .iter()
                    .position(|x| x == name)
                    .unwrap_or(pos);
                out.push((c, pos as u32));
            }
        }
        out
    }

    fn attempt_failed(
        &mut self,
        i: u32,
        error: TaskError,
        now_ms: i64,
        by: WorkflowEvent,
        actions: &mut Vec<Action>,
    ) {
        let max_retries = self.plan.config.max_retries;
        let mut error = error;
        truncate_message(&mut error.message, MAX_ERROR_MESSAGE);
        let t = &mut self.state.tasks[i as usize];
        let attempt = t.attempt;
        if error.kind.is_retryable() && attempt <= max_retries {
            let due = now_ms + retry_backoff_ms(self.state.run_id, i, attempt);
            t.status = TaskStatus::Retrying;
            t.retry_ms = due;
            t.error = Some(error.clone());
            self.emit(
                Some(i),
                Some(attempt),
                now_ms,
                WorkflowEvent {
                    phase: WorkflowPhase::TaskRetrying,
                    error: Some(error),
                    retry_at: Some(Timestamp::from_unix_ms(due)),
                    ..by
                },
                actions,
            );
            self.arm_if_earlier(due, actions);
        } else {
            self.fail(i, error, now_ms, by, actions);
        }
    }

    /// Fails a task for good and skips everything that depends on it. `by` says which worker
    /// ran the last attempt, if any.
    fn fail(
        &mut self,
        i: u32,
        error: TaskError,
        now_ms: i64,
        by: WorkflowEvent,
        actions: &mut Vec<Action>,
    ) {
        let mut error = error;
        truncate_message(&mut error.message, MAX_ERROR_MESSAGE);
        let kept_messages = self.state.failed < MAX_ERROR_MESSAGES_KEPT;
        let t = &mut self.state.tasks[i as usize];
        let attempt = t.attempt;
        t.status = TaskStatus::Failed;
        t.error = Some(if kept_messages {
            error.clone()
        } else {
            TaskError {
                kind: error.kind,
                message: String::new(),
            }
        });
        self.terminal += 1;
        self.ready.remove(&i);
        let incident = self.failed_sensitive_action(i, attempt, &error);
        self.emit(
            Some(i),
            (attempt > 0).then_some(attempt),
            now_ms,
            WorkflowEvent {
                phase: WorkflowPhase::TaskFailed,
                error: Some(error),
                incident,
                ..by
            },
            actions,
        );
        self.skip_dependents(i, now_ms, actions);
        self.state.failed += 1;
        let threshold = self.abort_threshold();
        let unfinished = (self.terminal as usize) < self.graph.len();
        if self.state.failed >= threshold && unfinished && !self.state.status.is_terminal() {
            let reason = format!(
                "aborted: {}; last failure: {} ({})",
                self.threshold_reached(),
                self.plan.subtasks[i as usize].id,
                self.state.tasks[i as usize]
                    .error
                    .as_ref()
                    .map(ToString::to_string)
                    .unwrap_or_default()
            );
            self.stop(
                RunStatus::Failed,
                reason,
                EndCause::FailureThreshold,
                now_ms,
                actions,
            );
        }
    }

    /// Skips task `i` — added to a running plan, or given new dependencies by an edit — when
    /// one of its dependencies already ended without succeeding, as that dependency's end
    /// would have had it been there from the start (and what depends on it). True when it
    /// did.
    pub(crate) fn skip_if_dependency_ended(
        &mut self,
        i: u32,
        now_ms: i64,
        actions: &mut Vec<Action>,
    ) -> bool {
        let ended = self.graph.deps(i).iter().copied().find(|&d| {
            matches!(
                self.state.tasks[d as usize].status,
                TaskStatus::Failed | TaskStatus::Skipped | TaskStatus::Cancelled
            )
        });
        let Some(d) = ended else {
            return false;
        };
        let t = &mut self.state.tasks[i as usize];
        t.status = TaskStatus::Skipped;
        t.cause = Some(d);
        self.terminal += 1;
        self.ready.remove(&i);
        let detail = format!("dependency_failed: {}", self.plan.subtasks[d as usize].id);
        self.emit(
            Some(i),
            None,
            now_ms,
            WorkflowEvent {
                detail: Some(detail),
                ..WorkflowEvent::phase(WorkflowPhase::TaskSkipped)
            },
            actions,
        );
        self.skip_dependents(i, now_ms, actions);
        true
    }

    /// A task whose action is sensitive under the run's policy that failed for good after
    /// running is an incident of its agent (a cancellation is not): its words, if so.
    fn failed_sensitive_action(&self, i: u32, attempt: u32, error: &TaskError) -> Option<String> {
        let sub = &self.plan.subtasks[i as usize];
        let sensitive = self
            .state
            .hitl
            .as_ref()
            .is_some_and(|p| policy::hitl::is_sensitive(p, sub));
        // The agent's own failures only: not a cancellation, a refused call or budget, a
        // task nobody claimed.
        let agents_doing = matches!(
            error.kind,
            TaskErrorKind::AgentFailed
                | TaskErrorKind::Timeout
                | TaskErrorKind::InvalidOutput
                | TaskErrorKind::ResultTooLarge
                | TaskErrorKind::RedeliveriesExhausted
        );
        (sensitive && attempt > 0 && agents_doing).then(|| {
            format!(
                "sensitive action {} of task {} (run {}) failed: {error}",
                sub.action.as_deref().unwrap_or("(risk)"),
                sub.id,
                self.state.run_id
            )
        })
    }

    /// Task `i` ended without succeeding (failed, or skipped by a person's rejection): what
    /// depends on it is skipped, and so are consumers of topics that can no longer get an
    /// entry.
    pub(crate) fn skip_dependents(&mut self, i: u32, now_ms: i64, actions: &mut Vec<Action>) {
        let reason = format!("dependency_failed: {}", self.plan.subtasks[i as usize].id);
        let graph = Arc::clone(&self.graph);
        // Dependents are skipped; so are consumers of topics that can no longer get an
        // entry because every producer ended without producing.
        let mut stack: Vec<(u32, Option<u32>)> = graph.dependents[i as usize]
            .iter()
            .map(|&d| (d, None))
            .collect();
        stack.extend(
            self.orphaned_consumers(i)
                .into_iter()
                .map(|(c, j)| (c, Some(j))),
        );
        let mut skipped = 0usize;
        while let Some((d, via_topic)) = stack.pop() {
            let t = &mut self.state.tasks[d as usize];
            if !matches!(t.status, TaskStatus::Waiting | TaskStatus::Retrying) {
                continue;
            }
            t.status = TaskStatus::Skipped;
            t.cause = Some(i);
            t.via_topic = via_topic;
            self.terminal += 1;
            self.ready.remove(&d);
            skipped += 1;
            if skipped <= MAX_LISTED {
                let detail = match via_topic {
                    None => reason.clone(),
                    Some(_) => self
                        .state
                        .skip_reason(d as usize, Some(&self.plan))
                        .unwrap_or_else(|| reason.clone()),
                };
                self.emit(
                    Some(d),
                    None,
                    now_ms,
                    WorkflowEvent {
                        detail: Some(detail),
                        ..WorkflowEvent::phase(WorkflowPhase::TaskSkipped)
                    },
                    actions,
                );
            }
            stack.extend(graph.dependents[d as usize].iter().map(|&x| (x, None)));
            stack.extend(
                self.orphaned_consumers(d)
                    .into_iter()
                    .map(|(c, j)| (c, Some(j))),
            );
        }
        if skipped > MAX_LISTED {
            // One event for the rest keeps a step's events (and the stored outbox) bounded.
            self.emit(
                None,
                None,
                now_ms,
                WorkflowEvent {
                    detail: Some(format!(
                        "{} more tasks skipped ({reason})",
                        skipped - MAX_LISTED
                    )),
                    ..WorkflowEvent::phase(WorkflowPhase::TaskSkipped)
                },
                actions,
            );
        }
    }

    /// Says that the failure threshold was reached, with the figures.
    fn threshold_reached(&self) -> String {
        format!(
            "{} of {} tasks failed, reaching the failure threshold of {} (failure_ratio {})",
            self.state.failed,
            self.graph.len(),
            self.abort_threshold(),
            self.plan.config.failure_ratio
        )
    }

    /// When a waiting task's dependencies have all been dispatched at least once and are not
    /// all done, it waits at most `dependency_timeout` after the latest of those dispatches.
    fn dependency_deadline(&self, i: u32) -> Option<i64> {
        let task = &self.state.tasks[i as usize];
        if task.blocked() {
            // Not assigned yet: it waits for the lead, whose wait has its own deadline; or
            // paused by itself, until its pause's deadline.
            return None;
        }
        let timeout = self.plan.config.dependency_timeout.get().as_millis() as i64;
        // After a hold (of the run, or of this task), every wait gets at least its full
        // timeout again.
        let resumed = self.state.resumed_ms.max(task.resumed_ms);
        let floor = if resumed > 0 {
            resumed + timeout
        } else {
            i64::MIN
        };
        if self.remaining[i as usize] == 0 {
            // Dependencies met: a wait for a consumed topic is bounded from its start.
            return (self.missing[i as usize] > 0)
                .then(|| (self.state.tasks[i as usize].gated_ms + timeout).max(floor));
        }
        let deps = self.graph.deps(i);
        if deps.is_empty() {
            return None;
        }
        let mut latest = 0;
        for &d in deps {
            let t = &self.state.tasks[d as usize];
            match t.status {
                TaskStatus::Succeeded => {}
                TaskStatus::Dispatched | TaskStatus::Retrying => {
                    latest = latest.max(t.dispatched_ms)
                }
                _ => return None,
            }
        }
        Some((latest + timeout).max(floor))
    }

    /// When an anycast task's dispatched attempt stops waiting for a member: unclaimed (and
    /// unfinished) `dependency_timeout` after its dispatch, it fails `role_unclaimed`.
    fn claim_deadline(&self, i: u32) -> Option<i64> {
        let t = &self.state.tasks[i as usize];
        (t.status == TaskStatus::Dispatched && t.claimed != t.attempt)
            .then(|| self.anycast_role(i))
            .flatten()
            .map(|_| {
                let timeout = self.plan.config.dependency_timeout.get().as_millis() as i64;
                let due = t.dispatched_ms + timeout;
                if self.state.resumed_ms > 0 {
                    due.max(self.state.resumed_ms + timeout)
                } else {
                    due
                }
            })
    }

    fn on_timer(&mut self, now_ms: i64, actions: &mut Vec<Action>) {
        let held = self.hold_overdue(now_ms, actions);
        if self.state.status.is_terminal() || (!held && self.lead_overdue(now_ms, actions)) {
            return;
        }
        self.task_pauses_overdue(now_ms, actions);
        let n = self.graph.len() as u32;
        let mut timed_out = Vec::new();
        let mut unclaimed = Vec::new();
        for i in 0..n {
            let t = &self.state.tasks[i as usize];
            match t.status {
                TaskStatus::AwaitingApproval
                    if self.approval_deadline(i).is_some_and(|d| d <= now_ms) =>
                {
                    self.expire_approval(i, actions);
                }
                // While a person holds the run, no wait times out.
                TaskStatus::Dispatched
                    if !held && self.claim_deadline(i).is_some_and(|d| d <= now_ms) =>
                {
                    unclaimed.push(i);
                }
                TaskStatus::Retrying if t.retry_ms <= now_ms => {
                    self.state.tasks[i as usize].status = TaskStatus::Waiting;
                    if self.remaining[i as usize] == 0
                        && self.missing[i as usize] == 0
                        && !self.state.tasks[i as usize].blocked()
                    {
                        self.ready.insert(i);
                    }
                }
                TaskStatus::Waiting
                    if !held && self.dependency_deadline(i).is_some_and(|d| d <= now_ms) =>
                {
                    timed_out.push(i);
                }
                _ => {}
            }
        }
        let timeout = self.plan.config.dependency_timeout.get();
        for i in unclaimed {
            if self.state.tasks[i as usize].status != TaskStatus::Dispatched {
                // Skipped or cancelled by an earlier failure of this firing.
                continue;
            }
            let attempt = self.state.tasks[i as usize].attempt;
            let role = self.anycast_role(i).unwrap_or_default().to_owned();
            self.in_flight -= 1;
            actions.push(Action::Withdraw { task: i, attempt });
            let error = TaskError {
                kind: TaskErrorKind::RoleUnclaimed,
                message: format!(
                    "no member of role {role:?} claimed the task within {} of its dispatch (none was online, or all were busy)",
                    humantime_duration(timeout)
                ),
            };
            self.fail(
                i,
                error,
                now_ms,
                WorkflowEvent::phase(WorkflowPhase::TaskFailed),
                actions,
            );
            if self.state.status.is_terminal() {
                return;
            }
        }
        for i in timed_out {
            if self.state.tasks[i as usize].status == TaskStatus::Waiting {
                let message = if self.remaining[i as usize] == 0 {
                    let missing: Vec<&str> = self.graph.consumes[i as usize]
                        .iter()
                        .filter(|&&t| !self.topic_ready[t as usize])
                        .map(|&t| self.graph.topic_name(t))
                        .collect();
                    format!(
                        "consumed topic(s) {} got no entry within {}",
                        missing.join(", "),
                        humantime_duration(timeout)
                    )
                } else {
                    format!(
                        "dependencies did not finish within {} after being dispatched",
                        humantime_duration(timeout)
                    )
                };
                let error = TaskError {
                    kind: TaskErrorKind::DependencyTimeout,
                    message,
                };
                self.fail(
                    i,
                    error,
                    now_ms,
                    WorkflowEvent::phase(WorkflowPhase::TaskFailed),
                    actions,
                );
            }
        }
    }

    fn arm_if_earlier(&mut self, due_ms: i64, actions: &mut Vec<Action>) {
        if self.state.timer.is_some_and(|t| t.due_ms <= due_ms) {
            return;
        }
        let generation = self.state.next_generation;
        self.state.next_generation += 1;
        self.state.timer = Some(ArmedTimer { generation, due_ms });
        actions.push(Action::ArmTimer { generation, due_ms });
    }

    /// Dispatches what may run, keeps a timer armed for the next deadline, and finishes the
    /// run when every task has ended.
    fn after(&mut self, now_ms: i64, actions: &mut Vec<Action>) {
        let limit = self.plan.config.max_concurrency;
        // While a person holds the run, nothing new is dispatched.
        while self.in_flight < limit && !self.held() {
            let Some(i) = self.ready.pop_first() else {
                break;
            };
            // A task a person must approve waits for them without taking a slot.
            if self.ask_first(i, now_ms, actions) {
                continue;
            }
            self.dispatch(i, now_ms, actions);
        }
        if self.terminal as usize == self.graph.len() && !self.led() {
            if let Some(p) = self.state.planning.as_mut() {
                match p.status {
                    PlanningStatus::Planning
                        if self.state.tasks.first().map(|t| t.status)
                            == Some(TaskStatus::Succeeded) =>
                    {
                        // The planner answered: the run waits for the review's entry.
                        p.status = PlanningStatus::Reviewing;
                        actions.push(Action::ReviewPlan { round: p.round });
                        return;
                    }
                    PlanningStatus::Reviewing => return,
                    _ => {}
                }
            }
            self.finish(now_ms, actions);
            return;
        }
        if self.rescan_deadlines {
            self.rescan_deadlines = false;
            // The timer fired: re-arm it for the earliest remaining deadline.
            // While held, only the hold's own deadline, approvals and retries are clocked.
            let held = self.held();
            let mut next: Option<i64> = if held {
                self.hold_deadline()
            } else {
                self.lead_deadline()
            };
            for i in 0..self.graph.len() as u32 {
                let t = &self.state.tasks[i as usize];
                let due = match t.status {
                    TaskStatus::Retrying => Some(t.retry_ms),
                    TaskStatus::Waiting if !held => self.dependency_deadline(i),
                    TaskStatus::Dispatched if !held => self.claim_deadline(i),
                    TaskStatus::AwaitingApproval => self.approval_deadline(i),
                    _ => None,
                };
                // A task's own pause keeps its clock whether or not the run is held.
                let paused = (t.paused() && !t.status.is_terminal()).then_some(t.paused_until_ms);
                for d in due.into_iter().chain(paused) {
                    next = Some(next.map_or(d, |n: i64| n.min(d)));
                }
            }
            if let Some(due) = next {
                self.arm_if_earlier(due, actions);
            }
        }
    }

    fn dispatch(&mut self, i: u32, now_ms: i64, actions: &mut Vec<Action>) {
        let t = &mut self.state.tasks[i as usize];
        if std::mem::take(&mut t.resume) {
            // The suspended attempt continues: same attempt, same attempt id.
            if t.attempt_ms == 0 {
                t.attempt_ms = t.dispatched_ms;
            }
        } else {
            t.attempt += 1;
            t.suspensions = 0;
            t.held_stops = 0;
            t.attempt_ms = 0;
            t.decisions.clear();
        }
        t.status = TaskStatus::Dispatched;
        t.dispatched_ms = now_ms;
        let attempt = t.attempt;
        self.in_flight += 1;
        // No event here: the worker reports `task_started` with its id when it begins, and
        // the run view shows dispatched tasks; an event per dispatch would cost a stored
        // write per task for no new information.
        actions.push(Action::Dispatch { task: i, attempt });
        // An anycast attempt waits for a member of its role, at most `dependency_timeout`.
        if let Some(deadline) = self.claim_deadline(i) {
            self.arm_if_earlier(deadline, actions);
        }
        // Dependents whose dependencies are now all under way start their dependency clock.
        let graph = Arc::clone(&self.graph);
        for &d in &graph.dependents[i as usize] {
            if self.state.tasks[d as usize].status == TaskStatus::Waiting
                && let Some(deadline) = self.dependency_deadline(d)
            {
                self.arm_if_earlier(deadline, actions);
            }
        }
    }
}
