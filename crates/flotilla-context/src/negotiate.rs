//! Contract-net negotiation over mailboxes: one task asks several for offers and delegates the
//! work to the best.
//!
//! ```text
//! initiator                                   each candidate (responder)
//!   negotiate(candidates, request, work, deadline)
//!     ── request {…request, correlation_id} ──►  next_request(wait)
//!     ◄── offer {confidence, …} ──────────────── offer(&request, confidence, payload)
//!   (until every candidate offered or the deadline)
//!   winner = highest confidence; ties → lowest candidate id
//!     ── accept {confidence} ─────────────────►  await_award(&request, wait)
//!     ── delegation {work} ───────────────────►    → Some(delegation) for the winner
//!     ── info {closed, winner} ───────────────►    → None at once for the others
//!   → Award { winner, offers }
//! ```
//!
//! The helpers **peek**: they find the messages they look for (by type and correlation id)
//! after the read position without moving it, so nothing else in the mailbox is lost and a
//! later [`Mailbox::receive`] still returns everything, negotiation messages included.
//! Waiting is event-driven, as for `receive`.
//!
//! Within an attempt, correlation ids are derived from the attempt id and a counter
//! (`<attempt>.neg<k>`), so a redelivered attempt that negotiates again reuses its
//! predecessor's requests (deduplicated) and finds the offers already made to them. Callers
//! that are not one process per attempt (the CLI, a tool call) give their own deterministic
//! correlation id ([`Mailbox::run_negotiation`]).
//!
//! **Candidates by role.** A candidate `role:<name>` stands for every task of the run tree
//! that plays the role — its subtask names the role, or its agent's member card lists it —
//! as the coordinator's `mbox.role` endpoint answers ([`Mailbox::role_tasks`]); the initiator
//! is left out of its own role. Unlike a message to `role:<name>` (claimed by exactly one
//! reader), a call for offers goes to all of them. A role no task plays is `unknown_role`.
//!
//! **Responders in separate processes** (exec agents: each `flotilla mbox next-request` is a
//! new process) keep the request cursor of their execution in the cursors bucket, next to the
//! read position, and find a request again by its correlation id
//! ([`Mailbox::find_request`]).

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::jetstream::kv::Operation;
use bytes::Bytes;
use flotilla_model::api::{
    ApiError, ApiRequest, MboxNegotiateReply, MboxRoleReply, MboxRoleRequest, NegotiationOffer,
    NegotiationOutcome,
};
use flotilla_model::mailbox::{MailboxKind, MailboxMessage, addressed_role};
use flotilla_model::token::check_name;
use flotilla_model::{ErrorCode, PROTOCOL_VERSION};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tokio::time::Instant;
use tracing::warn;

use crate::error::{ContextError, ErrorKind, unavailable};
use crate::mailbox::{MAX_QUIET, Mailbox, SETTLE_DELAYS_MS, Sent, check_address};

/// The payload field of an offer holding its confidence (a number; higher wins).
pub const CONFIDENCE: &str = "confidence";

/// The payload field of the initiator's `info` that tells a candidate the negotiation was
/// decided without it.
pub const CLOSED: &str = "closed";

/// An offer received by the initiator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Offer {
    /// The candidate that offered.
    pub from: String,
    /// Its confidence.
    pub confidence: f64,
    /// The whole offer payload.
    pub payload: Value,
    /// Stream sequence of the offer.
    pub seq: u64,
}

/// The outcome of a negotiation that found a winner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Award {
    /// Ties the request, offers, accept and delegation together.
    pub correlation_id: String,
    /// The chosen candidate.
    pub winner: String,
    /// Its confidence.
    pub confidence: f64,
    /// Every valid offer received before the deadline, by candidate id.
    pub offers: Vec<Offer>,
    /// The accept sent to the winner.
    pub accept: Sent,
    /// The delegation (carrying the work) sent to the winner.
    pub delegation: Sent,
}

/// A decided negotiation: its candidates and offers, and the award when one was made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Negotiated {
    /// Ties the request, offers, accept and delegation together.
    pub correlation_id: String,
    /// The candidates asked (roles expanded), sorted.
    pub candidates: Vec<String>,
    /// Every valid offer received before the deadline, by candidate id.
    pub offers: Vec<Offer>,
    /// The award; `None` when no candidate offered in time.
    pub award: Option<Award>,
}

impl Negotiated {
    /// The wire form (`mbox.negotiate`'s reply; what `flotilla mbox negotiate` prints and the
    /// `negotiate` tool returns).
    pub fn reply(&self) -> MboxNegotiateReply {
        MboxNegotiateReply {
            protocol: PROTOCOL_VERSION,
            outcome: if self.award.is_some() {
                NegotiationOutcome::Awarded
            } else {
                NegotiationOutcome::NoOffers
            },
            correlation_id: self.correlation_id.clone(),
            candidates: self.candidates.clone(),
            winner: self.award.as_ref().map(|a| a.winner.clone()),
            confidence: self.award.as_ref().map(|a| a.confidence),
            offers: self
                .offers
                .iter()
                .map(|o| NegotiationOffer {
                    from: o.from.clone(),
                    confidence: o.confidence,
                    payload: o.payload.clone(),
                    seq: o.seq,
                })
                .collect(),
            delegation_seq: self.award.as_ref().map(|a| a.delegation.seq),
        }
    }
}

/// Picks the winner: highest confidence, ties to the lowest candidate id.
pub fn pick_winner(offers: &[Offer]) -> Option<&Offer> {
    offers.iter().max_by(|a, b| {
        a.confidence
            .total_cmp(&b.confidence)
            .then_with(|| b.from.cmp(&a.from))
    })
}

/// What a scan does with a message.
enum Scan {
    Next,
    Stop,
}

impl Mailbox {
    /// Peeks at the reader's messages after `after`, calling `visit` on each, until it says
    /// stop or — with nothing new — the deadline passes. Event-driven: subscribes before
    /// reading and sleeps until a message arrives. Returns whether `visit` stopped.
    async fn scan(
        &self,
        mut after: u64,
        deadline: Instant,
        mut visit: impl FnMut(&MailboxMessage) -> Scan,
    ) -> Result<bool, ContextError> {
        let reader = self.address()?.to_owned();
        let mut wake = self.subscribe(&reader).await?;
        // A message published just before the subscription started may be stored just after
        // the first read: the start counts as a wake-up.
        let mut settle: &[u64] = &SETTLE_DELAYS_MS;
        loop {
            let page = self.read_page(&reader, after, 1000, false).await?;
            after = page.next_since_seq;
            let found_new = !page.messages.is_empty();
            for m in &page.messages {
                if let Scan::Stop = visit(m) {
                    return Ok(true);
                }
            }
            if page.more {
                continue;
            }
            if found_new {
                settle = &[];
            }
            // After a wake-up, re-read with back-off: the message may not be readable yet.
            if let Some((&ms, rest)) = settle.split_first()
                && Instant::now() < deadline
            {
                settle = rest;
                tokio::time::sleep(Duration::from_millis(ms)).await;
                continue;
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            let until = deadline.min(Instant::now() + MAX_QUIET);
            match tokio::time::timeout_at(until, wake.next()).await {
                Ok(Some(_)) => settle = &SETTLE_DELAYS_MS,
                // Quiet for a while: re-read once in case a wake-up was lost.
                Err(_) if until < deadline => {}
                _ => return Ok(false),
            }
        }
    }

    /// Initiator: asks each of `candidates` for an offer on `request` (sent as a `request`
    /// message), collects `offer`s until every candidate answered or `deadline` passed, then
    /// sends the best candidate an `accept` and a `delegation` carrying `work`. Returns the
    /// award, or `None` when no candidate offered in time. Offers without a numeric
    /// `confidence`, or from others than the candidates, are ignored. A candidate
    /// `role:<name>` stands for every task of the run tree playing the role (module docs).
    pub async fn negotiate(
        &self,
        candidates: &[String],
        request: Value,
        work: Value,
        deadline: Duration,
    ) -> Result<Option<Award>, ContextError> {
        Ok(self
            .run_negotiation(None, candidates, request, work, deadline)
            .await?
            .award)
    }

    /// [`negotiate`](Self::negotiate) with a chosen correlation id (`None`: the next one of
    /// this handle), answering the candidates and offers as well as the award. Every input is
    /// checked before anything is sent: a refused negotiation sends nothing.
    pub async fn run_negotiation(
        &self,
        correlation: Option<&str>,
        candidates: &[String],
        request: Value,
        work: Value,
        deadline: Duration,
    ) -> Result<Negotiated, ContextError> {
        let unique = self.expand_candidates(candidates).await?;
        let correlation = match correlation {
            Some(c) => {
                check_correlation(c)?;
                c.to_owned()
            }
            None => self.fresh_correlation(),
        };
        let ends = Instant::now() + deadline;
        let mut first_seq = u64::MAX;
        for c in &unique {
            let sent = self
                .send(c, MailboxKind::Request, request.clone(), Some(&correlation))
                .await?;
            first_seq = first_seq.min(sent.seq);
        }
        // A repeated negotiation (same correlation) sends nothing new (the requests are
        // deduplicated, answering the first ones' sequences) and finds the offers made to it.
        let mut offers: BTreeMap<String, Offer> = BTreeMap::new();
        self.scan(first_seq, ends, |m| {
            if m.kind != MailboxKind::Offer || m.correlation_id.as_deref() != Some(&correlation) {
                return Scan::Next;
            }
            if !unique.contains(&m.from) || offers.contains_key(&m.from) {
                return Scan::Next;
            }
            match m.payload.get(CONFIDENCE).and_then(Value::as_f64) {
                Some(confidence) => {
                    offers.insert(
                        m.from.clone(),
                        Offer {
                            from: m.from.clone(),
                            confidence,
                            payload: m.payload.clone(),
                            seq: m.seq,
                        },
                    );
                }
                None => {
                    warn!(from = %m.from, correlation = %correlation, "Ignoring an offer without a numeric confidence");
                }
            }
            if offers.len() == unique.len() {
                Scan::Stop
            } else {
                Scan::Next
            }
        })
        .await?;
        let offers: Vec<Offer> = offers.into_values().collect();
        let Some(best) = pick_winner(&offers).cloned() else {
            self.close(&unique, None, &correlation).await?;
            return Ok(Negotiated {
                correlation_id: correlation,
                candidates: unique,
                offers,
                award: None,
            });
        };
        let mut accept_body = Map::new();
        accept_body.insert(CONFIDENCE.into(), Value::from(best.confidence));
        let accept = self
            .send(
                &best.from,
                MailboxKind::Accept,
                Value::Object(accept_body),
                Some(&correlation),
            )
            .await?;
        let delegation = self
            .send(
                &best.from,
                MailboxKind::Delegation,
                work,
                Some(&correlation),
            )
            .await?;
        let others: Vec<String> = unique
            .iter()
            .filter(|c| **c != best.from)
            .cloned()
            .collect();
        self.close(&others, Some(&best.from), &correlation).await?;
        Ok(Negotiated {
            award: Some(Award {
                correlation_id: correlation.clone(),
                winner: best.from,
                confidence: best.confidence,
                offers: offers.clone(),
                accept,
                delegation,
            }),
            correlation_id: correlation,
            candidates: unique,
            offers,
        })
    }

    /// The candidates as addresses: each checked, `role:<name>` expanded to the tasks of the
    /// run tree playing the role (without this task), sorted, without repeats. None given,
    /// or none left, is `invalid_address`; a role nobody plays is `unknown_role`.
    pub async fn expand_candidates(
        &self,
        candidates: &[String],
    ) -> Result<Vec<String>, ContextError> {
        let me = self.address()?.to_owned();
        if candidates.is_empty() {
            return Err(ContextError::new(
                ErrorKind::InvalidAddress,
                "a negotiation needs at least one candidate (a task id, or role:<name>)",
            ));
        }
        let mut unique: Vec<String> = Vec::with_capacity(candidates.len());
        let mut roles = Vec::new();
        for c in candidates {
            match addressed_role(c) {
                Some(role) => {
                    check_name(role).map_err(|e| {
                        ContextError::new(
                            ErrorKind::InvalidAddress,
                            format!("candidate {c:?}: the role {role:?} {e}"),
                        )
                    })?;
                    roles.push(role);
                }
                None => {
                    check_address(c)?;
                    if *c == me {
                        return Err(ContextError::new(
                            ErrorKind::InvalidAddress,
                            format!("{me} cannot negotiate with itself"),
                        ));
                    }
                    unique.push(c.clone());
                }
            }
        }
        for role in roles {
            let tasks = self.role_tasks(role).await?;
            unique.extend(tasks.into_iter().filter(|t| *t != me));
        }
        unique.sort();
        unique.dedup();
        if unique.is_empty() {
            return Err(ContextError::new(
                ErrorKind::InvalidAddress,
                format!(
                    "no candidate is left: the roles named are played only by {me}, the initiator"
                ),
            ));
        }
        Ok(unique)
    }

    /// The tasks of the run tree playing `role`, from the coordinator's `mbox.role` endpoint
    /// (it knows the plans and the member cards): sorted, `unknown_role` when none plays it.
    pub async fn role_tasks(&self, role: &str) -> Result<Vec<String>, ContextError> {
        check_name(role).map_err(|e| {
            ContextError::new(ErrorKind::InvalidAddress, format!("the role {role:?} {e}"))
        })?;
        let reply: MboxRoleReply = api_request(
            &self.c,
            &MboxRoleRequest {
                protocol: PROTOCOL_VERSION,
                run_id: self.c.scope().run_id,
                role: role.to_owned(),
            },
        )
        .await?;
        Ok(reply.tasks)
    }

    /// Tells `candidates` the negotiation is decided without them (a reject, in contract-net
    /// terms), so they stop waiting for an award at once instead of at their wait's end.
    async fn close(
        &self,
        candidates: &[String],
        winner: Option<&str>,
        correlation: &str,
    ) -> Result<(), ContextError> {
        for c in candidates {
            let mut body = Map::new();
            body.insert(CLOSED.into(), Value::Bool(true));
            if let Some(w) = winner {
                body.insert("winner".into(), Value::from(w));
            }
            self.send(c, MailboxKind::Info, Value::Object(body), Some(correlation))
                .await?;
        }
        Ok(())
    }

    /// A correlation id for a new negotiation: deterministic within an attempt, fresh
    /// otherwise.
    fn fresh_correlation(&self) -> String {
        let k = self.c.handles.negotiations.fetch_add(1, Ordering::Relaxed);
        match self.c.scope().attempt_id {
            Some(attempt) => format!("{attempt}.neg{k}"),
            None => format!("neg.{}", uuid::Uuid::now_v7()),
        }
    }

    /// Responder: the next `request` after the read position that this handle has not
    /// returned yet, waiting up to `wait` for one. With the read position persisted (exec
    /// agents), the request cursor is persisted too, so the next process of the execution
    /// continues after the request this one returned.
    pub async fn next_request(
        &self,
        wait: Duration,
    ) -> Result<Option<MailboxMessage>, ContextError> {
        let position = self.position().await?;
        let persisted = self.load_request_cursor().await?;
        let from = {
            let state = self.c.handles.reader.lock().await;
            state.request_cursor.max(position).max(persisted)
        };
        let mut found = None;
        self.scan(from, Instant::now() + wait, |m| {
            if m.kind == MailboxKind::Request {
                found = Some(m.clone());
                Scan::Stop
            } else {
                Scan::Next
            }
        })
        .await?;
        if let Some(m) = &found {
            let mut state = self.c.handles.reader.lock().await;
            state.request_cursor = state.request_cursor.max(m.seq);
            drop(state);
            self.store_request_cursor(m.seq).await;
        }
        Ok(found)
    }

    /// The key of this execution's request cursor (exec agents), beside its read position.
    fn request_cursor_key(&self) -> Option<String> {
        if !self.c.persist_position {
            return None;
        }
        let scope = self.c.scope();
        Some(format!(
            "{}.req",
            scope.names.mailbox_position_key(
                scope.root_run_id,
                scope.address().ok()?,
                scope.attempt_id?,
                scope.delivery?,
            )
        ))
    }

    async fn load_request_cursor(&self) -> Result<u64, ContextError> {
        let Some(key) = self.request_cursor_key() else {
            return Ok(0);
        };
        let kv = self.c.cursors_kv().await?;
        let entry = kv
            .entry(key.clone())
            .await
            .map_err(|e| unavailable(format!("reading {key}"), e))?;
        Ok(entry
            .filter(|e| e.operation == Operation::Put)
            .and_then(|e| std::str::from_utf8(&e.value).ok()?.trim().parse().ok())
            .unwrap_or(0))
    }

    /// Best effort, like the read position: losing it only means the next process of the
    /// execution returns the same request again.
    async fn store_request_cursor(&self, seq: u64) {
        let Some(key) = self.request_cursor_key() else {
            return;
        };
        let stored = match self.c.cursors_kv().await {
            Ok(kv) => kv
                .put(&key, Bytes::from(seq.to_string()))
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = stored {
            warn!(%key, error = %e, "Could not persist the request cursor");
        }
    }

    /// Responder: the `request` with `correlation` in this task's mailbox (its inbox and the
    /// broadcasts, from the start of what the stream keeps), without moving anything — how a
    /// responder that kept only the correlation id (a CLI call, a tool call) finds it again.
    /// `not_found` when there is none.
    pub async fn find_request(&self, correlation: &str) -> Result<MailboxMessage, ContextError> {
        check_correlation(correlation)?;
        let mut found = None;
        self.scan(0, Instant::now(), |m| {
            if m.kind == MailboxKind::Request && m.correlation_id.as_deref() == Some(correlation) {
                found = Some(m.clone());
                Scan::Stop
            } else {
                Scan::Next
            }
        })
        .await?;
        found.ok_or_else(|| {
            ContextError::new(
                ErrorKind::NotFound,
                format!(
                    "no request with correlation id {correlation:?} was sent to {}",
                    self.address().unwrap_or("this task")
                ),
            )
        })
    }

    /// Responder: offers to do what `request` asks, with `confidence`; `payload` (an object,
    /// or any value, kept under `detail`) travels with it.
    pub async fn offer(
        &self,
        request: &MailboxMessage,
        confidence: f64,
        payload: Value,
    ) -> Result<Sent, ContextError> {
        let correlation = correlation_of(request)?;
        if !confidence.is_finite() {
            return Err(ContextError::new(
                ErrorKind::Malformed,
                format!("confidence {confidence} is not a finite number"),
            ));
        }
        let mut body = match payload {
            Value::Object(m) => m,
            Value::Null => Map::new(),
            other => {
                let mut m = Map::new();
                m.insert("detail".into(), other);
                m
            }
        };
        body.insert(CONFIDENCE.into(), Value::from(confidence));
        self.send(
            &request.from,
            MailboxKind::Offer,
            Value::Object(body),
            Some(correlation),
        )
        .await
    }

    /// Responder: waits up to `wait` for the delegation that awards `request` to this task
    /// (it follows the initiator's accept). `None`: another candidate won (the initiator's
    /// `info` with `closed: true` ends the wait at once), or the initiator did not decide in
    /// time.
    pub async fn await_award(
        &self,
        request: &MailboxMessage,
        wait: Duration,
    ) -> Result<Option<MailboxMessage>, ContextError> {
        let correlation = correlation_of(request)?.to_owned();
        let mut found = None;
        self.scan(request.seq, Instant::now() + wait, |m| {
            if m.from != request.from || m.correlation_id.as_deref() != Some(&correlation) {
                Scan::Next
            } else if m.kind == MailboxKind::Delegation {
                found = Some(m.clone());
                Scan::Stop
            } else if m.kind == MailboxKind::Info
                && m.payload.get(CLOSED).and_then(Value::as_bool) == Some(true)
            {
                Scan::Stop
            } else {
                Scan::Next
            }
        })
        .await?;
        Ok(found)
    }
}

/// Longest correlation id accepted from a caller.
pub const MAX_CORRELATION_LEN: usize = 256;

/// Checks a caller's correlation id: 1 to 256 characters, no control characters.
fn check_correlation(c: &str) -> Result<(), ContextError> {
    if c.is_empty() || c.len() > MAX_CORRELATION_LEN || c.chars().any(char::is_control) {
        return Err(ContextError::new(
            ErrorKind::Malformed,
            format!(
                "correlation id {c:?} must be 1 to {MAX_CORRELATION_LEN} characters without control characters"
            ),
        ));
    }
    Ok(())
}

/// One request to the coordinators' API, asked again while no coordinator answers (a
/// restart) until the connection's request timeout; an `ApiError` answer becomes the
/// matching context error.
async fn api_request<R: ApiRequest>(
    c: &crate::Clients,
    request: &R,
) -> Result<R::Reply, ContextError> {
    let body = serde_json::to_vec(request)
        .map_err(|e| ContextError::with_source(ErrorKind::Malformed, "encoding", e))?;
    let bus = c.bus();
    let subject = bus.names().api(R::ENDPOINT);
    let body = Bytes::from(body);
    let timeout = bus.options().request_timeout;
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(50);
    let reply = loop {
        let sent = tokio::time::timeout_at(
            deadline,
            bus.client().request(subject.clone(), body.clone()),
        )
        .await
        .map_err(|_| {
            ContextError::new(
                ErrorKind::Unavailable,
                format!("no coordinator answered {} within {timeout:?}", R::ENDPOINT),
            )
        })?;
        match sent {
            Ok(reply) => break reply,
            Err(e)
                if e.kind() == async_nats::RequestErrorKind::NoResponders
                    && Instant::now() + pause < deadline =>
            {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            Err(e) => return Err(unavailable(format!("asking {}", R::ENDPOINT), e)),
        }
    };
    let failed = reply
        .headers
        .as_ref()
        .is_some_and(|h| h.get("Nats-Service-Error-Code").is_some());
    if failed {
        let e: ApiError = serde_json::from_slice(&reply.payload).map_err(|e| {
            ContextError::with_source(
                ErrorKind::Malformed,
                format!("reading {}'s error", R::ENDPOINT),
                e,
            )
        })?;
        let kind = match (e.status, e.error_code()) {
            (_, Some(ErrorCode::UnknownRole)) => ErrorKind::UnknownRole,
            (_, Some(ErrorCode::InvalidAddress)) => ErrorKind::InvalidAddress,
            (404, _) => ErrorKind::NotFound,
            (503 | 504, _) => ErrorKind::Unavailable,
            _ => ErrorKind::Malformed,
        };
        return Err(ContextError::new(kind, e.message));
    }
    serde_json::from_slice(&reply.payload).map_err(|e| {
        ContextError::with_source(
            ErrorKind::Malformed,
            format!("reading {}'s answer", R::ENDPOINT),
            e,
        )
    })
}

fn correlation_of(request: &MailboxMessage) -> Result<&str, ContextError> {
    request.correlation_id.as_deref().ok_or_else(|| {
        ContextError::new(
            ErrorKind::Malformed,
            format!(
                "the request from {} (seq {}) has no correlation id to answer",
                request.from, request.seq
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer(from: &str, confidence: f64) -> Offer {
        Offer {
            from: from.into(),
            confidence,
            payload: Value::Null,
            seq: 0,
        }
    }

    #[test]
    fn highest_confidence_wins_and_ties_go_to_the_lowest_id() {
        let offers = [offer("b", 0.7), offer("a", 0.9), offer("c", 0.9)];
        assert_eq!(pick_winner(&offers).map(|o| o.from.as_str()), Some("a"));
        let offers = [offer("z", 0.2), offer("y", 0.8)];
        assert_eq!(pick_winner(&offers).map(|o| o.from.as_str()), Some("y"));
        assert!(pick_winner(&[]).is_none());
    }
}
