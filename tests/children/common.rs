//! What the child-run tests (`children.rs`, `children_views.rs`) share: the small Rust agents
//! that call others as child runs, the services that run them beside the `scripted` agents,
//! and a request to the API.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use flotilla_context::{Agent, AgentContext, AgentError, AgentReply, ChildCall};
use flotilla_model::event::Event;
use flotilla_model::run::RunStatus;
use flotilla_worker::{AgentRegistry, WorkerOptions};
use futures::future::BoxFuture;
use serde_json::json;

use crate::support::{InProcess, WAIT, root, scripted};

/// Calls the agent named in its input (`{"agent", "produces"}`) as a child run and answers
/// with the child's final response.
#[derive(Debug)]
struct Caller;

impl Agent for Caller {
    fn run<'a>(
        &'a self,
        task: &'a flotilla_model::task::TaskEnvelope,
        ctx: AgentContext,
    ) -> BoxFuture<'a, Result<AgentReply, AgentError>> {
        Box::pin(async move {
            let call = ChildCall {
                agent: task.input["agent"].as_str().unwrap_or("echo").to_owned(),
                description: "look it up".into(),
                input: json!({"q": task.description}),
                produces: task.input["produces"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|v| v.as_str())
                            .map(str::to_owned)
                            .collect()
                    })
                    .unwrap_or_default(),
                ..ChildCall::default()
            };
            let (child, outcome) = ctx
                .call_agent(&call)
                .await
                .map_err(|e| AgentError::failed(e.to_string()))?;
            if outcome.status != RunStatus::Succeeded {
                return Err(AgentError::failed(format!(
                    "child {} ended {}",
                    child.handle.run_id,
                    outcome.status.as_str()
                )));
            }
            let answer = outcome.final_result.map(|r| r.response).unwrap_or_default();
            Ok(AgentReply::text(format!("child said: {answer}")))
        })
    }
}

/// Starts a slow child (`pause`), then a quick one (`echo`), and waits for both: the quick
/// child ends while the slow one still runs.
#[derive(Debug)]
struct SlowThenQuick;

impl Agent for SlowThenQuick {
    fn run<'a>(
        &'a self,
        _task: &'a flotilla_model::task::TaskEnvelope,
        ctx: AgentContext,
    ) -> BoxFuture<'a, Result<AgentReply, AgentError>> {
        Box::pin(async move {
            let failed = |e: flotilla_context::ContextError| AgentError::failed(e.to_string());
            let mut started = Vec::new();
            for agent in ["pause", "echo"] {
                let call = ChildCall {
                    agent: agent.into(),
                    call_id: Some(agent.into()),
                    ..ChildCall::default()
                };
                let child = ctx.clients().start_child(&call).await.map_err(failed)?;
                ctx.clients().announce_child(&child.handle, agent).await;
                started.push(child.handle.run_id);
            }
            let until = tokio::time::Instant::now() + WAIT;
            for child in started {
                ctx.clients()
                    .wait_child(child, until)
                    .await
                    .map_err(failed)?;
            }
            Ok(AgentReply::text("both done"))
        })
    }
}

/// Reports model usage (a deterministic stand-in for a model call: no model is called), then,
/// while `input.depth` > 0, calls itself one level deeper and answers with the child's answer.
#[derive(Debug)]
struct Nested;

impl Agent for Nested {
    fn run<'a>(
        &'a self,
        task: &'a flotilla_model::task::TaskEnvelope,
        ctx: AgentContext,
    ) -> BoxFuture<'a, Result<AgentReply, AgentError>> {
        Box::pin(async move {
            let depth = task.input["depth"].as_u64().unwrap_or(0);
            ctx.events
                .emit(Event::Usage {
                    prompt_tokens: 100 * (depth + 1),
                    completion_tokens: 10,
                    model: Some("stand-in".into()),
                    latency_ms: None,
                    cost_usd: Some(0.5),
                })
                .await;
            if depth == 0 {
                return Ok(AgentReply::text("leaf"));
            }
            let call = ChildCall {
                agent: "nested".into(),
                input: json!({ "depth": depth - 1 }),
                call_id: Some(format!("level{depth}")),
                ..ChildCall::default()
            };
            let (_, outcome) = ctx
                .call_agent(&call)
                .await
                .map_err(|e| AgentError::failed(e.to_string()))?;
            let answer = outcome.final_result.map(|r| r.response).unwrap_or_default();
            Ok(AgentReply::text(format!("{depth}/{answer}")))
        })
    }
}

pub(crate) async fn services() -> anyhow::Result<InProcess> {
    services_with(4).await
}

/// The services with one worker of `concurrency` slots running the agents of this file.
pub(crate) async fn services_with(concurrency: usize) -> anyhow::Result<InProcess> {
    let mut defs = BTreeMap::new();
    defs.insert("echo".to_string(), scripted("{task_id}: found it"));
    let mut pause = scripted("{task_id}: paused");
    if let flotilla_worker::AgentDefinition::Scripted(c) = &mut pause {
        c.delay = Duration::from_secs(3);
    }
    defs.insert("pause".to_string(), pause);
    defs.insert("slow_then_quick".to_string(), scripted("unused"));
    defs.insert("nested".to_string(), scripted("unused"));
    let mut slow = scripted("{task_id}: slow");
    if let flotilla_worker::AgentDefinition::Scripted(c) = &mut slow {
        c.delay = Duration::from_secs(30);
    }
    defs.insert("slow".to_string(), slow);
    // Named here for validation; the worker below runs the Rust agent.
    defs.insert("caller".to_string(), scripted("unused"));
    let mut f = InProcess::start(0, defs).await?;
    let mut registry = AgentRegistry::from_definitions(&f.agents, None, &root().join("config"))
        .map_err(anyhow::Error::msg)?;
    registry.insert("caller", Arc::new(Caller));
    registry.insert("slow_then_quick", Arc::new(SlowThenQuick));
    registry.insert("nested", Arc::new(Nested));
    let opts = WorkerOptions {
        started_event_delay: Duration::ZERO,
        concurrency,
        ..WorkerOptions::default()
    };
    f.add_worker_with_registry(opts, registry).await?;
    Ok(f)
}

/// Asks the API and returns the reply body and the error code (if it is an error).
pub(crate) async fn api(
    f: &InProcess,
    endpoint: &str,
    body: serde_json::Value,
) -> anyhow::Result<(serde_json::Value, Option<String>)> {
    let reply = f
        .bus
        .client()
        .request(
            f.bus.names().api(endpoint),
            serde_json::to_vec(&body)?.into(),
        )
        .await?;
    let value: serde_json::Value = serde_json::from_slice(&reply.payload)?;
    let failed = reply
        .headers
        .as_ref()
        .is_some_and(|h| h.get("Nats-Service-Error-Code").is_some());
    let code = failed.then(|| value["code"].as_str().unwrap_or_default().to_owned());
    Ok((value, code))
}
