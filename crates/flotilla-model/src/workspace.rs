//! Shared workspace entries (`<prefix>.ws.<run>.<topic>`).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::{RunId, TaskId};
use crate::time::Timestamp;

/// Largest workspace entry, in bytes.
pub const MAX_ENTRY_BYTES: usize = 1024 * 1024;

/// Default number of entries returned by one incremental read.
pub const DEFAULT_READ_LIMIT: usize = 200;

/// One entry of a workspace topic. `seq` is the workspace stream's sequence number: one global
/// increasing counter, so readers resume with `since_seq`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WorkspaceEntry {
    /// Global sequence (stream sequence).
    pub seq: u64,
    /// The run.
    pub run_id: RunId,
    /// Normalised topic.
    pub topic: String,
    /// The data.
    pub entry: serde_json::Value,
    /// The task that wrote it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub producer: Option<TaskId>,
    /// Server time of the write.
    pub ts: Timestamp,
}
