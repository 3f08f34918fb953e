//! The web console: a page where a platform team watches run trees live, answers
//! approvals and sees the team and the workers. It is a view, not a second engine: every
//! read and action goes through the client library and the same API requests as the CLI,
//! and a run's events through the same projection as `flotilla watch`.
//!
//! ```text
//!  browser ──HTTP/SSE──► Console (axum) ──Client──► NATS: API requests, run store, events
//!     ▲                      │  RunIndex ◄── watch of the flotilla-runs bucket
//!     └──── live: SSE ◄──────┘  notices ◄── <prefix>.notify.>
//! ```
//!
//! The browser never talks to NATS. The page is plain ES modules and CSS embedded in the
//! binary (`assets/`, `include_str!`): no build step, nothing to install at run time.
//! Security: see [`ConsoleOptions`] (identity) and the `auth` module (operator role, CSRF).
//!
//! One process can serve several tenants' installations ([`Console::bind_tenants`], the
//! `tenancy` module): each through its own connection as `console@<tenant>`, at
//! `/t/<tenant>/`, to the people of that tenant and the administrators only.
//!
//! ```no_run
//! # async fn demo(bus: flotilla_bus::Bus) -> Result<(), flotilla_console::ConsoleError> {
//! use flotilla_console::{Console, ConsoleOptions};
//! let console = Console::bind(bus, ConsoleOptions::default()).await?;
//! println!("console at {}", console.url());
//! console.serve(tokio_util::sync::CancellationToken::new()).await?;
//! # Ok(()) }
//! ```

mod api;
mod auth;
mod index;
mod monitor;
mod options;
mod tenancy;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{ConnectInfo, Query, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use flotilla_bus::Bus;
use flotilla_client::Client;
use futures::StreamExt;
use http::{HeaderValue, StatusCode, header};
use tokio::net::TcpListener;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

pub use auth::Identity;
pub use options::{
    BadTrustedProxy, ConsoleOptions, ConsoleOptionsError, DEFAULT_PORT, TrustedProxy,
};
pub use tenancy::Tenants;

use api::AppState;
use index::RunIndex;

/// Why the console could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    /// The settings cannot be used.
    #[error("invalid [console] section: {0}")]
    Options(#[from] ConsoleOptionsError),
    /// The run store could not be opened (not provisioned, NATS down).
    #[error("opening the run store: {0}")]
    Store(#[from] flotilla_client::ClientError),
    /// Subscribing to notices failed.
    #[error("subscribing to notices: {0}")]
    Subscribe(#[from] async_nats::SubscribeError),
    /// The listener could not bind or failed.
    #[error("console listener on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// The tenant records could not be read (no tenant was ever added, NATS refused).
    #[error("reading the tenant records: {0}")]
    Tenants(String),
    /// A tenant to serve has no record (`flotilla tenant list` shows the tenants).
    #[error(
        "tenant {0:?} does not exist (`flotilla tenant list` shows the tenants; `flotilla tenant add` adds one)"
    )]
    UnknownTenant(String),
    /// A tenant's installation could not be reached as its console user
    /// (`console@<tenant>`): its NATS users come with `flotilla tenant nats-config`.
    #[error("connecting to tenant {tenant}'s installation as console@{tenant}: {source}")]
    Connect {
        /// The tenant.
        tenant: String,
        /// The cause.
        source: flotilla_bus::ConnectError,
    },
}

impl ConsoleError {
    /// The address was taken by another process.
    pub fn is_addr_in_use(&self) -> bool {
        matches!(self, Self::Listen { source, .. } if source.kind() == std::io::ErrorKind::AddrInUse)
    }
}

/// How often the pending approvals are read again without a notice.
const PENDING_EVERY: std::time::Duration = std::time::Duration::from_secs(5);
/// How long a notice waits for the rest of its burst before the approvals are read.
const PENDING_SETTLE: std::time::Duration = std::time::Duration::from_millis(100);

/// The embedded page.
const INDEX_HTML: &str = include_str!("../assets/index.html");
const APP_JS: &str = include_str!("../assets/app.js");
const APP_CSS: &str = include_str!("../assets/app.css");
/// The icon browsers ask for (`/favicon.ico`, `/favicon.svg`).
const FAVICON_SVG: &str = include_str!("../assets/favicon.svg");

/// A bound console, ready to serve.
pub struct Console {
    listener: TcpListener,
    addr: SocketAddr,
    app: Router,
    /// Fires when the console stops: every open event stream ends.
    closing: CancellationToken,
    stop_index: CancellationToken,
    connected: Connected,
}

/// Whether every NATS connection the console serves through is up.
type Connected = Arc<dyn Fn() -> bool + Send + Sync>;

impl std::fmt::Debug for Console {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Console").field("addr", &self.addr).finish()
    }
}

impl Console {
    /// Checks `opts`, opens the run store, starts following the runs bucket and the
    /// notices, and binds `opts.listen`.
    pub async fn bind(bus: Bus, opts: ConsoleOptions) -> Result<Self, ConsoleError> {
        Self::bind_to(bus, opts.listen, opts).await
    }

    /// As [`bind`](Self::bind), on `addr` instead of `opts.listen` (port 0: any free port).
    pub async fn bind_to(
        bus: Bus,
        addr: SocketAddr,
        opts: ConsoleOptions,
    ) -> Result<Self, ConsoleError> {
        opts.validate()?;
        let (listener, addr) = listen(addr).await?;
        let (closing, stop_index) = (CancellationToken::new(), CancellationToken::new());
        let opts = Arc::new(opts);
        let nats = bus.client().clone();
        let state =
            AppState::start(bus, Arc::clone(&opts), None, closing.clone(), &stop_index).await?;
        Ok(Self {
            listener,
            addr,
            app: router(opts, api_routes().with_state(state)),
            closing,
            stop_index,
            connected: Arc::new(move || {
                nats.connection_state() == async_nats::connection::State::Connected
            }),
        })
    }

    /// A console of several tenants' installations (`flotilla console --tenants a,b` or
    /// `--all-tenants`), on `addr`: `nats` (no tenant) reaches the deployment's tenant
    /// records as its `console` user, and each tenant's installation is served through a
    /// connection of its own as `console@<tenant>`, at `/t/<tenant>/`. A signed-in identity
    /// sees the tenants whose record lists it in `people`; `administrators` see all.
    ///
    /// ```no_run
    /// # async fn demo(nats: flotilla_bus::NatsOptions) -> Result<(), flotilla_console::ConsoleError> {
    /// use flotilla_console::{Console, ConsoleOptions, Tenants};
    /// use flotilla_model::tenant::TenantName;
    /// let tenants = ["acme", "beta"].map(|t| TenantName::new(t).expect("a tenant name"));
    /// let opts = ConsoleOptions { administrators: vec!["root".into()], ..ConsoleOptions::default() };
    /// let console =
    ///     Console::bind_tenants(&nats, Tenants::Named(tenants.to_vec()), opts.listen, opts).await?;
    /// console.serve(tokio_util::sync::CancellationToken::new()).await?;
    /// # Ok(()) }
    /// ```
    pub async fn bind_tenants(
        nats: &flotilla_bus::NatsOptions,
        tenants: Tenants,
        addr: SocketAddr,
        opts: ConsoleOptions,
    ) -> Result<Self, ConsoleError> {
        opts.validate()?;
        let (listener, addr) = listen(addr).await?;
        let (closing, stop_index) = (CancellationToken::new(), CancellationToken::new());
        let opts = Arc::new(opts);
        let tenancy = tenancy::Tenancy::start(
            nats,
            tenants,
            Arc::clone(&opts),
            closing.clone(),
            stop_index.clone(),
        )
        .await?;
        let probe = Arc::clone(&tenancy);
        Ok(Self {
            listener,
            addr,
            app: router(opts, tenancy::routes(tenancy)),
            closing,
            stop_index,
            connected: Arc::new(move || probe.connected()),
        })
    }

    /// Whether the console's NATS connections are up (each tenant's and the tenant
    /// records' with several tenants): for its readiness.
    pub fn connected(&self) -> impl Fn() -> bool + Send + Sync + 'static {
        let c = Arc::clone(&self.connected);
        move || c()
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The URL to open (no secret in it: with tokens, add `?token=…` once).
    pub fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    /// Serves until `stop`.
    pub async fn serve(self, stop: CancellationToken) -> Result<(), ConsoleError> {
        let addr = self.addr;
        info!(%addr, "Console listening");
        let closing = self.closing.clone();
        let app = self.app;
        // The peer's address reaches the handlers: the proxy header is trusted by it.
        let result = axum::serve(
            self.listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        // A graceful stop waits for open connections; the event streams end with it (a page
        // holds one open for as long as it is shown).
        .with_graceful_shutdown(async move {
            stop.cancelled().await;
            closing.cancel();
        })
        .await
        .map_err(|source| ConsoleError::Listen { addr, source });
        self.stop_index.cancel();
        result
    }
}

/// Binds the listener on `addr`, and the address it got.
async fn listen(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), ConsoleError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| ConsoleError::Listen { addr, source })?;
    let addr = listener
        .local_addr()
        .map_err(|source| ConsoleError::Listen { addr, source })?;
    Ok((listener, addr))
}

impl AppState {
    /// One installation's console: its run store, the runs list kept from a watch of its runs
    /// bucket, its notices, and its pending approvals read again after each notice — until
    /// `stop`. `tenant`: whose installation it is (named in the audit; its usage is served).
    pub(crate) async fn start(
        bus: Bus,
        opts: Arc<ConsoleOptions>,
        tenant: Option<flotilla_model::tenant::TenantName>,
        closing: CancellationToken,
        stop: &CancellationToken,
    ) -> Result<Self, ConsoleError> {
        let store = flotilla_client::open_store(&bus).await?;
        let index = RunIndex::start(&store, stop.clone());
        let (notices, _) = broadcast::channel(64);
        let mut sub = bus
            .client()
            .subscribe(format!("{}.notify.>", bus.names().prefix()))
            .await?;
        let tx = notices.clone();
        let until = stop.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = until.cancelled() => return,
                    n = sub.next() => match n {
                        Some(_) => { let _ = tx.send(()); }
                        None => return,
                    },
                }
            }
        });
        // The pending approvals behind the runs list's `waiting`: read at start, after each
        // notice (approvals, questions and client tools each publish one) and every few
        // seconds (a deadline's default, an answer another console or the CLI gave).
        let client = Client::new(bus.clone());
        let (pending_index, until, mut notified) =
            (index.clone(), stop.clone(), notices.subscribe());
        tokio::spawn(async move {
            loop {
                if let Ok(p) = client.pending_approvals(None).await {
                    pending_index.set_pending(p);
                }
                tokio::select! {
                    _ = until.cancelled() => return,
                    _ = notified.recv() => {
                        // A burst of notices is read once.
                        tokio::time::sleep(PENDING_SETTLE).await;
                        while notified.try_recv().is_ok() {}
                    }
                    _ = tokio::time::sleep(PENDING_EVERY) => {}
                }
            }
        });
        Ok(AppState {
            client: Client::new(bus),
            store: Arc::new(store),
            index,
            opts,
            tenant,
            audit: Arc::new(Mutex::new(VecDeque::new())),
            notices,
            closing,
        })
    }
}

/// The API of one installation, under `/api/` (a console of several tenants serves one per
/// tenant under `/t/<tenant>/api/`).
fn api_routes() -> Router<AppState> {
    Router::new()
        .route("/api/me", get(api::me))
        .route("/api/runs", get(api::runs))
        .route("/api/runs/stream", get(api::runs_stream))
        .route("/api/runs/summaries", get(api::summaries))
        .route("/api/runs/{run}", get(api::run))
        .route("/api/runs/{run}/tree", get(api::tree))
        .route("/api/diff/{a}/{b}", get(api::diff))
        .route("/api/runs/{run}/events", get(api::events))
        .route("/api/runs/{run}/workspace", get(api::workspace))
        .route("/api/runs/{run}/mailbox/{reader}", get(api::mailbox))
        .route("/api/runs/{run}/state", get(api::state_keys))
        .route("/api/runs/{run}/state/{key}", get(api::state))
        .route("/api/runs/{run}/grants", get(api::grants))
        .route("/api/runs/{run}/tasks/{task}", get(api::task))
        // A fork has a body of its own; the static segment takes precedence over `{action}`.
        .route("/api/runs/{run}/fork", post(api::fork))
        .route("/api/runs/{run}/{action}", post(api::control))
        .route("/api/sessions/{session}", get(api::session))
        .route("/api/inbox", get(api::inbox))
        .route("/api/inbox/stream", get(api::inbox_stream))
        .route(
            "/api/approvals/{run}/{id}",
            get(api::approval).post(api::answer),
        )
        .route("/api/team", get(api::team))
        .route("/api/workers", get(api::workers))
        .route("/api/audit", get(api::audit))
}

/// The page, its assets and the health check, around `api` (the routes that read and act),
/// behind the checks of every request.
fn router(opts: Arc<ConsoleOptions>, api: Router) -> Router {
    Router::new()
        .route(
            "/",
            get(
                |State(o): State<Arc<ConsoleOptions>>, headers: http::HeaderMap, q| async move {
                    page(&o, &headers, q, "/")
                },
            ),
        )
        .route("/assets/app.js", get(|| asset(APP_JS, "text/javascript")))
        .route("/assets/app.css", get(|| asset(APP_CSS, "text/css")))
        // Browsers ask for /favicon.ico whatever the page links: both answer the same icon.
        .route("/favicon.svg", get(|| asset(FAVICON_SVG, "image/svg+xml")))
        .route("/favicon.ico", get(|| asset(FAVICON_SVG, "image/svg+xml")))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(Arc::clone(&opts))
        .merge(api)
        // Every route, the fallback too: reads as much as actions.
        .layer(axum::middleware::from_fn_with_state(opts, guard))
        .layer(axum::middleware::map_response(security_headers))
}

/// [`auth::admit`] before every route, with the connection's peer (none known: not a
/// trusted proxy).
async fn guard(State(opts): State<Arc<ConsoleOptions>>, mut req: Request, next: Next) -> Response {
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|ConnectInfo(a)| a.ip());
    let uri = req.uri().clone();
    match auth::admit(&opts, peer, &uri, req.headers_mut()) {
        Ok(auth::Admitted::AsIs) => {}
        Ok(auth::Admitted::DroppedIdentity) => warn!(
            peer = ?peer,
            header = opts.identity_header.as_deref().unwrap_or_default(),
            "A request carried the proxy identity header from a peer not in console.trusted-proxies; ignored it"
        ),
        Err(r) => {
            warn!(
                peer = ?peer,
                host = req
                    .headers()
                    .get(header::HOST)
                    .and_then(|h| h.to_str().ok())
                    .unwrap_or_default(),
                "A console request addressed to a name other than localhost or a loopback address; refused"
            );
            return api::refused(r);
        }
    }
    next.run(req).await
}

/// Headers every answer carries: no framing by other sites, no sniffing, no referrer
/// leaking run ids, scripts only from the console itself.
async fn security_headers(mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
        ),
    );
    r
}

async fn asset(body: &'static str, content_type: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// The page; `/?token=…` signs in: the token goes to an HttpOnly, SameSite=Strict cookie
/// and the browser is sent to `home` (`/`, or a tenant's `/t/<tenant>/`) so the token leaves
/// the address bar and the history.
pub(crate) fn page(
    opts: &ConsoleOptions,
    headers: &http::HeaderMap,
    Query(q): Query<HashMap<String, String>>,
    home: &str,
) -> Response {
    if let Some(token) = q.get("token") {
        if auth::identity_of_token(opts, token).is_none() {
            warn!("A console sign-in with an unknown token");
            return (StatusCode::UNAUTHORIZED, "unknown token").into_response();
        }
        // Behind a TLS-terminating proxy or Ingress, the cookie is for HTTPS only.
        let secure = headers
            .get("x-forwarded-proto")
            .is_some_and(|p| p.as_bytes().eq_ignore_ascii_case(b"https"));
        let cookie = format!(
            "{}={token}; HttpOnly; SameSite=Strict; Path=/{}",
            auth::TOKEN_COOKIE,
            if secure { "; Secure" } else { "" }
        );
        let mut r = Redirect::to(home).into_response();
        if let Ok(v) = HeaderValue::from_str(&cookie) {
            r.headers_mut().insert(header::SET_COOKIE, v);
        }
        return r;
    }
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        INDEX_HTML,
    )
        .into_response()
}
