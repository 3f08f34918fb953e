//! The request/reply API (NATS micro service, subjects `<prefix>.api.<endpoint>`).
//!
//! Each request type names its endpoint and its reply type, so a client cannot send a request
//! to the wrong subject or decode the wrong reply.

use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::ids::RunId;
use crate::run::RunView;
use crate::submit::{SubmitReply, SubmitRequest};

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

/// Read one run with its tasks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GetRunRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
}

impl ApiRequest for GetRunRequest {
    const ENDPOINT: &'static str = "run.get";
    type Reply = RunView;
}

/// An error answer of the API, sent with the micro-service error headers
/// (`Nats-Service-Error`, `Nats-Service-Error-Code`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ApiError {
    /// HTTP-like status: 400 bad request, 404 not found, 500 internal.
    pub status: u16,
    /// Stable code (`malformed`, `not_found`, `internal`).
    pub code: String,
    /// Human-readable detail.
    pub message: String,
}
