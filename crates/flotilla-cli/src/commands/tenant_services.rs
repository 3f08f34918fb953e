//! `flotilla coordinator|worker|supervisor --tenants a,b`: one process serving several
//! tenants of a shared deployment.
//!
//! Each tenant is served as `--tenant <name>` would serve it — its own connection (user
//! `<user>@<tenant>`), names and inboxes, its own coordinator, worker or supervisor — in one
//! process with one HTTP listener, whose readiness waits for every tenant
//! (`nats_connected@<tenant>`, `provisioned@<tenant>`, ...). A worker's agent slots are
//! shared: every tenant's queue is pulled for its own free places and its attempts take the
//! process's slots first come, first served ([`flotilla_worker::Worker::with_run_slots`]) —
//! the fair share of a shared pool.

use std::process::ExitCode;
use std::sync::Arc;

use flotilla_coordinator::Coordinator;
use flotilla_model::tenant::TenantName;
use flotilla_telemetry::{Health, Metrics};
use flotilla_worker::Worker;
use tokio::sync::{Semaphore, oneshot};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, info_span};

use super::services::{
    Observability, connect_provisioned, follow_connection, service_metadata, set_when_ready,
    supervisor_of,
};
use super::signals::shutdown_on_signals;
use crate::config::Config;

/// The configuration of each of `tenants`, checked: names valid, none twice, and not
/// combined with `--tenant`.
pub(crate) fn per_tenant(config: &Config, tenants: &[String]) -> anyhow::Result<Vec<Config>> {
    Ok(tenant_names(config, tenants)?
        .into_iter()
        .map(|name| {
            let mut c = config.clone();
            c.nats.tenant = Some(name.to_string());
            c
        })
        .collect())
}

/// `tenants` (of `--tenants`), checked: names valid, none twice, and not combined with
/// `--tenant`.
pub(crate) fn tenant_names(config: &Config, tenants: &[String]) -> anyhow::Result<Vec<TenantName>> {
    anyhow::ensure!(
        config.nats.tenant.is_none(),
        "--tenants serves several tenants; drop --tenant / nats.tenant ({:?})",
        config.nats.tenant.as_deref().unwrap_or_default()
    );
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for t in tenants {
        let name = TenantName::new(t).map_err(|e| anyhow::anyhow!("--tenants: {t:?} {e}"))?;
        anyhow::ensure!(
            seen.insert(name.clone()),
            "--tenants: {t:?} is listed twice"
        );
        out.push(name);
    }
    Ok(out)
}

/// Waits for every tenant's service. The first to fail stops the others (as a failing
/// service stops its process), and its error is the answer.
async fn join(
    mut tasks: JoinSet<anyhow::Result<()>>,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let mut first = Ok(());
    while let Some(r) = tasks.join_next().await {
        let r = r.map_err(anyhow::Error::from).and_then(|r| r);
        if first.is_ok() && r.is_err() {
            shutdown.cancel();
            first = r;
        }
    }
    first
}

/// `flotilla coordinator --tenants …`: a coordinator per tenant.
pub(crate) async fn coordinators(config: &Config, tenants: &[String]) -> anyhow::Result<ExitCode> {
    info!(tenants = tenants.len(), "Coordinating tenants");
    serve_each(
        config,
        tenants,
        "flotilla-coordinator",
        Start::Provisions,
        |c, bus, metrics, ready, shutdown| async move {
            let tenant = c
                .nats
                .tenant
                .as_deref()
                .and_then(|t| TenantName::new(t).ok());
            Coordinator::new(
                bus,
                c.coordinator.clone(),
                c.validation_context(),
                c.jetstream.clone(),
            )
            .with_metrics(metrics)
            .with_heartbeat(c.worker.heartbeat)
            .with_service_metadata(service_metadata(&c))
            .with_tenant(tenant)
            .on_ready(ready)
            .run(shutdown)
            .await
            .map_err(anyhow::Error::from)
        },
    )
    .await
}

/// `flotilla worker --tenants …`: a worker of the pool per tenant, sharing its slots.
pub(crate) async fn workers(config: &Config, tenants: &[String]) -> anyhow::Result<ExitCode> {
    let slots = Arc::new(Semaphore::new(config.worker.concurrency));
    info!(tenants = tenants.len(), concurrency = config.worker.concurrency, pool = %config.worker.pool, "Working for tenants, slots shared");
    serve_each(
        config,
        tenants,
        "flotilla-worker",
        Start::WaitsForStreams,
        move |c, bus, metrics, ready, shutdown| {
            let slots = Arc::clone(&slots);
            async move {
                Worker::new(bus, c.worker.clone(), c.agent_registry()?)
                    .with_metrics(metrics)
                    .with_run_slots(slots)
                    .on_ready(ready)
                    .run(shutdown)
                    .await
                    .map_err(anyhow::Error::from)
            }
        },
    )
    .await
}

/// `flotilla supervisor --tenants …`: a supervisor per tenant.
pub(crate) async fn supervisors(config: &Config, tenants: &[String]) -> anyhow::Result<ExitCode> {
    serve_each(
        config,
        tenants,
        "flotilla-supervisor",
        Start::WaitsForStreams,
        |c, bus, metrics, ready, shutdown| async move {
            supervisor_of(&c, bus)
                .with_metrics(metrics)
                .on_ready(ready)
                .run(shutdown)
                .await
                .map_err(anyhow::Error::from)
        },
    )
    .await
}

/// How a service of [`serve_each`] starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// It creates its streams and buckets (a coordinator): it connects and goes; it is ready
    /// at `consumers_bound@<tenant>`.
    Provisions,
    /// It waits for them (workers, supervisors: least privilege): `provisioned@<tenant>`
    /// first; it is ready at `consumer_bound@<tenant>`.
    WaitsForStreams,
}

/// Runs `service` once per tenant of `tenants`, each on its own connection (as `name`),
/// behind one listener whose readiness waits for every tenant's conditions ([`Start`]; the
/// service signals the last through its `ready` sender).
async fn serve_each<F, Fut>(
    config: &Config,
    tenants: &[String],
    name: &'static str,
    start: Start,
    service: F,
) -> anyhow::Result<ExitCode>
where
    F: Fn(Config, flotilla_bus::Bus, Metrics, oneshot::Sender<()>, CancellationToken) -> Fut
        + Clone
        + Send
        + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send,
{
    let configs = per_tenant(config, tenants)?;
    let health = Health::new();
    let conditions: Vec<_> = configs
        .iter()
        .map(|c| {
            let t = c.nats.tenant.clone().unwrap_or_default();
            match start {
                Start::Provisions => (
                    health.condition(format!("nats_connected@{t}")),
                    None,
                    health.condition(format!("consumers_bound@{t}")),
                ),
                Start::WaitsForStreams => (
                    health.condition(format!("nats_connected@{t}")),
                    Some(health.condition(format!("provisioned@{t}"))),
                    health.condition(format!("consumer_bound@{t}")),
                ),
            }
        })
        .collect();
    let obs = Observability::start(config.telemetry.http_addr, health, Metrics::new()).await?;
    let shutdown = shutdown_on_signals()?;
    obs.drain_on(&shutdown);
    let mut tasks = JoinSet::new();
    for (c, (nats, provisioned, bound)) in configs.into_iter().zip(conditions) {
        let t = c.nats.tenant.clone().unwrap_or_default();
        let (shutdown, metrics, service) = (shutdown.clone(), obs.metrics.clone(), service.clone());
        tasks.spawn(
            async move {
                let bus = match &provisioned {
                    None => {
                        let bus = flotilla_bus::Bus::connect(&c.nats, name).await?;
                        follow_connection(&nats, &bus);
                        bus
                    }
                    Some(provisioned) => {
                        match connect_provisioned(&c, name, &nats, provisioned, &shutdown).await? {
                            Some(bus) => bus,
                            None => return Ok(()),
                        }
                    }
                };
                let (tx, rx) = oneshot::channel();
                set_when_ready(rx, vec![bound]);
                service(c, bus, metrics, tx, shutdown).await
            }
            .instrument(info_span!("tenant", flotilla.tenant = %t)),
        );
    }
    let r = join(tasks, &shutdown).await;
    obs.stop().await;
    r.map(|()| ExitCode::SUCCESS)
}
