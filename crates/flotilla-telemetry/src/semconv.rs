//! Span names and attribute keys, in one place so the coordinator, workers and agents name
//! things alike and trace back-ends group them.
//!
//! Where they apply, names follow the OpenTelemetry GenAI agent conventions
//! (<https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-agent-spans/>): a worker's
//! attempt is an `invoke_agent` span, a tool call `execute_tool`, a model call `chat`. The
//! `opentelemetry-semantic-conventions` crate has these keys only behind its experimental
//! feature and marks them deprecated (they moved to a separate GenAI repository), so they are
//! restated here. Flotilla's own attributes use the `flotilla.` namespace.
//!
//! `tracing` span names are static; the conventions' full names (`invoke_agent {agent}`) are
//! set through the `otel.name` field, which `tracing-opentelemetry` uses as the span name:
//!
//! ```
//! let agent = "researcher";
//! let span = tracing::info_span!(
//!     "invoke_agent",
//!     otel.name = format!("invoke_agent {agent}"),
//!     gen_ai.operation.name = "invoke_agent",
//!     gen_ai.agent.name = agent,
//!     flotilla.run_id = "0190…",
//! );
//! # drop(span);
//! ```

/// Span: a worker runs one task attempt with an agent.
pub const INVOKE_AGENT: &str = "invoke_agent";
/// Span: an agent calls a tool.
pub const EXECUTE_TOOL: &str = "execute_tool";
/// Span: an agent calls a chat model.
pub const CHAT: &str = "chat";

/// The GenAI operation (`invoke_agent`, `execute_tool`, `chat`).
pub const GEN_AI_OPERATION_NAME: &str = "gen_ai.operation.name";
/// The agent definition's name.
pub const GEN_AI_AGENT_NAME: &str = "gen_ai.agent.name";
/// A unique id of the agent instance (Flotilla: the attempt id).
pub const GEN_AI_AGENT_ID: &str = "gen_ai.agent.id";
/// The model requested.
pub const GEN_AI_REQUEST_MODEL: &str = "gen_ai.request.model";
/// The model that answered.
pub const GEN_AI_RESPONSE_MODEL: &str = "gen_ai.response.model";
/// The model provider (`openai`, …).
pub const GEN_AI_PROVIDER_NAME: &str = "gen_ai.provider.name";
/// Prompt tokens of a model call.
pub const GEN_AI_USAGE_INPUT_TOKENS: &str = "gen_ai.usage.input_tokens";
/// Completion tokens of a model call.
pub const GEN_AI_USAGE_OUTPUT_TOKENS: &str = "gen_ai.usage.output_tokens";
/// The tool called.
pub const GEN_AI_TOOL_NAME: &str = "gen_ai.tool.name";
/// The model's id of a tool call.
pub const GEN_AI_TOOL_CALL_ID: &str = "gen_ai.tool.call.id";
/// The kind of tool (`function`: run by the agent).
pub const GEN_AI_TOOL_TYPE: &str = "gen_ai.tool.type";
/// The most tokens a model call may answer with (`max-output-tokens`).
pub const GEN_AI_REQUEST_MAX_TOKENS: &str = "gen_ai.request.max_tokens";
/// The class of error a failed operation ended with (the conventions' `error.type`).
pub const ERROR_TYPE: &str = "error.type";
/// A conversation spanning several calls (Flotilla: the run id).
pub const GEN_AI_CONVERSATION_ID: &str = "gen_ai.conversation.id";

/// The run.
pub const FLOTILLA_RUN_ID: &str = "flotilla.run_id";
/// The task within its run.
pub const FLOTILLA_TASK_ID: &str = "flotilla.task_id";
/// The attempt number (1 for the first).
pub const FLOTILLA_ATTEMPT: &str = "flotilla.attempt";
/// The worker pool.
pub const FLOTILLA_POOL: &str = "flotilla.pool";
/// The worker's id.
pub const FLOTILLA_WORKER_ID: &str = "flotilla.worker_id";
/// The process role (`coordinator`, `worker`, `up`, `client`).
pub const FLOTILLA_ROLE: &str = "flotilla.role";
