//! The request/reply API: a NATS micro service named after the prefix, discoverable with
//! standard NATS tooling (`$SRV.PING`, `$SRV.INFO`).
//!
//! | Subject | Request | Reply |
//! |---|---|---|
//! | `<prefix>.api.submit` | `SubmitRequest` | `SubmitReply` (at acceptance, or at the end with `wait: true`) |
//! | `<prefix>.api.run.get` | `GetRunRequest` | `RunView` |
//! | `<prefix>.api.run.cancel` | `CancelRunRequest` | `CancelRunReply` |
//! | `<prefix>.api.run.pause`, `run.resume`, `run.takeover`, `run.complete`, `run.edit` | see [`controls`] | |
//! | `<prefix>.api.run.tree` | `RunTreeRequest` | `RunTree` |
//! | `<prefix>.api.run.diff` | `RunDiffRequest` | `RunDiff` |
//! | `<prefix>.api.session.get` | `SessionRequest` | `SessionView` |
//! | `<prefix>.api.plan.validate` | `ValidatePlanRequest` | `ValidatePlanReply` |
//! | `<prefix>.api.approval.ask`, `approval.list`, `approval.get`, `approval.answer`, `approval.grants`, `approval.revoke` | see [`approvals`] | |
//! | `<prefix>.api.ws.append`, `ws.read`, `mbox.send`, `mbox.read`, `mbox.role`, `mbox.negotiate`, `state.get`, `state.list`, `state.set` | see [`collab`] | |
//!
//! The service's `$SRV.INFO` metadata carries what the process was given
//! ([`crate::Coordinator::with_service_metadata`]): `flotilla coordinator` and `flotilla up`
//! put the deployment's configuration fingerprint, host and pid there.
//!
//! Errors are an `ApiError` body with the micro-service headers `Nats-Service-Error` and
//! `Nats-Service-Error-Code`. No request goes unanswered: a request that does not decode is
//! `400 malformed`, one of a protocol version this build does not speak `400
//! unsupported_protocol`, and a reply too large for the deployment `413 too_large`. Each
//! request is handled in its own task, so a slow one (a mailbox read that waits) never holds
//! up the others.

use std::sync::Arc;
use std::time::Duration;

use async_nats::service::{Request, ServiceExt};
use flotilla_bus::wire;
use flotilla_model::ErrorCode;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::api::{
    ApiRequest, CancelRunReply, CancelRunRequest, ChildStartRequest, GetRunRequest,
    MAX_TASKS_PER_VIEW, MboxNegotiateRequest, MboxReadRequest, MboxRoleRequest, MboxSendRequest,
    StateGetRequest, StateListRequest, StateSetRequest, ValidatePlanReply, ValidatePlanRequest,
    WsAppendRequest, WsReadRequest,
};
use flotilla_model::codec::{CodecError, check_protocol};
use flotilla_model::ids::RunId;
use flotilla_model::run::RunOutcome;
use flotilla_model::runlog::{Control, ControlAction, RunInput, RunLogEntry};
use flotilla_model::submit::{SubmitReply, SubmitRequest};
use flotilla_model::time::Timestamp;
use flotilla_model::validate::{Problem, ProblemCode, ValidationContext, validate_plan};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::error::{CoordinatorError, CoordinatorErrorKind};
use crate::intake::{Answer, Intake, Source};
use crate::live::LiveWorkers;
use crate::store::{RunStore, record_of};

/// Longest a waiting duplicate submission is held before it is answered `504 timeout`.
const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

mod approvals;
mod collab;
mod controls;
mod fork;
mod fork_copy;

/// `404 not_found` for a run that does not exist.
/// `400 <code>` naming every problem of a request at once (in `problems`, and joined in the
/// message).
async fn respond_problems(req: &Request, code: ErrorCode, problems: Vec<Problem>) {
    let mut body = flotilla_model::api::ApiError::new(
        400,
        code,
        problems
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; "),
    );
    body.problems = problems;
    respond_api_error(req, &body).await;
}

async fn run_not_found(req: &Request, run: RunId) {
    respond_error(
        req,
        404,
        ErrorCode::NotFound,
        format!("run {run} does not exist"),
    )
    .await;
}

use flotilla_bus::service::{parse, respond_api_error, respond_error};

/// Answers `value` as JSON (`413 too_large` when it would not fit).
async fn respond_json<T: serde::Serialize>(req: &Request, max_payload: usize, value: &T) {
    flotilla_bus::service::respond_json(
        req,
        max_payload,
        value,
        "ask for less (tasks_limit on run.get, max_runs on run.tree)",
    )
    .await;
}

/// What the endpoints share.
struct Api {
    store: RunStore,
    intake: Arc<Intake>,
    ctx: ValidationContext,
    live: LiveWorkers,
    /// What the collaboration endpoints know of the runs they were asked about.
    runs: collab::RunCache,
    /// Ends server-side watches when the coordinator stops.
    shutdown: CancellationToken,
    /// Approvals (the operator's inbox).
    approvals: crate::approval_store::ApprovalStore,
}

/// One endpoint of the API: its micro-service name, its subject under `<prefix>.api` and
/// the handler a request to it is given to (in a task of its own).
struct Route {
    name: &'static str,
    subject: &'static str,
    handle: fn(Arc<Api>, Request) -> futures::future::BoxFuture<'static, ()>,
}

/// The API's routing: every endpoint, in the order the module's table lists them.
const ROUTES: &[Route] = &[
    Route {
        name: "submit",
        subject: SubmitRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.submit(req).await }),
    },
    Route {
        name: "run-fork",
        subject: flotilla_model::fork::RunForkRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.fork(req).await }),
    },
    Route {
        name: "run-get",
        subject: GetRunRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.get(req).await }),
    },
    Route {
        name: "run-cancel",
        subject: CancelRunRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.cancel(req).await }),
    },
    Route {
        name: "plan-validate",
        subject: ValidatePlanRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.validate(req).await }),
    },
    Route {
        name: "ws-append",
        subject: WsAppendRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.ws_append(req).await }),
    },
    Route {
        name: "ws-read",
        subject: WsReadRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.ws_read(req).await }),
    },
    Route {
        name: "mbox-send",
        subject: MboxSendRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.mbox_send(req).await }),
    },
    Route {
        name: "mbox-read",
        subject: MboxReadRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.mbox_read(req).await }),
    },
    Route {
        name: "mbox-role",
        subject: MboxRoleRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.mbox_role(req).await }),
    },
    Route {
        name: "mbox-negotiate",
        subject: MboxNegotiateRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.mbox_negotiate(req).await }),
    },
    Route {
        name: "state-get",
        subject: StateGetRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.state_get(req).await }),
    },
    Route {
        name: "state-list",
        subject: StateListRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.state_list(req).await }),
    },
    Route {
        name: "child-start",
        subject: ChildStartRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.child_start(req).await }),
    },
    Route {
        name: "state-set",
        subject: StateSetRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.state_set(req).await }),
    },
    Route {
        name: "watch",
        subject: flotilla_model::watch::WatchRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.watch(req).await }),
    },
    Route {
        name: "run-tree",
        subject: flotilla_model::tree::RunTreeRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.tree(req).await }),
    },
    Route {
        name: "run-diff",
        subject: flotilla_model::diff::RunDiffRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.diff(req).await }),
    },
    Route {
        name: "session-get",
        subject: flotilla_model::tree::SessionRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.session(req).await }),
    },
    Route {
        name: "approval-ask",
        subject: flotilla_model::approval::ApprovalAskRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.approval_ask(req).await }),
    },
    Route {
        name: "approval-list",
        subject: flotilla_model::approval::ApprovalListRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.approval_list(req).await }),
    },
    Route {
        name: "approval-get",
        subject: flotilla_model::approval::ApprovalGetRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.approval_get(req).await }),
    },
    Route {
        name: "approval-answer",
        subject: flotilla_model::approval::ApprovalAnswerRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.approval_answer(req).await }),
    },
    Route {
        name: "approval-grants",
        subject: flotilla_model::approval::GrantListRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.approval_grants(req).await }),
    },
    Route {
        name: "approval-revoke",
        subject: flotilla_model::approval::GrantRevokeRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.approval_revoke(req).await }),
    },
    Route {
        name: "run-pause",
        subject: flotilla_model::control::PauseRunRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.run_pause(req).await }),
    },
    Route {
        name: "run-resume",
        subject: flotilla_model::control::ResumeRunRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.run_resume(req).await }),
    },
    Route {
        name: "run-takeover",
        subject: flotilla_model::control::TakeoverRunRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.run_takeover(req).await }),
    },
    Route {
        name: "run-complete",
        subject: flotilla_model::control::CompleteTaskRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.run_complete(req).await }),
    },
    Route {
        name: "run-edit",
        subject: flotilla_model::control::EditPlanRequest::ENDPOINT,
        handle: |api, req| Box::pin(async move { api.run_edit(req).await }),
    },
];

/// How often a coordinator settles external agents' questions nobody waits for any more
/// (see [`Api::sweep_external_questions`]).
const EXTERNAL_SWEEP: std::time::Duration = std::time::Duration::from_secs(15);

/// Serves the API until `shutdown`; `registered` fires once every endpoint is subscribed
/// (dropped unsent when the service cannot start).
pub(crate) async fn serve(
    store: RunStore,
    intake: Arc<Intake>,
    ctx: ValidationContext,
    live: LiveWorkers,
    metadata: std::collections::HashMap<String, String>,
    shutdown: CancellationToken,
    bound: tokio::sync::oneshot::Sender<()>,
) -> Result<(), CoordinatorError> {
    let bus = store.bus().clone();
    let setup = |e: async_nats::Error| {
        CoordinatorError::new(
            CoordinatorErrorKind::Setup,
            format!("starting the API service: {e}"),
        )
    };
    let service = bus
        .client()
        .service_builder()
        .description(
            "Flotilla coordinator API: submit, read, cancel, pause, resume, take over runs; run trees and sessions; validate plans; workspace, mailboxes, session state; watch",
        )
        // The deployment's configuration fingerprint and where this coordinator runs, for
        // `flotilla up --nats-url` and operators (`nats micro info <prefix>`).
        .metadata(metadata)
        .start(bus.names().service(), env!("CARGO_PKG_VERSION"))
        .await
        .map_err(setup)?;
    let group = service.group(format!("{}.api", bus.names().prefix()));
    let mut requests = Vec::with_capacity(ROUTES.len());
    for (i, route) in ROUTES.iter().enumerate() {
        let endpoint = group
            .endpoint_builder()
            .name(route.name)
            .add(route.subject)
            .await
            .map_err(setup)?;
        requests.push(endpoint.map(move |req| (i, req)));
    }
    let mut requests = futures::stream::select_all(requests);
    // Every endpoint's subscription is at the server before the coordinator says it is
    // ready: a request sent once it is ready finds its endpoint.
    bus.client()
        .flush()
        .await
        .map_err(|e| setup(async_nats::Error::from(e)))?;
    let _ = bound.send(());
    let api = Arc::new(Api {
        approvals: crate::approval_store::ApprovalStore::new(bus.clone()),
        store,
        intake,
        ctx,
        live,
        runs: collab::RunCache::default(),
        shutdown: shutdown.clone(),
    });
    // External agents' questions wait in their calling attempt, not in a run machine: a
    // sweep settles those whose asker is gone (its worker died, the run ended). Every
    // coordinator sweeps; settling is a compare-and-set, so replicas never settle one twice.
    let mut sweep =
        tokio::time::interval_at(tokio::time::Instant::now() + EXTERNAL_SWEEP, EXTERNAL_SWEEP);
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sweeping: Option<tokio::task::JoinHandle<()>> = None;
    loop {
        let api = Arc::clone(&api);
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = sweep.tick() => {
                if sweeping.as_ref().is_none_or(tokio::task::JoinHandle::is_finished) {
                    sweeping = Some(tokio::spawn(async move { api.sweep_external_questions().await }));
                }
            }
            Some((i, req)) = requests.next() => {
                tokio::spawn((ROUTES[i].handle)(api, req));
            }
            else => break,
        }
    }
    let _ = service.stop().await;
    Ok(())
}

impl Api {
    fn max_payload(&self) -> usize {
        self.store.bus().max_payload()
    }

    /// `api.watch`: a server-side projection of a run tree, published to the watcher's
    /// subject until the run ends, the lease runs out without a renewal, or the coordinator
    /// stops. The projection is [`crate::watch::project`], as in the client library.
    async fn watch(&self, req: Request) {
        use flotilla_model::watch::{WatchEnd, WatchReply, WatchRequest};
        let Some(r) = parse::<WatchRequest>(&req).await else {
            return;
        };
        if let Err(e) = flotilla_model::token::check_subject(&r.deliver_subject) {
            return respond_error(
                &req,
                400,
                ErrorCode::InvalidDeliverSubject,
                format!("deliver_subject {:?} {e}", r.deliver_subject),
            )
            .await;
        }
        if !(1_000..=600_000).contains(&r.lease_ms) {
            return respond_error(
                &req,
                400,
                ErrorCode::InvalidLease,
                format!("lease_ms {} is outside 1000 to 600000", r.lease_ms),
            )
            .await;
        }
        match self.store.load(r.run_id).await {
            Ok(Some(_)) => {}
            Ok(None) if matches!(self.store.first_message(r.run_id).await, Ok(Some(_))) => {}
            Ok(None) => {
                return run_not_found(&req, r.run_id).await;
            }
            Err(e) => return respond_error(&req, 503, ErrorCode::Unavailable, e.to_string()).await,
        }
        let bus = self.store.bus().clone();
        let watch_id = uuid::Uuid::now_v7().to_string();
        let renew_subject = bus.names().api(&format!("watch.{watch_id}.renew"));
        let mut renewals = match bus.client().subscribe(renew_subject.clone()).await {
            Ok(s) => s,
            Err(e) => return respond_error(&req, 503, ErrorCode::Unavailable, e.to_string()).await,
        };
        let opts = crate::watch::WatchOptions {
            profile: r.profile,
            children: r.children,
            since: r.since,
            since_index: r.since_index,
        };
        let stream = match crate::watch::project(bus.clone(), r.run_id, opts).await {
            Ok(s) => s,
            Err(e) => return respond_error(&req, 503, ErrorCode::Unavailable, e.to_string()).await,
        };
        respond_json(
            &req,
            self.max_payload(),
            &WatchReply {
                watch_id: watch_id.clone(),
                renew_subject,
                lease_ms: r.lease_ms,
            },
        )
        .await;
        let lease = std::time::Duration::from_millis(r.lease_ms);
        let mut deadline = tokio::time::Instant::now() + lease;
        futures::pin_mut!(stream);
        let end = loop {
            tokio::select! {
                item = stream.next() => match item {
                    None => break WatchEnd { end: "ended".into(), message: None },
                    Some(Err(e)) => break WatchEnd { end: "error".into(), message: Some(e.to_string()) },
                    Some(Ok(ev)) => {
                        let body = serde_json::to_vec(&ev).unwrap_or_default();
                        if let Err(e) = bus.client().publish(r.deliver_subject.clone(), body.into()).await {
                            break WatchEnd { end: "error".into(), message: Some(e.to_string()) };
                        }
                    }
                },
                Some(_) = renewals.next() => deadline = tokio::time::Instant::now() + lease,
                () = tokio::time::sleep_until(deadline) => break WatchEnd { end: "lease_expired".into(), message: None },
                () = self.shutdown.cancelled() => break WatchEnd { end: "shutdown".into(), message: None },
            }
        };
        debug!(watch = %watch_id, run = %r.run_id, end = %end.end, "A watch ended");
        let body = serde_json::to_vec(&end).unwrap_or_default();
        let _ = bus.client().publish(r.deliver_subject, body.into()).await;
        let _ = bus.client().flush().await;
    }

    async fn submit(&self, req: Request) {
        let inbox = req.message.reply.as_ref().map(ToString::to_string);
        let source = Source::Api {
            inbox: inbox.as_deref(),
            now_ms: Timestamp::now().unix_ms(),
            fork: false,
        };
        match self
            .intake
            .submit(req.message.headers.as_ref(), &req.message.payload, source)
            .await
        {
            Ok(Answer::Now(reply)) => respond_json(&req, self.max_payload(), &reply).await,
            Ok(Answer::AtEnd) => {}
            Ok(Answer::WaitFor(run)) => match self.wait_for_end(run).await {
                Ok(outcome) => {
                    respond_json(&req, self.max_payload(), &SubmitReply::finished(outcome)).await;
                }
                Err((status, code, message)) => respond_error(&req, status, code, message).await,
            },
            // Only durable submissions wait for a quota; a request is answered at once.
            Ok(Answer::Later(_)) => {
                respond_error(
                    &req,
                    500,
                    ErrorCode::Internal,
                    "the submission was not answered".to_owned(),
                )
                .await;
            }
            Err(e) => {
                warn!(error = %e, "Submission failed");
                respond_error(&req, 503, ErrorCode::Unavailable, e.to_string()).await;
            }
        }
    }

    /// Waits until `run` ends and returns its outcome (at once if it has ended). Subscribes
    /// to the run's events before reading its record, so an end in between is not missed.
    async fn wait_for_end(&self, run: RunId) -> Result<RunOutcome, (u16, ErrorCode, String)> {
        let bus = self.store.bus();
        let unavailable = |e: String| (503, ErrorCode::Unavailable, e);
        let mut events = bus
            .client()
            .subscribe(bus.names().event(run))
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        let record = self
            .store
            .load(run)
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        if let Some(s) = record
            && s.snapshot.state.status.is_terminal()
            && let Some(o) = record_of(&s.snapshot.state).outcome
        {
            return Ok(o);
        }
        let wait = async {
            while let Some(msg) = events.next().await {
                if let Some(outcome) = terminal_outcome(&msg) {
                    return Some(outcome);
                }
            }
            None
        };
        match tokio::time::timeout(MAX_WAIT, wait).await {
            Ok(Some(o)) => Ok(o),
            Ok(None) => Err(unavailable("the event subscription ended".into())),
            Err(_) => Err((
                504,
                ErrorCode::Timeout,
                format!("run {run} did not end within {MAX_WAIT:?}"),
            )),
        }
    }

    async fn get(&self, req: Request) {
        let Some(r) = parse::<GetRunRequest>(&req).await else {
            return;
        };
        // Refused, not lowered (as `ws.read` does), so a client learns the bound.
        if let Some(n) = r.tasks_limit
            && !(1..=MAX_TASKS_PER_VIEW).contains(&n)
        {
            return respond_error(
                &req,
                400,
                ErrorCode::InvalidLimit,
                format!(
                    "tasks_limit {n} is out of range: give 1 to {MAX_TASKS_PER_VIEW} (default {MAX_TASKS_PER_VIEW}) and page with tasks_offset"
                ),
            )
            .await;
        }
        let (offset, limit) = if r.task_id.is_some() {
            (0, usize::MAX)
        } else {
            (
                r.tasks_offset,
                r.tasks_limit.unwrap_or(MAX_TASKS_PER_VIEW) as usize,
            )
        };
        match self.store.view(r.run_id, offset as usize, limit).await {
            Ok(Some(mut view)) if r.task_id.is_some() => {
                view.tasks
                    .retain(|t| Some(&t.task_id) == r.task_id.as_ref());
                respond_json(&req, self.max_payload(), &view).await
            }
            Ok(Some(view)) => respond_json(&req, self.max_payload(), &view).await,
            Ok(None) => run_not_found(&req, r.run_id).await,
            Err(e) => respond_error(&req, 500, ErrorCode::Internal, e.to_string()).await,
        }
    }

    /// `run.tree`: the run and its descendants with status, duration, tokens and cost.
    async fn tree(&self, req: Request) {
        use flotilla_model::tree::{MAX_RUNS_PER_ANSWER, RunTreeRequest};
        let Some(r) = parse::<RunTreeRequest>(&req).await else {
            return;
        };
        if r.max_runs == Some(0) || r.max_runs.is_some_and(|m| m > MAX_RUNS_PER_ANSWER) {
            return respond_error(
                &req,
                400,
                ErrorCode::InvalidMaxRuns,
                format!("max_runs must be 1 to {MAX_RUNS_PER_ANSWER}"),
            )
            .await;
        }
        let max = r.max_runs.unwrap_or(MAX_RUNS_PER_ANSWER) as usize;
        match crate::tree::run_tree(&self.store, r.run_id, max).await {
            Ok(Some(tree)) => respond_json(&req, self.max_payload(), &tree).await,
            Ok(None) => run_not_found(&req, r.run_id).await,
            Err(e) => respond_error(&req, 500, ErrorCode::Internal, e.to_string()).await,
        }
    }

    /// `run.diff`: two runs compared task by task.
    async fn diff(&self, req: Request) {
        let Some(r) = parse::<flotilla_model::diff::RunDiffRequest>(&req).await else {
            return;
        };
        match flotilla_runs::diff::run_diff(&self.store, r.a, r.b).await {
            Ok(Ok(diff)) => respond_json(&req, self.max_payload(), &diff).await,
            Ok(Err(missing)) => run_not_found(&req, missing).await,
            Err(e) => respond_error(&req, 500, ErrorCode::Internal, e.to_string()).await,
        }
    }

    /// `session.get`: the runs of a session.
    async fn session(&self, req: Request) {
        let Some(r) = parse::<flotilla_model::tree::SessionRequest>(&req).await else {
            return;
        };
        match crate::tree::session_view(&self.store, r.session_id).await {
            Ok(view) => respond_json(&req, self.max_payload(), &view).await,
            Err(e) => respond_error(&req, 500, ErrorCode::Internal, e.to_string()).await,
        }
    }

    async fn cancel(&self, req: Request) {
        let Some(mut r) = parse::<CancelRunRequest>(&req).await else {
            return;
        };
        // A person calling through a shared import is who the NATS server says.
        if let Some(who) = flotilla_bus::service::requester(&req) {
            r.by = Some(who);
        }
        let run = r.run_id;
        let state = match self.store.load(run).await {
            Ok(Some(s)) => s.snapshot.state,
            Ok(None) => {
                // Accepted but its start not recorded yet? Then it has a submission.
                match self.store.first_message(run).await {
                    Ok(Some(crate::store::First {
                        content:
                            crate::store::FirstMessage::Submission { .. }
                            | crate::store::FirstMessage::Entry(RunLogEntry {
                                input: RunInput::Submitted(_),
                                ..
                            }),
                        ..
                    })) => {
                        return self.append_cancel(&req, r).await;
                    }
                    Ok(_) => {
                        return respond_error(
                            &req,
                            404,
                            ErrorCode::NotFound,
                            format!("run {run} does not exist"),
                        )
                        .await;
                    }
                    Err(e) => {
                        return respond_error(&req, 500, ErrorCode::Internal, e.to_string()).await;
                    }
                }
            }
            Err(e) => return respond_error(&req, 500, ErrorCode::Internal, e.to_string()).await,
        };
        if state.status.is_terminal() {
            let reply = CancelRunReply {
                protocol: PROTOCOL_VERSION,
                run_id: run,
                cancelling: false,
                status: state.status,
                rollback_run_id: state.outcome.as_ref().and_then(|o| o.rollback_run_id),
            };
            return respond_json(&req, self.max_payload(), &reply).await;
        }
        self.append_cancel(&req, r).await;
    }

    async fn append_cancel(&self, req: &Request, r: CancelRunRequest) {
        let bus = self.store.bus();
        let mut reason = r.reason.unwrap_or_default();
        crate::machine::truncate_message(&mut reason, 1024);
        let entry = RunLogEntry {
            protocol: PROTOCOL_VERSION,
            run_id: r.run_id,
            input: RunInput::Control(Control {
                action: ControlAction::Cancel,
                reason: (!reason.is_empty()).then_some(reason),
                by: r.by,
                timeout_ms: None,
                rollback: r.rollback,
                task_id: None,
                reply_to: None,
            }),
        };
        match bus
            .publish(bus.names().runlog(r.run_id), &entry, None)
            .await
        {
            Ok(_) => {
                let reply = CancelRunReply {
                    protocol: PROTOCOL_VERSION,
                    run_id: r.run_id,
                    cancelling: true,
                    status: flotilla_model::run::RunStatus::Running,
                    rollback_run_id: r
                        .rollback
                        .then(|| flotilla_model::rollback::rollback_run_id(r.run_id)),
                };
                respond_json(req, self.max_payload(), &reply).await;
            }
            Err(e) => respond_error(req, 503, ErrorCode::Unavailable, e.to_string()).await,
        }
    }

    async fn validate(&self, req: Request) {
        let ctx = self.ctx.for_payload(self.max_payload());
        let headers = req.message.headers.as_ref();
        let r = match wire::decode::<ValidatePlanRequest>(headers, &req.message.payload) {
            Ok(r) => r,
            Err(CodecError::Decode { .. }) => {
                // Every problem of the plan at once — fields of the wrong type included —
                // unless the request itself is malformed.
                let codec = wire::codec_of(headers);
                return match flotilla_model::lenient::validate_request_problems(
                    codec,
                    &req.message.payload,
                    &ctx,
                ) {
                    Ok(errors) => {
                        let reply = ValidatePlanReply {
                            protocol: PROTOCOL_VERSION,
                            errors,
                            warnings: Vec::new(),
                        };
                        respond_json(&req, self.max_payload(), &reply).await;
                    }
                    Err(own) => {
                        let message = own
                            .iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>()
                            .join("; ");
                        respond_error(&req, 400, ErrorCode::Malformed, message).await;
                    }
                };
            }
            Err(e) => {
                return respond_error(&req, 400, ErrorCode::Malformed, e.to_string()).await;
            }
        };
        if let Err(e) = check_protocol(r.protocol) {
            return respond_error(&req, 400, ErrorCode::UnsupportedProtocol, e.to_string()).await;
        }
        let report = validate_plan(&r.plan, &ctx);
        let mut warnings = report.warnings;
        let pools: std::collections::BTreeSet<&str> =
            r.plan.subtasks.iter().map(|t| t.pool.as_str()).collect();
        if let Some(missing) = self
            .live
            .pools_without_workers(pools, Timestamp::now().unix_ms())
        {
            for pool in missing {
                warnings.push(Problem::new(
                    ProblemCode::NoLiveWorker,
                    "subtasks",
                    format!("no live worker serves pool {pool:?}"),
                ));
            }
        }
        if ctx.agents.is_none() {
            warnings.extend(
                self.live.unserved_agents(
                    r.plan
                        .subtasks
                        .iter()
                        .map(|t| (t.id.as_str(), t.pool.as_str(), t.agent.as_deref())),
                    Timestamp::now().unix_ms(),
                ),
            );
        }
        let reply = ValidatePlanReply {
            protocol: PROTOCOL_VERSION,
            errors: flotilla_model::validate::truncate_problems(
                report.errors,
                flotilla_model::validate::MAX_REPORTED_PROBLEMS,
            ),
            warnings,
        };
        respond_json(&req, self.max_payload(), &reply).await;
    }
}

/// The outcome carried by a run-terminal event, if this event message has one.
pub(crate) fn terminal_outcome(msg: &async_nats::Message) -> Option<RunOutcome> {
    flotilla_model::event::run_end_in(wire::codec_of(msg.headers.as_ref()), &msg.payload)
        .ok()
        .flatten()
}
