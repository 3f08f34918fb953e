//! Connecting with [`NatsOptions`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_nats::ConnectErrorKind as NatsKind;

use crate::error::{ConnectError, ConnectErrorKind};
use crate::options::{NatsAuth, NatsOptions};

/// Connects to NATS. The client reconnects forever after the first successful connection, so
/// services ride out server restarts; the first connection must succeed within
/// `connect-timeout`.
pub async fn connect(
    opts: &NatsOptions,
    default_name: &str,
) -> Result<async_nats::Client, ConnectError> {
    connect_noting_reconnects(opts, default_name, None).await
}

/// [`connect`], setting `reconnected` each time the client connects again (to the same
/// server or another one): what the client caches of the server's info is then out of date.
pub async fn connect_noting_reconnects(
    opts: &NatsOptions,
    default_name: &str,
    reconnected: Option<Arc<AtomicBool>>,
) -> Result<async_nats::Client, ConnectError> {
    opts.validate()?;
    let mut co = async_nats::ConnectOptions::new()
        .name(opts.name.clone().unwrap_or_else(|| default_name.to_owned()))
        .connection_timeout(opts.connect_timeout)
        .request_timeout(Some(opts.request_timeout))
        .max_reconnects(None);
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
    if let Some(flag) = reconnected {
        co = co.event_callback(move |event| {
            let flag = Arc::clone(&flag);
            async move {
                if matches!(event, async_nats::Event::Connected) {
                    flag.store(true, Ordering::Release);
                }
            }
        });
    }
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
    co.connect(addrs.as_slice()).await.map_err(|e| {
        let kind = match e.kind() {
            NatsKind::Authentication | NatsKind::AuthorizationViolation => {
                ConnectErrorKind::Authentication
            }
            NatsKind::Tls => ConnectErrorKind::Tls,
            NatsKind::ServerParse => ConnectErrorKind::InvalidOptions,
            _ => ConnectErrorKind::Unreachable,
        };
        ConnectError::with_source(kind, format!("connecting to {}", opts.urls.join(", ")), e)
    })
}
