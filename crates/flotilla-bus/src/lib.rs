//! Flotilla's NATS layer.
//!
//! * [`options`]: connection options from config (auth as a tagged enum, TLS, redacted secrets).
//! * [`connect`](mod@connect): connecting with those options.
//! * [`provision`]: idempotent creation and drift checks of the streams and KV buckets.
//! * [`wire`]: typed, versioned messages with JSON/MessagePack codecs.
//! * [`read`]: stored messages read back by sequence (batch direct gets), the paging primitive
//!   of workspace and mailbox reads.
//! * [`server`]: a local `nats-server` child process for `flotilla up` and tests.
//! * [`Bus`]: a connected client with the installation's names.

pub mod connect;
pub mod error;
pub mod options;
pub mod provision;
pub mod read;
pub mod server;
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
/// help: an oversize message and a missing stream fail the same way every time.
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
            PublishErrorKind::NoStream,
            format!(
                "no stream captures {subject}: provision the streams first (`flotilla nats provision`, or start a coordinator)"
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
        _ => PublishError::with_source(
            PublishErrorKind::Publish,
            format!("publishing to {subject}"),
            e,
        ),
    }
}

/// A connection to NATS with JetStream and the installation's names.
#[derive(Clone, Debug)]
pub struct Bus {
    client: async_nats::Client,
    js: jetstream::Context,
    names: Names,
    /// What it connected with: exec agents get the same server and credentials.
    opts: Arc<NatsOptions>,
}

impl Bus {
    /// Connects with `opts`. `role` names the connection (`flotilla-worker`).
    pub async fn connect(opts: &NatsOptions, role: &str) -> Result<Self, ConnectError> {
        let client = connect::connect(opts, role).await?;
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
    /// (see [`classify_publish_error`]): a message that is too large or a missing stream is
    /// terminal, a lost connection or timeout is retryable.
    pub async fn publish_encoded(
        &self,
        subject: String,
        out: wire::Outgoing,
    ) -> Result<jetstream::publish::PublishAck, PublishError> {
        let size = out.payload.len();
        let fut = self
            .js
            .publish_with_headers(subject.clone(), out.headers, out.payload)
            .await
            .map_err(|e| classify_publish_error(&subject, size, self.max_payload(), e))?;
        fut.await
            .map_err(|e| classify_publish_error(&subject, size, self.max_payload(), e))
    }

    /// The largest message the connected server accepts (its `max_payload`).
    pub fn max_payload(&self) -> usize {
        match self.client.server_info().max_payload {
            0 => flotilla_model::validate::DEFAULT_MAX_PAYLOAD,
            n => n,
        }
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
