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
    /// Registers an attempt of `run`: the token that fires when the run is cancelled, and
    /// whether it is held (now and as it changes).
    pub(crate) fn enter_run(
        &self,
        run: RunId,
    ) -> (CancellationToken, tokio::sync::watch::Receiver<bool>) {
        let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
        let entry = runs.entry(run).or_default();
        entry.attempts += 1;
        if self
            .cancelled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&run)
        {
            entry.cancel.cancel();
        }
        if self
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&run)
        {
            entry.hold.send_replace(true);
        }
        (entry.cancel.clone(), entry.hold.subscribe())
    }

    pub(crate) fn leave_run(&self, run: RunId) {
        let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(entry) = runs.get_mut(&run) {
            entry.attempts -= 1;
            if entry.attempts == 0 {
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
        if let Some(entry) = self
            .runs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&run)
        {
            info!(%run, attempts = entry.attempts, "Run cancelled: cancelling its attempts here");
            entry.cancel.cancel();
        }
    }

    /// `run` is held (`true`: its LLM attempts here stop at their next step boundary) or
    /// released (they run on, also those running now).
    pub(crate) fn hold_run(&self, run: RunId, held: bool) {
        let mut set = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let changed = if held {
            set.insert(run)
        } else {
            set.remove(&run)
        };
        drop(set);
        let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(entry) = runs.get_mut(&run) {
            if held && changed {
                info!(%run, attempts = entry.attempts, "Run held: its LLM attempts here stop at their next step");
            }
            entry.hold.send_replace(held);
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

/// Follows the control bucket, from the current entries on: cancel notices (`cancel.<run>`)
/// and holds (`hold.<run>`, present while the run is paused or taken over).
pub(crate) async fn watch_cancellations(
    kv: jetstream::kv::Store,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        let watch = match kv.watch_with_history(">").await {
            Ok(w) => w,
            Err(e) => {
                debug!(error = %e, "Cannot watch the control bucket; retrying");
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
            let put = entry.operation == jetstream::kv::Operation::Put;
            if let Some(run) = entry
                .key
                .strip_prefix("cancel.")
                .and_then(|r| r.parse::<RunId>().ok())
            {
                if put {
                    shared.cancel_run(run);
                }
            } else if let Some(run) = entry
                .key
                .strip_prefix("hold.")
                .and_then(|r| r.parse::<RunId>().ok())
            {
                shared.hold_run(run, put);
            }
        }
    }
}
