//! Provisioning against a real nats-server.

use std::time::Duration;

use async_nats::jetstream::stream::{Config, RetentionPolicy};
use flotilla_bus::provision::{Action, JetStreamOptions, plan, provision};
use flotilla_bus::{Bus, ProvisionErrorKind};
use flotilla_model::Names;
use flotilla_testkit::NatsServer;

#[tokio::test]
async fn provisioning_twice_is_a_no_op() -> anyhow::Result<()> {
    let server = NatsServer::start().await?;
    let bus = server.bus().await?;
    let opts = JetStreamOptions::default();
    let first = bus.provision(&opts).await?;
    assert!(
        first.resources.iter().all(|r| r.action == Action::Create),
        "{first}"
    );
    assert_eq!(
        first.resources.len(),
        7 + 11 + 1,
        "streams, buckets, object store"
    );
    // Quotas and usage: history 1, no age; per-message TTLs for its `end.<run>` markers.
    let usage = bus.js().get_stream("KV_flotilla-usage").await?;
    let usage = &usage.cached_info().config;
    assert_eq!(
        (
            usage.max_messages_per_subject,
            usage.max_age,
            usage.allow_message_ttl
        ),
        (1, std::time::Duration::ZERO, true)
    );
    // Remembered runs: one value per run, kept for `[supervisor.memory] max-age`.
    let memory = bus
        .js()
        .get_key_value("flotilla-memory")
        .await?
        .status()
        .await?;
    assert_eq!(memory.history(), 1);
    assert_eq!(memory.max_age(), opts.memory_max_age);
    assert_eq!(
        opts.memory_max_age,
        std::time::Duration::from_secs(30 * 24 * 3600)
    );
    let second = bus.provision(&opts).await?;
    assert!(!second.changed(), "{second}");
    assert!(
        second
            .resources
            .iter()
            .all(|r| r.action == Action::Unchanged),
        "{second}"
    );
    Ok(())
}

#[tokio::test]
async fn incompatible_stream_is_reported_and_nothing_changes() -> anyhow::Result<()> {
    let server = NatsServer::start().await?;
    let bus = server.bus().await?;
    // Someone created the task stream as a limits stream and put a message in it.
    bus.js()
        .create_stream(Config {
            name: "FLOTILLA_TASKS".into(),
            subjects: vec!["flotilla.task.>".into()],
            retention: RetentionPolicy::Limits,
            ..Default::default()
        })
        .await?;
    bus.js()
        .publish("flotilla.task.default.r.t", "x".into())
        .await?
        .await?;

    let err = bus
        .provision(&JetStreamOptions::default())
        .await
        .expect_err("must refuse");
    assert_eq!(err.kind(), ProvisionErrorKind::Incompatible);
    assert!(err.to_string().contains("retention"), "{err}");

    // The report says what differs.
    let p = plan(bus.js(), &Names::default(), &JetStreamOptions::default()).await?;
    let bad: Vec<_> = p.report().incompatible().collect();
    assert_eq!(bad.len(), 1);
    assert_eq!(bad[0].name, "FLOTILLA_TASKS");
    match &bad[0].action {
        Action::Incompatible { differences } => {
            assert_eq!(differences[0].field, "retention");
            assert!(differences[0].expected.contains("WorkQueue"));
            assert!(differences[0].actual.contains("Limits"));
        }
        other => panic!("unexpected {other:?}"),
    }

    // Nothing changed: the stream keeps its policy and message, nothing else was created.
    let mut tasks = bus.js().get_stream("FLOTILLA_TASKS").await?;
    let info = tasks.info().await?;
    assert_eq!(info.config.retention, RetentionPolicy::Limits);
    assert_eq!(info.state.messages, 1);
    assert!(bus.js().get_stream("FLOTILLA_INTAKE").await.is_err());
    assert!(bus.js().get_key_value("flotilla-runs").await.is_err());
    Ok(())
}

#[tokio::test]
async fn compatible_drift_is_updated() -> anyhow::Result<()> {
    let server = NatsServer::start().await?;
    let bus = server.bus().await?;
    bus.js()
        .create_stream(Config {
            name: "FLOTILLA_EVENTS".into(),
            subjects: vec!["flotilla.event.*".into()],
            max_age: Duration::from_secs(3600),
            ..Default::default()
        })
        .await?;
    let report = bus.provision(&JetStreamOptions::default()).await?;
    let events = report
        .resources
        .iter()
        .find(|r| r.name == "FLOTILLA_EVENTS")
        .expect("listed");
    match &events.action {
        Action::Update { changes } => {
            let fields: Vec<_> = changes.iter().map(|c| c.field).collect();
            assert!(fields.contains(&"max_age"), "{fields:?}");
            assert!(fields.contains(&"allow_direct"), "{fields:?}");
        }
        other => panic!("expected an update, got {other:?}"),
    }
    let mut s = bus.js().get_stream("FLOTILLA_EVENTS").await?;
    let info = s.info().await?;
    assert_eq!(
        info.config.max_age,
        JetStreamOptions::default().events_max_age
    );
    assert!(info.config.allow_direct);
    Ok(())
}

#[tokio::test]
async fn provisioned_streams_survive_a_server_restart() -> anyhow::Result<()> {
    let mut server = NatsServer::start().await?;
    let bus = server.provisioned_bus().await?;
    bus.publish(
        bus.names().submit(),
        &serde_json::json!({"plan": {"subtasks": []}}),
        Some("k1"),
    )
    .await?;
    drop(bus);
    server.restart().await?;
    let bus: Bus = server.bus().await?;
    let again = provision(bus.js(), bus.names(), &JetStreamOptions::default()).await?;
    assert!(!again.changed(), "{again}");
    let mut intake = bus.js().get_stream("FLOTILLA_INTAKE").await?;
    assert_eq!(intake.info().await?.state.messages, 1);
    Ok(())
}

#[tokio::test]
async fn custom_prefix_and_replicas_are_validated() -> anyhow::Result<()> {
    let server = NatsServer::start().await?;
    let mut o = server.nats_options();
    o.prefix = "acme".into();
    let bus = Bus::connect(&o, "t").await?;
    bus.provision(&JetStreamOptions::default()).await?;
    assert!(bus.js().get_stream("ACME_TASKS").await.is_ok());
    assert!(bus.js().get_key_value("acme-runs").await.is_ok());
    let bad = JetStreamOptions {
        replicas: 2,
        ..JetStreamOptions::default()
    };
    assert!(bus.provision(&bad).await.is_err());
    Ok(())
}
