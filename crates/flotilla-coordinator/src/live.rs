//! Which pools have live workers, kept in memory from a watch on the `<prefix>-workers`
//! bucket, so a submission can be warned (`no_live_worker`) without a read per submission.
//!
//! Workers refresh their entry every heartbeat. Entries of workers that died expire from the
//! bucket by age, which a KV watch does not report, so an entry counts as live only while its
//! last refresh is younger than the bucket's TTL.

use std::collections::BTreeSet;
use std::time::Duration;

use async_nats::jetstream::kv;
use flotilla_bus::mirror::KvMirror;
use flotilla_model::worker::WorkerInfo;
use tokio_util::sync::CancellationToken;

/// Live workers: the workers bucket mirrored in memory.
#[derive(Debug, Clone)]
pub(crate) struct LiveWorkers {
    workers: KvMirror<WorkerInfo>,
    ttl_ms: i64,
}

impl LiveWorkers {
    pub(crate) fn new(ttl: Duration) -> Self {
        Self {
            workers: KvMirror::new(),
            ttl_ms: ttl.as_millis() as i64,
        }
    }

    /// Follows the bucket until `shutdown`; restarts the watch after errors.
    pub(crate) async fn follow(self, store: kv::Store, shutdown: CancellationToken) {
        self.workers.run(store, shutdown).await;
    }

    /// Waits until the registry's entries as of the watch's start are held: only then does
    /// a missing pool mean no live worker.
    pub(crate) async fn synced(&self) {
        self.workers.synced().await;
    }

    /// The pools among `pools` with no live worker, or `None` while that is not known yet.
    pub(crate) fn pools_without_workers<'a>(
        &self,
        pools: impl IntoIterator<Item = &'a str>,
        now_ms: i64,
    ) -> Option<Vec<String>> {
        // Before the watch has delivered the bucket's content, nothing is known and no
        // warning is given.
        if !self.workers.is_synced() {
            return None;
        }
        Some(self.workers.read(|map| {
            let live: BTreeSet<&str> = map
                .values()
                .filter(|w| now_ms - w.at_ms < self.ttl_ms)
                .map(|w| w.value.pool.as_str())
                .collect();
            let missing: BTreeSet<&str> = pools.into_iter().filter(|p| !live.contains(p)).collect();
            missing.into_iter().map(str::to_owned).collect()
        }))
    }

    /// The live workers of `pool` that lack `feature` (their ids and versions): a change
    /// they would ignore must not reach them. Empty while the registry is not known yet.
    pub(crate) fn lacking(&self, pool: &str, feature: &str, now_ms: i64) -> Vec<String> {
        if !self.workers.is_synced() {
            return Vec::new();
        }
        self.workers.read(|map| {
            map.values()
                .filter(|w| now_ms - w.at_ms < self.ttl_ms && w.value.pool == pool)
                .filter(|w| !w.value.features.iter().any(|f| f == feature))
                .map(|w| format!("{} ({})", w.value.id, w.value.version))
                .collect()
        })
    }

    /// For a coordinator whose configuration defines no agents (so plans are not checked
    /// against a catalog): the problems of `tasks` — `(task, pool, agent)` — that the live
    /// workers already show, as `unknown_agent` warnings: an agent no live worker of its pool
    /// runs, or a task naming no agent in a pool whose live workers have no agents at all.
    /// Pools without live workers are `no_live_worker`'s business; nothing while the
    /// registry is not known yet.
    pub(crate) fn unserved_agents<'a>(
        &self,
        tasks: impl IntoIterator<Item = (&'a str, &'a str, Option<&'a str>)>,
        now_ms: i64,
    ) -> Vec<flotilla_model::problem::Problem> {
        use flotilla_model::problem::{Problem, ProblemCode};
        if !self.workers.is_synced() {
            return Vec::new();
        }
        let by_pool: std::collections::BTreeMap<String, BTreeSet<String>> =
            self.workers.read(|map| {
                let mut out: std::collections::BTreeMap<String, BTreeSet<String>> =
                    Default::default();
                for w in map.values().filter(|w| now_ms - w.at_ms < self.ttl_ms) {
                    out.entry(w.value.pool.clone())
                        .or_default()
                        .extend(w.value.agents.iter().cloned());
                }
                out
            });
        let mut problems = Vec::new();
        for (task, pool, agent) in tasks {
            let Some(served) = by_pool.get(pool) else {
                continue;
            };
            let they_run = if served.is_empty() {
                "no agents: its configuration defines none".to_owned()
            } else {
                served.iter().cloned().collect::<Vec<_>>().join(", ")
            };
            match agent {
                Some(a) if !served.contains(a) => problems.push(Problem::new(
                    ProblemCode::UnknownAgent,
                    format!("subtasks.{task}.agent"),
                    format!(
                        "no live worker of pool {pool:?} runs agent {a:?} (they run: {they_run}); the task fails unknown_agent unless one that does starts"
                    ),
                )),
                None if served.is_empty() => problems.push(Problem::new(
                    ProblemCode::UnknownAgent,
                    format!("subtasks.{task}.agent"),
                    format!(
                        "the live workers of pool {pool:?} have no agents (their configuration defines none): the task fails unknown_agent"
                    ),
                )),
                _ => {}
            }
        }
        problems
    }
}
