//! Workflow agents: agents composed of other agents (`kind = "sequential" | "parallel" |
//! "loop"`), as in ADK's workflow agents.
//!
//! ```toml
//! [agents.review]                  # draft, then critique, in order
//! kind = "sequential"
//! sub-agents = ["drafter", "critic"]
//! output-keys = { drafter = "draft" }   # session-state key of a sub-agent's result
//!
//! [agents.research]                # three branches at once, results gathered
//! kind = "parallel"
//! sub-agents = ["web", "papers", "news"]
//!
//! [agents.refine]                  # writer then judge, until the judge escalates
//! kind = "loop"
//! sub-agents = ["writer", "judge"]
//! max-iterations = 5
//! ```
//!
//! Every execution of a sub-agent is a **child run** of the workflow task's run
//! ([`AgentContext::call_agent`]): durable, on the workers of its pool, with its own record
//! and events, sharing the root's workspace and the session's state. The child's run id is
//! derived from the workflow attempt and the step (`s<i>-<agent>`, `p-<agent>`,
//! `l<iteration>-<i>-<agent>`), so a workflow attempt delivered again — its process died —
//! re-attaches to the children that exist instead of starting them again, and steps that
//! ended are read back, not re-run.
//!
//! Workflow agents are run by the coordinators, not by workers: the coordinator dispatches a
//! task whose agent is a workflow agent to the pool [`WORKFLOW_POOL`], which every
//! coordinator serves with an embedded worker whose waiting attempts hold no worker slot
//! (see `flotilla coordinator`). A nested workflow agent is a child run whose task is
//! dispatched the same way.
//!
//! What flows between steps:
//! - every child gets the workflow task's description and an `input` object: `workflow`
//!   (its name), `step`, `branch` (`<workflow>.<sub-agent>`, distinct per parallel branch),
//!   `iteration` (loops, from 1), the workflow task's own `input`, `query` and
//!   `dependency_results` (its dependencies in the plan), and `previous_results`
//!   (`[{agent, response, numeric_value}]` of the steps before it, in order; none for
//!   parallel branches, which are isolated);
//! - a sub-agent listed in `output-keys` has its result written to that session-state key
//!   when its child run succeeds (the child task's `output_key`), where later steps' agents
//!   read it (`{key}` placeholders, `state_get`, `flotilla state get`);
//! - a loop stops early when a sub-agent's response is a JSON object with `"escalate": true`.
//!
//! The workflow's result: sequential and loop — the last step's response and numeric value;
//! parallel — a JSON object of the branches' responses by sub-agent. A child that does not
//! succeed fails the workflow attempt (`agent_failed`, retried like any attempt: a retry is a
//! new attempt and runs its steps again) — except a child that was rejected (an invalid plan,
//! the tree's `tree_too_deep` / `tree_too_large`: `child_rejected`) or that failed because the
//! tree's budget is spent (`budget_exhausted`): those fail it for good, since a retry would
//! be refused alike.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use flotilla_context::{Agent, AgentContext, AgentError, AgentReply, ChildCall};
use flotilla_model::run::{RunOutcome, RunStatus};
use flotilla_model::task::{TaskEnvelope, TaskErrorKind};
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

pub use flotilla_model::subjects::WORKFLOW_POOL;

/// `kind = "sequential" | "parallel"`: sub-agents in order, or all at once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct WorkflowConfig {
    /// The agents composed, by name (each defined under `[agents]`).
    pub sub_agents: Vec<String>,
    /// Session-state keys the results of some sub-agents are written to.
    #[serde(default)]
    pub output_keys: BTreeMap<String, String>,
    /// Worker pool of the sub-agents' child runs (default: `default`).
    #[serde(default)]
    pub pool: Option<String>,
    /// Per-attempt time limit of each child task (default: the plan's).
    #[serde(default, with = "humantime_serde::option")]
    pub step_timeout: Option<Duration>,
}

/// `kind = "loop"`: sub-agents in order, again, until one escalates or `max-iterations`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct LoopConfig {
    /// The agents composed, by name.
    pub sub_agents: Vec<String>,
    /// Most iterations (at least 1).
    pub max_iterations: u32,
    /// Session-state keys the results of some sub-agents are written to (each iteration
    /// overwrites them).
    #[serde(default)]
    pub output_keys: BTreeMap<String, String>,
    /// Worker pool of the sub-agents' child runs (default: `default`).
    #[serde(default)]
    pub pool: Option<String>,
    /// Per-attempt time limit of each child task (default: the plan's).
    #[serde(default, with = "humantime_serde::option")]
    pub step_timeout: Option<Duration>,
}

/// How a workflow agent runs its sub-agents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkflowKind {
    /// In order, each after the previous one succeeded.
    Sequential,
    /// All at once.
    Parallel,
    /// In order, repeatedly.
    Loop {
        /// Most iterations.
        max_iterations: u32,
    },
}

/// A composed agent.
#[derive(Debug, Clone)]
pub struct WorkflowAgent {
    name: String,
    kind: WorkflowKind,
    sub_agents: Vec<String>,
    output_keys: BTreeMap<String, String>,
    pool: Option<String>,
    step_timeout: Option<Duration>,
}

/// One workflow definition as the tree check sees it.
#[derive(Debug, Clone, Copy)]
pub struct WorkflowShape<'a> {
    /// Its kind (for messages).
    pub kind: &'static str,
    /// Its sub-agents.
    pub sub_agents: &'a [String],
    /// Its output keys.
    pub output_keys: &'a BTreeMap<String, String>,
    /// For loops.
    pub max_iterations: Option<u32>,
}

/// Checks that the workflow definitions form a tree over the defined agents: every
/// sub-agent is defined, listed once in its workflow and by one workflow only (one parent),
/// no workflow contains itself (no cycles), output keys name sub-agents and are distinct,
/// and loops iterate at least once. Every problem names the definitions involved.
pub fn check_tree(
    workflows: &BTreeMap<&str, WorkflowShape<'_>>,
    defined: &BTreeSet<&str>,
) -> Result<(), Vec<String>> {
    let mut problems = Vec::new();
    let mut parent: BTreeMap<&str, &str> = BTreeMap::new();
    for (&name, w) in workflows {
        if w.sub_agents.is_empty() {
            problems.push(format!(
                "agents.{name}.sub-agents: a {} workflow needs at least one sub-agent",
                w.kind
            ));
        }
        if w.max_iterations == Some(0) {
            problems.push(format!("agents.{name}.max-iterations: must be at least 1"));
        }
        let mut seen = BTreeSet::new();
        for sub in w.sub_agents {
            if !seen.insert(sub.as_str()) {
                problems.push(format!("agents.{name}.sub-agents: {sub:?} is listed twice"));
                continue;
            }
            if sub == name {
                problems.push(format!(
                    "agents.{name}.sub-agents: {name:?} contains itself"
                ));
                continue;
            }
            if !defined.contains(sub.as_str()) {
                problems.push(format!(
                    "agents.{name}.sub-agents: {sub:?} is not defined under [agents]"
                ));
                continue;
            }
            if let Some(other) = parent.insert(sub.as_str(), name) {
                problems.push(format!(
                    "agents.{name}.sub-agents: {sub:?} already belongs to workflow {other:?} (an agent has one parent; define a second agent for the second use)"
                ));
            }
        }
        let mut keys = BTreeMap::new();
        for (sub, key) in w.output_keys {
            if !w.sub_agents.contains(sub) {
                problems.push(format!(
                    "agents.{name}.output-keys.{sub}: {sub:?} is not one of its sub-agents"
                ));
            }
            if let Err(e) = flotilla_model::token::check_name(key) {
                problems.push(format!("agents.{name}.output-keys.{sub}: {key:?} {e}"));
            }
            if let Some(first) = keys.insert(key.as_str(), sub.as_str()) {
                problems.push(format!(
                    "agents.{name}.output-keys: {first:?} and {sub:?} both write {key:?}; branches write distinct keys"
                ));
            }
        }
    }
    // Cycles through nesting: follow parents upwards from every workflow.
    for &start in workflows.keys() {
        let mut at = start;
        let mut path = vec![start];
        while let Some(&up) = parent.get(at) {
            if up == start {
                path.push(up);
                path.reverse();
                problems.push(format!(
                    "agents.{start}: workflows contain each other: {}",
                    path.join(" → ")
                ));
                break;
            }
            if path.contains(&up) {
                break;
            }
            path.push(up);
            at = up;
        }
    }
    problems.sort();
    problems.dedup();
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}

impl WorkflowAgent {
    /// A sequential or parallel workflow.
    pub fn new(name: &str, parallel: bool, c: &WorkflowConfig) -> Self {
        Self {
            name: name.to_owned(),
            kind: if parallel {
                WorkflowKind::Parallel
            } else {
                WorkflowKind::Sequential
            },
            sub_agents: c.sub_agents.clone(),
            output_keys: c.output_keys.clone(),
            pool: c.pool.clone(),
            step_timeout: c.step_timeout,
        }
    }

    /// A loop workflow.
    pub fn new_loop(name: &str, c: &LoopConfig) -> Self {
        Self {
            name: name.to_owned(),
            kind: WorkflowKind::Loop {
                max_iterations: c.max_iterations,
            },
            sub_agents: c.sub_agents.clone(),
            output_keys: c.output_keys.clone(),
            pool: c.pool.clone(),
            step_timeout: c.step_timeout,
        }
    }

    /// Its kind.
    pub fn kind(&self) -> WorkflowKind {
        self.kind
    }

    /// Runs one step: a child run of `sub`, waited for; its response and numeric value.
    async fn step(
        &self,
        task: &TaskEnvelope,
        ctx: &AgentContext,
        sub: &str,
        call_id: String,
        input: Value,
    ) -> Result<(String, Option<f64>), AgentError> {
        let call = ChildCall {
            agent: sub.to_owned(),
            description: task.description.clone(),
            input,
            pool: self.pool.clone(),
            produces: Vec::new(),
            timeout: self.step_timeout,
            call_id: Some(call_id),
            output_key: self.output_keys.get(sub).cloned(),
        };
        let (child, outcome) = ctx.call_agent(&call).await.map_err(|e| {
            if ctx.cancel.is_cancelled() {
                AgentError::cancelled(format!("workflow {}: {e}", self.name))
            } else if e.kind() == flotilla_context::ErrorKind::ChildRejected {
                // The step's child never ran (an invalid plan, or the tree's depth or size
                // limit): another attempt of the workflow would be refused alike.
                AgentError {
                    kind: TaskErrorKind::ChildRejected,
                    message: format!("workflow {}: sub-agent {sub}: {e}", self.name),
                }
            } else {
                AgentError::failed(format!("workflow {}: sub-agent {sub}: {e}", self.name))
            }
        })?;
        succeeded(&outcome).ok_or_else(|| AgentError {
            // A spent tree budget (or a refused grandchild) ends the workflow for good too.
            kind: flotilla_context::binding_failure(&outcome).unwrap_or(TaskErrorKind::AgentFailed),
            message: format!(
                "workflow {}: sub-agent {sub} (child run {}) ended {}: {}",
                self.name,
                child.handle.run_id,
                status_word(outcome.status),
                failure_summary(&outcome)
            ),
        })
    }

    fn input(&self, task: &TaskEnvelope, sub: &str, step: usize, extra: Value) -> Value {
        let mut input = json!({
            "workflow": self.name,
            "step": step,
            "branch": format!("{}.{sub}", self.name),
        });
        if let Some(m) = input.as_object_mut() {
            if !task.input.is_null() {
                m.insert("input".into(), task.input.clone());
            }
            if let Some(q) = &task.query {
                m.insert("query".into(), json!(q));
            }
            // The plan's own dependencies of the workflow task reach every step.
            if !task.dependency_results.is_empty() {
                m.insert(
                    "dependency_results".into(),
                    serde_json::to_value(&task.dependency_results).unwrap_or(Value::Null),
                );
            }
        }
        if let (Some(m), Value::Object(extra)) = (input.as_object_mut(), extra) {
            m.extend(extra);
        }
        input
    }

    async fn sequence(
        &self,
        task: &TaskEnvelope,
        ctx: &AgentContext,
        iteration: Option<u32>,
        previous: &mut Vec<Value>,
    ) -> Result<Option<(String, Option<f64>, bool)>, AgentError> {
        let mut last = None;
        for (i, sub) in self.sub_agents.iter().enumerate() {
            let call_id = match iteration {
                None => format!("s{i}-{sub}"),
                Some(it) => format!("l{it}-{i}-{sub}"),
            };
            let mut extra = json!({ "previous_results": previous.clone() });
            if let (Some(it), Some(m)) = (iteration, extra.as_object_mut()) {
                m.insert("iteration".into(), json!(it));
            }
            let input = self.input(task, sub, i, extra);
            let (response, numeric) = self.step(task, ctx, sub, call_id, input).await?;
            previous.push(json!({"agent": sub, "response": response, "numeric_value": numeric}));
            let escalate = escalates(&response);
            last = Some((response, numeric, escalate));
            if escalate && iteration.is_some() {
                break;
            }
        }
        Ok(last)
    }

    async fn attempt(
        &self,
        task: &TaskEnvelope,
        ctx: &AgentContext,
    ) -> Result<AgentReply, AgentError> {
        let reply = |response: String, numeric_value: Option<f64>| AgentReply {
            response,
            tokens: 0,
            tools_used: Vec::new(),
            numeric_value,
            confidence: None,
        };
        match self.kind {
            WorkflowKind::Sequential => {
                let mut previous = Vec::new();
                let (response, numeric, _) = self
                    .sequence(task, ctx, None, &mut previous)
                    .await?
                    .unwrap_or_default();
                Ok(reply(response, numeric))
            }
            WorkflowKind::Parallel => {
                let branches = self.sub_agents.iter().enumerate().map(|(i, sub)| {
                    let input = self.input(task, sub, i, json!({}));
                    async move {
                        let r = self.step(task, ctx, sub, format!("p-{sub}"), input).await;
                        (sub.clone(), r)
                    }
                });
                let mut gathered = serde_json::Map::new();
                for (sub, r) in futures::future::join_all(branches).await {
                    let (response, _) = r?;
                    gathered.insert(sub, Value::String(response));
                }
                Ok(reply(Value::Object(gathered).to_string(), None))
            }
            WorkflowKind::Loop { max_iterations } => {
                let mut previous = Vec::new();
                let mut last = None;
                for it in 1..=max_iterations {
                    let step = self.sequence(task, ctx, Some(it), &mut previous).await?;
                    let escalated = step.as_ref().is_some_and(|s| s.2);
                    last = step;
                    if escalated {
                        tracing::debug!(workflow = %self.name, iteration = it, "A sub-agent escalated; the loop ends");
                        break;
                    }
                }
                let (response, numeric, _) = last.unwrap_or_default();
                Ok(reply(response, numeric))
            }
        }
    }
}

impl Agent for WorkflowAgent {
    fn run<'a>(
        &'a self,
        task: &'a TaskEnvelope,
        ctx: AgentContext,
    ) -> BoxFuture<'a, Result<AgentReply, AgentError>> {
        Box::pin(async move { self.attempt(task, &ctx).await })
    }
}

/// The response and numeric value of a child that succeeded.
fn succeeded(outcome: &RunOutcome) -> Option<(String, Option<f64>)> {
    (outcome.status == RunStatus::Succeeded).then(|| {
        outcome
            .final_result
            .as_ref()
            .map(|f| (f.response.clone(), f.numeric_value))
            .unwrap_or_default()
    })
}

fn status_word(s: RunStatus) -> String {
    serde_json::to_value(s)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| format!("{s:?}"))
}

fn failure_summary(outcome: &RunOutcome) -> String {
    outcome
        .failed
        .first()
        .map(|f| format!("{} ({})", f.error.message, f.task_id))
        .or_else(|| outcome.reason.clone())
        .unwrap_or_else(|| "no reason given".into())
}

/// Whether a response asks a loop to stop: a JSON object with `"escalate": true`.
pub fn escalates(response: &str) -> bool {
    let t = response.trim();
    t.starts_with('{')
        && serde_json::from_str::<Value>(t)
            .ok()
            .and_then(|v| v.get("escalate").and_then(Value::as_bool))
            .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape<'a>(
        kind: &'static str,
        subs: &'a [String],
        keys: &'a BTreeMap<String, String>,
    ) -> WorkflowShape<'a> {
        WorkflowShape {
            kind,
            sub_agents: subs,
            output_keys: keys,
            max_iterations: None,
        }
    }

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn escalation_is_a_json_flag() {
        assert!(escalates(r#" {"escalate": true, "why": "good"} "#));
        assert!(!escalates(r#"{"escalate": false}"#));
        assert!(!escalates("escalate: true"));
        assert!(!escalates("{not json"));
    }

    #[test]
    fn trees_are_accepted_and_every_problem_is_named() {
        let none = BTreeMap::new();
        let (a, b, top) = (names(&["x", "y"]), names(&["z"]), names(&["pa", "pb"]));
        let defined: BTreeSet<&str> = ["x", "y", "z", "pa", "pb", "top"].into();
        let ok: BTreeMap<&str, WorkflowShape<'_>> = [
            ("pa", shape("sequential", &a, &none)),
            ("pb", shape("parallel", &b, &none)),
            ("top", shape("sequential", &top, &none)),
        ]
        .into();
        assert_eq!(check_tree(&ok, &defined), Ok(()));

        // Two parents, a cycle, an unknown and a repeated sub-agent, clashing keys.
        let (c1, c2) = (names(&["c2", "x"]), names(&["c1"]));
        let (twice, unknown) = (names(&["x", "y", "y"]), names(&["ghost"]));
        let clash: BTreeMap<String, String> = [
            ("x".to_owned(), "k".to_owned()),
            ("y".to_owned(), "k".to_owned()),
        ]
        .into();
        let defined: BTreeSet<&str> = ["x", "y", "c1", "c2", "t", "u"].into();
        let bad: BTreeMap<&str, WorkflowShape<'_>> = [
            ("c1", shape("sequential", &c1, &none)),
            ("c2", shape("loop", &c2, &none)),
            ("t", shape("parallel", &twice, &clash)),
            ("u", shape("sequential", &unknown, &none)),
        ]
        .into();
        let problems = check_tree(&bad, &defined).expect_err("bad tree");
        let text = problems.join("\n");
        for needle in [
            "agents.t.sub-agents: \"x\" already belongs to workflow \"c1\"",
            "agents.c1: workflows contain each other: c1 → c2 → c1",
            "agents.t.sub-agents: \"y\" is listed twice",
            "agents.u.sub-agents: \"ghost\" is not defined",
            "both write \"k\"",
        ] {
            assert!(text.contains(needle), "{needle:?} missing in:\n{text}");
        }
    }
}
