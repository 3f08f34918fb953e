//! A KV bucket kept in memory from a watch, for values read on every request or event (the
//! worker registry, the supervisor's roster and failure records): read here, not from the
//! server. Writes still go to the server; the mirror follows them a moment later
//! ([`KvMirror::note`] records a process's own write at once).
//!
//! The watch starts with the bucket's history — the last value of every key — and then
//! follows new writes, so a process started on a lived-in deployment holds what was written
//! before it started. The mirror is *synced* once that history is delivered (or the bucket is
//! found empty): being ready never waits for a write, which only this process might make.
//!
//! Entries that expire by age (the registry's TTL) leave no trace a watch reports: readers
//! judge freshness by [`Mirrored::at_ms`], the server time of the last write.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt;
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// One mirrored value.
#[derive(Debug, Clone)]
pub struct Mirrored<T> {
    /// The value.
    pub value: T,
    /// When it was written (server time, Unix ms).
    pub at_ms: i64,
    /// Its revision in the bucket: a value is replaced only by a later revision, so a
    /// process's [`KvMirror::note`] of its own write that comes after the watch delivered a
    /// later one does not put the older value back.
    pub revision: u64,
}

/// The live content of one bucket.
#[derive(Debug)]
pub struct KvMirror<T> {
    entries: Arc<RwLock<HashMap<String, Mirrored<T>>>>,
    synced: watch::Sender<bool>,
}

impl<T> Clone for KvMirror<T> {
    fn clone(&self) -> Self {
        Self {
            entries: Arc::clone(&self.entries),
            synced: self.synced.clone(),
        }
    }
}

/// Unix ms of a server timestamp.
pub fn unix_ms(t: time::OffsetDateTime) -> i64 {
    i64::try_from(t.unix_timestamp_nanos() / 1_000_000).unwrap_or(i64::MAX)
}

impl<T: DeserializeOwned + Clone + Send + Sync + 'static> Default for KvMirror<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// Every key of a bucket (a KV key wildcard).
const ALL_KEYS: &str = ">";

/// How often a mirror whose history has not arrived yet looks whether the bucket holds
/// anything it could deliver.
const EMPTY_LOOK: Duration = Duration::from_millis(250);

/// Whether `store` holds no message under `filter` (a key wildcard): its history delivers
/// nothing. A failed look says "not known", never "empty".
async fn nothing_matches(store: &kv::Store, filter: &str) -> bool {
    if filter == ALL_KEYS {
        // Asked now: the store's own info (`status`) is as of when it was opened, and a
        // store opened before its bucket filled would say "empty" for ever.
        return store
            .stream
            .get_info()
            .await
            .is_ok_and(|i| i.state.messages == 0);
    }
    match store
        .stream
        .info_with_subjects(format!("{}{filter}", store.prefix))
        .await
    {
        Ok(mut subjects) => subjects.next().await.is_none(),
        Err(_) => false,
    }
}

impl<T: DeserializeOwned + Clone + Send + Sync + 'static> KvMirror<T> {
    /// An empty mirror, not in sync until [`KvMirror::run`] has read the bucket.
    pub fn new() -> Self {
        Self {
            entries: Arc::default(),
            synced: watch::Sender::new(false),
        }
    }

    /// Follows `store` in a task of its own until `shutdown`.
    pub fn follow(&self, store: kv::Store, shutdown: CancellationToken) {
        let this = self.clone();
        tokio::spawn(async move { this.run(store, shutdown).await });
    }

    /// Follows the keys of `store` matching `filter` (KV key wildcards: `agent.>`) in a task
    /// of its own until `shutdown`: a bucket holding several kinds of values mirrors each
    /// kind apart.
    pub fn follow_keys(&self, store: kv::Store, filter: &str, shutdown: CancellationToken) {
        let this = self.clone();
        let filter = filter.to_owned();
        tokio::spawn(async move { this.run_filtered(store, Some(filter), shutdown).await });
    }

    /// Follows `store` until `shutdown`, restarting the watch after errors.
    pub async fn run(self, store: kv::Store, shutdown: CancellationToken) {
        self.run_filtered(store, None, shutdown).await
    }

    async fn run_filtered(
        self,
        store: kv::Store,
        filter: Option<String>,
        shutdown: CancellationToken,
    ) {
        let filter = filter.unwrap_or_else(|| ALL_KEYS.to_owned());
        while !shutdown.is_cancelled() {
            // History first (the last value of every key), then new writes.
            let watch = store.watch_with_history(&filter).await;
            let watch = match watch {
                Ok(w) => w,
                Err(e) => {
                    debug!(error = %e, "Cannot watch a bucket; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    }
                }
            };
            let watch = watch.take_until(shutdown.cancelled());
            futures::pin_mut!(watch);
            // Until the history is delivered, the bucket is looked at again now and then: one
            // with nothing matching delivers nothing (nor does one whose only values expired
            // by age before they were delivered), and is in sync as it is.
            let mut look = tokio::time::interval(EMPTY_LOOK);
            loop {
                let entry = tokio::select! {
                    entry = watch.next() => entry,
                    _ = look.tick(), if !self.is_synced() => {
                        if nothing_matches(&store, &filter).await {
                            self.synced.send_replace(true);
                        }
                        continue;
                    }
                };
                let Some(Ok(entry)) = entry else { break };
                // In sync once the history's last entry is in the map, not before: a reader
                // woken by `synced` reads every value written before the watch started. The
                // entry says nothing follows it (`delta`, the consumer's pending count when it
                // was delivered); `seen_current` does not say that: it also holds when the
                // server had pushed the whole history before answering the watch's creation,
                // while those entries still wait here to be read.
                let caught_up = entry.delta == 0;
                self.apply(entry);
                if caught_up {
                    self.synced.send_replace(true);
                }
            }
        }
    }

    /// One watched entry into the map.
    fn apply(&self, entry: kv::Entry) {
        let mut map = self.entries.write().unwrap_or_else(|p| p.into_inner());
        // A noted write may be ahead of the watch: older revisions change nothing.
        if map
            .get(&entry.key)
            .is_some_and(|m| m.revision > entry.revision)
        {
            return;
        }
        match entry.operation {
            kv::Operation::Put => match serde_json::from_slice::<T>(&entry.value) {
                Ok(value) => {
                    map.insert(
                        entry.key,
                        Mirrored {
                            value,
                            at_ms: unix_ms(entry.created),
                            revision: entry.revision,
                        },
                    );
                }
                Err(e) => {
                    warn!(bucket = %entry.bucket, key = %entry.key, error = %e, "Ignoring an unreadable value");
                }
            },
            kv::Operation::Delete | kv::Operation::Purge => {
                map.remove(&entry.key);
            }
        }
    }

    /// Whether the mirror holds the bucket's content as of its start — every value written
    /// before it started watching — (before that, an empty mirror says nothing about the
    /// bucket).
    pub fn is_synced(&self) -> bool {
        *self.synced.borrow()
    }

    /// Waits until the mirror holds the bucket's content as of its start.
    pub async fn synced(&self) {
        let mut rx = self.synced.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// Reads the entries in place (nothing is cloned), by key.
    pub fn read<R>(&self, f: impl FnOnce(&HashMap<String, Mirrored<T>>) -> R) -> R {
        f(&self.entries.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// One value.
    pub fn get(&self, key: &str) -> Option<Mirrored<T>> {
        self.entries
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
            .cloned()
    }

    /// Every value, by key.
    pub fn all(&self) -> Vec<(String, Mirrored<T>)> {
        let map = self.entries.read().unwrap_or_else(|p| p.into_inner());
        let mut all: Vec<(String, Mirrored<T>)> =
            map.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// The values for which `pred` holds, by key; only those are cloned.
    pub fn matching(&self, pred: impl Fn(&T) -> bool) -> Vec<(String, T)> {
        let map = self.entries.read().unwrap_or_else(|p| p.into_inner());
        let mut found: Vec<(String, T)> = map
            .iter()
            .filter(|(_, v)| pred(&v.value))
            .map(|(k, v)| (k.clone(), v.value.clone()))
            .collect();
        found.sort_by(|a, b| a.0.cmp(&b.0));
        found
    }

    /// Records a value this process just wrote at `revision`, so its next read sees it
    /// before the watch delivers it. A later revision already mirrored (the watch delivered
    /// another writer's change first: this process was slow to note its own) is kept.
    pub fn note(&self, key: &str, value: T, at_ms: i64, revision: u64) {
        let mut map = self.entries.write().unwrap_or_else(|p| p.into_inner());
        if map.get(key).is_some_and(|m| m.revision >= revision) {
            return;
        }
        map.insert(
            key.to_owned(),
            Mirrored {
                value,
                at_ms,
                revision,
            },
        );
    }
}
