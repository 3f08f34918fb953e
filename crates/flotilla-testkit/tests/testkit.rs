//! The test kit itself, against real servers.

use std::time::Duration;

use anyhow::Context;
use flotilla_testkit::{NatsCluster, NatsServer};
use futures::StreamExt;

#[tokio::test]
async fn server_starts_on_a_free_port_and_serves_jetstream() -> anyhow::Result<()> {
    let a = NatsServer::start().await?;
    let b = NatsServer::start().await?;
    assert_ne!(a.port(), b.port());
    let client = a.client().await?;
    let js = async_nats::jetstream::new(client);
    js.query_account().await.context("JetStream answers")?;
    Ok(())
}

#[tokio::test]
async fn streams_survive_a_restart() -> anyhow::Result<()> {
    let mut server = NatsServer::start().await?;
    let port = server.port();
    {
        let js = async_nats::jetstream::new(server.client().await?);
        js.create_stream(async_nats::jetstream::stream::Config {
            name: "KEEP".into(),
            subjects: vec!["keep.>".into()],
            ..Default::default()
        })
        .await?;
        js.publish("keep.one", "1".into()).await?.await?;
    }
    server.restart().await?;
    assert_eq!(server.port(), port, "restart keeps the port");
    let js = async_nats::jetstream::new(server.client().await?);
    let mut stream = js.get_stream("KEEP").await?;
    assert_eq!(stream.info().await?.state.messages, 1);
    Ok(())
}

#[tokio::test]
async fn a_killed_server_comes_back_with_its_data() -> anyhow::Result<()> {
    let mut server = NatsServer::start().await?;
    let client = server.client().await?;
    let js = async_nats::jetstream::new(client.clone());
    let kv = js
        .create_key_value(async_nats::jetstream::kv::Config {
            bucket: "k".into(),
            ..Default::default()
        })
        .await?;
    kv.put("a", "1".into()).await?;
    server.kill();
    server.start_again().await?;
    // The original client reconnects by itself.
    let value = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Ok(v) = kv.get("a").await {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await?;
    assert_eq!(value.as_deref(), Some(&b"1"[..]));
    Ok(())
}

#[tokio::test]
async fn user_password_and_token_auth_are_enforced() -> anyhow::Result<()> {
    let server = NatsServer::builder()
        .user_password("svc", "pw")
        .start()
        .await?;
    server.client().await.context("right credentials")?;
    let anonymous =
        flotilla_bus::connect::connect(&flotilla_bus::NatsOptions::with_url(server.url()), "t")
            .await;
    assert_eq!(
        anonymous.expect_err("no credentials").kind(),
        flotilla_bus::ConnectErrorKind::Authentication
    );

    let server = NatsServer::builder().token("t0k3n").start().await?;
    server.client().await.context("right token")?;
    let mut wrong = server.nats_options();
    wrong.auth = flotilla_bus::NatsAuth::Token {
        token: flotilla_bus::Secret::new("nope"),
    };
    let err = flotilla_bus::connect::connect(&wrong, "t")
        .await
        .expect_err("wrong token");
    assert_eq!(err.kind(), flotilla_bus::ConnectErrorKind::Authentication);
    Ok(())
}

#[tokio::test]
async fn three_node_cluster_replicates() -> anyhow::Result<()> {
    let cluster = NatsCluster::start(3).await?;
    let client = flotilla_bus::connect::connect(&cluster.nats_options(), "t").await?;
    let js = async_nats::jetstream::new(client.clone());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "R3".into(),
        subjects: vec!["r3.>".into()],
        num_replicas: 3,
        ..Default::default()
    })
    .await?;
    // The stream's placement reaches every server of the cluster shortly after it is
    // created: until then a publish through another server finds no stream.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match js.publish("r3.x", "x".into()).await?.await {
            Ok(_) => break,
            Err(_) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
    let mut sub = client.subscribe("r3.echo").await?;
    client.publish("r3.echo", "hi".into()).await?;
    assert!(sub.next().await.is_some());
    let mut s = js.get_stream("R3").await?;
    assert_eq!(s.info().await?.config.num_replicas, 3);
    Ok(())
}

/// The proxy forwards, holds a blackholed link open without a byte through it, and heals.
#[tokio::test]
async fn a_blackholed_proxy_forwards_nothing_and_closes_nothing() -> anyhow::Result<()> {
    use flotilla_testkit::proxy::TcpProxy;
    let server = NatsServer::start().await?;
    let proxy = TcpProxy::start(&server.url()).await?;
    // Pings far apart: the client must not give the link up during the test.
    let client = async_nats::ConnectOptions::new()
        .ping_interval(Duration::from_secs(600))
        .request_timeout(Some(Duration::from_millis(500)))
        .connect(proxy.url())
        .await?;
    let direct = server.client().await?;
    let mut echo = direct.subscribe("echo").await?;
    direct.flush().await?;
    tokio::spawn(async move {
        while let Some(m) = echo.next().await {
            if let Some(reply) = m.reply {
                let _ = direct.publish(reply, m.payload).await;
            }
        }
    });
    // The first answer may be slow on a busy machine: ask until one comes.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while let Err(e) = client.request("echo", "a".into()).await {
        if tokio::time::Instant::now() > deadline {
            return Err(e).context("no answer through the proxy");
        }
    }
    assert_eq!((proxy.accepted(), proxy.connections()), (1, 1));

    proxy.blackhole();
    let cut = client.request("echo", "b".into()).await;
    assert!(cut.is_err(), "a request crossed a blackholed link: {cut:?}");
    assert_eq!(proxy.connections(), 1, "the link stays open");
    assert_eq!(
        client.connection_state(),
        async_nats::connection::State::Connected,
        "the client was told nothing"
    );

    proxy.heal();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match client.request("echo", "c".into()).await {
            Ok(m) => {
                assert_eq!(&m.payload[..], b"c");
                break;
            }
            Err(e) if tokio::time::Instant::now() > deadline => {
                return Err(e).context("the healed link does not carry requests");
            }
            Err(_) => {}
        }
    }
    assert_eq!(proxy.accepted(), 1, "the same connection carried on");
    Ok(())
}
