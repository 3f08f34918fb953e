//! A Rust client for Flotilla: submit plans, follow a run's events, wait for its outcome,
//! read run records, and reach a run's workspace, mailboxes and session state through the
//! API. Everything here uses only the public wire protocol (`docs/protocol.md`), plus direct
//! reads of the run store.
//!
//! ```no_run
//! # async fn demo(bus: flotilla_bus::Bus, plan: flotilla_model::Plan) -> Result<(), flotilla_client::ClientError> {
//! use flotilla_client::Client;
//! use flotilla_model::submit::SubmitRequest;
//! let client = Client::new(bus);
//! let run = client.submit(SubmitRequest::new(plan)).await?;
//! let outcome = client.wait(run, std::time::Duration::from_secs(60)).await?;
//! println!("{:?}", outcome.status);
//! # Ok(()) }
//! ```

use std::time::Duration;

use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use flotilla_bus::{Bus, wire};
use flotilla_model::api::{
    ApiError, ApiRequest, CancelRunReply, CancelRunRequest, MboxReadRequest, MboxSendReply,
    MboxSendRequest, StateGetRequest, StateSetReply, StateSetRequest, ValidatePlanReply,
    ValidatePlanRequest, WsAppendReply, WsAppendRequest, WsReadRequest,
};
use flotilla_model::event::EventEnvelope;
use flotilla_model::ids::{RunId, SessionId};
use flotilla_model::mailbox::MailboxPage;
use flotilla_model::plan::Plan;
use flotilla_model::run::{RunOutcome, RunView};
use flotilla_model::state::StateValue;
use flotilla_model::subjects::{Bucket, StreamKind};
use flotilla_model::submit::{SubmitReply, SubmitRequest};
use flotilla_model::time::Timestamp;
use flotilla_model::tree::{RunTree, SessionView};
use flotilla_model::worker::WorkerInfo;
use flotilla_model::workspace::WorkspacePage;
use flotilla_runs::RunReader;

/// How [`Client::watch`] projects a run tree's events (the read model's options).
pub use flotilla_runs::watch::WatchOptions;

pub mod mailer;
pub mod progress;
use futures::{Stream, StreamExt};
pub use mailer::Mailer;
use tracing::Instrument;

flotilla_bus::error_kinds!(
    /// Why a client call failed.
    ClientErrorKind {
        /// NATS or JetStream failed.
        Nats => "NATS request failed", Retryable;
        /// A reply or event could not be decoded.
        Decode => "unreadable message", Terminal;
        /// The run did not end in time.
        TimedOut => "timed out waiting for the run", Retryable;
        /// No coordinator answered the request.
        NoCoordinator => "no coordinator answered", Retryable;
        /// No supervisor answered a team request.
        NoSupervisor => "no supervisor answered", Retryable;
        /// The message is larger than the deployment accepts.
        TooLarge => "too large for this deployment", Terminal;
        /// Flotilla's streams do not exist on this NATS yet.
        NotProvisioned => "streams not provisioned", Terminal;
        /// The service answered with an error.
        Api => "the API refused the request", Terminal;
        /// The run does not exist (`not_found`, as the API says).
        NotFound => "not_found", Terminal;
        /// The NATS user may not send the request (the server reported a permissions
        /// violation): the message names the subject and the user.
        PermissionDenied => "permission_denied", Terminal;
    }
);

/// A client call failed.
pub type ClientError = flotilla_bus::error::Error<ClientErrorKind>;

/// A NATS failure while `detail`; missing streams or buckets become
/// [`ClientErrorKind::NotProvisioned`], said once with what to do.
fn nats(
    detail: impl Into<String>,
    e: impl std::error::Error + Send + Sync + 'static,
) -> ClientError {
    match flotilla_bus::error::diagnose(&e) {
        Some(d @ flotilla_bus::error::Diagnosis::NotProvisioned) => {
            ClientError::new(ClientErrorKind::NotProvisioned, d.hint())
        }
        _ => ClientError::with_source(ClientErrorKind::Nats, detail, e),
    }
}

/// Opens the run store (the `flotilla-runs` bucket and the run log); a deployment that was
/// never provisioned is [`ClientErrorKind::NotProvisioned`].
pub async fn open_store(bus: &Bus) -> Result<RunReader, ClientError> {
    RunReader::open(bus)
        .await
        .map_err(|e| nats("opening the run store", e))
}

/// A publish error, with the deployment problems said plainly.
fn publish_error(e: flotilla_bus::PublishError) -> ClientError {
    match e.kind() {
        flotilla_bus::PublishErrorKind::NoStream => ClientError::new(
            ClientErrorKind::NotProvisioned,
            flotilla_bus::error::Diagnosis::NotProvisioned.hint(),
        ),
        flotilla_bus::PublishErrorKind::TooLarge => ClientError::with_source(
            ClientErrorKind::TooLarge,
            "the submission is larger than this deployment accepts",
            e,
        ),
        flotilla_bus::PublishErrorKind::PermissionDenied => {
            ClientError::new(ClientErrorKind::PermissionDenied, e.detail())
        }
        _ => nats("publishing the submission", e),
    }
}

/// How long the collaboration calls wait for the coordinator (a mailbox read adds its own
/// `wait_ms`).
pub(crate) const API_TIMEOUT: Duration = Duration::from_secs(10);

/// The API groups `flotilla supervisor` serves (every other endpoint is a coordinator's): a
/// request nothing answers names the service to start.
const SUPERVISOR_ENDPOINTS: [&str; 3] = ["team.", "memory.", "trust."];

/// A Flotilla client.
#[derive(Debug, Clone)]
pub struct Client {
    bus: Bus,
}

impl Client {
    /// A client on a connected bus.
    pub fn new(bus: Bus) -> Self {
        Self { bus }
    }

    /// The bus.
    pub fn bus(&self) -> &Bus {
        &self.bus
    }

    /// Submits durably and returns the run id (minted when the request has none).
    ///
    /// The submission goes to `<prefix>.submit.<run>`, where it is the first message of the
    /// run's history (so the run needs no second copy of its plan): JetStream stores it only if
    /// the run has no message yet, so submitting a run id again changes nothing and returns
    /// the same id. A submission with an `idempotency_key` goes to the intake stream
    /// (`<prefix>.submit`), where a coordinator maps the key to its run. So does a bare
    /// `query`: the coordinator fixes its planner task when it accepts the run, so the run's
    /// first message must be the coordinator's (`Nats-Msg-Id: submit.<run>` still makes a
    /// repeated publish a no-op).
    ///
    /// With OpenTelemetry export on (a `tracing-opentelemetry` layer), the submission is a
    /// `submit` span, child of the current span, and carries its `traceparent`: the run's
    /// spans in the coordinator and workers join that trace.
    pub async fn submit(&self, mut request: SubmitRequest) -> Result<RunId, ClientError> {
        let run = *request.run_id.get_or_insert_with(RunId::new);
        let span = flotilla_telemetry::spans::submit(Some(run));
        let names = self.bus.names();
        let bare_query = request.plan.is_none() && request.query.is_some();
        let (subject, msg_id, first) = match &request.idempotency_key {
            Some(key) => (names.submit(), key.clone(), false),
            None if bare_query => (names.submit(), format!("submit.{run}"), false),
            None => (names.submit_run(run), format!("submit.{run}"), true),
        };
        let mut out = wire::encode(&request, flotilla_model::codec::Codec::Json, Some(&msg_id))
            .map_err(|e| ClientError::with_source(ClientErrorKind::Decode, "encoding", e))?;
        if first {
            wire::expect_first(&mut out.headers);
        }
        if let Some(trace) = flotilla_telemetry::trace_context::span_context(&span) {
            insert_trace(&mut out.headers, &trace);
        }
        let max = self.bus.max_payload();
        if out.payload.len() > max {
            return Err(ClientError::new(
                ClientErrorKind::TooLarge,
                format!(
                    "plan_too_large: the submission is {} bytes; this deployment's NATS max payload is {max} bytes. Split the plan into several runs, or pass large inputs by reference",
                    out.payload.len()
                ),
            ));
        }
        match self
            .bus
            .publish_encoded(subject, out)
            .instrument(span)
            .await
        {
            Ok(_) => Ok(run),
            // The run exists already: submitting it again is a no-op.
            Err(e) if e.kind() == flotilla_bus::PublishErrorKind::NotFirst => Ok(run),
            Err(e) => Err(publish_error(e)),
        }
    }

    /// Asks the coordinators to cancel a run.
    pub async fn cancel(
        &self,
        run: RunId,
        reason: Option<String>,
    ) -> Result<CancelRunReply, ClientError> {
        self.cancel_with(run, reason, false).await
    }

    /// Asks the coordinators to cancel a run and undo its succeeded tasks that declare a
    /// compensation (the reply names the rollback run).
    pub async fn cancel_and_roll_back(
        &self,
        run: RunId,
        reason: Option<String>,
    ) -> Result<CancelRunReply, ClientError> {
        self.cancel_with(run, reason, true).await
    }

    async fn cancel_with(
        &self,
        run: RunId,
        reason: Option<String>,
        rollback: bool,
    ) -> Result<CancelRunReply, ClientError> {
        let request = CancelRunRequest {
            protocol: flotilla_model::PROTOCOL_VERSION,
            run_id: run,
            reason,
            by: None,
            rollback,
        };
        self.request(&request, Duration::from_secs(10)).await
    }

    /// Validates a plan against the deployment (its pools, agents and live workers).
    pub async fn validate(&self, plan: &Plan) -> Result<ValidatePlanReply, ClientError> {
        let request = ValidatePlanRequest {
            protocol: flotilla_model::PROTOCOL_VERSION,
            plan: plan.clone(),
        };
        self.request(&request, Duration::from_secs(5)).await
    }

    /// Sends an API request and decodes its reply; a refusal is a [`ClientErrorKind::Api`]
    /// error with the `ApiError`'s code, status and message (use [`call`](Self::call) to
    /// match on the code).
    pub async fn request<R: ApiRequest>(
        &self,
        request: &R,
        timeout: Duration,
    ) -> Result<R::Reply, ClientError> {
        match self.call(request, timeout).await? {
            Ok(reply) => Ok(reply),
            Err(err) => Err(ClientError::new(
                ClientErrorKind::Api,
                format!("{} ({}): {}", err.code, err.status, err.message),
            )),
        }
    }

    /// Sends an API request: the reply, or the service's refusal as an [`ApiError`] value
    /// (`Ok(Err(_))`) to match on its `code` — e.g. a `conflict` of
    /// [`state_set`](Self::state_set) with its `current_revision`.
    pub async fn call<R: ApiRequest>(
        &self,
        request: &R,
        timeout: Duration,
    ) -> Result<Result<R::Reply, ApiError>, ClientError> {
        let body = serde_json::to_vec(request)
            .map_err(|e| ClientError::with_source(ClientErrorKind::Decode, "encoding", e))?;
        let subject = self.bus.names().api(R::ENDPOINT);
        // The caller's trace (a `submit` span, an application's span) goes with the request.
        // No timeout of the connection's (its default is 10 s): a request that waits for a
        // run's end (`run.fork` with `wait`) takes as long as the caller allows, and the
        // caller's timeout below is the one that answers `TimedOut`.
        let mut sent = async_nats::Request::new()
            .payload(body.into())
            .timeout(None);
        if let Some(trace) = flotilla_telemetry::trace_context::current() {
            let mut headers = async_nats::HeaderMap::new();
            insert_trace(&mut headers, &trace);
            sent = sent.headers(headers);
        }
        let sent = self.bus.client().send_request(subject.clone(), sent);
        // A refused request gets no answer: the server's refusal, reported on the side, is
        // the answer, at once.
        let reply = self
            .bus
            .refusable(|s| s == subject, tokio::time::timeout(timeout, sent))
            .await
            .map_err(|refusal| {
                ClientError::new(
                    ClientErrorKind::PermissionDenied,
                    format!("{}: {refusal}", R::ENDPOINT),
                )
            })?
            .map_err(|_| {
                ClientError::new(
                    ClientErrorKind::TimedOut,
                    format!("no answer from {} within {timeout:?}", R::ENDPOINT),
                )
            })?
            .map_err(|e| {
                if e.kind() == async_nats::RequestErrorKind::NoResponders {
                    // The cause ("no responders") says nothing more than the kind.
                    let (kind, service) = if SUPERVISOR_ENDPOINTS.iter().any(|p| R::ENDPOINT.starts_with(p)) {
                        (ClientErrorKind::NoSupervisor, "flotilla supervisor")
                    } else {
                        (ClientErrorKind::NoCoordinator, "flotilla coordinator")
                    };
                    ClientError::new(
                        kind,
                        format!(
                            "nothing serves {}: start `{service}` or `flotilla up`",
                            self.bus.names().api(R::ENDPOINT)
                        ),
                    )
                } else if e.kind() == async_nats::RequestErrorKind::MaxPayloadExceeded {
                    ClientError::with_source(
                        ClientErrorKind::TooLarge,
                        format!(
                            "plan_too_large: the request is larger than this deployment's NATS max payload of {} bytes; split the plan, or pass large inputs by reference",
                            self.bus.max_payload()
                        ),
                        e,
                    )
                } else {
                    nats(format!("{} request", R::ENDPOINT), e)
                }
            })?;
        if reply
            .headers
            .as_ref()
            .is_some_and(|h| h.get("Nats-Service-Error-Code").is_some())
        {
            let err: ApiError = wire::decode(reply.headers.as_ref(), &reply.payload)
                .map_err(|e| ClientError::with_source(ClientErrorKind::Decode, "API error", e))?;
            return Ok(Err(err));
        }
        wire::decode(reply.headers.as_ref(), &reply.payload)
            .map(Ok)
            .map_err(|e| {
                ClientError::with_source(
                    ClientErrorKind::Decode,
                    format!("{} reply", R::ENDPOINT),
                    e,
                )
            })
    }

    /// Appends an entry to a workspace topic of a run's tree (`ws.append`).
    pub async fn ws_append(&self, request: &WsAppendRequest) -> Result<WsAppendReply, ClientError> {
        self.request(request, API_TIMEOUT).await
    }

    /// Reads a run tree's workspace after `since_seq` (`ws.read`); continue from
    /// `next_since_seq` while `more`.
    pub async fn ws_read(&self, request: &WsReadRequest) -> Result<WorkspacePage, ClientError> {
        self.request(request, API_TIMEOUT).await
    }

    /// Sends a mailbox message within a run's tree (`mbox.send`).
    pub async fn mbox_send(&self, request: &MboxSendRequest) -> Result<MboxSendReply, ClientError> {
        self.request(request, API_TIMEOUT).await
    }

    /// Reads a mailbox (`mbox.read`), waiting up to the request's `wait_ms` for a message.
    pub async fn mbox_read(&self, request: &MboxReadRequest) -> Result<MailboxPage, ClientError> {
        let wait = Duration::from_millis(request.wait_ms.unwrap_or(0));
        self.request(request, API_TIMEOUT + wait).await
    }

    /// Reads a session-state value (`state.get`); an unset key is an `Api` error
    /// (`not_found`).
    pub async fn state_get(&self, request: &StateGetRequest) -> Result<StateValue, ClientError> {
        self.request(request, API_TIMEOUT).await
    }

    /// Writes a session-state value (`state.set`), as a compare-and-set when the request has
    /// an `expected_revision` (a lost race is an `Api` error `conflict`; [`call`](Self::call)
    /// returns its `current_revision`).
    pub async fn state_set(&self, request: &StateSetRequest) -> Result<StateSetReply, ClientError> {
        self.request(request, API_TIMEOUT).await
    }

    /// Submits through the request/reply endpoint and returns the coordinator's answer
    /// (accepted with the run id, duplicate, or rejected with every problem).
    pub async fn submit_request(
        &self,
        request: &SubmitRequest,
        timeout: Duration,
    ) -> Result<SubmitReply, ClientError> {
        let span = flotilla_telemetry::spans::submit(request.run_id);
        self.request(request, timeout).instrument(span).await
    }

    /// Every event of a run, from its first, as they arrive.
    pub async fn events(
        &self,
        run: RunId,
    ) -> Result<impl Stream<Item = Result<EventEnvelope, ClientError>> + use<>, ClientError> {
        let consumer = self.event_consumer(run).await?;
        let messages = consumer
            .messages()
            .await
            .map_err(|e| nats("reading events", e))?;
        // Each message carries the events of one step: flattened into one stream of events.
        Ok(messages
            .map(|m| decode_event_message(&m.map_err(|e| nats("reading events", e))?))
            .flat_map(|r| {
                futures::stream::iter(match r {
                    Ok(events) => events.into_iter().map(Ok).collect::<Vec<_>>(),
                    Err(e) => vec![Err(e)],
                })
            }))
    }

    /// An ordered consumer of `run`'s events, from its first.
    pub(crate) async fn event_consumer(
        &self,
        run: RunId,
    ) -> Result<async_nats::jetstream::consumer::Consumer<pull::OrderedConfig>, ClientError> {
        let name = self.bus.names().stream(StreamKind::Events);
        let stream = self
            .bus
            .js()
            .get_stream(&name)
            .await
            .map_err(|e| nats(format!("opening {name}"), e))?;
        stream
            .create_consumer(pull::OrderedConfig {
                filter_subject: self.bus.names().event(run),
                deliver_policy: DeliverPolicy::All,
                ..Default::default()
            })
            .await
            .map_err(|e| nats("creating an ordered consumer", e))
    }

    /// Follows `run`'s tree as one audience sees it ([`flotilla_model::watch`]): the events
    /// its `profile` shows, children hidden, linked or flattened into the stream (live, in
    /// the order the event stream stored them, each run's `run_started` first, each child
    /// after its link, attributed to its run and agent). Ends once the run and every child
    /// shown have ended. Resume after an event with `opts.since` / `opts.since_index` = its
    /// `seq` / `index`. The same engine serves `<prefix>.api.watch`, so both give the same
    /// events in the same order.
    ///
    /// A run that does not exist — no record and no submission on its subject — is a
    /// [`ClientErrorKind::NotFound`] error, as `api.watch` answers `404 not_found`, instead of
    /// a watch that waits forever.
    pub async fn watch(
        &self,
        run: RunId,
        opts: WatchOptions,
    ) -> Result<
        impl Stream<Item = Result<flotilla_model::watch::ProjectedEvent, ClientError>> + use<>,
        ClientError,
    > {
        if !self.exists(run).await? {
            return Err(ClientError::new(
                ClientErrorKind::NotFound,
                format!("run {run} does not exist"),
            ));
        }
        let stream = flotilla_runs::watch::project(self.bus.clone(), run, opts)
            .await
            .map_err(|e| nats("following the run", e))?;
        Ok(stream.map(|r| r.map_err(|e| nats("following the run", e))))
    }

    /// Waits for a run to end and returns its outcome (event-driven, from the run's stored
    /// events and then its live ones, without a consumer on the server).
    pub async fn wait(&self, run: RunId, timeout: Duration) -> Result<RunOutcome, ClientError> {
        let until = tokio::time::Instant::now() + timeout;
        let found = self
            .bus
            .find_in_subject(
                StreamKind::Events,
                &self.bus.names().event(run),
                until,
                |headers, payload| {
                    flotilla_model::event::run_end_in(wire::codec_of(headers), payload)
                        .ok()
                        .flatten()
                },
            )
            .await
            .map_err(|e| nats(format!("following run {run}"), e))?;
        found.ok_or_else(|| {
            ClientError::new(
                ClientErrorKind::TimedOut,
                format!("run {run} did not end within {timeout:?}"),
            )
        })
    }

    /// Whether `run` exists: it has a record, or its submission is stored (accepted on the
    /// fast path, its start not recorded yet) — the test `api.watch` and `api.run.cancel`
    /// make before answering `not_found`.
    pub async fn exists(&self, run: RunId) -> Result<bool, ClientError> {
        let store = open_store(&self.bus).await?;
        if store
            .load(run)
            .await
            .map_err(|e| nats(format!("reading run {run}"), e))?
            .is_some()
        {
            return Ok(true);
        }
        Ok(store
            .first_message(run)
            .await
            .map_err(|e| nats(format!("reading run {run}"), e))?
            .is_some())
    }

    /// A run's record and tasks, read from the run store.
    pub async fn run(&self, run: RunId) -> Result<Option<RunView>, ClientError> {
        let store = open_store(&self.bus).await?;
        store
            .view(run, 0, usize::MAX)
            .await
            .map_err(|e| nats(format!("reading run {run}"), e))
    }

    /// The tree under `run` — the run and the child runs its agents started, recursively,
    /// with status, duration, tokens and cost per run — read from the run store and the event
    /// stream (the engine of `<prefix>.api.run.tree`). At most `max_runs` runs (≤ 1000).
    pub async fn tree(&self, run: RunId, max_runs: usize) -> Result<Option<RunTree>, ClientError> {
        let store = open_store(&self.bus).await?;
        flotilla_runs::tree::run_tree(&store, run, max_runs)
            .await
            .map_err(|e| nats(format!("reading the tree of run {run}"), e))
    }

    /// Run `a` compared with run `b`, task by task (the engine of `<prefix>.api.run.diff`);
    /// `Ok(Err(run))` names the first of the two that does not exist.
    pub async fn diff(
        &self,
        a: RunId,
        b: RunId,
    ) -> Result<Result<flotilla_model::diff::RunDiff, RunId>, ClientError> {
        let store = open_store(&self.bus).await?;
        flotilla_runs::diff::run_diff(&store, a, b)
            .await
            .map_err(|e| nats(format!("comparing run {a} with run {b}"), e))
    }

    /// Run `run` replayed from its log through the run machine alone — every task served
    /// from its recorded result: no model call, no tool run — and checked against what it
    /// recorded; `None` when the run does not exist.
    pub async fn replay(
        &self,
        run: RunId,
    ) -> Result<Option<flotilla_runs::replay::ReplayReport>, ClientError> {
        let store = open_store(&self.bus).await?;
        flotilla_runs::replay::replay_run(&store, run)
            .await
            .map_err(|e| nats(format!("replaying run {run}"), e))
    }

    /// The runs of a session, oldest first (the engine of `<prefix>.api.session.get`).
    pub async fn session(&self, session: SessionId) -> Result<SessionView, ClientError> {
        let store = open_store(&self.bus).await?;
        flotilla_runs::tree::session_view(&store, session)
            .await
            .map_err(|e| nats(format!("reading session {session}"), e))
    }

    /// Live workers with the time of their last registry refresh (server time), read from the
    /// workers registry (a KV bucket whose entries expire when a worker stops refreshing
    /// them), ordered by pool and worker id.
    pub async fn live_workers(&self) -> Result<Vec<(WorkerInfo, Timestamp)>, ClientError> {
        let kv = self
            .bus
            .kv(Bucket::Workers)
            .await
            .map_err(|e| nats("opening the workers registry", e))?;
        let mut keys = kv
            .keys()
            .await
            .map_err(|e| nats("listing the workers registry", e))?;
        let mut infos = Vec::new();
        while let Some(k) = keys.next().await {
            let k = k.map_err(|e| nats("listing the workers registry", e))?;
            if let Some(entry) = kv
                .entry(&k)
                .await
                .map_err(|e| nats(format!("reading worker {k} in the registry"), e))?
                && entry.operation == async_nats::jetstream::kv::Operation::Put
                && let Ok(info) = serde_json::from_slice::<WorkerInfo>(&entry.value)
            {
                infos.push((info, Timestamp(entry.created)));
            }
        }
        infos.sort_by(|(a, _), (b, _)| (&a.pool, &a.id).cmp(&(&b.pool, &b.id)));
        Ok(infos)
    }
}

/// Puts a trace context on an outgoing message (`traceparent`, `tracestate`).
fn insert_trace(headers: &mut async_nats::HeaderMap, trace: &flotilla_model::task::TraceContext) {
    headers.insert(wire::TRACEPARENT, trace.traceparent.as_str());
    if let Some(state) = &trace.tracestate {
        headers.insert("tracestate", state.as_str());
    }
}

/// The events one event message carries (one step's).
pub(crate) fn decode_event_message(
    m: &async_nats::jetstream::Message,
) -> Result<Vec<EventEnvelope>, ClientError> {
    flotilla_model::event::decode_events(wire::codec_of(m.headers.as_ref()), &m.payload)
        .map_err(|e| ClientError::with_source(ClientErrorKind::Decode, "event", e))
}
