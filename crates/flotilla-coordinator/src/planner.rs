//! Planning bare queries: the planner task, its output schema, and the review of its answer.
//!
//! A submission with a `query` and no `plan` becomes a run whose first plan is the
//! **planning plan**: one task (`_plan-1`) for the deployment's planner agent (an LLM agent
//! with role `planner`), whose `output_schema` is the plan schema restricted to the agents and
//! pools this deployment has. The planner task is an ordinary task — durable, retried, run by
//! a worker — so planning survives coordinator and worker crashes like any other work.
//!
//! ```text
//! query ──► _plan-1 ──answer──► review ──valid──► `planned` (accepted): the run continues
//!              ▲                  │                with the planned plan's tasks
//!              │                  ├──problems, repairs left──► `planned` (repair):
//!              └──────────────────┘                 _plan-<n+1> with the problems in its input
//!                                 └──problems, none left──► `planned` (failed): the run fails
//! ```
//!
//! The review ([`review`]) is pure: the coordinator appends its decision to the run log
//! (`planned`, message id `planned.<run>.<round>`), and the run's state machine applies the
//! entry like any other input. Replaying the log therefore reaches the same plan, whatever
//! the configuration is by then. Task ids starting with `_` are reserved, so a planned plan's
//! tasks can never be confused with a planner round's.

use std::collections::BTreeSet;

use flotilla_model::ids::TaskId;
use flotilla_model::plan::{Plan, PlanConfig, Strategy, Subtask};
use flotilla_model::runlog::PlanDecision;
use flotilla_model::validate::{
    MAX_REPORTED_PROBLEMS, Problem, ProblemCode, ValidationContext, check_plan_size, prepare_plan,
    truncate_problems,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// The role of the planner task (its system prompt on LLM agents).
pub const PLANNER_ROLE: &str = "planner";

/// `[coordinator.planner]`: who plans bare queries, and how persistently.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct PlannerOptions {
    /// The agent definition that plans bare queries (an LLM agent; its tasks get role
    /// `planner`). Unset: bare queries are rejected with `no_planner`.
    pub agent: Option<String>,
    /// The worker pool the planner task runs in.
    pub pool: String,
    /// Planner answers with problems that are sent back for repair before the run fails.
    pub max_repairs: u32,
    /// Most subtasks a planned plan may have (the output schema's `maxItems`).
    pub max_subtasks: u32,
}

impl Default for PlannerOptions {
    fn default() -> Self {
        Self {
            // No planner unless one is named: a deployment opts in to bare queries.
            agent: None,
            pool: flotilla_model::plan::DEFAULT_POOL.to_owned(),
            // Two repairs fix most slips (a typo in a dependency) without looping on a
            // planner that cannot produce a plan.
            max_repairs: 2,
            // Plans of a handful of tasks are what a planner writes well; more is a sign of
            // a runaway answer.
            max_subtasks: 20,
        }
    }
}

impl PlannerOptions {
    /// Checks the settings without I/O (the agent's existence is checked where the agent
    /// definitions are known).
    pub fn validate(&self) -> Result<(), String> {
        if let Some(agent) = &self.agent {
            flotilla_model::token::check_name(agent)
                .map_err(|e| format!("coordinator.planner.agent {agent:?} {e}"))?;
        }
        flotilla_model::token::check_name(&self.pool)
            .map_err(|e| format!("coordinator.planner.pool {:?} {e}", self.pool))?;
        if self.max_repairs > 10 {
            return Err("coordinator.planner.max-repairs must be at most 10".into());
        }
        if self.max_subtasks == 0 || self.max_subtasks > 1000 {
            return Err("coordinator.planner.max-subtasks must be between 1 and 1000".into());
        }
        Ok(())
    }
}

/// The planner task's id in round `round`.
pub fn planner_task_id(round: u32) -> TaskId {
    TaskId::new(format!("_plan-{round}"))
}

/// What the planner is told in its description (its input carries the query, the
/// deployment and, on a repair, the problems).
const INSTRUCTION: &str = "Plan how a team of agents answers the query in the input. Answer with a JSON object {\"subtasks\": [...]}, one entry per subtask: `id` (letters, digits, `-` and `_`; unique; not starting with `_`), `description` (what the agent does, in words), and where useful `role`, `agent` and `pool` (only those listed under `deployment` in the input), `dependencies` (ids of subtasks that must finish first), `produces` / `consumes` (workspace topics). A subtask with role `synthesis` gives the final answer. Use as few subtasks as the query needs; one is fine for a simple question.";

/// Added to [`INSTRUCTION`] when the deployment's member cards define roles.
const ROLES_INSTRUCTION: &str = "The team has the roles listed under `deployment.roles` (each with the agents that fill it): a subtask with a `role` and no `agent` is taken by whichever member of that role is free, so name only a listed role there; with an `agent`, the role only sets that agent's system prompt.";

/// The planning plan of round `round`: one planner task. `problems` and `previous` (the
/// rejected answer) are given on a repair.
pub fn planning_plan(
    query: &str,
    opts: &PlannerOptions,
    ctx: &ValidationContext,
    round: u32,
    problems: &[Problem],
    previous: Option<&Value>,
) -> Plan {
    let id = planner_task_id(round);
    let mut description = INSTRUCTION.to_owned();
    if ctx.agents.as_ref().is_some_and(|a| a.has_roles()) {
        description.push(' ');
        description.push_str(ROLES_INSTRUCTION);
    }
    if !problems.is_empty() {
        description.push_str(
            "\n\nYour previous plan (`previous_answer` in the input) was rejected for the `problems` listed in the input. Answer again with a corrected plan.",
        );
    }
    let mut task = Subtask::new(id.as_str(), &description);
    task.role = Some(PLANNER_ROLE.to_owned());
    task.agent = opts.agent.clone();
    task.pool = opts.pool.clone();
    task.output_schema = Some(output_schema(opts, ctx));
    let mut input = json!({
        "query": query,
        "deployment": deployment(ctx),
    });
    if !problems.is_empty() {
        input["problems"] = json!(problems);
    }
    if let Some(previous) = previous {
        input["previous_answer"] = previous.clone();
    }
    task.input = input;
    Plan {
        fork: None,
        name: Some(short_name(query)),
        query: Some(query.to_owned()),
        subtasks: vec![task],
        config: PlanConfig {
            max_concurrency: 1,
            strategy: Strategy::Simple,
            ..PlanConfig::default()
        },
    }
}

/// The agents, roles and pools a plan may name, as the planner is told them.
fn deployment(ctx: &ValidationContext) -> Value {
    let mut d = json!({});
    if let Some(agents) = &ctx.agents {
        d["agents"] = json!(agents.names);
        if let Some(default) = &agents.default {
            d["default_agent"] = json!(default);
        }
        if agents.has_roles() {
            d["roles"] = json!(agents.roles);
        }
    }
    if let Some(pools) = &ctx.pools {
        d["pools"] = json!(pools);
    }
    d
}

/// The plan schema restricted to this deployment: `agent` and `pool` are enums of what it
/// has, ids are safe tokens, and only the fields a planner should set are allowed. The
/// worker checks the model's answer against it (one repair, then `invalid_output`); the
/// coordinator still validates the plan fully, since a schema cannot say everything (cycles,
/// unknown dependencies).
pub fn output_schema(opts: &PlannerOptions, ctx: &ValidationContext) -> Value {
    let strings = json!({"type": "array", "items": {"type": "string"}});
    let mut props = json!({
        "id": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"},
        "description": {"type": "string"},
        "role": {"type": "string"},
        "agent": {"type": "string"},
        "pool": {"type": "string"},
        "dependencies": strings,
        "produces": strings,
        "consumes": strings,
        "output_key": {"type": "string"},
        "required": {"type": "boolean"},
    });
    if let Some(agents) = &ctx.agents {
        props["agent"] = json!({"enum": agents.names});
    }
    if let Some(pools) = &ctx.pools {
        props["pool"] = json!({"enum": pools});
    }
    json!({
        "type": "object",
        "additionalProperties": false,
        "required": ["subtasks"],
        "properties": {
            "name": {"type": "string"},
            "subtasks": {
                "type": "array",
                "minItems": 1,
                "maxItems": opts.max_subtasks,
                "items": {
                    "type": "object",
                    "additionalProperties": false,
                    "required": ["id", "description"],
                    "properties": props,
                },
            },
        },
    })
}

/// The part of a plan a planner writes.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlannerAnswer {
    #[serde(default)]
    name: Option<String>,
    subtasks: Vec<Subtask>,
}

/// Reviews the planner's answer of round `round` and decides. `planning` is the current
/// planning plan (the next round is built from it), `max_plan_bytes` the deployment's plan
/// size limit. Pure: the decision is appended to the run log, never recomputed on replay.
pub fn review(
    response: &str,
    query: &str,
    round: u32,
    max_repairs: u32,
    opts: &PlannerOptions,
    ctx: &ValidationContext,
    planning: &Plan,
) -> PlanDecision {
    let (answer, problems) = check_answer(response, query, opts, ctx);
    let problems = match answer {
        Some((plan, warnings)) => {
            return PlanDecision::Accepted { plan, warnings };
        }
        None => truncate_problems(problems, MAX_REPORTED_PROBLEMS),
    };
    if round > max_repairs {
        return PlanDecision::Failed { problems };
    }
    let previous: Value = serde_json::from_str(response).unwrap_or_else(|_| json!(response));
    // The next round keeps this round's planner settings (agent, pool, schema) as they were
    // accepted, so a configuration change mid-run does not switch planners.
    let mut next = planning.clone();
    if let Some(task) = next.subtasks.first_mut() {
        let fresh = planning_plan(query, opts, ctx, round + 1, &problems, Some(&previous));
        task.id = planner_task_id(round + 1);
        if let Some(t) = fresh.subtasks.into_iter().next() {
            task.description = t.description;
            if let Some(input) = task.input.as_object_mut() {
                input.insert("problems".into(), json!(problems));
                input.insert("previous_answer".into(), previous);
            }
        }
    }
    PlanDecision::Repair {
        plan: next,
        problems,
    }
}

/// Parses and validates an answer: the plan with its warnings, or every problem.
fn check_answer(
    response: &str,
    query: &str,
    opts: &PlannerOptions,
    ctx: &ValidationContext,
) -> (Option<(Plan, Vec<Problem>)>, Vec<Problem>) {
    let answer: PlannerAnswer = match serde_json::from_str(response.trim()) {
        Ok(a) => a,
        Err(e) => {
            return (
                None,
                vec![Problem::new(
                    ProblemCode::InvalidPlannerOutput,
                    "",
                    format!("the answer is not a plan of the form {{\"subtasks\": [...]}}: {e}"),
                )],
            );
        }
    };
    let plan = Plan {
        fork: None,
        name: answer.name.or_else(|| Some(short_name(query))),
        query: Some(query.to_owned()),
        subtasks: answer.subtasks,
        config: PlanConfig::default(),
    };
    let mut problems = Vec::new();
    if plan.subtasks.len() > opts.max_subtasks as usize {
        problems.push(Problem::new(
            ProblemCode::TooManySubtasks,
            "subtasks",
            format!(
                "{} subtasks exceed the planner's limit of {} (coordinator.planner.max-subtasks)",
                plan.subtasks.len(),
                opts.max_subtasks
            ),
        ));
    }
    if let Some(max) = ctx.limits.max_plan_bytes
        && let Some(p) = check_plan_size(&plan, max)
    {
        problems.push(p);
    }
    match prepare_plan(&plan, ctx) {
        Ok((plan, warnings)) if problems.is_empty() => (Some((plan, warnings)), problems),
        Ok(_) => (None, problems),
        Err(report) => {
            problems.extend(report.errors);
            (None, problems)
        }
    }
}

/// A run name from the query: its first words.
pub(crate) fn short_name(query: &str) -> String {
    let mut name = String::new();
    for word in query.split_whitespace() {
        if name.len() + word.len() > 60 {
            name.push('…');
            break;
        }
        if !name.is_empty() {
            name.push(' ');
        }
        name.push_str(word);
    }
    name
}

/// The pools a planning plan needs a live worker in.
pub fn planner_pools(opts: &PlannerOptions) -> BTreeSet<&str> {
    BTreeSet::from([opts.pool.as_str()])
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_model::validate::AgentCatalog;

    fn ctx() -> ValidationContext {
        ValidationContext {
            pools: Some(BTreeSet::from(["default".to_owned()])),
            agents: Some(AgentCatalog {
                names: BTreeSet::from(["planner".to_owned(), "writer".to_owned()]),
                default: Some("writer".into()),
                workflows: BTreeSet::new(),
                roles: Default::default(),
                compensations: Default::default(),
            }),
            ..ValidationContext::default()
        }
    }

    fn opts() -> PlannerOptions {
        PlannerOptions {
            agent: Some("planner".into()),
            ..PlannerOptions::default()
        }
    }

    #[test]
    fn the_schema_names_only_the_deployments_agents_and_pools() {
        let s = output_schema(&opts(), &ctx());
        let item = &s["properties"]["subtasks"]["items"]["properties"];
        assert_eq!(item["agent"]["enum"], json!(["planner", "writer"]));
        assert_eq!(item["pool"]["enum"], json!(["default"]));
        assert!(jsonschema::validator_for(&s).is_ok());
    }

    #[test]
    fn the_planner_is_told_the_roles_and_an_unknown_one_is_repaired() {
        let plain = planning_plan("q", &opts(), &ctx(), 1, &[], None);
        assert!(plain.subtasks[0].input["deployment"].get("roles").is_none());
        assert!(!plain.subtasks[0].description.contains("deployment.roles"));

        let mut with_roles = ctx();
        with_roles.agents = with_roles
            .agents
            .map(|a| a.with_roles([("writer", &["writing".to_owned()][..])]));
        let planning = planning_plan("q", &opts(), &with_roles, 1, &[], None);
        let task = &planning.subtasks[0];
        assert_eq!(
            task.input["deployment"]["roles"],
            json!({"writing": ["writer"]})
        );
        assert!(task.description.contains("deployment.roles"));
        let d = review(
            r#"{"subtasks":[{"id":"a","description":"x","role":"editing"}]}"#,
            "q",
            1,
            1,
            &opts(),
            &with_roles,
            &planning,
        );
        let PlanDecision::Repair { problems, .. } = d else {
            panic!("{d:?}")
        };
        assert_eq!(problems[0].code, ProblemCode::UnknownRole);
        assert_eq!(problems[0].path, "subtasks[0].role");
    }

    #[test]
    fn a_valid_answer_is_accepted_with_the_query() {
        let planning = planning_plan("q", &opts(), &ctx(), 1, &[], None);
        let d = review(
            r#"{"subtasks":[{"id":"a","description":"x"},{"id":"b","description":"y","dependencies":["a"]}]}"#,
            "What is up?",
            1,
            2,
            &opts(),
            &ctx(),
            &planning,
        );
        let PlanDecision::Accepted { plan, .. } = d else {
            panic!("{d:?}")
        };
        assert_eq!(plan.subtasks.len(), 2);
        assert_eq!(plan.query.as_deref(), Some("What is up?"));
    }

    #[test]
    fn problems_are_repaired_then_fail() {
        let planning = planning_plan("q", &opts(), &ctx(), 1, &[], None);
        let bad = r#"{"subtasks":[{"id":"a","description":"x","dependencies":["zzz"]}]}"#;
        let d = review(bad, "q", 1, 1, &opts(), &ctx(), &planning);
        let PlanDecision::Repair { plan, problems } = d else {
            panic!("{d:?}")
        };
        assert_eq!(problems[0].code, ProblemCode::UnknownDependency);
        assert_eq!(plan.subtasks[0].id.as_str(), "_plan-2");
        assert_eq!(
            plan.subtasks[0].input["problems"][0]["code"],
            json!("unknown_dependency")
        );
        let d = review("not json", "q", 2, 1, &opts(), &ctx(), &plan);
        let PlanDecision::Failed { problems } = d else {
            panic!("{d:?}")
        };
        assert_eq!(problems[0].code, ProblemCode::InvalidPlannerOutput);
    }

    #[test]
    fn reserved_ids_and_unknown_agents_are_problems() {
        let planning = planning_plan("q", &opts(), &ctx(), 1, &[], None);
        let d = review(
            r#"{"subtasks":[{"id":"_plan-1","description":"x","agent":"ghost"}]}"#,
            "q",
            1,
            0,
            &opts(),
            &ctx(),
            &planning,
        );
        let PlanDecision::Failed { problems } = d else {
            panic!("{d:?}")
        };
        let codes: Vec<_> = problems.iter().map(|p| p.code).collect();
        assert!(codes.contains(&ProblemCode::InvalidTaskId), "{codes:?}");
        assert!(codes.contains(&ProblemCode::UnknownAgent), "{codes:?}");
    }
}
