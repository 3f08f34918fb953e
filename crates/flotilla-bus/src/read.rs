//! Reading stored messages back: JetStream direct gets.
//!
//! Workspace and mailbox reads page through a stream by sequence: "the messages matching this
//! filter after sequence S, oldest first". A batch direct get (ADR-31) answers exactly that in
//! one request, from any replica of the stream, without creating a consumer:
//!
//! ```text
//! client ──{"seq": S+1, "next_by_subj": F, "batch": N, "max_bytes": B}──► $JS.API.DIRECT.GET.<stream>
//!        ◄── message (Nats-Sequence, Nats-Subject, Nats-Time-Stamp, Nats-Num-Pending) × ≤ N
//!        ◄── status 204 EOB                      (or a single 404 when nothing matches)
//! ```
//!
//! Every stored message is reachable by paging with the last sequence of the previous page,
//! so reads are lossless. `Nats-Num-Pending` on a message counts the matching messages stored
//! after it, which tells a reader whether there is more without another request.
//!
//! Direct gets may be answered by a follower replica, which can lag the leader by a moment in
//! a cluster: a reader may briefly not see a write that was just acknowledged. Callers that
//! depend on the newest state (mailbox numbering) recheck it with expected-sequence headers.

use std::time::Duration;

use async_nats::HeaderMap;
use bytes::Bytes;
use flotilla_model::subjects::{Bucket, StreamKind};
use futures::StreamExt;
use serde::Serialize;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::Bus;
use crate::error::{ReadError, ReadErrorKind, Retry};

/// `Nats-Num-Pending`: matching messages stored after this one (batch direct gets).
pub const NATS_NUM_PENDING: &str = "Nats-Num-Pending";

/// A message as stored in a stream.
#[derive(Debug, Clone)]
pub struct StoredMessage {
    /// Stream sequence.
    pub seq: u64,
    /// The subject it was published to.
    pub subject: String,
    /// Its headers (the publisher's, plus the server's `Nats-*` headers of the reply).
    pub headers: HeaderMap,
    /// Its body.
    pub payload: Bytes,
    /// When the server stored it (Unix milliseconds, server clock).
    pub ts_ms: i64,
    /// Messages matching the request's filter stored after this one (0 for single gets).
    pub num_pending: u64,
}

/// The body of a direct get request (ADR-31).
#[derive(Debug, Default, Serialize)]
struct DirectGetRequest<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    seq: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    next_by_subj: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    batch: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_bytes: Option<usize>,
}

/// What one reply message of a direct get is.
enum Reply {
    Message(Box<StoredMessage>),
    EndOfBatch,
    NotFound,
}

impl Bus {
    /// The messages of stream `kind` matching `filter` (wildcards allowed) with a sequence
    /// above `after_seq`, oldest first: at most `batch` of them, and — when `max_bytes` is
    /// given — stopping once about that many bytes were sent (always at least one message).
    /// Nothing matching is an empty list, not an error. Page on with the last message's
    /// `seq`; its `num_pending` says whether more are stored.
    pub async fn direct_batch(
        &self,
        kind: StreamKind,
        filter: &str,
        after_seq: u64,
        batch: usize,
        max_bytes: Option<usize>,
    ) -> Result<Vec<StoredMessage>, ReadError> {
        let stream = self.names().stream(kind);
        self.direct_batch_stream(&stream, filter, after_seq, batch, max_bytes)
            .await
    }

    /// [`direct_batch`](Self::direct_batch) on a stream named directly (a KV bucket's
    /// `KV_<bucket>` stream, for instance).
    pub async fn direct_batch_stream(
        &self,
        stream: &str,
        filter: &str,
        after_seq: u64,
        batch: usize,
        max_bytes: Option<usize>,
    ) -> Result<Vec<StoredMessage>, ReadError> {
        if batch == 0 {
            return Ok(Vec::new());
        }
        let request = DirectGetRequest {
            seq: Some(after_seq.saturating_add(1)),
            next_by_subj: Some(filter),
            batch: Some(batch),
            // The server reads a signed 64-bit count: a larger value is a malformed request.
            max_bytes: max_bytes.map(|b| b.min(1 << 40)),
        };
        let body = serde_json::to_vec(&request).map_err(|e| {
            ReadError::with_source(ReadErrorKind::Request, "encoding a direct get", e)
        })?;
        let client = self.client();
        let inbox = client.new_inbox();
        let mut replies = client.subscribe(inbox.clone()).await.map_err(|e| {
            ReadError::with_source(ReadErrorKind::Request, "subscribing for a direct get", e)
        })?;
        let subject = format!("$JS.API.DIRECT.GET.{stream}");
        client
            .publish_with_reply(subject, inbox, Bytes::from(body))
            .await
            .map_err(|e| {
                ReadError::with_source(
                    ReadErrorKind::Request,
                    format!("asking {stream} for {filter}"),
                    e,
                )
            })?;
        let timeout = self.request_timeout();
        let mut out = Vec::with_capacity(batch.min(1024));
        loop {
            let next = tokio::time::timeout(timeout, replies.next()).await;
            let msg = match next {
                Ok(Some(m)) => m,
                Ok(None) => {
                    return Err(ReadError::new(
                        ReadErrorKind::Request,
                        format!("the connection closed while reading {filter} from {stream}"),
                    ));
                }
                Err(_) => {
                    return Err(ReadError::new(
                        ReadErrorKind::TimedOut,
                        format!(
                            "{stream} did not answer a read of {filter} within {}",
                            humantime_serde::re::humantime::format_duration(timeout)
                        ),
                    ));
                }
            };
            match parse_reply(stream, msg)? {
                Reply::Message(m) => out.push(*m),
                // A batch ends with its end-of-batch status, or is a single "not found".
                Reply::EndOfBatch | Reply::NotFound => break,
            }
        }
        Ok(out)
    }

    /// The newest message on `subject` (an exact subject) of stream `kind`, if any.
    pub async fn last_for_subject(
        &self,
        kind: StreamKind,
        subject: &str,
    ) -> Result<Option<StoredMessage>, ReadError> {
        let stream = self.names().stream(kind);
        self.direct_single(
            &stream,
            &format!("$JS.API.DIRECT.GET.{stream}.{subject}"),
            None,
        )
        .await
    }

    /// The message with sequence `seq` of stream `kind`, if it is still stored.
    pub async fn direct_get(
        &self,
        kind: StreamKind,
        seq: u64,
    ) -> Result<Option<StoredMessage>, ReadError> {
        let stream = self.names().stream(kind);
        let body = serde_json::to_vec(&DirectGetRequest {
            seq: Some(seq),
            ..DirectGetRequest::default()
        })
        .map_err(|e| ReadError::with_source(ReadErrorKind::Request, "encoding a direct get", e))?;
        self.direct_single(
            &stream,
            &format!("$JS.API.DIRECT.GET.{stream}"),
            Some(Bytes::from(body)),
        )
        .await
    }

    async fn direct_single(
        &self,
        stream: &str,
        subject: &str,
        body: Option<Bytes>,
    ) -> Result<Option<StoredMessage>, ReadError> {
        let request = async_nats::Request::new()
            .payload(body.unwrap_or_default())
            .timeout(Some(self.request_timeout()));
        let msg = self
            .client()
            .send_request(subject.to_owned(), request)
            .await
            .map_err(|e| {
                use async_nats::RequestErrorKind as K;
                let kind = match e.kind() {
                    K::NoResponders => ReadErrorKind::NoStream,
                    K::TimedOut => ReadErrorKind::TimedOut,
                    K::InvalidSubject => ReadErrorKind::BadRequest,
                    _ => ReadErrorKind::Request,
                };
                ReadError::with_source(kind, no_stream_detail(stream, kind), e)
            })?;
        match parse_reply(stream, msg)? {
            Reply::Message(m) => Ok(Some(*m)),
            Reply::EndOfBatch | Reply::NotFound => Ok(None),
        }
    }

    /// How long a read waits for the server.
    fn request_timeout(&self) -> Duration {
        self.options().request_timeout
    }
}

fn no_stream_detail(stream: &str, kind: ReadErrorKind) -> String {
    match kind {
        ReadErrorKind::NoStream => format!(
            "stream {stream} does not answer direct gets (not provisioned? run `flotilla nats provision`)"
        ),
        ReadErrorKind::TimedOut => format!("stream {stream} did not answer in time"),
        _ => format!("reading stream {stream}"),
    }
}

/// Classifies one reply message of a direct get.
fn parse_reply(stream: &str, msg: async_nats::Message) -> Result<Reply, ReadError> {
    if let Some(status) = msg.status {
        return match status.as_u16() {
            204 => Ok(Reply::EndOfBatch),
            404 => Ok(Reply::NotFound),
            503 => Err(ReadError::new(
                ReadErrorKind::NoStream,
                no_stream_detail(stream, ReadErrorKind::NoStream),
            )),
            200 => Ok(Reply::EndOfBatch),
            code => Err(ReadError::new(
                ReadErrorKind::BadRequest,
                format!(
                    "stream {stream} refused a read: {code} {}",
                    msg.description.as_deref().unwrap_or("")
                ),
            )),
        };
    }
    let Some(headers) = msg.headers else {
        return Err(ReadError::new(
            ReadErrorKind::Malformed,
            format!("a direct get reply of {stream} has no headers"),
        ));
    };
    let get = |name: &str| headers.get(name).map(|v| v.as_str().to_owned());
    let seq = get("Nats-Sequence")
        .and_then(|s| s.parse::<u64>().ok())
        .ok_or_else(|| {
            ReadError::new(
                ReadErrorKind::Malformed,
                format!("a direct get reply of {stream} has no Nats-Sequence"),
            )
        })?;
    let subject = get("Nats-Subject").ok_or_else(|| {
        ReadError::new(
            ReadErrorKind::Malformed,
            format!("a direct get reply of {stream} has no Nats-Subject"),
        )
    })?;
    let ts_ms = get("Nats-Time-Stamp")
        .and_then(|t| OffsetDateTime::parse(&t, &Rfc3339).ok())
        .map(|t| (t.unix_timestamp_nanos() / 1_000_000) as i64)
        .ok_or_else(|| {
            ReadError::new(
                ReadErrorKind::Malformed,
                format!("a direct get reply of {stream} has no valid Nats-Time-Stamp"),
            )
        })?;
    let num_pending = get(NATS_NUM_PENDING)
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or(0);
    Ok(Reply::Message(Box::new(StoredMessage {
        seq,
        subject,
        headers,
        payload: msg.payload,
        ts_ms,
        num_pending,
    })))
}

/// Every stored message matching a filter, page by page: what paging with batch direct gets
/// by the last sequence of the previous page gives ([`Bus::pages`]).
#[derive(Debug)]
pub struct Pages<'a> {
    bus: &'a Bus,
    stream: String,
    filter: String,
    after: u64,
    batch: usize,
    max_bytes: Option<usize>,
    done: bool,
}

impl Pages<'_> {
    /// The next page, oldest first; `None` once every matching message was returned.
    pub async fn next(&mut self) -> Result<Option<Vec<StoredMessage>>, ReadError> {
        if self.done {
            return Ok(None);
        }
        let page = self
            .bus
            .direct_batch_stream(
                &self.stream,
                &self.filter,
                self.after,
                self.batch,
                self.max_bytes,
            )
            .await?;
        let Some(last) = page.last() else {
            self.done = true;
            return Ok(None);
        };
        self.after = last.seq;
        self.done = last.num_pending == 0;
        Ok(Some(page))
    }

    /// The sequence of the last message returned (the `after` given, before the first page).
    pub fn after(&self) -> u64 {
        self.after
    }
}

/// How often a quiet [`Bus::find_in_subject`] looks whether the connection was re-established
/// meanwhile (a local check): messages published while it was down never reach the
/// subscription, so the stream is read again then.
pub const RECONNECT_CHECK: Duration = Duration::from_secs(2);

/// The first pause of [`Bus::find_in_subject`] after a read that failed for now (it doubles
/// up to a second).
const READ_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// When [`Bus::find_in_subject`] reads the stream a second time after its first read: a
/// message routed by the server just before the subscription was registered may be stored
/// only after that first read (the stream stores what it captures asynchronously), and then
/// reaches neither. Seen as a run's end missed by a client that began to wait at that moment.
pub const SETTLE_RECHECK: Duration = Duration::from_millis(250);

/// How long a quiet [`Bus::find_in_subject`] waits before reading the stream again anyway (a
/// subscription can also drop messages when its reader falls far behind).
pub const QUIET_RECHECK: Duration = Duration::from_secs(30);

impl Bus {
    /// The messages of stream `kind` matching `filter` stored after sequence `after`, in pages
    /// of at most 1,000 messages and 4 MiB.
    pub fn pages(&self, kind: StreamKind, filter: &str, after: u64) -> Pages<'_> {
        self.stream_pages(&self.names().stream(kind), filter, after)
    }

    /// [`pages`](Self::pages) of a stream named directly (a KV bucket's `KV_<bucket>`).
    pub fn stream_pages(&self, stream: &str, filter: &str, after: u64) -> Pages<'_> {
        Pages {
            bus: self,
            stream: stream.to_owned(),
            filter: filter.to_owned(),
            after,
            batch: 1000,
            max_bytes: Some(4 << 20),
            done: false,
        }
    }

    /// The keys of KV bucket `bucket` that start with `key_prefix` (a dot-terminated prefix
    /// of whole tokens), without the prefix, each once, in the order they were first written
    /// — read from the bucket's stream by subject, without a watcher or listing every key.
    pub async fn kv_keys_under(
        &self,
        bucket: Bucket,
        key_prefix: &str,
    ) -> Result<Vec<String>, ReadError> {
        let bucket = self.names().bucket(bucket);
        let prefix = format!("$KV.{bucket}.{key_prefix}");
        let mut keys = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut pages = self.stream_pages(&format!("KV_{bucket}"), &format!("{prefix}>"), 0);
        while let Some(page) = pages.next().await? {
            for m in page {
                if let Some(key) = m.subject.strip_prefix(&prefix)
                    && seen.insert(key.to_owned())
                {
                    keys.push(key.to_owned());
                }
            }
        }
        Ok(keys)
    }

    /// The newest values of KV bucket `bucket` under `key_prefix` (a dot-terminated prefix of
    /// whole tokens), newest first: those among the bucket stream's last `limit` messages,
    /// without deleted or purged keys. Bounded by design — one stream-info request and
    /// batch direct gets of at most `limit` messages, no consumer and no key listing — so a
    /// bucket of any size costs the same to scan. With history 1 each message is the current
    /// value of its key; its `subject` is `$KV.<bucket>.<key>`.
    pub async fn kv_newest(
        &self,
        bucket: Bucket,
        key_prefix: &str,
        limit: usize,
    ) -> Result<Vec<StoredMessage>, ReadError> {
        let bucket = self.names().bucket(bucket);
        let stream = format!("KV_{bucket}");
        let info = self.js().get_stream(&stream).await.map_err(|e| {
            ReadError::with_source(ReadErrorKind::NoStream, format!("reading {stream}"), e)
        })?;
        let last = info.cached_info().state.last_sequence;
        let mut out = Vec::new();
        let mut pages = self.stream_pages(
            &stream,
            &format!("$KV.{bucket}.{key_prefix}>"),
            last.saturating_sub(limit as u64),
        );
        while let Some(page) = pages.next().await? {
            out.extend(page.into_iter().filter(|m| {
                m.headers
                    .get("KV-Operation")
                    .is_none_or(|op| op.as_str() == "PUT")
            }));
            if pages.after() >= last {
                break;
            }
        }
        out.retain(|m| m.seq <= last);
        out.reverse();
        Ok(out)
    }

    /// Reads the messages of `subject` in stream `kind` — those stored, then new ones as they
    /// are published — until `find` returns `Some`, and returns that; `None` when `until`
    /// passes first. No consumer is created on the server (a stream allows a limited number,
    /// and waiting for a run to end is frequent and short-lived): a core subscription is taken
    /// first, then the stored messages are read by batch direct gets, so nothing published
    /// in between is missed; new messages come from the subscription. A message the server
    /// routed just before the subscription was registered, and stored just after the first
    /// read, reaches neither: the stream is read once more [`SETTLE_RECHECK`] after the first
    /// read. It is read again after the connection was re-established ([`RECONNECT_CHECK`])
    /// and after [`QUIET_RECHECK`] without a message, and a read that fails for a moment (a
    /// timeout while a cluster node dies) is tried again until `until`. `find` may see a
    /// message twice (stored and published).
    pub async fn find_in_subject<T>(
        &self,
        kind: StreamKind,
        subject: &str,
        until: tokio::time::Instant,
        mut find: impl FnMut(Option<&HeaderMap>, &[u8]) -> Option<T>,
    ) -> Result<Option<T>, ReadError> {
        let mut live = self
            .client()
            .subscribe(subject.to_owned())
            .await
            .map_err(|e| {
                ReadError::with_source(
                    ReadErrorKind::Request,
                    format!("subscribing to {subject}"),
                    e,
                )
            })?;
        let stats = self.client().statistics();
        let connects = || stats.connects.load(std::sync::atomic::Ordering::Relaxed);
        let mut after = 0;
        let mut reads = 0u32;
        loop {
            let read_at = connects();
            reads += 1;
            // What the stream holds after `after`, page by page. A read that fails for a
            // moment (a cluster node died and the client is reconnecting elsewhere) is tried
            // again from where it stopped, until `until`.
            let mut pages = self.pages(kind, subject, after);
            let mut pause = READ_RETRY_PAUSE;
            loop {
                match pages.next().await {
                    Ok(Some(page)) => {
                        pause = READ_RETRY_PAUSE;
                        for m in &page {
                            if let Some(found) = find(Some(&m.headers), &m.payload) {
                                return Ok(Some(found));
                            }
                        }
                    }
                    Ok(None) => break,
                    Err(e)
                        if e.kind().retry() == Retry::Retryable
                            && tokio::time::Instant::now() + pause < until =>
                    {
                        tracing::debug!(%subject, error = %e, "Reading the stream failed for now; reading again");
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_secs(1));
                    }
                    Err(e) => return Err(e),
                }
            }
            after = pages.after();
            // Then what is published, until a reconnect or a long quiet spell sends us back to
            // the stream.
            let mut quiet = tokio::time::Instant::now() + QUIET_RECHECK;
            // After the first read, once more a moment later, whatever the subscription
            // brings meanwhile.
            let settle = (reads == 1).then(|| tokio::time::Instant::now() + SETTLE_RECHECK);
            loop {
                let check = tokio::time::Instant::now() + RECONNECT_CHECK;
                tokio::select! {
                    m = live.next() => match m {
                        Some(m) => {
                            quiet = tokio::time::Instant::now() + QUIET_RECHECK;
                            if let Some(found) = find(m.headers.as_ref(), &m.payload) {
                                return Ok(Some(found));
                            }
                        }
                        None => {
                            return Err(ReadError::new(
                                ReadErrorKind::Request,
                                format!("the subscription to {subject} ended"),
                            ));
                        }
                    },
                    () = tokio::time::sleep_until(
                        check.min(quiet).min(until).min(settle.unwrap_or(until))
                    ) => {
                        let now = tokio::time::Instant::now();
                        if now >= until {
                            return Ok(None);
                        }
                        if now >= quiet
                            || settle.is_some_and(|s| now >= s)
                            || connects() != read_at
                        {
                            break;
                        }
                    }
                }
            }
        }
    }
}
