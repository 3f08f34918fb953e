//! Flotilla's NATS layer.
//!
//! * [`options`]: connection options from config (auth as a tagged enum, TLS, redacted secrets).
//! * [`connect`](mod@connect): connecting with those options (a silent link is given up
//!   within three pings, and the client reconnects to another server).
//! * [`link`]: what a connection has seen — its server, reconnects, and the permission
//!   violations the server reported, which turn a refused operation into
//!   `permission_denied` at once instead of a timeout.
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
pub mod link;
pub mod liveness;
pub mod mirror;
pub mod options;
pub mod provision;
pub mod read;
pub mod server;
pub mod service;
pub mod startup;
pub mod wire;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, kv};
use flotilla_model::codec::Codec;
use flotilla_model::subjects::{Bucket, Names, StreamKind};
use serde::Serialize;

pub use error::{
    ConnectError, ConnectErrorKind, ProvisionError, ProvisionErrorKind, PublishError,
    PublishErrorKind, ReadError, ReadErrorKind, Retry,
};
pub use link::{Link, Refusal};
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
    /// Created to deliver only messages stored from then on (`DeliverPolicy::New`), not the
    /// stream's history: for a consumer added to a stream that other readers already looked
    /// after (the workers' teammate inboxes, on a deployment with mail from before).
    pub only_new: bool,
}

impl SharedConsumer {
    /// The JetStream API subject that creates (or updates) it on `stream`, as async-nats
    /// sends it: the filter is part of the subject when there is exactly one.
    fn create_subject(&self, stream: &str) -> String {
        match self.filters.as_slice() {
            [one] => format!("$JS.API.CONSUMER.CREATE.{stream}.{}.{one}", self.durable),
            _ => format!("$JS.API.CONSUMER.CREATE.{stream}.{}", self.durable),
        }
    }

    /// What a user needs in its publish allow list (`deploy/nats/accounts.conf`) to use it:
    /// create it, read its info, pull from it and acknowledge, each line quoted as the file
    /// writes them.
    pub fn permission_lines(&self, stream: &str) -> Vec<String> {
        let durable = &self.durable;
        [
            self.create_subject(stream),
            format!("$JS.API.CONSUMER.INFO.{stream}.{durable}"),
            format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"),
            format!("$JS.ACK.{stream}.{durable}.>"),
        ]
        .into_iter()
        .map(|l| format!("\"{l}\""))
        .collect()
    }
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
        _ if code == Some(jetstream::ErrorCode::STREAM_STORE_FAILED)
            && e.to_string().contains("maximum bytes exceeded") =>
        {
            PublishError::with_source(
                PublishErrorKind::StreamFull,
                format!(
                    "the stream of {subject} holds its max_bytes and refuses the {size}-byte message"
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
    max_payload: Arc<std::sync::atomic::AtomicUsize>,
    /// What the connection has seen: reconnects (the cached `max_payload` is then out of
    /// date) and the server's refusals.
    link: Arc<Link>,
    /// The tenant it connected for (`nats.tenant`), kept apart from the resolved options
    /// (whose prefix and user carry it written out).
    tenant: Option<Arc<str>>,
}

impl Bus {
    /// Connects with `opts`. `role` names the connection (`flotilla-worker`).
    pub async fn connect(opts: &NatsOptions, role: &str) -> Result<Self, ConnectError> {
        let (client, link) = connect::connect_watched(opts, role).await?;
        let tenant = opts.tenant.as_deref().map(Arc::from);
        let opts = &opts.resolved();
        let max_payload = Arc::new(std::sync::atomic::AtomicUsize::new(server_max_payload(
            &client,
        )));
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
            link,
            tenant,
        })
    }

    /// The tenant this connection acts for (`nats.tenant`); `None` for the deployment's own
    /// installation, and for a process given resolved options (an exec agent), whose names
    /// carry the tenant's prefix all the same.
    pub fn tenant(&self) -> Option<&str> {
        self.tenant.as_deref()
    }

    /// What the connection has seen: its server, and the server's recent refusals.
    pub fn link(&self) -> &Link {
        &self.link
    }

    /// Runs `op` — a request, JetStream API call or publish whose subjects `is_ours` accepts
    /// — and answers the server's refusal instead of its outcome: at once when the server
    /// reports a permissions violation for one of those subjects (or for the reply inbox)
    /// while `op` runs, and when `op` fails (a timeout, typically) after such a report.
    /// Refusals of other subjects pass by. The server reports violations asynchronously,
    /// so without this a refused request only times out.
    pub async fn refusable<T, E>(
        &self,
        is_ours: impl Fn(&str) -> bool,
        op: impl Future<Output = Result<T, E>>,
    ) -> Result<Result<T, E>, Refusal> {
        let since = Instant::now();
        let mut refusals = self.link.watch();
        let mut watching = true;
        tokio::pin!(op);
        loop {
            tokio::select! {
                biased;
                out = &mut op => {
                    return match out {
                        Ok(v) => Ok(Ok(v)),
                        Err(e) => match self.link.refused_since(since, &is_ours) {
                            Some(refusal) => Err(refusal),
                            None => Ok(Err(e)),
                        },
                    };
                }
                r = refusals.recv(), if watching => match r {
                    Ok(refusal) if refusal.concerns(&is_ours) => return Err(refusal),
                    Ok(_) => {}
                    // Missed announcements are still kept: look there.
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                        if let Some(refusal) = self.link.refused_since(since, &is_ours) {
                            return Err(refusal);
                        }
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => watching = false,
                },
            }
        }
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
        self.refusable(
            |s| s.starts_with("$JS.API."),
            provision::provision(&self.js, &self.names, opts),
        )
        .await
        .unwrap_or_else(|refusal| {
            Err(ProvisionError::new(
                ProvisionErrorKind::PermissionDenied,
                format!(
                    "provisioning streams and buckets: {refusal}; provision with credentials allowed to create streams (the operator's or the coordinator's in deploy/nats/accounts.conf)"
                ),
            ))
        })
    }

    /// Creates, or updates to `spec`, a shared durable pull consumer: explicit acks, every
    /// message from the start, and no server-side delivery limit — each role decides what
    /// repeated delivery means (the worker turns it into a failed attempt).
    ///
    /// A user whose permissions do not allow the consumer gets
    /// [`PermissionDenied`](ProvisionErrorKind::PermissionDenied) as soon as the server
    /// refuses it, with the lines to add to its permissions
    /// ([`SharedConsumer::permission_lines`]).
    pub async fn shared_consumer(
        &self,
        spec: SharedConsumer,
    ) -> Result<PullConsumer, ProvisionError> {
        let name = self.names.stream(spec.stream);
        let info = format!("$JS.API.STREAM.INFO.{name}");
        let create = spec.create_subject(&name);
        // Several filters: async-nats names the consumer without them.
        let create_prefix = format!("$JS.API.CONSUMER.CREATE.{name}.{}.", spec.durable);
        let lines = spec.permission_lines(&name);
        let durable = spec.durable.clone();
        let is_ours = |s: &str| s == info || s == create || s.starts_with(&create_prefix);
        let created = self.refusable(is_ours, self.create_shared_consumer(&name, spec));
        created.await.unwrap_or_else(|refusal| {
            let add = if refusal.subject == info {
                format!("\"{info}\"")
            } else {
                lines.join(" ")
            };
            Err(ProvisionError::new(
                ProvisionErrorKind::PermissionDenied,
                format!(
                    "creating consumer {durable} on {name}: {refusal}; add to the publish allow list of {} in deploy/nats/accounts.conf: {add}",
                    self.link.user()
                ),
            ))
        })
    }

    async fn create_shared_consumer(
        &self,
        name: &str,
        spec: SharedConsumer,
    ) -> Result<PullConsumer, ProvisionError> {
        let stream = self.js.get_stream(name).await.map_err(|e| {
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
                deliver_policy: if spec.only_new {
                    DeliverPolicy::New
                } else {
                    DeliverPolicy::All
                },
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
        let info = format!("$JS.API.STREAM.INFO.KV_{name}");
        match self
            .refusable(|s| s == info, self.js.get_key_value(&name))
            .await
        {
            Ok(Ok(store)) => Ok(store),
            Ok(Err(e)) => Err(ProvisionError::with_source(
                ProvisionErrorKind::Server,
                format!("opening bucket {name} (run `flotilla nats provision`?)"),
                e,
            )),
            Err(refusal) => Err(ProvisionError::new(
                ProvisionErrorKind::PermissionDenied,
                format!("opening bucket {name}: {refusal}"),
            )),
        }
    }

    /// Publishes an answer on a client's reply subject (core NATS, JSON). A terminal answer
    /// carries `id` as its `Nats-Msg-Id` (`finished.<run>`, `rejected.<run>`): a stream
    /// capturing the subject drops a repeat, and a client can recognise one (a process that
    /// dies between answering and recording that it did is repeated by its successor).
    /// Failures are logged: the answer is best effort, as every core publish is.
    pub async fn publish_reply<T: Serialize + ?Sized>(
        &self,
        to: &str,
        answer: &T,
        id: Option<&str>,
    ) {
        match wire::encode(answer, Codec::Json, id) {
            Ok(out) => {
                if let Err(e) = self
                    .client
                    .publish_with_headers(to.to_owned(), out.headers, out.payload)
                    .await
                {
                    tracing::warn!(subject = to, error = %e, "Could not answer on reply_to");
                }
            }
            Err(e) => tracing::warn!(error = %e, "Could not encode an answer"),
        }
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
        let acked = self.refusable(|s| s == subject, async {
            match self
                .js
                .publish_with_headers(subject.clone(), out.headers, out.payload)
                .await
            {
                Ok(fut) => fut.await,
                Err(e) => Err(e),
            }
        });
        match acked.await {
            Ok(Ok(ack)) => Ok(ack),
            Ok(Err(e)) => {
                let e = classify_publish_error(&subject, size, self.max_payload(), e);
                Err(self.confirm_unavailable(&subject, e).await)
            }
            Err(refusal) => Err(PublishError::new(
                PublishErrorKind::PermissionDenied,
                refusal.to_string(),
            )),
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
        if self.link.take_reconnected() {
            self.max_payload
                .store(server_max_payload(&self.client), Ordering::Release);
        }
        self.max_payload.load(Ordering::Acquire)
    }

    /// Waits until JetStream answers API requests (after a connect or a server restart).
    pub async fn wait_for_jetstream(&self, timeout: Duration) -> Result<(), ProvisionError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut backoff = Duration::from_millis(5);
        loop {
            let answered = self.refusable(|s| s == "$JS.API.INFO", self.js.query_account());
            match answered.await.map_err(|refusal| {
                ProvisionError::new(
                    ProvisionErrorKind::PermissionDenied,
                    format!("asking JetStream for the account's info: {refusal}"),
                )
            })? {
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
