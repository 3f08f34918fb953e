//! The live registry: this worker's entry in the workers bucket, refreshed every heartbeat
//! with the attempts it is running.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_nats::jetstream;
use flotilla_model::worker::WorkerInfo;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::shared::Shared;

/// Keeps the registry entry fresh until stopped.
pub(crate) async fn register(
    kv: jetstream::kv::Store,
    mut info: WorkerInfo,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(shared.opts.heartbeat);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        info.in_flight = shared.in_flight.load(Ordering::Relaxed);
        match serde_json::to_vec(&info) {
            Ok(bytes) => {
                if let Err(e) = kv.put(&info.id, bytes.into()).await {
                    debug!(error = %e, "Could not refresh the worker registration");
                }
            }
            Err(e) => debug!(error = %e, "Could not encode the worker registration"),
        }
    }
}

/// Counts an attempt as running while alive (the registry's `in_flight`).
pub(crate) struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    pub(crate) fn enter(counter: Arc<AtomicUsize>) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        Self(counter)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
