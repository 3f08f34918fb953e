//! The run log (`<prefix>.runlog.<run>`): every state-changing input of a run, in order.
//!
//! The coordinator's state for a run is a fold of these inputs; replaying a run's log rebuilds
//! it. Workers append results here, the coordinator appends submissions, and JetStream's
//! message scheduler appends timer firings.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::{AttemptId, RunId, SessionId, TaskId};
use crate::plan::Plan;
use crate::problem::Problem;
use crate::run::RunHandle;
use crate::task::{TaskResult, TraceContext};
use crate::time::Timestamp;

/// One run-log message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunLogEntry {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// The input.
    pub input: RunInput,
}

/// Inputs that change a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RunInput {
    /// A validated plan was accepted. Always the first entry of an accepted run's log.
    Submitted(Box<Submitted>),
    /// The submission was rejected. Always the first (and only) entry of a rejected run's
    /// log: the first entry decides a run's fate, once.
    Rejected(Box<Rejected>),
    /// A worker finished an attempt.
    TaskResult(Box<TaskResultInput>),
    /// A durable timer fired.
    TimerFired {
        /// Which arming of the run's timer fired; stale generations are ignored.
        generation: u64,
    },
    /// A person or a policy controls the run: cancel, pause, resume, take over.
    Control(Control),
    /// The coordinator's review of a planner answer (runs submitted as a bare query): the
    /// planned plan the run continues with, a repair round, or the end of planning. Appended
    /// by the coordinator once per planner round (message id `planned.<run>.<round>`); the
    /// run's state is a fold of the log, so the decision replays exactly.
    Planned(Box<Planned>),
    /// A workspace topic of the run's tree got an entry (from an agent, a client, the CLI):
    /// tasks that consume it may start. The coordinator's workspace watcher appends it.
    TopicWritten {
        /// The normalised topic.
        topic: String,
        /// The entry's workspace sequence.
        seq: u64,
    },
    /// A worker took an attempt of an anycast task (a `role` and no `agent`) from its role's
    /// queue and runs it with one of its members of the role: the attempt's wait for a
    /// member is over. Appended by that worker before the agent runs (message id
    /// `claimed.<run>.<task>.<attempt>`); one later than the wait's bound changes nothing.
    Claimed(Box<Claimed>),
    /// The supervisor recruited a member into the running plan: one new subtask, checked
    /// against its policy and validated. The run machine checks it again against the plan as
    /// it is when the input is applied and adds it, or refuses it (kept as a `refused` team
    /// change). Message id `recruited.<run>.<recruit_id>`.
    Recruited(Box<Recruited>),
    /// The supervisor retired a member from the run's team: its tasks that have not started
    /// are reassigned to their role or failed, per `policy`. Message id
    /// `retired.<run>.<member>`.
    Retired(Box<Retired>),
    /// Under the `supervisor` strategy, the lead assigned a subtask of the plan: it runs once
    /// its dependencies are met. Appended by the supervisor (message id
    /// `assigned.<run>.<task>`); an assignment of a task that is not waiting for one changes
    /// nothing.
    Assigned(Box<Assigned>),
    /// Under the `supervisor` strategy, the lead ended the run with its result: unfinished
    /// tasks are cancelled and the run succeeds with `result` as its final result. Appended by
    /// the supervisor (message id `finished.<run>`); the first one wins.
    Finished(Box<Finished>),
    /// An answer to an approval, or its deadline's default. Every answer is its own entry,
    /// appended by the API (message id `answer.<run>.<approval>.<id>`); the default is
    /// appended by the coordinator once the deadline's timer fired first (message id
    /// `approval.<run>.<approval>.expired`). The run machine applies the first in log order
    /// and, once the timer fired, only the default; one for an attempt that no longer waits
    /// changes nothing. Versions before 0.3 appended the answer that won in the escalations
    /// bucket, under `approval.<run>.<approval>`.
    ApprovalDecided(Box<crate::approval::ApprovalDecided>),
    /// A person completed a task by hand: their result stands as the task's, its dependents
    /// get it. Appended by the API (`run.complete`, message id `completed.<run>.<task>`);
    /// one for a task that is running or has ended changes nothing.
    Completed(Box<crate::control::Completed>),
    /// An LLM attempt stopped at a tool call that waits for a person (a gated tool, a tool
    /// it does not have, a question to the user): the attempt gives its worker slot back and
    /// waits as an approval; the decision dispatches it again, where it continues from its
    /// step journal. Appended by the worker (message id
    /// `suspended.<run>.<task>.<attempt>.<segment>`); one for an attempt that is not running
    /// that segment changes nothing.
    Suspended(Box<Suspended>),
    /// A person edited the remaining plan of a run under human control (`run.edit`): the plan
    /// the run follows from here. Appended by the API after checking it; the run machine
    /// applies it only while the run is under human control and its started tasks are
    /// unchanged (else `plan_edit_refused`).
    PlanEdited(Box<crate::control::PlanEdited>),
}

/// An assignment by a run's lead, as recorded on the run log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Assigned {
    /// The subtask assigned.
    pub task_id: TaskId,
    /// Who assigned it (`lead`, or `operator`).
    pub by: String,
    /// Why, in words.
    #[serde(default)]
    pub reason: String,
}

/// The end of a led run, as recorded on the run log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Finished {
    /// The run's final result (at most [`Finished::MAX_RESULT`] bytes).
    pub result: String,
    /// Who finished it (`lead`, or `operator`).
    pub by: String,
}

impl Finished {
    /// Longest final result a lead may give, in bytes.
    pub const MAX_RESULT: usize = 64 * 1024;
}

/// A recruit, as recorded on the run log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Recruited {
    /// The caller's id of the recruit (unique within the run).
    pub recruit_id: String,
    /// The subtask added: a `role` and no `agent`.
    pub subtask: crate::plan::Subtask,
    /// Who asked: `task:<id>` or `operator`.
    pub by: String,
    /// Why.
    pub reason: String,
}

/// A retirement, as recorded on the run log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Retired {
    /// The member (an agent definition).
    pub member: String,
    /// What becomes of its tasks that have not started.
    pub policy: crate::recruit::RetirePolicy,
    /// Who asked.
    pub by: String,
    /// Why.
    pub reason: String,
}

/// A control input.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Control {
    /// What to do.
    pub action: ControlAction,
    /// Why, in words (shown in the outcome).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Who asked (a user name, `supervisor`, …), for the record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// For `pause` and `takeover`: how long the hold lasts before its default applies (a
    /// pause resumes, a takeover cancels), in ms. Absent: 24 h.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// For `cancel`: undo the tasks that succeeded and declare a compensation, in reverse
    /// dependency order, in a rollback run (see [`crate::rollback`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rollback: bool,
    /// For `pause` and `resume`: the one task it applies to (the rest of the run goes on).
    /// Absent: the whole run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<TaskId>,
    /// For `pause`, `resume` and `takeover`: a subject where the coordinator that applies the
    /// entry says what the run machine made of it ([`crate::control::ControlVerdict`]) — the
    /// API answering the person who asked. Absent: nobody waits for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_to: Option<String>,
}

/// Control actions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ControlAction {
    /// Stop the run: nothing new is dispatched, running attempts are cancelled on their
    /// workers, and the run ends `cancelled`.
    Cancel,
    /// Hold the run (`paused`): nothing new is dispatched; attempts already running finish
    /// and their results apply. Until `resume`, or the pause's deadline (then it resumes).
    Pause,
    /// End a hold (`paused` or `human_control`): dispatch continues where it stopped.
    Resume,
    /// Hand the run to a person (`human_control`): nothing is dispatched by the agents; the
    /// person completes tasks, resumes or cancels. At the takeover's deadline the run is
    /// cancelled.
    Takeover,
}

impl ControlAction {
    /// The action as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cancel => "cancel",
            Self::Pause => "pause",
            Self::Resume => "resume",
            Self::Takeover => "takeover",
        }
    }
}

/// A rejected submission, as recorded on the run log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Rejected {
    /// Every problem (truncated past a limit, with a `too_many_problems` entry saying how
    /// many more there were).
    pub errors: Vec<Problem>,
    /// The plan's name, when it could be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Labels of the submission, when it could be read.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Where the rejection was also answered (a valid `reply_to`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_to: Option<String>,
    /// Intake-stream sequence of the submission (durable submissions): a redelivered
    /// submission recognises its own rejection by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intake_seq: Option<u64>,
}

/// An accepted submission.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Submitted {
    /// The plan, validated and normalised.
    pub plan: Plan,
    /// Labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<SessionId>,
    /// Parent link.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<RunHandle>,
    /// Where to publish the outcome (the submission's `reply_to`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_to: Option<String>,
    /// Where a request/reply submitter with `wait: true` waits for the outcome (its inbox).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_reply_to: Option<String>,
    /// Intake-stream sequence of the submission (durable submissions): a redelivered
    /// submission recognises its own acceptance by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intake_seq: Option<u64>,
    /// Tolerated validation problems.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<Problem>,
    /// Trace context of the submission.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<TraceContext>,
    /// Present when the submission was a bare query: `plan` is then the planning plan (one
    /// planner task), and the run is planned before it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planning: Option<PlanningSpec>,
    /// How deep the run sits in its tree (0: a root; a child is one deeper than its parent).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub depth: u32,
    /// The budgets the run's model calls count against, root of the tree first (its
    /// ancestors' with a budget, then its own): fixed when the run is admitted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub budget_scopes: Vec<crate::task::BudgetScope>,
    /// Whether the deployment's member cards defined roles when the run was admitted: then
    /// its tasks naming a `role` and no `agent` are anycast — queued on their role's queue
    /// and claimed by one member ([`crate::plan::Subtask::anycast_role`]). Fixed here so
    /// that every coordinator, and every replay, routes and bounds them alike.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub anycast: bool,
    /// For a bare query: what the coordinator decided with the supervisor's memory — a past
    /// plan reused (`plan` is then that plan and `planning` is absent), or the planner called
    /// with past matches as examples. Absent when memory was off or from older coordinators.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<crate::memory::MemoryUse>,
    /// The agent that leads the run under the `supervisor` strategy (the deployment's first
    /// agent with the role `supervisor` when the run was admitted; absent when it has none).
    /// Fixed here so that `auto` resolves alike on every coordinator and every replay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lead: Option<String>,
    /// The run's escalation policy: the deployment's `[hitl]` tightened by the plan's
    /// `config.hitl` when the run was admitted (absent: nothing in the run waits for a
    /// person). Fixed here so every coordinator, and every replay, gates the same tasks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hitl: Option<crate::approval::HitlPolicy>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// How a bare query is planned, fixed when the run is accepted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PlanningSpec {
    /// The query.
    pub query: String,
    /// Planner answers with problems that are sent back for repair before the run fails.
    pub max_repairs: u32,
}

/// The coordinator's review of planner round `round`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Planned {
    /// The planner round reviewed (1 for the first answer, 2 for the first repair, …).
    pub round: u32,
    /// What the review decided.
    pub decision: PlanDecision,
}

impl PlanDecision {
    /// The decision as it appears on the wire.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Accepted { .. } => "accepted",
            Self::Repair { .. } => "repair",
            Self::Failed { .. } => "failed",
        }
    }
}

/// What the review of a planner answer decided.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum PlanDecision {
    /// The answer is a valid plan: the run continues with it (validated and normalised).
    Accepted {
        /// The planned plan.
        plan: Plan,
        /// Tolerated validation problems.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        warnings: Vec<Problem>,
    },
    /// The answer has problems and repairs are left: the planner runs again with them.
    Repair {
        /// The next planning plan: one planner task whose input carries the problems.
        plan: Plan,
        /// The problems of the answer.
        problems: Vec<Problem>,
    },
    /// The answer has problems and no repairs are left: the run fails with them.
    Failed {
        /// The problems of the last answer.
        problems: Vec<Problem>,
    },
}

/// A worker's claim of an anycast task's attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Claimed {
    /// The task.
    pub task_id: TaskId,
    /// The attempt number.
    pub attempt: u32,
    /// The attempt id from the envelope.
    pub attempt_id: AttemptId,
    /// The worker that took it.
    pub worker: String,
    /// The member (agent definition) that runs it.
    pub agent: String,
    /// The role it was claimed for.
    pub role: String,
}

/// `Nats-Msg-Id` of a claim on the run log: one claim per attempt is recorded.
pub fn claimed_msg_id(run: RunId, task: &TaskId, attempt: u32) -> String {
    format!("claimed.{run}.{task}.{attempt}")
}

/// An attempt that stopped at a tool call waiting for a person.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Suspended {
    /// The task.
    pub task_id: TaskId,
    /// The attempt number.
    pub attempt: u32,
    /// The attempt id from the envelope.
    pub attempt_id: AttemptId,
    /// The worker that ran it.
    pub worker: String,
    /// How many times the attempt had suspended before (the envelope's `resume.segment`, 0
    /// on its first run).
    pub segment: u32,
    /// The call it waits at; absent when it stopped because its run is held (paused or
    /// taken over): it continues from its journal once the run is resumed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call: Option<SuspendedCall>,
}

/// The tool call an attempt suspended at.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SuspendedCall {
    /// Why it waits.
    pub trigger: crate::approval::Trigger,
    /// The model's id of the call.
    pub call_id: String,
    /// The tool.
    pub tool: String,
    /// The call's arguments (a JSON value; a string when they were not JSON).
    pub arguments: serde_json::Value,
    /// `digest_of(tool, arguments)`: the decision applies to these arguments only.
    pub digest: String,
    /// The question, for trigger `question`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub question: Option<String>,
}

/// `Nats-Msg-Id` of an attempt's suspension.
pub fn suspended_msg_id(run: RunId, task: &TaskId, attempt: u32, segment: u32) -> String {
    format!("suspended.{run}.{task}.{attempt}.{segment}")
}

/// A finished attempt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TaskResultInput {
    /// The task.
    pub task_id: TaskId,
    /// The attempt number.
    pub attempt: u32,
    /// The attempt id from the envelope.
    pub attempt_id: AttemptId,
    /// The worker that ran it.
    pub worker: String,
    /// When the worker started the agent (worker clock; informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Timestamp>,
    /// The member that ran an anycast task (absent for tasks whose envelope names their
    /// agent, or that run the default agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// The result.
    pub result: TaskResult,
    /// The worker answered the run's waiting submitters itself ([`crate::task::TaskAnswer`]):
    /// the coordinator that applies this result does not answer them again. Stored only
    /// right after the input the coordinator decided on, so the result ends the run as the
    /// worker said.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub answered: bool,
}
