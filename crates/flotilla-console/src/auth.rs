//! Who is asking, and may they act: identity from a proxy header, a token or the local
//! default ([`ConsoleOptions`]); the operator role; and the CSRF check of every POST.
//!
//! A POST must carry `X-Flotilla-Console: 1` — a custom header a cross-site form cannot set
//! and a cross-site script cannot send without a CORS preflight, which the console never
//! grants — and, when the browser sends `Origin`, come from the console's own origin.

use http::{HeaderMap, StatusCode, header};
use serde::Serialize;

use crate::options::ConsoleOptions;

/// The cookie holding the token after `/?token=…`.
pub(crate) const TOKEN_COOKIE: &str = "flotilla_console";
/// The header every POST must carry.
pub(crate) const CSRF_HEADER: &str = "x-flotilla-console";

/// The signed-in person.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Identity {
    /// Their name, as recorded with what they do (`by` of an answer or a control).
    pub name: String,
    /// May answer approvals and control runs.
    pub operator: bool,
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No identity (401).
    Unauthenticated,
    /// Not an operator (403).
    NotOperator,
    /// A POST without the console's header or from another origin (403).
    CrossSite,
}

impl Refusal {
    pub(crate) fn status(self) -> StatusCode {
        match self {
            Self::Unauthenticated => StatusCode::UNAUTHORIZED,
            Self::NotOperator | Self::CrossSite => StatusCode::FORBIDDEN,
        }
    }

    pub(crate) fn code(self) -> &'static str {
        match self {
            Self::Unauthenticated => "unauthenticated",
            Self::NotOperator => "not_operator",
            Self::CrossSite => "cross_site",
        }
    }

    pub(crate) fn message(self) -> &'static str {
        match self {
            Self::Unauthenticated => {
                "sign in: open the console with ?token=YOUR_TOKEN, or through the proxy"
            }
            Self::NotOperator => "only identities with the operator role may do this",
            Self::CrossSite => "refused: the request did not come from the console's page",
        }
    }
}

/// Compares two secrets in time independent of where they differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A cookie's value from the request's `Cookie` headers.
pub(crate) fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// The identity a token was issued to.
pub(crate) fn identity_of_token(opts: &ConsoleOptions, token: &str) -> Option<String> {
    opts.tokens
        .iter()
        .find(|(_, t)| same_secret(t.as_bytes(), token.as_bytes()))
        .map(|(who, _)| who.clone())
}

/// Who sent `headers`, with their role.
pub(crate) fn identify(opts: &ConsoleOptions, headers: &HeaderMap) -> Result<Identity, Refusal> {
    let operator = |name: &str| opts.operators.iter().any(|o| o == name);
    if let Some(h) = &opts.identity_header
        && let Some(v) = headers.get(h.as_str()).and_then(|v| v.to_str().ok())
        && !v.trim().is_empty()
    {
        let name = v.trim().to_owned();
        return Ok(Identity {
            operator: operator(&name),
            name,
        });
    }
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if let Some(token) = bearer.or_else(|| cookie(headers, TOKEN_COOKIE))
        && let Some(name) = identity_of_token(opts, token)
    {
        return Ok(Identity {
            operator: operator(&name),
            name,
        });
    }
    if opts.is_local() {
        let name = opts.local_identity.clone();
        return Ok(Identity {
            operator: opts.local_operator || operator(&name),
            name,
        });
    }
    Err(Refusal::Unauthenticated)
}

/// The CSRF check of a state-changing request.
pub(crate) fn same_site(headers: &HeaderMap) -> Result<(), Refusal> {
    if headers.get(CSRF_HEADER).and_then(|v| v.to_str().ok()) != Some("1") {
        return Err(Refusal::CrossSite);
    }
    if let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) {
        let host = headers
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        let forwarded = headers
            .get("x-forwarded-host")
            .and_then(|v| v.to_str().ok());
        let authority = origin.split_once("://").map_or(origin, |(_, a)| a);
        if authority != host && Some(authority) != forwarded {
            return Err(Refusal::CrossSite);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn with_tokens() -> ConsoleOptions {
        let mut o = ConsoleOptions::default();
        o.tokens
            .insert("alice".into(), "alice-token-0123456789".into());
        o.tokens.insert("bob".into(), "bob-token-0123456789".into());
        o.operators = vec!["alice".into()];
        o
    }

    #[test]
    fn tokens_name_identities_and_roles() {
        let o = with_tokens();
        let mut h = HeaderMap::new();
        assert_eq!(identify(&o, &h), Err(Refusal::Unauthenticated));
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer alice-token-0123456789"),
        );
        assert_eq!(
            identify(&o, &h),
            Ok(Identity {
                name: "alice".into(),
                operator: true
            })
        );
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            HeaderValue::from_static("x=1; flotilla_console=bob-token-0123456789"),
        );
        assert_eq!(
            identify(&o, &h),
            Ok(Identity {
                name: "bob".into(),
                operator: false
            })
        );
        h.insert(
            header::COOKIE,
            HeaderValue::from_static("flotilla_console=wrong"),
        );
        assert_eq!(identify(&o, &h), Err(Refusal::Unauthenticated));
    }

    #[test]
    fn the_proxy_header_is_read_only_when_configured() {
        let mut o = with_tokens();
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-user", HeaderValue::from_static("alice"));
        assert_eq!(identify(&o, &h), Err(Refusal::Unauthenticated));
        o.identity_header = Some("X-Forwarded-User".into());
        assert_eq!(identify(&o, &h).map(|i| i.operator), Ok(true));
    }

    #[test]
    fn local_mode_is_the_local_operator() {
        let o = ConsoleOptions::default();
        assert_eq!(
            identify(&o, &HeaderMap::new()),
            Ok(Identity {
                name: "local".into(),
                operator: true
            })
        );
    }

    #[test]
    fn posts_need_the_header_and_the_same_origin() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("127.0.0.1:9480"));
        assert_eq!(same_site(&h), Err(Refusal::CrossSite));
        h.insert(CSRF_HEADER, HeaderValue::from_static("1"));
        assert_eq!(same_site(&h), Ok(()));
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://127.0.0.1:9480"),
        );
        assert_eq!(same_site(&h), Ok(()));
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("https://evil.test"),
        );
        assert_eq!(same_site(&h), Err(Refusal::CrossSite));
    }
}
