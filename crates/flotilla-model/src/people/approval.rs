//! Humans in the loop: the escalation policy a run is admitted with, approval requests and
//! their decisions.
//!
//! The policy ([`HitlPolicy`]) is fixed when a run is admitted — the deployment's `[hitl]`
//! section, tightened by the plan's `config.hitl` — and carried in the run's state, so every
//! coordinator and every replay decides alike which task waits for a person
//! (`flotilla_machine::policy::hitl::gate`). A waiting task is a state of the run machine plus its durable
//! timer: it holds no worker slot and no consumer.
//!
//! An approval's life is the revisions of one key of the escalations bucket
//! (`<run>.<approval>`, [`approval_key`]): `pending` when requested, then exactly one of a
//! person's answer, the deadline's default (`expired`), or `withdrawn` (the run ended first).
//! Each later revision is written at the revision it read (compare-and-set), so the first
//! wins and a later answer is told `already_decided` with the decision. The winner is then
//! appended to the run log ([`crate::runlog::RunInput::ApprovalDecided`]), where the run
//! machine applies it once.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::{RunId, TaskId};
use crate::plan::Risk;
use crate::problem::{Problem, ProblemCode};
use crate::time::{Secs, Timestamp};

/// How much a person oversees an agent, strictest last.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum HitlMode {
    /// Monitor only: escalations are notified, nothing waits.
    HumanOnTheLoop,
    /// Escalation triggers (sensitive actions) wait for a person; the rest runs.
    #[default]
    HumanInTheLoop,
    /// Every dispatch waits for a person's approval.
    HumanInCommand,
}

impl HitlMode {
    /// The mode as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::HumanOnTheLoop => "human_on_the_loop",
            Self::HumanInTheLoop => "human_in_the_loop",
            Self::HumanInCommand => "human_in_command",
        }
    }
}

/// Why a person is asked.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Trigger {
    /// The task's `action` is in the sensitive list, or its `risk` reaches the sensitive
    /// risk.
    SensitiveAction,
    /// The task's agent or role is overseen `human_in_command`: every dispatch is approved.
    HumanInCommand,
    /// The task failed `[hitl] consecutive-failures` attempts in a row: a person decides
    /// whether it is tried again instead of the retry policy alone.
    ConsecutiveFailures,
    /// An LLM agent called a tool it does not have (`[hitl] out-of-scope = true`): a person
    /// answers in the tool's place (`respond`), or refuses (`reject`, the model reads why).
    OutOfScope,
    /// An LLM agent asked the user a question (its `ask_user` tool): the answer (`respond`)
    /// is the tool's result.
    Question,
    /// An LLM agent called a tool the client runs (`client_tools`): the client's answer
    /// (`respond`) is the tool's result.
    ClientTool,
    /// A task's result carried a `confidence` below `[hitl] low-confidence`: it is held for
    /// review before its dependents run (approve keeps it, `respond`/`edit` replace it,
    /// reject fails the task).
    LowConfidence,
    /// An LLM agent's model call is estimated to cost more than `[hitl] cost-limit` (US
    /// dollars per call): it is made once a person approves (reject fails the task).
    Cost,
    /// An LLM agent's model call would pass its run's (or its tree's) budget, and the
    /// deployment says `[hitl] on-budget-exhausted = "ask"`: approve (or `edit` with
    /// `{"max_tokens": N, "max_cost": X}`) extends that budget and the call is made; reject
    /// fails the task `budget_exhausted` as without asking.
    Budget,
    /// An agent of the NATS Agent Protocol that the task called (`call_agent`, `flotilla
    /// call agents:…`) asked a question mid-call (`query`), which is how that protocol frames
    /// a permission request: approve answers it `yes`, `respond` with the person's text,
    /// reject (and the deadline, whose default is always reject) `no`. Asked with
    /// `approval.ask` by the calling attempt, which waits for it; the run machine does not
    /// (its decision is not appended to the run log).
    ExternalAgent,
}

impl Trigger {
    /// The trigger as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SensitiveAction => "sensitive_action",
            Self::HumanInCommand => "human_in_command",
            Self::ConsecutiveFailures => "consecutive_failures",
            Self::OutOfScope => "out_of_scope",
            Self::Question => "question",
            Self::ClientTool => "client_tool",
            Self::LowConfidence => "low_confidence",
            Self::Cost => "cost",
            Self::Budget => "budget",
            Self::ExternalAgent => "external_agent",
        }
    }
}

/// What a wait decides when nobody answers before its deadline.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DefaultDecision {
    /// The task is rejected (a required task fails the run, an optional one is skipped).
    #[default]
    Reject,
    /// The task runs as asked.
    Approve,
}

impl DefaultDecision {
    /// Whether it is `reject`.
    pub fn is_reject(&self) -> bool {
        *self == Self::Reject
    }
}

/// The default approval deadline: 30 min.
pub const DEFAULT_APPROVAL_TIMEOUT: Secs = Secs::from_secs(1800);
/// Longest approval deadline: 7 days.
pub const MAX_APPROVAL_TIMEOUT: Secs = Secs::from_secs(7 * 24 * 3600);
/// Actions that are sensitive unless the deployment says otherwise.
pub const DEFAULT_SENSITIVE_ACTIONS: [&str; 4] = ["delete", "publish", "pay", "send_email"];
/// The most `consecutive-failures` may be.
pub const MAX_CONSECUTIVE_FAILURES: u32 = 100;

/// The deployment's `[hitl]` section: who is overseen how, and what waits for a person.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct HitlConfig {
    /// The mode of agents and roles not listed below (default `human_in_the_loop`).
    pub mode: HitlMode,
    /// Task actions that wait for approval (compared lower-case; default `delete`,
    /// `publish`, `pay`, `send_email`).
    pub sensitive_actions: Vec<String>,
    /// Tasks whose `risk` is at least this wait for approval too (default: none — risk alone
    /// asks nobody).
    pub sensitive_risk: Option<Risk>,
    /// How long a request waits for an answer (default 30 min, at most 7 days).
    pub approval_timeout: Secs,
    /// What an unanswered request decides, per trigger (default `reject` for both).
    pub on_timeout: OnTimeout,
    /// Modes of agents, by agent name (a stricter or looser oversight than `mode`).
    pub agents: BTreeMap<String, HitlMode>,
    /// Modes of roles, by role name; an agent's own mode wins over its role's.
    pub roles: BTreeMap<String, HitlMode>,
    /// After this many failed attempts of a task in a row, its next retry waits for a
    /// person (trigger `consecutive_failures`) instead of running by the retry policy
    /// alone; 0: never (the default, so that upgrading turns no existing retry into a wait;
    /// 3 is a good start; at most 100). A task allowed fewer attempts never reaches it.
    pub consecutive_failures: u32,
    /// An LLM agent's call of a tool it does not have waits for a person (trigger
    /// `out_of_scope`), who may answer in the tool's place, instead of the model being told
    /// at once that no such tool exists. Default false: models do misname tools, and each
    /// such call would otherwise wait for a person.
    pub out_of_scope: bool,
    /// A successful result whose `confidence` (0 to 1, when the agent gives one) is below
    /// this is held for review before its dependents run (trigger `low_confidence`); 0: never
    /// (default 0.6). Results without a confidence are never held.
    pub low_confidence: f64,
    /// A model call of an LLM agent whose estimated cost (its prompt and `max-output-tokens`
    /// at the agent's `price`) is above this many US dollars waits for a person (trigger
    /// `cost`). Default: none. Agents without a price are never asked.
    pub cost_limit: Option<f64>,
    /// What a model call that would pass its run's budget does: `fail` the task with
    /// `budget_exhausted` (the default), or `ask` a person to extend the budget (trigger
    /// `budget`) while the attempt waits without a worker slot.
    pub on_budget_exhausted: OnBudgetExhausted,
    /// `[hitl.trust]`: earned trust levels, and whether admissions use them.
    pub trust: crate::trust::TrustConfig,
}

/// `[hitl] on-budget-exhausted`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnBudgetExhausted {
    /// The task fails `budget_exhausted`.
    #[default]
    Fail,
    /// A person is asked to extend the budget.
    Ask,
}

impl Default for HitlConfig {
    fn default() -> Self {
        Self {
            mode: HitlMode::default(),
            sensitive_actions: DEFAULT_SENSITIVE_ACTIONS
                .iter()
                .map(|s| (*s).to_owned())
                .collect(),
            sensitive_risk: None,
            approval_timeout: DEFAULT_APPROVAL_TIMEOUT,
            on_timeout: OnTimeout::default(),
            agents: BTreeMap::new(),
            roles: BTreeMap::new(),
            consecutive_failures: 0,
            out_of_scope: false,
            low_confidence: DEFAULT_LOW_CONFIDENCE,
            cost_limit: None,
            on_budget_exhausted: OnBudgetExhausted::Fail,
            trust: crate::trust::TrustConfig::default(),
        }
    }
}

/// The default decision of an unanswered request, per trigger.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct OnTimeout {
    /// For a sensitive action (default `reject`).
    pub sensitive_action: DefaultDecision,
    /// For a dispatch under `human_in_command` (default `reject`).
    pub human_in_command: DefaultDecision,
    /// For a retry after consecutive failures (default `reject`: the task is not tried
    /// again). Written only when not the default, so coordinators that predate it read the
    /// run's state.
    #[serde(skip_serializing_if = "DefaultDecision::is_reject")]
    pub consecutive_failures: DefaultDecision,
    /// For an LLM agent's call of a tool it does not have (default `reject`: the model is
    /// told nobody answered). Written only when not the default.
    #[serde(skip_serializing_if = "DefaultDecision::is_reject")]
    pub out_of_scope: DefaultDecision,
    /// For an LLM agent's question (`ask_user`; default `reject`: the model is told nobody
    /// answered). Written only when not the default.
    #[serde(skip_serializing_if = "DefaultDecision::is_reject")]
    pub question: DefaultDecision,
    /// For a client tool's call (default `reject`: the model is told the client did not
    /// answer). Written only when not the default.
    #[serde(skip_serializing_if = "DefaultDecision::is_reject")]
    pub client_tool: DefaultDecision,
    /// For a result held for review (default `reject`: the task fails, as a rejected
    /// review does; `approve` keeps the result). Written only when not the default.
    #[serde(skip_serializing_if = "DefaultDecision::is_reject")]
    pub low_confidence: DefaultDecision,
    /// For a model call over the cost limit (default `reject`: the task fails). Written only
    /// when not the default.
    #[serde(skip_serializing_if = "DefaultDecision::is_reject")]
    pub cost: DefaultDecision,
    /// For a request to extend a budget (default `reject`: the task fails
    /// `budget_exhausted`; `approve` extends it by its own limits). Written only when not the
    /// default.
    #[serde(skip_serializing_if = "DefaultDecision::is_reject")]
    pub budget: DefaultDecision,
}

impl OnTimeout {
    /// The default for `trigger`.
    pub fn of(&self, trigger: Trigger) -> DefaultDecision {
        match trigger {
            Trigger::SensitiveAction => self.sensitive_action,
            Trigger::HumanInCommand => self.human_in_command,
            Trigger::ConsecutiveFailures => self.consecutive_failures,
            Trigger::OutOfScope => self.out_of_scope,
            Trigger::Question => self.question,
            Trigger::ClientTool => self.client_tool,
            Trigger::LowConfidence => self.low_confidence,
            Trigger::Cost => self.cost,
            Trigger::Budget => self.budget,
            // The protocol's own default for a permission request: deny.
            Trigger::ExternalAgent => DefaultDecision::Reject,
        }
    }
}

impl HitlConfig {
    /// Problems of the section: an empty action name, a deadline out of range.
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = check_actions(&self.sensitive_actions, "hitl.sensitive-actions");
        out.extend(check_timeout(
            self.approval_timeout,
            "hitl.approval-timeout".into(),
        ));
        out.extend(self.trust.problems());
        out.extend(check_confidence(self.low_confidence, "hitl.low-confidence"));
        if let Some(l) = self.cost_limit
            && !(l.is_finite() && l > 0.0)
        {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "hitl.cost-limit",
                format!("must be a positive amount of US dollars per model call, not {l}"),
            ));
        }
        if self.consecutive_failures > MAX_CONSECUTIVE_FAILURES {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "hitl.consecutive-failures",
                format!(
                    "must be 0 (never) to {MAX_CONSECUTIVE_FAILURES}, not {}",
                    self.consecutive_failures
                ),
            ));
        }
        out
    }
}

/// A problem when `value` is not a confidence threshold (0 to 1).
fn check_confidence(value: f64, field: &str) -> Option<Problem> {
    (!(0.0..=1.0).contains(&value)).then(|| {
        Problem::new(
            ProblemCode::InvalidConfig,
            field,
            format!("must be between 0 (never hold a result) and 1, not {value}"),
        )
    })
}

/// A problem per sensitive action of `actions` that names none, at `field[i]`.
fn check_actions(actions: &[String], field: &str) -> Vec<Problem> {
    actions
        .iter()
        .enumerate()
        .filter(|(_, a)| a.trim().is_empty())
        .map(|(i, _)| {
            Problem::new(
                ProblemCode::InvalidConfig,
                format!("{field}[{i}]"),
                "a sensitive action must name an action",
            )
        })
        .collect()
}

fn check_timeout(t: Secs, field: String) -> Option<Problem> {
    (t.get().is_zero() || t > MAX_APPROVAL_TIMEOUT).then(|| {
        Problem::new(
            ProblemCode::InvalidConfig,
            field,
            format!(
                "an approval deadline must be between 1 s and 7 days, not {} s",
                t.get().as_secs()
            ),
        )
    })
}

/// A plan's `config.hitl`: it may tighten the deployment's oversight, never loosen it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PlanHitl {
    /// A stricter mode for the whole run (a looser one than the deployment's is ignored).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<HitlMode>,
    /// More sensitive actions (added to the deployment's).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sensitive_actions: Vec<String>,
    /// The run's approval deadline (1 s to 7 days; default the deployment's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub approval_timeout: Option<Secs>,
    /// A higher review threshold for results' confidence (0 to 1; a lower one than the
    /// deployment's is ignored).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub low_confidence: Option<f64>,
}

impl PlanHitl {
    /// Problems of the plan's section, named under `config.hitl`.
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = check_actions(&self.sensitive_actions, "config.hitl.sensitive_actions");
        if let Some(t) = self.approval_timeout {
            out.extend(check_timeout(t, "config.hitl.approval_timeout".into()));
        }
        if let Some(l) = self.low_confidence {
            out.extend(check_confidence(l, "config.hitl.low_confidence"));
        }
        out
    }
}

/// The escalation policy of one run, fixed at admission. Field names are short: it is part
/// of the run's state, written on every change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct HitlPolicy {
    /// Mode of agents and roles not listed.
    #[serde(rename = "m", default)]
    pub mode: HitlMode,
    /// Sensitive actions, lower-case.
    #[serde(rename = "sa", default, skip_serializing_if = "Vec::is_empty")]
    pub sensitive_actions: Vec<String>,
    /// Sensitive risk.
    #[serde(rename = "sr", default, skip_serializing_if = "Option::is_none")]
    pub sensitive_risk: Option<Risk>,
    /// Approval deadline, in seconds.
    #[serde(rename = "t")]
    pub timeout: Secs,
    /// Defaults of unanswered requests.
    #[serde(rename = "d", default)]
    pub on_timeout: OnTimeout,
    /// Modes by `agent:<name>` and `role:<name>`.
    #[serde(rename = "ms", default, skip_serializing_if = "BTreeMap::is_empty")]
    pub modes: BTreeMap<String, HitlMode>,
    /// The deployment's default agent: the agent of tasks naming none and no role.
    #[serde(rename = "da", default, skip_serializing_if = "Option::is_none")]
    pub default_agent: Option<String>,
    /// Failed attempts in a row after which a retry waits for a person; 0: never (and for
    /// runs admitted before the trigger existed).
    #[serde(rename = "cf", default, skip_serializing_if = "is_zero")]
    pub consecutive_failures: u32,
    /// Whether an LLM agent's call of a tool it does not have waits for a person.
    #[serde(rename = "os", default, skip_serializing_if = "std::ops::Not::not")]
    pub out_of_scope: bool,
    /// Results with a confidence below this are held for review; 0: never (and for runs
    /// admitted before the trigger existed).
    #[serde(rename = "lc", default, skip_serializing_if = "is_zero_f64")]
    pub low_confidence: f64,
    /// Model calls estimated above this many US dollars wait for a person.
    #[serde(rename = "cl", default, skip_serializing_if = "Option::is_none")]
    pub cost_limit: Option<f64>,
    /// A model call that would pass a budget asks a person to extend it.
    #[serde(rename = "ba", default, skip_serializing_if = "std::ops::Not::not")]
    pub budget_ask: bool,
}

fn is_zero_f64(n: &f64) -> bool {
    *n == 0.0
}

/// The default `[hitl] low-confidence`.
pub const DEFAULT_LOW_CONFIDENCE: f64 = 0.6;

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The approval id of attempt `attempt` of task `index` (its position in the plan):
/// deterministic, so a replay asks the same question.
pub fn approval_id(index: u32, attempt: u32) -> String {
    format!("t{index}a{attempt}")
}

/// The approval id of the `call`-th tool call (1, 2, …) that attempt `attempt` of task
/// `index` suspended at: deterministic, so a replay asks the same question.
pub fn tool_approval_id(index: u32, attempt: u32, call: u32) -> String {
    format!("t{index}a{attempt}c{call}")
}

/// The `call` of a wait that reviews an attempt's result (trigger `low_confidence`): its
/// approval id is `t<task>a<attempt>r`.
pub const REVIEW_CALL: u32 = u32::MAX;

/// The approval id of a wait: a dispatch's (`call` 0), a result's review ([`REVIEW_CALL`]) or
/// a tool call's.
pub fn wait_id(index: u32, attempt: u32, call: u32) -> String {
    if call == 0 {
        approval_id(index, attempt)
    } else if call == REVIEW_CALL {
        format!("t{index}a{attempt}r")
    } else {
        tool_approval_id(index, attempt, call)
    }
}

/// The tool call an approval is about.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ToolCallRef {
    /// The model's id of the call.
    pub call_id: String,
    /// The tool's name.
    pub tool: String,
}

/// The escalations-bucket key of an approval.
pub fn approval_key(run: RunId, approval: &str) -> String {
    format!("{run}.{approval}")
}

/// A person's decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Decision {
    /// Run as asked.
    Approve,
    /// Do not run. A required task fails the run; an optional one is skipped.
    Reject {
        /// Why (shown in the run's outcome; an LLM sees it as the tool's result).
        #[serde(default)]
        message: String,
    },
    /// Run with this input instead of the plan's (recorded).
    Edit {
        /// The input the task runs with.
        input: serde_json::Value,
    },
    /// Do not run: this is the task's result, supplied by the person.
    Respond {
        /// The result (the task's response).
        result: String,
    },
}

impl Decision {
    /// The decision as it appears on the wire.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Approve => "approve",
            Self::Reject { .. } => "reject",
            Self::Edit { .. } => "edit",
            Self::Respond { .. } => "respond",
        }
    }

    /// The decision a default stands for.
    pub fn of_default(d: DefaultDecision, timeout: Secs) -> Self {
        match d {
            DefaultDecision::Approve => Self::Approve,
            DefaultDecision::Reject => Self::Reject {
                message: format!(
                    "nobody answered within {} s; the default is reject",
                    timeout.get().as_secs()
                ),
            },
        }
    }
}

/// Longest rejection message, comment or supplied result, in bytes.
pub const MAX_ANSWER_TEXT: usize = 64 * 1024;

/// Where an approval stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalStatus {
    /// Waiting for an answer.
    Pending,
    /// A person answered.
    Decided,
    /// Nobody answered before the deadline: its default decided.
    Expired,
    /// The run ended (cancelled, failed) before anyone answered.
    Withdrawn,
}

impl ApprovalStatus {
    /// The status as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Decided => "decided",
            Self::Expired => "expired",
            Self::Withdrawn => "withdrawn",
        }
    }
}

/// What a person is asked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalRequest {
    /// The approval (unique within the run: `t<task index>a<attempt>`).
    pub approval_id: String,
    /// The run.
    pub run_id: RunId,
    /// The task.
    pub task_id: TaskId,
    /// The attempt the approval lets run.
    pub attempt: u32,
    /// What triggered it.
    pub trigger: Trigger,
    /// The oversight mode of the task's agent or role.
    pub mode: HitlMode,
    /// The task's action.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
    /// The task's risk.
    pub risk: Risk,
    /// The task's agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// The task's role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// The task's description.
    pub description: String,
    /// The task's input, as it would run — or, for a tool call, the call's arguments.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub input: serde_json::Value,
    /// SHA-256 (hex) of the description and input (for a tool call: of the tool's name and
    /// the arguments): an answer naming another digest was given for other arguments and
    /// does not apply.
    pub digest: String,
    /// The tool call an LLM attempt suspended at (absent: the approval is of the task's
    /// dispatch). `description` is then the agent's question (trigger `question`) or says
    /// which tool it calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call: Option<ToolCallRef>,
    /// When it was asked (server time of the deciding input).
    pub requested_at: Timestamp,
    /// When its default decides.
    pub deadline: Timestamp,
    /// What the deadline decides.
    pub default: DefaultDecision,
}

/// The answer that decided an approval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalAnswer {
    /// The decision.
    #[serde(flatten)]
    pub decision: Decision,
    /// Who decided (`deadline` for an expiry, `run` for a withdrawal).
    pub by: String,
    /// A comment for the record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
    /// When (the deciding process's clock; the escalations bucket's revision has the
    /// server's).
    pub at: Timestamp,
    /// The tool was approved for the rest of the session too (see
    /// [`ApprovalAnswerRequest::always`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub always: bool,
    /// The rejection was marked as an incident of the task's agent (see
    /// [`ApprovalAnswerRequest::incident`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub incident: bool,
}

/// An approval as stored in the escalations bucket (each revision whole).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalRecord {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// Where it stands.
    pub status: ApprovalStatus,
    /// What was asked.
    pub request: ApprovalRequest,
    /// What decided it (absent while pending).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<ApprovalAnswer>,
}

/// The decision of an approval, as recorded on the run log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalDecided {
    /// The approval.
    pub approval_id: String,
    /// The task.
    pub task_id: TaskId,
    /// The attempt it lets run.
    pub attempt: u32,
    /// How it ended.
    pub status: ApprovalStatus,
    /// The decision that applies.
    #[serde(flatten)]
    pub decision: Decision,
    /// Who decided.
    pub by: String,
    /// For a tool call's approval: the call, and the digest of the arguments decided on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call: Option<ToolCallRef>,
    /// The request's digest (written for tool calls, whose decision must match the
    /// arguments the resumed attempt replays).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// The rejection is an incident of the task's agent (the run machine says so on the
    /// `approval_decided` event, and the supervisor records it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub incident: bool,
}

/// `Nats-Msg-Id` of an approval's decision on the run log.
pub fn decided_msg_id(run: RunId, approval: &str) -> String {
    format!("approval.{run}.{approval}")
}

/// List approvals (`approval.list`): pending ones across runs, or every approval of one run
/// (its audit trail).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ApprovalListRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// Only this run's approvals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<RunId>,
    /// Decided, expired and withdrawn approvals too (default: pending only).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub all: bool,
    /// Most approvals answered (default and maximum [`MAX_LISTED_APPROVALS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

/// Most approvals one `approval.list` answers.
pub const MAX_LISTED_APPROVALS: u32 = 1000;

/// Approvals, oldest request first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalList {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The approvals.
    pub approvals: Vec<ApprovalRecord>,
    /// More matched than `limit`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

/// One approval with its history (`approval.get`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ApprovalGetRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// The approval.
    pub approval_id: String,
}

/// An approval and every revision of it, oldest first, with the server's time of each.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalView {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The approval now.
    pub record: ApprovalRecord,
    /// The revisions the bucket keeps (the latest: the record itself says when it was
    /// requested and answered), oldest first, with the server's time.
    pub history: Vec<ApprovalRevision>,
}

/// One revision of an approval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalRevision {
    /// The escalations bucket's revision.
    pub revision: u64,
    /// When it was stored (server time).
    pub at: Timestamp,
    /// Where the approval stood.
    pub status: ApprovalStatus,
    /// The answer, once settled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<ApprovalAnswer>,
}

/// Answer an approval (`approval.answer`): the first answer wins. On the wire the decision's
/// fields sit beside the others: `"decision": "reject", "message": "…"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(try_from = "AnswerWire", into = "AnswerWire")]
pub struct ApprovalAnswerRequest {
    /// Wire protocol version.
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// The approval.
    pub approval_id: String,
    /// The decision.
    pub decision: Decision,
    /// Who answers (a person's name; required).
    pub by: String,
    /// A comment for the record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
    /// The digest of the request the person saw: when given and different from the stored
    /// request's, the answer was for other arguments and is refused (`409 digest_mismatch`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// With `approve` of a tool call (trigger `sensitive_action` or `human_in_command`):
    /// approve this tool for the rest of the run's session too — its later calls in the
    /// session run without asking until the grant is revoked (`approval.revoke`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub always: bool,
    /// With `reject`: the rejection is an incident of the task's agent (and role) — what it
    /// asked to do should not have been asked — recorded in their trust records (downgraded
    /// to novice at once), as an operator's `trust.incident` would.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub incident: bool,
}

/// What became of an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AnswerOutcome {
    /// This answer decided the approval.
    Decided,
    /// Something decided it first (another answer, the deadline, the run's end): `record`
    /// says what.
    AlreadyDecided,
}

/// The answer to `approval.answer`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalAnswerReply {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// Whether this answer decided.
    pub outcome: AnswerOutcome,
    /// The approval as settled.
    pub record: ApprovalRecord,
}

/// The kind of a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DecisionKind {
    /// See [`Decision::Approve`].
    Approve,
    /// See [`Decision::Reject`].
    Reject,
    /// See [`Decision::Edit`].
    Edit,
    /// See [`Decision::Respond`].
    Respond,
}

/// `approval.answer` as it is encoded: strict about unknown fields, and about the field each
/// decision needs (`input` for `edit`, `result` for `respond`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AnswerWire {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// The approval.
    pub approval_id: String,
    /// `approve`, `reject`, `edit` or `respond`.
    pub decision: DecisionKind,
    /// For `reject`: why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// For `edit`: the input the task runs with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<serde_json::Value>,
    /// For `respond`: the task's result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// Who answers.
    pub by: String,
    /// A comment for the record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
    /// The digest of the request the person saw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// With `approve` of a tool call: approve the tool for the session.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub always: bool,
    /// With `reject`: the rejection is an incident of the task's agent.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub incident: bool,
}

impl TryFrom<AnswerWire> for ApprovalAnswerRequest {
    type Error = String;

    fn try_from(w: AnswerWire) -> Result<Self, String> {
        let stray = |field: &str| format!("`{field}` does not go with decision {:?}", w.decision);
        let decision = match w.decision {
            DecisionKind::Approve => {
                if w.message.is_some() || w.input.is_some() || w.result.is_some() {
                    return Err(stray("message/input/result"));
                }
                Decision::Approve
            }
            DecisionKind::Reject => {
                if w.input.is_some() || w.result.is_some() {
                    return Err(stray("input/result"));
                }
                Decision::Reject {
                    message: w.message.clone().unwrap_or_default(),
                }
            }
            DecisionKind::Edit => Decision::Edit {
                input: w
                    .input
                    .clone()
                    .ok_or("decision edit needs `input` (the input the task runs with)")?,
            },
            DecisionKind::Respond => Decision::Respond {
                result: w
                    .result
                    .clone()
                    .ok_or("decision respond needs `result` (the task's result)")?,
            },
        };
        Ok(Self {
            protocol: w.protocol,
            run_id: w.run_id,
            approval_id: w.approval_id,
            decision,
            by: w.by,
            comment: w.comment,
            digest: w.digest,
            always: w.always,
            incident: w.incident,
        })
    }
}

impl From<ApprovalAnswerRequest> for AnswerWire {
    fn from(r: ApprovalAnswerRequest) -> Self {
        let (decision, message, input, result) = match r.decision {
            Decision::Approve => (DecisionKind::Approve, None, None, None),
            Decision::Reject { message } => (DecisionKind::Reject, Some(message), None, None),
            Decision::Edit { input } => (DecisionKind::Edit, None, Some(input), None),
            Decision::Respond { result } => (DecisionKind::Respond, None, None, Some(result)),
        };
        Self {
            protocol: r.protocol,
            run_id: r.run_id,
            approval_id: r.approval_id,
            decision,
            message,
            input,
            result,
            by: r.by,
            comment: r.comment,
            digest: r.digest,
            always: r.always,
            incident: r.incident,
        }
    }
}

impl crate::api::ApiRequest for ApprovalListRequest {
    const ENDPOINT: &'static str = "approval.list";
    type Reply = ApprovalList;
}

impl crate::api::ApiRequest for ApprovalGetRequest {
    const ENDPOINT: &'static str = "approval.get";
    type Reply = ApprovalView;
}

impl crate::api::ApiRequest for ApprovalAnswerRequest {
    const ENDPOINT: &'static str = "approval.answer";
    type Reply = ApprovalAnswerReply;
}

impl crate::api::ApiRequest for ApprovalAskRequest {
    const ENDPOINT: &'static str = "approval.ask";
    type Reply = ApprovalAskReply;
}

crate::api::has_protocol!(
    ApprovalAskRequest,
    ApprovalListRequest,
    ApprovalGetRequest,
    ApprovalAnswerRequest,
    GrantListRequest,
    GrantRevokeRequest
);

/// Session-state keys starting with this are Flotilla's own: agents and clients read them but
/// only Flotilla writes them (`_grant.<tool>`: a tool approved for the session).
pub const RESERVED_STATE_PREFIX: &str = "_";

/// The session-state key of a tool's grant, `_grant.<tool>`: a key of its own token in the
/// state bucket (`<session>._grant.<tool>`), which the NATS permissions of workers deny
/// (`$KV.flotilla-state.*._grant.>`), and which no `state.set` key can name (keys have no
/// dots).
pub fn grant_key(tool: &str) -> String {
    format!("{GRANT_PREFIX}{tool}")
}

/// What every grant key starts with.
pub const GRANT_PREFIX: &str = "_grant.";

/// A tool approved for the rest of a session (`approve` with `always`): stored in session
/// state under [`grant_key`]; its calls in the session's runs no longer wait for a person on
/// the `sensitive_action` and `human_in_command` triggers. Questions, client tools and
/// out-of-scope calls still wait. Revoked with `approval.revoke`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ToolGrant {
    /// The tool.
    pub tool: String,
    /// Who approved it.
    pub by: String,
    /// The run and approval it was approved in.
    pub run_id: RunId,
    /// The approval.
    pub approval_id: String,
    /// When (the answering coordinator's clock).
    pub at: Timestamp,
    /// Their comment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
}

/// `approval.grants`: the tools approved for a session (give `run_id` for its run's
/// session, or `session_id`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GrantListRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// A run of the session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<RunId>,
    /// The session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<crate::ids::SessionId>,
}

/// Reply to `approval.grants`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GrantList {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The session.
    pub session_id: String,
    /// Its grants, by tool.
    #[serde(default)]
    pub grants: Vec<ToolGrant>,
}

/// `approval.revoke`: withdraws a tool's grant in a session; its next call waits for a
/// person again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GrantRevokeRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// A run of the session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<RunId>,
    /// The session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<crate::ids::SessionId>,
    /// The tool.
    pub tool: String,
    /// Who revokes it (required).
    pub by: String,
}

/// Reply to `approval.revoke`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GrantRevokeReply {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The grant withdrawn (a tool without one is `404 not_found`, and nothing changes).
    pub revoked: ToolGrant,
}

impl crate::api::ApiRequest for GrantListRequest {
    const ENDPOINT: &'static str = "approval.grants";
    type Reply = GrantList;
}

impl crate::api::ApiRequest for GrantRevokeRequest {
    const ENDPOINT: &'static str = "approval.revoke";
    type Reply = GrantRevokeReply;
}

impl ApprovalAnswerRequest {
    /// Problems of the answer itself (before any approval is read).
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        if self.by.trim().is_empty() {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "by",
                "an answer must say who gives it",
            ));
        }
        if crate::token::check_name(&self.approval_id).is_err() {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "approval_id",
                format!(
                    "{:?} is not an approval id (`t<task>a<attempt>`)",
                    self.approval_id
                ),
            ));
        }
        if self.incident && !matches!(self.decision, Decision::Reject { .. }) {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "incident",
                format!(
                    "`incident` goes with decision reject only, not {}",
                    self.decision.as_str()
                ),
            ));
        }
        if self.always && self.decision != Decision::Approve {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "always",
                format!(
                    "`always` goes with decision approve only, not {}",
                    self.decision.as_str()
                ),
            ));
        }
        let text = match &self.decision {
            Decision::Reject { message } => message.len(),
            Decision::Respond { result } => result.len(),
            Decision::Edit { input } => input.to_string().len(),
            Decision::Approve => 0,
        };
        if text > MAX_ANSWER_TEXT
            || self
                .comment
                .as_ref()
                .is_some_and(|c| c.len() > MAX_ANSWER_TEXT)
        {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "decision",
                format!(
                    "a message, result, input or comment is longer than {MAX_ANSWER_TEXT} bytes"
                ),
            ));
        }
        out
    }
}

/// Default deadline of an `approval.ask`, seconds.
pub const DEFAULT_ASK_TIMEOUT_S: u64 = 300;
/// Longest deadline of an `approval.ask`, seconds.
pub const MAX_ASK_TIMEOUT_S: u64 = 3600;
/// Longest `query_id` of an `approval.ask`, bytes.
pub const MAX_QUERY_ID: usize = 256;

/// Ask a person on behalf of a running attempt (`approval.ask`): an agent of the NATS Agent
/// Protocol the attempt called asked a question mid-call (its `query`, the protocol's frame
/// for a permission request). Stored like every approval (trigger `external_agent`), so
/// `approval.list`, the console's inbox and the notices show it, and answered with
/// `approval.answer`. Asking again with the same `query_id` answers the same approval; asked
/// again past its deadline, the approval is settled `expired` (its default: reject) unless an
/// answer came first — that is how the waiting attempt ends its wait.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ApprovalAskRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The calling run.
    pub run_id: RunId,
    /// The calling task.
    pub task_id: TaskId,
    /// The calling attempt (the task's current one).
    pub attempt: u32,
    /// The calling attempt's id, from its task envelope (`FLOTILLA_ATTEMPT_ID` of an exec
    /// agent): a question of an attempt that is not the task's current one is refused.
    pub attempt_id: crate::ids::AttemptId,
    /// The agent that asks (`agents:<agent>.<owner>.<session>`).
    pub agent: String,
    /// The query's id as the agent sent it (with the run, task and attempt, the approval's
    /// identity).
    pub query_id: String,
    /// What the agent asks (the query's `prompt`).
    pub question: String,
    /// What the call was about (the prompt sent to the agent), for the person's context.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub context: String,
    /// Seconds until the default (reject) decides: default [`DEFAULT_ASK_TIMEOUT_S`], 1 to
    /// [`MAX_ASK_TIMEOUT_S`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<u64>,
}

/// The answer to `approval.ask`: the approval as stored now (pending, or settled when
/// answered or past its deadline).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalAskReply {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The approval.
    pub record: ApprovalRecord,
}

impl ApprovalAskRequest {
    /// Problems of the request itself (before any run is read).
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        if self.attempt == 0 {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "attempt",
                "attempts count from 1",
            ));
        }
        if !self.agent.starts_with("agents:") || self.agent.len() <= "agents:".len() {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "agent",
                format!(
                    "{:?} is not an external agent (`agents:<agent>.<owner>.<session>`)",
                    self.agent
                ),
            ));
        }
        if self.query_id.trim().is_empty() || self.query_id.len() > MAX_QUERY_ID {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "query_id",
                format!("a query id is 1 to {MAX_QUERY_ID} bytes"),
            ));
        }
        if self.question.trim().is_empty() {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "question",
                "the question is empty",
            ));
        }
        if self.question.len() > MAX_ANSWER_TEXT || self.context.len() > MAX_ANSWER_TEXT {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "question",
                format!("the question or its context is longer than {MAX_ANSWER_TEXT} bytes"),
            ));
        }
        if let Some(t) = self.timeout_s
            && !(1..=MAX_ASK_TIMEOUT_S).contains(&t)
        {
            out.push(Problem::new(
                ProblemCode::InvalidTimeout,
                "timeout_s",
                format!("timeout_s must be 1 to {MAX_ASK_TIMEOUT_S}, not {t}"),
            ));
        }
        out
    }

    /// The approval's id: `t<task index>a<attempt>x<12 hex digits of the query id's
    /// SHA-256>` — the same query asked again is the same approval.
    pub fn approval_id(&self, task_index: u32) -> String {
        use sha2::Digest;
        let d = sha2::Sha256::digest(self.query_id.as_bytes());
        let hex: String = d[..6].iter().map(|b| format!("{b:02x}")).collect();
        format!("t{task_index}a{}x{hex}", self.attempt)
    }
}

/// What an external agent's query is answered with, once its approval is settled: `yes` for
/// approve, the person's text for respond, `no` for anything else (reject, the deadline, a
/// withdrawal); `None` while it is pending.
pub fn external_reply(record: &ApprovalRecord) -> Option<String> {
    let answer = record.answer.as_ref()?;
    if record.status == ApprovalStatus::Pending {
        return None;
    }
    Some(match (&record.status, &answer.decision) {
        (ApprovalStatus::Decided, Decision::Approve) => "yes".to_owned(),
        (ApprovalStatus::Decided, Decision::Respond { result }) => result.clone(),
        _ => "no".to_owned(),
    })
}

/// The SHA-256 (hex) of what a task runs with: its description and input.
pub fn digest_of(description: &str, input: &serde_json::Value) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(description.as_bytes());
    h.update([0u8]);
    h.update(input.to_string().as_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_sections_are_named() {
        let d = HitlConfig {
            sensitive_actions: vec![" ".into()],
            approval_timeout: Secs::from_secs(0),
            consecutive_failures: MAX_CONSECUTIVE_FAILURES + 1,
            low_confidence: 2.0,
            ..HitlConfig::default()
        };
        let fields: Vec<String> = d.problems().into_iter().map(|p| p.path).collect();
        assert_eq!(
            fields,
            [
                "hitl.sensitive-actions[0]",
                "hitl.approval-timeout",
                "hitl.low-confidence",
                "hitl.consecutive-failures"
            ]
        );
    }
}
