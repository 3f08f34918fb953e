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

/// A run with attempts running on this worker.
#[derive(Debug)]
pub(crate) struct RunEntry {
    /// Fires when the run is cancelled.
    pub(crate) cancel: CancellationToken,
    /// Attempts of the run running here.
    pub(crate) attempts: Vec<HeldAttempt>,
}

impl Default for RunEntry {
    fn default() -> Self {
        Self {
            cancel: CancellationToken::new(),
            attempts: Vec::new(),
        }
    }
}

/// One attempt running here, as holds see it.
#[derive(Debug)]
pub(crate) struct HeldAttempt {
    /// Which of the run's attempts here this is.
    pub(crate) id: u64,
    /// Its task, as the token of its control-bucket hold key (`hold.<run>.<task>`).
    pub(crate) task: String,
    /// Whether it is held now — its run, or its task alone (it reads this at each step
    /// boundary).
    pub(crate) hold: tokio::sync::watch::Sender<bool>,
}

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
    /// The runs with attempts running here: their cancellation, the token that fires while
    /// they are held (paused, taken over), and how many attempts are running.
    pub(crate) runs: Mutex<HashMap<RunId, RunEntry>>,
    /// Runs known to be cancelled (from the control bucket).
    pub(crate) cancelled: Mutex<HashSet<RunId>>,
    /// Runs known to be held (from the control bucket).
    pub(crate) held: Mutex<HashSet<RunId>>,
    /// Tasks known to be paused by themselves (from the control bucket): the run and the
    /// task's key token.
    pub(crate) held_tasks: Mutex<HashSet<(RunId, String)>>,
    /// Numbers the attempts registered in [`Shared::runs`].
    pub(crate) next_attempt: std::sync::atomic::AtomicU64,
    pub(crate) metrics: Metrics,
    /// This worker's share of the pool's slot gauges.
    pub(crate) slots: WorkerSlots,
    /// How long this worker's attempts take lately: prefetch only while they are short.
    pub(crate) pace: Pace,
}

impl Shared {
    /// Waits until a side queue of this worker (a role's queue, the teammate turns) may be
    /// pulled: at once while an agent slot is free; while every slot is taken, in line with
    /// what already waits for one here (the slot semaphore is fair) — the slot that comes is
    /// passed on at once to whoever is next, and the queue is pulled for one message, which
    /// then waits for a slot in turn like a prefetched task. Looking at the free count again
    /// instead, until a slot is free, never sees one while a worker is kept busy by short
    /// pool tasks: each slot that frees goes straight to the prefetched task already waiting,
    /// and the side queue starves for as long as the pool has work (a teammate's turn left
    /// pending for minutes on a live worker). `false`: the worker is stopping.
    pub(crate) async fn wait_for_turn(&self, stop: &CancellationToken) -> bool {
        if self.run_slots.available_permits() > 0 {
            return true;
        }
        tokio::select! {
            () = stop.cancelled() => false,
            p = Arc::clone(&self.run_slots).acquire_owned() => p.is_ok(),
        }
    }
}
