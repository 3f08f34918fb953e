//! The workspace watcher: turns a topic's entries into `topic_written` run-log inputs, so a
//! task that consumes a topic starts when the topic gets its first entry — from any writer:
//! an agent, the CLI, a plain JetStream publish.
//!
//! Coordinators share one durable consumer on the workspace stream. For each valid entry on
//! `<prefix>.ws.<root>.<topic>` they append `topic_written {topic, seq}` to the root run's
//! log, with the message id `topic.<root>.<topic>`: repeats within the duplicate window are
//! dropped by JetStream, and a recently announced `(root, topic)` is not announced again by
//! this coordinator. The run machine ignores topics it does not wait for, so a late or
//! repeated announcement changes nothing. Entries of automatic produce (the coordinator's
//! own, marked `Flotilla-Produced-By`) are skipped: the machine counted them when it
//! decided to write them.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use async_nats::jetstream::AckKind;
use async_nats::jetstream::consumer::PullConsumer;
use flotilla_bus::liveness::Pulse;
use flotilla_bus::{Bus, wire};
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::ids::RunId;
use flotilla_model::runlog::{RunInput, RunLogEntry};
use flotilla_model::workspace::{PRODUCED_BY_HEADER, WorkspaceWrite};
use futures::StreamExt;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// `(root, topic)` pairs announced recently; forgotten wholesale past this many.
const RECENT_CAPACITY: usize = 50_000;

/// Entries announced at once.
const CONCURRENCY: usize = 64;

/// Deliveries of an entry whose announcement keeps failing (the run log refusing it) before
/// it is set aside with an error line: about five minutes, pausing 1 s doubling to 30 s.
const MAX_DELIVERIES: i64 = 15;

/// Consumes the workspace stream until `shutdown`. `pulse` marks each pull for the stall
/// check; waiting for a free place among the announcements under way is busy, not stalled.
pub(crate) async fn watch_workspace(
    bus: Bus,
    consumer: PullConsumer,
    pulse: Pulse,
    shutdown: CancellationToken,
) {
    let recent: Arc<Mutex<HashSet<(RunId, String)>>> = Arc::default();
    let prefix: Arc<str> = format!("{}.ws.", bus.names().prefix()).into();
    let places = Arc::new(Semaphore::new(CONCURRENCY));
    let mut announcing = tokio::task::JoinSet::new();
    while !shutdown.is_cancelled() {
        // One life of the message stream; the announcements it started run on.
        let life = async {
            let messages = match consumer
                .stream()
                .max_messages_per_batch(256)
                .heartbeat(crate::PULL_HEARTBEAT)
                .expires(flotilla_bus::consume::LONG_PULL_EXPIRY)
                .messages()
                .await
            {
                Ok(m) => m,
                Err(e) => {
                    warn!(error = %e, "Cannot pull from the workspace stream; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => {}
                        _ = tokio::time::sleep(std::time::Duration::from_millis(500)) => {}
                    }
                    return;
                }
            };
            pulse.pulled();
            // A lost pull request (its consumer's leader died) ends the stream: pull again.
            let messages = flotilla_bus::consume::until_stalled(messages);
            futures::pin_mut!(messages);
            loop {
                let place = {
                    let _full = pulse.busy();
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        p = Arc::clone(&places).acquire_owned() => match p { Ok(p) => p, Err(_) => return },
                    }
                };
                let msg = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    m = messages.next() => match m {
                        Some(Ok(m)) => m,
                        Some(Err(_)) => continue,
                        None => return,
                    },
                };
                pulse.pulled();
                let (bus, recent, prefix) = (bus.clone(), Arc::clone(&recent), Arc::clone(&prefix));
                announcing.spawn(async move {
                    match announce(&bus, &recent, &prefix, &msg).await {
                        Ok(()) => {
                            let _ = msg.ack().await;
                        }
                        Err(e) => {
                            let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
                            if delivered >= MAX_DELIVERIES {
                                // Tasks consuming the topic wait for their dependency timeout,
                                // which fails them visibly.
                                tracing::error!(subject = %msg.subject, delivered, error = %e, "Could not announce a workspace entry, delivery after delivery; terminating it");
                                let _ = msg.ack_with(AckKind::Term).await;
                            } else {
                                let pause = flotilla_bus::consume::redelivery_delay(
                                    delivered,
                                    std::time::Duration::from_secs(1),
                                    crate::MAX_REDELIVERY_DELAY,
                                );
                                warn!(subject = %msg.subject, delivered, retry_in = ?pause, error = %e, "Could not announce a workspace entry; it will be redelivered");
                                let _ = msg.ack_with(AckKind::Nak(Some(pause))).await;
                            }
                        }
                    }
                    drop(place);
                });
                while announcing.try_join_next().is_some() {}
            }
        };
        let _ = pulse.attend(life).await;
    }
    while announcing.join_next().await.is_some() {}
}

/// Announces one entry to its root run, unless there is nothing to announce.
async fn announce(
    bus: &Bus,
    recent: &Mutex<HashSet<(RunId, String)>>,
    prefix: &str,
    msg: &async_nats::jetstream::Message,
) -> Result<(), flotilla_bus::PublishError> {
    if wire::header(msg.headers.as_ref(), PRODUCED_BY_HEADER).is_some() {
        return Ok(());
    }
    let Some((root, topic)) = msg
        .subject
        .strip_prefix(prefix)
        .and_then(|rest| rest.split_once('.'))
        .and_then(|(root, topic)| Some((root.parse::<RunId>().ok()?, topic.to_owned())))
    else {
        debug!(subject = %msg.subject, "Workspace subject without a run id; ignoring");
        return Ok(());
    };
    if wire::decode::<WorkspaceWrite>(msg.headers.as_ref(), &msg.payload).is_err() {
        warn!(subject = %msg.subject, "A message on a workspace subject is not a workspace write; it does not count as an entry");
        return Ok(());
    }
    let key = (root, topic);
    if recent.lock().map(|r| r.contains(&key)).unwrap_or(false) {
        return Ok(());
    }
    let seq = msg.info().map(|i| i.stream_sequence).unwrap_or_default();
    let (root, topic) = key;
    let entry = RunLogEntry {
        protocol: PROTOCOL_VERSION,
        run_id: root,
        input: RunInput::TopicWritten {
            topic: topic.clone(),
            seq,
        },
    };
    bus.publish(
        bus.names().runlog(root),
        &entry,
        Some(&format!("topic.{root}.{topic}")),
    )
    .await?;
    if let Ok(mut r) = recent.lock() {
        if r.len() >= RECENT_CAPACITY {
            r.clear();
        }
        r.insert((root, topic));
    }
    Ok(())
}
