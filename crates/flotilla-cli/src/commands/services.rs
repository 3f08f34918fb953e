//! `flotilla coordinator`, `flotilla worker`, `flotilla supervisor`, `flotilla up`.
//!
//! Each service starts its HTTP listener first (`/healthz` answers while NATS connects), with
//! readiness conditions registered up front and flipped as start-up progresses:
//! `nats_connected` (follows the live connection), `provisioned`, and `consumers_bound` /
//! `consumer_bound` (signalled by the coordinator or worker itself). SIGTERM marks the service
//! draining, so `/readyz` answers 503 until it exits; the listener stops last.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use flotilla_bus::Bus;
use flotilla_bus::server::LocalNatsServer;
use flotilla_coordinator::Coordinator;
use flotilla_model::subjects::StreamKind;
use flotilla_model::subjects::WORKFLOW_POOL;
use flotilla_supervisor::Supervisor;
use flotilla_telemetry::events::ConsumerLag;
use flotilla_telemetry::{Condition, Health, HttpAddr, HttpServer, InternalEvent, Metrics};
use flotilla_worker::Worker;
use futures::StreamExt;
use tokio::sync::{oneshot, watch};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use super::signals::shutdown_on_signals;
use crate::config::Config;

/// A service's health, metrics and HTTP listener. The listener has its own stop token: it
/// keeps answering (503 on `/readyz`) while the service drains, and stops after it.
pub(super) struct Observability {
    health: Health,
    pub(super) metrics: Metrics,
    server: Option<HttpServer>,
    stop: CancellationToken,
}

impl Observability {
    /// Starts the listener on `addr` (unless off; `auto` takes the next free port when
    /// another service on this host has 9464). Register readiness conditions on `health`
    /// before calling this, so `/readyz` never reports ready too early.
    pub(super) async fn start(
        addr: HttpAddr,
        health: Health,
        metrics: Metrics,
    ) -> anyhow::Result<Self> {
        let stop = CancellationToken::new();
        let server = HttpServer::start(addr, health.clone(), metrics.clone(), stop.clone()).await?;
        Ok(Self {
            health,
            metrics,
            server,
            stop,
        })
    }

    /// Marks the service draining once `shutdown` fires.
    pub(super) fn drain_on(&self, shutdown: &CancellationToken) {
        let (shutdown, health) = (shutdown.clone(), self.health.clone());
        tokio::spawn(async move {
            shutdown.cancelled().await;
            health.set_draining();
        });
    }

    /// Stops the listener and the samplers.
    pub(super) async fn stop(self) {
        self.stop.cancel();
        if let Some(server) = self.server
            && let Err(e) = server.stopped().await
        {
            warn!(error = %e, "The HTTP listener failed");
        }
    }
}

/// `nats_connected` follows `bus`'s live connection state from now on.
pub(super) fn follow_connection(condition: &Condition, bus: &Bus) {
    let client = bus.client().clone();
    condition.follow(move || client.connection_state() == async_nats::connection::State::Connected);
}

/// Sets `conditions` when `ready` fires (a coordinator or worker bound its consumers).
pub(super) fn set_when_ready(ready: oneshot::Receiver<()>, conditions: Vec<Condition>) {
    tokio::spawn(async move {
        if ready.await.is_ok() {
            for c in conditions {
                c.set(true);
            }
        }
    });
}

/// Sets `conditions` when `ready` fires (this process's coordinator answers its API), and
/// returns what the services that rely on that coordinator wait for: they answer nobody
/// before it does (a prompt taken by a half-started process could not be cancelled).
fn when_coordinator_ready(
    ready: oneshot::Receiver<()>,
    conditions: Vec<Condition>,
) -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        if ready.await.is_ok() {
            for c in conditions {
                c.set(true);
            }
            let _ = tx.send(true);
        }
    });
    rx
}

/// Waits until this process's coordinator is ready: false when `shutdown` fires first or the
/// coordinator stopped before it was.
async fn wait_coordinator(mut ready: watch::Receiver<bool>, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        r = ready.wait_for(|r| *r) => r.is_ok(),
        () = shutdown.cancelled() => false,
    }
}

/// Runs `service` once this process's coordinator is ready; nothing if it never is.
async fn once_ready<E>(
    ready: watch::Receiver<bool>,
    shutdown: CancellationToken,
    service: impl std::future::Future<Output = Result<(), E>>,
) -> Result<(), E> {
    if !wait_coordinator(ready, &shutdown).await {
        return Ok(());
    }
    service.await
}

/// Samples a pool consumer's backlog every `interval` until `stop`: one JetStream API request
/// per sample, off the task path.
fn sample_consumer_lag(
    bus: Bus,
    pool: String,
    interval: Duration,
    metrics: Metrics,
    stop: CancellationToken,
) {
    metrics.init_pool(&pool);
    tokio::spawn(async move {
        let stream = bus.names().stream(StreamKind::Tasks);
        let durable = bus.names().pool_consumer(&pool);
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let info = match bus.js().get_stream_no_info(&stream).await {
                Ok(s) => s.consumer_info(&durable).await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match info {
                Ok(info) => ConsumerLag {
                    pool: &pool,
                    pending: info.num_pending,
                    ack_pending: info.num_ack_pending as u64,
                }
                .emit(&metrics),
                Err(e) => debug!(%pool, error = %e, "Cannot sample the pool consumer"),
            }
        }
    });
}

pub(crate) async fn coordinator(config: &Config) -> anyhow::Result<ExitCode> {
    let health = Health::new();
    let nats = health.condition("nats_connected");
    let ready = vec![
        health.condition("provisioned"),
        health.condition("consumers_bound"),
    ];
    let obs = Observability::start(config.telemetry.http_addr, health, Metrics::new()).await?;
    let shutdown = shutdown_on_signals()?;
    obs.drain_on(&shutdown);
    let bus = Bus::connect(&config.nats, "flotilla-coordinator")
        .instrument(info_span!("startup", flotilla.role = "coordinator"))
        .await?;
    follow_connection(&nats, &bus);
    let (tx, rx) = oneshot::channel();
    // The workflow worker (child runs through the API) and the exposed agents (runs
    // submitted, watched and cancelled through it) start once the coordinator answers.
    let started = when_coordinator_ready(rx, ready);
    let workflows = match workflow_worker(config).await? {
        Some(w) => {
            let w = w.with_metrics(obs.metrics.clone());
            let token = shutdown.clone();
            Some(tokio::spawn(once_ready(
                started.clone(),
                shutdown.clone(),
                async move { w.run(token).await },
            )))
        }
        None => None,
    };
    let exposer = match agents_exposer(config).await? {
        Some(e) => {
            let token = shutdown.clone();
            Some(tokio::spawn(once_ready(
                started,
                shutdown.clone(),
                async move { e.run(token).await },
            )))
        }
        None => None,
    };
    Coordinator::new(
        bus,
        config.coordinator.clone(),
        config.validation_context(),
        config.jetstream.clone(),
    )
    .with_metrics(obs.metrics.clone())
    .with_heartbeat(config.worker.heartbeat)
    .with_service_metadata(service_metadata(config))
    .with_tenant(tenant_of(config))
    .on_ready(tx)
    .run(shutdown)
    .await?;
    if let Some(w) = workflows {
        w.await??;
    }
    if let Some(e) = exposer {
        e.await??;
    }
    obs.stop().await;
    Ok(ExitCode::SUCCESS)
}

/// The tenant a coordinator serves (`nats.tenant`, validated with the configuration): its
/// quota refusals and usage name it.
fn tenant_of(config: &Config) -> Option<flotilla_model::tenant::TenantName> {
    config
        .nats
        .tenant
        .as_deref()
        .and_then(|t| flotilla_model::tenant::TenantName::new(t).ok())
}

/// The coordinators' server of the NATS Agent Protocol, when the configuration exposes
/// agents (`expose = true` on an agent, or `[agents-protocol] expose-all`): each coordinator
/// process registers every exposed agent on the `agents` micro service, so prompts are
/// shared among the replicas.
async fn agents_exposer(config: &Config) -> anyhow::Result<Option<flotilla_agents::Exposer>> {
    let agents = config.exposed_agents();
    if agents.is_empty() {
        return Ok(None);
    }
    if let Some(t) = &config.nats.tenant {
        warn!(
            tenant = %t,
            agents = agents.len(),
            "Agents are exposed on the NATS Agent Protocol, but a tenant takes no part in it (its subjects are shared by the whole account): not exposed"
        );
        return Ok(None);
    }
    let bus = Bus::connect(&config.nats, "flotilla-agents").await?;
    Ok(Some(flotilla_agents::Exposer::new(
        bus,
        config.agents_protocol.clone(),
        agents,
    )))
}

/// The supervisor of this configuration's members. It also serves the exposed persistent
/// teammates on the NATS Agent Protocol; the exposed definitions' addresses are the
/// coordinators', never a teammate's (a configuration whose exposed definitions collide is
/// refused when the coordinator starts, so here they are just left out).
pub(super) fn supervisor_of(config: &Config, bus: Bus) -> Supervisor {
    let definitions = flotilla_agents::Exposer::addresses(
        &config.agents_protocol,
        bus.names().prefix(),
        &config.exposed_agents(),
    )
    .unwrap_or_default();
    let supervisor = Supervisor::new(
        bus,
        config.supervisor.clone(),
        config.member_cards(),
        config.worker.heartbeat,
    )
    .with_validation(config.validation_context())
    .with_trust(config.hitl.trust.clone())
    .with_agents_protocol(config.agents_protocol.clone(), definitions);
    // The NATS Agent Protocol's subjects are shared by the whole account: a tenant takes no
    // part in it (its users have no rights there).
    if config.nats.tenant.is_some() {
        supervisor.without_agents_protocol()
    } else {
        supervisor
    }
}

/// `flotilla supervisor`: the team roster, presence and failure records; the team API.
/// Like a worker, it waits for the streams and buckets rather than creating them.
pub(crate) async fn supervisor(config: &Config) -> anyhow::Result<ExitCode> {
    let health = Health::new();
    let nats = health.condition("nats_connected");
    let provisioned = health.condition("provisioned");
    let bound = health.condition("consumer_bound");
    let obs = Observability::start(config.telemetry.http_addr, health, Metrics::new()).await?;
    let shutdown = shutdown_on_signals()?;
    obs.drain_on(&shutdown);
    let bus = connect_provisioned(
        config,
        "flotilla-supervisor",
        &nats,
        &provisioned,
        &shutdown,
    )
    .instrument(info_span!("startup", flotilla.role = "supervisor"))
    .await?;
    let Some(bus) = bus else {
        obs.stop().await;
        return Ok(ExitCode::SUCCESS);
    };
    let (tx, rx) = oneshot::channel();
    set_when_ready(rx, vec![bound]);
    supervisor_of(config, bus)
        .with_metrics(obs.metrics.clone())
        .on_ready(tx)
        .run(shutdown)
        .await?;
    obs.stop().await;
    Ok(ExitCode::SUCCESS)
}

/// How many workflow attempts one coordinator drives at once: each waiting one is a future,
/// not a worker slot.
const WORKFLOW_CONCURRENCY: usize = 1024;

/// The coordinator's embedded worker of the workflow pool ([`WORKFLOW_POOL`]), when the
/// configuration defines workflow agents (`sequential`, `parallel`, `loop`). It runs them as
/// any worker runs an agent — pulling, heartbeating, handing back on a stop — so a workflow
/// survives a coordinator crash like any task (redelivered to another coordinator, whose
/// attempt re-attaches to the children that exist).
async fn workflow_worker(config: &Config) -> anyhow::Result<Option<Worker>> {
    let registry = config.workflow_registry()?;
    if registry.is_empty() {
        return Ok(None);
    }
    let mut opts = config.worker.clone();
    opts.pool = WORKFLOW_POOL.to_owned();
    opts.concurrency = WORKFLOW_CONCURRENCY;
    // Workflow agents are no teammates: the pools' workers read the teammate inboxes.
    opts.read_inboxes = false;
    opts.id = opts.id.map(|id| format!("{id}-workflows"));
    let bus = Bus::connect(&config.nats, "flotilla-workflows").await?;
    Ok(Some(Worker::new(bus, opts, registry)))
}

pub(crate) async fn worker(config: &Config) -> anyhow::Result<ExitCode> {
    if let Some(warning) = crate::config::no_agents_warning(config) {
        warn!("{}", warning.trim_start_matches("warning: "));
    }
    let health = Health::new();
    let nats = health.condition("nats_connected");
    let provisioned = health.condition("provisioned");
    let bound = health.condition("consumer_bound");
    let obs = Observability::start(config.telemetry.http_addr, health, Metrics::new()).await?;
    let shutdown = shutdown_on_signals()?;
    obs.drain_on(&shutdown);
    let bus = connect_provisioned(config, "flotilla-worker", &nats, &provisioned, &shutdown)
        .instrument(
            info_span!("startup", flotilla.role = "worker", flotilla.pool = %config.worker.pool),
        )
        .await?;
    let Some(bus) = bus else {
        // Stopped while waiting: nothing ran.
        obs.stop().await;
        return Ok(ExitCode::SUCCESS);
    };
    sample_consumer_lag(
        bus.clone(),
        config.worker.pool.clone(),
        config.telemetry.consumer_lag_interval,
        obs.metrics.clone(),
        obs.stop.clone(),
    );
    let (tx, rx) = oneshot::channel();
    set_when_ready(rx, vec![bound]);
    Worker::new(bus, config.worker.clone(), config.agent_registry()?)
        .with_metrics(obs.metrics.clone())
        .on_ready(tx)
        .run(shutdown)
        .await?;
    obs.stop().await;
    Ok(ExitCode::SUCCESS)
}

/// Connects as `name`, follows the connection on `nats`, and waits until the streams and
/// buckets exist, then sets `provisioned`. Workers and supervisors only check that the
/// resources exist (least privilege), waiting for whoever creates them; `/readyz` says
/// `provisioned: false` meanwhile. `None`: `shutdown` fired while waiting.
pub(super) async fn connect_provisioned(
    config: &Config,
    name: &str,
    nats: &Condition,
    provisioned: &Condition,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<Bus>> {
    let bus = Bus::connect(&config.nats, name).await?;
    follow_connection(nats, &bus);
    if !wait_provisioned(&bus, config, shutdown).await? {
        return Ok(None);
    }
    provisioned.set(true);
    Ok(Some(bus))
}

/// How often a waiting worker looks for its streams and buckets again: a dozen JetStream
/// info requests per look, only while it starts.
const PROVISION_POLL: Duration = Duration::from_secs(1);
/// How often a waiting worker says what it waits for.
const PROVISION_LOG_EVERY: Duration = Duration::from_secs(5);

/// A worker only checks that the streams and buckets exist: creating and updating them is the
/// coordinator's and the operator's right (least privilege, `deploy/nats/accounts.conf`).
/// Missing resources are waited for — a worker that starts before any coordinator, as on a
/// fresh Kubernetes install, is not ready but does not crash — and so is JetStream answering
/// nothing or "no leader" for now (a cluster node restarting, a leader election), for up to
/// `worker.provision-wait`, with a log line every few seconds; then the worker stops with a
/// message saying how to create them. An error that will not pass (refused permissions)
/// stops it at once. Drift is logged and left to whoever provisions. `Ok(false)`: `shutdown`
/// fired while waiting.
async fn wait_provisioned(
    bus: &Bus,
    config: &Config,
    shutdown: &CancellationToken,
) -> anyhow::Result<bool> {
    let started = tokio::time::Instant::now();
    let give_up = started + config.worker.provision_wait;
    let mut next_log = started;
    loop {
        let now = tokio::time::Instant::now();
        let what = match check_resources(bus, config).await {
            Ok((missing, drifted)) if missing.is_empty() => {
                for name in drifted {
                    warn!(resource = %name, "JetStream resource differs from this configuration; run `flotilla nats provision`");
                }
                if started.elapsed() >= PROVISION_POLL {
                    info!("The streams and buckets exist now: starting");
                }
                return Ok(true);
            }
            Ok((missing, _)) => Waiting::Missing(format!(
                "{} of Flotilla's streams and buckets are missing on {} under prefix `{}` ({})",
                missing.len(),
                config.nats.urls.join(","),
                bus.names().prefix(),
                missing.join(", ")
            )),
            Err(e) if flotilla_bus::startup::is_transient(&e) => Waiting::Unavailable(format!(
                "JetStream on {} is not answering for now ({})",
                config.nats.urls.join(","),
                flotilla_bus::error::report(&e)
            )),
            Err(e) => {
                return Err(anyhow::Error::new(e).context("checking JetStream streams and buckets"));
            }
        };
        if now >= give_up {
            let waited = humantime::format_duration(config.worker.provision_wait);
            match what {
                Waiting::Missing(what) => anyhow::bail!(
                    "{what}, and waiting {waited} did not bring them. Workers do not create them: start `flotilla coordinator` (it creates them) or run `flotilla nats provision` with credentials allowed to create streams; `worker.provision-wait` sets how long a worker waits"
                ),
                Waiting::Unavailable(what) => anyhow::bail!(
                    "{what}, and waiting {waited} did not change that: check the NATS cluster (a node down, no quorum); `worker.provision-wait` sets how long a worker waits"
                ),
            }
        }
        if now >= next_log {
            let left = humantime::format_duration(Duration::from_secs(
                give_up.saturating_duration_since(now).as_secs_f64().ceil() as u64,
            ));
            match what {
                Waiting::Missing(what) => warn!(
                    "{what}: waiting for a coordinator (or `flotilla nats provision`) to create them; giving up in {left}"
                ),
                Waiting::Unavailable(what) => warn!(
                    "{what} (a cluster node restarting, or a leader election): waiting; giving up in {left}"
                ),
            }
            next_log = now + PROVISION_LOG_EVERY;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(false),
            _ = tokio::time::sleep_until((now + PROVISION_POLL).min(give_up)) => {}
        }
    }
}

/// What a starting worker waits for.
enum Waiting {
    /// Streams or buckets that do not exist yet.
    Missing(String),
    /// JetStream, briefly unavailable.
    Unavailable(String),
}

/// The streams and buckets of this deployment that do not exist yet, and those that differ
/// from this configuration.
async fn check_resources(
    bus: &Bus,
    config: &Config,
) -> Result<(Vec<String>, Vec<String>), flotilla_bus::ProvisionError> {
    use flotilla_bus::provision::{Action, plan};
    let plan = plan(bus.js(), bus.names(), &config.jetstream).await?;
    let (mut missing, mut drifted) = (Vec::new(), Vec::new());
    for r in &plan.report().resources {
        match &r.action {
            Action::Create => missing.push(r.name.clone()),
            Action::Unchanged => {}
            Action::Update { .. } | Action::Incompatible { .. } => drifted.push(r.name.clone()),
        }
    }
    Ok((missing, drifted))
}

/// What a coordinator advertises with its API micro service (`$SRV.INFO.<prefix>`): the
/// deployment's configuration fingerprint ([`Config::fingerprint`]), and where it runs.
pub(super) fn service_metadata(config: &Config) -> std::collections::HashMap<String, String> {
    [
        (
            flotilla_coordinator::FINGERPRINT_METADATA.to_owned(),
            config.fingerprint(),
        ),
        (
            "host".to_owned(),
            gethostname::gethostname().to_string_lossy().into_owned(),
        ),
        ("pid".to_owned(), std::process::id().to_string()),
    ]
    .into_iter()
    .collect()
}

/// How long `up` collects `$SRV.INFO` answers after the first one: every coordinator of the
/// prefix answers the one request, within a round trip or two.
const INFO_GATHER: Duration = Duration::from_millis(300);

/// `flotilla up --nats-url` against a prefix another deployment serves would hand its plans to
/// that deployment's coordinators (and its tasks to their workers). Their API micro service
/// advertises their configuration fingerprint: coordinators with another fingerprint (or
/// none: an older build) stop `up` before it provisions or submits anything, with what to do.
async fn refuse_foreign_deployment(bus: &Bus, config: &Config) -> anyhow::Result<()> {
    let subject = format!("$SRV.INFO.{}", bus.names().service());
    let ours = config.fingerprint();
    // One request first: with no coordinator at all the server says so at once.
    match bus.client().request(subject.clone(), "".into()).await {
        Ok(_) => {}
        Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders => return Ok(()),
        Err(e) => return Err(e).context(format!("asking {subject} for running coordinators")),
    }
    // Then every coordinator's answer to one request.
    let inbox = bus.client().new_inbox();
    let mut answers = bus.client().subscribe(inbox.clone()).await?;
    bus.client()
        .publish_with_reply(subject.clone(), inbox, "".into())
        .await?;
    bus.client().flush().await?;
    let mut foreign = Vec::new();
    let until = tokio::time::Instant::now() + INFO_GATHER;
    while let Ok(Some(msg)) = tokio::time::timeout_at(until, answers.next()).await {
        let Ok(info) = serde_json::from_slice::<async_nats::service::Info>(&msg.payload) else {
            continue;
        };
        let theirs = info
            .metadata
            .get(flotilla_coordinator::FINGERPRINT_METADATA)
            .cloned();
        if theirs.as_deref() != Some(ours.as_str()) {
            let at = |k: &str| info.metadata.get(k).cloned().unwrap_or_else(|| "?".into());
            foreign.push(format!(
                "fingerprint {} on host {} (pid {}, flotilla {})",
                theirs.as_deref().unwrap_or("none (an older flotilla)"),
                at("host"),
                at("pid"),
                info.version
            ));
        }
    }
    if foreign.is_empty() {
        return Ok(());
    }
    anyhow::bail!(
        "another deployment already serves prefix `{prefix}` on {urls}: its coordinator(s) have another configuration ({list}; this configuration's fingerprint is {ours}), and they would take the plans of this `up`. Choose a prefix of your own (`[nats] prefix = \"mine\"` in the config, or FLOTILLA_NATS__PREFIX=mine), or stop those coordinators",
        prefix = bus.names().prefix(),
        urls = config.nats.urls.join(","),
        list = foreign.join("; "),
    )
}

/// Options of `flotilla up`.
#[derive(Debug)]
pub(crate) struct UpOptions {
    pub(crate) workers: usize,
    pub(crate) data_dir: PathBuf,
    /// The embedded server's client port (`None`: a free one).
    pub(crate) nats_port: Option<u16>,
    /// Whether a taken console port falls back to a free one (not when the port was asked
    /// for with `--console-listen`).
    pub(crate) console_port_fallback: bool,
    pub(crate) submit: Option<PathBuf>,
    /// With `submit`: the console too, and stay up after the run until a signal.
    pub(crate) stay: bool,
    pub(crate) embedded: bool,
}

/// Everything in one process: an embedded nats-server (unless `--nats-url`), one coordinator
/// and N workers. With `--submit`, runs that plan to the end and exits with its status (with
/// `--stay`, after a signal: the console shows the run meanwhile).
pub(crate) async fn up(mut config: Config, opts: UpOptions) -> anyhow::Result<ExitCode> {
    // A one-shot `--submit` is a command; without it, or with `--stay`, `up` is a service.
    let service = opts.submit.is_none() || opts.stay;
    if let Some(warning) = crate::config::no_agents_warning(&config) {
        errln!("{warning}");
    }
    // Signals are handled from the start: a SIGTERM during start-up still stops cleanly
    // (and removes the URL file).
    let shutdown = if service {
        shutdown_on_signals()?
    } else {
        CancellationToken::new()
    };
    // One deployment per store: before anything listens, starts or is written. (With
    // `--nats-url` the store is elsewhere: the data directory holds nothing of it.)
    let mut lock = if opts.embedded {
        Some(super::datadir::DataDirLock::take(&opts.data_dir)?)
    } else {
        None
    };
    let mut url_file = None;
    // One registry and one listener for the coordinator and every worker of this process.
    let health = Health::new();
    let nats = health.condition("nats_connected");
    let provisioned = health.condition("provisioned");
    let coordinator_ready = health.condition("coordinator.consumers_bound");
    let supervisor_ready = health.condition("supervisor.consumer_bound");
    let workers_ready: Vec<Condition> = (0..opts.workers.max(1))
        .map(|i| health.condition(format!("worker[{i}].consumer_bound")))
        .collect();
    let obs = Observability::start(config.telemetry.http_addr, health, Metrics::new()).await?;
    let server = if opts.embedded {
        let s = LocalNatsServer::start_in_on(&opts.data_dir.join("nats"), opts.nats_port).await?;
        config.nats.urls = vec![s.url()];
        let Some(held) = &lock else {
            anyhow::bail!("an embedded server without the data directory's lock");
        };
        url_file = Some(super::datadir::UrlFile::write(
            held,
            &opts.data_dir,
            &s.url(),
        )?);
        errln!(
            "Embedded nats-server {} (store in {}); other flotilla commands run in this directory use it while `up` runs (elsewhere: --nats-url {})",
            s.url(),
            opts.data_dir.join("nats").display(),
            s.url()
        );
        Some(s)
    } else {
        None
    };
    if let Some(lock) = &mut lock {
        lock.set_nats_url(&config.nats.urls.join(","))?;
    }
    let bus = async {
        let bus = Bus::connect(&config.nats, "flotilla-up").await?;
        // The services' own connections go to the same servers; this one stands for them.
        follow_connection(&nats, &bus);
        bus.wait_for_jetstream(std::time::Duration::from_secs(20))
            .await?;
        if !opts.embedded {
            // Before anything is provisioned or submitted: the prefix may be another
            // deployment's, whose coordinators would take this process's plans.
            refuse_foreign_deployment(&bus, &config).await?;
        }
        bus.provision(&config.jetstream).await?;
        provisioned.set(true);
        anyhow::Ok(bus)
    }
    .instrument(info_span!("startup", flotilla.role = "up"))
    .await?;
    obs.drain_on(&shutdown);
    sample_consumer_lag(
        bus.clone(),
        config.worker.pool.clone(),
        config.telemetry.consumer_lag_interval,
        obs.metrics.clone(),
        obs.stop.clone(),
    );
    let mut services = tokio::task::JoinSet::new();
    let coordinator = Coordinator::new(
        Bus::connect(&config.nats, "flotilla-coordinator").await?,
        config.coordinator.clone(),
        config.validation_context(),
        config.jetstream.clone(),
    );
    let (tx, rx) = oneshot::channel();
    let started = when_coordinator_ready(rx, vec![coordinator_ready]);
    let coordinator = coordinator
        .with_metrics(obs.metrics.clone())
        .with_heartbeat(config.worker.heartbeat)
        .with_service_metadata(service_metadata(&config))
        .with_tenant(tenant_of(&config))
        .on_ready(tx);
    let token = shutdown.clone();
    services.spawn(async move { coordinator.run(token).await.map_err(|e| e.to_string()) });
    // What relies on the coordinator answers once it does.
    if let Some(w) = workflow_worker(&config).await? {
        let w = w.with_metrics(obs.metrics.clone());
        let token = shutdown.clone();
        services.spawn(once_ready(started.clone(), shutdown.clone(), async move {
            w.run(token).await.map_err(|e| e.to_string())
        }));
    }
    if let Some(e) = agents_exposer(&config).await? {
        let token = shutdown.clone();
        services.spawn(once_ready(started.clone(), shutdown.clone(), async move {
            e.run(token).await.map_err(|e| e.to_string())
        }));
    }
    {
        let (tx, rx) = oneshot::channel();
        set_when_ready(rx, vec![supervisor_ready]);
        let supervisor = supervisor_of(
            &config,
            Bus::connect(&config.nats, "flotilla-supervisor").await?,
        )
        .with_metrics(obs.metrics.clone())
        .on_ready(tx);
        let token = shutdown.clone();
        services.spawn(async move { supervisor.run(token).await.map_err(|e| e.to_string()) });
    }
    for (i, ready) in workers_ready.into_iter().enumerate() {
        let mut wopts = config.worker.clone();
        if let Some(id) = &wopts.id {
            wopts.id = Some(format!("{id}-{i}"));
        }
        let worker = Worker::new(
            Bus::connect(&config.nats, "flotilla-worker").await?,
            wopts,
            config.agent_registry()?,
        );
        let (tx, rx) = oneshot::channel();
        set_when_ready(rx, vec![ready]);
        let worker = worker.with_metrics(obs.metrics.clone()).on_ready(tx);
        let token = shutdown.clone();
        services.spawn(async move { worker.run(token).await.map_err(|e| e.to_string()) });
    }
    // The web console, unless `[console] enabled = false` or this is a one-shot `--submit`;
    // once the coordinator answers (its actions are the coordinator's API).
    if config.console.enabled && service && wait_coordinator(started, &shutdown).await {
        let bus = Bus::connect(&config.nats, "flotilla-console").await?;
        match super::console::bind(bus, &config, opts.console_port_fallback).await {
            Ok(console) => {
                errln!("{}", super::console::url_line(&console, &config));
                if let Some(lock) = &mut lock {
                    lock.set_console_url(&console.url())?;
                }
                let token = shutdown.clone();
                services
                    .spawn(async move { console.serve(token).await.map_err(|e| e.to_string()) });
            }
            Err(e) => warn!(error = %e, "The console did not start"),
        }
    }
    let code = match &opts.submit {
        Some(plan) => {
            let opts = super::submit::SubmitOptions {
                follow: true,
                ..Default::default()
            };
            // With `--stay`, a signal during the run stops `up` (the run stays stored).
            let code = tokio::select! {
                code = super::submit::submit_on(&bus, plan, opts) => code,
                () = shutdown.cancelled() => Ok(ExitCode::from(130)),
            };
            if service && !shutdown.is_cancelled() && code.is_ok() {
                errln!(
                    "The run ended; Flotilla stays up to look at it (the console above). Ctrl-C stops it."
                );
                shutdown.cancelled().await;
            }
            shutdown.cancel();
            code?
        }
        None => {
            errln!(
                "Flotilla is up with {} worker(s) in pool {:?}. Ctrl-C stops it.",
                opts.workers.max(1),
                config.worker.pool
            );
            shutdown.cancelled().await;
            ExitCode::SUCCESS
        }
    };
    while let Some(r) = services.join_next().await {
        if let Ok(Err(e)) = r {
            errln!("error: {e}");
        }
    }
    obs.stop().await;
    // `up`'s own connection is closed before its embedded server stops: the server going away
    // under an open connection reads as a lost link (a warning) at the end of a good run.
    if server.is_some()
        && tokio::time::timeout(std::time::Duration::from_secs(2), bus.client().drain())
            .await
            .is_err()
    {
        debug!("Closing the connection to the embedded server timed out");
    }
    drop(url_file);
    drop(server);
    // Released last: the store is free only once its server has stopped.
    drop(lock);
    Ok(code)
}
