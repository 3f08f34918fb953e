//! The worker: setting up its consumer, registry entry and cancel watch, the pull loop that
//! asks for as many tasks as it has free slots (plus prefetch while attempts are short), and
//! the graceful stop that drains, then hands back, what is still running.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use flotilla_bus::liveness::{Pulse, Stall, Watchdog};
use flotilla_bus::startup::Patience;
use flotilla_bus::{Bus, SharedConsumer};
use flotilla_model::subjects::{Bucket, StreamKind};
use flotilla_model::time::Timestamp;
use flotilla_model::worker::WorkerInfo;
use flotilla_telemetry::events::ConsumerStalled;
use flotilla_telemetry::{InternalEvent, Metrics};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::agents::AgentRegistry;
use crate::cancel::watch_cancellations;
use crate::claim::{Claim, role_consumer};
use crate::error::{WorkerError, WorkerErrorKind, setup};
use crate::options::WorkerOptions;
use crate::pace::Pace;
use crate::pull::{Pulled, Queue, pull_once};
use crate::registry::register;
use crate::shared::Shared;

/// How long a busy worker gathers freed slots before asking for more tasks.
const GATHER: Duration = Duration::from_millis(1);

/// A worker process (or one of several in `flotilla up`).
#[derive(Debug)]
pub struct Worker {
    bus: Bus,
    opts: WorkerOptions,
    agents: Arc<AgentRegistry>,
    id: String,
    ready: Option<tokio::sync::oneshot::Sender<()>>,
    metrics: Metrics,
    /// The agent slots, when shared with the workers of other tenants in this process.
    run_slots: Option<Arc<Semaphore>>,
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
            run_slots: None,
        }
    }

    /// Runs attempts only in `slots`, shared with other workers of this process — one per
    /// tenant of a shared pool (`flotilla worker --tenants a,b`). Each tenant's worker still
    /// pulls its own queue for its own free places; an attempt then waits for a slot in
    /// turn (the semaphore is first come, first served), so a tenant whose queue floods the
    /// pool delays another's task by the attempts already waiting, not by its whole backlog,
    /// and no slot idles while any tenant has work.
    pub fn with_run_slots(mut self, slots: Arc<Semaphore>) -> Self {
        self.run_slots = Some(slots);
        self
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

    /// Binds the shared consumer of `spec` (`what` in errors and logs), riding out JetStream
    /// being briefly unavailable.
    async fn bind(
        &self,
        spec: SharedConsumer,
        what: &str,
        patience: &Patience,
    ) -> Result<PullConsumer, WorkerError> {
        patience
            .ride_out(what, || self.bus.shared_consumer(spec.clone()))
            .await
            .map_err(|e| setup(what.to_owned(), e))
    }

    /// Opens `bucket` (`what` in errors and logs), riding out JetStream being briefly
    /// unavailable.
    async fn open(
        &self,
        bucket: Bucket,
        what: &str,
        patience: &Patience,
    ) -> Result<async_nats::jetstream::kv::Store, WorkerError> {
        patience
            .ride_out(what, || self.bus.kv(bucket))
            .await
            .map_err(|e| setup(what.to_owned(), e))
    }

    /// The role queues this worker claims from: one consumer per role its agents fill, with
    /// the member that runs the role's tasks here.
    async fn role_consumers(
        &self,
        patience: &Patience,
    ) -> Result<Vec<(PullConsumer, Claim)>, WorkerError> {
        let mut out = Vec::new();
        for role in self.agents.roles() {
            let Some(agent) = self.agents.member_of(&role) else {
                continue;
            };
            let consumer = self
                .bind(
                    role_consumer(self.bus.names(), &role, &self.opts),
                    &format!("setting up the consumer of role {role}"),
                    patience,
                )
                .await?;
            let agent = agent.to_owned();
            out.push((consumer, Claim { role, agent }));
        }
        Ok(out)
    }

    /// Runs until `shutdown` is cancelled, then drains (see the module docs). Starting, it
    /// rides out JetStream being briefly unavailable (a cluster node restarting, a leader
    /// election) for up to `worker.provision-wait`; stopped meanwhile, it returns without an
    /// error.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), WorkerError> {
        self.opts
            .validate()
            .map_err(|e| WorkerError::new(WorkerErrorKind::Config, e))?;
        let stopping = shutdown.clone();
        match self.serve(shutdown).await {
            Err(e) if stopping.is_cancelled() => {
                info!(error = %e, "Worker stopped while starting");
                Ok(())
            }
            other => other,
        }
    }

    async fn serve(mut self, shutdown: CancellationToken) -> Result<(), WorkerError> {
        let patience = Patience::new(self.opts.provision_wait, shutdown.clone());
        let consumer = self
            .bind(
                pool_consumer(self.bus.names(), &self.opts.pool, &self.opts),
                "setting up the pool consumer",
                &patience,
            )
            .await?;
        let roles = self.role_consumers(&patience).await?;
        let turns = self
            .bind(
                crate::turn::turn_consumer(self.bus.names(), &self.opts.pool, &self.opts),
                "setting up the teammate turn consumer",
                &patience,
            )
            .await?;
        let inboxes = if self.opts.read_inboxes {
            Some(
                self.bind(
                    crate::inbox::inbox_consumer(self.bus.names(), &self.opts),
                    "setting up the teammate inbox consumer",
                    &patience,
                )
                .await?,
            )
        } else {
            None
        };
        let team_kv = self
            .open(Bucket::Team, "opening the team bucket", &patience)
            .await?;
        let registry = self
            .open(Bucket::Workers, "opening the workers bucket", &patience)
            .await?;
        let shared = Arc::new(Shared {
            bus: self.bus.clone(),
            opts: self.opts.clone(),
            agents: Arc::clone(&self.agents),
            id: self.id.clone(),
            in_flight: Arc::new(AtomicUsize::new(0)),
            run_slots: self
                .run_slots
                .clone()
                .unwrap_or_else(|| Arc::new(Semaphore::new(self.opts.concurrency))),
            hard_stop: CancellationToken::new(),
            runs: Mutex::new(HashMap::new()),
            cancelled: Mutex::new(HashSet::new()),
            held: Mutex::new(HashSet::new()),
            held_tasks: Mutex::new(HashSet::new()),
            next_attempt: std::sync::atomic::AtomicU64::new(0),
            slots: self
                .metrics
                .worker_slots(&self.opts.pool, self.opts.concurrency),
            metrics: self.metrics.clone(),
            pace: Pace::new(),
        });
        let control = self
            .open(Bucket::Control, "opening the control bucket", &patience)
            .await?;
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
            features: flotilla_model::worker::WORKER_FEATURES
                .iter()
                .chain(
                    inboxes
                        .is_some()
                        .then_some(&flotilla_model::worker::FEATURE_READS_INBOXES),
                )
                .map(|f| (*f).to_owned())
                .collect(),
        };
        let register_stop = CancellationToken::new();
        let registration = tokio::spawn(register(
            registry.clone(),
            info,
            Arc::clone(&shared),
            register_stop.clone(),
        ));
        // Every pull loop below marks its pulls; a loop that stops pulling while its consumer
        // holds messages is restarted (`flotilla_bus::liveness`).
        let metrics = self.metrics.clone();
        let watchdog = Watchdog::new(
            self.opts.heartbeat,
            Arc::new(move |s: &Stall| {
                ConsumerStalled {
                    stream: &s.stream,
                    consumer: &s.consumer,
                    pending: s.pending,
                    since_pull: s.since_pull,
                }
                .emit(&metrics);
            }),
        );
        let pulse = watchdog.watch(&consumer);
        let roles: Vec<_> = roles
            .into_iter()
            .map(|(c, claim)| (watchdog.watch(&c), c, claim))
            .collect();
        let turns_pulse = watchdog.watch(&turns);
        let inboxes = inboxes.map(|c| (watchdog.watch(&c), c));
        let watching = tokio::spawn(Arc::clone(&watchdog).run(shutdown.clone()));
        if let Some(ready) = self.ready.take() {
            let _ = ready.send(());
        }
        info!(worker = %self.id, pool = %self.opts.pool, concurrency = self.opts.concurrency, roles = ?roles.iter().map(|(_, _, c)| c.role.as_str()).collect::<Vec<_>>(), "Worker started");
        // Role queues, beside the pool's: pulled only while a slot is free here.
        let mut role_loops = tokio::task::JoinSet::new();
        for (pulse, consumer, claim) in roles {
            role_loops.spawn(pull_role(
                Arc::clone(&shared),
                consumer,
                claim,
                pulse,
                shutdown.clone(),
            ));
        }

        // Teammate turns, beside the pool's tasks: pulled only while a slot is free here.
        role_loops.spawn(crate::turn::pull_turns(
            Arc::clone(&shared),
            turns,
            team_kv.clone(),
            turns_pulse,
            shutdown.clone(),
        ));
        // Teammate turns taken straight from the inboxes (`read-inboxes`).
        if let Some((pulse, consumer)) = inboxes {
            role_loops.spawn(crate::inbox::pull_inboxes(
                Arc::clone(&shared),
                consumer,
                team_kv,
                pulse,
                shutdown.clone(),
            ));
        }

        // Messages held at once: the running ones plus `prefetch` waiting for a slot, so a
        // slot that frees finds its next task already here instead of idling on a pull.
        let slots = Arc::new(Semaphore::new(self.opts.concurrency + self.opts.prefetch));
        let mut running = tokio::task::JoinSet::new();
        // Whether the last pull request brought tasks.
        let mut busy = false;
        while !shutdown.is_cancelled() {
            // One pull, under the watchdog: a restart drops it (its permits go back) and the
            // loop pulls again; the attempts it started run on in `running`.
            let pulled = pulse
                .attend(pull_pool(
                    &shared,
                    &consumer,
                    &slots,
                    busy,
                    &pulse,
                    &mut running,
                    &shutdown,
                ))
                .await;
            match pulled {
                Some(Pulled::Received(n)) => busy = n > 0,
                Some(Pulled::Failed) => continue,
                Some(Pulled::Stopped) => break,
                None => busy = false,
            }
            // Reap finished tasks so the set does not grow.
            while running.try_join_next().is_some() {}
        }
        info!(worker = %self.id, in_flight = running.len(), "Worker stopping: no new tasks; draining");
        let grace = tokio::time::sleep(self.opts.shutdown_grace);
        tokio::pin!(grace);
        // The role loops end once their own attempts have (handed back at the grace's end).
        while !(running.is_empty() && role_loops.is_empty()) {
            tokio::select! {
                Some(_) = running.join_next(), if !running.is_empty() => {}
                Some(_) = role_loops.join_next(), if !role_loops.is_empty() => {}
                _ = &mut grace, if !shared.hard_stop.is_cancelled() => {
                    warn!(worker = %self.id, in_flight = running.len(), "Grace period over: handing back unfinished tasks");
                    shared.hard_stop.cancel();
                }
                else => break,
            }
        }
        register_stop.cancel();
        watcher_stop.cancel();
        let _ = watching.await;
        let _ = registration.await;
        let _ = watcher.await;
        let _ = registry.delete(&self.id).await;
        info!(worker = %self.id, "Worker stopped");
        Ok(())
    }
}

/// One pull of the pool loop: waits for free places (the running tasks plus `prefetch`; busy
/// meanwhile — a worker with no free slot does not pull, on purpose), asks for that many
/// tasks and starts what arrives in `running`.
async fn pull_pool(
    shared: &Arc<Shared>,
    consumer: &PullConsumer,
    slots: &Arc<Semaphore>,
    busy: bool,
    pulse: &Pulse,
    running: &mut tokio::task::JoinSet<()>,
    shutdown: &CancellationToken,
) -> Pulled {
    let waiting = pulse.busy();
    // While attempts are long (or not known yet), the prefetch places are held back for this
    // pull request: it asks only for free slots.
    let keep_back = match shared.opts.prefetch {
        0 => None,
        _ if shared.pace.short() => None,
        n => Some(tokio::select! {
            _ = shutdown.cancelled() => return Pulled::Stopped,
            p = Arc::clone(slots).acquire_many_owned(n as u32) => match p { Ok(p) => p, Err(_) => return Pulled::Stopped },
        }),
    };
    let first = tokio::select! {
        _ = shutdown.cancelled() => return Pulled::Stopped,
        p = Arc::clone(slots).acquire_owned() => match p { Ok(p) => p, Err(_) => return Pulled::Stopped },
    };
    drop(waiting);
    let mut permits = vec![first];
    while let Ok(p) = Arc::clone(slots).try_acquire_owned() {
        permits.push(p);
    }
    // A busy worker with many slots gathers freed slots for a moment, so it asks for tasks in
    // batches rather than one pull request per finished task.
    let gather = (shared.opts.concurrency / 4).max(1);
    if busy && permits.len() < gather {
        let until = tokio::time::Instant::now() + GATHER;
        while permits.len() < gather {
            match tokio::time::timeout_at(until, Arc::clone(slots).acquire_owned()).await {
                Ok(Ok(p)) => permits.push(p),
                _ => break,
            }
        }
    }
    let queue = Queue {
        consumer,
        pulse,
        claim: None,
    };
    let pulled = pull_once(shared, queue, &mut permits, busy, running, shutdown).await;
    drop(keep_back);
    pulled
}

/// Pulls `claim.role`'s queue while this worker has a free slot, until `shutdown`; then
/// waits for the attempts it started (the worker's graceful stop hands them back).
pub(crate) async fn pull_role(
    shared: Arc<Shared>,
    consumer: PullConsumer,
    claim: Claim,
    pulse: Pulse,
    shutdown: CancellationToken,
) {
    let mut running = tokio::task::JoinSet::new();
    // Tasks of this role held here at once, running or waiting for a slot.
    let held = Arc::new(Semaphore::new(shared.opts.concurrency));
    let mut busy = false;
    while !shutdown.is_cancelled() {
        let pull = async {
            // Claim only with a free slot, or — all taken — in turn with the tasks already
            // waiting for one here ([`Shared::wait_for_turn`]).
            let waiting = pulse.busy();
            if !shared.wait_for_turn(&shutdown).await {
                return Pulled::Stopped;
            }
            let free = shared.run_slots.available_permits().max(1);
            let first = tokio::select! {
                _ = shutdown.cancelled() => return Pulled::Stopped,
                p = Arc::clone(&held).acquire_owned() => match p { Ok(p) => p, Err(_) => return Pulled::Stopped },
            };
            drop(waiting);
            let mut permits = vec![first];
            while permits.len() < free {
                match Arc::clone(&held).try_acquire_owned() {
                    Ok(p) => permits.push(p),
                    Err(_) => break,
                }
            }
            let queue = Queue {
                consumer: &consumer,
                pulse: &pulse,
                claim: Some(&claim),
            };
            pull_once(&shared, queue, &mut permits, busy, &mut running, &shutdown).await
        };
        match pulse.attend(pull).await {
            Some(Pulled::Received(n)) => busy = n > 0,
            Some(Pulled::Failed) => continue,
            Some(Pulled::Stopped) => break,
            None => busy = false,
        }
        while running.try_join_next().is_some() {}
    }
    while running.join_next().await.is_some() {}
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
        only_new: false,
    }
}
