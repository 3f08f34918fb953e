//! The collaboration endpoints: a run tree's workspace, mailboxes and session state, reached
//! by any NATS client with plain request/reply.
//!
//! | Subject | Request | Reply |
//! |---|---|---|
//! | `<prefix>.api.ws.append` | `WsAppendRequest` | `WsAppendReply` |
//! | `<prefix>.api.ws.read` | `WsReadRequest` | `WorkspacePage` |
//! | `<prefix>.api.mbox.send` | `MboxSendRequest` | `MboxSendReply` |
//! | `<prefix>.api.mbox.read` | `MboxReadRequest` | `MailboxPage` |
//! | `<prefix>.api.mbox.role`, `mbox.negotiate` | see [`negotiate`] | |
//! | `<prefix>.api.state.get` | `StateGetRequest` | `StateValue` |
//! | `<prefix>.api.state.list` | `StateListRequest` | `StateKeys` |
//! | `<prefix>.api.state.set` | `StateSetRequest` | `StateSetReply` |
//!
//! ```text
//! request ─► decode + protocol version ─► limits and writer fields ─► the run (404 unknown_run)
//!         ─► operator scope on the run's tree and session, with the request's writer identity
//!         ─► the flotilla-context client agents use ─► reply, or ApiError {status, code}
//! ```
//!
//! The endpoints use the same clients as agents and the CLI ([`flotilla_context`]), so names,
//! sizes, idempotency and paging follow the same rules, and a [`ContextError`]'s
//! [`code`](ContextError::code) and [`status`](flotilla_context::ErrorKind::status) become
//! the answer's. Every check runs before anything is written: a refused request stores
//! nothing.
//!
//! * **Runs.** The run is read from the run store (its record, else — accepted but not
//!   started yet — its submission); an unknown run is `404 unknown_run`. What the endpoints
//!   need of a run (its root, its session, its plan's tasks and their `produces`) never
//!   changes once it is accepted, so it is kept in a bounded cache.
//! * **Writers.** `ws.append` writes as `task_id` (a task of the run's plan, `400
//!   unknown_task` otherwise; under strict data flow only its declared topics, `400
//!   undeclared_topic`) or, outside a task, as `by` (default `operator`; a name of letters,
//!   digits, `_` and `-`, not the reserved `coordinator`). `mbox.send` sends as `from`: a task
//!   of the plan, or any other valid address for a client outside the plan (recorded with
//!   `by: operator`); a bad address is `400 invalid_address`. `attempt` belongs to a task.
//!   Other malformed identities are `400 invalid_writer`.
//! * **Limits.** Read limits outside 1..=1000 and `wait_ms` over 30,000 are refused (`400
//!   invalid_limit`), not clamped: a client learns the bound instead of silently getting
//!   less. A page whose JSON would not fit one NATS message is cut after the last entry that
//!   fits (`more: true`, `next_since_seq` at that entry), so every entry stays readable.
//! * **Sessions.** `state.*` act on `session_id`, else the run's session. Naming both a run
//!   and another session is `400 invalid_scope`.

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_nats::service::Request;
use flotilla_context::mailbox::check_address;
use flotilla_context::scope::OPERATOR;
use flotilla_context::{Clients, ContextError, Scope};
use flotilla_model::ErrorCode;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::api::{
    ApiError, ChildStartReply, ChildStartRequest, MAX_MBOX_WAIT_MS, MboxReadRequest, MboxSendReply,
    MboxSendRequest, StateGetRequest, StateKeys, StateListRequest, StateSetReply, StateSetRequest,
    WsAppendReply, WsAppendRequest, WsReadRequest,
};
use flotilla_model::ids::{RunId, SessionId, TaskId};
use flotilla_model::mailbox::{MAX_READ_LIMIT as MBOX_MAX_LIMIT, MailboxPage};
use flotilla_model::plan::{DataflowValidation, Plan};
use flotilla_model::run::RunHandle;
use flotilla_model::runlog::{RunInput, RunLogEntry};
use flotilla_model::state::StateValue;
use flotilla_model::token::{check_name, normalize_topic};
use flotilla_model::workspace::{MAX_READ_LIMIT as WS_MAX_LIMIT, WorkspacePage};
use serde::Serialize;
use tracing::{debug, warn};

use super::{Api, parse, respond_api_error, respond_json};

mod negotiate;
use crate::error::{StoreError, StoreErrorKind};
use crate::lineage::{root_of, session_of};
use crate::store::{First, FirstMessage};

/// Most bytes of plan facts the run cache holds before it starts over.
const CACHE_BYTES: usize = 8 * 1024 * 1024;

/// Room kept in a reply for a page's own fields next to its entries.
const PAGE_ROOM: usize = 1024;

/// The writer name the coordinator's own writes (automatic produce) carry: nobody else may
/// claim it.
const RESERVED_WRITER: &str = "coordinator";

/// What the endpoints need of a run. Fixed once the run is accepted.
#[derive(Debug)]
struct RunFacts {
    run: RunId,
    /// The root of its tree: whose workspace and mailboxes it uses.
    root: RunId,
    /// Its session-state key prefix.
    session: String,
    /// Its plan's data-flow validation.
    dataflow: DataflowValidation,
    /// Its plan's tasks with the topics each declares in `produces` (normalised); `None` when
    /// the run has no plan (rejected before one was recorded).
    tasks: Option<HashMap<TaskId, Vec<String>>>,
}

impl RunFacts {
    fn new(run: RunId, root: RunId, session: String, plan: Option<&Plan>) -> Self {
        Self {
            run,
            root,
            session,
            dataflow: plan.map_or(DataflowValidation::Lenient, |p| {
                p.config.dataflow_validation
            }),
            tasks: plan.map(|p| {
                p.subtasks
                    .iter()
                    .map(|t| {
                        let produces = t.produces.iter().map(|p| normalize_topic(p)).collect();
                        (t.id.clone(), produces)
                    })
                    .collect()
            }),
        }
    }

    /// Roughly the bytes it holds, for the cache's bound.
    fn weight(&self) -> usize {
        let tasks = self.tasks.as_ref().map_or(0, |tasks| {
            tasks
                .iter()
                .map(|(id, produces)| {
                    48 + id.as_str().len() + produces.iter().map(|p| 24 + p.len()).sum::<usize>()
                })
                .sum()
        });
        128 + self.session.len() + tasks
    }

    /// An operator's scope on the run: its tree, its session, no task identity.
    fn scope(&self, api: &Api) -> Scope {
        Scope::operator(
            api.store.bus().names().clone(),
            self.run,
            self.root,
            self.session.clone(),
        )
    }

    fn has_task(&self, task: &str) -> bool {
        self.tasks
            .as_ref()
            .is_some_and(|t| t.contains_key(&TaskId::new(task)))
    }

    /// The topics `task` declares, or `400 unknown_task`.
    fn produces(&self, task: &TaskId) -> Result<&[String], ApiError> {
        self.tasks
            .as_ref()
            .and_then(|t| t.get(task))
            .map(Vec::as_slice)
            .ok_or_else(|| {
                bad(
                    ErrorCode::UnknownTask,
                    format!(
                        "task_id {:?} is not a task of run {}; write outside a task with `by` instead",
                        task.as_str(),
                        self.run
                    ),
                )
            })
    }
}

/// Facts of the runs the endpoints were asked about, bounded by [`CACHE_BYTES`] (emptied
/// when full: a miss costs two reads).
#[derive(Debug, Default)]
pub(super) struct RunCache {
    inner: Mutex<CacheInner>,
}

#[derive(Debug, Default)]
struct CacheInner {
    runs: HashMap<RunId, Arc<RunFacts>>,
    bytes: usize,
}

impl RunCache {
    fn get(&self, run: RunId) -> Option<Arc<RunFacts>> {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.runs.get(&run).cloned()
    }

    fn put(&self, facts: Arc<RunFacts>) {
        let weight = facts.weight();
        if weight > CACHE_BYTES {
            return;
        }
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if inner.runs.contains_key(&facts.run) {
            return;
        }
        if inner.bytes + weight > CACHE_BYTES {
            inner.runs.clear();
            inner.bytes = 0;
        }
        inner.bytes += weight;
        inner.runs.insert(facts.run, facts);
    }
}

/// A `400` answer.
pub(super) fn bad(code: ErrorCode, message: impl Into<String>) -> ApiError {
    ApiError::new(400, code, message)
}

/// The answer for a context error: its code and status, and for a `conflict` the current
/// revision.
pub(super) fn context_error(e: ContextError) -> ApiError {
    let message = match std::error::Error::source(&e) {
        Some(source) => format!("{}: {source}", e.message()),
        None => e.message().to_owned(),
    };
    ApiError {
        current_revision: e.current_revision(),
        ..ApiError::new(e.kind().status(), e.kind().error_code(), message)
    }
}

/// The answer for a run-store error.
fn store_error(e: StoreError) -> ApiError {
    match e.kind() {
        StoreErrorKind::Nats => ApiError::new(503, ErrorCode::Unavailable, e.to_string()),
        _ => ApiError::new(500, ErrorCode::Internal, e.to_string()),
    }
}

/// Checks a read limit: absent (the default) or 1 to `max`.
fn check_limit(limit: Option<u32>, max: usize, default: usize) -> Result<Option<usize>, ApiError> {
    match limit {
        None => Ok(None),
        Some(n) if n >= 1 && n as usize <= max => Ok(Some(n as usize)),
        Some(n) => Err(bad(
            ErrorCode::InvalidLimit,
            format!(
                "limit {n} is out of range: give 1 to {max} (default {default}) and page with next_since_seq"
            ),
        )),
    }
}

/// Checks the writer name of a write outside a task.
fn check_writer_name(by: &str) -> Result<(), ApiError> {
    check_name(by).map_err(|e| {
        bad(
            ErrorCode::InvalidWriter,
            format!("by {by:?} {e}; writer names use letters, digits, `_` and `-`"),
        )
    })?;
    if by == RESERVED_WRITER {
        return Err(bad(
            ErrorCode::InvalidWriter,
            format!("by {by:?} is reserved for the coordinator's own writes"),
        ));
    }
    Ok(())
}

fn check_attempt(attempt: Option<u32>) -> Result<(), ApiError> {
    if attempt == Some(0) {
        return Err(bad(
            ErrorCode::InvalidWriter,
            "attempt 0 does not exist: attempts count from 1",
        ));
    }
    Ok(())
}

/// Counts the bytes of a JSON encoding without keeping them.
struct Counter(usize);

impl io::Write for Counter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn json_len<T: Serialize>(value: &T) -> usize {
    let mut counter = Counter(0);
    // Serialising a value that came from JSON cannot fail; an error only undercounts, and
    // the reply's own size check still answers `413 too_large` then.
    let _ = serde_json::to_writer(&mut counter, value);
    counter.0
}

/// How many of `items` fit a reply of `max_payload` bytes: at least one, so a reader always
/// moves on (one stored entry fits a message by construction).
fn fitting<T: Serialize>(items: &[T], max_payload: usize) -> usize {
    let budget = max_payload.saturating_sub(PAGE_ROOM);
    let mut used = 0;
    for (i, item) in items.iter().enumerate() {
        used += json_len(item) + 1;
        if used > budget {
            return i.max(1);
        }
    }
    items.len()
}

impl Api {
    /// Answers with `answer`'s value or error.
    pub(super) async fn answer<T: Serialize>(
        &self,
        req: &Request,
        endpoint: &str,
        answer: Result<T, ApiError>,
    ) {
        match answer {
            Ok(value) => respond_json(req, self.max_payload(), &value).await,
            Err(e) => {
                if e.status >= 500 {
                    warn!(endpoint, status = e.status, code = %e.code, error = %e.message, "API request failed");
                } else {
                    debug!(endpoint, status = e.status, code = %e.code, error = %e.message, "API request refused");
                }
                respond_api_error(req, &e).await;
            }
        }
    }

    /// What the endpoints need of `run`, or `404 unknown_run`.
    async fn run_facts(&self, run: RunId) -> Result<Arc<RunFacts>, ApiError> {
        if let Some(facts) = self.runs.get(run) {
            return Ok(facts);
        }
        let (root, session, started) = match self.store.load(run).await.map_err(store_error)? {
            Some(s) => (
                root_of(&s.snapshot.state),
                session_of(&s.snapshot.state),
                true,
            ),
            // Accepted but not started yet: its submission says the same (the rule of
            // `root_of` / `session_of`: the run is its own root; the session id, else the
            // root).
            None => {
                let (session, parent) =
                    match self.store.first_message(run).await.map_err(store_error)? {
                        Some(First {
                            content: FirstMessage::Submission { request, .. },
                            ..
                        }) => (request.session_id, request.parent),
                        Some(First {
                            content:
                                FirstMessage::Entry(RunLogEntry {
                                    input: RunInput::Submitted(s),
                                    ..
                                }),
                            ..
                        }) => (s.session_id, s.parent),
                        _ => return Err(unknown_run(run)),
                    };
                let root = parent.as_ref().map_or(run, RunHandle::root_run);
                let session = session.map_or_else(|| root.to_string(), |s| s.to_string());
                (root, session, false)
            }
        };
        let plan = match self.store.plan(run).await {
            Ok(plan) => plan,
            // A run rejected before its plan was recorded has none.
            Err(e) if e.kind() == StoreErrorKind::Decode => None,
            Err(e) => return Err(store_error(e)),
        };
        let facts = Arc::new(RunFacts::new(run, root, session, plan.as_ref()));
        // A started run's record is final in what is used here; a pending one's may still be
        // rejected (and lose its session), so it is read again next time.
        if started {
            self.runs.put(Arc::clone(&facts));
        }
        Ok(facts)
    }

    pub(super) fn clients(&self, scope: Scope) -> Result<Clients, ApiError> {
        Clients::new(self.store.bus().clone(), scope).map_err(context_error)
    }

    /// `ws.append`.
    pub(super) async fn ws_append(&self, req: Request) {
        let Some(r) = parse::<WsAppendRequest>(&req).await else {
            return;
        };
        let answer = self.append(r).await;
        self.answer(&req, "ws.append", answer).await;
    }

    async fn append(&self, r: WsAppendRequest) -> Result<WsAppendReply, ApiError> {
        check_attempt(r.attempt)?;
        match (&r.task_id, r.attempt, &r.by) {
            (Some(_), _, Some(by)) => {
                return Err(bad(
                    ErrorCode::InvalidWriter,
                    format!(
                        "give task_id (a task writes) or by (a writer outside a task, here {by:?}), not both"
                    ),
                ));
            }
            (None, Some(_), _) => {
                return Err(bad(
                    ErrorCode::InvalidWriter,
                    "attempt belongs to a task: give task_id with it",
                ));
            }
            (None, None, Some(by)) => check_writer_name(by)?,
            _ => {}
        }
        let facts = self.run_facts(r.run_id).await?;
        let mut scope = facts.scope(self);
        match &r.task_id {
            Some(task) => {
                scope.produces = Some(facts.produces(task)?.to_vec());
                scope.dataflow = facts.dataflow;
                scope.task_id = Some(task.clone());
                scope.attempt = r.attempt;
                scope.by = None;
            }
            None => scope.by = Some(r.by.unwrap_or_else(|| OPERATOR.to_owned())),
        }
        let appended = self
            .clients(scope)?
            .workspace()
            .append_with_key(&r.topic, r.entry, r.idempotency_key.as_deref())
            .await
            .map_err(context_error)?;
        Ok(WsAppendReply {
            protocol: PROTOCOL_VERSION,
            seq: appended.seq,
            topic: appended.topic,
            duplicate: appended.duplicate,
        })
    }

    /// `ws.read`.
    pub(super) async fn ws_read(&self, req: Request) {
        let Some(r) = parse::<WsReadRequest>(&req).await else {
            return;
        };
        let answer = self.read_workspace(r).await;
        self.answer(&req, "ws.read", answer).await;
    }

    async fn read_workspace(&self, r: WsReadRequest) -> Result<WorkspacePage, ApiError> {
        let limit = check_limit(
            r.limit,
            WS_MAX_LIMIT,
            flotilla_model::workspace::DEFAULT_READ_LIMIT,
        )?;
        let facts = self.run_facts(r.run_id).await?;
        let workspace = self.clients(facts.scope(self))?.workspace();
        let mut page = match &r.topic {
            Some(topic) => workspace.read(topic, r.since_seq, limit).await,
            None => workspace.read_all(r.since_seq, limit).await,
        }
        .map_err(context_error)?;
        let keep = fitting(&page.entries, self.max_payload());
        if keep < page.entries.len() {
            page.entries.truncate(keep);
            page.next_since_seq = page.entries.last().map_or(r.since_seq, |e| e.seq);
            page.more = true;
        }
        Ok(page)
    }

    /// `mbox.send`.
    pub(super) async fn mbox_send(&self, req: Request) {
        let Some(r) = parse::<MboxSendRequest>(&req).await else {
            return;
        };
        let answer = self.send(r).await;
        self.answer(&req, "mbox.send", answer).await;
    }

    async fn send(&self, r: MboxSendRequest) -> Result<MboxSendReply, ApiError> {
        check_address(&r.from).map_err(context_error)?;
        check_attempt(r.attempt)?;
        let facts = self.run_facts(r.run_id).await?;
        let from_task = facts.has_task(&r.from);
        if r.attempt.is_some() && !from_task {
            return Err(bad(
                ErrorCode::InvalidWriter,
                format!(
                    "attempt belongs to a task, and {:?} is not a task of run {}",
                    r.from, facts.run
                ),
            ));
        }
        let mut scope = facts.scope(self).with_task(TaskId::new(r.from.as_str()));
        scope.attempt = r.attempt;
        // A task sends as itself; anyone else is a client outside the plan.
        scope.by = (!from_task).then(|| OPERATOR.to_owned());
        let sent = self
            .clients(scope)?
            .mailbox()
            .send_with_key(
                &r.to,
                r.kind,
                r.payload,
                r.correlation_id.as_deref(),
                r.idempotency_key.as_deref(),
            )
            .await
            .map_err(context_error)?;
        Ok(MboxSendReply {
            protocol: PROTOCOL_VERSION,
            seq: sent.seq,
            n: sent.n,
            duplicate: sent.duplicate,
        })
    }

    /// `mbox.read`.
    pub(super) async fn mbox_read(&self, req: Request) {
        let Some(r) = parse::<MboxReadRequest>(&req).await else {
            return;
        };
        let answer = self.read_mailbox(r).await;
        self.answer(&req, "mbox.read", answer).await;
    }

    async fn read_mailbox(&self, r: MboxReadRequest) -> Result<MailboxPage, ApiError> {
        let limit = check_limit(
            r.limit,
            MBOX_MAX_LIMIT,
            flotilla_model::mailbox::DEFAULT_READ_LIMIT,
        )?;
        let wait = r.wait_ms.unwrap_or(0);
        if wait > MAX_MBOX_WAIT_MS {
            return Err(bad(
                ErrorCode::InvalidLimit,
                format!(
                    "wait_ms {wait} is more than {MAX_MBOX_WAIT_MS}; read again to wait longer"
                ),
            ));
        }
        let facts = self.run_facts(r.run_id).await?;
        let mailbox = self
            .clients(facts.scope(self).with_task(TaskId::new(r.reader.as_str())))?
            .mailbox();
        // Checks the reader before anything is read.
        mailbox.address().map_err(context_error)?;
        let start = match r.since_seq {
            Some(since) => {
                mailbox.seek(since).await;
                since
            }
            None => mailbox.position().await.map_err(context_error)?,
        };
        let mut page = mailbox
            .receive(limit, Duration::from_millis(wait))
            .await
            .map_err(context_error)?;
        let keep = fitting(&page.messages, self.max_payload());
        if keep < page.messages.len() {
            page.messages.truncate(keep);
            page.next_since_seq = page.messages.last().map_or(start, |m| m.seq);
            page.more = true;
            // What was cut is read (and committed) next time.
            mailbox.seek(page.next_since_seq).await;
        }
        if r.commit && page.next_since_seq > start {
            mailbox.commit().await.map_err(context_error)?;
        }
        Ok(page)
    }

    /// The scope of a session-state request: `session_id`, else the run's session.
    pub(super) async fn session_scope(
        &self,
        run: Option<RunId>,
        session: Option<SessionId>,
    ) -> Result<Scope, ApiError> {
        match (run, session) {
            (None, None) => Err(bad(
                ErrorCode::InvalidScope,
                "give run_id (its session is used) or session_id",
            )),
            (Some(run), session) => {
                let facts = self.run_facts(run).await?;
                if let Some(session) = session
                    && session.to_string() != facts.session
                {
                    return Err(bad(
                        ErrorCode::InvalidScope,
                        format!(
                            "run {run} belongs to session {}, not {session}; give one of run_id and session_id",
                            facts.session
                        ),
                    ));
                }
                Ok(facts.scope(self))
            }
            (None, Some(session)) => {
                // State operations use only the session; its id stands in for the run.
                let stand_in = RunId::from_uuid(*session.as_uuid());
                Ok(Scope::operator(
                    self.store.bus().names().clone(),
                    stand_in,
                    stand_in,
                    session.to_string(),
                ))
            }
        }
    }

    /// `state.get`.
    pub(super) async fn state_get(&self, req: Request) {
        let Some(r) = parse::<StateGetRequest>(&req).await else {
            return;
        };
        let answer = self.get_state(r).await;
        self.answer(&req, "state.get", answer).await;
    }

    async fn get_state(&self, r: StateGetRequest) -> Result<StateValue, ApiError> {
        let scope = self.session_scope(r.run_id, r.session_id).await?;
        let session = scope.session.clone();
        let value = self
            .clients(scope)?
            .state()
            .get(&r.key)
            .await
            .map_err(context_error)?;
        value.ok_or_else(|| {
            ApiError::new(
                404,
                ErrorCode::NotFound,
                format!("state key {:?} is not set in session {session}", r.key),
            )
        })
    }

    /// `state.list`: the session's keys, without Flotilla's own (session grants).
    pub(super) async fn state_list(&self, req: Request) {
        let Some(r) = parse::<StateListRequest>(&req).await else {
            return;
        };
        let answer = async {
            let page = r
                .page()
                .map_err(|m| ApiError::new(400, ErrorCode::InvalidLimit, m))?;
            let scope = self.session_scope(r.run_id, r.session_id).await?;
            let session_id = scope.session.clone();
            let mut keys: Vec<String> = self
                .clients(scope)?
                .state()
                .list()
                .await
                .map_err(context_error)?
                .into_iter()
                .filter(|k| !k.starts_with(flotilla_model::approval::GRANT_PREFIX))
                .filter(|k| r.after.as_ref().is_none_or(|a| k > a))
                .collect();
            keys.sort();
            let more = keys.len() > page;
            keys.truncate(page);
            Ok(StateKeys {
                protocol: PROTOCOL_VERSION,
                session_id,
                keys,
                more,
            })
        }
        .await;
        self.answer(&req, "state.list", answer).await;
    }

    /// `state.set`.
    pub(super) async fn state_set(&self, req: Request) {
        let Some(r) = parse::<StateSetRequest>(&req).await else {
            return;
        };
        let answer = self.set_state(r).await;
        self.answer(&req, "state.set", answer).await;
    }

    async fn set_state(&self, r: StateSetRequest) -> Result<StateSetReply, ApiError> {
        let scope = self.session_scope(r.run_id, r.session_id).await?;
        let state = self.clients(scope)?.state();
        let revision = match r.expected_revision {
            Some(expected) => state.compare_and_set(&r.key, &r.value, expected).await,
            None => state.set(&r.key, &r.value).await,
        }
        .map_err(context_error)?;
        Ok(StateSetReply {
            protocol: PROTOCOL_VERSION,
            revision,
        })
    }
}

/// `404 unknown_run`.
impl Api {
    /// `child.start`.
    pub(super) async fn child_start(&self, req: Request) {
        let Some(r) = parse::<ChildStartRequest>(&req).await else {
            return;
        };
        let trace = crate::intake::header_trace(req.message.headers.as_ref());
        let answer = self.start_child(r, trace).await;
        self.answer(&req, "child.start", answer).await;
    }

    /// Publishes the child's submission as its run's first message, with the caller's trace
    /// context (so the child's run is in its parent's trace), then links it from the parent:
    /// the parent's `agent_run_started` event, under the same event id the parent's worker
    /// uses, so a child is in `run.tree`, `watch` and `session.get` however it was started.
    async fn start_child(
        &self,
        r: ChildStartRequest,
        trace: Option<flotilla_model::task::TraceContext>,
    ) -> Result<ChildStartReply, ApiError> {
        let mut submission = r.submission;
        let invalid = |m: String| bad(ErrorCode::InvalidParent, m);
        let child = submission
            .run_id
            .ok_or_else(|| invalid("a child run's submission names its run_id".into()))?;
        let parent = submission
            .parent
            .clone()
            .ok_or_else(|| invalid("a child run's submission has a parent link".into()))?;
        if let Some(p) = flotilla_model::validate::check_parent(&parent, child).first() {
            return Err(invalid(p.message.clone()));
        }
        if submission.idempotency_key.is_some() {
            return Err(invalid(
                "a child run is identified by its run_id, not an idempotency key".into(),
            ));
        }
        let task = parent
            .parent_task_id
            .clone()
            .ok_or_else(|| invalid("the parent link names the parent task".into()))?;
        let facts = self.run_facts(parent.run_id).await?;
        facts.produces(&task)?;
        if parent.root_run() != facts.root {
            return Err(invalid(format!(
                "the parent link names root {} but run {} belongs to the tree of {}",
                parent.root_run(),
                parent.run_id,
                facts.root
            )));
        }
        if let Some(s) = submission.session_id
            && s.to_string() != facts.session
        {
            return Err(bad(
                ErrorCode::InvalidScope,
                format!(
                    "a child run shares its parent's session {}, not {s}",
                    facts.session
                ),
            ));
        }
        // A child shares its parent's session (its session id, else its root's id).
        if submission.session_id.is_none() {
            submission.session_id = facts.session.parse().ok();
        }
        submission.protocol = PROTOCOL_VERSION;
        let bus = self.store.bus();
        let mut out = flotilla_bus::wire::encode(
            &submission,
            flotilla_model::codec::Codec::Json,
            Some(&format!("submit.{child}")),
        )
        .map_err(|e| bad(ErrorCode::Malformed, e.to_string()))?;
        flotilla_bus::wire::expect_first(&mut out.headers);
        if let Some(t) = &trace {
            out.headers
                .insert(flotilla_bus::wire::TRACEPARENT, t.traceparent.as_str());
            if let Some(state) = &t.tracestate {
                out.headers.insert("tracestate", state.as_str());
            }
        }
        if out.payload.len() > bus.max_payload() {
            return Err(ApiError::new(
                413,
                ErrorCode::PlanTooLarge,
                format!(
                    "the child's submission is {} bytes; the max payload is {}",
                    out.payload.len(),
                    bus.max_payload()
                ),
            ));
        }
        let created = match bus
            .publish_encoded(bus.names().submit_run(child), out)
            .await
        {
            Ok(_) => true,
            Err(e) if e.kind() == flotilla_bus::PublishErrorKind::NotFirst => false,
            Err(e) => return Err(ApiError::new(503, ErrorCode::Unavailable, e.to_string())),
        };
        self.link_child(&parent, child, &submission).await?;
        Ok(ChildStartReply {
            protocol: PROTOCOL_VERSION,
            run_id: child,
            created,
        })
    }
}

impl Api {
    /// The parent's `agent_run_started` link to `child`. Its event id is the one the parent's
    /// worker announces the child under (`<parent>.child.<child>`), and the message id is the
    /// batch's, so the link is stored once whoever publishes it first.
    async fn link_child(
        &self,
        parent: &RunHandle,
        child: RunId,
        submission: &flotilla_model::submit::SubmitRequest,
    ) -> Result<(), ApiError> {
        let agent = submission
            .plan
            .as_ref()
            .and_then(|p| p.subtasks.first())
            .and_then(|t| t.agent.clone());
        let handle = RunHandle {
            run_id: child,
            agent_id: None,
            parent_run_id: Some(parent.run_id),
            parent_tool_call_id: parent.parent_tool_call_id.clone(),
            parent_task_id: parent.parent_task_id.clone(),
            root_run_id: Some(parent.root_run()),
        };
        let envelope = flotilla_model::event::EventEnvelope {
            protocol: PROTOCOL_VERSION,
            id: format!("{}.child.{child}", parent.run_id),
            run_id: parent.run_id,
            task_id: parent.parent_task_id.clone(),
            attempt: None,
            ts: flotilla_model::time::Timestamp::now(),
            source: "coordinator".into(),
            event: flotilla_model::event::Event::AgentRunStarted {
                child: handle,
                agent,
            },
        };
        let batch = flotilla_model::event::EventBatch::new(parent.run_id, vec![envelope]);
        let bus = self.store.bus();
        bus.publish(
            bus.names().event(parent.run_id),
            &batch,
            Some(&batch.msg_id()),
        )
        .await
        .map_err(|e| ApiError::new(503, ErrorCode::Unavailable, e.to_string()))?;
        Ok(())
    }
}

fn unknown_run(run: RunId) -> ApiError {
    ApiError::new(
        404,
        ErrorCode::UnknownRun,
        format!("run {run} does not exist"),
    )
}

#[cfg(test)]
mod tests {
    use flotilla_model::submit::SubmitRequest;
    use flotilla_model::validate::ValidationContext;

    use super::*;
    use crate::intake::Intake;
    use crate::live::LiveWorkers;
    use crate::store::RunStore;

    #[tokio::test]
    async fn a_run_accepted_but_not_started_resolves_from_its_submission() -> anyhow::Result<()> {
        let server = flotilla_testkit::NatsServer::start().await?;
        let bus = server.provisioned_bus().await?;
        let store = RunStore::open(&bus).await?;
        let live = LiveWorkers::new(Duration::from_secs(30));
        let ctx = ValidationContext::default();
        let api = Api {
            approvals: crate::approval_store::ApprovalStore::new(bus.clone()),
            intake: Arc::new(Intake::new(
                store.clone(),
                ctx.clone(),
                live.clone(),
                flotilla_telemetry::Metrics::new(),
                crate::planner::PlannerOptions::default(),
                Arc::new(crate::lineage::Lineages::new(
                    store.clone(),
                    crate::lineage::TreeLimits {
                        max_depth: 8,
                        max_runs: 100,
                    },
                )),
            )),
            store,
            ctx,
            live,
            runs: RunCache::default(),
            shutdown: tokio_util::sync::CancellationToken::new(),
        };
        let run = RunId::new();
        let err = api.run_facts(run).await.expect_err("no such run");
        assert_eq!((err.status, err.code.as_str()), (404, "unknown_run"));

        // The submission is the run's first message; no coordinator has started it.
        let plan: Plan = serde_json::from_value(serde_json::json!({
            "subtasks": [{"id": "draft", "produces": ["Quarterly Figures"]}]
        }))?;
        let mut request = SubmitRequest::new(plan);
        let session = SessionId::new();
        request.run_id = Some(run);
        request.session_id = Some(session);
        bus.publish(bus.names().submit_run(run), &request, None)
            .await?;
        let facts = api.run_facts(run).await.expect("pending run");
        assert_eq!(
            (facts.root, facts.session.as_str()),
            (run, session.to_string().as_str())
        );
        assert_eq!(facts.dataflow, DataflowValidation::Strict);
        assert_eq!(
            facts.produces(&TaskId::new("draft")).expect("a task"),
            ["quarterly_figures".to_string()]
        );
        assert_eq!(
            facts
                .produces(&TaskId::new("ghost"))
                .expect_err("no task")
                .code,
            "unknown_task"
        );
        // Not cached until started: a pending run may still be rejected.
        assert!(api.runs.get(run).is_none());
        Ok(())
    }

    #[test]
    fn limits_are_checked_not_clamped() {
        assert_eq!(check_limit(None, 1000, 200).ok(), Some(None));
        assert_eq!(check_limit(Some(5), 1000, 200).ok(), Some(Some(5)));
        assert_eq!(check_limit(Some(1000), 1000, 200).ok(), Some(Some(1000)));
        for n in [0, 1001, u32::MAX] {
            let e = check_limit(Some(n), 1000, 200).expect_err("out of range");
            assert_eq!((e.status, e.code.as_str()), (400, "invalid_limit"));
            assert!(e.message.contains("1000"), "{}", e.message);
        }
    }

    #[test]
    fn writer_names() {
        assert!(check_writer_name("billing-service").is_ok());
        for bad in ["", "a b", "a.b", "coordinator", &"x".repeat(65)] {
            let e = check_writer_name(bad).expect_err(bad);
            assert_eq!(e.code, "invalid_writer", "{bad}");
        }
        assert!(check_attempt(Some(0)).is_err());
        assert!(check_attempt(Some(1)).is_ok() && check_attempt(None).is_ok());
    }

    #[test]
    fn pages_are_cut_to_fit_but_never_empty() {
        let items: Vec<String> = (0..10).map(|_| "x".repeat(300)).collect();
        assert_eq!(fitting(&items, 1 << 20), 10);
        // 303 bytes per item (quotes and a comma): 3 fit in 2,048 − 1,024.
        assert_eq!(fitting(&items, 2048), 3);
        assert_eq!(fitting(&items, 10), 1);
        assert_eq!(fitting::<String>(&[], 10), 0);
    }

    #[test]
    fn context_errors_keep_code_status_and_revision() {
        let e = context_error(ContextError::conflict("lost", 7));
        assert_eq!(
            (e.status, e.code.as_str(), e.current_revision),
            (409, "conflict", Some(7))
        );
        let e = context_error(ContextError::new(
            flotilla_context::ErrorKind::EntryTooLarge,
            "big",
        ));
        assert_eq!((e.status, e.code.as_str()), (413, "entry_too_large"));
    }
}
