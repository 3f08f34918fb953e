//! MCP tools: the tools of Model Context Protocol servers, offered to the model.
//!
//! ```toml
//! [agents.analyst.mcp-servers.files]      # a stdio server, started by the worker
//! command = "python3"
//! args = ["tools/files_mcp.py"]
//!
//! [agents.analyst.mcp-servers.search]     # a streamable HTTP server
//! url = "http://127.0.0.1:9000/mcp"
//! tools = ["search"]                      # optional allow-list
//! timeout = "30s"                         # connecting, listing, and each call
//! ```
//!
//! The client is the official SDK (`rmcp`). Each worker connects to a server the first time
//! an attempt of the agent needs it and keeps the connection (a stdio server runs as a child
//! of the worker and ends with it); a broken connection is opened again by the next attempt.
//! The server's tools are listed at every attempt and offered as `<server>__<tool>` with the
//! server's input schema, against which arguments are checked before the call. A result
//! marked `isError`, a timeout or a transport failure becomes an error result for the model,
//! as with every tool. A server that cannot be reached fails the attempt (`agent_failed`,
//! retried): the model is never offered a partial tool set silently.
//!
//! Limitation: streamable HTTP servers are reached over plain `http://` only (the HTTP client
//! has no TLS); put an `https://` server behind a local proxy, or run it over stdio.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rmcp::ServiceExt;
use rmcp::model::{CallToolRequestParams, CallToolResult};
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tokio::sync::Mutex;

/// `[agents.NAME.mcp-servers.SERVER]`: one MCP server, by command (stdio) or URL.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct McpServerConfig {
    /// Program of a stdio server (looked up on `PATH` unless it contains a `/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// Its arguments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// Extra environment variables of the stdio server.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Working directory of the stdio server (relative: to the config file's directory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<PathBuf>,
    /// URL of a streamable HTTP server (`http://…`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Offer only these tools of the server (default: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<String>>,
    /// Longest connecting, listing or one call may take (default 60 s).
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
}

fn default_timeout() -> Duration {
    Duration::from_secs(60)
}

impl McpServerConfig {
    /// What is wrong with it, if anything (`Err((field suffix, message))`).
    pub(crate) fn check(&self) -> Result<(), (&'static str, String)> {
        match (&self.command, &self.url) {
            (Some(_), Some(_)) => {
                return Err(("command", "and url are both set; a server has one".into()));
            }
            (None, None) => {
                return Err(("command", "or url is needed".into()));
            }
            (Some(c), None) if c.trim().is_empty() => {
                return Err(("command", "is empty".into()));
            }
            (None, Some(u)) => match reqwest::Url::parse(u) {
                Ok(url) if url.scheme() == "http" && url.host_str().is_some() => {}
                Ok(url) if url.scheme() == "https" => {
                    return Err((
                        "url",
                        format!(
                            "{u:?}: https MCP servers are not supported yet (the MCP HTTP client has no TLS); use a stdio server or a local http proxy"
                        ),
                    ));
                }
                _ => return Err(("url", format!("{u:?} is not an http:// URL"))),
            },
            _ => {}
        }
        if self.timeout.is_zero() {
            return Err(("timeout", "must be above zero".into()));
        }
        Ok(())
    }
}

type Client = RunningService<RoleClient, ()>;

/// One server as a worker uses it: its connection, opened on first use.
#[derive(Debug)]
pub(crate) struct McpServer {
    name: String,
    config: McpServerConfig,
    cwd: PathBuf,
    client: Mutex<Option<Arc<Client>>>,
}

/// A tool of an MCP server.
#[derive(Debug, Clone)]
pub(crate) struct McpTool {
    /// The server's name for it.
    pub(crate) name: String,
    pub(crate) description: Option<String>,
    pub(crate) input_schema: Value,
}

impl McpServer {
    pub(crate) fn new(name: &str, config: &McpServerConfig, base_dir: &std::path::Path) -> Self {
        let cwd = match &config.cwd {
            Some(p) if p.is_absolute() => p.clone(),
            Some(p) => base_dir.join(p),
            None => base_dir.to_path_buf(),
        };
        Self {
            name: name.to_owned(),
            config: config.clone(),
            cwd,
            client: Mutex::new(None),
        }
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    async fn connect(&self) -> Result<Client, String> {
        let connecting = async {
            if let Some(command) = &self.config.command {
                let mut cmd = tokio::process::Command::new(command);
                cmd.args(&self.config.args)
                    .envs(&self.config.env)
                    .current_dir(&self.cwd);
                let (transport, _stderr) = TokioChildProcess::builder(cmd)
                    .stderr(std::process::Stdio::inherit())
                    .spawn()
                    .map_err(|e| {
                        format!("cannot start {command:?} in {}: {e}", self.cwd.display())
                    })?;
                ().serve(transport)
                    .await
                    .map_err(|e| format!("initialising: {e}"))
            } else {
                let url = self.config.url.clone().unwrap_or_default();
                ().serve(StreamableHttpClientTransport::from_uri(url))
                    .await
                    .map_err(|e| format!("initialising: {e}"))
            }
        };
        tokio::time::timeout(self.config.timeout, connecting)
            .await
            .map_err(|_| format!("no answer within {:?}", self.config.timeout))?
    }

    /// The open connection, connecting (again) when there is none or it closed.
    async fn client(&self) -> Result<Arc<Client>, String> {
        let mut slot = self.client.lock().await;
        if let Some(c) = slot.as_ref()
            && !c.is_closed()
        {
            return Ok(Arc::clone(c));
        }
        let client = Arc::new(
            self.connect()
                .await
                .map_err(|e| format!("MCP server {}: {e}", self.name))?,
        );
        *slot = Some(Arc::clone(&client));
        Ok(client)
    }

    async fn forget(&self) {
        *self.client.lock().await = None;
    }

    /// The server's tools (after the allow-list).
    pub(crate) async fn tools(&self) -> Result<Vec<McpTool>, String> {
        let client = self.client().await?;
        let listed = tokio::time::timeout(self.config.timeout, client.list_all_tools()).await;
        let tools = match listed {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => {
                self.forget().await;
                return Err(format!("MCP server {}: listing tools: {e}", self.name));
            }
            Err(_) => {
                self.forget().await;
                return Err(format!(
                    "MCP server {}: listing tools took longer than {:?}",
                    self.name, self.config.timeout
                ));
            }
        };
        Ok(tools
            .into_iter()
            .filter(|t| {
                self.config
                    .tools
                    .as_ref()
                    .is_none_or(|allowed| allowed.iter().any(|a| a == t.name.as_ref()))
            })
            .map(|t| McpTool {
                name: t.name.to_string(),
                description: t.description.map(|d| d.to_string()),
                input_schema: Value::Object((*t.input_schema).clone()),
            })
            .collect())
    }

    /// Calls `tool`; `Err` carries the message for the model.
    pub(crate) async fn call(&self, tool: &str, args: &Value) -> Result<Value, String> {
        let client = self.client().await?;
        let mut params = CallToolRequestParams::new(tool.to_owned());
        if let Value::Object(m) = args {
            params = params.with_arguments(m.clone());
        } else {
            params = params.with_arguments(Map::new());
        }
        let called = tokio::time::timeout(self.config.timeout, client.call_tool(params)).await;
        match called {
            Ok(Ok(result)) => result_value(result),
            Ok(Err(e)) => {
                if client.is_closed() {
                    self.forget().await;
                }
                Err(format!("MCP server {}: {e}", self.name))
            }
            Err(_) => Err(format!(
                "MCP server {}: {tool} did not answer within {:?}",
                self.name, self.config.timeout
            )),
        }
    }
}

/// A tool result as JSON: the structured content, else the text blocks (joined), else the
/// blocks themselves; an `isError` result is an error with that text.
fn result_value(result: CallToolResult) -> Result<Value, String> {
    let text: Vec<String> = result
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect();
    if result.is_error == Some(true) {
        return Err(if text.is_empty() {
            "the tool reported an error".into()
        } else {
            text.join("\n")
        });
    }
    if let Some(v) = result.structured_content {
        return Ok(v);
    }
    if text.len() == result.content.len() {
        let joined = text.join("\n");
        return Ok(serde_json::from_str(&joined).unwrap_or(Value::String(joined)));
    }
    Ok(serde_json::to_value(&result.content).unwrap_or(Value::Null))
}

/// The name a server's tool is offered under: `<server>__<tool>`, cut to the 64 characters
/// chat APIs allow, characters other than letters, digits, `_` and `-` replaced by `_`.
pub(crate) fn offered_name(server: &str, tool: &str) -> String {
    let raw = format!("{server}__{tool}");
    raw.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_configs() {
        assert_eq!(offered_name("files", "read.file"), "files__read_file");
        assert_eq!(offered_name("s", &"x".repeat(100)).len(), 64);
        let stdio = McpServerConfig {
            command: Some("python3".into()),
            args: Vec::new(),
            env: BTreeMap::new(),
            cwd: None,
            url: None,
            tools: None,
            timeout: default_timeout(),
        };
        assert!(stdio.check().is_ok());
        let both = McpServerConfig {
            url: Some("http://h/mcp".into()),
            ..stdio.clone()
        };
        assert_eq!(both.check().expect_err("both").0, "command");
        let https = McpServerConfig {
            command: None,
            url: Some("https://h/mcp".into()),
            ..stdio
        };
        assert!(
            https
                .check()
                .expect_err("https")
                .1
                .contains("not supported")
        );
    }
}
