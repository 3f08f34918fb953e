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
use flotilla_model::time::Timestamp;
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
    /// returns its outcome; `unavailable` when `until` passes first. No consumer is created on
    /// the server ([`Bus::find_in_subject`](flotilla_bus::Bus::find_in_subject)): a stream
    /// allows a limited number, and every waiting parent would hold one.
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
                |headers, payload| run_outcome(child, headers, payload),
            )
            .await
            .map_err(|e| unavailable("following the child's events", e))?;
        found.ok_or_else(|| {
            ContextError::new(
                ErrorKind::Unavailable,
                format!("child run {child} did not end in time"),
            )
        })
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
        let reply = tokio::time::timeout(
            bus.options().request_timeout,
            bus.client().request(subject, Bytes::from(body)),
        )
        .await
        .map_err(|_| {
            ContextError::new(
                ErrorKind::Unavailable,
                "no coordinator answered child.start in time",
            )
        })?
        .map_err(|e| unavailable("asking a coordinator to start a child run", e))?;
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

/// The outcome in an event message of `run`, if it holds the run's end.
fn run_outcome(
    run: RunId,
    headers: Option<&async_nats::HeaderMap>,
    payload: &[u8],
) -> Option<RunOutcome> {
    flotilla_model::event::run_end_in(wire::codec_of(headers), payload).unwrap_or_else(|e| {
        warn!(%run, error = %e, "Skipping an undecodable event message of a child run");
        None
    })
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
