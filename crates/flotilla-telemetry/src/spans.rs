//! The spans of a run's trace, built alike by the client, the coordinator and the workers.
//!
//! ```text
//!  client     submit ─────────────────────────────── (traceparent on the submission)
//!               │
//!  coordinator  ├─ step (one per batch of run-log inputs applied)
//!               │    ├─ dispatch  (one per task attempt published; its context goes into the
//!               │    │    │        envelope's `trace` and the `traceparent` header)
//!  worker       │    │    └─ invoke_agent {agent}   (model calls and tools nest inside)
//!               ├─ step …
//! ```
//!
//! Every step is a child of the run's trace context (the client's `submit` span, or — when
//! the client sent none — the coordinator's span that admitted the run), so one run is one
//! trace however many coordinators and workers take part. Names and attributes follow the
//! GenAI agent conventions where they apply ([`crate::semconv`]).
//!
//! The coordinator and worker build their spans only while spans are exported
//! ([`exporting`]): without an exporter they get [`Span::none`], so the hot path pays nothing
//! for tracing (no span allocation, no field formatting by the log layer).

use std::sync::atomic::{AtomicBool, Ordering};

use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::task::TaskEnvelope;
use tracing::{Span, field};

static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Whether this process exports spans: set when an OpenTelemetry layer is built
/// ([`crate::logging::otel_layer`], which [`crate::logging::init`] uses when the `OTEL_*`
/// variables ask for export). Embedders with their own OpenTelemetry layer call
/// [`set_exporting`].
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// Turns the coordinator's and workers' spans on (or off) for this process.
pub fn set_exporting(on: bool) {
    EXPORTING.store(on, Ordering::Relaxed);
}

/// A client submits a run (PRODUCER): child of the caller's current span. Built whether or
/// not this process exports, so an application with its own OpenTelemetry layer gets its
/// submissions into its traces; without any interested layer it is disabled and costs
/// nothing. `run` when the client names the run (an idempotency key may map to another).
pub fn submit(run: Option<RunId>) -> Span {
    let span = tracing::info_span!(
        "submit",
        otel.kind = "producer",
        flotilla.run_id = field::Empty,
    );
    if let Some(run) = run {
        span.record("flotilla.run_id", field::display(run));
    }
    span
}

/// A coordinator's intake handles a submission that goes through the intake stream (one with
/// an idempotency key): the run's trace root when the client sent no trace context.
pub fn intake() -> Span {
    if !exporting() {
        return Span::none();
    }
    tracing::info_span!(parent: None, "intake", flotilla.role = "coordinator")
}

/// A coordinator applies a batch of one run's inputs. Created without a parent: the caller
/// makes it a child of the run's trace context ([`crate::trace_context::set_parent`]) before
/// it starts.
pub fn step(run: RunId, inputs: usize) -> Span {
    if !exporting() {
        return Span::none();
    }
    tracing::info_span!(
        parent: None,
        "step",
        flotilla.run_id = %run,
        flotilla.inputs = inputs,
    )
}

/// A coordinator publishes a task attempt to its pool (PRODUCER), within `step`.
pub fn dispatch(
    step: &Span,
    run: RunId,
    task: &TaskId,
    attempt: u32,
    pool: &str,
    agent: &str,
) -> Span {
    if !exporting() || step.is_none() {
        return Span::none();
    }
    tracing::info_span!(
        parent: step,
        "dispatch",
        otel.kind = "producer",
        flotilla.run_id = %run,
        flotilla.task_id = %task,
        flotilla.attempt = attempt,
        flotilla.pool = pool,
        gen_ai.agent.name = agent,
    )
}

/// A worker runs one attempt with an agent (`invoke_agent {agent}`). Created without a
/// parent: the caller makes it a child of the envelope's trace context before entering it.
/// [`failed`] marks it failed.
pub fn invoke_agent(task: &TaskEnvelope, agent: &str, worker: &str) -> Span {
    if !exporting() {
        return Span::none();
    }
    tracing::info_span!(
        parent: None,
        "invoke_agent",
        otel.name = format!("invoke_agent {agent}"),
        otel.status_code = field::Empty,
        "error.type" = field::Empty,
        gen_ai.operation.name = "invoke_agent",
        gen_ai.agent.name = agent,
        gen_ai.agent.id = %task.attempt_id,
        gen_ai.conversation.id = %task.run_id,
        flotilla.run_id = %task.run_id,
        flotilla.task_id = %task.task_id,
        flotilla.attempt = task.attempt,
        flotilla.pool = %task.pool,
        flotilla.worker_id = worker,
    )
}

/// Marks a span failed with the error kind (`error.type`).
pub fn failed(span: &Span, kind: &'static str) {
    span.record("otel.status_code", "ERROR");
    span.record("error.type", kind);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_export_the_service_spans_are_none() {
        set_exporting(false);
        let run = RunId::new();
        assert!(step(run, 1).is_none());
        assert!(intake().is_none());
        let parent = Span::none();
        let task = TaskId::new("t");
        assert!(dispatch(&parent, run, &task, 1, "default", "echo").is_none());
    }
}
