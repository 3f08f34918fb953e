//! The per-run event stream (`<prefix>.event.<run>`).
//!
//! Every run has its own stream of events. Workers emit agent events (replies, tool calls,
//! usage); the coordinator emits `workflow` events as tasks and the run change state. Each
//! event has a deterministic `id`, so a consumer can drop the rare duplicate that survives
//! JetStream's de-duplication window after a coordinator crash.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::{AttemptId, RunId, TaskId};
use crate::plan::StrategyChoice;
use crate::problem::Problem;
use crate::run::{RunHandle, RunOutcome};
use crate::task::TaskError;
use crate::time::Timestamp;

/// The version of event messages: since 2, one message carries every event of one step.
pub const EVENT_PROTOCOL_VERSION: u32 = 2;

/// One message on a run's event subject: the events of one coordinator step (or of one
/// worker emission), in order. Each event keeps its own deterministic `id`, so a follower
/// that must be exact drops repeats by it (a step re-performed after a crash may repeat
/// events in a new message).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct EventBatch {
    /// Event message version: 2.
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// The events, in order.
    pub events: Vec<EventEnvelope>,
}

impl EventBatch {
    /// A batch of `events` of `run`.
    pub fn new(run_id: RunId, events: Vec<EventEnvelope>) -> Self {
        Self {
            protocol: EVENT_PROTOCOL_VERSION,
            run_id,
            events,
        }
    }

    /// The batch's `Nats-Msg-Id`: its first and last event ids, so a re-performed step
    /// repeats the same id and a merged batch gets a new one.
    pub fn msg_id(&self) -> String {
        match (self.events.first(), self.events.last()) {
            (Some(a), Some(b)) if self.events.len() > 1 => format!("{}..{}", a.id, b.id),
            (Some(a), _) => a.id.clone(),
            _ => format!("{}.empty", self.run_id),
        }
    }
}

/// Reads the events of one event message: a batch (protocol 2) or, from older publishers,
/// a single event (protocol 1).
pub fn decode_events(
    codec: crate::codec::Codec,
    payload: &[u8],
) -> Result<Vec<EventEnvelope>, crate::codec::CodecError> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Message {
        Batch(EventBatch),
        Single(Box<EventEnvelope>),
    }
    match codec.decode::<Message>(payload)? {
        Message::Batch(b) => {
            crate::codec::check_protocol_of("event message", b.protocol, EVENT_PROTOCOL_VERSION)?;
            Ok(b.events)
        }
        Message::Single(e) => Ok(vec![*e]),
    }
}

/// The outcome carried by an event message, when it holds its run's end (a run-terminal
/// workflow event).
pub fn run_end_in(
    codec: crate::codec::Codec,
    payload: &[u8],
) -> Result<Option<crate::run::RunOutcome>, crate::codec::CodecError> {
    Ok(decode_events(codec, payload)?
        .into_iter()
        .find_map(|e| match e.event {
            Event::Workflow(w) if w.phase.ends_run() => w.outcome.map(|o| *o),
            _ => None,
        }))
}

/// An event as published.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct EventEnvelope {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// Deterministic id, also the `Nats-Msg-Id`.
    pub id: String,
    /// The run.
    pub run_id: RunId,
    /// The task, for task-level events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<TaskId>,
    /// The attempt, for task-level events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    /// When it happened.
    pub ts: Timestamp,
    /// Who emitted it: `coordinator`, `worker/<worker id>` (an agent's events), or
    /// `task/<task id>` (a child run's link, written by the starting task's attempt — the same
    /// on every worker and delivery).
    pub source: String,
    /// The event.
    pub event: Event,
}

/// Event kinds (DESIGN §1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    /// Text the agent says to the user. A streaming agent sends the text in increments as it
    /// arrives (`final` absent or false: append to what came before), then once more in full
    /// with `final: true` (replace what came before).
    AssistantReply {
        /// The text: an increment, or the whole reply when `final`.
        text: String,
        /// This event carries the whole reply of one model turn.
        #[serde(rename = "final", default, skip_serializing_if = "std::ops::Not::not")]
        is_final: bool,
    },
    /// The agent's reasoning, for debug audiences. Reserved: nothing in Flotilla emits it
    /// yet.
    PlannerThought {
        /// The text.
        text: String,
    },
    /// A tool call started.
    ToolStart {
        /// Call id.
        call_id: String,
        /// Tool name.
        tool: String,
        /// Arguments.
        #[serde(default)]
        input: serde_json::Value,
    },
    /// Partial output of a running tool call: a call to an agent of the NATS Agent Protocol
    /// (`flotilla call agents:…` from an exec agent, `call_agent` with an `agents:` target
    /// from an LLM agent) emits one per streamed piece (`{"text"}`) and per question the
    /// agent asked (`{"query", "answered"}`; answered by a person through an approval:
    /// `approval_id`, `status`, `reply`), so its answer can be followed before it ends.
    ToolUpdate {
        /// Call id.
        call_id: String,
        /// Partial output.
        #[serde(default)]
        output: serde_json::Value,
    },
    /// A tool call finished.
    ToolEnd {
        /// Call id.
        call_id: String,
        /// Whether it succeeded.
        ok: bool,
        /// Output.
        #[serde(default)]
        output: serde_json::Value,
        /// The child run, when the tool was an agent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        run_link: Option<RunHandle>,
        /// The tool's name.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tool: Option<String>,
        /// How long the call took, in milliseconds.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        duration_ms: Option<u64>,
        /// Why it failed (also handed to the model as the tool's result).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    /// The agent asked the user a question (its `ask_user` tool) and its attempt waits for
    /// the answer: a pending approval of trigger `question` (answer it with
    /// `flotilla runs answer RUN TOKEN`, or `approval.answer` with `respond`). Published by
    /// the coordinator once the request is stored, so the token can be answered at once.
    AwaitClarification {
        /// The question.
        question: String,
        /// The reply token: the approval id to answer (absent on events of older
        /// coordinators, which workers published).
        #[serde(default, skip_serializing_if = "String::is_empty")]
        token: String,
    },
    /// The agent called a tool the client runs (the plan's `client_tools` or the agent's
    /// `client-tools`) and its attempt waits for the result: a pending approval of trigger
    /// `client_tool` per call. Published by the coordinator once the request is stored.
    AwaitExternalTools {
        /// The calls waiting (one per event: the attempt stops at the first).
        calls: Vec<ExternalToolCall>,
    },
    /// Token usage of one model call.
    Usage {
        /// Prompt tokens.
        prompt_tokens: u64,
        /// Completion tokens.
        completion_tokens: u64,
        /// The model that answered (as the provider reports it, else as requested).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        model: Option<String>,
        /// Time from sending the request to the end of the reply, in milliseconds.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        latency_ms: Option<u64>,
        /// The call's cost in US dollars, when the agent has a price.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cost_usd: Option<f64>,
    },
    /// Run and task lifecycle.
    Workflow(WorkflowEvent),
    /// A child run started (the run-tree link).
    AgentRunStarted {
        /// The child.
        child: RunHandle,
        /// The agent the child runs (its name in the configuration).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        agent: Option<String>,
    },
    /// One step of an LLM agent's attempt, journaled so that a redelivered attempt (its
    /// worker died) resumes from it instead of calling the model or the tools again. A
    /// debugging record: user-facing views skip it.
    AgentStep {
        /// The attempt the step belongs to (the same on every delivery of the attempt).
        attempt_id: AttemptId,
        /// Position in the attempt, from 0: model replies and tool rounds alternate.
        step: u32,
        /// What happened.
        entry: StepEntry,
    },
}

/// A journaled step of an LLM agent's attempt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StepEntry {
    /// The model's reply to one call.
    ModelReply {
        /// Its text.
        #[serde(default)]
        content: String,
        /// The tools it called.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        tool_calls: Vec<StepToolCall>,
        /// Prompt tokens of the call.
        prompt_tokens: u64,
        /// Completion tokens of the call.
        completion_tokens: u64,
        /// The model that answered.
        model: String,
    },
    /// The results of one round of tool calls, in call order, as handed to the model.
    ToolResults {
        /// One per call.
        results: Vec<String>,
    },
}

/// A tool call of a journaled model reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct StepToolCall {
    /// The call's id.
    pub id: String,
    /// The tool.
    pub name: String,
    /// Its arguments, as the model wrote them (JSON text).
    pub arguments: String,
}

/// A tool call to be executed by the client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ExternalToolCall {
    /// Call id (the model's).
    pub call_id: String,
    /// Tool name.
    pub tool: String,
    /// Arguments, checked against the tool's parameters.
    #[serde(default)]
    pub input: serde_json::Value,
    /// The reply token: the approval id whose `respond` carries the tool's result.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub token: String,
}

/// A lifecycle change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WorkflowEvent {
    /// What happened.
    pub phase: WorkflowPhase,
    /// Number of tasks (on `run_started`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks_total: Option<u32>,
    /// The worker (on `task_started`, and on the task's outcome).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    /// The agent definition that runs the task (on task-level events: the task's `agent`,
    /// or the deployment's default agent; for an anycast task — a `role` and no `agent` —
    /// the member of the role that claimed it, absent on events before a claim).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// The task's role (on task-level events, when the plan names one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// When the worker started the attempt (worker clock), on the task's outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Timestamp>,
    /// The error (on `task_failed`, `task_retrying`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<TaskError>,
    /// When the retry is due (on `task_retrying`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_at: Option<Timestamp>,
    /// Free-text detail (skip reason, rejection summary).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// The outcome (on run-terminal phases).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Box<RunOutcome>>,
    /// The strategy chosen and why (on `run_started`, and on `run_planned`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<StrategyChoice>,
    /// Problems of a planner answer (on `plan_repairing`, and on `run_failed` when planning
    /// failed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<Problem>,
    /// What a bare query's run took from memory (on `run_started`): a past plan reused, or
    /// the planner called and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Box<crate::memory::MemoryUse>>,
    /// The approval (on `approval_requested` and `approval_decided`): its id within the run;
    /// the request itself is in the escalations bucket under `<run>.<approval_id>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_id: Option<String>,
    /// An incident Flotilla records against the task's agent and role (their trust drops to
    /// novice at once), in words: on `approval_decided` when a person rejected with
    /// `incident`, on `task_failed` when a sensitive action failed. The supervisor records
    /// it, once per reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incident: Option<String>,
}

impl WorkflowEvent {
    /// An event with only a phase.
    pub fn phase(phase: WorkflowPhase) -> Self {
        Self {
            phase,
            tasks_total: None,
            worker: None,
            agent: None,
            role: None,
            started_at: None,
            error: None,
            retry_at: None,
            detail: None,
            outcome: None,
            strategy: None,
            problems: Vec::new(),
            memory: None,
            approval_id: None,
            incident: None,
        }
    }
}

/// Lifecycle phases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WorkflowPhase {
    /// The run was accepted and scheduling began.
    RunStarted,
    /// A worker began an attempt.
    TaskStarted,
    /// A task succeeded.
    TaskSucceeded,
    /// An attempt failed and a retry is scheduled.
    TaskRetrying,
    /// A task failed for good.
    TaskFailed,
    /// A task will not run.
    TaskSkipped,
    /// The run succeeded.
    RunSucceeded,
    /// The run failed.
    RunFailed,
    /// The plan was rejected.
    RunRejected,
    /// The run was cancelled.
    RunCancelled,
    /// A bare query's planner answered with a valid plan; the run continues with it
    /// (`tasks_total` is the planned plan's).
    RunPlanned,
    /// A planner answer had problems (`problems`); the planner runs again with them.
    PlanRepairing,
    /// A member was recruited into the run: `task_id` is the task added, `role` its role,
    /// `detail` the reason, `tasks_total` the plan's new size.
    MemberRecruited,
    /// A member was retired from the run's team: `agent` is the member, `detail` the reason
    /// and what became of its tasks.
    MemberRetired,
    /// The run refused a recruit that reached its run log (`detail` says why).
    RecruitRefused,
    /// Under the `supervisor` strategy, the lead assigned a task: it may run once its
    /// dependencies are met (`task_id`; `detail` is who assigned it and why).
    TaskAssigned,
    /// A task waits for a person's approval before it is dispatched (`approval_id`; `detail`
    /// is the trigger and the deadline). Its request is in the escalations bucket and on
    /// `<prefix>.notify.approval.<run>`.
    ApprovalRequested,
    /// A task's approval was decided (`approval_id`; `detail` is the decision and who made
    /// it), or — under `human_on_the_loop` — a sensitive task was dispatched with a notice.
    ApprovalDecided,
    /// A person paused the run (`detail`: who and why, and until when): nothing new is
    /// dispatched.
    RunPaused,
    /// The run resumed (`detail`: who, or the pause's deadline): dispatch continues.
    RunResumed,
    /// A person took the run over (`detail`: who and why, and until when): it is under human
    /// control.
    RunTakenOver,
    /// A running LLM attempt stopped at a step boundary because its run is held (paused or
    /// taken over): its slot is free; it continues from its step journal, the same attempt,
    /// once the run resumes (`attempt`, `worker`).
    TaskSuspended,
    /// A person edited the plan of the run under human control (`run.edit`): `tasks_total`
    /// is the edited plan's, `detail` says who, why, how many tasks were added and which
    /// changed.
    PlanEdited,
    /// A plan edit reached the run but was not applied (`detail` says why: the run was no
    /// longer under human control, or a task it changes had started meanwhile).
    PlanEditRefused,
    /// One task of the run was paused by itself (`run.pause` with `task_id`; a lead's
    /// `pause_member` tool): it is not dispatched, and a running LLM attempt of it stops at
    /// its next step boundary (`task_suspended`) — the rest of the run goes on. `detail`: who
    /// and why, and until when (then it resumes).
    TaskPaused,
    /// A paused task resumed (`detail`: who, or the pause's deadline): it runs once its
    /// dependencies are met, a suspended attempt from its journal.
    TaskResumed,
}

impl WorkflowPhase {
    /// Whether this phase ends the run.
    pub fn ends_run(self) -> bool {
        matches!(
            self,
            Self::RunSucceeded | Self::RunFailed | Self::RunRejected | Self::RunCancelled
        )
    }
}
