//! How an exec agent reaches NATS: the worker's server URLs and credentials as environment
//! variables, which the `flotilla` CLI reads when it runs inside the agent.
//!
//! Secrets travel in the child's environment (readable by the agent's own user only); an
//! installation that wants agents to hold narrower rights gives workers credentials meant for
//! their agents.

use std::path::{Path, PathBuf};

use flotilla_bus::{NatsAuth, NatsOptions, Secret, TlsOptions};

use crate::error::{ContextError, ErrorKind};
use crate::scope::{
    ENV_NATS_CREDS, ENV_NATS_NKEY, ENV_NATS_PASSWORD, ENV_NATS_TOKEN, ENV_NATS_URL, ENV_NATS_USER,
    ENV_PREFIX,
};

/// TLS settings, as the CLI's configuration variables (`[nats.tls]`).
pub const ENV_NATS_TLS_REQUIRED: &str = "FLOTILLA_NATS__TLS__REQUIRED";
/// CA bundle (`nats.tls.ca`).
pub const ENV_NATS_TLS_CA: &str = "FLOTILLA_NATS__TLS__CA";
/// Client certificate (`nats.tls.cert`).
pub const ENV_NATS_TLS_CERT: &str = "FLOTILLA_NATS__TLS__CERT";
/// Client key (`nats.tls.key`).
pub const ENV_NATS_TLS_KEY: &str = "FLOTILLA_NATS__TLS__KEY";
/// The inbox prefix of a tenant's connection (`nats.inbox-prefix`): its users may read
/// only replies under it.
pub const ENV_NATS_INBOX_PREFIX: &str = "FLOTILLA_NATS__INBOX_PREFIX";

/// The variables that let a child process connect as `opts` does: `FLOTILLA_NATS_URL`, the
/// credentials of the configured authentication (`FLOTILLA_NATS_USER` and
/// `FLOTILLA_NATS_PASSWORD`, `FLOTILLA_NATS_TOKEN`, `FLOTILLA_NATS_CREDS`,
/// `FLOTILLA_NATS_NKEY`) and TLS files. Paths are made absolute, since the child runs in
/// another directory.
pub fn connection_env(opts: &NatsOptions) -> Vec<(&'static str, String)> {
    let mut env = vec![(ENV_NATS_URL, opts.urls.join(","))];
    // A tenant's process hands over what the tenant resolves to (its user, its inboxes).
    let opts = &opts.resolved();
    if let Some(p) = &opts.inbox_prefix {
        env.push((ENV_NATS_INBOX_PREFIX, p.clone()));
    }
    match &opts.auth {
        NatsAuth::None => {}
        NatsAuth::Token { token } => env.push((ENV_NATS_TOKEN, token.expose().to_owned())),
        NatsAuth::UserPassword { user, password } => {
            env.push((ENV_NATS_USER, user.clone()));
            env.push((ENV_NATS_PASSWORD, password.expose().to_owned()));
        }
        NatsAuth::Nkey { seed } => env.push((ENV_NATS_NKEY, seed.expose().to_owned())),
        NatsAuth::CredsFile { path } => env.push((ENV_NATS_CREDS, absolute(path))),
    }
    if let Some(tls) = &opts.tls {
        if tls.required {
            env.push((ENV_NATS_TLS_REQUIRED, "true".to_owned()));
        }
        for (name, path) in [
            (ENV_NATS_TLS_CA, &tls.ca),
            (ENV_NATS_TLS_CERT, &tls.cert),
            (ENV_NATS_TLS_KEY, &tls.key),
        ] {
            if let Some(p) = path {
                env.push((name, absolute(p)));
            }
        }
    }
    env
}

/// The connection an exec agent's environment describes: the inverse of [`connection_env`],
/// what the `flotilla` CLI uses inside an agent. `None` when `FLOTILLA_NATS_URL` is not set
/// (not inside an agent). Everything not carried by the variables keeps its default; the
/// prefix comes from `FLOTILLA_PREFIX`.
pub fn connection_from_env() -> Result<Option<NatsOptions>, ContextError> {
    connection_from_vars(|name| std::env::var(name).ok())
}

/// [`connection_from_env`] over any variable lookup. Credentials of more than one kind, or a
/// user without a password, are `invalid_scope`: the worker sets exactly one kind.
pub fn connection_from_vars(
    var: impl Fn(&str) -> Option<String>,
) -> Result<Option<NatsOptions>, ContextError> {
    let get = |name: &str| var(name).filter(|v| !v.trim().is_empty());
    let Some(urls) = get(ENV_NATS_URL) else {
        return Ok(None);
    };
    let invalid = |message: String| ContextError::new(ErrorKind::InvalidScope, message);
    let mut opts = NatsOptions {
        urls: urls
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_owned)
            .collect(),
        ..NatsOptions::default()
    };
    if let Some(prefix) = get(ENV_PREFIX) {
        opts.prefix = prefix.trim().to_owned();
    }
    opts.inbox_prefix = get(ENV_NATS_INBOX_PREFIX).map(|p| p.trim().to_owned());
    let (user, password) = (get(ENV_NATS_USER), get(ENV_NATS_PASSWORD));
    let mut kinds = Vec::new();
    if let Some(token) = get(ENV_NATS_TOKEN) {
        kinds.push((
            ENV_NATS_TOKEN,
            NatsAuth::Token {
                token: Secret::new(token),
            },
        ));
    }
    match (user, password) {
        (Some(user), Some(password)) => kinds.push((
            ENV_NATS_USER,
            NatsAuth::UserPassword {
                user,
                password: Secret::new(password),
            },
        )),
        (None, None) => {}
        _ => {
            return Err(invalid(format!(
                "{ENV_NATS_USER} and {ENV_NATS_PASSWORD} must be set together"
            )));
        }
    }
    if let Some(seed) = get(ENV_NATS_NKEY) {
        kinds.push((
            ENV_NATS_NKEY,
            NatsAuth::Nkey {
                seed: Secret::new(seed),
            },
        ));
    }
    if let Some(path) = get(ENV_NATS_CREDS) {
        kinds.push((
            ENV_NATS_CREDS,
            NatsAuth::CredsFile {
                path: PathBuf::from(path),
            },
        ));
    }
    if kinds.len() > 1 {
        let names: Vec<&str> = kinds.iter().map(|(n, _)| *n).collect();
        return Err(invalid(format!(
            "credentials of more than one kind are set ({}); set one",
            names.join(", ")
        )));
    }
    if let Some((_, auth)) = kinds.pop() {
        opts.auth = auth;
    }
    let required = match get(ENV_NATS_TLS_REQUIRED).as_deref().map(str::trim) {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return Err(invalid(format!(
                "{ENV_NATS_TLS_REQUIRED}={other:?}: expected true or false"
            )));
        }
    };
    let tls = TlsOptions {
        required,
        ca: get(ENV_NATS_TLS_CA).map(PathBuf::from),
        cert: get(ENV_NATS_TLS_CERT).map(PathBuf::from),
        key: get(ENV_NATS_TLS_KEY).map(PathBuf::from),
    };
    if tls != TlsOptions::default() {
        opts.tls = Some(tls);
    }
    opts.validate()
        .map_err(|e| invalid(format!("the NATS connection of the environment: {e}")))?;
    Ok(Some(opts))
}

fn absolute(path: &Path) -> String {
    std::path::absolute(path)
        .unwrap_or_else(|_| path.to_path_buf())
        .to_string_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use flotilla_bus::Secret;

    use super::*;

    #[test]
    fn credentials_follow_the_auth_kind() {
        let mut opts = NatsOptions::with_url("nats://a:4222");
        opts.urls.push("nats://b:4222".into());
        opts.auth = NatsAuth::UserPassword {
            user: "svc".into(),
            password: Secret::new("pw"),
        };
        let env = connection_env(&opts);
        assert_eq!(
            env,
            vec![
                (ENV_NATS_URL, "nats://a:4222,nats://b:4222".to_string()),
                (ENV_NATS_USER, "svc".to_string()),
                (ENV_NATS_PASSWORD, "pw".to_string()),
            ]
        );
        opts.auth = NatsAuth::CredsFile {
            path: "agent.creds".into(),
        };
        let env = connection_env(&opts);
        assert!(env[1].1.ends_with("/agent.creds") && env[1].1.starts_with('/'));
    }

    fn lookup(env: Vec<(&'static str, String)>) -> impl Fn(&str) -> Option<String> {
        let map: std::collections::HashMap<&str, String> = env.into_iter().collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn the_environment_gives_back_the_connection() {
        assert_eq!(connection_from_vars(|_| None).expect("unset"), None);
        let mut opts = NatsOptions::with_url("nats://a:4222");
        opts.urls.push("nats://b:4222".into());
        for auth in [
            NatsAuth::None,
            NatsAuth::Token {
                token: Secret::new("t"),
            },
            NatsAuth::UserPassword {
                user: "svc".into(),
                password: Secret::new("pw"),
            },
            NatsAuth::Nkey {
                seed: Secret::new("SUAB"),
            },
            NatsAuth::CredsFile {
                path: "/etc/agent.creds".into(),
            },
        ] {
            opts.auth = auth;
            let back = connection_from_vars(lookup(connection_env(&opts)))
                .expect("valid")
                .expect("set");
            assert_eq!(back, opts);
        }
        opts.tls = Some(TlsOptions {
            required: true,
            ca: Some("/etc/ca.pem".into()),
            cert: None,
            key: None,
        });
        let mut env = connection_env(&opts);
        env.push((ENV_PREFIX, "acme".into()));
        let back = connection_from_vars(lookup(env))
            .expect("valid")
            .expect("set");
        assert_eq!(back.tls, opts.tls);
        assert_eq!(back.prefix, "acme");
    }

    #[test]
    fn contradictory_credentials_are_refused() {
        let with = |extra: Vec<(&'static str, &str)>| {
            let mut env = vec![(ENV_NATS_URL, "nats://a:4222".to_string())];
            env.extend(extra.into_iter().map(|(k, v)| (k, v.to_string())));
            connection_from_vars(lookup(env))
        };
        let err = with(vec![(ENV_NATS_USER, "u")]).expect_err("no password");
        assert_eq!(err.code(), "invalid_scope");
        let err = with(vec![(ENV_NATS_TOKEN, "t"), (ENV_NATS_NKEY, "SU")]).expect_err("two");
        assert!(err.message().contains(ENV_NATS_NKEY), "{err}");
        let err = with(vec![(ENV_NATS_TLS_REQUIRED, "yes")]).expect_err("bad bool");
        assert!(err.message().contains("yes"), "{err}");
        let err = with(vec![(ENV_PREFIX, "a.b")]).expect_err("bad prefix");
        assert_eq!(err.code(), "invalid_scope");
    }
}
