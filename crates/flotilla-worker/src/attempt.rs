//! Running one delivered task: checks before it runs (cancelled run, too many deliveries, a
//! result already stored), waiting for an agent slot, the claim of a role task, the agent's
//! run under heartbeats, its timeout and cancellation, and the attempt's span and duration
//! metric.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind};
use flotilla_bus::{Bus, wire};
use flotilla_context::{Clients, Scope, WorkerSlot};
use flotilla_model::api::{ApiRequest, GetRunRequest};
use flotilla_model::event::{Event, WorkflowEvent, WorkflowPhase};
use flotilla_model::numeric::extract_numeric_value;
use flotilla_model::run::{RunView, TaskStatus};
use flotilla_model::task::{TaskEnvelope, TaskError, TaskErrorKind, TaskResult};
use flotilla_model::time::Timestamp;
use flotilla_telemetry::events::TaskAttemptFinished;
use flotilla_telemetry::{AttemptOutcome, InternalEvent, spans, trace_context};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, warn};

use crate::agent::{AgentContext, AgentError, EventEmitter};
use crate::cancel::LeaveRun;
use crate::claim::{Claim, send_claim};
use crate::registry::InFlight;
use crate::result::{finish, report_bad_envelope, suspend};
use crate::shared::Shared;

/// Runs one delivered task message to the end. `held` is the message's place among those the
/// worker holds (running or prefetched); it is released as soon as the agent is done, so the
/// next task is pulled while this one's result is being stored. `claim`: the task came from a
/// role's queue, and the member named there runs it.
pub(crate) async fn handle(
    shared: &Shared,
    msg: jetstream::Message,
    held: tokio::sync::OwnedSemaphorePermit,
    stopping: &CancellationToken,
    claim: Option<Claim>,
) {
    let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
    let mut task: TaskEnvelope = match wire::decode(msg.headers.as_ref(), &msg.payload) {
        Ok(t) => t,
        Err(e) => {
            Box::pin(report_bad_envelope(shared, &msg, &e.to_string())).await;
            return;
        }
    };
    // A role task runs with this worker's member of the role: the agent, its events, its
    // span and its result name it.
    if let Some(c) = &claim {
        task.agent = Some(c.agent.clone());
    }
    let claim = claim.as_ref();
    let task = task;
    let started_at = Timestamp::now();
    let mut attempt = Attempt::new(shared, &task);
    trace_context::set_parent(&attempt.span, task.trace.as_ref());
    if shared.is_cancelled(task.run_id) {
        debug!(run = %task.run_id, task = %task.task_id, "Task of a cancelled run; not running it");
        let result = TaskResult::failure(TaskErrorKind::Cancelled, "the run was cancelled");
        attempt.ended(Box::pin(finish(shared, &msg, &task, claim, result, started_at)).await);
        return;
    }
    if delivered > shared.opts.max_deliveries {
        warn!(run = %task.run_id, task = %task.task_id, delivered, "Task redelivered too often; reporting it failed");
        let result = TaskResult::failure(
            TaskErrorKind::RedeliveriesExhausted,
            format!(
                "delivered {delivered} times without a result (workers stopped while running it)"
            ),
        );
        attempt.ended(Box::pin(finish(shared, &msg, &task, claim, result, started_at)).await);
        return;
    }
    if delivered > 1
        && let Some(view) = Box::pin(already_done(&shared.bus, &task)).await
    {
        debug!(run = %task.run_id, task = %task.task_id, "Redelivered task already has a result; acknowledging");
        // A worker answering the run's submitters itself may have stopped between storing
        // its result and answering (its message came back unacknowledged): the ended run's
        // recorded outcome is answered again, under the same message id.
        if let (Some(a), Some(outcome)) = (&task.answer, view.and_then(|v| v.record.outcome)) {
            let reply = flotilla_model::submit::SubmitReply::finished(outcome);
            Box::pin(crate::result::answer_submitters(
                shared,
                task.run_id,
                &a.reply_to,
                &reply,
            ))
            .await;
        }
        attempt.not_run();
        let _ = msg.ack().await;
        return;
    }
    // A prefetched task waits for a slot, keeping its message alive; a stopping worker hands
    // it back at once.
    let Some(slot) = wait_for_slot(shared, &msg, stopping).await else {
        // A prefetched task the stopping worker never started: not an attempt.
        attempt.not_run();
        let _ = msg.ack_with(AckKind::Nak(None)).await;
        return;
    };
    // The attempt's place and slot — with the gauges and the registry's count that say it is
    // taken — given back while its agent waits for child runs.
    let occupancy: flotilla_context::slot::OccupancyFactory = {
        let (gauges, count) = (shared.slots.gauges(), Arc::clone(&shared.in_flight));
        Arc::new(move || Box::new((gauges.attempt(), InFlight::enter(Arc::clone(&count)))))
    };
    let slot = WorkerSlot::new(vec![held, slot], occupancy);
    let started_at = Timestamp::now();
    attempt.started = Instant::now();
    let events = EventEmitter::new(Some(shared.bus.clone()), &task, &shared.id, delivered);
    // The attempt's collaboration clients; the mailbox read position they share is committed
    // once the attempt's success is stored.
    let scope = Scope::from_envelope(&task, delivered, shared.bus.names().clone());
    let clients = match Clients::new(shared.bus.clone(), scope) {
        Ok(c) => c,
        Err(e) => {
            warn!(run = %task.run_id, task = %task.task_id, error = %e, "Cannot build the agent context");
            let result = TaskResult::failure(TaskErrorKind::Internal, e.to_string());
            slot.end();
            attempt.ended(Box::pin(finish(shared, &msg, &task, claim, result, started_at)).await);
            return;
        }
    };
    // A role task is claimed now that a slot runs it: sent before the agent starts, stored
    // while it runs.
    if let Some(c) = claim {
        tokio::spawn(Box::pin(send_claim(shared, &task, c)).await);
    }
    let started_event = Event::Workflow(WorkflowEvent {
        worker: Some(shared.id.clone()),
        started_at: Some(started_at),
        agent: task
            .agent
            .clone()
            .or_else(|| shared.agents.default_agent().map(str::to_owned)),
        role: task.role.clone(),
        ..WorkflowEvent::phase(WorkflowPhase::TaskStarted)
    });
    let mut announced = shared.opts.started_event_delay.is_zero();
    if announced {
        Box::pin(events.emit(started_event.clone())).await;
    }

    // Where the agent leaves the tool call it stops at to wait for a person.
    let mut suspension = None;
    let outcome = match shared.agents.resolve(task.agent.as_deref()) {
        Err(message) => Err(AgentError {
            kind: TaskErrorKind::UnknownAgent,
            message,
        }),
        Ok((_, agent)) => {
            let (run_cancelled, run_held, registered) =
                shared.enter_run(task.run_id, &task.task_id);
            let _leave = LeaveRun(shared, task.run_id, registered);
            let cancel = shared.hard_stop.child_token();
            let timeout = task.timeout.get();
            let ctx = AgentContext::new(
                clients.clone(),
                cancel.clone(),
                Instant::now() + timeout,
                events.clone(),
                shared.id.clone(),
            )
            .with_slot(slot.clone())
            .with_hold(run_held);
            suspension = Some(ctx.suspension());
            let announce = tokio::time::sleep(shared.opts.started_event_delay);
            tokio::pin!(announce);
            // Model calls and tools of the agent nest in its `invoke_agent` span.
            let run = agent.run(&task, ctx).instrument(attempt.span.clone());
            tokio::pin!(run);
            let deadline = tokio::time::sleep(timeout);
            tokio::pin!(deadline);
            let mut heartbeat = tokio::time::interval_at(
                tokio::time::Instant::now() + shared.opts.progress_interval(),
                shared.opts.progress_interval(),
            );
            loop {
                tokio::select! {
                    biased;
                    r = &mut run => {
                        if shared.hard_stop.is_cancelled() && r.is_err() {
                            // The worker is stopping and cancelled the agent: that is not the
                            // task's failure. Hand it back for another worker.
                            info!(run = %task.run_id, task = %task.task_id, "Handing an unfinished task back");
                            slot.end();
                            let _ = msg.ack_with(AckKind::Nak(None)).await;
                            return;
                        }
                        break r;
                    }
                    _ = &mut announce, if !announced => {
                        announced = true;
                        Box::pin(events.emit(started_event.clone())).await;
                    }
                    _ = heartbeat.tick() => {
                        if let Err(e) = msg.ack_with(AckKind::Progress).await {
                            debug!(error = %e, "Heartbeat failed");
                        }
                    }
                    _ = &mut deadline => {
                        cancel.cancel();
                        break Err(AgentError {
                            kind: TaskErrorKind::Timeout,
                            message: format!("the attempt exceeded its timeout of {}", humantime_serde::re::humantime::format_duration(timeout)),
                        });
                    }
                    _ = run_cancelled.cancelled() => {
                        cancel.cancel();
                        // The outcome is decided: a child wait ending now takes no slot.
                        slot.end();
                        // Let the agent observe the cancellation (an exec agent's processes
                        // are killed), then report the attempt cancelled.
                        let _ = tokio::time::timeout(Duration::from_secs(2), &mut run).await;
                        info!(run = %task.run_id, task = %task.task_id, "Attempt cancelled with its run");
                        break Err(AgentError::cancelled("the run was cancelled"));
                    }
                    _ = shared.hard_stop.cancelled() => {
                        cancel.cancel();
                        slot.end();
                        // Let the agent observe the cancellation, then hand the task back.
                        let _ = tokio::time::timeout(Duration::from_secs(2), &mut run).await;
                        info!(run = %task.run_id, task = %task.task_id, "Handing an unfinished task back");
                        let _ = msg.ack_with(AckKind::Nak(None)).await;
                        return;
                    }
                }
            }
        }
    };
    // The agent is done: its slot and its place go to the next task now.
    slot.end();
    shared.pace.record(attempt.started.elapsed());
    if let Some(stop) = suspension.and_then(|s| s.take()) {
        // The agent stopped at a tool call that waits for a person, or at a step boundary of
        // a held run: the attempt is not over. Its mailbox reads stay uncommitted and its
        // child runs keep running.
        let call = match stop {
            flotilla_context::agent::Stop::Call(call) => Some(call),
            flotilla_context::agent::Stop::Held => None,
        };
        attempt.ended(Box::pin(suspend(shared, &msg, &task, call)).await);
        return;
    }
    let result = match outcome {
        Ok(reply) => {
            let numeric_value = reply
                .numeric_value
                .or_else(|| extract_numeric_value(&reply.response));
            let confidence = reply
                .confidence
                .and_then(flotilla_model::task::valid_confidence)
                .or_else(|| flotilla_model::task::stated_confidence(&reply.response));
            TaskResult {
                response: reply.response,
                tokens: reply.tokens,
                success: true,
                tools_used: reply.tools_used,
                numeric_value,
                error: None,
                confidence,
            }
        }
        Err(e) => TaskResult {
            error: Some(TaskError {
                kind: e.kind,
                message: e.message,
            }),
            ..TaskResult::failure(e.kind, "")
        },
    };
    let success = result.success;
    let stored = Box::pin(finish(shared, &msg, &task, claim, result, started_at)).await;
    attempt.ended(stored);
    if stored.is_some() && success {
        // At-least-once mailboxes: what the attempt read counts as consumed only now that its
        // success is stored. A crash before this point lets a redelivery read it again.
        if let Err(e) = Box::pin(clients.mailbox().commit()).await {
            warn!(run = %task.run_id, task = %task.task_id, error = %e, "Could not commit the mailbox cursor; the messages read stay unread for this task");
        }
    } else if stored.is_some() {
        // A failed, timed-out or cancelled attempt takes its unfinished child runs with it.
        let why = format!(
            "parent attempt {} of {} ended without success",
            task.attempt, task.task_id
        );
        match Box::pin(clients.cancel_children(&why)).await {
            Ok(0) => {}
            Ok(n) => {
                debug!(run = %task.run_id, task = %task.task_id, children = n, "Cancelled the child runs of a failed attempt")
            }
            Err(e) => {
                warn!(run = %task.run_id, task = %task.task_id, error = %e, "Could not cancel the child runs of a failed attempt")
            }
        }
    }
}

/// Whether the coordinator already has a result for this attempt (only asked on redelivery).
/// Whether a redelivered task's attempt is over already (its run ended, or the task moved
/// on): `Some`, with the run's view when the run ended; `None` to run it.
async fn already_done(bus: &Bus, task: &TaskEnvelope) -> Option<Option<RunView>> {
    let req = GetRunRequest {
        task_id: Some(task.task_id.clone()),
        ..GetRunRequest::new(task.run_id)
    };
    let body = serde_json::to_vec(&req).ok()?;
    let asked = tokio::time::timeout(
        Duration::from_secs(2),
        bus.client()
            .request(bus.names().api(GetRunRequest::ENDPOINT), body.into()),
    )
    .await;
    let Ok(Ok(reply)) = asked else { return None };
    let view = serde_json::from_slice::<RunView>(&reply.payload).ok()?;
    if view.record.status.is_terminal() {
        return Some(Some(view));
    }
    view.tasks
        .iter()
        .find(|t| t.task_id == task.task_id)
        .is_some_and(|t| !(t.status == TaskStatus::Dispatched && t.attempts == task.attempt))
        .then_some(None)
}

/// Waits for a free agent slot, sending in-progress acknowledgements meanwhile so the waiting
/// message is not redelivered. `None` when the worker stops first.
pub(crate) async fn wait_for_slot(
    shared: &Shared,
    msg: &jetstream::Message,
    stopping: &CancellationToken,
) -> Option<tokio::sync::OwnedSemaphorePermit> {
    if let Ok(p) = Arc::clone(&shared.run_slots).try_acquire_owned() {
        return Some(p);
    }
    let mut progress = tokio::time::interval_at(
        tokio::time::Instant::now() + shared.opts.progress_interval(),
        shared.opts.progress_interval(),
    );
    let acquire = Arc::clone(&shared.run_slots).acquire_owned();
    tokio::pin!(acquire);
    loop {
        tokio::select! {
            p = &mut acquire => return p.ok(),
            _ = stopping.cancelled() => return None,
            _ = progress.tick() => {
                let _ = msg.ack_with(AckKind::Progress).await;
            }
        }
    }
}

/// One delivered task's attempt as seen by metrics and traces: its `invoke_agent` span, and
/// its duration recorded by outcome when it ends — however it ends (a path that returns
/// without a stored result handed the task back).
struct Attempt<'a> {
    shared: &'a Shared,
    task: &'a TaskEnvelope,
    agent: &'a str,
    span: tracing::Span,
    started: Instant,
    /// Set once recorded (or when the message turned out not to be an attempt).
    done: bool,
}

impl<'a> Attempt<'a> {
    fn new(shared: &'a Shared, task: &'a TaskEnvelope) -> Self {
        // The label and span name: the agent that runs it (the task's, else the default).
        let agent = match shared.agents.resolve(task.agent.as_deref()) {
            Ok((name, _)) => name,
            Err(_) => task.agent.as_deref().unwrap_or("none"),
        };
        Self {
            shared,
            task,
            agent,
            span: spans::invoke_agent(task, agent, &shared.id),
            started: Instant::now(),
            done: false,
        }
    }

    /// The result is stored with `outcome` (`None`: the task was handed back).
    fn ended(&mut self, outcome: Option<AttemptOutcome>) {
        let outcome = outcome.unwrap_or(AttemptOutcome::HandedBack);
        if outcome != AttemptOutcome::Succeeded {
            spans::failed(&self.span, outcome.as_str());
        }
        TaskAttemptFinished {
            run: self.task.run_id,
            task: &self.task.task_id,
            attempt: self.task.attempt,
            pool: &self.shared.opts.pool,
            agent: self.agent,
            outcome,
            duration: self.started.elapsed(),
        }
        .emit(&self.shared.metrics);
        self.done = true;
    }

    /// The message needed no attempt (its result was already stored).
    fn not_run(&mut self) {
        self.done = true;
    }
}

impl Drop for Attempt<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.ended(None);
        }
    }
}
