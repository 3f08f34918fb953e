//! Flotilla's LLM agent (`kind = "llm"` in `[agents.NAME]`): tasks answered by a model behind
//! any OpenAI-compatible chat-completions API (OpenAI, vLLM, llama.cpp's `llama-server`,
//! Ollama).
//!
//! * [`config`]: the provider, model, key source, limits, instruction and tools of an agent,
//!   validated with errors naming the field.
//! * [`roles`]: the system prompts of team roles (shipped defaults, `[roles.NAME]` overrides).
//! * [`prompt`]: the documented user-message template, capped with explicit cut markers.
//! * [`provider`]: the HTTP calls — streaming, retries of 429/5xx honouring `Retry-After`
//!   within the attempt's deadline, a per-worker cap on concurrent requests per provider,
//!   prompt cancellation.
//! * [`tools`]: the agent context as tools (`workspace_*`, `mailbox_*`, `state_*`, and
//!   [`contract_net`]'s `negotiate`, `next_request`, `offer`, `await_award`; the opt-in
//!   [`recruit`] and [`teammate_tools`]' `spawn_teammate`, `send_message`, `broadcast`,
//!   `list_team`, `shutdown_teammate`),
//!   commands declared in config, and ([`mcp`]) the tools of MCP servers, with JSON Schema
//!   checks of the arguments.
//! * [`budget`]: the run's `max_tokens` / `max_cost`, reserved before every call across all
//!   workers; a call that could pass them is not made.
//! * [`journal`]: every model reply and tool round recorded, so a redelivered attempt
//!   resumes without calling the model again for steps it already has.
//! * [`ratelimit`]: requests and tokens per minute per provider, shared by every worker of
//!   the deployment through JetStream KV.
//! * [`agent`]: the loop tying them together, with `assistant_reply`, `tool_start`,
//!   `tool_end` and `usage` events, and structured output (`output_schema`).
//!
//! The worker builds these agents from its configuration; embedders build them directly:
//!
//! ```no_run
//! # fn example() -> Result<(), flotilla_llm::ConfigError> {
//! use std::sync::Arc;
//! let mut config = flotilla_llm::LlmConfig::new("http://127.0.0.1:8080/v1", "smollm2");
//! config.max_tool_rounds = 4;
//! let agent = flotilla_llm::LlmAgent::new(
//!     "analyst",
//!     &config,
//!     Arc::new(flotilla_llm::Roles::default()),
//!     &flotilla_llm::Providers::default(),
//!     std::path::Path::new("."),
//! )?;
//! # let _ = agent; Ok(()) }
//! ```

pub mod agent;
pub mod budget;
mod call;
pub mod config;
pub mod contract_net;
pub mod gate;
pub mod journal;
pub mod lead_tools;
pub mod mcp;
pub mod prompt;
pub mod provider;
pub mod ratelimit;
pub mod recruit;
pub mod roles;
mod supervisor_api;
pub mod teammate_tools;
pub mod tools;

pub use agent::LlmAgent;
pub use config::{ConfigError, ExecToolConfig, LlmConfig, Price, ToolChoice};
pub use mcp::McpServerConfig;
pub use provider::Providers;
pub use roles::{RoleConfig, Roles};
