//! Connecting with [`NatsOptions`].
//!
//! A connection notices a silent link (packets to its server dropped, the node cut off from
//! the network) by pinging: it pings after `ping-interval` without a byte from the server
//! and gives the connection up when a third ping falls due with two unanswered, within
//! [`NatsOptions::dead_link_after`] (9 s by default). It then reconnects, to another of its
//! servers first ([`Link::next_server`](crate::link::Link)), and logs losing and regaining
//! the server with its address. Requests in flight on the lost connection end at their
//! timeout; subscriptions are made again on the new connection.

use std::sync::Arc;

use async_nats::ConnectErrorKind as NatsKind;
use tracing::info;

use crate::error::{ConnectError, ConnectErrorKind};
use crate::link::{self, Link};
use crate::options::{NatsAuth, NatsOptions};

/// Connects to NATS. The client reconnects forever after the first successful connection, so
/// services ride out server restarts and silent links; the first connection must succeed
/// within `connect-timeout`.
pub async fn connect(
    opts: &NatsOptions,
    default_name: &str,
) -> Result<async_nats::Client, ConnectError> {
    connect_watched(opts, default_name).await.map(|(c, _)| c)
}

/// [`connect`], with the connection's [`Link`]: which server it is on, whether it connected
/// again, and what the server refused it.
pub async fn connect_watched(
    opts: &NatsOptions,
    default_name: &str,
) -> Result<(async_nats::Client, Arc<Link>), ConnectError> {
    opts.validate()?;
    let opts = &opts.resolved();
    let link = Arc::new(Link::new(opts));
    let mut co = async_nats::ConnectOptions::new()
        .name(opts.name.clone().unwrap_or_else(|| default_name.to_owned()))
        .connection_timeout(opts.connect_timeout)
        .request_timeout(Some(opts.request_timeout))
        .ping_interval(opts.ping_interval)
        .max_reconnects(None);
    if !opts.discover_servers {
        co = co.ignore_discovered_servers();
    }
    if let Some(p) = &opts.inbox_prefix {
        co = co.custom_inbox_prefix(p.clone());
    }
    co = match &opts.auth {
        NatsAuth::None => co,
        NatsAuth::Token { token } => co.token(token.expose().to_owned()),
        NatsAuth::UserPassword { user, password } => {
            co.user_and_password(user.clone(), password.expose().to_owned())
        }
        NatsAuth::Nkey { seed } => co.nkey(seed.expose().to_owned()),
        NatsAuth::CredsFile { path } => co.credentials_file(path).await.map_err(|e| {
            ConnectError::with_source(
                ConnectErrorKind::Credentials,
                format!("reading {}", path.display()),
                e,
            )
        })?,
    };
    let events = Arc::clone(&link);
    co = co.event_callback(move |event| {
        let link = Arc::clone(&events);
        async move { link.on_event(event) }
    });
    let selection = Arc::clone(&link);
    co = co.reconnect_to_server_callback(move |servers, _info| {
        let link = Arc::clone(&selection);
        async move {
            link.next_server(&servers)
                .map(|addr| async_nats::ReconnectToServer { addr, delay: None })
        }
    });
    if let Some(tls) = &opts.tls {
        co = co.require_tls(tls.required);
        if let Some(ca) = &tls.ca {
            co = co.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&tls.cert, &tls.key) {
            co = co.add_client_certificate(cert.clone(), key.clone());
        }
    }
    let addrs: Vec<async_nats::ServerAddr> = opts
        .urls
        .iter()
        .map(|u| u.parse())
        .collect::<Result<_, _>>()
        .map_err(|e| {
            ConnectError::with_source(ConnectErrorKind::InvalidOptions, "bad server URL", e)
        })?;
    let client = co.connect(addrs.as_slice()).await.map_err(|e| {
        let kind = match e.kind() {
            NatsKind::Authentication | NatsKind::AuthorizationViolation => {
                ConnectErrorKind::Authentication
            }
            NatsKind::Tls => ConnectErrorKind::Tls,
            NatsKind::ServerParse => ConnectErrorKind::InvalidOptions,
            _ => ConnectErrorKind::Unreachable,
        };
        ConnectError::with_source(kind, format!("connecting to {}", opts.urls.join(", ")), e)
    })?;
    // The first connection tried the URLs in turn; the pool says which one took it (the
    // only entry connected so far), so a lost link is not dialled first again.
    let first = client
        .server_pool()
        .await
        .ok()
        .and_then(|pool| pool.into_iter().find(|s| s.did_connect).map(|s| s.addr));
    info!(
        server = first.as_ref().map(link::show).as_deref().unwrap_or("?"),
        server_name = %client.server_info().server_name,
        "Connected to NATS"
    );
    link.started_on(first);
    Ok((client, link))
}
