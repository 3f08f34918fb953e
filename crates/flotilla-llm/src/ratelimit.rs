//! Request and token rates per provider, shared by every worker of a deployment.
//!
//! `requests-per-minute` and `tokens-per-minute` on an LLM agent limit what *all* workers
//! together send to its provider (agents of one provider — same `provider` key, by default
//! the base URL — share the limit; when they disagree, each call is checked against the
//! numbers of the agent making it). The per-worker `max-concurrent-requests` cap cannot do
//! that: ten replicas with a cap of 8 still send 80 requests at once.
//!
//! The state is one KV entry per provider, `ratelimit.<provider>` in the `<prefix>-cursors`
//! bucket, changed by compare-and-set like the run budgets. It holds a *generic cell rate
//! algorithm* (GCRA) clock per limit: the theoretical arrival time (TAT) of the next request
//! or token, in Unix milliseconds. With period `P` = one minute and a limit of `n`, one unit
//! costs `P / n`:
//!
//! ```text
//! tat' = max(tat, now) + weight × P / n
//! tat' − now ≤ P  → allowed: store tat'            (a full minute's quota may go at once)
//! otherwise       → wait tat' − P − now, then try again
//! ```
//!
//! Every HTTP request takes one request unit, retries included; the first try of a call also
//! takes its estimated tokens (the prompt, characters ÷ 4, plus `max-output-tokens`), and the
//! tokens the reply used beyond the estimate are charged after it. A call never waits past
//! the attempt's deadline: it fails (retryably) instead. Workers' clocks are compared, so
//! keep them in sync (NTP); a skew of `s` shifts a worker's share by about `s`.
//!
//! A tenant's quotas `model_requests_per_minute` and `model_tokens_per_minute` are a second
//! limit of the same kind over every call of the installation, whatever its provider: key
//! `quota.model` of the same bucket, taken after the provider's ([`TenantModelQuotas`]). The
//! quotas are read from the installation's usage bucket at most every [`QUOTAS_REFRESH`]
//! per agent definition, so a change applies within that.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::kv;
use flotilla_context::AgentContext;
use flotilla_model::subjects::{Bucket, kv_key_token};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::config::LlmConfig;

/// The period the limits are per.
const PERIOD_MS: f64 = 60_000.0;
/// Compare-and-set tries before giving up on a contended entry.
const MAX_TRIES: u32 = 100;
/// How long the tenant's model quotas, once read, are used before reading them again.
pub const QUOTAS_REFRESH: Duration = Duration::from_secs(5);
/// The key of the tenant's model quota clocks in the cursors bucket.
const TENANT_KEY: &str = "quota.model";

/// The shared clocks of one provider.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
struct Clocks {
    /// TAT of the next request, Unix ms.
    #[serde(default)]
    requests: f64,
    /// TAT of the next token, Unix ms.
    #[serde(default)]
    tokens: f64,
}

/// Why a request could not be admitted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RateLimitError {
    /// The attempt was cancelled while waiting.
    #[error("cancelled while waiting for the provider's rate limit")]
    Cancelled,
    /// Waiting would pass the attempt's deadline: which limit, and the wait.
    #[error("{0} admits the next request in {1:?}, after the attempt's deadline")]
    PastDeadline(String, Duration),
    /// The shared entry could not be read or written.
    #[error("the provider's shared rate limit: {0}")]
    Unavailable(String),
}

/// The shared rate limit of one agent's provider, as one attempt uses it.
#[derive(Debug, Clone)]
pub struct RateLimit {
    kv: kv::Store,
    key: String,
    requests_per_minute: Option<u32>,
    tokens_per_minute: Option<u64>,
    /// Whose limit: the provider's, or the tenant's quota.
    tenant: Option<String>,
}

fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

impl RateLimit {
    /// The limit of `config`'s provider, or `None` when it sets neither rate.
    pub async fn open(ctx: &AgentContext, config: &LlmConfig) -> Result<Option<Self>, String> {
        if config.requests_per_minute.is_none() && config.tokens_per_minute.is_none() {
            return Ok(None);
        }
        let kv = ctx
            .clients()
            .bus()
            .kv(Bucket::Cursors)
            .await
            .map_err(|e| format!("opening the rate-limit bucket: {e}"))?;
        Ok(Some(Self {
            kv,
            key: format!("ratelimit.{}", kv_key_token(&config.provider_key())),
            requests_per_minute: config.requests_per_minute,
            tokens_per_minute: config.tokens_per_minute,
            tenant: None,
        }))
    }

    /// Which limit this is, for errors and logs.
    fn describe(&self) -> String {
        match &self.tenant {
            None => {
                let rates = match (self.requests_per_minute, self.tokens_per_minute) {
                    (Some(r), Some(t)) => format!("{r} requests and {t} tokens per minute"),
                    (Some(r), None) => format!("{r} requests per minute"),
                    (None, Some(t)) => format!("{t} tokens per minute"),
                    (None, None) => "none".into(),
                };
                format!("the provider's shared rate limit ({rates})")
            }
            Some(who) => {
                let mut quotas = Vec::new();
                if let Some(r) = self.requests_per_minute {
                    quotas.push(format!("model_requests_per_minute = {r}"));
                }
                if let Some(t) = self.tokens_per_minute {
                    quotas.push(format!("model_tokens_per_minute = {t}"));
                }
                format!("{who}'s quota ({})", quotas.join(", "))
            }
        }
    }

    /// The clocks after taking `requests` and `tokens` at `now`, or how long to wait (ms).
    fn take(&self, c: Clocks, now: f64, requests: u64, tokens: u64) -> Result<Clocks, f64> {
        take(
            self.requests_per_minute,
            self.tokens_per_minute,
            c,
            now,
            requests,
            tokens,
        )
    }

    async fn read(&self) -> Result<(Clocks, u64), RateLimitError> {
        let entry = self
            .kv
            .entry(&self.key)
            .await
            .map_err(|e| RateLimitError::Unavailable(format!("reading: {e}")))?;
        Ok(match entry.filter(|e| e.operation == kv::Operation::Put) {
            None => (Clocks::default(), 0),
            Some(e) => (
                serde_json::from_slice(&e.value).unwrap_or_default(),
                e.revision,
            ),
        })
    }

    async fn write(&self, c: Clocks, revision: u64) -> bool {
        let body = serde_json::to_vec(&c).unwrap_or_default();
        if revision == 0 {
            self.kv.create(&self.key, body.into()).await.is_ok()
        } else {
            self.kv
                .update(&self.key, body.into(), revision)
                .await
                .is_ok()
        }
    }

    /// Takes one request and `tokens` tokens, waiting while the deployment's limits do not
    /// admit them — never past `deadline`.
    pub async fn acquire(
        &self,
        tokens: u64,
        cancel: &CancellationToken,
        deadline: tokio::time::Instant,
    ) -> Result<(), RateLimitError> {
        let mut tries = 0;
        loop {
            tries += 1;
            if tries > MAX_TRIES {
                return Err(RateLimitError::Unavailable(
                    "too many concurrent changes".into(),
                ));
            }
            let (clocks, revision) = self.read().await?;
            match self.take(clocks, now_ms(), 1, tokens) {
                Ok(next) => {
                    if self.write(next, revision).await {
                        return Ok(());
                    }
                    // Another worker took its share first: read again, soon.
                    let jitter = u64::from(tries % 4) + 1;
                    tokio::time::sleep(Duration::from_millis(jitter)).await;
                }
                Err(wait_ms) => {
                    let wait = Duration::from_secs_f64(wait_ms / 1000.0);
                    if tokio::time::Instant::now() + wait >= deadline {
                        return Err(RateLimitError::PastDeadline(self.describe(), wait));
                    }
                    tracing::debug!(key = %self.key, wait_ms = wait.as_millis() as u64, "Waiting for a shared rate limit");
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        () = cancel.cancelled() => return Err(RateLimitError::Cancelled),
                    }
                    tries = 0;
                }
            }
        }
    }

    /// Charges `tokens` more (a reply longer than its estimate), without waiting: the next
    /// call waits for them instead.
    pub async fn charge(&self, tokens: u64) {
        if tokens == 0 || self.tokens_per_minute.is_none() {
            return;
        }
        for _ in 0..MAX_TRIES {
            let Ok((mut c, revision)) = self.read().await else {
                break;
            };
            if let Some(tpm) = self.tokens_per_minute {
                c.tokens = c.tokens.max(now_ms()) + tokens.min(tpm) as f64 * PERIOD_MS / tpm as f64;
            }
            if self.write(c, revision).await {
                return;
            }
        }
        tracing::warn!(key = %self.key, tokens, "Could not charge a reply's extra tokens to the shared rate limit");
    }
}

/// The tenant's model quotas as an agent definition last read them: read again at most every
/// [`QUOTAS_REFRESH`], so a model call costs no extra read while they are known.
#[derive(Debug, Default)]
pub struct TenantModelQuotas {
    last: std::sync::Mutex<Option<(std::time::Instant, Option<RateLimit>)>>,
    /// Whether a failure to read them was logged as a warning already (later ones are
    /// logged at debug level: an installation without the usage bucket fails every time).
    warned: std::sync::atomic::AtomicBool,
}

impl TenantModelQuotas {
    /// The limit of the installation's `model_requests_per_minute` and
    /// `model_tokens_per_minute`, or `None` without them (or when they cannot be read: then
    /// calls go unlimited until they can, with a warning).
    pub async fn limit(&self, ctx: &AgentContext) -> Option<RateLimit> {
        if let Ok(guard) = self.last.lock()
            && let Some((at, limit)) = guard.as_ref()
            && at.elapsed() < QUOTAS_REFRESH
        {
            return limit.clone();
        }
        let limit = match Self::read(ctx).await {
            Ok(limit) => limit,
            Err(e) => {
                if self.warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::debug!(error = %e, "Could not read the installation's model quotas");
                } else {
                    tracing::warn!(error = %e, "Could not read the installation's model quotas; calling without them until they can be read");
                }
                None
            }
        };
        if let Ok(mut guard) = self.last.lock() {
            *guard = Some((std::time::Instant::now(), limit.clone()));
        }
        limit
    }

    async fn read(ctx: &AgentContext) -> Result<Option<RateLimit>, String> {
        let bus = ctx.clients().bus();
        let Some(quotas) = flotilla_tenants::ledger::Ledger::open(bus)
            .await
            .map_err(|e| e.to_string())?
            .quotas()
            .await
            .map_err(|e| e.to_string())?
        else {
            return Ok(None);
        };
        let (rpm, tpm) = (
            quotas.model_requests_per_minute,
            quotas.model_tokens_per_minute,
        );
        if rpm.is_none() && tpm.is_none() {
            return Ok(None);
        }
        let kv = bus
            .kv(Bucket::Cursors)
            .await
            .map_err(|e| format!("opening the rate-limit bucket: {e}"))?;
        Ok(Some(RateLimit {
            kv,
            key: TENANT_KEY.to_owned(),
            requests_per_minute: rpm.map(|r| u32::try_from(r).unwrap_or(u32::MAX)),
            tokens_per_minute: tpm,
            tenant: Some(flotilla_model::tenant::installation(bus.tenant())),
        }))
    }
}

/// The arithmetic of the limits (see the module docs), on plain numbers.
fn take(
    requests_per_minute: Option<u32>,
    tokens_per_minute: Option<u64>,
    c: Clocks,
    now: f64,
    requests: u64,
    tokens: u64,
) -> Result<Clocks, f64> {
    let mut next = c;
    let mut wait: f64 = 0.0;
    if let Some(rpm) = requests_per_minute
        && requests > 0
    {
        let tat = c.requests.max(now) + requests as f64 * PERIOD_MS / f64::from(rpm);
        wait = wait.max(tat - PERIOD_MS - now);
        next.requests = tat;
    }
    if let Some(tpm) = tokens_per_minute
        && tokens > 0
    {
        // A call larger than a whole minute's tokens goes once the clock is idle.
        let weight = tokens.min(tpm);
        let tat = c.tokens.max(now) + weight as f64 * PERIOD_MS / tpm as f64;
        wait = wait.max(tat - PERIOD_MS - now);
        next.tokens = tat;
    }
    if wait > 0.0 { Err(wait) } else { Ok(next) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(
        rpm: Option<u32>,
        tpm: Option<u64>,
    ) -> impl Fn(Clocks, f64, u64, u64) -> Result<Clocks, f64> {
        move |c, now, r, t| take(rpm, tpm, c, now, r, t)
    }

    #[test]
    fn a_minutes_quota_goes_at_once_then_one_per_interval() {
        let take = limit(Some(60), None);
        let mut c = Clocks::default();
        let now = 1_000_000.0;
        for _ in 0..60 {
            c = take(c, now, 1, 0).expect("within the minute's quota");
        }
        let wait = take(c, now, 1, 0).expect_err("61st waits");
        assert!((wait - 1000.0).abs() < 1e-6, "{wait}");
        assert!(take(c, now + 1000.0, 1, 0).is_ok());
    }

    #[test]
    fn tokens_are_weighted_and_capped_at_a_minute() {
        let take = limit(None, Some(1_000));
        let now = 5_000_000.0;
        let c = take(Clocks::default(), now, 1, 600).expect("fits");
        let wait = take(c, now, 1, 600).expect_err("1,200 tokens in a minute");
        assert!((wait - 12_000.0).abs() < 1e-6, "{wait}");
        // Larger than a minute: admitted when idle.
        assert!(take(Clocks::default(), now, 1, 5_000).is_ok());
        // Requests are unlimited here.
        assert!(take(c, now, 100, 0).is_ok());
    }
}
