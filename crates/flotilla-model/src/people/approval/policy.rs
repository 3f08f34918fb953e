//! The escalation policy on the wire: a plan's `config.hitl` ([`PlanHitl`]) and the policy a
//! run is admitted with ([`HitlPolicy`]) — data only. The deployment's `[hitl]` section is
//! configuration, kept with the policy that reads it (`flotilla_machine::policy::config`);
//! what the policy decides is `flotilla_machine::policy::hitl`.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::plan::Risk;
use crate::problem::{Problem, ProblemCode};
use crate::time::Secs;

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

/// A problem when `value` is not a confidence threshold (0 to 1).
pub fn check_confidence(value: f64, field: &str) -> Option<Problem> {
    (!(0.0..=1.0).contains(&value)).then(|| {
        Problem::new(
            ProblemCode::InvalidConfig,
            field,
            format!("must be between 0 (never hold a result) and 1, not {value}"),
        )
    })
}

/// A problem per sensitive action of `actions` that names none, at `field[i]`.
pub fn check_actions(actions: &[String], field: &str) -> Vec<Problem> {
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

pub fn check_timeout(t: Secs, field: String) -> Option<Problem> {
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

fn is_zero(n: &u32) -> bool {
    *n == 0
}
