//! `flotilla runs fork RUN --at TASK`: a new run of an ended run's plan from a task on, with
//! the fork point changed (`<prefix>.api.run.fork`, served by the coordinator). Exit 0 when
//! the fork was accepted (with `--wait`: when it succeeded), 1 when it was refused or did not
//! succeed, 2 when no coordinator answers.
//!
//! `flotilla runs replay RUN`: the run replayed from its log through the run machine and
//! checked against what it recorded (read from the store; no service needed). Exit 0 when
//! the replay reached the same decisions, 1 when it diverged or the run does not exist.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use flotilla_client::ClientErrorKind;
use flotilla_model::fork::{RunForkReply, RunForkRequest, parse_fork_point};
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::run::RunStatus;
use flotilla_model::submit::SubmitStatus;

use super::team::connect;
use crate::config::Config;

/// How long a fork request without `--wait` waits for its answer.
const ANSWER_WAIT: Duration = Duration::from_secs(30);
/// How long `--wait` waits for the fork to end.
const RUN_WAIT: Duration = Duration::from_secs(24 * 3600);

/// What changes at the fork point.
#[derive(Debug, Default)]
pub(crate) struct Changes {
    pub(crate) agent: Option<String>,
    pub(crate) model: Option<String>,
    pub(crate) edit: Option<PathBuf>,
    pub(crate) instructions: Option<PathBuf>,
    pub(crate) description: Option<String>,
    pub(crate) input: Option<String>,
}

/// Forks `run` at `at` and prints what happened.
pub(crate) async fn fork(
    config: &Config,
    run: RunId,
    at: String,
    changes: Changes,
    fork_run_id: Option<RunId>,
    wait: bool,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let (at, step) = parse_fork_point(&at).map_err(|e| anyhow::anyhow!("--at: {e}"))?;
    let mut request = RunForkRequest::new(run, at);
    request.step = step;
    request.agent = changes.agent;
    request.model = changes.model;
    if let Some(path) = changes.edit {
        let text = std::fs::read_to_string(&path)
            .map_err(|e| anyhow::anyhow!("cannot read the edit file {}: {e}", path.display()))?;
        // One subtask, or a list of them.
        request.edits = match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(serde_json::Value::Array(_)) => serde_json::from_str(&text),
            _ => serde_json::from_str(&text).map(|s| vec![s]),
        }
        .map_err(|e| {
            anyhow::anyhow!(
                "--edit {}: not a subtask or a list of subtasks: {e}",
                path.display()
            )
        })?;
    }
    request.description = match (changes.instructions, changes.description) {
        (Some(path), _) => Some(std::fs::read_to_string(&path).map_err(|e| {
            anyhow::anyhow!("cannot read the instructions file {}: {e}", path.display())
        })?),
        (None, d) => d,
    };
    request.input = match changes.input {
        Some(text) => Some(
            serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("--input is not JSON: {e}"))?,
        ),
        None => None,
    };
    request.fork_run_id = fork_run_id;
    request.wait = wait;
    let client = connect(config).await?;
    let timeout = if wait { RUN_WAIT } else { ANSWER_WAIT };
    let reply = match client.call(&request, timeout).await {
        Ok(r) => r,
        Err(e) if e.kind() == ClientErrorKind::NoCoordinator => {
            errln!("error: {e}");
            return Ok(ExitCode::from(2));
        }
        Err(e) => return Err(e.into()),
    };
    let reply = match reply {
        Ok(r) => r,
        Err(e) => {
            if json {
                let out = serde_json::json!({"error": e.code, "message": e.message});
                outln!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                errln!("error: {}: {}", e.code, e.message);
            }
            return Ok(ExitCode::from(1));
        }
    };
    if json {
        outln!("{}", serde_json::to_string_pretty(&reply)?);
    } else {
        print(&reply);
    }
    Ok(exit_of(&reply))
}

fn exit_of(reply: &RunForkReply) -> ExitCode {
    let ok = match reply.status {
        SubmitStatus::Accepted | SubmitStatus::Duplicate => true,
        SubmitStatus::Finished => reply
            .outcome
            .as_ref()
            .is_some_and(|o| o.status == RunStatus::Succeeded),
        SubmitStatus::Rejected => false,
    };
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn print(reply: &RunForkReply) {
    let list = |ids: &[TaskId]| {
        if ids.is_empty() {
            "-".to_owned()
        } else {
            ids.iter()
                .map(TaskId::as_str)
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    let run = reply
        .run_id
        .map_or_else(|| "-".to_owned(), |r| r.to_string());
    match reply.status {
        SubmitStatus::Rejected => {
            errln!("Fork of run {} at {} rejected:", reply.fork_of, reply.at);
            for p in &reply.errors {
                errln!("  {p}");
            }
            return;
        }
        SubmitStatus::Duplicate => outln!("Fork {run} exists already (duplicate)"),
        _ => outln!("Fork {run} of run {} at {}", reply.fork_of, reply.at),
    }
    outln!("  reused: {}", list(&reply.reused));
    outln!("  rerun:  {}", list(&reply.rerun));
    for w in &reply.warnings {
        outln!("  warning: {w}");
    }
    if let Some(o) = &reply.outcome {
        outln!("  status: {}", o.status.as_str());
        if let Some(reason) = &o.reason {
            outln!("  reason: {reason}");
        }
        if let Some(fr) = &o.final_result {
            outln!("  result: {}", fr.response);
        }
    }
}

/// Replays `run` and prints what it found.
pub(crate) async fn replay(config: &Config, run: RunId, json: bool) -> anyhow::Result<ExitCode> {
    let client = connect(config).await?;
    let Some(report) = client.replay(run).await? else {
        errln!("error: run {run} does not exist");
        return Ok(ExitCode::from(1));
    };
    if json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let (runs, replies, rounds) = totals(&report);
        if report.same {
            outln!(
                "Replayed run {run} and {} child run(s): the same decisions and answers, status {}",
                runs - 1,
                report.recorded.as_str()
            );
        } else {
            outln!("Replayed run {run}: it diverged");
        }
        outln!(
            "  {replies} model replies and {rounds} tool rounds served from the journals: 0 model calls, 0 tool runs"
        );
        print_replayed(&report, 0);
    }
    Ok(if report.same {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Runs, model replies and tool rounds of a replayed tree.
fn totals(r: &flotilla_runs::replay::ReplayReport) -> (u32, u32, u32) {
    r.children.iter().map(totals).fold(
        (1, r.model_replies, r.tool_rounds),
        |(a, b, c), (x, y, z)| (a + x, b + y, c + z),
    )
}

/// A line per replayed run, indented by depth, with its divergence.
fn print_replayed(r: &flotilla_runs::replay::ReplayReport, depth: usize) {
    let pad = "  ".repeat(depth + 1);
    outln!(
        "{pad}{} {}: {} run-log entries, {} events, {} conversation(s) — {}",
        if r.same { "✓" } else { "✗" },
        r.run_id,
        r.entries,
        r.events,
        r.conversations,
        if r.divergence.is_some() {
            "diverged"
        } else if r.same {
            "the same"
        } else {
            "a child run diverged"
        }
    );
    if let Some(d) = &r.divergence {
        if let Some(seq) = d.seq {
            outln!(
                "{pad}  at run-log entry {seq}{}",
                d.input
                    .as_deref()
                    .map_or_else(String::new, |k| format!(" ({k})"))
            );
        }
        if let Some(t) = &d.task_id {
            outln!("{pad}  task      {t}");
        }
        if let Some(step) = d.step {
            outln!("{pad}  step      {step}");
        }
        outln!("{pad}  recorded  {}", d.recorded);
        outln!("{pad}  replayed  {}", d.replayed);
    }
    for c in &r.children {
        print_replayed(c, depth + 1);
    }
    if r.omitted > 0 {
        outln!(
            "{pad}  ({} child run(s) not replayed: over the cap)",
            r.omitted
        );
    }
}
