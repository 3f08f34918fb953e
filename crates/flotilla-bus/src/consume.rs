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
