//! Long-lived pulls from durable consumers that survive a consumer's leader dying.
//!
//! A pull consumer's message stream keeps one pull request open on the consumer's leader. When
//! that leader dies (a cluster node killed), the request dies with it, and async-nats only
//! reports a missed idle heartbeat: it keeps counting the lost request's messages as pending
//! and asks again only when that request would have expired (30 s by default). Every consumer
//! of the coordinators — the run log, the intake, the workspace — then stops for that long
//! although a new leader is elected in seconds. [`until_stalled`] ends the stream at the first
//! missed heartbeat instead, so the caller's loop opens a new one at once: a fresh pull
//! request, sent again every two heartbeats until a leader takes it.
//!
//! A message that cannot be handled now is handed back with a delay that grows with its
//! deliveries ([`redelivery_delay`]); every consumer bounds its deliveries and then fails
//! visibly rather than retrying forever.

/// How long one pull request of a long-lived message stream stays open at the server. A
/// connection cut off without a word (a partition, not a crash) leaves its pull request at the
/// server, which goes on delivering to it until the request expires — those messages then wait
/// out their ack wait. A short expiry bounds that: after the client reconnects elsewhere, the
/// dead connection's request takes at most this long more. The cost is one small request per
/// expiry per idle consumer.
pub const LONG_PULL_EXPIRY: std::time::Duration = std::time::Duration::from_secs(3);

/// The idle heartbeat of a long-lived message stream's pull requests (see [`until_stalled`]).
pub const LONG_PULL_HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(1);

use async_nats::jetstream::Message;
use async_nats::jetstream::consumer::pull::{MessagesError, MessagesErrorKind};
use futures::{Stream, StreamExt};

/// `messages`, ended at its first missed idle heartbeat (see the module docs). Other errors
/// pass through for the caller to log or skip.
pub fn until_stalled<S>(messages: S) -> impl Stream<Item = Result<Message, MessagesError>>
where
    S: Stream<Item = Result<Message, MessagesError>>,
{
    messages.take_while(|m| {
        let stalled = matches!(m, Err(e) if e.kind() == MessagesErrorKind::MissingHeartbeat);
        if stalled {
            tracing::debug!("A pull consumer missed its heartbeat; pulling again");
        }
        futures::future::ready(!stalled)
    })
}

/// How long a message handed back after a failed try waits before its next delivery:
/// `first`, doubling with each delivery up to `max`. A fault that lasts (a leader election,
/// NATS restarting) is retried without a storm; the caller bounds the deliveries and ends
/// in a visible failure.
pub fn redelivery_delay(
    delivered: i64,
    first: std::time::Duration,
    max: std::time::Duration,
) -> std::time::Duration {
    let doublings = u32::try_from(delivered.saturating_sub(1).clamp(0, 16)).unwrap_or(16);
    first.saturating_mul(1 << doublings).min(max)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::redelivery_delay;

    #[test]
    fn redeliveries_back_off_to_a_ceiling() {
        let (first, max) = (Duration::from_secs(1), Duration::from_secs(30));
        let delays: Vec<u64> = (0..8)
            .map(|d| redelivery_delay(d, first, max).as_secs())
            .collect();
        assert_eq!(delays, [1, 1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(redelivery_delay(i64::MAX, first, max), max);
    }
}
