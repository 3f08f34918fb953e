//! A tenant's record (`<prefix>-tenants`, key `<name>`) and its quotas.

use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Longest tenant name, in bytes: it becomes part of stream names, user names and a DNS
/// label in the Helm chart.
pub const MAX_TENANT_LEN: usize = 32;

/// Names no tenant may take: they would read as the deployment's own words.
pub const RESERVED_TENANTS: [&str; 3] = ["default", "all", "tenants"];

/// Why a string is not a tenant name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TenantNameError {
    /// Empty, or longer than [`MAX_TENANT_LEN`].
    #[error("must be 1 to {MAX_TENANT_LEN} characters long")]
    Length,
    /// A character outside `a-z 0-9 -`.
    #[error("contains {0:?}; tenant names use lowercase letters, digits and `-`")]
    Character(char),
    /// Starts or ends with `-`.
    #[error("must start and end with a letter or digit")]
    Edge,
    /// One of [`RESERVED_TENANTS`].
    #[error("is reserved")]
    Reserved,
}

/// A tenant's name: lowercase letters, digits and inner `-` (a DNS label, a subject token
/// and a stream-name fragment at once).
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(try_from = "String", into = "String")]
pub struct TenantName(String);

impl TenantName {
    /// Checks `name`.
    pub fn new(name: &str) -> Result<Self, TenantNameError> {
        if name.is_empty() || name.len() > MAX_TENANT_LEN {
            return Err(TenantNameError::Length);
        }
        if let Some(c) = name
            .chars()
            .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-'))
        {
            return Err(TenantNameError::Character(c));
        }
        if name.starts_with('-') || name.ends_with('-') {
            return Err(TenantNameError::Edge);
        }
        if RESERVED_TENANTS.contains(&name) {
            return Err(TenantNameError::Reserved);
        }
        Ok(Self(name.to_owned()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The tenant's prefix under the deployment's `base` prefix: `<base>-<tenant>`.
    pub fn prefix(&self, base: &str) -> String {
        format!("{base}-{}", self.0)
    }

    /// The tenant's inbox prefix: `_INBOX_<tenant>` (its users may read only these replies).
    pub fn inbox_prefix(&self) -> String {
        format!("_INBOX_{}", self.0)
    }

    /// The NATS user of `role` (`client`, `worker-default`, ...) in this tenant:
    /// `<role>@<tenant>`.
    pub fn user(&self, role: &str) -> String {
        format!("{role}@{}", self.0)
    }
}

impl TryFrom<String> for TenantName {
    type Error = TenantNameError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::new(&s)
    }
}

impl From<TenantName> for String {
    fn from(n: TenantName) -> Self {
        n.0
    }
}

impl fmt::Display for TenantName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A tenant as the deployment records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantRecord {
    /// Its name.
    pub name: TenantName,
    /// The worker pools it may use; each gets a user `worker-<pool>@<tenant>`.
    #[serde(default = "default_pools")]
    pub pools: Vec<String>,
    /// The NATS users (of the `PEOPLE` account) who act for it: operators who answer its
    /// approvals and control its runs. A person may belong to several tenants.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub people: Vec<String>,
    /// Its quotas; an absent quota is unlimited.
    #[serde(default, skip_serializing_if = "Quotas::is_empty")]
    pub quotas: Quotas,
    /// When it was added (Unix milliseconds).
    pub created_ms: i64,
}

fn default_pools() -> Vec<String> {
    vec!["default".to_owned()]
}

/// A tenant's limits. Each is optional (unlimited when absent) and held across every
/// coordinator and worker of the deployment.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quotas {
    /// Runs not yet ended at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrent_runs: Option<u64>,
    /// Runs submitted per clock hour (UTC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runs_per_hour: Option<u64>,
    /// Model tokens per day (UTC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_day: Option<u64>,
    /// Model cost per calendar month (UTC), in millionths of a US dollar.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_per_month_micros: Option<u64>,
    /// Requests to model providers per minute, by every worker of the tenant together. A
    /// call over it waits for its turn (never past its attempt's deadline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_requests_per_minute: Option<u64>,
    /// Model tokens per minute (estimated before a call, corrected after it), by every
    /// worker of the tenant together; a call over it waits like one over the requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_tokens_per_minute: Option<u64>,
    /// Bytes the tenant's workspace topics may hold (its workspace stream's `max_bytes`,
    /// enforced by the NATS server): a write that would pass it is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_bytes: Option<u64>,
    /// Bytes the tenant's mailboxes may hold (its mailbox stream's `max_bytes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mailbox_bytes: Option<u64>,
    /// Persistent teammates not shut down, across every team of the tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_teammates: Option<u64>,
    /// Quotas that queue a submission until they reset instead of refusing it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub queue: Vec<QuotaKind>,
}

impl Quotas {
    /// No quota at all.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// The limit of `kind`, if any.
    pub fn limit(&self, kind: QuotaKind) -> Option<u64> {
        match kind {
            QuotaKind::ConcurrentRuns => self.concurrent_runs,
            QuotaKind::RunsPerHour => self.runs_per_hour,
            QuotaKind::TokensPerDay => self.tokens_per_day,
            QuotaKind::CostPerMonth => self.cost_per_month_micros,
            QuotaKind::ModelRequestsPerMinute => self.model_requests_per_minute,
            QuotaKind::ModelTokensPerMinute => self.model_tokens_per_minute,
            QuotaKind::WorkspaceBytes => self.workspace_bytes,
            QuotaKind::MailboxBytes => self.mailbox_bytes,
            QuotaKind::PersistentTeammates => self.persistent_teammates,
        }
    }

    /// Sets the limit of `kind`.
    pub fn set(&mut self, kind: QuotaKind, limit: Option<u64>) {
        match kind {
            QuotaKind::ConcurrentRuns => self.concurrent_runs = limit,
            QuotaKind::RunsPerHour => self.runs_per_hour = limit,
            QuotaKind::TokensPerDay => self.tokens_per_day = limit,
            QuotaKind::CostPerMonth => self.cost_per_month_micros = limit,
            QuotaKind::ModelRequestsPerMinute => self.model_requests_per_minute = limit,
            QuotaKind::ModelTokensPerMinute => self.model_tokens_per_minute = limit,
            QuotaKind::WorkspaceBytes => self.workspace_bytes = limit,
            QuotaKind::MailboxBytes => self.mailbox_bytes = limit,
            QuotaKind::PersistentTeammates => self.persistent_teammates = limit,
        }
    }
}

/// One kind of quota.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum QuotaKind {
    /// [`Quotas::concurrent_runs`].
    ConcurrentRuns,
    /// [`Quotas::runs_per_hour`].
    RunsPerHour,
    /// [`Quotas::tokens_per_day`].
    TokensPerDay,
    /// [`Quotas::cost_per_month_micros`].
    CostPerMonth,
    /// [`Quotas::model_requests_per_minute`].
    ModelRequestsPerMinute,
    /// [`Quotas::model_tokens_per_minute`].
    ModelTokensPerMinute,
    /// [`Quotas::workspace_bytes`].
    WorkspaceBytes,
    /// [`Quotas::mailbox_bytes`].
    MailboxBytes,
    /// [`Quotas::persistent_teammates`].
    PersistentTeammates,
}

impl QuotaKind {
    /// Every kind.
    pub const ALL: [QuotaKind; 9] = [
        Self::ConcurrentRuns,
        Self::RunsPerHour,
        Self::TokensPerDay,
        Self::CostPerMonth,
        Self::ModelRequestsPerMinute,
        Self::ModelTokensPerMinute,
        Self::WorkspaceBytes,
        Self::MailboxBytes,
        Self::PersistentTeammates,
    ];

    /// The name on the wire and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ConcurrentRuns => "concurrent_runs",
            Self::RunsPerHour => "runs_per_hour",
            Self::TokensPerDay => "tokens_per_day",
            Self::CostPerMonth => "cost_per_month",
            Self::ModelRequestsPerMinute => "model_requests_per_minute",
            Self::ModelTokensPerMinute => "model_tokens_per_minute",
            Self::WorkspaceBytes => "workspace_bytes",
            Self::MailboxBytes => "mailbox_bytes",
            Self::PersistentTeammates => "persistent_teammates",
        }
    }

    /// The kind named `s` (its wire name, or with `-` for `_`).
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.replace('-', "_");
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

impl fmt::Display for QuotaKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How messages name an installation: `tenant <name>`, or `this installation` for the
/// deployment's own (default) one.
pub fn installation(tenant: Option<&str>) -> String {
    tenant.map_or_else(|| "this installation".to_owned(), |t| format!("tenant {t}"))
}

/// Why a tenant's submission was refused (`quota_exceeded`): which quota, its limit, what
/// is used, and when it resets (`None` for concurrent runs: when one ends). A rejection
/// carries it on its problem of code `quota_exceeded` ([`crate::problem::Problem::quota`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct QuotaExceeded {
    /// The tenant; absent for the deployment's own (default) installation, whose quotas
    /// are set the same way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<TenantName>,
    /// The quota.
    pub quota: QuotaKind,
    /// Its limit.
    pub limit: u64,
    /// What is used now.
    pub used: u64,
    /// When the window resets (Unix milliseconds); absent for quotas without a window
    /// (concurrent runs, bytes, teammates: they free when something ends or is removed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resets_at_ms: Option<i64>,
}

impl fmt::Display for QuotaExceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} is over its {} quota",
            installation(self.tenant.as_ref().map(TenantName::as_str)),
            self.quota
        )?;
        write!(f, ": {} used of {}", self.used, self.limit)?;
        match self.resets_at_ms {
            Some(ms) => write!(
                f,
                "; it resets at {}",
                crate::time::Timestamp::from_unix_ms(ms)
            ),
            None => f.write_str(match self.quota {
                QuotaKind::WorkspaceBytes | QuotaKind::MailboxBytes => {
                    "; space frees as entries age out or runs are purged"
                }
                QuotaKind::PersistentTeammates => "; one frees when a teammate is shut down",
                _ => "; a slot frees when one of its runs ends",
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_names_are_dns_labels() {
        for ok in ["acme", "a", "team-7", "0x"] {
            assert!(TenantName::new(ok).is_ok(), "{ok}");
        }
        assert_eq!(TenantName::new(""), Err(TenantNameError::Length));
        assert_eq!(
            TenantName::new(&"a".repeat(33)),
            Err(TenantNameError::Length)
        );
        assert_eq!(
            TenantName::new("Acme"),
            Err(TenantNameError::Character('A'))
        );
        assert_eq!(TenantName::new("a_b"), Err(TenantNameError::Character('_')));
        assert_eq!(TenantName::new("a.b"), Err(TenantNameError::Character('.')));
        assert_eq!(TenantName::new("-a"), Err(TenantNameError::Edge));
        assert_eq!(TenantName::new("default"), Err(TenantNameError::Reserved));
        let t = TenantName::new("acme").unwrap();
        assert_eq!(t.prefix("flotilla"), "flotilla-acme");
        assert_eq!(t.user("worker-default"), "worker-default@acme");
        assert_eq!(t.inbox_prefix(), "_INBOX_acme");
    }

    #[test]
    fn a_record_round_trips_and_omits_what_is_unset() {
        let r = TenantRecord {
            name: TenantName::new("acme").unwrap(),
            pools: vec!["default".into()],
            people: vec![],
            quotas: Quotas::default(),
            created_ms: 1,
        };
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"name": "acme", "pools": ["default"], "created_ms": 1})
        );
        let back: TenantRecord = serde_json::from_value(json).unwrap();
        assert_eq!(back, r);
        assert!(
            serde_json::from_value::<TenantRecord>(
                serde_json::json!({"name": "A", "created_ms": 1})
            )
            .is_err()
        );
        assert_eq!(
            QuotaKind::parse("runs-per-hour"),
            Some(QuotaKind::RunsPerHour)
        );
        assert_eq!(QuotaKind::parse("bogus"), None);
    }
}
