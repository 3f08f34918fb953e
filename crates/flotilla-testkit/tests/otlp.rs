//! The test OTLP receiver decodes both OTLP/HTTP encodings and wakes waiters. (That a real
//! OpenTelemetry exporter talks to it is tested in `flotilla-telemetry`'s `tests/otlp.rs`.)

use std::time::Duration;

use flotilla_testkit::otlp::OtlpReceiver;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn kv(key: &str, value: any_value::Value) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: Some(AnyValue { value: Some(value) }),
        ..Default::default()
    }
}

fn request(
    service: &str,
    name: &str,
    span_id: u8,
    parent: Option<u8>,
) -> ExportTraceServiceRequest {
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource {
                attributes: vec![kv(
                    "service.name",
                    any_value::Value::StringValue(service.into()),
                )],
                ..Default::default()
            }),
            scope_spans: vec![ScopeSpans {
                spans: vec![Span {
                    trace_id: vec![0xab; 16],
                    span_id: vec![span_id; 8],
                    parent_span_id: parent.map(|p| vec![p; 8]).unwrap_or_default(),
                    name: name.into(),
                    attributes: vec![
                        kv("flotilla.attempt", any_value::Value::IntValue(2)),
                        kv("ok", any_value::Value::BoolValue(true)),
                    ],
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        }],
    }
}

/// POSTs `body` with HTTP/1.1 and returns the status code.
async fn post(receiver: &OtlpReceiver, content_type: &str, body: &[u8]) -> anyhow::Result<u16> {
    let addr = receiver.endpoint().trim_start_matches("http://").to_owned();
    let mut s = tokio::net::TcpStream::connect(&addr).await?;
    let head = format!(
        "POST /v1/traces HTTP/1.1\r\nHost: {addr}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await?;
    s.write_all(body).await?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await?;
    let raw = String::from_utf8_lossy(&raw);
    Ok(raw
        .split_whitespace()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("no status: {raw}"))?
        .parse()?)
}

#[tokio::test]
async fn protobuf_and_json_exports_are_decoded() -> anyhow::Result<()> {
    let receiver = OtlpReceiver::start().await?;
    assert!(receiver.traces_endpoint().ends_with("/v1/traces"));

    let waiter = receiver.wait_for(|s| s.len() == 2, Duration::from_secs(10));
    let send = async {
        let proto = request("svc-a", "root", 1, None).encode_to_vec();
        anyhow::ensure!(post(&receiver, "application/x-protobuf", &proto).await? == 200);
        let json = serde_json::to_vec(&request("svc-b", "child", 2, Some(1)))?;
        anyhow::ensure!(post(&receiver, "application/json", &json).await? == 200);
        Ok(())
    };
    let (spans, sent) = tokio::join!(waiter, send);
    sent?;
    let spans = spans?;

    let root = spans.iter().find(|s| s.name == "root").expect("root");
    assert_eq!(root.trace_id, "ab".repeat(16));
    assert_eq!(root.span_id, "01".repeat(8));
    assert_eq!(root.parent_span_id, None);
    assert_eq!(root.service_name.as_deref(), Some("svc-a"));
    assert_eq!(root.attribute("flotilla.attempt"), Some("2"));
    assert_eq!(root.attribute("ok"), Some("true"));

    let child = spans.iter().find(|s| s.name == "child").expect("child");
    assert_eq!(child.trace_id, root.trace_id);
    assert_eq!(child.parent_span_id.as_deref(), Some(root.span_id.as_str()));
    assert_eq!(child.service_name.as_deref(), Some("svc-b"));
    Ok(())
}

#[tokio::test]
async fn bad_requests_are_refused_and_waiting_times_out_with_a_summary() -> anyhow::Result<()> {
    let receiver = OtlpReceiver::start().await?;
    assert_eq!(post(&receiver, "text/plain", b"hi").await?, 415);
    assert_eq!(
        post(&receiver, "application/x-protobuf", b"\xff\xff").await?,
        400
    );
    let proto = request("svc-a", "only", 3, None).encode_to_vec();
    assert_eq!(
        post(&receiver, "application/x-protobuf", &proto).await?,
        200
    );

    let err = receiver
        .wait_for(
            |s| s.iter().any(|s| s.name == "never"),
            Duration::from_millis(200),
        )
        .await
        .expect_err("no such span");
    assert_eq!(err.count, 1);
    assert!(err.summary.contains("svc-a \"only\""), "{err}");
    Ok(())
}
