//! Controls a person applies to a run while it runs: pause it, resume it, take it over,
//! complete one of its tasks by hand.
//!
//! Each is an input on the run's log (`control` with `pause`, `resume` or `takeover`, and
//! `completed`) that the run machine applies, so every coordinator and every replay decides
//! alike. A hold (paused, or under human control) is a wait like any other: it has a deadline
//! and a default — a paused run resumes, a taken-over run is cancelled — so a run nobody comes
//! back to does not sit forever.
//!
//! ```text
//!             pause                      takeover
//! running ───────────► paused ─────────────────────► human_control
//!    ▲  └──────────────────────── takeover ──────────────►  │
//!    │  resume (or the pause's deadline)                    │
//!    └──────────────────────────────────────────────────────┘ resume
//!                                 the takeover's deadline ──► cancelled
//! ```

use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::{RunId, TaskId};
use crate::problem::{Problem, ProblemCode};
use crate::run::{FailedTask, RunStatus, TaskStatus};

/// How long a pause lasts when the request does not say: then the run resumes.
pub const DEFAULT_PAUSE_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// How long a takeover lasts when the request does not say: then the run is cancelled (the
/// person took it because the agents should not go on alone; handing it back unasked would
/// undo that).
pub const DEFAULT_TAKEOVER_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// Shortest hold a request may ask for.
pub const MIN_HOLD_TIMEOUT: Duration = Duration::from_secs(1);
/// Longest hold a request may ask for.
pub const MAX_HOLD_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);
/// Longest result a person may give when completing a task, in bytes.
pub const MAX_COMPLETED_RESULT: usize = 64 * 1024;
/// Longest `reason` or `comment`, in bytes.
pub const MAX_CONTROL_TEXT: usize = 1024;
/// Most runs of a tree a pause, resume or takeover reaches (the run and its descendants).
pub const MAX_CONTROLLED_RUNS: usize = 1000;
/// Most tasks listed per list of a takeover context; the rest are counted in `omitted`.
pub const MAX_CONTEXT_TASKS: usize = 100;
/// Longest result preview in a takeover context, in bytes.
pub const MAX_CONTEXT_RESULT: usize = 1024;

/// Checks a requested hold: `None` takes `default`; otherwise 1 s to 7 days.
pub fn hold_timeout(timeout_ms: Option<u64>, default: Duration) -> Result<Duration, String> {
    let Some(ms) = timeout_ms else {
        return Ok(default);
    };
    let d = Duration::from_millis(ms);
    if d < MIN_HOLD_TIMEOUT || d > MAX_HOLD_TIMEOUT {
        return Err(format!(
            "timeout_ms {ms} is out of range: a hold lasts 1000 ms to {} ms (7 days)",
            MAX_HOLD_TIMEOUT.as_millis()
        ));
    }
    Ok(d)
}

/// Pause a run (`<prefix>.api.run.pause`): nothing new is dispatched; attempts already
/// running finish and their results are kept. Its descendant runs are paused too (unless
/// `children` is false). Idempotent: pausing a paused run changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PauseRunRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// Why, in words (at most 1024 bytes; shown in the run's events).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Who asks, for the record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// How long the pause lasts before the run resumes by itself, in ms (1 s to 7 days;
    /// default 24 h).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Whether the run's descendant runs are paused too (default true; not with `task_id`).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub children: bool,
    /// Pause only this task of the run (a member): it is not dispatched, and a running LLM
    /// attempt of it stops at its next step boundary, while the rest of the run goes on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<TaskId>,
}

/// Resume a paused or taken-over run (`<prefix>.api.run.resume`): dispatch continues exactly
/// where it stopped; every wait's clock (dependencies, claims) starts afresh. Its descendant
/// runs resume too (unless `children` is false). Idempotent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ResumeRunRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// Why, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Who asks, for the record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// Whether the run's descendant runs resume too (default true; not with `task_id`).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub children: bool,
    /// Resume only this task, paused by itself (`run.pause` with `task_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<TaskId>,
}

/// Take a run over (`<prefix>.api.run.takeover`): it moves to `human_control` — nothing is
/// dispatched by the agents — and the answer carries its [`TakeoverContext`]. The person
/// then completes tasks (`run.complete`), hands the run back (`run.resume`) or cancels it.
/// Its descendant runs are paused (unless `children` is false). A takeover of a run already
/// under human control changes nothing and answers the context again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TakeoverRunRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// Why, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Who takes over, for the record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// How long the person holds the run before it is cancelled, in ms (1 s to 7 days;
    /// default 24 h).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Whether the run's descendant runs are paused (default true).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub children: bool,
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

/// The answer to a pause, resume or takeover.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ControlRunReply {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// Whether the control was recorded on the run log: `false` when the run was already in
    /// the asked state (or had ended — then `status` is its final status).
    pub applied: bool,
    /// The run's status when the request was handled (before the control applies;
    /// `pending` for a run whose start is not recorded yet — the control is recorded and
    /// applies after the start).
    pub status: RunStatus,
    /// Descendant runs the control was also recorded for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<RunId>,
    /// On a takeover: where the run stands (absent when the run's start could not be read
    /// within a few seconds: take it over again to read it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<Box<TakeoverContext>>,
    /// The task paused or resumed, for a control of one task; `applied` then says whether
    /// the task was not already in the asked state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<TaskId>,
    /// Why the control changed nothing (`applied: false`: "the run is already paused by
    /// alice until …"), or, with `pending`, that the run has not applied it yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// The control is on the run log, but no coordinator applied it within a few seconds
    /// (none is running, or the run's is busy): `applied` says only that it was recorded, and
    /// the run's events say what it did once it is applied.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pending: bool,
}

/// What the run machine made of a pause, resume or takeover whose run-log entry named a
/// `reply_to` ([`crate::runlog::Control::reply_to`]): published there by the coordinator
/// that applied the entry, once the run's record holds the decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ControlVerdict {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// The entry's run-log sequence.
    pub seq: u64,
    /// Whether it changed the run (or its task).
    pub applied: bool,
    /// The run's status before the entry applied (its status, when it changed nothing).
    pub status: RunStatus,
    /// Why it changed nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// Complete a task by hand (`<prefix>.api.run.complete`): the person's `result` stands as
/// the task's result — it succeeds, its dependents get the result as from any agent. Only a
/// task that is not running and has not ended may be completed (waiting, retrying, or
/// awaiting approval — its approval is withdrawn).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CompleteTaskRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// The task.
    pub task_id: TaskId,
    /// The result (at most 64 KiB).
    pub result: String,
    /// Who completes it (required: the result is recorded as from `human:<by>`).
    pub by: String,
    /// Why, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
}

impl CompleteTaskRequest {
    /// Every problem of the request at once: no `by`, text longer than allowed.
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        if self.by.trim().is_empty() {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "by",
                "who completes the task is required",
            ));
        } else if self.by.len() > MAX_CONTROL_TEXT {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "by",
                format!("longer than {MAX_CONTROL_TEXT} bytes"),
            ));
        }
        if self.result.len() > MAX_COMPLETED_RESULT {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "result",
                format!(
                    "{} bytes is more than the {MAX_COMPLETED_RESULT} a completion may carry",
                    self.result.len()
                ),
            ));
        }
        if self
            .comment
            .as_ref()
            .is_some_and(|c| c.len() > MAX_CONTROL_TEXT)
        {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "comment",
                format!("longer than {MAX_CONTROL_TEXT} bytes"),
            ));
        }
        out
    }
}

/// The answer to `run.complete`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct CompleteTaskReply {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// The task.
    pub task_id: TaskId,
    /// `true`: the completion was recorded on the run log and applies next.
    pub completing: bool,
}

impl crate::api::ApiRequest for PauseRunRequest {
    const ENDPOINT: &'static str = "run.pause";
    type Reply = ControlRunReply;
}

impl crate::api::ApiRequest for ResumeRunRequest {
    const ENDPOINT: &'static str = "run.resume";
    type Reply = ControlRunReply;
}

impl crate::api::ApiRequest for TakeoverRunRequest {
    const ENDPOINT: &'static str = "run.takeover";
    type Reply = ControlRunReply;
}

impl crate::api::ApiRequest for CompleteTaskRequest {
    const ENDPOINT: &'static str = "run.complete";
    type Reply = CompleteTaskReply;
}

crate::api::has_protocol!(
    PauseRunRequest,
    ResumeRunRequest,
    TakeoverRunRequest,
    CompleteTaskRequest,
    EditPlanRequest,
);

/// `<prefix>.api.run.edit`: replace the remaining plan of a run under human control (taken
/// over). The edited plan keeps every task of the current plan at its position with its id;
/// tasks that have started (dispatched, waiting for approval, ended) stay exactly as they are,
/// waiting tasks may change, new tasks may be appended, and `config` stays as it is. It is
/// validated like a submission (`400 invalid_plan` with every problem); a run not under human
/// control is `409 not_taken_over`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EditPlanRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// The whole plan as it should run from here.
    pub plan: crate::plan::Plan,
    /// Who edits (recorded).
    pub by: String,
    /// Why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The answer to a plan edit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct EditPlanReply {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// Tasks of the edited plan.
    pub tasks_total: u32,
    /// Tasks it adds.
    pub added: u32,
    /// Waiting tasks it changes.
    pub changed: Vec<TaskId>,
}

impl crate::api::ApiRequest for EditPlanRequest {
    const ENDPOINT: &'static str = "run.edit";
    type Reply = EditPlanReply;
}

/// A plan edit, as recorded on the run log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PlanEdited {
    /// The plan the run follows from here (normalised).
    pub plan: crate::plan::Plan,
    /// Who edited it.
    pub by: String,
    /// Why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The tasks of `current` that `edited` changes, in plan order.
pub fn changed_tasks(current: &crate::plan::Plan, edited: &crate::plan::Plan) -> Vec<TaskId> {
    current
        .subtasks
        .iter()
        .zip(&edited.subtasks)
        .filter(|(a, b)| a != b)
        .map(|(a, _)| a.id.clone())
        .collect()
}

/// Why `edited` may not replace `current` for a run whose task `i` has `started(i)` (it was
/// dispatched at least once, waits for a person, or ended): one problem per thing it changes
/// that it may not. Pure: the API checks an edit with it, and the run machine again when it
/// applies the edit (the run may have moved on in between).
pub fn edit_problems(
    current: &crate::plan::Plan,
    edited: &crate::plan::Plan,
    started: impl Fn(usize) -> bool,
) -> Vec<Problem> {
    let mut out = Vec::new();
    if edited.config != current.config {
        out.push(Problem::new(
            ProblemCode::InvalidConfig,
            "config",
            "an edit keeps the plan's config as it is",
        ));
    }
    if edited.subtasks.len() < current.subtasks.len() {
        out.push(Problem::new(
            ProblemCode::InvalidConfig,
            "subtasks",
            format!(
                "the edited plan has {} tasks, the run {}: an edit keeps every task (complete one by hand to settle it)",
                edited.subtasks.len(),
                current.subtasks.len()
            ),
        ));
    }
    // Topics are the run's workspace: which have entries is known for the current plan's
    // topics only, so an edit works with those.
    let known: std::collections::BTreeSet<&str> = current
        .subtasks
        .iter()
        .flat_map(|t| t.produces.iter().chain(&t.consumes))
        .map(String::as_str)
        .collect();
    for (i, t) in edited.subtasks.iter().enumerate() {
        for (field, topics) in [("produces", &t.produces), ("consumes", &t.consumes)] {
            if let Some(new) = topics.iter().find(|x| !known.contains(x.as_str())) {
                out.push(Problem::new(
                    ProblemCode::InvalidConfig,
                    format!("subtasks[{i}].{field}"),
                    format!(
                        "topic {new:?} is not one of the run's: an edit may use only the workspace topics the plan already has"
                    ),
                ));
            }
        }
    }
    for (i, (was, now)) in current.subtasks.iter().zip(&edited.subtasks).enumerate() {
        if was.id != now.id {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                format!("subtasks[{i}].id"),
                format!(
                    "task {} must stay at position {i} (found {}): an edit keeps every task where it is",
                    was.id, now.id
                ),
            ));
        } else if started(i) && was != now {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                format!("subtasks[{i}]"),
                format!("task {} has started: it cannot change", was.id),
            ));
        }
    }
    out
}

/// A task completed by a person, as recorded on the run log (message id
/// `completed.<run>.<task>`: the first completion of a task is the one recorded).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Completed {
    /// The task.
    pub task_id: TaskId,
    /// The person's result.
    pub result: String,
    /// Who.
    pub by: String,
    /// Why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
}

/// `Nats-Msg-Id` of a completion on the run log.
pub fn completed_msg_id(run: RunId, task: &TaskId) -> String {
    format!("completed.{run}.{task}")
}

/// Where a taken-over run stands: what the person needs to carry on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TakeoverContext {
    /// The run.
    pub run_id: RunId,
    /// Its status when read.
    pub status: RunStatus,
    /// Tasks in the plan.
    pub tasks_total: u32,
    /// Tasks that have ended (succeeded, failed, skipped): how far the run got.
    pub step: u32,
    /// Succeeded tasks with their results (previews of at most 1 KiB), in plan order.
    pub completed: Vec<ContextResult>,
    /// Tasks that have not ended, with what each waits for.
    pub pending: Vec<PendingTask>,
    /// Tasks that failed.
    pub failed: Vec<FailedTask>,
    /// What to do next.
    pub suggested_next: SuggestedAction,
    /// The latest failure's reason, when a task failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<String>,
    /// Tasks left out of the lists above (each list holds at most 100).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub omitted: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A succeeded task's result in a takeover context.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ContextResult {
    /// The task.
    pub task_id: TaskId,
    /// Who produced it (a worker id, or `human:<who>`).
    pub by: String,
    /// The result's response (at most 1 KiB).
    pub result: String,
    /// Whether `result` was cut.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

/// A task that has not ended, in a takeover context.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PendingTask {
    /// The task.
    pub task_id: TaskId,
    /// Its status.
    pub status: TaskStatus,
    /// Dependencies that have not succeeded yet.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waiting_on: Vec<TaskId>,
    /// Whether it could be dispatched now (dependencies met) but for the hold.
    pub ready: bool,
}

/// What a person who took a run over may do next.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SuggestedAction {
    /// `complete` (a ready task: do it yourself, or resume and let its agent), `wait` (a task
    /// runs on a worker), `answer_approval` (a task waits for a person), `resume` (nothing
    /// to do by hand).
    pub action: String,
    /// The task it concerns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<TaskId>,
    /// In words.
    pub detail: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hold_timeouts_are_bounded() {
        assert_eq!(
            hold_timeout(None, DEFAULT_PAUSE_TIMEOUT),
            Ok(DEFAULT_PAUSE_TIMEOUT)
        );
        assert_eq!(
            hold_timeout(Some(5_000), DEFAULT_PAUSE_TIMEOUT),
            Ok(Duration::from_secs(5))
        );
        assert!(hold_timeout(Some(999), DEFAULT_PAUSE_TIMEOUT).is_err());
        assert!(hold_timeout(Some(8 * 24 * 3600 * 1000), DEFAULT_PAUSE_TIMEOUT).is_err());
    }

    #[test]
    fn children_default_to_true_on_the_wire() -> Result<(), serde_json::Error> {
        let r: PauseRunRequest =
            serde_json::from_str(r#"{"run_id":"0190d5f4-7b1c-7a3e-8f00-000000000001"}"#)?;
        assert!(r.children);
        assert!(
            serde_json::from_str::<PauseRunRequest>(
                r#"{"run_id":"0190d5f4-7b1c-7a3e-8f00-000000000001","bogus":1}"#
            )
            .is_err()
        );
        Ok(())
    }
}
