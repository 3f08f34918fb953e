//! `flotilla submit PLAN [--follow] [--wait] [--json]` and `flotilla submit --query TEXT …`.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use flotilla_bus::Bus;
use flotilla_client::Client;
use flotilla_model::event::{Event, WorkflowPhase};
use flotilla_model::ids::RunId;
use flotilla_model::run::{RunOutcome, RunStatus};
use flotilla_model::submit::{SubmitRequest, SubmitStatus};
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::config::Config;

/// Options of `flotilla submit`.
#[derive(Debug, Default)]
pub(crate) struct SubmitOptions {
    pub(crate) follow: bool,
    pub(crate) wait: bool,
    pub(crate) json: bool,
    pub(crate) run_id: Option<RunId>,
    pub(crate) idempotency_key: Option<String>,
    pub(crate) labels: BTreeMap<String, String>,
    pub(crate) session: Option<flotilla_model::ids::SessionId>,
    pub(crate) timeout: Option<Duration>,
    /// A bare query instead of a plan file.
    pub(crate) query: Option<String>,
}

/// Submits, then (with `--follow` / `--wait`) waits for the outcome. Exit code 0 when the run
/// succeeded, 1 when it failed or was rejected.
pub(crate) async fn submit(
    config: &Config,
    plan_path: Option<&Path>,
    opts: SubmitOptions,
) -> anyhow::Result<ExitCode> {
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    match (plan_path, opts.query.clone()) {
        (Some(path), None) => submit_on(&bus, path, opts).await,
        (None, Some(query)) => send(&bus, SubmitRequest::query(query), opts).await,
        _ => anyhow::bail!("give either a plan file or --query"),
    }
}

/// [`submit`] on an existing connection (also used by `flotilla up --submit`).
pub(crate) async fn submit_on(
    bus: &Bus,
    plan_path: &Path,
    opts: SubmitOptions,
) -> anyhow::Result<ExitCode> {
    // The coordinator validates against the deployment; a file that does not decode gets
    // every problem of its structure here.
    let ctx = flotilla_model::validate::ValidationContext::default();
    let plan = match super::plan::read_plan(plan_path, &ctx)? {
        Ok(p) => p,
        Err(report) => {
            for p in &report.errors {
                errln!("error {p}");
            }
            return Ok(ExitCode::from(1));
        }
    };
    send(bus, SubmitRequest::new(plan), opts).await
}

/// Sends a submission (a plan or a bare query) with the options applied.
async fn send(
    bus: &Bus,
    mut request: SubmitRequest,
    opts: SubmitOptions,
) -> anyhow::Result<ExitCode> {
    let client = Client::new(bus.clone());
    request.run_id = Some(opts.run_id.unwrap_or_default());
    request.idempotency_key = opts.idempotency_key.clone();
    request.labels = opts.labels.clone();
    request.session_id = opts.session;
    if !opts.follow && !opts.wait {
        return submit_and_report(&client, request, opts.json).await;
    }
    let run = client.submit(request).await?;
    errln!("Submitted run {run}");
    let outcome = follow(&client, run, opts.follow, opts.timeout).await?;
    print_outcome(&outcome, opts.json);
    if outcome.status == RunStatus::Rejected && !opts.json {
        print_problems(&client, run).await;
    }
    Ok(exit_code(&outcome))
}

/// Submits through the request/reply endpoint, so the answer says whether the plan was
/// accepted: exit 0 accepted (or a duplicate of an existing run), 1 rejected. Without a
/// coordinator, the submission goes to the durable intake instead, where it waits for one;
/// exit 0 then means "queued for validation", and the output says so.
async fn submit_and_report(
    client: &Client,
    request: SubmitRequest,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let reply = match client
        .submit_request(&request, Duration::from_secs(30))
        .await
    {
        Ok(reply) => reply,
        Err(e) if e.kind() == flotilla_client::ClientErrorKind::NoCoordinator => {
            let run = client.submit(request).await?;
            if json {
                outln!(
                    "{}",
                    serde_json::json!({ "run_id": run, "status": "queued" })
                );
            } else {
                outln!("{run}");
            }
            errln!(
                "note: no coordinator is running; the submission is stored durably and will be validated when one starts. Exit 0 means queued for validation, not accepted: check with `flotilla runs show {run}`"
            );
            return Ok(ExitCode::SUCCESS);
        }
        Err(e) => return Err(e.into()),
    };
    if json {
        outln!("{}", serde_json::to_string_pretty(&reply)?);
    }
    let run = reply.run_id.map(|r| r.to_string()).unwrap_or_default();
    match reply.status {
        SubmitStatus::Rejected => {
            if !json {
                errln!("Run {run} rejected: {} problem(s)", reply.errors.len());
                for p in &reply.errors {
                    errln!("  error   {p}");
                }
            }
            Ok(ExitCode::from(1))
        }
        status => {
            if !json {
                outln!("{run}");
                if status == SubmitStatus::Duplicate {
                    errln!(
                        "note: duplicate: run {run} already exists (status {})",
                        reply
                            .run_status
                            .map_or_else(|| "unknown".to_owned(), |s| s.to_string())
                    );
                }
                for p in &reply.warnings {
                    errln!("  warning {p}");
                }
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Prints a rejected run's problems, one per line.
async fn print_problems(client: &Client, run: RunId) {
    if let Ok(Some(view)) = client.run(run).await {
        for p in &view.record.errors {
            errln!("  error   {p}");
        }
    }
}

fn exit_code(outcome: &RunOutcome) -> ExitCode {
    if outcome.status == RunStatus::Succeeded {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// Follows a run's events to its end. With `progress`, shows a progress bar and one status
/// line per task change on stderr.
pub(crate) async fn follow(
    client: &Client,
    run: RunId,
    progress: bool,
    timeout: Option<Duration>,
) -> anyhow::Result<RunOutcome> {
    let started = Instant::now();
    let bar = if progress {
        let b = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        b.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} tasks {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b.enable_steady_tick(Duration::from_millis(120));
        Some(b)
    } else {
        None
    };
    let line = |text: String| {
        if let Some(b) = &bar {
            b.suspend(|| errln!("{text}"));
        }
    };
    let events = client.events(run).await?;
    futures::pin_mut!(events);
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    loop {
        let next = match deadline {
            Some(d) => match tokio::time::timeout_at(d, events.next()).await {
                Ok(n) => n,
                Err(_) => anyhow::bail!(
                    "run {run} did not finish within {:?}",
                    timeout.unwrap_or_default()
                ),
            },
            None => events.next().await,
        };
        let Some(event) = next else {
            anyhow::bail!("the event stream of run {run} ended unexpectedly");
        };
        let event = event?;
        let t = format!("{:>7.2}s", started.elapsed().as_secs_f64());
        let task = event
            .task_id
            .as_ref()
            .map(|t| t.to_string())
            .unwrap_or_default();
        let w = match event.event {
            Event::Workflow(w) => w,
            // An agent waits for a person or the client: say so, with the command that
            // answers, instead of a silence until the timeout.
            Event::AwaitClarification { question, token } if !token.is_empty() => {
                line(format!(
                    "{t}  ? {task} asks: {question}\n           answer: flotilla runs answer {run} {token} --text …"
                ));
                if let Some(b) = &bar {
                    b.set_message(format!("waiting: {task} asks a question"));
                }
                continue;
            }
            Event::AwaitExternalTools { calls } => {
                for c in calls {
                    line(format!(
                        "{t}  ? {task} waits for the client's tool {} (token {})",
                        c.tool, c.token
                    ));
                }
                if let Some(b) = &bar {
                    b.set_message(format!("waiting: {task} waits for the client"));
                }
                continue;
            }
            _ => continue,
        };
        match w.phase {
            WorkflowPhase::RunStarted => {
                if let Some(b) = &bar {
                    b.set_length(u64::from(w.tasks_total.unwrap_or(0)));
                }
            }
            WorkflowPhase::TaskStarted => {
                // A task with a role says who plays it (for a role task: the member that
                // claimed it).
                let playing = match (&w.role, &w.agent) {
                    (Some(role), Some(agent)) => format!(" as {agent} ({role})"),
                    _ => String::new(),
                };
                line(format!(
                    "{t}  ▶ {task} started on {}{playing}",
                    w.worker.unwrap_or_default()
                ));
                if let Some(b) = &bar {
                    b.set_message(format!("running {task}"));
                }
            }
            WorkflowPhase::TaskSucceeded => {
                let took = took(w.started_at, event.ts);
                let on = w.worker.map(|w| format!(" on {w}")).unwrap_or_default();
                line(format!("{t}  ✓ {task} succeeded{on}{took}"));
                if let Some(b) = &bar {
                    b.inc(1);
                }
            }
            WorkflowPhase::TaskRetrying => {
                let err = w.error.map(|e| e.to_string()).unwrap_or_default();
                line(format!(
                    "{t}  ↻ {task} will retry (attempt {} failed: {err})",
                    event.attempt.unwrap_or(0)
                ));
            }
            WorkflowPhase::TaskFailed => {
                let err = w.error.map(|e| e.to_string()).unwrap_or_default();
                line(format!("{t}  ✗ {task} failed: {err}"));
                if let Some(b) = &bar {
                    b.inc(1);
                }
            }
            WorkflowPhase::TaskSkipped => {
                line(format!(
                    "{t}  ⤼ {task} skipped: {}",
                    w.detail.unwrap_or_default()
                ));
                if let Some(b) = &bar {
                    b.inc(1);
                }
            }
            WorkflowPhase::ApprovalRequested => {
                let id = w.approval_id.unwrap_or_default();
                line(format!(
                    "{t}  ⏸ {task} waits for a person: approval {id} ({})\n           answer: flotilla approvals approve {run} {id} (or reject)",
                    w.detail.unwrap_or_default()
                ));
                if let Some(b) = &bar {
                    b.set_message(format!("waiting for approval {id} of {task}"));
                }
            }
            WorkflowPhase::ApprovalDecided => {
                let id = w.approval_id.unwrap_or_default();
                let what = w.detail.unwrap_or_default();
                line(if id.is_empty() {
                    format!("{t}  ⏵ {task} {what}")
                } else {
                    format!("{t}  ⏵ approval {id} of {task}: {what}")
                });
                if let Some(b) = &bar {
                    b.set_message(String::new());
                }
            }
            WorkflowPhase::RunPaused | WorkflowPhase::RunTakenOver => {
                let what = if w.phase == WorkflowPhase::RunPaused {
                    "paused"
                } else {
                    "taken over"
                };
                line(format!(
                    "{t}  ⏸ run {what}: {}\n           resume: flotilla runs resume {run}",
                    w.detail.unwrap_or_default()
                ));
                if let Some(b) = &bar {
                    b.set_message(format!("waiting: the run is {what}"));
                }
            }
            WorkflowPhase::RunResumed => {
                line(format!(
                    "{t}  ⏵ run resumed: {}",
                    w.detail.unwrap_or_default()
                ));
                if let Some(b) = &bar {
                    b.set_message(String::new());
                }
            }
            WorkflowPhase::TaskPaused | WorkflowPhase::TaskResumed => {
                let what = if w.phase == WorkflowPhase::TaskPaused {
                    "⏸ paused"
                } else {
                    "⏵ resumed"
                };
                line(format!(
                    "{t}  {task} {what}: {}",
                    w.detail.unwrap_or_default()
                ));
            }
            phase if phase.ends_run() => {
                if let Some(b) = &bar {
                    b.finish_and_clear();
                }
                let outcome = w.outcome.map(|o| *o).unwrap_or(RunOutcome {
                    run_id: run,
                    status: RunStatus::Failed,
                    final_result: None,
                    failed: Vec::new(),
                    skipped: Vec::new(),
                    failed_omitted: 0,
                    skipped_omitted: 0,
                    reason: w.detail,
                    cause: None,
                    rollback_run_id: None,
                });
                return Ok(outcome);
            }
            _ => {}
        }
    }
}

/// " in 1.23s": how long an attempt that started at `started` (the worker's clock) took until
/// its outcome's event at `ended`; empty when its start is unknown.
pub(crate) fn took(
    started: Option<flotilla_model::time::Timestamp>,
    ended: flotilla_model::time::Timestamp,
) -> String {
    started
        .map(|s| {
            format!(
                " in {:.2}s",
                (ended.unix_ms() - s.unix_ms()).max(0) as f64 / 1000.0
            )
        })
        .unwrap_or_default()
}

/// Prints the outcome: the final result on stdout, a summary on stderr.
pub(crate) fn print_outcome(outcome: &RunOutcome, json: bool) {
    if json {
        outln!(
            "{}",
            serde_json::to_string_pretty(outcome).unwrap_or_default()
        );
        return;
    }
    errln!("Run {} {}", outcome.run_id, outcome.status);
    if let Some(reason) = &outcome.reason
        && outcome.status != RunStatus::Rejected
    {
        errln!("  reason: {reason}");
    }
    for f in &outcome.failed {
        errln!(
            "  failed:  {} after {} attempt(s): {}",
            f.task_id,
            f.attempts,
            f.error
        );
    }
    if outcome.failed_omitted > 0 {
        errln!("  … and {} more failed task(s)", outcome.failed_omitted);
    }
    for s in &outcome.skipped {
        errln!("  skipped: {} ({})", s.task_id, s.reason);
    }
    if outcome.skipped_omitted > 0 {
        errln!("  … and {} more skipped task(s)", outcome.skipped_omitted);
    }
    if let Some(fr) = &outcome.final_result
        && let Some(a) = &fr.artifact
    {
        errln!(
            "  the final result is {} bytes; shown shortened, whole in artifact {}/{}",
            a.size,
            a.bucket,
            a.name
        );
    }
    if let Some(fr) = &outcome.final_result {
        outln!("{}", fr.response);
    }
}
