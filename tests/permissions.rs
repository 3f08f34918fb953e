//! Least privilege, proven on a real nats-server running the shipped
//! `deploy/nats/accounts.conf`: each role that works the bus (operator, coordinator, worker of
//! pool `default`, client) can do its job, and is refused outside it. A worker does not
//! provision and says so; `flotilla nats provision` creates the pools' consumers ahead of the
//! workers; the shipped server configs are valid. The supervisor, memory, people, the console
//! and a real plan on every role's credentials are in `permissions_services.rs`.
//!
//! A refusal is proven three ways: the server reports a permission violation naming the
//! subject on that role's connection (collected from the connection's events, waited for,
//! never slept on); the operation itself fails; and the operator sees that nothing changed.
//! Every allowed step ends by checking that the role's connection saw no violation at all, so
//! an over-tight permission fails the test too.

mod support;

#[path = "permissions/common.rs"]
mod common;

use std::time::Duration;

use anyhow::{Context, anyhow, ensure};
use async_nats::jetstream::{self, consumer, stream};
use flotilla_bus::JetStreamOptions;
use flotilla_bus::provision::{Action, provision};
use flotilla_model::subjects::StreamKind;
use futures::StreamExt;

use common::{
    AGENTS, CLIENT, COORDINATOR, OPERATOR, Role, WORKER, credentials_env, messages_in, names,
    pool_consumer, server, watch_sees_put,
};

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
    let watch = control.watch_all().await?;
    watch_sees_put(watch, &operator, "flotilla-control", "r1", "pause").await?;
    // The teammates' entries, watched (a worker reading the inboxes claims from its mirror).
    let team = worker.js.get_key_value("flotilla-team").await?;
    let watch = team.watch_with_history("teammate.>").await?;
    watch_sees_put(watch, &operator, "flotilla-team", "teammate.t.ann", "{}").await?;

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
