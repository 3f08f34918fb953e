//! Built-in agents and the `[agents.NAME]` configuration that defines them.
//!
//! ```toml
//! default-agent = "echo"
//!
//! [agents.echo]                      # deterministic test/demo agent
//! kind = "scripted"
//! reply = "{task_id}: done"
//!
//! [agents.fetch_data]                # runs a command; envelope JSON on stdin
//! kind = "exec"
//! command = "python3"
//! args = ["examples/agents/earnings.py", "fetch"]
//!
//! [agents.analyst]                   # a model behind an OpenAI-compatible API
//! kind = "llm"
//! base-url = "http://127.0.0.1:8080/v1"
//! model = "smollm2"
//! api-key-env = "LLM_API_KEY"        # optional for local servers
//! ```
//!
//! `kind = "llm"` agents are built by [`flotilla_llm`] (see [`flotilla_llm::config`] for
//! every key); their system prompts come from `[roles.NAME]` ([`RoleConfig`]) on top of the
//! shipped role prompts. All LLM agents of one registry share its per-provider request caps.

mod entry;
mod exec;
mod scripted;
pub mod shim;
pub mod workflow;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use entry::AgentEntry;
pub use exec::ExecAgent;
pub use flotilla_llm::{LlmAgent, LlmConfig, RoleConfig};
pub use scripted::ScriptedAgent;
pub use workflow::{LoopConfig, WorkflowAgent, WorkflowConfig, WorkflowShape};

use crate::agent::Agent;

/// One agent definition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum AgentDefinition {
    /// Runs a command per task.
    Exec(ExecConfig),
    /// A deterministic agent with a fixed reply, for tests and demos.
    Scripted(ScriptedConfig),
    /// A model behind an OpenAI-compatible chat-completions API.
    Llm(Box<LlmConfig>),
    /// Sub-agents in order ([`workflow`]); run by the coordinators.
    Sequential(WorkflowConfig),
    /// Sub-agents at once ([`workflow`]); run by the coordinators.
    Parallel(WorkflowConfig),
    /// Sub-agents in order, repeatedly ([`workflow`]); run by the coordinators.
    Loop(LoopConfig),
}

impl AgentDefinition {
    /// Whether it is a workflow agent (run by the coordinators, not by workers).
    pub fn is_workflow(&self) -> bool {
        matches!(
            self,
            Self::Sequential(_) | Self::Parallel(_) | Self::Loop(_)
        )
    }
}

static NO_KEYS: BTreeMap<String, String> = BTreeMap::new();

/// The sub-agents of a definition in the agent tree (workflow agents, and LLM agents'
/// `sub-agents`).
fn sub_agents_of(def: &AgentDefinition) -> &[String] {
    match def {
        AgentDefinition::Sequential(c) | AgentDefinition::Parallel(c) => &c.sub_agents,
        AgentDefinition::Loop(c) => &c.sub_agents,
        AgentDefinition::Llm(c) => &c.sub_agents,
        _ => &[],
    }
}

/// The agents `name` (an LLM agent) may transfer the conversation to, by ADK's scope rules:
/// its sub-agents, its parent (unless `disallow-transfer-to-parent`) and its peers — the
/// parent's other sub-agents (unless `disallow-transfer-to-peers`).
pub fn transfer_targets(defs: &BTreeMap<String, AgentDefinition>, name: &str) -> Vec<String> {
    let Some(AgentDefinition::Llm(c)) = defs.get(name) else {
        return Vec::new();
    };
    let mut targets: Vec<String> = c.sub_agents.clone();
    let parent = defs
        .iter()
        .find(|(_, d)| sub_agents_of(d).iter().any(|s| s == name))
        .map(|(p, d)| (p, sub_agents_of(d)));
    if let Some((parent, siblings)) = parent {
        if !c.disallow_transfer_to_parent {
            targets.push(parent.clone());
        }
        if !c.disallow_transfer_to_peers {
            targets.extend(siblings.iter().filter(|s| *s != name).cloned());
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    targets.retain(|t| seen.insert(t.clone()));
    targets
}

/// Checks that the workflow agents among `defs` form a tree (see [`workflow::check_tree`]);
/// the error lists every problem, naming the definitions.
pub fn check_workflows(defs: &BTreeMap<String, AgentDefinition>) -> Result<(), String> {
    let shapes: BTreeMap<&str, WorkflowShape<'_>> = defs
        .iter()
        .filter_map(|(name, def)| {
            let shape = match def {
                AgentDefinition::Sequential(c) => WorkflowShape {
                    kind: "sequential",
                    sub_agents: &c.sub_agents,
                    output_keys: &c.output_keys,
                    max_iterations: None,
                },
                AgentDefinition::Parallel(c) => WorkflowShape {
                    kind: "parallel",
                    sub_agents: &c.sub_agents,
                    output_keys: &c.output_keys,
                    max_iterations: None,
                },
                AgentDefinition::Loop(c) => WorkflowShape {
                    kind: "loop",
                    sub_agents: &c.sub_agents,
                    output_keys: &c.output_keys,
                    max_iterations: Some(c.max_iterations),
                },
                // An LLM agent's sub-agents (transfer targets) are part of the same tree.
                AgentDefinition::Llm(c) if !c.sub_agents.is_empty() => WorkflowShape {
                    kind: "llm",
                    sub_agents: &c.sub_agents,
                    output_keys: &NO_KEYS,
                    max_iterations: None,
                },
                _ => return None,
            };
            Some((name.as_str(), shape))
        })
        .collect();
    let defined = defs.keys().map(String::as_str).collect();
    workflow::check_tree(&shapes, &defined).map_err(|p| p.join("; "))
}

/// `kind = "exec"`: run a command. The task envelope is written to its stdin as JSON; its
/// stdout is the response (plain text, or a JSON object with `response`, `tokens`,
/// `tools_used`, `numeric_value`); a non-zero exit is a failure carrying stderr.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ExecConfig {
    /// Program to run (looked up on `PATH` unless it contains a `/`).
    pub command: String,
    /// Arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// Extra environment variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory; relative paths are relative to the config file's directory,
    /// which is also the default.
    #[serde(default)]
    pub cwd: Option<PathBuf>,
}

/// `kind = "scripted"`: a deterministic agent. Used by tests and demos to exercise the
/// machinery without an LLM; it is labelled as such wherever it appears.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ScriptedConfig {
    /// Reply template. Placeholders: `{task_id}`, `{run_id}`, `{attempt}`, `{description}`,
    /// `{input}` (the task's input as JSON),
    /// `{dependencies}` (ids of the injected dependency results, comma separated),
    /// `{previous}` (ids of the injected previous results), `{dependency_numbers}` (their
    /// `numeric_value`s, `id=value`, comma separated).
    #[serde(default = "default_reply")]
    pub reply: String,
    /// How long each attempt takes.
    #[serde(default, with = "humantime_serde")]
    pub delay: Duration,
    /// Fail the first N attempts of every task.
    #[serde(default)]
    pub fail_first: u32,
    /// Message of the scripted failures.
    #[serde(default = "default_failure")]
    pub failure: String,
    /// Tokens reported per reply.
    #[serde(default)]
    pub tokens: u64,
}

fn default_reply() -> String {
    "{task_id} done".into()
}

fn default_failure() -> String {
    "scripted failure".into()
}

impl Default for ScriptedConfig {
    fn default() -> Self {
        Self {
            reply: default_reply(),
            delay: Duration::ZERO,
            fail_first: 0,
            failure: default_failure(),
            tokens: 0,
        }
    }
}

/// The agents a worker can run, by name, and the team roles they fill.
#[derive(Debug, Clone, Default)]
pub struct AgentRegistry {
    agents: BTreeMap<String, Arc<dyn Agent>>,
    default: Option<String>,
    /// Role → the agents here that fill it (from their member cards), in name order.
    roles: BTreeMap<String, Vec<String>>,
}

impl AgentRegistry {
    /// Builds agents from definitions, with the shipped role prompts. `base_dir` resolves
    /// relative paths (the directory of the config file).
    pub fn from_definitions(
        defs: &BTreeMap<String, AgentDefinition>,
        default: Option<String>,
        base_dir: &Path,
    ) -> Result<Self, String> {
        Self::from_config(defs, &BTreeMap::new(), default, base_dir)
    }

    /// Builds agents from definitions; LLM agents take their role prompts from `roles` on
    /// top of the shipped ones.
    pub fn from_config(
        defs: &BTreeMap<String, AgentDefinition>,
        roles: &BTreeMap<String, RoleConfig>,
        default: Option<String>,
        base_dir: &Path,
    ) -> Result<Self, String> {
        let roles = Arc::new(flotilla_llm::Roles::with_config(roles).map_err(|e| e.to_string())?);
        let providers = flotilla_llm::Providers::default();
        check_workflows(defs)?;
        let mut agents: BTreeMap<String, Arc<dyn Agent>> = BTreeMap::new();
        for (name, def) in defs {
            flotilla_model::token::check_name(name)
                .map_err(|e| format!("agents.{name}: the name {e}"))?;
            let agent: Arc<dyn Agent> = match def {
                AgentDefinition::Exec(c) => Arc::new(ExecAgent::new(name, c, base_dir)?),
                AgentDefinition::Scripted(c) => Arc::new(ScriptedAgent::new(c.clone())),
                AgentDefinition::Llm(c) => Arc::new(
                    LlmAgent::new(name, c, Arc::clone(&roles), &providers, base_dir)
                        .map_err(|e| e.to_string())?
                        .with_transfer_targets(transfer_targets(defs, name)),
                ),
                // Workflow agents run on the coordinators ([`Self::workflows`]).
                AgentDefinition::Sequential(_)
                | AgentDefinition::Parallel(_)
                | AgentDefinition::Loop(_) => continue,
            };
            agents.insert(name.clone(), agent);
        }
        if let Some(d) = &default
            && !agents.contains_key(d)
        {
            let why = if defs.get(d).is_some_and(AgentDefinition::is_workflow) {
                "is a workflow agent, which cannot be the default"
            } else {
                "is not defined under [agents]"
            };
            return Err(format!("default-agent {d:?} {why}"));
        }
        Ok(Self {
            agents,
            default,
            roles: BTreeMap::new(),
        })
    }

    /// The team roles the agents fill, from their member cards (`roles = [...]` in
    /// `[agents.NAME]`): a worker running this registry claims anycast tasks of these roles
    /// (one role queue consumer each). Cards of agents it does not run are ignored.
    pub fn with_cards<'a>(
        mut self,
        cards: impl IntoIterator<Item = (&'a str, &'a flotilla_model::team::MemberCard)>,
    ) -> Self {
        self.roles.clear();
        for (name, card) in cards {
            if !self.agents.contains_key(name) {
                continue;
            }
            for role in &card.roles {
                let members = self.roles.entry(role.clone()).or_default();
                if !members.iter().any(|m| m == name) {
                    members.push(name.to_owned());
                    members.sort();
                }
            }
        }
        self
    }

    /// The roles the agents here fill.
    pub fn roles(&self) -> Vec<String> {
        self.roles.keys().cloned().collect()
    }

    /// The agent that runs an anycast task of `role` here: its first member by name (a
    /// deterministic choice), or `None` when no agent here fills the role.
    pub fn member_of(&self, role: &str) -> Option<&str> {
        self.roles
            .get(role)
            .and_then(|m| m.first())
            .map(String::as_str)
    }

    /// The workflow agents among `defs`, for the coordinators' embedded worker of
    /// [`workflow::WORKFLOW_POOL`]. Empty when there are none.
    pub fn workflows(defs: &BTreeMap<String, AgentDefinition>) -> Result<Self, String> {
        check_workflows(defs)?;
        let mut agents: BTreeMap<String, Arc<dyn Agent>> = BTreeMap::new();
        for (name, def) in defs {
            let agent: Arc<dyn Agent> = match def {
                AgentDefinition::Sequential(c) => Arc::new(WorkflowAgent::new(name, false, c)),
                AgentDefinition::Parallel(c) => Arc::new(WorkflowAgent::new(name, true, c)),
                AgentDefinition::Loop(c) => Arc::new(WorkflowAgent::new_loop(name, c)),
                _ => continue,
            };
            agents.insert(name.clone(), agent);
        }
        Ok(Self {
            agents,
            default: None,
            roles: BTreeMap::new(),
        })
    }

    /// Whether it holds no agent.
    pub fn is_empty(&self) -> bool {
        self.agents.is_empty()
    }

    /// Adds or replaces an agent (for embedding Flotilla with custom agents).
    pub fn insert(&mut self, name: impl Into<String>, agent: Arc<dyn Agent>) {
        self.agents.insert(name.into(), agent);
    }

    /// Sets the default agent.
    pub fn set_default(&mut self, name: Option<String>) {
        self.default = name;
    }

    /// The agent for a task: the named one, or the default.
    pub fn resolve(&self, name: Option<&str>) -> Result<(&str, &Arc<dyn Agent>), String> {
        let name = match name.or(self.default.as_deref()) {
            Some(n) => n,
            None => {
                return Err("the task names no agent and this worker has no default-agent".into());
            }
        };
        self.agents
            .get_key_value(name)
            .map(|(k, v)| (k.as_str(), v))
            .ok_or_else(|| match self.names().as_slice() {
                [] => format!(
                    "this worker has no agent named {name:?} (it has no agents: is its configuration file found?)"
                ),
                names => format!(
                    "this worker has no agent named {name:?} (it has: {})",
                    names.join(", ")
                ),
            })
    }

    /// Names of the defined agents.
    pub fn names(&self) -> Vec<String> {
        self.agents.keys().cloned().collect()
    }

    /// The default agent's name.
    pub fn default_agent(&self) -> Option<&str> {
        self.default.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_targets_follow_the_agent_tree_and_its_disallow_flags() {
        let defs: BTreeMap<String, AgentDefinition> = toml::from_str(
            r#"
            [desk]
            kind = "sequential"
            sub-agents = ["dispatcher"]

            [dispatcher]
            kind = "llm"
            base-url = "http://127.0.0.1:9/v1"
            model = "m"
            sub-agents = ["billing", "support", "faq"]

            [billing]
            kind = "llm"
            base-url = "http://127.0.0.1:9/v1"
            model = "m"
            disallow-transfer-to-peers = true

            [support]
            kind = "llm"
            base-url = "http://127.0.0.1:9/v1"
            model = "m"
            disallow-transfer-to-parent = true

            [faq]
            kind = "scripted"
            "#,
        )
        .expect("parses");
        assert_eq!(
            transfer_targets(&defs, "dispatcher"),
            vec!["billing", "support", "faq", "desk"]
        );
        assert_eq!(transfer_targets(&defs, "billing"), vec!["dispatcher"]);
        assert_eq!(transfer_targets(&defs, "support"), vec!["billing", "faq"]);
        assert!(
            transfer_targets(&defs, "faq").is_empty(),
            "not an LLM agent"
        );
        assert!(check_workflows(&defs).is_ok());

        // The LLM agents' sub-agents are part of the tree: one parent each.
        let mut twice = defs.clone();
        if let Some(AgentDefinition::Llm(c)) = twice.get_mut("billing") {
            c.sub_agents = vec!["faq".into()];
        }
        let e = check_workflows(&twice).expect_err("faq has two parents");
        assert!(e.contains("\"faq\" already belongs to"), "{e}");
    }

    #[test]
    fn definitions_parse_from_toml() {
        let defs: BTreeMap<String, AgentDefinition> = toml::from_str(
            r#"
            [echo]
            kind = "scripted"
            reply = "hi {task_id}"
            delay = "10ms"
            fail-first = 1

            [run]
            kind = "exec"
            command = "python3"
            args = ["x.py"]
            "#,
        )
        .expect("parses");
        assert!(matches!(
            defs["echo"],
            AgentDefinition::Scripted(ScriptedConfig { fail_first: 1, .. })
        ));
        assert!(matches!(&defs["run"], AgentDefinition::Exec(c) if c.command == "python3"));
        let bad = toml::from_str::<BTreeMap<String, AgentDefinition>>(
            "[x]\nkind = \"scripted\"\nreplay = \"typo\"\n",
        );
        assert!(bad.is_err(), "unknown keys are rejected");
        let bad = toml::from_str::<BTreeMap<String, AgentDefinition>>("[x]\nkind = \"oracle\"\n");
        assert!(bad.is_err(), "unknown kinds are rejected");
        let bad = toml::from_str::<BTreeMap<String, AgentDefinition>>("[x]\nkind = \"llm\"\n");
        assert!(bad.is_err(), "an llm agent needs base-url and model");
    }

    #[test]
    fn llm_agents_are_built_with_roles_and_checked() {
        let defs: BTreeMap<String, AgentDefinition> = toml::from_str(
            r#"
            [writer]
            kind = "llm"
            base-url = "http://127.0.0.1:8080/v1"
            model = "smollm2"
            max-tool-rounds = 2
            tools = ["workspace_read"]
            "#,
        )
        .expect("parses");
        assert!(
            matches!(&defs["writer"], AgentDefinition::Llm(c) if c.model == "smollm2" && c.max_tool_rounds == 2)
        );
        let mut roles = BTreeMap::new();
        roles.insert(
            "editor".to_string(),
            RoleConfig {
                prompt: "Edit.".into(),
            },
        );
        let reg = AgentRegistry::from_config(&defs, &roles, None, Path::new(".")).expect("valid");
        assert_eq!(reg.resolve(Some("writer")).expect("built").0, "writer");

        let bad: BTreeMap<String, AgentDefinition> = toml::from_str(
            "[w]\nkind = \"llm\"\nbase-url = \"http://h/v1\"\nmodel = \"m\"\ntemperature = 9.0\n",
        )
        .expect("parses");
        let e = AgentRegistry::from_definitions(&bad, None, Path::new(".")).expect_err("bad");
        assert!(e.starts_with("agents.w.temperature:"), "{e}");
        roles.insert(
            "empty".into(),
            RoleConfig {
                prompt: String::new(),
            },
        );
        let e =
            AgentRegistry::from_config(&defs, &roles, None, Path::new(".")).expect_err("bad role");
        assert!(e.starts_with("roles.empty:"), "{e}");
    }

    #[test]
    fn registry_resolves_names_and_default() {
        let mut defs = BTreeMap::new();
        defs.insert(
            "echo".to_string(),
            AgentDefinition::Scripted(ScriptedConfig::default()),
        );
        let reg = AgentRegistry::from_definitions(&defs, Some("echo".into()), Path::new("."))
            .expect("valid");
        assert_eq!(reg.resolve(None).expect("default").0, "echo");
        assert!(reg.resolve(Some("nope")).is_err());
        assert!(
            AgentRegistry::from_definitions(&defs, Some("missing".into()), Path::new(".")).is_err()
        );
    }
}
