//! What the permission tests (`permissions.rs`, `permissions_services.rs`) share: the users
//! of the shipped `deploy/nats/accounts.conf`, a server started with it, one role's
//! connection with the permission violations the server reported on it, and the agents and
//! consumers the tests configure.

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, anyhow, bail, ensure};
use async_nats::jetstream::{self, consumer};
use async_nats::{Event, ServerError};
use flotilla_model::Names;
use flotilla_testkit::NatsServer;
use tokio::sync::mpsc;

use crate::support;

/// Users and development passwords of `deploy/nats/accounts.conf`.
pub(crate) const OPERATOR: (&str, &str) = ("operator", "operator-dev-password");
pub(crate) const COORDINATOR: (&str, &str) = ("coordinator", "coordinator-dev-password");
pub(crate) const WORKER: (&str, &str) = ("worker-default", "worker-default-dev-password");
pub(crate) const CLIENT: (&str, &str) = ("client", "client-dev-password");
pub(crate) const SUPERVISOR: (&str, &str) = ("supervisor", "supervisor-dev-password");
pub(crate) const CONSOLE: (&str, &str) = ("console", "console-dev-password");

/// Timeout of JetStream calls that are expected to be refused (they get no answer).
const REFUSED_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a refusal may take to be reported by the server.
const VIOLATION_WAIT: Duration = Duration::from_secs(10);

fn accounts_conf() -> PathBuf {
    support::root().join("deploy/nats/accounts.conf")
}

/// A server with the shipped accounts; the kit's own clients connect as the operator.
pub(crate) async fn server() -> anyhow::Result<NatsServer> {
    Ok(NatsServer::builder()
        .config_file(accounts_conf())
        .connect_as(OPERATOR.0, OPERATOR.1)
        .start()
        .await?)
}

/// `operator` puts `value` at `key` in `bucket`, and `watch` — opened beforehand on another
/// role's connection — must see it within 10 s.
pub(crate) async fn watch_sees_put(
    mut watch: jetstream::kv::Watch,
    operator: &Role,
    bucket: &str,
    key: &str,
    value: &'static str,
) -> anyhow::Result<()> {
    use futures::StreamExt;
    operator
        .js
        .get_key_value(bucket)
        .await?
        .put(key, value.into())
        .await?;
    let seen = tokio::time::timeout(Duration::from_secs(10), watch.next())
        .await
        .with_context(|| format!("the {bucket} watch saw nothing"))?
        .context("watch ended")??;
    ensure!(seen.key == key, "{bucket}: {seen:?}");
    Ok(())
}

/// One role's connection, with the permission violations the server reported on it.
pub(crate) struct Role {
    pub(crate) user: &'static str,
    pub(crate) client: async_nats::Client,
    /// JetStream with the normal timeout, for allowed operations.
    pub(crate) js: jetstream::Context,
    /// JetStream with a short timeout, for operations that must fail.
    pub(crate) js_refused: jetstream::Context,
    pub(crate) violations: mpsc::UnboundedReceiver<String>,
}

impl Role {
    pub(crate) async fn connect(
        server: &NatsServer,
        (user, password): (&'static str, &str),
    ) -> anyhow::Result<Self> {
        Self::connect_with_inbox(server, (user, password), "_INBOX").await
    }

    /// [`Role::connect`] with replies under `inbox` (a tenant's `_INBOX_<tenant>`, a
    /// person's `_INBOX_<name>`).
    pub(crate) async fn connect_with_inbox(
        server: &NatsServer,
        (user, password): (&'static str, &str),
        inbox: &str,
    ) -> anyhow::Result<Self> {
        let (tx, violations) = mpsc::unbounded_channel();
        let client =
            async_nats::ConnectOptions::with_user_and_password(user.into(), password.into())
                .custom_inbox_prefix(inbox)
                .event_callback(move |event| {
                    let tx = tx.clone();
                    async move {
                        if let Event::ServerError(ServerError::Other(e)) = event
                            && e.to_lowercase().contains("permissions violation")
                        {
                            let _ = tx.send(e);
                        }
                    }
                })
                .connect(server.url())
                .await
                .with_context(|| format!("connecting as {user}"))?;
        let js = jetstream::new(client.clone());
        let mut js_refused = jetstream::new(client.clone());
        js_refused.set_timeout(REFUSED_TIMEOUT);
        Ok(Self {
            user,
            client,
            js,
            js_refused,
            violations,
        })
    }

    /// Waits until the server reports a permission violation for `subject` on this
    /// connection. Any other violation first is an error: it means an unexpected refusal.
    pub(crate) async fn refused(&mut self, subject: &str) -> anyhow::Result<()> {
        let needle = format!("\"{subject}\"");
        let deadline = tokio::time::Instant::now() + VIOLATION_WAIT;
        let report = tokio::time::timeout_at(deadline, self.violations.recv())
            .await
            .map_err(|_| anyhow!("{}: the server did not refuse {subject}", self.user))?
            .ok_or_else(|| anyhow!("{}: connection closed", self.user))?;
        ensure!(
            report.contains(&needle),
            "{}: expected a refusal of {subject}, got: {report}",
            self.user
        );
        Ok(())
    }

    /// A core publish that the server must refuse.
    pub(crate) async fn publish_refused(&mut self, subject: &str) -> anyhow::Result<()> {
        self.client
            .publish(subject.to_owned(), "forbidden".into())
            .await?;
        self.client.flush().await?;
        self.refused(subject).await
    }

    /// A request that the server must refuse although `subject` has a responder: no answer.
    pub(crate) async fn request_refused(&mut self, subject: &str) -> anyhow::Result<()> {
        let answer = tokio::time::timeout(
            REFUSED_TIMEOUT,
            self.client.request(subject.to_owned(), "{}".into()),
        )
        .await;
        ensure!(
            !matches!(answer, Ok(Ok(_))),
            "{}: a request to {subject} was answered",
            self.user
        );
        self.refused(subject).await
    }

    /// A core subscription that the server must refuse.
    pub(crate) async fn subscribe_refused(&mut self, subject: &str) -> anyhow::Result<()> {
        let _sub = self.client.subscribe(subject.to_owned()).await?;
        self.client.flush().await?;
        self.refused(subject).await
    }

    /// Fails if the server refused anything on this connection so far.
    pub(crate) async fn no_violations(&mut self) -> anyhow::Result<()> {
        // A round trip first: every -ERR for earlier commands has been read by then.
        self.client.flush().await?;
        if let Ok(v) = self.violations.try_recv() {
            bail!("{} was refused something it needs: {v}", self.user);
        }
        Ok(())
    }
}

pub(crate) async fn messages_in(js: &jetstream::Context, stream: &str) -> anyhow::Result<u64> {
    Ok(js.get_stream(stream).await?.info().await?.state.messages)
}

pub(crate) fn names() -> Names {
    Names::default()
}

/// The pool consumer exactly as `flotilla_bus::Bus::shared_consumer` creates it (the same
/// JetStream API subject: durable name and filter in the subject).
pub(crate) fn pool_consumer(pool: &str) -> consumer::pull::Config {
    consumer::pull::Config {
        durable_name: Some(names().pool_consumer(pool)),
        filter_subject: names().pool_filter(pool),
        ack_policy: consumer::AckPolicy::Explicit,
        max_deliver: -1,
        ..Default::default()
    }
}

/// `FLOTILLA_NATS__AUTH__*`: how the Helm chart hands credentials to a pod.
pub(crate) fn credentials_env((user, password): (&str, &str)) -> Vec<(&'static str, String)> {
    vec![
        ("FLOTILLA_NATS__AUTH__KIND", "user-password".to_owned()),
        ("FLOTILLA_NATS__AUTH__USER", user.to_owned()),
        ("FLOTILLA_NATS__AUTH__PASSWORD", password.to_owned()),
    ]
}

pub(crate) const AGENTS: &str = r#"
default-agent = "echo"
[agents.echo]
kind = "scripted"
reply = "{task_id} done"
[agents.long]
kind = "scripted"
delay = "60s"
[agents.caller]
kind = "exec"
command = "sh"
args = ["-c", "\"$FLOTILLA_BIN\" call echo --description lookup"]
[agents.researcher]
kind = "scripted"
reply = "{task_id} researched"
roles = ["research"]
"#;

/// `(name, value)` pairs borrowed for `Command::envs`.
pub(crate) fn refs<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// `flotilla <args>` as the platform's operator (its NATS user), without the `FLOTILLA_*`
/// variables of the test's environment, to the end.
pub(crate) fn operator_cli(
    p: &support::Processes,
    args: &[&str],
) -> anyhow::Result<std::process::Output> {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"));
    for (k, _) in std::env::vars() {
        if k.starts_with("FLOTILLA_") {
            cmd.env_remove(k);
        }
    }
    Ok(cmd
        .arg("--config")
        .arg(&p.config)
        .args(args)
        .envs(credentials_env(OPERATOR))
        .current_dir(p.dir())
        .stdin(std::process::Stdio::null())
        .output()?)
}
