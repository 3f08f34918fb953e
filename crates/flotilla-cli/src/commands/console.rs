//! `flotilla console`: the web console as its own service (of one installation, or with
//! `--tenants a,b` / `--all-tenants` of several tenants'), and the console `flotilla up`
//! starts. The console itself is the `flotilla-console` library; this file connects it,
//! serves its health endpoints and prints where to open it.

use std::net::SocketAddr;
use std::process::ExitCode;

use flotilla_bus::Bus;
use flotilla_console::{Console, ConsoleError, Tenants};
use flotilla_telemetry::{Health, HttpServer, Metrics};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::config::Config;

/// Binds the console on `console.listen`. For `flotilla up` (`fallback`), a taken port
/// falls back to any free one on the same address, so a second `up` on one host still
/// has its console.
pub(crate) async fn bind(bus: Bus, config: &Config, fallback: bool) -> anyhow::Result<Console> {
    let opts = config.console.clone();
    match Console::bind(bus.clone(), opts.clone()).await {
        Err(e) if fallback && e.is_addr_in_use() => {
            let any = SocketAddr::new(opts.listen.ip(), 0);
            warn!(listen = %opts.listen, "The console's port is taken; listening on a free one");
            Ok(Console::bind_to(bus, any, opts).await?)
        }
        r => Ok(r?),
    }
}

/// The line that says where the console is (never a token: with tokens, how to sign in).
pub(crate) fn url_line(console: &Console, config: &Config) -> String {
    let how = if !config.console.tokens.is_empty() {
        " (sign in once with ?token=YOUR_TOKEN)"
    } else if config.console.identity_header.is_some() {
        " (behind your authenticating proxy)"
    } else {
        ""
    };
    format!("Console: {}{how}", console.url())
}

/// `flotilla console`; with `tenants`, a console of those tenants' installations.
pub(crate) async fn console(config: &Config, tenants: Option<Tenants>) -> anyhow::Result<ExitCode> {
    let health = Health::new();
    let nats = health.condition("nats_connected");
    let listening = health.condition("console_listening");
    let stop_http = CancellationToken::new();
    let server = HttpServer::start(
        config.telemetry.http_addr,
        health.clone(),
        Metrics::new(),
        stop_http.clone(),
    )
    .await?;
    let shutdown = super::signals::shutdown_on_signals()?;
    let bound = match tenants {
        None => {
            let bus = Bus::connect(&config.nats, "flotilla-console").await?;
            bind(bus, config, false).await
        }
        Some(tenants) => Console::bind_tenants(
            &config.nats,
            tenants,
            config.console.listen,
            config.console.clone(),
        )
        .await
        .map_err(anyhow::Error::from),
    };
    let console = match bound {
        Ok(c) => c,
        Err(e) => {
            if let Some(ConsoleError::Listen { addr, .. }) = e.downcast_ref::<ConsoleError>() {
                anyhow::bail!(
                    "{e}: another process listens on {addr}; choose another with --listen or console.listen"
                );
            }
            return Err(e);
        }
    };
    nats.follow(console.connected());
    errln!("{}", url_line(&console, config));
    listening.set(true);
    {
        let (shutdown, health) = (shutdown.clone(), health.clone());
        tokio::spawn(async move {
            shutdown.cancelled().await;
            health.set_draining();
        });
    }
    console.serve(shutdown).await?;
    stop_http.cancel();
    if let Some(server) = server {
        server.stopped().await?;
    }
    Ok(ExitCode::SUCCESS)
}
