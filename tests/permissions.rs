//! Least privilege, proven on a real nats-server running the shipped
//! `deploy/nats/accounts.conf`: each role (operator, coordinator, worker of pool `default`,
//! client, supervisor) can do its job, and is refused outside it.
//!
//! A refusal is proven three ways: the server reports a permission violation naming the
//! subject on that role's connection (collected from the connection's events, waited for,
//! never slept on); the operation itself fails; and the operator sees that nothing changed.
//! Every allowed step ends by checking that the role's connection saw no violation at all, so
//! an over-tight permission fails the test too. The last test runs a real plan with the
//! `flotilla` binary, coordinator, worker, supervisor and client each connecting with its own
//! credentials; the supervisor's roster and failure records answer the client.

mod support;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, anyhow, bail, ensure};
use async_nats::jetstream::{self, consumer, stream};
use async_nats::{Event, ServerError};
use flotilla_bus::provision::{Action, provision};
use flotilla_bus::{Bus, JetStreamOptions, NatsAuth, NatsOptions, Secret};
use flotilla_model::Names;
use flotilla_model::subjects::StreamKind;
use flotilla_model::team::{RecordScope, TeamListRequest, TeamStatsRequest};
use flotilla_testkit::NatsServer;
use futures::StreamExt;
use tokio::sync::mpsc;

/// Users and development passwords of `deploy/nats/accounts.conf`.
const OPERATOR: (&str, &str) = ("operator", "operator-dev-password");
const COORDINATOR: (&str, &str) = ("coordinator", "coordinator-dev-password");
const WORKER: (&str, &str) = ("worker-default", "worker-default-dev-password");
const CLIENT: (&str, &str) = ("client", "client-dev-password");
const SUPERVISOR: (&str, &str) = ("supervisor", "supervisor-dev-password");
const CONSOLE: (&str, &str) = ("console", "console-dev-password");

/// Timeout of JetStream calls that are expected to be refused (they get no answer).
const REFUSED_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a refusal may take to be reported by the server.
const VIOLATION_WAIT: Duration = Duration::from_secs(10);

fn accounts_conf() -> PathBuf {
    support::root().join("deploy/nats/accounts.conf")
}

/// A server with the shipped accounts; the kit's own clients connect as the operator.
async fn server() -> anyhow::Result<NatsServer> {
    Ok(NatsServer::builder()
        .config_file(accounts_conf())
        .connect_as(OPERATOR.0, OPERATOR.1)
        .start()
        .await?)
}

/// One role's connection, with the permission violations the server reported on it.
struct Role {
    user: &'static str,
    client: async_nats::Client,
    /// JetStream with the normal timeout, for allowed operations.
    js: jetstream::Context,
    /// JetStream with a short timeout, for operations that must fail.
    js_refused: jetstream::Context,
    violations: mpsc::UnboundedReceiver<String>,
}

impl Role {
    async fn connect(
        server: &NatsServer,
        (user, password): (&'static str, &str),
    ) -> anyhow::Result<Self> {
        let (tx, violations) = mpsc::unbounded_channel();
        let client =
            async_nats::ConnectOptions::with_user_and_password(user.into(), password.into())
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
    async fn refused(&mut self, subject: &str) -> anyhow::Result<()> {
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
    async fn publish_refused(&mut self, subject: &str) -> anyhow::Result<()> {
        self.client
            .publish(subject.to_owned(), "forbidden".into())
            .await?;
        self.client.flush().await?;
        self.refused(subject).await
    }

    /// A request that the server must refuse although `subject` has a responder: no answer.
    async fn request_refused(&mut self, subject: &str) -> anyhow::Result<()> {
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
    async fn subscribe_refused(&mut self, subject: &str) -> anyhow::Result<()> {
        let _sub = self.client.subscribe(subject.to_owned()).await?;
        self.client.flush().await?;
        self.refused(subject).await
    }

    /// Fails if the server refused anything on this connection so far.
    async fn no_violations(&mut self) -> anyhow::Result<()> {
        // A round trip first: every -ERR for earlier commands has been read by then.
        self.client.flush().await?;
        if let Ok(v) = self.violations.try_recv() {
            bail!("{} was refused something it needs: {v}", self.user);
        }
        Ok(())
    }
}

async fn messages_in(js: &jetstream::Context, stream: &str) -> anyhow::Result<u64> {
    Ok(js.get_stream(stream).await?.info().await?.state.messages)
}

fn names() -> Names {
    Names::default()
}

/// A subject matched by a stream's subject filter (wildcards filled in).
fn concrete(filter: &str) -> String {
    filter
        .split('.')
        .enumerate()
        .map(|(i, t)| match t {
            "*" | ">" => format!("t{i}"),
            t => t.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(".")
}

/// The pool consumer exactly as `flotilla_bus::Bus::shared_consumer` creates it (the same
/// JetStream API subject: durable name and filter in the subject).
fn pool_consumer(pool: &str) -> consumer::pull::Config {
    consumer::pull::Config {
        durable_name: Some(names().pool_consumer(pool)),
        filter_subject: names().pool_filter(pool),
        ack_policy: consumer::AckPolicy::Explicit,
        max_deliver: -1,
        ..Default::default()
    }
}

/// A role's consumer (anycast tasks), as the workers hosting a member create it.
fn role_consumer(role: &str) -> consumer::pull::Config {
    consumer::pull::Config {
        durable_name: Some(names().role_consumer(role)),
        filter_subject: names().role_filter(role),
        ack_policy: consumer::AckPolicy::Explicit,
        max_deliver: -1,
        ..Default::default()
    }
}

#[tokio::test]
async fn only_the_operator_and_the_coordinator_provision() -> anyhow::Result<()> {
    let server = server().await?;
    let opts = JetStreamOptions::default();

    for who in [WORKER, CLIENT] {
        let mut role = Role::connect(&server, who).await?;
        let err = provision(&role.js_refused, &names(), &opts).await;
        ensure!(err.is_err(), "{} provisioned streams", role.user);
        role.refused("$JS.API.STREAM.CREATE.FLOTILLA_INTAKE")
            .await?;
    }
    let operator = Role::connect(&server, OPERATOR).await?;
    ensure!(
        operator.js.stream_names().count().await == 0,
        "a refused role created something"
    );

    // The coordinator provisions a fresh server at start-up: it may create everything.
    let mut coordinator = Role::connect(&server, COORDINATOR).await?;
    let report = provision(&coordinator.js, &names(), &opts).await?;
    ensure!(
        report.resources.iter().all(|r| r.action == Action::Create),
        "{report}"
    );
    coordinator.no_violations().await?;

    // The operator provisions too (idempotent: unchanged).
    let mut operator = operator;
    let report = provision(&operator.js, &names(), &opts).await?;
    ensure!(
        report
            .resources
            .iter()
            .all(|r| r.action == Action::Unchanged),
        "{report}"
    );
    operator.no_violations().await?;

    // The coordinator creates and updates, but never deletes; it purges only the queued tasks
    // of a cancelled run (FLOTILLA_TASKS), never other streams.
    ensure!(
        coordinator
            .js_refused
            .delete_stream("FLOTILLA_EVENTS")
            .await
            .is_err()
    );
    coordinator
        .refused("$JS.API.STREAM.DELETE.FLOTILLA_EVENTS")
        .await?;
    let events = coordinator.js_refused.get_stream("FLOTILLA_EVENTS").await?;
    ensure!(events.purge().await.is_err());
    coordinator
        .refused("$JS.API.STREAM.PURGE.FLOTILLA_EVENTS")
        .await?;
    ensure!(operator.js.get_stream("FLOTILLA_EVENTS").await.is_ok());
    Ok(())
}

#[tokio::test]
async fn a_worker_works_its_pool_and_nothing_else() -> anyhow::Result<()> {
    let server = server().await?;
    let operator = Role::connect(&server, OPERATOR).await?;
    provision(&operator.js, &names(), &JetStreamOptions::default()).await?;
    let tasks = operator.js.get_stream("FLOTILLA_TASKS").await?;
    // Another pool's consumer, with a task waiting in it.
    tasks.create_consumer(pool_consumer("gpu")).await?;
    for subject in [
        "flotilla.task.default.r1.t1",
        "flotilla.task.gpu.r1.t1",
        "flotilla.role.research.r1.t2",
    ] {
        operator.js.publish(subject, "task".into()).await?.await?;
    }
    // Stand-in API endpoints answered by the operator: a refused request is then a refusal,
    // not a missing responder.
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let mut api = operator.client.subscribe("flotilla.api.>").await?;
    let responder = tokio::spawn({
        let client = operator.client.clone();
        let seen = std::sync::Arc::clone(&seen);
        async move {
            while let Some(m) = api.next().await {
                if let Ok(mut seen) = seen.lock() {
                    seen.push(m.subject.to_string());
                }
                if let Some(reply) = m.reply {
                    let _ = client.publish(reply, "{}".into()).await;
                }
            }
        }
    });
    operator.client.flush().await?;

    let mut worker = Role::connect(&server, WORKER).await?;

    // --- its job ---
    worker.js.query_account().await?;
    // The start-up check is a read-only plan: everything exists, nothing to create.
    let plan =
        flotilla_bus::provision::plan(&worker.js, &names(), &JetStreamOptions::default()).await?;
    ensure!(
        plan.report()
            .resources
            .iter()
            .all(|r| r.action == Action::Unchanged),
        "{}",
        plan.report()
    );
    let stream = worker.js.get_stream("FLOTILLA_TASKS").await?;
    let pool = stream.create_consumer(pool_consumer("default")).await?;
    let mut batch = pool
        .fetch()
        .max_messages(1)
        .expires(Duration::from_secs(5))
        .messages()
        .await?;
    let task = batch
        .next()
        .await
        .context("no task pulled")?
        .map_err(|e| anyhow!("pulling: {e}"))?;
    ensure!(task.subject.as_str() == "flotilla.task.default.r1.t1");
    task.ack_with(jetstream::AckKind::Progress)
        .await
        .map_err(|e| anyhow!("in-progress ack: {e}"))?;
    task.double_ack().await.map_err(|e| anyhow!("ack: {e}"))?;
    // The queue of a role its agents fill (anycast tasks), shared with the role's other
    // members.
    let role = stream.create_consumer(role_consumer("research")).await?;
    let mut batch = role
        .fetch()
        .max_messages(1)
        .expires(Duration::from_secs(5))
        .messages()
        .await?;
    let task = batch
        .next()
        .await
        .context("no role task pulled")?
        .map_err(|e| anyhow!("pulling: {e}"))?;
    ensure!(task.subject.as_str() == "flotilla.role.research.r1.t2");
    task.double_ack().await.map_err(|e| anyhow!("ack: {e}"))?;

    let ack = worker
        .js
        .publish("flotilla.runlog.r1", "result".into())
        .await?
        .await?;
    ensure!(ack.stream == "FLOTILLA_RUNLOG");
    worker
        .js
        .publish("flotilla.event.r1", "event".into())
        .await?
        .await?;
    worker
        .js
        .publish("flotilla.ws.r1.figures", "entry".into())
        .await?
        .await?;
    let ws = worker.js.get_stream("FLOTILLA_WORKSPACE").await?;
    ws.direct_get_last_for_subject("flotilla.ws.r1.figures")
        .await?;
    // The mailbox layout is changing (`<root>.<to>` to `<root>.<to>.<from>`); the permission
    // covers both, so write to whatever the provisioned stream captures.
    let mailbox = concrete(&names().stream_subjects(StreamKind::Mailbox)[0]);
    worker
        .js
        .publish(mailbox.clone(), "hello".into())
        .await?
        .await
        .with_context(|| format!("publishing to {mailbox}"))?;

    let workers = worker.js.get_key_value("flotilla-workers").await?;
    workers.put("worker-1", "{}".into()).await?;
    ensure!(workers.get("worker-1").await?.is_some());
    let state = worker.js.get_key_value("flotilla-state").await?;
    state.put("session1.answer", "42".into()).await?;
    ensure!(state.get("session1.answer").await?.is_some());
    let control = worker.js.get_key_value("flotilla-control").await?;
    ensure!(control.get("r1").await?.is_none());
    let mut watch = control.watch_all().await?;
    operator
        .js
        .get_key_value("flotilla-control")
        .await?
        .put("r1", "pause".into())
        .await?;
    let change = tokio::time::timeout(Duration::from_secs(10), watch.next())
        .await
        .context("the control watch saw nothing")?
        .context("watch ended")??;
    ensure!(change.key == "r1");

    let artifacts = worker.js.get_object_store("flotilla-artifacts").await?;
    artifacts
        .put("r1/report.txt", &mut "a large report".as_bytes())
        .await?;
    let mut object = artifacts.get("r1/report.txt").await?;
    let mut body = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut object, &mut body).await?;
    ensure!(body == b"a large report");

    let answer = worker
        .client
        .request("flotilla.api.run.get", "{}".into())
        .await?;
    ensure!(answer.payload.as_ref() == b"{}");
    worker.no_violations().await?;

    // --- refused ---
    let publish = worker
        .js_refused
        .publish("flotilla.submit", "plan".into())
        .await;
    ensure!(
        match publish {
            Ok(ack) => ack.await.is_err(),
            Err(_) => true,
        },
        "a worker submitted a plan"
    );
    worker.refused("flotilla.submit").await?;
    let fast = format!("flotilla.submit.{}", flotilla_model::RunId::new());
    let publish = worker.js_refused.publish(fast.clone(), "plan".into()).await;
    ensure!(
        match publish {
            Ok(ack) => ack.await.is_err(),
            Err(_) => true,
        },
        "a worker submitted a plan on a run's subject"
    );
    worker.refused(&fast).await?;
    ensure!(messages_in(&operator.js, "FLOTILLA_INTAKE").await? == 0);
    worker.request_refused("flotilla.api.submit").await?;

    let before = messages_in(&operator.js, "FLOTILLA_TASKS").await?;
    worker.publish_refused("flotilla.task.default.x.y").await?;
    worker.publish_refused("flotilla.task.gpu.x.y").await?;
    worker.publish_refused("flotilla.role.research.x.y").await?;
    ensure!(messages_in(&operator.js, "FLOTILLA_TASKS").await? == before);

    ensure!(
        worker
            .js_refused
            .delete_stream("FLOTILLA_TASKS")
            .await
            .is_err()
    );
    worker
        .refused("$JS.API.STREAM.DELETE.FLOTILLA_TASKS")
        .await?;
    let runlog = worker.js_refused.get_stream("FLOTILLA_RUNLOG").await?;
    ensure!(runlog.purge().await.is_err());
    worker
        .refused("$JS.API.STREAM.PURGE.FLOTILLA_RUNLOG")
        .await?;
    ensure!(messages_in(&operator.js, "FLOTILLA_RUNLOG").await? == 1);
    ensure!(
        worker
            .js_refused
            .create_stream(stream::Config {
                name: "ROGUE".into(),
                subjects: vec!["rogue.>".into()],
                ..Default::default()
            })
            .await
            .is_err()
    );
    worker.refused("$JS.API.STREAM.CREATE.ROGUE").await?;

    // Another pool's consumer: neither pulled from nor reconfigured.
    let inbox = worker.client.new_inbox();
    worker
        .client
        .publish_with_reply(
            "$JS.API.CONSUMER.MSG.NEXT.FLOTILLA_TASKS.pool-gpu",
            inbox,
            r#"{"batch":1,"expires":500000000}"#.into(),
        )
        .await?;
    worker.client.flush().await?;
    worker
        .refused("$JS.API.CONSUMER.MSG.NEXT.FLOTILLA_TASKS.pool-gpu")
        .await?;
    let refused_stream = worker.js_refused.get_stream("FLOTILLA_TASKS").await?;
    ensure!(
        refused_stream
            .create_consumer(pool_consumer("gpu"))
            .await
            .is_err(),
        "a worker created another pool's consumer"
    );
    worker
        .refused("$JS.API.CONSUMER.CREATE.FLOTILLA_TASKS.pool-gpu.flotilla.task.gpu.>")
        .await?;
    // Nor the queue of a role its pool hosts no member of.
    ensure!(
        refused_stream
            .create_consumer(role_consumer("editing"))
            .await
            .is_err(),
        "a worker created the consumer of a role it has no permission for"
    );
    worker
        .refused("$JS.API.CONSUMER.CREATE.FLOTILLA_TASKS.role-editing.flotilla.role.editing.>")
        .await?;
    let gpu = operator
        .js
        .get_consumer_from_stream::<consumer::pull::Config, _, _>("pool-gpu", "FLOTILLA_TASKS")
        .await?
        .info()
        .await?
        .clone();
    ensure!(
        gpu.num_pending == 1 && gpu.num_ack_pending == 0,
        "the gpu task was touched: {gpu:?}"
    );

    // Buckets it does not own; subscriptions outside its inbox.
    worker.publish_refused("$KV.flotilla-runs.r1").await?;
    // An agent may not change its own oversight.
    worker.publish_refused("flotilla.api.trust.set").await?;
    worker
        .publish_refused("flotilla.api.trust.incident")
        .await?;
    // Nor answer an approval, nor grant itself a tool for the session.
    worker
        .publish_refused("flotilla.api.approval.answer")
        .await?;
    worker
        .publish_refused("flotilla.api.approval.revoke")
        .await?;
    worker
        .publish_refused("$KV.flotilla-state.s1._grant.send_email")
        .await?;
    worker.publish_refused("$KV.flotilla-control.r1").await?;
    worker.subscribe_refused("flotilla.task.>").await?;
    ensure!(
        operator
            .js
            .get_key_value("flotilla-runs")
            .await?
            .get("r1")
            .await?
            .is_none()
    );

    operator.client.flush().await?;
    responder.abort();
    let seen = seen.lock().map_err(|_| anyhow!("poisoned"))?.clone();
    ensure!(
        seen == ["flotilla.api.run.get"],
        "the API saw requests it should not have: {seen:?}"
    );
    Ok(())
}

#[tokio::test]
async fn a_client_submits_and_reads_but_writes_nothing_else() -> anyhow::Result<()> {
    let server = server().await?;
    let operator = Role::connect(&server, OPERATOR).await?;
    provision(&operator.js, &names(), &JetStreamOptions::default()).await?;
    // The coordinators' shared run-log consumer exists, as in a running installation.
    operator
        .js
        .get_stream("FLOTILLA_RUNLOG")
        .await?
        .create_consumer(consumer::pull::Config {
            durable_name: Some("coordinator".into()),
            filter_subject: names().runlog_all(),
            ack_policy: consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await?;
    operator
        .js
        .publish("flotilla.event.r1", "run_started".into())
        .await?
        .await?;
    operator
        .js
        .publish("flotilla.runlog.r1", "submitted".into())
        .await?
        .await?;
    operator
        .js
        .get_key_value("flotilla-runs")
        .await?
        .put("r1", "record".into())
        .await?;

    let mut client = Role::connect(&server, CLIENT).await?;

    // --- its job ---
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "run.r2");
    let ack = client
        .js
        .publish_with_headers("flotilla.submit", headers, "plan".into())
        .await?
        .await?;
    ensure!(ack.stream == "FLOTILLA_INTAKE");
    ensure!(messages_in(&operator.js, "FLOTILLA_INTAKE").await? == 1);
    // Events, as flotilla_client::Client::events reads them: an ordered consumer.
    let events = client.js.get_stream("FLOTILLA_EVENTS").await?;
    let mut messages = events
        .create_consumer(consumer::pull::OrderedConfig {
            filter_subject: "flotilla.event.r1".into(),
            ..Default::default()
        })
        .await?
        .messages()
        .await?;
    let first = tokio::time::timeout(Duration::from_secs(10), messages.next())
        .await
        .context("no event")?
        .context("events ended")??;
    ensure!(first.payload.as_ref() == b"run_started");
    // Runs, their logs and the live workers.
    let runs = client.js.get_key_value("flotilla-runs").await?;
    ensure!(runs.get("r1").await?.is_some());
    let keys: Vec<String> = runs
        .keys()
        .await?
        .filter_map(|k| async { k.ok() })
        .collect()
        .await;
    ensure!(keys == ["r1"]);
    let runlog = client.js.get_stream("FLOTILLA_RUNLOG").await?;
    runlog
        .direct_get_first_for_subject("flotilla.runlog.r1")
        .await?;
    let workers = client.js.get_key_value("flotilla-workers").await?;
    ensure!(workers.get("nobody").await?.is_none());
    client.no_violations().await?;

    // --- refused ---
    let publish = client
        .js_refused
        .publish("flotilla.runlog.x", "result".into())
        .await;
    ensure!(
        match publish {
            Ok(ack) => ack.await.is_err(),
            Err(_) => true,
        },
        "a client wrote a task result"
    );
    client.refused("flotilla.runlog.x").await?;
    ensure!(messages_in(&operator.js, "FLOTILLA_RUNLOG").await? == 1);
    client.publish_refused("flotilla.task.default.x.y").await?;
    client.publish_refused("flotilla.event.x").await?;
    client.publish_refused("flotilla.ws.x.topic").await?;
    client
        .publish_refused(&concrete(&names().stream_subjects(StreamKind::Mailbox)[0]))
        .await?;
    client.publish_refused("flotilla.timer.x.1").await?;
    client.publish_refused("$KV.flotilla-runs.r1").await?;
    client.publish_refused("$KV.flotilla-workers.w1").await?;
    ensure!(
        messages_in(&operator.js, "FLOTILLA_TASKS").await? == 0
            && messages_in(&operator.js, "FLOTILLA_WORKSPACE").await? == 0
            && messages_in(&operator.js, "FLOTILLA_MAILBOX").await? == 0
    );
    ensure!(
        client
            .js_refused
            .delete_stream("FLOTILLA_INTAKE")
            .await
            .is_err()
    );
    client
        .refused("$JS.API.STREAM.DELETE.FLOTILLA_INTAKE")
        .await?;
    // Neither reconfigure nor drain the coordinators' consumer.
    let refused_runlog = client.js_refused.get_stream("FLOTILLA_RUNLOG").await?;
    ensure!(
        refused_runlog
            .create_consumer(consumer::pull::Config {
                durable_name: Some("coordinator".into()),
                filter_subject: names().runlog_all(),
                ack_wait: Duration::from_secs(3600),
                ..Default::default()
            })
            .await
            .is_err()
    );
    client
        .refused("$JS.API.CONSUMER.CREATE.FLOTILLA_RUNLOG.coordinator.flotilla.runlog.*")
        .await?;
    client
        .publish_refused("$JS.API.CONSUMER.MSG.NEXT.FLOTILLA_RUNLOG.coordinator")
        .await?;
    let info = operator
        .js
        .get_consumer_from_stream::<consumer::pull::Config, _, _>("coordinator", "FLOTILLA_RUNLOG")
        .await?
        .info()
        .await?
        .clone();
    ensure!(
        info.config.ack_wait != Duration::from_secs(3600) && info.num_ack_pending == 0,
        "the coordinators' consumer was touched: {info:?}"
    );
    Ok(())
}

/// The supervisors' consumer of the event stream exactly as `flotilla_bus::Bus::shared_consumer`
/// creates it for `flotilla supervisor` (the same JetStream API subject: durable name and
/// filter in the subject).
fn supervisor_consumer() -> consumer::pull::Config {
    consumer::pull::Config {
        durable_name: Some(flotilla_supervisor::CONSUMER.into()),
        filter_subject: names().event_all(),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: Duration::from_secs(30),
        max_deliver: -1,
        ..Default::default()
    }
}

/// Pulls the next message of `consumer` (within 5 s).
async fn pull_one(
    consumer: &consumer::Consumer<consumer::pull::Config>,
) -> anyhow::Result<jetstream::Message> {
    let mut batch = consumer
        .fetch()
        .max_messages(1)
        .expires(Duration::from_secs(5))
        .messages()
        .await?;
    batch
        .next()
        .await
        .context("nothing pulled")?
        .map_err(|e| anyhow!("pulling: {e}"))
}

#[tokio::test]
async fn a_supervisor_keeps_the_team_and_writes_nothing_else() -> anyhow::Result<()> {
    let server = server().await?;
    let operator = Role::connect(&server, OPERATOR).await?;
    provision(&operator.js, &names(), &JetStreamOptions::default()).await?;
    // A running installation: the coordinators' consumer, a pool's consumer with a task.
    operator
        .js
        .get_stream("FLOTILLA_RUNLOG")
        .await?
        .create_consumer(consumer::pull::Config {
            durable_name: Some("coordinator".into()),
            filter_subject: names().runlog_all(),
            ack_policy: consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await?;
    operator
        .js
        .get_stream("FLOTILLA_TASKS")
        .await?
        .create_consumer(pool_consumer("default"))
        .await?;
    for (subject, body) in [
        ("flotilla.runlog.r1", "result"),
        ("flotilla.event.r1", "task_started"),
        ("flotilla.event.r1", "task_failed"),
        ("flotilla.task.default.r1.t1", "task"),
        ("flotilla.notify.pause.r1", "pause"),
        ("flotilla.notify.approval.r1", "approval"),
    ] {
        operator.js.publish(subject, body.into()).await?.await?;
    }
    operator
        .js
        .get_key_value("flotilla-runs")
        .await?
        .put("r1", "record".into())
        .await?;
    // Stand-ins for the coordinators' API answered by the operator, so a refused request is
    // a refusal, not a missing responder.
    let mut api = operator.client.subscribe("flotilla.api.run.>").await?;
    let mut submit = operator.client.subscribe("flotilla.api.submit").await?;
    let responder = tokio::spawn({
        let client = operator.client.clone();
        async move {
            loop {
                let m = tokio::select! {
                    Some(m) = api.next() => m,
                    Some(m) = submit.next() => m,
                    else => break,
                };
                if let Some(reply) = m.reply {
                    let _ = client.publish(reply, "{}".into()).await;
                }
            }
        }
    });
    operator.client.flush().await?;

    let mut supervisor = Role::connect(&server, SUPERVISOR).await?;

    // --- its job ---
    supervisor.js.query_account().await?;
    // The start-up check is a read-only plan: everything exists, nothing to create.
    let plan =
        flotilla_bus::provision::plan(&supervisor.js, &names(), &JetStreamOptions::default())
            .await?;
    ensure!(
        plan.report()
            .resources
            .iter()
            .all(|r| r.action == Action::Unchanged),
        "{}",
        plan.report()
    );
    // Events: the shared durable consumer, created (or bound) as the service does; pulled,
    // and acknowledged all three ways (nak: delivered again; term; ack; confirmed by the
    // server here, so the next pull sees their effect).
    let events = supervisor.js.get_stream("FLOTILLA_EVENTS").await?;
    let mut follow = events.create_consumer(supervisor_consumer()).await?;
    let first = pull_one(&follow).await?;
    ensure!(first.payload.as_ref() == b"task_started");
    first
        .double_ack_with(jetstream::AckKind::Nak(None))
        .await
        .map_err(|e| anyhow!("nak: {e}"))?;
    let again = pull_one(&follow).await?;
    ensure!(
        again.payload.as_ref() == b"task_started",
        "the nak redelivers"
    );
    again.double_ack().await.map_err(|e| anyhow!("ack: {e}"))?;
    let second = pull_one(&follow).await?;
    ensure!(second.payload.as_ref() == b"task_failed");
    second
        .double_ack_with(jetstream::AckKind::Term)
        .await
        .map_err(|e| anyhow!("term: {e}"))?;
    // After a reconnect the pull loop reads the consumer's info.
    ensure!(follow.info().await?.num_ack_pending == 0);
    // Webhooks: a consumer per webhook on the notice stream, with one kind (its filter in
    // the API subject) or several (not); pulled, retried by a delayed nak, acknowledged.
    let notices = supervisor.js.get_stream("FLOTILLA_NOTIFY").await?;
    let mut pauses = notices
        .create_consumer(consumer::pull::Config {
            durable_name: Some("webhook-pauses".into()),
            filter_subject: "flotilla.notify.pause.*".into(),
            deliver_policy: consumer::DeliverPolicy::All,
            ack_policy: consumer::AckPolicy::Explicit,
            max_deliver: 3,
            ..Default::default()
        })
        .await?;
    let notice = pull_one(&pauses).await?;
    ensure!(notice.payload.as_ref() == b"pause");
    notice
        .double_ack_with(jetstream::AckKind::Nak(Some(Duration::from_millis(100))))
        .await
        .map_err(|e| anyhow!("delayed nak: {e}"))?;
    let again = pull_one(&pauses).await?;
    ensure!(again.payload.as_ref() == b"pause", "the nak redelivers");
    again.double_ack().await.map_err(|e| anyhow!("ack: {e}"))?;
    ensure!(pauses.info().await?.num_ack_pending == 0);
    let all = notices
        .create_consumer(consumer::pull::Config {
            durable_name: Some("webhook-ops".into()),
            filter_subjects: vec![
                "flotilla.notify.approval.*".into(),
                "flotilla.notify.takeover.*".into(),
            ],
            deliver_policy: consumer::DeliverPolicy::All,
            ack_policy: consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await?;
    let approval = pull_one(&all).await?;
    ensure!(approval.payload.as_ref() == b"approval");
    approval
        .double_ack_with(jetstream::AckKind::Term)
        .await
        .map_err(|e| anyhow!("term: {e}"))?;
    // Its buckets: read, watched, written with compare-and-set.
    for (bucket, key) in [
        ("flotilla-team", "member.echo"),
        ("flotilla-failures", "agent.echo"),
        ("flotilla-trust", "agent.echo"),
    ] {
        let kv = supervisor.js.get_key_value(bucket).await?;
        let mut watch = kv.watch_all().await?;
        let rev = kv.create(key, "{\"v\":1}".into()).await?;
        kv.update(key, "{\"v\":2}".into(), rev).await?;
        // A write on a stale revision loses the race (what a replica's retry is for).
        ensure!(
            kv.update(key, "{\"v\":3}".into(), rev).await.is_err(),
            "{bucket}: a stale compare-and-set was stored"
        );
        let entry = kv.entry(key).await?.context("no entry")?;
        ensure!(entry.value.as_ref() == b"{\"v\":2}", "{bucket}: {entry:?}");
        let seen = tokio::time::timeout(Duration::from_secs(10), watch.next())
            .await
            .with_context(|| format!("the {bucket} watch saw nothing"))?
            .context("watch ended")??;
        ensure!(seen.key == key, "{bucket}: {seen:?}");
    }
    // Live workers: watched (presence) and the bucket's status read.
    let workers = supervisor.js.get_key_value("flotilla-workers").await?;
    let mut watch = workers.watch_all().await?;
    workers.status().await?;
    operator
        .js
        .get_key_value("flotilla-workers")
        .await?
        .put("worker-1", "{}".into())
        .await?;
    let seen = tokio::time::timeout(Duration::from_secs(10), watch.next())
        .await
        .context("the workers watch saw nothing")?
        .context("watch ended")??;
    ensure!(seen.key == "worker-1");
    // The team API: a micro service `flotilla-supervisor` with endpoints under
    // `flotilla.api.team.`, answering a client's request and discovery.
    let service = async_nats::service::ServiceExt::service_builder(&supervisor.client)
        .start("flotilla-supervisor", "0.0.0")
        .await
        .map_err(|e| anyhow!("starting the service: {e}"))?;
    let mut list = service
        .group("flotilla.api")
        .endpoint("team.list")
        .await
        .map_err(|e| anyhow!("adding an endpoint: {e}"))?;
    let answering = tokio::spawn(async move {
        while let Some(req) = list.next().await {
            let _ = req.respond(Ok("roster".into())).await;
        }
    });
    supervisor.client.flush().await?;
    let client = Role::connect(&server, CLIENT).await?;
    let answer = client
        .client
        .request("flotilla.api.team.list", "{}".into())
        .await?;
    ensure!(answer.payload.as_ref() == b"roster");
    let pong = client
        .client
        .request("$SRV.PING.flotilla-supervisor", "".into())
        .await?;
    ensure!(
        String::from_utf8_lossy(&pong.payload).contains("flotilla-supervisor"),
        "{pong:?}"
    );
    // Recruitment: a run's record read and watched, its run log read by sequence and by
    // subject, a budget read, and an input appended to a run's log.
    let runs = supervisor.js.get_key_value("flotilla-runs").await?;
    runs.entry("r1").await?;
    let _watch = runs.watch_with_history("r1").await?;
    let runlog = supervisor.js.get_stream("FLOTILLA_RUNLOG").await?;
    runlog.direct_get(1).await?;
    let cursors = supervisor.js.get_key_value("flotilla-cursors").await?;
    ensure!(cursors.entry("budget.r1").await?.is_none());
    supervisor
        .js
        .publish("flotilla.runlog.r1", "recruited".into())
        .await?
        .await?;
    supervisor.no_violations().await?;

    // --- refused ---
    // Run inputs of any kind but its own.
    supervisor.request_refused("flotilla.api.submit").await?;
    for subject in [
        "flotilla.submit".to_string(),
        format!("flotilla.submit.{}", flotilla_model::RunId::new()),
        "flotilla.timer.r1.1".into(),
        "flotilla.task.default.r1.t2".into(),
        "flotilla.event.r1".into(),
        // Buckets it does not own (runs, workers, session state), and those reserved for
        // later work (run controls, escalations).
        "$KV.flotilla-runs.r1".into(),
        "$KV.flotilla-workers.w1".into(),
        "$KV.flotilla-state.s1.k".into(),
        "$KV.flotilla-control.cancel.r1".into(),
        "$KV.flotilla-escalations.e1".into(),
        // Notices are the coordinators' to publish.
        "flotilla.notify.pause.r2".into(),
        // A reply it was not asked for.
        "_INBOX.forged".into(),
    ] {
        supervisor.publish_refused(&subject).await?;
    }
    ensure!(
        messages_in(&operator.js, "FLOTILLA_INTAKE").await? == 0
            && messages_in(&operator.js, "FLOTILLA_RUNLOG").await? == 2
            && messages_in(&operator.js, "FLOTILLA_TASKS").await? == 1
            && messages_in(&operator.js, "FLOTILLA_EVENTS").await? == 2
            && messages_in(&operator.js, "KV_flotilla-control").await? == 0
            && messages_in(&operator.js, "KV_flotilla-escalations").await? == 0,
        "a refused publish was stored"
    );
    // The coordinators' API (reserved: run.cancel for later policy decisions).
    supervisor
        .request_refused("flotilla.api.run.cancel")
        .await?;
    // No consumer on run logs (it reads single entries), the coordinators' consumer, a
    // pool's consumer.
    let refused_runlog = supervisor.js_refused.get_stream("FLOTILLA_RUNLOG").await?;
    for durable in [flotilla_supervisor::CONSUMER, "coordinator"] {
        ensure!(
            refused_runlog
                .create_consumer(consumer::pull::Config {
                    durable_name: Some(durable.into()),
                    filter_subject: names().runlog_all(),
                    ..Default::default()
                })
                .await
                .is_err(),
            "the supervisor created or changed run-log consumer {durable}"
        );
        supervisor
            .refused(&format!(
                "$JS.API.CONSUMER.CREATE.FLOTILLA_RUNLOG.{durable}.flotilla.runlog.*"
            ))
            .await?;
    }
    supervisor
        .publish_refused("$JS.API.CONSUMER.MSG.NEXT.FLOTILLA_RUNLOG.coordinator")
        .await?;
    supervisor
        .publish_refused("$JS.API.CONSUMER.MSG.NEXT.FLOTILLA_TASKS.pool-default")
        .await?;
    // On the event stream: no other consumer, no ordered reader, no deleting its own.
    let refused_events = supervisor.js_refused.get_stream("FLOTILLA_EVENTS").await?;
    ensure!(
        refused_events
            .create_consumer(consumer::pull::OrderedConfig {
                filter_subject: "flotilla.event.r1".into(),
                ..Default::default()
            })
            .await
            .is_err()
    );
    supervisor
        .refused("$JS.API.CONSUMER.CREATE.FLOTILLA_EVENTS")
        .await?;
    ensure!(
        refused_events
            .delete_consumer(flotilla_supervisor::CONSUMER)
            .await
            .is_err()
    );
    supervisor
        .refused("$JS.API.CONSUMER.DELETE.FLOTILLA_EVENTS.supervisor")
        .await?;
    // Cursors other than budgets (mailbox positions, claims).
    supervisor
        .publish_refused("$JS.API.DIRECT.GET.KV_flotilla-cursors.$KV.flotilla-cursors.mbox.r1.t1")
        .await?;
    // No stream administration.
    ensure!(
        supervisor
            .js_refused
            .delete_stream("FLOTILLA_EVENTS")
            .await
            .is_err()
    );
    supervisor
        .refused("$JS.API.STREAM.DELETE.FLOTILLA_EVENTS")
        .await?;
    ensure!(refused_events.purge().await.is_err());
    supervisor
        .refused("$JS.API.STREAM.PURGE.FLOTILLA_EVENTS")
        .await?;
    ensure!(messages_in(&operator.js, "FLOTILLA_EVENTS").await? == 2);
    // Subscriptions outside its replies and its own service: neither the coordinators' API
    // (it could answer a submission), their discovery, nor the event stream as published.
    supervisor.subscribe_refused("flotilla.api.submit").await?;
    supervisor.subscribe_refused("$SRV.PING.flotilla").await?;
    supervisor.subscribe_refused("flotilla.event.>").await?;
    let info = operator
        .js
        .get_consumer_from_stream::<consumer::pull::Config, _, _>("coordinator", "FLOTILLA_RUNLOG")
        .await?
        .info()
        .await?
        .clone();
    ensure!(
        info.num_ack_pending == 0 && info.num_pending == 2,
        "the coordinators' consumer was touched: {info:?}"
    );
    answering.abort();
    responder.abort();
    Ok(())
}

/// The permission violations the server logged for `user` (nats-server 2.15 names the user
/// as `"FLOTILLA/user:NAME"`, earlier releases as `User "NAME"`).
fn refusals_in_server_log(server: &NatsServer, user: &str) -> anyhow::Result<Vec<String>> {
    let log = std::fs::read_to_string(server.dir().join("nats-server.log"))?;
    let (new, old) = (format!("/user:{user}\""), format!("User \"{user}\""));
    Ok(log
        .lines()
        .filter(|l| l.contains("Violation") && (l.contains(&new) || l.contains(&old)))
        .map(str::to_owned)
        .collect())
}

/// `FLOTILLA_NATS__AUTH__*`: how the Helm chart hands credentials to a pod.
fn credentials_env((user, password): (&str, &str)) -> Vec<(&'static str, String)> {
    vec![
        ("FLOTILLA_NATS__AUTH__KIND", "user-password".to_owned()),
        ("FLOTILLA_NATS__AUTH__USER", user.to_owned()),
        ("FLOTILLA_NATS__AUTH__PASSWORD", password.to_owned()),
    ]
}

fn refs<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

const AGENTS: &str = r#"
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

/// Sends `body` to the prompt `subject` of the NATS Agent Protocol and reads the stream to
/// its end: each message's `Nats-Service-Error-Code` (an error frame) and body.
async fn prompt_stream(
    nats: &async_nats::Client,
    subject: &str,
    body: &str,
) -> anyhow::Result<Vec<(Option<String>, String)>> {
    let inbox = nats.new_inbox();
    let mut sub = nats.subscribe(inbox.clone()).await?;
    nats.publish_with_reply(subject.to_owned(), inbox, body.to_owned().into())
        .await?;
    let mut out = Vec::new();
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(20), sub.next())
            .await
            .map_err(|_| anyhow!("nothing for 20 s after {out:?}"))?
            .ok_or_else(|| anyhow!("the stream's subscription ended"))?;
        let code = msg
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Service-Error-Code"))
            .map(|v| v.as_str().to_owned());
        if msg.payload.is_empty() && code.is_none() {
            return Ok(out);
        }
        out.push((code, String::from_utf8_lossy(&msg.payload).into_owned()));
    }
}

/// A `Bus` (the library's connection) with `role`'s credentials.
async fn bus_as(server: &NatsServer, (user, password): (&str, &str)) -> anyhow::Result<Bus> {
    let opts = NatsOptions {
        auth: NatsAuth::UserPassword {
            user: user.into(),
            password: Secret::new(password),
        },
        ..NatsOptions::with_url(server.url())
    };
    Ok(Bus::connect(&opts, "permissions-test").await?)
}

#[tokio::test]
async fn memory_is_written_by_the_supervisor_and_read_by_the_coordinators() -> anyhow::Result<()> {
    use flotilla_model::subjects::Bucket;
    let server = server().await?;
    let operator = Role::connect(&server, OPERATOR).await?;
    provision(&operator.js, &names(), &JetStreamOptions::default()).await?;

    // The supervisor: creates an entry once (create-if-absent), reads it by key and with the
    // bounded scan memory.list uses, purges it (memory.forget), serves memory.*.
    let mut supervisor = Role::connect(&server, SUPERVISOR).await?;
    let memory = supervisor.js.get_key_value("flotilla-memory").await?;
    memory.create("run.r1", "{\"v\":1}".into()).await?;
    ensure!(
        memory.create("run.r1", "{\"v\":2}".into()).await.is_err(),
        "a second create of one run was stored"
    );
    memory.create("run.r2", "{\"v\":1}".into()).await?;
    ensure!(memory.entry("run.r1").await?.is_some());
    let as_supervisor = bus_as(&server, SUPERVISOR).await?;
    let newest = as_supervisor
        .kv_newest(Bucket::Memory, "run.", 1000)
        .await?;
    ensure!(newest.len() == 2, "{newest:?}");
    memory.purge("run.r2").await?;
    let _api = supervisor
        .client
        .subscribe("flotilla.api.memory.list")
        .await?;
    supervisor.no_violations().await?;

    // The coordinator reads with the same bounded scan, and writes nothing there.
    let mut coordinator = Role::connect(&server, COORDINATOR).await?;
    let as_coordinator = bus_as(&server, COORDINATOR).await?;
    let newest = as_coordinator
        .kv_newest(Bucket::Memory, "run.", 1000)
        .await?;
    ensure!(
        newest.len() == 1 && newest[0].subject.ends_with("run.r1"),
        "the purged entry is not read: {newest:?}"
    );
    coordinator.no_violations().await?;
    coordinator
        .publish_refused("$KV.flotilla-memory.run.r3")
        .await?;

    // A client reaches memory only through the API: no reads, no writes.
    let mut client = Role::connect(&server, CLIENT).await?;
    client.publish_refused("$KV.flotilla-memory.run.r3").await?;
    client
        .publish_refused("$JS.API.DIRECT.GET.KV_flotilla-memory")
        .await?;
    // A worker neither.
    let mut worker = Role::connect(&server, WORKER).await?;
    worker.publish_refused("$KV.flotilla-memory.run.r3").await?;
    // The supervisor writes run entries only.
    supervisor
        .publish_refused("$KV.flotilla-memory.other.key")
        .await?;
    let stored = operator.js.get_key_value("flotilla-memory").await?;
    ensure!(
        stored.entry("run.r3").await?.is_none(),
        "a refused write was stored"
    );
    ensure!(
        messages_in(&operator.js, "KV_flotilla-memory").await? == 2,
        "run.r1 and run.r2's purge marker only"
    );
    Ok(())
}

#[tokio::test]
async fn a_worker_does_not_provision_and_says_so() -> anyhow::Result<()> {
    let empty = server().await?;
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("flotilla.toml");
    std::fs::write(
        &config,
        format!("{AGENTS}\n[nats]\nurls = [\"{}\"]\n", empty.url()),
    )?;
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .arg("--config")
        .arg(&config)
        .arg("worker")
        .envs(credentials_env(WORKER))
        .env("FLOTILLA_LOG", "warn")
        // It waits for a coordinator to provision; not this long.
        .env("FLOTILLA_WORKER__PROVISION_WAIT", "1s")
        .env("FLOTILLA_TELEMETRY__HTTP_ADDR", "off")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .context("the worker did not stop")??;
    let log = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.code() == Some(2), "{:?}:\n{log}", out.status);
    ensure!(
        log.contains("streams and buckets are missing")
            && log.contains("FLOTILLA_TASKS")
            && log.contains("Workers do not create them"),
        "{log}"
    );
    let operator = Role::connect(&empty, OPERATOR).await?;
    ensure!(
        operator.js.stream_names().count().await == 0,
        "the worker created streams"
    );
    Ok(())
}

/// `flotilla nats provision` with the operator's credentials: `--pools` creates each pool's
/// consumer ahead of its workers (what KEDA reads), bad pool names change nothing.
#[tokio::test]
async fn provisioning_creates_the_pool_consumers_ahead_of_the_workers() -> anyhow::Result<()> {
    let server = server().await?;
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("flotilla.toml");
    std::fs::write(
        &config,
        format!("{AGENTS}\n[nats]\nurls = [\"{}\"]\n", server.url()),
    )?;
    let provision = |args: &[&str]| {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
            .arg("--config")
            .arg(&config)
            .args(["nats", "provision"])
            .args(args)
            .envs(credentials_env(OPERATOR))
            .env("FLOTILLA_LOG", "warn")
            .kill_on_drop(true)
            .output()
    };
    let operator = Role::connect(&server, OPERATOR).await?;

    // A bad name is refused before anything is created.
    let out = provision(&["--pools", "default,gp.u"]).await?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "{err}");
    ensure!(err.contains("--pools: pool \"gp.u\""), "{err}");
    ensure!(
        operator.js.stream_names().count().await == 0,
        "something was created"
    );

    // A dry run says the consumers are missing and creates nothing.
    let out = provision(&["--pools", "default,gpu", "--dry-run", "--json"]).await?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    ensure!(
        report["consumers"]
            .as_array()
            .is_some_and(|c| c.len() == 2 && c.iter().all(|c| c["action"] == "missing")),
        "{report}"
    );
    ensure!(
        operator.js.stream_names().count().await == 0,
        "a dry run created something"
    );

    let out = provision(&["--pools", "default,gpu", "--json"]).await?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    ensure!(report["consumers"][1]["name"] == "pool-gpu", "{report}");
    ensure!(report["consumers"][1]["action"] == "create", "{report}");
    let tasks = operator.js.get_stream("FLOTILLA_TASKS").await?;
    for pool in ["default", "gpu"] {
        let mut consumer = tasks
            .get_consumer::<consumer::pull::Config>(&names().pool_consumer(pool))
            .await
            .map_err(|e| anyhow!("no consumer of pool {pool}: {e}"))?;
        let info = consumer.info().await?;
        ensure!(
            info.config.filter_subject == names().pool_filter(pool),
            "{info:?}"
        );
        ensure!(info.config.ack_policy == consumer::AckPolicy::Explicit);
    }
    // Again: the consumers exist and are left alone.
    let out = provision(&["--pools", "default,gpu"]).await?;
    let text = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success() && text.contains("pool-gpu") && text.contains("exists"),
        "{text}"
    );

    // The pool's worker binds the consumer it finds, with its own rights.
    let mut worker = Role::connect(&server, WORKER).await?;
    let stream = worker.js.get_stream("FLOTILLA_TASKS").await?;
    stream.create_consumer(pool_consumer("default")).await?;
    worker.no_violations().await?;
    Ok(())
}

#[tokio::test]
async fn a_plan_runs_with_every_role_on_its_own_credentials() -> anyhow::Result<()> {
    // Processes provisions as the operator (the Helm chart's provisioning job).
    let mut p = support::Processes::with_server(server().await?, AGENTS).await?;
    let coordinator_env = credentials_env(COORDINATOR);
    let worker_env = credentials_env(WORKER);
    let client_env = credentials_env(CLIENT);
    let supervisor_env = credentials_env(SUPERVISOR);

    let c = p.spawn_env(&["coordinator"], &refs(&coordinator_env))?;
    if let Err(e) = support::wait_for_api(&p.bus).await {
        bail!("{e}\ncoordinator log:\n{}", p.log(c));
    }
    let w = p.spawn_env(&["worker"], &refs(&worker_env))?;
    p.wait_registered(w).await?;
    // A client library connection with the client's credentials (no operator rights).
    let opts = NatsOptions {
        auth: NatsAuth::UserPassword {
            user: CLIENT.0.into(),
            password: Secret::new(CLIENT.1),
        },
        ..NatsOptions::with_url(p.server.url())
    };
    let client = flotilla_client::Client::new(Bus::connect(&opts, "permissions-test").await?);

    // The supervisor: its roster (every configured agent) answers the client.
    let s = p.spawn_env(&["supervisor"], &refs(&supervisor_env))?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let asked = client
            .request(
                &TeamListRequest {
                    protocol: flotilla_model::PROTOCOL_VERSION,
                    role: None,
                },
                Duration::from_secs(2),
            )
            .await;
        if let Ok(list) = &asked {
            let mut members: Vec<&str> = list.members.iter().map(|m| m.name.as_str()).collect();
            members.sort_unstable();
            if members == ["caller", "echo", "long", "researcher"] {
                break;
            }
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the supervisor's roster is not complete ({asked:?}):\n{}",
            p.log(s)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The supervisor serves an exposed teammate on the NATS Agent Protocol with its own
    // credentials: the `agents` service instance, its prompt endpoint and the streamed
    // answer on the caller's inbox (a turn run by the worker on its credentials).
    client
        .request(
            &flotilla_model::teammate::TeamSpawnRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                team: Some("crew".into()),
                name: "ann".into(),
                role: "helper".into(),
                instructions: "x".into(),
                agent: Some("echo".into()),
                pool: None,
                by: None,
                expose: true,
            },
            Duration::from_secs(5),
        )
        .await?;
    // A caller discovers before it prompts (docs/protocol.md, "Unknown addresses"): a prompt
    // sent while the instance registers can find its status endpoint answering and its
    // prompt endpoint not yet subscribed, and nobody takes it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let probe = async_nats::Request::new()
            .payload(bytes::Bytes::new())
            .timeout(Some(Duration::from_secs(2)));
        if p.bus
            .client()
            .send_request("agents.status.ann.flotilla.crew".to_owned(), probe)
            .await
            .is_ok()
        {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the exposed teammate never registered:\n{}",
            p.log(s)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let stream =
            match prompt_stream(p.bus.client(), "agents.prompt.ann.flotilla.crew", "hi").await {
                Ok(stream) => stream,
                Err(e) => bail!("the exposed teammate's stream: {e}\n{}", p.log(s)),
            };
        if stream
            .iter()
            .any(|(code, body)| code.is_none() && body.contains("ann done"))
        {
            break;
        }
        // Answered `unknown_agent` until the instance is registered.
        ensure!(
            tokio::time::Instant::now() < deadline
                && stream
                    .iter()
                    .all(|(code, _)| code.is_none() || code.as_deref() == Some("404")),
            "no answer from the exposed teammate: {stream:?}\n{}",
            p.log(s)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let plan = p.dir().join("plan.json");
    std::fs::write(
        &plan,
        r#"{"name":"least-privilege","subtasks":[
            {"id":"gather","produces":["facts"],"output_key":"gathered"},
            {"id":"analyse","consumes":["facts"],"description":"about {gathered}"},
            {"id":"delegate","agent":"caller"},
            {"id":"look","role":"research"},
            {"id":"report","dependencies":["analyse","delegate","look"]}]}"#,
    )?;
    let plan = plan.to_string_lossy().into_owned();
    let (root, session) = (
        flotilla_model::RunId::new().to_string(),
        flotilla_model::SessionId::new().to_string(),
    );
    let submit = p.spawn_env(
        &[
            "submit",
            &plan,
            "--wait",
            "--json",
            "--timeout",
            "60s",
            "--run-id",
            &root,
            "--session",
            &session,
        ],
        &refs(&client_env),
    )?;
    let code = match p.wait_exit(submit, support::WAIT).await {
        Ok(code) => code,
        Err(e) => bail!(
            "{e}\nsubmit:\n{}\ncoordinator:\n{}\nworker:\n{}",
            p.log(submit),
            p.log(c),
            p.log(w)
        ),
    };
    ensure!(
        code == Some(0),
        "submit exited {code:?}:\n{}\ncoordinator:\n{}\nworker:\n{}",
        p.log(submit),
        p.log(c),
        p.log(w)
    );
    let out = p.log(submit);
    ensure!(
        out.contains("succeeded") && out.contains("report done"),
        "{out}"
    );

    // The client lists runs, workers, the run's tree and its session with its own
    // credentials.
    for args in [
        &["runs", "list"][..],
        &["workers", "--json"],
        &["runs", "tree", &root],
        &["sessions", "show", &session, "--json"],
        // Watches of the tree (the child flattened in): here and by a coordinator.
        &[
            "watch",
            &root,
            "--children",
            "flatten",
            "--profile",
            "debug",
        ],
        &["watch", &root, "--children", "flatten", "--server"],
    ] {
        let i = p.spawn_env(args, &refs(&client_env))?;
        let code = p.wait_exit(i, support::WAIT).await?;
        ensure!(code == Some(0), "{args:?} exited {code:?}:\n{}", p.log(i));
        ensure!(
            !p.log(i).contains("Permissions Violation"),
            "{args:?} was refused something:\n{}",
            p.log(i)
        );
        if args[0] == "sessions" {
            // The log holds stderr too: the JSON document starts at the first `{` line (log lines
            // may follow it).
            let log = p.log(i);
            let json = log.find("\n{").map_or(log.as_str(), |at| &log[at + 1..]);
            let view: flotilla_model::tree::SessionView = serde_json::Deserializer::from_str(json)
                .into_iter()
                .next()
                .ok_or_else(|| anyhow::anyhow!("no JSON: {log}"))?
                .map_err(|e| anyhow::anyhow!("{e}: {log}"))?;
            ensure!(view.runs.len() == 2, "the run and its child: {view:?}");
        }
        if args[1] == "tree" {
            ensure!(p.log(i).contains("2 runs"), "{}", p.log(i));
        }
    }
    // And reads the run store through its own connection (no operator rights).
    let runs = flotilla_coordinator::store::RunStore::open(client.bus()).await?;
    // The plan's run and the child run its `delegate` task started.
    ensure!(runs.list().await?.len() == 2);

    // Cancelling with the client's credentials: the coordinator records it, posts the cancel
    // notice and removes queued tasks; the worker sees the notice and cancels its attempt.
    let mut long = flotilla_model::submit::SubmitRequest::new(support::plan(vec![
        flotilla_model::plan::Subtask::new("long", "").with_agent("long"),
    ]));
    let run = flotilla_model::RunId::new();
    long.run_id = Some(run);
    client.submit(long).await?;
    support::task_started(&client, run, "long").await?;
    let cancel = p.spawn_env(
        &[
            "runs",
            "cancel",
            &run.to_string(),
            "--reason",
            "least privilege",
        ],
        &refs(&client_env),
    )?;
    let code = p.wait_exit(cancel, support::WAIT).await?;
    ensure!(
        code == Some(0),
        "cancel exited {code:?}:\n{}\ncoordinator:\n{}",
        p.log(cancel),
        p.log(c)
    );
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let results = support::results_of(&p.bus, run).await?;
        if results.len() == 1 {
            ensure!(!results[0].2, "the attempt was cancelled, not completed");
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the worker did not cancel its attempt:\nworker:\n{}\ncoordinator:\n{}",
            p.log(w),
            p.log(c)
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // The supervisor counted the plan's attempt outcomes, each once: `echo` ran gather,
    // analyse, report and the child run's task, `caller` ran delegate (the cancelled
    // attempt counts for nobody).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let stats = client
            .request(
                &TeamStatsRequest {
                    protocol: flotilla_model::PROTOCOL_VERSION,
                    name: None,
                    scope: Some(RecordScope::Agent),
                },
                Duration::from_secs(5),
            )
            .await?;
        let of = |name: &str| {
            stats
                .records
                .iter()
                .find(|r| r.name == name)
                .map(|r| (r.total_succeeded, r.total_failed))
        };
        if of("echo") == Some((4, 0)) && of("caller") == Some((1, 0)) {
            ensure!(of("long").is_none(), "{stats:?}");
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the supervisor did not count the run: {stats:?}\nsupervisor:\n{}",
            p.log(s)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The team as a person reads it, with the client's credentials.
    for args in [&["team", "--json"][..], &["team", "stats", "echo"]] {
        let i = p.spawn_env(args, &refs(&client_env))?;
        let code = p.wait_exit(i, support::WAIT).await?;
        ensure!(code == Some(0), "{args:?} exited {code:?}:\n{}", p.log(i));
        ensure!(p.log(i).contains("echo"), "{args:?}:\n{}", p.log(i));
    }
    for (name, i) in [("coordinator", c), ("worker", w), ("supervisor", s)] {
        ensure!(
            !p.log(i).contains("Permissions Violation"),
            "{name} was refused something:\n{}",
            p.log(i)
        );
    }
    // The server's log too, whatever the processes' log level: nothing any role did,
    // start-up included, was refused.
    for (user, _) in [COORDINATOR, WORKER, CLIENT, SUPERVISOR] {
        let refused = refusals_in_server_log(&p.server, user)?;
        ensure!(
            refused.is_empty(),
            "{user} was refused:\n{}",
            refused.join("\n")
        );
    }
    Ok(())
}

#[test]
fn the_shipped_server_configs_are_valid() -> anyhow::Result<()> {
    let binary = flotilla_bus::server::find_binary()?;
    for (file, env) in [
        ("single.conf", None),
        ("cluster.conf", Some(("SERVER_NAME", "nats-0"))),
        ("accounts.conf", None),
    ] {
        let path = support::root().join("deploy/nats").join(file);
        let mut cmd = std::process::Command::new(&binary);
        cmd.arg("-t").arg("-c").arg(&path);
        if let Some((k, v)) = env {
            cmd.env(k, v);
        }
        let out = cmd.output()?;
        ensure!(
            out.status.success(),
            "{file}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Durability: both configs fsync every write before acknowledging it.
    for file in ["single.conf", "cluster.conf"] {
        let text = std::fs::read_to_string(support::root().join("deploy/nats").join(file))?;
        ensure!(
            text.lines()
                .any(|l| l.trim_start().starts_with("sync_interval: always")),
            "{file} lacks sync_interval: always"
        );
    }
    Ok(())
}

/// A person of account PEOPLE calls the API as themselves: the server stamps the request
/// with their NATS user (the shared import of `deploy/nats/accounts.conf`), and Flotilla
/// records that user as who acted — not the `by` the request claims. The person reaches the
/// API and nothing else of the FLOTILLA account.
#[tokio::test]
async fn a_person_acts_as_their_nats_user_whatever_the_request_claims() -> anyhow::Result<()> {
    use flotilla_model::runlog::{ControlAction, RunInput};
    const ALICE: (&str, &str) = ("alice", "alice-dev-password");
    let mut p = support::Processes::with_server(server().await?, AGENTS).await?;
    let coordinator_env = credentials_env(COORDINATOR);
    let c = p.spawn_env(&["coordinator"], &refs(&coordinator_env))?;
    if let Err(e) = support::wait_for_api(&p.bus).await {
        bail!("{e}\ncoordinator log:\n{}", p.log(c));
    }
    // A run that waits: its one task has no worker.
    let run = p
        .client
        .submit(flotilla_model::submit::SubmitRequest::new(support::plan(
            vec![flotilla_model::plan::Subtask::new(
                "wait",
                "no worker runs this",
            )],
        )))
        .await?;
    let alice = async_nats::ConnectOptions::with_user_and_password(ALICE.0.into(), ALICE.1.into())
        .connect(p.server.url())
        .await?;
    let body = serde_json::json!({"run_id": run, "by": "mallory", "reason": "checking"});
    let reply = tokio::time::timeout(
        Duration::from_secs(10),
        alice.request("flotilla.api.run.pause", body.to_string().into()),
    )
    .await
    .context("no answer to the person's pause")??;
    let answer: flotilla_model::control::ControlRunReply =
        serde_json::from_slice(&reply.payload)
            .with_context(|| String::from_utf8_lossy(&reply.payload).into_owned())?;
    ensure!(answer.applied, "{answer:?}");
    let store = flotilla_client::open_store(&p.bus).await?;
    let by: Vec<Option<String>> = store
        .history(run)
        .await?
        .into_iter()
        .filter_map(|(_, _, e)| match e.input {
            RunInput::Control(c) if c.action == ControlAction::Pause => Some(c.by),
            _ => None,
        })
        .collect();
    ensure!(by == [Some("alice".to_owned())], "{by:?}");
    // A person cannot ask on behalf of an attempt (an external agent's question): the
    // server says who asks, and it is not a worker.
    let ask = serde_json::json!({
        "run_id": run, "task_id": "wait", "attempt": 1,
        "attempt_id": uuid::Uuid::now_v7(), "agent": "agents:gate.ext.default",
        "query_id": "q", "question": "may I?"
    });
    let reply = tokio::time::timeout(
        Duration::from_secs(10),
        alice.request("flotilla.api.approval.ask", ask.to_string().into()),
    )
    .await
    .context("no answer to the person's approval.ask")??;
    let refused: serde_json::Value = serde_json::from_slice(&reply.payload)?;
    ensure!(
        refused["status"] == 403 && refused["code"] == "forbidden",
        "{refused}"
    );
    // Nothing but the API: no stream of the FLOTILLA account (its run log among them).
    let js = async_nats::jetstream::new(alice.clone());
    ensure!(
        js.get_stream("FLOTILLA_RUNLOG").await.is_err(),
        "a person read a FLOTILLA stream"
    );
    Ok(())
}

/// One HTTP/1.1 request to the console, signed in with [`CONSOLE_TOKEN`] (a POST with the
/// console's CSRF header): the status and the body.
async fn console_http(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> anyhow::Result<(u16, String)> {
    let auth = format!("Bearer {CONSOLE_TOKEN}");
    let mut headers = vec![("Authorization", auth.as_str())];
    if method == "POST" {
        headers.push(("X-Flotilla-Console", "1"));
    }
    Ok(flotilla_testkit::http::request(addr, method, path, &headers, body).await?)
}

const CONSOLE_TOKEN: &str = "alice-console-token-0123456789";

const EXPOSED: &str = r#"
[agents.greeter]
kind = "scripted"
reply = "hello from the greeter"
expose = true
[agents.asker]
kind = "exec"
command = "sh"
args = ["-c", '"$FLOTILLA_BIN" call agents:greeter "say hello" --wait 1m']
"#;

/// The web console on the `console` user of the shipped accounts.conf: every page and action
/// works — runs, a run, its tree, events, workspace, mailbox, state, grants, the inbox, an
/// approval, a pause, the team, the workers with their pools' backlog — and the server
/// refused it nothing. The same deployment exposes an agent on the NATS Agent Protocol and
/// a plan calls it: the coordinator, the worker and the supervisor are refused nothing.
#[tokio::test]
async fn the_console_works_on_its_own_credentials() -> anyhow::Result<()> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let addr = format!("127.0.0.1:{port}");
    // An exposed agent and an exec agent that calls it through the NATS Agent Protocol: the
    // coordinator serves the `agents` service, the worker calls it, the supervisor
    // discovers agents — each on its own credentials.
    let config = format!(
        "{AGENTS}{EXPOSED}\n[console]\nlisten = \"{addr}\"\noperators = [\"alice\"]\n[console.tokens]\nalice = \"{CONSOLE_TOKEN}\"\n"
    );
    let mut p = support::Processes::with_server(server().await?, &config).await?;
    let c = p.spawn_env(&["coordinator"], &refs(&credentials_env(COORDINATOR)))?;
    if let Err(e) = support::wait_for_api(&p.bus).await {
        bail!("{e}\ncoordinator log:\n{}", p.log(c));
    }
    let w = p.spawn_env(&["worker"], &refs(&credentials_env(WORKER)))?;
    p.wait_registered(w).await?;
    let s = p.spawn_env(&["supervisor"], &refs(&credentials_env(SUPERVISOR)))?;
    let console = p.spawn_env(&["console"], &refs(&credentials_env(CONSOLE)))?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while console_http(&addr, "GET", "/healthz", None)
        .await
        .map(|r| r.0)
        .ok()
        != Some(200)
    {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the console did not start:\n{}",
            p.log(console)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A run waiting for a person (the `publish` action is sensitive by default).
    let client = flotilla_client::Client::new(bus_as(&p.server, CLIENT).await?);
    let mut publish = flotilla_model::plan::Subtask::new("publish", "publish it");
    publish.action = Some("publish".into());
    let run = client
        .submit(flotilla_model::submit::SubmitRequest::new(support::plan(
            vec![
                flotilla_model::plan::Subtask::new("gather", ""),
                publish.after(&["gather"]),
            ],
        )))
        .await?;
    let run_s = run.to_string();
    let deadline = tokio::time::Instant::now() + support::WAIT;
    let approval = loop {
        let (code, body) =
            console_http(&addr, "GET", &format!("/api/inbox?run={run}"), None).await?;
        ensure!(code == 200, "inbox: {code} {body}");
        let inbox: serde_json::Value = serde_json::from_str(&body)?;
        if let Some(id) = inbox["approvals"][0]["request"]["approval_id"].as_str() {
            break id.to_owned();
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "no approval: {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let (code, body) = console_http(
        &addr,
        "POST",
        &format!("/api/approvals/{run}/{approval}"),
        Some(r#"{"decision":"approve","comment":"on the console's credentials"}"#),
    )
    .await?;
    ensure!(code == 200, "approve: {code} {body}");
    let outcome = client.wait(run, support::WAIT).await?;
    ensure!(
        outcome.status == flotilla_model::run::RunStatus::Succeeded,
        "{outcome:?}"
    );
    for path in [
        "/api/runs".to_owned(),
        format!("/api/runs/{run}"),
        format!("/api/runs/{run}/tree"),
        format!("/api/runs/summaries?ids={run}"),
        format!("/api/runs/{run}/workspace"),
        format!("/api/runs/{run}/mailbox/publish"),
        format!("/api/runs/{run}/grants"),
        format!("/api/runs/{run}/state"),
        "/api/inbox".to_owned(),
        "/api/team".to_owned(),
        "/api/workers".to_owned(),
    ] {
        let mut answer = console_http(&addr, "GET", &path, None).await?;
        // The supervisor may still be starting: the team page says so (503) until it answers.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while answer.0 == 503 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(200)).await;
            answer = console_http(&addr, "GET", &path, None).await?;
        }
        let (code, body) = answer;
        ensure!(
            code == 200,
            "{path}: {code} {body}\nrefused: {:?}",
            [COORDINATOR, CONSOLE, SUPERVISOR]
                .map(|(u, _)| refusals_in_server_log(&p.server, u).unwrap_or_default())
        );
        if path == "/api/workers" {
            // The pool's backlog needs the consumer info the `console` user may read.
            ensure!(body.contains("\"backlog\":0"), "{body}");
        }
        if path == "/api/runs" {
            ensure!(body.contains(&run_s), "{body}");
        }
    }
    // A key never written is the API's 404, not a permission error.
    let (code, body) = console_http(
        &addr,
        "GET",
        &format!("/api/runs/{run}/state/nothing"),
        None,
    )
    .await?;
    ensure!(code == 404, "state: {code} {body}");
    // The run's events, to their end.
    let (code, body) = console_http(
        &addr,
        "GET",
        &format!("/api/runs/{run}/events?profile=debug"),
        None,
    )
    .await?;
    ensure!(
        code == 200 && body.contains("event: end"),
        "events: {code} {body}"
    );
    ensure!(
        body.contains("run_succeeded") || body.contains("succeeded"),
        "{body}"
    );
    // A control: the run has ended, so the pause changes nothing, but it is the API's answer.
    let (code, body) =
        console_http(&addr, "POST", &format!("/api/runs/{run}/pause"), Some("{}")).await?;
    ensure!(code == 200, "pause: {code} {body}");
    // A plan's exec agent calls the exposed agent over the protocol.
    let asked = client
        .submit(flotilla_model::submit::SubmitRequest::new(support::plan(
            vec![flotilla_model::plan::Subtask::new("ask", "").with_agent("asker")],
        )))
        .await?;
    let outcome = client.wait(asked, support::WAIT).await?;
    ensure!(
        outcome.status == flotilla_model::run::RunStatus::Succeeded
            && format!("{outcome:?}").contains("hello from the greeter"),
        "{outcome:?}\ncoordinator:\n{}\nworker:\n{}",
        p.log(c),
        p.log(w)
    );
    for (user, _) in [COORDINATOR, WORKER, SUPERVISOR] {
        let refused = refusals_in_server_log(&p.server, user)?;
        ensure!(
            refused.is_empty(),
            "{user} was refused:\n{}",
            refused.join("\n")
        );
    }
    ensure!(
        !p.log(console).contains("Permissions Violation"),
        "the console was refused something:\n{}",
        p.log(console)
    );
    let refused = refusals_in_server_log(&p.server, CONSOLE.0)?;
    ensure!(
        refused.is_empty(),
        "console was refused:\n{}",
        refused.join("\n")
    );
    let _ = s;
    Ok(())
}
