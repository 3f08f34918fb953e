//! A run's inputs, from run-log messages to acknowledgements: each message of the run-log
//! stream is decoded into an [`Inbound`] (an entry, a durable submission, a misaddressed or
//! an unreadable message), the batch is stepped through [`Runtime::step`] with
//! compare-and-set retries, and the messages are then acknowledged, or handed back for
//! redelivery with a growing delay — up to [`MAX_INPUT_DELIVERIES`], after which the run is
//! ended with the reason. Also how a subject token names a run: canonical run ids,
//! and the ids misaddressed submissions are recorded under.

use std::time::Duration;

use async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE;
use async_nats::jetstream::{self, AckKind};
use flotilla_bus::wire;
use flotilla_model::ids::RunId;
use flotilla_model::runlog::{Rejected, RunLogEntry};
use flotilla_model::submit::SubmitRequest;
use flotilla_model::validate::{Problem, ProblemCode};
use flotilla_telemetry::InternalEvent;
use flotilla_telemetry::events::CasConflict;
use tracing::{debug, warn};

use crate::store::{UnreadableSubmission, unix_ms};

use super::{Cached, Decoded, Inbound, Runtime, StepError, Stepped};

/// The run-log sequences of `inputs` (for debug logs).
fn seqs_of(inputs: &[Decoded]) -> Vec<(u64, i64)> {
    inputs.iter().map(|d| (d.seq, d.delivered)).collect()
}

/// How often a run is reloaded and re-applied after losing compare-and-set races in a row.
const MAX_CAS_ATTEMPTS: usize = 8;

/// Deliveries of a run-log input whose step keeps failing for a reason that may pass (NATS
/// unavailable) before the run is ended with that reason: with the redelivery delay (250 ms
/// doubling to 5 s) about five minutes — far beyond a leader election's seconds.
const MAX_INPUT_DELIVERIES: i64 = 60;

impl Runtime {
    /// Applies one run's inputs; acks them when done, hands them back on failure.
    pub(super) async fn process(
        &self,
        run: RunId,
        mut cached: Option<Cached>,
        msgs: Vec<jetstream::Message>,
    ) -> Option<Cached> {
        let mut inputs = Vec::with_capacity(msgs.len());
        for msg in msgs {
            let info = match msg.info() {
                Ok(i) => (
                    i.stream_sequence,
                    unix_ms(i.published),
                    i.delivered,
                    i.published.unix_timestamp_nanos(),
                ),
                Err(e) => {
                    warn!(error = %e, "Run-log message without JetStream metadata; dropping");
                    continue;
                }
            };
            let on_submit_subject = msg.subject.starts_with(self.submit_prefix.as_str());
            let client_submission = on_submit_subject
                && wire::header(msg.headers.as_ref(), wire::KIND_HEADER)
                    != Some(wire::KIND_RUNLOG_ENTRY);
            let token = msg.subject.rsplit('.').next().unwrap_or_default();
            let inbound = if on_submit_subject && canonical_run_id(token).is_none() {
                let request = wire::decode::<SubmitRequest>(msg.headers.as_ref(), &msg.payload);
                let (reply_to, name, labels) = match request {
                    Ok(r) => (r.reply_to.clone(), r.plan_name(), r.labels),
                    Err(_) => (
                        crate::intake::loose_fields(msg.headers.as_ref(), &msg.payload, None)
                            .reply_to,
                        None,
                        Default::default(),
                    ),
                };
                Inbound::Misaddressed(Box::new(Rejected {
                    errors: vec![misaddressed_problem(token)],
                    name,
                    labels,
                    reply_to: reply_to.filter(|s| flotilla_model::token::check_subject(s).is_ok()),
                    intake_seq: None,
                }))
            } else if client_submission {
                // Stored with "expected last subject sequence 0" on the run's submission
                // subject, where every first message goes: it is the run's first.
                let first = wire::header(
                    msg.headers.as_ref(),
                    NATS_EXPECTED_LAST_SUBJECT_SEQUENCE.as_ref(),
                ) == Some("0");
                let request = wire::decode::<SubmitRequest>(msg.headers.as_ref(), &msg.payload)
                    .map(Box::new)
                    .map_err(|_| {
                        Box::new(UnreadableSubmission::of(msg.headers.as_ref(), &msg.payload))
                    });
                Inbound::Submission { request, first }
            } else {
                match wire::decode::<RunLogEntry>(msg.headers.as_ref(), &msg.payload) {
                    Ok(entry) if entry.run_id == run => Inbound::Entry(entry),
                    Ok(_) => {
                        warn!(%run, seq = info.0, "Run-log entry names another run; dropping");
                        let _ = msg.ack_with(AckKind::Term).await;
                        continue;
                    }
                    Err(e) => {
                        // Bytes do not change: this entry will never be readable. End the run
                        // visibly instead of stalling it.
                        warn!(%run, seq = info.0, error = %e, "Unreadable run-log entry; the run cannot continue");
                        Inbound::Unreadable(format!(
                            "run-log entry {} could not be read: {e}",
                            info.0
                        ))
                    }
                }
            };
            inputs.push(Decoded {
                seq: info.0,
                ts_ms: info.1,
                published_ns: info.3,
                delivered: info.2,
                inbound,
                msg,
            });
        }
        if inputs.is_empty() {
            return cached;
        }
        // In the run log's order: a redelivered message (a submission whose start another
        // coordinator has not recorded yet) can arrive after later ones, and an input is
        // applied only once the run it belongs to has started.
        inputs.sort_by_key(|d| d.seq);
        // Messages of a start recorded by this step are acknowledged with its inputs.
        let mut owed: Vec<jetstream::Message> = cached
            .as_mut()
            .and_then(|c| c.unflushed.as_mut())
            .map(|u| std::mem::take(&mut u.msgs))
            .unwrap_or_default();
        // Set once a step changed nothing on a copy that may be stale: the next reads the run
        // from the leader.
        let mut from_leader = false;
        // Handed back this often already: a failure that may pass has not, and the run is
        // ended with it instead of retried forever.
        let delivered = inputs.iter().map(|d| d.delivered).max().unwrap_or(1);
        for _ in 0..MAX_CAS_ATTEMPTS {
            // Boxed: the step is a large future; moving it costs more than allocating it.
            let stepped = Box::pin(self.step(run, cached.take(), &inputs, None, from_leader)).await;
            let stepped = match stepped {
                Err(StepError::Failed(reason)) if delivered >= MAX_INPUT_DELIVERIES => {
                    Err(StepError::Terminal(format!(
                        "its run-log inputs could not be applied, {delivered} deliveries over several minutes: {reason}"
                    )))
                }
                other => other,
            };
            match stepped {
                Ok(Stepped::Done(entry)) => {
                    debug!(%run, seqs = ?seqs_of(&inputs), owed = owed.len(), "Inputs applied; acknowledging");
                    self.ack_all(run, &inputs).await;
                    for m in &owed {
                        let _ = m.ack().await;
                    }
                    return entry;
                }
                Ok(Stepped::Deferred(mut entry)) => {
                    debug!(%run, seqs = ?seqs_of(&inputs), "Start performed; its inputs are acknowledged once it is recorded");
                    // The start is owed: these messages are acknowledged when it is recorded.
                    if let Some(u) = entry.unflushed.as_mut() {
                        u.msgs.extend(inputs.into_iter().map(|d| d.msg));
                        u.msgs.append(&mut owed);
                    }
                    return Some(entry);
                }
                Err(StepError::Conflict) => CasConflict { run }.emit(&self.metrics),
                Err(StepError::Stale) => {
                    debug!(%run, "The run's copy may be stale; reading it from the leader");
                    from_leader = true;
                }
                Err(StepError::Wait(pause)) => {
                    debug!(%run, ?pause, "Submission waits for its quota; handing it back");
                    for d in &inputs {
                        let _ = d.msg.ack_with(AckKind::Nak(Some(pause))).await;
                    }
                    for m in &owed {
                        let _ = m
                            .ack_with(AckKind::Nak(Some(Duration::from_millis(250))))
                            .await;
                    }
                    return None;
                }
                Err(StepError::Failed(reason)) => {
                    warn!(%run, %reason, "Applying run-log inputs failed; they will be redelivered");
                    break;
                }
                Err(StepError::Terminal(reason)) => {
                    // Retrying would fail the same way: end the run with the reason.
                    warn!(%run, %reason, "Applying run-log inputs failed for good; ending the run");
                    for _ in 0..MAX_CAS_ATTEMPTS {
                        match Box::pin(self.step(run, None, &inputs, Some(&reason), true)).await {
                            Ok(_) => {
                                self.ack_all(run, &inputs).await;
                                for m in &owed {
                                    let _ = m.ack().await;
                                }
                                return None;
                            }
                            Err(StepError::Conflict | StepError::Stale) => continue,
                            Err(StepError::Failed(r)) => {
                                warn!(%run, reason = %r, "Ending the run failed; the inputs will be redelivered");
                                break;
                            }
                            Err(StepError::Wait(_)) => break,
                            Err(StepError::Terminal(r)) => {
                                tracing::error!(%run, reason = %r, "The run cannot even be ended; setting its inputs aside");
                                for d in &inputs {
                                    let _ = d.msg.ack_with(AckKind::Term).await;
                                }
                                return None;
                            }
                        }
                    }
                    break;
                }
            }
        }
        // Handed back with a delay that grows with each delivery (250 ms doubling to 5 s), so
        // a fault that lasts (a leader election, NATS restarting) is retried without a storm.
        for d in &inputs {
            let _ = d
                .msg
                .ack_with(AckKind::Nak(Some(redelivery_delay(d.delivered))))
                .await;
        }
        for m in &owed {
            let _ = m
                .ack_with(AckKind::Nak(Some(Duration::from_millis(250))))
                .await;
        }
        None
    }

    async fn ack_all(&self, run: RunId, inputs: &[Decoded]) {
        for d in inputs {
            if let Err(e) = d.msg.ack().await {
                debug!(%run, error = %e, "Ack failed; the input will be redelivered and ignored");
            }
        }
    }
}

/// How long a run-log input handed back after a failed step waits before its next delivery:
/// 250 ms, doubling per delivery, at most 5 s.
fn redelivery_delay(delivered: i64) -> Duration {
    let exp = u32::try_from(delivered.saturating_sub(1).clamp(0, 5)).unwrap_or(5);
    Duration::from_millis(250 << exp).min(Duration::from_secs(5))
}

/// The run a subject token names when it is a run id in canonical form (lower-case,
/// hyphenated): any other spelling of a UUID would be a second subject for the same run.
pub(super) fn canonical_run_id(token: &str) -> Option<RunId> {
    let canonical = token.len() == 36
        && token.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_digit() || (b'a'..=b'f').contains(&b),
        });
    canonical.then(|| token.parse().ok()).flatten()
}

/// Namespace of the ids under which misaddressed submissions are recorded.
const MISADDRESSED_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x3f6d_1c2b_8a4e_4f0d_9b7a_5e2c_1d0f_6a83);

/// The run id a misaddressed submission (`<prefix>.submit.<token>` where the token is not a
/// canonical run id) is recorded under: `UUIDv5(MISADDRESSED_NAMESPACE, token)`, so a client
/// can find its rejection and a redelivery lands on the same record.
pub(super) fn misaddressed_run_id(token: &str) -> RunId {
    RunId::from_uuid(uuid::Uuid::new_v5(
        &MISADDRESSED_NAMESPACE,
        token.as_bytes(),
    ))
}

/// The problem of a submission published on `<prefix>.submit.<token>` with a token that is
/// not a canonical run id.
fn misaddressed_problem(token: &str) -> Problem {
    match token.parse::<RunId>() {
        Ok(run) => Problem::new(
            ProblemCode::NonCanonicalRunId,
            "subject",
            format!(
                "the submission subject names run {token:?}, which is not spelled canonically; one run has one subject: publish it on the canonical form {run} (lower-case, hyphenated)"
            ),
        ),
        Err(_) => Problem::new(
            ProblemCode::InvalidRunId,
            "subject",
            format!(
                "the submission subject's last token {token:?} is not a run id; publish a submission on <prefix>.submit.<run> with a UUID in canonical form (lower-case, hyphenated), or without a run id on <prefix>.submit"
            ),
        ),
    }
}
