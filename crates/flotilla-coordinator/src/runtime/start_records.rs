//! Lazy start recording: a run's start step is performed at once but recorded later (see the
//! [module docs](super)). [`Runtime::flush`] writes the record of a start still owed and
//! acknowledges the messages that started the run; [`Runtime::replay`] rebuilds a start that
//! was performed but never recorded from the run's first message, so another coordinator can
//! perform it again.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::AckKind;
use flotilla_model::ids::RunId;
use flotilla_model::runlog::{RunInput, RunLogEntry};
use tracing::{debug, warn};

use crate::error::StoreErrorKind;
use crate::machine::{Action, RunMachine};
use crate::store::{FirstMessage, SnapshotRef};

use super::perform::Replies;
use super::{Cached, Decoded, Runtime, StepError, Unflushed};

impl Runtime {
    /// Records a run's start (its record, then its events) and acknowledges the message that
    /// started it. Returns the entry to keep cached.
    pub(super) async fn flush(&self, run: RunId, mut entry: Cached) -> Option<Cached> {
        let Some(unflushed) = entry.unflushed.take() else {
            return Some(entry);
        };
        // The messages that started the run produced this outbox: if its events cannot be
        // published now, their redelivery finds the record and publishes them.
        let seqs: Vec<u64> = unflushed
            .msgs
            .iter()
            .filter_map(|m| m.info().ok().map(|i| i.stream_sequence))
            .collect();
        let snapshot = SnapshotRef {
            state: entry.machine.state(),
            outbox: &unflushed.events,
            outbox_seqs: &seqs,
        };
        match self.store.create(run, &snapshot).await {
            Ok(revision) => entry.revision = revision,
            Err(e) if e.kind() == StoreErrorKind::AlreadyExists => {
                // Another coordinator rebuilt and recorded the start (and performed it again):
                // its record covers this message. Forget the cached copy.
                debug!(%run, seqs = ?seqs, "Start recorded elsewhere; acknowledging its inputs");
                for m in &unflushed.msgs {
                    let _ = m.ack().await;
                }
                return None;
            }
            Err(e) => {
                // Handed back to the consumer: its redelivery finds the run cached (or
                // rebuilds it) and records the start then.
                warn!(%run, error = %e, "Cannot record a run's start yet; retrying soon");
                for m in &unflushed.msgs {
                    let _ = m
                        .ack_with(AckKind::Nak(Some(Duration::from_millis(500))))
                        .await;
                }
                entry.unflushed = Some(Unflushed {
                    events: unflushed.events,
                    msgs: Vec::new(),
                });
                return Some(entry);
            }
        }
        if let Err(e) = self
            .perform(
                &mut entry,
                &unflushed.events,
                &tracing::Span::none(),
                Replies::Send,
            )
            .await
        {
            let reason = match e {
                StepError::Failed(r) | StepError::Terminal(r) => r,
                StepError::Conflict | StepError::Stale => "conflict".into(),
                StepError::Wait(_) => "waiting for a quota".into(),
            };
            // The record's outbox holds the events: a redelivery re-performs them.
            warn!(%run, %reason, "Publishing a run's start events failed; they will be re-published");
            for m in &unflushed.msgs {
                let _ = m
                    .ack_with(AckKind::Nak(Some(Duration::from_millis(250))))
                    .await;
            }
            return Some(entry);
        }
        for m in &unflushed.msgs {
            let _ = m.ack().await;
        }
        Some(entry)
    }

    /// A run that is neither cached nor recorded: rebuilt from its first message (a start
    /// that was performed but not yet recorded), with the start's actions to perform again.
    /// `None` when the run has no first message, when the first message is among `inputs`
    /// (the run starts now), or when it is a client's submission that turns out invalid: a
    /// client's own submission is validated again, exactly as its coordinator validated it,
    /// so no coordinator ever starts a run that another rejected (or is rejecting). Nor
    /// when `inputs` hold the run's rejection: a refusal at admission (`tree_too_large`,
    /// `quota_exceeded`) rests on facts a verdict made again does not read.
    pub(super) async fn replay(
        &self,
        run: RunId,
        inputs: &[Decoded],
    ) -> Result<Option<(Cached, Vec<Action>)>, StepError> {
        let first = match self.store.first_message(run).await {
            Ok(f) => f,
            Err(e) if e.kind() == StoreErrorKind::Decode => {
                return Err(StepError::Terminal(e.to_string()));
            }
            Err(e) => return Err(e.into()),
        };
        let Some(first) = first else { return Ok(None) };
        if inputs.iter().any(|d| d.seq == first.seq) {
            return Ok(None);
        }
        // The run's rejection is among the inputs: its admission was refused (by the tree's
        // size or the installation's quota, say: facts the verdict made again does not see),
        // so the rejection decides and nothing is rebuilt, nor dispatched.
        let rejected = inputs.iter().any(|d| {
            matches!(
                &d.inbound,
                super::Inbound::Entry(RunLogEntry {
                    input: RunInput::Rejected(_),
                    ..
                })
            )
        });
        let submitted = match first.content {
            FirstMessage::Submission { .. } if rejected => return Ok(None),
            FirstMessage::Submission { request, trace } => {
                match self.verdict(run, Ok(&request), trace, first.ts_ms).await? {
                    Ok(mut submitted) => {
                        // Its admission took its slot; it spends under what the tenant has
                        // left now.
                        if let Some(q) = &self.quota {
                            q.rebuilt(run, &mut submitted).await;
                        }
                        submitted
                    }
                    Err(rejected) => {
                        self.reject(run, &rejected, first.ts_ms).await?;
                        return Ok(None);
                    }
                }
            }
            FirstMessage::Unreadable(unreadable) => {
                self.reject(run, &self.rejection_of(run, &unreadable), first.ts_ms)
                    .await?;
                return Ok(None);
            }
            FirstMessage::Entry(RunLogEntry {
                input: RunInput::Submitted(s),
                ..
            }) => *s,
            FirstMessage::Entry(RunLogEntry {
                input: RunInput::Rejected(r),
                ..
            }) => {
                crate::intake::record_rejection(
                    &self.store,
                    &self.metrics,
                    run,
                    &r,
                    first.ts_ms,
                    false,
                )
                .await?;
                return Ok(None);
            }
            FirstMessage::Entry(_) => {
                return Err(StepError::Terminal(format!(
                    "the run log of {run} does not start with its submission"
                )));
            }
        };
        debug!(%run, "Rebuilding an unrecorded start from the run's first message");
        let plan = Arc::new(submitted.plan.clone());
        let (mut machine, actions) = RunMachine::start(run, &submitted, plan, first.ts_ms);
        machine.set_first_seq(first.seq);
        Ok(Some((
            Cached {
                machine,
                revision: 0,
                results: HashMap::new(),
                last_used: 0,
                touched: tokio::time::Instant::now(),
                unflushed: None,
                last_log_seq: None,
            },
            actions,
        )))
    }
}
