//! `[agents.NAME]` with `kind = "llm"`: the provider, the model, the prompt and the tools of an
//! LLM agent.
//!
//! ```toml
//! [agents.analyst]
//! kind = "llm"
//! base-url = "https://api.openai.com/v1"   # any OpenAI-compatible server
//! model = "gpt-4o-mini"
//! api-key-env = "OPENAI_API_KEY"           # or api-key-file; never inline
//! temperature = 0.2
//! max-output-tokens = 1024
//! request-timeout = "2m"
//! tool-choice = "auto"                     # or "required": a tool call in every round
//! instruction = "Work for {customer}."     # {key}: session state
//! tools = ["workspace_read", "workspace_write", "state_get"]
//!
//! [agents.analyst.exec-tools.word_count]   # arguments as JSON on stdin
//! command = "python3"
//! args = ["tools/word_count.py"]
//! description = "Counts the words of a text"
//! parameters = { type = "object", properties = { text = { type = "string" } }, required = ["text"] }
//! ```
//!
//! The API key is read from the environment variable or file named here when a model call is
//! made — never from the config file itself, never logged, and redacted from `Debug` output
//! (as are the values of extra headers).

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::mcp::McpServerConfig;

/// Names of the built-in tools: what `tools` may list, and its default (all of them).
pub const BUILTIN_TOOLS: &[&str] = &[
    "workspace_read",
    "workspace_write",
    "mailbox_send",
    "mailbox_read",
    "state_get",
    "state_set",
];

/// Built-in tools an agent gets only when its `tools` lists them: `recruit` and the
/// persistent-teammate tools (`spawn_teammate`, `send_message`, `broadcast`, `list_team`,
/// `shutdown_teammate`) change the team, and the contract-net tools (`negotiate`,
/// `next_request`, `offer`, `await_award`) are four more schemas in every prompt, and a run's
/// lead needs `assign_task` and `finish_run` (and may pause members with `pause_member`), and `ask_user` makes the attempt wait for a
/// person — none is a default.
pub const OPT_IN_TOOLS: &[&str] = &[
    RECRUIT,
    "negotiate",
    "next_request",
    "offer",
    "await_award",
    SPAWN_TEAMMATE,
    SEND_MESSAGE,
    BROADCAST,
    LIST_TEAM,
    SHUTDOWN_TEAMMATE,
    ASSIGN_TASK,
    FINISH_RUN,
    PAUSE_MEMBER,
    RESUME_MEMBER,
    ASK_USER,
];

// The opt-in tools' names, each offered by its module (`recruit`, `teammate_tools`,
// `lead_tools`, `gate`), which re-exports it.

/// `recruit`, as `tools` lists it.
pub const RECRUIT: &str = "recruit";
/// `spawn_teammate`, as `tools` lists it.
pub const SPAWN_TEAMMATE: &str = "spawn_teammate";
/// `send_message`.
pub const SEND_MESSAGE: &str = "send_message";
/// `broadcast`.
pub const BROADCAST: &str = "broadcast";
/// `list_team`.
pub const LIST_TEAM: &str = "list_team";
/// `shutdown_teammate`.
pub const SHUTDOWN_TEAMMATE: &str = "shutdown_teammate";
/// `assign_task`: runs one held subtask.
pub const ASSIGN_TASK: &str = "assign_task";
/// `finish_run`: ends the run.
pub const FINISH_RUN: &str = "finish_run";
/// `pause_member`: pauses one member's task.
pub const PAUSE_MEMBER: &str = "pause_member";
/// `resume_member`: resumes a paused member's task.
pub const RESUME_MEMBER: &str = "resume_member";
/// `ask_user`: the built-in tool with which an agent asks the user a question.
pub const ASK_USER: &str = "ask_user";

/// The tool offered when an agent lists `agent-tools`: no `exec-tools` command may take its
/// name.
pub const CALL_AGENT: &str = "call_agent";

/// The tool offered when an agent has transfer targets in the agent tree (re-exported by
/// `tools`).
pub const TRANSFER: &str = "transfer_to_agent";

/// An `agent-tools` entry with this prefix (`agents:AGENT[.OWNER[.SESSION]]`) names an agent
/// of the NATS Agent Protocol, not an agent definition of this deployment.
pub const EXTERNAL_PREFIX: &str = "agents:";

/// An LLM agent's configuration.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct LlmConfig {
    /// Base URL of the OpenAI-compatible API, up to and including the version
    /// (`https://api.openai.com/v1`, `http://127.0.0.1:8080/v1`).
    pub base_url: String,
    /// The model to ask.
    pub model: String,
    /// Environment variable holding the API key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// File holding the API key (relative paths: to the config file's directory). Read at
    /// every model call, so a rotated key is picked up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_file: Option<PathBuf>,
    /// Groups agents for the per-worker cap on concurrent requests (default: the base URL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// Sampling temperature, 0 to 2 (default: the server's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Most tokens per model reply (default: the server's). Also what a run budget reserves
    /// for each reply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u32>,
    /// The model's price, for `usage` events and runs with a `max_cost`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price: Option<Price>,
    /// Longest one model call may take, retries not counted (default 2 min).
    #[serde(default = "default_request_timeout", with = "humantime_serde")]
    pub request_timeout: Duration,
    /// Extra HTTP headers sent with every request (values are redacted in `Debug`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// The agent's own instruction, added to the role's system prompt. `{key}` placeholders
    /// take session-state values (`{key?}`: empty when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instruction: Option<String>,
    /// Rounds of tool calls before the model must answer (default 8).
    #[serde(default = "default_max_tool_rounds")]
    pub max_tool_rounds: u32,
    /// Whether the model may answer at once (`auto`, the default) or must call a tool in
    /// each of its `max-tool-rounds` rounds before it answers (`required`, sent as
    /// `tool_choice: required`; servers differ in how strictly they enforce it).
    #[serde(default, skip_serializing_if = "ToolChoice::is_auto")]
    pub tool_choice: ToolChoice,
    /// Most requests this worker sends to the provider at once, over all agents of the
    /// provider (default 8; agents of one provider disagreeing: the smallest wins).
    #[serde(default = "default_max_concurrent_requests")]
    pub max_concurrent_requests: usize,
    /// Speak HTTP/2 from the first byte (`h2c`, "prior knowledge") to an `http://` provider
    /// that serves it, so its requests share a few connections instead of one each (default
    /// false: HTTP/1.1 on `http://`, one connection per request in flight; `https://`
    /// providers negotiate HTTP/2 anyway). Either way a worker keeps one connection pool per
    /// 100 requests of `max-concurrent-requests`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub http2_prior_knowledge: bool,
    /// Most requests per minute that all workers of the deployment together send to the
    /// provider (shared through JetStream KV; default: unlimited). Retries count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u32>,
    /// Most tokens (prompt + completion) per minute that all workers of the deployment
    /// together spend at the provider (shared through JetStream KV; default: unlimited).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
    /// Retries of a call answered with 429, 5xx, a broken stream or a timeout (default 6);
    /// always bounded by the attempt's deadline.
    #[serde(default = "default_max_retries")]
    pub max_retries: u32,
    /// First backoff between retries, doubled each time; a `Retry-After` from the server wins
    /// (default 500 ms).
    #[serde(default = "default_retry_initial", with = "humantime_serde")]
    pub retry_initial_backoff: Duration,
    /// Longest backoff between retries (default 30 s).
    #[serde(default = "default_retry_max", with = "humantime_serde")]
    pub retry_max_backoff: Duration,
    /// Most characters of the rendered user message; larger parts are cut, lowest priority
    /// first, with an explicit marker (default 48,000).
    #[serde(default = "default_max_prompt_chars")]
    pub max_prompt_chars: usize,
    /// Stream replies (SSE). Off: one JSON reply per call (default on).
    #[serde(default = "default_true")]
    pub stream: bool,
    /// Built-in tools offered to the model (default: all of them).
    #[serde(default = "default_tools")]
    pub tools: Vec<String>,
    /// Commands offered to the model as tools, by tool name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub exec_tools: BTreeMap<String, ExecToolConfig>,
    /// Tools the client that submits a run executes, by tool name (`await_external_tools`):
    /// a call suspends the attempt until the client answers with the result. The plan's
    /// `config.client_tools` add to these for one run.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub client_tools: BTreeMap<String, ClientToolConfig>,
    /// The agents below this one in the agent tree: `transfer_to_agent` may hand the
    /// conversation to them (and to this agent's parent and peers, unless disallowed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sub_agents: Vec<String>,
    /// Never transfer the conversation to the parent agent.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub disallow_transfer_to_parent: bool,
    /// Never transfer the conversation to a peer (another sub-agent of the parent).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub disallow_transfer_to_peers: bool,
    /// Agents offered to the model through the `call_agent` tool (agent-as-tool): each call
    /// runs the named agent as a child run and returns its answer. An entry
    /// `agents:AGENT[.OWNER[.SESSION]]` is an agent of the NATS Agent Protocol on this NATS,
    /// prompted directly (its streamed answer in the run's events).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub agent_tools: Vec<String>,
    /// MCP servers whose tools are offered to the model (as `<server>__<tool>`), by name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub mcp_servers: BTreeMap<String, McpServerConfig>,
}

/// When the model calls tools: `tool-choice` of an LLM agent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ToolChoice {
    /// The model decides (`tool_choice: auto`).
    #[default]
    Auto,
    /// Every round up to `max-tool-rounds` must call a tool (`tool_choice: required`); then
    /// the model answers.
    Required,
}

impl ToolChoice {
    fn is_auto(&self) -> bool {
        *self == Self::Auto
    }
}

/// A model's price in US dollars per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Price {
    /// Per million prompt tokens.
    pub input_per_mtok: f64,
    /// Per million completion tokens.
    pub output_per_mtok: f64,
}

impl Price {
    /// The cost of `input` prompt and `output` completion tokens, in US dollars.
    pub fn cost(&self, input: u64, output: u64) -> f64 {
        (input as f64 * self.input_per_mtok + output as f64 * self.output_per_mtok) / 1e6
    }
}

/// A command offered to the model as a tool. Its arguments (a JSON object matching
/// `parameters`) are written to its stdin; its stdout is the tool's result (JSON if it parses,
/// text otherwise); a non-zero exit is an error the model sees, with the end of stderr.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ExecToolConfig {
    /// Program to run (looked up on `PATH` unless it contains a `/`).
    pub command: String,
    /// Arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// What the tool does, for the model.
    #[serde(default)]
    pub description: String,
    /// JSON Schema of the arguments (default: any object).
    #[serde(default = "default_parameters")]
    pub parameters: Value,
    /// Longest one call may take (default 60 s).
    #[serde(default = "default_tool_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// Working directory (relative: to the config file's directory, also the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<PathBuf>,
    /// Extra environment variables.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
}

/// A tool the client runs (`[agents.<name>.client-tools.<tool>]`): offered to the model like
/// any tool; Flotilla never runs it, the client answers each call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ClientToolConfig {
    /// What the tool does, for the model.
    pub description: String,
    /// JSON Schema of the arguments (default: any object).
    #[serde(default = "default_parameters")]
    pub parameters: Value,
}

fn default_request_timeout() -> Duration {
    // Long answers of slow models take a minute or more; a hung server should not hold a
    // worker slot for the whole task timeout.
    Duration::from_secs(120)
}
fn default_max_tool_rounds() -> u32 {
    // Enough for read → think → write loops; small enough to stop a model that loops.
    8
}
fn default_max_concurrent_requests() -> usize {
    // Twice the default worker concurrency: never the bottleneck unless set lower.
    8
}
fn default_max_retries() -> u32 {
    6
}
fn default_retry_initial() -> Duration {
    Duration::from_millis(500)
}
fn default_retry_max() -> Duration {
    Duration::from_secs(30)
}
fn default_max_prompt_chars() -> usize {
    // About 12k tokens: fits every current model's context with room for the reply.
    48_000
}
fn default_true() -> bool {
    true
}
fn default_tools() -> Vec<String> {
    BUILTIN_TOOLS.iter().map(|t| (*t).to_owned()).collect()
}
fn default_parameters() -> Value {
    serde_json::json!({"type": "object"})
}
fn default_tool_timeout() -> Duration {
    Duration::from_secs(60)
}

impl LlmConfig {
    /// A configuration with defaults for everything but the server and the model.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            model: model.into(),
            api_key_env: None,
            api_key_file: None,
            provider: None,
            temperature: None,
            max_output_tokens: None,
            price: None,
            request_timeout: default_request_timeout(),
            headers: BTreeMap::new(),
            instruction: None,
            max_tool_rounds: default_max_tool_rounds(),
            tool_choice: ToolChoice::Auto,
            max_concurrent_requests: default_max_concurrent_requests(),
            http2_prior_knowledge: false,
            max_retries: default_max_retries(),
            retry_initial_backoff: default_retry_initial(),
            retry_max_backoff: default_retry_max(),
            max_prompt_chars: default_max_prompt_chars(),
            stream: true,
            tools: default_tools(),
            exec_tools: BTreeMap::new(),
            client_tools: BTreeMap::new(),
            mcp_servers: BTreeMap::new(),
            agent_tools: Vec::new(),
            sub_agents: Vec::new(),
            disallow_transfer_to_parent: false,
            disallow_transfer_to_peers: false,
            requests_per_minute: None,
            tokens_per_minute: None,
        }
    }

    /// The key of the provider's concurrency cap: `provider`, else the base URL without a
    /// trailing slash.
    pub fn provider_key(&self) -> String {
        self.provider
            .clone()
            .unwrap_or_else(|| self.base_url.trim_end_matches('/').to_owned())
    }

    /// Checks every field without I/O; `agent` names the agent in errors.
    pub fn validate(&self, agent: &str) -> Result<(), ConfigError> {
        let bad = |field: &str, message: String| ConfigError::Invalid {
            agent: agent.to_owned(),
            field: field.to_owned(),
            message,
        };
        let url = reqwest::Url::parse(&self.base_url)
            .map_err(|e| bad("base-url", format!("{:?} is not a URL: {e}", self.base_url)))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            return Err(bad(
                "base-url",
                format!(
                    "{:?} must be an http:// or https:// URL with a host",
                    self.base_url
                ),
            ));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(bad(
                "base-url",
                "must not carry credentials; use api-key-env or api-key-file".into(),
            ));
        }
        if self.model.trim().is_empty() {
            return Err(bad("model", "is empty".into()));
        }
        match (&self.api_key_env, &self.api_key_file) {
            (Some(_), Some(_)) => {
                return Err(bad(
                    "api-key-env",
                    "and api-key-file are both set; choose one".into(),
                ));
            }
            (Some(var), None) if var.is_empty() || var.contains(['=', '\0']) => {
                return Err(bad(
                    "api-key-env",
                    format!("{var:?} is not an environment variable name"),
                ));
            }
            (None, Some(path)) if path.as_os_str().is_empty() => {
                return Err(bad("api-key-file", "is empty".into()));
            }
            _ => {}
        }
        if let Some(p) = &self.provider
            && p.trim().is_empty()
        {
            return Err(bad("provider", "is empty".into()));
        }
        if let Some(t) = self.temperature
            && !(0.0..=2.0).contains(&t)
        {
            return Err(bad("temperature", format!("{t} is outside 0 to 2")));
        }
        // Tools come from every source: built-ins, commands, agents (`call_agent`), MCP
        // servers and the agent tree (`transfer_to_agent` to sub-agents).
        if self.tool_choice == ToolChoice::Required
            && self.tools.is_empty()
            && self.exec_tools.is_empty()
            && self.client_tools.is_empty()
            && self.agent_tools.is_empty()
            && self.mcp_servers.is_empty()
            && self.sub_agents.is_empty()
        {
            return Err(bad(
                "tool-choice",
                "is required but the agent has no tools".into(),
            ));
        }
        if self.max_output_tokens == Some(0) {
            return Err(bad("max-output-tokens", "must be at least 1".into()));
        }
        if let Some(p) = self.price
            && !(p.input_per_mtok.is_finite()
                && p.output_per_mtok.is_finite()
                && p.input_per_mtok >= 0.0
                && p.output_per_mtok >= 0.0)
        {
            return Err(bad("price", "prices must be numbers of at least 0".into()));
        }
        if self.request_timeout < Duration::from_millis(100) {
            return Err(bad("request-timeout", "must be at least 100ms".into()));
        }
        for (name, value) in &self.headers {
            let lower = name.to_ascii_lowercase();
            if matches!(
                lower.as_str(),
                "authorization" | "api-key" | "x-api-key" | "proxy-authorization"
            ) {
                return Err(bad(
                    "headers",
                    format!(
                        "{name:?} would put a credential in the config file; use api-key-env or api-key-file"
                    ),
                ));
            }
            if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(bad(
                    "headers",
                    format!("{name:?} is not an HTTP header name"),
                ));
            }
            if http::HeaderValue::from_str(value).is_err() {
                return Err(bad(
                    "headers",
                    format!("the value of {name:?} is not a valid HTTP header value"),
                ));
            }
        }
        if self.max_tool_rounds > 100 {
            return Err(bad(
                "max-tool-rounds",
                format!("{} is more than 100", self.max_tool_rounds),
            ));
        }
        if self.requests_per_minute == Some(0) {
            return Err(bad(
                "requests-per-minute",
                "must be at least 1 (leave it out for no limit)".into(),
            ));
        }
        if self.tokens_per_minute == Some(0) {
            return Err(bad(
                "tokens-per-minute",
                "must be at least 1 (leave it out for no limit)".into(),
            ));
        }
        if self.max_concurrent_requests == 0 {
            return Err(bad("max-concurrent-requests", "must be at least 1".into()));
        }
        if self.max_retries > 100 {
            return Err(bad(
                "max-retries",
                format!("{} is more than 100", self.max_retries),
            ));
        }
        if self.retry_initial_backoff.is_zero()
            || self.retry_initial_backoff > self.retry_max_backoff
        {
            return Err(bad(
                "retry-initial-backoff",
                "must be above zero and at most retry-max-backoff".into(),
            ));
        }
        if self.max_prompt_chars < 1000 {
            return Err(bad(
                "max-prompt-chars",
                format!("{} is less than 1000", self.max_prompt_chars),
            ));
        }
        for t in &self.tools {
            if !BUILTIN_TOOLS.contains(&t.as_str()) && !OPT_IN_TOOLS.contains(&t.as_str()) {
                return Err(ConfigError::UnknownTool {
                    agent: agent.to_owned(),
                    tool: t.clone(),
                });
            }
        }
        for (name, tool) in &self.exec_tools {
            let field = format!("exec-tools.{name}");
            if !flotilla_model::plan::is_tool_name(name) {
                return Err(bad(
                    &field,
                    "tool names are 1 to 64 letters, digits, `_` or `-`".into(),
                ));
            }
            if BUILTIN_TOOLS.contains(&name.as_str()) || OPT_IN_TOOLS.contains(&name.as_str()) {
                return Err(bad(
                    &field,
                    format!("{name:?} is the name of a built-in tool"),
                ));
            }
            if tool.command.trim().is_empty() {
                return Err(bad(&format!("{field}.command"), "is empty".into()));
            }
            if tool.timeout.is_zero() {
                return Err(bad(
                    &format!("{field}.timeout"),
                    "must be above zero".into(),
                ));
            }
            check_parameters(agent, &field, &tool.parameters)?;
        }
        for (name, tool) in &self.client_tools {
            let field = format!("client-tools.{name}");
            if !flotilla_model::plan::is_tool_name(name) {
                return Err(bad(
                    &field,
                    "tool names are 1 to 64 letters, digits, `_` or `-`".into(),
                ));
            }
            if flotilla_model::plan::RESERVED_TOOL_NAMES.contains(&name.as_str()) {
                return Err(bad(
                    &field,
                    format!("{name:?} is the name of a built-in tool"),
                ));
            }
            if self.exec_tools.contains_key(name) {
                return Err(bad(
                    &field,
                    format!("{name:?} is also an exec tool of this agent; a tool has one runner"),
                ));
            }
            if tool.description.trim().is_empty() {
                return Err(bad(
                    &format!("{field}.description"),
                    "say what the tool does, for the model".into(),
                ));
            }
            check_parameters(agent, &field, &tool.parameters)?;
        }
        for a in &self.agent_tools {
            if let Some(target) = a.strip_prefix(EXTERNAL_PREFIX) {
                if let Err(e) = target.parse::<flotilla_agents::call::Target>() {
                    return Err(bad(
                        "agent-tools",
                        format!("{a:?} is not an agent of the NATS Agent Protocol: {e}"),
                    ));
                }
                continue;
            }
            if flotilla_model::token::check_name(a).is_err() {
                return Err(bad(
                    "agent-tools",
                    format!("{a:?} is not an agent name (letters, digits, `_`, `-`)"),
                ));
            }
        }
        if self.exec_tools.contains_key(CALL_AGENT) {
            return Err(bad(
                "exec-tools.call_agent",
                "call_agent is the agent-as-tool built-in (see agent-tools); name the command differently".into(),
            ));
        }
        for (name, server) in &self.mcp_servers {
            let field = format!("mcp-servers.{name}");
            if name.is_empty()
                || name.len() > 32
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            {
                return Err(bad(
                    &field,
                    "server names are 1 to 32 letters, digits, `_` or `-`".into(),
                ));
            }
            server
                .check()
                .map_err(|(suffix, message)| bad(&format!("{field}.{suffix}"), message))?;
        }
        Ok(())
    }
}

/// A tool's `parameters` (at `<field>.parameters`): a JSON Schema of an object (tool
/// arguments are objects) that compiles.
fn check_parameters(agent: &str, field: &str, parameters: &Value) -> Result<(), ConfigError> {
    let invalid = |message: String| ConfigError::InvalidSchema {
        agent: agent.to_owned(),
        field: format!("{field}.parameters"),
        message,
    };
    if parameters.get("type").and_then(Value::as_str) != Some("object") {
        return Err(invalid(
            "must be a JSON Schema with \"type\": \"object\" (tool arguments are objects)".into(),
        ));
    }
    jsonschema::validator_for(parameters)
        .map(|_| ())
        .map_err(|e| invalid(e.to_string()))
}

impl fmt::Debug for LlmConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let headers: BTreeMap<&str, &str> = self
            .headers
            .keys()
            .map(|k| (k.as_str(), "[redacted]"))
            .collect();
        f.debug_struct("LlmConfig")
            .field("base_url", &self.base_url)
            .field("model", &self.model)
            .field("api_key_env", &self.api_key_env)
            .field("api_key_file", &self.api_key_file)
            .field("provider", &self.provider)
            .field("temperature", &self.temperature)
            .field("max_output_tokens", &self.max_output_tokens)
            .field("price", &self.price)
            .field("request_timeout", &self.request_timeout)
            .field("headers", &headers)
            .field("instruction", &self.instruction)
            .field("max_tool_rounds", &self.max_tool_rounds)
            .field("max_concurrent_requests", &self.max_concurrent_requests)
            .field("http2_prior_knowledge", &self.http2_prior_knowledge)
            .field("max_retries", &self.max_retries)
            .field("max_prompt_chars", &self.max_prompt_chars)
            .field("stream", &self.stream)
            .field("tools", &self.tools)
            .field("exec_tools", &self.exec_tools.keys().collect::<Vec<_>>())
            .field(
                "client_tools",
                &self.client_tools.keys().collect::<Vec<_>>(),
            )
            .field("mcp_servers", &self.mcp_servers.keys().collect::<Vec<_>>())
            .field("agent_tools", &self.agent_tools)
            .field("sub_agents", &self.sub_agents)
            .field("requests_per_minute", &self.requests_per_minute)
            .field("tokens_per_minute", &self.tokens_per_minute)
            .finish_non_exhaustive()
    }
}

/// A configuration problem, naming the agent and the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A field has a value that cannot work.
    #[error("agents.{agent}.{field}: {message}")]
    Invalid {
        /// The agent.
        agent: String,
        /// The field (kebab-case, as in the config file).
        field: String,
        /// What is wrong.
        message: String,
    },
    /// `tools` names a built-in tool that does not exist.
    #[error("agents.{agent}.tools: no built-in tool is named {tool:?} (built-in tools: {list}; opt-in: {opt_in})", list = BUILTIN_TOOLS.join(", "), opt_in = OPT_IN_TOOLS.join(", "))]
    UnknownTool {
        /// The agent.
        agent: String,
        /// The unknown name.
        tool: String,
    },
    /// A JSON Schema does not compile.
    #[error("agents.{agent}.{field}: not a valid JSON Schema: {message}")]
    InvalidSchema {
        /// The agent.
        agent: String,
        /// The field.
        field: String,
        /// The compiler's complaint.
        message: String,
    },
    /// A `[roles.NAME]` entry cannot be used.
    #[error("roles.{role}: {message}")]
    InvalidRole {
        /// The role.
        role: String,
        /// What is wrong.
        message: String,
    },
}

impl ConfigError {
    /// The field at fault (`base-url`, `exec-tools.NAME.parameters`, `tools`, `prompt`).
    pub fn field(&self) -> &str {
        match self {
            Self::Invalid { field, .. } | Self::InvalidSchema { field, .. } => field,
            Self::UnknownTool { .. } => "tools",
            Self::InvalidRole { .. } => "prompt",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(extra: &str) -> Result<LlmConfig, toml::de::Error> {
        toml::from_str(&format!(
            "base-url = \"http://127.0.0.1:1/v1\"\nmodel = \"m\"\n{extra}"
        ))
    }

    #[test]
    fn defaults_and_kebab_case_keys() {
        let c = parse("max-tool-rounds = 3\nrequest-timeout = \"5s\"").expect("parses");
        assert_eq!(c.max_tool_rounds, 3);
        assert_eq!(c.request_timeout, Duration::from_secs(5));
        assert_eq!(c.tools.len(), BUILTIN_TOOLS.len());
        assert!(c.stream);
        assert!(c.validate("a").is_ok());
        assert!(parse("api-key = \"sk-inline\"").is_err(), "no inline keys");
        let c = parse("agent-tools = [\"writer\", \"agents:coder.alice\"]").expect("parses");
        assert!(
            c.validate("a").is_ok(),
            "an external target is an agent tool"
        );
    }

    #[test]
    fn every_problem_names_its_field() {
        let cases: &[(&str, &str)] = &[
            ("base-url = \"ftp://x\"", "base-url"),
            ("model = \"  \"", "model"),
            ("api-key-env = \"A\"\napi-key-file = \"k\"", "api-key-env"),
            ("temperature = 3.5", "temperature"),
            ("max-output-tokens = 0", "max-output-tokens"),
            (
                "price = { input-per-mtok = -1.0, output-per-mtok = 2.0 }",
                "price",
            ),
            ("request-timeout = \"1ms\"", "request-timeout"),
            ("headers = { Authorization = \"Bearer x\" }", "headers"),
            ("max-concurrent-requests = 0", "max-concurrent-requests"),
            ("requests-per-minute = 0", "requests-per-minute"),
            ("tokens-per-minute = 0", "tokens-per-minute"),
            ("max-prompt-chars = 10", "max-prompt-chars"),
            ("tools = [\"rm_rf\"]", "tools"),
            ("agent-tools = [\"agents:Bad Name\"]", "agent-tools"),
            ("agent-tools = [\"agents:a.b.c.d\"]", "agent-tools"),
            (
                "[exec-tools.count]\ncommand = \"wc\"\nparameters = { type = \"string\" }",
                "exec-tools.count.parameters",
            ),
            (
                "[exec-tools.state_get]\ncommand = \"x\"",
                "exec-tools.state_get",
            ),
            ("[exec-tools.x]\ncommand = \" \"", "exec-tools.x.command"),
            (
                "[mcp-servers.files]\nurl = \"ftp://x\"",
                "mcp-servers.files.url",
            ),
            ("[mcp-servers.\"a b\"]\ncommand = \"x\"", "mcp-servers.a b"),
            (
                "[client-tools.ask_user]\ndescription = \"asks\"",
                "client-tools.ask_user",
            ),
            (
                "[client-tools.pick]\ndescription = \" \"",
                "client-tools.pick.description",
            ),
            (
                "[client-tools.pick]\ndescription = \"picks\"\nparameters = { type = \"array\" }",
                "client-tools.pick.parameters",
            ),
            (
                "[client-tools.\"a b\"]\ndescription = \"picks\"",
                "client-tools.a b",
            ),
            (
                "[client-tools.count]\ndescription = \"counts\"\n[exec-tools.count]\ncommand = \"wc\"",
                "client-tools.count",
            ),
        ];
        for (extra, field) in cases {
            // Later keys override the defaults above; TOML forbids repeats, so rebuild.
            let text = if extra.starts_with("base-url") || extra.starts_with("model") {
                let base = if extra.starts_with("base-url") {
                    "model = \"m\""
                } else {
                    "base-url = \"http://h/v1\""
                };
                format!("{base}\n{extra}")
            } else {
                format!("base-url = \"http://h/v1\"\nmodel = \"m\"\n{extra}")
            };
            let c: LlmConfig = toml::from_str(&text).expect(extra);
            let e = c.validate("writer").expect_err(extra);
            assert_eq!(e.field(), *field, "{extra}: {e}");
            assert!(e.to_string().starts_with("agents.writer."), "{e}");
        }
    }

    /// Client tools may not take the name of a tool Flotilla offers itself: the plan's are
    /// checked against `RESERVED_TOOL_NAMES` by the coordinator, which knows no LLM crate.
    #[test]
    fn reserved_tool_names_cover_every_built_in_tool() {
        let reserved = flotilla_model::plan::RESERVED_TOOL_NAMES;
        for t in BUILTIN_TOOLS
            .iter()
            .chain(OPT_IN_TOOLS)
            .chain([&CALL_AGENT, &TRANSFER])
        {
            assert!(reserved.contains(t), "{t} is not reserved");
        }
    }

    #[test]
    fn debug_redacts_header_values() {
        let mut c = LlmConfig::new("http://h/v1", "m");
        c.headers.insert("x-org".into(), "very-secret-value".into());
        let shown = format!("{c:?}");
        assert!(!shown.contains("very-secret-value"), "{shown}");
        assert!(shown.contains("x-org"), "{shown}");
    }
}
