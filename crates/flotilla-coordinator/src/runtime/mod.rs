//! The thin runtime around [`RunMachine`]: reads the run log, applies inputs, stores the
//! state with compare-and-set, then performs the actions.
//!
//! ```text
//! run-log stream ──► router ──(hash of run id)──► shard 0..N ──► per run: load (cache, KV,
//!   submit.<run>, runlog.<run>                                   or replay its first entry)
//!                                                                 apply inputs (pure)
//!                                                                 CAS-write snapshot + outbox
//!                                                                 perform actions (idempotent)
//!                                                                 ack inputs
//! ```
//!
//! **Exactly-once effect.** Inputs are idempotent in the machine. A change is written with
//! compare-and-set before any action is performed, so two coordinators can never both act on
//! the same state: the loser reloads and re-applies. Every action is idempotent to perform
//! (deterministic `Nats-Msg-Id`s, one subject per timer). If a coordinator dies between the
//! write and the acks, the inputs are redelivered; the next coordinator sees that they
//! produced the stored outbox and performs it again — JetStream drops what was already
//! published. An outbox written recently (within half the duplicate window) is also
//! re-performed whenever a coordinator loads a run it did not write, which covers a crash
//! followed by other inputs of the same run arriving first.
//!
//! **A run's start is recorded lazily.** The start step is a pure function of the run's first
//! message (its submission), so its record is not written at once: the start's tasks are
//! dispatched, and its record and events are written with the run's next step — for short
//! tasks, one write and one event message for the whole run — or after
//! `coordinator.start-flush-delay` at the latest. The message that started the run is
//! acknowledged only once the start is recorded, so a coordinator that dies before is
//! replaced within the ack wait, well inside JetStream's duplicate window: a coordinator that
//! finds no record rebuilds the start from the run's first message and performs it again,
//! and JetStream drops what was already published.
//!
//! The runtime's parts, by what they do:
//!
//! * this module: the [`Runtime`], the router from the run-log stream to the shards, and each
//!   shard's loop (the cache of runs and the start-flush timer);
//! * [`inputs`]: decoding run-log messages, stepping them with retries, acknowledging;
//! * [`admission`]: verdicts on first messages, rejections, duplicate submissions;
//! * [`apply`]: one step — load, apply through the machine, compare-and-set write, perform;
//! * [`start_records`]: lazy start recording (flush) and rebuilding an unrecorded start;
//! * [`perform`]: acting on the machine's actions (tasks, timers, events, replies);
//! * [`envelope`]: building an attempt's task message;
//! * [`results`]: task results and what they turn into (workspace, state, final result,
//!   planner reviews);
//! * [`cancel`]: cancel notices for a stopped run's attempts;
//! * [`metrics`]: counting what committed steps decided.

mod admission;
mod apply;
mod approvals;
mod cancel;
mod envelope;
mod inputs;
mod metrics;
mod perform;
mod results;
mod start_records;

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use flotilla_bus::Bus;
use flotilla_bus::liveness::Pulse;
use flotilla_model::ids::RunId;
use flotilla_model::runlog::{Rejected, RunLogEntry};
use flotilla_model::submit::SubmitRequest;
use flotilla_model::task::TaskResult;
use flotilla_model::validate::ValidationContext;
use flotilla_telemetry::Metrics;
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::PULL_HEARTBEAT;
use crate::error::{StoreError, StoreErrorKind};
use crate::live::LiveWorkers;
use crate::machine::{Action, RunMachine};
use crate::options::CoordinatorOptions;
use crate::store::{RunStore, UnreadableSubmission};

use inputs::{canonical_run_id, misaddressed_run_id};

/// A run held in memory by its shard.
struct Cached {
    machine: RunMachine,
    /// KV revision of the record; 0 while the run's start is not recorded yet.
    revision: u64,
    /// Results of succeeded tasks, for building dependents' envelopes.
    results: HashMap<u32, TaskResult>,
    last_used: u64,
    /// When an input last touched it (`cache-idle` drops it after that long).
    touched: tokio::time::Instant,
    /// The start step, performed but not recorded yet.
    unflushed: Option<Unflushed>,
    /// The stream sequence of the last message on the run's log subject
    /// (`<prefix>.runlog.<run>`) applied here, 0 for none; `None` when not known (the run
    /// was loaded from its record). Known, it lets a dispatch whose success ends the run
    /// tell its worker to answer the run's submitters itself (`TaskAnswer::after_seq`).
    last_log_seq: Option<u64>,
}

/// What a performed-but-unrecorded start still owes: its record, its events, and the ack of
/// the message that started the run.
struct Unflushed {
    /// The start step's events, published with the next step's (one message) or at the flush.
    events: Vec<Action>,
    /// The message that started the run; acknowledged once the start is recorded.
    msgs: Vec<jetstream::Message>,
}

/// What a run-log-stream message says.
enum Inbound {
    /// A run-log entry (`<prefix>.runlog.<run>`).
    Entry(RunLogEntry),
    /// A durable submission (`<prefix>.submit.<run>`), not yet validated (or not even
    /// decodable); `first` when its publisher made sure it was the run's first message.
    Submission {
        request: Result<Box<SubmitRequest>, Box<UnreadableSubmission>>,
        first: bool,
    },
    /// A submission on `<prefix>.submit.<token>` whose token is not a canonical run id: it is
    /// refused, recorded as a rejected run under the id derived from the token.
    Misaddressed(Box<Rejected>),
    /// A message that cannot be decoded: the run cannot continue, and ends with this reason.
    Unreadable(String),
}

/// A decoded run-log message.
struct Decoded {
    msg: jetstream::Message,
    seq: u64,
    ts_ms: i64,
    /// When the stream stored it (Unix ns, server clock): the start of a dependency hop.
    published_ns: i128,
    delivered: i64,
    inbound: Inbound,
}

/// How a step ended.
enum Stepped {
    /// Done: the inputs can be acknowledged; the run stays cached when `Some`.
    Done(Option<Cached>),
    /// The run started and its start is not recorded yet: the inputs are acknowledged at the
    /// flush, and the run must stay cached.
    Deferred(Cached),
}

/// Why processing a run's inputs stopped.
enum StepError {
    /// Compare-and-set lost: reload and try again.
    Conflict,
    /// Nothing changed against cached state, which may be stale: reload and try again (not a
    /// conflict).
    Stale,
    /// Something failed that may work later (NATS unavailable); the inputs are handed back
    /// for redelivery.
    Failed(String),
    /// Something failed that will fail the same way every time (a message too large for the
    /// deployment): the run is ended with this reason instead of retrying forever.
    Terminal(String),
    /// A submission waits for its installation's quota (`concurrent_runs` queues): its
    /// message is handed back, to be admitted again after this long. Not a failure: it does
    /// not count towards ending the run.
    Wait(Duration),
}

impl From<StoreError> for StepError {
    fn from(e: StoreError) -> Self {
        match e.kind() {
            StoreErrorKind::Conflict | StoreErrorKind::AlreadyExists => Self::Conflict,
            StoreErrorKind::TooLarge | StoreErrorKind::Decode => Self::Terminal(e.to_string()),
            _ => Self::Failed(e.to_string()),
        }
    }
}

impl From<crate::approval_store::ApprovalError> for StepError {
    /// Approvals fail only for reasons that may pass (NATS unavailable, a race lost too
    /// often) or that retrying reports again: the inputs are handed back.
    fn from(e: crate::approval_store::ApprovalError) -> Self {
        Self::Failed(e.to_string())
    }
}

impl From<flotilla_bus::PublishError> for StepError {
    fn from(e: flotilla_bus::PublishError) -> Self {
        match e.kind() {
            // A stream the deployment has can be briefly unknown while a cluster elects its
            // leader (a node was killed): the step is retried, the run never ends on it. A
            // stream that is really gone stops every run alike, visibly, in the logs. So does
            // a permission the coordinator's NATS user lacks, until its permissions are fixed.
            flotilla_bus::PublishErrorKind::NoStream
            | flotilla_bus::PublishErrorKind::PermissionDenied => Self::Failed(e.to_string()),
            kind => match kind.retry() {
                flotilla_bus::Retry::Terminal => Self::Terminal(e.to_string()),
                flotilla_bus::Retry::Retryable => Self::Failed(e.to_string()),
            },
        }
    }
}

/// Applies run-log inputs.
pub(crate) struct Runtime {
    store: RunStore,
    bus: Bus,
    opts: CoordinatorOptions,
    ctx: ValidationContext,
    live: LiveWorkers,
    duplicate_window_ms: i64,
    /// `<prefix>.submit.`: messages on it are durable submissions.
    submit_prefix: String,
    metrics: Metrics,
    /// The `agent` label of tasks that name none.
    /// The agent of tasks naming none, when the deployment has one.
    default_agent: Option<String>,
    /// Parents' facts and tree counts, for admitting child runs.
    lineages: Arc<crate::lineage::Lineages>,
    /// Approvals of waiting tasks.
    approvals: crate::approval_store::ApprovalStore,
    /// Earned trust levels admissions use (`[hitl.trust] enabled`).
    trust: crate::trust::Trust,
    /// The installation's quotas (absent: none apply).
    quota: Option<Arc<crate::quota::Quota>>,
}

impl Runtime {
    pub(crate) fn new(
        store: RunStore,
        bus: Bus,
        opts: CoordinatorOptions,
        ctx: ValidationContext,
        live: LiveWorkers,
        duplicate_window: Duration,
        metrics: Metrics,
    ) -> Self {
        let submit_prefix = format!("{}.submit.", bus.names().prefix());
        let default_agent = ctx.agents.as_ref().and_then(|a| a.default.clone());
        let lineages = Arc::new(crate::lineage::Lineages::new(
            store.clone(),
            crate::lineage::TreeLimits::of(&opts),
        ));
        Self {
            approvals: crate::approval_store::ApprovalStore::new(bus.clone()),
            trust: crate::trust::Trust::default(),
            quota: None,
            metrics,
            default_agent,
            lineages,
            store,
            bus,
            opts,
            ctx,
            live,
            duplicate_window_ms: duplicate_window.as_millis() as i64,
            submit_prefix,
        }
    }

    /// Admits runs with the earned trust levels of `trust`.
    pub(crate) fn with_trust(mut self, trust: crate::trust::Trust) -> Self {
        self.trust = trust;
        self
    }

    /// Admits root runs under the installation's quotas, and gives back and counts what
    /// each run held and spent when it ends.
    pub(crate) fn with_quota(mut self, quota: Arc<crate::quota::Quota>) -> Self {
        self.quota = Some(quota);
        self
    }

    /// Consumes the run-log stream until `shutdown`. `pulse` is the stall check's view of the
    /// loop: it marks each message and each new pull, and says when it waits for a shard
    /// that is behind (not pulling, on purpose).
    pub(crate) async fn run(
        self: Arc<Self>,
        consumer: jetstream::consumer::PullConsumer,
        pulse: Pulse,
        shutdown: CancellationToken,
    ) {
        let mut lanes = Vec::with_capacity(self.opts.shards);
        let mut tasks = Vec::with_capacity(self.opts.shards);
        for _ in 0..self.opts.shards {
            let (tx, rx) = mpsc::channel::<(RunId, jetstream::Message)>(self.opts.batch * 4);
            lanes.push(tx);
            tasks.push(tokio::spawn(Arc::clone(&self).shard(rx)));
        }
        while !shutdown.is_cancelled() {
            // One life of the message stream: a new one after it ends, after the stall check
            // restarts it, or after it could not be opened.
            let life = pulse
                .attend(self.route(&consumer, &pulse, &lanes, &shutdown))
                .await;
            if life == Some(Routed::Stopped) {
                break;
            }
        }
        drop(lanes);
        for t in tasks {
            let _ = t.await;
        }
    }

    /// Routes the messages of one stream of the run-log consumer to the shards, until it ends.
    async fn route(
        &self,
        consumer: &jetstream::consumer::PullConsumer,
        pulse: &Pulse,
        lanes: &[mpsc::Sender<(RunId, jetstream::Message)>],
        shutdown: &CancellationToken,
    ) -> Routed {
        let stream = consumer
            .stream()
            .max_messages_per_batch(self.opts.batch)
            .heartbeat(PULL_HEARTBEAT)
            .expires(flotilla_bus::consume::LONG_PULL_EXPIRY)
            .messages()
            .await;
        let mut messages = match stream {
            // A lost pull request (its consumer's leader died) ends the stream: pull again.
            Ok(m) => Box::pin(flotilla_bus::consume::until_stalled(m)),
            Err(e) => {
                warn!(error = %e, "Cannot pull from the run log; retrying");
                return tokio::select! {
                    _ = shutdown.cancelled() => Routed::Stopped,
                    _ = tokio::time::sleep(Duration::from_millis(500)) => Routed::Ended,
                };
            }
        };
        pulse.pulled();
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => return Routed::Stopped,
                next = messages.next() => next,
            };
            match next {
                Some(Ok(msg)) => {
                    pulse.pulled();
                    // `<prefix>.runlog.<run>` or `<prefix>.submit.<run>`: the run is the
                    // last token, spelled canonically (one run, one subject).
                    let token = msg.subject.rsplit('.').next().unwrap_or_default();
                    let run = match canonical_run_id(token) {
                        Some(run) => run,
                        // A submission on a subject that is not a run's: refused visibly, as
                        // a rejected run under an id derived from the token.
                        None if msg.subject.starts_with(self.submit_prefix.as_str()) => {
                            misaddressed_run_id(token)
                        }
                        None => {
                            warn!(subject = %msg.subject, "Run-log message on a subject that names no run; dropping");
                            let _ = msg.ack_with(AckKind::Term).await;
                            continue;
                        }
                    };
                    let lane = &lanes[shard_of(run, lanes.len())];
                    let sent = match lane.try_send((run, msg)) {
                        Ok(()) => Ok(()),
                        Err(mpsc::error::TrySendError::Full(m)) => {
                            // The shard is behind: wait for it (busy, not stalled).
                            let _behind = pulse.busy();
                            lane.send(m).await.map_err(|_| ())
                        }
                        Err(mpsc::error::TrySendError::Closed(_)) => Err(()),
                    };
                    if sent.is_err() {
                        return Routed::Stopped;
                    }
                }
                Some(Err(e)) => {
                    debug!(error = %e, "Run-log pull interrupted");
                    if matches!(
                        e.kind(),
                        jetstream::consumer::pull::MessagesErrorKind::ConsumerDeleted
                            | jetstream::consumer::pull::MessagesErrorKind::NoResponders
                    ) {
                        return Routed::Ended;
                    }
                }
                None => return Routed::Ended,
            }
        }
    }

    async fn shard(self: Arc<Self>, mut rx: mpsc::Receiver<(RunId, jetstream::Message)>) {
        let mut cache: HashMap<RunId, Cached> = HashMap::new();
        // Runs whose start is not recorded, oldest first (the delay is constant, so this is
        // also the order they fall due).
        let mut due: VecDeque<(tokio::time::Instant, RunId)> = VecDeque::new();
        let mut tick: u64 = 0;
        let per_shard_cap = (self.opts.cache_runs / self.opts.shards).max(16);
        let idle = self.opts.cache_idle;
        let cached = self.metrics.cached_runs();
        // The gauge follows this shard's cache by the change in its size.
        let mut counted: i64 = 0;
        let mut count = |len: usize| {
            let now = len as i64;
            cached.inc_by(now - counted);
            counted = now;
        };
        let mut sweep = tokio::time::interval((idle / 4).max(Duration::from_secs(1)));
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let next_due = due.front().map(|(at, _)| *at);
            let first = tokio::select! {
                m = rx.recv() => m,
                _ = sweep.tick() => {
                    // Runs no input touched for `cache-idle`: waiting, or finished by another
                    // coordinator. Never a run whose start is unrecorded.
                    let now = tokio::time::Instant::now();
                    cache.retain(|_, c| c.unflushed.is_some() || now.duration_since(c.touched) < idle);
                    if cache.capacity() > 4 * cache.len().max(64) {
                        cache.shrink_to_fit();
                    }
                    count(cache.len());
                    continue;
                }
                _ = sleep_until(next_due) => {
                    let now = tokio::time::Instant::now();
                    while due.front().is_some_and(|(at, _)| *at <= now) {
                        let Some((_, run)) = due.pop_front() else { break };
                        if let Some(entry) = cache.remove(&run)
                            && let Some(entry) = self.flush(run, entry).await
                        {
                            cache.insert(run, entry);
                        }
                    }
                    continue;
                }
            };
            let Some(first) = first else { break };
            let mut batch = vec![first];
            while batch.len() < self.opts.batch {
                match rx.try_recv() {
                    Ok(m) => batch.push(m),
                    Err(_) => break,
                }
            }
            // Group by run, keeping each run's inputs in arrival order.
            let mut order: Vec<RunId> = Vec::new();
            let mut groups: HashMap<RunId, Vec<jetstream::Message>> = HashMap::new();
            for (run, msg) in batch {
                groups
                    .entry(run)
                    .or_insert_with(|| {
                        order.push(run);
                        Vec::new()
                    })
                    .push(msg);
            }
            let work = order.into_iter().filter_map(|run| {
                let msgs = groups.remove(&run)?;
                let cached = cache.remove(&run);
                let this = Arc::clone(&self);
                // Boxed: a run's processing is a large future, and the batch collects many.
                Some(Box::pin(async move {
                    (run, this.process(run, cached, msgs).await)
                }))
            });
            let delay = self.opts.start_flush_delay;
            for (run, entry) in futures::future::join_all(work).await {
                if let Some(mut e) = entry {
                    tick += 1;
                    e.last_used = tick;
                    e.touched = tokio::time::Instant::now();
                    if e.unflushed.is_some() && e.revision == 0 {
                        due.push_back((tokio::time::Instant::now() + delay, run));
                    }
                    cache.insert(run, e);
                }
            }
            if cache.len() > per_shard_cap {
                // Drop the least recently used tenth (never a run whose start is unrecorded).
                let mut ages: Vec<(u64, RunId)> = cache
                    .iter()
                    .filter(|(_, c)| c.unflushed.is_none())
                    .map(|(r, c)| (c.last_used, *r))
                    .collect();
                ages.sort_unstable();
                for (_, r) in ages.into_iter().take(per_shard_cap / 10 + 1) {
                    cache.remove(&r);
                }
            }
            count(cache.len());
        }
        // Stopping: record every start still owed.
        for (run, entry) in cache.drain() {
            if entry.unflushed.is_some() {
                self.flush(run, entry).await;
            }
        }
    }
}

/// How one stream of the run-log consumer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Routed {
    /// It ended (or could not be opened): open another.
    Ended,
    /// The coordinator is stopping.
    Stopped,
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn shard_of(run: RunId, shards: usize) -> usize {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    run.hash(&mut h);
    (h.finish() % shards as u64) as usize
}
