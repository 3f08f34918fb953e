//! `[supervisor]` in `flotilla.toml`.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Supervisor settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct SupervisorOptions {
    /// How long a worker's registry entry may go without a refresh before its members count
    /// as offline. Default: two worker heartbeats (set by `flotilla supervisor` from
    /// `[worker] heartbeat` when left out).
    #[serde(with = "humantime_serde", skip_serializing_if = "Option::is_none")]
    pub presence_timeout: Option<Duration>,
    /// A member running attempts that emitted nothing for this long is `stale`, not
    /// `working`.
    #[serde(with = "humantime_serde")]
    pub stale_after: Duration,
    /// Progress times are recorded to this resolution: a member's entry is rewritten at most
    /// this often for progress alone (a streaming agent emits many events a second).
    #[serde(with = "humantime_serde")]
    pub progress_resolution: Duration,
    /// How often presence is recomputed from the worker registry (offline, stale).
    #[serde(with = "humantime_serde")]
    pub presence_interval: Duration,
    /// Most event messages one supervisor handles in one batch (one write per member and
    /// record per batch).
    pub batch: usize,
    /// How long a delivered event message may stay unacknowledged before JetStream gives it
    /// to another supervisor replica.
    #[serde(with = "humantime_serde")]
    pub ack_wait: Duration,
    /// Most teammates of one team that are not shut down (`team_full` beyond).
    pub team_size: usize,
    /// Most turns one teammate is dispatched per hour (`turns_per_hour` beyond).
    pub turns_per_hour: u32,
    /// Longest message to a teammate, in bytes (`message_too_large` beyond).
    pub max_message_bytes: usize,
    /// The policy recruits and retirements are checked against (`[supervisor.recruit]`).
    pub recruit: RecruitPolicy,
    /// `[supervisor.memory]`: remembering finished runs for the planners.
    pub memory: MemoryOptions,
    /// `[[supervisor.webhooks]]`: where notices (approvals requested, runs paused or taken
    /// over) are POSTed.
    pub webhooks: Vec<WebhookOptions>,
    /// List the agents of the NATS Agent Protocol on this NATS (not this deployment's own)
    /// as external members of the roster. On by default: discovery is one `$SRV.INFO.agents`
    /// request per `agents-discovery` and a subscription to their heartbeats.
    pub external_agents: bool,
    /// How often `$SRV.INFO.agents` is asked (a heartbeat of an agent not yet listed asks at
    /// once). Default 30 s, the protocol's heartbeat interval.
    #[serde(with = "humantime_serde")]
    pub agents_discovery: Duration,
    /// How long a starting supervisor waits out JetStream answering nothing or saying it has
    /// no leader (a cluster node restarting, an election) while it opens its buckets and
    /// consumers; an error that will not pass (refused permissions) stops it at once.
    #[serde(with = "humantime_serde")]
    pub startup_wait: Duration,
}

/// `[[supervisor.webhooks]]`: one HTTP endpoint that receives notices.
///
/// Each webhook has its own durable consumer (`webhook-<name>`) on the notice stream, which
/// the supervisor replicas share: a notice is POSTed by one of them, retried with backoff
/// until the endpoint answers 2xx or `max-attempts` is reached, and a slow or dead endpoint
/// delays only its own notices — never a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct WebhookOptions {
    /// Names the webhook (a token: its consumer is `webhook-<name>`, its metrics carry it).
    pub name: String,
    /// `http://` or `https://` URL the notices are POSTed to.
    pub url: String,
    /// Which notices: `approval`, `question`, `client_tool`, `pause`, `takeover`. Empty:
    /// all.
    #[serde(default)]
    pub kinds: Vec<flotilla_model::notify::NoticeKind>,
    /// The environment variable holding the signing secret: each POST carries
    /// `X-Flotilla-Signature: sha256=<hex HMAC-SHA256 of "<timestamp>.<body>">`. Without it
    /// deliveries are unsigned (a warning at start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_env: Option<String>,
    /// How long one POST may take.
    #[serde(default = "webhook_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// Most POSTs of one notice (the first included); after the last failure it is dropped
    /// and counted (`flotilla_webhook_deliveries_total{outcome="dropped"}`).
    #[serde(default = "webhook_max_attempts")]
    pub max_attempts: u32,
    /// The pause before the first retry; each further retry waits twice as long, up to
    /// `max-backoff`.
    #[serde(default = "webhook_backoff", with = "humantime_serde")]
    pub backoff: Duration,
    /// The longest pause between retries.
    #[serde(default = "webhook_max_backoff", with = "humantime_serde")]
    pub max_backoff: Duration,
    /// How far back a webhook met for the first time starts: the notices published in this
    /// window before its consumer was created (those of a fresh deployment before its first
    /// supervisor was up, those of a webhook added to a running one) are delivered too. A
    /// webhook already known goes on where it left off, whatever this says.
    #[serde(default = "webhook_backfill", with = "humantime_serde")]
    pub backfill: Duration,
}

fn webhook_timeout() -> Duration {
    Duration::from_secs(10)
}

fn webhook_max_attempts() -> u32 {
    10
}

fn webhook_backoff() -> Duration {
    Duration::from_secs(1)
}

fn webhook_max_backoff() -> Duration {
    Duration::from_secs(300)
}

fn webhook_backfill() -> Duration {
    Duration::from_secs(3600)
}

impl WebhookOptions {
    /// Checks the values; the error names the webhook and the key.
    pub fn validate(&self) -> Result<(), String> {
        let at = format!("webhooks[{}]", self.name);
        flotilla_model::token::check_token(&self.name)
            .map_err(|e| format!("webhooks: name {:?} {e}", self.name))?;
        let uri: http::Uri = self
            .url
            .parse()
            .map_err(|e| format!("{at}.url {:?} is not a URL: {e}", self.url))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
            return Err(format!(
                "{at}.url {:?} must be an http:// or https:// URL with a host",
                self.url
            ));
        }
        if let Some(var) = &self.secret_env
            && var.is_empty()
        {
            return Err(format!("{at}.secret-env must name an environment variable"));
        }
        if !(Duration::from_secs(1)..=Duration::from_secs(300)).contains(&self.timeout) {
            return Err(format!("{at}.timeout must be 1s to 5m"));
        }
        if !(1..=100).contains(&self.max_attempts) {
            return Err(format!("{at}.max-attempts must be 1 to 100"));
        }
        if self.backoff < Duration::from_millis(10) || self.max_backoff < self.backoff {
            return Err(format!(
                "{at}.backoff must be at least 10ms and at most max-backoff"
            ));
        }
        if self.max_backoff > Duration::from_secs(24 * 3600) {
            return Err(format!("{at}.max-backoff must be at most 24h"));
        }
        Ok(())
    }

    /// The pause after failed attempt `attempt` (1-based): `backoff`, doubled per attempt,
    /// at most `max-backoff`.
    pub fn pause_after(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(20);
        self.backoff
            .saturating_mul(1u32 << doublings)
            .min(self.max_backoff)
    }
}

/// `[supervisor.memory]`: what finished runs are remembered, and for how long.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct MemoryOptions {
    /// Record every finished root run in `<prefix>-memory` (the API answers either way).
    pub enabled: bool,
    /// How long an entry is kept (the bucket's max age, set when it is provisioned); `0s`
    /// keeps entries until they are forgotten.
    #[serde(with = "humantime_serde")]
    pub max_age: Duration,
    /// Most entries one `memory.list` reads: the newest stored.
    pub scan_limit: usize,
}

impl Default for MemoryOptions {
    fn default() -> Self {
        Self {
            enabled: true,
            max_age: Duration::from_secs(30 * 24 * 3600),
            scan_limit: 1000,
        }
    }
}

/// `[supervisor.recruit]`: who may recruit what into a running run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct RecruitPolicy {
    /// Roles a recruit may name. Empty: any role — in a deployment whose member cards define
    /// roles, any of those (a plan's `recruit_roles` narrows it further).
    pub allowed_roles: Vec<String>,
    /// Most members of one run's team: the distinct agents and roles its tasks name, a
    /// recruit's role included.
    pub max_team: usize,
    /// Most recruits one run may take (a plan's `max_recruits` may lower it).
    pub max_recruits: u32,
    /// The agents or roles whose tasks may recruit (`role:<name>` or an agent name). Empty:
    /// any running task of the run. Operators (requests naming no task) always may.
    pub recruiters: Vec<String>,
    /// How long a recruit's answer waits for the run to apply it; past it the answer is
    /// `recorded` and the run's events tell the rest.
    #[serde(with = "humantime_serde")]
    pub answer_wait: Duration,
}

impl Default for RecruitPolicy {
    fn default() -> Self {
        Self {
            allowed_roles: Vec::new(),
            max_team: 10,
            max_recruits: 5,
            recruiters: Vec::new(),
            answer_wait: Duration::from_secs(5),
        }
    }
}

impl RecruitPolicy {
    /// Checks the values; the error names the key.
    pub fn validate(&self) -> Result<(), String> {
        for role in &self.allowed_roles {
            flotilla_model::token::check_token(role)
                .map_err(|e| format!("recruit.allowed-roles: {role:?} {e}"))?;
        }
        for who in &self.recruiters {
            let name = who.strip_prefix("role:").unwrap_or(who);
            flotilla_model::token::check_token(name)
                .map_err(|e| format!("recruit.recruiters: {who:?} {e}"))?;
        }
        if self.max_team == 0 {
            return Err("recruit.max-team must be at least 1".into());
        }
        if self.answer_wait > Duration::from_secs(60) {
            return Err("recruit.answer-wait must be at most 60s".into());
        }
        Ok(())
    }
}

impl Default for SupervisorOptions {
    fn default() -> Self {
        Self {
            presence_timeout: None,
            stale_after: Duration::from_secs(120),
            progress_resolution: Duration::from_secs(5),
            presence_interval: Duration::from_secs(1),
            batch: 256,
            ack_wait: Duration::from_secs(30),
            recruit: RecruitPolicy::default(),
            memory: MemoryOptions::default(),
            team_size: 10,
            turns_per_hour: 120,
            max_message_bytes: flotilla_model::teammate::DEFAULT_MAX_MESSAGE_BYTES,
            webhooks: Vec::new(),
            external_agents: true,
            agents_discovery: Duration::from_secs(30),
            // As the coordinator's `startup-wait`: far beyond an election's seconds, short
            // enough that a broken cluster is reported.
            startup_wait: Duration::from_secs(300),
        }
    }
}

impl SupervisorOptions {
    /// Checks the values; the error names the key.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("stale-after", self.stale_after),
            ("progress-resolution", self.progress_resolution),
            ("presence-interval", self.presence_interval),
            ("ack-wait", self.ack_wait),
            ("agents-discovery", self.agents_discovery),
        ];
        for (key, d) in positive {
            if d.is_zero() {
                return Err(format!("{key} must be more than 0"));
            }
        }
        if let Some(t) = self.presence_timeout
            && t < self.presence_interval
        {
            return Err(format!(
                "presence-timeout ({t:?}) must be at least presence-interval ({:?})",
                self.presence_interval
            ));
        }
        if !(1..=4096).contains(&self.batch) {
            return Err(format!("batch must be 1 to 4096, not {}", self.batch));
        }
        if self.team_size == 0 || self.turns_per_hour == 0 {
            return Err("team-size and turns-per-hour must be more than 0".into());
        }
        if !(1..=flotilla_model::mailbox::MAX_PAYLOAD_BYTES / 2).contains(&self.max_message_bytes) {
            return Err(format!(
                "max-message-bytes must be 1 to {}",
                flotilla_model::mailbox::MAX_PAYLOAD_BYTES / 2
            ));
        }
        if !(1..=100_000).contains(&self.memory.scan_limit) {
            return Err("memory.scan-limit must be 1 to 100000".into());
        }
        if !self.memory.max_age.is_zero() && self.memory.max_age < Duration::from_secs(1) {
            return Err("memory.max-age must be 0 (keep) or at least 1s".into());
        }
        if self.progress_resolution >= self.stale_after {
            return Err("progress-resolution must be shorter than stale-after".into());
        }
        let mut names = std::collections::BTreeSet::new();
        for w in &self.webhooks {
            w.validate()?;
            if !names.insert(w.name.as_str()) {
                return Err(format!("webhooks: the name {:?} is used twice", w.name));
            }
        }
        self.recruit.validate()
    }

    /// The presence timeout, with two heartbeats of `heartbeat` as the default.
    pub fn presence_timeout_or(&self, heartbeat: Duration) -> Duration {
        self.presence_timeout.unwrap_or(heartbeat * 2)
    }
}
