//! The Flotilla worker: pulls the tasks of one pool, runs agents, publishes results.
//!
//! ```text
//!  FLOTILLA_TASKS ──pull (as many as free slots)──► worker ──► agent
//!        ▲                                            │ every heartbeat: +WPI (in progress)
//!        │                                            ▼
//!        └──────────── ack ◄── result acknowledged ◄── flotilla.runlog.<run> (result)
//! ```
//!
//! * One durable pull consumer per pool (`pool-<name>`), shared by every worker of the pool;
//!   each worker asks for exactly as many messages as it has free slots, so nothing waits in
//!   a client buffer while its ack timer runs.
//! * Prefetch follows the pace of the work: while this worker's recent attempts are short
//!   (under [`PREFETCH_MAX_ATTEMPT`] on average) it holds up to `prefetch` tasks beyond its
//!   slots, so a freed slot starts its next task without a pull round trip. A new worker, and
//!   one whose attempts take longer (model calls), pulls only for free slots: a task never
//!   waits behind a long attempt here while another worker of the pool has a free slot.
//! * While an agent runs, and until its result is stored (a run log without a leader for a
//!   few seconds while a cluster node dies), the worker sends in-progress acknowledgements
//!   twice per heartbeat;
//!   the consumer's ack wait is one and a half heartbeats, so a dead worker's task is
//!   redelivered to another worker within 1.5 heartbeats (7.5 s at the default 5 s), while a
//!   live worker has three chances per ack wait to keep its task.
//! * Cancellation: workers watch the control bucket; when a run is cancelled or aborted, its
//!   running attempts here are cancelled at once (event-driven), and a task of such a run that
//!   is pulled later is answered `cancelled` without running.
//! * A result larger than the server's max payload becomes a `result_too_large` failure
//!   instead of a publish retried forever.
//! * The task is acknowledged only after its result is durably in the run log (ack after
//!   result). Results carry `Nats-Msg-Id: result.<run>.<task>.<attempt>`, and the coordinator
//!   applies each attempt's result once.
//! * A message delivered more than `max-deliveries` times (workers keep dying on it) becomes a
//!   `redeliveries_exhausted` failure instead of another crash.
//! * Graceful stop: stop pulling, let in-flight tasks finish within the grace period, then
//!   cancel the rest and hand them back (NAK) so another worker starts them at once.
//! * Live registry: the worker keeps its entry in the `flotilla-workers` KV bucket (TTL).

pub mod agent;
pub mod agents;
pub mod options;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, AckKind};
use flotilla_bus::{Bus, PublishErrorKind, SharedConsumer, wire};
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::api::{ApiRequest, GetRunRequest};
use flotilla_model::codec::Codec;
use flotilla_model::event::{Event, WorkflowEvent, WorkflowPhase};
use flotilla_model::ids::RunId;
use flotilla_model::numeric::extract_numeric_value;
use flotilla_model::run::{RunView, TaskStatus};
use flotilla_model::runlog::{RunInput, RunLogEntry, TaskResultInput};
use flotilla_model::subjects::{Bucket, StreamKind};
use flotilla_model::task::{TaskEnvelope, TaskError, TaskErrorKind, TaskResult, result_msg_id};
use flotilla_model::time::Timestamp;
use flotilla_telemetry::events::TaskAttemptFinished;
use flotilla_telemetry::metrics::WorkerSlots;
use flotilla_telemetry::{AttemptOutcome, InternalEvent, Metrics, spans, trace_context};
use futures::StreamExt;
use serde::Deserialize;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, warn};

use crate::agent::{AgentContext, AgentError, EventEmitter};
pub use crate::agents::{AgentDefinition, AgentRegistry, RoleConfig};
pub use crate::options::WorkerOptions;
pub use flotilla_context::{Agent, AgentReply, Clients, Scope, WorkerSlot};

flotilla_bus::error_kinds!(
    /// Why a worker could not run.
    WorkerErrorKind {
        /// Invalid settings or agent definitions.
        Config => "invalid worker configuration", Terminal;
        /// Streams, consumer or registry could not be set up.
        Setup => "worker setup failed", Retryable;
    }
);

/// A worker could not run.
pub type WorkerError = flotilla_bus::error::Error<WorkerErrorKind>;

/// How long one pull request waits for tasks.
const PULL_EXPIRY: Duration = Duration::from_secs(1);
/// How long a pull request waits while tasks flow (the last one brought some).
const BUSY_PULL_EXPIRY: Duration = Duration::from_millis(20);
/// How long a busy worker gathers freed slots before asking for more tasks.
const GATHER: Duration = Duration::from_millis(1);
/// Attempts shorter than this on average make prefetching pay: it saves a pull round trip
/// (about 1 ms) per task, and costs at most one attempt's duration of waiting while another
/// worker may be idle. Model calls take seconds; no-op and cached agents take microseconds.
pub const PREFETCH_MAX_ATTEMPT: Duration = Duration::from_millis(50);

/// The recent duration of this worker's attempts, as an exponentially weighted average
/// (weight 1/5 for each new attempt): one atomic update per attempt.
#[derive(Debug)]
struct Pace(std::sync::atomic::AtomicU64);

impl Pace {
    /// No attempt has ended yet.
    const UNKNOWN: u64 = u64::MAX;

    /// No attempts seen.
    fn new() -> Self {
        Self(std::sync::atomic::AtomicU64::new(Self::UNKNOWN))
    }

    /// An attempt's agent ran for `d`.
    fn record(&self, d: Duration) {
        let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX - 1);
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                Some(if old == Self::UNKNOWN {
                    micros
                } else {
                    (old.saturating_mul(4)).saturating_add(micros) / 5
                })
            });
    }

    /// Whether prefetching pays: attempts have been seen and are short on average. Until the
    /// first attempt ends, the pace is unknown and the answer is no.
    fn short(&self) -> bool {
        let v = self.0.load(Ordering::Relaxed);
        v != Self::UNKNOWN && v < PREFETCH_MAX_ATTEMPT.as_micros() as u64
    }
}

pub use flotilla_model::worker::WorkerInfo;

/// A worker process (or one of several in `flotilla up`).
#[derive(Debug)]
pub struct Worker {
    bus: Bus,
    opts: WorkerOptions,
    agents: Arc<AgentRegistry>,
    id: String,
    ready: Option<tokio::sync::oneshot::Sender<()>>,
    metrics: Metrics,
}

/// State shared by a worker's tasks.
struct Shared {
    bus: Bus,
    opts: WorkerOptions,
    agents: Arc<AgentRegistry>,
    id: String,
    in_flight: Arc<AtomicUsize>,
    /// Agents running at once (`concurrency`).
    run_slots: Arc<Semaphore>,
    /// Fires when the grace period is over: running agents are cancelled and handed back.
    hard_stop: CancellationToken,
    /// Cancellation of the runs with attempts running here, with how many are running.
    runs: Mutex<HashMap<RunId, (CancellationToken, usize)>>,
    /// Runs known to be cancelled (from the control bucket).
    cancelled: Mutex<HashSet<RunId>>,
    metrics: Metrics,
    /// This worker's share of the pool's slot gauges.
    slots: WorkerSlots,
    /// How long this worker's attempts take lately: prefetch only while they are short.
    pace: Pace,
}

impl Shared {
    /// Registers an attempt of `run`; the token fires when the run is cancelled.
    fn enter_run(&self, run: RunId) -> CancellationToken {
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

    fn leave_run(&self, run: RunId) {
        let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(entry) = runs.get_mut(&run) {
            entry.1 -= 1;
            if entry.1 == 0 {
                runs.remove(&run);
            }
        }
    }

    /// A cancel notice arrived for `run`.
    fn cancel_run(&self, run: RunId) {
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

    fn is_cancelled(&self, run: RunId) -> bool {
        self.cancelled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&run)
    }
}

fn setup(
    detail: impl Into<String>,
    e: impl std::error::Error + Send + Sync + 'static,
) -> WorkerError {
    WorkerError::with_source(WorkerErrorKind::Setup, detail, e)
}

fn default_id() -> String {
    let host = gethostname::gethostname().to_string_lossy().into_owned();
    let host: String = host
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .take(40)
        .collect();
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    format!("{host}-{}", &suffix[..8])
}

impl Worker {
    /// A worker on `bus` running `agents`.
    pub fn new(bus: Bus, opts: WorkerOptions, agents: AgentRegistry) -> Self {
        let id = opts.id.clone().unwrap_or_else(default_id);
        Self {
            bus,
            opts,
            agents: Arc::new(agents),
            id,
            ready: None,
            metrics: Metrics::new(),
        }
    }

    /// Records this worker's metrics (attempt durations by outcome, in-flight attempts and
    /// free slots of its pool) in `metrics` — the process's registry, served on `/metrics` —
    /// instead of a private one.
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Signals `ready` once the pool consumer is bound and the worker is about to pull (for
    /// readiness probes).
    pub fn on_ready(mut self, ready: tokio::sync::oneshot::Sender<()>) -> Self {
        self.ready = Some(ready);
        self
    }

    /// This worker's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    async fn consumer(&self) -> Result<PullConsumer, WorkerError> {
        self.bus
            .shared_consumer(pool_consumer(self.bus.names(), &self.opts.pool, &self.opts))
            .await
            .map_err(|e| setup("setting up the pool consumer", e))
    }

    /// Runs until `shutdown` is cancelled, then drains (see the module docs).
    pub async fn run(mut self, shutdown: CancellationToken) -> Result<(), WorkerError> {
        self.opts
            .validate()
            .map_err(|e| WorkerError::new(WorkerErrorKind::Config, e))?;
        let consumer = self.consumer().await?;
        let registry = self
            .bus
            .kv(Bucket::Workers)
            .await
            .map_err(|e| setup("opening the workers bucket", e))?;
        let shared = Arc::new(Shared {
            bus: self.bus.clone(),
            opts: self.opts.clone(),
            agents: Arc::clone(&self.agents),
            id: self.id.clone(),
            in_flight: Arc::new(AtomicUsize::new(0)),
            run_slots: Arc::new(Semaphore::new(self.opts.concurrency)),
            hard_stop: CancellationToken::new(),
            runs: Mutex::new(HashMap::new()),
            cancelled: Mutex::new(HashSet::new()),
            slots: self
                .metrics
                .worker_slots(&self.opts.pool, self.opts.concurrency),
            metrics: self.metrics.clone(),
            pace: Pace::new(),
        });
        let control = self
            .bus
            .kv(Bucket::Control)
            .await
            .map_err(|e| setup("opening the control bucket", e))?;
        let watcher_stop = CancellationToken::new();
        let watcher = tokio::spawn(watch_cancellations(
            control,
            Arc::clone(&shared),
            watcher_stop.clone(),
        ));
        let info = WorkerInfo {
            id: self.id.clone(),
            pool: self.opts.pool.clone(),
            host: gethostname::gethostname().to_string_lossy().into_owned(),
            pid: std::process::id(),
            concurrency: self.opts.concurrency,
            in_flight: 0,
            agents: self.agents.names(),
            started_at: Timestamp::now(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
        };
        let register_stop = CancellationToken::new();
        let registration = tokio::spawn(register(
            registry.clone(),
            info,
            Arc::clone(&shared),
            register_stop.clone(),
        ));
        if let Some(ready) = self.ready.take() {
            let _ = ready.send(());
        }
        info!(worker = %self.id, pool = %self.opts.pool, concurrency = self.opts.concurrency, "Worker started");

        // Messages held at once: the running ones plus `prefetch` waiting for a slot, so a
        // slot that frees finds its next task already here instead of idling on a pull.
        let slots = Arc::new(Semaphore::new(self.opts.concurrency + self.opts.prefetch));
        let mut running = tokio::task::JoinSet::new();
        // Whether the last pull request brought tasks.
        let mut busy = false;
        'pull: while !shutdown.is_cancelled() {
            // While attempts are long (or not known yet), the prefetch places are held back
            // for this pull request: it asks only for free slots.
            let keep_back = match self.opts.prefetch {
                0 => None,
                _ if shared.pace.short() => None,
                n => Some(tokio::select! {
                    _ = shutdown.cancelled() => break,
                    p = Arc::clone(&slots).acquire_many_owned(n as u32) => match p { Ok(p) => p, Err(_) => break },
                }),
            };
            let first = tokio::select! {
                _ = shutdown.cancelled() => break,
                p = Arc::clone(&slots).acquire_owned() => match p { Ok(p) => p, Err(_) => break },
            };
            let mut permits = vec![first];
            while let Ok(p) = Arc::clone(&slots).try_acquire_owned() {
                permits.push(p);
            }
            // A busy worker with many slots gathers freed slots for a moment, so it asks for
            // tasks in batches rather than one pull request per finished task.
            let gather = (self.opts.concurrency / 4).max(1);
            if busy && permits.len() < gather {
                let until = tokio::time::Instant::now() + GATHER;
                while permits.len() < gather {
                    match tokio::time::timeout_at(until, Arc::clone(&slots).acquire_owned()).await {
                        Ok(Ok(p)) => permits.push(p),
                        _ => break,
                    }
                }
            }
            let batch = consumer
                .batch()
                .max_messages(permits.len())
                // A pull request dies with a server restart; a short expiry bounds how long a
                // worker waits on a lost one (one tiny request per second when idle). While
                // tasks flow, requests are short, so slots freed meanwhile are asked for soon.
                .expires(if busy { BUSY_PULL_EXPIRY } else { PULL_EXPIRY })
                .messages()
                .await;
            let mut batch = match batch {
                Ok(b) => b,
                Err(e) => {
                    debug!(error = %e, "Pull request failed; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(Duration::from_millis(250)) => continue,
                    }
                }
            };
            // The server ends a pull request at its expiry; one it forgot (restarted) never
            // ends, and the client library would wait 5 s more. Stop waiting shortly after.
            let request_over =
                tokio::time::Instant::now() + PULL_EXPIRY + Duration::from_millis(500);
            let mut received = 0usize;
            loop {
                let next = tokio::select! {
                    next = tokio::time::timeout_at(request_over, batch.next()) => next.unwrap_or(None),
                    _ = shutdown.cancelled() => {
                        // Hand back anything still arriving for this pull request.
                        while let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_millis(50), batch.next()).await {
                            let _ = m.ack_with(AckKind::Nak(None)).await;
                        }
                        break 'pull;
                    }
                };
                match next {
                    Some(Ok(msg)) => {
                        received += 1;
                        let Some(permit) = permits.pop() else {
                            let _ = msg.ack_with(AckKind::Nak(None)).await;
                            continue;
                        };
                        let shared = Arc::clone(&shared);
                        let stopping = shutdown.clone();
                        running.spawn(async move {
                            handle(&shared, msg, permit, &stopping).await;
                        });
                    }
                    Some(Err(e)) => {
                        debug!(error = %e, "Pull interrupted");
                        break;
                    }
                    None => break,
                }
            }
            drop(permits);
            drop(keep_back);
            busy = received > 0;
            // Reap finished tasks so the set does not grow.
            while running.try_join_next().is_some() {}
        }
        info!(worker = %self.id, in_flight = running.len(), "Worker stopping: no new tasks; draining");
        let grace = tokio::time::sleep(self.opts.shutdown_grace);
        tokio::pin!(grace);
        loop {
            tokio::select! {
                next = running.join_next() => if next.is_none() { break },
                _ = &mut grace, if !shared.hard_stop.is_cancelled() => {
                    warn!(worker = %self.id, in_flight = running.len(), "Grace period over: handing back unfinished tasks");
                    shared.hard_stop.cancel();
                }
            }
        }
        register_stop.cancel();
        watcher_stop.cancel();
        let _ = registration.await;
        let _ = watcher.await;
        let _ = registry.delete(&self.id).await;
        info!(worker = %self.id, "Worker stopped");
        Ok(())
    }
}

/// The shared durable consumer of `pool` (`pool-<name>` on the tasks stream) as the pool's
/// workers create it. `flotilla nats provision --pools` creates it the same way ahead of the
/// workers, for autoscalers that read its backlog before any worker runs (KEDA).
pub fn pool_consumer(
    names: &flotilla_model::Names,
    pool: &str,
    opts: &WorkerOptions,
) -> SharedConsumer {
    SharedConsumer {
        stream: StreamKind::Tasks,
        durable: names.pool_consumer(pool),
        description: format!("Flotilla workers of pool {pool}"),
        filters: vec![names.pool_filter(pool)],
        ack_wait: opts.ack_wait(),
        max_ack_pending: 100_000,
    }
}

/// Follows cancel notices in the control bucket (`cancel.<run>`), from the current ones on.
async fn watch_cancellations(
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

/// Keeps the registry entry fresh until stopped.
async fn register(
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

/// Whether the coordinator already has a result for this attempt (only asked on redelivery).
async fn already_done(bus: &Bus, task: &TaskEnvelope) -> bool {
    let req = GetRunRequest {
        task_id: Some(task.task_id.clone()),
        ..GetRunRequest::new(task.run_id)
    };
    let Ok(body) = serde_json::to_vec(&req) else {
        return false;
    };
    let asked = tokio::time::timeout(
        Duration::from_secs(2),
        bus.client()
            .request(bus.names().api(GetRunRequest::ENDPOINT), body.into()),
    )
    .await;
    let Ok(Ok(reply)) = asked else { return false };
    let Ok(view) = serde_json::from_slice::<RunView>(&reply.payload) else {
        return false;
    };
    if view.record.status.is_terminal() {
        return true;
    }
    view.tasks
        .iter()
        .find(|t| t.task_id == task.task_id)
        .is_some_and(|t| !(t.status == TaskStatus::Dispatched && t.attempts == task.attempt))
}

/// Runs one delivered task message to the end.
/// Runs one delivered task message to the end. `held` is the message's place among those the
/// worker holds (running or prefetched); it is released as soon as the agent is done, so the
/// next task is pulled while this one's result is being stored.
async fn handle(
    shared: &Shared,
    msg: jetstream::Message,
    held: tokio::sync::OwnedSemaphorePermit,
    stopping: &CancellationToken,
) {
    let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
    let task: TaskEnvelope = match wire::decode(msg.headers.as_ref(), &msg.payload) {
        Ok(t) => t,
        Err(e) => {
            report_bad_envelope(shared, &msg, &e.to_string()).await;
            return;
        }
    };
    let started_at = Timestamp::now();
    let mut attempt = Attempt::new(shared, &task);
    trace_context::set_parent(&attempt.span, task.trace.as_ref());
    if shared.is_cancelled(task.run_id) {
        debug!(run = %task.run_id, task = %task.task_id, "Task of a cancelled run; not running it");
        let result = TaskResult::failure(TaskErrorKind::Cancelled, "the run was cancelled");
        attempt.ended(finish(shared, &msg, &task, result, started_at).await);
        return;
    }
    if delivered > shared.opts.max_deliveries {
        warn!(run = %task.run_id, task = %task.task_id, delivered, "Task redelivered too often; reporting it failed");
        let result = TaskResult::failure(
            TaskErrorKind::RedeliveriesExhausted,
            format!(
                "delivered {delivered} times without a result (workers stopped while running it)"
            ),
        );
        attempt.ended(finish(shared, &msg, &task, result, started_at).await);
        return;
    }
    if delivered > 1 && already_done(&shared.bus, &task).await {
        debug!(run = %task.run_id, task = %task.task_id, "Redelivered task already has a result; acknowledging");
        attempt.not_run();
        let _ = msg.ack().await;
        return;
    }
    // A prefetched task waits for a slot, keeping its message alive; a stopping worker hands
    // it back at once.
    let Some(slot) = wait_for_slot(shared, &msg, stopping).await else {
        // A prefetched task the stopping worker never started: not an attempt.
        attempt.not_run();
        let _ = msg.ack_with(AckKind::Nak(None)).await;
        return;
    };
    // The attempt's place and slot — with the gauges and the registry's count that say it is
    // taken — given back while its agent waits for child runs.
    let occupancy: flotilla_context::slot::OccupancyFactory = {
        let (gauges, count) = (shared.slots.gauges(), Arc::clone(&shared.in_flight));
        Arc::new(move || Box::new((gauges.attempt(), InFlight::enter(Arc::clone(&count)))))
    };
    let slot = WorkerSlot::new(vec![held, slot], occupancy);
    let started_at = Timestamp::now();
    attempt.started = Instant::now();
    let events = EventEmitter::new(Some(shared.bus.clone()), &task, &shared.id, delivered);
    // The attempt's collaboration clients; the mailbox read position they share is committed
    // once the attempt's success is stored.
    let scope = Scope::from_envelope(&task, delivered, shared.bus.names().clone());
    let clients = match Clients::new(shared.bus.clone(), scope) {
        Ok(c) => c,
        Err(e) => {
            warn!(run = %task.run_id, task = %task.task_id, error = %e, "Cannot build the agent context");
            let result = TaskResult::failure(TaskErrorKind::Internal, e.to_string());
            slot.end();
            attempt.ended(finish(shared, &msg, &task, result, started_at).await);
            return;
        }
    };
    let started_event = Event::Workflow(WorkflowEvent {
        worker: Some(shared.id.clone()),
        started_at: Some(started_at),
        ..WorkflowEvent::phase(WorkflowPhase::TaskStarted)
    });
    let mut announced = shared.opts.started_event_delay.is_zero();
    if announced {
        events.emit(started_event.clone()).await;
    }

    let outcome = match shared.agents.resolve(task.agent.as_deref()) {
        Err(message) => Err(AgentError {
            kind: TaskErrorKind::UnknownAgent,
            message,
        }),
        Ok((_, agent)) => {
            let run_cancelled = shared.enter_run(task.run_id);
            let _leave = LeaveRun(shared, task.run_id);
            let cancel = shared.hard_stop.child_token();
            let timeout = task.timeout.get();
            let ctx = AgentContext::new(
                clients.clone(),
                cancel.clone(),
                Instant::now() + timeout,
                events.clone(),
                shared.id.clone(),
            )
            .with_slot(slot.clone());
            let announce = tokio::time::sleep(shared.opts.started_event_delay);
            tokio::pin!(announce);
            // Model calls and tools of the agent nest in its `invoke_agent` span.
            let run = agent.run(&task, ctx).instrument(attempt.span.clone());
            tokio::pin!(run);
            let deadline = tokio::time::sleep(timeout);
            tokio::pin!(deadline);
            let mut heartbeat = tokio::time::interval_at(
                tokio::time::Instant::now() + shared.opts.progress_interval(),
                shared.opts.progress_interval(),
            );
            loop {
                tokio::select! {
                    biased;
                    r = &mut run => {
                        if shared.hard_stop.is_cancelled() && r.is_err() {
                            // The worker is stopping and cancelled the agent: that is not the
                            // task's failure. Hand it back for another worker.
                            info!(run = %task.run_id, task = %task.task_id, "Handing an unfinished task back");
                            slot.end();
                            let _ = msg.ack_with(AckKind::Nak(None)).await;
                            return;
                        }
                        break r;
                    }
                    _ = &mut announce, if !announced => {
                        announced = true;
                        events.emit(started_event.clone()).await;
                    }
                    _ = heartbeat.tick() => {
                        if let Err(e) = msg.ack_with(AckKind::Progress).await {
                            debug!(error = %e, "Heartbeat failed");
                        }
                    }
                    _ = &mut deadline => {
                        cancel.cancel();
                        break Err(AgentError {
                            kind: TaskErrorKind::Timeout,
                            message: format!("the attempt exceeded its timeout of {}", humantime_serde::re::humantime::format_duration(timeout)),
                        });
                    }
                    _ = run_cancelled.cancelled() => {
                        cancel.cancel();
                        // The outcome is decided: a child wait ending now takes no slot.
                        slot.end();
                        // Let the agent observe the cancellation (an exec agent's processes
                        // are killed), then report the attempt cancelled.
                        let _ = tokio::time::timeout(Duration::from_secs(2), &mut run).await;
                        info!(run = %task.run_id, task = %task.task_id, "Attempt cancelled with its run");
                        break Err(AgentError::cancelled("the run was cancelled"));
                    }
                    _ = shared.hard_stop.cancelled() => {
                        cancel.cancel();
                        slot.end();
                        // Let the agent observe the cancellation, then hand the task back.
                        let _ = tokio::time::timeout(Duration::from_secs(2), &mut run).await;
                        info!(run = %task.run_id, task = %task.task_id, "Handing an unfinished task back");
                        let _ = msg.ack_with(AckKind::Nak(None)).await;
                        return;
                    }
                }
            }
        }
    };
    // The agent is done: its slot and its place go to the next task now.
    slot.end();
    shared.pace.record(attempt.started.elapsed());
    let result = match outcome {
        Ok(reply) => {
            let numeric_value = reply
                .numeric_value
                .or_else(|| extract_numeric_value(&reply.response));
            TaskResult {
                response: reply.response,
                tokens: reply.tokens,
                success: true,
                tools_used: reply.tools_used,
                numeric_value,
                error: None,
            }
        }
        Err(e) => TaskResult {
            error: Some(TaskError {
                kind: e.kind,
                message: e.message,
            }),
            ..TaskResult::failure(e.kind, "")
        },
    };
    let success = result.success;
    let stored = finish(shared, &msg, &task, result, started_at).await;
    attempt.ended(stored);
    if stored.is_some() && success {
        // At-least-once mailboxes: what the attempt read counts as consumed only now that its
        // success is stored. A crash before this point lets a redelivery read it again.
        if let Err(e) = clients.mailbox().commit().await {
            warn!(run = %task.run_id, task = %task.task_id, error = %e, "Could not commit the mailbox cursor; the messages read stay unread for this task");
        }
    } else if stored.is_some() {
        // A failed, timed-out or cancelled attempt takes its unfinished child runs with it.
        match clients
            .cancel_children(&format!(
                "parent attempt {} of {} ended without success",
                task.attempt, task.task_id
            ))
            .await
        {
            Ok(0) => {}
            Ok(n) => {
                debug!(run = %task.run_id, task = %task.task_id, children = n, "Cancelled the child runs of a failed attempt")
            }
            Err(e) => {
                warn!(run = %task.run_id, task = %task.task_id, error = %e, "Could not cancel the child runs of a failed attempt")
            }
        }
    }
}

/// Publishes the result durably, then acknowledges the task. Returns the outcome of the
/// result stored, or `None` when the task was handed back.
async fn finish(
    shared: &Shared,
    msg: &jetstream::Message,
    task: &TaskEnvelope,
    result: TaskResult,
    started_at: Timestamp,
) -> Option<AttemptOutcome> {
    let success = result.success;
    let mut outcome = match &result.error {
        _ if success => AttemptOutcome::Succeeded,
        Some(e) => AttemptOutcome::Failed(e.kind),
        None => AttemptOutcome::Failed(TaskErrorKind::AgentFailed),
    };
    let entry = RunLogEntry {
        protocol: PROTOCOL_VERSION,
        run_id: task.run_id,
        input: RunInput::TaskResult(Box::new(TaskResultInput {
            task_id: task.task_id.clone(),
            attempt: task.attempt,
            attempt_id: task.attempt_id,
            worker: shared.id.clone(),
            started_at: Some(started_at),
            result,
        })),
    };
    let msg_id = result_msg_id(task.run_id, &task.task_id, task.attempt);
    let out = match wire::encode(&entry, Codec::Json, Some(&msg_id)) {
        Ok(o) => o,
        Err(e) => {
            warn!(error = %e, "Cannot encode a result; handing the task back");
            let _ = msg.ack_with(AckKind::Nak(None)).await;
            return None;
        }
    };
    let subject = shared.bus.names().runlog(task.run_id);
    let limit = shared.bus.max_payload().saturating_sub(RESULT_HEADROOM);
    let mut out = if out.payload.len() > limit {
        let size = out.payload.len();
        warn!(run = %task.run_id, task = %task.task_id, size, limit, "Result too large for this deployment; reporting result_too_large");
        outcome = AttemptOutcome::Failed(TaskErrorKind::ResultTooLarge);
        match too_large_entry(shared, task, started_at, size, limit) {
            Some(o) => o,
            None => {
                let _ = msg.ack_with(AckKind::Nak(None)).await;
                return None;
            }
        }
    } else {
        out
    };
    // Until the result is stored, the task's message is kept alive at the heartbeat's pace,
    // however long storing takes (a run-log stream without a leader for a few seconds while
    // a cluster node dies, an acknowledgement that never comes and times out): were the ack
    // wait to pass, the task would be redelivered and its attempt run again.
    let stored = {
        let publish = async {
            let mut backoff = Duration::from_millis(100);
            loop {
                match shared
                    .bus
                    .publish_encoded(subject.clone(), out.clone())
                    .await
                {
                    Ok(_) => return true,
                    Err(e) if e.kind() == PublishErrorKind::TooLarge => {
                        // The server's limit is lower than the one announced at connect time.
                        warn!(run = %task.run_id, task = %task.task_id, error = %e, "Result refused as too large; reporting result_too_large");
                        outcome = AttemptOutcome::Failed(TaskErrorKind::ResultTooLarge);
                        match too_large_entry(shared, task, started_at, out.payload.len(), limit) {
                            Some(o) => out = o,
                            None => return false,
                        }
                    }
                    Err(e) if !shared.hard_stop.is_cancelled() => {
                        warn!(run = %task.run_id, task = %task.task_id, error = %e, "Result not stored yet; retrying");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                    Err(e) => {
                        warn!(run = %task.run_id, task = %task.task_id, error = %e, "Stopping before the result was stored; handing the task back");
                        return false;
                    }
                }
            }
        };
        tokio::pin!(publish);
        let mut progress = tokio::time::interval_at(
            tokio::time::Instant::now() + shared.opts.progress_interval(),
            shared.opts.progress_interval(),
        );
        loop {
            tokio::select! {
                stored = &mut publish => break stored,
                _ = progress.tick() => {
                    if let Err(e) = msg.ack_with(AckKind::Progress).await {
                        debug!(error = %e, "Heartbeat failed while storing the result");
                    }
                }
            }
        }
    };
    if !stored {
        let _ = msg.ack_with(AckKind::Nak(None)).await;
        return None;
    }
    if let Err(e) = msg.ack().await {
        debug!(error = %e, "Task ack failed; a redelivery will find the result already stored");
    }
    debug!(run = %task.run_id, task = %task.task_id, attempt = task.attempt, success, "Task finished");
    Some(outcome)
}

/// Room kept below the server's max payload for a result's headers.
const RESULT_HEADROOM: usize = 512;

/// Unregisters an attempt from its run's cancellation when the attempt ends.
struct LeaveRun<'a>(&'a Shared, RunId);

impl Drop for LeaveRun<'_> {
    fn drop(&mut self) {
        self.0.leave_run(self.1);
    }
}

/// The run-log entry of a `result_too_large` failure for a result of `size` bytes.
fn too_large_entry(
    shared: &Shared,
    task: &TaskEnvelope,
    started_at: Timestamp,
    size: usize,
    limit: usize,
) -> Option<wire::Outgoing> {
    let result = TaskResult::failure(
        TaskErrorKind::ResultTooLarge,
        format!(
            "the result is {size} bytes; this deployment's messages hold at most {limit}. Return large outputs by reference: store them as an artifact (object store) or workspace entries, and answer with the reference"
        ),
    );
    let entry = RunLogEntry {
        protocol: PROTOCOL_VERSION,
        run_id: task.run_id,
        input: RunInput::TaskResult(Box::new(TaskResultInput {
            task_id: task.task_id.clone(),
            attempt: task.attempt,
            attempt_id: task.attempt_id,
            worker: shared.id.clone(),
            started_at: Some(started_at),
            result,
        })),
    };
    let msg_id = result_msg_id(task.run_id, &task.task_id, task.attempt);
    match wire::encode(&entry, Codec::Json, Some(&msg_id)) {
        Ok(o) => Some(o),
        Err(e) => {
            warn!(error = %e, "Cannot encode a failure result");
            None
        }
    }
}

/// A task message that does not decode: if its run, task and attempt can still be read, its
/// attempt fails with `bad_envelope` (final), so the run does not wait for it forever;
/// otherwise it is terminated with a log line.
async fn report_bad_envelope(shared: &Shared, msg: &jetstream::Message, error: &str) {
    #[derive(Deserialize)]
    struct Ids {
        run_id: RunId,
        task_id: flotilla_model::TaskId,
        attempt: u32,
        attempt_id: flotilla_model::AttemptId,
    }
    let Ok(ids) = serde_json::from_slice::<Ids>(&msg.payload) else {
        warn!(subject = %msg.subject, error, "Unreadable task envelope without readable ids; terminating it");
        let _ = msg.ack_with(AckKind::Term).await;
        return;
    };
    warn!(run = %ids.run_id, task = %ids.task_id, error, "Unreadable task envelope; reporting bad_envelope");
    let entry = RunLogEntry {
        protocol: PROTOCOL_VERSION,
        run_id: ids.run_id,
        input: RunInput::TaskResult(Box::new(TaskResultInput {
            task_id: ids.task_id.clone(),
            attempt: ids.attempt,
            attempt_id: ids.attempt_id,
            worker: shared.id.clone(),
            started_at: Some(Timestamp::now()),
            result: TaskResult::failure(
                TaskErrorKind::BadEnvelope,
                format!("the task envelope could not be read: {error}"),
            ),
        })),
    };
    let msg_id = result_msg_id(ids.run_id, &ids.task_id, ids.attempt);
    match shared
        .bus
        .publish(shared.bus.names().runlog(ids.run_id), &entry, Some(&msg_id))
        .await
    {
        Ok(_) => {
            let _ = msg.ack().await;
        }
        Err(e) => {
            warn!(error = %e, "Could not report a bad envelope; it will be redelivered");
            let _ = msg
                .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                .await;
        }
    }
}

/// One delivered task's attempt as seen by metrics and traces: its `invoke_agent` span, and
/// its duration recorded by outcome when it ends — however it ends (a path that returns
/// without a stored result handed the task back).
struct Attempt<'a> {
    shared: &'a Shared,
    task: &'a TaskEnvelope,
    agent: &'a str,
    span: tracing::Span,
    started: Instant,
    /// Set once recorded (or when the message turned out not to be an attempt).
    done: bool,
}

impl<'a> Attempt<'a> {
    fn new(shared: &'a Shared, task: &'a TaskEnvelope) -> Self {
        // The label and span name: the agent that runs it (the task's, else the default).
        let agent = match shared.agents.resolve(task.agent.as_deref()) {
            Ok((name, _)) => name,
            Err(_) => task.agent.as_deref().unwrap_or("none"),
        };
        Self {
            shared,
            task,
            agent,
            span: spans::invoke_agent(task, agent, &shared.id),
            started: Instant::now(),
            done: false,
        }
    }

    /// The result is stored with `outcome` (`None`: the task was handed back).
    fn ended(&mut self, outcome: Option<AttemptOutcome>) {
        let outcome = outcome.unwrap_or(AttemptOutcome::HandedBack);
        if outcome != AttemptOutcome::Succeeded {
            spans::failed(&self.span, outcome.as_str());
        }
        TaskAttemptFinished {
            run: self.task.run_id,
            task: &self.task.task_id,
            attempt: self.task.attempt,
            pool: &self.shared.opts.pool,
            agent: self.agent,
            outcome,
            duration: self.started.elapsed(),
        }
        .emit(&self.shared.metrics);
        self.done = true;
    }

    /// The message needed no attempt (its result was already stored).
    fn not_run(&mut self) {
        self.done = true;
    }
}

impl Drop for Attempt<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.ended(None);
        }
    }
}

/// Counts an attempt as running while alive (the registry's `in_flight`).
struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    fn enter(counter: Arc<AtomicUsize>) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        Self(counter)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Waits for a free agent slot, sending in-progress acknowledgements meanwhile so the waiting
/// message is not redelivered. `None` when the worker stops first.
async fn wait_for_slot(
    shared: &Shared,
    msg: &jetstream::Message,
    stopping: &CancellationToken,
) -> Option<tokio::sync::OwnedSemaphorePermit> {
    if let Ok(p) = Arc::clone(&shared.run_slots).try_acquire_owned() {
        return Some(p);
    }
    let mut progress = tokio::time::interval_at(
        tokio::time::Instant::now() + shared.opts.progress_interval(),
        shared.opts.progress_interval(),
    );
    let acquire = Arc::clone(&shared.run_slots).acquire_owned();
    tokio::pin!(acquire);
    loop {
        tokio::select! {
            p = &mut acquire => return p.ok(),
            _ = stopping.cancelled() => return None,
            _ = progress.tick() => {
                let _ = msg.ack_with(AckKind::Progress).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefetch_waits_for_short_attempts_and_stops_at_a_long_one() {
        let pace = Pace::new();
        assert!(!pace.short(), "unknown pace: no prefetch");
        pace.record(Duration::from_micros(300));
        assert!(pace.short());
        for _ in 0..20 {
            pace.record(Duration::from_millis(2));
        }
        assert!(pace.short(), "quick attempts keep prefetching");
        // One model call ends it at once …
        pace.record(Duration::from_secs(2));
        assert!(!pace.short());
        // … and it takes a run of quick attempts to come back.
        let mut quick = 0;
        while !pace.short() {
            pace.record(Duration::from_millis(1));
            quick += 1;
            assert!(quick < 100, "never came back");
        }
        assert!(quick >= 5, "{quick}");
        let slow = Pace::new();
        slow.record(PREFETCH_MAX_ATTEMPT);
        assert!(!slow.short(), "{PREFETCH_MAX_ATTEMPT:?} is not short");
    }
}
