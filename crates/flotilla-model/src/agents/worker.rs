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
}
