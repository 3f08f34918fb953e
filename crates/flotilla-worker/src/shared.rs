//! State shared by a worker's tasks: its connection, settings and agents, its agent slots, the
//! runs with attempts here and those known cancelled, and the pace of its attempts.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};

use flotilla_bus::Bus;
use flotilla_model::ids::RunId;
use flotilla_telemetry::Metrics;
use flotilla_telemetry::metrics::WorkerSlots;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::agents::AgentRegistry;
use crate::options::WorkerOptions;
use crate::pace::Pace;

/// State shared by a worker's tasks.
pub(crate) struct Shared {
    pub(crate) bus: Bus,
    pub(crate) opts: WorkerOptions,
    pub(crate) agents: Arc<AgentRegistry>,
    pub(crate) id: String,
    pub(crate) in_flight: Arc<AtomicUsize>,
    /// Agents running at once (`concurrency`).
    pub(crate) run_slots: Arc<Semaphore>,
    /// Fires when the grace period is over: running agents are cancelled and handed back.
    pub(crate) hard_stop: CancellationToken,
    /// Cancellation of the runs with attempts running here, with how many are running.
    pub(crate) runs: Mutex<HashMap<RunId, (CancellationToken, usize)>>,
    /// Runs known to be cancelled (from the control bucket).
    pub(crate) cancelled: Mutex<HashSet<RunId>>,
    pub(crate) metrics: Metrics,
    /// This worker's share of the pool's slot gauges.
    pub(crate) slots: WorkerSlots,
    /// How long this worker's attempts take lately: prefetch only while they are short.
    pub(crate) pace: Pace,
}
