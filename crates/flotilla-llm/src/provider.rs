//! The model provider: an OpenAI-compatible chat-completions endpoint, called through
//! `async-openai` over Flotilla's own HTTP transport.
//!
//! ```text
//! complete(request) ─► permit of the provider's semaphore (per worker)
//!                   ─► POST /chat/completions (stream or not), bounded by request-timeout,
//!                      the attempt's deadline and its cancellation
//!                   ─► 429 / 5xx / broken stream / timeout: wait (Retry-After, else
//!                      exponential backoff with jitter) and retry, unless the wait would pass
//!                      the deadline or max-retries is spent
//!                   ─► other 4xx: fail at once
//! ```
//!
//! Why `async-openai`: it is the most used Rust client of the OpenAI API, keeps the
//! request/stream types current with the API, parses SSE, and lets the caller own the HTTP
//! transport (`middleware`). Flotilla's transport (hyper with rustls on ring) turns 429 and
//! 5xx answers into errors that keep the status and `Retry-After`, so retries are Flotilla's
//! and are bounded by the task's deadline (the crate's own retry layer is not used).
//!
//! Dropping a call (cancellation, deadline) drops the HTTP request: the connection is closed
//! and the server stops generating.

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use async_openai::middleware::HttpRequestFactory;
use async_openai::types::chat::{CreateChatCompletionRequest, FinishReason};
use bytes::Bytes;
use futures::StreamExt;
use futures::future::BoxFuture;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::config::LlmConfig;
use crate::ratelimit::{RateLimit, RateLimitError};

/// What the agents of one worker share per provider: the concurrency caps (one semaphore
/// per provider key) and the HTTP transports (one per provider key and HTTP mode), so the
/// agents of one provider share its connections. Every LLM agent built for one worker shares
/// one `Providers`.
#[derive(Debug, Clone, Default)]
pub struct Providers {
    caps: Arc<Mutex<HashMap<String, Cap>>>,
    transports: Arc<Mutex<HashMap<(String, bool), Transport>>>,
}

/// A provider's semaphore and its current size.
type Cap = (Arc<Semaphore>, usize);

impl Providers {
    /// The semaphore of `key`, created with `permits`; a later, smaller cap lowers it.
    pub fn semaphore(&self, key: &str, permits: usize) -> Arc<Semaphore> {
        let mut caps = self.caps.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = caps
            .entry(key.to_owned())
            .or_insert_with(|| (Arc::new(Semaphore::new(permits)), permits));
        if permits < entry.1 {
            entry.0.forget_permits(entry.1 - permits);
            entry.1 = permits;
        }
        Arc::clone(&entry.0)
    }

    /// The transport of `config`'s provider, created for its request cap on first use.
    fn transport(&self, config: &LlmConfig) -> Transport {
        let mut transports = self
            .transports
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        transports
            .entry((config.provider_key(), config.http2_prior_knowledge))
            .or_insert_with(|| {
                Transport::new(config.max_concurrent_requests, config.http2_prior_knowledge)
            })
            .clone()
    }
}

/// An API key, redacted in `Debug` and `Display`.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    /// The key, for the `Authorization` header only.
    fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey([redacted])")
    }
}

/// Where the API key comes from.
#[derive(Debug, Clone)]
pub enum KeySource {
    /// No key (local servers).
    None,
    /// An environment variable.
    Env(String),
    /// A file (trailing whitespace is trimmed).
    File(PathBuf),
}

impl KeySource {
    /// Reads the key now. Errors name the variable or file, never the key.
    pub fn load(&self) -> Result<Option<ApiKey>, String> {
        match self {
            Self::None => Ok(None),
            Self::Env(var) => match std::env::var(var) {
                Ok(k) if !k.trim().is_empty() => Ok(Some(ApiKey(k.trim().to_owned()))),
                Ok(_) => Err(format!(
                    "api-key-env: the environment variable {var} is empty"
                )),
                Err(_) => Err(format!(
                    "api-key-env: the environment variable {var} is not set in the worker's environment"
                )),
            },
            Self::File(path) => match std::fs::read_to_string(path) {
                Ok(k) if !k.trim().is_empty() => Ok(Some(ApiKey(k.trim().to_owned()))),
                Ok(_) => Err(format!("api-key-file: {} is empty", path.display())),
                Err(e) => Err(format!("api-key-file: cannot read {}: {e}", path.display())),
            },
        }
    }
}

/// An HTTP answer the transport turned into an error: 429 and 5xx.
#[derive(Debug, thiserror::Error)]
#[error("the provider answered {status}: {message}")]
struct StatusError {
    status: u16,
    retry_after: Option<Duration>,
    message: String,
}

/// A connection-level failure of the transport.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct TransportError(String);

/// Most requests a worker sends over one HTTP/2 connection to a provider.
///
/// hyper keeps one HTTP/2 connection per host and queues the requests above the server's
/// limit of concurrent streams (`SETTINGS_MAX_CONCURRENT_STREAMS`, often 100 to 256; RFC 9113
/// asks servers for at least 100) inside the client, where they wait unseen. So the transport
/// keeps one client — one connection pool — per this many requests of the provider's cap
/// (`max-concurrent-requests`), and each request takes the least loaded: a worker's requests
/// to one provider never wait for a stream while its cap allows them.
const STREAMS_PER_CONNECTION: usize = 100;

type Https = HyperClient<flotilla_http::HttpsConnector, reqwest::Body>;

/// One client of a transport (its own connection pool) and the requests it carries now,
/// their reply bodies included.
struct Lane {
    client: Https,
    in_flight: AtomicUsize,
}

/// Flotilla's HTTP transport for `async-openai`: hyper with rustls (ring provider) and the
/// platform's roots (the webpki roots when the platform has none), over one or more clients
/// ([`STREAMS_PER_CONNECTION`]).
#[derive(Clone)]
struct Transport {
    lanes: Arc<[Lane]>,
}

impl fmt::Debug for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transport")
            .field("lanes", &self.lanes.len())
            .finish_non_exhaustive()
    }
}

/// Largest error body kept from a 429 / 5xx answer.
const MAX_ERROR_BODY: usize = 4096;

impl Transport {
    /// A transport for up to `max_requests` requests at once; `http2_only` speaks HTTP/2
    /// from the first byte (h2c on `http://`, "prior knowledge").
    fn new(max_requests: usize, http2_only: bool) -> Self {
        let lanes = max_requests.div_ceil(STREAMS_PER_CONNECTION).max(1);
        // One connector, its TLS configuration and certificate roots, shared by the lanes.
        let connector = flotilla_http::https_connector();
        let lanes = (0..lanes)
            .map(|_| Lane {
                client: HyperClient::builder(TokioExecutor::new())
                    .http2_only(http2_only)
                    .build(connector.clone()),
                in_flight: AtomicUsize::new(0),
            })
            .collect();
        Self { lanes }
    }

    /// The least loaded lane, counted in until the guard drops.
    fn take_lane(&self) -> LaneGuard {
        let index = self
            .lanes
            .iter()
            .enumerate()
            .min_by_key(|(_, l)| l.in_flight.load(Ordering::Relaxed))
            .map_or(0, |(i, _)| i);
        self.lanes[index].in_flight.fetch_add(1, Ordering::Relaxed);
        LaneGuard {
            lanes: Arc::clone(&self.lanes),
            index,
        }
    }
}

/// A request's place on its lane, held until its reply body is dropped.
struct LaneGuard {
    lanes: Arc<[Lane]>,
    index: usize,
}

impl LaneGuard {
    fn client(&self) -> &Https {
        &self.lanes[self.index].client
    }
}

impl Drop for LaneGuard {
    fn drop(&mut self) {
        self.lanes[self.index]
            .in_flight
            .fetch_sub(1, Ordering::Relaxed);
    }
}

/// A reply body that keeps its request counted on its lane: an HTTP/2 stream stays open
/// until its body ends.
struct LaneBody {
    body: hyper::body::Incoming,
    _lane: LaneGuard,
}

impl hyper::body::Body for LaneBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

impl tower::Service<HttpRequestFactory> for Transport {
    type Response = reqwest::Response;
    type Error = OpenAIError;
    type Future = BoxFuture<'static, Result<reqwest::Response, OpenAIError>>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, factory: HttpRequestFactory) -> Self::Future {
        let lane = self.take_lane();
        Box::pin(async move {
            let request = factory.build().await?;
            let request = http::Request::<reqwest::Body>::try_from(request)?;
            let response = lane.client().request(request).await.map_err(|e| {
                OpenAIError::Boxed(Box::new(TransportError(format!(
                    "cannot reach the provider: {}",
                    error_chain(&e)
                ))))
            })?;
            let status = response.status();
            if status.as_u16() == 429 || status.is_server_error() {
                let retry_after = response
                    .headers()
                    .get(http::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(parse_retry_after);
                let body = read_limited(response.into_body()).await;
                return Err(OpenAIError::Boxed(Box::new(StatusError {
                    status: status.as_u16(),
                    retry_after,
                    message: error_message(&body),
                })));
            }
            Ok(reqwest::Response::from(response.map(|body| {
                reqwest::Body::wrap(LaneBody { body, _lane: lane })
            })))
        })
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

async fn read_limited(body: hyper::body::Incoming) -> Bytes {
    use http_body_util::BodyExt;
    let mut out = Vec::new();
    let mut body = body;
    while let Some(Ok(frame)) = body.frame().await {
        if let Some(data) = frame.data_ref() {
            out.extend_from_slice(data);
            if out.len() >= MAX_ERROR_BODY {
                out.truncate(MAX_ERROR_BODY);
                break;
            }
        }
    }
    Bytes::from(out)
}

/// The `error.message` of an OpenAI-style error body, else the body's text.
fn error_message(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .and_then(|m| m.as_str())
                .map(str::to_owned)
        })
        .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_owned())
}

/// `Retry-After` as seconds (fractions allowed) or an HTTP date.
pub fn parse_retry_after(value: &str) -> Option<Duration> {
    let v = value.trim();
    if let Ok(secs) = v.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0)
            .then(|| Duration::from_secs_f64(secs.min(3600.0)));
    }
    let when = httpdate(v)?;
    Some(
        when.duration_since(std::time::SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

/// Parses an IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`).
fn httpdate(v: &str) -> Option<std::time::SystemTime> {
    let parts: Vec<&str> = v.split_whitespace().collect();
    let [_, day, month, year, time, "GMT"] = parts.as_slice() else {
        return None;
    };
    let month = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ]
    .iter()
    .position(|m| m == month)? as i64
        + 1;
    let (day, year): (i64, i64) = (day.parse().ok()?, year.parse().ok()?);
    let hms: Vec<i64> = time.split(':').filter_map(|p| p.parse().ok()).collect();
    let [h, m, s] = hms.as_slice() else {
        return None;
    };
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + h * 3600 + m * 60 + s;
    u64::try_from(secs)
        .ok()
        .map(|s| std::time::UNIX_EPOCH + Duration::from_secs(s))
}

/// One tool call the model asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCallRequest {
    /// The call id, echoed in the tool's result.
    pub id: String,
    /// The tool.
    pub name: String,
    /// The arguments as sent (JSON text, unchecked).
    pub arguments: String,
}

/// A model's complete reply to one request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Completion {
    /// The text.
    pub content: String,
    /// Tool calls, in order.
    pub tool_calls: Vec<ToolCallRequest>,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Completion tokens.
    pub completion_tokens: u64,
    /// The model as the provider named it.
    pub model: String,
    /// Time from the request to the end of the reply (of the successful try).
    pub latency: Duration,
}

/// Why a model call failed for good.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The attempt was cancelled.
    #[error("cancelled during a model call")]
    Cancelled,
    /// The provider kept failing and the retries (or the deadline) ran out.
    #[error("{0}")]
    GaveUp(String),
    /// The provider refused the request (4xx other than 429), or the key is missing.
    #[error("{0}")]
    Rejected(String),
}

/// A failure of one try.
enum TryError {
    Retryable {
        message: String,
        retry_after: Option<Duration>,
    },
    Final(String),
}

/// Calls one provider for one agent.
pub struct Provider {
    config: LlmConfig,
    key: KeySource,
    semaphore: Arc<Semaphore>,
    transport: Transport,
    /// The API client of the key last read, kept while the key stays the same: building one
    /// per call cost every call a client's allocations and setup.
    client: Mutex<Option<KeyedClient>>,
}

/// An API client and the key it was built with.
type KeyedClient = (Option<ApiKey>, Arc<async_openai::Client<OpenAIConfig>>);

impl fmt::Debug for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Provider")
            .field("base_url", &self.config.base_url)
            .field("model", &self.config.model)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl Provider {
    /// A provider for `config`, sharing the worker's cap for its provider key.
    pub fn new(config: &LlmConfig, key: KeySource, providers: &Providers) -> Self {
        Self {
            semaphore: providers.semaphore(&config.provider_key(), config.max_concurrent_requests),
            config: config.clone(),
            key,
            transport: providers.transport(config),
            client: Mutex::new(None),
        }
    }

    /// The API client for `key`: the kept one while the key is unchanged, else a new one.
    fn client(
        &self,
        key: Option<&ApiKey>,
    ) -> Result<Arc<async_openai::Client<OpenAIConfig>>, String> {
        let mut kept = self.client.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((k, client)) = kept.as_ref()
            && k.as_ref() == key
        {
            return Ok(Arc::clone(client));
        }
        let client = Arc::new(self.build_client(key)?);
        *kept = Some((key.cloned(), Arc::clone(&client)));
        Ok(client)
    }

    fn build_client(
        &self,
        key: Option<&ApiKey>,
    ) -> Result<async_openai::Client<OpenAIConfig>, String> {
        // Everything explicit: the defaults would read OPENAI_* environment variables and send
        // a key meant for OpenAI to whatever server base-url names.
        let mut config = OpenAIConfig::new()
            .with_api_base(self.config.base_url.trim_end_matches('/'))
            .with_api_key(key.map(ApiKey::expose).unwrap_or_default())
            .with_org_id("")
            .with_project_id("");
        for (name, value) in &self.config.headers {
            let name = http::HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("headers: {name:?} is not an HTTP header name"))?;
            config = config
                .with_header(name, value.as_str())
                .map_err(|_| "headers: a value is not a valid HTTP header value".to_owned())?;
        }
        Ok(async_openai::Client::with_config(config).with_http_service(self.transport.clone()))
    }

    /// Sends `request` and returns the model's reply; `on_delta` sees streamed text as it
    /// arrives. Retries as the module docs say, never past `deadline`.
    pub async fn complete(
        &self,
        request: &CreateChatCompletionRequest,
        on_delta: &mut (dyn FnMut(&str) + Send),
        cancel: &CancellationToken,
        deadline: tokio::time::Instant,
        shared_limits: &[RateLimit],
        estimate: u64,
    ) -> Result<Completion, CallError> {
        let key = self.key.load().map_err(CallError::Rejected)?;
        let client = self.client(key.as_ref()).map_err(CallError::Rejected)?;
        let redact = |s: String| match &key {
            Some(k) if !k.expose().is_empty() => s.replace(k.expose(), "[redacted]"),
            _ => s,
        };
        let mut tries = 0u32;
        // Why the previous try failed, for an error given while waiting to try again.
        let mut last_error: Option<String> = None;
        loop {
            tries += 1;
            for limit in shared_limits {
                // Every HTTP request takes a request unit; only the first try its tokens.
                let tokens = if tries == 1 { estimate } else { 0 };
                // Boxed, as the other steps that are not live while the reply is awaited: a
                // suspended call's state is what the longest wait holds, thousands at once.
                Box::pin(limit.acquire(tokens, cancel, deadline))
                    .await
                    .map_err(|e| match e {
                        RateLimitError::Cancelled => CallError::Cancelled,
                        other => CallError::GaveUp(other.to_string()),
                    })?;
            }
            // Biased: a free slot is taken even when the deadline is due at the same moment
            // (a retry whose backoff overslept); the try itself is then cut at the deadline.
            let permit = tokio::select! {
                biased;
                p = Arc::clone(&self.semaphore).acquire_owned() => p.map_err(|_| CallError::GaveUp("the provider's request cap is closed".into()))?,
                _ = cancel.cancelled() => return Err(CallError::Cancelled),
                _ = tokio::time::sleep_until(deadline) => return Err(CallError::GaveUp(format!(
                    "waited for a free request slot of the provider (max-concurrent-requests {}) until the attempt's deadline{}",
                    self.config.max_concurrent_requests,
                    last_error.as_deref().map(|e| format!("; the last try failed: {e}")).unwrap_or_default()
                ))),
            };
            let now = tokio::time::Instant::now();
            let limit = (now + self.config.request_timeout).min(deadline);
            let budget = humantime_serde::re::humantime::format_duration(Duration::from_millis(
                limit.duration_since(now).as_millis() as u64,
            ));
            let started = Instant::now();
            let outcome = tokio::select! {
                r = self.try_once(&client, request, on_delta) => r,
                _ = cancel.cancelled() => return Err(CallError::Cancelled),
                _ = tokio::time::sleep_until(limit) => Err(TryError::Retryable {
                    message: format!("no complete reply within {budget}"),
                    retry_after: None,
                }),
            };
            drop(permit);
            match outcome {
                Ok(mut c) => {
                    c.latency = started.elapsed();
                    if c.model.is_empty() {
                        c.model.clone_from(&request.model);
                    }
                    return Ok(c);
                }
                Err(TryError::Final(m)) => return Err(CallError::Rejected(redact(m))),
                Err(TryError::Retryable {
                    message,
                    retry_after,
                }) => {
                    let message = redact(message);
                    if tries > self.config.max_retries {
                        return Err(CallError::GaveUp(format!(
                            "{message} (gave up after {tries} tries, max-retries {})",
                            self.config.max_retries
                        )));
                    }
                    let wait = retry_after.unwrap_or_else(|| self.backoff(tries));
                    if tokio::time::Instant::now() + wait >= deadline {
                        return Err(CallError::GaveUp(format!(
                            "{message} (after {tries} tr{}; the next retry, in {}, would pass the attempt's deadline)",
                            if tries == 1 { "y" } else { "ies" },
                            humantime_serde::re::humantime::format_duration(Duration::from_millis(
                                wait.as_millis() as u64
                            ))
                        )));
                    }
                    tracing::info!(
                        model = %request.model,
                        tries,
                        wait_ms = wait.as_millis() as u64,
                        error = %message,
                        "Model call failed; retrying"
                    );
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = cancel.cancelled() => return Err(CallError::Cancelled),
                    }
                    if tokio::time::Instant::now() >= deadline {
                        // The wait overslept (a loaded machine): a try now would be cut at
                        // once, and its error would hide why the call failed.
                        return Err(CallError::GaveUp(format!(
                            "{message} (after {tries} tr{}; the attempt's deadline passed while waiting to retry)",
                            if tries == 1 { "y" } else { "ies" }
                        )));
                    }
                    last_error = Some(message);
                }
            }
        }
    }

    /// Exponential backoff with jitter (50–100 % of the doubled base, capped).
    fn backoff(&self, tries: u32) -> Duration {
        let base = self
            .config
            .retry_initial_backoff
            .saturating_mul(1u32 << (tries - 1).min(16))
            .min(self.config.retry_max_backoff);
        let r = (uuid::Uuid::new_v4().as_u128() % 51) as u32;
        base * (50 + r) / 100
    }

    async fn try_once(
        &self,
        client: &async_openai::Client<OpenAIConfig>,
        request: &CreateChatCompletionRequest,
        on_delta: &mut (dyn FnMut(&str) + Send),
    ) -> Result<Completion, TryError> {
        if !self.config.stream {
            let r = Box::pin(client.chat().create(request.clone()))
                .await
                .map_err(classify)?;
            let mut c = Completion {
                model: r.model,
                ..Completion::default()
            };
            if let Some(u) = r.usage {
                c.prompt_tokens = u.prompt_tokens.into();
                c.completion_tokens = u.completion_tokens.into();
            }
            if let Some(choice) = r.choices.into_iter().next() {
                c.content = choice.message.content.unwrap_or_default();
                for call in choice.message.tool_calls.unwrap_or_default() {
                    if let async_openai::types::chat::ChatCompletionMessageToolCalls::Function(f) =
                        call
                    {
                        c.tool_calls.push(ToolCallRequest {
                            id: f.id,
                            name: f.function.name,
                            arguments: f.function.arguments,
                        });
                    }
                }
                if !c.content.is_empty() {
                    on_delta(&c.content);
                }
            }
            return Ok(c);
        }
        let mut stream = client
            .chat()
            .create_stream(request.clone())
            .await
            .map_err(classify)?;
        let mut c = Completion::default();
        // Tool calls by index, as their pieces arrive.
        let mut calls: Vec<ToolCallRequest> = Vec::new();
        let mut finished = false;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(classify)?;
            if c.model.is_empty() {
                c.model = chunk.model.clone();
            }
            if let Some(u) = chunk.usage {
                c.prompt_tokens = u.prompt_tokens.into();
                c.completion_tokens = u.completion_tokens.into();
            }
            for choice in chunk.choices.into_iter().filter(|ch| ch.index == 0) {
                if let Some(text) = choice.delta.content.filter(|t| !t.is_empty()) {
                    on_delta(&text);
                    c.content.push_str(&text);
                }
                for piece in choice.delta.tool_calls.unwrap_or_default() {
                    let i = piece.index as usize;
                    if calls.len() <= i {
                        calls.resize_with(i + 1, || ToolCallRequest {
                            id: String::new(),
                            name: String::new(),
                            arguments: String::new(),
                        });
                    }
                    let call = &mut calls[i];
                    if let Some(id) = piece.id {
                        call.id = id;
                    }
                    if let Some(f) = piece.function {
                        if let Some(n) = f.name {
                            call.name.push_str(&n);
                        }
                        if let Some(a) = f.arguments {
                            call.arguments.push_str(&a);
                        }
                    }
                }
                if let Some(reason) = choice.finish_reason {
                    finished = true;
                    if matches!(reason, FinishReason::ContentFilter) {
                        return Err(TryError::Final(
                            "the provider stopped the reply (content filter)".into(),
                        ));
                    }
                }
            }
        }
        if !finished {
            return Err(TryError::Retryable {
                message: "the reply stream ended before the model finished".into(),
                retry_after: None,
            });
        }
        for (i, mut call) in calls.into_iter().enumerate() {
            if call.name.is_empty() {
                continue;
            }
            if call.id.is_empty() {
                call.id = format!("call_{i}");
            }
            c.tool_calls.push(call);
        }
        Ok(c)
    }
}

fn classify(e: OpenAIError) -> TryError {
    match e {
        OpenAIError::Boxed(b) => match b.downcast::<StatusError>() {
            Ok(s) => TryError::Retryable {
                retry_after: s.retry_after,
                message: s.to_string(),
            },
            Err(b) => TryError::Retryable {
                message: b.to_string(),
                retry_after: None,
            },
        },
        OpenAIError::ApiError(api) => TryError::Final(format!(
            "the provider refused the request ({}): {}",
            api.status_code, api.api_error.message
        )),
        OpenAIError::Reqwest(e) => TryError::Retryable {
            message: format!("HTTP error: {}", error_chain(&e)),
            retry_after: None,
        },
        OpenAIError::JSONDeserialize(e, _) => TryError::Retryable {
            message: format!("the provider sent malformed JSON: {e}"),
            retry_after: None,
        },
        OpenAIError::StreamError(e) => TryError::Retryable {
            message: format!("the reply stream broke: {e}"),
            retry_after: None,
        },
        OpenAIError::InvalidArgument(m) => TryError::Final(format!("invalid request: {m}")),
        other => TryError::Final(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_in_seconds_and_dates() {
        assert_eq!(parse_retry_after("2"), Some(Duration::from_secs(2)));
        assert_eq!(parse_retry_after("0.25"), Some(Duration::from_millis(250)));
        assert_eq!(parse_retry_after("-1"), None);
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT"),
            Some(Duration::ZERO)
        );
        assert_eq!(
            httpdate("Sun, 06 Nov 1994 08:49:37 GMT"),
            Some(std::time::UNIX_EPOCH + Duration::from_secs(784_111_777))
        );
        assert_eq!(parse_retry_after("soon"), None);
    }

    #[test]
    fn keys_are_redacted_and_missing_keys_named() {
        let k = ApiKey("sk-very-secret".into());
        assert_eq!(format!("{k:?}"), "ApiKey([redacted])");
        let e = KeySource::Env("FLOTILLA_TEST_SURELY_UNSET_KEY".into())
            .load()
            .expect_err("unset");
        assert!(e.contains("FLOTILLA_TEST_SURELY_UNSET_KEY"), "{e}");
    }

    #[test]
    fn smaller_caps_lower_a_shared_semaphore() {
        let p = Providers::default();
        let a = p.semaphore("x", 4);
        let b = p.semaphore("x", 2);
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(a.available_permits(), 2);
        assert_eq!(p.semaphore("y", 3).available_permits(), 3);
    }
}
