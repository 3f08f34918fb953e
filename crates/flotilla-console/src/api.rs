//! The console's HTTP API: JSON reads, server-sent event streams and the operator's
//! actions. Every read and action is one of the Flotilla API requests the CLI sends
//! (`approval.*`, `run.pause|resume|takeover|cancel|complete|fork`, `team.list`, `ws.read`), or a
//! read of the run store through the client library; run events come from the same
//! projection as `flotilla watch` ([`Client::watch`]).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use flotilla_client::progress::{self, Progress};
use flotilla_client::{Client, ClientError, ClientErrorKind, WatchOptions};
use flotilla_model::RunId;
use flotilla_model::api::{ApiRequest, CancelRunRequest};
use flotilla_model::approval::{
    ApprovalAnswerRequest, ApprovalGetRequest, ApprovalListRequest, Decision, GrantListRequest,
    GrantRevokeRequest,
};
use flotilla_model::control::{
    CompleteTaskRequest, EditPlanRequest, PauseRunRequest, ResumeRunRequest, TakeoverRunRequest,
};
use flotilla_model::event::EventEnvelope;
use flotilla_model::fork::RunForkRequest;
use flotilla_model::ids::{SessionId, TaskId};
use flotilla_model::plan::Plan;
use flotilla_model::run::RunView;
use flotilla_model::subjects::StreamKind;
use flotilla_model::team::TeamListRequest;
use flotilla_model::time::Timestamp;
use flotilla_model::trust::TrustListRequest;
use flotilla_model::watch::{ChildPolicy, Profile};
use futures::{Stream, StreamExt};
use http::{HeaderMap, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::broadcast;
use tracing::info;

use crate::auth::{self, Identity, Refusal};
use crate::index::{Change, Filter, RunIndex};
use crate::monitor;
use crate::options::ConsoleOptions;

/// How long an API request to a coordinator or supervisor may take.
const API_TIMEOUT: Duration = Duration::from_secs(10);
/// Audit entries kept for `/api/audit` (the log has all of them).
const AUDIT_KEPT: usize = 500;
/// The most runs a tree answer lists (the API's maximum).
const TREE_RUNS: usize = 1000;

/// What every handler shares.
#[derive(Debug, Clone)]
pub(crate) struct AppState {
    pub(crate) client: Client,
    /// The run store, opened once (the reads `Client::run` and `Client::tree` make, without
    /// opening the store on every request).
    pub(crate) store: Arc<flotilla_runs::RunReader>,
    pub(crate) index: RunIndex,
    pub(crate) opts: Arc<ConsoleOptions>,
    /// The tenant whose installation this is (a console of several tenants serves one
    /// state per tenant); `None`: the console's one installation.
    pub(crate) tenant: Option<flotilla_model::tenant::TenantName>,
    pub(crate) audit: Arc<Mutex<VecDeque<AuditEntry>>>,
    /// A ping per notice on `<prefix>.notify.>` (approvals, questions, client tools).
    pub(crate) notices: broadcast::Sender<()>,
    /// Fires when the console stops: every open event stream ends (a browser reconnects to
    /// another replica, resuming where it was), so the graceful stop does not wait on pages
    /// that never close their streams.
    pub(crate) closing: tokio_util::sync::CancellationToken,
}

/// One operator action, as audited.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct AuditEntry {
    pub(crate) at: Timestamp,
    pub(crate) by: String,
    pub(crate) action: String,
    pub(crate) run_id: RunId,
    pub(crate) target: Option<String>,
    pub(crate) outcome: String,
}

/// An error answer: `{"error": code, "message": …}`.
pub(crate) fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({"error": code, "message": message.into()})),
    )
        .into_response()
}

pub(crate) fn refused(r: Refusal) -> Response {
    error(r.status(), r.code(), r.message())
}

fn client_error(e: &ClientError) -> Response {
    let (status, code) = match e.kind() {
        ClientErrorKind::NotFound => (StatusCode::NOT_FOUND, "not_found"),
        ClientErrorKind::NoCoordinator => (StatusCode::SERVICE_UNAVAILABLE, "no_coordinator"),
        ClientErrorKind::NoSupervisor => (StatusCode::SERVICE_UNAVAILABLE, "no_supervisor"),
        ClientErrorKind::TimedOut => (StatusCode::GATEWAY_TIMEOUT, "timed_out"),
        _ => (StatusCode::BAD_GATEWAY, "upstream"),
    };
    error(status, code, e.to_string())
}

fn store_error(e: &flotilla_runs::StoreError) -> Response {
    error(StatusCode::BAD_GATEWAY, "upstream", e.to_string())
}

impl AppState {
    /// What `view`'s run waits for and which of its tasks run where — the
    /// [`Client::progress`] of `flotilla runs show` — with the run's events it read (for the
    /// timeline). Without a coordinator to list approvals, the waits are the run's holds.
    async fn progress(&self, view: &RunView) -> (Progress, Vec<EventEnvelope>) {
        let run = view.record.handle.run_id;
        let events = self.client.events_so_far(run).await.unwrap_or_default();
        if view.record.status.is_terminal() {
            return (Progress::default(), events);
        }
        let pending = self
            .client
            .pending_approvals(Some(run))
            .await
            .unwrap_or_default();
        let progress = Progress {
            waiting: progress::waits(&view.record, &pending),
            running: progress::activity(&view.tasks, &events),
        };
        (progress, events)
    }

    fn who(&self, headers: &HeaderMap) -> Result<Identity, Refusal> {
        auth::identify(&self.opts, headers)
    }

    /// An operator, on a same-site request.
    fn operator(&self, headers: &HeaderMap) -> Result<Identity, Refusal> {
        auth::same_site(headers)?;
        let who = self.who(headers)?;
        if !who.operator {
            return Err(Refusal::NotOperator);
        }
        Ok(who)
    }

    /// An API request's answer as JSON: the reply, or the service's refusal with its status.
    async fn call<R: ApiRequest>(&self, request: &R) -> Response
    where
        R::Reply: Serialize,
    {
        match self.client.call(request, API_TIMEOUT).await {
            Ok(Ok(reply)) => Json(reply).into_response(),
            Ok(Err(refusal)) => (
                StatusCode::from_u16(refusal.status).unwrap_or(StatusCode::BAD_REQUEST),
                Json(refusal),
            )
                .into_response(),
            Err(e) => client_error(&e),
        }
    }

    /// Records an action: a log line (`flotilla_console::audit`) and the recent list.
    fn audit(
        &self,
        who: &Identity,
        action: &str,
        run: RunId,
        target: Option<&str>,
        status: StatusCode,
    ) {
        let outcome = if status.is_success() {
            "done".to_owned()
        } else {
            format!("refused ({})", status.as_u16())
        };
        match &self.tenant {
            None => info!(
                target: "flotilla_console::audit",
                by = %who.name, action, run = %run, target = target.unwrap_or("-"), %outcome,
                "Console action"
            ),
            Some(tenant) => info!(
                target: "flotilla_console::audit",
                by = %who.name, %tenant, action, run = %run, target = target.unwrap_or("-"), %outcome,
                "Console action"
            ),
        }
        if let Ok(mut audit) = self.audit.lock() {
            if audit.len() >= AUDIT_KEPT {
                audit.pop_front();
            }
            audit.push_back(AuditEntry {
                at: Timestamp::now(),
                by: who.name.clone(),
                action: action.to_owned(),
                run_id: run,
                target: target.map(str::to_owned),
                outcome,
            });
        }
    }
}

macro_rules! who {
    ($e:expr) => {
        match $e {
            Ok(w) => w,
            Err(r) => return refused(r),
        }
    };
}

pub(crate) async fn me(State(s): State<AppState>, headers: HeaderMap) -> Response {
    Json(who!(s.who(&headers))).into_response()
}

/// `/api/runs` query: the filter and the page.
#[derive(Debug, Deserialize)]
pub(crate) struct ListQuery {
    #[serde(default)]
    status: Option<String>,
    #[serde(default)]
    label: Option<String>,
    #[serde(default)]
    session: Option<String>,
    #[serde(default)]
    q: Option<String>,
    #[serde(default)]
    children: Option<String>,
    #[serde(default)]
    offset: Option<usize>,
    #[serde(default)]
    limit: Option<usize>,
}

pub(crate) async fn runs(
    State(s): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
) -> Response {
    who!(s.who(&headers));
    let session = match q.session.as_deref().filter(|s| !s.is_empty()) {
        None => None,
        Some(v) => match v.parse::<SessionId>() {
            Ok(s) => Some(s),
            Err(_) => return error(StatusCode::BAD_REQUEST, "invalid_session", v.to_owned()),
        },
    };
    let filter = Filter {
        status: q.status,
        label: q.label,
        session,
        q: q.q,
        children: matches!(q.children.as_deref(), Some("1" | "true")),
    };
    Json(
        s.index
            .page(&filter, q.offset.unwrap_or(0), q.limit.unwrap_or(200)),
    )
    .into_response()
}

/// A broadcast receiver as a stream (a lagging page is told to reload).
fn changes<T: Clone + Send + 'static>(
    rx: broadcast::Receiver<T>,
) -> impl Stream<Item = Result<T, u64>> + Send {
    futures::stream::unfold(rx, |mut rx| async move {
        match rx.recv().await {
            Ok(v) => Some((Ok(v), rx)),
            Err(broadcast::error::RecvError::Lagged(n)) => Some((Err(n), rx)),
            Err(broadcast::error::RecvError::Closed) => None,
        }
    })
}

pub(crate) async fn runs_stream(State(s): State<AppState>, headers: HeaderMap) -> Response {
    who!(s.who(&headers));
    let stream = changes::<Change>(s.index.subscribe()).map(|c| {
        Ok::<_, Infallible>(match c {
            Ok(change) => SseEvent::default()
                .event("run")
                .json_data(&change)
                .unwrap_or_else(|_| SseEvent::default().comment("unencodable")),
            Err(_) => SseEvent::default().event("reload").data("lagged"),
        })
    });
    Sse::new(stream.take_until(s.closing.clone().cancelled_owned()))
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// A run with all its tasks (the engine of `Client::run` and `flotilla runs show`), or the
/// answer for a run that does not exist or cannot be read.
async fn run_view(s: &AppState, run: RunId) -> Result<flotilla_model::run::RunView, Response> {
    match s.store.view(run, 0, usize::MAX).await {
        Ok(Some(v)) => Ok(v),
        Ok(None) => Err(error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("run {run} does not exist"),
        )),
        Err(e) => Err(store_error(&e)),
    }
}

pub(crate) async fn run(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(run): Path<RunId>,
) -> Response {
    who!(s.who(&headers));
    // The engine of `Client::run` and `flotilla runs show`.
    let view = match run_view(&s, run).await {
        Ok(v) => v,
        Err(answer) => return answer,
    };
    // The plan (task dependencies) for the DAG; a run still being planned has none yet.
    let plan = s.store.plan(run).await.ok().flatten();
    let (progress, events) = s.progress(&view).await;
    let mut timeline = monitor::timeline(&view, &events);
    monitor::settle(&mut timeline, &view);
    // What a person reads (the labels `flotilla runs show` prints): `waiting` for a run some
    // person must act on, `running` for a task a worker started.
    let label = progress::run_label(view.record.status, &progress.waiting);
    // A fork's original, by its plan name as the runs list knows it (the "fork of" line).
    let fork_of_name = view
        .record
        .fork_of
        .as_ref()
        .and_then(|f| s.index.names(std::iter::once(f.run_id)).remove(&f.run_id));
    let task_labels: serde_json::Map<String, serde_json::Value> = view
        .tasks
        .iter()
        .map(|t| {
            (
                t.task_id.as_str().to_owned(),
                progress::task_label(t, &progress).into(),
            )
        })
        .collect();
    Json(json!({
        "view": view,
        "plan": plan,
        "label": label,
        "progress": progress,
        "task_labels": task_labels,
        "timeline": timeline,
        "fork_of_name": fork_of_name,
    }))
    .into_response()
}

/// Most of a task's events one answer of `/api/runs/{run}/tasks/{task}` carries (its last).
const TASK_EVENTS: usize = 300;

/// One task as its panel shows it: the task's state, what the plan asked (input), its
/// result, attempts, worker and timings, what it waits for, and its events.
pub(crate) async fn task(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path((run, task)): Path<(RunId, String)>,
) -> Response {
    who!(s.who(&headers));
    let view = match run_view(&s, run).await {
        Ok(v) => v,
        Err(answer) => return answer,
    };
    let Some(at) = view.tasks.iter().position(|t| t.task_id.as_str() == task) else {
        return error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("run {run} has no task {task:?}"),
        );
    };
    let plan = match &view.plan {
        Some(p) => Some(p.clone()),
        None => s.store.plan(run).await.ok().flatten(),
    };
    let subtask = plan.and_then(|p| p.subtasks.into_iter().find(|t| t.id.as_str() == task));
    // The result the run kept (a worker's, or a person's), by its run-log sequence.
    let result = match s.store.state(run).await {
        Ok(Some(state)) => match state.tasks.get(at).map(|t| t.result_seq) {
            Some(seq) if seq > 0 => s.store.result_at(seq).await.ok(),
            _ => None,
        },
        _ => None,
    };
    let (progress, events) = s.progress(&view).await;
    let t = &view.tasks[at];
    let label = progress::task_label(t, &progress);
    let activity = progress.running.get(&t.task_id).cloned();
    let waits: Vec<_> = progress.waits_of(&t.task_id).cloned().collect();
    let mut timeline = monitor::timeline(&view, &events);
    monitor::settle(&mut timeline, &view);
    let line = timeline.tasks.into_iter().nth(at);
    let mine: Vec<_> = events
        .into_iter()
        .filter(|e| e.task_id.as_ref().is_some_and(|id| id.as_str() == task))
        .collect();
    let total = mine.len();
    let events: Vec<_> = mine
        .into_iter()
        .skip(total.saturating_sub(TASK_EVENTS))
        .collect();
    Json(json!({
        "run_id": run,
        "task": t,
        "label": label,
        "subtask": subtask,
        "result": result,
        "activity": activity,
        "waiting": waits,
        "timeline": line,
        "events": events,
        "events_total": total,
    }))
    .into_response()
}

pub(crate) async fn tree(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(run): Path<RunId>,
) -> Response {
    who!(s.who(&headers));
    // The engine of `Client::tree` and `flotilla runs tree`.
    match flotilla_runs::tree::run_tree(&s.store, run, TREE_RUNS).await {
        Ok(Some(t)) => Json(t).into_response(),
        Ok(None) => error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("run {run} does not exist"),
        ),
        Err(e) => store_error(&e),
    }
}

/// `/api/diff/{a}/{b}`: run `a` compared with run `b`, task by task (the engine of
/// `run.diff` and `flotilla runs diff`).
pub(crate) async fn diff(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path((a, b)): Path<(RunId, RunId)>,
) -> Response {
    who!(s.who(&headers));
    match flotilla_runs::diff::run_diff(&s.store, a, b).await {
        Ok(Ok(d)) => Json(d).into_response(),
        Ok(Err(missing)) => error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("run {missing} does not exist"),
        ),
        Err(e) => store_error(&e),
    }
}

/// `/api/runs/{run}/events` query.
#[derive(Debug, Deserialize)]
pub(crate) struct EventsQuery {
    #[serde(default)]
    profile: Profile,
    #[serde(default)]
    children: ChildPolicy,
    #[serde(default)]
    since: u64,
    #[serde(default)]
    since_index: Option<u32>,
}

/// `Last-Event-ID` (`<seq>.<index>`, as sent) of a reconnecting `EventSource`.
fn last_event_id(headers: &HeaderMap) -> Option<(u64, u32)> {
    let v = headers.get("last-event-id")?.to_str().ok()?;
    let (seq, index) = v.split_once('.')?;
    Some((seq.parse().ok()?, index.parse().ok()?))
}

/// The run's events as `flotilla watch` projects them, live, as server-sent events: `event`
/// (a `ProjectedEvent`, id `<seq>.<index>` so a reconnecting browser resumes after it),
/// then `end` once the run and the children shown have ended.
pub(crate) async fn events(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(run): Path<RunId>,
    Query(q): Query<EventsQuery>,
) -> Response {
    who!(s.who(&headers));
    let (since, since_index) = match last_event_id(&headers) {
        Some((seq, index)) => (seq, Some(index)),
        None => (q.since, q.since_index),
    };
    let opts = WatchOptions {
        profile: q.profile,
        children: q.children,
        since,
        since_index,
    };
    let stream = match s.client.watch(run, opts).await {
        Ok(stream) => stream,
        Err(e) => return client_error(&e),
    };
    let events = stream
        .map(|r| match r {
            Ok(e) => SseEvent::default()
                .id(format!("{}.{}", e.seq, e.index))
                .event("event")
                .json_data(&e)
                .unwrap_or_else(|_| SseEvent::default().comment("unencodable")),
            Err(e) => SseEvent::default().event("failed").data(e.to_string()),
        })
        .chain(futures::stream::once(async {
            SseEvent::default().event("end").data("ended")
        }))
        .map(Ok::<_, Infallible>);
    Sse::new(events.take_until(s.closing.clone().cancelled_owned()))
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// `/api/runs/{run}/workspace` query.
#[derive(Debug, Deserialize)]
pub(crate) struct WorkspaceQuery {
    #[serde(default)]
    since: u64,
    #[serde(default)]
    topic: Option<String>,
}

pub(crate) async fn workspace(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(run): Path<RunId>,
    Query(q): Query<WorkspaceQuery>,
) -> Response {
    who!(s.who(&headers));
    let r = flotilla_model::api::WsReadRequest {
        protocol: flotilla_model::PROTOCOL_VERSION,
        run_id: run,
        topic: q.topic.filter(|t| !t.is_empty()),
        since_seq: q.since,
        limit: Some(200),
    };
    s.call(&r).await
}

/// A task's mailbox, read without moving its cursor (`mbox.read`, `commit: false`).
pub(crate) async fn mailbox(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path((run, reader)): Path<(RunId, String)>,
    Query(q): Query<WorkspaceQuery>,
) -> Response {
    who!(s.who(&headers));
    s.call(&flotilla_model::api::MboxReadRequest {
        protocol: flotilla_model::PROTOCOL_VERSION,
        run_id: run,
        reader,
        since_seq: Some(q.since),
        limit: Some(200),
        wait_ms: None,
        commit: false,
    })
    .await
}

/// A session-state value of the run's session (`state.get`).
pub(crate) async fn state(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path((run, key)): Path<(RunId, String)>,
) -> Response {
    who!(s.who(&headers));
    s.call(&flotilla_model::api::StateGetRequest {
        protocol: flotilla_model::PROTOCOL_VERSION,
        run_id: Some(run),
        session_id: None,
        key,
    })
    .await
}

/// The keys of the run's session state (`state.list`).
pub(crate) async fn state_keys(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(run): Path<RunId>,
) -> Response {
    who!(s.who(&headers));
    s.call(&flotilla_model::api::StateListRequest {
        protocol: flotilla_model::PROTOCOL_VERSION,
        run_id: Some(run),
        session_id: None,
        after: None,
        limit: None,
    })
    .await
}

/// `/api/runs/summaries` query: comma-separated run ids.
#[derive(Debug, Deserialize)]
pub(crate) struct SummariesQuery {
    ids: String,
}

/// Most runs one summaries request reads (the rows in view).
const MAX_SUMMARIES: usize = 100;

/// The agent, tokens and cost of each listed run (its own usage events: the engine of
/// `flotilla runs tree`, one run deep), for the rows in view of the runs list.
pub(crate) async fn summaries(
    State(s): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<SummariesQuery>,
) -> Response {
    who!(s.who(&headers));
    let ids: Vec<RunId> = q
        .ids
        .split(',')
        .filter_map(|id| id.trim().parse().ok())
        .take(MAX_SUMMARIES)
        .collect();
    let out: serde_json::Map<String, serde_json::Value> = futures::stream::iter(ids)
        .map(|run| {
            let store = s.store.clone();
            async move {
                let node = flotilla_runs::tree::run_tree(&store, run, 1)
                    .await
                    .ok()
                    .flatten()
                    .map(|t| t.root);
                // A run of several tasks has no one agent: the agents its plan names.
                let agents = match &node {
                    Some(n) if n.agent.is_none() => plan_agents(&store, run).await,
                    _ => Vec::new(),
                };
                (run, node, agents)
            }
        })
        .buffer_unordered(8)
        .filter_map(|(run, node, agents)| async move {
            node.map(|n| {
                let agent = n.agent.clone().or_else(|| {
                    (!agents.is_empty()).then(|| agents.join(", "))
                });
                (
                    run.to_string(),
                    json!({"agent": agent, "agents": agents, "usage": n.usage, "children": n.children.len()}),
                )
            })
        })
        .collect()
        .await;
    Json(out).into_response()
}

/// The agents `run`'s plan names, in plan order, each once; a task without one runs the
/// deployment's default agent (`default`), or a member of its role (the role's name).
async fn plan_agents(store: &flotilla_runs::RunReader, run: RunId) -> Vec<String> {
    let Ok(Some(plan)) = store.plan(run).await else {
        return Vec::new();
    };
    let mut out: Vec<String> = Vec::new();
    for t in &plan.subtasks {
        let who = match (&t.agent, &t.role) {
            (Some(a), _) => a.clone(),
            (None, Some(r)) => format!("role {r}"),
            (None, None) => "default".to_owned(),
        };
        if !out.contains(&who) {
            out.push(who);
        }
    }
    out
}

pub(crate) async fn session(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(session): Path<SessionId>,
) -> Response {
    who!(s.who(&headers));
    match s.client.session(session).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => client_error(&e),
    }
}

/// The body of a run control.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct ControlBody {
    #[serde(default)]
    reason: Option<String>,
    /// With `pause` and `resume`: only this task (its descendants' runs are not touched);
    /// with `complete`: the task to complete (required).
    #[serde(default)]
    task: Option<TaskId>,
    /// With `complete`: the task's result (required).
    #[serde(default)]
    result: Option<String>,
    /// With `pause` and `takeover`: how long the hold lasts before its default (the
    /// coordinator's default when absent; its limits apply).
    #[serde(default)]
    timeout_ms: Option<u64>,
    /// With `cancel`: compensate the tasks that succeeded, in reverse dependency order.
    #[serde(default)]
    rollback: bool,
    /// With `edit`: the whole plan as it should run from here (required).
    #[serde(default)]
    plan: Option<Plan>,
    /// With `revoke`: the tool whose session grant is withdrawn (required).
    #[serde(default)]
    tool: Option<String>,
}

/// Pause, resume, take over or cancel a run, pause or resume one of its tasks, complete a
/// task or edit the plan of a run under human control, withdraw a tool's grant in the run's
/// session — operators only, audited, `by` the identity.
pub(crate) async fn control(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path((run, action)): Path<(RunId, String)>,
    body: Option<Json<ControlBody>>,
) -> Response {
    let who = who!(s.operator(&headers));
    let body = body.map(|b| b.0).unwrap_or_default();
    let reason = body.reason.filter(|r| !r.is_empty());
    let task = body.task;
    let target = match (&task, &body.tool) {
        (Some(t), _) => Some(t.as_str().to_owned()),
        (None, Some(tool)) => Some(format!("tool {tool}")),
        (None, None) => None,
    };
    let protocol = flotilla_model::PROTOCOL_VERSION;
    let by = Some(who.name.clone());
    let response = match action.as_str() {
        "pause" => {
            s.call(&PauseRunRequest {
                protocol,
                run_id: run,
                reason,
                by,
                timeout_ms: body.timeout_ms,
                children: task.is_none(),
                task_id: task,
            })
            .await
        }
        "resume" => {
            s.call(&ResumeRunRequest {
                protocol,
                run_id: run,
                reason,
                by,
                children: task.is_none(),
                task_id: task,
            })
            .await
        }
        "complete" => {
            let (Some(task_id), Some(result)) = (task, body.result) else {
                return error(
                    StatusCode::BAD_REQUEST,
                    "invalid_control",
                    "complete needs task and result",
                );
            };
            s.call(&CompleteTaskRequest {
                protocol,
                run_id: run,
                task_id,
                result,
                by: who.name.clone(),
                comment: reason,
            })
            .await
        }
        "takeover" => {
            s.call(&TakeoverRunRequest {
                protocol,
                run_id: run,
                reason,
                by,
                timeout_ms: body.timeout_ms,
                children: true,
            })
            .await
        }
        "cancel" => {
            s.call(&CancelRunRequest {
                protocol,
                run_id: run,
                reason,
                by,
                rollback: body.rollback,
            })
            .await
        }
        "edit" => {
            let Some(plan) = body.plan else {
                return error(
                    StatusCode::BAD_REQUEST,
                    "invalid_control",
                    "edit needs plan: the whole plan as it should run from here",
                );
            };
            s.call(&EditPlanRequest {
                protocol,
                run_id: run,
                plan,
                by: who.name.clone(),
                reason,
            })
            .await
        }
        "revoke" => {
            let Some(tool) = body.tool.filter(|t| !t.is_empty()) else {
                return error(
                    StatusCode::BAD_REQUEST,
                    "invalid_control",
                    "revoke needs tool: the tool whose grant is withdrawn",
                );
            };
            s.call(&GrantRevokeRequest {
                protocol,
                run_id: Some(run),
                session_id: None,
                tool,
                by: who.name.clone(),
            })
            .await
        }
        other => {
            return error(
                StatusCode::NOT_FOUND,
                "unknown_action",
                format!(
                    "no action {other:?}: pause, resume, takeover, cancel, complete, edit or revoke"
                ),
            );
        }
    };
    s.audit(&who, &action, run, target.as_deref(), response.status());
    response
}

/// The body of a fork from a run's page.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ForkBody {
    /// The fork point: the task that runs afresh first, with what is downstream of it.
    at: TaskId,
    /// Run the fork point with this agent instead (empty: its own).
    #[serde(default)]
    agent: Option<String>,
    /// Run the fork point with these instructions instead (empty: its own).
    #[serde(default)]
    description: Option<String>,
    /// Run the fork point with this input instead.
    #[serde(default)]
    input: Option<serde_json::Value>,
    /// Run the fork point with this model instead (empty: its agent's).
    #[serde(default)]
    model: Option<String>,
    /// Keep the fork point's conversation before this step (an LLM agent's).
    #[serde(default)]
    step: Option<u32>,
}

/// Forks an ended run at a task (`run.fork`): a new run in which the task, with the changes
/// asked, and what is downstream of it run again, and every other task that succeeded keeps
/// the run's result — operators only, audited. The answer is the API's `RunForkReply` (the
/// fork's `run_id`, what it keeps and reruns), or its refusal with its status (`400
/// invalid_plan` with every problem, `409 run_not_ended`, `404 unknown_task`, …).
pub(crate) async fn fork(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(run): Path<RunId>,
    Json(body): Json<ForkBody>,
) -> Response {
    let who = who!(s.operator(&headers));
    let at = body.at.as_str().to_owned();
    let mut request = RunForkRequest::new(run, body.at);
    request.agent = body.agent.filter(|a| !a.trim().is_empty());
    request.description = body.description.filter(|d| !d.trim().is_empty());
    request.input = body.input;
    request.model = body.model.filter(|m| !m.trim().is_empty());
    request.step = body.step;
    let response = s.call(&request).await;
    s.audit(&who, "fork", run, Some(&at), response.status());
    response
}

/// The tools approved for the rest of the run's session (`approval.grants`).
pub(crate) async fn grants(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(run): Path<RunId>,
) -> Response {
    who!(s.who(&headers));
    s.call(&GrantListRequest {
        protocol: flotilla_model::PROTOCOL_VERSION,
        run_id: Some(run),
        session_id: None,
    })
    .await
}

/// `/api/inbox` query.
#[derive(Debug, Deserialize)]
pub(crate) struct InboxQuery {
    #[serde(default)]
    run: Option<RunId>,
    #[serde(default)]
    all: Option<String>,
}

/// Pending approvals, questions and client tool requests across runs (`approval.list`).
pub(crate) async fn inbox(
    State(s): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<InboxQuery>,
) -> Response {
    who!(s.who(&headers));
    let request = ApprovalListRequest {
        protocol: flotilla_model::PROTOCOL_VERSION,
        run_id: q.run,
        all: matches!(q.all.as_deref(), Some("1" | "true")),
        limit: None,
    };
    match s.client.call(&request, API_TIMEOUT).await {
        // Each request's run by its plan name, as the cards name it.
        Ok(Ok(list)) => {
            let names = s
                .index
                .names(list.approvals.iter().map(|a| a.request.run_id));
            let mut v = serde_json::to_value(&list).unwrap_or_default();
            if let Some(o) = v.as_object_mut() {
                o.insert("names".into(), json!(names));
            }
            Json(v).into_response()
        }
        Ok(Err(refusal)) => (
            StatusCode::from_u16(refusal.status).unwrap_or(StatusCode::BAD_REQUEST),
            Json(refusal),
        )
            .into_response(),
        Err(e) => client_error(&e),
    }
}

/// A ping each time a notice says the inbox changed.
pub(crate) async fn inbox_stream(State(s): State<AppState>, headers: HeaderMap) -> Response {
    who!(s.who(&headers));
    let stream = changes(s.notices.subscribe())
        .map(|_| Ok::<_, Infallible>(SseEvent::default().event("inbox").data("changed")));
    Sse::new(stream.take_until(s.closing.clone().cancelled_owned()))
        .keep_alive(KeepAlive::default())
        .into_response()
}

pub(crate) async fn approval(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path((run, id)): Path<(RunId, String)>,
) -> Response {
    who!(s.who(&headers));
    s.call(&ApprovalGetRequest {
        protocol: flotilla_model::PROTOCOL_VERSION,
        run_id: run,
        approval_id: id,
    })
    .await
}

/// An answer from the page.
#[derive(Debug, Deserialize)]
pub(crate) struct AnswerBody {
    /// `approve`, `reject`, `edit` or `respond`.
    decision: String,
    #[serde(default)]
    message: Option<String>,
    #[serde(default)]
    input: Option<serde_json::Value>,
    #[serde(default)]
    result: Option<String>,
    #[serde(default)]
    comment: Option<String>,
    /// The digest of the request the person reviewed.
    #[serde(default)]
    digest: Option<String>,
    /// With `approve`: the tool is approved for the rest of the run's session too.
    #[serde(default)]
    always: bool,
    /// With `reject`: the rejection is an incident of the task's agent (and role).
    #[serde(default)]
    incident: bool,
}

/// Answers an approval (`approval.answer`) as the signed-in operator, audited.
pub(crate) async fn answer(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path((run, id)): Path<(RunId, String)>,
    Json(body): Json<AnswerBody>,
) -> Response {
    let who = who!(s.operator(&headers));
    let decision = match body.decision.as_str() {
        "approve" => Decision::Approve,
        "reject" => Decision::Reject {
            message: body.message.unwrap_or_default(),
        },
        "edit" => match body.input {
            Some(input) => Decision::Edit { input },
            None => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "invalid_answer",
                    "edit needs input",
                );
            }
        },
        "respond" => match body.result {
            Some(result) => Decision::Respond { result },
            None => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "invalid_answer",
                    "respond needs result",
                );
            }
        },
        other => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_answer",
                format!("no decision {other:?}: approve, reject, edit or respond"),
            );
        }
    };
    let action = format!("approval.{}", decision.as_str());
    let response = s
        .call(&ApprovalAnswerRequest {
            protocol: flotilla_model::PROTOCOL_VERSION,
            run_id: run,
            approval_id: id.clone(),
            decision,
            by: who.name.clone(),
            comment: body.comment.filter(|c| !c.is_empty()),
            digest: body.digest,
            always: body.always,
            incident: body.incident,
        })
        .await;
    s.audit(&who, &action, run, Some(&id), response.status());
    response
}

pub(crate) async fn team(State(s): State<AppState>, headers: HeaderMap) -> Response {
    who!(s.who(&headers));
    let protocol = flotilla_model::PROTOCOL_VERSION;
    let team = s
        .client
        .call(
            &TeamListRequest {
                protocol,
                role: None,
            },
            API_TIMEOUT,
        )
        .await;
    // Trust levels by agent and role (`trust.list`), when the supervisor serves them.
    let trust = s
        .client
        .call(&TrustListRequest { protocol }, API_TIMEOUT)
        .await
        .ok()
        .and_then(Result::ok);
    match team {
        Ok(Ok(team)) => Json(json!({"team": team, "trust": trust})).into_response(),
        Ok(Err(refusal)) => (
            StatusCode::from_u16(refusal.status).unwrap_or(StatusCode::BAD_REQUEST),
            Json(refusal),
        )
            .into_response(),
        Err(e) => client_error(&e),
    }
}

/// A pool's live capacity and backlog.
#[derive(Debug, Serialize)]
struct PoolView {
    pool: String,
    workers: usize,
    slots: usize,
    in_use: usize,
    /// Tasks waiting in the pool's queue (the pool consumer's pending count), when known.
    backlog: Option<u64>,
    /// Tasks delivered and not acknowledged yet.
    ack_pending: Option<usize>,
}

/// Live workers, and per pool: slots in use and backlog.
pub(crate) async fn workers(State(s): State<AppState>, headers: HeaderMap) -> Response {
    who!(s.who(&headers));
    let live = match s.client.live_workers().await {
        Ok(w) => w,
        Err(e) => return client_error(&e),
    };
    let mut pools: Vec<PoolView> = Vec::new();
    for (w, _) in &live {
        match pools.iter_mut().find(|p| p.pool == w.pool) {
            Some(p) => {
                p.workers += 1;
                p.slots += w.concurrency;
                p.in_use += w.in_flight;
            }
            None => pools.push(PoolView {
                pool: w.pool.clone(),
                workers: 1,
                slots: w.concurrency,
                in_use: w.in_flight,
                backlog: None,
                ack_pending: None,
            }),
        }
    }
    let bus = s.client.bus();
    let stream = bus.names().stream(StreamKind::Tasks);
    if let Ok(tasks) = bus.js().get_stream_no_info(&stream).await {
        for p in &mut pools {
            if let Ok(info) = tasks
                .consumer_info(&bus.names().pool_consumer(&p.pool))
                .await
            {
                p.backlog = Some(info.num_pending);
                p.ack_pending = Some(info.num_ack_pending);
            }
        }
    }
    let workers: Vec<_> = live
        .into_iter()
        .map(|(w, seen)| json!({"worker": w, "last_seen": seen}))
        .collect();
    Json(json!({"workers": workers, "pools": pools, "active_runs": s.index.active()}))
        .into_response()
}

pub(crate) async fn audit(State(s): State<AppState>, headers: HeaderMap) -> Response {
    who!(s.who(&headers));
    let entries: Vec<AuditEntry> = s
        .audit
        .lock()
        .map(|a| a.iter().rev().cloned().collect())
        .unwrap_or_default();
    Json(entries).into_response()
}
