//! Workspace topics: the shared, append-only data of a run tree
//! (`<prefix>.ws.<root-run>.<topic>`, stream `<PREFIX>_WORKSPACE`).
//!
//! A message on a topic's subject carries a [`WorkspaceWrite`]: the entry (a JSON object) and
//! who wrote it. The entry's `seq` is the stream sequence — one increasing number across all
//! topics of all runs — and its `ts` is the server's timestamp, so readers resume with
//! `since_seq` and never depend on a writer's clock. Reads return [`WorkspaceEntry`]s, paged
//! by [`WorkspacePage`].

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::{RunId, TaskId};
use crate::time::Timestamp;

/// Largest workspace entry (the encoded [`WorkspaceWrite`]), in bytes. Larger payloads go to
/// the artifact store with a reference entry.
pub const MAX_ENTRY_BYTES: usize = 1024 * 1024;

/// Entries returned by one read when the reader names no limit.
pub const DEFAULT_READ_LIMIT: usize = 200;

/// Most entries returned by one read.
pub const MAX_READ_LIMIT: usize = 1000;

/// Header on automatic-produce entries (the coordinator's): `Flotilla-Produced-By: <task>`.
/// The coordinator already knows such a topic has an entry, so its workspace watcher skips
/// them.
pub const PRODUCED_BY_HEADER: &str = "Flotilla-Produced-By";

/// Who wrote a workspace entry or sent a mailbox message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Writer {
    /// The run the writer works for.
    pub run_id: RunId,
    /// The task, when an agent (or the coordinator on a task's behalf) wrote it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<TaskId>,
    /// The attempt of that task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    /// Who else: `coordinator` (automatic produce), `operator` (the CLI outside a task), or a
    /// client's own name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
}

/// The body of a workspace message, as published.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WorkspaceWrite {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The data: a JSON object.
    pub entry: serde_json::Map<String, serde_json::Value>,
    /// Who wrote it (absent when a plain client did not say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writer: Option<Writer>,
}

/// One entry of a workspace topic, as read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WorkspaceEntry {
    /// The stream sequence: one increasing number across all topics.
    pub seq: u64,
    /// The (normalised) topic.
    pub topic: String,
    /// The data.
    pub entry: serde_json::Map<String, serde_json::Value>,
    /// Who wrote it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writer: Option<Writer>,
    /// Server time of the write.
    pub ts: Timestamp,
}

/// One page of an incremental read: the entries with `seq > since_seq`, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WorkspacePage {
    /// The entries.
    pub entries: Vec<WorkspaceEntry>,
    /// Pass this as `since_seq` to continue after this page.
    pub next_since_seq: u64,
    /// Whether more entries were already stored when this page was read.
    pub more: bool,
    /// Messages on the subjects read that are not workspace writes (a malformed raw publish);
    /// they were skipped, and the cursor moved past them.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub skipped: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The entries of a task's consumed topics present when it was dispatched, carried in its
/// envelope (`consumed`, by topic).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ConsumedTopic {
    /// Entries in order, oldest first, within the coordinator's byte budget.
    pub entries: Vec<WorkspaceEntry>,
    /// Read on from here (`since_seq`) for the entries that did not fit or came later.
    pub next_since_seq: u64,
    /// Whether entries present at dispatch were left out for the budget.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

/// Consumed topics of an envelope, by topic.
pub type ConsumedTopics = BTreeMap<String, ConsumedTopic>;

/// The entry the coordinator appends to each topic a task `produces` when the task
/// succeeds ("automatic produce"): `{subtask_id, summary, numeric_value}`.
pub fn produced_entry(
    task: &TaskId,
    response: &str,
    numeric_value: Option<f64>,
) -> serde_json::Map<String, serde_json::Value> {
    let mut m = serde_json::Map::new();
    m.insert("subtask_id".into(), serde_json::Value::from(task.as_str()));
    m.insert("summary".into(), serde_json::Value::from(response));
    m.insert(
        "numeric_value".into(),
        numeric_value.map_or(serde_json::Value::Null, serde_json::Value::from),
    );
    m
}
