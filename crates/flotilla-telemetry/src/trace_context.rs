//! W3C trace context in and out of Flotilla messages.
//!
//! One run is one trace. The client's submit span starts it; its context travels as a
//! `traceparent` header on the submission, is stored with the run, and is copied into every
//! [`TaskEnvelope`](flotilla_model::task::TaskEnvelope)'s `trace` field, so the coordinator's
//! step spans and each worker's attempt span join the same trace even though they run in
//! different processes and at different times:
//!
//! ```text
//!  client: submit ──traceparent──► coordinator: step ──envelope.trace──► worker: invoke_agent
//! ```
//!
//! * Receiving side: create the span, then [`set_parent`] with the message's context.
//! * Sending side: [`span_context`] (or [`current`]) gives the `traceparent` to put on the
//!   outgoing message.
//!
//! When OpenTelemetry export is off there is no trace to join: [`set_parent`] returns `false`
//! and [`current`] returns `None`. A component that forwards work should then pass the
//! incoming context on unchanged, so processes further down that do export still join the
//! caller's trace.

use std::collections::HashMap;

use flotilla_model::task::TraceContext;
use opentelemetry::Context;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

const TRACEPARENT: &str = "traceparent";
const TRACESTATE: &str = "tracestate";

/// The OpenTelemetry context of a `traceparent` / `tracestate` pair, or `None` when the
/// `traceparent` is malformed (a bad header never breaks a run; it just starts a new trace).
pub fn extract(trace: &TraceContext) -> Option<Context> {
    let mut carrier = HashMap::with_capacity(2);
    carrier.insert(TRACEPARENT.to_owned(), trace.traceparent.clone());
    if let Some(state) = &trace.tracestate {
        carrier.insert(TRACESTATE.to_owned(), state.clone());
    }
    let cx = TraceContextPropagator::new().extract(&carrier);
    cx.span().span_context().is_valid().then_some(cx)
}

/// Makes `span` a child of the remote `trace`. Call it right after creating the span and
/// before entering it. Returns whether the span was linked (false when export is off, the
/// context is malformed or absent, or the span has already started).
pub fn set_parent(span: &tracing::Span, trace: Option<&TraceContext>) -> bool {
    // Nothing records the span (export off): skip parsing the context.
    if span.is_disabled() {
        return false;
    }
    let Some(cx) = trace.and_then(extract) else {
        return false;
    };
    span.set_parent(cx).is_ok()
}

/// The `traceparent` / `tracestate` of `span`, for an outgoing message; `None` when the span
/// is not recorded by OpenTelemetry (export off, or the span filtered out).
pub fn span_context(span: &tracing::Span) -> Option<TraceContext> {
    if span.is_disabled() {
        return None;
    }
    inject(&span.context())
}

/// The context of the current span (see [`span_context`]).
pub fn current() -> Option<TraceContext> {
    span_context(&tracing::Span::current())
}

fn inject(cx: &Context) -> Option<TraceContext> {
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier: HashMap<String, String> = HashMap::with_capacity(2);
    TraceContextPropagator::new().inject_context(cx, &mut carrier);
    Some(TraceContext {
        traceparent: carrier.remove(TRACEPARENT)?,
        tracestate: carrier.remove(TRACESTATE).filter(|s| !s.is_empty()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_round_trips() {
        let tc = TraceContext {
            traceparent: PARENT.into(),
            tracestate: Some("vendor=a".into()),
        };
        let cx = extract(&tc).expect("valid");
        let sc = cx.span().span_context().clone();
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        assert!(sc.is_remote() && sc.is_sampled());
        assert_eq!(inject(&cx), Some(tc));
    }

    #[test]
    fn malformed_traceparents_start_no_trace() {
        for bad in [
            "",
            "garbage",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        ] {
            let tc = TraceContext {
                traceparent: bad.into(),
                tracestate: None,
            };
            assert!(extract(&tc).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn without_an_exporter_nothing_is_linked_or_injected() {
        // No OpenTelemetry layer in this test's subscriber.
        let span = tracing::info_span!("step");
        let tc = TraceContext {
            traceparent: PARENT.into(),
            tracestate: None,
        };
        assert!(!set_parent(&span, Some(&tc)));
        assert!(!set_parent(&span, None));
        assert_eq!(span_context(&span), None);
        assert_eq!(current(), None);
    }
}
