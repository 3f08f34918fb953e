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
    // The client may be reconnecting to the survivor (it was connected to a killed node): a
    // publish sent meanwhile times out, which says nothing of the stream. Once connected, the
    // answer for the stream is "unavailable".
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let err = loop {
        let err = bus
            .publish("leaderless.b".into(), &"while down", None)
            .await
            .expect_err("no leader");
        if err.kind() == PublishErrorKind::Unavailable
            || tokio::time::Instant::now() >= deadline
            || bus.client().connection_state() == async_nats::connection::State::Connected
                && !err.to_string().contains("timed out")
        {
            break err;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
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

/// A pull stream whose consumer's leader dies loses its pull request; async-nats reports only
/// missed heartbeats and asks again when the lost request would have expired (30 s).
/// [`flotilla_bus::consume::until_stalled`] ends the stream at the first missed heartbeat, so a
/// new pull reaches the new leader within seconds and a message published meanwhile arrives.
#[tokio::test]
async fn a_pull_outlives_its_consumers_leader() -> anyhow::Result<()> {
    use async_nats::jetstream::consumer::pull;
    use futures::StreamExt;

    let mut cluster = NatsCluster::start(3).await?;
    let bus: Bus = cluster.bus().clone();
    let stream = bus
        .js()
        .create_stream(async_nats::jetstream::stream::Config {
            name: "PULLED".into(),
            subjects: vec!["pulled.>".into()],
            num_replicas: 3,
            ..Default::default()
        })
        .await?;
    let mut consumer: async_nats::jetstream::consumer::PullConsumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("pulling".into()),
            num_replicas: 3,
            ..Default::default()
        })
        .await?;
    let heartbeat = Duration::from_secs(1);
    let open = |c: async_nats::jetstream::consumer::PullConsumer| async move {
        let m = c.stream().heartbeat(heartbeat).messages().await?;
        anyhow::Ok(Box::pin(flotilla_bus::consume::until_stalled(m)))
    };
    let mut messages = open(consumer.clone()).await?;
    bus.publish("pulled.a".into(), &"before", None).await?;
    let first = tokio::time::timeout(Duration::from_secs(10), messages.next())
        .await?
        .ok_or_else(|| anyhow::anyhow!("ended"))??;
    first.ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;

    let leader = consumer
        .info()
        .await?
        .cluster
        .as_ref()
        .and_then(|c| c.leader.clone())
        .and_then(|l| cluster.node_index(&l))
        .ok_or_else(|| anyhow::anyhow!("the consumer has no leader"))?;
    cluster.kill_node(leader);
    let killed = tokio::time::Instant::now();
    // The stream ends (a missed heartbeat) well before the lost request's 30 s expiry.
    while let Some(m) = tokio::time::timeout(Duration::from_secs(15), messages.next()).await? {
        let _ = m; // errors while reconnecting pass through
    }
    assert!(killed.elapsed() < Duration::from_secs(15));
    // Pulling again reaches the new leader: a message published now arrives.
    bus.publish_retrying(
        "pulled.b".into(),
        wire::encode(&"after", Codec::Json, Some("after-1"))?,
        tokio::time::Instant::now() + Duration::from_secs(30),
    )
    .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let got = loop {
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "nothing delivered");
        let mut messages = match open(consumer.clone()).await {
            Ok(m) => m,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        match tokio::time::timeout(Duration::from_secs(5), messages.next()).await {
            Ok(Some(Ok(m))) => break m,
            _ => continue,
        }
    };
    assert_eq!(got.subject.as_str(), "pulled.b");
    assert!(
        killed.elapsed() < Duration::from_secs(25),
        "{:?} after the kill",
        killed.elapsed()
    );
    Ok(())
}
