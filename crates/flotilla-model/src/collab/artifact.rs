//! References to large payloads kept in the JetStream object store.
//!
//! NATS messages are bounded by the server's max payload (1 MiB by default). Anything larger —
//! a long final result, a file an agent produced — goes to the object store bucket
//! `<prefix>-artifacts`, and messages carry an [`ArtifactRef`] instead.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Where a large payload is stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ArtifactRef {
    /// Object store bucket (`flotilla-artifacts`).
    pub bucket: String,
    /// Object name within the bucket.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// SHA-256 of the content, lower-case hex.
    pub sha256: String,
}
