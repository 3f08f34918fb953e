//! The spans of a run's trace, built alike by the client, the coordinator and the workers.
//!
//! ```text
//!  client     submit ─────────────────────────────── (traceparent on the submission)
//!               │
//!  coordinator  ├─ step (one per batch of run-log inputs applied)
//!               │    ├─ dispatch  (one per task attempt published; its context goes into the
//!               │    │    │        envelope's `trace` and the `traceparent` header)
//!  worker       │    │    └─ invoke_agent {agent}
//!               │    │         ├─ chat {model}            (one per model call, with token usage)
//!               │    │         └─ execute_tool {tool}     (one per tool call)
//!               │    │              └─ … a child run started by the tool (`child.start`
//!               │    │                   carries the context): its steps, dispatches, attempts
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

/// An agent calls a chat model (`chat {model}`, CLIENT), a child of the current span (the
/// attempt's `invoke_agent`). Record the answer with [`chat_answered`]; a failed call with
/// [`failed`].
pub fn chat(model: &str, provider: &str, max_tokens: Option<u32>) -> Span {
    if !exporting() {
        return Span::none();
    }
    let span = tracing::info_span!(
        "chat",
        otel.name = format!("chat {model}"),
        otel.kind = "client",
        otel.status_code = field::Empty,
        "error.type" = field::Empty,
        gen_ai.operation.name = "chat",
        gen_ai.provider.name = provider,
        gen_ai.request.model = model,
        gen_ai.request.max_tokens = field::Empty,
        gen_ai.response.model = field::Empty,
        gen_ai.usage.input_tokens = field::Empty,
        gen_ai.usage.output_tokens = field::Empty,
    );
    if let Some(max) = max_tokens {
        span.record("gen_ai.request.max_tokens", max);
    }
    span
}

/// Records what a model call used on its `chat` span.
pub fn chat_answered(span: &Span, response_model: &str, input_tokens: u64, output_tokens: u64) {
    if span.is_none() {
        return;
    }
    span.record("gen_ai.response.model", response_model);
    span.record("gen_ai.usage.input_tokens", input_tokens);
    span.record("gen_ai.usage.output_tokens", output_tokens);
}

/// An agent runs a tool the model called (`execute_tool {tool}`, INTERNAL), a child of the
/// current span (the attempt's `invoke_agent`). A child run the tool starts is a child of
/// this span. Mark a failed call with [`failed`].
pub fn execute_tool(tool: &str, call_id: &str) -> Span {
    if !exporting() {
        return Span::none();
    }
    tracing::info_span!(
        "execute_tool",
        otel.name = format!("execute_tool {tool}"),
        otel.status_code = field::Empty,
        "error.type" = field::Empty,
        gen_ai.operation.name = "execute_tool",
        gen_ai.tool.name = tool,
        gen_ai.tool.call.id = call_id,
        gen_ai.tool.type = "function",
    )
}

/// Marks a span failed with the error kind (`error.type`).
pub fn failed(span: &Span, kind: &str) {
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
        assert!(chat("m", "openai", Some(10)).is_none());
        assert!(execute_tool("state_set", "call_1").is_none());
    }
}
