//! The [`Agent`] trait: what a worker runs for a task.
//!
//! An agent receives the task envelope (instruction, input, predecessors' results) and an
//! [`AgentContext`]: cancellation, deadline, an event emitter, and the collaboration clients
//! of its attempt (workspace, mailbox, session state, artifacts). It returns a reply or an
//! error. The worker owns everything else: heartbeats, timeouts, retries (via the
//! coordinator), result publication, and committing the mailbox read position when the
//! attempt succeeds.
//!
//! The trait lives here, below the worker, so that every crate implementing agents (the
//! worker's built-in ones, the LLM agent) imports it without depending on the worker.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use flotilla_bus::{Bus, wire};

use crate::{Artifacts, Clients, Mailbox, Scope, State, Workspace};
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::codec::Codec;
use flotilla_model::event::{Event, EventEnvelope};
use flotilla_model::task::{TaskEnvelope, TaskErrorKind};
use flotilla_model::time::Timestamp;
use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

/// What an agent answers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AgentReply {
    /// The answer.
    pub response: String,
    /// Tokens spent.
    pub tokens: u64,
    /// Tools used.
    pub tools_used: Vec<String>,
    /// The salient number, if the agent knows it (otherwise it is extracted from the response).
    pub numeric_value: Option<f64>,
    /// How sure the agent is, 0 to 1, if it says (otherwise a JSON answer's `confidence`).
    pub confidence: Option<f64>,
}

impl AgentReply {
    /// A plain text reply.
    pub fn text(response: impl Into<String>) -> Self {
        Self {
            response: response.into(),
            ..Self::default()
        }
    }
}

/// Why an agent failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct AgentError {
    /// Kind (usually `agent_failed`).
    pub kind: TaskErrorKind,
    /// Detail.
    pub message: String,
}

impl AgentError {
    /// An `agent_failed` error.
    pub fn failed(message: impl Into<String>) -> Self {
        Self {
            kind: TaskErrorKind::AgentFailed,
            message: message.into(),
        }
    }

    /// A `cancelled` error: what an agent returns once `AgentContext::cancel` fired.
    pub fn cancelled(message: impl Into<String>) -> Self {
        Self {
            kind: TaskErrorKind::Cancelled,
            message: message.into(),
        }
    }
}

/// Publishes an agent's events to the run's event stream.
#[derive(Clone)]
pub struct EventEmitter {
    bus: Option<Bus>,
    run_id: flotilla_model::RunId,
    task_id: flotilla_model::TaskId,
    attempt: u32,
    source: String,
    id_prefix: String,
    counter: Arc<AtomicU64>,
}

impl fmt::Debug for EventEmitter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventEmitter")
            .field("run_id", &self.run_id)
            .field("task_id", &self.task_id)
            .finish()
    }
}

impl EventEmitter {
    /// An emitter for one delivery of an attempt (`bus: None` drops events, for tests). Event
    /// ids are `<run>.<attempt id>.<delivery>.<n>`: unique per attempt and per delivery, so a
    /// redelivered attempt's events are not dropped as duplicates of its predecessor's.
    pub fn new(bus: Option<Bus>, task: &TaskEnvelope, worker_id: &str, delivery: i64) -> Self {
        Self {
            bus,
            run_id: task.run_id,
            task_id: task.task_id.clone(),
            attempt: task.attempt,
            source: format!("worker/{worker_id}"),
            // A continued attempt (after a suspension) is told apart by its segment.
            id_prefix: match task.resume.as_ref().map_or(0, |r| r.segment) {
                0 => format!("{}.{}.{delivery}", task.run_id, task.attempt_id),
                segment => format!("{}.{}.r{segment}.{delivery}", task.run_id, task.attempt_id),
            },
            counter: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Publishes an event. Events are best effort: a failure is logged, not returned, so an
    /// agent never fails because its progress could not be shown.
    pub async fn emit(&self, event: Event) {
        let Some(bus) = &self.bus else { return };
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let batch = self.batch(format!("{}.{n}", self.id_prefix), event);
        match wire::encode(&batch, Codec::Json, Some(&batch.msg_id())) {
            Ok(out) => {
                // Fire and forget: the acknowledgement is collected by the client.
                if let Err(e) = bus
                    .js()
                    .publish_with_headers(bus.names().event(self.run_id), out.headers, out.payload)
                    .await
                {
                    tracing::debug!(error = %e, "Could not publish an agent event");
                }
            }
            Err(e) => tracing::debug!(error = %e, "Could not encode an agent event"),
        }
    }
}

impl EventEmitter {
    /// One event of this attempt as the message that carries it.
    fn batch(&self, id: String, event: Event) -> flotilla_model::event::EventBatch {
        let envelope = EventEnvelope {
            protocol: PROTOCOL_VERSION,
            id,
            run_id: self.run_id,
            task_id: Some(self.task_id.clone()),
            attempt: Some(self.attempt),
            ts: Timestamp::now(),
            source: self.source.clone(),
            event,
        };
        flotilla_model::event::EventBatch::new(self.run_id, vec![envelope])
    }

    /// Publishes an event with the given `id` (also its `Nats-Msg-Id`) and waits until the
    /// server has stored it — for records a later delivery of the attempt must find, such as
    /// the journal of an LLM agent's steps. The id must be the same on every delivery that
    /// records the same thing, so a repeat is dropped by JetStream's de-duplication; that also
    /// makes sending again safe, so a stream without a leader for a moment is ridden out
    /// ([`RIDE_OUT`](crate::RIDE_OUT)).
    pub async fn record(&self, id: String, event: Event) -> Result<(), String> {
        let Some(bus) = &self.bus else { return Ok(()) };
        let batch = self.batch(id, event);
        let out = wire::encode(&batch, Codec::Json, Some(&batch.msg_id()))
            .map_err(|e| format!("encoding: {e}"))?;
        bus.publish_retrying(
            bus.names().event(self.run_id),
            out,
            tokio::time::Instant::now() + crate::RIDE_OUT,
        )
        .await
        .map_err(|e| e.to_string())?;
        Ok(())
    }
}

/// What an agent gets besides the envelope.
#[derive(Debug, Clone)]
pub struct AgentContext {
    /// Cancelled when the attempt times out or the worker stops: stop promptly.
    pub cancel: CancellationToken,
    /// When the attempt's time budget runs out.
    pub deadline: Instant,
    /// Publishes agent events (replies, tool calls, usage) to the run's stream.
    pub events: EventEmitter,
    /// The worker running it.
    pub worker_id: String,
    /// The attempt's run tree, session and identity.
    pub scope: Arc<Scope>,
    clients: Clients,
    /// The worker slot the attempt occupies, given back while it waits for children.
    slot: crate::WorkerSlot,
    /// Where the agent leaves the tool call it stopped at to wait for a person.
    suspension: Suspension,
    /// Whether the run is held (paused, taken over), as the worker hears it.
    hold: Option<tokio::sync::watch::Receiver<bool>>,
}

/// Where an attempt stopped to wait ([`AgentContext::suspend`], [`AgentContext::suspend_held`]):
/// shared between the agent's context and the worker, which reports it instead of a result.
#[derive(Debug, Clone, Default)]
pub struct Suspension(Arc<std::sync::Mutex<Option<Stop>>>);

/// Why an attempt stopped.
#[derive(Debug, Clone, PartialEq)]
pub enum Stop {
    /// At a tool call that waits for a person.
    Call(flotilla_model::runlog::SuspendedCall),
    /// At a step boundary, because its run is held (paused, taken over).
    Held,
}

impl Suspension {
    /// Where the attempt stopped, if it did.
    pub fn take(&self) -> Option<Stop> {
        self.0.lock().ok().and_then(|mut s| s.take())
    }
}

impl AgentContext {
    /// Stops the attempt at `call` to wait for a person: return the error this gives. The
    /// worker then reports the suspension (not a failure), gives the slot back, and the
    /// attempt continues — on any worker — once the call is decided, from its step journal.
    pub fn suspend(&self, call: flotilla_model::runlog::SuspendedCall) -> AgentError {
        let message = format!(
            "waits for a person at tool call {} ({})",
            call.call_id, call.tool
        );
        if let Ok(mut s) = self.suspension.0.lock() {
            *s = Some(Stop::Call(call));
        }
        AgentError::failed(message)
    }

    /// Whether the attempt's run is held (paused or taken over): an agent that can stop at a
    /// step boundary and continue from its journal (the LLM agent) stops at its next one with
    /// [`suspend_held`](Self::suspend_held); others finish.
    pub fn held(&self) -> bool {
        self.hold.as_ref().is_some_and(|h| *h.borrow())
    }

    /// Stops the attempt because its run is held: return the error this gives. The worker
    /// reports the suspension and gives the slot back; the attempt continues from its step
    /// journal once the run is resumed.
    pub fn suspend_held(&self) -> AgentError {
        if let Ok(mut s) = self.suspension.0.lock() {
            *s = Some(Stop::Held);
        }
        AgentError::failed("stopped at a step boundary: the run is held")
    }

    /// The context with whether the attempt's run is held, as its worker hears it (true
    /// while the run is paused or taken over; false again once it is resumed).
    pub fn with_hold(mut self, hold: tokio::sync::watch::Receiver<bool>) -> Self {
        self.hold = Some(hold);
        self
    }

    /// The handle the worker reads a suspension from.
    pub fn suspension(&self) -> Suspension {
        self.suspension.clone()
    }

    /// The context of one attempt; the scope is the clients'.
    pub fn new(
        clients: Clients,
        cancel: CancellationToken,
        deadline: Instant,
        events: EventEmitter,
        worker_id: impl Into<String>,
    ) -> Self {
        Self {
            cancel,
            deadline,
            events,
            worker_id: worker_id.into(),
            scope: clients.scope_arc(),
            clients,
            slot: crate::WorkerSlot::default(),
            suspension: Suspension::default(),
            hold: None,
        }
    }

    /// The context with the worker slot the attempt occupies ([`crate::WorkerSlot`]):
    /// [`call_agent`](Self::call_agent) gives it back while it waits for the child.
    pub fn with_slot(mut self, slot: crate::WorkerSlot) -> Self {
        self.slot = slot;
        self
    }

    /// Workspace topics of the run tree (append, read, watch, artifacts by reference).
    pub fn workspace(&self) -> Workspace {
        self.clients.workspace()
    }

    /// The task's mailbox. Every handle shares the attempt's read position; the worker
    /// commits it when the attempt succeeds.
    pub fn mailbox(&self) -> Mailbox {
        self.clients.mailbox()
    }

    /// Session state.
    pub fn state(&self) -> State {
        self.clients.state()
    }

    /// Artifacts of the run tree.
    pub fn artifacts(&self) -> Artifacts {
        self.clients.artifacts()
    }

    /// All clients of the attempt (for passing on, e.g. to a process's environment).
    pub fn clients(&self) -> &Clients {
        &self.clients
    }

    /// Uses another agent as a tool: starts a child run of `call.agent` (or re-attaches to
    /// the one a crashed delivery of this attempt started), announces it on this run's event
    /// stream (`agent_run_started`), and waits — giving the attempt's worker slot back
    /// meanwhile, so the child can run even in a full pool — until it ends, the attempt's
    /// deadline passes or the attempt is cancelled. Returns the child's handle and outcome; a
    /// failed child is an outcome, not an error. A rejected child (it never ran: an invalid
    /// plan, or the tree's `tree_too_deep` / `tree_too_large` limits) is the error
    /// `child_rejected`, with the problems and the child's handle
    /// ([`ContextError::problems`](crate::ContextError::problems),
    /// [`rejected_child`](crate::ContextError::rejected_child)); it is final: asking again is
    /// rejected alike.
    pub async fn call_agent(
        &self,
        call: &crate::ChildCall,
    ) -> Result<(crate::ChildRun, flotilla_model::run::RunOutcome), crate::ContextError> {
        let child = self.clients.start_child(call).await?;
        self.clients
            .announce_child(&child.handle, &call.agent)
            .await;
        let until = tokio::time::Instant::from_std(self.deadline);
        // Waiting holds no worker slot: the child may need it ([`crate::slot`]).
        let outcome = self
            .slot
            .released(async {
                tokio::select! {
                    o = self.clients.wait_child(child.handle.run_id, until) => o.map(Some),
                    () = self.cancel.cancelled() => Ok(None),
                }
            })
            .await
            .map_err(|e| match e.kind() {
                // The same rejection, with the handle this call knows in full.
                crate::ErrorKind::ChildRejected => {
                    crate::ContextError::child_rejected(child.handle.clone(), e.problems().to_vec())
                }
                _ => e,
            })?;
        let Some(outcome) = outcome else {
            return Err(crate::ContextError::new(
                crate::ErrorKind::Unavailable,
                format!(
                    "the attempt was cancelled while child run {} ran",
                    child.handle.run_id
                ),
            ));
        };
        Ok((child, outcome))
    }
}

/// Something that can perform a task.
pub trait Agent: Send + Sync + fmt::Debug {
    /// Runs one attempt. Must return soon after `ctx.cancel` fires.
    fn run<'a>(
        &'a self,
        task: &'a TaskEnvelope,
        ctx: AgentContext,
    ) -> BoxFuture<'a, Result<AgentReply, AgentError>>;
}
