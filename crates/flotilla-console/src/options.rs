//! `[console]` in `flotilla.toml`: where the console listens and who may use it.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// The console's settings.
///
/// Identity comes from one of three places, checked in this order:
/// 1. `identity-header`: a header set by an authenticating proxy in front (OIDC); the
///    proxy must strip it from what clients send. Only read when configured.
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
    /// Identities with the operator role: they may answer approvals and pause, resume,
    /// take over or cancel runs. Everyone else only looks.
    pub operators: Vec<String>,
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
            operators: Vec::new(),
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
            .field("operators", &self.operators)
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
        if self.is_local() && !self.listen.ip().is_loopback() {
            return Err(ConsoleOptionsError::OpenToNetwork(self.listen));
        }
        Ok(())
    }

    /// Neither tokens nor a proxy header: everyone is the local identity.
    pub fn is_local(&self) -> bool {
        self.tokens.is_empty() && self.identity_header.is_none()
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
}
