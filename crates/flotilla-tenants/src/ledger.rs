//! Quotas and what they count: the KV bucket `<prefix>-usage` of every installation (the
//! deployment's own and each tenant's), kept by the coordinators of that installation with
//! compare-and-set, so any number of them hold one limit together.
//!
//! | Key | Value | Written |
//! |---|---|---|
//! | `quotas` | the installation's [`Quotas`] (JSON) | by the operator ([`Ledger::set_quotas`], `flotilla tenant add|set`) |
//! | `concurrent` | the root runs holding a slot, with when each was admitted ([`Held`]) | at admission and at each run's end, while `concurrent_runs` is set |
//! | `runs.h.<yyyymmddhh>` | root runs admitted in that clock hour (UTC) | at admission, while `runs_per_hour` is set |
//! | `tokens.d.<yyyymmdd>` | model tokens of the runs that ended that day (UTC) | at each run's end |
//! | `cost.m.<yyyymm>` | their cost in millionths of a US dollar, per calendar month (UTC) | at each run's end |
//! | `use.d.<yyyymmdd>` | the day's tokens, cost and calls by agent and model ([`DayDoc`]) | at each run's end |
//! | `end.<run>` | marks a run's usage as counted (expires after [`END_MARKER_TTL`]) | at each run's end |
//! | `teammates` | the persistent teammates counted against `persistent_teammates` ([`Mates`]) | by the supervisors, at each spawn and shutdown, while the quota is set |
//!
//! A tenant's installation counts its runs' usage (`tokens.d`, `cost.m`, `use.d`, `end.<run>`)
//! with or without quotas — its cost per tenant — off the runs' path (after their end is
//! told). Otherwise nothing is written while the installation has no quotas: a deployment
//! without them pays
//! nothing, neither at admission nor at a run's end (the coordinators follow `quotas` and
//! `concurrent` with a KV watch, [`Ledger::follow`], and read them from memory).
//!
//! ```text
//!  root run submitted ─► admit ── tokens.d / cost.m at the limit? ──yes──► refused (quota_exceeded)
//!                          │ no
//!                          ├─ runs.h at the limit? ────────────────yes──► refused
//!                          ├─ concurrent: run held already? ──yes──► admitted again (nothing counted)
//!                          │     full? ───────────────────────yes──► refused, or waits (`queue`)
//!                          │     CAS: add the run
//!                          ├─ runs.h: CAS +1 (full meanwhile: the run is taken out again, refused)
//!                          ▼
//!                      admitted, with what is left of the day's tokens and the month's cost
//!
//!  run ended ─► release: CAS remove the run from `concurrent` (a run not held: nothing)
//!            └► account: create end.<run> (exists: counted already) ─► CAS tokens.d, cost.m, use.d
//! ```
//!
//! **Exactly the limit.** Every change is a compare-and-set on one key, retried on conflict,
//! so coordinators admitting at the same moment never pass `concurrent_runs` or
//! `runs_per_hour` together. A refusal by `runs_per_hour` after the slot was taken gives the
//! slot back: another submission may be refused meanwhile (the slot looked taken), none is
//! admitted beyond the limit.
//!
//! **Idempotent.** Admitting a run already held counts nothing again (a redelivered
//! submission, a step retried); releasing a run not held changes nothing (an end performed
//! again by a successor). A run's usage is counted once: the first to create `end.<run>`
//! counts it. A coordinator killed between the marker and the counters loses that run's
//! usage from the counters (the marker is taken first so that two coordinators performing the
//! same end never both count it).
//!
//! Child runs are not admitted here (a tree is never refused halfway); their usage counts at
//! their own end, each run once.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::kv;
use flotilla_bus::Bus;
use flotilla_bus::mirror::KvMirror;
use flotilla_model::RunId;
use flotilla_model::plan::Budget;
use flotilla_model::subjects::Bucket;
use flotilla_model::tenant::{QuotaExceeded, QuotaKind, Quotas, TenantName};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::error::{TenantError, TenantErrorKind};

/// Key of the installation's [`Quotas`].
pub const QUOTAS_KEY: &str = "quotas";
/// Key of the runs holding a slot ([`Held`]).
pub const HELD_KEY: &str = "concurrent";
/// How long a run's `end.<run>` marker is kept: far longer than any repeat of its end (a
/// successor performs a stored end again within the duplicate window, or when the inputs that
/// ended it are redelivered, within minutes).
pub const END_MARKER_TTL: Duration = Duration::from_secs(24 * 3600);
/// Most `(agent, model)` pairs a day's usage keeps; later pairs count under
/// [`OTHER`]/[`OTHER`] (model names come from providers: a bound, whatever they report).
pub const MAX_USAGE_PAIRS: usize = 256;
/// Agent and model under which usage beyond [`MAX_USAGE_PAIRS`] is counted.
pub const OTHER: &str = "_other";
/// Most concurrent runs a quota may allow: the runs held are one KV value (about 55 bytes
/// each), which must fit one message.
pub const MAX_CONCURRENT_RUNS: u64 = 10_000;
/// The smallest `workspace_bytes`: the workspace stream's largest message (an entry of
/// 1 MiB with its envelope), which the NATS server requires `max_bytes` to hold.
pub const MIN_WORKSPACE_BYTES: u64 = flotilla_model::workspace::MAX_ENTRY_BYTES as u64 + 64 * 1024;
/// Days [`Ledger::usage`] reports at most.
pub const MAX_USAGE_DAYS: usize = 400;

/// Key of the persistent teammates counted against `persistent_teammates` ([`Mates`]).
pub const TEAMMATES_KEY: &str = "teammates";
/// How long a teammate's place is kept while no supervisor sees the teammate: one killed
/// between taking the place and creating the teammate leaves it taken no longer than this.
pub const TEAMMATE_GRACE_MS: i64 = 60_000;

/// Compare-and-set tries on one key before giving up.
const MAX_TRIES: usize = 64;

const HOUR_MS: i64 = 3_600_000;
const DAY_MS: i64 = 24 * HOUR_MS;

/// The root runs holding a slot (`concurrent_runs`), with when each was admitted (Unix ms).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Held {
    /// Run and admission time.
    #[serde(default)]
    pub runs: BTreeMap<RunId, i64>,
}

/// Tokens, cost and model calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spend {
    /// Prompt and completion tokens.
    pub tokens: u64,
    /// Cost in millionths of a US dollar (of the calls whose agent has a price).
    pub cost_micros: u64,
    /// Model calls.
    pub calls: u64,
}

impl Spend {
    fn add(&mut self, other: Spend) {
        self.tokens = self.tokens.saturating_add(other.tokens);
        self.cost_micros = self.cost_micros.saturating_add(other.cost_micros);
        self.calls = self.calls.saturating_add(other.calls);
    }
}

/// What one run spent, by agent and model (from its `usage` events).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunUsage {
    /// Agent, then model.
    pub by: BTreeMap<String, BTreeMap<String, Spend>>,
}

impl RunUsage {
    /// Counts one model call of `agent` answered by `model`.
    pub fn add(&mut self, agent: &str, model: &str, tokens: u64, cost_usd: Option<f64>) {
        let spend = Spend {
            tokens,
            cost_micros: micros(cost_usd.unwrap_or(0.0)),
            calls: 1,
        };
        self.by
            .entry(agent.to_owned())
            .or_default()
            .entry(model.to_owned())
            .or_default()
            .add(spend);
    }

    /// Everything together.
    pub fn total(&self) -> Spend {
        let mut t = Spend::default();
        for s in self.by.values().flat_map(BTreeMap::values) {
            t.add(*s);
        }
        t
    }

    /// Whether it spent nothing (no model call).
    pub fn is_empty(&self) -> bool {
        self.total() == Spend::default()
    }
}

/// US dollars in millionths (rounded; negative and non-finite amounts count 0).
pub fn micros(usd: f64) -> u64 {
    if usd.is_finite() && usd > 0.0 {
        (usd * 1_000_000.0).round() as u64
    } else {
        0
    }
}

/// One day's usage as stored (`use.d.<yyyymmdd>`): agent, then model.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DayDoc {
    /// Agent, then model.
    #[serde(default)]
    pub by: BTreeMap<String, BTreeMap<String, Spend>>,
}

impl DayDoc {
    /// Adds `run`'s usage, keeping at most [`MAX_USAGE_PAIRS`] pairs.
    pub fn add(&mut self, run: &RunUsage) {
        for (agent, models) in &run.by {
            for (model, spend) in models {
                let pairs: usize = self.by.values().map(BTreeMap::len).sum();
                let known = self.by.get(agent).is_some_and(|m| m.contains_key(model));
                let (a, m) = if known || pairs < MAX_USAGE_PAIRS {
                    (agent.as_str(), model.as_str())
                } else {
                    (OTHER, OTHER)
                };
                self.by
                    .entry(a.to_owned())
                    .or_default()
                    .entry(m.to_owned())
                    .or_default()
                    .add(*spend);
            }
        }
    }
}

/// The windows a moment falls in: its clock hour, day and month (UTC), as key suffixes, and
/// when each ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Windows {
    /// `yyyymmddhh`.
    pub hour: String,
    /// `yyyymmdd`.
    pub day: String,
    /// `yyyymm`.
    pub month: String,
    /// When the hour ends (Unix ms): `runs_per_hour` resets.
    pub hour_ends_ms: i64,
    /// When the day ends: `tokens_per_day` resets.
    pub day_ends_ms: i64,
    /// When the month ends: `cost_per_month` resets.
    pub month_ends_ms: i64,
}

/// The windows of `now_ms` (Unix ms).
pub fn windows(now_ms: i64) -> Windows {
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(now_ms) * 1_000_000)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    let (y, m, d, h) = (t.year(), u8::from(t.month()), t.day(), t.hour());
    let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
    let month_ends_ms = time::Month::try_from(nm)
        .ok()
        .and_then(|month| time::Date::from_calendar_date(ny, month, 1).ok())
        .map_or(i64::MAX, |date| {
            i64::try_from(date.midnight().assume_utc().unix_timestamp_nanos() / 1_000_000)
                .unwrap_or(i64::MAX)
        });
    Windows {
        hour: format!("{y:04}{m:02}{d:02}{h:02}"),
        day: format!("{y:04}{m:02}{d:02}"),
        month: format!("{y:04}{m:02}"),
        hour_ends_ms: (now_ms.div_euclid(HOUR_MS) + 1) * HOUR_MS,
        day_ends_ms: (now_ms.div_euclid(DAY_MS) + 1) * DAY_MS,
        month_ends_ms,
    }
}

/// Key of the root runs admitted in clock hour `hour` (`yyyymmddhh`).
pub fn runs_key(hour: &str) -> String {
    format!("runs.h.{hour}")
}

/// Key of the tokens of day `day` (`yyyymmdd`).
pub fn tokens_key(day: &str) -> String {
    format!("tokens.d.{day}")
}

/// Key of the cost of month `month` (`yyyymm`).
pub fn cost_key(month: &str) -> String {
    format!("cost.m.{month}")
}

/// Key of day `day`'s usage by agent and model.
pub fn day_key(day: &str) -> String {
    format!("use.d.{day}")
}

/// Key of the marker that run `run`'s usage is counted.
pub fn end_key(run: RunId) -> String {
    format!("end.{run}")
}

/// Whether `q` makes sense; the reason it does not, naming the quota.
pub fn check_quotas(q: &Quotas) -> Result<(), String> {
    for kind in QuotaKind::ALL {
        if q.limit(kind) == Some(0) {
            return Err(format!(
                "{kind} = 0 admits nothing; set at least 1, or leave it unset for no limit"
            ));
        }
    }
    if let Some(n) = q.concurrent_runs.filter(|n| *n > MAX_CONCURRENT_RUNS) {
        return Err(format!(
            "concurrent_runs = {n} is more than {MAX_CONCURRENT_RUNS}, the most a quota can hold"
        ));
    }
    if let Some(n) = q.workspace_bytes.filter(|n| *n < MIN_WORKSPACE_BYTES) {
        return Err(format!(
            "workspace_bytes = {n} is less than one entry of the largest size ({MIN_WORKSPACE_BYTES} bytes, an entry of 1 MiB with its envelope); set at least that"
        ));
    }
    for (i, kind) in q.queue.iter().enumerate() {
        if q.queue[..i].contains(kind) {
            return Err(format!("queue names {kind} twice"));
        }
        if q.limit(*kind).is_none() {
            return Err(format!(
                "queue names {kind}, which has no limit to wait for"
            ));
        }
        if matches!(
            kind,
            QuotaKind::ModelRequestsPerMinute | QuotaKind::ModelTokensPerMinute
        ) {
            return Err(format!(
                "{kind} is not queued: a model call over it always waits for its turn (never past its attempt's deadline)"
            ));
        }
        if *kind != QuotaKind::ConcurrentRuns {
            return Err(format!(
                "{kind} cannot queue: only concurrent_runs waits (for one of the tenant's runs to end); {kind} refuses"
            ));
        }
    }
    Ok(())
}

/// What admission decided about a root run.
#[derive(Debug, Clone, PartialEq)]
pub enum Admission {
    /// The installation has no quotas: nothing was read or written.
    Unlimited,
    /// Admitted. `reserved`: this call took the run's slot (`false`: it held one already,
    /// or no `concurrent_runs` applies). `budget`: what is left of the day's tokens and the
    /// month's cost, for the run's budget scope (none without those quotas).
    Admitted {
        /// Whether a slot was taken now (to give back if the run is not started after all).
        reserved: bool,
        /// The tenant's remaining tokens and cost, as a budget.
        budget: Option<Budget>,
    },
    /// Refused by `exceeded`; `queue`: its quota is one that waits (`Quotas::queue`).
    Refused {
        /// Which quota, its limit, what is used, when it resets.
        exceeded: QuotaExceeded,
        /// Whether the submission may wait instead of being refused.
        queue: bool,
    },
}

/// Current counters and limits, and usage by day, agent and model ([`Ledger::usage`],
/// `flotilla tenant usage`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    /// The tenant (absent: the deployment's own installation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<TenantName>,
    /// The installation's quotas (empty: none, nothing is counted).
    pub quotas: Quotas,
    /// The counters now.
    pub current: Current,
    /// Days from the one holding `since_ms`, oldest first (only days with usage).
    pub days: Vec<DayUsage>,
}

/// The counters now, and when each window resets.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Current {
    /// Root runs holding a slot.
    pub concurrent_runs: u64,
    /// Root runs admitted this clock hour.
    pub runs_this_hour: u64,
    /// Tokens of the runs that ended today.
    pub tokens_today: u64,
    /// Their cost this month, in millionths of a US dollar.
    pub cost_this_month_micros: u64,
    /// When the hour ends (Unix ms).
    pub hour_resets_at_ms: i64,
    /// When the day ends.
    pub day_resets_at_ms: i64,
    /// When the month ends.
    pub month_resets_at_ms: i64,
    /// Bytes the workspace holds (`workspace_bytes`).
    #[serde(default)]
    pub workspace_bytes: u64,
    /// Bytes the mailboxes hold (`mailbox_bytes`).
    #[serde(default)]
    pub mailbox_bytes: u64,
    /// Persistent teammates holding a place (counted only while `persistent_teammates` is
    /// set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_teammates: Option<u64>,
}

/// One day's usage.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DayUsage {
    /// The day (`yyyy-mm-dd`, UTC).
    pub day: String,
    /// Everything together.
    pub total: Spend,
    /// By agent and model, largest token count first.
    pub by: Vec<AgentModelUsage>,
}

/// One agent's usage of one model on one day.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentModelUsage {
    /// The agent (the task's, or the deployment's default agent).
    pub agent: String,
    /// The model (as the provider reported it).
    pub model: String,
    /// Tokens, cost and calls.
    #[serde(flatten)]
    pub spend: Spend,
}

/// The persistent teammates holding a place under `persistent_teammates`: teammate key
/// (`teammate.<team>.<name>`) and when its place was taken (Unix ms).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Mates {
    /// Teammate key and when its place was taken.
    #[serde(default)]
    pub mates: BTreeMap<String, i64>,
}

/// One change of a value under compare-and-set.
enum Change<T, R> {
    /// Write `T`, then answer `R`.
    Write(T, R),
    /// Write nothing; answer `R`.
    Keep(R),
}

/// The quotas and usage of one installation (its bus's prefix).
#[derive(Debug, Clone)]
pub struct Ledger {
    bus: Bus,
    kv: kv::Store,
    tenant: Option<TenantName>,
    quotas: KvMirror<Quotas>,
    held: KvMirror<Held>,
    following: bool,
    follows_held: bool,
}

fn nats(what: &str, e: impl std::error::Error + Send + Sync + 'static) -> TenantError {
    TenantError::nats(what.to_owned(), e)
}

impl Ledger {
    /// The ledger of `bus`'s installation (its bucket `<prefix>-usage` must be provisioned).
    ///
    /// ```no_run
    /// # async fn f(bus: flotilla_bus::Bus) -> Result<(), flotilla_tenants::TenantError> {
    /// use flotilla_model::tenant::Quotas;
    /// let ledger = flotilla_tenants::ledger::Ledger::open(&bus).await?;
    /// ledger.set_quotas(&Quotas { concurrent_runs: Some(10), ..Quotas::default() }).await?;
    /// # Ok(()) }
    /// ```
    pub async fn open(bus: &Bus) -> Result<Ledger, TenantError> {
        let kv = bus
            .kv(Bucket::Usage)
            .await
            .map_err(|e| nats("opening the usage bucket", e))?;
        Ok(Self {
            bus: bus.clone(),
            kv,
            tenant: None,
            quotas: KvMirror::new(),
            held: KvMirror::new(),
            following: false,
            follows_held: false,
        })
    }

    /// Names the tenant whose installation this is (in refusals and usage).
    pub fn with_tenant(mut self, tenant: Option<TenantName>) -> Self {
        self.tenant = tenant;
        self
    }

    /// The tenant whose installation this is.
    pub fn tenant(&self) -> Option<&TenantName> {
        self.tenant.as_ref()
    }

    /// Follows `quotas` and `concurrent` with KV watches until `shutdown`, so admissions and
    /// run ends read them from memory: wait for [`Ledger::synced`] before admitting.
    pub fn follow(&mut self, shutdown: CancellationToken) {
        self.quotas
            .follow_keys(self.kv.clone(), QUOTAS_KEY, shutdown.clone());
        self.held.follow_keys(self.kv.clone(), HELD_KEY, shutdown);
        self.following = true;
        self.follows_held = true;
    }

    /// Follows only `quotas` (a supervisor: it holds no runs), like [`Ledger::follow`].
    pub fn follow_quotas(&mut self, shutdown: CancellationToken) {
        self.quotas
            .follow_keys(self.kv.clone(), QUOTAS_KEY, shutdown);
        self.following = true;
    }

    /// Once the watches hold the values written before they started.
    pub async fn synced(&self) {
        self.quotas.synced().await;
        if self.follows_held {
            self.held.synced().await;
        }
    }

    /// Sets the installation's quotas; empty quotas remove them (nothing is counted any
    /// more). Nonsense (a limit of 0, a queue for a quota that cannot wait) is refused
    /// `invalid_quotas` and nothing is written.
    pub async fn set_quotas(&self, quotas: &Quotas) -> Result<(), TenantError> {
        check_quotas(quotas).map_err(|e| TenantError::new(TenantErrorKind::InvalidQuotas, e))?;
        if quotas.is_empty() {
            return self
                .kv
                .delete(QUOTAS_KEY)
                .await
                .map_err(|e| nats("removing the quotas", e));
        }
        let body = serde_json::to_vec(quotas)
            .map_err(|e| TenantError::new(TenantErrorKind::Decode, e.to_string()))?;
        self.kv
            .put(QUOTAS_KEY, body.into())
            .await
            .map_err(|e| nats("writing the quotas", e))?;
        Ok(())
    }

    /// The installation's quotas as stored (`None`: none).
    pub async fn quotas(&self) -> Result<Option<Quotas>, TenantError> {
        let (q, revision) = self.read::<Option<Quotas>>(QUOTAS_KEY).await?;
        Ok(q.filter(|q| revision > 0 && !q.is_empty()))
    }

    /// The quotas in force as the watch last saw them (no I/O): `None` without quotas, or
    /// when not following (then [`Ledger::quotas`] reads them).
    pub fn active(&self) -> Option<Quotas> {
        self.quotas
            .get(QUOTAS_KEY)
            .map(|m| m.value)
            .filter(|q| !q.is_empty())
    }

    async fn in_force(&self) -> Result<Option<Quotas>, TenantError> {
        if self.following {
            Ok(self.active())
        } else {
            self.quotas().await
        }
    }

    /// Admits root run `run` at `now_ms` (Unix ms) under the quotas in force: refuses it when
    /// the day's tokens or the month's cost is at its limit, or when `runs_per_hour` or
    /// `concurrent_runs` is full; otherwise takes its slot and counts it in the hour. A run
    /// already holding a slot is admitted again without counting anything.
    pub async fn admit(&self, run: RunId, now_ms: i64) -> Result<Admission, TenantError> {
        let Some(q) = self.in_force().await? else {
            return Ok(Admission::Unlimited);
        };
        // Held already (its submission redelivered before its start was recorded): admitted
        // when it took its slot, whatever was spent since.
        if q.concurrent_runs.is_some()
            && self.held.read(|m| {
                m.get(HELD_KEY)
                    .is_some_and(|h| h.value.runs.contains_key(&run))
            })
        {
            return Ok(Admission::Admitted {
                reserved: false,
                budget: self.left(now_ms).await?,
            });
        }
        let w = windows(now_ms);
        let refuse = |quota: QuotaKind, limit: u64, used: u64, resets_at_ms: Option<i64>| {
            Admission::Refused {
                exceeded: QuotaExceeded {
                    tenant: self.tenant.clone(),
                    quota,
                    limit,
                    used,
                    resets_at_ms,
                },
                queue: q.queue.contains(&quota),
            }
        };
        let mut budget = Budget {
            max_tokens: None,
            max_cost: None,
        };
        if let Some(limit) = q.tokens_per_day {
            let (used, _) = self.read::<u64>(&tokens_key(&w.day)).await?;
            if used >= limit {
                return Ok(refuse(
                    QuotaKind::TokensPerDay,
                    limit,
                    used,
                    Some(w.day_ends_ms),
                ));
            }
            budget.max_tokens = Some(limit - used);
        }
        if let Some(limit) = q.cost_per_month_micros {
            let (used, _) = self.read::<u64>(&cost_key(&w.month)).await?;
            if used >= limit {
                return Ok(refuse(
                    QuotaKind::CostPerMonth,
                    limit,
                    used,
                    Some(w.month_ends_ms),
                ));
            }
            budget.max_cost = Some((limit - used) as f64 / 1_000_000.0);
        }
        let budget = (budget.max_tokens.is_some() || budget.max_cost.is_some()).then_some(budget);
        let hour_key = runs_key(&w.hour);
        if let Some(limit) = q.runs_per_hour {
            let (used, _) = self.read::<u64>(&hour_key).await?;
            // A run held already was counted when it was admitted.
            if used >= limit && !self.holds(run).await? {
                return Ok(refuse(
                    QuotaKind::RunsPerHour,
                    limit,
                    used,
                    Some(w.hour_ends_ms),
                ));
            }
        }
        let mut reserved = false;
        if let Some(limit) = q.concurrent_runs {
            let taken = self
                .change_held(|mut held: Held| {
                    if held.runs.contains_key(&run) {
                        return Change::Keep(Ok(false));
                    }
                    let used = held.runs.len() as u64;
                    if used >= limit {
                        return Change::Keep(Err(used));
                    }
                    held.runs.insert(run, now_ms);
                    Change::Write(held, Ok(true))
                })
                .await?;
            match taken {
                Ok(newly) => reserved = newly,
                Err(used) => return Ok(refuse(QuotaKind::ConcurrentRuns, limit, used, None)),
            }
            if !reserved {
                // Held already: admitted and counted before.
                return Ok(Admission::Admitted {
                    reserved: false,
                    budget,
                });
            }
        }
        if let Some(limit) = q.runs_per_hour {
            let counted = self
                .change(&hour_key, None, |n: u64| {
                    if n >= limit {
                        Change::Keep(Err(n))
                    } else {
                        Change::Write(n + 1, Ok(()))
                    }
                })
                .await;
            let refused = match counted {
                Ok(Ok(())) => None,
                Ok(Err(used)) => Some(refuse(
                    QuotaKind::RunsPerHour,
                    limit,
                    used,
                    Some(w.hour_ends_ms),
                )),
                Err(e) => {
                    if reserved {
                        let _ = self.release(run).await;
                    }
                    return Err(e);
                }
            };
            if let Some(refused) = refused {
                if reserved {
                    self.release(run).await?;
                }
                return Ok(refused);
            }
        }
        Ok(Admission::Admitted { reserved, budget })
    }

    /// What is left of the day's tokens and the month's cost at `now_ms` under the quotas in
    /// force, as a budget (none without those quotas; a limit reached leaves 0).
    pub async fn left(&self, now_ms: i64) -> Result<Option<Budget>, TenantError> {
        let Some(q) = self.in_force().await? else {
            return Ok(None);
        };
        let w = windows(now_ms);
        let mut budget = Budget {
            max_tokens: None,
            max_cost: None,
        };
        if let Some(limit) = q.tokens_per_day {
            let (used, _) = self.read::<u64>(&tokens_key(&w.day)).await?;
            budget.max_tokens = Some(limit.saturating_sub(used));
        }
        if let Some(limit) = q.cost_per_month_micros {
            let (used, _) = self.read::<u64>(&cost_key(&w.month)).await?;
            budget.max_cost = Some(limit.saturating_sub(used) as f64 / 1_000_000.0);
        }
        Ok((budget.max_tokens.is_some() || budget.max_cost.is_some()).then_some(budget))
    }

    /// Whether run `run` holds a slot (read from the bucket).
    async fn holds(&self, run: RunId) -> Result<bool, TenantError> {
        Ok(self.read::<Held>(HELD_KEY).await?.0.runs.contains_key(&run))
    }

    /// The runs holding a slot, with when each was admitted (read from the bucket).
    pub async fn held(&self) -> Result<Held, TenantError> {
        Ok(self.read::<Held>(HELD_KEY).await?.0)
    }

    /// Gives back run `run`'s slot; `false` when it held none (released already, or never
    /// reserved). Read from the bucket, not the watch (which may not have seen another
    /// coordinator's reservation yet) — except without `concurrent_runs`, when a run the watch
    /// does not show holding a slot costs no I/O.
    pub async fn release(&self, run: RunId) -> Result<bool, TenantError> {
        if self.following {
            let limited = self.active().is_some_and(|q| q.concurrent_runs.is_some());
            let seen = self.held.read(|m| {
                m.get(HELD_KEY)
                    .is_some_and(|h| h.value.runs.contains_key(&run))
            });
            if !limited && !seen {
                return Ok(false);
            }
        }
        self.change_noting(
            HELD_KEY,
            None,
            |mut held: Held| {
                if held.runs.remove(&run).is_some() {
                    Change::Write(held, true)
                } else {
                    Change::Keep(false)
                }
            },
            |held, revision| {
                let at = flotilla_model::time::Timestamp::now().unix_ms();
                self.held.note(HELD_KEY, held, at, revision);
            },
        )
        .await
    }

    /// Takes a place for persistent teammate `key` at `now_ms` under `persistent_teammates`
    /// (nothing without that quota): `Err` names the quota, limit and use when every place is
    /// taken. `live` are the teammates not shut down as the caller sees them: they count
    /// whether or not they hold a place (those spawned before the quota was set), and a place
    /// whose teammate is neither live nor taken within [`TEAMMATE_GRACE_MS`] is given back.
    /// Taking a place held already changes nothing.
    pub async fn take_teammate(
        &self,
        key: &str,
        now_ms: i64,
        live: &std::collections::BTreeSet<String>,
    ) -> Result<Result<(), QuotaExceeded>, TenantError> {
        let Some(limit) = self.in_force().await?.and_then(|q| q.persistent_teammates) else {
            return Ok(Ok(()));
        };
        let tenant = self.tenant.clone();
        self.change(TEAMMATES_KEY, None, |mut m: Mates| {
            if m.mates.contains_key(key) {
                return Change::Keep(Ok(()));
            }
            m.mates
                .retain(|k, at| live.contains(k) || now_ms - *at < TEAMMATE_GRACE_MS);
            let used = live.iter().filter(|k| !m.mates.contains_key(*k)).count() as u64
                + m.mates.len() as u64;
            if used >= limit {
                return Change::Keep(Err(QuotaExceeded {
                    tenant: tenant.clone(),
                    quota: QuotaKind::PersistentTeammates,
                    limit,
                    used,
                    resets_at_ms: None,
                }));
            }
            m.mates.insert(key.to_owned(), now_ms);
            Change::Write(m, Ok(()))
        })
        .await
    }

    /// Gives back teammate `key`'s place (shut down, or its spawn failed); `false` when it
    /// held none. Nothing is read without `persistent_teammates`.
    pub async fn free_teammate(&self, key: &str) -> Result<bool, TenantError> {
        if self
            .in_force()
            .await?
            .is_none_or(|q| q.persistent_teammates.is_none())
        {
            return Ok(false);
        }
        self.change(TEAMMATES_KEY, None, |mut m: Mates| {
            if m.mates.remove(key).is_some() {
                Change::Write(m, true)
            } else {
                Change::Keep(false)
            }
        })
        .await
    }

    /// Counts run `run`'s usage, which ended at `ended_ms`, in its day and month and by
    /// agent and model — once: `false` when it was counted already (or spent nothing, or the
    /// installation has no quotas: then nothing is written).
    pub async fn account(
        &self,
        run: RunId,
        usage: &RunUsage,
        ended_ms: i64,
    ) -> Result<bool, TenantError> {
        // A tenant's usage is counted with or without quotas (its cost per tenant); the
        // deployment's own installation counts only while it has quotas.
        if usage.is_empty() || (self.tenant.is_none() && self.in_force().await?.is_none()) {
            return Ok(false);
        }
        match self
            .kv
            .create_with_ttl(end_key(run), "1".into(), END_MARKER_TTL)
            .await
        {
            Ok(_) => {}
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => return Ok(false),
            Err(e) => return Err(nats("marking a run's usage counted", e)),
        }
        let w = windows(ended_ms);
        let total = usage.total();
        if total.tokens > 0 {
            self.change(&tokens_key(&w.day), None, |n: u64| {
                Change::Write(n.saturating_add(total.tokens), ())
            })
            .await?;
        }
        if total.cost_micros > 0 {
            self.change(&cost_key(&w.month), None, |n: u64| {
                Change::Write(n.saturating_add(total.cost_micros), ())
            })
            .await?;
        }
        self.change(&day_key(&w.day), None, |mut doc: DayDoc| {
            doc.add(usage);
            Change::Write(doc, ())
        })
        .await?;
        Ok(true)
    }

    /// The counters and limits now, and usage by day, agent and model from the day holding
    /// `since_ms` on (at most [`MAX_USAGE_DAYS`] days, the newest).
    pub async fn usage(&self, since_ms: i64) -> Result<Usage, TenantError> {
        let now_ms = flotilla_model::time::Timestamp::now().unix_ms();
        let w = windows(now_ms);
        let quotas = self.quotas().await?.unwrap_or_default();
        let space = crate::space::used(&self.bus).await?;
        let current = Current {
            concurrent_runs: self.held().await?.runs.len() as u64,
            runs_this_hour: self.read::<u64>(&runs_key(&w.hour)).await?.0,
            tokens_today: self.read::<u64>(&tokens_key(&w.day)).await?.0,
            cost_this_month_micros: self.read::<u64>(&cost_key(&w.month)).await?.0,
            hour_resets_at_ms: w.hour_ends_ms,
            day_resets_at_ms: w.day_ends_ms,
            month_resets_at_ms: w.month_ends_ms,
            workspace_bytes: space.workspace_bytes,
            mailbox_bytes: space.mailbox_bytes,
            persistent_teammates: match quotas.persistent_teammates {
                Some(_) => Some(self.read::<Mates>(TEAMMATES_KEY).await?.0.mates.len() as u64),
                None => None,
            },
        };
        let first_day = windows(since_ms).day;
        let bucket = self.bus.names().bucket(Bucket::Usage);
        let prefix = format!("$KV.{bucket}.use.d.");
        let mut days = Vec::new();
        let mut pages = self
            .bus
            .stream_pages(&format!("KV_{bucket}"), &format!("{prefix}*"), 0);
        while let Some(page) = pages
            .next()
            .await
            .map_err(|e| nats("reading usage by day", e))?
        {
            for m in page {
                let deleted = m
                    .headers
                    .get("KV-Operation")
                    .is_some_and(|op| op.as_str() != "PUT");
                let Some(day) = m.subject.strip_prefix(&prefix) else {
                    continue;
                };
                if deleted || day < first_day.as_str() {
                    continue;
                }
                let Ok(doc) = serde_json::from_slice::<DayDoc>(&m.payload) else {
                    continue;
                };
                days.push(day_usage(day, &doc));
            }
        }
        days.sort_by(|a, b| a.day.cmp(&b.day));
        days.dedup_by(|a, b| a.day == b.day);
        if days.len() > MAX_USAGE_DAYS {
            days.drain(..days.len() - MAX_USAGE_DAYS);
        }
        Ok(Usage {
            tenant: self.tenant.clone(),
            quotas,
            current,
            days,
        })
    }

    /// A key's value and revision (the type's default and 0 when it is not set).
    async fn read<T: DeserializeOwned + Default>(
        &self,
        key: &str,
    ) -> Result<(T, u64), TenantError> {
        let entry = self
            .kv
            .entry(key)
            .await
            .map_err(|e| nats(&format!("reading {key} of the usage bucket"), e))?;
        match entry.filter(|e| e.operation == kv::Operation::Put) {
            None => Ok((T::default(), 0)),
            Some(e) => serde_json::from_slice(&e.value)
                .map(|v| (v, e.revision))
                .map_err(|err| {
                    TenantError::new(
                        TenantErrorKind::Decode,
                        format!("{key} of the usage bucket cannot be read: {err}"),
                    )
                }),
        }
    }

    /// Applies `f` to `key` with compare-and-set, starting from `known` (a mirrored value
    /// and its revision) when given — a write it decides is checked by the compare-and-set,
    /// a decision to write nothing is made again on the value read — and reading again after
    /// each lost race.
    async fn change<T, R>(
        &self,
        key: &str,
        known: Option<(T, u64)>,
        f: impl FnMut(T) -> Change<T, R>,
    ) -> Result<R, TenantError>
    where
        T: DeserializeOwned + Serialize + Default,
    {
        self.change_noting(key, known, f, |_, _| {}).await
    }

    /// The runs held, changed by `f` with compare-and-set; the mirror notes what this
    /// process wrote at once (its next admission starts from it).
    async fn change_held<R>(
        &self,
        f: impl FnMut(Held) -> Change<Held, R>,
    ) -> Result<R, TenantError> {
        let known = self.held.get(HELD_KEY).map(|m| (m.value, m.revision));
        self.change_noting(HELD_KEY, known, f, |held, revision| {
            let at = flotilla_model::time::Timestamp::now().unix_ms();
            self.held.note(HELD_KEY, held, at, revision);
        })
        .await
    }

    /// [`Ledger::change`], telling `wrote` the value written and its revision.
    async fn change_noting<T, R>(
        &self,
        key: &str,
        mut known: Option<(T, u64)>,
        mut f: impl FnMut(T) -> Change<T, R>,
        mut wrote: impl FnMut(T, u64),
    ) -> Result<R, TenantError>
    where
        T: DeserializeOwned + Serialize + Default,
    {
        for attempt in 0..MAX_TRIES {
            let (value, revision, mirrored) = match known.take() {
                Some((v, r)) => (v, r, true),
                None => {
                    let (v, r) = self.read::<T>(key).await?;
                    (v, r, false)
                }
            };
            let (next, answer) = match f(value) {
                // A decision to write nothing stands on the bucket's value only: a mirrored
                // one may be behind (a slot another coordinator gave back a moment ago).
                Change::Keep(_) if mirrored => continue,
                Change::Keep(r) => return Ok(r),
                Change::Write(next, r) => (next, r),
            };
            let body: bytes::Bytes = serde_json::to_vec(&next)
                .map_err(|e| TenantError::new(TenantErrorKind::Decode, e.to_string()))?
                .into();
            let written = if revision == 0 {
                self.kv.create(key, body).await.map_err(|e| {
                    (
                        e.kind() == kv::CreateErrorKind::AlreadyExists,
                        nats(&format!("writing {key} of the usage bucket"), e),
                    )
                })
            } else {
                self.kv.update(key, body, revision).await.map_err(|e| {
                    (
                        e.kind() == kv::UpdateErrorKind::WrongLastRevision,
                        nats(&format!("writing {key} of the usage bucket"), e),
                    )
                })
            };
            match written {
                Ok(revision) => {
                    wrote(next, revision);
                    return Ok(answer);
                }
                Err((true, _)) => {
                    // Another coordinator changed it first: read again, after a moment that
                    // grows with the contention.
                    let pause = Duration::from_micros(200 * (1 << attempt.min(6)) as u64);
                    tokio::time::sleep(pause).await;
                }
                Err((false, e)) => return Err(e),
            }
        }
        Err(TenantError::new(
            TenantErrorKind::Conflict,
            format!("{key} of the usage bucket: too many concurrent changes"),
        ))
    }
}

/// A stored day's usage as reported.
fn day_usage(day: &str, doc: &DayDoc) -> DayUsage {
    let mut total = Spend::default();
    let mut by = Vec::new();
    for (agent, models) in &doc.by {
        for (model, spend) in models {
            total.add(*spend);
            by.push(AgentModelUsage {
                agent: agent.clone(),
                model: model.clone(),
                spend: *spend,
            });
        }
    }
    by.sort_by_key(|u| std::cmp::Reverse(u.spend.tokens));
    let pretty = if day.len() == 8 {
        format!("{}-{}-{}", &day[..4], &day[4..6], &day[6..])
    } else {
        day.to_owned()
    };
    DayUsage {
        day: pretty,
        total,
        by,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2024-02-29 23:59:59.999 UTC (a leap day, the last millisecond of a day and a month).
    const LEAP_END: i64 = 1_709_251_199_999;

    #[test]
    fn windows_name_the_hour_day_and_month_and_when_each_ends() {
        let w = windows(LEAP_END);
        assert_eq!(w.hour, "2024022923");
        assert_eq!(w.day, "20240229");
        assert_eq!(w.month, "202402");
        // 2024-03-01 00:00:00 UTC ends all three.
        assert_eq!(w.hour_ends_ms, LEAP_END + 1);
        assert_eq!(w.day_ends_ms, LEAP_END + 1);
        assert_eq!(w.month_ends_ms, LEAP_END + 1);
        let next = windows(LEAP_END + 1);
        assert_eq!(
            (next.hour.as_str(), next.day.as_str(), next.month.as_str()),
            ("2024030100", "20240301", "202403")
        );
        assert_eq!(next.hour_ends_ms, LEAP_END + 1 + HOUR_MS);
        assert_eq!(next.day_ends_ms, LEAP_END + 1 + DAY_MS);
        // December rolls into the next year.
        let dec = windows(1_703_980_800_000); // 2023-12-31 00:00 UTC
        assert_eq!(dec.month, "202312");
        assert_eq!(dec.month_ends_ms, 1_704_067_200_000); // 2024-01-01
        assert_eq!(runs_key(&dec.hour), "runs.h.2023123100");
        assert_eq!(tokens_key(&dec.day), "tokens.d.20231231");
        assert_eq!(cost_key(&dec.month), "cost.m.202312");
        assert_eq!(day_key(&dec.day), "use.d.20231231");
    }

    #[test]
    fn keys_are_valid_kv_keys() {
        let run = RunId::new();
        let w = windows(1_700_000_000_000);
        for key in [
            runs_key(&w.hour),
            tokens_key(&w.day),
            cost_key(&w.month),
            day_key(&w.day),
            end_key(run),
            QUOTAS_KEY.to_owned(),
            HELD_KEY.to_owned(),
        ] {
            assert!(
                key.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
                    && !key.starts_with('.')
                    && !key.ends_with('.'),
                "{key}"
            );
        }
    }

    #[test]
    fn nonsense_quotas_are_named() {
        let ok = Quotas {
            concurrent_runs: Some(2),
            runs_per_hour: Some(100),
            queue: vec![QuotaKind::ConcurrentRuns],
            ..Quotas::default()
        };
        assert_eq!(check_quotas(&ok), Ok(()));
        let zero = Quotas {
            tokens_per_day: Some(0),
            ..Quotas::default()
        };
        assert!(
            check_quotas(&zero)
                .unwrap_err()
                .contains("tokens_per_day = 0")
        );
        let huge = Quotas {
            concurrent_runs: Some(MAX_CONCURRENT_RUNS + 1),
            ..Quotas::default()
        };
        assert!(check_quotas(&huge).is_err());
        let no_limit = Quotas {
            queue: vec![QuotaKind::ConcurrentRuns],
            ..Quotas::default()
        };
        assert!(check_quotas(&no_limit).unwrap_err().contains("no limit"));
        let cannot = Quotas {
            runs_per_hour: Some(5),
            queue: vec![QuotaKind::RunsPerHour],
            ..Quotas::default()
        };
        assert!(check_quotas(&cannot).unwrap_err().contains("cannot queue"));
        let twice = Quotas {
            concurrent_runs: Some(5),
            queue: vec![QuotaKind::ConcurrentRuns, QuotaKind::ConcurrentRuns],
            ..Quotas::default()
        };
        assert!(check_quotas(&twice).unwrap_err().contains("twice"));
    }

    #[test]
    fn usage_adds_up_and_a_day_keeps_a_bounded_number_of_pairs() {
        let mut run = RunUsage::default();
        run.add("researcher", "gpt-x", 100, Some(0.0015));
        run.add("researcher", "gpt-x", 50, None);
        run.add("writer", "claude", 10, Some(0.000_000_4));
        assert_eq!(
            run.total(),
            Spend {
                tokens: 160,
                cost_micros: 1500,
                calls: 3
            }
        );
        assert_eq!(micros(-1.0), 0);
        assert_eq!(micros(f64::NAN), 0);
        let mut doc = DayDoc::default();
        doc.add(&run);
        doc.add(&run);
        assert_eq!(doc.by["researcher"]["gpt-x"].tokens, 300);
        let mut many = RunUsage::default();
        for i in 0..MAX_USAGE_PAIRS + 10 {
            many.add("a", &format!("m{i}"), 1, None);
        }
        doc.add(&many);
        let pairs: usize = doc.by.values().map(BTreeMap::len).sum();
        assert_eq!(
            pairs,
            MAX_USAGE_PAIRS + 1,
            "the cap, and the pair that takes the rest"
        );
        assert!(doc.by[OTHER][OTHER].tokens >= 10);
        let reported = day_usage("20240229", &doc);
        assert_eq!(reported.day, "2024-02-29");
        assert_eq!(reported.by[0].agent, "researcher");
        assert_eq!(
            reported.total.tokens,
            300 + 20 + (MAX_USAGE_PAIRS as u64 + 10)
        );
    }

    #[test]
    fn held_runs_round_trip_as_json() {
        let mut held = Held::default();
        let run = RunId::new();
        held.runs.insert(run, 7);
        let json = serde_json::to_string(&held).unwrap();
        assert!(json.contains(&run.to_string()), "{json}");
        let back: Held = serde_json::from_str(&json).unwrap();
        assert_eq!(back, held);
    }
}
