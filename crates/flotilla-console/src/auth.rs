//! Who is asking, and may they act: identity from a proxy header, a token or the local
//! default ([`ConsoleOptions`]); the operator role; and the CSRF check of every POST.
//!
//! Before any route, [`admit`] sees every request: the proxy identity header is dropped
//! unless the connection comes from one of `trusted-proxies`, and in local mode a request
//! not addressed to `localhost` or a loopback address is refused — a page of another site
//! whose name was re-pointed at 127.0.0.1 (DNS rebinding) is same-origin with itself, so
//! its requests pass the checks below, but they carry its name in `Host`.
//!
//! A POST must carry `X-Flotilla-Console: 1` — a custom header a cross-site form cannot set
//! and a cross-site script cannot send without a CORS preflight, which the console never
//! grants — and, when the browser sends `Origin`, come from the console's own origin.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use http::{HeaderMap, StatusCode, Uri, header};
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
    /// In local mode, a request addressed to a name other than `localhost` or a loopback
    /// address (403): a DNS-rebinding page.
    BadHost,
}

impl Refusal {
    pub(crate) fn status(self) -> StatusCode {
        match self {
            Self::Unauthenticated => StatusCode::UNAUTHORIZED,
            Self::NotOperator | Self::CrossSite | Self::BadHost => StatusCode::FORBIDDEN,
        }
    }

    pub(crate) fn code(self) -> &'static str {
        match self {
            Self::Unauthenticated => "unauthenticated",
            Self::NotOperator => "not_operator",
            Self::CrossSite => "cross_site",
            Self::BadHost => "bad_host",
        }
    }

    pub(crate) fn message(self) -> &'static str {
        match self {
            Self::Unauthenticated => {
                "sign in: open the console with ?token=YOUR_TOKEN, or through the proxy"
            }
            Self::NotOperator => "only identities with the operator role may do this",
            Self::CrossSite => "refused: the request did not come from the console's page",
            Self::BadHost => {
                "refused: without tokens or a proxy identity the console answers only requests addressed to localhost or a loopback address (open http://127.0.0.1:PORT/)"
            }
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

/// What [`admit`] did with a request it let through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admitted {
    /// Nothing to change.
    AsIs,
    /// The proxy identity header came from a peer not in `trusted-proxies`: dropped.
    DroppedIdentity,
}

/// The check of every request, before its route: in local mode, the `Host` it was sent to
/// (and the request target's authority, if any) must be `localhost` or a loopback address;
/// with `identity-header`, the header is removed from `headers` unless `peer` (the TCP peer;
/// `None`: unknown) is a trusted proxy, so [`identify`] never reads it from anyone else.
pub(crate) fn admit(
    opts: &ConsoleOptions,
    peer: Option<IpAddr>,
    uri: &Uri,
    headers: &mut HeaderMap,
) -> Result<Admitted, Refusal> {
    if opts.is_local() {
        let host = headers
            .get(header::HOST)
            .map(|h| h.to_str().unwrap_or_default());
        let target = uri.authority().map(|a| a.as_str());
        let loopback = (host.is_some() || target.is_some())
            && host.is_none_or(is_loopback_authority)
            && target.is_none_or(is_loopback_authority);
        if !loopback {
            return Err(Refusal::BadHost);
        }
    }
    if let Some(h) = &opts.identity_header
        && !peer.is_some_and(|p| opts.trusts(p))
        // Every value of a repeated header goes.
        && headers.remove(h.as_str()).is_some()
    {
        return Ok(Admitted::DroppedIdentity);
    }
    Ok(Admitted::AsIs)
}

/// `localhost`, `127.x.y.z` or `[::1]`, with or without a port.
fn is_loopback_authority(authority: &str) -> bool {
    let host = if let Some(rest) = authority.strip_prefix('[') {
        // `[v6]` or `[v6]:port`.
        let Some((v6, after)) = rest.split_once(']') else {
            return false;
        };
        if !(after.is_empty() || after.strip_prefix(':').is_some_and(is_port)) {
            return false;
        }
        return v6
            .parse::<Ipv6Addr>()
            .is_ok_and(|a| IpAddr::V6(a).to_canonical().is_loopback());
    } else {
        match authority.split_once(':') {
            Some((host, port)) if is_port(port) => host,
            Some(_) => return false,
            None => authority,
        }
    };
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<Ipv4Addr>().is_ok_and(|a| a.is_loopback())
}

fn is_port(p: &str) -> bool {
    !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit())
}

/// Who sent `headers`, with their role. The proxy header is read as is: [`admit`] has
/// removed it from requests that did not come through a trusted proxy.
pub(crate) fn identify(opts: &ConsoleOptions, headers: &HeaderMap) -> Result<Identity, Refusal> {
    // Administrators act everywhere: they are operators of every tenant they see.
    let operator =
        |name: &str| opts.operators.iter().any(|o| o == name) || opts.is_administrator(name);
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
    fn administrators_are_operators() {
        let mut o = with_tokens();
        o.tokens
            .insert("root".into(), "root-token-0123456789".into());
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer root-token-0123456789"),
        );
        assert_eq!(identify(&o, &h).map(|i| i.operator), Ok(false));
        o.administrators = vec!["root".into()];
        assert_eq!(identify(&o, &h).map(|i| i.operator), Ok(true));
    }

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().expect("an address"))
    }

    /// `headers` as they reach the routes from `peer` (or the refusal).
    fn admitted(
        o: &ConsoleOptions,
        peer: Option<IpAddr>,
        headers: &HeaderMap,
    ) -> Result<Identity, Refusal> {
        let mut h = headers.clone();
        admit(o, peer, &Uri::from_static("/"), &mut h)?;
        identify(o, &h)
    }

    #[test]
    fn the_proxy_header_is_read_only_when_configured() {
        let mut o = with_tokens();
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-user", HeaderValue::from_static("alice"));
        assert_eq!(
            admitted(&o, ip("10.0.0.1"), &h),
            Err(Refusal::Unauthenticated)
        );
        o.identity_header = Some("X-Forwarded-User".into());
        o.trusted_proxies = vec!["10.0.0.0/8".parse().expect("a network")];
        assert_eq!(
            admitted(&o, ip("10.0.0.1"), &h).map(|i| i.operator),
            Ok(true)
        );
    }

    #[test]
    fn the_proxy_header_is_read_only_from_trusted_proxies() {
        let mut o = with_tokens();
        o.identity_header = Some("X-Forwarded-User".into());
        o.trusted_proxies = vec![
            "10.0.0.0/8".parse().expect("a network"),
            "127.0.0.1".parse().expect("an address"),
        ];
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-user", HeaderValue::from_static("alice"));
        h.append("x-forwarded-user", HeaderValue::from_static("alice"));
        let alice = Ok(Identity {
            name: "alice".into(),
            operator: true,
        });
        // Through the proxy (an IPv4 peer on an IPv6 socket too): the header names her.
        for peer in ["10.1.2.3", "127.0.0.1", "::ffff:10.1.2.3"] {
            assert_eq!(admitted(&o, ip(peer), &h), alice, "{peer}");
        }
        // Around it: the header is dropped, whoever it names.
        let mut dropped = h.clone();
        assert_eq!(
            admit(&o, ip("192.168.1.5"), &Uri::from_static("/"), &mut dropped),
            Ok(Admitted::DroppedIdentity)
        );
        assert!(dropped.get("x-forwarded-user").is_none(), "every value");
        for peer in [ip("192.168.1.5"), ip("127.0.0.2"), ip("::1"), None] {
            assert_eq!(
                admitted(&o, peer, &h),
                Err(Refusal::Unauthenticated),
                "{peer:?}"
            );
        }
        // A token still signs in from anywhere; the header does not override it there.
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer bob-token-0123456789"),
        );
        assert_eq!(
            admitted(&o, ip("192.168.1.5"), &h).map(|i| i.name),
            Ok("bob".into())
        );
        // Only the proxy header: without it, nobody.
        o.tokens.clear();
        h.remove(header::AUTHORIZATION);
        assert_eq!(
            admitted(&o, ip("192.168.1.5"), &h),
            Err(Refusal::Unauthenticated)
        );
        assert_eq!(admitted(&o, ip("10.9.9.9"), &h), alice);
    }

    #[test]
    fn local_mode_answers_only_requests_addressed_to_loopback() {
        let o = ConsoleOptions::default();
        let at = |host: Option<&'static str>, uri: &'static str| {
            let mut h = HeaderMap::new();
            if let Some(host) = host {
                h.insert(header::HOST, HeaderValue::from_static(host));
            }
            admit(&o, ip("127.0.0.1"), &Uri::from_static(uri), &mut h)
        };
        for good in [
            "127.0.0.1:9480",
            "127.0.0.1",
            "127.1.2.3:80",
            "localhost",
            "LocalHost:9480",
            "[::1]:9480",
            "[::1]",
        ] {
            assert_eq!(at(Some(good), "/"), Ok(Admitted::AsIs), "{good}");
        }
        for bad in [
            "evil.test:9480",
            "evil.test",
            "127.0.0.1.evil.test:9480",
            "localhost.evil.test",
            "0.0.0.0:9480",
            "10.0.0.1:9480",
            "[::2]:9480",
            "[::1]x",
            "::1",
            "127.0.0.1:port",
            "localhost:",
            "",
        ] {
            assert_eq!(at(Some(bad), "/"), Err(Refusal::BadHost), "{bad:?}");
        }
        // No name at all, or a rebinding name in the request target.
        assert_eq!(at(None, "/"), Err(Refusal::BadHost));
        assert_eq!(
            at(Some("127.0.0.1:9480"), "http://evil.test:9480/api/runs"),
            Err(Refusal::BadHost)
        );
        assert_eq!(
            at(None, "http://127.0.0.1:9480/api/runs"),
            Ok(Admitted::AsIs)
        );
        // With identities, the name does not matter (a token or the proxy decides).
        let mut h = HeaderMap::new();
        h.insert(
            header::HOST,
            HeaderValue::from_static("flotilla.example.com"),
        );
        assert_eq!(
            admit(
                &with_tokens(),
                ip("10.0.0.1"),
                &Uri::from_static("/"),
                &mut h
            ),
            Ok(Admitted::AsIs)
        );
        assert_eq!(Refusal::BadHost.status(), StatusCode::FORBIDDEN);
        assert_eq!(Refusal::BadHost.code(), "bad_host");
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
