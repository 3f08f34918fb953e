//! `flotilla eval --variant FILE (--runs IDS | --label K=V | --plan NAME | --session S)`: a
//! change tried on many past runs. Each selected run is forked with the variant (`run.fork`,
//! a few at a time), waited for, and compared with its original (`runs diff`); the report is
//! a row per run and totals, as Markdown or JSON.
//!
//! Each fork's id is derived from its original and the variant
//! ([`flotilla_model::fork::derived_fork_id`]), so an eval run again — after an interruption,
//! or to print its report again — finds the forks it already made (`duplicate`) and waits for
//! them instead of running them twice. Selected by plan, label or session, forks themselves
//! are never taken (`--runs` takes what it names).

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use flotilla_model::diff::RunDiff;
use flotilla_model::fork::{RunForkRequest, derived_fork_id};
use flotilla_model::ids::{RunId, SessionId, TaskId};
use flotilla_model::run::{RunRecord, RunStatus};
use flotilla_model::tree::UsageTotals;
use futures::StreamExt;
use serde::{Deserialize, Serialize};

use super::team::connect;
use crate::config::Config;

/// How long one fork may take to end.
const FORK_WAIT: Duration = Duration::from_secs(24 * 3600);

/// What an eval changes in every run it forks: the fork point and its changes, as
/// `runs fork` takes them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Variant {
    /// The fork point: a task every selected run's plan has.
    pub(crate) at: String,
    /// Another agent for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) agent: Option<String>,
    /// Other instructions for it (its description).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) description: Option<String>,
    /// Another input for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) input: Option<serde_json::Value>,
}

/// Which past runs an eval forks.
#[derive(Debug, Default)]
pub(crate) struct Selector {
    pub(crate) runs: Vec<RunId>,
    pub(crate) label: Option<String>,
    pub(crate) plan: Option<String>,
    pub(crate) session: Option<SessionId>,
    pub(crate) limit: usize,
}

/// One run of the eval.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Row {
    pub(crate) run_id: RunId,
    pub(crate) fork_id: RunId,
    pub(crate) original: RunStatus,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) fork: Option<RunStatus>,
    /// Tasks whose result or status changed.
    pub(crate) changed: Vec<TaskId>,
    pub(crate) original_usage: UsageTotals,
    pub(crate) fork_usage: UsageTotals,
    pub(crate) original_ms: u64,
    pub(crate) fork_ms: u64,
    /// Why the run could not be forked or compared.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) error: Option<String>,
}

/// The eval's report.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Report {
    pub(crate) variant: Variant,
    pub(crate) rows: Vec<Row>,
    pub(crate) runs: usize,
    pub(crate) original_succeeded: usize,
    pub(crate) fork_succeeded: usize,
    pub(crate) changed_runs: usize,
    pub(crate) errors: usize,
    pub(crate) original_usage: UsageTotals,
    pub(crate) fork_usage: UsageTotals,
}

/// Runs the eval and prints its report: exit 0 when every selected run was forked and
/// compared, 1 otherwise (a run without the fork point, a refused fork, no run selected).
pub(crate) async fn eval(
    config: &Config,
    variant: &Path,
    selector: Selector,
    concurrency: usize,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let variant = read_variant(variant)?;
    let client = connect(config).await?;
    let store = flotilla_client::open_store(client.bus()).await?;
    let selected = select(&store, &selector).await?;
    if selected.is_empty() {
        errln!("error: no ended run matches the selection");
        return Ok(ExitCode::from(1));
    }
    let key = serde_json::to_string(&variant)?;
    let total = selected.len();
    errln!(
        "Forking {total} runs at {} ({concurrency} at a time)",
        variant.at
    );
    let mut done = 0usize;
    let mut rows: Vec<Row> = Vec::with_capacity(total);
    let mut forks = futures::stream::iter(selected.into_iter().map(|record| {
        let (client, variant, key) = (client.clone(), variant.clone(), key.clone());
        async move { one(&client, record, &variant, &key).await }
    }))
    .buffer_unordered(concurrency.max(1));
    while let Some(row) = forks.next().await {
        done += 1;
        let what = match (&row.error, row.fork) {
            (Some(e), _) => format!("error: {e}"),
            (None, Some(s)) => format!("{} ({} changed)", s.as_str(), row.changed.len()),
            (None, None) => "-".to_owned(),
        };
        errln!("[{done}/{total}] {} → {}: {what}", row.run_id, row.fork_id);
        rows.push(row);
    }
    drop(forks);
    rows.sort_by_key(|r| r.run_id);
    let report = summarize(variant, rows);
    if json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        outln!("{}", markdown(&report).trim_end());
    }
    Ok(if report.errors == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn read_variant(path: &Path) -> anyhow::Result<Variant> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read the variant {}: {e}", path.display()))?;
    let is_toml = path.extension().is_some_and(|e| e == "toml");
    let variant: Variant = if is_toml {
        use figment::providers::Format;
        figment::Figment::from(figment::providers::Toml::string(&text))
            .extract()
            .map_err(|e| anyhow::anyhow!("invalid variant {}: {e}", path.display()))?
    } else {
        serde_json::from_str(&text)
            .map_err(|e| anyhow::anyhow!("invalid variant {}: {e}", path.display()))?
    };
    anyhow::ensure!(
        !variant.at.trim().is_empty(),
        "invalid variant {}: `at` names no task",
        path.display()
    );
    Ok(variant)
}

/// The ended runs the selector names, oldest first, at most `limit`; never a fork.
async fn select(store: &flotilla_runs::RunReader, s: &Selector) -> anyhow::Result<Vec<RunRecord>> {
    let ended = |r: &RunRecord| r.status.is_terminal() && r.status != RunStatus::Rejected;
    let mut out = Vec::new();
    if !s.runs.is_empty() {
        for run in &s.runs {
            let Some(r) = store.record(*run).await? else {
                anyhow::bail!("run {run} does not exist");
            };
            anyhow::ensure!(ended(&r), "run {run} has not ended ({})", r.status.as_str());
            out.push(r);
        }
        return Ok(out);
    }
    let label = match &s.label {
        Some(l) => Some(
            l.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .ok_or_else(|| anyhow::anyhow!("--label takes KEY=VALUE, not {l:?}"))?,
        ),
        None => None,
    };
    anyhow::ensure!(
        label.is_some() || s.plan.is_some() || s.session.is_some(),
        "say which runs: --runs, --label, --plan or --session"
    );
    let mut records = store.recent(usize::MAX).await?;
    records.reverse();
    for r in records {
        if !ended(&r) || r.fork_of.is_some() {
            continue;
        }
        if let Some((k, v)) = &label
            && r.labels.get(k) != Some(v)
        {
            continue;
        }
        if let Some(p) = &s.plan
            && r.name.as_deref() != Some(p.as_str())
        {
            continue;
        }
        if let Some(session) = s.session
            && r.session_id != Some(session)
        {
            continue;
        }
        out.push(r);
    }
    out.truncate(s.limit);
    Ok(out)
}

/// Forks one run with the variant, waits for the fork, and compares the two.
async fn one(
    client: &flotilla_client::Client,
    record: RunRecord,
    variant: &Variant,
    key: &str,
) -> Row {
    let run = record.handle.run_id;
    let fork_id = derived_fork_id(run, key);
    let mut row = Row {
        run_id: run,
        fork_id,
        original: record.status,
        fork: None,
        changed: Vec::new(),
        original_usage: UsageTotals::default(),
        fork_usage: UsageTotals::default(),
        original_ms: 0,
        fork_ms: 0,
        error: None,
    };
    let mut request = RunForkRequest::new(run, TaskId::new(variant.at.clone()));
    request.agent = variant.agent.clone();
    request.description = variant.description.clone();
    request.input = variant.input.clone();
    request.fork_run_id = Some(fork_id);
    request.wait = true;
    match client.call(&request, FORK_WAIT).await {
        Ok(Ok(reply)) if !reply.errors.is_empty() => {
            row.error = Some(
                reply
                    .errors
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; "),
            );
            return row;
        }
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            row.error = Some(format!("{}: {}", e.code, e.message));
            return row;
        }
        Err(e) => {
            row.error = Some(e.to_string());
            return row;
        }
    }
    match client.diff(run, fork_id).await {
        Ok(Ok(d)) => fill(&mut row, &d),
        Ok(Err(missing)) => row.error = Some(format!("run {missing} does not exist")),
        Err(e) => row.error = Some(e.to_string()),
    }
    row
}

fn fill(row: &mut Row, d: &RunDiff) {
    row.fork = Some(d.b.status);
    row.changed = d
        .tasks
        .iter()
        .filter(|t| t.changed)
        .map(|t| t.task_id.clone())
        .collect();
    row.original_usage = d.a.usage;
    row.fork_usage = d.b.usage;
    row.original_ms = d.a.duration_ms;
    row.fork_ms = d.b.duration_ms;
}

fn summarize(variant: Variant, rows: Vec<Row>) -> Report {
    let mut original_usage = UsageTotals::default();
    let mut fork_usage = UsageTotals::default();
    for r in &rows {
        original_usage.add(&r.original_usage);
        fork_usage.add(&r.fork_usage);
    }
    Report {
        variant,
        runs: rows.len(),
        original_succeeded: rows
            .iter()
            .filter(|r| r.original == RunStatus::Succeeded)
            .count(),
        fork_succeeded: rows
            .iter()
            .filter(|r| r.fork == Some(RunStatus::Succeeded))
            .count(),
        changed_runs: rows.iter().filter(|r| !r.changed.is_empty()).count(),
        errors: rows.iter().filter(|r| r.error.is_some()).count(),
        original_usage,
        fork_usage,
        rows,
    }
}

/// The report as a Markdown table, a row per run, then the totals.
fn markdown(r: &Report) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| run | fork | original | fork status | changed | tokens (orig → fork) | cost (orig → fork) | duration (orig → fork) |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|");
    for row in &r.rows {
        let status = match (&row.error, row.fork) {
            (Some(e), _) => format!("error: {}", e.replace('|', "\\|")),
            (None, Some(s)) => s.as_str().to_owned(),
            (None, None) => "-".to_owned(),
        };
        let changed: Vec<&str> = row.changed.iter().map(TaskId::as_str).collect();
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} → {} | ${:.4} → ${:.4} | {} → {} ms |",
            row.run_id,
            row.fork_id,
            row.original.as_str(),
            status,
            if changed.is_empty() {
                "-".to_owned()
            } else {
                changed.join(", ")
            },
            row.original_usage.tokens(),
            row.fork_usage.tokens(),
            row.original_usage.cost_usd,
            row.fork_usage.cost_usd,
            row.original_ms,
            row.fork_ms
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{} runs forked at {}: {} of {} forks succeeded (originals: {}), {} with a changed result, {} errors; tokens {} → {}, cost ${:.4} → ${:.4}",
        r.runs,
        r.variant.at,
        r.fork_succeeded,
        r.runs,
        r.original_succeeded,
        r.changed_runs,
        r.errors,
        r.original_usage.tokens(),
        r.fork_usage.tokens(),
        r.original_usage.cost_usd,
        r.fork_usage.cost_usd
    );
    out
}

/// `--runs` values: ids separated by commas (or given several times).
pub(crate) fn run_ids(values: &[String]) -> anyhow::Result<Vec<RunId>> {
    values
        .iter()
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(|v| {
            v.parse::<RunId>()
                .map_err(|e| anyhow::anyhow!("--runs: {v:?} is not a run id: {e}"))
        })
        .collect()
}
