//! What the machine leaves behind: a run's state ([`RunState`], one [`TaskState`] per task),
//! stored as the run's record, and the [`Action`]s of a change, stored as its outbox. Data and
//! the queries a reader needs (counts, task views) — the decisions are in [`crate::RunMachine`].

use std::collections::BTreeMap;

use flotilla_model::approval::{DefaultDecision, HitlPolicy, Trigger};
use flotilla_model::event::WorkflowEvent;
use flotilla_model::ids::{RunId, SessionId, TaskId};
use flotilla_model::plan::{Plan, StrategyChoice, Subtask};
use flotilla_model::recruit::TeamChange;
use flotilla_model::run::PlanningStatus;
use flotilla_model::run::{
    EndCause, RunHandle, RunOutcome, RunStatus, TaskCounts, TaskStatus, TaskView,
};
use flotilla_model::task::{BudgetScope, TaskError, TraceContext};
use flotilla_model::time::Timestamp;
use flotilla_model::validate::Problem;
use serde::{Deserialize, Serialize};

/// The durable timer currently armed for a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArmedTimer {
    /// Generation; firings of other generations are ignored.
    pub generation: u64,
    /// When it fires (Unix ms, server time).
    pub due_ms: i64,
}

/// One task's scheduling state. Field names are short: this is written on every change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskState {
    /// Status.
    #[serde(rename = "s")]
    pub status: TaskStatus,
    /// Attempts dispatched so far.
    #[serde(rename = "a", default)]
    pub attempt: u32,
    /// When the latest attempt was dispatched (Unix ms).
    #[serde(rename = "d", default)]
    pub dispatched_ms: i64,
    /// When a retry is due (Unix ms), while retrying.
    #[serde(rename = "r", default)]
    pub retry_ms: i64,
    /// Run-log sequence of the successful result.
    #[serde(rename = "q", default)]
    pub result_seq: u64,
    /// The last error.
    #[serde(rename = "e", default, skip_serializing_if = "Option::is_none")]
    pub error: Option<TaskError>,
    /// Why it was skipped, as text (records written before `cause` existed).
    #[serde(rename = "k", default, skip_serializing_if = "Option::is_none")]
    pub skip_reason: Option<String>,
    /// The failed task that made this one skipped (an index: compact however long task ids
    /// are, so the record stays bounded).
    #[serde(rename = "c", default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<u32>,
    /// When skipped because a consumed topic can no longer get an entry: that topic's
    /// position in the task's `consumes` (its producers all ended without producing;
    /// `cause` is the failure behind it).
    #[serde(rename = "vt", default, skip_serializing_if = "Option::is_none")]
    pub via_topic: Option<u32>,
    /// When the task's dependencies were all met while a consumed topic had no entry yet
    /// (Unix ms): its wait for the topic is bounded from here by `dependency_timeout`.
    #[serde(rename = "g", default, skip_serializing_if = "is_zero_ms")]
    pub gated_ms: i64,
    /// The latest attempt of an anycast task that a member claimed (0: none): an attempt
    /// dispatched and not claimed waits for a member, bounded by `dependency_timeout`.
    #[serde(rename = "cl", default, skip_serializing_if = "is_zero_attempt")]
    pub claimed: u32,
    /// Under the `supervisor` strategy: the lead has not assigned the task yet, so it does
    /// not run (nor wait on a deadline) however ready it is.
    #[serde(rename = "h", default, skip_serializing_if = "std::ops::Not::not")]
    pub held: bool,
    /// While the task waits for a person's approval: what was asked and until when.
    #[serde(rename = "ap", default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<PendingApproval>,
    /// The attempt a person (or a deadline's default) let run: it is dispatched without
    /// asking again (0: none).
    #[serde(rename = "ok", default, skip_serializing_if = "is_zero_attempt")]
    pub approved: u32,
    /// Run-log sequence of the `approval_decided` entry whose edited input the approved
    /// attempt runs with (0: the plan's input).
    #[serde(rename = "es", default, skip_serializing_if = "is_zero_seq")]
    pub edit_seq: u64,
    /// How many times the latest attempt suspended at a tool call waiting for a person.
    #[serde(rename = "su", default, skip_serializing_if = "is_zero_attempt")]
    pub suspensions: u32,
    /// The latest attempt suspended and its wait is decided: its next dispatch continues it
    /// (same attempt, same attempt id) instead of starting a new one.
    #[serde(rename = "rp", default, skip_serializing_if = "std::ops::Not::not")]
    pub resume: bool,
    /// When the latest attempt was first dispatched (Unix ms; 0: `dispatched_ms`), once it
    /// was dispatched again to continue after a suspension: its attempt id derives from it.
    #[serde(rename = "am", default, skip_serializing_if = "is_zero_ms")]
    pub attempt_ms: i64,
    /// Run-log sequences of the decisions about the latest attempt's suspended tool calls,
    /// in order (at most [`MAX_SUSPENSIONS`]).
    #[serde(rename = "ds", default, skip_serializing_if = "Vec::is_empty")]
    pub decisions: Vec<u64>,
    /// How many of the latest attempt's suspensions were stops of a held run (they count in
    /// `suspensions`, not against [`MAX_SUSPENSIONS`]; at most [`MAX_HELD_STOPS`]).
    #[serde(rename = "hs", default, skip_serializing_if = "is_zero_attempt")]
    pub held_stops: u32,
    /// Paused by itself (a lead's `pause_member`, `run.pause` with a task): not dispatched
    /// until resumed or until this time (Unix ms), when it resumes. 0: not paused.
    #[serde(rename = "pu", default, skip_serializing_if = "is_zero_ms")]
    pub paused_until_ms: i64,
    /// The pause is the run's lead's (`by: "lead"`): the lead may lift it. A person's pause
    /// only a person lifts (or its deadline).
    #[serde(rename = "pl", default, skip_serializing_if = "std::ops::Not::not")]
    pub paused_by_lead: bool,
    /// When the task last resumed from its own pause (Unix ms): its dependency and topic
    /// clocks give at least their full timeout again from then.
    #[serde(rename = "pr", default, skip_serializing_if = "is_zero_ms")]
    pub resumed_ms: i64,
}

/// How many times one attempt may suspend at a tool call waiting for a person; the next
/// suspension fails the attempt (`agent_failed`), which bounds the state an attempt keeps.
pub const MAX_SUSPENSIONS: u32 = 64;

/// How many times one attempt may stop at a step boundary because its run is held; the next
/// stop fails the attempt (a bound on the state it keeps, and on a hold that never lifts).
pub const MAX_HELD_STOPS: u32 = 1024;

/// A task's wait for a person.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingApproval {
    /// The attempt it would let run.
    #[serde(rename = "a")]
    pub attempt: u32,
    /// When the deadline's default decides (Unix ms, server time).
    #[serde(rename = "d")]
    pub deadline_ms: i64,
    /// What triggered it.
    #[serde(rename = "t")]
    pub trigger: Trigger,
    /// The deadline fired before any answer: its default decides, and the wait takes only
    /// the default's record (appended once by the runtime), no answer.
    #[serde(rename = "x", default, skip_serializing_if = "std::ops::Not::not")]
    pub expiring: bool,
    /// 0: the wait is for the attempt's dispatch; n ≥ 1: for the n-th tool call the
    /// dispatched attempt suspended at; `REVIEW_CALL`: for the attempt's result.
    #[serde(rename = "c", default, skip_serializing_if = "is_zero_attempt")]
    pub call: u32,
    /// For a tool call: the run-log sequence of the suspension (the call and its arguments);
    /// for a review: the result's.
    #[serde(rename = "f", default, skip_serializing_if = "is_zero_seq")]
    pub from_seq: u64,
}

impl PendingApproval {
    /// A wait of `attempt` for `trigger` (`call`: 0 a dispatch, n a suspended tool call,
    /// `REVIEW_CALL` a result's review at run-log `from_seq`); its deadline is set when it
    /// starts.
    pub fn new(attempt: u32, trigger: Trigger, call: u32, from_seq: u64) -> Self {
        Self {
            attempt,
            deadline_ms: 0,
            trigger,
            expiring: false,
            call,
            from_seq,
        }
    }

    /// The approval's id for task `task`.
    pub fn id(&self, task: u32) -> String {
        flotilla_model::approval::wait_id(task, self.attempt, self.call)
    }
}

fn is_zero_attempt(a: &u32) -> bool {
    *a == 0
}

fn is_zero_ms(ms: &i64) -> bool {
    *ms == 0
}

impl TaskState {
    /// When the latest attempt was first dispatched: where its attempt id comes from.
    pub fn attempt_started_ms(&self) -> i64 {
        if self.attempt_ms != 0 {
            self.attempt_ms
        } else {
            self.dispatched_ms
        }
    }

    /// Whether the task is paused by itself (see [`TaskState::paused_until_ms`]).
    pub fn paused(&self) -> bool {
        self.paused_until_ms > 0
    }

    /// Whether the task may not be dispatched whatever its dependencies: held for the lead's
    /// assignment, or paused by itself.
    pub fn blocked(&self) -> bool {
        self.held || self.paused()
    }

    /// Whether the task has started as far as a plan edit is concerned: dispatched at least
    /// once, waiting for a person or let through by one, or ended.
    pub fn started(&self) -> bool {
        self.status != TaskStatus::Waiting
            || self.attempt > 0
            || self.approval.is_some()
            || self.approved != 0
            || self.edit_seq != 0
    }

    /// A waiting task, held for the lead's assignment when `held`.
    pub(crate) fn held(held: bool) -> Self {
        Self {
            held,
            ..Self::new()
        }
    }

    pub(crate) fn new() -> Self {
        Self {
            status: TaskStatus::Waiting,
            attempt: 0,
            dispatched_ms: 0,
            retry_ms: 0,
            result_seq: 0,
            error: None,
            skip_reason: None,
            cause: None,
            via_topic: None,
            gated_ms: 0,
            claimed: 0,
            held: false,
            approval: None,
            approved: 0,
            edit_seq: 0,
            suspensions: 0,
            resume: false,
            attempt_ms: 0,
            decisions: Vec::new(),
            held_stops: 0,
            paused_until_ms: 0,
            paused_by_lead: false,
            resumed_ms: 0,
        }
    }
}

/// Longest task error message kept in the run state and events; the run log keeps the
/// whole result.
pub const MAX_ERROR_MESSAGE: usize = 1024;
/// Failed tasks whose error messages the run state keeps; later ones keep only the kind, so
/// the state of a huge run stays within one message.
pub const MAX_ERROR_MESSAGES_KEPT: u32 = 1000;
/// Most tasks listed in an outcome's `failed` and `skipped` lists, and most `task_skipped`
/// events one failure emits; the rest are counted.
pub const MAX_LISTED: usize = 100;

/// Cuts a message to at most `max` bytes on a character boundary, marking the cut.
pub fn truncate_message(message: &mut String, max: usize) {
    if message.len() <= max {
        return;
    }
    let mut end = max;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    message.truncate(end);
    message.push_str(" …[truncated]");
}

/// Everything the coordinator knows about a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    /// The run.
    pub run_id: RunId,
    /// Status.
    pub status: RunStatus,
    /// Accepted (or rejected) at, Unix ms server time.
    pub created_ms: i64,
    /// Finished at.
    #[serde(default)]
    pub finished_ms: Option<i64>,
    /// Plan name.
    #[serde(default)]
    pub name: Option<String>,
    /// Labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Session.
    #[serde(default)]
    pub session_id: Option<SessionId>,
    /// Parent link.
    #[serde(default)]
    pub parent: Option<RunHandle>,
    /// Where to publish the outcome.
    #[serde(default)]
    pub reply_to: Option<String>,
    /// Where a waiting request/reply submitter gets the outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_reply_to: Option<String>,
    /// Trace context.
    #[serde(default)]
    pub trace: Option<TraceContext>,
    /// Validation warnings.
    #[serde(default)]
    pub warnings: Vec<Problem>,
    /// Validation errors (rejected runs).
    #[serde(default)]
    pub errors: Vec<Problem>,
    /// Per task, in plan order.
    #[serde(default)]
    pub tasks: Vec<TaskState>,
    /// The armed timer.
    #[serde(default)]
    pub timer: Option<ArmedTimer>,
    /// Next timer generation.
    #[serde(default)]
    pub next_generation: u64,
    /// Inputs that changed the state (the basis of deterministic event ids).
    #[serde(default)]
    pub applied: u64,
    /// Tasks that failed for good (the failure policy's count).
    #[serde(default)]
    pub failed: u32,
    /// Why the run stopped early (cancelled, aborted): the reason of its cancelled tasks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<String>,
    /// Stream sequence of the run's first message (its submission): a later submission of the
    /// same run is a duplicate, a redelivery of this one is not.
    #[serde(default)]
    pub first_seq: u64,
    /// Topics (indices into the plan's topics) that have an entry: their consumers may start.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub topics_ready: Vec<u32>,
    /// The outcome, once terminal.
    #[serde(default)]
    pub outcome: Option<RunOutcome>,
    /// Run-log sequence of the `planned` (or `plan_edited`) entry holding the plan the run
    /// follows now; 0 when it is the submission's (every plan run, and a bare query until it
    /// is planned). A restore reads the plan from there: one read, as for any run.
    #[serde(default, skip_serializing_if = "is_zero_seq")]
    pub plan_seq: u64,
    /// After a person's plan edit: how many recruited subtasks and team changes the edited
    /// plan already holds ([`RunState::amend`] applies only later ones).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edit_mark: Option<(u32, u32)>,
    /// Planning of a bare query.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planning: Option<PlanningState>,
    /// The strategy chosen for the plan the run follows, and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<StrategyChoice>,
    /// How deep the run sits in its tree (0: a root); a child run is one deeper than its
    /// parent, and `coordinator.max-depth` bounds it.
    #[serde(default, skip_serializing_if = "is_zero_depth")]
    pub depth: u32,
    /// The budgets the run's model calls count against, root of the tree first (fixed at
    /// admission): every task's envelope carries them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub budget_scopes: Vec<BudgetScope>,
    /// Whether tasks naming a role and no agent are anycast (claimed from their role's queue
    /// by one member), fixed at admission: the deployment's member cards defined roles.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub anycast: bool,
    /// How the run's team changed while it ran (recruits, retirements, refused recruits), in
    /// run-log order; at most [`flotilla_model::recruit::MAX_TEAM_CHANGES`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub team: Vec<TeamChange>,
    /// The subtasks recruits added, in order: the plan a restore runs with is the stored plan
    /// with these appended ([`RunState::amend`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recruited: Vec<Subtask>,
    /// What a bare query took from memory (from its `submitted` input).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<flotilla_model::memory::MemoryUse>,
    /// The agent that leads the run under the `supervisor` strategy (fixed at admission).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lead: Option<String>,
    /// Under the `supervisor` strategy, once the plan runs: when the run stops waiting for
    /// its lead's `finished` (Unix ms; 0: no such wait).
    #[serde(default, skip_serializing_if = "is_zero_ms")]
    pub lead_deadline_ms: i64,
    /// The run's escalation policy (fixed at admission; absent: nothing waits for a person).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hitl: Option<HitlPolicy>,
    /// When the run is a fork: the run it forks, its fork point and how many results it
    /// kept (fixed at its start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork_of: Option<flotilla_model::fork::ForkRef>,
    /// While a person holds the run (`paused`, `human_control`): since when, until when, by
    /// whom.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold: Option<Hold>,
    /// When the run last resumed from a hold (Unix ms; 0: never): every wait's clock
    /// (dependencies, topics, claims) gives at least its full timeout from here.
    #[serde(default, skip_serializing_if = "is_zero_ms")]
    pub resumed_ms: i64,
}

/// A person's hold on a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hold {
    /// Since when (Unix ms, server time).
    #[serde(rename = "s")]
    pub since_ms: i64,
    /// When its default applies (a pause resumes, a takeover cancels).
    #[serde(rename = "d")]
    pub deadline_ms: i64,
    /// Who holds it.
    #[serde(rename = "b", default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// Why.
    #[serde(rename = "r", default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The approval whose decision ends the hold: a pause Flotilla made while a request to
    /// extend the run's budget waits (trigger `budget`).
    #[serde(rename = "a", default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<String>,
}

fn is_zero_depth(depth: &u32) -> bool {
    *depth == 0
}

fn is_zero_seq(seq: &u64) -> bool {
    *seq == 0
}

/// Where planning of a bare query stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanningState {
    /// The current planner round (1 + repairs so far).
    pub round: u32,
    /// Repairs allowed.
    pub max_repairs: u32,
    /// Status.
    pub status: PlanningStatus,
}

impl RunState {
    /// A run whose submission is stored but not validated yet: nothing about its fate is
    /// known, so it has no tasks and no outcome.
    pub fn pending(
        run_id: RunId,
        created_ms: i64,
        name: Option<String>,
        labels: BTreeMap<String, String>,
        session_id: Option<SessionId>,
        parent: Option<RunHandle>,
    ) -> Self {
        let mut state = Self::rejected(run_id, Vec::new(), created_ms, name, labels);
        state.status = RunStatus::Pending;
        state.finished_ms = None;
        state.outcome = None;
        state.session_id = session_id;
        state.parent = parent;
        state
    }

    /// A rejected run: nothing is dispatched, the errors are kept.
    pub fn rejected(
        run_id: RunId,
        errors: Vec<Problem>,
        now_ms: i64,
        name: Option<String>,
        labels: BTreeMap<String, String>,
    ) -> Self {
        let reason = errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        Self {
            fork_of: None,
            run_id,
            status: RunStatus::Rejected,
            created_ms: now_ms,
            finished_ms: Some(now_ms),
            name,
            labels,
            session_id: None,
            parent: None,
            reply_to: None,
            wait_reply_to: None,
            trace: None,
            warnings: Vec::new(),
            errors,
            tasks: Vec::new(),
            timer: None,
            next_generation: 0,
            applied: 0,
            failed: 0,
            stop_reason: None,
            first_seq: 0,
            topics_ready: Vec::new(),
            plan_seq: 0,
            planning: None,
            strategy: None,
            depth: 0,
            budget_scopes: Vec::new(),
            anycast: false,
            team: Vec::new(),
            recruited: Vec::new(),
            memory: None,
            lead: None,
            lead_deadline_ms: 0,
            hold: None,
            resumed_ms: 0,
            hitl: None,
            edit_mark: None,
            outcome: Some(RunOutcome {
                run_id,
                status: RunStatus::Rejected,
                final_result: None,
                failed: Vec::new(),
                skipped: Vec::new(),
                failed_omitted: 0,
                skipped_omitted: 0,
                reason: Some(reason),
                cause: Some(EndCause::Rejected),
                rollback_run_id: None,
            }),
        }
    }

    /// Task counts by status.
    pub fn counts(&self) -> TaskCounts {
        let mut c = TaskCounts {
            total: self.tasks.len() as u32,
            ..TaskCounts::default()
        };
        for t in &self.tasks {
            match t.status {
                TaskStatus::Waiting | TaskStatus::Retrying | TaskStatus::AwaitingApproval => {
                    c.waiting += 1
                }
                TaskStatus::Dispatched => c.running += 1,
                TaskStatus::Succeeded => c.succeeded += 1,
                TaskStatus::Failed => c.failed += 1,
                TaskStatus::Skipped => c.skipped += 1,
                TaskStatus::Cancelled => c.cancelled += 1,
            }
        }
        c
    }

    /// Why task `i` was skipped or cancelled, in words.
    pub fn skip_reason(&self, i: usize, plan: Option<&Plan>) -> Option<String> {
        let t = self.tasks.get(i)?;
        match t.status {
            TaskStatus::Skipped => match (t.cause, t.via_topic) {
                (Some(c), via) => {
                    let cause = plan
                        .and_then(|p| p.subtasks.get(c as usize))
                        .map_or_else(|| format!("#{c}"), |s| s.id.to_string());
                    Some(match via {
                        None => format!("dependency_failed: {cause}"),
                        Some(j) => format!(
                            "producer_failed: {cause} (consumed topic {} can get no entry from the plan)",
                            plan.and_then(|p| p.subtasks.get(i))
                                .and_then(|s| s.consumes.get(j as usize))
                                .map_or_else(|| format!("#{j}"), |t| format!("{t:?}"))
                        ),
                    })
                }
                (None, _) => t.skip_reason.clone(),
            },
            TaskStatus::Cancelled => self
                .stop_reason
                .clone()
                .or_else(|| t.skip_reason.clone())
                .or_else(|| Some("cancelled".into())),
            _ => None,
        }
    }

    /// Client view of the tasks from `offset`, at most `limit` of them, given the plan.
    pub fn task_views(&self, plan: Option<&Plan>, offset: usize, limit: usize) -> Vec<TaskView> {
        self.tasks
            .iter()
            .enumerate()
            .skip(offset)
            .take(limit)
            .map(|(i, t)| TaskView {
                task_id: plan
                    .and_then(|p| p.subtasks.get(i))
                    .map(|s| s.id.clone())
                    .unwrap_or_else(|| TaskId::new(format!("#{i}"))),
                status: t.status,
                attempts: t.attempt,
                error: t.error.clone(),
                skip_reason: self.skip_reason(i, plan),
                dispatched_at: (t.attempt > 0).then(|| Timestamp::from_unix_ms(t.dispatched_ms)),
                pool: plan.and_then(|p| p.subtasks.get(i)).map(|s| s.pool.clone()),
                paused_until: (t.paused() && !t.status.is_terminal())
                    .then(|| Timestamp::from_unix_ms(t.paused_until_ms)),
            })
            .collect()
    }
}

/// A workflow event to publish.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Emission {
    /// Deterministic event id (also its `Nats-Msg-Id`).
    pub id: String,
    /// The task, for task events.
    pub task: Option<u32>,
    /// The attempt, for task events.
    pub attempt: Option<u32>,
    /// When (Unix ms, server time of the deciding input).
    pub at_ms: i64,
    /// The event.
    pub event: WorkflowEvent,
}

/// What the runtime must do after an input. Every action is idempotent to perform.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t")]
pub enum Action {
    /// Publish attempt `attempt` of `task` (message id `task.<run>.<task>.<attempt>`).
    Dispatch {
        /// Task index.
        task: u32,
        /// Attempt number.
        attempt: u32,
    },
    /// Publish a workflow event.
    Emit(Box<Emission>),
    /// Append the succeeded task's result to each topic it produces (automatic produce:
    /// `{subtask_id, summary, numeric_value}`, message id `produce.<run>.<task>.<topic>`).
    /// Performed before the step's dispatches, which may consume the entries.
    Produce {
        /// Task index.
        task: u32,
    },
    /// Write the succeeded task's response to its `output_key` in session state (message id
    /// `output.<run>.<task>`). Performed before the step's dispatches, which may read it.
    StoreOutput {
        /// Task index.
        task: u32,
    },
    /// Remove the queued message of attempt `attempt` of anycast task `task` from its role's
    /// queue: no member claimed it in time, and none may start it now.
    Withdraw {
        /// Task index.
        task: u32,
        /// Attempt number.
        attempt: u32,
    },
    /// Schedule a durable timer firing into the run log at `due_ms`.
    ArmTimer {
        /// Generation.
        generation: u64,
        /// Due time.
        due_ms: i64,
    },
    /// Attempts of this run are still running although the run stopped (cancelled,
    /// aborted): tell their workers to cancel them.
    CancelAttempts,
    /// The run is held (paused, taken over) or no longer: tell the workers, whose running
    /// LLM attempts of the run stop at their next step boundary while it is.
    HoldAttempts {
        /// Held (true) or released (false).
        held: bool,
    },
    /// Task `task` is paused by itself or no longer: tell the workers, whose running LLM
    /// attempt of it stops at its next step boundary while it is.
    HoldTask {
        /// Task index.
        task: u32,
        /// Held (true) or released (false).
        held: bool,
    },
    /// The run ended: complete its outcome (final result), emit the terminal event and answer
    /// a waiting submitter.
    Finish,
    /// The run was cancelled with `rollback`: submit its rollback run (id
    /// [`flotilla_model::rollback::rollback_run_id`]), a child that undoes `tasks` (plan
    /// indexes, succeeded, each with a compensation) in reverse dependency order.
    Rollback {
        /// The tasks to undo.
        tasks: Vec<u32>,
    },
    /// Task `task` waits for a person before attempt `attempt` is dispatched (or, with
    /// `notify_only`, is dispatched with a notice): store the request in the escalations
    /// bucket (create-if-absent) and notify `<prefix>.notify.approval.<run>`.
    RequestApproval {
        /// Task index.
        task: u32,
        /// The attempt it would let run.
        attempt: u32,
        /// What triggered it.
        trigger: Trigger,
        /// When its default decides (Unix ms).
        deadline_ms: i64,
        /// Only notify: nothing waits.
        notify_only: bool,
        /// 0: the dispatch; n ≥ 1: the attempt's n-th suspended tool call.
        call: u32,
        /// For a tool call: the run-log sequence of its suspension.
        from_seq: u64,
    },
    /// The deadline of task `task`'s approval passed before any answer in log order: its
    /// default decides. Append that decision to the run log (`approval_decided`, status
    /// `expired`, message id `approval.<run>.<approval>.expired`) — the record a resumed
    /// attempt and a replay read; the machine takes no answer for this wait from here on.
    ExpireApproval {
        /// Task index.
        task: u32,
        /// The attempt it would let run.
        attempt: u32,
        /// 0: the dispatch; n ≥ 1: the attempt's n-th suspended tool call.
        call: u32,
        /// The run's default for the wait's trigger (`[hitl] on-timeout`). Absent from
        /// outboxes written before 0.3: the run's policy gives it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        default: Option<DefaultDecision>,
    },
    /// The machine applied the decision at run-log `seq` to task `task`'s wait: write the
    /// decided approval to the escalations bucket (its projection of the log, idempotent),
    /// and a grant when the answer approved the tool `always`.
    ProjectApproval {
        /// Task index.
        task: u32,
        /// The attempt it would have let run.
        attempt: u32,
        /// 0: the dispatch; n ≥ 1: the attempt's n-th suspended tool call; `REVIEW_CALL`: a
        /// result's review.
        call: u32,
        /// For a tool call: the run-log sequence of its suspension; for a review: the
        /// result's.
        from_seq: u64,
        /// What triggered the wait.
        trigger: Trigger,
        /// The wait's deadline (Unix ms): the request is rebuilt from it when the bucket
        /// does not hold it.
        deadline_ms: i64,
        /// The run-log entry that decided (an `approval_decided`).
        seq: u64,
    },
    /// The run ended while task `task` waited for a person: mark its approval `withdrawn`
    /// unless an answer came first.
    WithdrawApproval {
        /// Task index.
        task: u32,
        /// The attempt it would have let run.
        attempt: u32,
        /// 0: the dispatch; n ≥ 1: the attempt's n-th suspended tool call.
        call: u32,
    },
    /// The planner task of round `round` (task 0 of the planning plan) succeeded: review its
    /// answer and append the decision to the run log (`planned`, message id
    /// `planned.<run>.<round>`). The run waits for that entry.
    ReviewPlan {
        /// The planner round.
        round: u32,
    },
}
