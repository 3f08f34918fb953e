//! The LLM agent's spans, exported over OTLP to the test kit's receiver: a `chat` span per
//! model call with its token usage and an `execute_tool` span per tool call, children of the
//! worker's `invoke_agent` span in the run's trace, and a `child.start` whose `traceparent`
//! names the `execute_tool` span that asked for the child. The model is the test kit's
//! scripted OpenAI-compatible server (a test double), NATS a real nats-server.
//!
//! This file is its own test binary because export is switched on for the whole process.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use flotilla_context::Agent;
use flotilla_model::ErrorCode;
use flotilla_model::api::{ApiError, ApiRequest, ChildStartRequest};
use flotilla_model::task::TraceContext;
use flotilla_telemetry::logging::{OtlpConfig, OtlpProtocol, otel_layer, tracer_provider};
use flotilla_telemetry::{spans, trace_context};
use flotilla_testkit::openai::Reply;
use flotilla_testkit::otlp::{OtlpReceiver, ReceivedSpan};
use futures::StreamExt;
use serde_json::json;
use tracing::Instrument;
use tracing_subscriber::layer::SubscriberExt;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const DISPATCH_SPAN: &str = "00f067aa0ba902b7";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_and_tool_calls_are_spans_of_the_attempt_and_children_join_the_trace()
-> anyhow::Result<()> {
    let receiver = OtlpReceiver::start().await?;
    let provider = tracer_provider(
        &OtlpConfig {
            protocol: OtlpProtocol::HttpProtobuf,
            traces_endpoint: Some(receiver.traces_endpoint()),
        },
        "flotilla-llm-test",
    )?;
    let subscriber = tracing_subscriber::registry().with(otel_layer(&provider));
    tracing::subscriber::set_global_default(subscriber)?;
    assert!(spans::exporting());

    let h = Harness::start().await?;
    // A stand-in for the coordinator's `child.start` endpoint: records the request's
    // headers and answers 503, so no child is started.
    let seen: Arc<Mutex<Vec<async_nats::HeaderMap>>> = Arc::default();
    let client = h.bus.client().clone();
    let mut requests = client
        .subscribe(h.bus.names().api(ChildStartRequest::ENDPOINT))
        .await?;
    client.flush().await?;
    let kept = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Some(m) = requests.next().await {
            if let Ok(mut s) = kept.lock() {
                s.push(m.headers.clone().unwrap_or_default());
            }
            let Some(reply) = m.reply else { continue };
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Service-Error-Code", "503");
            let body = serde_json::to_vec(&ApiError::new(
                503,
                ErrorCode::Unavailable,
                "no coordinator here",
            ))
            .unwrap_or_default();
            let _ = client
                .publish_with_headers(reply, headers, body.into())
                .await;
        }
    });

    let mut config = h.config();
    config.tools = vec!["state_set".into()];
    config.agent_tools = vec!["helper".into()];
    config.max_output_tokens = Some(64);
    let agent = h.agent(&config)?;
    h.llm.push(
        Reply::tool_calls([
            ("state_set", json!({"key": "k", "value": 1})),
            ("call_agent", json!({"agent": "helper", "request": "look"})),
        ])
        .usage(120, 30),
    );
    h.llm.push(Reply::text("done").usage(200, 10));
    let mut task = envelope("ask", "Set k, ask the helper.");
    task.trace = Some(TraceContext {
        traceparent: format!("00-{TRACE_ID}-{DISPATCH_SPAN}-01"),
        tracestate: None,
    });
    // The worker's attempt span, as the worker builds it.
    let attempt = spans::invoke_agent(&task, "test_agent", "test-worker");
    assert!(trace_context::set_parent(&attempt, task.trace.as_ref()));
    let (ctx, _cancel) = h.context(&task, Duration::from_secs(20))?;
    let reply = agent
        .run(&task, ctx)
        .instrument(attempt.clone())
        .await
        .map_err(anyhow::Error::msg)?;
    assert_eq!(reply.response, "done");
    drop(attempt);
    let flushed = tokio::task::spawn_blocking(move || provider.force_flush()).await?;
    flushed?;

    let spans = receiver
        .wait_for(
            |s| {
                s.iter().filter(|x| x.name.starts_with("chat")).count() == 2
                    && s.iter()
                        .filter(|x| x.name.starts_with("execute_tool"))
                        .count()
                        == 2
                    && s.iter().any(|x| x.name.starts_with("invoke_agent"))
            },
            Duration::from_secs(20),
        )
        .await?;
    let invoke = spans
        .iter()
        .find(|s| s.name == "invoke_agent test_agent")
        .ok_or_else(|| anyhow::anyhow!("no invoke_agent span: {spans:#?}"))?;
    assert_eq!(invoke.trace_id, TRACE_ID);
    assert_eq!(invoke.parent_span_id.as_deref(), Some(DISPATCH_SPAN));
    let under_attempt = |s: &ReceivedSpan| {
        s.trace_id == TRACE_ID && s.parent_span_id.as_deref() == Some(invoke.span_id.as_str())
    };

    let chats: Vec<&ReceivedSpan> = spans
        .iter()
        .filter(|s| s.name.starts_with("chat"))
        .collect();
    let mut usage: Vec<(String, String)> = Vec::new();
    for chat in &chats {
        assert_eq!(chat.name, "chat scripted-model");
        assert!(under_attempt(chat), "{chat:#?}");
        assert_eq!(chat.attribute("gen_ai.operation.name"), Some("chat"));
        assert_eq!(chat.attribute("gen_ai.provider.name"), Some("openai"));
        assert_eq!(
            chat.attribute("gen_ai.request.model"),
            Some("scripted-model")
        );
        assert_eq!(chat.attribute("gen_ai.request.max_tokens"), Some("64"));
        assert!(
            chat.attribute("gen_ai.response.model").is_some(),
            "{chat:#?}"
        );
        usage.push((
            chat.attribute("gen_ai.usage.input_tokens")
                .unwrap_or_default()
                .to_owned(),
            chat.attribute("gen_ai.usage.output_tokens")
                .unwrap_or_default()
                .to_owned(),
        ));
    }
    usage.sort();
    assert_eq!(
        usage,
        vec![("120".into(), "30".into()), ("200".into(), "10".into())]
    );

    let tool = |name: &str| {
        spans
            .iter()
            .find(|s| s.name == format!("execute_tool {name}"))
            .ok_or_else(|| anyhow::anyhow!("no execute_tool {name}: {spans:#?}"))
    };
    let state_set = tool("state_set")?;
    assert!(under_attempt(state_set), "{state_set:#?}");
    assert_eq!(
        state_set.attribute("gen_ai.operation.name"),
        Some("execute_tool")
    );
    assert_eq!(state_set.attribute("gen_ai.tool.name"), Some("state_set"));
    assert!(state_set.attribute("gen_ai.tool.call.id").is_some());
    assert_eq!(state_set.attribute("error.type"), None);
    let call_agent = tool("call_agent")?;
    assert!(under_attempt(call_agent), "{call_agent:#?}");
    assert_eq!(call_agent.attribute("error.type"), Some("unavailable"));

    // The child run was asked for inside the `execute_tool call_agent` span: its context is
    // what `child.start` carried for the coordinator to put on the child's submission.
    let seen = seen.lock().map_err(|e| anyhow::anyhow!("{e}"))?.clone();
    assert_eq!(seen.len(), 1);
    let traceparent = seen[0]
        .get("traceparent")
        .map(|v| v.as_str().to_owned())
        .unwrap_or_default();
    assert_eq!(
        traceparent,
        format!("00-{TRACE_ID}-{}-01", call_agent.span_id),
        "child.start names the tool call's span"
    );
    Ok(())
}
