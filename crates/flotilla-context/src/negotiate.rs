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
//! predecessor's requests (deduplicated) and finds the offers already made to them.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use flotilla_model::mailbox::{MailboxKind, MailboxMessage};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tokio::time::Instant;
use tracing::warn;

use crate::error::{ContextError, ErrorKind};
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
    /// `confidence`, or from others than the candidates, are ignored.
    pub async fn negotiate(
        &self,
        candidates: &[String],
        request: Value,
        work: Value,
        deadline: Duration,
    ) -> Result<Option<Award>, ContextError> {
        let me = self.address()?.to_owned();
        let mut unique: Vec<String> = candidates.to_vec();
        unique.sort();
        unique.dedup();
        if unique.is_empty() {
            return Err(ContextError::new(
                ErrorKind::InvalidAddress,
                "a negotiation needs at least one candidate",
            ));
        }
        for c in &unique {
            check_address(c)?;
            if *c == me {
                return Err(ContextError::new(
                    ErrorKind::InvalidAddress,
                    format!("{me} cannot negotiate with itself"),
                ));
            }
        }
        let ends = Instant::now() + deadline;
        let correlation = self.fresh_correlation();
        let mut first_seq = u64::MAX;
        for c in &unique {
            let sent = self
                .send(c, MailboxKind::Request, request.clone(), Some(&correlation))
                .await?;
            first_seq = first_seq.min(sent.seq);
        }
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
            return Ok(None);
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
        let others: Vec<String> = unique.into_iter().filter(|c| *c != best.from).collect();
        self.close(&others, Some(&best.from), &correlation).await?;
        Ok(Some(Award {
            correlation_id: correlation,
            winner: best.from,
            confidence: best.confidence,
            offers,
            accept,
            delegation,
        }))
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
    /// returned yet, waiting up to `wait` for one.
    pub async fn next_request(
        &self,
        wait: Duration,
    ) -> Result<Option<MailboxMessage>, ContextError> {
        let position = self.position().await?;
        let from = {
            let state = self.c.handles.reader.lock().await;
            state.request_cursor.max(position)
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
        }
        Ok(found)
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
