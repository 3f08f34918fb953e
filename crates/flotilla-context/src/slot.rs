//! The worker slot an attempt occupies, given back while the attempt only waits.
//!
//! A worker runs at most `concurrency` agents at once and holds at most `concurrency +
//! prefetch` task messages. An agent that uses another agent as a tool waits for a child run,
//! which needs a slot of its own — often in the same pool. If waiting parents kept their
//! slots, a pool whose slots were all taken by waiting parents would never run their
//! children (and a worker holding a prefetched child behind its waiting parent would keep it
//! from idle workers): a deadlock. So while an attempt waits for children
//! ([`AgentContext::call_agent`](crate::AgentContext::call_agent)), its slot goes back to the
//! worker, which can pull and run other tasks — the children among them; when the last wait
//! ends, the attempt takes a slot again (waiting its turn like any task) before it goes on.
//!
//! Exec agents waiting in `flotilla call` are separate processes the worker cannot see
//! waiting: they keep their slot (give their pool room, or run children in another pool).

use std::sync::Arc;

use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore};

/// The slot of one attempt: the permits it holds and the semaphores they came from.
#[derive(Debug, Clone, Default)]
pub struct WorkerSlot {
    inner: Option<Arc<Inner>>,
}

#[derive(Debug)]
struct Inner {
    /// The semaphores, in the order permits are taken (the worker's place for a held message,
    /// then its running-agent slot).
    semaphores: Vec<Arc<Semaphore>>,
    state: Mutex<SlotState>,
}

#[derive(Debug, Default)]
struct SlotState {
    permits: Vec<OwnedSemaphorePermit>,
    /// Waits under way: the permits are given back while any is.
    waiting: usize,
    /// The attempt ended: nothing is taken again.
    done: bool,
}

impl WorkerSlot {
    /// The slot made of `permits`, taken from `semaphores` in order.
    pub fn new(semaphores: Vec<Arc<Semaphore>>, permits: Vec<OwnedSemaphorePermit>) -> Self {
        Self {
            inner: Some(Arc::new(Inner {
                semaphores,
                state: Mutex::new(SlotState {
                    permits,
                    waiting: 0,
                    done: false,
                }),
            })),
        }
    }

    /// Runs `wait` with the slot given back to the worker, then takes a slot again (unless the
    /// attempt has ended meanwhile). Concurrent waits of one attempt share one release.
    pub async fn released<F: std::future::Future>(&self, wait: F) -> F::Output {
        let Some(inner) = &self.inner else {
            return wait.await;
        };
        {
            let mut state = inner.state.lock().await;
            state.waiting += 1;
            state.permits.clear();
        }
        let out = wait.await;
        let mut state = inner.state.lock().await;
        state.waiting -= 1;
        if state.waiting == 0 && !state.done && state.permits.is_empty() {
            for semaphore in &inner.semaphores {
                match Arc::clone(semaphore).acquire_owned().await {
                    Ok(p) => state.permits.push(p),
                    // The worker is gone: nothing to take.
                    Err(_) => break,
                }
            }
        }
        out
    }

    /// The attempt ended: gives the slot back for good.
    pub async fn end(&self) {
        if let Some(inner) = &self.inner {
            let mut state = inner.state.lock().await;
            state.done = true;
            state.permits.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_waiting_attempt_gives_its_slot_back_and_takes_one_again() {
        let held = Arc::new(Semaphore::new(1));
        let run = Arc::new(Semaphore::new(1));
        let permits = vec![
            Arc::clone(&held).acquire_owned().await.expect("held"),
            Arc::clone(&run).acquire_owned().await.expect("run"),
        ];
        let slot = WorkerSlot::new(vec![Arc::clone(&held), Arc::clone(&run)], permits);
        assert_eq!((held.available_permits(), run.available_permits()), (0, 0));
        // While it waits, another task (its child) can take the slot and finish.
        let during = slot
            .released(async {
                let child = Arc::clone(&run).acquire_owned().await.expect("child");
                let seen = (held.available_permits(), run.available_permits());
                drop(child);
                seen
            })
            .await;
        assert_eq!(during, (1, 0));
        assert_eq!((held.available_permits(), run.available_permits()), (0, 0));
        // Two concurrent waits: the slot is back only when both are over.
        let (a, b) = tokio::join!(
            slot.released(tokio::time::sleep(std::time::Duration::from_millis(20))),
            slot.released(async { run.available_permits() })
        );
        let _ = (a, b);
        assert_eq!(run.available_permits(), 0);
        slot.end().await;
        assert_eq!((held.available_permits(), run.available_permits()), (1, 1));
        // After the end, a wait takes nothing again.
        slot.released(async {}).await;
        assert_eq!(run.available_permits(), 1);
    }
}
