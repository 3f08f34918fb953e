//! An OTLP/HTTP trace receiver for tests: what a collector would receive, kept for assertions.
//!
//! [`OtlpReceiver::start`] listens on a free loopback port and accepts `POST /v1/traces` in
//! both OTLP/HTTP encodings (binary protobuf and JSON), decoded with the `opentelemetry-proto`
//! types. Point a process at it with `OTEL_EXPORTER_OTLP_ENDPOINT=<`[`endpoint`]`>` and
//! `OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf`, then [`wait_for`] the spans a test expects —
//! exports are batched and asynchronous, so tests wait on a condition with a deadline instead
//! of sleeping.
//!
//! ```no_run
//! # async fn t() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! let receiver = flotilla_testkit::otlp::OtlpReceiver::start().await?;
//! // … run something exporting to receiver.endpoint() …
//! let spans = receiver
//!     .wait_for(|spans| spans.iter().any(|s| s.name == "startup"), Duration::from_secs(20))
//!     .await?;
//! assert!(spans.iter().any(|s| s.service_name.as_deref() == Some("flotilla-worker")));
//! # Ok(()) }
//! ```
//!
//! [`endpoint`]: OtlpReceiver::endpoint
//! [`wait_for`]: OtlpReceiver::wait_for

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use prost::Message;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// One received span, flattened for assertions. Ids are lowercase hex, as in `traceparent`.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedSpan {
    /// 32 hex digits.
    pub trace_id: String,
    /// 16 hex digits.
    pub span_id: String,
    /// The parent's span id; `None` for a root span.
    pub parent_span_id: Option<String>,
    /// The span name.
    pub name: String,
    /// `service.name` of the exporting process.
    pub service_name: Option<String>,
    /// The instrumentation scope (tracer) name.
    pub scope: String,
    /// Span attributes, values rendered as text.
    pub attributes: BTreeMap<String, String>,
    /// Resource attributes of the exporting process, values rendered as text.
    pub resource: BTreeMap<String, String>,
}

impl ReceivedSpan {
    /// An attribute's value.
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

/// [`OtlpReceiver::wait_for`] gave up.
#[derive(Debug, thiserror::Error)]
#[error("the expected spans did not arrive within {timeout:?}; received {count}:\n{summary}")]
pub struct WaitForSpansError {
    /// How long it waited.
    pub timeout: Duration,
    /// Spans received by then.
    pub count: usize,
    /// One line per received span (service, name, ids), for the assertion message.
    pub summary: String,
}

struct Shared {
    spans: Mutex<Vec<ReceivedSpan>>,
    /// Bumped after every stored batch.
    batches: watch::Sender<u64>,
}

/// A running receiver; stops on drop.
#[derive(Debug)]
pub struct OtlpReceiver {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}

impl OtlpReceiver {
    /// Listens on `127.0.0.1` on a free port.
    pub async fn start() -> Result<Self, std::io::Error> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            spans: Mutex::new(Vec::new()),
            batches: watch::channel(0).0,
        });
        let app = Router::new()
            .route("/v1/traces", post(traces))
            .with_state(Arc::clone(&shared));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { addr, shared, task })
    }

    /// The base URL for `OTEL_EXPORTER_OTLP_ENDPOINT` (`http://127.0.0.1:<port>`).
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The full traces URL for `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (`…/v1/traces`).
    pub fn traces_endpoint(&self) -> String {
        format!("{}/v1/traces", self.endpoint())
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.shared
            .spans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Waits until `predicate` holds for the spans received so far (checked now and after every
    /// batch), and returns them; fails after `timeout` with a summary of what did arrive.
    pub async fn wait_for(
        &self,
        predicate: impl Fn(&[ReceivedSpan]) -> bool,
        timeout: Duration,
    ) -> Result<Vec<ReceivedSpan>, WaitForSpansError> {
        let deadline = tokio::time::Instant::now() + timeout;
        // Subscribe before looking, so a batch stored in between still wakes us.
        let mut batches = self.shared.batches.subscribe();
        loop {
            let spans = self.spans();
            if predicate(&spans) {
                return Ok(spans);
            }
            match tokio::time::timeout_at(deadline, batches.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => {
                    let spans = self.spans();
                    let mut summary = String::new();
                    for s in &spans {
                        let _ = writeln!(
                            summary,
                            "  {} {:?} trace={} span={} parent={:?}",
                            s.service_name.as_deref().unwrap_or("?"),
                            s.name,
                            s.trace_id,
                            s.span_id,
                            s.parent_span_id
                        );
                    }
                    return Err(WaitForSpansError {
                        timeout,
                        count: spans.len(),
                        summary,
                    });
                }
            }
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn traces(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    if headers.contains_key(header::CONTENT_ENCODING) {
        return (
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "compressed OTLP is not supported by the test receiver",
        )
            .into_response();
    }
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_ascii_lowercase();
    let json = content_type.starts_with("application/json");
    let request = if json {
        serde_json::from_slice::<ExportTraceServiceRequest>(&body).map_err(|e| e.to_string())
    } else if content_type.starts_with("application/x-protobuf") {
        ExportTraceServiceRequest::decode(body).map_err(|e| e.to_string())
    } else {
        return (
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("unsupported content type {content_type:?}"),
        )
            .into_response();
    };
    let request = match request {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, e).into_response(),
    };
    let received = flatten(request);
    shared
        .spans
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .extend(received);
    shared.batches.send_modify(|n| *n += 1);
    if json {
        ([(header::CONTENT_TYPE, "application/json")], "{}").into_response()
    } else {
        (
            [(header::CONTENT_TYPE, "application/x-protobuf")],
            ExportTraceServiceResponse::default().encode_to_vec(),
        )
            .into_response()
    }
}

fn flatten(request: ExportTraceServiceRequest) -> Vec<ReceivedSpan> {
    let mut out = Vec::new();
    for rs in request.resource_spans {
        let resource = rs
            .resource
            .map(|r| attributes(&r.attributes))
            .unwrap_or_default();
        let service_name = resource.get("service.name").cloned();
        for ss in rs.scope_spans {
            let scope = ss.scope.map(|s| s.name).unwrap_or_default();
            for span in ss.spans {
                out.push(ReceivedSpan {
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: (!span.parent_span_id.is_empty())
                        .then(|| hex(&span.parent_span_id)),
                    name: span.name,
                    service_name: service_name.clone(),
                    scope: scope.clone(),
                    attributes: attributes(&span.attributes),
                    resource: resource.clone(),
                });
            }
        }
    }
    out
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| {
            (
                kv.key.clone(),
                kv.value.as_ref().map(text).unwrap_or_default(),
            )
        })
        .collect()
}

fn text(v: &AnyValue) -> String {
    match &v.value {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}
