//! Humans in the loop: the escalation policy a run is admitted with, approval requests and
//! their decisions.
//!
//! The policy ([`HitlPolicy`]) is fixed when a run is admitted — the deployment's `[hitl]`
//! section, tightened by the plan's `config.hitl` — and carried in the run's state, so every
//! coordinator and every replay decides alike which task waits for a person
//! (`flotilla_machine::policy::hitl::gate`). A waiting task is a state of the run machine plus its durable
//! timer: it holds no worker slot and no consumer.
//!
//! A task's approval is decided on its run's log: every answer is an `approval_decided`
//! entry ([`crate::runlog::RunInput::ApprovalDecided`]), and so is the deadline's default
//! once its timer fires; the run machine takes the first in log order, exactly once. The
//! escalations bucket (`<run>.<approval>`, [`approval_key`]) is a projection of that
//! decision: `pending` when requested, then the decided record, written after the run
//! machine decided (or `withdrawn` when the run ended first), so a later answer is told
//! `already_decided` with it. An external agent's question (`approval.ask`) is not a wait of
//! the run: it is decided in the bucket alone, first answer wins by compare-and-set.

mod api;
mod policy;

pub use api::*;
pub use policy::*;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::{RunId, TaskId};
use crate::plan::Risk;
use crate::time::{Secs, Timestamp};

/// The approval id of attempt `attempt` of task `index` (its position in the plan):
/// deterministic, so a replay asks the same question.
pub fn approval_id(index: u32, attempt: u32) -> String {
    format!("t{index}a{attempt}")
}

/// The approval id of the `call`-th tool call (1, 2, …) that attempt `attempt` of task
/// `index` suspended at: deterministic, so a replay asks the same question.
pub fn tool_approval_id(index: u32, attempt: u32, call: u32) -> String {
    format!("t{index}a{attempt}c{call}")
}

/// The `call` of a wait that reviews an attempt's result (trigger `low_confidence`): its
/// approval id is `t<task>a<attempt>r`.
pub const REVIEW_CALL: u32 = u32::MAX;

/// The approval id of a wait: a dispatch's (`call` 0), a result's review ([`REVIEW_CALL`]) or
/// a tool call's.
pub fn wait_id(index: u32, attempt: u32, call: u32) -> String {
    if call == 0 {
        approval_id(index, attempt)
    } else if call == REVIEW_CALL {
        format!("t{index}a{attempt}r")
    } else {
        tool_approval_id(index, attempt, call)
    }
}

/// The tool call an approval is about.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ToolCallRef {
    /// The model's id of the call.
    pub call_id: String,
    /// The tool's name.
    pub tool: String,
}

/// The escalations-bucket key of an approval.
pub fn approval_key(run: RunId, approval: &str) -> String {
    format!("{run}.{approval}")
}

/// A person's decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Decision {
    /// Run as asked.
    Approve,
    /// Do not run. A required task fails the run; an optional one is skipped.
    Reject {
        /// Why (shown in the run's outcome; an LLM sees it as the tool's result).
        #[serde(default)]
        message: String,
    },
    /// Run with this input instead of the plan's (recorded).
    Edit {
        /// The input the task runs with.
        input: serde_json::Value,
    },
    /// Do not run: this is the task's result, supplied by the person.
    Respond {
        /// The result (the task's response).
        result: String,
    },
}

impl Decision {
    /// The decision as it appears on the wire.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Approve => "approve",
            Self::Reject { .. } => "reject",
            Self::Edit { .. } => "edit",
            Self::Respond { .. } => "respond",
        }
    }

    /// The decision a default stands for.
    pub fn of_default(d: DefaultDecision, timeout: Secs) -> Self {
        match d {
            DefaultDecision::Approve => Self::Approve,
            DefaultDecision::Reject => Self::Reject {
                message: format!(
                    "nobody answered within {} s; the default is reject",
                    timeout.get().as_secs()
                ),
            },
        }
    }
}

/// Longest rejection message, comment or supplied result, in bytes.
pub const MAX_ANSWER_TEXT: usize = 64 * 1024;

/// Where an approval stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalStatus {
    /// Waiting for an answer.
    Pending,
    /// A person answered.
    Decided,
    /// Nobody answered before the deadline: its default decided.
    Expired,
    /// The run ended (cancelled, failed) before anyone answered.
    Withdrawn,
}

impl ApprovalStatus {
    /// The status as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Decided => "decided",
            Self::Expired => "expired",
            Self::Withdrawn => "withdrawn",
        }
    }
}

/// What a person is asked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalRequest {
    /// The approval (unique within the run: `t<task index>a<attempt>`).
    pub approval_id: String,
    /// The run.
    pub run_id: RunId,
    /// The task.
    pub task_id: TaskId,
    /// The attempt the approval lets run.
    pub attempt: u32,
    /// What triggered it.
    pub trigger: Trigger,
    /// The oversight mode of the task's agent or role.
    pub mode: HitlMode,
    /// The task's action.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
    /// The task's risk.
    pub risk: Risk,
    /// The task's agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// The task's role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// The task's description.
    pub description: String,
    /// The task's input, as it would run — or, for a tool call, the call's arguments.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub input: serde_json::Value,
    /// SHA-256 (hex) of the description and input (for a tool call: of the tool's name and
    /// the arguments): an answer naming another digest was given for other arguments and
    /// does not apply.
    pub digest: String,
    /// The tool call an LLM attempt suspended at (absent: the approval is of the task's
    /// dispatch). `description` is then the agent's question (trigger `question`) or says
    /// which tool it calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call: Option<ToolCallRef>,
    /// When it was asked (server time of the deciding input).
    pub requested_at: Timestamp,
    /// When its default decides.
    pub deadline: Timestamp,
    /// What the deadline decides.
    pub default: DefaultDecision,
}

/// The answer that decided an approval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalAnswer {
    /// The decision.
    #[serde(flatten)]
    pub decision: Decision,
    /// Who decided (`deadline` for an expiry, `run` for a withdrawal).
    pub by: String,
    /// A comment for the record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
    /// When (the deciding process's clock; the escalations bucket's revision has the
    /// server's).
    pub at: Timestamp,
    /// The tool was approved for the rest of the session too (see
    /// [`ApprovalAnswerRequest::always`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub always: bool,
    /// The rejection was marked as an incident of the task's agent (see
    /// [`ApprovalAnswerRequest::incident`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub incident: bool,
}

/// An approval as stored in the escalations bucket (each revision whole).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalRecord {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// Where it stands.
    pub status: ApprovalStatus,
    /// What was asked.
    pub request: ApprovalRequest,
    /// What decided it (absent while pending).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<ApprovalAnswer>,
}

/// The decision of an approval, as recorded on the run log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalDecided {
    /// The approval.
    pub approval_id: String,
    /// The task.
    pub task_id: TaskId,
    /// The attempt it lets run.
    pub attempt: u32,
    /// How it ended.
    pub status: ApprovalStatus,
    /// The decision that applies.
    #[serde(flatten)]
    pub decision: Decision,
    /// Who decided.
    pub by: String,
    /// For a tool call's approval: the call, and the digest of the arguments decided on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call: Option<ToolCallRef>,
    /// The request's digest (written for tool calls, whose decision must match the
    /// arguments the resumed attempt replays).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// The rejection is an incident of the task's agent (the run machine says so on the
    /// `approval_decided` event, and the supervisor records it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub incident: bool,
    /// The person's comment, kept with the decision in the escalations bucket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
    /// When the person answered (for the deadline's default: the deadline). Absent on
    /// entries of versions before 0.3, whose decision the bucket held already.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<Timestamp>,
    /// The person approved the tool for the rest of the session too (`approval.answer`'s
    /// `always`): written as a grant once this answer decides.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub always: bool,
    /// Where the coordinator that applies the entry says whether it decided (a
    /// [`crate::control::ControlVerdict`] with the entry's sequence): the API answering the
    /// person waits there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_to: Option<String>,
}

/// `Nats-Msg-Id` of the deadline's default on the run log: one per approval, so an expiry
/// appended again after a crash is dropped.
pub fn expired_msg_id(run: RunId, approval: &str) -> String {
    format!("approval.{run}.{approval}.expired")
}

/// `Nats-Msg-Id` of one answer on the run log: every answer is its own entry (`answer`: a
/// fresh id per `approval.answer` request), and the run machine applies the first.
pub fn answer_msg_id(run: RunId, approval: &str, answer: &str) -> String {
    format!("answer.{run}.{approval}.{answer}")
}

/// What an external agent's query is answered with, once its approval is settled: `yes` for
/// approve, the person's text for respond, `no` for anything else (reject, the deadline, a
/// withdrawal); `None` while it is pending.
pub fn external_reply(record: &ApprovalRecord) -> Option<String> {
    let answer = record.answer.as_ref()?;
    if record.status == ApprovalStatus::Pending {
        return None;
    }
    Some(match (&record.status, &answer.decision) {
        (ApprovalStatus::Decided, Decision::Approve) => "yes".to_owned(),
        (ApprovalStatus::Decided, Decision::Respond { result }) => result.clone(),
        _ => "no".to_owned(),
    })
}

/// The SHA-256 (hex) of what a task runs with: its description and input.
pub fn digest_of(description: &str, input: &serde_json::Value) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(description.as_bytes());
    h.update([0u8]);
    h.update(input.to_string().as_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}
