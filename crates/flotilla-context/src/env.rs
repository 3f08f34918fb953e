//! How an exec agent reaches NATS: the worker's server URLs and credentials as environment
//! variables, which the `flotilla` CLI reads when it runs inside the agent.
//!
//! Secrets travel in the child's environment (readable by the agent's own user only); an
//! installation that wants agents to hold narrower rights gives workers credentials meant for
//! their agents.

use std::path::Path;

use flotilla_bus::{NatsAuth, NatsOptions};

use crate::scope::{
    ENV_NATS_CREDS, ENV_NATS_NKEY, ENV_NATS_PASSWORD, ENV_NATS_TOKEN, ENV_NATS_URL, ENV_NATS_USER,
};

/// TLS settings, as the CLI's configuration variables (`[nats.tls]`).
pub const ENV_NATS_TLS_REQUIRED: &str = "FLOTILLA_NATS__TLS__REQUIRED";
/// CA bundle (`nats.tls.ca`).
pub const ENV_NATS_TLS_CA: &str = "FLOTILLA_NATS__TLS__CA";
/// Client certificate (`nats.tls.cert`).
pub const ENV_NATS_TLS_CERT: &str = "FLOTILLA_NATS__TLS__CERT";
/// Client key (`nats.tls.key`).
pub const ENV_NATS_TLS_KEY: &str = "FLOTILLA_NATS__TLS__KEY";

/// The variables that let a child process connect as `opts` does: `FLOTILLA_NATS_URL`, the
/// credentials of the configured authentication (`FLOTILLA_NATS_USER` and
/// `FLOTILLA_NATS_PASSWORD`, `FLOTILLA_NATS_TOKEN`, `FLOTILLA_NATS_CREDS`,
/// `FLOTILLA_NATS_NKEY`) and TLS files. Paths are made absolute, since the child runs in
/// another directory.
pub fn connection_env(opts: &NatsOptions) -> Vec<(&'static str, String)> {
    let mut env = vec![(ENV_NATS_URL, opts.urls.join(","))];
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
}
