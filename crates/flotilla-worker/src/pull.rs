//! One pull request on a queue of this worker (its pool's, or a role's): as many tasks as it
//! has free places, each started as an attempt as it arrives. The pool's loop and the role
//! loops (`worker`) share it, so both wait the same way on a request the server forgot and
//! hand back the same way on a stop; teammate turns (`turn`) pull with the same expiry.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::AckKind;
use async_nats::jetstream::consumer::PullConsumer;
use flotilla_bus::liveness::Pulse;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::attempt::handle;
use crate::claim::Claim;
use crate::shared::Shared;

/// How long one pull request waits for tasks.
pub(crate) const PULL_EXPIRY: Duration = Duration::from_secs(1);

/// How long a pull request waits while tasks flow (the last one brought some).
pub(crate) const BUSY_PULL_EXPIRY: Duration = Duration::from_millis(20);

/// A queue this worker pulls: its consumer, the pulse its loop marks, and — for a role's
/// queue — the member here that runs what it brings.
#[derive(Clone, Copy)]
pub(crate) struct Queue<'a> {
    pub(crate) consumer: &'a PullConsumer,
    pub(crate) pulse: &'a Pulse,
    pub(crate) claim: Option<&'a Claim>,
}

/// How one pull request went.
pub(crate) enum Pulled {
    /// It ended after bringing this many messages.
    Received(usize),
    /// It could not be sent; the caller asks again (after a short pause, already waited).
    Failed,
    /// The worker is stopping: what still arrived was handed back.
    Stopped,
}

/// Sends one pull request on `consumer` for `permits.len()` tasks and starts each task that
/// arrives on a permit of `permits` (one that finds none is handed back), as `claim`'s
/// member for a role queue. Pool and role loops share it, so both wait the same way on a
/// request the server forgot and hand back the same way on a stop.
pub(crate) async fn pull_once(
    shared: &Arc<Shared>,
    queue: Queue<'_>,
    permits: &mut Vec<tokio::sync::OwnedSemaphorePermit>,
    busy: bool,
    running: &mut tokio::task::JoinSet<()>,
    shutdown: &CancellationToken,
) -> Pulled {
    let Queue {
        consumer,
        pulse,
        claim,
    } = queue;
    let batch = consumer
        .batch()
        .max_messages(permits.len())
        // A pull request dies with a server restart; a short expiry bounds how long a worker
        // waits on a lost one (one tiny request per second when idle). While tasks flow,
        // requests are short, so slots freed meanwhile are asked for soon.
        .expires(if busy { BUSY_PULL_EXPIRY } else { PULL_EXPIRY })
        .messages()
        .await;
    let mut batch = match batch {
        Ok(b) => {
            pulse.pulled();
            b
        }
        Err(e) => {
            debug!(role = ?claim.map(|c| &c.role), error = %e, "Pull request failed; retrying");
            tokio::select! {
                _ = shutdown.cancelled() => return Pulled::Stopped,
                _ = tokio::time::sleep(Duration::from_millis(250)) => return Pulled::Failed,
            }
        }
    };
    // The server ends a pull request at its expiry; one it forgot (restarted) never ends, and
    // the client library would wait 5 s more. Stop waiting shortly after.
    let request_over = tokio::time::Instant::now() + PULL_EXPIRY + Duration::from_millis(500);
    let mut received = 0usize;
    loop {
        let next = tokio::select! {
            next = tokio::time::timeout_at(request_over, batch.next()) => next.unwrap_or(None),
            _ = shutdown.cancelled() => {
                // Hand back anything still arriving for this pull request.
                while let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_millis(50), batch.next()).await {
                    let _ = m.ack_with(AckKind::Nak(None)).await;
                }
                return Pulled::Stopped;
            }
        };
        match next {
            Some(Ok(msg)) => {
                pulse.pulled();
                received += 1;
                let Some(permit) = permits.pop() else {
                    let _ = msg.ack_with(AckKind::Nak(None)).await;
                    continue;
                };
                let shared = Arc::clone(shared);
                let stopping = shutdown.clone();
                let claim = claim.cloned();
                running.spawn(async move {
                    handle(&shared, msg, permit, &stopping, claim).await;
                });
            }
            Some(Err(e)) => {
                debug!(role = ?claim.map(|c| &c.role), error = %e, "Pull interrupted");
                break;
            }
            None => break,
        }
    }
    Pulled::Received(received)
}

/// One pull request of up to `max` messages on a side queue (the teammate turns, the
/// teammate inboxes), each handed to `start` as it arrives, until the request ends or its
/// expiry is well past. `false`: the worker is stopping.
pub(crate) async fn pull_each(
    consumer: &PullConsumer,
    max: usize,
    pulse: &Pulse,
    shutdown: &CancellationToken,
    mut start: impl FnMut(async_nats::jetstream::Message),
) -> bool {
    let batch = consumer
        .batch()
        .max_messages(max)
        .expires(PULL_EXPIRY)
        .messages()
        .await;
    let mut batch = match batch {
        Ok(b) => {
            pulse.pulled();
            b
        }
        Err(e) => {
            debug!(error = %e, stream = ?consumer.cached_info().stream_name, "Pull request failed; retrying");
            return tokio::select! {
                _ = shutdown.cancelled() => false,
                _ = tokio::time::sleep(Duration::from_millis(250)) => true,
            };
        }
    };
    let over = tokio::time::Instant::now() + PULL_EXPIRY + Duration::from_millis(500);
    loop {
        let next = tokio::select! {
            n = tokio::time::timeout_at(over, batch.next()) => n.unwrap_or(None),
            _ = shutdown.cancelled() => return false,
        };
        match next {
            Some(Ok(msg)) => {
                pulse.pulled();
                start(msg);
            }
            _ => return true,
        }
    }
}
