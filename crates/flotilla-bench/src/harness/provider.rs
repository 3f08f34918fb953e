//! The simulated OpenAI-compatible provider the LLM-driven sections share (`llm`, `agents`):
//! a test double, not a model. A small HTTP server on a free loopback port answers
//! `POST /v1/chat/completions` after a configurable delay with a short reply, streamed (SSE
//! `data:` chunks, a usage chunk when the request asks with `stream_options.include_usage`,
//! then `data: [DONE]`) or as one JSON body. It asks for one `state_get` tool call when the
//! request offers that tool and holds no tool result yet, so a task can take one tool round.
//! It serves HTTP/1.1 and HTTP/2 without TLS (h2c), at most 100 requests at once on one
//! HTTP/2 connection. It records the time each request spent in its handler (body parsed →
//! reply handed to the HTTP layer, the delay included): the *server time*; and the most
//! requests it held in the delay at once, which shows how many calls were truly in flight.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};

/// The reply text of the simulated provider (streamed word by word).
pub(crate) const REPLY: &str = "Done: the figure is 42.";

/// Counters of the simulated provider.
#[derive(Default)]
struct Sim {
    delay_micros: AtomicU64,
    server_nanos: AtomicU64,
    requests: AtomicU64,
    /// Requests received (counted on arrival; `requests` counts them answered).
    arrived: AtomicU64,
    bad_requests: AtomicU64,
    /// Requests in the delay now, and the most at once since the last
    /// [`Provider::take_peak_waiting`].
    waiting: AtomicU64,
    peak_waiting: AtomicU64,
}

/// The simulated OpenAI-compatible provider; stops on drop.
pub(crate) struct Provider {
    pub(crate) addr: std::net::SocketAddr,
    sim: Arc<Sim>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Provider {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Provider {
    pub(crate) async fn start() -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the simulated provider to a loopback port")?;
        let addr = listener.local_addr()?;
        let sim = Arc::new(Sim::default());
        let app = Router::new()
            .route("/v1/chat/completions", post(chat))
            .with_state(Arc::clone(&sim));
        // HTTP/1.1 and h2c, at most 100 requests at once on one HTTP/2 connection: the
        // lowest limit RFC 9113 asks servers for, and what many providers announce.
        let task = tokio::spawn(flotilla_testkit::openai::serve_http1_and_h2c(
            listener,
            app,
            100,
            Arc::new(AtomicU64::new(0)),
        ));
        Ok(Self { addr, sim, task })
    }

    pub(crate) fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    pub(crate) fn set_delay(&self, d: Duration) {
        self.sim
            .delay_micros
            .store(d.as_micros() as u64, Ordering::SeqCst);
    }

    /// (server nanoseconds, requests) so far.
    /// Requests received so far (counted on arrival).
    pub(crate) fn arrived(&self) -> u64 {
        self.sim.arrived.load(Ordering::SeqCst)
    }

    /// Requests whose body was not JSON so far.
    pub(crate) fn bad_requests(&self) -> u64 {
        self.sim.bad_requests.load(Ordering::SeqCst)
    }

    /// The most requests held in the delay at once since the last call: the model calls
    /// truly in flight together, which a figure claiming N concurrent agents shows.
    pub(crate) fn take_peak_waiting(&self) -> u64 {
        self.sim
            .peak_waiting
            .swap(self.sim.waiting.load(Ordering::SeqCst), Ordering::SeqCst)
    }

    pub(crate) fn totals(&self) -> (u64, u64) {
        (
            self.sim.server_nanos.load(Ordering::SeqCst),
            self.sim.requests.load(Ordering::SeqCst),
        )
    }
}

async fn chat(State(sim): State<Arc<Sim>>, body: Bytes) -> Response {
    let t0 = Instant::now();
    sim.arrived.fetch_add(1, Ordering::SeqCst);
    let response = answer(&sim, &body).await;
    sim.server_nanos
        .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::SeqCst);
    sim.requests.fetch_add(1, Ordering::SeqCst);
    response
}

/// A request counted in [`Sim::waiting`] until dropped (a caller that hangs up mid-delay
/// drops the handler's future).
struct Waiting<'a>(&'a Sim);

impl<'a> Waiting<'a> {
    fn enter(sim: &'a Sim) -> Self {
        let now = sim.waiting.fetch_add(1, Ordering::SeqCst) + 1;
        sim.peak_waiting.fetch_max(now, Ordering::SeqCst);
        Self(sim)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn answer(sim: &Sim, body: &[u8]) -> Response {
    let Ok(request) = serde_json::from_slice::<Value>(body) else {
        sim.bad_requests.fetch_add(1, Ordering::SeqCst);
        return (
            StatusCode::BAD_REQUEST,
            [(header::CONTENT_TYPE, "application/json")],
            json!({"error": {"message": "the request body is not JSON", "type": "invalid_request_error"}}).to_string(),
        )
            .into_response();
    };
    let delay = sim.delay_micros.load(Ordering::SeqCst);
    if delay > 0 {
        let _waiting = Waiting::enter(sim);
        tokio::time::sleep(Duration::from_micros(delay)).await;
    }
    let offers_state_get = request
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|tools| {
            tools
                .iter()
                .any(|t| t.pointer("/function/name").and_then(Value::as_str) == Some("state_get"))
        });
    let has_tool_result = request
        .get("messages")
        .and_then(Value::as_array)
        .is_some_and(|m| {
            m.iter()
                .any(|m| m.get("role").and_then(Value::as_str) == Some("tool"))
        });
    let tool_call = offers_state_get && !has_tool_result;
    let model = request
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("simulated")
        .to_owned();
    let usage = json!({"prompt_tokens": (body.len() / 4).max(1), "completion_tokens": 8, "total_tokens": (body.len() / 4).max(1) + 8});
    let id = "chatcmpl-simulated";
    let call = json!({"id": "call_0", "type": "function",
                      "function": {"name": "state_get", "arguments": "{\"key\": \"figure\"}"}});
    if request.get("stream").and_then(Value::as_bool) != Some(true) {
        let mut message = json!({"role": "assistant", "content": if tool_call { Value::Null } else { REPLY.into() }});
        if tool_call {
            message["tool_calls"] = json!([call]);
        }
        let reply = json!({
            "id": id, "object": "chat.completion", "created": 1_700_000_000u32, "model": model,
            "choices": [{"index": 0, "message": message,
                         "finish_reason": if tool_call { "tool_calls" } else { "stop" }}],
            "usage": usage,
        });
        return (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            reply.to_string(),
        )
            .into_response();
    }
    let include_usage = request
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        == Some(true);
    let chunk = |delta: Value, finish: Option<&str>| {
        json!({"id": id, "object": "chat.completion.chunk", "created": 1_700_000_000u32,
               "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let mut events = vec![chunk(json!({"role": "assistant", "content": ""}), None)];
    if tool_call {
        events.push(chunk(
            json!({"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                                   "function": {"name": "state_get", "arguments": ""}}]}),
            None,
        ));
        events.push(chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"key\": \"figure\"}"}}]}),
            None,
        ));
        events.push(chunk(json!({}), Some("tool_calls")));
    } else {
        for piece in REPLY.split_inclusive(' ') {
            events.push(chunk(json!({"content": piece}), None));
        }
        events.push(chunk(json!({}), Some("stop")));
    }
    if include_usage {
        events.push(
            json!({"id": id, "object": "chat.completion.chunk", "created": 1_700_000_000u32,
                           "model": model, "choices": [], "usage": usage}),
        );
    }
    let mut frames: Vec<Result<Bytes, std::convert::Infallible>> = events
        .iter()
        .map(|e| Ok(Bytes::from(format!("data: {e}\n\n"))))
        .collect();
    frames.push(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(futures::stream::iter(frames)))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}
