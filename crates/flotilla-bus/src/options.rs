//! NATS connection options, as read from the `[nats]` section of `flotilla.toml`.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{ConnectError, ConnectErrorKind};

/// How to reach and authenticate to NATS.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct NatsOptions {
    /// Server URLs; the client fails over between them. Also accepted as one
    /// comma-separated string (`FLOTILLA_NATS__URLS=nats://a:4222,nats://b:4222`).
    #[serde(deserialize_with = "urls_from_list_or_text")]
    pub urls: Vec<String>,
    /// Connection name shown in server monitoring (default: the role, e.g. `flotilla-worker`).
    pub name: Option<String>,
    /// Subject, stream and bucket prefix of this installation.
    pub prefix: String,
    /// The tenant this process acts for (`flotilla tenant add`): its names are those of
    /// prefix `<prefix>-<tenant>`, a user name `<user>@<tenant>` (a user/password login
    /// whose user has no `@` yet), and its inboxes `_INBOX_<tenant>` — what the tenant's
    /// users are pinned to by the server. Unset: the deployment's default tenant.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The prefix of reply inboxes (default `_INBOX`; a tenant's is `_INBOX_<tenant>`). A
    /// user allowed only its own inboxes cannot read replies meant for others.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inbox_prefix: Option<String>,
    /// Authentication.
    pub auth: NatsAuth,
    /// TLS, when the server requires it or client certificates are used.
    pub tls: Option<TlsOptions>,
    /// How long one connection attempt may take.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Default timeout of requests (JetStream API calls, KV operations).
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// How long the client may hear nothing from its server before it sends a ping. A
    /// connection whose link went silent (packets dropped, a node cut off from the network)
    /// is closed when a third ping falls due with two unanswered, so within
    /// [`dead_link_after`](Self::dead_link_after) (three intervals) of the last byte
    /// received; the client then reconnects to another of its servers.
    #[serde(with = "humantime_serde")]
    pub ping_interval: Duration,
    /// Whether the client also fails over to the servers its cluster advertises (each
    /// node's client URL, learnt on connecting) besides `urls`. Turn it off where those
    /// addresses cannot be reached from the client (a proxy or NAT in front of each node):
    /// then only `urls` are tried.
    pub discover_servers: bool,
}

impl Default for NatsOptions {
    fn default() -> Self {
        Self {
            // The port nats-server listens on by default.
            urls: vec!["nats://127.0.0.1:4222".to_owned()],
            name: None,
            prefix: flotilla_model::subjects::DEFAULT_PREFIX.to_owned(),
            tenant: None,
            inbox_prefix: None,
            auth: NatsAuth::None,
            tls: None,
            // Long enough for a cross-zone TLS handshake, short enough to fail over quickly.
            connect_timeout: Duration::from_secs(5),
            // JetStream API calls normally answer in milliseconds; 10 s rides out a leader
            // election in a cluster.
            request_timeout: Duration::from_secs(10),
            // A silent link is given up within 9 s (three intervals): less than two worker
            // heartbeats at their default of 5 s, so a cut-off worker reconnects elsewhere
            // before its tasks are handed to another worker. An idle connection costs a
            // ping and a pong every 3 s.
            ping_interval: Duration::from_secs(3),
            // Clusters advertise reachable client URLs unless told otherwise.
            discover_servers: true,
        }
    }
}

/// How many pings may go unanswered: async-nats 0.51 closes the connection when a ping
/// falls due with this many outstanding (its fixed `MAX_PENDING_PINGS`), so a silent link is
/// given up when the `PINGS_OUTSTANDING + 1`-th ping is due.
pub const PINGS_OUTSTANDING: u32 = 2;

/// The shortest `ping-interval` accepted: below it, a busy moment on a shared machine (a
/// server that answers a ping a few tens of milliseconds late) would close healthy
/// connections.
pub const MIN_PING_INTERVAL: Duration = Duration::from_millis(100);

/// Reads URLs from a list or a comma-separated string.
fn urls_from_list_or_text<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Urls {
        List(Vec<String>),
        Text(String),
    }
    Ok(match Urls::deserialize(d)? {
        Urls::List(l) => l,
        Urls::Text(t) => t
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_owned)
            .collect(),
    })
}

/// Authentication methods. Secrets never appear in `Debug` output or logs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum NatsAuth {
    /// No authentication.
    #[default]
    None,
    /// A shared token.
    Token {
        /// The token.
        token: Secret,
    },
    /// User name and password.
    UserPassword {
        /// User.
        user: String,
        /// Password.
        password: Secret,
    },
    /// An NKey seed (`SU…`).
    Nkey {
        /// The seed.
        seed: Secret,
    },
    /// A `.creds` file (JWT + seed), as issued by `nsc`.
    CredsFile {
        /// Path of the file.
        path: PathBuf,
    },
}

/// TLS settings.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct TlsOptions {
    /// Require TLS even if the server does not ask for it.
    pub required: bool,
    /// CA bundle to trust (PEM).
    pub ca: Option<PathBuf>,
    /// Client certificate (PEM), with `key`.
    pub cert: Option<PathBuf>,
    /// Client key (PEM), with `cert`.
    pub key: Option<PathBuf>,
}

/// A secret string: printed as `***` by `Debug`, `Display` and `Serialize`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret.
    pub fn new(secret: impl Into<String>) -> Self {
        Self(secret.into())
    }

    /// The secret itself. Call only where it is handed to the NATS client.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("***")
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Secret)
    }
}

impl NatsOptions {
    /// Options for one URL with defaults for everything else.
    pub fn with_url(url: impl Into<String>) -> Self {
        Self {
            urls: vec![url.into()],
            ..Self::default()
        }
    }

    /// How long a connection whose link went silent stays open before the client gives it up
    /// and reconnects elsewhere: three [`ping_interval`](Self::ping_interval)s after the
    /// last byte from the server (see [`PINGS_OUTSTANDING`]).
    pub fn dead_link_after(&self) -> Duration {
        self.ping_interval * (PINGS_OUTSTANDING + 1)
    }

    /// The prefix this process's names derive from: `prefix`, or `<prefix>-<tenant>`.
    pub fn effective_prefix(&self) -> String {
        match &self.tenant {
            Some(t) => format!("{}-{t}", self.prefix),
            None => self.prefix.clone(),
        }
    }

    /// The inbox prefix to connect with: `inbox_prefix`, else the tenant's `_INBOX_<tenant>`.
    pub fn effective_inbox_prefix(&self) -> Option<String> {
        self.inbox_prefix
            .clone()
            .or_else(|| self.tenant.as_ref().map(|t| format!("_INBOX_{t}")))
    }

    /// The options with the tenant applied: the effective prefix, inbox prefix and user
    /// name written out, and `tenant` unset — what an exec agent of this process is given,
    /// and what applying again leaves unchanged.
    pub fn resolved(&self) -> NatsOptions {
        let mut out = self.clone();
        let Some(t) = out.tenant.take() else {
            return out;
        };
        out.prefix = self.effective_prefix();
        out.inbox_prefix = self.effective_inbox_prefix();
        if let NatsAuth::UserPassword { user, .. } = &mut out.auth
            && !user.contains('@')
        {
            *user = format!("{user}@{t}");
        }
        out
    }

    /// Checks the options without doing I/O.
    pub fn validate(&self) -> Result<(), ConnectError> {
        let invalid = |msg: String| Err(ConnectError::new(ConnectErrorKind::InvalidOptions, msg));
        if self.urls.is_empty() {
            return invalid("nats.urls is empty: give at least one server URL".into());
        }
        for url in &self.urls {
            if let Err(e) = url.parse::<async_nats::ServerAddr>() {
                return invalid(format!("nats.urls: {url:?} is not a NATS URL: {e}"));
            }
        }
        if let Err(e) = flotilla_model::token::check_name(&self.prefix) {
            return invalid(format!("nats.prefix {:?} {e}", self.prefix));
        }
        if let Some(t) = &self.tenant
            && let Err(e) = flotilla_model::tenant::TenantName::new(t)
        {
            return invalid(format!("nats.tenant {t:?} {e}"));
        }
        if let Some(p) = &self.inbox_prefix
            && let Err(e) = flotilla_model::token::check_name(p)
        {
            return invalid(format!("nats.inbox-prefix {p:?} {e}"));
        }
        if let Some(tls) = &self.tls
            && tls.cert.is_some() != tls.key.is_some()
        {
            return invalid("nats.tls: cert and key must be given together".into());
        }
        if self.connect_timeout.is_zero() || self.request_timeout.is_zero() {
            return invalid(
                "nats.connect-timeout and nats.request-timeout must be more than 0".into(),
            );
        }
        if self.ping_interval < MIN_PING_INTERVAL {
            return invalid(format!(
                "nats.ping-interval is {}: it must be at least {} (a silent link is given up after three intervals)",
                humantime::format_duration(self.ping_interval),
                humantime::format_duration(MIN_PING_INTERVAL)
            ));
        }
        if let NatsAuth::UserPassword { user, .. } = &self.auth
            && user.is_empty()
        {
            return invalid("nats.auth: user must not be empty".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_resolves_to_its_prefix_user_and_inboxes_once() {
        let opts = NatsOptions {
            tenant: Some("acme".into()),
            auth: NatsAuth::UserPassword {
                user: "client".into(),
                password: Secret::new("p"),
            },
            ..NatsOptions::default()
        };
        assert!(opts.validate().is_ok());
        assert_eq!(opts.effective_prefix(), "flotilla-acme");
        let r = opts.resolved();
        assert_eq!(r.prefix, "flotilla-acme");
        assert_eq!(r.inbox_prefix.as_deref(), Some("_INBOX_acme"));
        assert_eq!(r.tenant, None);
        assert!(matches!(&r.auth, NatsAuth::UserPassword { user, .. } if user == "client@acme"));
        // Resolving again changes nothing (an exec agent's options are resolved ones).
        assert_eq!(r.resolved(), r);
        // A user already scoped keeps its name.
        let scoped = NatsOptions {
            auth: NatsAuth::UserPassword {
                user: "bob@acme".into(),
                password: Secret::new("p"),
            },
            ..opts.clone()
        };
        assert!(
            matches!(&scoped.resolved().auth, NatsAuth::UserPassword { user, .. } if user == "bob@acme")
        );
        for bad in ["Acme", "a.b", "default", ""] {
            let o = NatsOptions {
                tenant: Some(bad.into()),
                ..NatsOptions::default()
            };
            let e = o.validate().unwrap_err().to_string();
            assert!(e.contains("nats.tenant"), "{bad}: {e}");
        }
        let o = NatsOptions {
            inbox_prefix: Some("_INBOX.x".into()),
            ..NatsOptions::default()
        };
        assert!(
            o.validate()
                .unwrap_err()
                .to_string()
                .contains("nats.inbox-prefix")
        );
    }

    #[test]
    fn secrets_are_redacted_in_debug() {
        let opts = NatsOptions {
            auth: NatsAuth::UserPassword {
                user: "svc".into(),
                password: Secret::new("hunter2"),
            },
            ..NatsOptions::default()
        };
        let shown = format!("{opts:?}");
        assert!(shown.contains("svc"));
        assert!(!shown.contains("hunter2"), "{shown}");
        let token = NatsAuth::Token {
            token: Secret::new("s3cr3t"),
        };
        assert!(!format!("{token:?}").contains("s3cr3t"));
    }

    #[test]
    fn auth_is_a_tagged_enum_in_toml() {
        let opts: NatsOptions = toml::from_str(
            r#"
            urls = ["nats://a:4222", "nats://b:4222"]
            auth = { kind = "user-password", user = "u", password = "p" }
            connect-timeout = "2s"
            "#,
        )
        .expect("parses");
        assert_eq!(
            opts.auth,
            NatsAuth::UserPassword {
                user: "u".into(),
                password: Secret::new("p")
            }
        );
        assert_eq!(opts.connect_timeout, Duration::from_secs(2));
        assert!(opts.validate().is_ok());
        assert!(toml::from_str::<NatsOptions>("auth = { kind = \"magic\" }").is_err());
        assert!(toml::from_str::<NatsOptions>("colour = 1").is_err());
    }

    #[test]
    fn validation_names_the_problem() {
        let mut opts = NatsOptions::default();
        opts.urls.clear();
        assert_eq!(
            opts.validate().expect_err("empty").kind(),
            ConnectErrorKind::InvalidOptions
        );
        let opts = NatsOptions {
            tls: Some(TlsOptions {
                cert: Some("c.pem".into()),
                ..TlsOptions::default()
            }),
            ..NatsOptions::default()
        };
        let err = opts.validate().expect_err("half a key pair");
        assert!(err.to_string().contains("cert and key"), "{err}");
        let opts = NatsOptions {
            prefix: "a.b".into(),
            ..NatsOptions::default()
        };
        assert!(opts.validate().is_err());
    }

    #[test]
    fn a_silent_link_is_given_up_within_two_worker_heartbeats_by_default() {
        let opts = NatsOptions::default();
        // The worker heartbeat's default (flotilla-worker's `WorkerOptions::heartbeat`).
        let heartbeat = Duration::from_secs(5);
        assert!(opts.dead_link_after() <= 2 * heartbeat, "{opts:?}");
        assert_eq!(opts.dead_link_after(), 3 * opts.ping_interval);
        assert!(opts.discover_servers);
        assert!(opts.validate().is_ok());
    }

    #[test]
    fn the_ping_interval_is_read_and_checked() {
        let opts: NatsOptions =
            toml::from_str("ping-interval = \"1s\"\ndiscover-servers = false").expect("parses");
        assert_eq!(opts.ping_interval, Duration::from_secs(1));
        assert_eq!(opts.dead_link_after(), Duration::from_secs(3));
        assert!(!opts.discover_servers);
        assert!(opts.validate().is_ok());
        for bad in ["0s", "50ms"] {
            let opts: NatsOptions =
                toml::from_str(&format!("ping-interval = \"{bad}\"")).expect("parses");
            let err = opts.validate().expect_err(bad);
            assert_eq!(err.kind(), ConnectErrorKind::InvalidOptions, "{bad}");
            assert!(
                err.to_string().contains("nats.ping-interval is")
                    && err.to_string().contains("at least 100ms"),
                "{err}"
            );
        }
        assert!(toml::from_str::<NatsOptions>("ping-interval = \"soon\"").is_err());
    }
}
