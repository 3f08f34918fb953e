//! Webhooks: notices POSTed to the HTTP endpoints an operator configured.
//!
//! Notices (`<prefix>.notify.<kind>.<run>`) are kept on the notice stream. Each webhook of
//! `[[supervisor.webhooks]]` reads them through its own durable consumer, `webhook-<name>`,
//! shared by the supervisor replicas — so a notice is POSTed by one replica, survives a
//! replica's death (unacknowledged, it goes to another after `timeout` plus a margin), and a
//! dead endpoint holds back only its own notices. Nothing here waits inside a run.
//!
//! One POST per delivery: the stored notice as the body, `X-Flotilla-Delivery` the notice's
//! id (the same on every retry and every replica — the receiver's idempotency key),
//! `X-Flotilla-Notice` its kind, `X-Flotilla-Attempt` the attempt, and, with a secret,
//! `X-Flotilla-Timestamp` and `X-Flotilla-Signature: sha256=<hex>`, the HMAC-SHA256 of
//! `<timestamp>.<body>` under the secret. A 2xx answer acknowledges the notice; anything else
//! (another status, a refused connection, a timeout) is retried after `backoff`, doubled per
//! attempt up to `max-backoff` (a delayed negative acknowledgement: JetStream keeps the clock,
//! not this process), until `max-attempts`, when the notice is dropped, logged and counted.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::AckKind;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::consumer::pull;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy};
use bytes::Bytes;
use flotilla_bus::liveness::Pulse;
use flotilla_model::subjects::StreamKind;
use flotilla_telemetry::InternalEvent;
use flotilla_telemetry::events::WebhookDelivery;
use futures::StreamExt;
use hmac::{Hmac, Mac};
use http_body_util::Full;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use sha2::Sha256;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::Team;
use crate::error::SupervisorError;
use crate::options::WebhookOptions;

/// POSTs one webhook has in flight at once per replica.
const CONCURRENCY: usize = 8;

/// How long past one POST's timeout a delivery may stay unacknowledged before JetStream gives
/// it to another replica.
const ACK_MARGIN: Duration = Duration::from_secs(5);

type Https = flotilla_http::HttpsConnector;

/// One configured webhook, ready to deliver.
pub(crate) struct Webhook {
    opts: WebhookOptions,
    uri: http::Uri,
    secret: Option<Vec<u8>>,
}

impl std::fmt::Debug for Webhook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret.
        f.debug_struct("Webhook")
            .field("name", &self.opts.name)
            .field("url", &self.opts.url)
            .field("signed", &self.secret.is_some())
            .finish()
    }
}

/// The consumer a webhook's deliveries come from.
pub(crate) fn consumer_name(webhook: &str) -> String {
    format!("webhook-{webhook}")
}

/// The webhooks of `team`'s options with their consumers (created or updated; see [`bind`]
/// for where a new one starts). A secret variable that is not set is an
/// error: signed deliveries were asked for.
pub(crate) async fn prepare(
    team: &Team,
    patience: &flotilla_bus::startup::Patience,
) -> Result<Vec<(Webhook, PullConsumer)>, SupervisorError> {
    let mut out = Vec::new();
    if team.opts.webhooks.is_empty() {
        return Ok(out);
    }
    let names = team.bus.names();
    let stream_name = names.stream(StreamKind::Notify);
    let stream = patience
        .ride_out("opening the notice stream", || {
            team.bus.js().get_stream(&stream_name)
        })
        .await
        .map_err(|e| {
            SupervisorError::Setup(format!(
                "opening stream {stream_name} (run `flotilla nats provision`?): {e}"
            ))
        })?;
    for opts in &team.opts.webhooks {
        let secret = match &opts.secret_env {
            Some(var) => match std::env::var(var) {
                Ok(v) if !v.is_empty() => Some(v.into_bytes()),
                _ => {
                    return Err(SupervisorError::Setup(format!(
                        "webhooks[{}].secret-env: the environment variable {var} is not set",
                        opts.name
                    )));
                }
            },
            None => {
                warn!(webhook = %opts.name, "Webhook deliveries are not signed: set secret-env");
                None
            }
        };
        let uri: http::Uri = opts
            .url
            .parse()
            .map_err(|e| SupervisorError::Setup(format!("webhooks[{}].url: {e}", opts.name)))?;
        let mut filters: Vec<String> = opts
            .kinds
            .iter()
            .map(|k| names.notify_kind(k.as_str()))
            .collect();
        filters.sort();
        filters.dedup();
        let (filter_subject, filter_subjects) = match filters.len() {
            0 => (
                names.stream_subjects(StreamKind::Notify).concat(),
                Vec::new(),
            ),
            1 => (filters.concat(), Vec::new()),
            _ => (String::new(), filters),
        };
        let durable = consumer_name(&opts.name);
        let config = |deliver_policy| pull::Config {
            durable_name: Some(durable.clone()),
            description: Some(format!(
                "Flotilla supervisors: notices to webhook {}",
                opts.name
            )),
            filter_subject: filter_subject.clone(),
            filter_subjects: filter_subjects.clone(),
            deliver_policy,
            ack_policy: AckPolicy::Explicit,
            ack_wait: opts.timeout + ACK_MARGIN,
            max_deliver: i64::from(opts.max_attempts),
            max_ack_pending: 1000,
            ..Default::default()
        };
        let consumer = bind(&stream, &durable, &opts.backfill, config)
            .await
            .map_err(|e| {
                SupervisorError::Setup(format!("creating consumer {durable} on {stream_name}: {e}"))
            })?;
        info!(webhook = %opts.name, url = %opts.url, kinds = ?opts.kinds, signed = secret.is_some(), "Delivering notices to a webhook");
        out.push((
            Webhook {
                opts: opts.clone(),
                uri,
                secret,
            },
            consumer,
        ));
    }
    Ok(out)
}

/// Creates or updates the webhook's consumer. One met for the first time starts `backfill`
/// before now (a notice published before any supervisor was up is delivered too); one that
/// exists keeps where it started — JetStream cannot change that, and its position is what
/// has been delivered — while its other settings (kinds, timeouts, attempts) follow the
/// configuration. Two replicas creating it at once: the one that loses takes the winner's.
async fn bind(
    stream: &async_nats::jetstream::stream::Stream,
    durable: &str,
    backfill: &Duration,
    config: impl Fn(DeliverPolicy) -> pull::Config,
) -> Result<PullConsumer, async_nats::Error> {
    let existing = || async {
        match stream.consumer_info(durable).await {
            Ok(info) => Ok(Some(info.config.deliver_policy)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(async_nats::Error::from(e)),
        }
    };
    let first = match existing().await? {
        Some(policy) => policy,
        None => DeliverPolicy::ByStartTime {
            start_time: time::OffsetDateTime::now_utc()
                - time::Duration::try_from(*backfill).unwrap_or(time::Duration::ZERO),
        },
    };
    match stream.create_consumer(config(first)).await {
        Ok(c) => Ok(c),
        // Created meanwhile by another replica: take its start.
        Err(e) => match existing().await? {
            Some(policy) => Ok(stream.create_consumer(config(policy)).await?),
            None => Err(e.into()),
        },
    }
}

fn is_not_found(e: &async_nats::jetstream::context::ConsumerInfoError) -> bool {
    e.kind() == async_nats::jetstream::context::ConsumerInfoErrorKind::NotFound
}

/// An HTTP(S) client on Flotilla's one outbound connector ([`flotilla_http`]).
pub(crate) fn client() -> HyperClient<Https, Full<Bytes>> {
    HyperClient::builder(TokioExecutor::new()).build(flotilla_http::https_connector())
}

/// `sha256=<hex>`: the HMAC-SHA256 of `<timestamp>.<body>` under `secret`.
pub(crate) fn signature(secret: &[u8], timestamp: &str, body: &[u8]) -> String {
    // HMAC takes a key of any length; this cannot fail.
    let mut mac = match Hmac::<Sha256>::new_from_slice(secret) {
        Ok(m) => m,
        Err(_) => return String::new(),
    };
    mac.update(timestamp.as_bytes());
    mac.update(b".");
    mac.update(body);
    let digest = mac.finalize().into_bytes();
    let mut out = String::with_capacity(7 + 64);
    out.push_str("sha256=");
    for b in digest {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// Delivers `hook`'s notices until `stop`. `pulse` marks each notice taken for the stall
/// check; waiting for a free place among the deliveries under way is busy, not stalled.
pub(crate) async fn deliver(
    team: Arc<Team>,
    hook: Webhook,
    consumer: PullConsumer,
    pulse: Pulse,
    stop: CancellationToken,
) -> Result<(), SupervisorError> {
    let http = client();
    let hook = Arc::new(hook);
    let what = format!("the notices for webhook {}", hook.opts.name);
    let places = Arc::new(Semaphore::new(CONCURRENCY));
    let mut delivering = tokio::task::JoinSet::new();
    // At most CONCURRENCY pulled at once: a delivery's acknowledgement clock starts when it is
    // pulled, so nothing waits in a local buffer while its `ack_wait` runs out (which would
    // redeliver it and spend attempts without a POST).
    while !stop.is_cancelled() {
        // One life of the message stream; the deliveries it started run on.
        let life = async {
            let Some(messages) =
                crate::messages::messages_of(&consumer, &pulse, &stop, &what, Some(CONCURRENCY))
                    .await
            else {
                return;
            };
            futures::pin_mut!(messages);
            loop {
                let place = {
                    let _full = pulse.busy();
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        p = Arc::clone(&places).acquire_owned() => match p { Ok(p) => p, Err(_) => return },
                    }
                };
                let msg = tokio::select! {
                    _ = stop.cancelled() => return,
                    m = messages.next() => match m {
                        Some(m) => m,
                        None => return,
                    },
                };
                pulse.pulled();
                let (team, hook, http) = (Arc::clone(&team), Arc::clone(&hook), http.clone());
                delivering.spawn(async move {
                    match msg {
                        Ok(msg) => deliver_one(&team, &hook, &http, msg).await,
                        Err(e) => debug!(webhook = %hook.opts.name, error = %e, "Reading notices"),
                    }
                    drop(place);
                });
                while delivering.try_join_next().is_some() {}
            }
        };
        let _ = pulse.attend(life).await;
    }
    while delivering.join_next().await.is_some() {}
    Ok(())
}

/// Why one POST failed.
#[derive(Debug, thiserror::Error)]
enum PostError {
    #[error("answered {0}")]
    Status(http::StatusCode),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("{0}")]
    Transport(String),
}

async fn deliver_one(
    team: &Team,
    hook: &Webhook,
    http: &HyperClient<Https, Full<Bytes>>,
    msg: async_nats::jetstream::Message,
) {
    let (attempt, seq) = match msg.info() {
        Ok(i) => (
            u32::try_from(i.delivered).unwrap_or(u32::MAX),
            i.stream_sequence,
        ),
        Err(_) => (1, 0),
    };
    let kind = msg
        .subject
        .split('.')
        .nth(2)
        .unwrap_or("unknown")
        .to_owned();
    let id = msg
        .headers
        .as_ref()
        .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
        .map(|v| v.as_str().to_owned())
        .unwrap_or_else(|| format!("notice.{seq}"));
    let name = hook.opts.name.as_str();
    // The POST may take up to its timeout: restart the acknowledgement clock first.
    let _ = msg.ack_with(AckKind::Progress).await;
    match post(hook, http, &id, &kind, attempt, msg.payload.clone()).await {
        Ok(()) => {
            let _ = msg.ack().await;
            debug!(webhook = name, id, attempt, "Notice delivered");
            WebhookDelivery {
                webhook: name,
                outcome: "delivered",
            }
            .emit(&team.metrics);
        }
        Err(e) if attempt >= hook.opts.max_attempts => {
            let _ = msg.ack_with(AckKind::Term).await;
            warn!(webhook = name, id, attempt, error = %e, "Notice dropped: its last delivery attempt failed");
            WebhookDelivery {
                webhook: name,
                outcome: "dropped",
            }
            .emit(&team.metrics);
        }
        Err(e) => {
            let pause = hook.opts.pause_after(attempt);
            let _ = msg.ack_with(AckKind::Nak(Some(pause))).await;
            info!(webhook = name, id, attempt, retry_in = ?pause, error = %e, "Notice delivery failed; retrying");
            WebhookDelivery {
                webhook: name,
                outcome: "retried",
            }
            .emit(&team.metrics);
        }
    }
}

async fn post(
    hook: &Webhook,
    http: &HyperClient<Https, Full<Bytes>>,
    id: &str,
    kind: &str,
    attempt: u32,
    body: Bytes,
) -> Result<(), PostError> {
    let mut req = http::Request::builder()
        .method(http::Method::POST)
        .uri(hook.uri.clone())
        .header(http::header::CONTENT_TYPE, "application/json")
        .header(
            http::header::USER_AGENT,
            concat!("flotilla/", env!("CARGO_PKG_VERSION")),
        )
        .header("x-flotilla-delivery", id)
        .header("x-flotilla-notice", kind)
        .header("x-flotilla-attempt", attempt.to_string());
    if let Some(secret) = &hook.secret {
        let ts = (time::OffsetDateTime::now_utc().unix_timestamp()).to_string();
        req = req
            .header("x-flotilla-signature", signature(secret, &ts, &body))
            .header("x-flotilla-timestamp", ts);
    }
    let req = req
        .body(Full::new(body))
        .map_err(|e| PostError::Transport(e.to_string()))?;
    let resp = match tokio::time::timeout(hook.opts.timeout, http.request(req)).await {
        Err(_) => return Err(PostError::Timeout(hook.opts.timeout)),
        Ok(Err(e)) => return Err(PostError::Transport(error_chain(&e))),
        Ok(Ok(r)) => r,
    };
    if resp.status().is_success() {
        Ok(())
    } else {
        Err(PostError::Status(resp.status()))
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_the_hmac_sha256_of_timestamp_dot_body() {
        // Computed independently: Python's hmac.new(b"s3cret", b'1700000000.{"a":1}',
        // hashlib.sha256).hexdigest().
        assert_eq!(
            signature(b"s3cret", "1700000000", br#"{"a":1}"#),
            "sha256=1698a50bc74d1ff1db85c4e0a5297c2ad9fdba245d5737cdb789e4cc6e098940"
        );
    }
}
