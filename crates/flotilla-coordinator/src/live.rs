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
}
