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
