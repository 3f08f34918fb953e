//! A console of several tenants (`flotilla console --tenants a,b`, `--all-tenants`): one
//! process and one listener serving each tenant's installation through a connection of its
//! own as `console@<tenant>` — its own run store, runs list, notices and pending approvals,
//! exactly what a console of that one installation holds — under `/t/<tenant>/`.
//!
//! ```text
//!  browser ── /t/<tenant>/api/… ──► dispatch ──► that tenant's API (its own connection, RunIndex, notices)
//!                                     │ who is asking (auth), and are they in <tenant>?
//!                                     └ tenant records ◄── watch of <prefix>-tenants (as `console`)
//! ```
//!
//! **Who sees what.** A signed-in identity sees the tenants whose record lists it in
//! `people` (`flotilla tenant add|set --person`); `[console] administrators` see every
//! tenant and are operators in each; in local mode (no tokens, no proxy header) the person
//! at the machine sees every tenant. A request for a tenant the identity is not in is
//! refused `403 not_in_tenant` before it reaches that tenant's API, so it reads and changes
//! nothing there. Membership is read from memory, from a watch of the deployment's tenant
//! records (history, then live) on the deployment's own `console` user, so `flotilla tenant
//! set --people` takes effect on the next request, without a restart.
//!
//! **Which tenants are served.** `--tenants a,b`: those, each with a record when the
//! console starts. `--all-tenants`: every tenant with a record, and those added later (their
//! installation is reached once the NATS server has their users: a failed connection is
//! tried again every few seconds); a removed tenant is no longer served.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Query, Request, State};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{any, get};
use flotilla_bus::mirror::KvMirror;
use flotilla_bus::{Bus, NatsOptions};
use flotilla_model::tenant::{TenantName, TenantRecord};
use flotilla_tenants::ledger::{Ledger, MAX_USAGE_DAYS};
use http::{HeaderMap, StatusCode};
use serde::Deserialize;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::ConsoleError;
use crate::api::{AppState, error, refused};
use crate::auth::{self, Identity};
use crate::options::ConsoleOptions;

/// Which tenants a console of several serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tenants {
    /// These (`--tenants a,b`): each must have a record when the console starts.
    Named(Vec<TenantName>),
    /// Every tenant with a record (`--all-tenants`), those added later too.
    All,
}

/// How long the console waits for the tenant records at start.
const RECORDS_WAIT: Duration = Duration::from_secs(30);
/// How often `--all-tenants` looks for tenants added or removed (in memory: the records
/// are watched).
const FOLLOW_EVERY: Duration = Duration::from_secs(1);
/// How long a tenant whose installation could not be reached waits for the next try.
const RETRY_EVERY: Duration = Duration::from_secs(5);
/// Milliseconds in a day (the usage panel's `days`).
const DAY_MS: i64 = 24 * 3600 * 1000;

/// One tenant's installation as the console serves it.
struct Installation {
    /// Its console (connection, run store, runs list, notices).
    state: AppState,
    /// Its API, as a console of that one installation serves it, with its usage.
    router: Router,
    /// Stops its runs list, notices and pending approvals.
    stop: CancellationToken,
}

/// The tenants a console serves, who may see each, and their installations.
pub(crate) struct Tenancy {
    opts: Arc<ConsoleOptions>,
    /// The connection options without a tenant: each tenant's are these with its name.
    nats: NatsOptions,
    /// The deployment's own connection (its `console` user): the tenant records.
    home: Bus,
    records: KvMirror<TenantRecord>,
    served: RwLock<BTreeMap<TenantName, Arc<Installation>>>,
    /// `--all-tenants`: tenants come and go with their records.
    all: bool,
    closing: CancellationToken,
    stop: CancellationToken,
}

impl Tenancy {
    /// Follows the tenant records, checks that every tenant of `tenants` has one, and
    /// reaches each tenant's installation (`--all-tenants`: those it can, the others later).
    pub(crate) async fn start(
        nats: &NatsOptions,
        tenants: Tenants,
        opts: Arc<ConsoleOptions>,
        closing: CancellationToken,
        stop: CancellationToken,
    ) -> Result<Arc<Self>, ConsoleError> {
        if let Some(t) = &nats.tenant {
            return Err(ConsoleError::Tenants(format!(
                "nats.tenant is {t:?}: a console of several tenants connects to each as console@<tenant>; drop --tenant / nats.tenant"
            )));
        }
        let home = Bus::connect(nats, "flotilla-console")
            .await
            .map_err(|e| ConsoleError::Tenants(format!("connecting as the console user: {e}")))?;
        let bucket = flotilla_tenants::store::bucket_name(home.names().prefix());
        let kv = home.js().get_key_value(&bucket).await.map_err(|e| {
            ConsoleError::Tenants(format!(
                "no tenant bucket {bucket}: no tenant was added (`flotilla tenant add`), or the console user may not read it ({e})"
            ))
        })?;
        let records = KvMirror::new();
        records.follow(kv, stop.clone());
        tokio::time::timeout(RECORDS_WAIT, records.synced())
            .await
            .map_err(|_| {
                ConsoleError::Tenants(format!(
                    "the records of {bucket} did not arrive within {}s",
                    RECORDS_WAIT.as_secs()
                ))
            })?;
        let this = Arc::new(Self {
            opts,
            nats: nats.clone(),
            home,
            records,
            served: RwLock::default(),
            all: tenants == Tenants::All,
            closing,
            stop,
        });
        match tenants {
            Tenants::Named(names) => {
                if let Some(unknown) = names.iter().find(|n| this.record(n).is_none()) {
                    return Err(ConsoleError::UnknownTenant(unknown.to_string()));
                }
                for name in names {
                    let installation = this.open(&name).await?;
                    this.write().insert(name, Arc::new(installation));
                }
            }
            Tenants::All => {
                // The tenants there now are served from the start when they can be; the others
                // (and those added later) by the follower.
                let mut failed = HashMap::new();
                for (key, _) in this.records.all() {
                    let Ok(name) = TenantName::new(&key) else {
                        continue;
                    };
                    this.try_open(&name, &mut failed).await;
                }
                tokio::spawn(Arc::clone(&this).follow(failed));
            }
        }
        info!(tenants = ?this.served_names(), all = this.all, "Console serving tenants");
        Ok(this)
    }

    /// Reaches tenant `name`'s installation as `console@<name>` and starts its console.
    async fn open(&self, name: &TenantName) -> Result<Installation, ConsoleError> {
        let mut nats = self.nats.clone();
        nats.tenant = Some(name.to_string());
        let bus = Bus::connect(&nats, "flotilla-console")
            .await
            .map_err(|source| ConsoleError::Connect {
                tenant: name.to_string(),
                source,
            })?;
        let stop = self.stop.child_token();
        let state = match AppState::start(
            bus,
            Arc::clone(&self.opts),
            Some(name.clone()),
            self.closing.clone(),
            &stop,
        )
        .await
        {
            Ok(s) => s,
            Err(e) => {
                stop.cancel();
                return Err(e);
            }
        };
        let router = crate::api_routes()
            .route("/api/usage", get(usage))
            .with_state(state.clone());
        Ok(Installation {
            state,
            router,
            stop,
        })
    }

    /// `--all-tenants`: serves each tenant whose record appears (trying again every few
    /// seconds while its installation cannot be reached) and stops serving those whose
    /// record goes, until the console stops.
    async fn follow(self: Arc<Self>, mut failed: HashMap<TenantName, tokio::time::Instant>) {
        loop {
            let known: BTreeSet<TenantName> = self
                .records
                .all()
                .into_iter()
                .filter_map(|(k, _)| TenantName::new(&k).ok())
                .collect();
            let gone: Vec<TenantName> = self
                .served_names()
                .into_iter()
                .filter(|n| !known.contains(n))
                .collect();
            for name in gone {
                if let Some(i) = self.write().remove(&name) {
                    i.stop.cancel();
                    info!(tenant = %name, "The tenant's record was removed; the console no longer serves it");
                }
            }
            for name in known {
                let served = self.read().contains_key(&name);
                let waiting = failed
                    .get(&name)
                    .is_some_and(|at| at.elapsed() < RETRY_EVERY);
                if served || waiting {
                    continue;
                }
                self.try_open(&name, &mut failed).await;
            }
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = tokio::time::sleep(FOLLOW_EVERY) => {}
            }
        }
    }

    /// Serves tenant `name` if its installation can be reached; `failed` holds when each
    /// tenant that could not be was last tried.
    async fn try_open(
        &self,
        name: &TenantName,
        failed: &mut HashMap<TenantName, tokio::time::Instant>,
    ) {
        match self.open(name).await {
            Ok(i) => {
                failed.remove(name);
                self.write().insert(name.clone(), Arc::new(i));
                info!(tenant = %name, "Console serving the tenant");
            }
            Err(e) => {
                // Said once; the NATS users of a tenant just added come with the next
                // `tenant nats-config` and reload.
                if failed
                    .insert(name.clone(), tokio::time::Instant::now())
                    .is_none()
                {
                    warn!(tenant = %name, error = %e, "Cannot reach the tenant's installation yet; trying again every few seconds");
                } else {
                    debug!(tenant = %name, error = %e, "Cannot reach the tenant's installation yet");
                }
            }
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<TenantName, Arc<Installation>>> {
        self.served.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<TenantName, Arc<Installation>>> {
        self.served.write().unwrap_or_else(|p| p.into_inner())
    }

    fn served_names(&self) -> Vec<TenantName> {
        self.read().keys().cloned().collect()
    }

    /// Tenant `name`'s record, as last watched.
    fn record(&self, name: &TenantName) -> Option<TenantRecord> {
        self.records.get(name.as_str()).map(|m| m.value)
    }

    /// Whether the deployment's connection and every tenant's are up.
    pub(crate) fn connected(&self) -> bool {
        let up = |c: &async_nats::Client| {
            c.connection_state() == async_nats::connection::State::Connected
        };
        up(self.home.client())
            && self
                .read()
                .values()
                .all(|i| up(i.state.client.bus().client()))
    }

    /// Whether `who` sees every tenant: an administrator, or the person at this machine (local
    /// mode: no tokens and no proxy header).
    fn sees_all(&self, who: &Identity) -> bool {
        self.opts.is_administrator(&who.name) || self.opts.is_local()
    }

    /// Whether `who` sees the tenant of `record`.
    fn sees(&self, who: &Identity, record: &TenantRecord) -> bool {
        self.sees_all(who) || record.people.contains(&who.name)
    }

    /// The tenants served that `who` sees, by name.
    fn mine(&self, who: &Identity) -> Vec<TenantName> {
        self.served_names()
            .into_iter()
            .filter(|n| self.record(n).is_some_and(|r| self.sees(who, &r)))
            .collect()
    }

    /// The installation of `tenant` (as written in the path) for `who`, or the refusal:
    /// `403 not_in_tenant` for a tenant they are not in — whether it exists or not, which
    /// they are not told —, `404 unknown_tenant` for one that has no record or this console
    /// does not serve, `503 tenant_unavailable` for one it cannot reach yet.
    fn admit(&self, who: &Identity, tenant: &str) -> Result<Arc<Installation>, Denied> {
        let name = TenantName::new(tenant).ok();
        let record = name.as_ref().and_then(|n| self.record(n));
        let (Some(name), Some(record)) = (name, record) else {
            if self.sees_all(who) {
                return Err(Denied(
                    StatusCode::NOT_FOUND,
                    "unknown_tenant",
                    format!("there is no tenant {tenant:?} (`flotilla tenant list` shows them)"),
                ));
            }
            return Err(not_in_tenant(who, tenant));
        };
        if !self.sees(who, &record) {
            return Err(not_in_tenant(who, tenant));
        }
        match self.read().get(&name) {
            Some(i) => Ok(Arc::clone(i)),
            None if self.all => Err(Denied(
                StatusCode::SERVICE_UNAVAILABLE,
                "tenant_unavailable",
                format!(
                    "the console cannot reach tenant {name}'s installation yet (its NATS users come with `flotilla tenant nats-config` and a reload)"
                ),
            )),
            None => Err(Denied(
                StatusCode::NOT_FOUND,
                "unknown_tenant",
                format!(
                    "this console does not serve tenant {name} (it serves those of `flotilla console --tenants`)"
                ),
            )),
        }
    }
}

/// A request refused before it reached a tenant's API: status, code, message.
struct Denied(StatusCode, &'static str, String);

/// The refusal of a request for a tenant `who` is not in: it names the tenant, and is logged.
fn not_in_tenant(who: &Identity, tenant: &str) -> Denied {
    warn!(by = %who.name, tenant, "A console request for a tenant the identity is not in; refused");
    Denied(
        StatusCode::FORBIDDEN,
        "not_in_tenant",
        format!(
            "{} is not in tenant {tenant:?}: a tenant's people (`flotilla tenant set {tenant} --person …`) and the console's administrators see it",
            who.name
        ),
    )
}

/// The routes of a console of several tenants: the page at `/` (it opens the person's first
/// tenant) and at `/t/<tenant>/`, who is signed in with their tenants at `/api/me`, and
/// each tenant's API at `/t/<tenant>/api/…`. Any other `/api/…` names no tenant: `400
/// tenant_required`.
pub(crate) fn routes(tenancy: Arc<Tenancy>) -> Router {
    Router::new()
        .route("/api/me", get(me))
        .route("/api/{*rest}", any(tenant_required))
        .route("/t/{tenant}", get(to_tenant_page))
        .route("/t/{tenant}/", get(tenant_page))
        .route("/t/{tenant}/api/{*rest}", any(dispatch))
        .with_state(tenancy)
}

/// Who is signed in, and the tenants they see (the page's tenant picker).
async fn me(State(t): State<Arc<Tenancy>>, headers: HeaderMap) -> Response {
    let who = match auth::identify(&t.opts, &headers) {
        Ok(w) => w,
        Err(r) => return refused(r),
    };
    axum::Json(json!({
        "name": who.name,
        "operator": who.operator,
        "administrator": t.opts.is_administrator(&who.name),
        "tenants": t.mine(&who),
    }))
    .into_response()
}

async fn tenant_required(uri: http::Uri) -> Response {
    error(
        StatusCode::BAD_REQUEST,
        "tenant_required",
        format!(
            "this console serves several tenants: ask /t/TENANT{} (GET /api/me lists your tenants)",
            uri.path()
        ),
    )
}

/// `/t/<tenant>` → `/t/<tenant>/` (the page's relative paths need the slash).
async fn to_tenant_page(Path(tenant): Path<String>) -> Response {
    match TenantName::new(&tenant) {
        Ok(name) => Redirect::permanent(&format!("/t/{name}/")).into_response(),
        Err(_) => StatusCode::NOT_FOUND.into_response(),
    }
}

/// The page, for one tenant (which tenants the person sees is the API's to say).
async fn tenant_page(
    State(t): State<Arc<Tenancy>>,
    Path(tenant): Path<String>,
    headers: HeaderMap,
    q: Query<HashMap<String, String>>,
) -> Response {
    // A sign-in goes back to this tenant's page: only ever a tenant's path of this console.
    let home = match TenantName::new(&tenant) {
        Ok(name) => format!("/t/{name}/"),
        Err(_) => "/".to_owned(),
    };
    crate::page(&t.opts, &headers, q, &home)
}

/// `/t/<tenant>/api/…`: the request goes to that tenant's API as `/api/…`, once the
/// identity is known and in the tenant.
async fn dispatch(
    State(t): State<Arc<Tenancy>>,
    Path((tenant, _)): Path<(String, String)>,
    req: Request,
) -> Response {
    let who = match auth::identify(&t.opts, req.headers()) {
        Ok(w) => w,
        Err(r) => return refused(r),
    };
    let installation = match t.admit(&who, &tenant) {
        Ok(i) => i,
        Err(Denied(status, code, message)) => return error(status, code, message),
    };
    let (parts, body) = req.into_parts();
    // The path as sent (still percent-encoded) after `/t/<tenant>`: a tenant's name needs no
    // encoding.
    let rest = parts
        .uri
        .path()
        .strip_prefix(&format!("/t/{tenant}"))
        .unwrap_or_default();
    let target = match parts.uri.query() {
        Some(q) => format!("{rest}?{q}"),
        None => rest.to_owned(),
    };
    let Ok(uri) = target.parse::<http::Uri>() else {
        return error(StatusCode::BAD_REQUEST, "bad_path", target);
    };
    // A fresh request: the outer route's path parameters must not reach the tenant's routes
    // (axum adds a nested route's parameters to those already there).
    let mut forwarded = Request::new(body);
    *forwarded.method_mut() = parts.method;
    *forwarded.uri_mut() = uri;
    *forwarded.version_mut() = parts.version;
    *forwarded.headers_mut() = parts.headers;
    let mut router = installation.router.clone();
    match tower::Service::call(&mut router, forwarded).await {
        Ok(r) => r,
        Err(never) => match never {},
    }
}

/// `/t/<tenant>/api/usage` query.
#[derive(Debug, Deserialize)]
struct UsageQuery {
    /// Days back from today (default 7, as `flotilla tenant usage`'s `--since 7d`).
    #[serde(default)]
    days: Option<usize>,
}

/// The tenant's quotas, counters and usage by day, agent and model — the document
/// `flotilla tenant usage <tenant> --json` prints ([`flotilla_tenants::ledger::Usage`]),
/// read from its installation's usage bucket.
async fn usage(
    State(s): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<UsageQuery>,
) -> Response {
    if let Err(r) = auth::identify(&s.opts, &headers) {
        return refused(r);
    }
    let days = q.days.unwrap_or(7);
    if !(1..=MAX_USAGE_DAYS).contains(&days) {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_days",
            format!("days must be 1 to {MAX_USAGE_DAYS}, not {days}"),
        );
    }
    let since_ms = flotilla_model::time::Timestamp::now()
        .unix_ms()
        .saturating_sub(i64::try_from(days).unwrap_or(0) * DAY_MS);
    let ledger = match Ledger::open(s.client.bus()).await {
        Ok(l) => l.with_tenant(s.tenant.clone()),
        Err(e) => return error(StatusCode::BAD_GATEWAY, "upstream", e.to_string()),
    };
    match ledger.usage(since_ms).await {
        Ok(u) => axum::Json(u).into_response(),
        Err(e) => error(StatusCode::BAD_GATEWAY, "upstream", e.to_string()),
    }
}
