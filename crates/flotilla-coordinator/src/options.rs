//! `[coordinator]` settings.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Coordinator settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct CoordinatorOptions {
    /// Parallel lanes of run processing; a run always stays in one lane, so its inputs are
    /// applied in order within a coordinator.
    pub shards: usize,
    /// Most run-log messages taken in one batch.
    pub batch: usize,
    /// Most runs whose state is cached in memory (finished runs are dropped at once; the
    /// least recently used beyond this).
    pub cache_runs: usize,
    /// A cached run no input has touched for this long is dropped: a run that waits (for a
    /// person, a long task) costs no memory, and one another coordinator finished — the
    /// shared run-log consumer gives a run's inputs to any coordinator — is not kept until
    /// the cache is full. Its next input reads it back from its record.
    #[serde(with = "humantime_serde")]
    pub cache_idle: Duration,
    /// How long a delivered run-log or intake message may stay unacknowledged before
    /// JetStream gives it to another coordinator: the failover time after a crash.
    #[serde(with = "humantime_serde")]
    pub ack_wait: Duration,
    /// Submissions validated at once.
    pub intake_concurrency: usize,
    /// Serve the request/reply API (`<prefix>.api.*`).
    pub api: bool,
    /// Byte budget of `previous_results` in a task envelope beyond the direct dependencies'
    /// results; the nearest ancestors are kept.
    pub previous_results_budget: usize,
    /// Byte budget of the consumed topics' entries carried in a task envelope (oldest first;
    /// the agent reads on from each topic's cursor).
    pub consumed_budget: usize,
    /// Bytes of a run's final result carried inline in its outcome (record, terminal event,
    /// reply); a larger final result is stored whole as an artifact and referenced.
    pub final_result_budget: usize,
    /// Longest a run's start stays unrecorded: its record and start events are written with
    /// its next step (one write for a quick run), or after this delay. Must stay well under
    /// the ack wait and JetStream's duplicate window.
    #[serde(with = "humantime_serde")]
    pub start_flush_delay: Duration,
    /// Deepest a child run may sit below its root (the root is at depth 0): agents calling
    /// agents, transfers and workflow steps past it are refused with `tree_too_deep`.
    pub max_depth: u32,
    /// Most runs one run tree may hold, its root included; further child runs are refused
    /// with `tree_too_large`.
    pub max_runs_per_tree: u32,
    /// How long a starting coordinator waits out JetStream answering nothing or "no leader
    /// for now" (a cluster node restarting, a leader election) while it provisions and opens
    /// its streams, buckets and consumers, before it gives up and exits. An error that will
    /// not pass (refused permissions, incompatible resources) stops it at once. `0s` gives up
    /// at the first failure.
    #[serde(with = "humantime_serde")]
    pub startup_wait: Duration,
    /// `[coordinator.planner]`: the agent that plans bare queries (`submit --query`).
    pub planner: crate::planner::PlannerOptions,
    /// `[coordinator.memory]`: bare queries reuse or learn from past runs' plans.
    pub memory: crate::memory::MemoryOptions,
    /// The deployment's escalation policy (the top-level `[hitl]` section, set by the
    /// binary): which tasks wait for a person.
    #[serde(skip)]
    pub hitl: flotilla_machine::policy::HitlConfig,
}

impl Default for CoordinatorOptions {
    fn default() -> Self {
        Self {
            // Enough lanes to keep two cores busy while each waits on JetStream round trips.
            shards: 16,
            batch: 256,
            cache_runs: 20_000,
            // Longer than the gaps between a busy run's steps; a wait for a person or a
            // finish elsewhere is let go within a minute.
            cache_idle: Duration::from_secs(60),
            // A crashed coordinator's in-flight inputs move to a survivor within this time.
            ack_wait: Duration::from_secs(10),
            intake_concurrency: 64,
            api: true,
            // Keeps envelopes well under the 1 MiB default NATS payload limit.
            previous_results_budget: 256 * 1024,
            // With the previous results, well under the 1 MiB default payload.
            consumed_budget: 256 * 1024,
            // A quarter of the default 1 MiB max payload: the outcome shares its messages
            // with the run state and event envelope.
            final_result_budget: 256 * 1024,
            // Longer than a quick task, short enough that `run_started` is seen promptly.
            start_flush_delay: Duration::from_millis(250),
            // Deep enough for a coordinator, its specialists and their tools; a transfer loop
            // between peers is stopped long before it exhausts anything.
            max_depth: 8,
            // A research team with a few dozen tool calls; a runaway tree stops here.
            max_runs_per_tree: 100,
            // As long as a worker waits for its streams (`worker.provision-wait`): far beyond
            // an election's seconds, short enough that a broken cluster is reported.
            startup_wait: Duration::from_secs(300),
            // No planner: bare queries are rejected until one is configured.
            planner: crate::planner::PlannerOptions::default(),
            memory: crate::memory::MemoryOptions::default(),
            hitl: flotilla_machine::policy::HitlConfig::default(),
        }
    }
}

impl CoordinatorOptions {
    /// Checks the settings without I/O.
    pub fn validate(&self) -> Result<(), String> {
        if self.shards == 0
            || self.batch == 0
            || self.intake_concurrency == 0
            || self.cache_runs == 0
        {
            return Err(
                "coordinator.shards, batch, cache-runs and intake-concurrency must be at least 1"
                    .into(),
            );
        }
        if self.cache_idle < Duration::from_secs(1) {
            return Err("coordinator.cache-idle must be at least 1s".into());
        }
        if self.final_result_budget < 1024 {
            return Err("coordinator.final-result-budget must be at least 1024 bytes".into());
        }
        if self.ack_wait < Duration::from_secs(1) {
            return Err("coordinator.ack-wait must be at least 1s".into());
        }
        if self.start_flush_delay * 4 > self.ack_wait {
            return Err(
                "coordinator.start-flush-delay must be at most a quarter of coordinator.ack-wait"
                    .into(),
            );
        }
        if self.max_depth == 0 || self.max_runs_per_tree < 2 {
            return Err(
                "coordinator.max-depth must be at least 1 and coordinator.max-runs-per-tree at least 2 (a root and one child)"
                    .into(),
            );
        }
        self.planner.validate()?;
        self.memory.validate()?;
        Ok(())
    }
}
