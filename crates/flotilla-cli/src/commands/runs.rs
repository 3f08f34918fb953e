//! `flotilla runs list|show|history|cancel`, `flotilla workers`.

use std::process::ExitCode;

use flotilla_bus::Bus;
use flotilla_client::progress;
use flotilla_model::ids::RunId;
use flotilla_model::run::RunStatus;
use flotilla_model::runlog::{PlanDecision, RunInput};
use flotilla_model::time::Timestamp;
use flotilla_runs::RunReader;

use crate::config::Config;

/// The run store, through the client library: a deployment never provisioned is said once,
/// with what to do.
async fn store(config: &Config) -> anyhow::Result<RunReader> {
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    Ok(flotilla_client::open_store(&bus).await?)
}

pub(crate) async fn list(config: &Config, limit: usize, json: bool) -> anyhow::Result<ExitCode> {
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    let store = flotilla_client::open_store(&bus).await?;
    // Newest first, by submission time (clients may choose any UUID as run id).
    let records = store.recent(limit).await?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&records)?);
        return Ok(ExitCode::SUCCESS);
    }
    // A live run some person must act on reads `waiting`: the pending approvals say which
    // (without a coordinator to list them, only paused and taken-over runs do).
    let pending = if records.iter().any(|r| !r.status.is_terminal()) {
        flotilla_client::Client::new(bus.clone())
            .pending_approvals(None)
            .await
            .unwrap_or_default()
    } else {
        Vec::new()
    };
    let width = records
        .iter()
        .filter_map(|r| r.name.as_deref())
        .map(|n| n.chars().count())
        .max()
        .unwrap_or(4)
        .clamp(4, 24);
    outln!(
        "{:<36}  {:<9}  {:<width$}  {:>9}  {:<24}",
        "RUN",
        "STATUS",
        "NAME",
        "TASKS",
        "CREATED"
    );
    let mut waiting = Vec::new();
    for r in &records {
        let c = &r.tasks;
        let waits = progress::waits(r, &pending);
        outln!(
            "{:<36}  {:<9}  {:<width$}  {:>9}  {:<24}",
            r.handle.run_id.to_string(),
            progress::run_label(r.status, &waits),
            fit(r.name.as_deref().unwrap_or("-"), width),
            format!("{}/{}", c.succeeded, c.total),
            r.created_at.to_string()
        );
        waiting.extend(waits.into_iter().map(|w| (r.handle.run_id, w)));
    }
    if !waiting.is_empty() {
        outln!();
        outln!("waiting for a person:");
        for (run, w) in waiting {
            outln!("  {run}  {}", wait_line(&w));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `s` in at most `width` characters, cut with an ellipsis.
pub(crate) fn fit(s: &str, width: usize) -> String {
    if s.chars().count() <= width {
        return s.to_owned();
    }
    let mut cut: String = s.chars().take(width.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// One wait in a line: what, of which task, until when, and the command that answers it.
pub(crate) fn wait_line(w: &progress::Wait) -> String {
    let mut line = w.kind.as_str().to_owned();
    if let Some(id) = &w.approval_id {
        line.push_str(&format!(" {id}"));
    }
    if let Some(t) = &w.task_id {
        line.push_str(&format!(" of task {t}"));
    }
    line.push_str(&format!(": {}", w.what));
    if let Some(d) = w.deadline {
        line.push_str(&format!(" (default at {d})"));
    }
    line.push_str(&format!("\n      answer: {}", w.answer));
    line
}

pub(crate) async fn show(config: &Config, run: RunId, json: bool) -> anyhow::Result<ExitCode> {
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    let store = flotilla_client::open_store(&bus).await?;
    let Some(view) = store.view(run, 0, usize::MAX).await? else {
        errln!("error: run {run} does not exist");
        return Ok(ExitCode::from(1));
    };
    if json {
        outln!("{}", serde_json::to_string_pretty(&view)?);
        return Ok(ExitCode::SUCCESS);
    }
    let r = &view.record;
    let progress = flotilla_client::Client::new(bus.clone())
        .progress(&view)
        .await
        .unwrap_or_default();
    outln!("run       {}", r.handle.run_id);
    if let Some(n) = &r.name {
        outln!("name      {n}");
    }
    match progress::run_label(r.status, &progress.waiting) {
        "waiting" => outln!("status    waiting (the run is {})", r.status),
        label => outln!("status    {label}"),
    }
    for w in &progress.waiting {
        outln!("waits for {}", wait_line(w));
    }
    outln!("created   {}", r.created_at);
    if let Some(f) = r.finished_at {
        outln!("finished  {f}");
    }
    for (k, v) in &r.labels {
        outln!("label     {k}={v}");
    }
    if let Some(s) = &r.strategy {
        outln!("strategy  {} ({})", s.strategy.as_str(), s.reason);
    }
    if let Some(f) = &r.fork_of {
        outln!("{}", fork_line(f));
    }
    if let Some(p) = &r.planning {
        outln!(
            "planning  {} (planner round {} of at most {})",
            match p.status {
                flotilla_model::run::PlanningStatus::Planning => "planning",
                flotilla_model::run::PlanningStatus::Reviewing => "reviewing",
                flotilla_model::run::PlanningStatus::Planned => "planned",
                flotilla_model::run::PlanningStatus::Failed => "failed",
            },
            p.round,
            p.max_repairs + 1
        );
    }
    if let Some(plan) = &view.plan {
        // The plan the planner wrote for a bare query: a tree of tasks and their inputs.
        if let Some(q) = &plan.query {
            outln!("query     {q}");
        }
        outln!("planned plan:");
        for t in &plan.subtasks {
            let mut line = format!("  {}", t.id);
            if let Some(role) = &t.role {
                line.push_str(&format!(" [{role}]"));
            }
            if let Some(agent) = &t.agent {
                line.push_str(&format!(" agent={agent}"));
            }
            if !t.dependencies.is_empty() {
                let deps: Vec<&str> = t.dependencies.iter().map(|d| d.as_str()).collect();
                line.push_str(&format!(" after {}", deps.join(", ")));
            }
            outln!("{line}");
            if !t.description.is_empty() {
                outln!("      {}", t.description);
            }
        }
    }
    for p in &r.errors {
        outln!("error     {p}");
    }
    for p in &r.warnings {
        outln!("warning   {p}");
    }
    if !view.team.is_empty() {
        // Who joined and left the run's team while it ran, and why.
        outln!();
        outln!("team changes:");
        for c in &view.team {
            use flotilla_model::recruit::TeamChangeKind;
            let what = match c.kind {
                TeamChangeKind::Recruited => format!(
                    "recruited {} as task {} ({})",
                    c.member,
                    c.task_id.as_ref().map(|t| t.as_str()).unwrap_or("-"),
                    c.id
                ),
                TeamChangeKind::Retired => format!(
                    "retired {} ({} reassigned, {} failed)",
                    c.member,
                    c.reassigned.len(),
                    c.failed.len()
                ),
                TeamChangeKind::Refused => format!(
                    "refused recruit {} of {}: {}",
                    c.id,
                    c.member,
                    c.refusal.as_deref().unwrap_or("-")
                ),
            };
            outln!("  {}  {what}, by {}: {}", c.at, c.by, c.reason);
        }
    }
    if !view.tasks.is_empty() {
        outln!();
        let width = view
            .tasks
            .iter()
            .map(|t| t.task_id.as_str().chars().count())
            .max()
            .unwrap_or(4)
            .clamp(4, 32);
        outln!(
            "{:<width$}  {:<17}  {:<10}  {:>8}  DETAIL",
            "TASK",
            "STATUS",
            "POOL",
            "ATTEMPTS"
        );
        let now = Timestamp::now();
        for t in &view.tasks {
            let running = progress.running.get(&t.task_id).map(|a| {
                format!(
                    "on {} for {}",
                    a.worker,
                    format_duration_ms(
                        u64::try_from(now.unix_ms() - a.started_at.unix_ms()).unwrap_or(0)
                    )
                )
            });
            let asked = progress
                .waits_of(&t.task_id)
                .next()
                .map(|w| format!("{}: {}", w.what, w.answer));
            let detail = asked
                .or(running)
                .or_else(|| t.error.as_ref().map(ToString::to_string))
                .or_else(|| t.skip_reason.clone())
                .or_else(|| t.paused_until.map(|u| format!("paused until {u}")))
                .or_else(|| {
                    (t.status == flotilla_model::run::TaskStatus::Dispatched)
                        .then(|| "queued for a worker".to_owned())
                })
                .unwrap_or_default();
            outln!(
                "{:<width$}  {:<17}  {:<10}  {:>8}  {detail}",
                fit(t.task_id.as_str(), width),
                progress::task_label(t, &progress),
                t.pool.as_deref().unwrap_or("-"),
                t.attempts
            );
        }
        if !r.status.is_terminal() {
            waiting_pools(&bus, &view).await;
        }
    }
    if let Some(o) = &r.outcome {
        if let Some(reason) = &o.reason {
            outln!("\nreason    {reason}");
        }
        if let Some(fr) = &o.final_result {
            outln!("\n{}", fr.response);
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) async fn history(config: &Config, run: RunId, json: bool) -> anyhow::Result<ExitCode> {
    let store = store(config).await?;
    let entries = store.history(run).await?;
    if entries.is_empty() && store.load(run).await?.is_none() {
        errln!("error: run {run} does not exist");
        return Ok(ExitCode::from(1));
    }
    if json {
        let items: Vec<_> = entries
            .iter()
            .map(|(seq, ts, e)| serde_json::json!({ "seq": seq, "ts": ts, "entry": e }))
            .collect();
        outln!("{}", serde_json::to_string_pretty(&items)?);
        return Ok(ExitCode::SUCCESS);
    }
    outln!("{:>8}  {:<30}  {:<13}  DETAIL", "SEQ", "TIME", "INPUT");
    for (seq, ts, e) in entries {
        let (kind, detail) = match &e.input {
            RunInput::Submitted(s) => match &s.planning {
                Some(p) => ("submitted", format!("query to plan: {}", p.query)),
                None => ("submitted", format!("{} subtasks", s.plan.subtasks.len())),
            },
            RunInput::Planned(p) => (
                "planned",
                match &p.decision {
                    PlanDecision::Accepted { plan, .. } => format!(
                        "round {}: plan accepted, {} subtasks",
                        p.round,
                        plan.subtasks.len()
                    ),
                    PlanDecision::Repair { problems, .. } => format!(
                        "round {}: {} problem(s), repair: {}",
                        p.round,
                        problems.len(),
                        problems
                            .first()
                            .map(ToString::to_string)
                            .unwrap_or_default()
                    ),
                    PlanDecision::Failed { problems } => format!(
                        "round {}: {} problem(s), planning failed: {}",
                        p.round,
                        problems.len(),
                        problems
                            .first()
                            .map(ToString::to_string)
                            .unwrap_or_default()
                    ),
                },
            ),
            RunInput::TaskResult(r) => (
                "task_result",
                format!(
                    "{} attempt {} on {}: {}",
                    r.task_id,
                    r.attempt,
                    r.worker,
                    if r.result.success {
                        "success".to_owned()
                    } else {
                        r.result
                            .error
                            .as_ref()
                            .map(ToString::to_string)
                            .unwrap_or_else(|| "failure".into())
                    }
                ),
            ),
            RunInput::Claimed(c) => (
                "claimed",
                format!(
                    "{} attempt {} by {} (role {}) on {}",
                    c.task_id, c.attempt, c.agent, c.role, c.worker
                ),
            ),
            RunInput::Recruited(r) => (
                "recruited",
                format!(
                    "{} as task {} (role {}) by {}: {}",
                    r.recruit_id,
                    r.subtask.id,
                    r.subtask.role.as_deref().unwrap_or("-"),
                    r.by,
                    r.reason
                ),
            ),
            RunInput::Assigned(a) => (
                "assigned",
                format!("{} by {}: {}", a.task_id, a.by, a.reason),
            ),
            RunInput::ApprovalDecided(a) => (
                "approval_decided",
                format!(
                    "{} {} (attempt {}): {} by {}",
                    a.approval_id,
                    a.task_id,
                    a.attempt,
                    a.decision.as_str(),
                    a.by
                ),
            ),
            RunInput::Suspended(su) => (
                "suspended",
                match &su.call {
                    Some(c) => format!(
                        "{} (attempt {}) at tool {} ({}) on {}",
                        su.task_id,
                        su.attempt,
                        c.tool,
                        c.trigger.as_str(),
                        su.worker
                    ),
                    None => format!(
                        "{} (attempt {}) at a step boundary, the run being held, on {}",
                        su.task_id, su.attempt, su.worker
                    ),
                },
            ),
            RunInput::Finished(f) => (
                "finished",
                format!("by {}: {} bytes of result", f.by, f.result.len()),
            ),
            RunInput::Retired(r) => (
                "retired",
                format!(
                    "{} ({}) by {}: {}",
                    r.member,
                    r.policy.as_str(),
                    r.by,
                    r.reason
                ),
            ),
            RunInput::TimerFired { generation } => {
                ("timer_fired", format!("generation {generation}"))
            }
            RunInput::TopicWritten { topic, seq } => {
                ("topic_written", format!("{topic} (workspace seq {seq})"))
            }
            RunInput::Rejected(r) => (
                "rejected",
                format!(
                    "{} problem(s): {}",
                    r.errors.len(),
                    r.errors
                        .first()
                        .map(ToString::to_string)
                        .unwrap_or_default()
                ),
            ),
            RunInput::Control(c) => (
                "control",
                format!(
                    "{}{}{}{}{}",
                    c.action.as_str(),
                    c.task_id
                        .as_ref()
                        .map(|t| format!(" task {t}"))
                        .unwrap_or_default(),
                    c.reason
                        .as_deref()
                        .map(|r| format!(": {r}"))
                        .unwrap_or_default(),
                    c.by.as_deref()
                        .map(|b| format!(" (by {b})"))
                        .unwrap_or_default(),
                    c.timeout_ms
                        .map(|ms| format!(" for {} s", ms / 1000))
                        .unwrap_or_default()
                ),
            ),
            RunInput::PlanEdited(pe) => (
                "plan_edited",
                format!(
                    "by {}: {} subtasks{}",
                    pe.by,
                    pe.plan.subtasks.len(),
                    pe.reason
                        .as_deref()
                        .map(|r| format!(" ({r})"))
                        .unwrap_or_default()
                ),
            ),
            RunInput::Completed(c) => (
                "completed",
                format!(
                    "{} by {}: {} bytes of result{}",
                    c.task_id,
                    c.by,
                    c.result.len(),
                    c.comment
                        .as_deref()
                        .map(|m| format!(" ({m})"))
                        .unwrap_or_default()
                ),
            ),
        };
        outln!("{seq:>8}  {:<30}  {kind:<13}  {detail}", ts.to_rfc3339());
    }
    Ok(ExitCode::SUCCESS)
}

/// Says which pools the run's queued tasks wait on, and whether any worker serves them.
async fn waiting_pools(bus: &Bus, view: &flotilla_model::run::RunView) {
    let pools: std::collections::BTreeSet<&str> = view
        .tasks
        .iter()
        .filter(|t| t.status == flotilla_model::run::TaskStatus::Dispatched)
        .filter_map(|t| t.pool.as_deref())
        .collect();
    if pools.is_empty() {
        return;
    }
    let live = flotilla_client::Client::new(bus.clone())
        .live_workers()
        .await
        .unwrap_or_default();
    outln!();
    for pool in pools {
        let n = live.iter().filter(|(w, _)| w.pool == pool).count();
        if n == 0 {
            outln!(
                "waiting   pool {pool}: tasks are queued, and NO live worker serves this pool (start `flotilla worker --pool {pool}`)"
            );
        } else {
            outln!("pool      {pool}: {n} live worker(s)");
        }
    }
}

pub(crate) async fn workers(config: &Config, json: bool) -> anyhow::Result<ExitCode> {
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    let infos = flotilla_client::Client::new(bus).live_workers().await?;
    let now = Timestamp::now().unix_ms();
    if json {
        let items: Vec<_> = infos
            .iter()
            .map(|(w, seen)| {
                serde_json::json!({ "worker": w, "last_seen": seen, "last_seen_secs_ago": (now - seen.unix_ms()).max(0) as f64 / 1000.0 })
            })
            .collect();
        outln!("{}", serde_json::to_string_pretty(&items)?);
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "{:<28}  {:<10}  {:<20}  {:>8}  {:>8}  {:>10}  STARTED",
        "WORKER",
        "POOL",
        "HOST",
        "PID",
        "BUSY",
        "LAST SEEN"
    );
    for (w, seen) in infos {
        let ago = (now - seen.unix_ms()).max(0) as f64 / 1000.0;
        outln!(
            "{:<28}  {:<10}  {:<20}  {:>8}  {:>8}  {:>10}  {}",
            w.id,
            w.pool,
            w.host.chars().take(20).collect::<String>(),
            w.pid,
            format!("{}/{}", w.in_flight, w.concurrency),
            format!("{ago:.1}s ago"),
            w.started_at
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// How `flotilla runs cancel` cancels and what it waits for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CancelHow {
    /// Undo the succeeded tasks that declare a compensation.
    pub(crate) rollback: bool,
    /// Wait for the run's end (and its rollback's).
    pub(crate) wait: bool,
    /// Machine-readable output.
    pub(crate) json: bool,
}

/// `flotilla runs cancel RUN [--reason] [--rollback] [--no-wait]`: asks the coordinators to
/// cancel, then (by default) waits for the run to end — and, with `--rollback`, for its
/// rollback run, exiting 1 when a compensation failed.
pub(crate) async fn cancel(
    config: &Config,
    run: RunId,
    reason: Option<String>,
    how: CancelHow,
) -> anyhow::Result<ExitCode> {
    let json = how.json;
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    let client = flotilla_client::Client::new(bus);
    let asked = if how.rollback {
        client.cancel_and_roll_back(run, reason).await
    } else {
        client.cancel(run, reason).await
    };
    let reply = match asked {
        Ok(r) => r,
        Err(e) if e.kind() == flotilla_client::ClientErrorKind::Api => {
            errln!("error: {e}");
            return Ok(ExitCode::from(1));
        }
        Err(e) => return Err(e.into()),
    };
    if !reply.cancelling {
        if json {
            outln!("{}", serde_json::to_string_pretty(&reply)?);
        } else {
            errln!("Run {run} had already ended: {}", reply.status);
        }
        return Ok(ExitCode::SUCCESS);
    }
    if !how.wait {
        if json {
            outln!("{}", serde_json::to_string_pretty(&reply)?);
        } else {
            errln!("Cancelling run {run}");
            if let Some(r) = reply.rollback_run_id {
                errln!("  its rollback, if any task needs undoing: run {r}");
            }
        }
        return Ok(ExitCode::SUCCESS);
    }
    errln!("Cancelling run {run}…");
    let outcome = client
        .wait(run, std::time::Duration::from_secs(120))
        .await?;
    if !json {
        errln!("Run {run} {}", outcome.status);
        if let Some(reason) = &outcome.reason {
            errln!("  reason: {reason}");
        }
    }
    let Some(rollback) = outcome.rollback_run_id else {
        if json {
            outln!("{}", serde_json::to_string_pretty(&outcome)?);
        } else if how.rollback && outcome.status == RunStatus::Cancelled {
            errln!("  nothing to roll back: no succeeded task declares a compensation");
        }
        return Ok(ExitCode::SUCCESS);
    };
    if !json {
        errln!("Rolling back in run {rollback}…");
    }
    let undone = client
        .wait(rollback, std::time::Duration::from_secs(600))
        .await?;
    let ok = undone.status == RunStatus::Succeeded;
    if json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "outcome": outcome,
                "rollback": undone,
            }))?
        );
    } else {
        errln!("Rollback run {rollback} {}", undone.status);
        if !ok && let Some(reason) = &undone.reason {
            errln!("  reason: {reason}");
        }
        for f in &undone.failed {
            errln!("  compensation {} failed: {}", f.task_id, f.error);
        }
        for s in &undone.skipped {
            errln!("  compensation {} not run: {}", s.task_id, s.reason);
        }
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `flotilla runs tree RUN`: the run and, recursively, the child runs its agents started,
/// with agent, status, duration, tokens and cost per run (the engine of `api.run.tree`).
pub(crate) async fn tree(
    config: &Config,
    run: RunId,
    max_runs: usize,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    let client = flotilla_client::Client::new(bus);
    let Some(tree) = client.tree(run, max_runs).await? else {
        errln!("error: run {run} does not exist");
        return Ok(ExitCode::from(1));
    };
    if json {
        outln!("{}", serde_json::to_string_pretty(&tree)?);
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "{:<40} {:<16} {:<10} {:>9} {:>9} {:>10}  VIA",
        "RUN",
        "AGENT",
        "STATUS",
        "DURATION",
        "TOKENS",
        "COST"
    );
    print_tree(&tree.root, 0);
    if let Some(f) = &tree.root.fork_of {
        outln!("{}", fork_line(f));
    }
    let total = &tree.root.subtree_usage;
    outln!(
        "{} run{}, {} tokens in {} model call{}{}{}",
        tree.runs,
        if tree.runs == 1 { "" } else { "s" },
        total.tokens(),
        total.calls,
        if total.calls == 1 { "" } else { "s" },
        if total.cost_usd > 0.0 {
            format!(", ${:.4}", total.cost_usd)
        } else {
            String::new()
        },
        if tree.omitted > 0 {
            format!(" ({} more not listed: --max-runs)", tree.omitted)
        } else {
            String::new()
        }
    );
    Ok(ExitCode::SUCCESS)
}

/// `fork of <run> at <task> (N results kept)`.
fn fork_line(f: &flotilla_model::fork::ForkRef) -> String {
    format!(
        "fork of   {} at {} ({} result{} kept)",
        f.run_id,
        f.task_id,
        f.reused,
        if f.reused == 1 { "" } else { "s" }
    )
}

fn print_tree(node: &flotilla_model::tree::RunTreeNode, depth: usize) {
    let via = match (&node.parent_task_id, &node.parent_tool_call_id) {
        (Some(t), Some(c)) => format!("{t} ({c})"),
        (Some(t), None) => t.to_string(),
        _ => node.name.clone().unwrap_or_default(),
    };
    let run = format!("{}{}", "  ".repeat(depth), node.run_id);
    outln!(
        "{:<40} {:<16} {:<10} {:>9} {:>9} {:>10}  {}",
        run,
        node.agent.as_deref().unwrap_or("-"),
        node.status.as_str(),
        format_duration_ms(node.duration_ms),
        node.usage.tokens(),
        format_cost(node.usage.cost_usd),
        via
    );
    for c in &node.children {
        print_tree(c, depth + 1);
    }
}

/// A cost in US dollars as the run tables print it (`-` for none).
pub(crate) fn format_cost(usd: f64) -> String {
    if usd > 0.0 {
        format!("${usd:.4}")
    } else {
        "-".to_owned()
    }
}

/// A duration as the run tables print it: `850ms`, `4.2s`, `3m05s`.
pub(crate) fn format_duration_ms(ms: u64) -> String {
    if ms < 1_000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        format!("{:.1}s", ms as f64 / 1_000.0)
    } else {
        format!("{}m{:02}s", ms / 60_000, (ms % 60_000) / 1_000)
    }
}

/// `flotilla sessions show SESSION`: the runs of a session, oldest first.
pub(crate) async fn session(
    config: &Config,
    session: flotilla_model::ids::SessionId,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    let client = flotilla_client::Client::new(bus);
    let view = client.session(session).await?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&view)?);
        return Ok(ExitCode::SUCCESS);
    }
    if view.runs.is_empty() {
        errln!("Session {session} has no runs");
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "{:<36}  {:<36}  {:<10}  {:<24}  NAME",
        "RUN",
        "PARENT",
        "STATUS",
        "CREATED"
    );
    for r in &view.runs {
        outln!(
            "{:<36}  {:<36}  {:<10}  {:<24}  {}",
            r.handle.run_id,
            r.handle
                .parent_run_id
                .map_or_else(|| "-".to_owned(), |p| p.to_string()),
            r.status.as_str(),
            r.created_at.to_rfc3339(),
            r.name.as_deref().unwrap_or("-")
        );
    }
    if view.omitted > 0 {
        outln!("({} older runs not listed)", view.omitted);
    }
    Ok(ExitCode::SUCCESS)
}
