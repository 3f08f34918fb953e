//! The `scripted` agent: deterministic replies, delays and failures for tests and demos.
//! It never calls a model; it exists to exercise Flotilla's machinery.

use futures::future::BoxFuture;

use super::ScriptedConfig;
use crate::agent::{Agent, AgentContext, AgentError, AgentReply};
use flotilla_model::task::TaskEnvelope;

/// A deterministic agent.
#[derive(Debug, Clone)]
pub struct ScriptedAgent {
    config: ScriptedConfig,
}

impl ScriptedAgent {
    /// An agent with this script.
    pub fn new(config: ScriptedConfig) -> Self {
        Self { config }
    }

    fn render(&self, task: &TaskEnvelope) -> String {
        let ids = |m: &std::collections::BTreeMap<flotilla_model::TaskId, _>| {
            m.keys()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        let numbers = task
            .dependency_results
            .iter()
            .map(|(id, r)| match r.numeric_value {
                Some(v) => format!("{id}={v}"),
                None => format!("{id}=none"),
            })
            .collect::<Vec<_>>()
            .join(",");
        self.config
            .reply
            .replace("{task_id}", task.task_id.as_str())
            .replace("{run_id}", &task.run_id.to_string())
            .replace("{attempt}", &task.attempt.to_string())
            .replace("{description}", &task.description)
            .replace("{input}", &task.input.to_string())
            .replace("{dependencies}", &ids(&task.dependency_results))
            .replace("{previous}", &ids(&task.previous_results))
            .replace("{dependency_numbers}", &numbers)
    }
}

impl Agent for ScriptedAgent {
    fn run<'a>(
        &'a self,
        task: &'a TaskEnvelope,
        ctx: AgentContext,
    ) -> BoxFuture<'a, Result<AgentReply, AgentError>> {
        Box::pin(async move {
            if !self.config.delay.is_zero() {
                tokio::select! {
                    _ = tokio::time::sleep(self.config.delay) => {}
                    _ = ctx.cancel.cancelled() => return Err(AgentError::cancelled("cancelled")),
                }
            }
            if task.attempt <= self.config.fail_first {
                return Err(AgentError::failed(format!(
                    "{} (attempt {})",
                    self.config.failure, task.attempt
                )));
            }
            Ok(AgentReply {
                response: self.render(task),
                tokens: self.config.tokens,
                tools_used: Vec::new(),
                numeric_value: None,
                confidence: None,
            })
        })
    }
}
