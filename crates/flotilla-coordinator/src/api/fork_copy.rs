//! What a fork sees of its original's collaboration: the workspace entries and mailbox posts
//! the kept tasks' agents wrote, and the session state as it stood when the fork point was
//! dispatched — copied into the fork's own workspace, mailboxes and session before it is
//! submitted, so its first task reads them. The original is only read.
//!
//! A kept task's automatic produce is not copied: the fork's start writes it again from the
//! kept result. Copies keep their writer and are published with message ids derived from the
//! fork and the original entry, so a fork request repeated within the stream's duplicate window
//! stores each once; a fork whose run exists already copies nothing.

use std::collections::{BTreeMap, HashSet};

use flotilla_bus::wire;
use flotilla_bus::{Bus, StoredMessage};
use flotilla_model::RunId;
use flotilla_model::ids::TaskId;
use flotilla_model::mailbox::MailboxPost;
use flotilla_model::subjects::{Bucket, StreamKind};
use flotilla_model::workspace::{PRODUCED_BY_HEADER, WorkspaceWrite, Writer};

/// Most workspace entries, and most mailbox posts, one fork is given: what the handler holds
/// in memory between reading and writing them.
pub(super) const MAX_COPIED: usize = 10_000;

/// Why a fork's copy could not be made.
#[derive(Debug)]
pub(super) enum CopyError {
    /// The streams or the state bucket could not be read or written.
    Unavailable(String),
    /// The kept tasks left more than [`MAX_COPIED`] of `what`.
    TooMany(&'static str),
}

impl From<String> for CopyError {
    fn from(e: String) -> Self {
        Self::Unavailable(e)
    }
}

/// Header on a copied workspace entry or mailbox post: the run it was copied from.
pub(super) const COPIED_FROM_HEADER: &str = "Flotilla-Copied-From";

/// What was copied into a fork.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Copied {
    pub(super) entries: u32,
    pub(super) posts: u32,
    pub(super) state_keys: u32,
}

/// The original's side of a copy.
pub(super) struct Source<'a> {
    /// The run forked.
    pub(super) run: RunId,
    /// Its tree's root (whose workspace and mailboxes its tasks used).
    pub(super) root: RunId,
    /// Its session (the key prefix of its state).
    pub(super) session: String,
    /// The tasks the fork keeps.
    pub(super) kept: &'a HashSet<TaskId>,
    /// When the fork point's last attempt was dispatched, or for a fork at a step when its
    /// first new step was stored (Unix ms): state written later is not copied.
    pub(super) cutoff_ms: i64,
    /// A fork at a step: the fork point and its attempt — what its kept steps wrote (before
    /// the cutoff) is copied as a kept task's is.
    pub(super) fork_point: Option<(&'a TaskId, u32)>,
}

impl Source<'_> {
    /// Whether `writer` is one whose writes the fork keeps: a kept task of the run forked (or
    /// of a copy it got as a fork itself), or the fork point's kept steps before `ts_ms`.
    fn keeps(&self, writer: &Writer, copied_in: bool, ts_ms: i64) -> bool {
        if writer.run_id != self.run && !copied_in {
            return false;
        }
        if writer.by.as_deref() == Some("coordinator") {
            return false;
        }
        let Some(task) = writer.task_id.as_ref() else {
            return false;
        };
        self.kept.contains(task)
            || self.fork_point.is_some_and(|(at, attempt)| {
                at == task && writer.attempt == Some(attempt) && ts_ms < self.cutoff_ms
            })
    }
}

/// What a fork will be given, read from its original: `(subject under the fork's root,
/// message)` per entry and post, and the state values by key.
#[derive(Default)]
pub(super) struct Gathered {
    entries: Vec<(String, StoredMessage)>,
    posts: Vec<(String, StoredMessage)>,
    state: BTreeMap<String, bytes::Bytes>,
}

fn failed(what: &str, e: &dyn std::fmt::Display) -> String {
    format!("copying {what} into the fork: {e}")
}

/// Reads what `from`'s kept tasks left, for `fork`: the workspace, the mailboxes and the
/// session state, the three at once.
pub(super) async fn gather(
    bus: &Bus,
    from: &Source<'_>,
    fork: RunId,
) -> Result<Gathered, CopyError> {
    let (entries, posts, state) = tokio::try_join!(
        workspace_entries(bus, from, fork),
        mailbox_posts(bus, from, fork),
        async { session_state(bus, from).await.map_err(CopyError::from) }
    )?;
    Ok(Gathered {
        entries,
        posts,
        state,
    })
}

/// Workspace entries an agent of a kept task wrote (not the automatic produce).
async fn workspace_entries(
    bus: &Bus,
    from: &Source<'_>,
    fork: RunId,
) -> Result<Vec<(String, StoredMessage)>, CopyError> {
    let names = bus.names();
    let prefix = format!("{}.ws.{}.", names.prefix(), from.root);
    let filter = names.workspace_all(from.root);
    kept_messages(
        bus,
        from,
        (StreamKind::Workspace, &filter, &prefix),
        "workspace entries",
        |topic, m| {
            if m.headers.get(PRODUCED_BY_HEADER).is_some() {
                return None;
            }
            let write = wire::codec_of(Some(&m.headers))
                .decode::<WorkspaceWrite>(&m.payload)
                .ok()?;
            Some((names.workspace(fork, topic), write.writer?))
        },
    )
    .await
}

/// Mailbox posts a kept task sent (`mbox.<root>.<to>.<from>`), by their sender: the tree
/// shares the root's mailboxes, and a child run's task may have the same id.
async fn mailbox_posts(
    bus: &Bus,
    from: &Source<'_>,
    fork: RunId,
) -> Result<Vec<(String, StoredMessage)>, CopyError> {
    let names = bus.names();
    let prefix = format!("{}.mbox.{}.", names.prefix(), from.root);
    let filter = format!("{prefix}*.*");
    kept_messages(
        bus,
        from,
        (StreamKind::Mailbox, &filter, &prefix),
        "mailbox posts",
        |rest, m| {
            let (to, sender) = rest.split_once('.')?;
            let post = wire::codec_of(Some(&m.headers))
                .decode::<MailboxPost>(&m.payload)
                .ok()?;
            Some((names.mailbox(fork, to, sender), post.sender?))
        },
    )
    .await
}

/// The messages of stream `kind` under `filter` that a writer the fork keeps wrote, each with
/// its subject under the fork. `place` reads a message (its subject after `prefix`) and
/// answers its new subject and its writer, or `None` for one the fork is not given.
async fn kept_messages(
    bus: &Bus,
    from: &Source<'_>,
    (kind, filter, prefix): (StreamKind, &str, &str),
    what: &'static str,
    place: impl Fn(&str, &StoredMessage) -> Option<(String, Writer)>,
) -> Result<Vec<(String, StoredMessage)>, CopyError> {
    let mut pages = bus.pages(kind, filter, 0);
    let mut out = Vec::new();
    while let Some(page) = pages.next().await.map_err(|e| failed(what, &e))? {
        for m in page {
            let Some(rest) = m.subject.strip_prefix(prefix) else {
                continue;
            };
            let Some((subject, writer)) = place(rest, &m) else {
                continue;
            };
            let copied_in = m.headers.get(COPIED_FROM_HEADER).is_some();
            if from.keeps(&writer, copied_in, m.ts_ms) {
                if out.len() == MAX_COPIED {
                    return Err(CopyError::TooMany(what));
                }
                out.push((subject, m));
            }
        }
    }
    Ok(out)
}

/// The session state as it stood at the cutoff: per key, its last value written before then.
async fn session_state(
    bus: &Bus,
    from: &Source<'_>,
) -> Result<BTreeMap<String, bytes::Bytes>, String> {
    let names = bus.names();
    let bucket = names.bucket(Bucket::State);
    let key_prefix = format!("$KV.{bucket}.{}.", from.session);
    let mut latest: BTreeMap<String, Option<bytes::Bytes>> = BTreeMap::new();
    let mut pages = bus.stream_pages(&format!("KV_{bucket}"), &format!("{key_prefix}>"), 0);
    while let Some(page) = pages
        .next()
        .await
        .map_err(|e| failed("session state", &e))?
    {
        for m in page {
            if m.ts_ms >= from.cutoff_ms {
                continue;
            }
            let Some(key) = m.subject.strip_prefix(&key_prefix) else {
                continue;
            };
            let deleted = m
                .headers
                .get("KV-Operation")
                .is_some_and(|op| op.as_str() != "PUT");
            latest.insert(key.to_owned(), (!deleted).then(|| m.payload.clone()));
        }
    }
    Ok(latest
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (k, v)))
        .collect())
}

/// Writes what was gathered into `fork`'s workspace, mailboxes and session.
pub(super) async fn publish(
    bus: &Bus,
    gathered: Gathered,
    from: RunId,
    fork: RunId,
) -> Result<Copied, String> {
    let mut copied = Copied::default();
    for (messages, count, what) in [
        (gathered.entries, &mut copied.entries, "a workspace entry"),
        (gathered.posts, &mut copied.posts, "a mailbox post"),
    ] {
        for (subject, m) in messages {
            publish_copy(bus, subject, &m, from, fork)
                .await
                .map_err(|e| failed(what, &e))?;
            *count += 1;
        }
    }
    if gathered.state.is_empty() {
        return Ok(copied);
    }
    let names = bus.names();
    let state = bus
        .kv(Bucket::State)
        .await
        .map_err(|e| failed("session state", &e))?;
    for (key, value) in gathered.state {
        // Only where the fork has no value yet: a repeated fork does not write twice.
        let target = names.state_key(&fork.to_string(), &key);
        match state.create(&target, value).await {
            Ok(_) => copied.state_keys += 1,
            Err(e) if e.kind() == async_nats::jetstream::kv::CreateErrorKind::AlreadyExists => {}
            Err(e) => return Err(failed("a session-state value", &e)),
        }
    }
    Ok(copied)
}

/// Publishes a copy of `m` on `subject`, with its codec header and a message id of the fork
/// and the original's sequence.
async fn publish_copy(
    bus: &Bus,
    subject: String,
    m: &StoredMessage,
    from: RunId,
    fork: RunId,
) -> Result<(), String> {
    let mut headers = async_nats::HeaderMap::new();
    for (name, values) in m.headers.iter() {
        let n: &str = name.as_ref();
        if n.starts_with("Nats-") {
            continue;
        }
        for v in values {
            headers.append(n, v.as_str());
        }
    }
    headers.insert(COPIED_FROM_HEADER, from.to_string().as_str());
    headers.insert(
        async_nats::header::NATS_MESSAGE_ID,
        format!("forkcopy.{fork}.{}", m.seq).as_str(),
    );
    bus.js()
        .publish_with_headers(subject, headers, m.payload.clone())
        .await
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}
