//! Role prompts: the system prompt of an LLM agent comes from its task's `role`.
//!
//! Flotilla ships prompts for `planner`, `researcher`, `analyst`, `writer`, `critic` and
//! `synthesis`; `[roles.NAME]` in the config adds roles or replaces shipped prompts:
//!
//! ```toml
//! [roles.analyst]
//! prompt = "You are a careful financial analyst. Show the numbers you rely on."
//! ```
//!
//! A task with a role nobody defined gets a generic prompt naming the role; a task without a
//! role gets the generic team-member prompt.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::config::ConfigError;

/// One `[roles.NAME]` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct RoleConfig {
    /// The role's system prompt.
    pub prompt: String,
}

/// The shipped role prompts.
pub const DEFAULT_ROLES: &[(&str, &str)] = &[
    (
        "planner",
        "You are the planner of a team of AI agents. You break a request into a small number of concrete subtasks, each done by one agent, with the dependencies between them. You only plan; you do not do the work yourself. Answer with the plan in the exact format you are asked for.",
    ),
    (
        "researcher",
        "You are the researcher of a team of AI agents. You gather the facts, figures and sources the team needs for its task, from the material and tools you are given. Report what you found, where it came from, and what you could not find. Do not invent facts.",
    ),
    (
        "analyst",
        "You are the analyst of a team of AI agents. You work with the data and results you are given: compute, compare and interpret them. Show the figures you rely on and state the key number of your answer plainly.",
    ),
    (
        "writer",
        "You are the writer of a team of AI agents. You turn the team's findings into clear, well-structured prose for the reader of the final answer. Stay faithful to the results you are given; do not add claims they do not support.",
    ),
    (
        "critic",
        "You are the critic of a team of AI agents. You review the work you are given for errors, gaps, unsupported claims and risks, and say concretely what should change. Be specific and brief.",
    ),
    (
        "synthesis",
        "You are the synthesizer of a team of AI agents. You combine the results of the other agents into the final answer to the user's query: consistent, complete and concise. Where results disagree, say so and explain which you trust.",
    ),
];

/// Prompt of a task without a role.
pub const GENERIC_PROMPT: &str = "You are a member of a team of AI agents working together on a request. Do the task you are given, using the results and tools you are given, and answer with the result.";

/// The role prompts an agent uses: the shipped ones, overridden and extended by config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roles {
    prompts: BTreeMap<String, String>,
}

impl Default for Roles {
    fn default() -> Self {
        Self {
            prompts: DEFAULT_ROLES
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        }
    }
}

impl Roles {
    /// The shipped roles with `configured` on top. An empty prompt is an error.
    pub fn with_config(configured: &BTreeMap<String, RoleConfig>) -> Result<Self, ConfigError> {
        let mut roles = Self::default();
        for (name, role) in configured {
            if name.trim().is_empty() {
                return Err(ConfigError::InvalidRole {
                    role: name.clone(),
                    message: "the role name is empty".into(),
                });
            }
            if role.prompt.trim().is_empty() {
                return Err(ConfigError::InvalidRole {
                    role: name.clone(),
                    message: "the prompt is empty".into(),
                });
            }
            roles.prompts.insert(name.clone(), role.prompt.clone());
        }
        Ok(roles)
    }

    /// The system prompt of `role`.
    pub fn prompt(&self, role: Option<&str>) -> String {
        match role {
            None => GENERIC_PROMPT.to_owned(),
            Some(r) => self.prompts.get(r).cloned().unwrap_or_else(|| {
                format!(
                    "You are the {r} of a team of AI agents working together on a request. Do the task you are given, using the results and tools you are given, and answer with the result."
                )
            }),
        }
    }

    /// Names of the known roles.
    pub fn names(&self) -> Vec<&str> {
        self.prompts.keys().map(String::as_str).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_configured_and_unknown_roles() {
        let mut configured = BTreeMap::new();
        configured.insert(
            "analyst".to_string(),
            RoleConfig {
                prompt: "Count carefully.".into(),
            },
        );
        let roles = Roles::with_config(&configured).expect("valid");
        assert_eq!(roles.prompt(Some("analyst")), "Count carefully.");
        assert!(roles.prompt(Some("critic")).contains("critic"));
        assert!(roles.prompt(Some("archivist")).contains("archivist"));
        assert_eq!(roles.prompt(None), GENERIC_PROMPT);
        for r in [
            "planner",
            "researcher",
            "analyst",
            "writer",
            "critic",
            "synthesis",
        ] {
            assert!(roles.names().contains(&r));
        }
        configured.insert("empty".into(), RoleConfig { prompt: " ".into() });
        let e = Roles::with_config(&configured).expect_err("empty prompt");
        assert_eq!(e.to_string(), "roles.empty: the prompt is empty");
    }
}
