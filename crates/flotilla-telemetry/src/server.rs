//! The HTTP listener of every service: `/healthz`, `/readyz`, `/metrics`.
//!
//! | Path | 200 when | Body |
//! |---|---|---|
//! | `/healthz` | the process runs | `ok` |
//! | `/readyz` | every readiness condition holds and the process is not draining (else 503) | JSON [`Readiness`](crate::Readiness) |
//! | `/metrics` | always | OpenMetrics text ([`crate::metrics::CONTENT_TYPE`]) |
//!
//! The listener is bound before the service connects to NATS, so liveness probes pass while
//! it connects and readiness says what it is waiting for. It is stopped by its own token, after
//! the service has finished draining, so `/readyz` keeps answering 503 during the drain.

use std::net::SocketAddr;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::health::Health;
use crate::metrics::{self, Metrics};
use crate::options::{AUTO_HTTP_PORTS, DEFAULT_HTTP_PORT, HttpAddr};

/// The listener could not start or failed.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Another process (or another Flotilla service) already listens there.
    #[error(
        "cannot listen on {addr}: address in use by another process (choose another with --http-addr or telemetry.http-addr)"
    )]
    AddressInUse {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Binding failed for another reason (permission denied for ports below 1024, an address
    /// not on this host, …).
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// `auto` found every port it tries taken.
    #[error(
        "cannot listen on any port from {first} to {last}: all in use (choose an address with --http-addr or telemetry.http-addr, or `off`)"
    )]
    NoFreePort {
        /// The first address tried.
        first: SocketAddr,
        /// The last address tried.
        last: SocketAddr,
    },
    /// Serving failed after the listener started.
    #[error("the HTTP listener on {addr} failed: {source}")]
    Serve {
        /// The address.
        addr: SocketAddr,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The listener's task panicked or was aborted.
    #[error("the HTTP listener on {addr} stopped unexpectedly")]
    Stopped {
        /// The address.
        addr: SocketAddr,
    },
}

#[derive(Clone)]
struct AppState {
    health: Health,
    metrics: Metrics,
}

/// A running listener.
#[derive(Debug)]
pub struct HttpServer {
    addr: SocketAddr,
    task: JoinHandle<std::io::Result<()>>,
}

impl HttpServer {
    /// Starts the listener `addr` asks for — none for `off`; for `auto` the first free port
    /// of [`HttpAddr::auto_candidates`], logged, so several services share a host with the
    /// defaults — and serves until `shutdown` is cancelled. Binding errors are returned here,
    /// before any work starts.
    pub async fn start(
        addr: HttpAddr,
        health: Health,
        metrics: Metrics,
        shutdown: CancellationToken,
    ) -> Result<Option<Self>, ServeError> {
        let listener = match addr {
            HttpAddr::Off => return Ok(None),
            HttpAddr::Bind(a) => listen(a).await?,
            HttpAddr::Auto => {
                let mut taken = Vec::new();
                let mut found = None;
                for a in HttpAddr::auto_candidates() {
                    match listen(a).await {
                        Ok(l) => {
                            found = Some(l);
                            break;
                        }
                        Err(ServeError::AddressInUse { .. }) => taken.push(a.port()),
                        Err(e) => return Err(e),
                    }
                }
                let Some(listener) = found else {
                    return Err(ServeError::NoFreePort {
                        first: SocketAddr::from(([0, 0, 0, 0], DEFAULT_HTTP_PORT)),
                        last: SocketAddr::from((
                            [0, 0, 0, 0],
                            DEFAULT_HTTP_PORT + AUTO_HTTP_PORTS - 1,
                        )),
                    });
                };
                if let (Some(first), Ok(bound)) = (taken.first(), listener.local_addr()) {
                    tracing::info!(
                        port = bound.port(),
                        "Port {first} is taken (another Flotilla service on this host?): serving /healthz, /readyz and /metrics on port {} instead",
                        bound.port()
                    );
                }
                listener
            }
        };
        Self::serve(listener, health, metrics, shutdown).map(Some)
    }

    /// Binds `addr` (port 0: any free port, see [`local_addr`](Self::local_addr)) and serves
    /// until `shutdown` is cancelled. Binding errors are returned here, before any work starts.
    pub async fn bind(
        addr: SocketAddr,
        health: Health,
        metrics: Metrics,
        shutdown: CancellationToken,
    ) -> Result<Self, ServeError> {
        Self::serve(listen(addr).await?, health, metrics, shutdown)
    }

    fn serve(
        listener: tokio::net::TcpListener,
        health: Health,
        metrics: Metrics,
        shutdown: CancellationToken,
    ) -> Result<Self, ServeError> {
        let addr = listener.local_addr().map_err(|source| ServeError::Bind {
            addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            source,
        })?;
        let app = router(health, metrics);
        let task = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await
        });
        tracing::info!(%addr, "HTTP listener started (/healthz, /readyz, /metrics)");
        Ok(Self { addr, task })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits until the listener has stopped (after its shutdown token was cancelled).
    pub async fn stopped(self) -> Result<(), ServeError> {
        let addr = self.addr;
        match self.task.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(source)) => Err(ServeError::Serve { addr, source }),
            Err(_) => Err(ServeError::Stopped { addr }),
        }
    }
}

/// A listening socket on `addr`, with a taken address told apart.
async fn listen(addr: SocketAddr) -> Result<tokio::net::TcpListener, ServeError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| match source.kind() {
            std::io::ErrorKind::AddrInUse => ServeError::AddressInUse { addr, source },
            _ => ServeError::Bind { addr, source },
        })
}

fn router(health: Health, metrics: Metrics) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(AppState { health, metrics })
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(state): State<AppState>) -> Response {
    let readiness = state.health.readiness();
    let status = if readiness.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    match serde_json::to_string(&readiness) {
        Ok(body) => (status, [(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(_) => status.into_response(),
    }
}

async fn metrics_text(State(state): State<AppState>) -> Response {
    match state.metrics.encode() {
        Ok(body) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, metrics::CONTENT_TYPE)],
            body,
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::InternalEvent;
    use crate::events::ConsumerLag;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A minimal HTTP/1.0 GET: status code and body (the test needs no HTTP client crate).
    async fn get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: test\r\n\r\n").as_bytes())
            .await?;
        let mut raw = String::new();
        s.read_to_string(&mut raw).await?;
        let status = raw
            .split_whitespace()
            .nth(1)
            .ok_or_else(|| anyhow::anyhow!("no status line: {raw:?}"))?
            .parse()?;
        let body = raw
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Ok((status, body))
    }

    #[tokio::test]
    async fn serves_health_readiness_and_metrics() -> anyhow::Result<()> {
        let health = Health::new();
        let bound = health.condition("consumer_bound");
        let metrics = Metrics::new();
        let stop = CancellationToken::new();
        let server = HttpServer::bind(
            "127.0.0.1:0".parse()?,
            health.clone(),
            metrics.clone(),
            stop.clone(),
        )
        .await?;
        let addr = server.local_addr();
        assert_ne!(addr.port(), 0);

        assert_eq!(get(addr, "/healthz").await?, (200, "ok\n".into()));

        let (status, body) = get(addr, "/readyz").await?;
        assert_eq!(status, 503, "{body}");
        let r: serde_json::Value = serde_json::from_str(&body)?;
        assert_eq!(r["conditions"]["consumer_bound"], false);

        bound.set(true);
        assert_eq!(get(addr, "/readyz").await?.0, 200);
        health.set_draining();
        let (status, body) = get(addr, "/readyz").await?;
        assert_eq!(status, 503);
        assert!(body.contains("\"draining\":true"), "{body}");

        ConsumerLag {
            pool: "default",
            pending: 7,
            ack_pending: 2,
        }
        .emit(&metrics);
        let (status, body) = get(addr, "/metrics").await?;
        assert_eq!(status, 200);
        assert!(
            body.contains("flotilla_pool_consumer_pending_messages{pool=\"default\"} 7"),
            "{body}"
        );
        assert_eq!(get(addr, "/nope").await?.0, 404);

        stop.cancel();
        server.stopped().await?;
        assert!(tokio::net::TcpStream::connect(addr).await.is_err());
        Ok(())
    }

    #[tokio::test]
    async fn auto_moves_to_the_next_free_port_and_off_listens_nowhere() -> anyhow::Result<()> {
        let stop = CancellationToken::new();
        let start =
            || HttpServer::start(HttpAddr::Auto, Health::new(), Metrics::new(), stop.clone());
        // Two services on one host with the default: the second does not fail.
        let first = start().await?.expect("a listener");
        let second = start().await?.expect("a listener");
        let (a, b) = (first.local_addr(), second.local_addr());
        assert_ne!(a.port(), b.port());
        for addr in [a, b] {
            assert!((9464..9564).contains(&addr.port()), "{addr}");
            let local = SocketAddr::from(([127, 0, 0, 1], addr.port()));
            assert_eq!(get(local, "/healthz").await?.0, 200);
        }
        assert!(
            HttpServer::start(HttpAddr::Off, Health::new(), Metrics::new(), stop.clone())
                .await?
                .is_none()
        );
        stop.cancel();
        first.stopped().await?;
        second.stopped().await?;
        Ok(())
    }

    #[tokio::test]
    async fn a_taken_address_is_named() -> anyhow::Result<()> {
        let taken = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = taken.local_addr()?;
        let err = HttpServer::bind(
            addr,
            Health::new(),
            Metrics::new(),
            CancellationToken::new(),
        )
        .await
        .expect_err("in use");
        assert!(matches!(err, ServeError::AddressInUse { addr: a, .. } if a == addr));
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
        assert!(err.to_string().contains("address in use"), "{err}");
        Ok(())
    }
}
