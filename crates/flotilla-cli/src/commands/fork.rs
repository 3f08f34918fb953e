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
use flotilla_model::fork::{RunForkReply, RunForkRequest};
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
    let mut request = RunForkRequest::new(run, TaskId::new(at));
    request.agent = changes.agent;
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
    } else if report.same {
        outln!(
            "Replayed run {run}: the same decisions ({} run-log entries, {} events compared; 0 model calls, 0 tool runs), status {}",
            report.entries,
            report.events,
            report.recorded.as_str()
        );
    } else {
        outln!(
            "Replayed run {run}: it diverged ({} run-log entries, {} events compared)",
            report.entries,
            report.events
        );
        if let Some(d) = &report.divergence {
            if let Some(seq) = d.seq {
                outln!(
                    "  at run-log entry {seq}{}",
                    d.input
                        .as_deref()
                        .map_or_else(String::new, |k| format!(" ({k})"))
                );
            }
            if let Some(t) = &d.task_id {
                outln!("  task      {t}");
            }
            outln!("  recorded  {}", d.recorded);
            outln!("  replayed  {}", d.replayed);
        }
    }
    Ok(if report.same {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
