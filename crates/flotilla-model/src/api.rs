//! The request/reply API (NATS micro service, subjects `<prefix>.api.<endpoint>`).
//!
//! Each request type names its endpoint and its reply type, so a client cannot send a request
//! to the wrong subject or decode the wrong reply.

use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::ids::RunId;
use crate::plan::Plan;
use crate::run::{RunStatus, RunView};
use crate::submit::{SubmitReply, SubmitRequest};
use crate::validate::Problem;

/// A request of the API.
pub trait ApiRequest: Serialize + DeserializeOwned {
    /// Endpoint name; the subject is `<prefix>.api.<ENDPOINT>`.
    const ENDPOINT: &'static str;
    /// What the endpoint answers.
    type Reply: Serialize + DeserializeOwned;
}

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
    /// Most tasks to include (default and maximum 1000).
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
    /// HTTP-like status: 400 bad request, 404 not found, 413 reply too large, 500 internal,
    /// 503 unavailable.
    pub status: u16,
    /// Stable code (`malformed`, `not_found`, `internal`).
    pub code: String,
    /// Human-readable detail.
    pub message: String,
}
