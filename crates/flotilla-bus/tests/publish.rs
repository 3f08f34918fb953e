//! How publishes fail and recover, against real nats-servers: a stream that does not exist
//! is a terminal error (provision first); a stream without a leader — a cluster node died and
//! a new leader is not elected yet, which JetStream answers exactly like a missing stream —
//! is retryable, and [`Bus::publish_retrying`] rides it out.

use std::time::Duration;

use flotilla_bus::{Bus, PublishErrorKind, Retry, wire};
use flotilla_model::codec::Codec;
use flotilla_testkit::{NatsCluster, NatsServer};

#[tokio::test]
async fn a_subject_no_stream_captures_is_a_terminal_error() -> anyhow::Result<()> {
    let server = NatsServer::start().await?;
    let bus = server.bus().await?; // not provisioned
    let err = bus
        .publish(bus.names().runlog(flotilla_model::RunId::new()), &"x", None)
        .await
        .expect_err("no stream");
    assert_eq!(err.kind(), PublishErrorKind::NoStream, "{err}");
    assert_eq!(err.kind().retry(), Retry::Terminal);
    assert!(err.to_string().contains("flotilla nats provision"), "{err}");
    // The retrying publish gives up on it at once.
    let started = tokio::time::Instant::now();
    let out = wire::encode(&"x", Codec::Json, Some("id-1"))?;
    let err = bus
        .publish_retrying("nowhere.x".into(), out, started + Duration::from_secs(30))
        .await
        .expect_err("no stream");
    assert_eq!(err.kind(), PublishErrorKind::NoStream, "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
    Ok(())
}

#[tokio::test]
async fn a_stream_without_a_leader_is_retryable_and_ridden_out() -> anyhow::Result<()> {
    let mut cluster = NatsCluster::start(3).await?;
    let bus: Bus = cluster.bus().clone();
    bus.js()
        .create_stream(async_nats::jetstream::stream::Config {
            name: "LEADERLESS".into(),
            subjects: vec!["leaderless.>".into()],
            num_replicas: 3,
            ..Default::default()
        })
        .await?;
    bus.publish("leaderless.a".into(), &"first", None).await?;
    // Two of three nodes down: the stream has no quorum, so no leader takes publishes.
    let survivor = cluster
        .stream_leader("LEADERLESS")
        .await
        .map_or(0, |l| (l + 1) % 3);
    let down: Vec<usize> = (0..3).filter(|&i| i != survivor).collect();
    for &i in &down {
        cluster.kill_node(i);
    }
    let err = bus
        .publish("leaderless.b".into(), &"while down", None)
        .await
        .expect_err("no leader");
    assert_eq!(err.kind(), PublishErrorKind::Unavailable, "{err}");
    assert_eq!(err.kind().retry(), Retry::Retryable);
    // A retrying publish started now is stored once the nodes are back.
    let publishing = {
        let bus = bus.clone();
        let out = wire::encode(&"retried", Codec::Json, Some("retried-1"))?;
        tokio::spawn(async move {
            bus.publish_retrying(
                "leaderless.c".into(),
                out,
                tokio::time::Instant::now() + Duration::from_secs(90),
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    for &i in &down {
        cluster.start_node(i).await?;
    }
    let ack = publishing.await??;
    assert!(!ack.duplicate);
    let mut stream = bus.js().get_stream("LEADERLESS").await?;
    assert_eq!(stream.info().await?.state.messages, 2, "first and retried");
    Ok(())
}
