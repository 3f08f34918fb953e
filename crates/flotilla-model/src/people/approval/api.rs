//! The approvals API: the operator's inbox (`approval.list`, `approval.get`,
//! `approval.answer`), an external agent's question (`approval.ask`), and the tools approved
//! for a session (`approval.grants`, `approval.revoke`).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::{RunId, TaskId};
use crate::problem::{Problem, ProblemCode};
use crate::time::Timestamp;

use super::*;

/// List approvals (`approval.list`): pending ones across runs, or every approval of one run
/// (its audit trail).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ApprovalListRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// Only this run's approvals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<RunId>,
    /// Decided, expired and withdrawn approvals too (default: pending only).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub all: bool,
    /// Most approvals answered (default and maximum [`MAX_LISTED_APPROVALS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

/// Most approvals one `approval.list` answers.
pub const MAX_LISTED_APPROVALS: u32 = 1000;

/// Approvals, oldest request first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalList {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The approvals.
    pub approvals: Vec<ApprovalRecord>,
    /// More matched than `limit`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

/// One approval with its history (`approval.get`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ApprovalGetRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// The approval.
    pub approval_id: String,
}

/// An approval and every revision of it, oldest first, with the server's time of each.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalView {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The approval now.
    pub record: ApprovalRecord,
    /// The revisions the bucket keeps (the latest: the record itself says when it was
    /// requested and answered), oldest first, with the server's time.
    pub history: Vec<ApprovalRevision>,
}

/// One revision of an approval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalRevision {
    /// The escalations bucket's revision.
    pub revision: u64,
    /// When it was stored (server time).
    pub at: Timestamp,
    /// Where the approval stood.
    pub status: ApprovalStatus,
    /// The answer, once settled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<ApprovalAnswer>,
}

/// Answer an approval (`approval.answer`): the first answer wins. On the wire the decision's
/// fields sit beside the others: `"decision": "reject", "message": "…"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(try_from = "AnswerWire", into = "AnswerWire")]
pub struct ApprovalAnswerRequest {
    /// Wire protocol version.
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// The approval.
    pub approval_id: String,
    /// The decision.
    pub decision: Decision,
    /// Who answers (a person's name; required).
    pub by: String,
    /// A comment for the record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
    /// The digest of the request the person saw: when given and different from the stored
    /// request's, the answer was for other arguments and is refused (`409 digest_mismatch`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// With `approve` of a tool call (trigger `sensitive_action` or `human_in_command`):
    /// approve this tool for the rest of the run's session too — its later calls in the
    /// session run without asking until the grant is revoked (`approval.revoke`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub always: bool,
    /// With `reject`: the rejection is an incident of the task's agent (and role) — what it
    /// asked to do should not have been asked — recorded in their trust records (downgraded
    /// to novice at once), as an operator's `trust.incident` would.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub incident: bool,
}

/// What became of an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AnswerOutcome {
    /// This answer decided the approval.
    Decided,
    /// Something decided it first (another answer, the deadline, the run's end): `record`
    /// says what.
    AlreadyDecided,
}

/// The answer to `approval.answer`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalAnswerReply {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// Whether this answer decided.
    pub outcome: AnswerOutcome,
    /// The approval as settled.
    pub record: ApprovalRecord,
}

/// The kind of a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DecisionKind {
    /// See [`Decision::Approve`].
    Approve,
    /// See [`Decision::Reject`].
    Reject,
    /// See [`Decision::Edit`].
    Edit,
    /// See [`Decision::Respond`].
    Respond,
}

/// `approval.answer` as it is encoded: strict about unknown fields, and about the field each
/// decision needs (`input` for `edit`, `result` for `respond`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AnswerWire {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// The approval.
    pub approval_id: String,
    /// `approve`, `reject`, `edit` or `respond`.
    pub decision: DecisionKind,
    /// For `reject`: why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// For `edit`: the input the task runs with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<serde_json::Value>,
    /// For `respond`: the task's result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// Who answers.
    pub by: String,
    /// A comment for the record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
    /// The digest of the request the person saw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// With `approve` of a tool call: approve the tool for the session.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub always: bool,
    /// With `reject`: the rejection is an incident of the task's agent.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub incident: bool,
}

impl TryFrom<AnswerWire> for ApprovalAnswerRequest {
    type Error = String;

    fn try_from(w: AnswerWire) -> Result<Self, String> {
        let stray = |field: &str| format!("`{field}` does not go with decision {:?}", w.decision);
        let decision = match w.decision {
            DecisionKind::Approve => {
                if w.message.is_some() || w.input.is_some() || w.result.is_some() {
                    return Err(stray("message/input/result"));
                }
                Decision::Approve
            }
            DecisionKind::Reject => {
                if w.input.is_some() || w.result.is_some() {
                    return Err(stray("input/result"));
                }
                Decision::Reject {
                    message: w.message.clone().unwrap_or_default(),
                }
            }
            DecisionKind::Edit => Decision::Edit {
                input: w
                    .input
                    .clone()
                    .ok_or("decision edit needs `input` (the input the task runs with)")?,
            },
            DecisionKind::Respond => Decision::Respond {
                result: w
                    .result
                    .clone()
                    .ok_or("decision respond needs `result` (the task's result)")?,
            },
        };
        Ok(Self {
            protocol: w.protocol,
            run_id: w.run_id,
            approval_id: w.approval_id,
            decision,
            by: w.by,
            comment: w.comment,
            digest: w.digest,
            always: w.always,
            incident: w.incident,
        })
    }
}

impl From<ApprovalAnswerRequest> for AnswerWire {
    fn from(r: ApprovalAnswerRequest) -> Self {
        let (decision, message, input, result) = match r.decision {
            Decision::Approve => (DecisionKind::Approve, None, None, None),
            Decision::Reject { message } => (DecisionKind::Reject, Some(message), None, None),
            Decision::Edit { input } => (DecisionKind::Edit, None, Some(input), None),
            Decision::Respond { result } => (DecisionKind::Respond, None, None, Some(result)),
        };
        Self {
            protocol: r.protocol,
            run_id: r.run_id,
            approval_id: r.approval_id,
            decision,
            message,
            input,
            result,
            by: r.by,
            comment: r.comment,
            digest: r.digest,
            always: r.always,
            incident: r.incident,
        }
    }
}

impl crate::api::ApiRequest for ApprovalListRequest {
    const ENDPOINT: &'static str = "approval.list";
    type Reply = ApprovalList;
}

impl crate::api::ApiRequest for ApprovalGetRequest {
    const ENDPOINT: &'static str = "approval.get";
    type Reply = ApprovalView;
}

impl crate::api::ApiRequest for ApprovalAnswerRequest {
    const ENDPOINT: &'static str = "approval.answer";
    type Reply = ApprovalAnswerReply;
}

impl crate::api::ApiRequest for ApprovalAskRequest {
    const ENDPOINT: &'static str = "approval.ask";
    type Reply = ApprovalAskReply;
}

crate::api::has_protocol!(
    ApprovalAskRequest,
    ApprovalListRequest,
    ApprovalGetRequest,
    ApprovalAnswerRequest,
    GrantListRequest,
    GrantRevokeRequest
);

/// Session-state keys starting with this are Flotilla's own: agents and clients read them but
/// only Flotilla writes them (`_grant.<tool>`: a tool approved for the session).
pub const RESERVED_STATE_PREFIX: &str = "_";

/// The session-state key of a tool's grant, `_grant.<tool>`: a key of its own token in the
/// state bucket (`<session>._grant.<tool>`), which the NATS permissions of workers deny
/// (`$KV.flotilla-state.*._grant.>`), and which no `state.set` key can name (keys have no
/// dots).
pub fn grant_key(tool: &str) -> String {
    format!("{GRANT_PREFIX}{tool}")
}

/// What every grant key starts with.
pub const GRANT_PREFIX: &str = "_grant.";

/// A tool approved for the rest of a session (`approve` with `always`): stored in session
/// state under [`grant_key`]; its calls in the session's runs no longer wait for a person on
/// the `sensitive_action` and `human_in_command` triggers. Questions, client tools and
/// out-of-scope calls still wait. Revoked with `approval.revoke`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ToolGrant {
    /// The tool.
    pub tool: String,
    /// Who approved it.
    pub by: String,
    /// The run and approval it was approved in.
    pub run_id: RunId,
    /// The approval.
    pub approval_id: String,
    /// When (the answering coordinator's clock).
    pub at: Timestamp,
    /// Their comment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
}

/// `approval.grants`: the tools approved for a session (give `run_id` for its run's
/// session, or `session_id`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GrantListRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// A run of the session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<RunId>,
    /// The session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<crate::ids::SessionId>,
}

/// Reply to `approval.grants`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GrantList {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The session.
    pub session_id: String,
    /// Its grants, by tool.
    #[serde(default)]
    pub grants: Vec<ToolGrant>,
}

/// `approval.revoke`: withdraws a tool's grant in a session; its next call waits for a
/// person again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GrantRevokeRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// A run of the session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<RunId>,
    /// The session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<crate::ids::SessionId>,
    /// The tool.
    pub tool: String,
    /// Who revokes it (required).
    pub by: String,
}

/// Reply to `approval.revoke`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GrantRevokeReply {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The grant withdrawn (a tool without one is `404 not_found`, and nothing changes).
    pub revoked: ToolGrant,
}

impl crate::api::ApiRequest for GrantListRequest {
    const ENDPOINT: &'static str = "approval.grants";
    type Reply = GrantList;
}

impl crate::api::ApiRequest for GrantRevokeRequest {
    const ENDPOINT: &'static str = "approval.revoke";
    type Reply = GrantRevokeReply;
}

impl ApprovalAnswerRequest {
    /// Problems of the answer itself (before any approval is read).
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        if self.by.trim().is_empty() {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "by",
                "an answer must say who gives it",
            ));
        }
        if crate::token::check_name(&self.approval_id).is_err() {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "approval_id",
                format!(
                    "{:?} is not an approval id (`t<task>a<attempt>`)",
                    self.approval_id
                ),
            ));
        }
        if self.incident && !matches!(self.decision, Decision::Reject { .. }) {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "incident",
                format!(
                    "`incident` goes with decision reject only, not {}",
                    self.decision.as_str()
                ),
            ));
        }
        if self.always && self.decision != Decision::Approve {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "always",
                format!(
                    "`always` goes with decision approve only, not {}",
                    self.decision.as_str()
                ),
            ));
        }
        let text = match &self.decision {
            Decision::Reject { message } => message.len(),
            Decision::Respond { result } => result.len(),
            Decision::Edit { input } => input.to_string().len(),
            Decision::Approve => 0,
        };
        if text > MAX_ANSWER_TEXT
            || self
                .comment
                .as_ref()
                .is_some_and(|c| c.len() > MAX_ANSWER_TEXT)
        {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "decision",
                format!(
                    "a message, result, input or comment is longer than {MAX_ANSWER_TEXT} bytes"
                ),
            ));
        }
        out
    }
}

/// Default deadline of an `approval.ask`, seconds.
pub const DEFAULT_ASK_TIMEOUT_S: u64 = 300;
/// Longest deadline of an `approval.ask`, seconds.
pub const MAX_ASK_TIMEOUT_S: u64 = 3600;
/// Longest `query_id` of an `approval.ask`, bytes.
pub const MAX_QUERY_ID: usize = 256;

/// Ask a person on behalf of a running attempt (`approval.ask`): an agent of the NATS Agent
/// Protocol the attempt called asked a question mid-call (its `query`, the protocol's frame
/// for a permission request). Stored like every approval (trigger `external_agent`), so
/// `approval.list`, the console's inbox and the notices show it, and answered with
/// `approval.answer`. Asking again with the same `query_id` answers the same approval; asked
/// again past its deadline, the approval is settled `expired` (its default: reject) unless an
/// answer came first — that is how the waiting attempt ends its wait.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ApprovalAskRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The calling run.
    pub run_id: RunId,
    /// The calling task.
    pub task_id: TaskId,
    /// The calling attempt (the task's current one).
    pub attempt: u32,
    /// The calling attempt's id, from its task envelope (`FLOTILLA_ATTEMPT_ID` of an exec
    /// agent): a question of an attempt that is not the task's current one is refused.
    pub attempt_id: crate::ids::AttemptId,
    /// The agent that asks (`agents:<agent>.<owner>.<session>`).
    pub agent: String,
    /// The query's id as the agent sent it (with the run, task and attempt, the approval's
    /// identity).
    pub query_id: String,
    /// What the agent asks (the query's `prompt`).
    pub question: String,
    /// What the call was about (the prompt sent to the agent), for the person's context.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub context: String,
    /// Seconds until the default (reject) decides: default [`DEFAULT_ASK_TIMEOUT_S`], 1 to
    /// [`MAX_ASK_TIMEOUT_S`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<u64>,
}

/// The answer to `approval.ask`: the approval as stored now (pending, or settled when
/// answered or past its deadline).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalAskReply {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The approval.
    pub record: ApprovalRecord,
}

impl ApprovalAskRequest {
    /// Problems of the request itself (before any run is read).
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        if self.attempt == 0 {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "attempt",
                "attempts count from 1",
            ));
        }
        if !self.agent.starts_with("agents:") || self.agent.len() <= "agents:".len() {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "agent",
                format!(
                    "{:?} is not an external agent (`agents:<agent>.<owner>.<session>`)",
                    self.agent
                ),
            ));
        }
        if self.query_id.trim().is_empty() || self.query_id.len() > MAX_QUERY_ID {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "query_id",
                format!("a query id is 1 to {MAX_QUERY_ID} bytes"),
            ));
        }
        if self.question.trim().is_empty() {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "question",
                "the question is empty",
            ));
        }
        if self.question.len() > MAX_ANSWER_TEXT || self.context.len() > MAX_ANSWER_TEXT {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "question",
                format!("the question or its context is longer than {MAX_ANSWER_TEXT} bytes"),
            ));
        }
        if let Some(t) = self.timeout_s
            && !(1..=MAX_ASK_TIMEOUT_S).contains(&t)
        {
            out.push(Problem::new(
                ProblemCode::InvalidTimeout,
                "timeout_s",
                format!("timeout_s must be 1 to {MAX_ASK_TIMEOUT_S}, not {t}"),
            ));
        }
        out
    }

    /// The approval's id: `t<task index>a<attempt>x<12 hex digits of the query id's
    /// SHA-256>` — the same query asked again is the same approval.
    pub fn approval_id(&self, task_index: u32) -> String {
        use sha2::Digest;
        let d = sha2::Sha256::digest(self.query_id.as_bytes());
        let hex: String = d[..6].iter().map(|b| format!("{b:02x}")).collect();
        format!("t{task_index}a{}x{hex}", self.attempt)
    }
}
