//! Least privilege of the services, proven on a real nats-server running the shipped
//! `deploy/nats/accounts.conf`: the supervisor keeps the team and writes nothing else, memory
//! is written by the supervisor and read by the coordinators, a person of account PEOPLE acts
//! as their NATS user and reaches the API only, and the web console works on its own
//! credentials. One test runs a real plan with the `flotilla` binary, coordinator, worker,
//! supervisor and client each connecting with its own credentials; the supervisor's roster
//! and failure records answer the client.
//!
//! Refusals and allowed steps are proven as in `permissions.rs`: the violation the server
//! reports on the role's connection, the operation failing, the operator seeing nothing
//! changed, and no violation at all on a connection that only did its job. The processes'
//! refusals are read from the server's log.

mod support;

#[path = "permissions/common.rs"]
mod common;

use std::time::Duration;

use anyhow::{Context, anyhow, bail, ensure};
use async_nats::jetstream::{self, consumer};
use flotilla_bus::provision::{Action, provision};
use flotilla_bus::{Bus, JetStreamOptions, NatsAuth, NatsOptions, Secret};
use flotilla_model::team::{RecordScope, TeamListRequest, TeamStatsRequest};
use flotilla_testkit::NatsServer;
use futures::StreamExt;

use common::{
    AGENTS, CLIENT, CONSOLE, COORDINATOR, OPERATOR, Role, SUPERVISOR, WORKER, credentials_env,
    messages_in, names, pool_consumer, server, watch_sees_put,
};

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
    let watch = workers.watch_all().await?;
    workers.status().await?;
    watch_sees_put(watch, &operator, "flotilla-workers", "worker-1", "{}").await?;
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

fn refs<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

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
