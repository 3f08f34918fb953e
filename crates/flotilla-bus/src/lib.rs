//! Flotilla's NATS layer.
//!
//! * [`options`]: connection options from config (auth as a tagged enum, TLS, redacted secrets).
//! * [`connect`](mod@connect): connecting with those options.
//! * [`provision`]: idempotent creation and drift checks of the streams and KV buckets.
//! * [`wire`]: typed, versioned messages with JSON/MessagePack codecs.
//! * [`liveness`]: a watchdog that restarts a pull loop which stopped pulling while its
//!   consumer holds messages.
//! * [`startup`]: start-up steps that ride out a cluster's leader election.
//! * [`read`]: stored messages read back by sequence (batch direct gets), the paging primitive
//!   of workspace and mailbox reads.
//! * [`server`]: a local `nats-server` child process for `flotilla up` and tests.
//! * [`Bus`]: a connected client with the installation's names.

pub mod connect;
pub mod consume;
pub mod error;
pub mod liveness;
pub mod mirror;
pub mod options;
pub mod provision;
pub mod read;
pub mod server;
pub mod service;
pub mod startup;
pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, kv};
use flotilla_model::codec::Codec;
use flotilla_model::subjects::{Bucket, Names, StreamKind};
use serde::Serialize;

pub use error::{
    ConnectError, ConnectErrorKind, ProvisionError, ProvisionErrorKind, PublishError,
    PublishErrorKind, ReadError, ReadErrorKind, Retry,
};
pub use options::{NatsAuth, NatsOptions, Secret, TlsOptions};
pub use provision::JetStreamOptions;
pub use read::StoredMessage;

/// A durable pull consumer shared by every replica of a role (coordinators on the intake and
/// run log, a pool's workers on the task stream).
#[derive(Debug, Clone)]
pub struct SharedConsumer {
    /// The stream it reads.
    pub stream: StreamKind,
    /// Durable name.
    pub durable: String,
    /// Shown in server monitoring.
    pub description: String,
    /// Subject filters (one or more).
    pub filters: Vec<String>,
    /// How long a delivered message may stay unacknowledged before redelivery.
    pub ack_wait: Duration,
    /// Most unacknowledged messages across all replicas.
    pub max_ack_pending: i64,
}

/// Maps a JetStream publish error to a [`PublishError`] whose kind says whether retrying can
/// help: an oversize message fails the same way every time; a publish no stream took ("no
/// responders", "temporarily unavailable", "not leader") is [`PublishErrorKind::Unavailable`]
/// — retryable — because a stream without a leader for a moment (a cluster node died) and a
/// stream that does not exist look the same here. [`Bus::publish_encoded`] tells them apart
/// when a publish fails that way (see [`Bus::confirm_unavailable`]).
pub fn classify_publish_error(
    subject: &str,
    size: usize,
    max_payload: usize,
    e: jetstream::context::PublishError,
) -> PublishError {
    use jetstream::context::PublishErrorKind as K;
    let code = std::error::Error::source(&e)
        .and_then(|s| s.downcast_ref::<jetstream::Error>())
        .map(jetstream::Error::error_code);
    match e.kind() {
        K::MaxPayloadExceeded => PublishError::with_source(
            PublishErrorKind::TooLarge,
            format!(
                "a {size}-byte message to {subject} exceeds the server's max payload of {max_payload} bytes"
            ),
            e,
        ),
        K::StreamNotFound => PublishError::with_source(
            PublishErrorKind::Unavailable,
            format!(
                "no stream took the message to {subject} (a cluster leader election, or the streams are not provisioned)"
            ),
            e,
        ),
        K::WrongLastSequence => PublishError::with_source(
            PublishErrorKind::NotFirst,
            format!("{subject} already has a first message"),
            e,
        ),
        _ if code == Some(jetstream::ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM) => {
            PublishError::with_source(
                PublishErrorKind::TooLarge,
                format!(
                    "a {size}-byte message to {subject} exceeds the stream's message size limit"
                ),
                e,
            )
        }
        _ if code == Some(jetstream::ErrorCode::STREAM_NOT_FOUND) => PublishError::with_source(
            PublishErrorKind::NoStream,
            format!(
                "no stream captures {subject}: provision the streams first (`flotilla nats provision`)"
            ),
            e,
        ),
        _ if code.is_some_and(is_leaderless) => PublishError::with_source(
            PublishErrorKind::Unavailable,
            format!(
                "the stream of {subject} has no leader for a moment (a cluster leader election)"
            ),
            e,
        ),
        _ => PublishError::with_source(
            PublishErrorKind::Publish,
            format!("publishing to {subject}"),
            e,
        ),
    }
}

/// JetStream's answers while a stream or the cluster has no leader: refused, nothing stored.
fn is_leaderless(code: jetstream::ErrorCode) -> bool {
    use jetstream::ErrorCode as C;
    [
        C::CLUSTER_NOT_AVAILABLE,
        C::CLUSTER_NOT_LEADER,
        C::CLUSTER_NOT_ACTIVE,
        C::CLUSTER_NOT_ASSIGNED,
    ]
    .contains(&code)
}

/// How long [`Bus::confirm_unavailable`] waits for JetStream to say which stream captures a
/// subject. The question goes to the cluster's meta leader, which may itself be the node that
/// died: no answer is no confirmation, and the failure stays retryable.
const STREAM_LOOKUP_TIMEOUT: Duration = Duration::from_secs(1);

/// The first pause of [`Bus::publish_retrying`]; it doubles up to [`MAX_RETRY_PAUSE`].
const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(50);
/// The longest pause between two tries of [`Bus::publish_retrying`].
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// A connection to NATS with JetStream and the installation's names.
#[derive(Clone, Debug)]
pub struct Bus {
    client: async_nats::Client,
    js: jetstream::Context,
    names: Names,
    /// What it connected with: exec agents get the same server and credentials.
    opts: Arc<NatsOptions>,
    /// The connected server's `max_payload`, read once per connection: it is asked on every
    /// publish that checks a size, and the client's server info is a copy of many strings.
    max_payload: Arc<MaxPayload>,
}

/// The server's `max_payload` as last read, and whether the client connected again since.
#[derive(Debug, Default)]
struct MaxPayload {
    bytes: std::sync::atomic::AtomicUsize,
    reconnected: Arc<std::sync::atomic::AtomicBool>,
}

impl Bus {
    /// Connects with `opts`. `role` names the connection (`flotilla-worker`).
    pub async fn connect(opts: &NatsOptions, role: &str) -> Result<Self, ConnectError> {
        let max_payload = Arc::new(MaxPayload::default());
        let client = connect::connect_noting_reconnects(
            opts,
            role,
            Some(Arc::clone(&max_payload.reconnected)),
        )
        .await?;
        max_payload.bytes.store(
            server_max_payload(&client),
            std::sync::atomic::Ordering::Release,
        );
        let names = Names::new(&opts.prefix).map_err(|e| {
            ConnectError::new(
                ConnectErrorKind::InvalidOptions,
                format!("nats.prefix {:?} {e}", opts.prefix),
            )
        })?;
        let mut js = jetstream::new(client.clone());
        js.set_timeout(opts.request_timeout);
        Ok(Self {
            client,
            js,
            names,
            opts: Arc::new(opts.clone()),
            max_payload,
        })
    }

    /// The options this bus connected with (URLs, credentials, timeouts). The worker hands
    /// the same server and credentials to the agents it runs.
    pub fn options(&self) -> &NatsOptions {
        &self.opts
    }

    /// The core NATS client.
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// The JetStream context.
    pub fn js(&self) -> &jetstream::Context {
        &self.js
    }

    /// Subject, stream and bucket names.
    pub fn names(&self) -> &Names {
        &self.names
    }

    /// Provisions streams and buckets (idempotent).
    pub async fn provision(
        &self,
        opts: &JetStreamOptions,
    ) -> Result<provision::ProvisionReport, ProvisionError> {
        provision::provision(&self.js, &self.names, opts).await
    }

    /// Creates, or updates to `spec`, a shared durable pull consumer: explicit acks, every
    /// message from the start, and no server-side delivery limit — each role decides what
    /// repeated delivery means (the worker turns it into a failed attempt).
    pub async fn shared_consumer(
        &self,
        spec: SharedConsumer,
    ) -> Result<PullConsumer, ProvisionError> {
        let name = self.names.stream(spec.stream);
        let stream = self.js.get_stream(&name).await.map_err(|e| {
            ProvisionError::with_source(
                ProvisionErrorKind::Server,
                format!("opening stream {name} (run `flotilla nats provision`?)"),
                e,
            )
        })?;
        let durable = spec.durable.clone();
        let (filter_subject, filter_subjects) = match <[String; 1]>::try_from(spec.filters) {
            Ok([one]) => (one, Vec::new()),
            Err(many) => (String::new(), many),
        };
        stream
            .create_consumer(pull::Config {
                durable_name: Some(spec.durable),
                description: Some(spec.description),
                filter_subject,
                filter_subjects,
                deliver_policy: DeliverPolicy::All,
                ack_policy: AckPolicy::Explicit,
                ack_wait: spec.ack_wait,
                max_deliver: -1,
                max_ack_pending: spec.max_ack_pending,
                ..Default::default()
            })
            .await
            .map_err(|e| {
                ProvisionError::with_source(
                    ProvisionErrorKind::Server,
                    format!("creating consumer {durable} on {name}"),
                    e,
                )
            })
    }

    /// Opens a KV bucket (it must have been provisioned).
    pub async fn kv(&self, bucket: Bucket) -> Result<kv::Store, ProvisionError> {
        let name = self.names.bucket(bucket);
        self.js.get_key_value(&name).await.map_err(|e| {
            ProvisionError::with_source(
                ProvisionErrorKind::Server,
                format!("opening bucket {name} (run `flotilla nats provision`?)"),
                e,
            )
        })
    }

    /// Publishes a typed message to JetStream and waits for the stream's acknowledgement.
    pub async fn publish<T: Serialize + ?Sized>(
        &self,
        subject: String,
        value: &T,
        msg_id: Option<&str>,
    ) -> Result<jetstream::publish::PublishAck, PublishError> {
        let out = wire::encode(value, Codec::Json, msg_id)?;
        self.publish_encoded(subject, out).await
    }

    /// Publishes an encoded message and waits for the acknowledgement. Errors are classified
    /// (see [`classify_publish_error`]): a message that is too large or a stream JetStream
    /// confirms missing is terminal; a lost connection, a timeout or a stream without a leader
    /// for a moment is retryable. The confirmation costs a request only when no stream took
    /// the message.
    pub async fn publish_encoded(
        &self,
        subject: String,
        out: wire::Outgoing,
    ) -> Result<jetstream::publish::PublishAck, PublishError> {
        let size = out.payload.len();
        let acked = match self
            .js
            .publish_with_headers(subject.clone(), out.headers, out.payload)
            .await
        {
            Ok(fut) => fut.await,
            Err(e) => Err(e),
        };
        match acked {
            Ok(ack) => Ok(ack),
            Err(e) => {
                let e = classify_publish_error(&subject, size, self.max_payload(), e);
                Err(self.confirm_unavailable(&subject, e).await)
            }
        }
    }

    /// For a publish that failed [`Unavailable`](PublishErrorKind::Unavailable): asks
    /// JetStream (`$JS.API.STREAM.NAMES`, answered by the meta leader) whether any stream
    /// captures `subject`. None does → [`NoStream`](PublishErrorKind::NoStream), terminal:
    /// the deployment is not provisioned. One does → still `Unavailable`, naming the stream
    /// without a leader. No answer within a second (the meta leader died too) → unchanged.
    /// Any other error is returned as it is.
    pub async fn confirm_unavailable(&self, subject: &str, e: PublishError) -> PublishError {
        if e.kind() != PublishErrorKind::Unavailable {
            return e;
        }
        use jetstream::context::GetStreamByNameErrorKind as K;
        match tokio::time::timeout(STREAM_LOOKUP_TIMEOUT, self.js.stream_by_subject(subject))
            .await
        {
            Ok(Ok(stream)) => e.reclassified(
                PublishErrorKind::Unavailable,
                format!(
                    "stream {stream} did not take the message to {subject}: it has no leader for a moment (a cluster node died; a new leader is being elected)"
                ),
            ),
            Ok(Err(lookup)) if matches!(lookup.kind(), K::NotFound) => e.reclassified(
                PublishErrorKind::NoStream,
                format!(
                    "no stream captures {subject}: provision the streams first (`flotilla nats provision`, or start a coordinator)"
                ),
            ),
            _ => e,
        }
    }

    /// Publishes like [`publish_encoded`](Self::publish_encoded), riding out transient
    /// faults until `until`: a stream without a leader for a moment (nothing was stored, so
    /// sending again is always safe) and — only for a message with a `Nats-Msg-Id`, which
    /// JetStream de-duplicates — a timeout or lost connection, after which the first send may
    /// have been stored. Pauses start at 50 ms and double up to 1 s; the last failure is
    /// returned when `until` passes, and a terminal one (too large, no stream) at once. The
    /// first send costs nothing extra.
    pub async fn publish_retrying(
        &self,
        subject: String,
        out: wire::Outgoing,
        until: tokio::time::Instant,
    ) -> Result<jetstream::publish::PublishAck, PublishError> {
        let idempotent = out
            .headers
            .get(async_nats::header::NATS_MESSAGE_ID)
            .is_some();
        let mut pause = FIRST_RETRY_PAUSE;
        loop {
            let e = match self.publish_encoded(subject.clone(), out.clone()).await {
                Ok(ack) => return Ok(ack),
                Err(e) => e,
            };
            let again = match e.kind() {
                PublishErrorKind::Unavailable => true,
                k => idempotent && k.retry() == Retry::Retryable,
            };
            if !again || tokio::time::Instant::now() + pause > until {
                return Err(e);
            }
            tracing::debug!(%subject, error = %e, "Publish not taken yet; sending again");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_RETRY_PAUSE);
        }
    }

    /// The largest message the connected server accepts (its `max_payload`).
    pub fn max_payload(&self) -> usize {
        use std::sync::atomic::Ordering;
        let cached = &self.max_payload;
        if cached.reconnected.swap(false, Ordering::AcqRel) {
            cached
                .bytes
                .store(server_max_payload(&self.client), Ordering::Release);
        }
        cached.bytes.load(Ordering::Acquire)
    }

    /// Waits until JetStream answers API requests (after a connect or a server restart).
    pub async fn wait_for_jetstream(&self, timeout: Duration) -> Result<(), ProvisionError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut backoff = Duration::from_millis(5);
        loop {
            match self.js.query_account().await {
                Ok(_) => return Ok(()),
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(ProvisionError::with_source(
                        ProvisionErrorKind::JetStreamUnavailable,
                        "JetStream did not answer",
                        e,
                    ));
                }
                Err(_) => {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(200));
                }
            }
        }
    }
}

/// The connected server's `max_payload` (the NATS default before a server said otherwise).
fn server_max_payload(client: &async_nats::Client) -> usize {
    match client.server_info().max_payload {
        0 => flotilla_model::validate::DEFAULT_MAX_PAYLOAD,
        n => n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(code: u64) -> jetstream::context::PublishError {
        let body = format!(r#"{{"code":503,"err_code":{code},"description":"refused"}}"#);
        let e: jetstream::Error = serde_json::from_str(&body).expect("an API error");
        jetstream::context::PublishError::with_source(
            jetstream::context::PublishErrorKind::Other,
            e,
        )
    }

    #[test]
    fn publishes_refused_for_want_of_a_leader_are_retryable() {
        for code in [10008, 10009, 10006, 10007] {
            let e = classify_publish_error("s", 1, 10, refused(code));
            assert_eq!(e.kind(), PublishErrorKind::Unavailable, "{code}: {e}");
            assert_eq!(e.kind().retry(), Retry::Retryable);
        }
        let e = classify_publish_error(
            "s",
            1,
            10,
            jetstream::context::PublishError::new(
                jetstream::context::PublishErrorKind::StreamNotFound,
            ),
        );
        assert_eq!(e.kind(), PublishErrorKind::Unavailable, "{e}");
        // A stream JetStream reports missing, and an oversize message, stay terminal.
        assert_eq!(
            classify_publish_error("s", 1, 10, refused(10059)).kind(),
            PublishErrorKind::NoStream
        );
        assert_eq!(
            classify_publish_error("s", 1, 10, refused(10054)).kind(),
            PublishErrorKind::TooLarge
        );
    }
}
