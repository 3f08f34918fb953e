//! The LLM agent: one attempt is a conversation with the model.
//!
//! ```text
//! system (role + instruction) ─┐
//! user (task template)        ─┴► model ──tool calls──► tools run concurrently ──results──┐
//!                                   ▲                    (tool_start / tool_end events)    │
//!                                   └──────────────────────────────────────────────────────┘
//!                                   │ text (after at most max-tool-rounds rounds)
//!                                   ▼
//!                   output_schema? ──invalid──► one repair turn ──still invalid──► invalid_output
//!                                   │ valid / no schema
//!                                   ▼
//!                             the task's response
//! ```
//!
//! Every model call publishes `assistant_reply` events — increments coalesced about every
//! 100 ms, then the whole text of the turn with `final: true` — and a `usage` event (tokens,
//! model, latency, cost when the agent has a price). The reply's `tokens` is the sum of
//! prompt and completion tokens over all calls of the attempt. When the run has a budget,
//! every call is reserved first ([`crate::budget`]); a call that could pass it is not made
//! and the task fails with `budget_exhausted` — or, when the run's policy says to ask, the
//! attempt waits for a person to extend the budget (trigger `budget`). A call estimated above
//! the policy's cost limit waits for approval before it is made (trigger `cost`). Every model reply and tool round is journaled
//! ([`crate::journal`]), so a redelivered attempt resumes instead of paying again.
//!
//! **Transfers.** `transfer_to_agent` hands the conversation to another agent as a child run
//! whose answer is this task's. The child's input carries the chain of agents the
//! conversation went through since the user's message (`transfer_chain`); a transfer to an
//! agent already in it would loop, so it is refused before any child starts, with the tool
//! result `{"error": {"code": "transfer_loop", …}}` for the model to read — as is a child run
//! the coordinator rejects (`tree_too_deep`, `tree_too_large`, …). Either way the model
//! continues (answering itself, or choosing another agent); an attempt that gives up after
//! such a refusal fails with `child_rejected`, which is not retried, so a runaway tree is not
//! started again under a new attempt.
//!
//! **Traces.** While spans are exported, each model call is a `chat {model}` span (GenAI
//! conventions, with the token usage) and each tool call an `execute_tool {tool}` span, both
//! children of the worker's `invoke_agent`; a child run started by a tool joins the trace
//! under its `execute_tool` span. Without export no span is built.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_openai::types::chat::{
    ChatCompletionMessageToolCall, ChatCompletionMessageToolCalls,
    ChatCompletionRequestAssistantMessage, ChatCompletionRequestAssistantMessageContent,
    ChatCompletionRequestMessage, ChatCompletionRequestSystemMessage,
    ChatCompletionRequestSystemMessageContent, ChatCompletionRequestToolMessage,
    ChatCompletionRequestToolMessageContent, ChatCompletionRequestUserMessage,
    ChatCompletionRequestUserMessageContent, ChatCompletionStreamOptions, ChatCompletionTool,
    ChatCompletionToolChoiceOption, ChatCompletionTools, CreateChatCompletionRequest, FunctionCall,
    FunctionObject, ResponseFormat, ResponseFormatJsonSchema, ToolChoiceOptions,
};
use flotilla_context::{Agent, AgentContext, AgentError, AgentReply, EventEmitter};
use flotilla_model::event::Event;
use flotilla_model::task::{TaskEnvelope, TaskErrorKind};
use flotilla_telemetry::spans;
use futures::future::BoxFuture;
use serde_json::Value;
use tokio::sync::mpsc;
use tracing::Instrument;

use flotilla_model::approval::{Decision, Trigger};

use crate::budget::BudgetGuard;
use crate::config::{ConfigError, LlmConfig, ToolChoice};
use crate::gate;
use crate::journal::Journal;
use crate::prompt;
use crate::provider::{CallError, Completion, KeySource, Provider, Providers, ToolCallRequest};
use crate::ratelimit::{RateLimit, TenantModelQuotas};
use crate::roles::Roles;
use crate::tools::{ToolOutcome, ToolSet};

/// How often streamed text is published, at most.
pub const DELTA_INTERVAL: Duration = Duration::from_millis(100);

/// The name of the structured-output schema sent in `response_format`.
const SCHEMA_NAME: &str = "task_output";

/// An agent answering tasks with an OpenAI-compatible model.
pub struct LlmAgent {
    name: String,
    config: LlmConfig,
    roles: Arc<Roles>,
    provider: Provider,
    tools: ToolSet,
    /// Agents `transfer_to_agent` may hand the conversation to (from the agent tree).
    transfer_targets: Vec<String>,
    /// The installation's model quotas, as last read.
    tenant_quotas: TenantModelQuotas,
}

impl fmt::Debug for LlmAgent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LlmAgent")
            .field("name", &self.name)
            .field("config", &self.config)
            .field(
                "tools",
                &self.tools.tools().map(|t| &t.name).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl LlmAgent {
    /// Builds agent `name` from `config` (validated here). `providers` holds the worker's
    /// per-provider request caps; `base_dir` resolves relative paths (the config file's
    /// directory). The API key is not read here but at each model call, so processes that
    /// only validate the configuration (a coordinator, `flotilla submit`) need no key.
    pub fn new(
        name: &str,
        config: &LlmConfig,
        roles: Arc<Roles>,
        providers: &Providers,
        base_dir: &Path,
    ) -> Result<Self, ConfigError> {
        config.validate(name)?;
        let key = match (&config.api_key_env, &config.api_key_file) {
            (Some(var), _) => KeySource::Env(var.clone()),
            (None, Some(p)) if p.is_absolute() => KeySource::File(p.clone()),
            (None, Some(p)) => KeySource::File(base_dir.join(p)),
            (None, None) => KeySource::None,
        };
        Ok(Self {
            name: name.to_owned(),
            tools: ToolSet::from_config(name, config, base_dir)?,
            provider: Provider::new(config, key, providers),
            config: config.clone(),
            roles,
            transfer_targets: Vec::new(),
            tenant_quotas: TenantModelQuotas::default(),
        })
    }

    /// Lets the model hand the conversation to `targets` (`transfer_to_agent`): the agent
    /// tree's parent, sub-agents and peers of this agent, as the registry that builds it
    /// computes them (ADK's scope rules, with `disallow-transfer-to-parent` / `-peers`).
    pub fn with_transfer_targets(mut self, targets: Vec<String>) -> Self {
        self.tools = std::mem::take(&mut self.tools).with_transfer(&targets);
        self.transfer_targets = targets;
        self
    }

    /// The agents this one may transfer to.
    pub fn transfer_targets(&self) -> &[String] {
        &self.transfer_targets
    }

    /// Hands the conversation so far to `target` as a child run; its answer is this task's.
    /// A transfer that would loop, or whose child the coordinator rejects, is refused: the
    /// model gets the error as the call's result and the conversation goes on here.
    #[allow(clippy::too_many_arguments)]
    async fn transfer(
        &self,
        task: &TaskEnvelope,
        ctx: &AgentContext,
        messages: &[ChatCompletionRequestMessage],
        call: &ToolCallRequest,
        target: String,
        reason: String,
        tokens: u64,
    ) -> Handover {
        let input = serde_json::from_str::<Value>(&call.arguments).unwrap_or(Value::Null);
        ctx.events
            .emit(Event::ToolStart {
                call_id: call.id.clone(),
                tool: call.name.clone(),
                input,
            })
            .await;
        let started = Instant::now();
        let span = spans::execute_tool(&call.name, &call.id);
        let mut chain = transfer_chain(task);
        let (run_link, handover) = if target == self.name || chain.contains(&target) {
            chain.push(self.name.clone());
            let outcome = ToolOutcome::err(
                "transfer_loop",
                format!(
                    "the conversation already went through {target} since the user's message ({} → {target}); transferring it there again would loop. Answer the user yourself, or transfer to an agent it has not been to.",
                    chain.join(" → ")
                ),
            );
            (None, Handover::Refused(outcome))
        } else {
            chain.push(self.name.clone());
            let child_call = flotilla_context::ChildCall {
                agent: target.clone(),
                description: task.description.clone(),
                input: serde_json::json!({
                    "transferred_from": self.name,
                    "reason": reason,
                    "conversation": conversation(messages),
                    "transfer_chain": chain,
                    "input": original_input(task),
                }),
                call_id: Some(crate::call::child_call_key(&call.id)),
                ..flotilla_context::ChildCall::default()
            };
            match ctx.call_agent(&child_call).instrument(span.clone()).await {
                Err(e) if e.kind() == flotilla_context::ErrorKind::ChildRejected => {
                    let outcome = ToolOutcome::rejected(&e);
                    (outcome.run_link.clone(), Handover::Refused(outcome))
                }
                Err(e) => (
                    None,
                    Handover::Done(Err(AgentError::failed(format!(
                        "agent {}: transferring to {target}: {e}",
                        self.name
                    )))),
                ),
                Ok((child, outcome)) => {
                    let kind = flotilla_context::binding_failure(&outcome);
                    let reply = match (&outcome.status, outcome.final_result) {
                        (flotilla_model::run::RunStatus::Succeeded, Some(f)) => Ok(AgentReply {
                            response: f.response,
                            tokens,
                            tools_used: vec![call.name.clone()],
                            numeric_value: f.numeric_value,
                            confidence: None,
                        }),
                        (status, _) => Err(AgentError {
                            // A spent tree budget stays `budget_exhausted` up the chain.
                            kind: kind.unwrap_or(TaskErrorKind::AgentFailed),
                            message: format!(
                                "agent {}: the conversation went to {target} (child run {}), which ended {status:?}",
                                self.name, child.handle.run_id
                            ),
                        }),
                    };
                    (Some(child.handle), Handover::Done(reply))
                }
            }
        };
        let (ok, output, error) = match &handover {
            Handover::Done(Ok(r)) => (
                true,
                serde_json::json!({"agent": target, "response": r.response}),
                None,
            ),
            Handover::Done(Err(e)) => (
                false,
                serde_json::json!({"error": e.message}),
                Some(e.message.clone()),
            ),
            Handover::Refused(o) => (false, o.output.clone(), o.error.clone()),
        };
        if !ok {
            spans::failed(
                &span,
                match &handover {
                    Handover::Refused(o) => o.output["error"]["code"].as_str().unwrap_or("refused"),
                    _ => "agent_failed",
                },
            );
        }
        ctx.events
            .emit(Event::ToolEnd {
                call_id: call.id.clone(),
                ok,
                output,
                run_link,
                tool: Some(call.name.clone()),
                duration_ms: Some(started.elapsed().as_millis() as u64),
                error,
            })
            .await;
        handover
    }

    /// The system prompt: the role's, then the instruction with placeholders filled.
    async fn system_prompt(
        &self,
        task: &TaskEnvelope,
        ctx: &AgentContext,
    ) -> Result<String, AgentError> {
        let mut system = self.roles.prompt(task.role.as_deref());
        if let Some(instruction) = self.config.instruction.as_deref() {
            let keys = prompt::placeholders(instruction);
            let mut values = HashMap::new();
            let mut missing = Vec::new();
            for (key, optional) in keys {
                if values.contains_key(key) {
                    continue;
                }
                let value = ctx.state().get(key).await.map_err(|e| {
                    AgentError::failed(format!(
                        "reading session state {key:?} for the instruction: {e}"
                    ))
                })?;
                match value {
                    Some(v) => {
                        values.insert(
                            key,
                            match v.value {
                                Value::String(s) => s,
                                other => other.to_string(),
                            },
                        );
                    }
                    None if optional => {
                        values.insert(key, String::new());
                    }
                    None => missing.push(key),
                }
            }
            if !missing.is_empty() {
                return Err(AgentError {
                    kind: TaskErrorKind::MissingStateKey,
                    message: format!(
                        "the instruction of agent {} needs session-state key(s) {}, which are not set; write {{key?}} for an optional value",
                        self.name,
                        missing.join(", ")
                    ),
                });
            }
            system.push_str("\n\n");
            system.push_str(&prompt::fill(instruction, &values));
        }
        Ok(system)
    }

    /// The model the attempt calls: the task's (a fork or plan that tries another model),
    /// else the agent's.
    fn model<'a>(&'a self, task: &'a TaskEnvelope) -> &'a str {
        task.model.as_deref().unwrap_or(&self.config.model)
    }

    fn request(
        &self,
        task: &TaskEnvelope,
        tools: &ToolSet,
        messages: &[ChatCompletionRequestMessage],
        tools_allowed: bool,
        schema: Option<&Value>,
    ) -> CreateChatCompletionRequest {
        let mut r = CreateChatCompletionRequest {
            model: self.model(task).to_owned(),
            messages: messages.to_vec(),
            temperature: self.config.temperature,
            max_completion_tokens: self.config.max_output_tokens,
            ..Default::default()
        };
        if self.config.stream {
            r.stream_options = Some(ChatCompletionStreamOptions {
                include_usage: Some(true),
                include_obfuscation: None,
            });
        }
        if !tools.is_empty() {
            r.tools = Some(
                tools
                    .tools()
                    .map(|t| {
                        ChatCompletionTools::Function(ChatCompletionTool {
                            function: FunctionObject {
                                name: t.name.clone(),
                                description: (!t.description.is_empty())
                                    .then(|| t.description.clone()),
                                parameters: Some(t.parameters.clone()),
                                strict: None,
                            },
                        })
                    })
                    .collect(),
            );
            if !tools_allowed {
                // The rounds are spent: the model must answer now.
                r.tool_choice = Some(ChatCompletionToolChoiceOption::Mode(
                    ToolChoiceOptions::None,
                ));
            } else if self.config.tool_choice == ToolChoice::Required {
                r.tool_choice = Some(ChatCompletionToolChoiceOption::Mode(
                    ToolChoiceOptions::Required,
                ));
            }
        }
        if let Some(schema) = schema {
            r.response_format = Some(ResponseFormat::JsonSchema {
                json_schema: ResponseFormatJsonSchema {
                    description: None,
                    name: SCHEMA_NAME.into(),
                    schema: schema.clone(),
                    strict: None,
                },
            });
        }
        r
    }

    /// One model call with its events, within the run's budget, the provider's shared rate
    /// limit and the tenant's model quotas (`limits`).
    #[allow(clippy::too_many_arguments)]
    async fn call(
        &self,
        request: &CreateChatCompletionRequest,
        task: &TaskEnvelope,
        ctx: &AgentContext,
        step: u32,
        budget: Option<&BudgetGuard>,
        limits: &[RateLimit],
    ) -> Result<Completion, AgentError> {
        let cost_limit = task
            .tool_gate
            .as_ref()
            .and_then(|g| g.cost_limit)
            .zip(self.config.price);
        let (prompt_estimate, max_output) =
            if budget.is_some() || !limits.is_empty() || cost_limit.is_some() {
                (
                    estimate_prompt_tokens(request),
                    self.config.max_output_tokens.map_or(0, u64::from),
                )
            } else {
                (0, 0)
            };
        if let Some((limit_usd, price)) = cost_limit {
            self.check_cost(
                task,
                ctx,
                step,
                limit_usd,
                price.cost(prompt_estimate, max_output),
            )?;
        }
        let reservation = match budget {
            None => None,
            Some(b) => {
                Some(Box::pin(self.reserve(b, task, ctx, step, prompt_estimate, max_output)).await?)
            }
        };
        let estimate = prompt_estimate + max_output;
        let span = spans::chat(
            self.model(task),
            self.config.provider.as_deref().unwrap_or("openai"),
            self.config.max_output_tokens,
        );
        let result = self
            .call_model(request, ctx, limits, estimate)
            .instrument(span.clone())
            .await;
        match &result {
            Ok(c) => spans::chat_answered(&span, &c.model, c.prompt_tokens, c.completion_tokens),
            Err(e) => spans::failed(&span, e.kind.as_str()),
        }
        if let Ok(c) = &result {
            for l in limits {
                Box::pin(
                    l.charge((c.prompt_tokens + c.completion_tokens).saturating_sub(estimate)),
                )
                .await;
            }
        }
        if let (Some(b), Some(r)) = (budget, reservation) {
            match &result {
                Ok(c) => {
                    Box::pin(b.settle(r, c.prompt_tokens, c.completion_tokens)).await?;
                }
                Err(_) => Box::pin(b.release(r)).await,
            }
        }
        let completion = result?;
        Box::pin(
            ctx.events.emit(Event::Usage {
                prompt_tokens: completion.prompt_tokens,
                completion_tokens: completion.completion_tokens,
                model: Some(completion.model.clone()),
                latency_ms: Some(completion.latency.as_millis() as u64),
                cost_usd: self
                    .config
                    .price
                    .map(|p| p.cost(completion.prompt_tokens, completion.completion_tokens)),
            }),
        )
        .await;
        Ok(completion)
    }

    /// A call estimated above the run's cost limit (`[hitl] cost-limit`) is made only once a
    /// person approved it (trigger `cost`): the attempt suspends until then.
    fn check_cost(
        &self,
        task: &TaskEnvelope,
        ctx: &AgentContext,
        step: u32,
        limit_usd: f64,
        estimate_usd: f64,
    ) -> Result<(), AgentError> {
        if estimate_usd <= limit_usd {
            return Ok(());
        }
        // The person sees the estimate; the decision is bound to the call (agent, model, limit
        // and step), which is the same on every delivery even if the prompt's estimate is not.
        let shown = serde_json::json!({
            "agent": self.name,
            "model": self.model(task),
            "estimated_cost_usd": (estimate_usd * 1e6).round() / 1e6,
            "cost_limit_usd": limit_usd,
        });
        let bound = serde_json::json!({
            "agent": self.name,
            "model": self.model(task),
            "cost_limit_usd": limit_usd,
        });
        let decided = gate::decision_at_step(
            task,
            ctx,
            (Trigger::Cost, step, gate::MODEL_CALL),
            shown,
            &bound,
        )?;
        match &decided.decision {
            Decision::Approve | Decision::Edit { .. } => Ok(()),
            Decision::Reject { message } | Decision::Respond { result: message } => {
                Err(AgentError {
                    kind: TaskErrorKind::CallDeclined,
                    message: format!(
                        "agent {}: {} declined a model call estimated at ${estimate_usd:.4} (above the cost limit of ${limit_usd}){}",
                        self.name,
                        decided.by,
                        if message.is_empty() {
                            String::new()
                        } else {
                            format!(": {message}")
                        }
                    ),
                })
            }
        }
    }

    /// Reserves the call on the run's budgets. A call that would pass one fails the task
    /// `budget_exhausted` — or, under `[hitl] on-budget-exhausted = "ask"`, suspends the
    /// attempt until a person decides (trigger `budget`): approve extends that budget by its
    /// own limits (`edit` with `{"max_tokens": N, "max_cost": X}` by those amounts), once
    /// per decision however often the attempt is delivered, and the call is reserved again;
    /// reject fails it as without asking.
    async fn reserve(
        &self,
        budget: &BudgetGuard,
        task: &TaskEnvelope,
        ctx: &AgentContext,
        step: u32,
        prompt_estimate: u64,
        max_output: u64,
    ) -> Result<crate::budget::Reservation, AgentError> {
        let refusal = match budget.reserve(prompt_estimate, max_output).await {
            Ok(r) => return Ok(r),
            Err(r) => r,
        };
        // Only a spent budget is a person's to extend; a budget that could not be read is an
        // ordinary failure (retried).
        let ask = task.tool_gate.as_ref().is_some_and(|g| g.budget_ask)
            && refusal.error.kind == TaskErrorKind::BudgetExhausted;
        let Some(run) = refusal.run.filter(|_| ask) else {
            return Err(refusal.error);
        };
        let limits = refusal.limits;
        // Bound to the budget (its run and limits) and the step, not to what was spent (which
        // changes as the tree spends): the same on every delivery.
        let arguments = serde_json::json!({
            "run_id": run,
            "max_tokens": limits.max_tokens,
            "max_cost": limits.max_cost,
        });
        let decided = gate::decision_at_step(
            task,
            ctx,
            (Trigger::Budget, step, gate::EXTEND_BUDGET),
            arguments.clone(),
            &arguments,
        )?;
        let (tokens, cost) = match &decided.decision {
            Decision::Approve => (
                limits.max_tokens.unwrap_or(0),
                limits.max_cost.unwrap_or(0.0),
            ),
            Decision::Edit { input } => match extension_of(input) {
                Ok(amounts) => amounts,
                Err(why) => {
                    let mut error = refusal.error;
                    error.message = format!(
                        "{}; {} answered with an extension that is not one: {why}",
                        error.message, decided.by
                    );
                    return Err(error);
                }
            },
            Decision::Reject { message } | Decision::Respond { result: message } => {
                let mut error = refusal.error;
                error.message = format!(
                    "{}; {} declined to extend the budget{}",
                    error.message,
                    decided.by,
                    if message.is_empty() {
                        String::new()
                    } else {
                        format!(": {message}")
                    }
                );
                return Err(error);
            }
        };
        // Approval ids are a run's own; the budget may be an ancestor's, shared by the tree.
        budget
            .extend(
                run,
                &format!("{}.{}", task.run_id, decided.approval_id),
                tokens,
                cost,
            )
            .await?;
        budget
            .reserve(prompt_estimate, max_output)
            .await
            .map_err(|r| {
                let mut error = r.error;
                error.message = format!(
                    "{} (after {} extended the budget by {tokens} tokens and ${cost})",
                    error.message, decided.by
                );
                error
            })
    }

    async fn call_model(
        &self,
        request: &CreateChatCompletionRequest,
        ctx: &AgentContext,
        limits: &[RateLimit],
        estimate: u64,
    ) -> Result<Completion, AgentError> {
        let (tx, rx) = mpsc::unbounded_channel::<String>();
        let deadline = tokio::time::Instant::from_std(ctx.deadline);
        let call = async {
            let mut on_delta = move |t: &str| {
                let _ = tx.send(t.to_owned());
            };
            let r = self
                .provider
                .complete(
                    request,
                    &mut on_delta,
                    &ctx.cancel,
                    deadline,
                    limits,
                    estimate,
                )
                .await;
            drop(on_delta);
            r
        };
        let (result, ()) = tokio::join!(call, publish_deltas(ctx.events.clone(), rx));
        let completion = result.map_err(|e| match e {
            CallError::Cancelled => AgentError::cancelled("cancelled during a model call"),
            CallError::GaveUp(m) | CallError::Rejected(m) => AgentError::failed(format!(
                "agent {}: model call to {} failed: {m}",
                self.name, self.config.base_url
            )),
        })?;
        if !completion.content.is_empty() {
            Box::pin(ctx.events.emit(Event::AssistantReply {
                text: completion.content.clone(),
                is_final: true,
            }))
            .await;
        }
        Ok(completion)
    }

    /// Runs the calls of one round concurrently, with their events; results in call order,
    /// and whether one was refused for good (a rejected child run).
    async fn run_tools(
        &self,
        tools: &ToolSet,
        calls: &[ToolCallRequest],
        ctx: &AgentContext,
    ) -> Result<(Vec<String>, bool), AgentError> {
        let runs = calls.iter().map(|call| async move {
            emit_tool_start(ctx, call).await;
            let started = Instant::now();
            let span = spans::execute_tool(&call.name, &call.id);
            let outcome = tools
                .call(ctx, &call.id, &call.name, &call.arguments)
                .instrument(span.clone())
                .await;
            if let Some(e) = &outcome.error {
                spans::failed(
                    &span,
                    outcome.output["error"]["code"].as_str().unwrap_or("tool_failed"),
                );
                tracing::debug!(agent = %self.name, tool = %call.name, error = %e, "Tool call failed; the model gets the error");
            }
            ctx.events
                .emit(Event::ToolEnd {
                    call_id: call.id.clone(),
                    ok: outcome.error.is_none(),
                    output: outcome.output.clone(),
                    run_link: outcome.run_link.clone(),
                    tool: Some(call.name.clone()),
                    duration_ms: Some(started.elapsed().as_millis() as u64),
                    error: outcome.error.clone(),
                })
                .await;
            (outcome.text(), outcome.refused)
        });
        tokio::select! {
            results = futures::future::join_all(runs) => {
                let refused = results.iter().any(|(_, r)| *r);
                Ok((results.into_iter().map(|(t, _)| t).collect(), refused))
            }
            _ = ctx.cancel.cancelled() => Err(AgentError::cancelled("cancelled during tool calls")),
        }
    }

    /// Runs a round as planned: the calls to run (with a person's edited arguments where
    /// given), and the results a person gave instead of the others, in the calls' order.
    async fn run_round(
        &self,
        tools: &ToolSet,
        calls: &[ToolCallRequest],
        plan: &[crate::gate::CallPlan],
        ctx: &AgentContext,
    ) -> Result<(Vec<String>, bool), AgentError> {
        use crate::gate::CallPlan;
        let runnable: Vec<ToolCallRequest> = calls
            .iter()
            .zip(plan)
            .filter_map(|(call, p)| match p {
                CallPlan::Run(arguments) => Some(ToolCallRequest {
                    arguments: arguments.clone(),
                    ..call.clone()
                }),
                CallPlan::Answer { .. } => None,
            })
            .collect();
        let (ran, refused) = if runnable.is_empty() {
            (Vec::new(), false)
        } else {
            self.run_tools(tools, &runnable, ctx).await?
        };
        let mut ran = ran.into_iter();
        let mut results = Vec::with_capacity(calls.len());
        for (call, p) in calls.iter().zip(plan) {
            match p {
                CallPlan::Run(_) => results.push(ran.next().unwrap_or_default()),
                CallPlan::Answer { text, ok } => {
                    emit_tool_start(ctx, call).await;
                    ctx.events
                        .emit(Event::ToolEnd {
                            call_id: call.id.clone(),
                            ok: *ok,
                            output: Value::String(text.clone()),
                            run_link: None,
                            tool: Some(call.name.clone()),
                            duration_ms: Some(0),
                            error: (!ok).then(|| text.clone()),
                        })
                        .await;
                    results.push(text.clone());
                }
            }
        }
        Ok((results, refused))
    }

    async fn attempt(
        &self,
        task: &TaskEnvelope,
        ctx: &AgentContext,
    ) -> Result<AgentReply, AgentError> {
        let validator = match &task.output_schema {
            None => None,
            Some(schema) => Some(jsonschema::validator_for(schema).map_err(|e| AgentError {
                kind: TaskErrorKind::BadEnvelope,
                message: format!("the task's output_schema is not a valid JSON Schema: {e}"),
            })?),
        };
        let budget = Box::pin(BudgetGuard::open(ctx, task, self.config.price, &self.name)).await?;
        // Boxed, as every step not live while the model is awaited: a suspended attempt's
        // state is as large as its largest step, thousands at once.
        let tools = Box::pin(self.tools.for_attempt())
            .await
            .map_err(|e| AgentError::failed(format!("agent {}: {e}", self.name)))?
            .with_client_tools(&task.client_tools);
        let mut messages = vec![ChatCompletionRequestMessage::System(
            ChatCompletionRequestSystemMessage {
                content: ChatCompletionRequestSystemMessageContent::Text(
                    Box::pin(self.system_prompt(task, ctx)).await?,
                ),
                name: None,
            },
        )];
        match handed_over(task) {
            // Another agent transferred its conversation here: continue it.
            Some((from, reason, earlier)) => {
                messages.extend(earlier);
                messages.push(user(format!(
                    "{from} handed this conversation to you{}. Continue it: do what was asked, as the agent now in charge.",
                    if reason.is_empty() {
                        String::new()
                    } else {
                        format!(" ({reason})")
                    }
                )));
            }
            None => messages.push(user(prompt::user_message(
                task,
                self.config.max_prompt_chars,
            ))),
        }
        let limits: Vec<RateLimit> = Box::pin(RateLimit::open(ctx, &self.config))
            .await
            .map_err(|e| AgentError::failed(format!("agent {}: {e}", self.name)))?
            .into_iter()
            .chain(Box::pin(self.tenant_quotas.limit(ctx)).await)
            .collect();
        let mut journal = Box::pin(Journal::open(ctx, task, &self.name)).await?;
        let mut tokens = 0u64;
        let mut tools_used: Vec<String> = Vec::new();
        let mut rounds = 0u32;
        let mut repaired = false;
        // A call of this attempt was refused for good (a rejected child, a transfer loop):
        // giving up afterwards is final, not retried with a fresh subtree.
        let mut refused = false;
        loop {
            let tools_allowed = rounds < self.config.max_tool_rounds;
            let c = match journal.replay_model_reply() {
                Some(c) => c,
                None => {
                    // The run is held (paused, taken over): stop at this step boundary; the
                    // attempt continues from its journal when the run resumes.
                    if ctx.held() {
                        return Err(ctx.suspend_held());
                    }
                    let request = self.request(
                        task,
                        &tools,
                        &messages,
                        tools_allowed,
                        task.output_schema.as_ref(),
                    );
                    // Held here and lent down the call: every layer that took it by value
                    // kept its own 700-byte slot in the suspended call's state.
                    let c = self
                        .call(
                            &request,
                            task,
                            ctx,
                            journal.next_step(),
                            budget.as_ref(),
                            &limits,
                        )
                        .await?;
                    Box::pin(journal.record_model_reply(ctx, task, &c)).await;
                    c
                }
            };
            tokens += c.prompt_tokens + c.completion_tokens;
            if !c.tool_calls.is_empty() {
                if !tools_allowed {
                    return Err(AgentError {
                        kind: if refused {
                            TaskErrorKind::ChildRejected
                        } else {
                            TaskErrorKind::AgentFailed
                        },
                        message: format!(
                            "agent {}: the model still called tools after max-tool-rounds ({}) rounds{}",
                            self.name,
                            self.config.max_tool_rounds,
                            if refused {
                                ", after a child run or transfer it asked for was refused"
                            } else {
                                ""
                            }
                        ),
                    });
                }
                rounds += 1;
                for call in &c.tool_calls {
                    if !tools_used.contains(&call.name) {
                        tools_used.push(call.name.clone());
                    }
                }
                messages.push(assistant(&c));
                let transfer = c.tool_calls.iter().enumerate().find_map(|(i, t)| {
                    tools
                        .transfer_target(&t.name, &t.arguments)
                        .map(|x| (i, t, x))
                });
                let results = match journal.replay_tool_results(c.tool_calls.len()) {
                    // An earlier delivery ran this round (a refused transfer, or the tools).
                    Some(r) => {
                        refused |= r.iter().any(|t| is_refusal(t));
                        r
                    }
                    None => match transfer {
                        Some((i, call, (target, reason))) => {
                            match Box::pin(
                                self.transfer(task, ctx, &messages, call, target, reason, tokens),
                            )
                            .await
                            {
                                Handover::Done(reply) => return reply,
                                Handover::Refused(outcome) => {
                                    refused = true;
                                    let r = refused_round(&c.tool_calls, i, &outcome);
                                    Box::pin(journal.record_tool_results(ctx, task, &r)).await;
                                    r
                                }
                            }
                        }
                        None => {
                            // Calls a person must decide first stop the attempt here.
                            let plan =
                                Box::pin(crate::gate::plan_round(&tools, task, ctx, &c.tool_calls))
                                    .await?;
                            let (r, was_refused) =
                                Box::pin(self.run_round(&tools, &c.tool_calls, &plan, ctx)).await?;
                            refused |= was_refused;
                            Box::pin(journal.record_tool_results(ctx, task, &r)).await;
                            r
                        }
                    },
                };
                for (call, result) in c.tool_calls.iter().zip(results) {
                    messages.push(ChatCompletionRequestMessage::Tool(
                        ChatCompletionRequestToolMessage {
                            content: ChatCompletionRequestToolMessageContent::Text(result),
                            tool_call_id: call.id.clone(),
                        },
                    ));
                }
                continue;
            }
            let Some(validator) = &validator else {
                return Ok(AgentReply {
                    response: c.content,
                    tokens,
                    tools_used,
                    numeric_value: None,
                    confidence: None,
                });
            };
            match check_output(validator, &c.content) {
                Ok(value) => {
                    return Ok(AgentReply {
                        response: value.to_string(),
                        tokens,
                        tools_used,
                        numeric_value: None,
                        confidence: None,
                    });
                }
                Err(problem) if !repaired => {
                    repaired = true;
                    tracing::debug!(agent = %self.name, problem = %problem, "The answer does not match the output schema; asking once more");
                    messages.push(assistant(&c));
                    messages.push(user(format!(
                        "Your answer does not match the required JSON Schema: {problem}\nAnswer again with only a JSON value that matches the schema, nothing else."
                    )));
                }
                Err(problem) => {
                    return Err(AgentError {
                        kind: TaskErrorKind::InvalidOutput,
                        message: format!(
                            "agent {}: the answer does not match the task's output_schema, also after one repair: {problem}",
                            self.name
                        ),
                    });
                }
            }
        }
    }
}

impl Agent for LlmAgent {
    fn run<'a>(
        &'a self,
        task: &'a TaskEnvelope,
        ctx: AgentContext,
    ) -> BoxFuture<'a, Result<AgentReply, AgentError>> {
        Box::pin(async move { self.attempt(task, &ctx).await })
    }
}

/// How a transfer ended.
enum Handover {
    /// The target took the conversation: its answer (or failure) is the task's.
    Done(Result<AgentReply, AgentError>),
    /// Refused (a loop, a rejected child): the model reads the outcome and goes on.
    Refused(ToolOutcome),
}

/// The results of a round whose transfer (call `transfer`) was refused: the refusal, and for
/// the round's other calls a note that they did not run (a transfer ends the round).
/// The `tool_start` event of `call`: its arguments as JSON (as text when they are not).
async fn emit_tool_start(ctx: &AgentContext, call: &ToolCallRequest) {
    let input = serde_json::from_str::<Value>(&call.arguments)
        .unwrap_or_else(|_| Value::String(call.arguments.clone()));
    ctx.events
        .emit(Event::ToolStart {
            call_id: call.id.clone(),
            tool: call.name.clone(),
            input,
        })
        .await;
}

fn refused_round(calls: &[ToolCallRequest], transfer: usize, outcome: &ToolOutcome) -> Vec<String> {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            if i == transfer {
                outcome.text()
            } else {
                ToolOutcome::err(
                    "not_run",
                    format!(
                        "{} was not run: transfer_to_agent was called in the same round; call it again if it is still needed",
                        c.name
                    ),
                )
                .text()
            }
        })
        .collect()
}

/// Whether a tool result is a refusal for good (a rejected child's problems, a transfer
/// loop): what a replayed round tells of the calls an earlier delivery made.
fn is_refusal(result: &str) -> bool {
    serde_json::from_str::<Value>(result).is_ok_and(|v| {
        let e = &v["error"];
        e["code"] == "transfer_loop" || e["problems"].as_array().is_some_and(|p| !p.is_empty())
    })
}

/// The agents the conversation went through since the user's message, in order: empty for a
/// task that was not handed over; else what the handing agent passed on (`transfer_chain`),
/// or just that agent for a handover without a chain.
fn transfer_chain(task: &TaskEnvelope) -> Vec<String> {
    let Some(from) = task.input.get("transferred_from").and_then(Value::as_str) else {
        return Vec::new();
    };
    match task.input.get("transfer_chain").and_then(Value::as_array) {
        Some(chain) => chain
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect(),
        None => vec![from.to_owned()],
    }
}

/// The input of the task the conversation started in: a handed-over task's `input.input`
/// (so a chain of transfers does not nest it ever deeper), else the task's own.
fn original_input(task: &TaskEnvelope) -> Value {
    if task.input.get("transferred_from").is_some() {
        task.input.get("input").cloned().unwrap_or(Value::Null)
    } else {
        task.input.clone()
    }
}

/// A request's prompt size in tokens, estimated as a quarter of its characters (messages and
/// tools), rounded up: what a budget reserves for the prompt.
fn estimate_prompt_tokens(request: &CreateChatCompletionRequest) -> u64 {
    let chars = serde_json::to_string(&request.messages).map_or(0, |s| s.chars().count())
        + request
            .tools
            .as_ref()
            .and_then(|t| serde_json::to_string(t).ok())
            .map_or(0, |s| s.chars().count());
    (chars as u64).div_ceil(4)
}

/// The user and assistant texts of a conversation, for the agent it is handed to.
fn conversation(messages: &[ChatCompletionRequestMessage]) -> Value {
    let mut out = Vec::new();
    for m in messages {
        match m {
            ChatCompletionRequestMessage::User(u) => {
                if let ChatCompletionRequestUserMessageContent::Text(t) = &u.content {
                    out.push(serde_json::json!({"role": "user", "content": t}));
                }
            }
            ChatCompletionRequestMessage::Assistant(a) => {
                if let Some(ChatCompletionRequestAssistantMessageContent::Text(t)) = &a.content
                    && !t.is_empty()
                {
                    out.push(serde_json::json!({"role": "assistant", "content": t}));
                }
            }
            _ => {}
        }
    }
    Value::Array(out)
}

/// A conversation handed over by `transfer_to_agent`: who from, why, and its messages.
fn handed_over(task: &TaskEnvelope) -> Option<(String, String, Vec<ChatCompletionRequestMessage>)> {
    let from = task.input.get("transferred_from")?.as_str()?.to_owned();
    let reason = task.input["reason"].as_str().unwrap_or_default().to_owned();
    let earlier = task.input.get("conversation")?.as_array()?;
    let messages = earlier
        .iter()
        .filter_map(|m| {
            let text = m["content"].as_str()?.to_owned();
            Some(match m["role"].as_str()? {
                "assistant" => {
                    ChatCompletionRequestMessage::Assistant(ChatCompletionRequestAssistantMessage {
                        content: Some(ChatCompletionRequestAssistantMessageContent::Text(text)),
                        ..Default::default()
                    })
                }
                _ => user(text),
            })
        })
        .collect();
    Some((from, reason, messages))
}

fn user(text: String) -> ChatCompletionRequestMessage {
    ChatCompletionRequestMessage::User(ChatCompletionRequestUserMessage {
        content: ChatCompletionRequestUserMessageContent::Text(text),
        name: None,
    })
}

/// The model's turn as a message of the conversation.
fn assistant(c: &Completion) -> ChatCompletionRequestMessage {
    ChatCompletionRequestMessage::Assistant(ChatCompletionRequestAssistantMessage {
        content: (!c.content.is_empty())
            .then(|| ChatCompletionRequestAssistantMessageContent::Text(c.content.clone())),
        tool_calls: (!c.tool_calls.is_empty()).then(|| {
            c.tool_calls
                .iter()
                .map(|t| {
                    ChatCompletionMessageToolCalls::Function(ChatCompletionMessageToolCall {
                        id: t.id.clone(),
                        function: FunctionCall {
                            name: t.name.clone(),
                            arguments: t.arguments.clone(),
                        },
                    })
                })
                .collect()
        }),
        ..Default::default()
    })
}

/// The answer as JSON matching the schema, or what is wrong with it. A Markdown code fence
/// around the JSON is tolerated.
fn check_output(validator: &jsonschema::Validator, text: &str) -> Result<Value, String> {
    let inner = flotilla_model::task::unfenced_json(text);
    let value: Value =
        serde_json::from_str(inner).map_err(|e| format!("the answer is not JSON ({e})"))?;
    let problems = crate::tools::schema_problems(validator, &value);
    if problems.is_empty() {
        Ok(value)
    } else {
        Err(problems.join("; "))
    }
}

/// Publishes streamed text as `assistant_reply` increments, at most one per
/// [`DELTA_INTERVAL`], until the sender is dropped.
async fn publish_deltas(events: EventEmitter, mut rx: mpsc::UnboundedReceiver<String>) {
    let mut buf = String::new();
    let mut flush_at: Option<tokio::time::Instant> = None;
    loop {
        let next = match flush_at {
            Some(at) => tokio::time::timeout_at(at, rx.recv()).await,
            None => Ok(rx.recv().await),
        };
        match next {
            Ok(Some(text)) => {
                buf.push_str(&text);
                if flush_at.is_none() {
                    flush_at = Some(tokio::time::Instant::now() + DELTA_INTERVAL);
                }
            }
            Ok(None) => break,
            Err(_) => {
                flush_at = None;
                Box::pin(events.emit(Event::AssistantReply {
                    text: std::mem::take(&mut buf),
                    is_final: false,
                }))
                .await;
            }
        }
    }
    if !buf.is_empty() {
        Box::pin(events.emit(Event::AssistantReply {
            text: buf,
            is_final: false,
        }))
        .await;
    }
}

/// The amounts a person's `edit` of a budget request adds: `{"max_tokens": N, "max_cost": X}`,
/// each optional, neither negative.
fn extension_of(input: &Value) -> Result<(u64, f64), String> {
    let tokens = match input.get("max_tokens") {
        None | Some(Value::Null) => 0,
        Some(v) => v
            .as_u64()
            .ok_or_else(|| format!("max_tokens must be a whole number of tokens, not {v}"))?,
    };
    let cost = match input.get("max_cost") {
        None | Some(Value::Null) => 0.0,
        Some(v) => v
            .as_f64()
            .filter(|c| c.is_finite() && *c >= 0.0)
            .ok_or_else(|| {
                format!("max_cost must be a non-negative amount of US dollars, not {v}")
            })?,
    };
    if tokens == 0 && cost == 0.0 {
        return Err("it adds nothing (give max_tokens or max_cost)".into());
    }
    Ok((tokens, cost))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_extension_adds_something_and_nothing_negative() {
        use serde_json::json;
        assert_eq!(extension_of(&json!({"max_tokens": 500})), Ok((500, 0.0)));
        assert_eq!(
            extension_of(&json!({"max_tokens": 5, "max_cost": 0.5})),
            Ok((5, 0.5))
        );
        for bad in [
            json!({}),
            json!({"max_tokens": "lots"}),
            json!({"max_cost": -1.0}),
            json!({"max_tokens": -3}),
        ] {
            assert!(extension_of(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn output_is_checked_with_fences_tolerated() {
        let schema = serde_json::json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]});
        let v = jsonschema::validator_for(&schema).expect("schema");
        assert_eq!(
            check_output(&v, "```json\n{\"n\": 3}\n```").expect("valid"),
            serde_json::json!({"n": 3})
        );
        assert!(
            check_output(&v, "three")
                .expect_err("not json")
                .contains("not JSON")
        );
        let e = check_output(&v, "{\"n\": \"3\"}").expect_err("wrong type");
        assert!(e.contains("/n"), "{e}");
    }
}
