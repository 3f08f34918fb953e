//! Plan validation.
//!
//! [`validate_plan`] returns **every** problem of a plan at once, each with a stable
//! [`ProblemCode`], the path of the offending value (`subtasks[2].dependencies[0]`) and a
//! message. [`prepare_plan`] validates and returns the plan as it will run: topics normalised
//! and, in lenient data-flow mode, consumptions without a producer dropped.
//!
//! The graph checks are linear in tasks plus edges (Kahn's algorithm for cycles), so a
//! 10,000-subtask plan validates in a few milliseconds (`flotilla bench validate`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::plan::{DataflowValidation, Plan, Strategy};
pub use crate::problem::{Problem, ProblemCode};
use crate::token::{check_name, check_token, normalize_topic};

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

/// Most problems carried in a rejection; the rest are counted in one `too_many_problems`
/// entry, so a rejection always fits in a message.
pub const MAX_REPORTED_PROBLEMS: usize = 100;

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
}

impl AgentCatalog {
    /// Whether a task naming `agent` (or none: the default) runs a workflow agent.
    pub fn is_workflow(&self, agent: Option<&str>) -> bool {
        agent
            .or(self.default.as_deref())
            .is_some_and(|a| self.workflows.contains(a))
    }
}

/// The outcome of validation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ValidationReport {
    /// Problems that make the plan unrunnable.
    pub errors: Vec<Problem>,
    /// Problems that were tolerated.
    pub warnings: Vec<Problem>,
}

impl ValidationReport {
    /// True when there are no errors.
    pub fn is_valid(&self) -> bool {
        self.errors.is_empty()
    }

    /// A report holding a single error.
    pub fn single(problem: Problem) -> Self {
        Self {
            errors: vec![problem],
            warnings: Vec::new(),
        }
    }

    /// Whether any error carries `code`.
    pub fn has(&self, code: ProblemCode) -> bool {
        self.errors.iter().any(|p| p.code == code)
    }
}

/// Keeps at most `max` problems; when more were found, the last kept entry is a
/// `too_many_problems` problem counting the rest. Rejections stay bounded however broken the
/// plan is.
pub fn truncate_problems(mut problems: Vec<Problem>, max: usize) -> Vec<Problem> {
    if problems.len() <= max {
        return problems;
    }
    let keep = max.saturating_sub(1);
    let omitted = problems.len() - keep;
    problems.truncate(keep);
    problems.push(Problem::new(
        ProblemCode::TooManyProblems,
        "",
        format!("{omitted} more problems are not listed; fix the ones above and validate again"),
    ));
    problems
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

/// Validates a plan and returns it ready to run (topics normalised). On error nothing is
/// returned but the report.
pub fn prepare_plan(
    plan: &Plan,
    ctx: &ValidationContext,
) -> Result<(Plan, Vec<Problem>), ValidationReport> {
    let report = validate_plan(plan, ctx);
    if !report.is_valid() {
        return Err(report);
    }
    Ok((normalize_plan(plan.clone()), report.warnings))
}

/// The plan as it runs: topics normalised. Pure and deterministic, so a coordinator that
/// rebuilds a run from its stored submission gets the same plan as the one that accepted it.
pub fn normalize_plan(mut plan: Plan) -> Plan {
    for task in &mut plan.subtasks {
        for topic in task.produces.iter_mut().chain(task.consumes.iter_mut()) {
            *topic = normalize_topic(topic);
        }
        for list in [&mut task.produces, &mut task.consumes] {
            let mut seen = BTreeSet::new();
            list.retain(|t| seen.insert(t.clone()));
        }
    }
    plan
}

/// Checks everything about a plan and reports every problem found.
pub fn validate_plan(plan: &Plan, ctx: &ValidationContext) -> ValidationReport {
    let mut v = Validator {
        report: ValidationReport::default(),
    };
    v.check_config(plan, ctx);
    let n = plan.subtasks.len();
    if n == 0 {
        v.error(
            ProblemCode::EmptyPlan,
            "subtasks",
            "the plan has no subtasks",
        );
    }
    if n > ctx.limits.max_subtasks {
        v.error(
            ProblemCode::TooManySubtasks,
            "subtasks",
            format!(
                "{n} subtasks exceed the limit of {}",
                ctx.limits.max_subtasks
            ),
        );
    }

    // Ids: the first occurrence of an id is the node; later ones are duplicates.
    let mut index: HashMap<&str, usize> = HashMap::with_capacity(n);
    for (i, task) in plan.subtasks.iter().enumerate() {
        let id = task.id.as_str();
        if let Err(e) = check_token(id) {
            v.error(
                ProblemCode::InvalidTaskId,
                format!("subtasks[{i}].id"),
                format!("task id {id:?} {e}"),
            );
        } else if id.starts_with('_') {
            v.error(
                ProblemCode::InvalidTaskId,
                format!("subtasks[{i}].id"),
                format!(
                    "task id {id:?} starts with `_`, which is reserved for Flotilla's own addresses (e.g. the mailbox broadcast `_all`)"
                ),
            );
        }
        if let Some(first) = index.get(id) {
            v.error(
                ProblemCode::DuplicateId,
                format!("subtasks[{i}].id"),
                format!("task id {id:?} is already used by subtasks[{first}]"),
            );
        } else {
            index.insert(id, i);
        }
    }

    // Topics normalised once: (produces, consumes) per task.
    let topics: Vec<(Vec<String>, Vec<String>)> = plan
        .subtasks
        .iter()
        .map(|t| {
            (
                t.produces.iter().map(|x| normalize_topic(x)).collect(),
                t.consumes.iter().map(|x| normalize_topic(x)).collect(),
            )
        })
        .collect();
    for (i, task) in plan.subtasks.iter().enumerate() {
        v.check_subtask(i, task, &topics[i], ctx);
    }

    // Dependency graph over first occurrences; unknown and self edges are reported and left out.
    let mut deps: Vec<Vec<usize>> = vec![Vec::new(); n];
    // `listed_by[d] == i` marks that task i already listed d, without a set per task.
    let mut listed_by: Vec<usize> = vec![usize::MAX; n];
    for (i, task) in plan.subtasks.iter().enumerate() {
        if index.get(task.id.as_str()) != Some(&i) {
            continue;
        }
        for (j, dep) in task.dependencies.iter().enumerate() {
            let path = format!("subtasks[{i}].dependencies[{j}]");
            match index.get(dep.as_str()) {
                None => v.error(
                    ProblemCode::UnknownDependency,
                    path,
                    format!(
                        "task {:?} depends on {:?}, which is not a subtask of this plan",
                        task.id.as_str(),
                        dep.as_str()
                    ),
                ),
                Some(&d) if d == i => v.error(
                    ProblemCode::SelfDependency,
                    path,
                    format!("task {:?} depends on itself", task.id.as_str()),
                ),
                Some(&d) => {
                    if listed_by[d] != i {
                        listed_by[d] = i;
                        deps[i].push(d);
                    } else {
                        v.warn(
                            ProblemCode::DuplicateDependency,
                            path,
                            format!(
                                "task {:?} lists {:?} more than once",
                                task.id.as_str(),
                                dep.as_str()
                            ),
                        );
                    }
                }
            }
        }
    }
    for cycle in find_cycles(&deps) {
        let names: Vec<String> = cycle
            .iter()
            .map(|&i| plan.subtasks[i].id.to_string())
            .collect();
        let mut shown = names.clone();
        shown.push(names[0].clone());
        let mut p = Problem::new(
            ProblemCode::Cycle,
            format!("subtasks[{}].dependencies", cycle[0]),
            format!(
                "dependency cycle: {} (each task depends on the next)",
                shown.join(" → ")
            ),
        );
        p.tasks = names;
        v.report.errors.push(p);
    }

    v.check_dataflow(plan, &topics);
    if v.report.errors.iter().all(|p| p.code != ProblemCode::Cycle) {
        let order = Reach::new(&deps);
        v.check_consumptions(plan, &topics, &index, &order);
        v.check_output_keys(plan, &index, &order);
    }
    if let Some(max) = ctx.limits.max_plan_bytes
        && let Some(p) = check_plan_size(plan, max)
    {
        v.report.errors.push(p);
    }
    v.report
}

struct Validator {
    report: ValidationReport,
}

impl Validator {
    fn error(&mut self, code: ProblemCode, path: impl Into<String>, message: impl Into<String>) {
        self.report.errors.push(Problem::new(code, path, message));
    }

    fn warn(&mut self, code: ProblemCode, path: impl Into<String>, message: impl Into<String>) {
        self.report.warnings.push(Problem::new(code, path, message));
    }

    fn check_config(&mut self, plan: &Plan, ctx: &ValidationContext) {
        let c = &plan.config;
        if c.max_concurrency == 0 || c.max_concurrency as usize > ctx.limits.max_subtasks {
            self.error(
                ProblemCode::InvalidConfig,
                "config.max_concurrency",
                format!(
                    "must be between 1 and {}, got {}",
                    ctx.limits.max_subtasks, c.max_concurrency
                ),
            );
        }
        if !(0.0..=1.0).contains(&c.failure_ratio) {
            self.error(
                ProblemCode::InvalidConfig,
                "config.failure_ratio",
                format!("must be between 0 and 1, got {}", c.failure_ratio),
            );
        }
        if c.max_tokens == Some(0) {
            self.error(
                ProblemCode::InvalidConfig,
                "config.max_tokens",
                "must be at least 1 (leave it out for no limit)",
            );
        }
        if let Some(cost) = c.max_cost
            && !(cost.is_finite() && cost > 0.0)
        {
            self.error(
                ProblemCode::InvalidConfig,
                "config.max_cost",
                format!("must be a positive number of US dollars, got {cost}"),
            );
        }
        if c.max_retries > ctx.limits.max_retries {
            self.error(
                ProblemCode::InvalidConfig,
                "config.max_retries",
                format!(
                    "must be at most {}, got {}",
                    ctx.limits.max_retries, c.max_retries
                ),
            );
        }
        self.check_timeout("config.dependency_timeout", c.dependency_timeout.get(), ctx);
        self.check_timeout("config.task_timeout", c.task_timeout.get(), ctx);
        if c.strategy == Strategy::Supervisor {
            self.error(
                ProblemCode::UnsupportedStrategy,
                "config.strategy",
                "the supervisor strategy is not available in this release; use auto, simple or dag",
            );
        }
    }

    fn check_timeout(&mut self, path: &str, d: Duration, ctx: &ValidationContext) {
        if d.is_zero() || d > ctx.limits.max_timeout {
            self.error(
                ProblemCode::InvalidTimeout,
                path,
                format!(
                    "must be more than 0 and at most {}, got {}",
                    humantime::format_duration(ctx.limits.max_timeout),
                    humantime::format_duration(d)
                ),
            );
        }
    }

    fn check_subtask(
        &mut self,
        i: usize,
        task: &crate::plan::Subtask,
        (produces, consumes): &(Vec<String>, Vec<String>),
        ctx: &ValidationContext,
    ) {
        let limits = &ctx.limits;
        if task.description.len() > limits.max_description_bytes {
            self.error(
                ProblemCode::DescriptionTooLarge,
                format!("subtasks[{i}].description"),
                format!(
                    "{} bytes exceed the limit of {}",
                    task.description.len(),
                    limits.max_description_bytes
                ),
            );
        }
        if !task.input.is_null() {
            let depth = json_depth(&task.input);
            if depth > limits.max_input_depth {
                self.error(
                    ProblemCode::InputTooDeep,
                    format!("subtasks[{i}].input"),
                    format!(
                        "input is nested {depth} levels deep; the limit is {}",
                        limits.max_input_depth
                    ),
                );
            }
            let size = json_size(&task.input);
            if size > limits.max_input_bytes {
                self.error(
                    ProblemCode::InputTooLarge,
                    format!("subtasks[{i}].input"),
                    format!(
                        "{size} bytes exceed the limit of {}",
                        limits.max_input_bytes
                    ),
                );
            }
        }
        if let Some(t) = task.timeout {
            self.check_timeout(&format!("subtasks[{i}].timeout"), t.get(), ctx);
        }
        match check_name(&task.pool) {
            Err(e) => self.error(
                ProblemCode::InvalidPool,
                format!("subtasks[{i}].pool"),
                format!("pool {:?} {e}", task.pool),
            ),
            Ok(()) => {
                if let Some(pools) = &ctx.pools
                    && !pools.contains(&task.pool)
                {
                    self.error(
                        ProblemCode::UnknownPool,
                        format!("subtasks[{i}].pool"),
                        format!(
                            "pool {:?} is not configured (known pools: {})",
                            task.pool,
                            pools.iter().cloned().collect::<Vec<_>>().join(", ")
                        ),
                    );
                }
            }
        }
        match (&task.agent, &ctx.agents) {
            (Some(agent), catalog) => {
                if let Err(e) = check_name(agent) {
                    self.error(
                        ProblemCode::UnknownAgent,
                        format!("subtasks[{i}].agent"),
                        format!("agent name {agent:?} {e}"),
                    );
                } else if let Some(catalog) = catalog
                    && !catalog.names.contains(agent)
                {
                    self.error(
                        ProblemCode::UnknownAgent,
                        format!("subtasks[{i}].agent"),
                        format!(
                            "agent {agent:?} is not defined (defined agents: {})",
                            catalog.names.iter().cloned().collect::<Vec<_>>().join(", ")
                        ),
                    );
                }
            }
            (None, Some(catalog)) if catalog.default.is_none() => self.error(
                ProblemCode::NoAgent,
                format!("subtasks[{i}]"),
                format!(
                    "task {:?} names no agent and no default agent is configured",
                    task.id.as_str()
                ),
            ),
            (None, _) => {}
        }
        for (field, raw, normalised) in [
            ("produces", &task.produces, produces),
            ("consumes", &task.consumes, consumes),
        ] {
            for (j, (topic, normal)) in raw.iter().zip(normalised).enumerate() {
                if let Err(e) = check_token(normal) {
                    let mut p = Problem::new(
                        ProblemCode::InvalidTopic,
                        format!("subtasks[{i}].{field}[{j}]"),
                        format!("topic {topic:?} (normalised {normal:?}) {e}"),
                    );
                    p.topic = Some(topic.clone());
                    self.report.errors.push(p);
                }
            }
        }
        if let Some(key) = &task.output_key {
            let problem = match check_name(key) {
                Err(e) => Some(format!("output_key {key:?} {e}")),
                Ok(()) if key.len() > crate::state::MAX_KEY_LEN => Some(format!(
                    "output_key {key:?} is longer than {} characters",
                    crate::state::MAX_KEY_LEN
                )),
                Ok(()) => None,
            };
            if let Some(message) = problem {
                self.error(
                    ProblemCode::InvalidOutputKey,
                    format!("subtasks[{i}].output_key"),
                    message,
                );
            }
        }
        if let Some(schema) = &task.output_schema
            && !schema.is_object()
        {
            self.error(
                ProblemCode::InvalidOutputSchema,
                format!("subtasks[{i}].output_schema"),
                format!(
                    "output_schema must be a JSON Schema object (such as {{\"type\": \"object\", \"properties\": {{…}}}}), not {}",
                    match schema {
                        serde_json::Value::Null => "null",
                        serde_json::Value::Bool(_) => "a boolean",
                        serde_json::Value::Number(_) => "a number",
                        serde_json::Value::String(_) => "a string",
                        serde_json::Value::Array(_) => "an array",
                        serde_json::Value::Object(_) => "an object",
                    }
                ),
            );
        }
    }

    fn check_dataflow(&mut self, plan: &Plan, topics: &[(Vec<String>, Vec<String>)]) {
        let producers: std::collections::HashSet<&str> = topics
            .iter()
            .flat_map(|(p, _)| p.iter().map(String::as_str))
            .collect();
        // topic -> (first path, consumers)
        let mut missing: BTreeMap<String, (String, Vec<String>)> = BTreeMap::new();
        for (i, task) in plan.subtasks.iter().enumerate() {
            for (j, normal) in topics[i].1.iter().enumerate() {
                if normal.is_empty()
                    || producers.contains(normal.as_str())
                    || check_token(normal).is_err()
                {
                    continue;
                }
                let entry = missing
                    .entry(normal.clone())
                    .or_insert_with(|| (format!("subtasks[{i}].consumes[{j}]"), Vec::new()));
                if !entry.1.iter().any(|c| c == task.id.as_str()) {
                    entry.1.push(task.id.to_string());
                }
            }
        }
        let strict = plan.config.dataflow_validation == DataflowValidation::Strict;
        for (topic, (path, consumers)) in missing {
            let message = format!(
                "topic {topic:?} is consumed by {} but no subtask produces it{}",
                consumers.join(", "),
                if strict {
                    ""
                } else {
                    " (lenient: the consumers wait for an entry from another writer, at most dependency_timeout)"
                }
            );
            let mut p = Problem::new(ProblemCode::MissingProducer, path, message);
            p.topic = Some(topic);
            p.tasks = consumers;
            if strict {
                self.report.errors.push(p);
            } else {
                self.report.warnings.push(p);
            }
        }
    }
}

/// Reachability over an acyclic dependency graph, answered cheaply for the common case: a
/// topological position per task (a task's descendants always come after it), and a
/// bounded number of graph walks for the rest, so validating a 10,000-task plan stays fast.
struct Reach<'a> {
    deps: &'a [Vec<usize>],
    dependents: Vec<Vec<usize>>,
    position: Vec<usize>,
    walks_left: std::cell::Cell<usize>,
}

/// Graph walks one validation may spend on reachability questions; past it the questions
/// are not asked (the run-time deadline still bounds what they would have caught).
const MAX_REACH_WALKS: usize = 256;

impl<'a> Reach<'a> {
    fn new(deps: &'a [Vec<usize>]) -> Self {
        let n = deps.len();
        let mut dependents = vec![Vec::new(); n];
        let mut left: Vec<usize> = deps.iter().map(Vec::len).collect();
        for (i, ds) in deps.iter().enumerate() {
            for &d in ds {
                dependents[d].push(i);
            }
        }
        let mut queue: Vec<usize> = (0..n).filter(|&i| left[i] == 0).collect();
        let mut position = vec![usize::MAX; n];
        let mut next = 0;
        while let Some(i) = queue.pop() {
            position[i] = next;
            next += 1;
            for &t in &dependents[i] {
                left[t] -= 1;
                if left[t] == 0 {
                    queue.push(t);
                }
            }
        }
        Self {
            deps,
            dependents,
            position,
            walks_left: std::cell::Cell::new(MAX_REACH_WALKS),
        }
    }

    /// Whether `later` (transitively) depends on `earlier`. `None`: not answered (the walk
    /// budget is spent).
    fn depends_on(&self, later: usize, earlier: usize) -> Option<bool> {
        if later == earlier || self.position[later] <= self.position[earlier] {
            return Some(false);
        }
        if self.deps[later].contains(&earlier) {
            return Some(true);
        }
        let left = self.walks_left.get();
        if left == 0 {
            return None;
        }
        self.walks_left.set(left - 1);
        // Walk down from `earlier`, never past `later`'s position.
        let limit = self.position[later];
        let mut seen = vec![false; self.deps.len()];
        let mut stack = vec![earlier];
        while let Some(i) = stack.pop() {
            for &d in &self.dependents[i] {
                if d == later {
                    return Some(true);
                }
                if !seen[d] && self.position[d] < limit {
                    seen[d] = true;
                    stack.push(d);
                }
            }
        }
        Some(false)
    }
}

impl Validator {
    /// A consumer waits for its topic's first entry; if every producer of the topic is the
    /// consumer itself or waits for it, the entry can never come from the plan.
    fn check_consumptions(
        &mut self,
        plan: &Plan,
        topics: &[(Vec<String>, Vec<String>)],
        index: &HashMap<&str, usize>,
        reach: &Reach<'_>,
    ) {
        let mut producers: HashMap<&str, Vec<usize>> = HashMap::new();
        for (i, (produced, _)) in topics.iter().enumerate() {
            if index.get(plan.subtasks[i].id.as_str()) != Some(&i) {
                continue;
            }
            for t in produced {
                producers.entry(t.as_str()).or_default().push(i);
            }
        }
        let strict = plan.config.dataflow_validation == DataflowValidation::Strict;
        for (c, (_, consumed)) in topics.iter().enumerate() {
            if index.get(plan.subtasks[c].id.as_str()) != Some(&c) {
                continue;
            }
            for (j, t) in consumed.iter().enumerate() {
                let Some(ps) = producers.get(t.as_str()) else {
                    continue;
                };
                // Satisfiable as soon as one producer is neither the consumer nor waits
                // for it.
                let mut stuck = true;
                for &p in ps {
                    match (p == c, reach.depends_on(p, c)) {
                        (true, _) | (false, Some(true)) => {}
                        (false, Some(false)) | (false, None) => {
                            stuck = false;
                            break;
                        }
                    }
                }
                if !stuck {
                    continue;
                }
                let names: Vec<String> = ps
                    .iter()
                    .map(|&p| plan.subtasks[p].id.to_string())
                    .collect();
                let consumer = plan.subtasks[c].id.as_str();
                let mut p = Problem::new(
                    ProblemCode::UnsatisfiableConsumption,
                    format!("subtasks[{c}].consumes[{j}]"),
                    format!(
                        "task {consumer:?} consumes {t:?}, but it is produced only by {} — {} — so the task would wait for its own output{}",
                        names.join(", "),
                        if ps.len() == 1 && ps[0] == c {
                            "the task itself"
                        } else {
                            "the task or tasks that depend on it"
                        },
                        if strict {
                            ""
                        } else {
                            " (lenient: it waits for another writer, at most dependency_timeout)"
                        }
                    ),
                );
                p.topic = Some(t.clone());
                p.tasks = std::iter::once(consumer.to_owned()).chain(names).collect();
                if strict {
                    self.report.errors.push(p);
                } else {
                    self.report.warnings.push(p);
                }
            }
        }
    }

    /// Two tasks writing one `output_key` are fine when one runs after the other (the later
    /// write wins, by design); when they may run at the same time, which wins is a race.
    fn check_output_keys(&mut self, plan: &Plan, index: &HashMap<&str, usize>, reach: &Reach<'_>) {
        let mut by_key: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, t) in plan.subtasks.iter().enumerate() {
            if let Some(k) = &t.output_key
                && index.get(t.id.as_str()) == Some(&i)
            {
                by_key.entry(k.as_str()).or_default().push(i);
            }
        }
        for (key, tasks) in by_key {
            'pairs: for (x, &a) in tasks.iter().enumerate() {
                for &b in &tasks[x + 1..] {
                    let ordered = reach.depends_on(a, b).unwrap_or(true)
                        || reach.depends_on(b, a).unwrap_or(true);
                    if !ordered {
                        let (na, nb) = (plan.subtasks[a].id.as_str(), plan.subtasks[b].id.as_str());
                        let mut p = Problem::new(
                            ProblemCode::SharedOutputKey,
                            format!("subtasks[{b}].output_key"),
                            format!(
                                "tasks {na:?} and {nb:?} may run at the same time and both write output_key {key:?}; give parallel branches distinct keys"
                            ),
                        );
                        p.tasks = vec![na.to_owned(), nb.to_owned()];
                        self.report.warnings.push(p);
                        break 'pairs;
                    }
                }
            }
        }
    }
}

/// Finds dependency cycles. `deps[i]` lists the tasks `i` depends on. Returns one cycle per
/// group of tasks that cannot be ordered, each as the task indices in dependency order.
fn find_cycles(deps: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let n = deps.len();
    // Kahn: a task is resolved when all its dependencies are.
    let mut unresolved: Vec<usize> = deps.iter().map(Vec::len).collect();
    let mut dependents: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, ds) in deps.iter().enumerate() {
        for &d in ds {
            dependents[d].push(i);
        }
    }
    let mut queue: Vec<usize> = (0..n).filter(|&i| unresolved[i] == 0).collect();
    while let Some(d) = queue.pop() {
        for &t in &dependents[d] {
            unresolved[t] -= 1;
            if unresolved[t] == 0 {
                queue.push(t);
            }
        }
    }
    // Every task left over has an unresolved dependency that is also left over, so following
    // such dependencies must revisit a task: that revisit closes a cycle.
    let mut cycles = Vec::new();
    let mut walked = vec![false; n];
    for start in 0..n {
        if unresolved[start] == 0 || walked[start] {
            continue;
        }
        let mut path: Vec<usize> = Vec::new();
        let mut pos_in_path: HashMap<usize, usize> = HashMap::new();
        let mut at = start;
        loop {
            if let Some(&p) = pos_in_path.get(&at) {
                cycles.push(path[p..].to_vec());
                break;
            }
            if walked[at] {
                break;
            }
            walked[at] = true;
            pos_in_path.insert(at, path.len());
            path.push(at);
            match deps[at].iter().find(|&&d| unresolved[d] > 0) {
                Some(&next) => at = next,
                None => break,
            }
        }
    }
    cycles
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

fn json_size(value: &serde_json::Value) -> usize {
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

/// Checks a submission's parent link (`parent`, the parent run's handle) for run `run`: the
/// parent and the root are other runs, and the task and call ids are subject-safe tokens.
pub fn check_parent(parent: &crate::run::RunHandle, run: crate::ids::RunId) -> Vec<Problem> {
    let mut out = Vec::new();
    let mut bad = |path: &str, message: String| {
        out.push(Problem::new(ProblemCode::InvalidParent, path, message));
    };
    if parent.run_id == run {
        bad(
            "parent.run_id",
            format!("run {run} cannot be its own parent"),
        );
    }
    if parent.root_run() == run {
        bad(
            "parent.root_run_id",
            format!("run {run} cannot be the root of its own tree"),
        );
    }
    if let Some(t) = &parent.parent_task_id
        && let Err(e) = crate::token::check_token(t.as_str())
    {
        bad(
            "parent.parent_task_id",
            format!("task id {:?} {e}", t.as_str()),
        );
    }
    if let Some(c) = &parent.parent_tool_call_id
        && let Err(e) = crate::token::check_token(c)
    {
        bad("parent.parent_tool_call_id", format!("call id {c:?} {e}"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Subtask;

    fn plan(tasks: Vec<Subtask>) -> Plan {
        Plan {
            name: None,
            query: None,
            subtasks: tasks,
            config: Default::default(),
        }
    }

    fn codes(r: &ValidationReport) -> Vec<ProblemCode> {
        r.errors.iter().map(|p| p.code).collect()
    }

    #[test]
    fn earnings_dag_is_valid() {
        let mut fetch = Subtask::new("fetch_data", "fetch");
        fetch.produces = vec!["Raw Data".into()];
        let mut growth = Subtask::new("calc_growth", "growth").after(&["fetch_data"]);
        growth.consumes = vec!["raw_data".into()];
        let margin = Subtask::new("calc_margin", "margin").after(&["fetch_data"]);
        let synth = Subtask::new("synthesis", "report").after(&["calc_growth", "calc_margin"]);
        let p = plan(vec![fetch, growth, margin, synth]);
        let r = validate_plan(&p, &ValidationContext::default());
        assert!(r.is_valid(), "{r:?}");
        let (ready, warnings) = prepare_plan(&p, &ValidationContext::default()).expect("valid");
        assert!(warnings.is_empty());
        assert_eq!(ready.subtasks[0].produces, vec!["raw_data".to_string()]);
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
    fn problem_lists_are_truncated_with_a_count() {
        let problems: Vec<Problem> = (0..250)
            .map(|i| Problem::new(ProblemCode::DuplicateId, format!("subtasks[{i}]"), "dup"))
            .collect();
        let kept = truncate_problems(problems, MAX_REPORTED_PROBLEMS);
        assert_eq!(kept.len(), MAX_REPORTED_PROBLEMS);
        let last = kept.last().expect("a summary");
        assert_eq!(last.code, ProblemCode::TooManyProblems);
        assert!(last.message.starts_with("151 more"), "{}", last.message);
        let few = truncate_problems(vec![Problem::new(ProblemCode::Cycle, "", "c")], 5);
        assert_eq!(few.len(), 1);
    }

    #[test]
    fn cycle_names_its_tasks() {
        let p = plan(vec![
            Subtask::new("a", "").after(&["b"]),
            Subtask::new("b", "").after(&["a"]),
            Subtask::new("c", "").after(&["a"]),
        ]);
        let r = validate_plan(&p, &ValidationContext::default());
        assert_eq!(codes(&r), vec![ProblemCode::Cycle]);
        assert_eq!(r.errors[0].tasks, vec!["a".to_string(), "b".to_string()]);
        assert!(
            r.errors[0].message.contains("a → b → a"),
            "{}",
            r.errors[0].message
        );
    }

    #[test]
    fn every_problem_is_reported_at_once() {
        let mut bad_topic = Subtask::new("x", "");
        bad_topic.consumes = vec!["nobody.makes*this".into()];
        let mut lonely = Subtask::new("y", "");
        lonely.consumes = vec!["Growth Rate".into()];
        let p = plan(vec![
            Subtask::new("a.b", ""),
            Subtask::new("dup", ""),
            Subtask::new("dup", ""),
            Subtask::new("self", "").after(&["self"]),
            Subtask::new("ghost", "").after(&["nope"]),
            bad_topic,
            lonely,
        ]);
        let r = validate_plan(&p, &ValidationContext::default());
        let got: BTreeSet<_> = codes(&r).into_iter().collect();
        let want: BTreeSet<_> = [
            ProblemCode::InvalidTaskId,
            ProblemCode::DuplicateId,
            ProblemCode::SelfDependency,
            ProblemCode::UnknownDependency,
            ProblemCode::InvalidTopic,
            ProblemCode::MissingProducer,
        ]
        .into_iter()
        .collect();
        assert_eq!(got, want, "{r:#?}");
        let missing = r
            .errors
            .iter()
            .find(|p| p.code == ProblemCode::MissingProducer)
            .expect("missing producer");
        assert_eq!(missing.topic.as_deref(), Some("growth_rate"));
        assert_eq!(missing.tasks, vec!["y".to_string()]);
        assert_eq!(missing.path, "subtasks[6].consumes[0]");
    }

    #[test]
    fn lenient_dataflow_warns_and_keeps_the_gate() {
        let mut t = Subtask::new("t", "");
        t.consumes = vec!["Ghost Topic".into(), "ghost topic".into()];
        let mut p = plan(vec![t]);
        p.config.dataflow_validation = DataflowValidation::Lenient;
        let (ready, warnings) =
            prepare_plan(&p, &ValidationContext::default()).expect("lenient ok");
        assert_eq!(warnings[0].code, ProblemCode::MissingProducer);
        // Another writer (an agent, the CLI) may still provide the entry.
        assert_eq!(ready.subtasks[0].consumes, vec!["ghost_topic".to_string()]);
    }

    #[test]
    fn reserved_ids_and_output_keys_are_checked() {
        let mut a = Subtask::new("_all", "");
        a.output_key = Some("bad.key".into());
        let mut b = Subtask::new("b", "");
        b.output_key = Some("k".repeat(200));
        let r = validate_plan(&plan(vec![a, b]), &ValidationContext::default());
        assert_eq!(
            codes(&r),
            vec![
                ProblemCode::InvalidTaskId,
                ProblemCode::InvalidOutputKey,
                ProblemCode::InvalidOutputKey
            ],
            "{r:#?}"
        );
        assert!(r.errors[0].message.contains("reserved"), "{r:#?}");
    }

    #[test]
    fn budgets_must_be_positive() {
        let mut p = plan(vec![Subtask::new("a", "")]);
        p.config.max_tokens = Some(0);
        p.config.max_cost = Some(-1.0);
        let r = validate_plan(&p, &ValidationContext::default());
        let paths: Vec<&str> = r.errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            vec!["config.max_tokens", "config.max_cost"],
            "{r:#?}"
        );
        p.config.max_tokens = Some(10_000);
        p.config.max_cost = Some(0.5);
        assert!(
            validate_plan(&p, &ValidationContext::default())
                .errors
                .is_empty()
        );
        assert_eq!(
            p.config.budget(),
            Some(crate::task::Budget {
                max_tokens: Some(10_000),
                max_cost: Some(0.5)
            })
        );
    }

    #[test]
    fn output_schemas_must_be_objects() {
        let mut good = Subtask::new("good", "");
        good.output_schema = Some(serde_json::json!({"type": "object"}));
        let mut bad = Subtask::new("bad", "");
        bad.output_schema = Some(serde_json::json!("object"));
        let r = validate_plan(&plan(vec![good, bad]), &ValidationContext::default());
        assert_eq!(codes(&r), vec![ProblemCode::InvalidOutputSchema], "{r:#?}");
        assert_eq!(r.errors[0].path, "subtasks[1].output_schema");
        assert!(r.errors[0].message.contains("a string"), "{r:#?}");
    }

    #[test]
    fn parallel_tasks_sharing_an_output_key_are_warned_about() {
        let with_key = |id: &str, deps: &[&str]| {
            let mut t = Subtask::new(id, "").after(deps);
            t.output_key = Some("summary".into());
            t
        };
        // a → b in sequence: the later write wins by design. c runs beside both.
        let p = plan(vec![
            with_key("a", &[]),
            with_key("b", &["a"]),
            Subtask::new("x", ""),
            with_key("c", &["x"]),
        ]);
        let r = validate_plan(&p, &ValidationContext::default());
        assert!(r.is_valid(), "{r:#?}");
        let shared: Vec<_> = r
            .warnings
            .iter()
            .filter(|w| w.code == ProblemCode::SharedOutputKey)
            .collect();
        assert_eq!(shared.len(), 1, "{r:#?}");
        assert_eq!(shared[0].tasks, vec!["a".to_string(), "c".to_string()]);
        let sequential = plan(vec![with_key("a", &[]), with_key("b", &["a"])]);
        let r = validate_plan(&sequential, &ValidationContext::default());
        assert!(r.warnings.is_empty(), "{r:#?}");
    }

    #[test]
    fn a_task_cannot_wait_for_its_own_output() {
        let mut own = Subtask::new("own", "");
        own.produces = vec!["draft".into()];
        own.consumes = vec!["draft".into()];
        // `first` consumes a topic only its dependent produces.
        let mut first = Subtask::new("first", "");
        first.consumes = vec!["later".into()];
        let mut second = Subtask::new("second", "").after(&["first"]);
        second.produces = vec!["later".into()];
        // Fine: the producer does not wait for the consumer.
        let mut fetch = Subtask::new("fetch", "");
        fetch.produces = vec!["figures".into()];
        let mut growth = Subtask::new("growth", "");
        growth.consumes = vec!["figures".into()];
        let p = plan(vec![own, first, second, fetch, growth]);
        let r = validate_plan(&p, &ValidationContext::default());
        assert_eq!(
            codes(&r),
            vec![
                ProblemCode::UnsatisfiableConsumption,
                ProblemCode::UnsatisfiableConsumption
            ],
            "{r:#?}"
        );
        assert_eq!(
            r.errors[0].tasks,
            vec!["own".to_string(), "own".to_string()]
        );
        assert_eq!(
            r.errors[1].tasks,
            vec!["first".to_string(), "second".to_string()]
        );
        let mut lenient = p.clone();
        lenient.config.dataflow_validation = DataflowValidation::Lenient;
        let r = validate_plan(&lenient, &ValidationContext::default());
        assert!(r.is_valid(), "{r:#?}");
        assert_eq!(r.warnings.len(), 2);
    }

    #[test]
    fn context_checks_pools_and_agents() {
        let ctx = ValidationContext {
            pools: Some(["default".to_string()].into()),
            agents: Some(AgentCatalog {
                names: ["echo".to_string()].into(),
                default: None,
                workflows: BTreeSet::new(),
            }),
            limits: Limits::default(),
        };
        let mut gpu = Subtask::new("a", "").with_agent("echo");
        gpu.pool = "gpu".into();
        let p = plan(vec![
            gpu,
            Subtask::new("b", "").with_agent("llm"),
            Subtask::new("c", ""),
        ]);
        let r = validate_plan(&p, &ctx);
        assert_eq!(
            codes(&r),
            vec![
                ProblemCode::UnknownPool,
                ProblemCode::UnknownAgent,
                ProblemCode::NoAgent
            ]
        );
    }

    #[test]
    fn limits_and_config_ranges() {
        let ctx = ValidationContext {
            limits: Limits {
                max_subtasks: 2,
                max_description_bytes: 4,
                max_input_bytes: 8,
                ..Limits::default()
            },
            ..Default::default()
        };
        let mut big = Subtask::new("a", "too long");
        big.input = serde_json::json!({"k": "0123456789"});
        let mut p = plan(vec![big, Subtask::new("b", ""), Subtask::new("c", "")]);
        p.config.failure_ratio = 1.5;
        p.config.max_concurrency = 0;
        p.config.strategy = Strategy::Supervisor;
        let r = validate_plan(&p, &ctx);
        let got: BTreeSet<_> = codes(&r).into_iter().collect();
        for c in [
            ProblemCode::TooManySubtasks,
            ProblemCode::DescriptionTooLarge,
            ProblemCode::InputTooLarge,
            ProblemCode::InvalidConfig,
            ProblemCode::UnsupportedStrategy,
        ] {
            assert!(got.contains(&c), "missing {c}: {r:#?}");
        }
        let empty = validate_plan(&plan(vec![]), &ValidationContext::default());
        assert_eq!(codes(&empty), vec![ProblemCode::EmptyPlan]);
    }

    mod props {
        use super::*;
        use proptest::prelude::{any, prop_assert, prop_assume, proptest};
        use proptest::strategy::Strategy as _;

        /// A random DAG: task i may depend only on tasks with a smaller index.
        fn dag() -> impl proptest::strategy::Strategy<Value = Vec<Vec<usize>>> {
            (1usize..40).prop_flat_map(|n| {
                (0..n)
                    .map(|i| proptest::collection::btree_set(0..i.max(1), 0..=i.min(4)))
                    .collect::<Vec<_>>()
                    .prop_map(move |sets| {
                        sets.into_iter()
                            .enumerate()
                            .map(|(i, s)| s.into_iter().filter(|&d| d < i).collect())
                            .collect()
                    })
            })
        }

        fn to_plan(deps: &[Vec<usize>]) -> Plan {
            let names: Vec<String> = (0..deps.len()).map(|i| format!("t{i}")).collect();
            plan(
                deps.iter()
                    .enumerate()
                    .map(|(i, ds)| {
                        let refs: Vec<&str> = ds.iter().map(|&d| names[d].as_str()).collect();
                        Subtask::new(&names[i], "").after(&refs)
                    })
                    .collect(),
            )
        }

        fn reachable(deps: &[Vec<usize>], from: usize) -> BTreeSet<usize> {
            let mut seen = BTreeSet::new();
            let mut stack = vec![from];
            while let Some(x) = stack.pop() {
                for &d in &deps[x] {
                    if seen.insert(d) {
                        stack.push(d);
                    }
                }
            }
            seen
        }

        proptest! {
            #[test]
            fn random_dags_validate(deps in dag()) {
                let r = validate_plan(&to_plan(&deps), &ValidationContext::default());
                prop_assert!(r.is_valid(), "{:?}", r);
            }

            #[test]
            fn a_back_edge_is_always_caught(deps in dag(), pick in any::<proptest::sample::Index>()) {
                // Choose a task with at least one ancestor and make an ancestor depend on it.
                let candidates: Vec<(usize, usize)> = (0..deps.len())
                    .flat_map(|i| reachable(&deps, i).into_iter().map(move |a| (i, a)))
                    .collect();
                prop_assume!(!candidates.is_empty());
                let (task, ancestor) = candidates[pick.index(candidates.len())];
                let mut with_back = deps.clone();
                with_back[ancestor].push(task);
                let r = validate_plan(&to_plan(&with_back), &ValidationContext::default());
                prop_assert!(r.has(ProblemCode::Cycle), "{:?}", r);
                // The reported cycle really is one: each task depends on the next.
                for p in r.errors.iter().filter(|p| p.code == ProblemCode::Cycle) {
                    let idx: Vec<usize> = p.tasks.iter().map(|t| t[1..].parse().unwrap()).collect();
                    for w in 0..idx.len() {
                        let next = idx[(w + 1) % idx.len()];
                        prop_assert!(with_back[idx[w]].contains(&next));
                    }
                }
            }
        }
    }
}
