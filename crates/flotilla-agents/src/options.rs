//! `[agents-protocol]` in `flotilla.toml`: which agents speak the NATS Agent Protocol, under
//! which owner, and how often they beat.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Settings of the NATS Agent Protocol.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct AgentsProtocolOptions {
    /// Expose every agent definition, not only those with `expose = true`. Off by default:
    /// whoever can publish to `agents.prompt.…` on this NATS can start runs of an exposed
    /// agent, so each one is a choice.
    pub expose_all: bool,
    /// Expose every persistent teammate (served by the supervisors), not only those spawned
    /// with `expose`. Off by default, for the same reason as `expose-all`: a prompt is a
    /// message to the teammate and costs a turn.
    pub expose_teammates: bool,
    /// The `owner` token of the exposed agents (`[a-z0-9_-]+`). Default: the deployment's
    /// NATS prefix, so two deployments on one NATS never answer each other's prompts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// The `session` token of the exposed agents. Default `default`, the protocol's name for
    /// an agent that serves no particular session.
    pub session: String,
    /// How often each exposed agent beats (`agents.hb.…`). Default 30 s, the protocol's
    /// recommendation; callers count an agent alive for three intervals.
    #[serde(with = "humantime_serde")]
    pub heartbeat: Duration,
    /// How often a running prompt's stream carries a keep-alive `ack`, which also tells
    /// whether the caller still listens (a caller that went away cancels the run). Default
    /// 15 s: well inside the 60 s inactivity timeout callers use by default.
    #[serde(with = "humantime_serde")]
    pub keepalive: Duration,
    /// Longest a prompt's run may take before it is cancelled and the caller gets an error.
    /// Default 30 min.
    #[serde(with = "humantime_serde")]
    pub prompt_timeout: Duration,
    /// The worker pool a prompt's task goes to. Default `default`.
    pub pool: String,
}

impl Default for AgentsProtocolOptions {
    fn default() -> Self {
        Self {
            expose_all: false,
            expose_teammates: false,
            owner: None,
            session: crate::wire::DEFAULT_SESSION.to_owned(),
            heartbeat: Duration::from_secs(crate::wire::DEFAULT_HEARTBEAT_SECS),
            keepalive: Duration::from_secs(15),
            prompt_timeout: Duration::from_secs(30 * 60),
            pool: flotilla_model::plan::DEFAULT_POOL.to_owned(),
        }
    }
}

impl AgentsProtocolOptions {
    /// Checks tokens and durations without I/O; the error names the key.
    pub fn validate(&self) -> Result<(), String> {
        let owner = self.owner.as_deref().unwrap_or("flotilla");
        crate::wire::AgentAddress::new("x", owner, &self.session).map_err(|e| e.to_string())?;
        if self.heartbeat < Duration::from_secs(1) {
            return Err("heartbeat must be at least 1s (the protocol counts whole seconds)".into());
        }
        if self.keepalive.is_zero() {
            return Err("keepalive must be more than 0s".into());
        }
        if self.prompt_timeout.is_zero() {
            return Err("prompt-timeout must be more than 0s".into());
        }
        flotilla_model::token::check_name(&self.pool)
            .map_err(|e| format!("pool {:?} {e}", self.pool))?;
        Ok(())
    }

    /// The owner token: the configured one, or the prefix made a token (lowercase,
    /// characters outside `[a-z0-9_-]` as `-`).
    pub fn owner_for(&self, prefix: &str) -> String {
        self.owner.clone().unwrap_or_else(|| {
            prefix
                .to_ascii_lowercase()
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                        c
                    } else {
                        '-'
                    }
                })
                .collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_tokens_are_named() {
        let o = AgentsProtocolOptions::default();
        assert_eq!(o.validate(), Ok(()));
        assert_eq!(o.owner_for("Acme.Prod"), "acme-prod");
        let bad = AgentsProtocolOptions {
            owner: Some("Has Space".into()),
            ..o.clone()
        };
        assert!(bad.validate().unwrap_err().contains("owner"));
        let bad = AgentsProtocolOptions {
            heartbeat: Duration::from_millis(10),
            ..o
        };
        assert!(bad.validate().unwrap_err().contains("heartbeat"));
    }
}
