//! `[console]` in `flotilla.toml`: where the console listens and who may use it.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

use ipnet::IpNet;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The console's settings.
///
/// Identity comes from one of three places, checked in this order:
/// 1. `identity-header`: a header set by an authenticating proxy in front (OIDC); the
///    proxy must strip it from what clients send. Only read when configured, and only on
///    connections from `trusted-proxies` (required with it): from any other peer the
///    header is ignored, so a client that reaches the console around the proxy cannot
///    name itself.
/// 2. `tokens`: a bearer token (`Authorization: Bearer …`, or the cookie the page sets
///    after `/?token=…`) names the identity it was issued to.
/// 3. Neither configured: the console is for the person at this machine — it must then
///    listen on a loopback address, and everyone reaching it is `local-identity`.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct ConsoleOptions {
    /// Whether `flotilla up` starts the console (`flotilla console` always does).
    pub enabled: bool,
    /// Where to listen. Default `127.0.0.1:9480`: off the network.
    pub listen: SocketAddr,
    /// Tokens by identity (`alice = "…"`). Empty: no token sign-in.
    pub tokens: BTreeMap<String, String>,
    /// A header carrying the identity an authenticating proxy verified (e.g.
    /// `X-Forwarded-User`). Unset: no proxy identity.
    pub identity_header: Option<String>,
    /// The addresses or networks the authenticating proxy connects from (`10.0.0.0/8`,
    /// `127.0.0.1`, `fd00::/8`): `identity-header` is read only on connections from these
    /// (the TCP peer, not any forwarded-for header). Required with `identity-header`.
    pub trusted_proxies: Vec<TrustedProxy>,
    /// Identities with the operator role: they may answer approvals and pause, resume,
    /// take over or cancel runs. Everyone else only looks.
    pub operators: Vec<String>,
    /// Platform administrators: a console serving several tenants (`flotilla console
    /// --tenants`) shows them every tenant, and they are operators in each (and in a console
    /// of one installation). Everyone else sees only the tenants whose record lists them in
    /// `people` (`flotilla tenant add|set --person`).
    pub administrators: Vec<String>,
    /// The identity of everyone when neither tokens nor a proxy header are configured
    /// (default `local`).
    pub local_identity: String,
    /// Whether that local identity is an operator (default true: the person at this
    /// machine runs the deployment).
    pub local_operator: bool,
}

/// The console's default port.
pub const DEFAULT_PORT: u16 = 9480;

impl Default for ConsoleOptions {
    fn default() -> Self {
        Self {
            // `flotilla up` shows its console.
            enabled: true,
            // Loopback: nothing off this machine reaches it until configured to.
            listen: SocketAddr::from(([127, 0, 0, 1], DEFAULT_PORT)),
            tokens: BTreeMap::new(),
            identity_header: None,
            trusted_proxies: Vec::new(),
            operators: Vec::new(),
            // Nobody: each person sees only their tenants.
            administrators: Vec::new(),
            local_identity: "local".to_owned(),
            local_operator: true,
        }
    }
}

impl std::fmt::Debug for ConsoleOptions {
    // Tokens are secrets: only their identities are shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleOptions")
            .field("enabled", &self.enabled)
            .field("listen", &self.listen)
            .field("tokens", &self.tokens.keys().collect::<Vec<_>>())
            .field("identity_header", &self.identity_header)
            .field("trusted_proxies", &self.trusted_proxies)
            .field("operators", &self.operators)
            .field("administrators", &self.administrators)
            .field("local_identity", &self.local_identity)
            .field("local_operator", &self.local_operator)
            .finish()
    }
}

/// A `[console]` section that cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConsoleOptionsError {
    /// Without tokens or a proxy header, anyone reaching the console would be an operator.
    #[error(
        "console.listen {0} is not a loopback address, and neither console.tokens nor console.identity-header is set: anyone reaching it would act as `local`; configure one of them, or listen on 127.0.0.1"
    )]
    OpenToNetwork(SocketAddr),
    /// A token that is empty (or too short to be a secret).
    #[error("console.tokens.{0}: a token needs at least 16 characters")]
    WeakToken(String),
    /// A header name HTTP does not allow.
    #[error("console.identity-header {0:?} is not a valid header name")]
    BadHeader(String),
    /// A proxy identity header that any client could send: no proxy is trusted to set it.
    #[error(
        "console.identity-header {0:?} is set but console.trusted-proxies is empty: anyone reaching the console could send that header and act as any identity; list the addresses or networks your authenticating proxy connects from (e.g. trusted-proxies = [\"10.0.0.0/8\"])"
    )]
    UntrustedHeader(String),
    /// An administrator's name that names nobody: empty, or with spaces around it.
    #[error(
        "console.administrators: {0:?} is not an identity (an identity's name is not empty and has no spaces around it)"
    )]
    BadAdministrator(String),
    /// An administrator listed twice.
    #[error("console.administrators: {0:?} is listed twice")]
    DuplicateAdministrator(String),
}

impl ConsoleOptions {
    /// Checks the settings (no I/O).
    pub fn validate(&self) -> Result<(), ConsoleOptionsError> {
        for (who, token) in &self.tokens {
            if token.len() < 16 {
                return Err(ConsoleOptionsError::WeakToken(who.clone()));
            }
        }
        if let Some(h) = &self.identity_header
            && http::HeaderName::from_bytes(h.as_bytes()).is_err()
        {
            return Err(ConsoleOptionsError::BadHeader(h.clone()));
        }
        if let Some(h) = &self.identity_header
            && self.trusted_proxies.is_empty()
        {
            return Err(ConsoleOptionsError::UntrustedHeader(h.clone()));
        }
        let mut seen = std::collections::BTreeSet::new();
        for a in &self.administrators {
            if a.trim().is_empty() || a.trim() != a {
                return Err(ConsoleOptionsError::BadAdministrator(a.clone()));
            }
            if !seen.insert(a) {
                return Err(ConsoleOptionsError::DuplicateAdministrator(a.clone()));
            }
        }
        if self.is_local() && !self.listen.ip().is_loopback() {
            return Err(ConsoleOptionsError::OpenToNetwork(self.listen));
        }
        Ok(())
    }

    /// Neither tokens nor a proxy header: everyone is the local identity.
    pub fn is_local(&self) -> bool {
        self.tokens.is_empty() && self.identity_header.is_none()
    }

    /// Whether `name` is a platform administrator (every tenant, operator in each).
    pub fn is_administrator(&self, name: &str) -> bool {
        self.administrators.iter().any(|a| a == name)
    }

    /// Whether a connection from `peer` comes from a trusted proxy (an IPv4 peer on an IPv6
    /// socket, `::ffff:a.b.c.d`, is matched as `a.b.c.d`).
    pub fn trusts(&self, peer: IpAddr) -> bool {
        let peer = peer.to_canonical();
        self.trusted_proxies.iter().any(|p| p.contains(peer))
    }
}

/// An address or network trusted proxies connect from: `10.0.0.0/8`, `127.0.0.1`,
/// `fd00::/8` (an address alone is that one address). Written and read as that string.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TrustedProxy(IpNet);

impl TrustedProxy {
    /// Whether `ip` is this address or in this network.
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.0.contains(&ip)
    }
}

/// Not an address or a network.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an IP address or a CIDR network (e.g. 10.0.0.0/8, 127.0.0.1, fd00::/8)")]
pub struct BadTrustedProxy(String);

impl FromStr for TrustedProxy {
    type Err = BadTrustedProxy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.contains('/') {
            s.parse::<IpNet>()
                .map(|n| Self(n.trunc()))
                .map_err(|_| BadTrustedProxy(s.to_owned()))
        } else {
            s.parse::<IpAddr>()
                .map(|a| Self(IpNet::from(a.to_canonical())))
                .map_err(|_| BadTrustedProxy(s.to_owned()))
        }
    }
}

impl fmt::Display for TrustedProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.prefix_len() == self.0.max_prefix_len() {
            self.0.addr().fmt(f)
        } else {
            self.0.fmt(f)
        }
    }
}

impl fmt::Debug for TrustedProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl Serialize for TrustedProxy {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for TrustedProxy {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_listen_on_loopback_and_validate() {
        let o = ConsoleOptions::default();
        assert!(o.listen.ip().is_loopback());
        assert_eq!(o.validate(), Ok(()));
    }

    #[test]
    fn an_open_listener_needs_an_identity_source() {
        let mut o = ConsoleOptions {
            listen: "0.0.0.0:9480".parse().expect("an address"),
            ..ConsoleOptions::default()
        };
        assert!(matches!(
            o.validate(),
            Err(ConsoleOptionsError::OpenToNetwork(_))
        ));
        o.identity_header = Some("X-Forwarded-User".into());
        o.trusted_proxies = vec!["10.0.0.0/8".parse().expect("a network")];
        assert_eq!(o.validate(), Ok(()));
        o.identity_header = Some("bad header".into());
        assert!(matches!(
            o.validate(),
            Err(ConsoleOptionsError::BadHeader(_))
        ));
    }

    #[test]
    fn tokens_are_not_shown_and_must_be_long() {
        let mut o = ConsoleOptions::default();
        o.tokens.insert("alice".into(), "short".into());
        assert_eq!(
            o.validate(),
            Err(ConsoleOptionsError::WeakToken("alice".into()))
        );
        o.tokens
            .insert("alice".into(), "s3cret-s3cret-s3cret".into());
        assert_eq!(o.validate(), Ok(()));
        assert!(!format!("{o:?}").contains("s3cret"));
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("an address")
    }

    #[test]
    fn administrators_are_named() {
        let mut o = ConsoleOptions {
            administrators: vec!["root".into(), "ops@example.com".into()],
            ..ConsoleOptions::default()
        };
        assert_eq!(o.validate(), Ok(()));
        assert!(o.is_administrator("root") && !o.is_administrator("alice"));
        for bad in ["", "  ", " root"] {
            o.administrators = vec![bad.into()];
            let err = o.validate().expect_err("refused");
            assert_eq!(err, ConsoleOptionsError::BadAdministrator(bad.into()));
            assert!(err.to_string().contains("console.administrators"), "{err}");
        }
        o.administrators = vec!["root".into(), "root".into()];
        assert_eq!(
            o.validate(),
            Err(ConsoleOptionsError::DuplicateAdministrator("root".into()))
        );
    }

    #[test]
    fn an_identity_header_needs_trusted_proxies() {
        let mut o = ConsoleOptions {
            identity_header: Some("X-Forwarded-User".into()),
            ..ConsoleOptions::default()
        };
        let err = o.validate().expect_err("no trusted proxies");
        assert_eq!(
            err,
            ConsoleOptionsError::UntrustedHeader("X-Forwarded-User".into())
        );
        assert!(err.to_string().contains("console.trusted-proxies"), "{err}");
        o.trusted_proxies = vec!["127.0.0.1".parse().expect("an address")];
        assert_eq!(o.validate(), Ok(()));
    }

    #[test]
    fn trusted_proxies_are_addresses_or_networks() {
        let o = ConsoleOptions {
            trusted_proxies: ["10.0.0.0/8", "127.0.0.1", "fd00::/8", "192.168.1.7/24"]
                .iter()
                .map(|s| s.parse().expect("valid"))
                .collect(),
            ..ConsoleOptions::default()
        };
        for yes in [
            "10.1.2.3",
            "127.0.0.1",
            "fd00::1",
            "192.168.1.200",
            "::ffff:10.9.9.9",
        ] {
            assert!(o.trusts(ip(yes)), "{yes}");
        }
        for no in [
            "11.0.0.1",
            "127.0.0.2",
            "::1",
            "fe80::1",
            "192.168.2.1",
            "::ffff:8.8.8.8",
        ] {
            assert!(!o.trusts(ip(no)), "{no}");
        }
        assert!(!ConsoleOptions::default().trusts(ip("127.0.0.1")));
        // A network written with host bits is that network.
        assert_eq!(o.trusted_proxies[3].to_string(), "192.168.1.0/24");
        assert_eq!(o.trusted_proxies[1].to_string(), "127.0.0.1");
        for bad in ["", "10.0.0.0/33", "evil.test", "10.0.0", "10.0.0.0/8/8"] {
            assert!(bad.parse::<TrustedProxy>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn trusted_proxies_are_read_and_written_as_strings() {
        let o: ConsoleOptions = serde_json::from_value(serde_json::json!({
            "identity-header": "X-Forwarded-User",
            "trusted-proxies": ["10.0.0.0/8", "::1"],
        }))
        .expect("loads");
        assert_eq!(o.validate(), Ok(()));
        assert!(o.trusts(ip("10.20.30.40")) && o.trusts(ip("::1")));
        let back = serde_json::to_value(&o).expect("serializes");
        assert_eq!(
            back["trusted-proxies"],
            serde_json::json!(["10.0.0.0/8", "::1"])
        );
        let err = serde_json::from_value::<ConsoleOptions>(
            serde_json::json!({"trusted-proxies": ["anywhere"]}),
        )
        .expect_err("refused");
        assert!(err.to_string().contains("not an IP address"), "{err}");
    }
}
