//! Spans exported over real OTLP/HTTP (to the test kit's receiver) keep their parentage, also
//! across a `traceparent` hand-over between two "processes" (two tracer providers with
//! different service names, as a coordinator and a worker would have).

use std::time::Duration;

use flotilla_model::task::TraceContext;
use flotilla_telemetry::logging::{
    InitError, OtlpConfig, OtlpProtocol, otel_layer, tracer_provider,
};
use flotilla_telemetry::trace_context;
use flotilla_testkit::otlp::OtlpReceiver;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;

fn http(receiver: &OtlpReceiver) -> OtlpConfig {
    OtlpConfig {
        protocol: OtlpProtocol::HttpProtobuf,
        traces_endpoint: Some(receiver.traces_endpoint()),
    }
}

/// Runs `f` with a subscriber exporting to `provider` (this thread only).
fn with_provider<T>(provider: &SdkTracerProvider, f: impl FnOnce() -> T) -> T {
    let subscriber = tracing_subscriber::registry().with(otel_layer(provider));
    tracing::subscriber::with_default(subscriber, f)
}

/// Flushes the batch processor without blocking the runtime the receiver runs on.
async fn flush(provider: SdkTracerProvider) -> anyhow::Result<()> {
    tokio::task::spawn_blocking(move || provider.shutdown()).await??;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_across_a_traceparent_hand_over() -> anyhow::Result<()> {
    let receiver = OtlpReceiver::start().await?;
    let client = tracer_provider(&http(&receiver), "test-client")?;
    let worker = tracer_provider(&http(&receiver), "test-worker")?;

    // "Client": a root span and a child; the child's context goes on the wire.
    let carried: TraceContext = with_provider(&client, || {
        let root = tracing::info_span!("submit", flotilla.run_id = "r1");
        let _root = root.enter();
        let step = tracing::info_span!("step");
        let _step = step.enter();
        trace_context::current()
    })
    .ok_or_else(|| anyhow::anyhow!("no context while exporting"))?;
    assert!(carried.traceparent.starts_with("00-"), "{carried:?}");

    // "Worker": a span whose parent is the remote context, with a child of its own.
    let linked = with_provider(&worker, || {
        let attempt = tracing::info_span!(
            "invoke_agent",
            otel.name = "invoke_agent echo",
            gen_ai.agent.name = "echo",
            flotilla.attempt = 1_i64
        );
        let linked = trace_context::set_parent(&attempt, Some(&carried));
        let _a = attempt.enter();
        tracing::info_span!("tool").in_scope(|| {});
        linked
    });
    assert!(linked, "set_parent must find the OpenTelemetry layer");

    flush(client).await?;
    flush(worker).await?;
    let spans = receiver
        .wait_for(|s| s.len() >= 4, Duration::from_secs(20))
        .await?;

    let by_name = |n: &str| {
        spans
            .iter()
            .find(|s| s.name == n)
            .ok_or_else(|| anyhow::anyhow!("no span {n}: {spans:#?}"))
    };
    let (submit, step) = (by_name("submit")?, by_name("step")?);
    let (attempt, tool) = (by_name("invoke_agent echo")?, by_name("tool")?);

    for s in [step, attempt, tool] {
        assert_eq!(s.trace_id, submit.trace_id, "one trace: {spans:#?}");
    }
    assert_eq!(submit.parent_span_id, None);
    assert_eq!(step.parent_span_id.as_ref(), Some(&submit.span_id));
    assert_eq!(attempt.parent_span_id.as_ref(), Some(&step.span_id));
    assert_eq!(tool.parent_span_id.as_ref(), Some(&attempt.span_id));
    assert_eq!(
        carried.traceparent,
        format!("00-{}-{}-01", step.trace_id, step.span_id)
    );

    assert_eq!(submit.service_name.as_deref(), Some("test-client"));
    assert_eq!(attempt.service_name.as_deref(), Some("test-worker"));
    assert_eq!(
        attempt
            .resource
            .get("service.namespace")
            .map(String::as_str),
        Some("flotilla")
    );
    assert_eq!(attempt.attribute("gen_ai.agent.name"), Some("echo"));
    assert_eq!(attempt.attribute("flotilla.attempt"), Some("1"));
    assert_eq!(submit.attribute("flotilla.run_id"), Some("r1"));
    assert_eq!(submit.scope, "flotilla");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_spans_and_exporter_internals_are_not_exported() -> anyhow::Result<()> {
    let receiver = OtlpReceiver::start().await?;
    let provider = tracer_provider(&http(&receiver), "test")?;
    with_provider(&provider, || {
        tracing::debug_span!("noise").in_scope(|| {});
        tracing::info_span!(target: "hyper", "transport").in_scope(|| {});
        tracing::info_span!("kept").in_scope(|| {});
    });
    flush(provider).await?;
    let spans = receiver
        .wait_for(
            |s| s.iter().any(|s| s.name == "kept"),
            Duration::from_secs(20),
        )
        .await?;
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["kept"]);
    Ok(())
}

#[test]
fn grpc_needs_a_runtime() -> anyhow::Result<()> {
    let grpc = OtlpConfig {
        protocol: OtlpProtocol::Grpc,
        traces_endpoint: Some("http://127.0.0.1:4317".into()),
    };
    assert!(matches!(
        tracer_provider(&grpc, "x"),
        Err(InitError::NoRuntime)
    ));
    let rt = tokio::runtime::Runtime::new()?;
    let provider = {
        let _in_runtime = rt.enter();
        tracer_provider(&grpc, "x")?
    };
    // Nothing listens on the port: shutting down reports the failed export, it does not hang.
    let _ = provider.shutdown_with_timeout(Duration::from_secs(5));
    drop(rt);
    Ok(())
}
