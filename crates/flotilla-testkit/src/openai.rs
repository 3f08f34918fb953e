//! A scripted OpenAI-compatible chat-completions server for tests. **It is a test double**: it
//! never runs a model. Every answer is one a test scripted beforehand.
//!
//! [`OpenAiServer::start`] listens on a free loopback port and serves
//! `POST /v1/chat/completions`, streaming (SSE, `stream: true`) and non-streaming. Each request
//! takes the next [`Reply`] of the script (the first whose [`Reply::when`] matcher, if any, is
//! found in the request body), so a test states exactly what "the model" says:
//!
//! * text, streamed in small chunks ([`Reply::text`]);
//! * tool calls, several in one reply when the test wants parallel calls
//!   ([`Reply::tool_calls`]);
//! * usage in the final chunk (when the request asks with `stream_options.include_usage`,
//!   as OpenAI does) or in the body of a non-streaming reply ([`Reply::usage`]; without it the
//!   counts are derived from the sizes of request and reply — made-up numbers, but stable);
//! * provider failures: `429` with `Retry-After` ([`Reply::rate_limited`]), any status
//!   ([`Reply::status`]), a malformed JSON chunk in the middle of a stream
//!   ([`Reply::malformed_chunk`]), slow replies ([`Reply::delay`], [`Reply::chunk_delay`]),
//!   and replies that never come ([`Reply::hang`], [`Reply::hang_mid_stream`]).
//!
//! When the script is exhausted the server answers `500` with a message saying so, which makes
//! an unexpected extra call visible in the test. Every request is recorded
//! ([`OpenAiServer::requests`]) with its headers and JSON body, so tests assert on the
//! prompts, the tools offered and the `response_format` sent.
//!
//! A script may also live in a file ([`read_script`]): the examples' replies in
//! `config/examples/models/*.json`, which `flotilla example` and the tests of those examples
//! both load. A file is a JSON list of replies, each answering one model call, in order:
//! `{"text": "…"}` or `{"tool_calls": [{"name": "…", "arguments": {…}}]}` (with an optional
//! `"text"` said before the calls), each optionally `"when": "…"` — then it answers only a
//! request whose body contains that text (the prompt names its task: `Your task (ID)`).
//!
//! ```no_run
//! # async fn t() -> Result<(), Box<dyn std::error::Error>> {
//! use flotilla_testkit::openai::{OpenAiServer, Reply};
//! let server = OpenAiServer::start().await?;
//! server.push(Reply::tool_calls([("state_get", serde_json::json!({"key": "q"}))]));
//! server.push(Reply::text("The answer is 42.").usage(120, 8));
//! // … point an LLM agent at server.base_url() …
//! let requests = server.requests();
//! assert_eq!(requests[0].tool_names(), vec!["state_get".to_string()]);
//! # Ok(()) }
//! ```

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// Why a file of scripted replies could not be read ([`read_script`]).
#[derive(Debug, thiserror::Error)]
pub enum ScriptFileError {
    /// The file could not be read.
    #[error("reading scripted replies {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// It is not a list of scripted replies.
    #[error(
        "{}: not a list of scripted replies ({{\"text\": …}} or {{\"tool_calls\": [{{\"name\": …, \"arguments\": {{…}}}}]}}, each with an optional \"when\"): {source}",
        path.display()
    )]
    Malformed {
        /// The file.
        path: PathBuf,
        /// Where the JSON is wrong.
        source: serde_json::Error,
    },
    /// A reply says nothing: no text and no tool call.
    #[error("{}: reply {number} has neither text nor tool_calls", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
        /// The reply's number in the list, from 1.
        number: usize,
    },
}

/// One reply of a script file.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileReply {
    /// Answers only a request whose body contains this.
    #[serde(default)]
    when: Option<String>,
    /// The answer's text (said before the tool calls, when there are some).
    #[serde(default)]
    text: Option<String>,
    /// Tool calls the model asks for.
    #[serde(default)]
    tool_calls: Vec<FileToolCall>,
}

/// One tool call of a script file's reply.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileToolCall {
    name: String,
    /// The arguments (`{}` when left out).
    #[serde(default)]
    arguments: Option<Value>,
}

/// The replies of a script file (see the [module](self) for its format), in order, ready for
/// [`OpenAiServer::push_all`].
pub fn read_script(path: &Path) -> Result<Vec<Reply>, ScriptFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| ScriptFileError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse_script(&text, path)
}

/// The replies of a script read from `path` whose text is `text`.
pub fn parse_script(text: &str, path: &Path) -> Result<Vec<Reply>, ScriptFileError> {
    let replies: Vec<FileReply> =
        serde_json::from_str(text).map_err(|source| ScriptFileError::Malformed {
            path: path.to_path_buf(),
            source,
        })?;
    replies
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            let reply = match (r.text, r.tool_calls.is_empty()) {
                (None, true) => {
                    return Err(ScriptFileError::Empty {
                        path: path.to_path_buf(),
                        number: i + 1,
                    });
                }
                (Some(text), true) => Reply::text(text),
                (text, false) => {
                    let calls = r
                        .tool_calls
                        .into_iter()
                        .map(|c| (c.name, c.arguments.unwrap_or_else(|| json!({}))));
                    let reply = Reply::tool_calls(calls);
                    match text {
                        Some(t) => reply.with_text(t),
                        None => reply,
                    }
                }
            };
            Ok(match r.when {
                Some(needle) => reply.when(needle),
                None => reply,
            })
        })
        .collect()
}

/// One tool call of a scripted reply.
#[derive(Debug, Clone, PartialEq)]
pub struct ScriptedToolCall {
    /// The call id (`call_<request>_<index>` unless given).
    pub id: Option<String>,
    /// The tool's name.
    pub name: String,
    /// The arguments exactly as sent to the client: usually JSON, but a test may script
    /// invalid JSON to see how the agent copes.
    pub arguments: String,
}

#[derive(Debug, Clone, PartialEq)]
enum Kind {
    Text(String),
    ToolCalls {
        text: Option<String>,
        calls: Vec<ScriptedToolCall>,
    },
    Status {
        status: u16,
        retry_after: Option<String>,
        body: String,
    },
    Malformed {
        before: String,
    },
    Hang,
    HangMidStream {
        before: String,
    },
}

/// What the server answers to one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    kind: Kind,
    usage: Option<(u64, u64)>,
    delay: Duration,
    chunk_delay: Duration,
    matcher: Option<String>,
    model: Option<String>,
}

impl Reply {
    fn of(kind: Kind) -> Self {
        Self {
            kind,
            usage: None,
            delay: Duration::ZERO,
            chunk_delay: Duration::ZERO,
            matcher: None,
            model: None,
        }
    }

    /// A text answer (streamed in chunks of a few characters).
    pub fn text(text: impl Into<String>) -> Self {
        Self::of(Kind::Text(text.into()))
    }

    /// One tool call with JSON arguments.
    pub fn tool_call(name: impl Into<String>, arguments: Value) -> Self {
        Self::tool_calls([(name, arguments)])
    }

    /// Several tool calls in one reply (the model asks for them in parallel).
    pub fn tool_calls<N: Into<String>>(calls: impl IntoIterator<Item = (N, Value)>) -> Self {
        Self::of(Kind::ToolCalls {
            text: None,
            calls: calls
                .into_iter()
                .map(|(name, args)| ScriptedToolCall {
                    id: None,
                    name: name.into(),
                    arguments: args.to_string(),
                })
                .collect(),
        })
    }

    /// Tool calls given exactly (ids, raw argument text).
    pub fn raw_tool_calls(calls: Vec<ScriptedToolCall>) -> Self {
        Self::of(Kind::ToolCalls { text: None, calls })
    }

    /// Text said before the tool calls of this reply.
    pub fn with_text(mut self, text: impl Into<String>) -> Self {
        if let Kind::ToolCalls { text: t, .. } = &mut self.kind {
            *t = Some(text.into());
        }
        self
    }

    /// `429 Too Many Requests` with `Retry-After: <seconds>` (fractions allowed, e.g. `0.2`;
    /// real servers send whole seconds or an HTTP date).
    pub fn rate_limited(retry_after: impl Into<String>) -> Self {
        Self::of(Kind::Status {
            status: 429,
            retry_after: Some(retry_after.into()),
            body: json!({"error": {"message": "Rate limit reached (scripted)", "type": "requests", "code": "rate_limit_exceeded"}}).to_string(),
        })
    }

    /// Any HTTP status with an OpenAI-style error body (`500`, `400`, `401`…).
    pub fn status(status: u16) -> Self {
        Self::of(Kind::Status {
            status,
            retry_after: None,
            body: json!({"error": {"message": format!("scripted status {status}"), "type": "server_error", "code": null}}).to_string(),
        })
    }

    /// Any HTTP status with an OpenAI-style error body carrying `message` (what a provider
    /// says about a bad key, an unknown model…).
    pub fn status_message(status: u16, message: impl Into<String>) -> Self {
        Self::of(Kind::Status {
            status,
            retry_after: None,
            body: json!({"error": {"message": message.into(), "type": "invalid_request_error", "code": null}}).to_string(),
        })
    }

    /// A stream that sends `before` as text, then a chunk that is not JSON.
    pub fn malformed_chunk(before: impl Into<String>) -> Self {
        Self::of(Kind::Malformed {
            before: before.into(),
        })
    }

    /// Accepts the request and never answers (no status line), until the client gives up.
    pub fn hang() -> Self {
        Self::of(Kind::Hang)
    }

    /// Starts streaming `before`, then sends nothing more and never ends the stream.
    pub fn hang_mid_stream(before: impl Into<String>) -> Self {
        Self::of(Kind::HangMidStream {
            before: before.into(),
        })
    }

    /// Token usage reported for this reply (prompt, completion).
    pub fn usage(mut self, prompt_tokens: u64, completion_tokens: u64) -> Self {
        self.usage = Some((prompt_tokens, completion_tokens));
        self
    }

    /// Waits this long before answering at all (a slow server).
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// Waits this long between stream chunks (a slowly generating model).
    pub fn chunk_delay(mut self, delay: Duration) -> Self {
        self.chunk_delay = delay;
        self
    }

    /// Answers only a request whose raw body contains `needle` (for concurrent callers:
    /// each takes the first queued reply that matches it).
    pub fn when(mut self, needle: impl Into<String>) -> Self {
        self.matcher = Some(needle.into());
        self
    }

    /// The model name reported in the reply (default: the requested one).
    pub fn model(mut self, model: impl Into<String>) -> Self {
        self.model = Some(model.into());
        self
    }
}

/// A request as the server received it.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedRequest {
    /// The path (`/v1/chat/completions`).
    pub path: String,
    /// Headers, names in lower case.
    pub headers: BTreeMap<String, String>,
    /// The JSON body (`Value::Null` when it was not JSON).
    pub body: Value,
    /// Which reply of the script answered it (`None`: the script was exhausted).
    pub reply_index: Option<usize>,
    /// Whether it came over HTTP/2 (else HTTP/1.x).
    pub http2: bool,
}

impl RecordedRequest {
    /// Whether the client asked for a stream.
    pub fn stream(&self) -> bool {
        self.body.get("stream").and_then(Value::as_bool) == Some(true)
    }

    /// The requested model.
    pub fn model(&self) -> &str {
        self.body
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or_default()
    }

    /// The messages sent.
    pub fn messages(&self) -> &[Value] {
        self.body
            .get("messages")
            .and_then(Value::as_array)
            .map_or(&[], Vec::as_slice)
    }

    /// Text of every message with `role`, in order (string contents, or the text parts).
    pub fn texts(&self, role: &str) -> Vec<String> {
        self.messages()
            .iter()
            .filter(|m| m.get("role").and_then(Value::as_str) == Some(role))
            .map(|m| content_text(m.get("content").unwrap_or(&Value::Null)))
            .collect()
    }

    /// The system prompt (all system messages, joined).
    pub fn system(&self) -> String {
        self.texts("system").join("\n")
    }

    /// The user messages, joined.
    pub fn user(&self) -> String {
        self.texts("user").join("\n")
    }

    /// Names of the tools offered.
    pub fn tool_names(&self) -> Vec<String> {
        self.body
            .get("tools")
            .and_then(Value::as_array)
            .map(|tools| {
                tools
                    .iter()
                    .filter_map(|t| t.pointer("/function/name").and_then(Value::as_str))
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The `response_format` sent, if any.
    pub fn response_format(&self) -> Option<&Value> {
        self.body.get("response_format")
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
    }
}

fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// [`OpenAiServer::wait_for_requests`] gave up.
#[derive(Debug, thiserror::Error)]
#[error("expected {expected} requests within {timeout:?}; {got} arrived")]
pub struct WaitForRequestsError {
    /// Requests expected.
    pub expected: usize,
    /// Requests received.
    pub got: usize,
    /// How long it waited.
    pub timeout: Duration,
}

#[derive(Default)]
struct Script {
    queue: VecDeque<(usize, Reply)>,
    pushed: usize,
}

struct Shared {
    script: Mutex<Script>,
    requests: Mutex<Vec<RecordedRequest>>,
    arrivals: watch::Sender<usize>,
    disconnects: AtomicU64,
    connections: Arc<AtomicU64>,
}

/// A running scripted server; stops on drop.
pub struct OpenAiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    app: Router,
    max_streams: u32,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for OpenAiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl OpenAiServer {
    /// Listens on `127.0.0.1` on a free port, with an empty script: HTTP/1.1, and h2c with
    /// hyper's default stream limit.
    pub async fn start() -> Result<Self, std::io::Error> {
        Self::start_h2c(DEFAULT_MAX_STREAMS).await
    }

    /// Listens as [`start`](Self::start) does, with at most `max_streams` requests at once on
    /// one HTTP/2 connection (h2c, "prior knowledge") — the limit a provider announces
    /// (`SETTINGS_MAX_CONCURRENT_STREAMS`).
    pub async fn start_h2c(max_streams: u32) -> Result<Self, std::io::Error> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            script: Mutex::new(Script::default()),
            requests: Mutex::new(Vec::new()),
            arrivals: watch::channel(0).0,
            disconnects: AtomicU64::new(0),
            connections: Arc::new(AtomicU64::new(0)),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(chat))
            .route("/chat/completions", post(chat))
            .with_state(Arc::clone(&shared));
        let task = spawn_serving(listener, &app, max_streams, &shared);
        Ok(Self {
            addr,
            shared,
            app,
            max_streams,
            task,
        })
    }

    /// A provider restarted behind the same URL: closes every connection and the listener,
    /// then listens again on the same address, keeping the script and the recorded requests.
    pub async fn restart(&mut self) -> Result<(), std::io::Error> {
        self.task.abort();
        // The listener and the connections close once the serving task is dropped.
        let _ = (&mut self.task).await;
        let listener = tokio::net::TcpListener::bind(self.addr).await?;
        self.task = spawn_serving(listener, &self.app, self.max_streams, &self.shared);
        Ok(())
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.shared.connections.load(Ordering::SeqCst)
    }

    /// The base URL an OpenAI client takes (`http://127.0.0.1:<port>/v1`).
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Appends a reply to the script.
    pub fn push(&self, reply: Reply) {
        let mut s = self
            .shared
            .script
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let n = s.pushed;
        s.pushed += 1;
        s.queue.push_back((n, reply));
    }

    /// Appends several replies, in order.
    pub fn push_all(&self, replies: impl IntoIterator<Item = Reply>) {
        for r in replies {
            self.push(r);
        }
    }

    /// Replies not used yet.
    pub fn remaining(&self) -> usize {
        self.shared
            .script
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .queue
            .len()
    }

    /// Every request received so far, in arrival order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared
            .requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Streams the client stopped reading before they ended (best effort: counted when the
    /// server notices, which for a hanging stream is when the client closes the connection).
    pub fn disconnects(&self) -> u64 {
        self.shared.disconnects.load(Ordering::SeqCst)
    }

    /// Waits until at least `n` requests have arrived, and returns them.
    pub async fn wait_for_requests(
        &self,
        n: usize,
        timeout: Duration,
    ) -> Result<Vec<RecordedRequest>, WaitForRequestsError> {
        let mut arrivals = self.shared.arrivals.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let got = self.requests();
            if got.len() >= n {
                return Ok(got);
            }
            match tokio::time::timeout_at(deadline, arrivals.changed()).await {
                Ok(Ok(())) => {}
                _ => {
                    return Err(WaitForRequestsError {
                        expected: n,
                        got: self.requests().len(),
                        timeout,
                    });
                }
            }
        }
    }
}

impl Drop for OpenAiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `app` on `listener` in a task of its own, counting its connections in `shared`.
fn spawn_serving(
    listener: tokio::net::TcpListener,
    app: &Router,
    max_streams: u32,
    shared: &Shared,
) -> JoinHandle<()> {
    tokio::spawn(serve_http1_and_h2c(
        listener,
        app.clone(),
        max_streams,
        Arc::clone(&shared.connections),
    ))
}

/// hyper's default limit of concurrent streams on one HTTP/2 connection, which `axum::serve`
/// keeps: what [`OpenAiServer::start`] allows.
const DEFAULT_MAX_STREAMS: u32 = 200;

/// Serves `app` on `listener` over HTTP/1.1 and over HTTP/2 without TLS (h2c, told apart by
/// the client's first bytes), with at most `max_streams` concurrent requests on one HTTP/2
/// connection, counting the connections it accepts in `connections`. Runs until dropped;
/// dropping it closes every connection it accepted, as a stopped server's would be.
pub async fn serve_http1_and_h2c(
    listener: tokio::net::TcpListener,
    app: Router,
    max_streams: u32,
    connections: Arc<AtomicU64>,
) {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use hyper_util::service::TowerToHyperService;
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder.http2().max_concurrent_streams(max_streams);
    // The connections, aborted with this future.
    let mut open = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            // Reap the connections that ended.
            Some(_) = open.join_next(), if !open.is_empty() => continue,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(_) => {
                // Out of file descriptors, most likely: try again shortly, as axum does.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        connections.fetch_add(1, Ordering::SeqCst);
        let builder = builder.clone();
        let service = TowerToHyperService::new(app.clone());
        open.spawn(async move {
            let _ = builder
                .serve_connection_with_upgrades(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Counts a stream the client abandoned when dropped before it finished.
struct StreamGuard {
    shared: Arc<Shared>,
    done: bool,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if !self.done {
            self.shared.disconnects.fetch_add(1, Ordering::SeqCst);
        }
    }
}

async fn chat(
    State(shared): State<Arc<Shared>>,
    uri: axum::http::Uri,
    version: axum::http::Version,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let raw = String::from_utf8_lossy(&body).into_owned();
    let parsed: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let chosen = {
        let mut s = shared.script.lock().unwrap_or_else(PoisonError::into_inner);
        let pos = s
            .queue
            .iter()
            .position(|(_, r)| r.matcher.as_deref().is_none_or(|m| raw.contains(m)));
        pos.and_then(|p| s.queue.remove(p))
    };
    let index = {
        let mut requests = shared
            .requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        requests.push(RecordedRequest {
            path: uri.path().to_owned(),
            headers: headers
                .iter()
                .map(|(k, v)| {
                    (
                        k.as_str().to_ascii_lowercase(),
                        String::from_utf8_lossy(v.as_bytes()).into_owned(),
                    )
                })
                .collect(),
            body: parsed.clone(),
            reply_index: chosen.as_ref().map(|(i, _)| *i),
            http2: version == axum::http::Version::HTTP_2,
        });
        requests.len()
    };
    shared.arrivals.send_modify(|n| *n += 1);
    if parsed.is_null() {
        return error_response(400, None, "the request body is not JSON");
    }
    let Some((_, reply)) = chosen else {
        return error_response(
            500,
            None,
            "the scripted OpenAI test server has no reply left for this request",
        );
    };
    if !reply.delay.is_zero() {
        tokio::time::sleep(reply.delay).await;
    }
    let stream = parsed.get("stream").and_then(Value::as_bool) == Some(true);
    let include_usage = parsed
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        == Some(true);
    let model = reply.model.clone().unwrap_or_else(|| {
        parsed
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or("scripted")
            .to_owned()
    });
    let ctx = ReplyContext {
        id: format!("chatcmpl-scripted-{index}"),
        model,
        request_index: index,
        prompt_bytes: body.len(),
    };
    match reply.kind.clone() {
        Kind::Status {
            status,
            retry_after,
            body,
        } => error_body(status, retry_after.as_deref(), body),
        Kind::Hang => {
            // Never answer; the handler is dropped when the client goes away.
            let _guard = StreamGuard {
                shared: Arc::clone(&shared),
                done: false,
            };
            std::future::pending::<Response>().await
        }
        kind if stream => sse(shared, ctx, reply, kind, include_usage),
        Kind::Text(text) => non_stream(&ctx, &reply, Some(&text), &[]),
        Kind::ToolCalls { text, calls } => non_stream(&ctx, &reply, text.as_deref(), &calls),
        Kind::Malformed { .. } => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            "{\"id\": \"chatcmpl-broken\", \"choices\": [",
        )
            .into_response(),
        Kind::HangMidStream { .. } => {
            let _guard = StreamGuard {
                shared: Arc::clone(&shared),
                done: false,
            };
            std::future::pending::<Response>().await
        }
    }
}

struct ReplyContext {
    id: String,
    model: String,
    request_index: usize,
    prompt_bytes: usize,
}

impl ReplyContext {
    fn call_id(&self, i: usize, call: &ScriptedToolCall) -> String {
        call.id
            .clone()
            .unwrap_or_else(|| format!("call_{}_{i}", self.request_index))
    }

    fn usage(&self, reply: &Reply, completion_chars: usize) -> Value {
        let (p, c) = reply.usage.unwrap_or((
            (self.prompt_bytes as u64 / 4).max(1),
            (completion_chars as u64 / 4).max(1),
        ));
        json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c})
    }

    fn chunk(&self, delta: Value, finish: Option<&str>) -> Value {
        json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": 1_700_000_000u32,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        })
    }
}

fn error_response(status: u16, retry_after: Option<&str>, message: &str) -> Response {
    error_body(
        status,
        retry_after,
        json!({"error": {"message": message, "type": "server_error", "code": null}}).to_string(),
    )
}

fn error_body(status: u16, retry_after: Option<&str>, body: String) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (code, [(header::CONTENT_TYPE, "application/json")], body).into_response();
    if let Some(ra) = retry_after
        && let Ok(v) = ra.parse()
    {
        response.headers_mut().insert(header::RETRY_AFTER, v);
    }
    response
}

fn non_stream(
    ctx: &ReplyContext,
    reply: &Reply,
    text: Option<&str>,
    calls: &[ScriptedToolCall],
) -> Response {
    let mut message = json!({"role": "assistant", "content": text});
    if !calls.is_empty() {
        message["tool_calls"] = calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({"id": ctx.call_id(i, c), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}})
            })
            .collect();
    }
    let chars = text.map_or(0, str::len) + calls.iter().map(|c| c.arguments.len()).sum::<usize>();
    let body = json!({
        "id": ctx.id,
        "object": "chat.completion",
        "created": 1_700_000_000u32,
        "model": ctx.model,
        "choices": [{"index": 0, "message": message,
                     "finish_reason": if calls.is_empty() { "stop" } else { "tool_calls" }}],
        "usage": ctx.usage(reply, chars),
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// Splits text into chunks of about `n` characters (on char boundaries).
fn pieces(text: &str, n: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    chars.chunks(n.max(1)).map(|c| c.iter().collect()).collect()
}

fn sse(
    shared: Arc<Shared>,
    ctx: ReplyContext,
    reply: Reply,
    kind: Kind,
    include_usage: bool,
) -> Response {
    let (tx, mut rx) = mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        let mut guard = StreamGuard {
            shared,
            done: false,
        };
        let send = |v: String| {
            let tx = tx.clone();
            async move { tx.send(Bytes::from(format!("data: {v}\n\n"))).await.is_ok() }
        };
        let pause = || async {
            if !reply.chunk_delay.is_zero() {
                tokio::time::sleep(reply.chunk_delay).await;
            }
        };
        if !send(
            ctx.chunk(json!({"role": "assistant", "content": ""}), None)
                .to_string(),
        )
        .await
        {
            return;
        }
        let (text, calls, end) = match &kind {
            Kind::Text(t) => (Some(t.as_str()), &[][..], End::Finish),
            Kind::ToolCalls { text, calls } => (text.as_deref(), calls.as_slice(), End::Finish),
            Kind::Malformed { before } => (Some(before.as_str()), &[][..], End::Malformed),
            Kind::HangMidStream { before } => (Some(before.as_str()), &[][..], End::Hang),
            Kind::Status { .. } | Kind::Hang => (None, &[][..], End::Finish),
        };
        let mut chars = 0;
        for piece in pieces(text.unwrap_or_default(), 4) {
            pause().await;
            chars += piece.len();
            if !send(ctx.chunk(json!({"content": piece}), None).to_string()).await {
                return;
            }
        }
        for (i, call) in calls.iter().enumerate() {
            pause().await;
            let head = json!({"tool_calls": [{"index": i, "id": ctx.call_id(i, call), "type": "function",
                                              "function": {"name": call.name, "arguments": ""}}]});
            if !send(ctx.chunk(head, None).to_string()).await {
                return;
            }
            // Arguments arrive in pieces, as real servers send them.
            for piece in pieces(&call.arguments, 7) {
                chars += piece.len();
                let part = json!({"tool_calls": [{"index": i, "function": {"arguments": piece}}]});
                if !send(ctx.chunk(part, None).to_string()).await {
                    return;
                }
            }
        }
        match end {
            End::Malformed => {
                let _ = tx
                    .send(Bytes::from_static(
                        b"data: {\"id\": \"chatcmpl-broken\", \"choices\": [\n\n",
                    ))
                    .await;
                guard.done = true;
                return;
            }
            End::Hang => {
                // Keep the stream open, sending nothing, until the client goes away.
                tx.closed().await;
                return;
            }
            End::Finish => {}
        }
        pause().await;
        let finish = if calls.is_empty() {
            "stop"
        } else {
            "tool_calls"
        };
        if !send(ctx.chunk(json!({}), Some(finish)).to_string()).await {
            return;
        }
        if include_usage {
            let usage = json!({
                "id": ctx.id, "object": "chat.completion.chunk", "created": 1_700_000_000u32,
                "model": ctx.model, "choices": [], "usage": ctx.usage(&reply, chars),
            });
            if !send(usage.to_string()).await {
                return;
            }
        }
        if tx
            .send(Bytes::from_static(b"data: [DONE]\n\n"))
            .await
            .is_ok()
        {
            guard.done = true;
        }
    });
    let body =
        futures::stream::poll_fn(move |cx| rx.poll_recv(cx).map(|o| o.map(Ok::<_, Infallible>)));
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

enum End {
    Finish,
    Malformed,
    Hang,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_split_on_char_boundaries() {
        assert_eq!(pieces("héllo wörld", 4), vec!["héll", "o wö", "rld"]);
        assert!(pieces("", 4).is_empty());
    }
}
