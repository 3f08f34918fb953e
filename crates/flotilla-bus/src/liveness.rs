//! Liveness of pull loops: a loop that stops pulling while its consumer holds messages is
//! noticed and started again.
//!
//! Every service takes its work from durable pull consumers, each in a loop of its own. Such
//! a loop can stop asking for messages without ending: a pull request the server forgot
//! while the client waits out its own timeout, an await that never returns, a panic in the
//! loop's task. The process looks alive (its heartbeat and registry entry are fresh, other
//! loops run) while the consumer's messages wait for nobody. A [`Watchdog`] per service
//! notices that and restarts the loop:
//!
//! ```text
//!  pull loop ── each pull it makes: a timestamp (no I/O) ──► Pulse ◄── every heartbeat ── Watchdog
//!     ▲          while it waits for capacity on purpose: busy       │ last pull older than a
//!     │                                                             │ heartbeat, not busy?
//!     │                                                             ▼
//!     │                                       consumer info: messages pending? (one request)
//!     │                                                             │ still so a heartbeat later,
//!     │                                                             ▼ two heartbeats without a pull
//!     └──── the pull under way is dropped, a new one begins ◄── Stall (the service logs and counts it)
//! ```
//!
//! The check is cheap: a loop that pulls is never asked about (its timestamp is fresh), and a
//! consumer-info request is made only for a loop whose last pull is old. A loop that does not
//! pull on purpose — a worker whose slots are all taken, a coordinator whose shards are
//! behind — says so with [`Pulse::busy`] and is not checked meanwhile. A consumer seen with
//! messages pending once is checked again a heartbeat later before anything happens, so a
//! message on its way to an idle loop at the moment of the check is not taken for a stall;
//! nor is a consumer with all the unacknowledged messages it allows out (`max_ack_pending`),
//! to which the server delivers nothing whoever pulls.
//!
//! Restarting is cooperative: a loop runs each pull (or each life of a message stream) under
//! [`Pulse::attend`], which drops it when the watchdog asks; what the loop owns outside it
//! (the attempts it started, the handlers still running) is untouched. A panic inside is
//! caught there too, logged, and the loop goes on with a new pull instead of ending silently.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use futures::FutureExt;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How long a loop whose pull panicked waits before it pulls again (a pull that panics every
/// time would otherwise spin).
const AFTER_PANIC: Duration = Duration::from_secs(1);

/// A stall the watchdog saw and acted on: the loop of `consumer` made no pull for
/// `since_pull` while the consumer held `pending` messages. It has been restarted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stall {
    /// The stream the consumer reads (durable names repeat across streams: the coordinators'
    /// intake and run-log consumers are both `coordinator`).
    pub stream: String,
    /// The durable consumer's name.
    pub consumer: String,
    /// Messages not yet delivered to anyone, as the consumer reported them.
    pub pending: u64,
    /// How long the loop had made no pull.
    pub since_pull: Duration,
}

/// What a service does with a [`Stall`]: log it and count it (its internal event).
pub type StallHook = Arc<dyn Fn(&Stall) + Send + Sync>;

/// Watches the pull loops of one service (see the module docs).
pub struct Watchdog {
    heartbeat: Duration,
    on_stall: StallHook,
    watched: Mutex<Vec<Arc<Watched>>>,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog")
            .field("heartbeat", &self.heartbeat)
            .finish_non_exhaustive()
    }
}

impl Watchdog {
    /// A watchdog that checks every `heartbeat` (the service's own liveness interval) and
    /// calls `on_stall` for each loop it restarts. A loop is stalled after two heartbeats
    /// without a pull with messages pending.
    pub fn new(heartbeat: Duration, on_stall: StallHook) -> Arc<Self> {
        Arc::new(Self {
            heartbeat,
            on_stall,
            watched: Mutex::new(Vec::new()),
        })
    }

    /// The check interval.
    pub fn heartbeat(&self) -> Duration {
        self.heartbeat
    }

    /// Watches the loop that pulls from `consumer`: it marks its pulls on the returned
    /// [`Pulse`] (one per loop; clones share it).
    pub fn watch(&self, consumer: &PullConsumer) -> Pulse {
        let info = consumer.cached_info();
        let watched = Arc::new(Watched::new(
            info.stream_name.clone(),
            info.name.clone(),
            Some(consumer.clone()),
        ));
        self.watched
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Arc::clone(&watched));
        Pulse(watched)
    }

    /// Checks every watched loop once per heartbeat until `stop`.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let mut tick = tokio::time::interval(self.heartbeat);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let watched = self
                .watched
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            for w in watched {
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = self.check(&w) => {}
                }
            }
        }
    }

    /// One look at one loop: nothing when it pulled within a heartbeat or is busy; a
    /// consumer-info request otherwise; a restart when messages were pending at two looks in
    /// a row and it made no pull for two heartbeats.
    async fn check(&self, w: &Watched) {
        if !w.quiet_for(self.heartbeat) {
            w.suspect.store(false, Ordering::Relaxed);
            return;
        }
        let Some(consumer) = &w.consumer else { return };
        let pending = match tokio::time::timeout(self.heartbeat, consumer.get_info()).await {
            // Every message it may have out is out (`max_ack_pending`): the server delivers
            // nothing more until some are acknowledged, whoever pulls. Not this loop's stall.
            Ok(Ok(info))
                if info.config.max_ack_pending > 0
                    && info.num_ack_pending as i64 >= info.config.max_ack_pending =>
            {
                0
            }
            Ok(Ok(info)) => info.num_pending,
            Ok(Err(e)) => {
                tracing::debug!(consumer = %w.name, error = %e, "Cannot read a consumer's state for the stall check");
                return;
            }
            Err(_) => {
                tracing::debug!(consumer = %w.name, "No answer about a consumer's state for the stall check");
                return;
            }
        };
        // A pull may have been made while the question was out.
        if pending == 0 || !w.quiet_for(self.heartbeat) {
            w.suspect.store(false, Ordering::Relaxed);
            return;
        }
        let seen_before = w.suspect.swap(true, Ordering::Relaxed);
        let since_pull = w.since_pull();
        if !seen_before || since_pull < self.heartbeat * 2 {
            return;
        }
        w.suspect.store(false, Ordering::Relaxed);
        (self.on_stall)(&Stall {
            stream: w.stream.clone(),
            consumer: w.name.clone(),
            pending,
            since_pull,
        });
        w.restart();
    }
}

/// The state of one watched loop.
struct Watched {
    /// The stream its consumer reads.
    stream: String,
    /// The durable consumer's name.
    name: String,
    /// Asked for its pending messages (`None`: a pulse nobody watches).
    consumer: Option<PullConsumer>,
    /// Where `last_pull` counts from.
    origin: Instant,
    /// Milliseconds from `origin` to the last pull (or the end of the last busy spell).
    last_pull: AtomicU64,
    /// Busy spells under way: the loop does not pull on purpose.
    busy: AtomicUsize,
    /// Seen quiet with messages pending at the last check.
    suspect: AtomicBool,
    /// Cancelled to drop the pull under way; replaced by a fresh one at each restart.
    restart: Mutex<CancellationToken>,
}

impl Watched {
    fn new(stream: String, name: String, consumer: Option<PullConsumer>) -> Self {
        Self {
            stream,
            name,
            consumer,
            origin: Instant::now(),
            last_pull: AtomicU64::new(0),
            busy: AtomicUsize::new(0),
            suspect: AtomicBool::new(false),
            restart: Mutex::new(CancellationToken::new()),
        }
    }

    fn mark(&self) {
        let ms = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_pull.store(ms, Ordering::Relaxed);
    }

    fn since_pull(&self) -> Duration {
        let now = self.origin.elapsed();
        now.saturating_sub(Duration::from_millis(
            self.last_pull.load(Ordering::Relaxed),
        ))
    }

    /// Not busy, and no pull for at least `d`.
    fn quiet_for(&self, d: Duration) -> bool {
        self.busy.load(Ordering::Relaxed) == 0 && self.since_pull() >= d
    }

    fn restart(&self) {
        let mut token = self.restart.lock().unwrap_or_else(PoisonError::into_inner);
        token.cancel();
        *token = CancellationToken::new();
        drop(token);
        // The new pull gets its two heartbeats.
        self.mark();
    }
}

/// A pull loop's side of the watch: where it marks its pulls and busy spells, and under which
/// it runs each pull ([`attend`](Self::attend)).
#[derive(Clone)]
pub struct Pulse(Arc<Watched>);

impl std::fmt::Debug for Pulse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pulse")
            .field("consumer", &self.0.name)
            .finish()
    }
}

impl Pulse {
    /// A pulse no watchdog checks (an embedder's loop without one): marks cost the same and
    /// change nothing; panics are still caught by [`attend`](Self::attend).
    pub fn unwatched(name: impl Into<String>) -> Self {
        Self(Arc::new(Watched::new(String::new(), name.into(), None)))
    }

    /// The loop made a pull (sent a pull request, opened a message stream, or received a
    /// message): a timestamp, nothing else.
    pub fn pulled(&self) {
        self.0.mark();
    }

    /// The loop does not pull on purpose (no free slot, its handlers all busy) until the
    /// guard drops; the watchdog leaves it alone meanwhile, and the two heartbeats count from
    /// the end of the spell.
    pub fn busy(&self) -> Busy {
        self.0.busy.fetch_add(1, Ordering::Relaxed);
        Busy(Arc::clone(&self.0))
    }

    /// Runs one pull (or one life of a message stream) of the loop: `None` when the watchdog
    /// restarted the loop meanwhile (`work` was dropped) or `work` panicked (logged); the
    /// caller then simply pulls again.
    pub async fn attend<F: Future>(&self, work: F) -> Option<F::Output> {
        let restart = self
            .0
            .restart
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        tokio::select! {
            biased;
            () = restart.cancelled() => None,
            out = AssertUnwindSafe(work).catch_unwind() => match out {
                Ok(v) => Some(v),
                Err(_) => {
                    tracing::error!(consumer = %self.0.name, "A pull loop panicked; pulling again");
                    tokio::time::sleep(AFTER_PANIC).await;
                    None
                }
            },
        }
    }

    /// The consumer this pulse is for.
    pub fn consumer(&self) -> &str {
        &self.0.name
    }
}

/// A busy spell of a loop ([`Pulse::busy`]).
#[derive(Debug)]
pub struct Busy(Arc<Watched>);

impl Drop for Busy {
    fn drop(&mut self) {
        if self.0.busy.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.0.mark();
        }
    }
}

impl std::fmt::Debug for Watched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watched").field("name", &self.name).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_busy_loop_is_never_quiet_and_its_quiet_time_starts_when_the_spell_ends() {
        let pulse = Pulse::unwatched("c");
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(pulse.0.quiet_for(Duration::from_millis(20)));
        let busy = pulse.busy();
        let again = pulse.busy();
        assert!(!pulse.0.quiet_for(Duration::ZERO));
        drop(busy);
        assert!(!pulse.0.quiet_for(Duration::ZERO), "one spell still runs");
        drop(again);
        assert!(!pulse.0.quiet_for(Duration::from_millis(20)), "just ended");
        pulse.pulled();
        assert!(pulse.0.since_pull() < Duration::from_millis(20));
    }

    #[tokio::test]
    async fn attend_drops_the_pull_on_a_restart_and_survives_a_panic() {
        let pulse = Pulse::unwatched("c");
        assert_eq!(pulse.attend(async { 7 }).await, Some(7));
        let hung = pulse.attend(std::future::pending::<()>());
        let restart = async {
            tokio::time::sleep(Duration::from_millis(10)).await;
            pulse.0.restart();
        };
        let (out, ()) = tokio::join!(hung, restart);
        assert_eq!(out, None, "the hung pull was dropped");
        assert_eq!(
            pulse.attend(async { 8 }).await,
            Some(8),
            "the next pull runs"
        );
        let panicked = pulse
            .attend(async {
                if pulse.consumer() == "c" {
                    panic!("a test panic");
                }
            })
            .await;
        assert_eq!(panicked, None);
    }
}
