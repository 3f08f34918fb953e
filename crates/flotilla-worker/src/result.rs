//! Storing an attempt's result: published durably to the run log (retried, the task kept
//! alive meanwhile) before the task is acknowledged; a result too large for the deployment
//! becomes a `result_too_large` failure, an unreadable task envelope a `bad_envelope` one.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use flotilla_bus::{PublishErrorKind, wire};
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::codec::Codec;
use flotilla_model::ids::RunId;
use flotilla_model::runlog::{
    RunInput, RunLogEntry, Suspended, SuspendedCall, TaskResultInput, suspended_msg_id,
};
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
    let entry = RunLogEntry {
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
        })),
    };
    let msg_id = result_msg_id(task.run_id, &task.task_id, task.attempt);
    let out = match wire::encode(&entry, Codec::Json, Some(&msg_id)) {
        Ok(o) => o,
        Err(e) => {
            warn!(error = %e, "Cannot encode a result; handing the task back");
            let _ = msg.ack_with(AckKind::Nak(None)).await;
            return None;
        }
    };
    let subject = shared.bus.names().runlog(task.run_id);
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
                    Ok(_) => return true,
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
                            None => return false,
                        }
                    }
                    Err(e) if !shared.hard_stop.is_cancelled() => {
                        warn!(run = %task.run_id, task = %task.task_id, error = %e, "Result not stored yet; retrying");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                    Err(e) => {
                        warn!(run = %task.run_id, task = %task.task_id, error = %e, "Stopping before the result was stored; handing the task back");
                        return false;
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
    if !stored {
        let _ = msg.ack_with(AckKind::Nak(None)).await;
        return None;
    }
    if let Err(e) = msg.ack().await {
        debug!(error = %e, "Task ack failed; a redelivery will find the result already stored");
    }
    debug!(run = %task.run_id, task = %task.task_id, attempt = task.attempt, success, "Task finished");
    Some(outcome)
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
