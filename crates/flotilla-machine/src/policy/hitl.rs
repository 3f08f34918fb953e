//! The escalation policy of a run: fixed at admission from the deployment's `[hitl]`
//! section, tightened by the plan's `config.hitl` and loosened only by trust that was earned
//! ([`resolve_trusted`]); carried in the run's state, so every coordinator and every replay
//! decides alike which task waits for a person ([`gate`]) and which tool calls do
//! ([`tool_gate`]). A waiting task is a state of the run machine plus its durable timer: it
//! holds no worker slot and no consumer.

use std::collections::BTreeMap;

use flotilla_model::approval::{HitlMode, HitlPolicy, PlanHitl, Trigger};
use flotilla_model::plan::Subtask;
use flotilla_model::task::ToolGate;

use super::config::{HitlConfig, OnBudgetExhausted};

/// Why and how a task waits for a person before it is dispatched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gate {
    /// What triggered it.
    pub trigger: Trigger,
    /// Only notify (`human_on_the_loop`): the task runs without waiting.
    pub notify_only: bool,
}

/// The run's policy: the deployment's, tightened by the plan's. `None` when nothing could
/// ever wait or notify (no sensitive action or risk, no `human_in_command` anywhere).
pub fn resolve(
    deployment: &HitlConfig,
    plan: Option<&PlanHitl>,
    default_agent: Option<&str>,
) -> Option<HitlPolicy> {
    resolve_trusted(deployment, plan, default_agent, &BTreeMap::new())
}

/// [`resolve`] with earned modes (`agent:<name>` / `role:<name>` → the mode of its trust
/// level, [`super::trust::trusted_modes`]): each applies where the deployment lists no mode
/// of its own for that agent or role, and the plan may tighten it like any other.
pub fn resolve_trusted(
    deployment: &HitlConfig,
    plan: Option<&PlanHitl>,
    default_agent: Option<&str>,
    trusted: &BTreeMap<String, HitlMode>,
) -> Option<HitlPolicy> {
    let mut mode = deployment.mode;
    let mut actions: Vec<String> = deployment
        .sensitive_actions
        .iter()
        .map(|a| a.trim().to_lowercase())
        .collect();
    let mut timeout = deployment.approval_timeout;
    if let Some(p) = plan {
        if let Some(m) = p.mode {
            mode = mode.max(m);
        }
        actions.extend(p.sensitive_actions.iter().map(|a| a.trim().to_lowercase()));
        if let Some(t) = p.approval_timeout {
            timeout = t;
        }
    }
    actions.sort();
    actions.dedup();
    let mut modes = BTreeMap::new();
    for (r, m) in &deployment.roles {
        modes.insert(format!("role:{r}"), *m);
    }
    for (a, m) in &deployment.agents {
        modes.insert(format!("agent:{a}"), *m);
    }
    for (key, m) in trusted {
        modes.entry(key.clone()).or_insert(*m);
    }
    let plan_mode = plan.and_then(|p| p.mode);
    if let Some(pm) = plan_mode {
        // The plan tightens every listed agent and role too.
        for m in modes.values_mut() {
            *m = (*m).max(pm);
        }
    }
    let policy = HitlPolicy {
        mode,
        sensitive_actions: actions,
        sensitive_risk: deployment.sensitive_risk,
        timeout,
        on_timeout: deployment.on_timeout,
        consecutive_failures: deployment.consecutive_failures,
        out_of_scope: deployment.out_of_scope,
        cost_limit: deployment.cost_limit,
        budget_ask: deployment.on_budget_exhausted == OnBudgetExhausted::Ask,
        low_confidence: plan
            .and_then(|p| p.low_confidence)
            .map_or(deployment.low_confidence, |l| {
                l.max(deployment.low_confidence)
            }),
        default_agent: default_agent
            .filter(|a| modes.contains_key(&format!("agent:{a}")))
            .map(str::to_owned),
        modes,
    };
    let can_gate = !policy.sensitive_actions.is_empty()
        || policy.sensitive_risk.is_some()
        || policy.consecutive_failures > 0
        || policy.out_of_scope
        || policy.low_confidence > 0.0
        || policy.cost_limit.is_some()
        || policy.budget_ask
        || policy.mode == HitlMode::HumanInCommand
        || policy
            .modes
            .values()
            .any(|m| *m == HitlMode::HumanInCommand);
    can_gate.then_some(policy)
}

/// The mode of the agent or role that runs `sub`: the agent's own, else its role's, else the
/// run's.
pub fn mode_of(policy: &HitlPolicy, sub: &Subtask) -> HitlMode {
    let agent = sub
        .agent
        .as_ref()
        .or(policy.default_agent.as_ref().filter(|_| sub.role.is_none()));
    agent
        .and_then(|a| policy.modes.get(&format!("agent:{a}")))
        .or_else(|| {
            sub.role
                .as_ref()
                .and_then(|r| policy.modes.get(&format!("role:{r}")))
        })
        .copied()
        .unwrap_or(policy.mode)
}

/// Whether `sub` waits for a person before it is dispatched (or, on the loop, is only
/// notified), when `failed` attempts of it have failed so far (each retry follows a failure,
/// so they are in a row). A sensitive action outranks `human_in_command`, which outranks
/// consecutive failures.
pub fn gate(policy: &HitlPolicy, sub: &Subtask, failed: u32) -> Option<Gate> {
    let mode = mode_of(policy, sub);
    let trigger = if is_sensitive(policy, sub) {
        Trigger::SensitiveAction
    } else if mode == HitlMode::HumanInCommand {
        Trigger::HumanInCommand
    } else if policy.consecutive_failures > 0 && failed >= policy.consecutive_failures {
        Trigger::ConsecutiveFailures
    } else {
        return None;
    };
    Some(Gate {
        trigger,
        notify_only: mode == HitlMode::HumanOnTheLoop,
    })
}

/// Whether `sub`'s action is sensitive under `policy`: a listed sensitive action (compared
/// trimmed and lower-case) or a risk at or above the sensitive risk.
pub fn is_sensitive(policy: &HitlPolicy, sub: &Subtask) -> bool {
    sub.action.as_ref().is_some_and(|a| {
        let a = a.trim().to_lowercase();
        policy.sensitive_actions.contains(&a)
    }) || policy.sensitive_risk.is_some_and(|r| sub.risk >= r)
}

/// Which tool calls of an LLM attempt of `sub` wait for a person: every call under
/// `human_in_command`, calls of sensitive tools (by name) otherwise, and calls of tools the
/// agent does not have when `out_of_scope` is set. `None` on the loop (nothing waits) or when
/// nothing is gated.
pub fn tool_gate(policy: &HitlPolicy, sub: &Subtask) -> Option<ToolGate> {
    let mode = mode_of(policy, sub);
    if mode == HitlMode::HumanOnTheLoop {
        return None;
    }
    let gate = ToolGate {
        all: mode == HitlMode::HumanInCommand,
        sensitive: policy.sensitive_actions.clone(),
        out_of_scope: policy.out_of_scope,
        cost_limit: policy.cost_limit,
        budget_ask: policy.budget_ask,
    };
    (gate.all
        || !gate.sensitive.is_empty()
        || gate.out_of_scope
        || gate.cost_limit.is_some()
        || gate.budget_ask)
        .then_some(gate)
}

/// Whether a result stating `confidence` is held for review (trigger `low_confidence`):
/// below the run's threshold, and the task not overseen `human_on_the_loop` (notified only:
/// nothing waits). The confidence and the threshold when it is.
pub fn review(policy: &HitlPolicy, sub: &Subtask, confidence: f64) -> Option<(f64, f64)> {
    (confidence < policy.low_confidence && mode_of(policy, sub) != HitlMode::HumanOnTheLoop)
        .then_some((confidence, policy.low_confidence))
}

#[cfg(test)]
mod tests {
    use flotilla_model::approval::DefaultDecision;

    use crate::policy::config::DEFAULT_LOW_CONFIDENCE;

    use super::*;

    fn sub(action: Option<&str>, agent: Option<&str>, role: Option<&str>) -> Subtask {
        let mut s = Subtask::new("t", "do it");
        s.action = action.map(str::to_owned);
        s.agent = agent.map(str::to_owned);
        s.role = role.map(str::to_owned);
        s
    }

    #[test]
    fn the_default_deployment_gates_sensitive_actions_only() {
        let p = resolve(&HitlConfig::default(), None, None).expect("a policy");
        assert_eq!(
            gate(&p, &sub(Some("Publish"), None, None), 0).map(|g| g.trigger),
            Some(Trigger::SensitiveAction)
        );
        assert_eq!(gate(&p, &sub(Some("read"), None, None), 0), None);
        assert_eq!(gate(&p, &sub(None, None, None), 0), None);
    }

    #[test]
    fn modes_go_agent_then_role_then_run_and_plans_only_tighten() {
        let mut d = HitlConfig::default();
        d.roles.insert("writer".into(), HitlMode::HumanInCommand);
        d.agents.insert("bot".into(), HitlMode::HumanOnTheLoop);
        let p = resolve(&d, None, None).expect("a policy");
        let g = gate(&p, &sub(None, None, Some("writer")), 0).expect("gated");
        assert_eq!(g.trigger, Trigger::HumanInCommand);
        assert!(!g.notify_only);
        // The agent's own mode wins over its role's: on the loop, a sensitive action only
        // notifies.
        let g = gate(&p, &sub(Some("pay"), Some("bot"), Some("writer")), 0).expect("gated");
        assert!(g.notify_only);
        // A plan asking for less oversight changes nothing; asking for more tightens all.
        let loose = PlanHitl {
            mode: Some(HitlMode::HumanOnTheLoop),
            ..PlanHitl::default()
        };
        assert_eq!(resolve(&d, Some(&loose), None), Some(p.clone()));
        let strict = PlanHitl {
            mode: Some(HitlMode::HumanInCommand),
            sensitive_actions: vec!["Deploy".into()],
            ..PlanHitl::default()
        };
        let s = resolve(&d, Some(&strict), None).expect("a policy");
        assert!(
            !gate(&s, &sub(None, Some("bot"), None), 0)
                .expect("gated")
                .notify_only
        );
        assert_eq!(
            gate(&s, &sub(Some("deploy"), None, None), 0).map(|g| g.trigger),
            Some(Trigger::SensitiveAction)
        );
    }

    #[test]
    fn nothing_to_gate_is_no_policy() {
        let d = HitlConfig {
            sensitive_actions: Vec::new(),
            low_confidence: 0.0,
            ..HitlConfig::default()
        };
        assert_eq!(resolve(&d, None, None), None);
        // A review threshold alone is something to gate (results stating low confidence).
        let reviewing = HitlConfig {
            sensitive_actions: Vec::new(),
            ..HitlConfig::default()
        };
        let p = resolve(&reviewing, None, None).expect("a policy");
        assert_eq!(p.low_confidence, DEFAULT_LOW_CONFIDENCE);
    }

    #[test]
    fn a_retry_after_consecutive_failures_is_gated_below_the_other_triggers() {
        let d = HitlConfig {
            sensitive_actions: Vec::new(),
            consecutive_failures: 2,
            ..HitlConfig::default()
        };
        let p = resolve(&d, None, None).expect("a policy: the trigger can fire");
        assert_eq!(gate(&p, &sub(None, None, None), 0), None);
        assert_eq!(gate(&p, &sub(None, None, None), 1), None);
        let g = gate(&p, &sub(None, None, None), 2).expect("gated");
        assert_eq!(g.trigger, Trigger::ConsecutiveFailures);
        assert_eq!(p.on_timeout.of(g.trigger), DefaultDecision::Reject);
        // A sensitive action still says so.
        let mut with_actions = d.clone();
        with_actions.sensitive_actions = vec!["pay".into()];
        let p = resolve(&with_actions, None, None).expect("a policy");
        assert_eq!(
            gate(&p, &sub(Some("pay"), None, None), 5).map(|g| g.trigger),
            Some(Trigger::SensitiveAction)
        );
        // Off (the default): never.
        let off = resolve(&HitlConfig::default(), None, None).expect("a policy");
        assert_eq!(gate(&off, &sub(None, None, None), 50), None);
        // A policy stored before the trigger existed reads as off, and the default decision
        // is written only when it is not `reject`.
        let json = serde_json::to_value(&off).expect("encodes");
        assert!(json.get("cf").is_none(), "{json}");
        assert!(json["d"].get("consecutive-failures").is_none(), "{json}");
    }

    #[test]
    fn on_the_loop_no_tool_call_waits_and_a_low_confidence_is_not_held() {
        let mut d = HitlConfig::default();
        d.agents.insert("bot".into(), HitlMode::HumanOnTheLoop);
        d.agents.insert("boss".into(), HitlMode::HumanInCommand);
        let p = resolve(&d, None, None).expect("a policy");
        assert_eq!(tool_gate(&p, &sub(None, Some("bot"), None)), None);
        let g = tool_gate(&p, &sub(None, Some("boss"), None)).expect("gated");
        assert!(g.all);
        assert_eq!(review(&p, &sub(None, Some("bot"), None), 0.1), None);
        assert_eq!(
            review(&p, &sub(None, Some("boss"), None), 0.1),
            Some((0.1, DEFAULT_LOW_CONFIDENCE))
        );
        assert_eq!(review(&p, &sub(None, Some("boss"), None), 0.9), None);
    }
}
