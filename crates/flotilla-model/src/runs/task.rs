//! What a worker receives and what it sends back.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::{AttemptId, RunId, SessionId, TaskId};
use crate::numeric::extract_numeric_value;
use crate::plan::Risk;
use crate::time::{Secs, Timestamp};

mod error;
pub use error::{TaskError, TaskErrorKind};

// A run's spending limits are set by its plan; task envelopes carry them.
pub use crate::plan::Budget;

/// W3C trace context carried with a task so one trace spans client → coordinator → worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TraceContext {
    /// The `traceparent` header value (`00-<trace-id>-<span-id>-<flags>`).
    pub traceparent: String,
    /// The `tracestate` header value, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
}

/// A task handed to a worker: published on `<prefix>.task.<pool>.<run>.<task>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TaskEnvelope {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run this task belongs to.
    pub run_id: RunId,
    /// The root of the run's tree, whose workspace and mailboxes the task shares (absent:
    /// the run is its own root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root_run_id: Option<RunId>,
    /// The run's session, whose state the task reads and writes (absent: the root run's id
    /// names the session).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<SessionId>,
    /// The task's id in the plan.
    pub task_id: TaskId,
    /// 1 for the first attempt, 2 for the first retry, …
    pub attempt: u32,
    /// Unique id of this attempt.
    pub attempt_id: AttemptId,
    /// Agent definition to run; `None` means the worker's default agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// Pool the task was queued on.
    pub pool: String,
    /// Team role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// The instruction.
    #[serde(default)]
    pub description: String,
    /// Kind of action (for policy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
    /// Risk of the action.
    #[serde(default)]
    pub risk: Risk,
    /// Whether the run fails if this task fails.
    pub required: bool,
    /// The run's query, if the plan had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query: Option<String>,
    /// Free-form input from the plan.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub input: serde_json::Value,
    /// Time budget of this attempt, counted from when a worker starts it.
    pub timeout: Secs,
    /// Results of every task this one transitively depends on.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub previous_results: BTreeMap<TaskId, DependencyResult>,
    /// Results of this task's direct dependencies.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub dependency_results: BTreeMap<TaskId, DependencyResult>,
    /// Workspace topics the task reads.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub consumes: Vec<String>,
    /// Workspace topics the task writes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub produces: Vec<String>,
    /// The run's spending limits (from the plan's `max_tokens` / `max_cost`); what has been
    /// spent is counted across workers (see `docs/protocol.md`, budgets).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<Budget>,
    /// Every budget the attempt's model calls count against, root of the tree first: each
    /// ancestor run's with a budget, then the run's own. A child run spends under its tree's
    /// budgets and may only narrow them; a call is made only when every scope has room.
    /// Empty: only `budget`, against the run itself (envelopes of older coordinators).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub budget_scopes: Vec<BudgetScope>,
    /// JSON Schema the answer must match (from the subtask's `output_schema`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_schema: Option<serde_json::Value>,
    /// Entries of the consumed topics present at dispatch, by topic (within the
    /// coordinator's byte budget; read on from each topic's `next_since_seq`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub consumed: crate::workspace::ConsumedTopics,
    /// The plan's data-flow mode: under `strict`, the task may write only the topics it
    /// `produces`.
    #[serde(default, skip_serializing_if = "is_strict")]
    pub dataflow_validation: crate::plan::DataflowValidation,
    /// When the coordinator dispatched this attempt (server time of the deciding input).
    pub dispatched_at: Timestamp,
    /// Trace context of the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<TraceContext>,
    /// Which of the attempt's tool calls wait for a person (LLM agents; absent: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_gate: Option<ToolGate>,
    /// Set when the attempt suspended earlier (at a tool call waiting for a person) and
    /// continues now: the agent rebuilds its conversation from its step journal, without
    /// calling the model or running a tool again, and applies the decisions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume: Option<Resume>,
    /// The run's client tools (the plan's `client_tools`), offered to an LLM agent next to
    /// its own: a call waits for the client's answer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub client_tools: Vec<crate::plan::ClientTool>,
    /// The model an LLM agent calls instead of its configured one (the subtask's `model`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// A fork at a step: the attempt's conversation starts with these steps of the original
    /// attempt, replayed from its journal (no model call, no tool run), and goes on live from
    /// the first step after them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept_steps: Option<crate::plan::KeptSteps>,
    /// The attempt's success decides its run (it is the last task and the run's result is
    /// its own): the worker answers the run's waiting submitters itself once its result is
    /// stored — one hop less than through a coordinator ([`TaskAnswer`]). Absent: the
    /// coordinator answers, as for every other attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<TaskAnswer>,
}

/// How the worker of an attempt whose success decides its run answers the run's waiting
/// submitters ([`TaskEnvelope::answer`]).
///
/// The worker stores its result on the run's log subject with
/// `Nats-Expected-Last-Subject-Sequence: after_seq`, marked `answered` — so it is stored only
/// if nothing else reached the run since the coordinator decided the success would end it —
/// and then publishes the `finished` [`crate::submit::SubmitReply`] to each of `reply_to`:
/// the outcome a coordinator then records from the log (succeeded, the final result made of
/// this task's result alone). When the append finds another input first, or the final result
/// would pass `final_result_budget / 2` bytes (a coordinator may store it as an artifact),
/// the result is stored unmarked and the coordinator answers as for any run — as when its
/// confidence is under `review_below`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TaskAnswer {
    /// The subjects waiting for the run's terminal answer (its `reply_to`, and an API
    /// submitter's wait inbox).
    pub reply_to: Vec<String>,
    /// The stream sequence of the run's last run-log message (`<prefix>.runlog.<run>`) the
    /// coordinator had applied; 0: none.
    pub after_seq: u64,
    /// Bytes of final result the deployment carries inline in outcomes.
    pub final_result_budget: u64,
    /// A result with a confidence under this is held for a person's review
    /// (`[hitl] low-confidence`) instead of ending the run: the coordinator answers then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub review_below: Option<f64>,
}

/// One budget a run's model calls count against: the limits of run `run_id` (the run itself
/// or an ancestor), whose spending is kept under `budget.<run_id>` in the cursors bucket.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct BudgetScope {
    /// The run whose budget this is.
    pub run_id: RunId,
    /// Its limits.
    #[serde(flatten)]
    pub limits: Budget,
}

/// A predecessor's result as injected into a dependent task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DependencyResult {
    /// The agent's answer.
    pub response: String,
    /// Tokens the agent spent.
    #[serde(default)]
    pub tokens: u64,
    /// Whether the task succeeded.
    pub success: bool,
    /// Tools the agent used.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools_used: Vec<String>,
    /// The salient number of the response: the agent's own, or, when it gives none, the one
    /// the worker extracts from the response text (the first percentage, else the first
    /// currency amount, else the last plain number).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numeric_value: Option<f64>,
}

/// What an agent produced for one attempt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TaskResult {
    /// The agent's answer (empty on failure).
    #[serde(default)]
    pub response: String,
    /// Tokens spent.
    #[serde(default)]
    pub tokens: u64,
    /// Whether the attempt succeeded.
    pub success: bool,
    /// Tools used.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools_used: Vec<String>,
    /// The salient number of the response.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numeric_value: Option<f64>,
    /// Why the attempt failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<TaskError>,
    /// How sure the agent is of the answer, 0 to 1, when it says: a successful result
    /// below the run's `[hitl] low-confidence` is held for review before its dependents run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confidence: Option<f64>,
}

/// The confidence an answer states: a JSON object's numeric `confidence` from 0 to 1 (the
/// shape an agent with an `output_schema` answers in); anything else states none.
pub fn stated_confidence(response: &str) -> Option<f64> {
    let trimmed = response.trim();
    if !trimmed.starts_with('{') {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(trimmed).ok()?;
    valid_confidence(v.get("confidence")?.as_f64()?)
}

/// `c` when it is a confidence (finite, 0 to 1).
pub fn valid_confidence(c: f64) -> Option<f64> {
    (c.is_finite() && (0.0..=1.0).contains(&c)).then_some(c)
}

impl TaskResult {
    /// A successful result; `numeric_value` is extracted from the response.
    pub fn success(response: impl Into<String>) -> Self {
        let response = response.into();
        let numeric_value = extract_numeric_value(&response);
        Self {
            response,
            tokens: 0,
            success: true,
            tools_used: Vec::new(),
            numeric_value,
            error: None,
            confidence: None,
        }
    }

    /// A failed result.
    pub fn failure(kind: TaskErrorKind, message: impl Into<String>) -> Self {
        Self {
            response: String::new(),
            tokens: 0,
            success: false,
            tools_used: Vec::new(),
            numeric_value: None,
            error: Some(TaskError {
                kind,
                message: message.into(),
            }),
            confidence: None,
        }
    }

    /// The view of this result injected into dependents.
    pub fn as_dependency(&self) -> DependencyResult {
        DependencyResult {
            response: self.response.clone(),
            tokens: self.tokens,
            success: self.success,
            tools_used: self.tools_used.clone(),
            numeric_value: self.numeric_value,
        }
    }
}

fn is_strict(d: &crate::plan::DataflowValidation) -> bool {
    *d == crate::plan::DataflowValidation::Strict
}

impl TaskEnvelope {
    /// The run whose workspace and mailboxes the task shares: the root of its run tree.
    pub fn root_run(&self) -> RunId {
        self.root_run_id.unwrap_or(self.run_id)
    }

    /// The session key prefix of the task's state: the session id, else the root run id.
    pub fn session(&self) -> String {
        self.session_id
            .map_or_else(|| self.root_run().to_string(), |s| s.to_string())
    }

    /// The `Nats-Msg-Id` of this attempt's task message: publishing the same attempt twice is
    /// dropped by JetStream.
    pub fn msg_id(&self) -> String {
        match &self.resume {
            Some(r) if r.segment > 0 => format!(
                "{}.r{}",
                task_msg_id(self.run_id, &self.task_id, self.attempt),
                r.segment
            ),
            _ => task_msg_id(self.run_id, &self.task_id, self.attempt),
        }
    }

    /// The person's decision about tool call `call_id` with these arguments, if any.
    pub fn decision_for(&self, call_id: &str, digest: &str) -> Option<&ToolDecision> {
        self.resume
            .as_ref()?
            .decisions
            .iter()
            .find(|d| d.call_id == call_id && d.digest == digest)
    }
}

/// Which tool calls of an LLM attempt wait for a person before they run (from the run's
/// escalation policy, see `flotilla_machine::policy::hitl::tool_gate`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
pub struct ToolGate {
    /// Every call (the agent is overseen `human_in_command`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub all: bool,
    /// Calls of tools with these names (lower-case; the deployment's and the plan's
    /// sensitive actions).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sensitive: Vec<String>,
    /// Calls of tools the agent does not have.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub out_of_scope: bool,
    /// Model calls estimated to cost more than this many US dollars (trigger `cost`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_limit: Option<f64>,
    /// A model call that would pass a budget asks a person to extend it (trigger `budget`)
    /// instead of failing the task.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub budget_ask: bool,
}

impl ToolGate {
    /// Why a call of `tool` waits for a person (`known`: the agent has that tool), if it
    /// does. A sensitive name outranks `human_in_command`.
    pub fn trigger(&self, tool: &str, known: bool) -> Option<crate::approval::Trigger> {
        use crate::approval::Trigger;
        if !known {
            return self.out_of_scope.then_some(Trigger::OutOfScope);
        }
        if self.sensitive.iter().any(|s| s.eq_ignore_ascii_case(tool)) {
            Some(Trigger::SensitiveAction)
        } else if self.all {
            Some(Trigger::HumanInCommand)
        } else {
            None
        }
    }
}

/// An attempt continuing after it suspended.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
pub struct Resume {
    /// How many times the attempt suspended so far (1 on its first resumption).
    pub segment: u32,
    /// The decisions about the calls it suspended at, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decisions: Vec<ToolDecision>,
}

/// A person's decision (or a deadline's default) about one tool call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ToolDecision {
    /// The approval.
    pub approval_id: String,
    /// The model's id of the call.
    pub call_id: String,
    /// The digest of the tool's name and arguments the decision is for: it applies to that
    /// call with those arguments only.
    pub digest: String,
    /// The decision: `approve` runs the tool, `edit` runs it with `input` as the
    /// arguments, `respond` gives `result` to the model as the tool's result without running
    /// it, `reject` gives the model `message` and never runs it.
    #[serde(flatten)]
    pub decision: crate::approval::Decision,
    /// Who decided (`deadline` for a default).
    pub by: String,
}

/// `Nats-Msg-Id` of a task message.
pub fn task_msg_id(run: RunId, task: &TaskId, attempt: u32) -> String {
    format!("task.{run}.{task}.{attempt}")
}

/// `Nats-Msg-Id` of a result on the run log: one result per attempt is ever recorded.
pub fn result_msg_id(run: RunId, task: &TaskId, attempt: u32) -> String {
    format!("result.{run}.{task}.{attempt}")
}

/// The JSON of an answer, without the Markdown code fence a model may put around it
/// (```` ```json … ``` ````): what an LLM agent checks against a task's `output_schema`, and
/// what a replay of its conversation reads alike.
pub fn unfenced_json(text: &str) -> &str {
    let trimmed = text.trim();
    trimmed
        .strip_prefix("```json")
        .or_else(|| trimmed.strip_prefix("```"))
        .and_then(|t| t.strip_suffix("```"))
        .unwrap_or(trimmed)
        .trim()
}
