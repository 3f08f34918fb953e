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
//! A worker's waiting attempts are therefore not bounded by `concurrency`: they cost a
//! future and a heartbeat each, and the children they wait for are.
//!
//! Cancellation-safe: a wait that is dropped half-way (an agent's own timeout around
//! `call_agent`) still counts as over, and the slot is taken again in the background. Once the
//! attempt has ended ([`WorkerSlot::end`]) nothing is taken again, and a re-take under way
//! stops.
//!
//! Exec agents waiting in `flotilla call` are separate processes the worker cannot see
//! waiting: they keep their slot (give their pool room, or run children in another pool).

use std::any::Any;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

/// Whatever marks a slot as taken besides its permits (gauges, counters), made anew each
/// time the slot is taken and dropped when it is given back.
pub type Occupancy = Box<dyn Any + Send>;

/// Makes an [`Occupancy`].
pub type OccupancyFactory = Arc<dyn Fn() -> Occupancy + Send + Sync>;

/// The slot of one attempt: the permits it holds and the semaphores they came from.
#[derive(Clone, Default)]
pub struct WorkerSlot {
    inner: Option<Arc<Inner>>,
}

impl std::fmt::Debug for WorkerSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = self.inner.as_ref().map(|i| i.lock().held.is_some());
        f.debug_struct("WorkerSlot").field("held", &held).finish()
    }
}

struct Inner {
    /// The semaphores, in the order permits are taken (the worker's place for a held message,
    /// then its running-agent slot).
    semaphores: Vec<Arc<Semaphore>>,
    occupancy: OccupancyFactory,
    /// Fires when the attempt ends: a re-take under way stops.
    ended: CancellationToken,
    state: Mutex<SlotState>,
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes the slot again, unless the attempt ended or another wait began meanwhile.
    async fn retake(self: Arc<Self>) {
        let mut permits = Vec::with_capacity(self.semaphores.len());
        for semaphore in &self.semaphores {
            tokio::select! {
                p = Arc::clone(semaphore).acquire_owned() => match p {
                    Ok(p) => permits.push(p),
                    Err(_) => return,
                },
                () = self.ended.cancelled() => return,
            }
        }
        let mut state = self.lock();
        if state.waiting == 0 && state.held.is_none() && !self.ended.is_cancelled() {
            state.held = Some((permits, (self.occupancy)()));
        }
    }
}

#[derive(Default)]
struct SlotState {
    /// The permits and occupancy while the attempt holds its slot.
    held: Option<(Vec<OwnedSemaphorePermit>, Occupancy)>,
    /// Waits under way: the slot is given back while any is.
    waiting: usize,
}

/// One wait: counts as over when dropped, whether it finished or not.
struct Waiting {
    inner: Arc<Inner>,
    finished: bool,
}

impl Waiting {
    fn begin(inner: &Arc<Inner>) -> Self {
        let given_back = {
            let mut state = inner.lock();
            state.waiting += 1;
            state.held.take()
        };
        drop(given_back);
        Self {
            inner: Arc::clone(inner),
            finished: false,
        }
    }

    /// The wait is over: `true` when this was the last one and the slot must be taken again.
    fn over(&mut self) -> bool {
        self.finished = true;
        let mut state = self.inner.lock();
        state.waiting -= 1;
        state.waiting == 0 && state.held.is_none() && !self.inner.ended.is_cancelled()
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if !self.finished && self.over() {
            // Abandoned half-way: take the slot again in the background.
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(Arc::clone(&self.inner).retake());
            }
        }
    }
}

impl WorkerSlot {
    /// The slot made of `permits` (taken again from their semaphores in the same order) and
    /// what `occupancy` makes each time the slot is taken, now included.
    pub fn new(permits: Vec<OwnedSemaphorePermit>, occupancy: OccupancyFactory) -> Self {
        let semaphores = permits.iter().map(|p| Arc::clone(p.semaphore())).collect();
        let taken = occupancy();
        Self {
            inner: Some(Arc::new(Inner {
                semaphores,
                occupancy,
                ended: CancellationToken::new(),
                state: Mutex::new(SlotState {
                    held: Some((permits, taken)),
                    waiting: 0,
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
        let mut waiting = Waiting::begin(inner);
        let out = wait.await;
        if waiting.over() {
            Arc::clone(inner).retake().await;
        }
        out
    }

    /// The attempt ended (or was cancelled): gives the slot back for good.
    pub fn end(&self) {
        if let Some(inner) = &self.inner {
            inner.ended.cancel();
            let given_back = inner.lock().held.take();
            drop(given_back);
        }
    }

    /// Whether the attempt holds its slot now (not waiting, not ended).
    pub fn is_held(&self) -> bool {
        self.inner.as_ref().is_some_and(|i| i.lock().held.is_some())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicI64, Ordering};
    use std::time::Duration;

    use super::*;

    struct Fixture {
        held: Arc<Semaphore>,
        run: Arc<Semaphore>,
        occupied: Arc<AtomicI64>,
        slot: WorkerSlot,
    }

    struct Occupied(Arc<AtomicI64>);

    impl Drop for Occupied {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    async fn fixture() -> Fixture {
        let held = Arc::new(Semaphore::new(1));
        let run = Arc::new(Semaphore::new(1));
        let occupied = Arc::new(AtomicI64::new(0));
        let count = Arc::clone(&occupied);
        let factory: OccupancyFactory = Arc::new(move || {
            count.fetch_add(1, Ordering::SeqCst);
            Box::new(Occupied(Arc::clone(&count)))
        });
        let permits = vec![
            Arc::clone(&held).acquire_owned().await.expect("held"),
            Arc::clone(&run).acquire_owned().await.expect("run"),
        ];
        let slot = WorkerSlot::new(permits, factory);
        Fixture {
            held,
            run,
            occupied,
            slot,
        }
    }

    fn free(f: &Fixture) -> (usize, usize, i64) {
        (
            f.held.available_permits(),
            f.run.available_permits(),
            f.occupied.load(Ordering::SeqCst),
        )
    }

    #[tokio::test]
    async fn a_waiting_attempt_gives_its_slot_back_and_takes_one_again() {
        let f = fixture().await;
        assert_eq!(free(&f), (0, 0, 1));
        // While it waits, another task (its child) can take the slot and finish.
        let during = f
            .slot
            .released(async {
                let child = Arc::clone(&f.run).acquire_owned().await.expect("child");
                let seen = free(&f);
                drop(child);
                seen
            })
            .await;
        assert_eq!(during, (1, 0, 0));
        assert_eq!(free(&f), (0, 0, 1));
        // Two concurrent waits: the slot is back only when both are over.
        let (_, inner) = tokio::join!(
            f.slot
                .released(tokio::time::sleep(Duration::from_millis(20))),
            f.slot.released(async { free(&f) })
        );
        assert_eq!(inner, (1, 1, 0));
        assert_eq!(free(&f), (0, 0, 1));
        f.slot.end();
        assert_eq!(free(&f), (1, 1, 0));
        // After the end, a wait takes nothing again.
        f.slot.released(async {}).await;
        assert_eq!(free(&f), (1, 1, 0));
    }

    #[tokio::test]
    async fn an_abandoned_wait_still_ends_and_the_slot_is_taken_again() {
        let f = fixture().await;
        let abandoned = tokio::time::timeout(
            Duration::from_millis(10),
            f.slot.released(std::future::pending::<()>()),
        )
        .await;
        assert!(abandoned.is_err());
        // Taken again in the background.
        for _ in 0..100 {
            if f.slot.is_held() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(f.slot.is_held());
        assert_eq!(free(&f), (0, 0, 1));
        // A later wait gives it back and takes it again as usual.
        assert_eq!(f.slot.released(async { free(&f) }).await, (1, 1, 0));
        assert_eq!(free(&f), (0, 0, 1));
    }

    #[tokio::test]
    async fn ending_stops_a_retake_that_waits_for_a_busy_slot() {
        let f = fixture().await;
        let run = Arc::clone(&f.run);
        let slot = f.slot.clone();
        let waiter = tokio::spawn(async move {
            slot.released(async move {
                // Another task takes the run slot for good while this one waits.
                std::mem::forget(run.acquire_owned().await.expect("other"));
            })
            .await;
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !waiter.is_finished(),
            "the retake waits for the busy run slot"
        );
        f.slot.end();
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("ending stops the retake")
            .expect("joined");
        assert!(!f.slot.is_held());
        assert_eq!(
            free(&f),
            (1, 0, 0),
            "the place taken half-way is given back"
        );
    }
}
