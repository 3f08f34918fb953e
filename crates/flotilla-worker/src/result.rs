//! Storing an attempt's result: published durably to the run log (retried, the task kept
//! alive meanwhile) before the task is acknowledged; a result too large for the deployment
//! becomes a `result_too_large` failure, an unreadable task envelope a `bad_envelope` one.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use flotilla_bus::{PublishErrorKind, wire};
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::codec::Codec;
use flotilla_model::ids::RunId;
use flotilla_model::run::{FinalResult, RunOutcome, RunStatus};
use flotilla_model::runlog::{
    RunInput, RunLogEntry, Suspended, SuspendedCall, TaskResultInput, suspended_msg_id,
};
use flotilla_model::submit::SubmitReply;
use flotilla_model::task::{TaskEnvelope, TaskErrorKind, TaskResult, result_msg_id};
use flotilla_model::time::Timestamp;
use flotilla_telemetry::AttemptOutcome;
use serde::Deserialize;
use tracing::{debug, warn};

use crate::claim::Claim;
use crate::shared::Shared;

/// Publishes the result durably, then acknowledges the task. Returns the outcome of the
/// result stored, or `None` when the task was handed back.
pub(crate) async fn finish(
    shared: &Shared,
    msg: &jetstream::Message,
    task: &TaskEnvelope,
    claim: Option<&Claim>,
    result: TaskResult,
    started_at: Timestamp,
) -> Option<AttemptOutcome> {
    // The member that ran a role task (other results name no agent: their plan or the
    // default does).
    let agent = claim.map(|c| c.agent.clone());
    let success = result.success;
    let mut outcome = match &result.error {
        _ if success => AttemptOutcome::Succeeded,
        Some(e) => AttemptOutcome::Failed(e.kind),
        None => AttemptOutcome::Failed(TaskErrorKind::AgentFailed),
    };
    // The success of an attempt that ends its run: answered from here once stored, when the
    // final result it makes needs no artifact (one hop less than through a coordinator).
    let reply = task
        .answer
        .as_ref()
        .filter(|a| {
            success
                && a.review_below
                    .is_none_or(|below| result.confidence.is_none_or(|c| c >= below))
        })
        .and_then(|a| finished_reply(task, &result, a.final_result_budget).map(|r| (a, r)));
    let mut entry = RunLogEntry {
        protocol: PROTOCOL_VERSION,
        run_id: task.run_id,
        input: RunInput::TaskResult(Box::new(TaskResultInput {
            task_id: task.task_id.clone(),
            attempt: task.attempt,
            attempt_id: task.attempt_id,
            worker: shared.id.clone(),
            started_at: Some(started_at),
            agent: agent.clone(),
            result,
            answered: reply.is_some(),
        })),
    };
    let msg_id = result_msg_id(task.run_id, &task.task_id, task.attempt);
    let subject = shared.bus.names().runlog(task.run_id);
    let mut answered = false;
    // Whether a marked result may have been stored although its store failed (a lost
    // acknowledgement): then the unmarked store below finds it stored, and the worker answers.
    let mut maybe_marked = false;
    if let Some((a, reply)) = &reply {
        match store_answered(shared, &subject, &entry, &msg_id, a.after_seq).await {
            Stored::Answering => {
                answer_submitters(shared, task.run_id, &a.reply_to, reply).await;
                answered = true;
            }
            // Another input reached the run first: stored unmarked below, and a
            // coordinator answers.
            Stored::Moved => {}
            Stored::Unknown => maybe_marked = true,
        }
        if let RunInput::TaskResult(r) = &mut entry.input {
            r.answered = false;
        }
    }
    if answered {
        if let Err(e) = msg.ack().await {
            debug!(error = %e, "Task ack failed; a redelivery will find the result already stored");
        }
        debug!(run = %task.run_id, task = %task.task_id, attempt = task.attempt, "Task finished; its run's submitters answered from the worker");
        return Some(outcome);
    }
    let out = match wire::encode(&entry, Codec::Json, Some(&msg_id)) {
        Ok(o) => o,
        Err(e) => {
            warn!(error = %e, "Cannot encode a result; handing the task back");
            let _ = msg.ack_with(AckKind::Nak(None)).await;
            return None;
        }
    };
    let limit = shared.bus.max_payload().saturating_sub(RESULT_HEADROOM);
    let mut out = if out.payload.len() > limit {
        let size = out.payload.len();
        warn!(run = %task.run_id, task = %task.task_id, size, limit, "Result too large for this deployment; reporting result_too_large");
        outcome = AttemptOutcome::Failed(TaskErrorKind::ResultTooLarge);
        match too_large_entry(shared, task, agent.clone(), started_at, size, limit) {
            Some(o) => o,
            None => {
                let _ = msg.ack_with(AckKind::Nak(None)).await;
                return None;
            }
        }
    } else {
        out
    };
    // Until the result is stored, the task's message is kept alive at the heartbeat's pace,
    // however long storing takes (a run-log stream without a leader for a few seconds while
    // a cluster node dies, an acknowledgement that never comes and times out): were the ack
    // wait to pass, the task would be redelivered and its attempt run again.
    let stored = {
        let publish = async {
            let mut backoff = Duration::from_millis(100);
            loop {
                match shared
                    .bus
                    .publish_encoded(subject.clone(), out.clone())
                    .await
                {
                    Ok(ack) => return Some(ack.duplicate),
                    Err(e) if e.kind() == PublishErrorKind::TooLarge => {
                        // The server's limit is lower than the one announced at connect time.
                        warn!(run = %task.run_id, task = %task.task_id, error = %e, "Result refused as too large; reporting result_too_large");
                        outcome = AttemptOutcome::Failed(TaskErrorKind::ResultTooLarge);
                        match too_large_entry(
                            shared,
                            task,
                            agent.clone(),
                            started_at,
                            out.payload.len(),
                            limit,
                        ) {
                            Some(o) => out = o,
                            None => return None,
                        }
                    }
                    Err(e) if !shared.hard_stop.is_cancelled() => {
                        warn!(run = %task.run_id, task = %task.task_id, error = %e, "Result not stored yet; retrying");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                    Err(e) => {
                        warn!(run = %task.run_id, task = %task.task_id, error = %e, "Stopping before the result was stored; handing the task back");
                        return None;
                    }
                }
            }
        };
        tokio::pin!(publish);
        let mut progress = tokio::time::interval_at(
            tokio::time::Instant::now() + shared.opts.progress_interval(),
            shared.opts.progress_interval(),
        );
        loop {
            tokio::select! {
                stored = &mut publish => break stored,
                _ = progress.tick() => {
                    if let Err(e) = msg.ack_with(AckKind::Progress).await {
                        debug!(error = %e, "Heartbeat failed while storing the result");
                    }
                }
            }
        }
    };
    let Some(duplicate) = stored else {
        let _ = msg.ack_with(AckKind::Nak(None)).await;
        return None;
    };
    if duplicate
        && maybe_marked
        && let Some((a, reply)) = &reply
    {
        answer_submitters(shared, task.run_id, &a.reply_to, reply).await;
    }
    if let Err(e) = msg.ack().await {
        debug!(error = %e, "Task ack failed; a redelivery will find the result already stored");
    }
    debug!(run = %task.run_id, task = %task.task_id, attempt = task.attempt, success, "Task finished");
    Some(outcome)
}

/// What storing a result marked `answered` came to.
enum Stored {
    /// Stored right after the message the coordinator decided on: the worker answers.
    Answering,
    /// Not stored now: another input reached the run's log first (it is stored unmarked the
    /// usual way, and a coordinator answers), or an earlier delivery stored it.
    Moved,
    /// Not known (no acknowledgement): it is stored unmarked the usual way; if that finds
    /// the result stored already — this one, marked — the worker answers (a repeat answer
    /// carries the same message id).
    Unknown,
}

/// Stores `entry` (a result marked `answered`) on the run's log subject only if the
/// subject's last message is still `after_seq`: nothing reached the run since its
/// coordinator found that this success ends it. One try; anything else falls back.
async fn store_answered(
    shared: &Shared,
    subject: &str,
    entry: &RunLogEntry,
    msg_id: &str,
    after_seq: u64,
) -> Stored {
    let Ok(mut out) = wire::encode(entry, Codec::Json, Some(msg_id)) else {
        return Stored::Moved;
    };
    if out.payload.len() > shared.bus.max_payload().saturating_sub(RESULT_HEADROOM) {
        return Stored::Moved;
    }
    out.headers.insert(
        async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
        after_seq.to_string(),
    );
    match shared.bus.publish_encoded(subject.to_owned(), out).await {
        Ok(ack) if !ack.duplicate => Stored::Answering,
        // Stored by an earlier delivery of this attempt, whose result this worker does not
        // know (it ran the agent again): answered, if at all, by that delivery — or, when it
        // stopped before answering, from the ended run's record by a later delivery.
        Ok(_) => Stored::Moved,
        Err(e) if e.kind() == PublishErrorKind::NotFirst => {
            debug!(
                subject,
                "The run moved on before this result; its coordinator answers"
            );
            Stored::Moved
        }
        Err(e) => {
            debug!(subject, error = %e, "Could not store a result marked answered; storing it the usual way");
            Stored::Unknown
        }
    }
}

/// The `finished` answer of a run that `result` of its last task ended — succeeded, its final
/// result this task's: the outcome its coordinator records from the log — when that final
/// result is carried inline as it is, as a coordinator decides it
/// (`runtime::results::complete_outcome`: estimated within half of `budget`, it is never
/// measured nor stored as an artifact). `None`: a coordinator answers.
fn finished_reply(task: &TaskEnvelope, result: &TaskResult, budget: u64) -> Option<SubmitReply> {
    let final_result = FinalResult::of([(&task.task_id, result)], false);
    if final_result.estimated_len() as u64 > budget / 2 {
        return None;
    }
    Some(SubmitReply::finished(RunOutcome {
        run_id: task.run_id,
        status: RunStatus::Succeeded,
        final_result: Some(final_result),
        failed: Vec::new(),
        skipped: Vec::new(),
        failed_omitted: 0,
        skipped_omitted: 0,
        reason: None,
        cause: None,
        rollback_run_id: None,
    }))
}

/// Sends `reply` to each waiting submitter, under the message id a coordinator answers with
/// (`finished.<run>`), so a repeat is recognisable.
pub(crate) async fn answer_submitters(
    shared: &Shared,
    run: RunId,
    reply_to: &[String],
    reply: &SubmitReply,
) {
    let id = SubmitReply::finished_id(run);
    for to in reply_to {
        shared.bus.publish_reply(to, reply, Some(&id)).await;
    }
}

/// Reports that the attempt stopped at `call` to wait for a person — or, `None`, at a step
/// boundary because its run is held — (a `suspended` run-log entry), then acknowledges its
/// message: the attempt waits without a worker. `None` when it
/// could not be stored (the message is handed back; a later delivery replays its journal and
/// stops at the same call, whose suspension is then stored once).
pub(crate) async fn suspend(
    shared: &Shared,
    msg: &jetstream::Message,
    task: &TaskEnvelope,
    call: Option<SuspendedCall>,
) -> Option<AttemptOutcome> {
    let segment = task.resume.as_ref().map_or(0, |r| r.segment);
    let entry = RunLogEntry {
        protocol: PROTOCOL_VERSION,
        run_id: task.run_id,
        input: RunInput::Suspended(Box::new(Suspended {
            task_id: task.task_id.clone(),
            attempt: task.attempt,
            attempt_id: task.attempt_id,
            worker: shared.id.clone(),
            segment,
            call,
        })),
    };
    let msg_id = suspended_msg_id(task.run_id, &task.task_id, task.attempt, segment);
    let out = match wire::encode(&entry, Codec::Json, Some(&msg_id)) {
        Ok(o) => o,
        Err(e) => {
            warn!(error = %e, "Cannot encode a suspension; handing the task back");
            let _ = msg.ack_with(AckKind::Nak(None)).await;
            return None;
        }
    };
    let subject = shared.bus.names().runlog(task.run_id);
    let mut backoff = Duration::from_millis(100);
    for _ in 0..8 {
        match shared
            .bus
            .publish_encoded(subject.clone(), out.clone())
            .await
        {
            Ok(_) => {
                if let Err(e) = msg.ack().await {
                    debug!(error = %e, "Task ack failed after its suspension was stored");
                }
                debug!(run = %task.run_id, task = %task.task_id, attempt = task.attempt, segment, "Attempt suspended");
                return Some(AttemptOutcome::Suspended);
            }
            Err(e) if !shared.hard_stop.is_cancelled() => {
                warn!(run = %task.run_id, task = %task.task_id, error = %e, "Suspension not stored yet; retrying");
                let _ = msg.ack_with(AckKind::Progress).await;
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
            Err(_) => break,
        }
    }
    let _ = msg.ack_with(AckKind::Nak(None)).await;
    None
}

/// Room kept below the server's max payload for a result's headers.
const RESULT_HEADROOM: usize = 512;

/// The run-log entry of a `result_too_large` failure for a result of `size` bytes.
fn too_large_entry(
    shared: &Shared,
    task: &TaskEnvelope,
    agent: Option<String>,
    started_at: Timestamp,
    size: usize,
    limit: usize,
) -> Option<wire::Outgoing> {
    let result = TaskResult::failure(
        TaskErrorKind::ResultTooLarge,
        format!(
            "the result is {size} bytes; this deployment's messages hold at most {limit}. Return large outputs by reference: store them as an artifact (object store) or workspace entries, and answer with the reference"
        ),
    );
    let entry = RunLogEntry {
        protocol: PROTOCOL_VERSION,
        run_id: task.run_id,
        input: RunInput::TaskResult(Box::new(TaskResultInput {
            task_id: task.task_id.clone(),
            attempt: task.attempt,
            attempt_id: task.attempt_id,
            worker: shared.id.clone(),
            started_at: Some(started_at),
            agent,
            result,
            answered: false,
        })),
    };
    let msg_id = result_msg_id(task.run_id, &task.task_id, task.attempt);
    match wire::encode(&entry, Codec::Json, Some(&msg_id)) {
        Ok(o) => Some(o),
        Err(e) => {
            warn!(error = %e, "Cannot encode a failure result");
            None
        }
    }
}

/// A task message that does not decode: if its run, task and attempt can still be read, its
/// attempt fails with `bad_envelope` (final), so the run does not wait for it forever;
/// otherwise it is terminated with a log line. A report the run log refuses is tried again
/// (1 s doubling to 30 s) up to `worker.max-deliveries`, then terminated with an error line.
pub(crate) async fn report_bad_envelope(shared: &Shared, msg: &jetstream::Message, error: &str) {
    #[derive(Deserialize)]
    struct Ids {
        run_id: RunId,
        task_id: flotilla_model::TaskId,
        attempt: u32,
        attempt_id: flotilla_model::AttemptId,
    }
    let Ok(ids) = serde_json::from_slice::<Ids>(&msg.payload) else {
        warn!(subject = %msg.subject, error, "Unreadable task envelope without readable ids; terminating it");
        let _ = msg.ack_with(AckKind::Term).await;
        return;
    };
    warn!(run = %ids.run_id, task = %ids.task_id, error, "Unreadable task envelope; reporting bad_envelope");
    let entry = RunLogEntry {
        protocol: PROTOCOL_VERSION,
        run_id: ids.run_id,
        input: RunInput::TaskResult(Box::new(TaskResultInput {
            task_id: ids.task_id.clone(),
            attempt: ids.attempt,
            attempt_id: ids.attempt_id,
            worker: shared.id.clone(),
            started_at: Some(Timestamp::now()),
            agent: None,
            result: TaskResult::failure(
                TaskErrorKind::BadEnvelope,
                format!("the task envelope could not be read: {error}"),
            ),
            answered: false,
        })),
    };
    let msg_id = result_msg_id(ids.run_id, &ids.task_id, ids.attempt);
    match shared
        .bus
        .publish(shared.bus.names().runlog(ids.run_id), &entry, Some(&msg_id))
        .await
    {
        Ok(_) => {
            let _ = msg.ack().await;
        }
        Err(e) => {
            let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
            if delivered >= shared.opts.max_deliveries {
                // The run log refused the report delivery after delivery: set the message
                // aside, loudly; the run ends on its own deadlines.
                tracing::error!(run = %ids.run_id, task = %ids.task_id, delivered, error = %e, "Could not report a bad envelope, delivery after delivery; terminating it");
                let _ = msg.ack_with(AckKind::Term).await;
                return;
            }
            let pause = flotilla_bus::consume::redelivery_delay(
                delivered,
                Duration::from_secs(1),
                Duration::from_secs(30),
            );
            warn!(run = %ids.run_id, task = %ids.task_id, delivered, retry_in = ?pause, error = %e, "Could not report a bad envelope; it will be redelivered");
            let _ = msg.ack_with(AckKind::Nak(Some(pause))).await;
        }
    }
}
