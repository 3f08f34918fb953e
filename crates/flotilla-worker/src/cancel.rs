//! Cancellation and holds of runs: the attempts running here per run, the cancel notices of
//! the control bucket that cancel them at once, the runs known cancelled, whose later tasks
//! are answered `cancelled` without running, and the holds — of a run (`hold.<run>`) or of one
//! task alone (`hold.<run>.<task>`) — that stop their LLM attempts at the next step.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::subjects::kv_key_token;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use crate::shared::{HeldAttempt, Shared};

impl Shared {
    /// Registers an attempt of `run`'s task `task`: the token that fires when the run is
    /// cancelled, whether it is held — its run or its task alone — now and as it changes, and
    /// the attempt's registration (for [`LeaveRun`]).
    pub(crate) fn enter_run(
        &self,
        run: RunId,
        task: &TaskId,
    ) -> (CancellationToken, tokio::sync::watch::Receiver<bool>, u64) {
        let id = self
            .next_attempt
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let task = kv_key_token(task.as_str());
        let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
        let held = self.is_held(run, &task);
        let entry = runs.entry(run).or_default();
        if self
            .cancelled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&run)
        {
            entry.cancel.cancel();
        }
        let hold = tokio::sync::watch::Sender::new(held);
        let receiver = hold.subscribe();
        entry.attempts.push(HeldAttempt { id, task, hold });
        (entry.cancel.clone(), receiver, id)
    }

    pub(crate) fn leave_run(&self, run: RunId, id: u64) {
        let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(entry) = runs.get_mut(&run) {
            entry.attempts.retain(|a| a.id != id);
            if entry.attempts.is_empty() {
                runs.remove(&run);
            }
        }
    }

    /// Whether an attempt of `run`'s task (its key token) is held: its run, or the task.
    fn is_held(&self, run: RunId, task: &str) -> bool {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&run)
            || self
                .held_tasks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(&(run, task.to_owned()))
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
            info!(%run, attempts = entry.attempts.len(), "Run cancelled: cancelling its attempts here");
            entry.cancel.cancel();
        }
        // Its tasks' own holds end with it.
        self.held_tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(r, _)| *r != run);
    }

    /// `run` is held (`true`: its LLM attempts here stop at their next step boundary) or
    /// released (they run on, also those running now, unless their task is paused).
    pub(crate) fn hold_run(&self, run: RunId, held: bool) {
        let newly = mark(&self.held, run, held);
        self.tell_attempts(run, None, newly);
    }

    /// Task `task` (its key token) of `run` is paused by itself (`true`: its LLM attempt
    /// here stops at its next step boundary) or no longer.
    pub(crate) fn hold_task(&self, run: RunId, task: &str, held: bool) {
        let newly = mark(&self.held_tasks, (run, task.to_owned()), held);
        self.tell_attempts(run, Some(task), newly);
    }

    /// Tells `run`'s attempts here (those of `task` only, if given) whether they are held.
    fn tell_attempts(&self, run: RunId, task: Option<&str>, announce: bool) {
        let runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
        let Some(entry) = runs.get(&run) else {
            return;
        };
        for a in &entry.attempts {
            if task.is_some_and(|t| t != a.task) {
                continue;
            }
            let held = self.is_held(run, &a.task);
            if announce && held {
                info!(%run, task = %a.task, "Held: the attempt here stops at its next step");
            }
            a.hold.send_replace(held);
        }
    }

    pub(crate) fn is_cancelled(&self, run: RunId) -> bool {
        self.cancelled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&run)
    }
}

/// Puts `key` in `set` (held) or takes it out; whether it was newly held. The lock is
/// released before the attempts are told.
fn mark<K: std::hash::Hash + Eq>(set: &Mutex<HashSet<K>>, key: K, held: bool) -> bool {
    let mut set = set.lock().unwrap_or_else(|p| p.into_inner());
    if held {
        set.insert(key)
    } else {
        set.remove(&key);
        false
    }
}

/// Unregisters an attempt from its run's cancellation and holds when the attempt ends.
pub(crate) struct LeaveRun<'a>(pub(crate) &'a Shared, pub(crate) RunId, pub(crate) u64);

impl Drop for LeaveRun<'_> {
    fn drop(&mut self) {
        self.0.leave_run(self.1, self.2);
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
            } else if let Some(rest) = entry.key.strip_prefix("hold.") {
                // `hold.<run>`: the run; `hold.<run>.<task>`: one task alone.
                let (run, task) = match rest.split_once('.') {
                    Some((run, task)) => (run, Some(task)),
                    None => (rest, None),
                };
                let Ok(run) = run.parse::<RunId>() else {
                    continue;
                };
                match task {
                    Some(task) => shared.hold_task(run, task, put),
                    None => shared.hold_run(run, put),
                }
            }
        }
    }
}
