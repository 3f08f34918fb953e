//! `flotilla coordinator`, `flotilla worker`, `flotilla up`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use flotilla_bus::Bus;
use flotilla_bus::server::{LocalNatsServer, LocalServerOptions};
use flotilla_coordinator::Coordinator;
use flotilla_worker::Worker;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::Config;

/// A token cancelled on SIGTERM or Ctrl-C. The handlers are installed before this returns,
/// so a signal that arrives right after start-up still drains instead of killing.
pub(crate) fn shutdown_on_signals() -> anyhow::Result<CancellationToken> {
    let token = CancellationToken::new();
    let t = token.clone();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => info!("SIGTERM received: shutting down"),
            _ = interrupt.recv() => info!("Interrupted: shutting down"),
        }
        t.cancel();
    });
    Ok(token)
}

pub(crate) async fn coordinator(config: &Config) -> anyhow::Result<ExitCode> {
    let shutdown = shutdown_on_signals()?;
    let bus = Bus::connect(&config.nats, "flotilla-coordinator").await?;
    Coordinator::new(
        bus,
        config.coordinator.clone(),
        config.validation_context(),
        config.jetstream.clone(),
    )
    .run(shutdown)
    .await?;
    Ok(ExitCode::SUCCESS)
}

pub(crate) async fn worker(config: &Config) -> anyhow::Result<ExitCode> {
    let shutdown = shutdown_on_signals()?;
    let bus = Bus::connect(&config.nats, "flotilla-worker").await?;
    check_provisioned(&bus, config).await?;
    Worker::new(bus, config.worker.clone(), config.agent_registry()?)
        .run(shutdown)
        .await?;
    Ok(ExitCode::SUCCESS)
}

/// A worker only checks that the streams and buckets exist: creating and updating them is the
/// coordinator's and the operator's right (least privilege, `deploy/nats/accounts.conf`).
/// Missing resources stop the worker with a message saying how to create them; drift is
/// logged and left to whoever provisions.
async fn check_provisioned(bus: &Bus, config: &Config) -> anyhow::Result<()> {
    use flotilla_bus::provision::{Action, plan};
    let plan = plan(bus.js(), bus.names(), &config.jetstream)
        .await
        .context("checking JetStream streams and buckets")?;
    let mut missing = Vec::new();
    for r in &plan.report().resources {
        match &r.action {
            Action::Create => missing.push(r.name.as_str()),
            Action::Unchanged => {}
            Action::Update { .. } | Action::Incompatible { .. } => {
                warn!(resource = %r.name, "JetStream resource differs from this configuration; run `flotilla nats provision`");
            }
        }
    }
    if !missing.is_empty() {
        anyhow::bail!(
            "JetStream resources are missing: {}. Workers do not create them; start a coordinator or run `flotilla nats provision` with credentials allowed to create streams",
            missing.join(", ")
        );
    }
    Ok(())
}

/// A nats-server for `up` and `bench` when no URL is given: a child process with its store in
/// `data_dir`.
pub(crate) async fn embedded_nats(data_dir: &Path) -> anyhow::Result<LocalNatsServer> {
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("creating {}", data_dir.display()))?;
    let opts = LocalServerOptions::in_dir(data_dir);
    let server = LocalNatsServer::start(opts).await?;
    Ok(server)
}

/// Options of `flotilla up`.
#[derive(Debug)]
pub(crate) struct UpOptions {
    pub(crate) workers: usize,
    pub(crate) data_dir: PathBuf,
    pub(crate) submit: Option<PathBuf>,
    pub(crate) embedded: bool,
}

/// Everything in one process: an embedded nats-server (unless `--nats-url`), one coordinator
/// and N workers. With `--submit`, runs that plan to the end and exits with its status.
pub(crate) async fn up(mut config: Config, opts: UpOptions) -> anyhow::Result<ExitCode> {
    let mut url_file = None;
    let server = if opts.embedded {
        let s = embedded_nats(&opts.data_dir.join("nats")).await?;
        config.nats.urls = vec![s.url()];
        url_file = Some(UrlFile::write(&opts.data_dir, &s.url())?);
        eprintln!(
            "Embedded nats-server {} (store in {}); other flotilla commands run in this directory use it while `up` runs (elsewhere: --nats-url {})",
            s.url(),
            opts.data_dir.join("nats").display(),
            s.url()
        );
        Some(s)
    } else {
        None
    };
    let bus = Bus::connect(&config.nats, "flotilla-up").await?;
    bus.wait_for_jetstream(std::time::Duration::from_secs(20))
        .await?;
    bus.provision(&config.jetstream).await?;
    let shutdown = match opts.submit {
        Some(_) => CancellationToken::new(),
        None => shutdown_on_signals()?,
    };
    let mut services = tokio::task::JoinSet::new();
    let coordinator = Coordinator::new(
        Bus::connect(&config.nats, "flotilla-coordinator").await?,
        config.coordinator.clone(),
        config.validation_context(),
        config.jetstream.clone(),
    );
    let token = shutdown.clone();
    services.spawn(async move { coordinator.run(token).await.map_err(|e| e.to_string()) });
    for i in 0..opts.workers.max(1) {
        let mut wopts = config.worker.clone();
        if let Some(id) = &wopts.id {
            wopts.id = Some(format!("{id}-{i}"));
        }
        let worker = Worker::new(
            Bus::connect(&config.nats, "flotilla-worker").await?,
            wopts,
            config.agent_registry()?,
        );
        let token = shutdown.clone();
        services.spawn(async move { worker.run(token).await.map_err(|e| e.to_string()) });
    }
    let code = match &opts.submit {
        Some(plan) => {
            let opts = super::submit::SubmitOptions {
                follow: true,
                ..Default::default()
            };
            let code = super::submit::submit_on(&bus, plan, opts).await;
            shutdown.cancel();
            code?
        }
        None => {
            eprintln!(
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
            eprintln!("error: {e}");
        }
    }
    drop(url_file);
    drop(server);
    Ok(code)
}

/// `<data-dir>/nats-url`: the embedded server's URL and this process's id, so other commands
/// in the same directory find the server (see `config::running_up_url`). Removed on exit.
struct UrlFile(PathBuf);

impl UrlFile {
    fn write(dir: &Path, url: &str) -> anyhow::Result<Self> {
        let path = dir.join("nats-url");
        std::fs::write(&path, format!("{url}\n{}\n", std::process::id()))
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(Self(path))
    }
}

impl Drop for UrlFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
