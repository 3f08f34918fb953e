//! What a plan is checked against: the installation's context (pools, agents) and the
//! limits on sizes, counts and durations, and how the size and depth of JSON values are
//! measured against them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::plan::Plan;
use crate::problem::{Problem, ProblemCode};

/// Size and count limits applied to plans.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Most subtasks in one plan.
    pub max_subtasks: usize,
    /// Largest `description`, in bytes.
    pub max_description_bytes: usize,
    /// Largest `input`, serialised as JSON, in bytes.
    pub max_input_bytes: usize,
    /// Longest accepted timeout.
    pub max_timeout: Duration,
    /// Highest `max_retries`.
    pub max_retries: u32,
    /// Deepest nesting of a subtask's `input` (objects and arrays). Stored messages wrap the
    /// input a few levels deeper, and every decoder on the way has a recursion limit (128 in
    /// serde_json), so deeper input would pass intake and break a later decode.
    pub max_input_depth: usize,
    /// Largest plan, as JSON, when the deployment's message size is known (its NATS max
    /// payload less room for the envelope); `None` skips the check.
    pub max_plan_bytes: Option<usize>,
}

/// Room left in a NATS message for what wraps a plan (run-log entry, labels, trace).
pub const PLAN_ENVELOPE_ROOM: usize = 16 * 1024;

/// NATS's default max payload, assumed when the deployment's is unknown.
pub const DEFAULT_MAX_PAYLOAD: usize = 1024 * 1024;

impl Default for Limits {
    fn default() -> Self {
        Self {
            // The coordinator keeps a run's scheduling state in one KV value; 10,000 tasks keep
            // it well under the default 1 MiB NATS payload.
            max_subtasks: 10_000,
            max_description_bytes: 32 * 1024,
            max_input_bytes: 256 * 1024,
            max_timeout: Duration::from_secs(7 * 24 * 3600),
            max_retries: 100,
            max_input_depth: 64,
            max_plan_bytes: None,
        }
    }
}

/// What the validator knows about the installation. `None` skips the matching check, which is
/// what `flotilla plan validate` does when it runs without a config.
#[derive(Debug, Clone, Default)]
pub struct ValidationContext {
    /// Pools workers are configured for.
    pub pools: Option<BTreeSet<String>>,
    /// Agent definitions.
    pub agents: Option<AgentCatalog>,
    /// Limits.
    pub limits: Limits,
}

impl ValidationContext {
    /// This context, with plans bounded to what one message of `max_payload` bytes holds
    /// besides the envelope around a plan ([`PLAN_ENVELOPE_ROOM`]).
    pub fn for_payload(&self, max_payload: usize) -> Self {
        let mut ctx = self.clone();
        ctx.limits.max_plan_bytes = Some(max_payload.saturating_sub(PLAN_ENVELOPE_ROOM));
        ctx
    }
}

/// The agent definitions a plan may name.
#[derive(Debug, Clone, Default)]
pub struct AgentCatalog {
    /// Defined agent names.
    pub names: BTreeSet<String>,
    /// The agent used when a subtask names none.
    pub default: Option<String>,
    /// The workflow agents among `names` (`sequential`, `parallel`, `loop`): their tasks are
    /// dispatched to the coordinators' pool [`crate::subjects::WORKFLOW_POOL`].
    pub workflows: BTreeSet<String>,
    /// The team roles the member cards define (`roles = [...]` in `[agents.NAME]`), each with
    /// the agents that fill it. Workflow agents are left out: they run on the coordinators,
    /// which claim no role's tasks. Empty: the deployment defines no roles, and a subtask's
    /// `role` only picks the system prompt of the agent that runs it.
    pub roles: BTreeMap<String, BTreeSet<String>>,
    /// Each agent's compensation (`[agents.NAME] compensate = "…"`): the agent that undoes
    /// its tasks when their run is cancelled with `rollback`.
    pub compensations: BTreeMap<String, String>,
}

impl AgentCatalog {
    /// Whether the member cards define any role: then a subtask naming a `role` and no
    /// `agent` is an anycast task, claimed by one free member of the role.
    pub fn has_roles(&self) -> bool {
        !self.roles.is_empty()
    }

    /// The agent that leads runs under the `supervisor` strategy: the first (by name) whose
    /// card has the role [`crate::plan::LEAD_ROLE`].
    pub fn lead(&self) -> Option<&str> {
        self.roles
            .get(crate::plan::LEAD_ROLE)
            .and_then(|agents| agents.first())
            .map(String::as_str)
    }

    /// The catalog's roles from member cards: `cards` gives each agent's roles; workflow
    /// agents (in `self.workflows`) are left out.
    pub fn with_roles<'a>(
        mut self,
        cards: impl IntoIterator<Item = (&'a str, &'a [String])>,
    ) -> Self {
        for (agent, roles) in cards {
            if self.workflows.contains(agent) {
                continue;
            }
            for role in roles {
                self.roles
                    .entry(role.clone())
                    .or_default()
                    .insert(agent.to_owned());
            }
        }
        self
    }

    /// The agent that undoes a task naming `agent` (or none: the default), if its agent
    /// declares one.
    pub fn compensation(&self, agent: Option<&str>) -> Option<&str> {
        agent
            .or(self.default.as_deref())
            .and_then(|a| self.compensations.get(a))
            .map(String::as_str)
    }

    /// Whether a task naming `agent` (or none: the default) runs a workflow agent.
    pub fn is_workflow(&self, agent: Option<&str>) -> bool {
        agent
            .or(self.default.as_deref())
            .is_some_and(|a| self.workflows.contains(a))
    }
}

/// Checks a plan's encoded size against `max_bytes` (see [`Limits::max_plan_bytes`]).
pub fn check_plan_size(plan: &Plan, max_bytes: usize) -> Option<Problem> {
    let size = json_size(&serde_json::to_value(plan).unwrap_or_default());
    (size > max_bytes).then(|| {
        Problem::new(
            ProblemCode::PlanTooLarge,
            "",
            format!(
                "the plan is {size} bytes as JSON; this deployment accepts plans up to {max_bytes} bytes (its NATS max payload less {PLAN_ENVELOPE_ROOM} bytes of envelope). Split it into several runs, or pass large inputs by reference (workspace entries, artifacts)"
            ),
        )
    })
}

/// Nesting depth of a JSON value: 0 for a scalar, 1 for a flat array or object. Iterative,
/// so no input can exhaust the stack.
pub fn json_depth(value: &serde_json::Value) -> usize {
    let mut deepest = 0;
    let mut stack: Vec<(&serde_json::Value, usize)> = vec![(value, 0)];
    while let Some((v, d)) = stack.pop() {
        deepest = deepest.max(d);
        match v {
            serde_json::Value::Array(a) => stack.extend(a.iter().map(|x| (x, d + 1))),
            serde_json::Value::Object(o) => stack.extend(o.values().map(|x| (x, d + 1))),
            _ => {}
        }
    }
    deepest
}

pub(super) fn json_size(value: &serde_json::Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(0);
    // Writing a Value into a counter cannot fail.
    let _ = serde_json::to_writer(&mut c, value);
    c.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Subtask;
    use crate::validate::tests::{codes, plan};
    use crate::validate::validate_plan;

    #[test]
    fn oversize_plans_are_reported_against_the_limit() {
        let tasks = (0..200)
            .map(|i| Subtask::new(&format!("t{i}"), &"x".repeat(100)))
            .collect();
        let p = plan(tasks);
        let ctx = ValidationContext {
            limits: Limits {
                max_plan_bytes: Some(10_000),
                ..Limits::default()
            },
            ..ValidationContext::default()
        };
        let r = validate_plan(&p, &ctx);
        assert_eq!(codes(&r), vec![ProblemCode::PlanTooLarge]);
        assert!(
            r.errors[0].message.contains("10000 bytes"),
            "{}",
            r.errors[0].message
        );
        assert!(validate_plan(&p, &ValidationContext::default()).is_valid());
    }

    #[test]
    fn deep_input_is_refused_at_validation() {
        let mut deep = serde_json::json!(1);
        for _ in 0..100 {
            deep = serde_json::json!([deep]);
        }
        let mut t = Subtask::new("a", "");
        t.input = deep;
        let r = validate_plan(&plan(vec![t]), &ValidationContext::default());
        assert_eq!(codes(&r), vec![ProblemCode::InputTooDeep]);
        assert!(
            r.errors[0].message.contains("100 levels"),
            "{}",
            r.errors[0].message
        );
        assert_eq!(json_depth(&serde_json::json!({"a": [1, {"b": 2}]})), 3);
        assert_eq!(json_depth(&serde_json::json!("x")), 0);
    }
}
