//! Plans and subtasks, as clients write them.
//!
//! A plan is a list of subtasks forming a DAG through `dependencies`. `produces` / `consumes`
//! name workspace topics: a task that consumes a topic waits for the topic's first entry
//! (from any writer) but not for any task — two consumers of one topic run in parallel.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::TaskId;
use crate::time::Secs;

mod risk;
pub use risk::Risk;

/// The pool a subtask runs in when it names none.
pub const DEFAULT_POOL: &str = "default";

/// A unit of work submitted as one run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// A short human-readable name shown in run listings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The user query the plan answers; passed to every task in its envelope.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query: Option<String>,
    /// The subtasks, in any order.
    pub subtasks: Vec<Subtask>,
    /// Execution settings.
    #[serde(default)]
    pub config: PlanConfig,
    /// Set on a fork's plan by `run.fork` (never by a client: a submission that sets it is
    /// refused, `fork_reserved`): the run it forks and the results it keeps. An older
    /// coordinator refuses the field by name (`unknown field`) instead of running the
    /// reused tasks again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork: Option<ForkOrigin>,
}

/// One step of a plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Subtask {
    /// Unique within the plan; a subject-safe token.
    pub id: TaskId,
    /// What the task should do, in words (the agent's instruction).
    #[serde(default)]
    pub description: String,
    /// The team role that performs it (`analyst`, `synthesis`). The task whose role is
    /// `synthesis` provides the run's final result. With an `agent`, the role picks that
    /// agent's system prompt. Without one, in a deployment whose member cards define roles,
    /// the task is *anycast*: exactly one free member of the role claims it (see
    /// [`Subtask::anycast_role`]); in a deployment without roles the default agent runs it
    /// with the role's prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// The agent definition that runs it (`[agents.NAME]` in the worker config). When absent,
    /// the configured default agent runs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// The worker pool that executes it.
    #[serde(default = "default_pool")]
    pub pool: String,
    /// Ids of tasks that must succeed before this one starts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dependencies: Vec<TaskId>,
    /// Workspace topics this task writes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub produces: Vec<String>,
    /// Workspace topics this task reads: it is dispatched once each has an entry (no
    /// ordering on other tasks implied).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub consumes: Vec<String>,
    /// The kind of action the task takes (`read`, `publish`, `pay`…). Passed to the agent in
    /// its envelope; an action in the deployment's `[hitl] sensitive-actions` waits for a
    /// person's approval before it is dispatched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
    /// How risky the action is. Passed to the agent in its envelope; at or above
    /// `[hitl] sensitive-risk` (when set) the task waits for approval too.
    #[serde(default)]
    pub risk: Risk,
    /// The agent that undoes this task's work (a compensation) when its run is cancelled with
    /// `rollback` after the task succeeded. Absent: the task's agent's own `compensate`
    /// (`[agents.NAME] compensate = "…"`), filled in when the plan is accepted; a task with
    /// neither is not undone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensate: Option<String>,
    /// Whether the run fails when this task fails. Optional tasks may fail or be skipped
    /// without failing the run.
    #[serde(default = "default_true")]
    pub required: bool,
    /// Per-attempt time limit; defaults to the plan's `task_timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<Secs>,
    /// Free-form input handed to the agent.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub input: serde_json::Value,
    /// Session-state key that receives the task's final response when it succeeds; later
    /// tasks read it with `{key}` in their description.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_key: Option<String>,
    /// JSON Schema of the answer. LLM agents ask the model for JSON matching it
    /// (`response_format: json_schema`) and check the reply; an answer that does not match,
    /// also after one repair, fails the task with `invalid_output`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_schema: Option<serde_json::Value>,
    /// The model an LLM agent calls for this task instead of its configured `model` (a fork
    /// that tries another model, an evaluation's variant). Its price, provider and limits stay
    /// the agent's. Agents that call no model ignore it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

/// Longest `model` a subtask may name, in bytes.
pub const MAX_MODEL_LEN: usize = 200;

fn default_pool() -> String {
    DEFAULT_POOL.to_owned()
}

const fn default_true() -> bool {
    true
}

/// What to do with a consumed topic that nothing produces.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DataflowValidation {
    /// Reject the plan, naming the topic and its consumers.
    #[default]
    Strict,
    /// Warn; a consumer waits for an entry from any writer (bounded by
    /// `dependency_timeout`), and agents may write topics they do not declare.
    Lenient,
}

/// How the coordinator schedules the plan.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Chosen per run: a plan of one subtask is answered directly (`simple`), any other
    /// plan runs as `dag`. The choice and its reason are recorded on the run.
    #[default]
    Auto,
    /// One task at a time in the order listed, each after the previous one; every task gets
    /// the results of all earlier tasks.
    Simple,
    /// Dependency-driven: a task starts as soon as its dependencies have succeeded.
    Dag,
    /// Led: a lead agent (an LLM agent with the role `supervisor`, a persistent teammate of
    /// the run) decides which subtasks run and when (`assigned`), recruits and retires
    /// members, and ends the run with its result (`finished`). No subtask runs until the lead
    /// assigns it; the failure ratio still aborts the run.
    Supervisor,
}

impl Strategy {
    /// The strategy as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Simple => "simple",
            Self::Dag => "dag",
            Self::Supervisor => "supervisor",
        }
    }
}

/// The role of the agent that leads a run under the `supervisor` strategy.
pub const LEAD_ROLE: &str = "supervisor";

/// Plans with more subtasks than this are led (`auto` picks `supervisor` when the deployment
/// has a lead).
pub const LEAD_ABOVE_SUBTASKS: usize = 5;

/// The strategy a run uses, and why: `auto` resolved, or the plan's explicit choice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct StrategyChoice {
    /// The strategy the run is scheduled with (never `auto`).
    pub strategy: Strategy,
    /// Why, in words (`one subtask: answered directly`, `requested by the plan`).
    pub reason: String,
}

impl StrategyChoice {
    /// Resolves a plan's strategy in a deployment without a lead agent: see
    /// [`StrategyChoice::resolve`].
    pub fn of(plan: &Plan) -> Self {
        Self::resolve(plan, false)
    }

    /// Resolves a plan's strategy: `auto` becomes `simple` for one subtask; `supervisor` when
    /// the deployment has a lead (`led`) and the plan is large (more than
    /// [`LEAD_ABOVE_SUBTASKS`] subtasks) or dynamic (it lets its members recruit:
    /// `recruit_roles` or `max_recruits` set); `dag` otherwise. An explicit strategy is kept.
    /// Pure, and `led` is fixed when the run is admitted, so replaying a run chooses the same.
    pub fn resolve(plan: &Plan, led: bool) -> Self {
        let n = plan.subtasks.len();
        let dynamic = plan
            .config
            .recruit_roles
            .as_ref()
            .is_some_and(|r| !r.is_empty())
            || plan.config.max_recruits.is_some_and(|m| m > 0);
        match plan.config.strategy {
            Strategy::Auto if led && dynamic => Self {
                strategy: Strategy::Supervisor,
                reason: "auto: the plan recruits at run time (recruit_roles / max_recruits): a lead directs it".into(),
            },
            Strategy::Auto if n == 1 => Self {
                strategy: Strategy::Simple,
                reason: "auto: one subtask, answered directly".into(),
            },
            Strategy::Auto if led && n > LEAD_ABOVE_SUBTASKS => Self {
                strategy: Strategy::Supervisor,
                reason: format!(
                    "auto: {n} subtasks (more than {LEAD_ABOVE_SUBTASKS}): a lead directs them"
                ),
            },
            Strategy::Auto => Self {
                strategy: Strategy::Dag,
                reason: format!(
                    "auto: {} subtasks, scheduled by their dependencies",
                    plan.subtasks.len()
                ),
            },
            s => Self {
                strategy: s,
                reason: "requested by the plan".into(),
            },
        }
    }
}

/// Execution settings of a plan. Every field has a default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PlanConfig {
    /// Most tasks of this run in flight at once (default 5).
    pub max_concurrency: u32,
    /// How long a task waits for dependencies that have all been dispatched (default 360 s).
    pub dependency_timeout: Secs,
    /// Per-attempt time limit of tasks without their own `timeout` (default 10 min).
    pub task_timeout: Secs,
    /// Inject `previous_results` / `dependency_results` into task envelopes (default true).
    pub pass_dependency_results: bool,
    /// Handling of consumed topics without a producer (default strict).
    pub dataflow_validation: DataflowValidation,
    /// Retries after a failed attempt (default 3, so at most 4 attempts).
    pub max_retries: u32,
    /// Fraction of failed tasks that aborts the run: it aborts once failures reach
    /// `floor(len * ratio) + 1` (default 0.5; 0 aborts on the first failure).
    pub failure_ratio: f64,
    /// Scheduling strategy (default auto).
    pub strategy: Strategy,
    /// Most model tokens (prompt plus completion) the run may spend over all its tasks
    /// (default: no limit). A model call that could pass it is not made; the task fails
    /// with `budget_exhausted`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    /// Most money, in US dollars, the run's model calls may cost (default: no limit). Needs
    /// a price on every LLM agent the run uses.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_cost: Option<f64>,
    /// Roles a recruit of this run may name (default: the deployment's `allowed-roles`); it
    /// narrows the deployment's policy, never widens it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recruit_roles: Option<Vec<String>>,
    /// Most recruits of this run (default: the deployment's `max-recruits`); it narrows the
    /// deployment's policy, never widens it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_recruits: Option<u32>,
    /// Under the `supervisor` strategy: how long the run waits for its lead to finish it
    /// (default 1 h); then it fails with `lead_timeout`. Left out of the encoding while it
    /// is the default, so a plan that does not set it reads as before on older coordinators.
    #[serde(skip_serializing_if = "is_default_lead_timeout")]
    #[schemars(extend("default" = 3600))]
    pub lead_timeout: Secs,
    /// Oversight of this run by people: a stricter mode, more sensitive actions, its approval
    /// deadline (default: the deployment's `[hitl]`). It tightens the deployment's policy,
    /// never loosens it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hitl: Option<crate::approval::PlanHitl>,
    /// Tools the submitting client runs itself (`await_external_tools`): offered to the
    /// run's LLM agents next to their own tools; a call waits — no slot held — until the
    /// client answers with the tool's result (`approval.answer` with `respond`, or
    /// `flotilla runs answer`). At most 16.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub client_tools: Vec<ClientTool>,
}

/// A tool the client executes: its name, what it does and the JSON Schema of its arguments,
/// as the model is offered them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ClientTool {
    /// The name the model calls it by: 1 to 64 letters, digits, `_` or `-`, not a
    /// built-in tool's ([`RESERVED_TOOL_NAMES`]).
    pub name: String,
    /// What it does, for the model (1 to 1,024 bytes).
    pub description: String,
    /// JSON Schema of its arguments (`"type": "object"`; at most 16 KiB as JSON).
    #[serde(default = "empty_object_schema")]
    pub parameters: serde_json::Value,
}

fn empty_object_schema() -> serde_json::Value {
    serde_json::json!({"type": "object"})
}

/// Most client tools of one plan.
pub const MAX_CLIENT_TOOLS: usize = 16;

/// Names of Flotilla's own LLM tools, which a client tool may not take (`model_call` and
/// `extend_budget` name what a `cost` and a `budget` approval ask about).
pub const RESERVED_TOOL_NAMES: &[&str] = &[
    "workspace_read",
    "workspace_write",
    "mailbox_send",
    "mailbox_read",
    "state_get",
    "state_set",
    "recruit",
    "negotiate",
    "next_request",
    "offer",
    "await_award",
    "spawn_teammate",
    "send_message",
    "broadcast",
    "list_team",
    "shutdown_teammate",
    "assign_task",
    "finish_run",
    "pause_member",
    "resume_member",
    "ask_user",
    "call_agent",
    "transfer_to_agent",
    "model_call",
    "extend_budget",
];

/// Whether `name` may name a tool: 1 to 64 letters, digits, `_` or `-`.
pub fn is_tool_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// The default `lead_timeout`: 1 h.
pub const DEFAULT_LEAD_TIMEOUT: Secs = Secs::from_secs(3600);

fn is_default_lead_timeout(t: &Secs) -> bool {
    *t == DEFAULT_LEAD_TIMEOUT
}

/// Spending limits of a run, carried to its tasks.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Budget {
    /// Most model tokens (prompt plus completion) of the whole run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    /// Most cost of the whole run's model calls, in US dollars.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cost: Option<f64>,
}

impl PlanConfig {
    /// The run's budget, when it has one.
    pub fn budget(&self) -> Option<Budget> {
        (self.max_tokens.is_some() || self.max_cost.is_some()).then_some(Budget {
            max_tokens: self.max_tokens,
            max_cost: self.max_cost,
        })
    }
}

impl Default for PlanConfig {
    fn default() -> Self {
        Self {
            max_concurrency: 5,
            dependency_timeout: Secs::from_secs(360),
            task_timeout: Secs::from_secs(600),
            pass_dependency_results: true,
            dataflow_validation: DataflowValidation::Strict,
            max_retries: 3,
            failure_ratio: 0.5,
            strategy: Strategy::Auto,
            max_tokens: None,
            max_cost: None,
            recruit_roles: None,
            max_recruits: None,
            lead_timeout: DEFAULT_LEAD_TIMEOUT,
            hitl: None,
            client_tools: Vec::new(),
        }
    }
}

impl Plan {
    /// A plan without subtasks and with default settings (a starting point for builders;
    /// the validator rejects it as it is).
    pub fn empty() -> Self {
        Self {
            name: None,
            query: None,
            subtasks: Vec::new(),
            config: PlanConfig::default(),
            fork: None,
        }
    }

    /// Looks a subtask up by id.
    pub fn subtask(&self, id: &str) -> Option<&Subtask> {
        self.subtasks.iter().find(|t| t.id.as_str() == id)
    }

    /// Index of every subtask by id (first occurrence wins for duplicates).
    pub fn index(&self) -> BTreeMap<&str, usize> {
        let mut index = BTreeMap::new();
        for (i, t) in self.subtasks.iter().enumerate() {
            index.entry(t.id.as_str()).or_insert(i);
        }
        index
    }
}

impl Subtask {
    /// A subtask with defaults for everything but its id and description.
    pub fn new(id: &str, description: &str) -> Self {
        Self {
            id: TaskId::new(id),
            description: description.to_owned(),
            role: None,
            agent: None,
            pool: default_pool(),
            dependencies: Vec::new(),
            produces: Vec::new(),
            consumes: Vec::new(),
            action: None,
            risk: Risk::Low,
            compensate: None,
            required: true,
            timeout: None,
            input: serde_json::Value::Null,
            output_key: None,
            output_schema: None,
            model: None,
        }
    }

    /// Builder-style: add dependencies.
    pub fn after(mut self, deps: &[&str]) -> Self {
        self.dependencies
            .extend(deps.iter().map(|d| TaskId::new(*d)));
        self
    }

    /// Builder-style: choose the agent.
    pub fn with_agent(mut self, agent: &str) -> Self {
        self.agent = Some(agent.to_owned());
        self
    }

    /// The role whose member claims this task, when it is an anycast task: it names a
    /// `role` and no `agent`, in a deployment whose member cards define roles
    /// (`roles_defined`). Such a task waits in its role's queue until one free member of the
    /// role takes it; its `pool` is not used. Otherwise (`None`) the role only picks the
    /// system prompt of the agent that runs it.
    pub fn anycast_role(&self, roles_defined: bool) -> Option<&str> {
        match (&self.role, &self.agent) {
            (Some(role), None) if roles_defined => Some(role),
            _ => None,
        }
    }
}

/// What a fork's plan reuses: set by `run.fork` only (a submission that sets it is refused,
/// `fork_reserved`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkOrigin {
    /// The run forked.
    pub run_id: crate::ids::RunId,
    /// The fork point: the task that runs afresh first.
    pub task_id: TaskId,
    /// The tasks that keep the original's result, in plan order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reused: Vec<ReusedResult>,
    /// A fork at a step of the fork point's conversation: every attempt of the fork point
    /// starts with these steps of the original's attempt instead of calling the model for
    /// them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation: Option<KeptSteps>,
}

/// The first `steps` steps (model replies and tool rounds, numbered from 0) of attempt
/// `attempt_id` of run `run_id`, as its step journal recorded them: a conversation an attempt
/// starts with, replayed without a model call or a tool run. Set by `run.fork` for a fork at
/// a step; the worker reads them from the original run's events.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KeptSteps {
    /// The run whose attempt recorded them.
    pub run_id: crate::ids::RunId,
    /// The attempt.
    pub attempt_id: crate::ids::AttemptId,
    /// How many steps are kept: steps `0 .. steps`; step `steps` is made afresh.
    pub steps: u32,
}

impl ForkOrigin {
    /// The run-log sequence of `task`'s reused result, when the fork reuses it.
    pub fn reused_seq(&self, task: &TaskId) -> Option<u64> {
        self.reused
            .iter()
            .find(|r| &r.task_id == task)
            .map(|r| r.seq)
    }
}

/// One task a fork does not run: it keeps the result at `seq`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReusedResult {
    /// The task.
    pub task_id: TaskId,
    /// Run-log stream sequence of the original's result for it.
    pub seq: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_plan_gets_defaults() {
        let plan: Plan =
            serde_json::from_str(r#"{"subtasks":[{"id":"a"}]}"#).expect("minimal plan parses");
        let a = &plan.subtasks[0];
        assert_eq!(a.pool, "default");
        assert!(a.required);
        assert_eq!(plan.config.max_concurrency, 5);
        assert_eq!(plan.config.dependency_timeout, Secs::from_secs(360));
    }

    #[test]
    fn auto_strategy_resolves_by_plan_size() {
        let mut plan = Plan::empty();
        plan.subtasks.push(Subtask::new("a", ""));
        assert_eq!(StrategyChoice::of(&plan).strategy, Strategy::Simple);
        plan.subtasks.push(Subtask::new("b", ""));
        let choice = StrategyChoice::of(&plan);
        assert_eq!(choice.strategy, Strategy::Dag);
        assert!(choice.reason.contains("2 subtasks"), "{choice:?}");
        plan.config.strategy = Strategy::Simple;
        assert_eq!(
            StrategyChoice::of(&plan),
            StrategyChoice {
                strategy: Strategy::Simple,
                reason: "requested by the plan".into()
            }
        );
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let err = serde_json::from_str::<Plan>(r#"{"subtasks":[{"id":"a","depends":["b"]}]}"#)
            .expect_err("unknown field");
        assert!(err.to_string().contains("depends"), "{err}");
    }
}
