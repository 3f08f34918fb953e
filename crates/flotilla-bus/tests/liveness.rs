//! The stall check of pull loops against a real nats-server: a loop whose pull never returns
//! while its consumer holds messages is restarted by the watchdog — the stall reported with
//! the consumer, the pending messages and the silence, and counted in
//! `flotilla_consumer_stalls_total` — and the restarted loop takes the messages; a loop that
//! waits for capacity on purpose (busy) with messages pending is left alone.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use flotilla_bus::liveness::{Pulse, Stall, Watchdog};
use flotilla_bus::{Bus, SharedConsumer};
use flotilla_model::subjects::StreamKind;
use flotilla_telemetry::events::ConsumerStalled;
use flotilla_telemetry::{InternalEvent, Metrics};
use flotilla_testkit::NatsServer;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

const HEARTBEAT: Duration = Duration::from_millis(200);

async fn pool(bus: &Bus, pool: &str) -> anyhow::Result<PullConsumer> {
    Ok(bus
        .shared_consumer(SharedConsumer {
            stream: StreamKind::Tasks,
            durable: bus.names().pool_consumer(pool),
            description: "a test pool".into(),
            filters: vec![bus.names().pool_filter(pool)],
            ack_wait: Duration::from_secs(30),
            max_ack_pending: 1000,
            only_new: false,
        })
        .await?)
}

async fn publish(bus: &Bus, pool: &str, n: usize) -> anyhow::Result<()> {
    for i in 0..n {
        let subject = format!("{}.task.{pool}.run.t{i}", bus.names().prefix());
        bus.publish(subject, &i, None).await?;
    }
    Ok(())
}

/// One pull of up to 10 messages, acknowledged; how many came.
async fn pull(consumer: &PullConsumer, pulse: &Pulse) -> anyhow::Result<usize> {
    let mut batch = consumer
        .batch()
        .max_messages(10)
        .expires(Duration::from_millis(100))
        .messages()
        .await?;
    pulse.pulled();
    let mut n = 0;
    while let Some(Ok(m)) = batch.next().await {
        pulse.pulled();
        m.ack().await.map_err(anyhow::Error::msg)?;
        n += 1;
    }
    Ok(n)
}

#[tokio::test]
async fn a_loop_that_stops_pulling_with_messages_pending_is_restarted_and_counted()
-> anyhow::Result<()> {
    let server = NatsServer::start().await?;
    let bus = server.provisioned_bus().await?;
    let metrics = Metrics::new();
    let seen: Arc<Mutex<Vec<Stall>>> = Arc::default();
    let watchdog = {
        let (metrics, seen) = (metrics.clone(), Arc::clone(&seen));
        Watchdog::new(
            HEARTBEAT,
            Arc::new(move |s: &Stall| {
                ConsumerStalled {
                    stream: &s.stream,
                    consumer: &s.consumer,
                    pending: s.pending,
                    since_pull: s.since_pull,
                }
                .emit(&metrics);
                seen.lock().expect("not poisoned").push(s.clone());
            }),
        )
    };
    let stuck = pool(&bus, "stuck").await?;
    let saturated = pool(&bus, "saturated").await?;
    let stuck_pulse = watchdog.watch(&stuck);
    let saturated_pulse = watchdog.watch(&saturated);
    let stop = CancellationToken::new();
    let watching = tokio::spawn(Arc::clone(&watchdog).run(stop.clone()));

    // The first pull never returns (the test hook: what a forgotten pull request or an await
    // that never ends looks like to the loop); the next ones take what is there.
    let taken = tokio::spawn({
        let (consumer, pulse) = (stuck.clone(), stuck_pulse.clone());
        async move {
            let mut lives = 0;
            let mut taken = 0;
            while taken < 5 {
                lives += 1;
                let first = lives == 1;
                let pulled = pulse
                    .attend(async {
                        if first {
                            pulse.pulled();
                            std::future::pending::<()>().await;
                        }
                        pull(&consumer, &pulse).await
                    })
                    .await;
                if let Some(n) = pulled {
                    taken += n?;
                }
            }
            anyhow::Ok(lives)
        }
    });
    // The saturated loop waits for capacity that never comes, saying so.
    let busy = saturated_pulse.busy();
    publish(&bus, "stuck", 5).await?;
    publish(&bus, "saturated", 5).await?;

    let lives = tokio::time::timeout(Duration::from_secs(30), taken).await???;
    assert!(lives >= 2, "the loop was started again ({lives} lives)");
    let stalls = seen.lock().expect("not poisoned").clone();
    assert_eq!(stalls.len(), 1, "{stalls:?}");
    assert_eq!(stalls[0].consumer, bus.names().pool_consumer("stuck"));
    assert_eq!(stalls[0].stream, bus.names().stream(StreamKind::Tasks));
    assert_eq!(stalls[0].pending, 5);
    assert!(stalls[0].since_pull >= HEARTBEAT * 2, "{stalls:?}");
    let text = metrics.encode()?;
    assert!(
        text.contains(
            "flotilla_consumer_stalls_total{stream=\"FLOTILLA_TASKS\",consumer=\"pool-stuck\"} 1\n"
        ),
        "{text}"
    );

    // Busy all along, with five messages pending: never flagged. Once capacity is back, the
    // loop has two heartbeats to pull, and does.
    tokio::time::sleep(HEARTBEAT * 4).await;
    assert!(
        !metrics.encode()?.contains("consumer=\"pool-saturated\""),
        "a loop waiting for capacity on purpose is not stalled"
    );
    drop(busy);
    let mut taken = 0;
    while taken < 5 {
        taken += pull(&saturated, &saturated_pulse).await?;
    }
    assert_eq!(seen.lock().expect("not poisoned").len(), 1);
    stop.cancel();
    watching.await?;
    Ok(())
}
