//! Point-to-point mailboxes (layer 3 of the handoff) between the tasks of a run tree, on
//! `<prefix>.mbox.<root-run>.<to>.<from>` in stream `<PREFIX>_MAILBOX`.
//!
//! ```text
//!  send(to, kind, payload) ── n = last n of (to, from) + 1, expected last subject seq ──► stored
//!                                                                                          │
//!  receive(limit, wait): inbox <to = me> + broadcasts <to = _all, from ≠ me>, after the     │
//!  read position ◄──────────────── event-driven wake-up (core NATS subscription) ◄──────────┘
//!  commit(): read position ──CAS──► committed cursor (KV <prefix>-cursors)
//! ```
//!
//! **Sending** never waits for the receiver. Each `(to, from)` pair numbers its posts
//! `n = 1, 2, …` without gaps: the sender reads the pair's last post and publishes with
//! `Nats-Expected-Last-Subject-Sequence`, retrying (bounded, jittered) when another send of
//! the same pair won the race. Sends are idempotent per attempt
//! (`Nats-Msg-Id: mbox.<attempt>.<to>.<digest of kind, payload, correlation id>`): a
//! redelivered attempt repeating a send does not duplicate it — and one attempt sending the
//! very same message twice to one recipient sends it once.
//!
//! **Receiving is at-least-once.** A reader's read position starts at its committed cursor.
//! `receive` returns the messages after the position and moves the position past them;
//! `commit` stores the position as the committed cursor (compare-and-set on the KV revision,
//! never backwards). The worker commits when an attempt succeeds, so a retried or redelivered
//! attempt starts again from the last commit and sees again what a crashed or failed
//! predecessor had read: agents must tolerate seeing a message twice. Exec agents read from
//! separate processes; their position persists per execution
//! (`mbox.<root>.<reader>.pos.<attempt>.<delivery>` in the cursors bucket) and the worker
//! commits it when the attempt succeeds.
//!
//! **Waiting is event-driven.** With `wait > 0`, `receive` subscribes (core NATS) to the
//! reader's inbox and the broadcast subject *before* reading the stream, so nothing published
//! after the read is missed, then sleeps until a message arrives or the wait ends. A message
//! reaches subscribers a moment before it can be read from the stream, and some published
//! messages are never stored (a send that lost its numbering race), so after a wake-up the
//! reader re-reads a few times within about a second (backing off) before it sleeps again,
//! and a reader quiet for two seconds re-reads once in case a wake-up was lost.
//!
//! **Role addresses: exactly one claim.** A message to `role:<name>` goes to the role's box
//! (`_role-<name>` in the `to` position). A reader whose scope plays the role (the task's
//! `role`) reads that box too, and takes a message from it only by claiming it — a create of
//! `mbox.<root>._claim.<seq>` in the cursors bucket, so exactly one reader wins; a reader's
//! retries find their own claim and read it again, other readers pass it over. Peeks and
//! negotiations never claim.
//!
//! **Caps are visible.** The stream keeps the newest N posts per pair; the numbering makes the
//! loss countable ([`Mailbox::stats`]: `dropped = first retained n − 1`).
//!
//! Posts that do not decode, or whose body's `from`/`to` contradict the subject, are skipped
//! with a warning and counted in `skipped`; the position moves past them.

use std::pin::Pin;
use std::time::Duration;

use async_nats::header::{NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, NATS_MESSAGE_ID};
use async_nats::jetstream::kv::Operation;
use async_nats::{HeaderMap, Message};
use bytes::Bytes;
use flotilla_bus::{StoredMessage, classify_publish_error, wire};
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::mailbox::{
    BROADCAST, BROADCAST_TO, DEFAULT_READ_LIMIT, MAX_PAYLOAD_BYTES, MAX_READ_LIMIT, MailboxKind,
    MailboxMessage, MailboxPage, MailboxPost, MailboxStats, ROLE_ADDRESS, ROLE_BOX, SenderStats,
    addressed_role, role_box,
};
use flotilla_model::subjects::StreamKind;
use flotilla_model::time::Timestamp;
use flotilla_model::token::{check_name, check_token};
use futures::{Stream, StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::canonical::digest16;
use crate::error::{ContextError, ErrorKind, unavailable};
use crate::{Clients, PAGE_MAX_BYTES};

/// Tries to number a post before giving up (each try loses only to another send of the same
/// pair that succeeded).
const MAX_SEND_TRIES: u32 = 64;

/// Re-reads after a wake-up that found nothing yet (milliseconds to sleep before each):
/// about one second in all, since on a loaded server a stream stores a message well after
/// its subscribers saw it.
pub(crate) const SETTLE_DELAYS_MS: [u64; 10] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512];

/// The longest a waiting reader sleeps without re-reading: a wake-up can be lost (a
/// reconnect, a slow consumer), and a reader must not then wait out its whole wait.
pub(crate) const MAX_QUIET: Duration = Duration::from_secs(2);

/// The answer to a send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sent {
    /// Stream sequence of the post (the earlier one's, for a duplicate).
    pub seq: u64,
    /// Its number within its `(to, from)` pair.
    pub n: u64,
    /// The send repeated an earlier one and was not stored again.
    pub duplicate: bool,
}

/// A reader's position, shared by every mailbox handle of one attempt.
#[derive(Debug, Default)]
pub(crate) struct ReaderState {
    /// Read position (stream sequence); `None` until the first read loads it.
    position: Option<u64>,
    /// The position was taken over from an exec execution's persisted key, deleted once
    /// committed.
    adopted: bool,
    /// Where the responder side of a negotiation looks for the next request.
    pub(crate) request_cursor: u64,
}

/// The messages a reader waits on: its inbox and the broadcast box.
type Wake = Pin<Box<dyn Stream<Item = Message> + Send>>;

/// One scope's mailbox: sending as its task, reading its task's inbox.
#[derive(Debug, Clone)]
pub struct Mailbox {
    pub(crate) c: Clients,
}

/// Checks a task address (sender or recipient): a subject token not starting with `_`.
pub fn check_address(address: &str) -> Result<(), ContextError> {
    if let Err(e) = check_token(address) {
        return Err(ContextError::new(
            ErrorKind::InvalidAddress,
            format!(
                "address {address:?} {e}; addresses are task ids (or * to broadcast, role:<name> for one task playing a role)"
            ),
        ));
    }
    if address.starts_with('_') {
        return Err(ContextError::new(
            ErrorKind::InvalidAddress,
            format!(
                "address {address:?} starts with `_`, which is reserved ({BROADCAST} is the broadcast box; send to * to broadcast)"
            ),
        ));
    }
    Ok(())
}

/// The subject token and body value of a recipient.
fn recipient(to: &str) -> Result<(String, String), ContextError> {
    if to == BROADCAST_TO {
        return Ok((BROADCAST.to_owned(), BROADCAST_TO.to_owned()));
    }
    if let Some(role) = addressed_role(to) {
        if let Err(e) = check_name(role) {
            return Err(ContextError::new(
                ErrorKind::InvalidAddress,
                format!("address {to:?}: the role {role:?} {e}"),
            ));
        }
        return Ok((role_box(role), to.to_owned()));
    }
    check_address(to)?;
    Ok((to.to_owned(), to.to_owned()))
}

/// The read limit actually used: default 100, lowered to at most 1,000.
pub fn effective_limit(limit: Option<usize>) -> usize {
    match limit {
        None | Some(0) => DEFAULT_READ_LIMIT,
        Some(n) => n.min(MAX_READ_LIMIT),
    }
}

/// The `(to, from)` tokens of a mailbox subject.
fn pair_of(subject: &str) -> (&str, &str) {
    let mut rev = subject.rsplit('.');
    let from = rev.next().unwrap_or_default();
    let to = rev.next().unwrap_or_default();
    (to, from)
}

/// A stored post as a message, or why it is malformed.
fn decode_post(m: &StoredMessage) -> Result<MailboxMessage, String> {
    let post: MailboxPost =
        wire::decode(Some(&m.headers), &m.payload).map_err(|e| e.to_string())?;
    let (to, from) = pair_of(&m.subject);
    let to_body = match to.strip_prefix(ROLE_BOX) {
        _ if to == BROADCAST => BROADCAST_TO.to_owned(),
        Some(role) => format!("{ROLE_ADDRESS}{role}"),
        None => to.to_owned(),
    };
    if post.from != from || post.to != to_body {
        return Err(format!(
            "the body says from {:?} to {:?}, the subject from {from:?} to {to_body:?}",
            post.from, post.to
        ));
    }
    Ok(MailboxMessage {
        seq: m.seq,
        ts: Timestamp::from_unix_ms(m.ts_ms),
        kind: post.kind,
        from: post.from,
        to: post.to,
        payload: post.payload,
        correlation_id: post.correlation_id,
        n: post.n,
        sender: post.sender,
    })
}

/// The number of a stored post (0 when it is not a numbered post).
fn number_of(m: &StoredMessage) -> u64 {
    match wire::decode::<MailboxPost>(Some(&m.headers), &m.payload) {
        Ok(p) => p.n,
        Err(e) => {
            warn!(subject = %m.subject, seq = m.seq, error = %e, "The last message of a mailbox pair is not a post; numbering restarts after it");
            0
        }
    }
}

fn jitter(base: Duration) -> Duration {
    // 50–150 % of the base, from a random UUID's bits (no RNG dependency needed).
    let r = (uuid::Uuid::new_v4().as_u128() % 101) as u32;
    base * (50 + r) / 100
}

impl Mailbox {
    pub(crate) fn new(c: Clients) -> Self {
        Self { c }
    }

    /// The reader and sender address: the scope's task.
    pub fn address(&self) -> Result<&str, ContextError> {
        let a = self.c.scope().address()?;
        check_address(a)?;
        Ok(a)
    }

    /// Sends a message to `to` (a task id of the run tree, or `*` for every task). Returns
    /// once the stream stored it; never waits for the receiver.
    pub async fn send(
        &self,
        to: &str,
        kind: MailboxKind,
        payload: Value,
        correlation_id: Option<&str>,
    ) -> Result<Sent, ContextError> {
        self.send_with_key(to, kind, payload, correlation_id, None)
            .await
    }

    /// [`send`](Self::send) with an idempotency key for sends outside an attempt (operators,
    /// clients): repeats with the same key to the same recipient are sent once. Inside an
    /// attempt the attempt's own message id is used and the key is ignored.
    pub async fn send_with_key(
        &self,
        to: &str,
        kind: MailboxKind,
        payload: Value,
        correlation_id: Option<&str>,
        idempotency_key: Option<&str>,
    ) -> Result<Sent, ContextError> {
        let from = self.address()?.to_owned();
        let (to_token, to_body) = recipient(to)?;
        let scope = self.c.scope();
        let mut post = MailboxPost {
            protocol: PROTOCOL_VERSION,
            kind,
            from: from.clone(),
            to: to_body,
            payload,
            correlation_id: correlation_id.map(str::to_owned),
            n: 0,
            sender: Some(scope.writer()),
        };
        let cap = self.c.write_cap(MAX_PAYLOAD_BYTES);
        let size = serde_json::to_vec(&post)
            .map_err(|e| ContextError::with_source(ErrorKind::Malformed, "encoding the post", e))?
            .len();
        if size > cap {
            return Err(ContextError::new(
                ErrorKind::PayloadTooLarge,
                format!(
                    "the message is {size} bytes; messages hold at most {cap} bytes (put large data in an artifact and send its reference)"
                ),
            ));
        }
        let msg_id = match (scope.attempt_id, idempotency_key) {
            (Some(attempt), _) => Some(format!(
                "mbox.{attempt}.{to_token}.{}",
                digest16(&[
                    &Value::from(kind.as_str()),
                    &post.payload,
                    &post.correlation_id.clone().map_or(Value::Null, Value::from),
                ])
            )),
            (None, Some(key)) => Some(format!(
                "mbox.key.{}.{from}.{to_token}.{}",
                scope.root_run_id,
                digest16(&[&Value::from(key)])
            )),
            (None, None) => None,
        };
        let subject = scope.names.mailbox(scope.root_run_id, &to_token, &from);
        let bus = self.c.bus();
        let mut backoff = Duration::from_millis(1);
        // A stream without a leader for a moment (a cluster node died) is ridden out until
        // then; those tries are not numbering conflicts.
        let ride_out = tokio::time::Instant::now() + crate::RIDE_OUT;
        let mut unavailable_pause = Duration::from_millis(50);
        let mut tries = 0;
        while tries < MAX_SEND_TRIES {
            tries += 1;
            let last = bus.last_for_subject(StreamKind::Mailbox, &subject).await?;
            let (expected, last_n) = last.as_ref().map_or((0, 0), |m| (m.seq, number_of(m)));
            post.n = last_n + 1;
            let body = serde_json::to_vec(&post).map_err(|e| {
                ContextError::with_source(ErrorKind::Malformed, "encoding the post", e)
            })?;
            let mut headers = HeaderMap::new();
            headers.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, expected.to_string());
            if let Some(id) = &msg_id {
                headers.insert(NATS_MESSAGE_ID, id.as_str());
            }
            let size = body.len();
            let published = match bus
                .js()
                .publish_with_headers(subject.clone(), headers, Bytes::from(body))
                .await
            {
                Ok(ack) => ack.await,
                Err(e) => Err(e),
            };
            match published {
                Ok(ack) if ack.duplicate => {
                    // The earlier send's number: read it back.
                    let n = bus
                        .direct_get(StreamKind::Mailbox, ack.sequence)
                        .await?
                        .map_or(0, |m| number_of(&m));
                    return Ok(Sent {
                        seq: ack.sequence,
                        n,
                        duplicate: true,
                    });
                }
                Ok(ack) => {
                    return Ok(Sent {
                        seq: ack.sequence,
                        n: post.n,
                        duplicate: false,
                    });
                }
                Err(e)
                    if e.kind()
                        == async_nats::jetstream::context::PublishErrorKind::WrongLastSequence =>
                {
                    debug!(%subject, "Another send numbered the pair first; retrying");
                    tokio::time::sleep(jitter(backoff)).await;
                    backoff = (backoff * 2).min(Duration::from_millis(50));
                }
                Err(e) => {
                    let e = classify_publish_error(&subject, size, bus.max_payload(), e);
                    let e = bus.confirm_unavailable(&subject, e).await;
                    if e.kind() == flotilla_bus::PublishErrorKind::Unavailable
                        && tokio::time::Instant::now() + unavailable_pause < ride_out
                    {
                        debug!(%subject, error = %e, "The mailbox stream has no leader for now; sending again");
                        tokio::time::sleep(unavailable_pause).await;
                        unavailable_pause = (unavailable_pause * 2).min(Duration::from_secs(1));
                        tries -= 1;
                        continue;
                    }
                    return Err(match e.kind() {
                        flotilla_bus::PublishErrorKind::TooLarge => ContextError::with_source(
                            ErrorKind::PayloadTooLarge,
                            format!(
                                "the message is larger than this deployment's messages (cap {cap} bytes)"
                            ),
                            e,
                        ),
                        flotilla_bus::PublishErrorKind::StreamFull => {
                            crate::error::stream_full(bus, StreamKind::Mailbox, e).await
                        }
                        _ => unavailable(format!("sending to {to}"), e),
                    });
                }
            }
        }
        Err(ContextError::new(
            ErrorKind::Unavailable,
            format!(
                "could not number a message to {to}: {MAX_SEND_TRIES} concurrent sends of the same pair won first"
            ),
        ))
    }

    /// The messages after the read position (the reader's inbox and the broadcasts of the
    /// others, by sequence), at most `limit` (see [`effective_limit`]); moves the position past
    /// them. With `wait > 0` and nothing there, blocks until a message arrives or the wait
    /// ends (event-driven; see the module docs). Commit with [`commit`](Self::commit).
    pub async fn receive(
        &self,
        limit: Option<usize>,
        wait: Duration,
    ) -> Result<MailboxPage, ContextError> {
        let reader = self.address()?.to_owned();
        let limit = effective_limit(limit);
        let mut state = self.c.handles.reader.lock().await;
        let start = self.load_position(&mut state, &reader).await?;
        let mut wake = if wait.is_zero() {
            None
        } else {
            Some(self.subscribe(&reader).await?)
        };
        let deadline = Instant::now() + wait;
        let mut after = start;
        let mut skipped = 0;
        // A message published just before the subscription started may be stored just
        // after the first read: the start counts as a wake-up.
        let mut settle: &[u64] = if wake.is_some() {
            &SETTLE_DELAYS_MS
        } else {
            &[]
        };
        let page = loop {
            let mut page = self.read_page(&reader, after, limit, true).await?;
            skipped += page.skipped;
            after = page.next_since_seq;
            if !page.messages.is_empty() {
                page.skipped = skipped;
                break page;
            }
            if page.more {
                continue;
            }
            if let Some((&ms, rest)) = settle.split_first()
                && Instant::now() < deadline
            {
                settle = rest;
                // A wake-up ends the pause at once: re-read now, then settle again.
                let pause = tokio::time::sleep(Duration::from_millis(ms));
                match wake.as_mut() {
                    Some(w) => {
                        tokio::select! {
                            () = pause => {}
                            Some(_) = w.next() => settle = &SETTLE_DELAYS_MS,
                        }
                    }
                    None => pause.await,
                }
                continue;
            }
            let woken = match wake.as_mut() {
                Some(w) if Instant::now() < deadline => {
                    let until = deadline.min(Instant::now() + MAX_QUIET);
                    match tokio::time::timeout_at(until, w.next()).await {
                        Ok(Some(_)) => true,
                        // Quiet for a while: re-read once, then wait on.
                        Err(_) if until < deadline => continue,
                        _ => false,
                    }
                }
                _ => false,
            };
            if !woken {
                break MailboxPage {
                    messages: Vec::new(),
                    next_since_seq: after,
                    more: false,
                    skipped,
                };
            }
            settle = &SETTLE_DELAYS_MS;
        };
        if after != start {
            state.position = Some(after);
            self.persist(&reader, after).await;
        }
        Ok(page)
    }

    /// The messages after `since_seq`, as [`receive`](Self::receive) would return them,
    /// without moving the read position (peeking, or an operator's read from a chosen point).
    pub async fn read_after(
        &self,
        since_seq: u64,
        limit: Option<usize>,
    ) -> Result<MailboxPage, ContextError> {
        let reader = self.address()?.to_owned();
        self.read_page(&reader, since_seq, effective_limit(limit), false)
            .await
    }

    /// Subscribes to the reader's inbox, the broadcast box and its role's box: the wake-up
    /// signal.
    pub(crate) async fn subscribe(&self, reader: &str) -> Result<Wake, ContextError> {
        let scope = self.c.scope();
        let client = self.c.bus().client();
        let inbox = client
            .subscribe(scope.names.mailbox_inbox(scope.root_run_id, reader))
            .await
            .map_err(|e| unavailable("subscribing to the inbox", e))?;
        let broadcast = client
            .subscribe(scope.names.mailbox_inbox(scope.root_run_id, BROADCAST))
            .await
            .map_err(|e| unavailable("subscribing to broadcasts", e))?;
        let both = futures::stream::select(inbox, broadcast);
        match &scope.role {
            Some(role) => {
                let role = client
                    .subscribe(
                        scope
                            .names
                            .mailbox_inbox(scope.root_run_id, &role_box(role)),
                    )
                    .await
                    .map_err(|e| unavailable("subscribing to the role's box", e))?;
                Ok(Box::pin(futures::stream::select(both, role)))
            }
            None => Ok(Box::pin(both)),
        }
    }

    /// One page for `reader` after `after`: its inbox, the broadcast box and — with `claim`,
    /// when the scope plays a role — the role's box, merged by sequence. Each filter is read
    /// up to `limit`; the merge keeps only sequences every read covers, so no message is
    /// skipped between pages. A role's message is in the page only when this reader claims it
    /// (or already had); one another reader claimed is passed over, as read.
    pub(crate) async fn read_page(
        &self,
        reader: &str,
        after: u64,
        limit: usize,
        claim: bool,
    ) -> Result<MailboxPage, ContextError> {
        let scope = self.c.scope();
        let bus = self.c.bus();
        let inbox = scope.names.mailbox_inbox(scope.root_run_id, reader);
        let broadcast = scope.names.mailbox_inbox(scope.root_run_id, BROADCAST);
        let own_broadcast = scope.names.mailbox(scope.root_run_id, BROADCAST, reader);
        let role_filter = scope
            .role
            .as_deref()
            .filter(|_| claim)
            .map(|r| scope.names.mailbox_inbox(scope.root_run_id, &role_box(r)));
        let read = |filter: String| async move {
            bus.direct_batch(
                StreamKind::Mailbox,
                &filter,
                after,
                limit,
                Some(PAGE_MAX_BYTES),
            )
            .await
        };
        let (a, b, c) = tokio::try_join!(read(inbox), read(broadcast), async {
            match role_filter {
                Some(f) => read(f).await,
                None => Ok(Vec::new()),
            }
        })?;
        // A list that stopped with more pending covers its filter only up to its last
        // sequence.
        let truncated = |l: &[StoredMessage]| l.last().filter(|m| m.num_pending > 0).map(|m| m.seq);
        let cutoff = [truncated(&a), truncated(&b), truncated(&c)]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(u64::MAX);
        let role_seqs: std::collections::HashSet<u64> = c.iter().map(|m| m.seq).collect();
        let mut merged: Vec<StoredMessage> = a
            .into_iter()
            .chain(b)
            .chain(c)
            .filter(|m| m.seq <= cutoff)
            .collect();
        merged.sort_by_key(|m| m.seq);
        let more = cutoff != u64::MAX || merged.len() > limit;
        merged.truncate(limit);
        let mut page = MailboxPage {
            messages: Vec::with_capacity(merged.len()),
            next_since_seq: merged.last().map_or(after, |m| m.seq),
            more,
            skipped: 0,
        };
        for m in merged {
            if m.subject == own_broadcast {
                continue;
            }
            match decode_post(&m) {
                Ok(msg) => {
                    if role_seqs.contains(&m.seq) && !self.claim(reader, m.seq).await? {
                        continue;
                    }
                    page.messages.push(msg);
                }
                Err(why) => {
                    warn!(subject = %m.subject, seq = m.seq, error = %why, "Skipping a malformed mailbox message");
                    page.skipped += 1;
                }
            }
        }
        Ok(page)
    }

    /// Claims the role message at `seq` for `reader`: `true` when it is this reader's (it
    /// claimed it now, or did before — a retried attempt reads it again), `false` when
    /// another reader of the role has it. The claim is a compare-and-set create in the
    /// cursors bucket, so exactly one reader wins; it expires with the mailboxes.
    async fn claim(&self, reader: &str, seq: u64) -> Result<bool, ContextError> {
        let scope = self.c.scope();
        let key = scope.names.mailbox_claim_key(scope.root_run_id, seq);
        let kv = self.c.cursors_kv().await?;
        match kv.create(&key, Bytes::from(reader.to_owned())).await {
            Ok(_) => return Ok(true),
            Err(e) if e.kind() == async_nats::jetstream::kv::CreateErrorKind::AlreadyExists => {}
            Err(e) => return Err(unavailable(format!("claiming {key}"), e)),
        }
        let holder = kv
            .get(&key)
            .await
            .map_err(|e| unavailable(format!("reading {key}"), e))?;
        Ok(holder.is_some_and(|h| h.as_ref() == reader.as_bytes()))
    }

    /// The read position, loaded on first use: the committed cursor, or — for an exec
    /// agent's process — the position its execution persisted, whichever is further.
    async fn load_position(
        &self,
        state: &mut ReaderState,
        reader: &str,
    ) -> Result<u64, ContextError> {
        if let Some(p) = state.position {
            return Ok(p);
        }
        let (committed, _) = self.read_cursor(reader).await?;
        let execution = if self.c.persist_position {
            self.read_execution_position(reader).await?
        } else {
            None
        };
        let p = committed.max(execution.unwrap_or(0));
        state.position = Some(p);
        Ok(p)
    }

    /// Moves the read position to `since_seq`: the next [`receive`](Self::receive) returns
    /// the messages after it (and may wait for them), and [`commit`](Self::commit) commits
    /// from there, never moving the committed cursor backwards. For reads from a chosen
    /// point (the API's `mbox.read` with `since_seq`), and for giving back messages that
    /// were read but not delivered (a reply cut to fit one message).
    pub async fn seek(&self, since_seq: u64) {
        self.c.handles.reader.lock().await.position = Some(since_seq);
    }

    /// The current read position (loading it from the committed cursor on first use).
    pub async fn position(&self) -> Result<u64, ContextError> {
        let reader = self.address()?.to_owned();
        let mut state = self.c.handles.reader.lock().await;
        self.load_position(&mut state, &reader).await
    }

    /// The key of this execution's persisted position, when the scope is an attempt.
    fn execution_key(&self, reader: &str) -> Option<String> {
        let scope = self.c.scope();
        Some(scope.names.mailbox_position_key(
            scope.root_run_id,
            reader,
            scope.attempt_id?,
            scope.delivery?,
        ))
    }

    async fn read_execution_position(&self, reader: &str) -> Result<Option<u64>, ContextError> {
        let Some(key) = self.execution_key(reader) else {
            return Ok(None);
        };
        let kv = self.c.cursors_kv().await?;
        let entry = kv
            .entry(key.clone())
            .await
            .map_err(|e| unavailable(format!("reading {key}"), e))?;
        Ok(entry
            .filter(|e| e.operation == Operation::Put)
            .and_then(|e| std::str::from_utf8(&e.value).ok()?.trim().parse().ok()))
    }

    /// Persists the position of this execution (exec agents), best effort: losing it only
    /// means the next read of the same execution repeats messages (at-least-once).
    async fn persist(&self, reader: &str, position: u64) {
        if !self.c.persist_position {
            return;
        }
        let Some(key) = self.execution_key(reader) else {
            return;
        };
        let stored = match self.c.cursors_kv().await {
            Ok(kv) => kv
                .put(&key, Bytes::from(position.to_string()))
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = stored {
            warn!(%key, error = %e, "Could not persist the mailbox read position");
        }
    }

    /// The reader's committed cursor and its KV revision (`None`: never written).
    async fn read_cursor(&self, reader: &str) -> Result<(u64, Option<u64>), ContextError> {
        let scope = self.c.scope();
        let key = scope.names.mailbox_cursor_key(scope.root_run_id, reader);
        let kv = self.c.cursors_kv().await?;
        let entry = kv
            .entry(key.clone())
            .await
            .map_err(|e| unavailable(format!("reading cursor {key}"), e))?;
        Ok(match entry {
            None => (0, None),
            Some(e) if e.operation != Operation::Put => (0, Some(e.revision)),
            Some(e) => {
                let seq = std::str::from_utf8(&e.value)
                    .ok()
                    .and_then(|v| v.trim().parse().ok())
                    .ok_or_else(|| {
                        ContextError::new(
                            ErrorKind::Malformed,
                            format!("cursor {key} does not hold a sequence number"),
                        )
                    })?;
                (seq, Some(e.revision))
            }
        })
    }

    /// The reader's committed cursor (0 when it never committed).
    pub async fn committed(&self) -> Result<u64, ContextError> {
        let reader = self.address()?.to_owned();
        Ok(self.read_cursor(&reader).await?.0)
    }

    /// Commits the read position as the reader's cursor: a later attempt (or handle) starts
    /// after it. Never moves the cursor backwards. Returns the committed cursor, or `None`
    /// when this handle has read nothing (then nothing is written).
    pub async fn commit(&self) -> Result<Option<u64>, ContextError> {
        let reader = self.address()?.to_owned();
        let mut state = self.c.handles.reader.lock().await;
        let Some(position) = state.position else {
            return Ok(None);
        };
        let scope = self.c.scope();
        let key = scope.names.mailbox_cursor_key(scope.root_run_id, &reader);
        let kv = self.c.cursors_kv().await?;
        let mut committed = None;
        for _ in 0..MAX_SEND_TRIES {
            let (current, revision) = self.read_cursor(&reader).await?;
            if position <= current {
                committed = Some(current);
                break;
            }
            let value = Bytes::from(position.to_string());
            let written = match revision {
                None => kv.create(&key, value).await.map(|_| ()).map_err(|e| {
                    (
                        e.kind() == async_nats::jetstream::kv::CreateErrorKind::AlreadyExists,
                        e.to_string(),
                    )
                }),
                Some(rev) => kv.update(&key, value, rev).await.map(|_| ()).map_err(|e| {
                    (
                        e.kind() == async_nats::jetstream::kv::UpdateErrorKind::WrongLastRevision,
                        e.to_string(),
                    )
                }),
            };
            match written {
                Ok(()) => {
                    committed = Some(position);
                    break;
                }
                // Another handle of the same reader committed meanwhile: re-read.
                Err((true, _)) => continue,
                Err((false, e)) => {
                    return Err(ContextError::new(
                        ErrorKind::Unavailable,
                        format!("committing cursor {key}: {e}"),
                    ));
                }
            }
        }
        let Some(committed) = committed else {
            return Err(ContextError::new(
                ErrorKind::Unavailable,
                format!("committing cursor {key}: it kept changing"),
            ));
        };
        if state.adopted
            && let Some(exec_key) = self.execution_key(&reader)
        {
            // The execution's position is committed; its key is no longer needed.
            if let Err(e) = kv.purge(&exec_key).await {
                debug!(key = %exec_key, error = %e, "Could not remove a committed read position");
            }
            state.adopted = false;
        }
        Ok(Some(committed))
    }

    /// Takes over the read position an exec agent's processes persisted for this execution
    /// (the worker calls it when an exec agent succeeds, then commits).
    pub async fn adopt_execution_position(&self) -> Result<(), ContextError> {
        let Ok(reader) = self.address().map(str::to_owned) else {
            return Ok(());
        };
        let Some(persisted) = self.read_execution_position(&reader).await? else {
            return Ok(());
        };
        let mut state = self.c.handles.reader.lock().await;
        state.position = Some(state.position.unwrap_or(0).max(persisted));
        state.adopted = true;
        Ok(())
    }

    /// The counts of `mailbox` (a task id, `*` for the broadcast box; default: the scope's
    /// own): per sender, posts sent, still retained and dropped (by the cap or the age
    /// limit), from the pair numbering; the owner's committed cursor and unread count.
    pub async fn stats(&self, mailbox: Option<&str>) -> Result<MailboxStats, ContextError> {
        let mailbox = match mailbox {
            Some(m) => m.to_owned(),
            None => self.address()?.to_owned(),
        };
        let (to_token, shown) = recipient(&mailbox)?;
        let scope = self.c.scope();
        let bus = self.c.bus();
        let name = bus.names().stream(StreamKind::Mailbox);
        let stream = bus
            .js()
            .get_stream(&name)
            .await
            .map_err(|e| unavailable(format!("opening stream {name}"), e))?;
        let filter = scope.names.mailbox_inbox(scope.root_run_id, &to_token);
        let mut subjects: Vec<(String, usize)> = stream
            .info_with_subjects(&filter)
            .await
            .map_err(|e| unavailable(format!("counting {filter}"), e))?
            .try_collect()
            .await
            .map_err(|e| unavailable(format!("counting {filter}"), e))?;
        subjects.sort();
        let mut stats = MailboxStats {
            mailbox: shown,
            senders: Vec::with_capacity(subjects.len()),
            sent: 0,
            retained: 0,
            dropped: 0,
            committed: 0,
            unread: 0,
        };
        for (subject, count) in subjects {
            let first = bus
                .direct_batch(StreamKind::Mailbox, &subject, 0, 1, None)
                .await?;
            let last = bus.last_for_subject(StreamKind::Mailbox, &subject).await?;
            let first_n = first.first().map_or(0, number_of);
            let last_n = last.as_ref().map_or(0, number_of);
            let sender = SenderStats {
                from: pair_of(&subject).1.to_owned(),
                sent: last_n,
                retained: count as u64,
                dropped: first_n.saturating_sub(1),
            };
            stats.sent += sender.sent;
            stats.retained += sender.retained;
            stats.dropped += sender.dropped;
            stats.senders.push(sender);
        }
        if to_token == BROADCAST {
            stats.unread = stats.retained;
        } else {
            stats.committed = self.read_cursor(&mailbox).await?.0;
            let count = |filter: String| async move {
                let first = bus
                    .direct_batch(StreamKind::Mailbox, &filter, stats.committed, 1, None)
                    .await?;
                Ok::<u64, ContextError>(first.first().map_or(0, |m| m.num_pending + 1))
            };
            let inbox = count(filter.clone()).await?;
            let broadcasts = count(scope.names.mailbox_inbox(scope.root_run_id, BROADCAST)).await?;
            let own = count(scope.names.mailbox(scope.root_run_id, BROADCAST, &mailbox)).await?;
            stats.unread = inbox + broadcasts.saturating_sub(own);
        }
        Ok(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert!(check_address("calc_growth").is_ok());
        assert!(check_address("売上").is_ok());
        for bad in ["", "a.b", "a*", "a b", "_all", "_x"] {
            assert_eq!(
                check_address(bad).expect_err(bad).code(),
                "invalid_address",
                "{bad}"
            );
        }
        assert_eq!(
            recipient("*").expect("broadcast"),
            ("_all".to_string(), "*".to_string())
        );
        assert_eq!(pair_of("flotilla.mbox.r.to.from"), ("to", "from"));
    }

    #[test]
    fn limits() {
        assert_eq!(effective_limit(None), 100);
        assert_eq!(effective_limit(Some(5000)), 1000);
    }
}
