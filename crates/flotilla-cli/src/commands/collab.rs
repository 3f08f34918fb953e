//! `flotilla ws | mbox | state | artifacts`: the agent context (workspace topics, mailboxes,
//! session state, artifacts) from the command line, for agents in any language and for
//! operators.
//!
//! **Scope.** Inside an exec agent the commands need no flags: the worker sets the attempt's
//! scope (`FLOTILLA_RUN_ID`, `FLOTILLA_TASK_ID`, `FLOTILLA_ATTEMPT_ID`, …) and connection
//! (`FLOTILLA_NATS_URL` and credentials) in the command's environment, and
//! [`Scope::from_env`] / [`flotilla_context::connection_from_env`] read them back. Each call
//! is a new process, so the mailbox read position of the execution is persisted after every
//! `mbox read` ([`Clients::persist_read_position`]): the next `mbox read` of the same
//! execution continues where the previous one stopped, and the worker commits the position
//! when the attempt succeeds (a failed or crashed attempt's successor reads the same messages
//! again: at-least-once). Outside an agent, `--run RUN` acts as an operator on that run (its
//! workspace, mailboxes, session state and artifacts), with `--as TASK` for an identity where
//! one is needed (reading or sending mail).
//!
//! **Connection.** `--nats-url` and `--config` win; otherwise, inside an agent, the worker's
//! `FLOTILLA_NATS_URL` and credentials; otherwise the usual configuration.
//!
//! **Output.** One JSON document on stdout (JSON lines for `ws watch`; raw bytes for
//! `artifacts get`). Errors are one JSON object on stderr, `{"error": {"code", "message"}}`,
//! with exit code 2 for invalid input and 1 for everything else ([`EXIT_CODES`]).

use std::io::{IsTerminal, Read};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use bytes::Bytes;
use clap::{Args, Subcommand};
use flotilla_bus::{Bus, NatsOptions};
use flotilla_context::{Clients, ContextError, Scope};
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::mailbox::MailboxKind;
use futures::StreamExt;
use serde::Serialize;
use serde_json::{Value, json};

use crate::config;

/// Exit codes and error format, shown in the help of every command group.
pub(crate) const EXIT_CODES: &str = "\
Output: one JSON document on stdout (`ws watch`: one JSON entry per line; `artifacts get`: the
raw bytes).

Errors: one JSON object on stderr, {\"error\": {\"code\": \"...\", \"message\": \"...\"}} (a lost
compare-and-set also carries \"current_revision\"; `call`'s child_rejected carries \"run_id\"
and \"problems\"), and the exit code:
  0  success
  2  invalid input, nothing was changed: invalid_topic, undeclared_topic, entry_too_large,
     invalid_address, payload_too_large, invalid_key, value_too_large, invalid_name,
     invalid_json, invalid_argument, invalid_scope, invalid_config, unknown_role
  1  anything else: not_found, conflict, timeout, unavailable, malformed, io, child_failed,
     child_rejected, no_offers (`mbox negotiate`: nobody offered in time)
Usage errors found by the argument parser (unknown flags, missing arguments) are plain text,
exit 2.

Scope: inside an exec agent, the environment the worker sets (FLOTILLA_RUN_ID, FLOTILLA_TASK_ID,
FLOTILLA_NATS_URL, ...); outside one, --run RUN (and --as TASK where an identity is needed).";

/// Input larger than this is refused before parsing (every JSON value stored is far smaller).
const MAX_JSON_INPUT: u64 = 8 * 1024 * 1024;

/// Who acts: the agent's environment by default, or an operator on a run.
#[derive(Debug, Args)]
pub(crate) struct ScopeArgs {
    /// Act as an operator on this run (outside an agent). Default: the scope the worker sets
    /// for an exec agent (FLOTILLA_RUN_ID, FLOTILLA_TASK_ID, …).
    #[arg(long, global = true, value_name = "RUN_ID")]
    run: Option<RunId>,
    /// With --run: act as this task (the mailbox address to read or send as; the writer
    /// task of workspace entries).
    #[arg(long = "as", global = true, value_name = "ADDRESS")]
    as_task: Option<String>,
}

/// `flotilla ws`.
#[derive(Debug, Args)]
pub(crate) struct WsArgs {
    #[command(flatten)]
    scope: ScopeArgs,
    #[command(subcommand)]
    command: WsCommand,
}

#[derive(Debug, Subcommand)]
enum WsCommand {
    /// Append an entry (a JSON object) to a topic. Prints {seq, topic, duplicate}.
    Write {
        /// Topic (normalised: trimmed, lower case, spaces to `_`).
        topic: String,
        /// The entry, a JSON object; `-` or absent: read it from stdin.
        #[arg(conflicts_with = "file")]
        json: Option<String>,
        /// Read the entry from this file.
        #[arg(long, value_name = "PATH")]
        file: Option<PathBuf>,
        /// Outside an attempt: repeats with this key are stored once (inside one, the
        /// attempt's own id makes writes idempotent).
        #[arg(long, value_name = "KEY")]
        idempotency_key: Option<String>,
    },
    /// One page of a topic's entries after --since (or, with --all, of every topic of the
    /// run). Prints {entries, next_since_seq, more}: continue with --since NEXT_SINCE_SEQ
    /// while more is true.
    Read {
        /// Topic (required unless --all).
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        topic: Option<String>,
        /// Every topic of the run.
        #[arg(long)]
        all: bool,
        /// Entries with a sequence number above this.
        #[arg(long, default_value_t = 0, value_name = "SEQ")]
        since: u64,
        /// Entries per page (default 200, at most 1000).
        #[arg(long, value_name = "N")]
        limit: Option<usize>,
    },
    /// `read --all`: one page of every topic of the run.
    ReadAll {
        /// Entries with a sequence number above this.
        #[arg(long, default_value_t = 0, value_name = "SEQ")]
        since: u64,
        /// Entries per page (default 200, at most 1000).
        #[arg(long, value_name = "N")]
        limit: Option<usize>,
    },
    /// The entries of a topic after --since, live: one JSON entry per line, the stored ones
    /// first, then each new one as it is written. Ends after --count entries or at --timeout
    /// (an error, exit 1, when --count entries did not come by then).
    Watch {
        /// Topic (absent: every topic of the run).
        topic: Option<String>,
        /// Entries with a sequence number above this.
        #[arg(long, default_value_t = 0, value_name = "SEQ")]
        since: u64,
        /// Stop after this many entries.
        #[arg(long, value_name = "N")]
        count: Option<u64>,
        /// Stop after this long (seconds, or e.g. `500ms`, `2m`).
        #[arg(long, value_name = "SECS", value_parser = parse_duration)]
        timeout: Option<Duration>,
    },
    /// Store FILE (or stdin, `-`) as artifact NAME of the run and append a reference entry
    /// {"artifact": {bucket, name, size, sha256}} to TOPIC: the way to share data larger
    /// than an entry. Prints {artifact, seq, topic, duplicate}.
    PutArtifact {
        /// Topic of the reference entry.
        topic: String,
        /// Artifact name (`/`-separated segments of letters, digits, `.`, `_`, `-`).
        name: String,
        /// The content; `-`: stdin.
        file: String,
    },
}

/// `flotilla mbox`.
#[derive(Debug, Args)]
pub(crate) struct MboxArgs {
    #[command(flatten)]
    scope: ScopeArgs,
    #[command(subcommand)]
    command: MboxCommand,
}

#[derive(Debug, Subcommand)]
enum MboxCommand {
    /// Send a message to a task of the run (or `*`: every task). Never waits for the
    /// receiver. Prints {seq, n, duplicate}.
    Send {
        /// Recipient: a task id, `*` to broadcast, or `role:<name>` (read by exactly one task
        /// of the run tree playing the role: the first to read it).
        to: String,
        /// The payload (any JSON); `-` or absent: read it from stdin.
        #[arg(conflicts_with = "file")]
        payload: Option<String>,
        /// Read the payload from this file.
        #[arg(long, value_name = "PATH")]
        file: Option<PathBuf>,
        /// Message type: request, offer, accept, delegation or info.
        #[arg(long = "type", default_value = "info", value_name = "TYPE")]
        kind: String,
        /// Ties a conversation together (request → offers → accept → delegation).
        #[arg(long, value_name = "ID")]
        correlation_id: Option<String>,
        /// Outside an attempt: repeats with this key to the same recipient are sent once.
        #[arg(long, value_name = "KEY")]
        idempotency_key: Option<String>,
    },
    /// The messages after the read position (the inbox, the broadcasts of the others and,
    /// inside a task with a role, the role's messages it claims first), oldest first; moves the position past them. Prints {messages, next_since_seq, more}.
    /// Inside an agent the position persists across calls of the same execution and is
    /// committed when the attempt succeeds; an operator's read (--run --as) moves nothing
    /// unless --commit.
    Read {
        /// Messages per read (default 100, at most 1000).
        #[arg(long, value_name = "N")]
        limit: Option<usize>,
        /// With nothing unread, wait this long for a message (seconds, or e.g. `500ms`).
        #[arg(long, value_name = "SECS", value_parser = parse_duration)]
        wait: Option<Duration>,
        /// Peek at the messages after this sequence number, moving nothing.
        #[arg(long, value_name = "SEQ", conflicts_with_all = ["wait", "commit"])]
        since: Option<u64>,
        /// Commit the position after reading (the messages count as consumed now).
        #[arg(long)]
        commit: bool,
    },
    /// Per sender: posts sent, retained and dropped by the cap; the owner's committed cursor
    /// and unread count.
    Stats {
        /// A task id, or `*` for the broadcast box (default: this task's own).
        mailbox: Option<String>,
    },
    /// Commit the read position now (inside an agent the worker also commits it when the
    /// attempt succeeds). Prints {committed, cursor}.
    Commit,
    /// Contract-net initiator: send a call for offers (`request`) to every candidate, collect
    /// their offers until all answered or --deadline, then award the work (`accept` and
    /// `delegation`) to the highest confidence (ties: the lowest task id) and tell the others
    /// it is closed. Prints {outcome: "awarded", correlation_id, candidates, winner,
    /// confidence, offers, delegation_seq}; with no offer in time, exit 1 and the error
    /// no_offers (carrying correlation_id and candidates).
    Negotiate {
        /// Comma separated: task ids, and `role:<name>` for every task of the run tree that
        /// plays the role (this task left out).
        #[arg(long, value_name = "LIST")]
        candidates: String,
        /// The call for offers (any JSON).
        #[arg(long, value_name = "JSON")]
        request: String,
        /// The work delegated to the winner (any JSON).
        #[arg(long, value_name = "JSON")]
        work: String,
        /// How long to collect offers (seconds, or e.g. `500ms`, `2m`).
        #[arg(long, value_name = "SECS", value_parser = parse_duration, default_value = "5s")]
        deadline: Duration,
        /// Ties the messages together. Default inside an agent: derived from the attempt,
        /// the candidates, the request and the work, so a retried delivery that negotiates the
        /// same again finds its predecessor's offers (and two identical negotiations of one
        /// attempt are one); outside one: a fresh id.
        #[arg(long, value_name = "ID")]
        correlation_id: Option<String>,
    },
    /// Contract-net responder: the next call for offers (`request`) after the read position
    /// that this execution has not been given yet, without moving the read position. Prints
    /// {request: MESSAGE or null}.
    NextRequest {
        /// With none there, wait this long for one (bare --wait: 30 s).
        #[arg(long, value_name = "SECS", value_parser = parse_duration, num_args = 0..=1, default_missing_value = "30")]
        wait: Option<Duration>,
    },
    /// Contract-net responder: offer to do the request with this correlation id. Prints
    /// {seq, n, duplicate}.
    Offer {
        /// The request's correlation id.
        #[arg(long = "correlation", value_name = "ID")]
        correlation: String,
        /// How well this task can do it (a number; the highest wins).
        #[arg(long, value_name = "X")]
        confidence: String,
        /// More for the initiator (any JSON; an object's fields travel beside confidence).
        #[arg(long, value_name = "JSON")]
        payload: Option<String>,
    },
    /// Contract-net responder: wait for the outcome of the request with this correlation id.
    /// Prints {awarded: true, delegation: MESSAGE} when this task won (the delegation carries
    /// the work), else {awarded: false, delegation: null} (another won, or nothing was
    /// decided within --wait).
    AwaitAward {
        /// The request's correlation id.
        #[arg(long = "correlation", value_name = "ID")]
        correlation: String,
        /// How long to wait (bare --wait: 30 s; default 0: look once).
        #[arg(long, value_name = "SECS", value_parser = parse_duration, num_args = 0..=1, default_missing_value = "30")]
        wait: Option<Duration>,
    },
}

/// `flotilla state`.
#[derive(Debug, Args)]
pub(crate) struct StateArgs {
    #[command(flatten)]
    scope: ScopeArgs,
    #[command(subcommand)]
    command: StateCommand,
}

#[derive(Debug, Subcommand)]
enum StateCommand {
    /// The value of KEY: {key, value, revision, ts}; not_found (exit 1) when unset.
    Get {
        /// Key (letters, digits, `_`, `-`).
        key: String,
    },
    /// Set KEY to a JSON value. Prints {key, revision}.
    Set {
        /// Key (letters, digits, `_`, `-`).
        key: String,
        /// The value (any JSON); `-` or absent: read it from stdin.
        #[arg(conflicts_with = "file")]
        json: Option<String>,
        /// Read the value from this file.
        #[arg(long, value_name = "PATH")]
        file: Option<PathBuf>,
        /// Compare-and-set: write only if KEY is at this revision (0: only if unset); a lost
        /// race is `conflict` (exit 1) with the current revision.
        #[arg(long, value_name = "N")]
        if_revision: Option<u64>,
    },
    /// Delete KEY (nothing happens when it is unset). Prints {key, deleted}.
    Delete {
        /// Key.
        key: String,
    },
    /// The keys set in the session. Prints {session, keys}.
    List,
}

/// `flotilla artifacts`.
#[derive(Debug, Args)]
pub(crate) struct ArtifactsArgs {
    #[command(flatten)]
    scope: ScopeArgs,
    #[command(subcommand)]
    command: ArtifactsCommand,
}

#[derive(Debug, Subcommand)]
enum ArtifactsCommand {
    /// Store FILE (or stdin, `-`) as artifact NAME of the run, replacing an earlier one.
    /// Prints its reference {bucket, name, size, sha256}.
    Put {
        /// Artifact name (`/`-separated segments of letters, digits, `.`, `_`, `-`).
        name: String,
        /// The content; `-`: stdin.
        file: String,
    },
    /// The bytes of artifact NAME, raw on stdout (or into a file with -o).
    Get {
        /// Artifact name.
        name: String,
        /// Write the bytes here and print {name, size, path}.
        #[arg(short, long, value_name = "FILE")]
        output: Option<PathBuf>,
    },
}

/// `flotilla call`.
#[derive(Debug, Args)]
pub(crate) struct CallArgs {
    /// The agent definition to run as a child run of this task; or `agents:AGENT[.OWNER[.SESSION]]`,
    /// an agent of the NATS Agent Protocol on this NATS (discovered with `$SRV.INFO.agents`),
    /// prompted with INPUT as text.
    agent: String,
    /// Input for the agent (JSON; for an `agents:` target the prompt, as text); `-`: stdin.
    /// Default: none.
    input: Option<String>,
    /// The child task's instruction.
    #[arg(long, default_value = "")]
    description: String,
    /// Worker pool of the child task.
    #[arg(long)]
    pool: Option<String>,
    /// Topics the child task writes (comma separated), in the run tree's workspace.
    #[arg(long, value_delimiter = ',')]
    produces: Vec<String>,
    /// Per-attempt time limit of the child task (e.g. 30s, 5m).
    #[arg(long, value_parser = parse_duration)]
    timeout: Option<Duration>,
    /// How long to wait for the child to end (default: 10m).
    #[arg(long, value_parser = parse_duration, default_value = "10m")]
    wait: Duration,
    /// Identifies the call within the attempt. Default: derived from the agent, description,
    /// input, pool and produces, so a retried delivery that makes the same call re-attaches to
    /// the child its predecessor started (two identical calls in one attempt are one child).
    #[arg(long)]
    call_id: Option<String>,
}

/// `flotilla call …`: runs an agent as a child run of the calling task and prints its
/// outcome; exit 1 with code `child_failed` when the child did not succeed, `child_rejected`
/// (with the problems) when the coordinator rejected it.
pub(crate) async fn call(global: Global<'_>, args: CallArgs) -> anyhow::Result<ExitCode> {
    Ok(finish(run_call(global, args).await))
}

async fn run_call(global: Global<'_>, args: CallArgs) -> Result<(), CliError> {
    use sha2::Digest;
    if let Some(target) = args.agent.strip_prefix(EXTERNAL_PREFIX) {
        return call_external(global, target, &args).await;
    }
    let input = match args.input.as_deref() {
        None => Value::Null,
        Some(text) => json_value(Some(text), &None)?,
    };
    let call_id = match args.call_id {
        Some(id) => id,
        None => {
            let key = json!([
                args.agent,
                args.description,
                input,
                args.pool,
                args.produces
            ]);
            let digest = sha2::Sha256::digest(key.to_string().as_bytes());
            let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
            format!("cli-{hex}")
        }
    };
    let call = flotilla_context::ChildCall {
        agent: args.agent,
        description: args.description,
        input,
        pool: args.pool,
        produces: args.produces,
        timeout: args.timeout,
        call_id: Some(call_id),
        output_key: None,
    };
    let clients = connect(
        global,
        &ScopeArgs {
            run: None,
            as_task: None,
        },
    )
    .await?;
    let child = clients.start_child(&call).await?;
    clients.announce_child(&child.handle, &call.agent).await;
    let until = tokio::time::Instant::now() + args.wait;
    let outcome = match clients.wait_child(child.handle.run_id, until).await {
        Ok(o) => o,
        // The child never ran: its problems (`tree_too_deep`, `unknown_agent`, …) go with
        // the error, and the worker fails this attempt for good if the command gives up.
        Err(e) if e.kind() == flotilla_context::ErrorKind::ChildRejected => {
            print_json(&json!({
                "run_id": child.handle.run_id,
                "created": child.created,
                "status": flotilla_model::run::RunStatus::Rejected,
                "problems": e.problems(),
            }))?;
            let mut error = CliError::from(e);
            let detail = error.detail.get_or_insert_with(|| json!({}));
            detail["run_id"] = json!(child.handle.run_id);
            return Err(error);
        }
        Err(e) if e.kind() == flotilla_context::ErrorKind::Unavailable => {
            return Err(CliError::new("timeout", e.message().to_owned()));
        }
        Err(e) => return Err(e.into()),
    };
    let final_result = outcome.final_result.as_ref();
    print_json(&json!({
        "run_id": child.handle.run_id,
        "created": child.created,
        "status": outcome.status,
        "response": final_result.map(|r| r.response.clone()),
        "numeric_value": final_result.and_then(|r| r.numeric_value),
        "outcome": outcome,
    }))?;
    if outcome.status == flotilla_model::run::RunStatus::Succeeded {
        Ok(())
    } else {
        Err(CliError::new(
            "child_failed",
            format!(
                "child run {} ended {}: {}",
                child.handle.run_id,
                outcome.status.as_str(),
                outcome.reason.as_deref().unwrap_or("")
            ),
        ))
    }
}

/// Global flags that decide the connection.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Global<'a> {
    /// `--config`.
    pub(crate) config: Option<&'a Path>,
    /// `--nats-url`.
    pub(crate) nats_url: Option<&'a str>,
}

/// A failed command, as printed: a stable code, a message and the exit code.
#[derive(Debug)]
struct CliError {
    code: &'static str,
    message: String,
    current_revision: Option<u64>,
    /// More fields of the error object (a rejected child's `run_id`, its `problems`).
    detail: Option<Value>,
    /// NATS could not be reached: nothing was asked, so nothing changed (exit 2, as for
    /// every command; the code stays `unavailable`).
    unreachable: bool,
}

impl CliError {
    fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            current_revision: None,
            detail: None,
            unreachable: false,
        }
    }

    /// NATS could not be reached (code `unavailable`, exit 2).
    fn unreachable(message: impl Into<String>) -> Self {
        Self {
            unreachable: true,
            ..Self::new("unavailable", message)
        }
    }

    /// 2 for invalid input or an unreachable NATS (nothing was changed), 1 otherwise.
    fn exit_code(&self) -> u8 {
        if self.unreachable {
            return 2;
        }
        match self.code {
            "invalid_topic" | "undeclared_topic" | "entry_too_large" | "invalid_address"
            | "payload_too_large" | "invalid_key" | "value_too_large" | "invalid_name"
            | "invalid_json" | "invalid_argument" | "invalid_scope" | "invalid_config"
            | "unknown_role" => 2,
            _ => 1,
        }
    }

    fn to_json(&self) -> Value {
        let mut error = json!({ "code": self.code, "message": self.message });
        if let Some(r) = self.current_revision {
            error["current_revision"] = r.into();
        }
        if let (Some(Value::Object(more)), Some(e)) = (&self.detail, error.as_object_mut()) {
            e.extend(more.clone());
        }
        json!({ "error": error })
    }
}

impl From<ContextError> for CliError {
    fn from(e: ContextError) -> Self {
        Self {
            code: e.code(),
            // The message with its cause, as Display shows it, without the code prefix.
            message: e
                .to_string()
                .strip_prefix(&format!("{}: ", e.code()))
                .map(str::to_owned)
                .unwrap_or_else(|| e.message().to_owned()),
            current_revision: e.current_revision(),
            detail: (!e.problems().is_empty()).then(|| json!({ "problems": e.problems() })),
            unreachable: false,
        }
    }
}

/// The prefix naming an agent of the NATS Agent Protocol in `flotilla call`.
const EXTERNAL_PREFIX: &str = "agents:";

/// How long `flotilla call agents:…` waits for `$SRV.INFO.agents` answers.
const DISCOVERY_WAIT: Duration = Duration::from_secs(1);

/// `flotilla call agents:TARGET PROMPT`: prompts an agent of the NATS Agent Protocol and
/// prints `{agent, instance_id, status, response}`. Inside an agent's attempt the call is a
/// tool call on the calling run's events (`tool_start`, a `tool_update` per streamed piece,
/// `tool_end`). A question the agent asks (`query`, also a permission request) becomes an
/// approval of the calling attempt (`approval.ask`) that a person answers (`yes`, `no`, or
/// their text; `no` at its deadline), recorded in the run's events; outside an attempt it is
/// not answered — the agent's default (deny) applies — and said on stderr. A dead agent (no
/// heartbeat for three intervals), a stalled stream or `--wait` ending the call are errors
/// (`agent_dead`, `stalled`, `timeout`), never a hang.
async fn call_external(global: Global<'_>, target: &str, args: &CallArgs) -> Result<(), CliError> {
    let target: flotilla_agents::call::Target = target
        .parse()
        .map_err(|e: String| CliError::new("invalid_argument", e))?;
    let prompt = match args.input.as_deref() {
        None => return Err(CliError::new("invalid_argument", "the prompt is missing")),
        Some("-") => {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .map_err(|e| io_error("reading the prompt from stdin", e))?;
            text
        }
        Some(text) => text.to_owned(),
    };
    if prompt.trim().is_empty() {
        return Err(CliError::new("invalid_argument", "the prompt is empty"));
    }
    let mut opts = nats_options(global)?;
    let scope = Scope::from_env().ok();
    if let Some(scope) = &scope {
        opts.prefix = scope.names.prefix().to_owned();
    }
    let bus = bus(&opts).await?;
    let nats = bus.client().clone();
    let found = flotilla_agents::call::discover(&nats, DISCOVERY_WAIT)
        .await
        .map_err(external_error)?;
    let agent = target.resolve(&found).map_err(external_error)?.clone();
    // Inside an attempt, the agent's questions go to a person as approvals of this run.
    let asker = scope.as_ref().and_then(|s| {
        Some(flotilla_agents::ask::Asker {
            client: flotilla_client::Client::new(bus.clone()),
            run_id: s.run_id,
            task_id: s.task_id.clone()?,
            attempt: s.attempt?,
            attempt_id: s.attempt_id?,
            agent: format!(
                "{EXTERNAL_PREFIX}{}.{}.{}",
                agent.address.agent, agent.address.owner, agent.address.session
            ),
            context: prompt.clone(),
            call_ends: tokio::time::Instant::now() + args.wait,
        })
    });
    let events = scope.map(|s| ToolEvents::new(bus.clone(), s, &agent.address.display(), &prompt));
    if let Some(e) = &events {
        e.start().await;
    }
    let call_opts = flotilla_agents::call::CallOptions {
        timeout: args.wait,
        ..Default::default()
    };
    let envelope = flotilla_agents::wire::Envelope::text(prompt.clone());
    let result = flotilla_agents::call::call(&nats, &agent, &envelope, call_opts, |event| {
        let events = events.clone();
        let asker = asker.clone();
        async move {
            match event {
                flotilla_agents::call::CallEvent::Text(t) => {
                    if let Some(e) = &events {
                        e.update(json!({"text": t})).await;
                    }
                }
                flotilla_agents::call::CallEvent::Query(q) => match asker {
                    // Answered by a person while the stream goes on (the wait may be long).
                    Some(asker) => {
                        tokio::spawn(async move {
                            let outcome = flotilla_agents::ask::ask_and_answer(&asker, &q).await;
                            if let Some(e) = &events {
                                e.update(query_update(&q, &outcome)).await;
                            }
                        });
                    }
                    None => {
                        errln!(
                            "The agent asked {:?}; a call outside an attempt cannot ask a person, so its default (deny) applies",
                            q.prompt
                        );
                    }
                },
                flotilla_agents::call::CallEvent::Status(_) => {}
            }
        }
    })
    .await;
    if let Some(e) = &events {
        e.end(&result).await;
    }
    let response = result.map_err(external_error)?;
    print_json(&json!({
        "agent": agent.address.display(),
        "instance_id": agent.instance_id,
        "status": "succeeded",
        "response": response,
    }))
}

/// The `tool_update` recording how an agent's question was answered.
fn query_update(
    q: &flotilla_agents::wire::Query,
    outcome: &Result<flotilla_agents::ask::Asked, String>,
) -> serde_json::Value {
    match outcome {
        Ok(a) => json!({"query": q.prompt, "answered": true, "approval_id": a.approval_id,
                        "status": a.status.as_str(), "reply": a.reply}),
        Err(e) => json!({"query": q.prompt, "answered": false, "error": e}),
    }
}

fn external_error(e: flotilla_agents::call::CallError) -> CliError {
    CliError::new(e.code(), e.to_string())
}

/// The calling attempt's events of one external call: a tool call named `call_agent`.
#[derive(Clone)]
struct ToolEvents {
    bus: Bus,
    scope: std::sync::Arc<Scope>,
    call_id: String,
    agent: String,
    prompt: String,
    seq: std::sync::Arc<std::sync::atomic::AtomicU32>,
    started: std::time::Instant,
}

impl ToolEvents {
    fn new(bus: Bus, scope: Scope, agent: &str, prompt: &str) -> Self {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(format!("{agent}\n{prompt}").as_bytes());
        let hex: String = digest[..6].iter().map(|b| format!("{b:02x}")).collect();
        Self {
            bus,
            scope: std::sync::Arc::new(scope),
            call_id: format!("agents-{hex}"),
            agent: agent.to_owned(),
            prompt: prompt.to_owned(),
            seq: Default::default(),
            started: std::time::Instant::now(),
        }
    }

    async fn emit(&self, event: flotilla_model::event::Event) {
        use flotilla_model::event::{EventBatch, EventEnvelope};
        let n = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let scope = &self.scope;
        let attempt = scope.attempt_id.map(|a| a.to_string()).unwrap_or_default();
        let envelope = EventEnvelope {
            protocol: flotilla_model::PROTOCOL_VERSION,
            id: format!("{}.{attempt}.{}.{n}", scope.run_id, self.call_id),
            run_id: scope.run_id,
            task_id: scope.task_id.clone(),
            attempt: scope.attempt,
            ts: flotilla_model::time::Timestamp::now(),
            source: format!("task/{}", scope.task_id.as_ref().map_or("", TaskId::as_str)),
            event,
        };
        let batch = EventBatch::new(scope.run_id, vec![envelope]);
        if let Ok(out) = flotilla_bus::wire::encode(
            &batch,
            flotilla_model::codec::Codec::Json,
            Some(&batch.msg_id()),
        ) && let Err(e) = self
            .bus
            .publish_encoded(self.bus.names().event(scope.run_id), out)
            .await
        {
            tracing::warn!(error = %e, "An external call's event was not published");
        }
    }

    async fn start(&self) {
        self.emit(flotilla_model::event::Event::ToolStart {
            call_id: self.call_id.clone(),
            tool: "call_agent".into(),
            input: json!({"agent": format!("{EXTERNAL_PREFIX}{}", self.agent), "request": self.prompt}),
        })
        .await;
    }

    async fn update(&self, output: Value) {
        self.emit(flotilla_model::event::Event::ToolUpdate {
            call_id: self.call_id.clone(),
            output,
        })
        .await;
    }

    async fn end(&self, result: &Result<String, flotilla_agents::call::CallError>) {
        let (ok, output, error) = match result {
            Ok(text) => (true, json!({"agent": self.agent, "response": text}), None),
            Err(e) => (false, json!({"code": e.code()}), Some(e.to_string())),
        };
        self.emit(flotilla_model::event::Event::ToolEnd {
            call_id: self.call_id.clone(),
            ok,
            output,
            run_link: None,
            tool: Some("call_agent".into()),
            duration_ms: Some(self.started.elapsed().as_millis() as u64),
            error,
        })
        .await;
    }
}

fn io_error(what: impl std::fmt::Display, e: std::io::Error) -> CliError {
    CliError::new("io", format!("{what}: {e}"))
}

/// Prints the outcome of a command: its error as JSON on stderr, with its exit code.
fn finish(result: Result<(), CliError>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            errln!("{}", e.to_json());
            ExitCode::from(e.exit_code())
        }
    }
}

/// `flotilla ws …`.
pub(crate) async fn ws(global: Global<'_>, args: WsArgs) -> anyhow::Result<ExitCode> {
    Ok(finish(run_ws(global, args).await))
}

/// `flotilla mbox …`.
pub(crate) async fn mbox(global: Global<'_>, args: MboxArgs) -> anyhow::Result<ExitCode> {
    Ok(finish(run_mbox(global, args).await))
}

/// `flotilla state …`.
pub(crate) async fn state(global: Global<'_>, args: StateArgs) -> anyhow::Result<ExitCode> {
    Ok(finish(run_state(global, args).await))
}

/// `flotilla artifacts …`.
pub(crate) async fn artifacts(global: Global<'_>, args: ArtifactsArgs) -> anyhow::Result<ExitCode> {
    Ok(finish(run_artifacts(global, args).await))
}

async fn run_ws(global: Global<'_>, args: WsArgs) -> Result<(), CliError> {
    // Input is read and checked before connecting: bad input changes nothing.
    let input = match &args.command {
        WsCommand::Write { json, file, .. } => Some(json_object(json.as_deref(), file)?),
        _ => None,
    };
    let clients = connect(global, &args.scope).await?;
    let ws = clients.workspace();
    match args.command {
        WsCommand::Write {
            topic,
            idempotency_key,
            ..
        } => {
            let entry = input.unwrap_or_default();
            let appended = ws
                .append_with_key(&topic, entry, idempotency_key.as_deref())
                .await?;
            print_json(&appended)
        }
        WsCommand::Read {
            topic,
            all: _,
            since,
            limit,
        } => {
            let page = match topic {
                Some(t) => ws.read(&t, since, limit).await?,
                None => ws.read_all(since, limit).await?,
            };
            print_json(&page)
        }
        WsCommand::ReadAll { since, limit } => print_json(&ws.read_all(since, limit).await?),
        WsCommand::Watch {
            topic,
            since,
            count,
            timeout,
        } => watch(&clients, topic.as_deref(), since, count, timeout).await,
        WsCommand::PutArtifact { topic, name, file } => {
            let bytes = read_content(&file)?;
            let (artifact, appended) = ws.append_artifact(&topic, &name, bytes).await?;
            print_json(&json!({
                "artifact": artifact,
                "seq": appended.seq,
                "topic": appended.topic,
                "duplicate": appended.duplicate,
            }))
        }
    }
}

/// `ws watch`: entries as JSON lines until `count` or `timeout`.
async fn watch(
    clients: &Clients,
    topic: Option<&str>,
    since: u64,
    count: Option<u64>,
    timeout: Option<Duration>,
) -> Result<(), CliError> {
    if count == Some(0) {
        return Ok(());
    }
    let entries = clients.workspace().watch(topic, since).await?;
    futures::pin_mut!(entries);
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    let mut seen = 0u64;
    loop {
        let next = match deadline {
            Some(d) => match tokio::time::timeout_at(d, entries.next()).await {
                Ok(n) => n,
                Err(_) => break,
            },
            None => entries.next().await,
        };
        let Some(entry) = next else { break };
        let line = serde_json::to_string(&entry?)
            .map_err(|e| CliError::new("malformed", format!("encoding an entry: {e}")))?;
        // A reader that went away (`… | head -1`) ends the command (crate::output).
        outln!("{line}");
        seen += 1;
        if count.is_some_and(|c| seen >= c) {
            return Ok(());
        }
    }
    match count {
        Some(c) => Err(CliError::new(
            "timeout",
            format!(
                "{seen} of {c} entries arrived within {}",
                humantime_serde::re::humantime::format_duration(timeout.unwrap_or_default())
            ),
        )),
        None => Ok(()),
    }
}

/// A negotiation's inputs, checked before anything connects: candidates (split), request,
/// work.
type NegotiateInput = (Vec<String>, Value, Value);

/// Checks `negotiate`'s arguments: at least one candidate, JSON request and work.
fn negotiate_input(
    candidates: &str,
    request: &str,
    work: &str,
) -> Result<NegotiateInput, CliError> {
    let list: Vec<String> = candidates
        .split(',')
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(str::to_owned)
        .collect();
    if list.is_empty() {
        return Err(CliError::new(
            "invalid_address",
            "--candidates names no candidate: give task ids or role:<name>, comma separated",
        ));
    }
    let parse = |flag: &str, text: &str| {
        serde_json::from_str::<Value>(text)
            .map_err(|e| CliError::new("invalid_json", format!("{flag} is not valid JSON: {e}")))
    };
    Ok((list, parse("--request", request)?, parse("--work", work)?))
}

/// `offer`'s confidence: a finite number.
fn confidence_of(text: &str) -> Result<f64, CliError> {
    match text.trim().parse::<f64>() {
        Ok(x) if x.is_finite() => Ok(x),
        _ => Err(CliError::new(
            "invalid_argument",
            format!("--confidence {text:?} is not a finite number (e.g. 0.8)"),
        )),
    }
}

/// The default correlation id of a negotiation inside an attempt: the attempt and a digest
/// of what is negotiated (see `Negotiate::correlation_id`).
fn negotiation_correlation(clients: &Clients, input: &NegotiateInput) -> Option<String> {
    use sha2::Digest;
    let attempt = clients.scope().attempt_id?;
    let key = json!([input.0, input.1, input.2]);
    let digest = sha2::Sha256::digest(key.to_string().as_bytes());
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    Some(format!("{attempt}.neg-{hex}"))
}

async fn run_mbox(global: Global<'_>, args: MboxArgs) -> Result<(), CliError> {
    let negotiation = match &args.command {
        MboxCommand::Negotiate {
            candidates,
            request,
            work,
            ..
        } => Some(negotiate_input(candidates, request, work)?),
        _ => None,
    };
    let offer = match &args.command {
        MboxCommand::Offer {
            confidence,
            payload,
            ..
        } => Some((
            confidence_of(confidence)?,
            match payload {
                Some(text) => serde_json::from_str::<Value>(text).map_err(|e| {
                    CliError::new("invalid_json", format!("--payload is not valid JSON: {e}"))
                })?,
                None => Value::Null,
            },
        )),
        _ => None,
    };
    let input = match &args.command {
        MboxCommand::Send {
            payload,
            file,
            kind,
            ..
        } => {
            let kind: MailboxKind = kind
                .parse()
                .map_err(|e: String| CliError::new("invalid_argument", format!("--type: {e}")))?;
            Some((kind, json_value(payload.as_deref(), file)?))
        }
        _ => None,
    };
    let clients = connect(global, &args.scope).await?;
    let mbox = clients.mailbox();
    match args.command {
        MboxCommand::Send {
            to,
            correlation_id,
            idempotency_key,
            ..
        } => {
            let (kind, payload) = input.unwrap_or((MailboxKind::Info, Value::Null));
            let sent = mbox
                .send_with_key(
                    &to,
                    kind,
                    payload,
                    correlation_id.as_deref(),
                    idempotency_key.as_deref(),
                )
                .await?;
            print_json(&sent)
        }
        MboxCommand::Read {
            limit,
            since: Some(since),
            ..
        } => print_json(&mbox.read_after(since, limit).await?),
        MboxCommand::Read {
            limit,
            wait,
            since: None,
            commit,
        } => {
            let page = mbox.receive(limit, wait.unwrap_or_default()).await?;
            let mut out = to_value(&page)?;
            if commit {
                out["committed"] = json!(mbox.commit().await?);
            }
            print_json(&out)
        }
        MboxCommand::Stats { mailbox } => print_json(&mbox.stats(mailbox.as_deref()).await?),
        MboxCommand::Commit => {
            // Inside an agent the position is the one this execution's reads persisted.
            mbox.adopt_execution_position().await?;
            let committed = mbox.commit().await?;
            let cursor = mbox.committed().await?;
            print_json(&json!({ "committed": committed, "cursor": cursor }))
        }
        MboxCommand::Negotiate {
            deadline,
            correlation_id,
            ..
        } => {
            let Some(input) = negotiation else {
                return Err(CliError::new("invalid_argument", "negotiate: no input"));
            };
            let correlation = correlation_id.or_else(|| negotiation_correlation(&clients, &input));
            let (candidates, request, work) = input;
            let negotiated = mbox
                .run_negotiation(correlation.as_deref(), &candidates, request, work, deadline)
                .await?;
            let reply = negotiated.reply();
            if negotiated.award.is_some() {
                return print_json(&reply);
            }
            let mut e = CliError::new(
                "no_offers",
                format!(
                    "no candidate offered within {}; every candidate was told the negotiation is closed",
                    humantime_serde::re::humantime::format_duration(deadline)
                ),
            );
            e.detail = Some(json!({
                "correlation_id": reply.correlation_id,
                "candidates": reply.candidates,
            }));
            Err(e)
        }
        MboxCommand::NextRequest { wait } => {
            let request = mbox.next_request(wait.unwrap_or_default()).await?;
            print_json(&json!({ "request": request }))
        }
        MboxCommand::Offer { correlation, .. } => {
            let Some((confidence, payload)) = offer else {
                return Err(CliError::new("invalid_argument", "offer: no input"));
            };
            let request = mbox.find_request(&correlation).await?;
            print_json(&mbox.offer(&request, confidence, payload).await?)
        }
        MboxCommand::AwaitAward { correlation, wait } => {
            let request = mbox.find_request(&correlation).await?;
            let delegation = mbox.await_award(&request, wait.unwrap_or_default()).await?;
            print_json(&json!({
                "awarded": delegation.is_some(),
                "delegation": delegation,
            }))
        }
    }
}

async fn run_state(global: Global<'_>, args: StateArgs) -> Result<(), CliError> {
    let input = match &args.command {
        StateCommand::Set { json, file, .. } => Some(json_value(json.as_deref(), file)?),
        _ => None,
    };
    let clients = connect(global, &args.scope).await?;
    let state = clients.state();
    match args.command {
        StateCommand::Get { key } => match state.get(&key).await? {
            Some(v) => print_json(&v),
            None => Err(CliError::new(
                "not_found",
                format!(
                    "state {key:?} is not set in session {}",
                    clients.scope().session
                ),
            )),
        },
        StateCommand::Set {
            key, if_revision, ..
        } => {
            let value = input.unwrap_or(Value::Null);
            let revision = match if_revision {
                Some(expected) => state.compare_and_set(&key, &value, expected).await?,
                None => state.set(&key, &value).await?,
            };
            print_json(&json!({ "key": key, "revision": revision }))
        }
        StateCommand::Delete { key } => {
            state.delete(&key).await?;
            print_json(&json!({ "key": key, "deleted": true }))
        }
        StateCommand::List => print_json(&json!({
            "session": clients.scope().session,
            "keys": state.list().await?,
        })),
    }
}

async fn run_artifacts(global: Global<'_>, args: ArtifactsArgs) -> Result<(), CliError> {
    let input = match &args.command {
        ArtifactsCommand::Put { file, .. } => Some(read_content(file)?),
        ArtifactsCommand::Get { .. } => None,
    };
    let clients = connect(global, &args.scope).await?;
    let artifacts = clients.artifacts();
    match args.command {
        ArtifactsCommand::Put { name, .. } => {
            print_json(&artifacts.put(&name, input.unwrap_or_default()).await?)
        }
        ArtifactsCommand::Get { name, output } => {
            let bytes = artifacts.get(&name).await?;
            match output {
                Some(path) => {
                    std::fs::write(&path, &bytes)
                        .map_err(|e| io_error(format!("writing {}", path.display()), e))?;
                    print_json(&json!({
                        "name": name,
                        "size": bytes.len(),
                        "path": path.display().to_string(),
                    }))
                }
                None => {
                    crate::output::stdout_bytes(&bytes);
                    Ok(())
                }
            }
        }
    }
}

/// The clients of the command's scope: an operator's on `--run`, else the exec agent's from
/// its environment (with its read position persisted across processes).
async fn connect(global: Global<'_>, args: &ScopeArgs) -> Result<Clients, CliError> {
    let mut opts = nats_options(global)?;
    if let Some(run) = args.run {
        let bus = bus(&opts).await?;
        let scope = operator_scope(&bus, run, args.as_task.as_deref()).await?;
        return Ok(Clients::new(bus, scope)?);
    }
    if args.as_task.is_some() {
        return Err(CliError::new(
            "invalid_argument",
            "--as needs --run: inside an agent the identity is the agent's task",
        ));
    }
    let scope = Scope::from_env()?;
    // The agent's installation prefix is the worker's, whatever a config file says.
    opts.prefix = scope.names.prefix().to_owned();
    let bus = bus(&opts).await?;
    Ok(Clients::new(bus, scope)?.persist_read_position(true))
}

/// How to connect: `--nats-url` / `--config` first, then the worker's connection in an
/// agent's environment, then the usual configuration.
fn nats_options(global: Global<'_>) -> Result<NatsOptions, CliError> {
    let from_env = if global.nats_url.is_none() {
        flotilla_context::connection_from_env()?
    } else {
        None
    };
    if global.config.is_none()
        && let Some(opts) = &from_env
    {
        return Ok(opts.clone());
    }
    let loaded = config::load(global.config, global.nats_url)
        .map_err(|e| CliError::new("invalid_config", flotilla_bus::error::report(e.as_ref())))?;
    let mut opts = loaded.nats;
    if let Some(env) = from_env {
        opts.urls = env.urls;
        opts.auth = env.auth;
        opts.tls = env.tls;
    }
    Ok(opts)
}

async fn bus(opts: &NatsOptions) -> Result<Bus, CliError> {
    Bus::connect(opts, "flotilla-cli").await.map_err(|e| {
        CliError::unreachable(format!("connecting to NATS ({}): {e}", opts.urls.join(",")))
    })
}

/// An operator's scope on `run`: its tree's root and the session on its record.
async fn operator_scope(bus: &Bus, run: RunId, as_task: Option<&str>) -> Result<Scope, CliError> {
    let store = flotilla_client::open_store(bus)
        .await
        .map_err(|e| CliError::new("unavailable", e.to_string()))?;
    let record = store
        .record(run)
        .await
        .map_err(|e| CliError::new("unavailable", format!("reading run {run}: {e}")))?
        .ok_or_else(|| CliError::new("not_found", format!("run {run} does not exist")))?;
    let root = record.handle.root_run();
    let session = record
        .session_id
        .map_or_else(|| root.to_string(), |s| s.to_string());
    let scope = Scope::operator(bus.names().clone(), run, root, session);
    Ok(match as_task {
        Some(task) => {
            flotilla_context::mailbox::check_address(task)?;
            scope.with_task(TaskId::new(task))
        }
        None => scope,
    })
}

/// The text of a JSON argument: the argument itself, the file, or stdin (`-` or absent).
fn json_input(arg: Option<&str>, file: &Option<PathBuf>) -> Result<Vec<u8>, CliError> {
    let (what, reader): (String, Box<dyn Read>) = match (arg, file) {
        (_, Some(path)) => (
            path.display().to_string(),
            Box::new(
                std::fs::File::open(path)
                    .map_err(|e| io_error(format!("opening {}", path.display()), e))?,
            ),
        ),
        (Some(text), None) if text != "-" => return Ok(text.as_bytes().to_vec()),
        _ => ("stdin".to_owned(), Box::new(std::io::stdin())),
    };
    let mut bytes = Vec::new();
    reader
        .take(MAX_JSON_INPUT + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| io_error(format!("reading {what}"), e))?;
    if bytes.len() as u64 > MAX_JSON_INPUT {
        return Err(CliError::new(
            "invalid_json",
            format!(
                "{what} holds more than {MAX_JSON_INPUT} bytes of JSON; entries, payloads and values are far smaller (store large data as an artifact)"
            ),
        ));
    }
    Ok(bytes)
}

/// A JSON value from an argument, a file or stdin.
fn json_value(arg: Option<&str>, file: &Option<PathBuf>) -> Result<Value, CliError> {
    let bytes = json_input(arg, file)?;
    serde_json::from_slice(&bytes)
        .map_err(|e| CliError::new("invalid_json", format!("the JSON given is not valid: {e}")))
}

/// A JSON object (a workspace entry) from an argument, a file or stdin.
fn json_object(
    arg: Option<&str>,
    file: &Option<PathBuf>,
) -> Result<serde_json::Map<String, Value>, CliError> {
    match json_value(arg, file)? {
        Value::Object(m) => Ok(m),
        other => Err(CliError::new(
            "invalid_json",
            format!(
                "an entry is a JSON object, not {}",
                match other {
                    Value::Null => "null",
                    Value::Bool(_) => "a boolean",
                    Value::Number(_) => "a number",
                    Value::String(_) => "a string",
                    Value::Array(_) => "an array",
                    Value::Object(_) => "an object",
                }
            ),
        )),
    }
}

/// Bytes of a file, or of stdin for `-`.
fn read_content(file: &str) -> Result<Bytes, CliError> {
    let mut bytes = Vec::new();
    if file == "-" {
        std::io::stdin()
            .read_to_end(&mut bytes)
            .map_err(|e| io_error("reading stdin", e))?;
    } else {
        bytes = std::fs::read(file).map_err(|e| io_error(format!("reading {file}"), e))?;
    }
    Ok(Bytes::from(bytes))
}

fn to_value(v: &impl Serialize) -> Result<Value, CliError> {
    serde_json::to_value(v).map_err(|e| CliError::new("malformed", format!("encoding: {e}")))
}

/// One JSON document on stdout: indented on a terminal, one line otherwise.
fn print_json(v: &impl Serialize) -> Result<(), CliError> {
    let text = if std::io::stdout().is_terminal() {
        serde_json::to_string_pretty(v)
    } else {
        serde_json::to_string(v)
    }
    .map_err(|e| CliError::new("malformed", format!("encoding: {e}")))?;
    outln!("{text}");
    Ok(())
}

/// Seconds (`2`, `0.5`) or a duration (`500ms`, `2m`).
fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if let Ok(secs) = s.parse::<f64>() {
        return Duration::try_from_secs_f64(secs)
            .map_err(|_| format!("{s:?} is not a number of seconds"));
    }
    humantime_serde::re::humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use flotilla_context::ErrorKind;

    use super::*;

    #[test]
    fn input_errors_exit_2_and_the_rest_1() {
        for code in [
            "invalid_topic",
            "undeclared_topic",
            "entry_too_large",
            "invalid_key",
            "value_too_large",
            "invalid_json",
        ] {
            assert_eq!(CliError::new(code, "x").exit_code(), 2, "{code}");
        }
        for code in ["not_found", "conflict", "unavailable", "timeout", "io"] {
            assert_eq!(CliError::new(code, "x").exit_code(), 1, "{code}");
        }
        assert_eq!(CliError::unreachable("x").exit_code(), 2);
        assert_eq!(
            CliError::unreachable("x").to_json()["error"]["code"],
            "unavailable"
        );
        let e: CliError = ContextError::conflict("lost", 4).into();
        assert_eq!(
            e.to_json(),
            json!({"error": {"code": "conflict", "message": "lost", "current_revision": 4}})
        );
        let e: CliError = ContextError::new(ErrorKind::UndeclaredTopic, "no").into();
        assert_eq!((e.code, e.message.as_str()), ("undeclared_topic", "no"));
    }

    #[test]
    fn durations_are_seconds_or_humantime() {
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("0.5"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert!(parse_duration("-1").is_err());
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn entries_must_be_objects() {
        let e = json_object(Some("[1]"), &None).expect_err("array");
        assert_eq!(e.code, "invalid_json");
        assert!(e.message.contains("an array"), "{}", e.message);
        let e = json_value(Some("{oops"), &None).expect_err("bad json");
        assert_eq!(e.exit_code(), 2);
        assert_eq!(
            json_object(Some(r#"{"a":1}"#), &None).expect("object")["a"],
            1
        );
    }
}
