//! The Flotilla coordinator: plan intake, validation, scheduling and run completion.
//!
//! Stateless: every run lives in JetStream (the run log and the `flotilla-runs` KV bucket),
//! so any number of coordinators may run side by side. They share one durable consumer on
//! the intake stream and one on the run log; compare-and-set on each run's snapshot keeps
//! them from ever double-scheduling.
//!
//! * [`machine`]: the pure run machine (`flotilla-machine`), the only place a run's decisions
//!   are made.
//! * [`store`]: writing run records (the read side is `flotilla-runs`).
//! * The runtime (private): applies run-log inputs and performs the machine's actions.
//! * Intake and API (private): submissions from the intake stream and `<prefix>.api.*`.
//!
//! ```no_run
//! # async fn run(bus: flotilla_bus::Bus) -> Result<(), Box<dyn std::error::Error>> {
//! use flotilla_coordinator::{Coordinator, CoordinatorOptions};
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! Coordinator::new(bus, CoordinatorOptions::default(), Default::default(), Default::default())
//!     .run(shutdown)
//!     .await?;
//! # Ok(()) }
//! ```

mod admission;
mod api;
mod approval_store;
pub mod error;
mod events;
mod intake;
mod lineage;
mod live;
pub mod memory;
mod notices;
pub mod options;
pub mod planner;
mod pull;
mod quota;
mod runtime;
pub mod store;
mod topics;
mod trust;

/// The run machine, re-exported: the coordinator applies inputs through it.
pub use flotilla_machine as machine;
/// Run trees and sessions as read, and the event projection engine (the read model's).
pub use flotilla_runs::{tree, watch};

use std::sync::Arc;

use async_nats::jetstream::AckKind;
use async_nats::jetstream::consumer::PullConsumer;
use flotilla_bus::liveness::{Pulse, Stall, Watchdog};
use flotilla_bus::startup::Patience;
use flotilla_bus::{Bus, JetStreamOptions, SharedConsumer};
use flotilla_model::subjects::StreamKind;
use flotilla_model::validate::ValidationContext;
use flotilla_telemetry::events::ConsumerStalled;
use flotilla_telemetry::{InternalEvent, Metrics};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

pub use error::{CoordinatorError, CoordinatorErrorKind, StoreError, StoreErrorKind};
pub use options::CoordinatorOptions;
pub use planner::PlannerOptions;

use crate::intake::{Answer, Intake, Source};
use crate::live::LiveWorkers;
use crate::runtime::Runtime;
use crate::store::{RunStore, unix_ms};

// Used across the coordinator's modules, which name them at the crate root.
pub(crate) use events::publish_event;
pub(crate) use pull::{MAX_REDELIVERY_DELAY, PULL_HEARTBEAT};

/// Deliveries of an intake message that keeps failing with a terminal error before it is
/// set aside (terminated) instead of redelivered forever.
const MAX_INTAKE_DELIVERIES: i64 = 5;

/// Deliveries of an intake message that keeps failing for a reason that may pass (NATS
/// unavailable) before it is set aside with an error line: pausing 1 s doubling to
/// [`MAX_REDELIVERY_DELAY`], about a quarter of an hour — far beyond a leader election or a
/// server restart.
const MAX_INTAKE_RETRIES: i64 = 30;

/// A coordinator process.
#[derive(Debug)]
pub struct Coordinator {
    bus: Bus,
    opts: CoordinatorOptions,
    ctx: ValidationContext,
    jetstream: JetStreamOptions,
    ready: Option<tokio::sync::oneshot::Sender<()>>,
    metrics: Metrics,
    /// Metadata of the API micro service (`$SRV.INFO`).
    service_metadata: std::collections::HashMap<String, String>,
    /// The interval of the stall check of its pull loops ([`Coordinator::with_heartbeat`]).
    heartbeat: std::time::Duration,
    /// The tenant whose installation it serves ([`Coordinator::with_tenant`]).
    tenant: Option<flotilla_model::tenant::TenantName>,
}

/// How long a starting coordinator waits to read its installation's quotas before it
/// admits runs without them (they apply as soon as it reads them).
const QUOTA_SYNC_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The stall check's interval when nobody sets one: the workers' default heartbeat.
const DEFAULT_HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(5);

/// The `$SRV.INFO` metadata key under which a coordinator advertises its deployment's
/// configuration fingerprint (see [`Coordinator::with_service_metadata`]).
pub const FINGERPRINT_METADATA: &str = "fingerprint";

fn setup(
    detail: impl Into<String>,
    e: impl std::error::Error + Send + Sync + 'static,
) -> CoordinatorError {
    CoordinatorError::with_source(CoordinatorErrorKind::Setup, detail, e)
}

impl Coordinator {
    /// A coordinator on `bus`. `ctx` says which pools and agents plans may name.
    pub fn new(
        bus: Bus,
        opts: CoordinatorOptions,
        ctx: ValidationContext,
        jetstream: JetStreamOptions,
    ) -> Self {
        Self {
            bus,
            opts,
            ctx,
            jetstream,
            ready: None,
            metrics: Metrics::new(),
            service_metadata: Default::default(),
            heartbeat: DEFAULT_HEARTBEAT,
            tenant: None,
        }
    }

    /// Names the tenant whose installation this coordinator serves (`nats.tenant`): its
    /// quota refusals and usage say so. Its bus already has the tenant's names.
    pub fn with_tenant(mut self, tenant: Option<flotilla_model::tenant::TenantName>) -> Self {
        self.tenant = tenant;
        self
    }

    /// The interval of the stall check of its pull loops (the run log, the intake, the
    /// workspace): a loop that makes no pull for two of them while its consumer holds
    /// messages is restarted, logged and counted (`flotilla_consumer_stalls_total`).
    /// `flotilla coordinator` gives it the deployment's `[worker] heartbeat` (5 s by default).
    pub fn with_heartbeat(mut self, heartbeat: std::time::Duration) -> Self {
        self.heartbeat = heartbeat;
        self
    }

    /// Advertises `metadata` with the API micro service (`$SRV.INFO.<prefix>`): standard NATS
    /// tooling shows it, and `flotilla up --nats-url` reads [`FINGERPRINT_METADATA`] to tell
    /// its own deployment's coordinators from another deployment's on the same prefix.
    pub fn with_service_metadata(
        mut self,
        metadata: std::collections::HashMap<String, String>,
    ) -> Self {
        self.service_metadata = metadata;
        self
    }

    /// Records this coordinator's metrics (submissions, runs and tasks finished, dispatches,
    /// retries, dependency hops, compare-and-set conflicts) in `metrics` — the process's
    /// registry, served on `/metrics` — instead of a private one.
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Signals `ready` once streams and buckets are provisioned and the coordinator's consumers
    /// are bound (for readiness probes).
    pub fn on_ready(mut self, ready: tokio::sync::oneshot::Sender<()>) -> Self {
        self.ready = Some(ready);
        self
    }

    async fn consumer(
        &self,
        kind: StreamKind,
        filters: Vec<String>,
        patience: &Patience,
    ) -> Result<PullConsumer, CoordinatorError> {
        let durable = match kind {
            StreamKind::Intake => self.bus.names().intake_consumer(),
            StreamKind::Workspace => self.bus.names().workspace_consumer(),
            _ => self.bus.names().runlog_consumer(),
        };
        let spec = SharedConsumer {
            stream: kind,
            durable: durable.to_owned(),
            description: "Flotilla coordinators (shared)".into(),
            filters,
            ack_wait: self.opts.ack_wait,
            max_ack_pending: 20_000,
            only_new: false,
        };
        patience
            .ride_out(&format!("binding consumer {durable}"), || {
                self.bus.shared_consumer(spec.clone())
            })
            .await
            .map_err(|e| setup("setting up a coordinator consumer", e))
    }

    /// Runs until `shutdown` is cancelled. Starting, it rides out JetStream being briefly
    /// unavailable (a cluster node restarting, a leader election) for up to
    /// `coordinator.startup-wait`; stopped meanwhile, it returns without an error.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), CoordinatorError> {
        self.opts
            .validate()
            .map_err(|e| CoordinatorError::new(CoordinatorErrorKind::Config, e))?;
        let stopping = shutdown.clone();
        match self.serve(shutdown).await {
            Err(e) if stopping.is_cancelled() => {
                info!(error = %e, "Coordinator stopped while starting");
                Ok(())
            }
            other => other,
        }
    }

    async fn serve(mut self, shutdown: CancellationToken) -> Result<(), CoordinatorError> {
        let patience = Patience::new(self.opts.startup_wait, shutdown.clone());
        patience
            .ride_out("provisioning streams and buckets", || {
                self.bus.provision(&self.jetstream)
            })
            .await
            .map_err(|e| setup("provisioning streams and buckets", e))?;
        let store = patience
            .ride_out("opening the run store", || RunStore::open(&self.bus))
            .await
            .map_err(|e| setup("opening the run store", e))?;
        let runlog = self
            .consumer(
                StreamKind::RunLog,
                vec![self.bus.names().run_inputs_all()],
                &patience,
            )
            .await?;
        let intake_consumer = self
            .consumer(
                StreamKind::Intake,
                vec![self.bus.names().submit()],
                &patience,
            )
            .await?;
        let workspace_consumer = self
            .consumer(
                StreamKind::Workspace,
                vec![self.bus.names().workspace_everything()],
                &patience,
            )
            .await?;
        let live = LiveWorkers::new(self.jetstream.worker_ttl);
        let trust = if self.opts.hitl.trust.enabled {
            let kv = patience
                .ride_out("opening the trust bucket", || {
                    self.bus.kv(flotilla_model::subjects::Bucket::Trust)
                })
                .await
                .map_err(|e| setup("opening the trust bucket", e))?;
            let mirror = flotilla_bus::mirror::KvMirror::new();
            mirror.follow(kv, shutdown.clone());
            // Admit nothing with levels not read yet (this coordinator is not ready, and
            // nothing relying on it answers, until they are).
            info!("Reading the earned trust levels before starting");
            tokio::select! {
                _ = mirror.synced() => {}
                _ = shutdown.cancelled() => return Ok(()),
            }
            trust::Trust::from_mirror(mirror)
        } else {
            trust::Trust::default()
        };
        // The installation's quotas, followed from the usage bucket: admissions and run ends
        // read them from memory (without quotas they cost nothing).
        let quota = {
            let mut ledger = patience
                .ride_out("opening the usage bucket", || {
                    flotilla_tenants::ledger::Ledger::open(&self.bus)
                })
                .await
                .map_err(|e| setup("opening the usage bucket", e))?
                .with_tenant(self.tenant.clone());
            ledger.follow(shutdown.clone());
            tokio::select! {
                _ = ledger.synced() => {}
                _ = tokio::time::sleep(QUOTA_SYNC_WAIT) => {
                    // NATS permissions of an older deployment (no usage bucket): the watch
                    // keeps trying, and quotas apply once it reads them.
                    warn!(
                        "The installation's quotas cannot be read yet (the coordinator's NATS user needs the usage bucket, see deploy/nats/accounts.conf); admitting without them until they can"
                    );
                }
                _ = shutdown.cancelled() => return Ok(()),
            }
            Arc::new(quota::Quota::new(ledger, store.clone()).with_metrics(self.metrics.clone()))
        };
        let runtime = Arc::new(
            Runtime::new(
                store.clone(),
                self.bus.clone(),
                self.opts.clone(),
                self.ctx.clone(),
                live.clone(),
                self.jetstream.duplicate_window,
                self.metrics.clone(),
            )
            .with_trust(trust.clone())
            .with_quota(Arc::clone(&quota)),
        );
        let workers = patience
            .ride_out("opening the workers bucket", || {
                self.bus.kv(flotilla_model::subjects::Bucket::Workers)
            })
            .await
            .map_err(|e| setup("opening the workers bucket", e))?;
        let intake = Arc::new(
            Intake::new(
                store.clone(),
                self.ctx.clone(),
                live.clone(),
                self.metrics.clone(),
                self.opts.planner.clone(),
                Arc::new(lineage::Lineages::new(
                    store.clone(),
                    lineage::TreeLimits::of(&self.opts),
                )),
            )
            .with_memory(memory::Memory::new(
                self.bus.clone(),
                self.opts.memory.clone(),
            ))
            .with_hitl(self.opts.hitl.clone())
            .with_trust(trust)
            .with_quota(quota),
        );
        // Every pull loop marks its pulls; one that stops pulling while its consumer holds
        // messages is restarted (`flotilla_bus::liveness`).
        let metrics = self.metrics.clone();
        let watchdog = Watchdog::new(
            self.heartbeat,
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
        let runlog_pulse = watchdog.watch(&runlog);
        let intake_pulse = watchdog.watch(&intake_consumer);
        let workspace_pulse = watchdog.watch(&workspace_consumer);
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(Arc::clone(&watchdog).run(shutdown.clone()));
        tasks.spawn(live.clone().follow(workers, shutdown.clone()));
        tasks.spawn(Arc::clone(&runtime).run(runlog, runlog_pulse, shutdown.clone()));
        tasks.spawn(topics::watch_workspace(
            self.bus.clone(),
            workspace_consumer,
            workspace_pulse,
            shutdown.clone(),
        ));
        tasks.spawn(consume_intake(
            intake_consumer,
            Arc::clone(&intake),
            self.opts.intake_concurrency,
            intake_pulse,
            shutdown.clone(),
        ));
        // Ready once it answers as it should: the live workers known (from the registry's
        // history) and, with the API, every endpoint subscribed.
        let answering = {
            let live = live.clone();
            async move { live.synced().await }
        };
        let api_bound = if self.opts.api {
            let (store, intake, shutdown) = (store.clone(), Arc::clone(&intake), shutdown.clone());
            let ctx = self.ctx.clone();
            let metadata = std::mem::take(&mut self.service_metadata);
            let (bound, api_bound) = tokio::sync::oneshot::channel();
            tasks.spawn(async move {
                if let Err(e) =
                    api::serve(store, intake, ctx, live, metadata, shutdown, bound).await
                {
                    warn!(error = %e, "The API service stopped");
                }
            });
            Some(api_bound)
        } else {
            None
        };
        let started = async {
            answering.await;
            match api_bound {
                Some(bound) => bound.await.is_ok(),
                None => true,
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => {}
            started = started => if started {
                if let Some(ready) = self.ready.take() {
                    let _ = ready.send(());
                }
                info!(prefix = self.bus.names().prefix(), "Coordinator started");
            }
        }
        while tasks.join_next().await.is_some() {}
        info!("Coordinator stopped");
        Ok(())
    }
}

/// Consumes the intake stream: each submission is validated and accepted or rejected, up to
/// `concurrency` at once. `pulse` marks each pull for the stall check; waiting for a free
/// place among the submissions under way is busy, not stalled.
async fn consume_intake(
    consumer: PullConsumer,
    intake: Arc<Intake>,
    concurrency: usize,
    pulse: Pulse,
    shutdown: CancellationToken,
) {
    let places = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let mut handling = tokio::task::JoinSet::new();
    while !shutdown.is_cancelled() {
        // One life of the message stream; the submissions it started run on in `handling`.
        let life = async {
            let messages = match consumer
                .stream()
                .max_messages_per_batch(concurrency)
                .heartbeat(crate::PULL_HEARTBEAT)
                .expires(flotilla_bus::consume::LONG_PULL_EXPIRY)
                .messages()
                .await
            {
                Ok(m) => m,
                Err(e) => {
                    warn!(error = %e, "Cannot pull from the intake; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => {}
                        _ = tokio::time::sleep(std::time::Duration::from_millis(500)) => {}
                    }
                    return;
                }
            };
            pulse.pulled();
            // A lost pull request (its consumer's leader died) ends the stream: pull again.
            let messages = flotilla_bus::consume::until_stalled(messages);
            futures::pin_mut!(messages);
            loop {
                let place = {
                    let _full = pulse.busy();
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        p = Arc::clone(&places).acquire_owned() => match p { Ok(p) => p, Err(_) => return },
                    }
                };
                let msg = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    m = messages.next() => match m {
                        Some(Ok(m)) => m,
                        Some(Err(_)) => continue,
                        None => return,
                    },
                };
                pulse.pulled();
                let intake = Arc::clone(&intake);
                handling.spawn(async move {
                    submit_one(&intake, msg).await;
                    drop(place);
                });
                while handling.try_join_next().is_some() {}
            }
        };
        let _ = pulse.attend(life).await;
    }
    // Submissions under way finish (their acknowledgement decides what happens to them).
    while handling.join_next().await.is_some() {}
}

/// Validates and accepts or rejects one submission from the intake stream, then acknowledges
/// it — or hands it back for another try, bounded: see [`MAX_INTAKE_DELIVERIES`] and
/// [`MAX_INTAKE_RETRIES`].
async fn submit_one(intake: &Intake, msg: async_nats::jetstream::Message) {
    let Ok(info) = msg.info() else {
        let _ = msg.ack_with(AckKind::Term).await;
        return;
    };
    let source = Source::Intake {
        seq: info.stream_sequence,
        now_ms: unix_ms(info.published),
    };
    let delivered = info.delivered;
    match intake
        .submit(msg.headers.as_ref(), &msg.payload, source)
        .await
    {
        Ok(Answer::Now(_) | Answer::AtEnd | Answer::WaitFor(_)) => {
            let _ = msg.ack().await;
        }
        Ok(Answer::Later(pause)) => {
            // Its quota queues: handed back until a slot frees (the intake refuses it once
            // it has waited `quota::QUEUE_WAIT`).
            let _ = msg.ack_with(AckKind::Nak(Some(pause))).await;
        }
        Err(e)
            if delivered >= MAX_INTAKE_DELIVERIES
                && e.kind().retry() == flotilla_bus::Retry::Terminal =>
        {
            // It fails the same way every time: set it aside, loudly.
            tracing::error!(error = %e, delivered, "Submission cannot be processed; terminating it");
            let _ = msg.ack_with(AckKind::Term).await;
        }
        Err(e) if delivered >= MAX_INTAKE_RETRIES => {
            // It kept failing for a quarter of an hour: set it aside, loudly.
            tracing::error!(error = %e, delivered, "Submission could not be handled, delivery after delivery; terminating it");
            let _ = msg.ack_with(AckKind::Term).await;
        }
        Err(e) => {
            let pause = flotilla_bus::consume::redelivery_delay(
                delivered,
                std::time::Duration::from_secs(1),
                MAX_REDELIVERY_DELAY,
            );
            warn!(error = %e, delivered, retry_in = ?pause, "Submission could not be handled; it will be redelivered");
            let _ = msg.ack_with(AckKind::Nak(Some(pause))).await;
        }
    }
}
