//! Tools the model may call: the agent context as built-in tools, commands declared in
//! config (`exec-tools`), and the tools of MCP servers ([`crate::mcp`]).
//!
//! | Tool | Arguments | Result |
//! |---|---|---|
//! | `workspace_read` | `topic`, `since_seq`?, `limit`? | `{entries, next_since_seq, more}` |
//! | `workspace_write` | `topic`, `entry` (object) | `{seq, topic, duplicate}` |
//! | `mailbox_send` | `to` (task id or `*`), `kind`?, `payload`, `correlation_id`? | `{seq, n, duplicate}` |
//! | `mailbox_read` | `limit`?, `wait_ms`? | `{messages, next_since_seq, more}` |
//! | `state_get` | `key` | `{key, found, value, revision}` |
//! | `state_set` | `key`, `value` | `{key, revision}` |
//! | `negotiate`, `next_request`, `offer`, `await_award` | see [`crate::contract_net`] | |
//! | `transfer_to_agent` (agents in the tree around it) | `agent_name` (parent, sub-agent or peer), `reason`? | ends the attempt: the target continues the conversation as a child run, and its answer is the task's (unless refused: `transfer_loop`, a rejected child) |
//! | `call_agent` (with `agent-tools`) | `agent` (one of them), `request`, `input`?, `timeout_s`? | `{agent, response, numeric_value}`; the child run in `tool_end.run_link` |
//!
//! An `agent-tools` entry `agents:AGENT[.OWNER[.SESSION]]` is an agent of the NATS Agent
//! Protocol on this NATS ([`flotilla_agents::call`], the client behind `flotilla call
//! agents:…`): the call discovers it, prompts it with `request` (and `input` as JSON after
//! it), streams each piece of its answer into the run's events as a `tool_update` of the
//! call, and returns `{agent, response}`. `timeout_s` (default 600, never past the attempt's
//! deadline) bounds it; a dead agent (three heartbeat intervals without one), a stalled
//! stream or the timeout are errors for the model (`agent_dead`, `stalled`, `timeout`), as
//! are `unknown_agent` and the agent's own error frames. A question the agent asks (`query`,
//! how the protocol carries permission requests) is put to a person as an approval of the
//! attempt ([`flotilla_agents::ask`]: approve → `yes`, respond → the text, reject or the
//! deadline → `no`) while the stream goes on, and a `tool_update` records the answer.
//!
//! Arguments are checked against each tool's JSON Schema before anything runs. Every problem
//! — arguments that are not JSON or do not match, an unknown tool, a context error such as
//! writing an undeclared topic, a failing command — becomes the tool's result
//! `{"error": {"code", "message"}}` for the model to read and correct; it never fails the
//! attempt. Only cancellation stops a call early.
//!
//! A child run the coordinator rejects (`call_agent`, `transfer_to_agent`) is such an error
//! too, with the rejection's problems: `{"error": {"code": "tree_too_deep", "message",
//! "problems": [{"code", "path", "message"}], "run_id"}}` — the code is the first problem's
//! (`tree_too_deep`, `tree_too_large`, `unknown_agent`, …). A transfer back to an agent the
//! conversation already went through is refused before any child starts: `transfer_loop`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use flotilla_context::{AgentContext, ContextError};
use flotilla_model::mailbox::MailboxKind;
use flotilla_model::run::RunStatus;
use flotilla_model::task::TaskErrorKind;
use serde_json::{Map, Value, json};
use tokio::io::AsyncWriteExt;

pub use crate::call::{MAX_TOOL_OUTPUT, ToolOutcome};
use crate::call::{child_call_key, to_json};
use crate::config::{ConfigError, ExecToolConfig, LlmConfig};
use crate::mcp::{McpServer, offered_name};

// Tool names are configuration's vocabulary (what `tools` may list, what `exec-tools` may
// not be named); here is where they are offered.
pub use crate::config::{BUILTIN_TOOLS, CALL_AGENT, EXTERNAL_PREFIX, OPT_IN_TOOLS, TRANSFER};

/// Longest a `mailbox_read` may wait for a message.
const MAX_MAILBOX_WAIT_MS: u64 = 30_000;

/// What a tool does when called.
#[derive(Debug, Clone)]
enum Action {
    Builtin(&'static str),
    CallAgent,
    /// Handled by the agent loop (it ends the attempt); a call reaching the tool set had
    /// arguments the schema refused.
    Transfer,
    Exec(Arc<ExecTool>),
    Mcp(Arc<McpServer>, String),
    /// Run by the client (`client-tools`, the plan's `client_tools`): a call waits for the
    /// client's answer ([`crate::gate`]); it never runs here.
    Client,
}

#[derive(Debug)]
struct ExecTool {
    config: ExecToolConfig,
    cwd: PathBuf,
}

/// One tool offered to the model.
#[derive(Debug, Clone)]
pub struct Tool {
    /// Name the model calls it by.
    pub name: String,
    /// What it does, for the model.
    pub description: String,
    /// JSON Schema of its arguments.
    pub parameters: Value,
    validator: Arc<jsonschema::Validator>,
    action: Action,
}

/// The tools of one agent.
#[derive(Debug, Clone, Default)]
pub struct ToolSet {
    tools: BTreeMap<String, Tool>,
    mcp: Vec<Arc<McpServer>>,
}

/// `ask_user`'s description and parameters (the gate answers its calls: [`crate::gate`]).
fn ask_user_spec() -> (&'static str, Value) {
    (
        "Asks the user a question and waits for the answer (it may take a while; you continue with the answer as this tool's result). Ask only what you cannot find out yourself.",
        json!({"type": "object", "properties": {
            "question": {"type": "string", "minLength": 1, "description": "The question, complete enough to answer without more context"}
        }, "required": ["question"], "additionalProperties": false}),
    )
}

fn builtin_spec(name: &str) -> (&'static str, Value) {
    if let Some(spec) = crate::contract_net::spec(name) {
        return spec;
    }
    if let Some(spec) = crate::teammate_tools::spec(name) {
        return spec;
    }
    if let Some(spec) = crate::lead_tools::spec(name) {
        return spec;
    }
    match name {
        crate::recruit::RECRUIT => crate::recruit::spec(),
        crate::gate::ASK_USER => ask_user_spec(),
        "workspace_read" => (
            "Reads entries of a workspace topic shared by the team, oldest first. Continue from next_since_seq while more is true.",
            json!({"type": "object", "properties": {
                "topic": {"type": "string", "description": "Topic name"},
                "since_seq": {"type": "integer", "minimum": 0, "description": "Return entries after this sequence (default 0)"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 1000, "description": "Most entries (default 200)"}
            }, "required": ["topic"], "additionalProperties": false}),
        ),
        "workspace_write" => (
            "Appends an entry (a JSON object) to a workspace topic the team reads.",
            json!({"type": "object", "properties": {
                "topic": {"type": "string", "description": "Topic name"},
                "entry": {"type": "object", "description": "The data to append"}
            }, "required": ["topic", "entry"], "additionalProperties": false}),
        ),
        "mailbox_send" => (
            "Sends a message to another task of the team by its task id, to every task with \"*\", or to whichever task playing a role reads it first with \"role:<name>\". Does not wait for an answer.",
            json!({"type": "object", "properties": {
                "to": {"type": "string", "description": "Recipient task id, * for all, or role:<name> for one task playing that role"},
                "kind": {"type": "string", "enum": ["request", "offer", "accept", "delegation", "info"], "description": "Message type (default info)"},
                "payload": {"description": "The message (any JSON)"},
                "correlation_id": {"type": "string", "description": "Ties a reply to a request"}
            }, "required": ["to", "payload"], "additionalProperties": false}),
        ),
        "mailbox_read" => (
            "Reads the messages sent to this task (and broadcasts, and messages to its role that no other task took first) that it has not read yet.",
            json!({"type": "object", "properties": {
                "limit": {"type": "integer", "minimum": 1, "maximum": 1000, "description": "Most messages (default 100)"},
                "wait_ms": {"type": "integer", "minimum": 0, "maximum": MAX_MAILBOX_WAIT_MS, "description": "Wait this long for a message when none is there (default 0)"}
            }, "additionalProperties": false}),
        ),
        "state_get" => (
            "Reads a value of the session state shared by the team's tasks.",
            json!({"type": "object", "properties": {
                "key": {"type": "string", "description": "State key"}
            }, "required": ["key"], "additionalProperties": false}),
        ),
        _ => (
            "Sets a value of the session state shared by the team's tasks.",
            json!({"type": "object", "properties": {
                "key": {"type": "string", "description": "State key"},
                "value": {"description": "Any JSON value"}
            }, "required": ["key", "value"], "additionalProperties": false}),
        ),
    }
}

impl ToolSet {
    /// The tools `config` declares; exec tools' relative paths resolve against `base_dir`.
    pub fn from_config(
        agent: &str,
        config: &LlmConfig,
        base_dir: &Path,
    ) -> Result<Self, ConfigError> {
        let mut tools = BTreeMap::new();
        let compile = |field: String, schema: &Value| {
            jsonschema::validator_for(schema)
                .map(Arc::new)
                .map_err(|e| ConfigError::InvalidSchema {
                    agent: agent.to_owned(),
                    field,
                    message: e.to_string(),
                })
        };
        for name in &config.tools {
            let Some(&builtin) = BUILTIN_TOOLS
                .iter()
                .chain(OPT_IN_TOOLS)
                .find(|b| **b == name.as_str())
            else {
                return Err(ConfigError::UnknownTool {
                    agent: agent.to_owned(),
                    tool: name.clone(),
                });
            };
            let (description, parameters) = builtin_spec(builtin);
            tools.insert(
                name.clone(),
                Tool {
                    name: name.clone(),
                    description: description.to_owned(),
                    validator: compile(format!("tools.{name}"), &parameters)?,
                    parameters,
                    action: Action::Builtin(builtin),
                },
            );
        }
        for (name, tool) in &config.exec_tools {
            let cwd = match &tool.cwd {
                Some(p) if p.is_absolute() => p.clone(),
                Some(p) => base_dir.join(p),
                None => base_dir.to_path_buf(),
            };
            tools.insert(
                name.clone(),
                Tool {
                    name: name.clone(),
                    description: tool.description.clone(),
                    validator: compile(format!("exec-tools.{name}.parameters"), &tool.parameters)?,
                    parameters: tool.parameters.clone(),
                    action: Action::Exec(Arc::new(ExecTool {
                        config: tool.clone(),
                        cwd,
                    })),
                },
            );
        }
        for (name, tool) in &config.client_tools {
            tools.insert(
                name.clone(),
                Tool {
                    name: name.clone(),
                    description: tool.description.clone(),
                    validator: compile(
                        format!("client-tools.{name}.parameters"),
                        &tool.parameters,
                    )?,
                    parameters: tool.parameters.clone(),
                    action: Action::Client,
                },
            );
        }
        if !config.agent_tools.is_empty() {
            let parameters = json!({"type": "object", "properties": {
                "agent": {"type": "string", "enum": config.agent_tools, "description": "The agent to ask"},
                "request": {"type": "string", "description": "What the agent should do"},
                "input": {"description": "Data for the agent (any JSON)"},
                "timeout_s": {"type": "integer", "minimum": 1, "maximum": MAX_EXTERNAL_TIMEOUT_S, "description": "For an agents: target, longest the call may take, in seconds (default 600)"}
            }, "required": ["agent", "request"], "additionalProperties": false});
            tools.insert(
                CALL_AGENT.to_owned(),
                Tool {
                    name: CALL_AGENT.to_owned(),
                    description: format!(
                        "Asks another agent of the team ({}) to do a piece of work and returns its answer. The agent runs as a separate run; this waits for its result.",
                        config.agent_tools.join(", ")
                    ),
                    validator: compile("agent-tools".into(), &parameters)?,
                    parameters,
                    action: Action::CallAgent,
                },
            );
        }
        let mcp = config
            .mcp_servers
            .iter()
            .map(|(name, server)| Arc::new(McpServer::new(name, server, base_dir)))
            .collect();
        Ok(Self { tools, mcp })
    }

    /// The tools of one attempt: these, plus the tools the MCP servers list now. An
    /// unreachable server is an error (the model is not offered a partial set silently).
    pub async fn for_attempt(&self) -> Result<Self, String> {
        if self.mcp.is_empty() {
            return Ok(self.clone());
        }
        let mut set = self.clone();
        for server in &self.mcp {
            for t in server.tools().await? {
                let name = offered_name(server.name(), &t.name);
                if set.tools.contains_key(&name) {
                    tracing::warn!(server = server.name(), tool = %t.name, "Skipping an MCP tool whose name is taken");
                    continue;
                }
                // A schema that does not compile still offers the tool, unchecked.
                let validator = jsonschema::validator_for(&t.input_schema)
                    .or_else(|_| jsonschema::validator_for(&json!({})))
                    .map_err(|e| e.to_string())?;
                set.tools.insert(
                    name.clone(),
                    Tool {
                        name,
                        description: t.description.clone().unwrap_or_default(),
                        parameters: t.input_schema.clone(),
                        validator: Arc::new(validator),
                        action: Action::Mcp(Arc::clone(server), t.name.clone()),
                    },
                );
            }
        }
        Ok(set)
    }

    /// Offers `transfer_to_agent` with `targets` (the agent tree's parent, children and
    /// peers the agent may hand the conversation to). No targets: no tool.
    pub fn with_transfer(mut self, targets: &[String]) -> Self {
        if targets.is_empty() {
            return self;
        }
        let parameters = json!({"type": "object", "properties": {
            "agent_name": {"type": "string", "enum": targets, "description": "The agent to hand the conversation to"},
            "reason": {"type": "string", "description": "Why, in a few words"}
        }, "required": ["agent_name"], "additionalProperties": false});
        if let Ok(validator) = jsonschema::validator_for(&parameters) {
            self.tools.insert(
                TRANSFER.to_owned(),
                Tool {
                    name: TRANSFER.to_owned(),
                    description: format!(
                        "Hands the whole conversation to another agent ({}), which answers the user in your place. Use it when that agent is better suited; you will not answer yourself.",
                        targets.join(", ")
                    ),
                    parameters,
                    validator: Arc::new(validator),
                    action: Action::Transfer,
                },
            );
        }
        self
    }

    /// Offers the run's client tools (the plan's `client_tools`). A tool of the agent's own
    /// with the same name keeps it (logged); a schema that does not compile is skipped
    /// (plans are validated before they run, so neither happens to a checked plan).
    pub fn with_client_tools(mut self, client: &[flotilla_model::plan::ClientTool]) -> Self {
        for t in client {
            if self.tools.contains_key(&t.name) {
                tracing::warn!(tool = %t.name, "The plan's client tool has the name of one of the agent's tools; the agent's is offered");
                continue;
            }
            let Ok(validator) = jsonschema::validator_for(&t.parameters) else {
                tracing::warn!(tool = %t.name, "Skipping a client tool whose parameters are not a JSON Schema");
                continue;
            };
            self.tools.insert(
                t.name.clone(),
                Tool {
                    name: t.name.clone(),
                    description: t.description.clone(),
                    parameters: t.parameters.clone(),
                    validator: Arc::new(validator),
                    action: Action::Client,
                },
            );
        }
        self
    }

    /// Whether `name` is a tool the client runs.
    pub fn is_client(&self, name: &str) -> bool {
        self.tools
            .get(name)
            .is_some_and(|t| matches!(t.action, Action::Client))
    }

    /// The tool `name` and the arguments of a call of it, parsed and checked against its
    /// schema; the problem, as the tool's outcome for the model, when there is no such tool
    /// or they are not valid.
    pub(crate) fn checked_arguments(
        &self,
        name: &str,
        arguments: &str,
    ) -> Result<(&Tool, Value), Box<ToolOutcome>> {
        let Some(tool) = self.tools.get(name) else {
            return Err(Box::new(ToolOutcome::err(
                "unknown_tool",
                format!(
                    "there is no tool named {name:?}; the tools are: {}",
                    self.tools.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            )));
        };
        let args: Value = if arguments.trim().is_empty() {
            Value::Object(Map::new())
        } else {
            serde_json::from_str(arguments).map_err(|e| {
                Box::new(ToolOutcome::err(
                    "invalid_arguments",
                    format!(
                        "the arguments are not valid JSON ({e}); send a JSON object matching the tool's parameters"
                    ),
                ))
            })?
        };
        let problems = schema_problems(&tool.validator, &args);
        if !problems.is_empty() {
            return Err(Box::new(ToolOutcome::err(
                "invalid_arguments",
                format!(
                    "the arguments do not match the tool's parameters: {}",
                    problems.join("; ")
                ),
            )));
        }
        Ok((tool, args))
    }

    /// Whether `name` with `arguments` is a valid transfer; the target when it is.
    pub fn transfer_target(&self, name: &str, arguments: &str) -> Option<(String, String)> {
        let tool = self.tools.get(name)?;
        if !matches!(tool.action, Action::Transfer) {
            return None;
        }
        let args: Value = serde_json::from_str(arguments).ok()?;
        if !tool.validator.is_valid(&args) {
            return None;
        }
        Some((
            str_arg(&args, "agent_name").to_owned(),
            str_arg(&args, "reason").to_owned(),
        ))
    }

    /// The tools, by name.
    pub fn tools(&self) -> impl Iterator<Item = &Tool> {
        self.tools.values()
    }

    /// Whether the agent has a tool named `name`.
    pub fn has(&self, name: &str) -> bool {
        self.tools.contains_key(name)
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    /// Runs the call `name(arguments)`: checks the arguments, then runs the tool. Problems
    /// come back as the outcome's error, for the model. The caller stops waiting when the
    /// attempt is cancelled (dropping the call kills an exec tool's command).
    pub async fn call(
        &self,
        ctx: &AgentContext,
        call_id: &str,
        name: &str,
        arguments: &str,
    ) -> ToolOutcome {
        let (tool, args) = match self.checked_arguments(name, arguments) {
            Ok(checked) => checked,
            Err(problem) => return *problem,
        };
        match &tool.action {
            Action::Builtin(crate::recruit::RECRUIT) => {
                crate::recruit::recruit(ctx, call_id, &args).await
            }
            Action::Builtin(crate::gate::ASK_USER) => ToolOutcome::err(
                "not_answered",
                "ask_user is answered by a person; this call could not wait for one",
            ),
            Action::Builtin(b) if crate::lead_tools::TOOLS.contains(b) => {
                crate::lead_tools::call(ctx, b, &args).await
            }
            Action::Builtin(b) if crate::teammate_tools::TOOLS.contains(b) => {
                crate::teammate_tools::call(ctx, b, &args).await
            }
            Action::Builtin(b) if crate::contract_net::TOOLS.contains(b) => {
                crate::contract_net::call(ctx, call_id, b, &args)
                    .await
                    .map_or_else(|e| ToolOutcome::err(e.code(), e.message()), ToolOutcome::ok)
            }
            Action::Builtin(b) => builtin(ctx, b, &args)
                .await
                .unwrap_or_else(|e| ToolOutcome::err(e.code(), e.message())),
            Action::Exec(t) => exec(ctx, t, &args).await,
            Action::CallAgent => call_agent(ctx, call_id, &args).await,
            Action::Transfer => ToolOutcome::err(
                "invalid_arguments",
                "transfer_to_agent is handled by the agent; this call could not be",
            ),
            Action::Mcp(server, tool) => match server.call(tool, &args).await {
                Ok(v) => ToolOutcome::ok(v),
                Err(m) => ToolOutcome::err("tool_failed", m),
            },
            Action::Client => ToolOutcome::err(
                "not_answered",
                format!("{name} is run by the client; this call could not wait for it"),
            ),
        }
    }
}

/// What is wrong with `value` under `validator`: at most five problems, each with where.
pub(crate) fn schema_problems(validator: &jsonschema::Validator, value: &Value) -> Vec<String> {
    validator
        .iter_errors(value)
        .take(5)
        .map(|e| {
            let at = e.instance_path().to_string();
            if at.is_empty() {
                e.to_string()
            } else {
                format!("at {at}: {e}")
            }
        })
        .collect()
}

fn str_arg<'a>(args: &'a Value, key: &str) -> &'a str {
    args.get(key).and_then(Value::as_str).unwrap_or_default()
}

async fn builtin(
    ctx: &AgentContext,
    name: &str,
    args: &Value,
) -> Result<ToolOutcome, ContextError> {
    Ok(match name {
        "workspace_read" => {
            let since = args.get("since_seq").and_then(Value::as_u64).unwrap_or(0);
            let limit = args
                .get("limit")
                .and_then(Value::as_u64)
                .map(|l| usize::try_from(l).unwrap_or(usize::MAX));
            let page = ctx
                .workspace()
                .read(str_arg(args, "topic"), since, limit)
                .await?;
            ToolOutcome::ok(to_json(&page))
        }
        "workspace_write" => {
            let entry = args
                .get("entry")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            let appended = ctx
                .workspace()
                .append(str_arg(args, "topic"), entry)
                .await?;
            ToolOutcome::ok(to_json(&appended))
        }
        "mailbox_send" => {
            let kind = match args.get("kind").and_then(Value::as_str) {
                None => MailboxKind::Info,
                Some(k) => match k.parse() {
                    Ok(k) => k,
                    Err(e) => return Ok(ToolOutcome::err("invalid_arguments", e)),
                },
            };
            let sent = ctx
                .mailbox()
                .send(
                    str_arg(args, "to"),
                    kind,
                    args.get("payload").cloned().unwrap_or(Value::Null),
                    args.get("correlation_id").and_then(Value::as_str),
                )
                .await?;
            ToolOutcome::ok(to_json(&sent))
        }
        "mailbox_read" => {
            let limit = args
                .get("limit")
                .and_then(Value::as_u64)
                .map(|l| usize::try_from(l).unwrap_or(usize::MAX));
            let wait = args
                .get("wait_ms")
                .and_then(Value::as_u64)
                .unwrap_or(0)
                .min(MAX_MAILBOX_WAIT_MS);
            let page = ctx
                .mailbox()
                .receive(limit, Duration::from_millis(wait))
                .await?;
            ToolOutcome::ok(to_json(&page))
        }
        "state_get" => {
            let key = str_arg(args, "key");
            match ctx.state().get(key).await? {
                Some(v) => ToolOutcome::ok(
                    json!({"key": key, "found": true, "value": v.value, "revision": v.revision}),
                ),
                None => ToolOutcome::ok(json!({"key": key, "found": false, "value": null})),
            }
        }
        _ => {
            let key = str_arg(args, "key");
            let revision = ctx
                .state()
                .set(key, args.get("value").unwrap_or(&Value::Null))
                .await?;
            ToolOutcome::ok(json!({"key": key, "revision": revision}))
        }
    })
}

/// Runs another agent as a child run and hands back its answer. The child's id comes from
/// the attempt and the model's tool call id, so a redelivered attempt replaying the same call
/// re-attaches to the same child.
/// Longest `timeout_s` of a call to an external agent.
const MAX_EXTERNAL_TIMEOUT_S: u64 = 3600;

/// How long a call to an external agent waits for `$SRV.INFO.agents` answers.
const DISCOVERY_WAIT: Duration = Duration::from_secs(1);

async fn call_agent(ctx: &AgentContext, call_id: &str, args: &Value) -> ToolOutcome {
    if let Some(target) = str_arg(args, "agent").strip_prefix(EXTERNAL_PREFIX) {
        return call_external(ctx, call_id, target, args).await;
    }
    let key = child_call_key(call_id);
    let call = flotilla_context::ChildCall {
        agent: str_arg(args, "agent").to_owned(),
        description: str_arg(args, "request").to_owned(),
        input: args.get("input").cloned().unwrap_or(Value::Null),
        call_id: Some(key),
        ..flotilla_context::ChildCall::default()
    };
    match ctx.call_agent(&call).await {
        Err(e) if e.kind() == flotilla_context::ErrorKind::ChildRejected => {
            ToolOutcome::rejected(&e)
        }
        Err(e) => ToolOutcome::err(e.code(), e.message()),
        Ok((child, outcome)) => {
            let mut result = match (&outcome.status, &outcome.final_result) {
                (RunStatus::Succeeded, Some(f)) => ToolOutcome::ok(json!({
                    "agent": call.agent,
                    "response": f.response,
                    "numeric_value": f.numeric_value,
                })),
                _ => ToolOutcome::err(
                    // A spent tree budget or a refused grandchild says so; other failures
                    // are the agent's.
                    flotilla_context::binding_failure(&outcome)
                        .map_or("agent_failed", TaskErrorKind::as_str),
                    format!(
                        "agent {} (child run {}) ended {:?}: {}",
                        call.agent,
                        child.handle.run_id,
                        outcome.status,
                        outcome
                            .failed
                            .first()
                            .map(|f| f.error.message.clone())
                            .or(outcome.reason.clone())
                            .unwrap_or_default()
                    ),
                ),
            };
            result.run_link = Some(child.handle);
            result
        }
    }
}

/// Calls an agent of the NATS Agent Protocol (see the module's docs): its streamed pieces
/// are `tool_update` events of the call `call_id`.
async fn call_external(
    ctx: &AgentContext,
    call_id: &str,
    target: &str,
    args: &Value,
) -> ToolOutcome {
    use flotilla_agents::call::{self, CallEvent, CallOptions, Target};
    let parsed: Target = match target.parse() {
        Ok(t) => t,
        Err(e) => return ToolOutcome::err("invalid_arguments", e),
    };
    let request = str_arg(args, "request");
    let prompt = match args.get("input") {
        None | Some(Value::Null) => request.to_owned(),
        Some(input) => format!("{request}\n\nInput (JSON):\n{input}"),
    };
    if prompt.trim().is_empty() {
        return ToolOutcome::err("invalid_arguments", "request is empty");
    }
    let asked = args
        .get("timeout_s")
        .and_then(Value::as_u64)
        .map_or(Duration::from_secs(600), Duration::from_secs);
    // Never past the attempt's deadline: the attempt would be gone before the answer.
    let left = ctx
        .deadline
        .saturating_duration_since(std::time::Instant::now());
    let opts = CallOptions {
        timeout: asked.min(left).max(Duration::from_millis(1)),
        ..CallOptions::default()
    };
    let nats = ctx.clients().bus().client().clone();
    let work = async {
        let found = call::discover(&nats, DISCOVERY_WAIT).await?;
        let agent = parsed.resolve(&found)?.clone();
        // The agent's questions go to a person as approvals of this attempt.
        let asker = ctx
            .scope
            .task_id
            .clone()
            .zip(ctx.scope.attempt)
            .zip(ctx.scope.attempt_id)
            .map(
                |((task_id, attempt), attempt_id)| flotilla_agents::ask::Asker {
                    client: flotilla_client::Client::new(ctx.clients().bus().clone()),
                    run_id: ctx.scope.run_id,
                    task_id,
                    attempt,
                    attempt_id,
                    agent: format!(
                        "{EXTERNAL_PREFIX}{}.{}.{}",
                        agent.address.agent, agent.address.owner, agent.address.session
                    ),
                    context: prompt.clone(),
                    call_ends: tokio::time::Instant::now() + opts.timeout,
                },
            );
        let envelope = flotilla_agents::wire::Envelope::text(prompt);
        let mut questions = tokio::task::JoinSet::new();
        let response = call::call(&nats, &agent, &envelope, opts, |event| {
            let output = match event {
                CallEvent::Text(t) => Some(json!({"text": t})),
                CallEvent::Query(q) => match asker.clone() {
                    // Answered while the stream goes on (a person's wait may be long).
                    Some(asker) => {
                        let events = ctx.events.clone();
                        let call_id = call_id.to_owned();
                        questions.spawn(async move {
                            let output = match flotilla_agents::ask::ask_and_answer(&asker, &q).await {
                                Ok(a) => json!({"query": q.prompt, "answered": true, "approval_id": a.approval_id,
                                                "status": a.status.as_str(), "reply": a.reply}),
                                Err(e) => json!({"query": q.prompt, "answered": false, "error": e}),
                            };
                            events
                                .emit(flotilla_model::event::Event::ToolUpdate { call_id, output })
                                .await;
                        });
                        None
                    }
                    None => Some(json!({"query": q.prompt, "answered": false})),
                },
                CallEvent::Status(_) => None,
            };
            let events = ctx.events.clone();
            let call_id = call_id.to_owned();
            async move {
                if let Some(output) = output {
                    events
                        .emit(flotilla_model::event::Event::ToolUpdate { call_id, output })
                        .await;
                }
            }
        })
        .await;
        // A question still waiting when the call ends is moot: nobody reads its answer.
        questions.abort_all();
        let response = response?;
        Ok::<_, call::CallError>((agent, response))
    };
    tokio::select! {
        r = work => match r {
            Ok((agent, response)) => ToolOutcome::ok(json!({
                "agent": format!("{EXTERNAL_PREFIX}{}.{}.{}", agent.address.agent, agent.address.owner, agent.address.session),
                "response": response,
            })),
            Err(e) => ToolOutcome::err(e.code(), e.to_string()),
        },
        _ = ctx.cancel.cancelled() => ToolOutcome::err("cancelled", "the attempt was cancelled during the call"),
    }
}

/// Longest stderr tail in an exec tool's error.
const STDERR_TAIL: usize = 2048;

async fn exec(ctx: &AgentContext, tool: &ExecTool, args: &Value) -> ToolOutcome {
    let c = &tool.config;
    let mut cmd = tokio::process::Command::new(&c.command);
    cmd.args(&c.args)
        .envs(&c.env)
        .envs(ctx.clients().agent_env())
        .current_dir(&tool.cwd)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            return ToolOutcome::err(
                "tool_failed",
                format!("cannot run {:?} in {}: {e}", c.command, tool.cwd.display()),
            );
        }
    };
    if let Some(mut stdin) = child.stdin.take() {
        // A command that ignores its input may close stdin early; that is fine.
        let _ = stdin.write_all(args.to_string().as_bytes()).await;
        drop(stdin);
    }
    // Dropping the future on timeout kills the command (`kill_on_drop`).
    let output = match tokio::time::timeout(c.timeout, child.wait_with_output()).await {
        Ok(Ok(o)) => o,
        Ok(Err(e)) => {
            return ToolOutcome::err("tool_failed", format!("waiting for {:?}: {e}", c.command));
        }
        Err(_) => {
            return ToolOutcome::err(
                "tool_timeout",
                format!(
                    "{:?} did not finish within {}",
                    c.command,
                    humantime_serde::re::humantime::format_duration(c.timeout)
                ),
            );
        }
    };
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let mut start = stderr.len().saturating_sub(STDERR_TAIL);
        while !stderr.is_char_boundary(start) {
            start += 1;
        }
        return ToolOutcome::err(
            "tool_failed",
            format!(
                "{:?} exited with {}: {}",
                c.command,
                output.status,
                stderr[start..].trim()
            ),
        );
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let trimmed = stdout.trim();
    ToolOutcome::ok(
        serde_json::from_str::<Value>(trimmed).unwrap_or_else(|_| Value::String(trimmed.into())),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::call::cut;

    #[test]
    fn builtin_schemas_compile_and_cut_is_marked() {
        let config = LlmConfig::new("http://h/v1", "m");
        let set = ToolSet::from_config("a", &config, Path::new(".")).expect("tools");
        assert_eq!(set.tools().count(), BUILTIN_TOOLS.len());
        // The opt-in tools' schemas compile too.
        let mut config = LlmConfig::new("http://h/v1", "m");
        config.tools = OPT_IN_TOOLS.iter().map(|t| (*t).to_owned()).collect();
        let set = ToolSet::from_config("a", &config, Path::new(".")).expect("opt-in tools");
        assert_eq!(set.tools().count(), OPT_IN_TOOLS.len());
        // Each has its own spec (an unmatched name would fall through to `state_set`'s).
        let described: std::collections::BTreeSet<&str> =
            set.tools().map(|t| t.description.as_str()).collect();
        assert_eq!(described.len(), OPT_IN_TOOLS.len(), "{described:?}");
        let text = cut(&"é".repeat(100), 51);
        assert!(text.starts_with(&"é".repeat(25)));
        assert!(text.contains("bytes cut"), "{text}");
    }
}
