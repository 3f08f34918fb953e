//! Writes ride out a stream that has no leader for a moment: on a three-node cluster with
//! two nodes down (no quorum, so no leader — what every stream a dead node led goes through
//! until a new leader is elected), a workspace append and a mailbox send wait for the
//! nodes to come back instead of failing `unavailable`, and are stored once.

mod common;

use std::time::Duration;

use flotilla_bus::{Bus, JetStreamOptions};
use flotilla_model::ids::RunId;
use flotilla_model::mailbox::MailboxKind;
use flotilla_model::subjects::StreamKind;
use flotilla_testkit::NatsCluster;
use serde_json::json;

#[tokio::test]
async fn writes_wait_for_a_stream_without_a_leader() -> anyhow::Result<()> {
    let mut cluster = NatsCluster::start(3).await?;
    let bus: Bus = cluster.bus().clone();
    bus.provision(&JetStreamOptions {
        replicas: 3,
        ..JetStreamOptions::default()
    })
    .await?;
    let run = RunId::new();
    let writer = common::task(&bus, run, "writer")?;
    writer
        .workspace()
        .append("notes", common::obj(json!({"n": 0})))
        .await?;
    // Keep the node leading the workspace stream's successor alive: the two others die.
    let ws = bus.names().stream(StreamKind::Workspace);
    let survivor = cluster.stream_leader(&ws).await.map_or(0, |l| (l + 1) % 3);
    let down: Vec<usize> = (0..3).filter(|&i| i != survivor).collect();
    for &i in &down {
        cluster.kill_node(i);
    }
    let writing = tokio::spawn(async move {
        let appended = writer
            .workspace()
            .append("notes", common::obj(json!({"n": 1})))
            .await;
        let sent = writer
            .mailbox()
            .send("reader", MailboxKind::Info, json!("hello"), None)
            .await;
        (appended, sent)
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    for &i in &down {
        cluster.start_node(i).await?;
    }
    let (appended, sent) = writing.await?;
    let appended = appended?;
    assert!(!appended.duplicate);
    assert_eq!(sent?.n, 1);
    let reader = common::task(&bus, run, "reader")?;
    let page = reader.workspace().read("notes", 0, None).await?;
    assert_eq!(page.entries.len(), 2, "each append stored once: {page:?}");
    Ok(())
}
