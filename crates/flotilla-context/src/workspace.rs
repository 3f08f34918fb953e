//! Workspace topics (layer 2 of the handoff): append-only JSON entries shared by a run tree,
//! on `<prefix>.ws.<root-run>.<topic>` in stream `<PREFIX>_WORKSPACE`.
//!
//! ```text
//! append(topic, entry) ──► WorkspaceWrite {entry, writer} ──► stream seq = the entry's seq
//! read(topic, since_seq, limit) ──► entries with seq > since_seq, oldest first, + next_since_seq
//! watch(topic, since_seq) ──► every entry after since_seq, live
//! ```
//!
//! * Topics are normalised (trim, lower case, spaces to `_`) and must be subject tokens.
//! * Under strict data flow a task writes only the topics it `produces`; lenient allows any.
//! * An entry (the encoded write) is at most 1 MiB, lowered to the server's max payload minus
//!   4 KiB; larger data goes to the artifact store with a reference entry
//!   ([`Workspace::append_artifact`]).
//! * Appends are idempotent per attempt: `Nats-Msg-Id: ws.<attempt>.<topic>.<digest>`, where
//!   the digest covers the canonical entry, so a redelivered attempt writing the same entry
//!   stores it once (within the stream's duplicate window). The flip side: one attempt
//!   appending the very same entry twice to one topic stores it once.
//! * Reads are lossless: page with `next_since_seq` until `more` is false and every entry is
//!   returned exactly once. A page holds at most `limit` entries (default 200; a larger limit
//!   is lowered to 1,000, not refused) and about [`crate::PAGE_MAX_BYTES`].
//! * Messages on workspace subjects that are not a [`WorkspaceWrite`] with an object `entry`
//!   (a malformed raw publish) are skipped with a warning and counted in `skipped`; the cursor
//!   moves past them, so readers never stall.

use std::sync::Arc;

use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use bytes::Bytes;
use flotilla_bus::{PublishErrorKind, StoredMessage, wire};
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::artifact::ArtifactRef;
use flotilla_model::plan::DataflowValidation;
use flotilla_model::subjects::StreamKind;
use flotilla_model::time::Timestamp;
use flotilla_model::token::{check_token, normalize_topic};
use flotilla_model::workspace::{
    DEFAULT_READ_LIMIT, MAX_ENTRY_BYTES, MAX_READ_LIMIT, WorkspaceEntry, WorkspacePage,
    WorkspaceWrite,
};
use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tracing::warn;

use crate::canonical::digest16;
use crate::error::{ContextError, ErrorKind, unavailable};
use crate::{Clients, PAGE_MAX_BYTES};

/// The answer to an append.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Appended {
    /// The entry's sequence (the earlier one's, for a duplicate).
    pub seq: u64,
    /// The normalised topic.
    pub topic: String,
    /// The append repeated an earlier one of the same attempt (or idempotency key) and was
    /// not stored again.
    pub duplicate: bool,
}

/// Workspace topics of a run tree, as one scope sees them.
#[derive(Debug, Clone)]
pub struct Workspace {
    c: Clients,
}

/// The read limit actually used: default 200, lowered to at most 1,000.
pub fn effective_limit(limit: Option<usize>) -> usize {
    match limit {
        None | Some(0) => DEFAULT_READ_LIMIT,
        Some(n) => n.min(MAX_READ_LIMIT),
    }
}

impl Workspace {
    pub(crate) fn new(c: Clients) -> Self {
        Self { c }
    }

    /// Normalises and checks a topic for writing by this scope.
    fn writable_topic(&self, topic: &str) -> Result<String, ContextError> {
        let normal = readable_topic(topic)?;
        let scope = self.c.scope();
        if scope.dataflow == DataflowValidation::Strict
            && let Some(declared) = &scope.produces
            && !declared.iter().any(|t| normalize_topic(t) == normal)
        {
            let task = scope.task_id.as_ref().map_or("this task", |t| t.as_str());
            return Err(ContextError::new(
                ErrorKind::UndeclaredTopic,
                format!(
                    "{task} may write only the topics it declares in produces ({}); {normal:?} is not one of them (the plan's data-flow validation is strict)",
                    if declared.is_empty() {
                        "none".to_owned()
                    } else {
                        declared.join(", ")
                    }
                ),
            ));
        }
        Ok(normal)
    }

    /// Appends `entry` to `topic`. Idempotent per attempt (see the module docs).
    pub async fn append(
        &self,
        topic: &str,
        entry: Map<String, Value>,
    ) -> Result<Appended, ContextError> {
        self.append_with_key(topic, entry, None).await
    }

    /// [`append`](Self::append) with an idempotency key for writes outside an attempt
    /// (operators, clients): repeats with the same key and topic are stored once. Inside an
    /// attempt the attempt's own message id is used and the key is ignored.
    pub async fn append_with_key(
        &self,
        topic: &str,
        entry: Map<String, Value>,
        idempotency_key: Option<&str>,
    ) -> Result<Appended, ContextError> {
        let topic = self.writable_topic(topic)?;
        let scope = self.c.scope();
        let write = WorkspaceWrite {
            protocol: PROTOCOL_VERSION,
            entry,
            writer: Some(scope.writer()),
        };
        let cap = self.c.write_cap(MAX_ENTRY_BYTES);
        let body = serde_json::to_vec(&write).map_err(|e| {
            ContextError::with_source(ErrorKind::Malformed, "encoding the entry", e)
        })?;
        if body.len() > cap {
            return Err(ContextError::new(
                ErrorKind::EntryTooLarge,
                format!(
                    "the entry is {} bytes; entries hold at most {cap} bytes (store large data with append_artifact / `flotilla artifacts put --topic`, which writes a reference entry)",
                    body.len()
                ),
            ));
        }
        let entry_value = Value::Object(write.entry);
        let msg_id = match (scope.attempt_id, idempotency_key) {
            (Some(attempt), _) => Some(format!(
                "ws.{attempt}.{topic}.{}",
                digest16(&[&entry_value])
            )),
            (None, Some(key)) => Some(format!(
                "ws.key.{}.{topic}.{}",
                scope.root_run_id,
                digest16(&[&Value::from(key)])
            )),
            (None, None) => None,
        };
        let out = wire::Outgoing {
            headers: msg_id_headers(msg_id.as_deref()),
            payload: Bytes::from(body),
        };
        let subject = scope.names.workspace(scope.root_run_id, &topic);
        let bus = self.c.bus();
        let ack = match bus
            .publish_retrying(subject, out, tokio::time::Instant::now() + crate::RIDE_OUT)
            .await
        {
            Ok(ack) => ack,
            Err(e) => {
                return Err(match e.kind() {
                    PublishErrorKind::TooLarge => ContextError::with_source(
                        ErrorKind::EntryTooLarge,
                        format!(
                            "the entry is larger than this deployment's messages (cap {cap} bytes)"
                        ),
                        e,
                    ),
                    PublishErrorKind::StreamFull => {
                        crate::error::stream_full(
                            bus,
                            flotilla_model::subjects::StreamKind::Workspace,
                            e,
                        )
                        .await
                    }
                    _ => unavailable(format!("appending to topic {topic}"), e),
                });
            }
        };
        Ok(Appended {
            seq: ack.sequence,
            topic,
            duplicate: ack.duplicate,
        })
    }

    /// Stores `bytes` as artifact `name` of the run tree and appends a reference entry
    /// `{"artifact": {bucket, name, size, sha256}}` to `topic`: the way to share data larger
    /// than an entry. The topic is checked before anything is stored.
    pub async fn append_artifact(
        &self,
        topic: &str,
        name: &str,
        bytes: Bytes,
    ) -> Result<(ArtifactRef, Appended), ContextError> {
        let normal = self.writable_topic(topic)?;
        let reference = self.c.artifacts().put(name, bytes).await?;
        let mut entry = Map::new();
        entry.insert(
            "artifact".into(),
            serde_json::to_value(&reference).map_err(|e| {
                ContextError::with_source(ErrorKind::Malformed, "encoding the reference", e)
            })?,
        );
        let appended = self.append(&normal, entry).await?;
        Ok((reference, appended))
    }

    /// Entries of `topic` with `seq > since_seq`, oldest first: at most `limit` (see
    /// [`effective_limit`]). Continue from `next_since_seq` while `more`.
    pub async fn read(
        &self,
        topic: &str,
        since_seq: u64,
        limit: Option<usize>,
    ) -> Result<WorkspacePage, ContextError> {
        let topic = readable_topic(topic)?;
        let scope = self.c.scope();
        let filter = scope.names.workspace(scope.root_run_id, &topic);
        self.page(&filter, since_seq, effective_limit(limit)).await
    }

    /// Entries of every topic of the run tree with `seq > since_seq`, oldest first.
    pub async fn read_all(
        &self,
        since_seq: u64,
        limit: Option<usize>,
    ) -> Result<WorkspacePage, ContextError> {
        let scope = self.c.scope();
        let filter = scope.names.workspace_all(scope.root_run_id);
        self.page(&filter, since_seq, effective_limit(limit)).await
    }

    async fn page(
        &self,
        filter: &str,
        since_seq: u64,
        limit: usize,
    ) -> Result<WorkspacePage, ContextError> {
        let messages = self
            .c
            .bus()
            .direct_batch(
                StreamKind::Workspace,
                filter,
                since_seq,
                limit,
                Some(PAGE_MAX_BYTES),
            )
            .await?;
        let mut page = WorkspacePage {
            entries: Vec::with_capacity(messages.len()),
            next_since_seq: messages.last().map_or(since_seq, |m| m.seq),
            more: messages.last().is_some_and(|m| m.num_pending > 0),
            skipped: 0,
        };
        for m in messages {
            match decode_entry(&m) {
                Some(e) => page.entries.push(e),
                None => page.skipped += 1,
            }
        }
        Ok(page)
    }

    /// Entries of `topic` (or of every topic of the tree) after `since_seq`, live: the stored
    /// ones first, then each new one as it is written. Malformed messages are skipped with a
    /// warning. The stream ends only when the connection does.
    pub async fn watch(
        &self,
        topic: Option<&str>,
        since_seq: u64,
    ) -> Result<
        impl Stream<Item = Result<WorkspaceEntry, ContextError>> + Send + 'static,
        ContextError,
    > {
        let scope = self.c.scope();
        let filter = match topic {
            Some(t) => scope
                .names
                .workspace(scope.root_run_id, &readable_topic(t)?),
            None => scope.names.workspace_all(scope.root_run_id),
        };
        let name = self.c.bus().names().stream(StreamKind::Workspace);
        let stream = self
            .c
            .bus()
            .js()
            .get_stream(&name)
            .await
            .map_err(|e| unavailable(format!("opening stream {name}"), e))?;
        let consumer = stream
            .create_consumer(pull::OrderedConfig {
                filter_subject: filter.clone(),
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: since_seq.saturating_add(1),
                },
                description: Some("flotilla workspace watch".into()),
                ..Default::default()
            })
            .await
            .map_err(|e| unavailable(format!("watching {filter}"), e))?;
        let messages = consumer
            .messages()
            .await
            .map_err(|e| unavailable(format!("watching {filter}"), e))?;
        let filter = Arc::new(filter);
        Ok(messages.filter_map(move |m| {
            let filter = Arc::clone(&filter);
            async move {
                match m {
                    Err(e) => Some(Err(unavailable(format!("watching {filter}"), e))),
                    Ok(msg) => {
                        let info = match msg.info() {
                            Ok(i) => (i.stream_sequence, i.published),
                            Err(e) => {
                                warn!(subject = %msg.subject, error = %e, "Skipping a workspace message without JetStream metadata");
                                return None;
                            }
                        };
                        let stored = StoredMessage {
                            seq: info.0,
                            subject: msg.subject.to_string(),
                            headers: msg.headers.clone().unwrap_or_default(),
                            payload: msg.payload.clone(),
                            ts_ms: (info.1.unix_timestamp_nanos() / 1_000_000) as i64,
                            num_pending: 0,
                        };
                        decode_entry(&stored).map(Ok)
                    }
                }
            }
        }))
    }
}

/// Headers carrying `Nats-Msg-Id` when there is one.
pub(crate) fn msg_id_headers(msg_id: Option<&str>) -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    if let Some(id) = msg_id {
        headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
    }
    headers
}

/// Normalises and checks a topic for reading.
fn readable_topic(topic: &str) -> Result<String, ContextError> {
    let normal = normalize_topic(topic);
    check_token(&normal).map_err(|e| {
        ContextError::new(
            ErrorKind::InvalidTopic,
            if normal == topic {
                format!("topic {topic:?} {e}")
            } else {
                format!("topic {topic:?} (normalised {normal:?}) {e}")
            },
        )
    })?;
    Ok(normal)
}

/// A stored workspace message as an entry, or `None` (with a warning) when it is not a
/// workspace write.
fn decode_entry(m: &StoredMessage) -> Option<WorkspaceEntry> {
    let topic = m.subject.rsplit('.').next().unwrap_or_default().to_owned();
    match wire::decode::<WorkspaceWrite>(Some(&m.headers), &m.payload) {
        Ok(w) => Some(WorkspaceEntry {
            seq: m.seq,
            topic,
            entry: w.entry,
            writer: w.writer,
            ts: Timestamp::from_unix_ms(m.ts_ms),
        }),
        Err(e) => {
            warn!(subject = %m.subject, seq = m.seq, error = %e, "Skipping a malformed workspace message");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_default_and_clamp() {
        assert_eq!(effective_limit(None), 200);
        assert_eq!(effective_limit(Some(0)), 200);
        assert_eq!(effective_limit(Some(5)), 5);
        assert_eq!(effective_limit(Some(50_000)), 1000);
    }

    #[test]
    fn topics_are_normalised_then_checked() {
        assert_eq!(readable_topic(" Raw Data ").expect("ok"), "raw_data");
        for bad in ["a.b", "x*", ">", "", "   "] {
            let err = readable_topic(bad).expect_err(bad);
            assert_eq!(err.code(), "invalid_topic", "{bad}");
        }
    }
}
