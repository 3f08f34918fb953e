//! The messages of a shared consumer, as one long-lived stream opened again while the server
//! cannot open it: how the event follower (`follow`), the teammate inboxes (`teammates`) and
//! the webhook deliveries (`webhooks`) read their consumers.

use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use flotilla_bus::liveness::Pulse;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// The message stream of a shared consumer (`what` names it in the log), retried every second
/// while the server cannot open it; `None` once `stop` is cancelled. `batch`: the most
/// messages pulled at once (`None`: the client's default). Opening it counts as a pull of
/// `pulse`.
pub(crate) async fn messages_of(
    consumer: &PullConsumer,
    pulse: &Pulse,
    stop: &CancellationToken,
    what: &str,
    batch: Option<usize>,
) -> Option<async_nats::jetstream::consumer::pull::Stream> {
    while !stop.is_cancelled() {
        let opened = match batch {
            Some(n) => {
                consumer
                    .stream()
                    .max_messages_per_batch(n)
                    .heartbeat(flotilla_bus::consume::LONG_PULL_HEARTBEAT)
                    .expires(flotilla_bus::consume::LONG_PULL_EXPIRY)
                    .messages()
                    .await
            }
            None => {
                consumer
                    .stream()
                    .heartbeat(flotilla_bus::consume::LONG_PULL_HEARTBEAT)
                    .expires(flotilla_bus::consume::LONG_PULL_EXPIRY)
                    .messages()
                    .await
            }
        };
        match opened {
            Ok(m) => {
                pulse.pulled();
                return Some(m);
            }
            Err(e) => {
                warn!(error = %e, "Cannot read {what}; retrying");
                tokio::select! {
                    _ = stop.cancelled() => return None,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        }
    }
    None
}
