//! The request/reply API (NATS micro service, subjects `<prefix>.api.<endpoint>`).
//!
//! Each request type names its endpoint and its reply type, so a client cannot send a request
//! to the wrong subject or decode the wrong reply.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub(crate) use crate::endpoint::has_protocol;
pub use crate::endpoint::{ApiRequest, HasProtocol};
use crate::error_code::ErrorCode;
use crate::ids::RunId;
use crate::plan::Plan;
use crate::problem::Problem;
use crate::run::{RunStatus, RunView};
use crate::submit::{SubmitReply, SubmitRequest};

has_protocol!(
    crate::watch::WatchRequest,
    crate::lead::AssignRequest,
    crate::lead::FinishRequest,
    GetRunRequest,
    CancelRunRequest,
    ValidatePlanRequest,
    WsAppendRequest,
    WsReadRequest,
    MboxSendRequest,
    MboxReadRequest,
    StateGetRequest,
    StateListRequest,
    StateSetRequest,
    ChildStartRequest,
    MboxRoleRequest,
    MboxNegotiateRequest,
    crate::tree::RunTreeRequest,
    crate::diff::RunDiffRequest,
    crate::fork::RunForkRequest,
    crate::tree::SessionRequest,
);

impl ApiRequest for SubmitRequest {
    const ENDPOINT: &'static str = "submit";
    type Reply = SubmitReply;
}

/// Most tasks in one `run.get` answer: bounds the reply of huge runs.
pub const MAX_TASKS_PER_VIEW: u32 = 1000;

/// Read one run with its tasks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GetRunRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// First task to include (plan order); page through large runs with it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tasks_offset: u32,
    /// Most tasks to include: 1 to 1000 (default 1000); another value is refused with
    /// `400 invalid_limit`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks_limit: Option<u32>,
    /// Include only this task (paging is then ignored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<crate::ids::TaskId>,
}

impl GetRunRequest {
    /// A request for the first page of a run's tasks.
    pub fn new(run_id: RunId) -> Self {
        Self {
            protocol: crate::PROTOCOL_VERSION,
            run_id,
            tasks_offset: 0,
            tasks_limit: None,
            task_id: None,
        }
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Cancel a run: a control input on its run log. Nothing new is dispatched, running
/// attempts are cancelled on their workers, and the run ends `cancelled`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CancelRunRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// Why (shown in the outcome).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Who asks, for the record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// Undo what the run did: once it is stopped, its succeeded tasks that declare a
    /// compensation (`compensate`) are compensated in reverse dependency order by a rollback
    /// run, a child of this one (`rollback_run_id` in the answer and the outcome).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rollback: bool,
}

/// The answer to a cancellation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct CancelRunReply {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// `true` when the cancellation was recorded; `false` when the run had already ended
    /// (then `status` is its final status).
    pub cancelling: bool,
    /// The run's status when the request was handled.
    pub status: RunStatus,
    /// With `rollback`, when the cancellation was recorded: the run that will undo the
    /// succeeded tasks that declare a compensation (it starts only if there are any; the
    /// cancelled run's outcome says whether it did).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollback_run_id: Option<RunId>,
}

impl ApiRequest for CancelRunRequest {
    const ENDPOINT: &'static str = "run.cancel";
    type Reply = CancelRunReply;
}

/// Validate a plan against the deployment (its pools, agents and live workers) without
/// running it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ValidatePlanRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The plan.
    pub plan: Plan,
}

/// The answer to a validation request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ValidatePlanReply {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// Problems that would reject the plan.
    #[serde(default)]
    pub errors: Vec<Problem>,
    /// Tolerated problems (e.g. `no_live_worker`).
    #[serde(default)]
    pub warnings: Vec<Problem>,
}

impl ApiRequest for ValidatePlanRequest {
    const ENDPOINT: &'static str = "plan.validate";
    type Reply = ValidatePlanReply;
}

impl ApiRequest for GetRunRequest {
    const ENDPOINT: &'static str = "run.get";
    type Reply = RunView;
}

/// An error answer of the API, sent with the micro-service error headers
/// (`Nats-Service-Error`, `Nats-Service-Error-Code`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ApiError {
    /// HTTP-like status: 400 bad request, 404 not found, 409 conflict, 413 too large,
    /// 500 internal, 503 unavailable, 504 timeout.
    pub status: u16,
    /// Stable code (`malformed`, `not_found`, `conflict`, `internal`, …).
    pub code: String,
    /// Human-readable detail.
    pub message: String,
    /// For a `conflict` (a lost compare-and-set): the key's current revision (0: the key
    /// does not exist), so the client can re-read and retry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_revision: Option<u64>,
    /// For a `recruit_refused` (`403`): the policy rule that refused it
    /// ([`crate::recruit::RecruitRule`], e.g. `team_full`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    /// Validation problems behind the error (a recruit whose subtask does not validate).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<crate::problem::Problem>,
}

impl ApiError {
    /// An error answer without a revision: `code` goes on the wire as its string.
    pub fn new(status: u16, code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            status,
            code: code.into(),
            message: message.into(),
            current_revision: None,
            rule: None,
            problems: Vec::new(),
        }
    }

    /// The code, or `None` when this build does not know it (a peer of another build may
    /// send one): never read as another code.
    pub fn error_code(&self) -> Option<ErrorCode> {
        ErrorCode::from_wire(&self.code)
    }

    /// Whether the code is `code`.
    pub fn is(&self, code: ErrorCode) -> bool {
        self.error_code() == Some(code)
    }
}

/// Append an entry to a workspace topic of a run's tree (`ws.append`). The coordinator checks
/// the topic, the size, and — when `task_id` is given and the plan is strict — that the task
/// declares the topic in `produces`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WsAppendRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// A run of the tree (its root's workspace is written).
    pub run_id: RunId,
    /// The topic (normalised: trimmed, lower case, spaces to `_`).
    pub topic: String,
    /// The data: a JSON object.
    pub entry: serde_json::Map<String, serde_json::Value>,
    /// The task writing, when an agent writes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<crate::ids::TaskId>,
    /// Its attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    /// Writer name for writes outside a task (default `operator`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// Repeats with the same key (within the duplicate window) are stored once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
}

/// The answer to an append.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct WsAppendReply {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The entry's sequence.
    pub seq: u64,
    /// The normalised topic.
    pub topic: String,
    /// The write repeated an earlier one and was not stored again.
    #[serde(default)]
    pub duplicate: bool,
}

impl ApiRequest for WsAppendRequest {
    const ENDPOINT: &'static str = "ws.append";
    type Reply = WsAppendReply;
}

/// Read a run tree's workspace incrementally (`ws.read`): entries with `seq > since_seq`,
/// oldest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WsReadRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// A run of the tree.
    pub run_id: RunId,
    /// One topic; absent: every topic of the tree.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topic: Option<String>,
    /// Return entries after this sequence (0: from the start).
    #[serde(default)]
    pub since_seq: u64,
    /// Most entries: 1 to 1000 (default 200); another value is refused (`invalid_limit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

impl ApiRequest for WsReadRequest {
    const ENDPOINT: &'static str = "ws.read";
    type Reply = crate::workspace::WorkspacePage;
}

/// Send a mailbox message within a run tree (`mbox.send`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MboxSendRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// A run of the tree.
    pub run_id: RunId,
    /// Sender address (a task id, or a name for a client outside the plan).
    pub from: String,
    /// Recipient address (a task id), or `*` for every task of the tree.
    pub to: String,
    /// Message type.
    #[serde(rename = "type")]
    pub kind: crate::mailbox::MailboxKind,
    /// Body (JSON).
    #[serde(default)]
    pub payload: serde_json::Value,
    /// Conversation id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<String>,
    /// The sender's attempt, when a task sends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    /// Repeats with the same key (within the duplicate window) are sent once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
}

/// The answer to a send.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct MboxSendReply {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// Stream sequence of the message.
    pub seq: u64,
    /// Its number within its `(to, from)` pair.
    pub n: u64,
    /// The send repeated an earlier one and was not stored again.
    #[serde(default)]
    pub duplicate: bool,
}

impl ApiRequest for MboxSendRequest {
    const ENDPOINT: &'static str = "mbox.send";
    type Reply = MboxSendReply;
}

/// Longest `wait_ms` of a mailbox read: 30 seconds.
pub const MAX_MBOX_WAIT_MS: u64 = 30_000;

/// Read a mailbox (`mbox.read`): the reader's messages (and broadcasts) after its committed
/// cursor, or after `since_seq`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MboxReadRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// A run of the tree.
    pub run_id: RunId,
    /// The mailbox's owner (a task id).
    pub reader: String,
    /// Read after this sequence; absent: after the reader's committed cursor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since_seq: Option<u64>,
    /// Most messages: 1 to 1000 (default 100); another value is refused (`invalid_limit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    /// Wait up to this many milliseconds for a message when there is none: at most 30,000;
    /// more is refused (`invalid_limit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<u64>,
    /// Commit the cursor past what this read returns.
    #[serde(default)]
    pub commit: bool,
}

impl ApiRequest for MboxReadRequest {
    const ENDPOINT: &'static str = "mbox.read";
    type Reply = crate::mailbox::MailboxPage;
}

/// Read a session-state value (`state.get`). The session is `session_id`, else the run's
/// session (its `session_id`, else its root run).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StateGetRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// A run of the session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<RunId>,
    /// The session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<crate::ids::SessionId>,
    /// The key.
    pub key: String,
}

impl ApiRequest for StateGetRequest {
    const ENDPOINT: &'static str = "state.get";
    type Reply = crate::state::StateValue;
}

/// Most keys one `state.list` answers (keys are at most 128 bytes: a page stays far under
/// the NATS payload limit however many keys a session has).
pub const MAX_STATE_KEYS: u32 = 1000;

/// The keys set in a session's state (`state.list`): give `run_id` for its run's session, or
/// `session_id`. Flotilla's own keys (a tool's session grant, `_grant.<tool>`: see
/// `approval.grants`) are not listed. Keys come in order, a page at a time: `after` the last
/// key of the previous page, at most `limit`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StateListRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// A run of the session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<RunId>,
    /// The session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<crate::ids::SessionId>,
    /// Only keys after this one (the last key of the previous page).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
    /// Most keys to answer: 1 to [`MAX_STATE_KEYS`] (the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

impl StateListRequest {
    /// The page size asked for, or why it cannot be.
    pub fn page(&self) -> Result<usize, String> {
        match self.limit {
            None => Ok(MAX_STATE_KEYS as usize),
            Some(n) if (1..=MAX_STATE_KEYS).contains(&n) => Ok(n as usize),
            Some(n) => Err(format!("limit must be 1 to {MAX_STATE_KEYS}, not {n}")),
        }
    }
}

/// Reply to `state.list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct StateKeys {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The session.
    pub session_id: String,
    /// Its keys, in order.
    pub keys: Vec<String>,
    /// More keys follow the last one (ask again with it as `after`).
    #[serde(default)]
    pub more: bool,
}

impl ApiRequest for StateListRequest {
    const ENDPOINT: &'static str = "state.list";
    type Reply = StateKeys;
}

/// Write a session-state value (`state.set`), optionally as a compare-and-set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StateSetRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// A run of the session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<RunId>,
    /// The session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<crate::ids::SessionId>,
    /// The key.
    pub key: String,
    /// The value (JSON, at most 256 KiB encoded).
    pub value: serde_json::Value,
    /// Write only if the key is at this revision (0: only if it does not exist).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_revision: Option<u64>,
}

/// The answer to a write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct StateSetReply {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The key's new revision.
    pub revision: u64,
}

impl ApiRequest for StateSetRequest {
    const ENDPOINT: &'static str = "state.set";
    type Reply = StateSetReply;
}

/// Start a child run for a task attempt (agent-as-tool). Agents ask the coordinator rather
/// than publishing the submission themselves, so workers need no right to submit runs: the
/// coordinator checks the parent link against the parent run and publishes the child's first
/// message (`Nats-Expected-Last-Subject-Sequence: 0`, so a repeated start is a no-op).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ChildStartRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The child's submission: `run_id` and `parent` (with `parent_task_id`) are required.
    pub submission: SubmitRequest,
}

/// The answer to [`ChildStartRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ChildStartReply {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The child run.
    pub run_id: RunId,
    /// `false`: the child existed already (a redelivered attempt re-attached).
    pub created: bool,
}

impl ApiRequest for ChildStartRequest {
    const ENDPOINT: &'static str = "child.start";
    type Reply = ChildStartReply;
}

/// The tasks of a run tree that play a role (`mbox.role`): how a `role:<name>` candidate of a
/// negotiation is expanded. A task plays a role when its subtask names it as its `role`, or
/// when its agent (the subtask's `agent`, else the deployment's default agent) lists it among
/// its member card's `roles`. Every run of the tree counts (the root and its child runs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MboxRoleRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// A run of the tree.
    pub run_id: RunId,
    /// The role (a name: letters, digits, `_`, `-`).
    pub role: String,
}

/// The answer to [`MboxRoleRequest`]: the tasks playing the role, sorted, without repeats.
/// None play it: `404 unknown_role`, whose message lists the roles the tree's tasks play.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct MboxRoleReply {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The role asked about.
    pub role: String,
    /// Its tasks (mailbox addresses), sorted.
    pub tasks: Vec<String>,
}

impl ApiRequest for MboxRoleRequest {
    const ENDPOINT: &'static str = "mbox.role";
    type Reply = MboxRoleReply;
}

/// Longest `deadline_ms` of `mbox.negotiate`: 30 seconds.
pub const MAX_NEGOTIATE_DEADLINE_MS: u64 = 30_000;

/// Run a contract-net negotiation as `from` (`mbox.negotiate`): a `request` to every
/// candidate, their `offer`s until all answered or the deadline, then `accept` and
/// `delegation` (carrying `work`) to the best (highest confidence, ties to the lowest address)
/// and `info {closed: true}` to the others. The reply comes when the negotiation is decided,
/// so the client's request timeout must exceed `deadline_ms`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MboxNegotiateRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// A run of the tree.
    pub run_id: RunId,
    /// The initiator's address (a task of the plan, or a client's name outside it).
    pub from: String,
    /// Task ids, or `role:<name>` for every task of the tree playing the role (see
    /// [`MboxRoleRequest`]; the initiator itself is left out of a role).
    pub candidates: Vec<String>,
    /// The call for offers (the `request` message's payload).
    #[serde(default)]
    pub request: serde_json::Value,
    /// The work delegated to the winner (the `delegation` message's payload).
    #[serde(default)]
    pub work: serde_json::Value,
    /// How long to collect offers: 1 to 30,000 ms.
    pub deadline_ms: u64,
    /// Ties the negotiation's messages together; absent: a fresh one. Asking again with the
    /// same id finds the offers already made (a client retrying after a lost reply).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<String>,
}

/// One offer a negotiation received.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct NegotiationOffer {
    /// The candidate that offered.
    pub from: String,
    /// Its confidence (higher wins).
    pub confidence: f64,
    /// The whole offer payload.
    pub payload: serde_json::Value,
    /// Stream sequence of the offer.
    pub seq: u64,
}

/// How a negotiation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum NegotiationOutcome {
    /// A winner was chosen and sent the delegation.
    Awarded,
    /// No candidate offered before the deadline; every candidate was told it is closed.
    NoOffers,
}

/// The answer to [`MboxNegotiateRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MboxNegotiateReply {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// `awarded` or `no_offers`.
    pub outcome: NegotiationOutcome,
    /// The negotiation's correlation id.
    pub correlation_id: String,
    /// The candidates asked (roles expanded), sorted.
    pub candidates: Vec<String>,
    /// The winner (`awarded`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub winner: Option<String>,
    /// The winner's confidence (`awarded`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confidence: Option<f64>,
    /// Every valid offer received before the deadline, by candidate.
    pub offers: Vec<NegotiationOffer>,
    /// Stream sequence of the delegation sent to the winner (`awarded`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delegation_seq: Option<u64>,
}

impl ApiRequest for MboxNegotiateRequest {
    const ENDPOINT: &'static str = "mbox.negotiate";
    type Reply = MboxNegotiateReply;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_built_from_a_code_sends_its_string() {
        let e = ApiError::new(404, ErrorCode::NotFound, "run x does not exist");
        assert_eq!(
            serde_json::to_value(&e).expect("encodes"),
            serde_json::json!({"status": 404, "code": "not_found", "message": "run x does not exist"})
        );
        assert_eq!(e.error_code(), Some(ErrorCode::NotFound));
        assert!(e.is(ErrorCode::NotFound));
        assert!(!e.is(ErrorCode::UnknownRun));
    }

    #[test]
    fn an_unknown_code_reads_as_none_and_round_trips_unchanged() {
        for code in [
            "some_future_code",
            "",
            "NOT_FOUND",
            "not found",
            "not_found\n",
        ] {
            let json = serde_json::json!({
                "status": 418,
                "code": code,
                "message": "from a peer of another build",
                "current_revision": 3,
                "rule": "future_rule",
            });
            let e: ApiError = serde_json::from_value(json.clone()).expect("decodes");
            assert_eq!(e.code, code);
            assert_eq!(e.error_code(), None, "{code:?}");
            assert!(ErrorCode::ALL.iter().all(|&c| !e.is(c)), "{code:?}");
            assert_eq!(serde_json::to_value(&e).expect("encodes"), json);
            let packed = rmp_serde::to_vec_named(&e).expect("packs");
            let back: ApiError = rmp_serde::from_slice(&packed).expect("unpacks");
            assert_eq!(back, e);
        }
    }
}
