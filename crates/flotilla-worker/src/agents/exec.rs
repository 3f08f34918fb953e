//! The `exec` agent: runs a command per task.
//!
//! The task envelope is written to the command's stdin as JSON. The environment carries the
//! attempt's scope and connection, so the `flotilla ws|mbox|state|artifacts` commands work
//! inside the command without flags: `FLOTILLA_RUN_ID`, `FLOTILLA_ROOT_RUN_ID`,
//! `FLOTILLA_TASK_ID`, `FLOTILLA_ATTEMPT`, `FLOTILLA_ATTEMPT_ID`, `FLOTILLA_DELIVERY`,
//! `FLOTILLA_SESSION_ID`, `FLOTILLA_PREFIX`, `FLOTILLA_PRODUCES`, `FLOTILLA_DATAFLOW`,
//! `FLOTILLA_NATS_URL` and, when the worker authenticates, its credentials
//! (`FLOTILLA_NATS_USER`/`FLOTILLA_NATS_PASSWORD`, `FLOTILLA_NATS_TOKEN`,
//! `FLOTILLA_NATS_CREDS`, `FLOTILLA_NATS_NKEY`), and `FLOTILLA_BIN`, the absolute path of the
//! `flotilla` executable, so scripts run `"$FLOTILLA_BIN" ws write …` without relying on
//! `PATH` (see [`flotilla_bin`]). When the command succeeds, the mailbox read
//! position its `flotilla mbox read` calls persisted is taken over, and the worker commits
//! it with the result. Stdout is the response: a JSON object
//! with a string `response` (and optionally `tokens`, `tools_used`, `numeric_value`), or plain
//! text. A non-zero exit is a failure carrying the end of stderr: `agent_failed`, or
//! `child_rejected` (not retried) when a `flotilla call` of the attempt had its child run
//! rejected (`rejected.<root>.<attempt>` in the cursors bucket). `TRACEPARENT` carries the
//! attempt's trace context, so the child runs of `flotilla call` join the run's trace. The command runs in its own
//! process group, which is killed when the attempt is cancelled or times out, and — through
//! the [exec shim](super::shim) — when the worker itself dies.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;

use futures::future::BoxFuture;
use tokio::io::AsyncWriteExt;

use super::ExecConfig;
use crate::agent::{Agent, AgentContext, AgentError, AgentReply};
use flotilla_model::task::{TaskEnvelope, TaskErrorKind};

/// Runs a command.
#[derive(Debug, Clone)]
pub struct ExecAgent {
    name: String,
    config: ExecConfig,
    cwd: PathBuf,
}

/// `FLOTILLA_BIN`: the `flotilla` executable, for the agent's `flotilla ws|mbox|state|artifacts`
/// calls.
pub(crate) const ENV_FLOTILLA_BIN: &str = "FLOTILLA_BIN";

/// The `flotilla` executable handed to commands as `FLOTILLA_BIN`, computed once: the
/// worker's own `FLOTILLA_BIN` when it has one (an embedder whose process is not the
/// `flotilla` binary points it at the CLI), else the running executable. `None` when neither
/// is known; the variable is then not set.
pub(crate) fn flotilla_bin() -> Option<&'static OsString> {
    static BIN: OnceLock<Option<OsString>> = OnceLock::new();
    BIN.get_or_init(|| {
        std::env::var_os(ENV_FLOTILLA_BIN)
            .filter(|b| !b.is_empty())
            .or_else(|| std::env::current_exe().ok().map(PathBuf::into_os_string))
    })
    .as_ref()
}

/// Longest stderr tail kept in an error.
const STDERR_TAIL: usize = 2048;

impl ExecAgent {
    /// An agent running `config`; relative paths resolve against `base_dir`.
    pub fn new(name: &str, config: &ExecConfig, base_dir: &Path) -> Result<Self, String> {
        if config.command.trim().is_empty() {
            return Err(format!("agents.{name}: command is empty"));
        }
        let cwd = match &config.cwd {
            Some(p) if p.is_absolute() => p.clone(),
            Some(p) => base_dir.join(p),
            None => base_dir.to_path_buf(),
        };
        Ok(Self {
            name: name.to_owned(),
            config: config.clone(),
            cwd,
        })
    }
}

/// Kills the whole process group unless the command finished.
struct GroupGuard {
    pgid: Option<i32>,
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if let Some(pgid) = self.pgid {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pgid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

fn parse_stdout(stdout: &str) -> AgentReply {
    let trimmed = stdout.trim();
    if trimmed.starts_with('{')
        && let Ok(v) = serde_json::from_str::<serde_json::Value>(trimmed)
        && let Some(response) = v.get("response").and_then(|r| r.as_str())
    {
        return AgentReply {
            response: response.to_owned(),
            tokens: v
                .get("tokens")
                .and_then(serde_json::Value::as_u64)
                .unwrap_or(0),
            tools_used: v
                .get("tools_used")
                .and_then(|t| t.as_array())
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default(),
            numeric_value: v.get("numeric_value").and_then(serde_json::Value::as_f64),
            confidence: v
                .get("confidence")
                .and_then(serde_json::Value::as_f64)
                .and_then(flotilla_model::task::valid_confidence),
        };
    }
    AgentReply::text(trimmed)
}

impl Agent for ExecAgent {
    fn run<'a>(
        &'a self,
        task: &'a TaskEnvelope,
        ctx: AgentContext,
    ) -> BoxFuture<'a, Result<AgentReply, AgentError>> {
        Box::pin(async move {
            let input = serde_json::to_vec(task)
                .map_err(|e| AgentError::failed(format!("encoding the envelope: {e}")))?;
            let mut cmd = match super::shim::exec_shim() {
                Some([shim, shim_args @ ..]) => {
                    let mut c = tokio::process::Command::new(shim);
                    c.args(shim_args)
                        .arg("--")
                        .arg(&self.config.command)
                        .env(super::shim::SHIM_PARENT_ENV, std::process::id().to_string());
                    c
                }
                _ => tokio::process::Command::new(&self.config.command),
            };
            if let Some(bin) = flotilla_bin() {
                cmd.env(ENV_FLOTILLA_BIN, bin);
            }
            cmd.args(&self.config.args)
                .envs(&self.config.env)
                .envs(ctx.clients().agent_env())
                .current_dir(&self.cwd)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .process_group(0)
                .kill_on_drop(true);
            let mut child = cmd.spawn().map_err(|e| {
                AgentError::failed(format!(
                    "agent {}: cannot run {:?} in {}: {e}",
                    self.name,
                    self.config.command,
                    self.cwd.display()
                ))
            })?;
            let mut guard = GroupGuard {
                pgid: child.id().and_then(|p| i32::try_from(p).ok()),
            };
            if let Some(mut stdin) = child.stdin.take() {
                // A command that ignores its input may close stdin early; that is fine.
                let _ = stdin.write_all(&input).await;
                drop(stdin);
            }
            let output = tokio::select! {
                out = child.wait_with_output() => out.map_err(|e| AgentError::failed(format!("waiting for {:?}: {e}", self.config.command)))?,
                _ = ctx.cancel.cancelled() => {
                    // Dropping the child future and the guard kills the process group.
                    return Err(AgentError::cancelled("cancelled; the command was killed"));
                }
            };
            guard.pgid = None;
            let stdout = String::from_utf8_lossy(&output.stdout);
            if output.status.success() {
                if let Err(e) = ctx.mailbox().adopt_execution_position().await {
                    tracing::warn!(agent = %self.name, error = %e, "Could not take over the mailbox read position of the command; its messages will be read again by a later attempt");
                }
                Ok(parse_stdout(&stdout))
            } else {
                let stderr = String::from_utf8_lossy(&output.stderr);
                let tail = if stderr.len() > STDERR_TAIL {
                    let mut start = stderr.len() - STDERR_TAIL;
                    while !stderr.is_char_boundary(start) {
                        start += 1;
                    }
                    &stderr[start..]
                } else {
                    &stderr[..]
                };
                let message = format!(
                    "{} exited with {}: {}",
                    self.config.command,
                    output.status,
                    tail.trim()
                );
                // A command that gives up after one of its `flotilla call`s was rejected fails
                // for good: a new attempt would start a new subtree, rejected alike.
                match ctx.clients().rejected_child().await {
                    Ok(Some(rejected)) => Err(AgentError {
                        kind: TaskErrorKind::ChildRejected,
                        message: format!(
                            "{message} (after child run {} was rejected: {})",
                            rejected.child,
                            rejected.codes()
                        ),
                    }),
                    Ok(None) => Err(AgentError::failed(message)),
                    Err(e) => {
                        tracing::debug!(error = %e, "Could not read whether a child run of the attempt was rejected");
                        Err(AgentError::failed(message))
                    }
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stdout_json_or_text() {
        let r = parse_stdout(
            "{\"response\": \"growth 12%\", \"tokens\": 7, \"numeric_value\": 12.0}\n",
        );
        assert_eq!(r.response, "growth 12%");
        assert_eq!(r.tokens, 7);
        assert_eq!(r.numeric_value, Some(12.0));
        let r = parse_stdout("  plain answer \n");
        assert_eq!(r.response, "plain answer");
        let r = parse_stdout("{\"not_response\": 1}");
        assert_eq!(r.response, "{\"not_response\": 1}");
    }
}
