//! The deployment's configuration the policy reads: `[hitl]` ([`HitlConfig`]) and
//! `[hitl.trust]` ([`TrustConfig`]). Configuration, not wire: a run carries the policy it was
//! admitted with (`flotilla_model::approval::HitlPolicy`), resolved from these by
//! [`super::hitl::resolve_trusted`], so a replay of its log needs none of it. The coordinator
//! (admission), the supervisor (earned trust) and the CLI (the config file) read it from here.

use std::collections::BTreeMap;

use flotilla_model::approval::{self, DEFAULT_APPROVAL_TIMEOUT, HitlMode, OnTimeout};
use flotilla_model::plan::Risk;
use flotilla_model::problem::{Problem, ProblemCode};
use flotilla_model::time::Secs;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

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
    pub trust: TrustConfig,
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
            trust: TrustConfig::default(),
        }
    }
}

impl HitlConfig {
    /// Problems of the section: an empty action name, a deadline out of range.
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = approval::check_actions(&self.sensitive_actions, "hitl.sensitive-actions");
        out.extend(approval::check_timeout(
            self.approval_timeout,
            "hitl.approval-timeout".into(),
        ));
        out.extend(self.trust.problems());
        out.extend(approval::check_confidence(
            self.low_confidence,
            "hitl.low-confidence",
        ));
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

/// The default `[hitl] low-confidence`.
pub const DEFAULT_LOW_CONFIDENCE: f64 = 0.6;

/// What one level takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct LevelRule {
    /// Attempts counted (succeeded and failed).
    pub min_tasks: u64,
    /// Succeeded over counted, in percent (0 to 100).
    pub min_success_percent: u32,
    /// Days since the agent or role was first counted.
    pub min_days: u32,
    /// Days since the last incident (or since first counted, without one).
    pub incident_free_days: u32,
}

/// `[hitl.trust]`: earned trust.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct TrustConfig {
    /// Admit runs with each agent's and role's earned mode (default false: the levels are
    /// kept and shown, the modes of `[hitl]` apply).
    pub enabled: bool,
    /// What `proficient` takes (default 50 tasks, 90 %, 7 days, 7 incident-free days).
    pub proficient: LevelRule,
    /// What `expert` takes (default 200 tasks, 98 %, 30 days, 30 incident-free days).
    pub expert: LevelRule,
}

impl Default for TrustConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            proficient: LevelRule {
                min_tasks: 50,
                min_success_percent: 90,
                min_days: 7,
                incident_free_days: 7,
            },
            expert: LevelRule {
                min_tasks: 200,
                min_success_percent: 98,
                min_days: 30,
                incident_free_days: 30,
            },
        }
    }
}

impl TrustConfig {
    /// Every problem of the section, each naming its key.
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        for (name, r) in [("proficient", &self.proficient), ("expert", &self.expert)] {
            if r.min_success_percent > 100 {
                out.push(Problem::new(
                    ProblemCode::InvalidConfig,
                    format!("hitl.trust.{name}.min-success-percent"),
                    format!("must be 0 to 100, not {}", r.min_success_percent),
                ));
            }
        }
        let (p, e) = (&self.proficient, &self.expert);
        if e.min_tasks < p.min_tasks
            || e.min_success_percent < p.min_success_percent
            || e.min_days < p.min_days
            || e.incident_free_days < p.incident_free_days
        {
            out.push(Problem::new(
                ProblemCode::InvalidConfig,
                "hitl.trust.expert",
                "expert must take at least what proficient takes, rule by rule",
            ));
        }
        out
    }
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
