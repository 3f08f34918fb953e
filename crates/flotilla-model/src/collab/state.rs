//! Session state: small JSON values shared by the runs of a session
//! (KV bucket `<prefix>-state`, key `<session>.<key>`).
//!
//! The session is the run's `session_id`, else its root run's id. A subtask's `output_key`
//! writes its final response there when it succeeds, and `{key}` placeholders in a
//! description are filled from it at dispatch.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::time::Timestamp;

/// Largest state value (encoded JSON), in bytes.
pub const MAX_VALUE_BYTES: usize = 256 * 1024;

/// Longest state key.
pub const MAX_KEY_LEN: usize = 128;

/// A stored value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct StateValue {
    /// The key (without the session).
    pub key: String,
    /// The value.
    pub value: serde_json::Value,
    /// KV revision: pass it as `expected_revision` to compare-and-set.
    pub revision: u64,
    /// Server time of the write.
    pub ts: Timestamp,
}
