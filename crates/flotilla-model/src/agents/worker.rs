//! The live worker registry: one entry per running worker in the `<prefix>-workers` KV bucket
//! (key = worker id, value = [`WorkerInfo`] as JSON).
//!
//! Workers refresh their entry every heartbeat; the bucket's TTL (`jetstream.worker-ttl`)
//! removes the entry of a worker that died without deregistering. The KV entry's own
//! timestamp is the time of the last refresh, so any client can tell how fresh an entry is
//! (`flotilla workers` shows it as LAST SEEN).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::time::Timestamp;

/// A worker's registry entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WorkerInfo {
    /// Worker id (also the KV key).
    pub id: String,
    /// The pool it serves.
    pub pool: String,
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// Task slots.
    pub concurrency: usize,
    /// Attempts running at the last refresh.
    pub in_flight: usize,
    /// Agents it can run.
    pub agents: Vec<String>,
    /// When it started (worker clock).
    pub started_at: Timestamp,
    /// Flotilla version.
    pub version: String,
    /// What the worker carries out of a task message beyond the first protocol version
    /// ([`FEATURE_TASK_MODEL`], [`FEATURE_KEPT_STEPS`]): a coordinator refuses a change a
    /// live worker of the pool would silently ignore. Absent from workers older than 0.3.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub features: Vec<String>,
}

/// A worker that runs an LLM task with the model its `model` names.
pub const FEATURE_TASK_MODEL: &str = "task_model";
/// A worker that starts an attempt with its `kept_steps` (a fork at a step).
pub const FEATURE_KEPT_STEPS: &str = "kept_steps";
/// A worker that takes teammate turns straight from the teammate inboxes (its
/// `read-inboxes`, on by default): while one is live, the supervisors leave the wake to the
/// workers and only look after mail still unread a few seconds later.
pub const FEATURE_READS_INBOXES: &str = "reads_inboxes";
/// What this version's workers carry out: their [`WorkerInfo::features`] (and
/// [`FEATURE_READS_INBOXES`] when they read the inboxes).
pub const WORKER_FEATURES: &[&str] = &[FEATURE_TASK_MODEL, FEATURE_KEPT_STEPS];
