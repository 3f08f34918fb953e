//! Cancellation of runs: the attempts running here per run, the cancel notices of the
//! control bucket that cancel them at once, and the runs known cancelled, whose later tasks
//! are answered `cancelled` without running.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use flotilla_model::ids::RunId;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use crate::shared::Shared;

impl Shared {
    /// Registers an attempt of `run`; the token fires when the run is cancelled.
    pub(crate) fn enter_run(&self, run: RunId) -> CancellationToken {
        let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
        let entry = runs
            .entry(run)
            .or_insert_with(|| (CancellationToken::new(), 0));
        entry.1 += 1;
        if self
            .cancelled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&run)
        {
            entry.0.cancel();
        }
        entry.0.clone()
    }

    pub(crate) fn leave_run(&self, run: RunId) {
        let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(entry) = runs.get_mut(&run) {
            entry.1 -= 1;
            if entry.1 == 0 {
                runs.remove(&run);
            }
        }
    }

    /// A cancel notice arrived for `run`.
    pub(crate) fn cancel_run(&self, run: RunId) {
        self.cancelled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(run);
        if let Some((token, n)) = self
            .runs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&run)
        {
            info!(%run, attempts = n, "Run cancelled: cancelling its attempts here");
            token.cancel();
        }
    }

    pub(crate) fn is_cancelled(&self, run: RunId) -> bool {
        self.cancelled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&run)
    }
}

/// Unregisters an attempt from its run's cancellation when the attempt ends.
pub(crate) struct LeaveRun<'a>(pub(crate) &'a Shared, pub(crate) RunId);

impl Drop for LeaveRun<'_> {
    fn drop(&mut self) {
        self.0.leave_run(self.1);
    }
}

/// Follows cancel notices in the control bucket (`cancel.<run>`), from the current ones on.
pub(crate) async fn watch_cancellations(
    kv: jetstream::kv::Store,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        let watch = match kv.watch_with_history("cancel.*").await {
            Ok(w) => w,
            Err(e) => {
                debug!(error = %e, "Cannot watch cancel notices; retrying");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                }
            }
        };
        let watch = watch.take_until(stop.cancelled());
        futures::pin_mut!(watch);
        while let Some(entry) = watch.next().await {
            let Ok(entry) = entry else { break };
            if entry.operation != jetstream::kv::Operation::Put {
                continue;
            }
            if let Some(run) = entry
                .key
                .strip_prefix("cancel.")
                .and_then(|r| r.parse::<RunId>().ok())
            {
                shared.cancel_run(run);
            }
        }
    }
}
