//! Checks of single values: the plan's settings (concurrency, failure ratio, budgets,
//! retries, timeouts, strategy) and each subtask's fields (sizes, timeout, pool and agent
//! names against the context, an anycast task's role, topics, output key and schema).

use std::time::Duration;

use super::{ValidationContext, Validator, json_depth, json_size};
use crate::plan::{Plan, Strategy};
use crate::problem::{Problem, ProblemCode};
use crate::token::{check_name, check_token};

impl Validator {
    pub(super) fn check_config(&mut self, plan: &Plan, ctx: &ValidationContext) {
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
        for (i, role) in c.recruit_roles.iter().flatten().enumerate() {
            if let Err(e) = crate::token::check_token(role) {
                self.error(
                    ProblemCode::InvalidConfig,
                    format!("config.recruit_roles[{i}]"),
                    format!("role {role:?} {e}"),
                );
            }
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
        self.check_timeout("config.lead_timeout", c.lead_timeout.get(), ctx);
        if let Some(h) = &c.hitl {
            self.report.errors.extend(h.problems());
        }
        self.check_client_tools(&c.client_tools);
        if c.strategy == Strategy::Supervisor
            && let Some(agents) = &ctx.agents
            && agents.lead().is_none()
        {
            let roles: Vec<&str> = agents.roles.keys().map(String::as_str).collect();
            self.error(
                ProblemCode::UnsupportedStrategy,
                "config.strategy",
                format!(
                    "the supervisor strategy needs a lead: an agent whose card has the role `{}`, and this deployment has none (roles: {})",
                    crate::plan::LEAD_ROLE,
                    if roles.is_empty() { "none".to_owned() } else { roles.join(", ") }
                ),
            );
        }
    }

    /// The plan's client tools: a bounded list of distinct, well-named tools with an object
    /// schema each, none taking a built-in tool's name.
    fn check_client_tools(&mut self, tools: &[crate::plan::ClientTool]) {
        use crate::plan::{MAX_CLIENT_TOOLS, RESERVED_TOOL_NAMES, is_tool_name};
        if tools.len() > MAX_CLIENT_TOOLS {
            self.error(
                ProblemCode::InvalidConfig,
                "config.client_tools",
                format!(
                    "{} client tools exceed the limit of {MAX_CLIENT_TOOLS}",
                    tools.len()
                ),
            );
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, t) in tools.iter().enumerate() {
            let at = |field: &str| format!("config.client_tools[{i}].{field}");
            if !is_tool_name(&t.name) {
                self.error(
                    ProblemCode::InvalidConfig,
                    at("name"),
                    format!(
                        "tool name {:?} must be 1 to 64 letters, digits, `_` or `-`",
                        t.name
                    ),
                );
            } else if RESERVED_TOOL_NAMES.contains(&t.name.as_str()) {
                self.error(
                    ProblemCode::InvalidConfig,
                    at("name"),
                    format!("{:?} is the name of a built-in tool", t.name),
                );
            } else if !seen.insert(t.name.as_str()) {
                self.error(
                    ProblemCode::InvalidConfig,
                    at("name"),
                    format!("client tool {:?} is declared twice", t.name),
                );
            }
            if t.description.trim().is_empty() || t.description.len() > 1024 {
                self.error(
                    ProblemCode::InvalidConfig,
                    at("description"),
                    format!(
                        "must say what the tool does in 1 to 1024 bytes, got {}",
                        t.description.len()
                    ),
                );
            }
            if t.parameters.get("type").and_then(serde_json::Value::as_str) != Some("object") {
                self.error(
                    ProblemCode::InvalidConfig,
                    at("parameters"),
                    "must be a JSON Schema with \"type\": \"object\" (tool arguments are objects)",
                );
            } else if let Err(e) = jsonschema::validator_for(&t.parameters) {
                self.error(
                    ProblemCode::InvalidConfig,
                    at("parameters"),
                    format!("is not a JSON Schema: {e}"),
                );
            } else if json_size(&t.parameters) > 16 * 1024 {
                self.error(
                    ProblemCode::InvalidConfig,
                    at("parameters"),
                    format!(
                        "{} bytes exceed the limit of 16384",
                        json_size(&t.parameters)
                    ),
                );
            }
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

    pub(super) fn check_subtask(
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
        if let Some(agent) = &task.compensate {
            if let Err(e) = check_name(agent) {
                self.error(
                    ProblemCode::UnknownAgent,
                    format!("subtasks[{i}].compensate"),
                    format!("agent name {agent:?} {e}"),
                );
            } else if let Some(catalog) = &ctx.agents
                && !catalog.names.contains(agent)
            {
                self.error(
                    ProblemCode::UnknownAgent,
                    format!("subtasks[{i}].compensate"),
                    format!(
                        "compensating agent {agent:?} is not defined (defined agents: {})",
                        catalog.names.iter().cloned().collect::<Vec<_>>().join(", ")
                    ),
                );
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
            // Anycast: one free member of the role claims it; the role must have one.
            (None, Some(catalog)) if task.anycast_role(catalog.has_roles()).is_some() => {
                let role = task.role.as_deref().unwrap_or_default();
                if !catalog.roles.contains_key(role) {
                    self.error(
                        ProblemCode::UnknownRole,
                        format!("subtasks[{i}].role"),
                        format!(
                            "task {:?} names role {role:?} and no agent, so a member of the role would claim it, but no member card has that role (roles: {}); name a role that exists, or an agent",
                            task.id.as_str(),
                            catalog.roles.keys().cloned().collect::<Vec<_>>().join(", ")
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
                Ok(()) if key.starts_with(crate::approval::RESERVED_STATE_PREFIX) => Some(format!(
                    "output_key {key:?} starts with `_`: such session-state keys are Flotilla's own"
                )),
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
        if let Some(model) = &task.model {
            let problem = if model.is_empty() {
                Some("model is empty (leave it out to use the agent's)".to_owned())
            } else if model.len() > crate::plan::MAX_MODEL_LEN {
                Some(format!(
                    "model is {} bytes long; the limit is {}",
                    model.len(),
                    crate::plan::MAX_MODEL_LEN
                ))
            } else if model.chars().any(|c| c.is_whitespace() || c.is_control()) {
                Some(format!(
                    "model {model:?} holds whitespace or control characters"
                ))
            } else {
                None
            };
            if let Some(message) = problem {
                self.error(
                    ProblemCode::InvalidModel,
                    format!("subtasks[{i}].model"),
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
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::plan::Subtask;
    use crate::validate::tests::{codes, plan};
    use crate::validate::{AgentCatalog, Limits, validate_plan};

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
            Some(crate::plan::Budget {
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
    fn context_checks_pools_and_agents() {
        let ctx = ValidationContext {
            pools: Some(["default".to_string()].into()),
            agents: Some(AgentCatalog {
                names: ["echo".to_string()].into(),
                default: None,
                workflows: BTreeSet::new(),
                roles: Default::default(),
                compensations: Default::default(),
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
    fn a_role_without_an_agent_needs_a_member_when_cards_define_roles() {
        let catalog = AgentCatalog {
            names: [
                "analyst".to_string(),
                "writer".to_string(),
                "flow".to_string(),
            ]
            .into(),
            default: None,
            workflows: ["flow".to_string()].into(),
            ..AgentCatalog::default()
        }
        .with_roles([
            ("analyst", &["research".to_string()][..]),
            (
                "writer",
                &["writing".to_string(), "research".to_string()][..],
            ),
            ("flow", &["review".to_string()][..]),
        ]);
        assert_eq!(
            catalog.roles["research"],
            ["analyst".to_string(), "writer".to_string()].into()
        );
        assert!(
            !catalog.roles.contains_key("review"),
            "workflow agents claim nothing"
        );
        let ctx = ValidationContext {
            agents: Some(catalog),
            ..Default::default()
        };
        let mut claimed = Subtask::new("a", "");
        claimed.role = Some("research".into());
        let mut unknown = Subtask::new("b", "");
        unknown.role = Some("review".into());
        // A role beside an agent is the agent's prompt, as before.
        let mut prompt = Subtask::new("c", "").with_agent("writer");
        prompt.role = Some("synthesis".into());
        let r = validate_plan(&plan(vec![claimed, unknown, prompt]), &ctx);
        assert_eq!(codes(&r), vec![ProblemCode::UnknownRole], "{r:#?}");
        assert_eq!(r.errors[0].path, "subtasks[1].role");
        assert!(
            r.errors[0].message.contains("roles: research, writing"),
            "{r:#?}"
        );

        // Without roles on any card, a role names a prompt: no agent and no default is
        // `no_agent`, as before.
        let ctx = ValidationContext {
            agents: Some(AgentCatalog {
                names: ["analyst".to_string()].into(),
                ..AgentCatalog::default()
            }),
            ..Default::default()
        };
        let mut t = Subtask::new("a", "");
        t.role = Some("research".into());
        let r = validate_plan(&plan(vec![t]), &ctx);
        assert_eq!(codes(&r), vec![ProblemCode::NoAgent], "{r:#?}");
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
        let ctx = ValidationContext {
            agents: Some(crate::validate::AgentCatalog::default()),
            ..ctx
        };
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
}
