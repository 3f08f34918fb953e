//! Child runs: an agent uses another agent (agent-as-tool) by starting a run of it that is a
//! child in the run tree, and waiting for its outcome.
//!
//! A child run is a run like any other (record, run log, events, tasks on workers) whose
//! submission carries a parent link: the parent run, task and call, and the tree's root, whose
//! workspace and mailboxes the child shares; it shares the parent's session state too.
//!
//! **Never lost, never doubled.** The child's run id is derived from the attempt id and the
//! call (`RunHandle::child_run_id`), and the coordinator (`child.start`: workers may not
//! submit runs themselves) publishes the submission as the run's first message
//! (`Nats-Expected-Last-Subject-Sequence: 0`): a redelivered attempt that makes the same call
//! re-attaches to the child its crashed predecessor started. Waiting reads the child's event
//! stream from its start, so an outcome that arrived while nobody waited is found.
//!
//! **Rejected children are errors.** A child whose submission the coordinator rejects (an
//! unknown agent, or the tree's limits: `tree_too_deep`, `tree_too_large`) never runs; waiting
//! for it answers `child_rejected` with the problems ([`ContextError::problems`]) instead of an
//! outcome, and records `rejected.<root>.<attempt>` in the cursors bucket, so the agent that
//! gives up on it fails for good ([`Clients::rejected_child`]) rather than being retried
//! with a fresh attempt that would start a fresh subtree and be rejected again.
//!
//! **One trace.** `child.start` requests carry the attempt's W3C trace context as
//! `traceparent` / `tracestate` headers — the current span's when spans are exported (the
//! agent's `execute_tool` or `invoke_agent` span), else the envelope's — which the
//! coordinator puts on the child's submission, so the child run is part of its parent's trace.
//!
//! **Cancelled with the parent.** Each start leaves a marker
//! `children.<root>.<attempt>.<child>` in the cursors bucket; when an attempt ends without
//! success the worker cancels the children it started ([`Clients::cancel_children`]), also
//! those started by an exec agent's `flotilla call` processes or a crashed delivery.

use std::time::Duration;

use bytes::Bytes;
use flotilla_bus::wire;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::api::{
    ApiError, ApiRequest, CancelRunRequest, ChildStartReply, ChildStartRequest,
};
use flotilla_model::codec::Codec;
use flotilla_model::event::{Event, EventBatch, EventEnvelope};
use flotilla_model::ids::{RunId, SessionId, TaskId};
use flotilla_model::plan::{Plan, PlanConfig, Subtask};
use flotilla_model::run::{RunHandle, RunOutcome};
use flotilla_model::subjects::{Bucket, StreamKind};
use flotilla_model::submit::SubmitRequest;
use flotilla_model::task::{TaskErrorKind, TraceContext};
use flotilla_model::time::Timestamp;
use flotilla_model::validate::{Problem, ProblemCode};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tracing::warn;

use crate::Clients;
use crate::error::{ContextError, ErrorKind, unavailable};

/// What to run as a child.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChildCall {
    /// The agent definition to run.
    pub agent: String,
    /// The instruction (the child task's description).
    #[serde(default)]
    pub description: String,
    /// Free-form input for the agent.
    #[serde(default)]
    pub input: serde_json::Value,
    /// Worker pool (default: `default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Topics the child task writes (in the root's workspace).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub produces: Vec<String>,
    /// Per-attempt time limit of the child task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<Duration>,
    /// Identifies the call within the attempt (a model's tool call id). Calls without one
    /// are numbered in the order the attempt makes them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call_id: Option<String>,
    /// Session-state key the child's result is written to when it succeeds (the child
    /// task's `output_key`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_key: Option<String>,
}

/// What `rejected.<root>.<attempt>` in the cursors bucket holds: a child run of the attempt
/// that was rejected, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RejectedChild {
    /// The rejected child run.
    pub child: RunId,
    /// Its problems.
    pub problems: Vec<Problem>,
}

impl RejectedChild {
    /// The problems' codes, comma separated (`tree_too_deep`, …).
    pub fn codes(&self) -> String {
        self.problems
            .iter()
            .map(|p| p.code.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// A started (or re-attached) child run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChildRun {
    /// The child's handle (its run id, parent link and root).
    pub handle: RunHandle,
    /// `false` when the child already existed: a redelivered attempt re-attached to it.
    pub created: bool,
}

impl Clients {
    /// Starts the child run of `call` (or re-attaches to it). Needs an attempt scope.
    pub async fn start_child(&self, call: &ChildCall) -> Result<ChildRun, ContextError> {
        let scope = self.scope();
        let (Some(task), Some(attempt)) = (scope.task_id.clone(), scope.attempt_id) else {
            return Err(ContextError::new(
                ErrorKind::InvalidScope,
                "starting a child run needs a task attempt (FLOTILLA_ATTEMPT_ID)",
            ));
        };
        check_agent(&call.agent)?;
        let call_key = match &call.call_id {
            Some(id) => {
                flotilla_model::token::check_token(id).map_err(|e| {
                    ContextError::new(ErrorKind::Malformed, format!("call id {id:?} {e}"))
                })?;
                id.clone()
            }
            None => {
                let k = self
                    .handles
                    .child_calls
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                format!("call{k}")
            }
        };
        let child = RunHandle::child_run_id(attempt, &call_key);
        let parent = RunHandle {
            run_id: scope.run_id,
            agent_id: None,
            parent_run_id: None,
            parent_tool_call_id: Some(call_key),
            parent_task_id: Some(task),
            root_run_id: Some(scope.root_run_id),
        };
        let mut subtask = Subtask::new(child_task_id(&call.agent).as_str(), &call.description)
            .with_agent(&call.agent);
        subtask.input = call.input.clone();
        subtask.produces = call.produces.clone();
        subtask.output_key = call.output_key.clone();
        if let Some(pool) = &call.pool {
            subtask.pool = pool.clone();
        }
        if let Some(t) = call.timeout {
            subtask.timeout = Some(t.into());
        }
        let mut request = SubmitRequest::new(Plan {
            name: Some(format!("{} (child of {})", call.agent, scope.run_id)),
            query: None,
            subtasks: vec![subtask],
            config: PlanConfig::default(),
            fork: None,
        });
        request.protocol = PROTOCOL_VERSION;
        request.run_id = Some(child);
        request.parent = Some(parent.clone());
        request.session_id = scope.session.parse::<SessionId>().ok();
        // The marker first: a crash between the two leaves a marker of a child that never
        // started (cancelling it is a no-op), never a child nobody can cancel.
        self.mark_child(child).await?;
        let created = self.request_child_start(request).await?;
        let handle = RunHandle {
            run_id: child,
            agent_id: None,
            parent_run_id: Some(parent.run_id),
            parent_tool_call_id: parent.parent_tool_call_id,
            parent_task_id: parent.parent_task_id,
            root_run_id: parent.root_run_id,
        };
        Ok(ChildRun { handle, created })
    }

    /// Announces `child` on this run's event stream (`agent_run_started`). The event id is
    /// derived from the child (`<run>.child.<child>`), so a re-attaching delivery's
    /// announcement is dropped as a duplicate. Best effort, like every agent event.
    pub async fn announce_child(&self, child: &RunHandle, agent: &str) {
        let scope = self.scope();
        let envelope = EventEnvelope {
            protocol: PROTOCOL_VERSION,
            id: format!("{}.child.{}", scope.run_id, child.run_id),
            run_id: scope.run_id,
            task_id: scope.task_id.clone(),
            attempt: scope.attempt,
            ts: Timestamp::now(),
            source: format!("task/{}", scope.task_id.as_ref().map_or("", TaskId::as_str)),
            event: Event::AgentRunStarted {
                child: child.clone(),
                agent: Some(agent.to_owned()),
            },
        };
        let batch = EventBatch::new(scope.run_id, vec![envelope]);
        let bus = self.bus();
        match wire::encode(&batch, Codec::Json, Some(&batch.msg_id())) {
            Ok(out) => {
                if let Err(e) = bus
                    .publish_retrying(
                        bus.names().event(scope.run_id),
                        out,
                        tokio::time::Instant::now() + crate::RIDE_OUT,
                    )
                    .await
                {
                    warn!(child = %child.run_id, error = %e, "Could not announce a child run");
                }
            }
            Err(e) => warn!(error = %e, "Could not encode a child run's announcement"),
        }
    }

    /// Waits until run `child` ends (event-driven, reading its events from the start) and
    /// returns its outcome; `unavailable` when `until` passes first. A child that was rejected
    /// never ran: that is the error `child_rejected`, carrying its problems, and it is
    /// recorded for the attempt ([`rejected_child`](Self::rejected_child)). No consumer is
    /// created on the server ([`Bus::find_in_subject`](flotilla_bus::Bus::find_in_subject)):
    /// a stream allows a limited number, and every waiting parent would hold one.
    pub async fn wait_child(
        &self,
        child: RunId,
        until: Instant,
    ) -> Result<RunOutcome, ContextError> {
        let bus = self.bus();
        let found = bus
            .find_in_subject(
                StreamKind::Events,
                &bus.names().event(child),
                until,
                |headers, payload| run_end(child, headers, payload),
            )
            .await
            .map_err(|e| unavailable("following the child's events", e))?;
        let Some((outcome, problems)) = found else {
            return Err(ContextError::new(
                ErrorKind::Unavailable,
                format!("child run {child} did not end in time"),
            ));
        };
        if outcome.status != flotilla_model::run::RunStatus::Rejected {
            return Ok(outcome);
        }
        let problems = if problems.is_empty() {
            problems_in(outcome.reason.as_deref().unwrap_or_default())
        } else {
            problems
        };
        let rejected = RejectedChild { child, problems };
        self.mark_rejected(&rejected).await;
        let scope = self.scope();
        let handle = RunHandle {
            run_id: child,
            agent_id: None,
            parent_run_id: Some(scope.run_id),
            parent_tool_call_id: None,
            parent_task_id: scope.task_id.clone(),
            root_run_id: Some(scope.root_run_id),
        };
        Err(ContextError::child_rejected(handle, rejected.problems))
    }

    /// The child run of this attempt that was rejected, if one was (by any delivery or
    /// process of the attempt, such as an exec agent's `flotilla call`): what an agent that
    /// gives up checks, so its failure is `child_rejected` (final) instead of a retry.
    pub async fn rejected_child(&self) -> Result<Option<RejectedChild>, ContextError> {
        let Some(key) = self.rejected_key() else {
            return Ok(None);
        };
        let entry = self
            .cursors_kv()
            .await?
            .get(&key)
            .await
            .map_err(|e| unavailable("reading the attempt's rejected child", e))?;
        Ok(entry.and_then(|v| serde_json::from_slice(&v).ok()))
    }

    fn rejected_key(&self) -> Option<String> {
        let scope = self.scope();
        scope
            .attempt_id
            .map(|a| format!("rejected.{}.{a}", scope.root_run_id))
    }

    /// Records a rejected child for the attempt (best effort: the error reaches the caller
    /// either way).
    async fn mark_rejected(&self, rejected: &RejectedChild) {
        let Some(key) = self.rejected_key() else {
            return;
        };
        let Ok(body) = serde_json::to_vec(rejected) else {
            return;
        };
        let stored = match self.cursors_kv().await {
            Ok(kv) => kv
                .put(&key, Bytes::from(body))
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = stored {
            warn!(child = %rejected.child, error = %e, "Could not record a rejected child run");
        }
    }

    /// Cancels the unfinished children started by this attempt (by any of its deliveries and
    /// processes). Returns how many cancel requests were sent; a child that already ended
    /// ignores its request.
    pub async fn cancel_children(&self, reason: &str) -> Result<usize, ContextError> {
        let scope = self.scope();
        let Some(attempt) = scope.attempt_id else {
            return Ok(0);
        };
        let bus = self.bus();
        let children: Vec<RunId> = bus
            .kv_keys_under(
                Bucket::Cursors,
                &format!("children.{}.{attempt}.", scope.root_run_id),
            )
            .await?
            .iter()
            .filter_map(|k| k.parse().ok())
            .collect();
        for child in &children {
            let request = CancelRunRequest {
                protocol: PROTOCOL_VERSION,
                run_id: *child,
                reason: Some(reason.to_owned()),
                by: Some(format!(
                    "parent {}/{}",
                    scope.run_id,
                    scope.task_id.as_ref().map_or("", TaskId::as_str)
                )),
                rollback: false,
            };
            let body = serde_json::to_vec(&request)
                .map_err(|e| ContextError::with_source(ErrorKind::Malformed, "encoding", e))?;
            if let Err(e) = bus
                .client()
                .request(bus.names().api("run.cancel"), Bytes::from(body))
                .await
            {
                warn!(%child, error = %e, "Could not cancel a child run");
            }
        }
        Ok(children.len())
    }

    /// Asks the coordinator to start the child (`child.start`): workers hold no right to
    /// submit runs themselves. Returns whether the child was created (else re-attached).
    async fn request_child_start(&self, submission: SubmitRequest) -> Result<bool, ContextError> {
        let child = submission.run_id;
        let body = serde_json::to_vec(&ChildStartRequest {
            protocol: PROTOCOL_VERSION,
            submission,
        })
        .map_err(|e| ContextError::with_source(ErrorKind::Malformed, "encoding", e))?;
        let bus = self.bus();
        let subject = bus.names().api(ChildStartRequest::ENDPOINT);
        let mut headers = async_nats::HeaderMap::new();
        if let Some(trace) = self.trace() {
            headers.insert(wire::TRACEPARENT, trace.traceparent.as_str());
            if let Some(state) = &trace.tracestate {
                headers.insert("tracestate", state.as_str());
            }
        }
        let body = Bytes::from(body);
        // A coordinator restarting (a rolling upgrade, a pod moved) leaves `child.start`
        // without responders for a moment: asked again until the request timeout, which is
        // safe because a child's run id is derived from the call (a second ask re-attaches).
        let timeout = bus.options().request_timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        let mut pause = Duration::from_millis(50);
        let reply = loop {
            let sent = tokio::time::timeout_at(
                deadline,
                bus.client()
                    .request_with_headers(subject.clone(), headers.clone(), body.clone()),
            )
            .await
            .map_err(|_| {
                ContextError::new(
                    ErrorKind::Unavailable,
                    format!("no coordinator answered child.start within {timeout:?}"),
                )
            })?;
            match sent {
                Ok(reply) => break reply,
                Err(e)
                    if e.kind() == async_nats::RequestErrorKind::NoResponders
                        && tokio::time::Instant::now() + pause < deadline =>
                {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                Err(e) => {
                    return Err(unavailable("asking a coordinator to start a child run", e));
                }
            }
        };
        let failed = reply
            .headers
            .as_ref()
            .is_some_and(|h| h.get("Nats-Service-Error-Code").is_some());
        if failed {
            let e: ApiError = serde_json::from_slice(&reply.payload).map_err(|e| {
                ContextError::with_source(ErrorKind::Malformed, "reading child.start's error", e)
            })?;
            let kind = match e.status {
                404 => ErrorKind::NotFound,
                503 | 504 => ErrorKind::Unavailable,
                413 => ErrorKind::PayloadTooLarge,
                _ => ErrorKind::InvalidScope,
            };
            return Err(ContextError::new(
                kind,
                format!(
                    "child.start refused child run {child:?}: {} ({})",
                    e.message, e.code
                ),
            ));
        }
        let ok: ChildStartReply = serde_json::from_slice(&reply.payload).map_err(|e| {
            ContextError::with_source(ErrorKind::Malformed, "reading child.start's answer", e)
        })?;
        Ok(ok.created)
    }

    /// The trace context a child run started now joins: the current span's while spans are
    /// exported (so the child nests under the tool call that started it), else the attempt's.
    pub fn trace(&self) -> Option<TraceContext> {
        flotilla_telemetry::trace_context::current().or_else(|| self.scope().trace.clone())
    }

    async fn mark_child(&self, child: RunId) -> Result<(), ContextError> {
        let scope = self.scope();
        let Some(attempt) = scope.attempt_id else {
            return Ok(());
        };
        let key = format!("children.{}.{attempt}.{child}", scope.root_run_id);
        self.cursors_kv()
            .await?
            .put(&key, Bytes::from_static(b"1"))
            .await
            .map(|_| ())
            .map_err(|e| unavailable("recording a child run", e))
    }
}

/// The failure of a child that binds its caller too: when the child failed because the run
/// tree's budget is spent (`budget_exhausted`) or a child of its own was refused
/// (`child_rejected`), the caller giving up on it fails with that kind — final, since a new
/// attempt of the caller would meet the same budget or limit — instead of `agent_failed`,
/// which would be retried with a fresh subtree.
pub fn binding_failure(outcome: &RunOutcome) -> Option<TaskErrorKind> {
    if outcome.status != flotilla_model::run::RunStatus::Failed {
        return None;
    }
    outcome.failed.iter().map(|f| f.error.kind).find(|k| {
        matches!(
            k,
            TaskErrorKind::BudgetExhausted | TaskErrorKind::ChildRejected
        )
    })
}

/// The outcome in an event message of `run`, with the problems of its run-ending event, if
/// the message holds the run's end.
fn run_end(
    run: RunId,
    headers: Option<&async_nats::HeaderMap>,
    payload: &[u8],
) -> Option<(RunOutcome, Vec<Problem>)> {
    let events = flotilla_model::event::decode_events(wire::codec_of(headers), payload)
        .map_err(
            |e| warn!(%run, error = %e, "Skipping an undecodable event message of a child run"),
        )
        .ok()?;
    events.into_iter().find_map(|e| match e.event {
        Event::Workflow(w) if w.phase.ends_run() => w.outcome.map(|o| (*o, w.problems)),
        _ => None,
    })
}

/// The problems of a rejection as its outcome's `reason` lists them (`[code] path: message`,
/// joined by `; `): for a `run_rejected` event that does not carry them as `problems`.
fn problems_in(reason: &str) -> Vec<Problem> {
    let code_at = |i: usize| -> Option<(ProblemCode, usize)> {
        let rest = reason.get(i..)?.strip_prefix('[')?;
        let end = rest.find(']')?;
        let code =
            serde_json::from_value(serde_json::Value::String(rest[..end].to_owned())).ok()?;
        Some((code, i + end + 2))
    };
    let starts: Vec<usize> = std::iter::once(0)
        .chain(reason.match_indices("; [").map(|(i, _)| i + 2))
        .filter(|&i| code_at(i).is_some())
        .collect();
    let mut out = Vec::with_capacity(starts.len());
    for (n, &start) in starts.iter().enumerate() {
        let Some((code, body)) = code_at(start) else {
            continue;
        };
        let end = starts.get(n + 1).map_or(reason.len(), |&next| next - 2);
        let text = reason.get(body..end).unwrap_or_default().trim();
        // `path: message` when the first word ends with a colon and holds no space.
        let (path, message) = match text.split_once(": ") {
            Some((p, m)) if !p.is_empty() && !p.contains(' ') => (p, m),
            _ => ("", text),
        };
        out.push(Problem::new(code, path, message));
    }
    out
}

/// The child's single task is named after the agent (its mailbox address in the tree).
fn child_task_id(agent: &str) -> TaskId {
    TaskId::new(agent)
}

fn check_agent(agent: &str) -> Result<(), ContextError> {
    flotilla_model::token::check_token(agent).map_err(|e| {
        ContextError::new(ErrorKind::Malformed, format!("agent name {agent:?} {e}"))
    })?;
    if agent.starts_with('_') {
        return Err(ContextError::new(
            ErrorKind::Malformed,
            format!("agent name {agent:?} starts with `_`, which task ids reserve"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rejections_reason_gives_back_its_problems() {
        let reason = "[tree_too_deep] the child would be at depth 9; coordinator.max-depth is 8; [unknown_agent] subtasks[0].agent: agent \"ghost\" is not defined";
        let problems = problems_in(reason);
        let codes: Vec<_> = problems.iter().map(|p| p.code).collect();
        assert_eq!(
            codes,
            vec![ProblemCode::TreeTooDeep, ProblemCode::UnknownAgent]
        );
        assert_eq!(
            problems[0].message,
            "the child would be at depth 9; coordinator.max-depth is 8"
        );
        assert_eq!(problems[0].path, "");
        assert_eq!(problems[1].path, "subtasks[0].agent");
        assert_eq!(problems[1].message, "agent \"ghost\" is not defined");
        assert!(problems_in("no codes here").is_empty());
        assert!(problems_in("[not_a_code] x").is_empty());
    }
}
