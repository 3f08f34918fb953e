//! `KvMirror` against a real nats-server: a process's note of its own write never puts back
//! an older value than the watch has already delivered (two writers of one key, one slow to
//! note what it wrote), and a note ahead of the watch is not undone by the watch catching up.

use std::time::Duration;

use flotilla_bus::mirror::KvMirror;
use flotilla_model::subjects::Bucket;
use flotilla_testkit::NatsServer;
use tokio_util::sync::CancellationToken;

async fn until(mirror: &KvMirror<u32>, key: &str, want: u32) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        if mirror.get(key).map(|m| m.value) == Some(want) {
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the mirror has {:?}, not {want}",
            mirror.get(key).map(|m| (m.value, m.revision))
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_late_note_of_an_older_write_keeps_the_newer_value() -> anyhow::Result<()> {
    let server = NatsServer::start().await?;
    let bus = server.provisioned_bus().await?;
    let kv = bus.kv(Bucket::Team).await?;
    let stop = CancellationToken::new();
    let mirror: KvMirror<u32> = KvMirror::new();
    mirror.follow(kv.clone(), stop.clone());
    mirror.synced().await;

    // This process writes 1; another writer writes 2 on top; the watch delivers both.
    let mine = kv.put("agent.a", b"1".to_vec().into()).await?;
    let theirs = kv.update("agent.a", b"2".to_vec().into(), mine).await?;
    until(&mirror, "agent.a", 2).await?;
    // Only now does this process note its own (older) write: the newer value stays.
    mirror.note("agent.a", 1, 0, mine);
    let now = mirror.get("agent.a").map(|m| (m.value, m.revision));
    assert_eq!(now, Some((2, theirs)));

    // A note ahead of the watch is kept while the watch catches up to it.
    let next = kv.update("agent.a", b"3".to_vec().into(), theirs).await?;
    mirror.note("agent.a", 3, 0, next);
    assert_eq!(mirror.get("agent.a").map(|m| m.value), Some(3));
    let last = kv.update("agent.a", b"4".to_vec().into(), next).await?;
    until(&mirror, "agent.a", 4).await?;
    assert_eq!(mirror.get("agent.a").map(|m| m.revision), Some(last));
    stop.cancel();
    Ok(())
}
