//! Which pools have live workers, kept in memory from a watch on the `<prefix>-workers`
//! bucket, so a submission can be warned (`no_live_worker`) without a read per submission.
//!
//! Workers refresh their entry every heartbeat. Entries of workers that died expire from the
//! bucket by age, which a KV watch does not report, so an entry counts as live only while its
//! last refresh is younger than the bucket's TTL.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::kv;
use flotilla_model::worker::WorkerInfo;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::store::unix_ms;

/// Live workers by id: (pool, last refresh in Unix ms).
#[derive(Debug, Clone, Default)]
pub(crate) struct LiveWorkers {
    inner: Arc<Mutex<HashMap<String, (String, i64)>>>,
    /// Whether the watch has delivered the bucket's current content: before that, nothing is
    /// known and no warning is given.
    synced: Arc<std::sync::atomic::AtomicBool>,
    ttl_ms: i64,
}

impl LiveWorkers {
    pub(crate) fn new(ttl: Duration) -> Self {
        Self {
            ttl_ms: ttl.as_millis() as i64,
            ..Self::default()
        }
    }

    /// Follows the bucket until `shutdown`; restarts the watch after errors.
    pub(crate) async fn follow(self, store: kv::Store, shutdown: CancellationToken) {
        while !shutdown.is_cancelled() {
            let watch = match store.watch_with_history(">").await {
                Ok(w) => w,
                Err(e) => {
                    debug!(error = %e, "Cannot watch the workers bucket; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    }
                }
            };
            // An empty bucket delivers nothing: call it synced right away.
            if store.status().await.is_ok_and(|s| s.values() == 0) {
                self.synced
                    .store(true, std::sync::atomic::Ordering::Relaxed);
            }
            let watch = watch.take_until(shutdown.cancelled());
            futures::pin_mut!(watch);
            while let Some(entry) = watch.next().await {
                let Ok(entry) = entry else { break };
                if entry.delta == 0 || entry.seen_current {
                    self.synced
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                }
                let mut map = self.inner.lock().unwrap_or_else(|p| p.into_inner());
                match entry.operation {
                    kv::Operation::Put => {
                        if let Ok(info) = serde_json::from_slice::<WorkerInfo>(&entry.value) {
                            map.insert(entry.key, (info.pool, unix_ms(entry.created)));
                        }
                    }
                    kv::Operation::Delete | kv::Operation::Purge => {
                        map.remove(&entry.key);
                    }
                }
            }
        }
    }

    /// The pools among `pools` with no live worker, or `None` while that is not known yet.
    pub(crate) fn pools_without_workers<'a>(
        &self,
        pools: impl IntoIterator<Item = &'a str>,
        now_ms: i64,
    ) -> Option<Vec<String>> {
        if !self.synced.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        let map = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let live: BTreeSet<&str> = map
            .values()
            .filter(|(_, seen)| now_ms - seen < self.ttl_ms)
            .map(|(pool, _)| pool.as_str())
            .collect();
        let missing: BTreeSet<&str> = pools.into_iter().filter(|p| !live.contains(p)).collect();
        Some(missing.into_iter().map(str::to_owned).collect())
    }
}
