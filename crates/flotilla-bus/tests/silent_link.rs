//! A bus whose link to its server goes silent — packets dropped, nothing closed — on a
//! three-node cluster, each node behind a proxy the test blackholes: the bus notices within
//! three pings, reconnects to another node, and what was in flight ends or carries on.

use std::time::Duration;

use anyhow::{Context, anyhow, ensure};
use flotilla_bus::{Bus, NatsOptions};
use flotilla_testkit::NatsCluster;
use flotilla_testkit::proxy::TcpProxy;
use futures::StreamExt;

/// Generous bounds for conditions polled on a shared machine (never asserted as timings).
const WAIT: Duration = Duration::from_secs(60);

/// Polls `check` until it holds or [`WAIT`] passes.
async fn until<F, Fut>(what: &str, mut check: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    while !check().await {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

#[tokio::test]
async fn a_silent_link_is_left_for_another_node_and_nothing_waits_forever() -> anyhow::Result<()> {
    let cluster = NatsCluster::start(3).await?;
    let mut proxies = Vec::new();
    for url in cluster.urls() {
        proxies.push(TcpProxy::start(&url).await?);
    }
    let opts = NatsOptions {
        urls: proxies.iter().map(TcpProxy::url).collect(),
        // The nodes advertise their own addresses, which the cut would not reach.
        discover_servers: false,
        ping_interval: Duration::from_millis(500),
        request_timeout: Duration::from_secs(2),
        ..NatsOptions::default()
    };
    let bus = Bus::connect(&opts, "silent-link-test").await?;
    let first = proxies
        .iter()
        .position(|p| p.connections() == 1)
        .ok_or_else(|| anyhow!("the bus is connected through no proxy"))?;
    ensure!(
        bus.link().server().as_deref() == Some(proxies[first].addr().to_string().as_str()),
        "the bus names its server: {:?}",
        bus.link().server()
    );

    // Someone on the cluster, not behind a proxy, answers requests and publishes.
    let direct = cluster.bus().client().clone();
    let mut echo = direct.subscribe("link.echo").await?;
    let answering = direct.clone();
    let responder = tokio::spawn(async move {
        while let Some(m) = echo.next().await {
            if let Some(reply) = m.reply {
                let _ = answering.publish(reply, m.payload).await;
            }
        }
    });
    direct.flush().await?;
    let mut sub = bus.client().subscribe("link.news").await?;
    bus.client().flush().await?;
    // The responder's interest reaches the other nodes over the cluster's routes a moment
    // after it subscribed: ask until it answers.
    until("a request answered before the cut", || async {
        bus.client()
            .request("link.echo", "before".into())
            .await
            .is_ok()
    })
    .await?;

    proxies[first].blackhole();
    let cut_at = tokio::time::Instant::now();
    // In flight on the dead link: it ends at the request timeout, it does not hang.
    let in_flight = tokio::time::timeout(WAIT, bus.client().request("link.echo", "cut".into()))
        .await
        .context("a request on the silent link never ended")?;
    ensure!(
        in_flight.is_err(),
        "answered across a blackhole: {in_flight:?}"
    );

    // The bus gives the link up and connects through another proxy, to another node.
    until("reconnected elsewhere", || async {
        bus.client().connection_state() == async_nats::connection::State::Connected
            && bus.link().server().as_deref() != Some(proxies[first].addr().to_string().as_str())
            && proxies
                .iter()
                .enumerate()
                .any(|(i, p)| i != first && p.connections() == 1)
    })
    .await?;
    eprintln!(
        "reconnected through another node {:?} after the cut",
        cut_at.elapsed()
    );

    // Requests are answered again; the subscription made before the cut was made again on
    // the new connection; JetStream answers.
    until("a request answered after the reconnect", || async {
        bus.client()
            .request("link.echo", "after".into())
            .await
            .is_ok()
    })
    .await?;
    let news = async {
        loop {
            direct.publish("link.news", "n".into()).await?;
            direct.flush().await?;
            if let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(200), sub.next()).await
            {
                return anyhow::Ok(m);
            }
        }
    };
    let m = tokio::time::timeout(WAIT, news)
        .await
        .context("the old subscription receives nothing after the reconnect")??;
    ensure!(&m.payload[..] == b"n");
    bus.wait_for_jetstream(WAIT).await?;
    responder.abort();
    Ok(())
}
