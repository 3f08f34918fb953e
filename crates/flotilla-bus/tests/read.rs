//! Direct-get reads against a real nats-server.

use flotilla_bus::ReadErrorKind;
use flotilla_model::subjects::StreamKind;
use flotilla_testkit::NatsServer;

#[tokio::test]
async fn batches_page_through_a_filter_in_order() -> anyhow::Result<()> {
    let server = NatsServer::start().await?;
    let bus = server.provisioned_bus().await?;
    let js = bus.js();
    // Interleave two filters so the sequences of one have gaps.
    for i in 0..25u32 {
        js.publish(format!("flotilla.ws.r1.t{}", i % 2), i.to_string().into())
            .await?
            .await?;
        js.publish("flotilla.ws.r2.other", "x".into())
            .await?
            .await?;
    }
    let mut seen = Vec::new();
    let mut after = 0;
    loop {
        let page = bus
            .direct_batch(StreamKind::Workspace, "flotilla.ws.r1.*", after, 7, None)
            .await?;
        let Some(last) = page.last() else { break };
        assert!(page.len() <= 7);
        after = last.seq;
        let more = last.num_pending > 0;
        for m in &page {
            assert!(m.subject.starts_with("flotilla.ws.r1."), "{}", m.subject);
            assert!(m.ts_ms > 0);
            seen.push(String::from_utf8(m.payload.to_vec())?);
        }
        if !more {
            break;
        }
    }
    let expected: Vec<String> = (0..25).map(|i: u32| i.to_string()).collect();
    assert_eq!(seen, expected, "every message once, in order");

    // Past the end, and a filter with no messages: empty, not an error.
    assert!(
        bus.direct_batch(StreamKind::Workspace, "flotilla.ws.r1.*", after, 7, None)
            .await?
            .is_empty()
    );
    assert!(
        bus.direct_batch(StreamKind::Workspace, "flotilla.ws.none.*", 0, 7, None)
            .await?
            .is_empty()
    );
    // A byte bound still returns at least one message.
    let small = bus
        .direct_batch(StreamKind::Workspace, "flotilla.ws.r1.*", 0, 100, Some(1))
        .await?;
    assert!(!small.is_empty() && small.len() < 25, "{}", small.len());
    Ok(())
}

#[tokio::test]
async fn last_and_single_gets() -> anyhow::Result<()> {
    let server = NatsServer::start().await?;
    let bus = server.provisioned_bus().await?;
    assert!(
        bus.last_for_subject(StreamKind::Mailbox, "flotilla.mbox.r.a.b")
            .await?
            .is_none()
    );
    let first = bus
        .js()
        .publish("flotilla.mbox.r.a.b", "1".into())
        .await?
        .await?;
    bus.js()
        .publish("flotilla.mbox.r.a.b", "2".into())
        .await?
        .await?;
    let last = bus
        .last_for_subject(StreamKind::Mailbox, "flotilla.mbox.r.a.b")
        .await?
        .expect("stored");
    assert_eq!(&last.payload[..], b"2");
    assert_eq!(last.subject, "flotilla.mbox.r.a.b");
    let one = bus
        .direct_get(StreamKind::Mailbox, first.sequence)
        .await?
        .expect("stored");
    assert_eq!(&one.payload[..], b"1");
    assert!(bus.direct_get(StreamKind::Mailbox, 999).await?.is_none());
    Ok(())
}

#[tokio::test]
async fn a_missing_stream_is_a_terminal_error() -> anyhow::Result<()> {
    let server = NatsServer::start().await?;
    let bus = server.bus().await?; // not provisioned
    let err = bus
        .direct_batch(StreamKind::Workspace, "flotilla.ws.x.*", 0, 10, None)
        .await
        .expect_err("no stream");
    assert_eq!(err.kind(), ReadErrorKind::NoStream, "{err}");
    let err = bus
        .last_for_subject(StreamKind::Workspace, "flotilla.ws.x.y")
        .await
        .expect_err("no stream");
    assert_eq!(err.kind(), ReadErrorKind::NoStream, "{err}");
    Ok(())
}

/// `find_in_subject` finds a stored message, a message published while it waits, nothing
/// (at its deadline), and keeps waiting across a server restart: a message published by
/// another connection right after the restart is found promptly (whether this connection's
/// subscription was back in time for it or the stream is read again after the reconnect —
/// which of the two depends on timing this test does not control).
#[tokio::test]
async fn find_in_subject_finds_stored_live_and_missed_messages() -> anyhow::Result<()> {
    use std::time::Duration;
    use tokio::time::Instant;
    let mut server = NatsServer::start().await?;
    let bus = server.provisioned_bus().await?;
    let subject = "flotilla.event.r1";
    let wanted = |want: &'static str| {
        move |_: Option<&async_nats::HeaderMap>, payload: &[u8]| {
            (payload == want.as_bytes()).then(|| want.to_owned())
        }
    };
    let soon = || Instant::now() + Duration::from_secs(10);
    bus.js().publish(subject, "a".into()).await?.await?;
    let found = bus
        .find_in_subject(StreamKind::Events, subject, soon(), wanted("a"))
        .await?;
    assert_eq!(found.as_deref(), Some("a"));

    // Published while waiting.
    let waiting = {
        let bus = bus.clone();
        tokio::spawn(async move {
            bus.find_in_subject(StreamKind::Events, subject, soon(), wanted("b"))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    bus.js().publish(subject, "b".into()).await?.await?;
    assert_eq!(waiting.await??.as_deref(), Some("b"));

    // Nothing by the deadline.
    let none = bus
        .find_in_subject(
            StreamKind::Events,
            subject,
            Instant::now() + Duration::from_millis(300),
            wanted("never"),
        )
        .await?;
    assert_eq!(none, None);

    // Published by another connection right after a restart.
    let waiting = {
        let bus = bus.clone();
        tokio::spawn(async move {
            let t0 = Instant::now();
            let found = bus
                .find_in_subject(
                    StreamKind::Events,
                    subject,
                    Instant::now() + Duration::from_secs(60),
                    wanted("c"),
                )
                .await;
            (found, t0.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    server.kill();
    server.start_again().await?;
    let other = server.bus().await?;
    other.js().publish(subject, "c".into()).await?.await?;
    let (found, took) = waiting.await?;
    assert_eq!(found?.as_deref(), Some("c"));
    assert!(
        took < flotilla_bus::read::QUIET_RECHECK,
        "found only after {took:?}"
    );
    Ok(())
}
