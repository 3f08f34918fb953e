//! `[worker]` settings.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Worker settings. Workers of one pool share a JetStream consumer, so they should share
/// `heartbeat` (it sets the consumer's ack wait).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct WorkerOptions {
    /// The pool this worker serves.
    pub pool: String,
    /// Agents running at once. An agent waiting for a child run (agent-as-tool) gives its
    /// slot back meanwhile, so children can run in a full pool.
    pub concurrency: usize,
    /// Tasks pulled ahead of free slots: one waits here (kept alive by in-progress acks)
    /// while the slots are busy, so a slot that frees starts its next task without a pull
    /// round trip. `0` pulls only for free slots.
    pub prefetch: usize,
    /// Liveness interval while an agent runs: in-progress acknowledgements go out twice per
    /// interval, and the consumer's ack wait is one and a half intervals, so a dead worker's
    /// task goes to another worker within 1.5 intervals (7.5 s at the default 5 s). The
    /// worker registry entry is refreshed once per interval.
    #[serde(with = "humantime_serde")]
    pub heartbeat: Duration,
    /// Deliveries of one task message before the worker gives up and reports
    /// `redeliveries_exhausted` (workers kept dying on it).
    pub max_deliveries: i64,
    /// On SIGTERM, how long in-flight tasks may run before they are handed back.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// Publish `task_started` only for attempts still running after this long. Quick tasks
    /// need no separate event (their outcome event names the worker and start time); long
    /// ones (model calls) show up live. `0s` announces every attempt.
    #[serde(with = "humantime_serde")]
    pub started_event_delay: Duration,
    /// How long a starting worker waits for its streams and buckets to exist — a coordinator
    /// creates them at start-up, or `flotilla nats provision` — before it gives up and exits.
    /// Workers never create them (least privilege), so a worker started first (every fresh
    /// install on Kubernetes races) waits, not ready, and says what it waits for every few
    /// seconds. `0s` gives up at once.
    #[serde(with = "humantime_serde")]
    pub provision_wait: Duration,
    /// Take teammate turns straight from the teammate inboxes: every worker reads them
    /// through one shared consumer (`worker-inbox` on the mailbox stream), and a message to an
    /// idle teammate of this pool that reaches a worker with a free slot is claimed there, at
    /// once — two hops from the send instead of five through the supervisor. Mail for another
    /// pool's teammate, or reaching a worker with every slot taken, is dispatched to that
    /// pool's turn queue as before. `false`: turns come only from the turn queue.
    pub read_inboxes: bool,
    /// Worker id (default: `<host>-<random>`).
    pub id: Option<String>,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        Self {
            pool: flotilla_model::plan::DEFAULT_POOL.to_owned(),
            // Agents mostly wait on I/O (models, tools); a few at once per process.
            concurrency: 4,
            // One: enough to hide the pull round trip, little to hand back on a stop.
            prefetch: 1,
            heartbeat: Duration::from_secs(5),
            max_deliveries: 5,
            // Kubernetes' default termination grace is 30 s; leave room to hand work back.
            shutdown_grace: Duration::from_secs(25),
            // Below what a person notices; above what a no-op or cached answer takes.
            started_event_delay: Duration::from_millis(200),
            // Long enough for a coordinator's image pull and start on a fresh cluster; then
            // the worker exits with the reason, and its restarts back off.
            provision_wait: Duration::from_secs(300),
            read_inboxes: true,
            id: None,
        }
    }
}

impl WorkerOptions {
    /// Checks the settings without I/O.
    pub fn validate(&self) -> Result<(), String> {
        flotilla_model::token::check_name(&self.pool)
            .map_err(|e| format!("worker.pool {:?} {e}", self.pool))?;
        if self.concurrency == 0 {
            return Err("worker.concurrency must be at least 1".into());
        }
        if self.prefetch > 1024 {
            return Err(format!(
                "worker.prefetch is {}; at most 1024 (tasks held beyond concurrency wait unstarted while other workers may be idle)",
                self.prefetch
            ));
        }
        if self.heartbeat < Duration::from_millis(100) {
            return Err("worker.heartbeat must be at least 100ms".into());
        }
        if self.max_deliveries < 1 {
            return Err("worker.max-deliveries must be at least 1".into());
        }
        if let Some(id) = &self.id {
            flotilla_model::token::check_name(id).map_err(|e| format!("worker.id {id:?} {e}"))?;
        }
        Ok(())
    }

    /// The consumer's ack wait: one and a half heartbeats (three progress acknowledgements).
    pub fn ack_wait(&self) -> Duration {
        self.heartbeat * 3 / 2
    }

    /// How often a running attempt's message gets an in-progress acknowledgement.
    pub fn progress_interval(&self) -> Duration {
        self.heartbeat / 2
    }
}
