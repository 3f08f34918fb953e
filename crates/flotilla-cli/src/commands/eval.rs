//! `flotilla eval --variant FILE (--runs IDS | --label K=V | --plan NAME | --session S)
//! [--judge AGENT] [--max-tokens N] [--max-cost USD]`: a change tried on many past runs. Each
//! selected run is forked with the variant (`run.fork`, a few at a time), waited for, and
//! compared with its original (`runs diff`); with `--judge`, an agent scores each pair; the
//! report is a row per run and totals, as Markdown or JSON.
//!
//! Each fork's id is derived from its original and the variant
//! ([`flotilla_model::fork::derived_fork_id`]), and each judgement's from its fork and the
//! judge agent ([`judge_run_id`]), so an eval run again — after an interruption, or to print
//! its report again — finds the forks and judgements it already made (`duplicate`) and waits
//! for them instead of paying for them twice. Selected by plan, label or session, forks
//! themselves are never taken (`--runs` takes what it names).
//!
//! The budget (`--max-tokens`, `--max-cost`) covers the forks' and the judge runs' model
//! usage, read from their usage events. It is checked before each fork starts: once the eval
//! has spent it, no fork starts, and the runs left are reported `not_run`. Forks in flight
//! finish (and are judged), so the eval can end above its budget by what they spent. Forks and
//! judgements found from an earlier attempt count as spent too: the budget is the eval's, not
//! one invocation's, so an eval run again with the same budget stops at the same run.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use flotilla_model::diff::RunDiff;
use flotilla_model::fork::{RunForkRequest, derived_fork_id};
use flotilla_model::ids::{RunId, SessionId, TaskId};
use flotilla_model::plan::{Plan, Subtask};
use flotilla_model::run::{RunOutcome, RunRecord, RunStatus};
use flotilla_model::submit::{SubmitRequest, SubmitStatus};
use flotilla_model::tree::UsageTotals;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::team::connect;
use crate::config::Config;

/// How long one fork, or one judgement, may take to end.
const RUN_WAIT: Duration = Duration::from_secs(24 * 3600);
/// How long a coordinator may take to accept (or refuse) a fork or a judge run: both are
/// answered at once, and their ends are then followed on the event stream, which no request
/// timeout of the connection cuts short.
const ANSWER_WAIT: Duration = Duration::from_secs(30);
/// The judge run's plan name (shown by `runs list`).
const JUDGE_PLAN: &str = "eval-judge";
/// The label a judge run carries, naming the fork it judges.
const JUDGE_LABEL: &str = "eval.judge-of";
/// What the judge agent is asked: its task's description. The pair is its task's `input`.
const JUDGE_INSTRUCTIONS: &str = "You judge a change tried on a past run. The task input has \
the original run's final answer (`original.response`) and the answer of the same run forked at \
task `at` with the change `variant` (`fork.response`), with each run's status. Score the \
fork's answer against the original's, from 0 (wrong, or much worse) to 1 (as good or better). \
Answer with JSON only: {\"score\": <number from 0 to 1>, \"reason\": \"<one sentence>\"}";
/// At most this much of a judge's answer is quoted in a `judge_error`.
const QUOTE_CHARS: usize = 120;

/// What an eval changes in every run it forks: the fork point and its changes, as
/// `runs fork` takes them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Variant {
    /// The fork point: a task every selected run's plan has; `TASK:STEP` forks inside its
    /// conversation (`runs fork --at TASK:STEP`).
    pub(crate) at: String,
    /// Another agent for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) agent: Option<String>,
    /// Another model for it (an LLM agent's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) model: Option<String>,
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

/// How an eval runs, besides what it forks.
#[derive(Debug, Default)]
pub(crate) struct EvalOptions {
    /// Forks (with their judgements) in flight at once.
    pub(crate) concurrency: usize,
    /// The report as JSON instead of Markdown.
    pub(crate) json: bool,
    /// The agent that scores each pair, if any.
    pub(crate) judge: Option<String>,
    /// What the eval may spend.
    pub(crate) budget: Budget,
}

/// What an eval may spend on model calls — its forks' and judge runs' — before it starts no
/// more forks. Either limit, or both; neither is no budget.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub(crate) struct Budget {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) max_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) max_cost_usd: Option<f64>,
}

impl Budget {
    fn is_set(&self) -> bool {
        self.max_tokens.is_some() || self.max_cost_usd.is_some()
    }

    /// Why no fork may start after `spent`, once it reached a limit.
    fn spent(&self, spent: &UsageTotals) -> Option<String> {
        let tokens = self.max_tokens.is_some_and(|m| spent.tokens() >= m);
        let cost = self.max_cost_usd.is_some_and(|m| spent.cost_usd >= m);
        (tokens || cost).then(|| {
            format!(
                "eval budget spent ({} tokens / {} of {})",
                spent.tokens(),
                usd(spent.cost_usd),
                self.limits()
            )
        })
    }

    /// The limits in words: `200 tokens`, `$0.0100`, or both.
    fn limits(&self) -> String {
        match (self.max_tokens, self.max_cost_usd) {
            (Some(t), Some(c)) => format!("{t} tokens, {}", usd(c)),
            (Some(t), None) => format!("{t} tokens"),
            (None, Some(c)) => usd(c),
            (None, None) => "no budget".to_owned(),
        }
    }
}

/// A dollar amount: four decimals, six under a cent (scripted and small models cost
/// fractions of a cent per run, which four decimals would show as nothing).
fn usd(v: f64) -> String {
    if v > 0.0 && v < 0.01 {
        format!("${v:.6}")
    } else {
        format!("${v:.4}")
    }
}

/// `--max-tokens`: a whole number above 0 (a budget of nothing would fork nothing).
pub(crate) fn max_tokens_arg(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(0) => Err("the eval's token budget must be more than 0".to_owned()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!(
            "{s:?} is not a number of tokens (a whole number above 0)"
        )),
    }
}

/// `--max-cost`: US dollars above 0 (`0.25` or `$0.25`).
pub(crate) fn max_cost_arg(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let v = t
        .strip_prefix('$')
        .unwrap_or(t)
        .parse::<f64>()
        .map_err(|_| format!("{s:?} is not an amount in US dollars (e.g. 0.50)"))?;
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!(
            "the eval's cost budget must be more than $0, not {s:?}"
        ))
    }
}

/// Where one run of the eval stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum RowState {
    /// Forked, the fork ended, and it was compared with its original.
    Compared,
    /// Not forked or not compared: `error` says why.
    Error,
    /// Not forked: the eval's budget was spent first (`reason`).
    NotRun,
}

/// One run of the eval.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Row {
    pub(crate) run_id: RunId,
    pub(crate) fork_id: RunId,
    pub(crate) status: RowState,
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
    /// Why the run was not forked (`not_run`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) reason: Option<String>,
    /// The judge run of the pair.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) judge_run_id: Option<RunId>,
    /// The judge's score, 0 to 1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) score: Option<f64>,
    /// The judge's reason for its score.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) judge_reason: Option<String>,
    /// Why the pair has no score: the judge run failed, or its answer was not a score.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) judge_error: Option<String>,
    /// The judge run's model usage.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) judge_usage: Option<UsageTotals>,
}

impl Row {
    fn new(record: &RunRecord, fork_id: RunId, status: RowState) -> Self {
        Self {
            run_id: record.handle.run_id,
            fork_id,
            status,
            original: record.status,
            fork: None,
            changed: Vec::new(),
            original_usage: UsageTotals::default(),
            fork_usage: UsageTotals::default(),
            original_ms: 0,
            fork_ms: 0,
            error: None,
            reason: None,
            judge_run_id: None,
            score: None,
            judge_reason: None,
            judge_error: None,
            judge_usage: None,
        }
    }

    /// What the row spent: its fork's and its judgement's model usage.
    fn spent(&self) -> UsageTotals {
        let mut u = self.fork_usage;
        if let Some(j) = &self.judge_usage {
            u.add(j);
        }
        u
    }

    fn failed(mut self, error: String) -> Self {
        self.status = RowState::Error;
        self.error = Some(error);
        self
    }
}

/// The judge's part of the totals.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct JudgeTotals {
    pub(crate) agent: String,
    /// Pairs with a score.
    pub(crate) judged: usize,
    /// Pairs whose judgement failed.
    pub(crate) errors: usize,
    /// The mean of the scores (none when no pair was scored).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) mean_score: Option<f64>,
    pub(crate) usage: UsageTotals,
}

/// The budget's part of the totals.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct BudgetTotals {
    #[serde(flatten)]
    pub(crate) limits: Budget,
    /// The forks' and judge runs' usage.
    pub(crate) spent: UsageTotals,
    /// Whether the budget stopped the eval before every run was forked.
    pub(crate) stopped: bool,
    /// Runs not forked because of it.
    pub(crate) not_run: usize,
    /// Why it stopped (`eval budget spent (…)`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) reason: Option<String>,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) judge: Option<JudgeTotals>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) budget: Option<BudgetTotals>,
}

/// Runs the eval and prints its report. Exit 0 when every selected run was forked, compared
/// and (with a judge) scored; 1 when one was not (a run without the fork point, a refused
/// fork, a judgement that failed, no run selected); 3 when the budget stopped the eval before
/// every run was forked, whatever else happened. Bad arguments exit 2, before anything is
/// forked.
pub(crate) async fn eval(
    config: &Config,
    variant: &Path,
    selector: Selector,
    opts: EvalOptions,
) -> anyhow::Result<ExitCode> {
    let variant = read_variant(variant)?;
    let judge = match opts.judge.as_deref().map(str::trim) {
        Some("") => anyhow::bail!("--judge names no agent"),
        j => j.map(str::to_owned),
    };
    if let Some(t) = opts.budget.max_tokens {
        anyhow::ensure!(t > 0, "--max-tokens must be more than 0");
    }
    if let Some(c) = opts.budget.max_cost_usd {
        anyhow::ensure!(c.is_finite() && c > 0.0, "--max-cost must be more than $0");
    }
    let client = connect(config).await?;
    let store = flotilla_client::open_store(client.bus()).await?;
    let selected = select(&store, &selector).await?;
    if selected.is_empty() {
        errln!("error: no ended run matches the selection");
        return Ok(ExitCode::from(1));
    }
    let key = serde_json::to_string(&variant)?;
    let total = selected.len();
    let concurrency = opts.concurrency.max(1);
    errln!(
        "Forking {total} runs at {} ({concurrency} at a time){}{}",
        variant.at,
        judge
            .as_deref()
            .map(|j| format!(", judged by {j}"))
            .unwrap_or_default(),
        if opts.budget.is_set() {
            format!(", budget {}", opts.budget.limits())
        } else {
            String::new()
        }
    );
    let mut waiting = selected.into_iter();
    let mut running = FuturesUnordered::new();
    let mut rows: Vec<Row> = Vec::with_capacity(total);
    let mut spent = UsageTotals::default();
    let mut stopped: Option<String> = None;
    loop {
        while stopped.is_none() && running.len() < concurrency {
            let Some(record) = waiting.next() else { break };
            let (client, variant, key, judge) =
                (client.clone(), variant.clone(), key.clone(), judge.clone());
            running
                .push(async move { one(&client, record, &variant, &key, judge.as_deref()).await });
        }
        let Some(row) = running.next().await else {
            break;
        };
        spent.add(&row.spent());
        errln!("[{}/{total}] {}", rows.len() + 1, progress(&row));
        rows.push(row);
        if stopped.is_none()
            && let Some(why) = opts.budget.spent(&spent)
        {
            let left = waiting.len();
            if left > 0 {
                errln!(
                    "{why}: {left} runs not forked{}",
                    if running.is_empty() {
                        String::new()
                    } else {
                        format!(" (the {} in flight finish)", running.len())
                    }
                );
            }
            stopped = Some(why);
        }
    }
    if let Some(why) = &stopped {
        for record in waiting {
            let fork_id = derived_fork_id(record.handle.run_id, &key);
            let mut row = Row::new(&record, fork_id, RowState::NotRun);
            row.reason = Some(why.clone());
            rows.push(row);
        }
    }
    rows.sort_by_key(|r| r.run_id);
    let report = summarize(variant, rows, judge, opts.budget, spent, stopped);
    if opts.json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        outln!("{}", markdown(&report).trim_end());
    }
    let judge_errors = report.judge.as_ref().map_or(0, |j| j.errors);
    Ok(if report.budget.as_ref().is_some_and(|b| b.not_run > 0) {
        ExitCode::from(3)
    } else if report.errors > 0 || judge_errors > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// The progress line of a row that ended.
fn progress(row: &Row) -> String {
    let what = match (&row.error, row.fork) {
        (Some(e), _) => format!("error: {e}"),
        (None, Some(s)) => format!("{} ({} changed)", s.as_str(), row.changed.len()),
        (None, None) => "-".to_owned(),
    };
    let judged = match (row.score, &row.judge_error) {
        (Some(s), _) => format!(", score {s:.2}"),
        (None, Some(e)) => format!(", judge error: {e}"),
        (None, None) => String::new(),
    };
    format!("{} → {}: {what}{judged}", row.run_id, row.fork_id)
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
    flotilla_model::fork::parse_fork_point(variant.at.trim())
        .map_err(|e| anyhow::anyhow!("invalid variant {}: `at`: {e}", path.display()))?;
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

/// Forks one run with the variant, waits for the fork, compares the two, and (with a judge)
/// has the pair scored.
async fn one(
    client: &flotilla_client::Client,
    record: RunRecord,
    variant: &Variant,
    key: &str,
    judge: Option<&str>,
) -> Row {
    let run = record.handle.run_id;
    let fork_id = derived_fork_id(run, key);
    let row = Row::new(&record, fork_id, RowState::Compared);
    // Checked when the variant was read.
    let (at, step) = flotilla_model::fork::parse_fork_point(variant.at.trim())
        .unwrap_or_else(|_| (TaskId::new(variant.at.clone()), None));
    let mut request = RunForkRequest::new(run, at);
    request.step = step;
    request.model = variant.model.clone();
    request.agent = variant.agent.clone();
    request.description = variant.description.clone();
    request.input = variant.input.clone();
    request.fork_run_id = Some(fork_id);
    // Accepted (or found: `duplicate`) at once; its end is followed on the event stream, so
    // the eval's own progress and concurrency decide how forks are waited for.
    request.wait = false;
    match client.call(&request, ANSWER_WAIT).await {
        Ok(Ok(reply)) if !reply.errors.is_empty() => {
            return row.failed(
                reply
                    .errors
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; "),
            );
        }
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return row.failed(format!("{}: {}", e.code, e.message)),
        Err(e) => return row.failed(e.to_string()),
    }
    let outcome = match client.wait(fork_id, RUN_WAIT).await {
        Ok(o) => o,
        Err(e) => return row.failed(e.to_string()),
    };
    let mut row = match client.diff(run, fork_id).await {
        Ok(Ok(d)) => fill(row, &d),
        Ok(Err(missing)) => return row.failed(format!("run {missing} does not exist")),
        Err(e) => return row.failed(e.to_string()),
    };
    // What the budget counts is the fork's whole tree: its child runs (agents called as
    // tools, transfers, workflow steps) spend too, and `runs diff` counts a run alone.
    // The original's alike, so the two sides compare.
    for (id, fork_side) in [(fork_id, true), (run, false)] {
        let usage = match client.tree(id, 1000).await {
            Ok(Some(t)) => t.root.subtree_usage,
            Ok(None) => continue,
            Err(e) => return row.failed(format!("run {id}'s usage: {e}")),
        };
        if fork_side {
            row.fork_usage = usage;
        } else {
            row.original_usage = usage;
        }
    }
    if let Some(agent) = judge {
        let original = match &record.outcome {
            Some(o) => Some(o.clone()),
            // An ended run's outcome is on its event stream too.
            None => client.wait(run, ANSWER_WAIT).await.ok(),
        };
        let pair = Pair {
            original: side(run, record.status, original.as_ref()),
            fork: side(fork_id, outcome.status, Some(&outcome)),
            at: &variant.at,
            variant,
        };
        judge_pair(client, agent, &pair, &mut row).await;
    }
    row
}

fn fill(mut row: Row, d: &RunDiff) -> Row {
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
    row
}

/// What the judge is shown of the two runs: its task's input.
#[derive(Debug, Serialize)]
struct Pair<'a> {
    original: Value,
    fork: Value,
    at: &'a str,
    variant: &'a Variant,
}

/// One run of a pair as the judge sees it: its id, status and final answer.
fn side(run: RunId, status: RunStatus, outcome: Option<&RunOutcome>) -> Value {
    let response = outcome
        .and_then(|o| o.final_result.as_ref())
        .map(|f| f.response.clone());
    json!({"run_id": run, "status": status, "response": response})
}

/// The judge run of the fork `fork` by `agent`: derived from both, so an eval run again
/// finds the judgement it made (`duplicate`) instead of paying for it again, and another
/// judge of the same fork gets a run of its own.
pub(crate) fn judge_run_id(fork: RunId, agent: &str) -> RunId {
    // FNV-1a over "judge:" and the agent's name.
    let mut h = 0xcbf2_9ce4_8422_2325_u64;
    for b in "judge:".bytes().chain(agent.bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    flotilla_model::ids::derived_run_id(fork, flotilla_model::ids::splitmix64(h))
}

/// Submits the pair to the judge agent as a one-task run (through the ordinary submit
/// endpoint, so it is admitted, budgeted and watched like any run), waits for its end, and
/// puts its score — or why there is none — and its usage on the row.
async fn judge_pair(client: &flotilla_client::Client, agent: &str, pair: &Pair<'_>, row: &mut Row) {
    let judge_id = judge_run_id(row.fork_id, agent);
    row.judge_run_id = Some(judge_id);
    let input = match serde_json::to_value(pair) {
        Ok(v) => v,
        Err(e) => {
            row.judge_error = Some(format!("cannot encode the pair: {e}"));
            return;
        }
    };
    let mut task = Subtask::new("judge", JUDGE_INSTRUCTIONS).with_agent(agent);
    task.input = input;
    let mut plan = Plan::empty();
    plan.name = Some(JUDGE_PLAN.to_owned());
    plan.subtasks.push(task);
    let mut request = SubmitRequest::new(plan);
    request.run_id = Some(judge_id);
    request
        .labels
        .insert(JUDGE_LABEL.to_owned(), row.fork_id.to_string());
    match client.submit_request(&request, ANSWER_WAIT).await {
        Ok(reply) if reply.status == SubmitStatus::Rejected => {
            let problems: Vec<String> = reply.errors.iter().map(ToString::to_string).collect();
            row.judge_error = Some(format!(
                "judge run {judge_id} rejected: {}",
                problems.join("; ")
            ));
            return;
        }
        Ok(_) => {}
        Err(e) => {
            row.judge_error = Some(format!("judge run {judge_id}: {e}"));
            return;
        }
    }
    let outcome = match client.wait(judge_id, RUN_WAIT).await {
        Ok(o) => o,
        Err(e) => {
            row.judge_error = Some(format!("judge run {judge_id}: {e}"));
            return;
        }
    };
    match client.tree(judge_id, 100).await {
        Ok(Some(t)) => row.judge_usage = Some(t.root.subtree_usage),
        Ok(None) => row.judge_usage = Some(UsageTotals::default()),
        Err(e) => {
            row.judge_error = Some(format!("judge run {judge_id}'s usage: {e}"));
            return;
        }
    }
    if outcome.status != RunStatus::Succeeded {
        row.judge_error = Some(format!(
            "judge run {judge_id} {}{}",
            outcome.status.as_str(),
            outcome
                .reason
                .as_deref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default()
        ));
        return;
    }
    let answer = outcome
        .final_result
        .as_ref()
        .map(|f| f.response.as_str())
        .unwrap_or_default();
    match verdict(answer) {
        Ok((score, reason)) => {
            row.score = Some(score);
            row.judge_reason = reason;
        }
        Err(e) => row.judge_error = Some(format!("judge run {judge_id}: {e}")),
    }
}

/// A judge's answer read as a score: `{"score": 0.8, "reason": "…"}` (in a code fence or
/// among other words too, as models write it) or a bare number, from 0 to 1.
fn verdict(answer: &str) -> Result<(f64, Option<String>), String> {
    let text = answer.trim();
    let unfenced = text
        .strip_prefix("```json")
        .or_else(|| text.strip_prefix("```"))
        .map_or(text, |t| t.trim_end().trim_end_matches("```").trim());
    let object = match (unfenced.find('{'), unfenced.rfind('}')) {
        (Some(a), Some(b)) if a < b => serde_json::from_str::<Value>(&unfenced[a..=b]).ok(),
        _ => None,
    };
    let (score, reason) = if let Ok(n) = unfenced.parse::<f64>() {
        (Some(n), None)
    } else if let Some(v) = &object {
        let score = match v.get("score") {
            Some(Value::Number(n)) => n.as_f64(),
            Some(Value::String(s)) => s.trim().parse::<f64>().ok(),
            _ => None,
        };
        let reason = v.get("reason").and_then(Value::as_str).map(str::to_owned);
        (score, reason)
    } else {
        (None, None)
    };
    let Some(score) = score else {
        return Err(format!(
            "the judge's answer is not a score: {:?} (expected {{\"score\": <0..1>, \"reason\": \"…\"}} or a number)",
            quote(text)
        ));
    };
    if !(0.0..=1.0).contains(&score) {
        return Err(format!("the judge's score {score} is not between 0 and 1"));
    }
    Ok((score, reason))
}

/// The start of `text`, for an error message.
fn quote(text: &str) -> String {
    match text.char_indices().nth(QUOTE_CHARS) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_owned(),
    }
}

fn summarize(
    variant: Variant,
    rows: Vec<Row>,
    judge: Option<String>,
    budget: Budget,
    spent: UsageTotals,
    stopped: Option<String>,
) -> Report {
    let mut original_usage = UsageTotals::default();
    let mut fork_usage = UsageTotals::default();
    for r in &rows {
        original_usage.add(&r.original_usage);
        fork_usage.add(&r.fork_usage);
    }
    let judge = judge.map(|agent| {
        let scores: Vec<f64> = rows.iter().filter_map(|r| r.score).collect();
        let mut usage = UsageTotals::default();
        for u in rows.iter().filter_map(|r| r.judge_usage.as_ref()) {
            usage.add(u);
        }
        JudgeTotals {
            agent,
            judged: scores.len(),
            errors: rows.iter().filter(|r| r.judge_error.is_some()).count(),
            mean_score: (!scores.is_empty())
                .then(|| scores.iter().sum::<f64>() / scores.len() as f64),
            usage,
        }
    });
    let not_run = rows.iter().filter(|r| r.status == RowState::NotRun).count();
    let budget = budget.is_set().then_some(BudgetTotals {
        limits: budget,
        spent,
        stopped: not_run > 0,
        not_run,
        reason: stopped,
    });
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
        judge,
        budget,
        rows,
    }
}

/// The report as a Markdown table, a row per run, then the totals. The `score` column and
/// the judge's and budget's totals appear only with `--judge` and a budget.
fn markdown(r: &Report) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let judged = r.judge.is_some();
    let _ = writeln!(
        out,
        "| run | fork | original | fork status | changed | tokens (orig → fork) | cost (orig → fork) | duration (orig → fork) |{}",
        if judged { " score |" } else { "" }
    );
    let _ = writeln!(
        out,
        "|---|---|---|---|---|---|---|---|{}",
        if judged { "---|" } else { "" }
    );
    let cell = |s: &str| s.replace('|', "\\|");
    for row in &r.rows {
        let status = match (row.status, &row.error, row.fork) {
            (RowState::NotRun, _, _) => format!(
                "not_run: {}",
                cell(row.reason.as_deref().unwrap_or_default())
            ),
            (_, Some(e), _) => format!("error: {}", cell(e)),
            (_, None, Some(s)) => s.as_str().to_owned(),
            (_, None, None) => "-".to_owned(),
        };
        let changed: Vec<&str> = row.changed.iter().map(TaskId::as_str).collect();
        let score = match (judged, row.score, &row.judge_error) {
            (false, _, _) => String::new(),
            (true, Some(s), _) => format!(" {s:.2} |"),
            (true, None, Some(e)) => format!(" judge error: {} |", cell(e)),
            (true, None, None) => " - |".to_owned(),
        };
        // A run not forked was not compared either: no figures rather than zeros.
        let figures = if row.status == RowState::NotRun {
            "- | - | -".to_owned()
        } else {
            format!(
                "{} → {} | ${:.4} → ${:.4} | {} → {} ms",
                row.original_usage.tokens(),
                row.fork_usage.tokens(),
                row.original_usage.cost_usd,
                row.fork_usage.cost_usd,
                row.original_ms,
                row.fork_ms
            )
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {figures} |{score}",
            row.run_id,
            row.fork_id,
            row.original.as_str(),
            status,
            if changed.is_empty() {
                "-".to_owned()
            } else {
                changed.join(", ")
            },
        );
    }
    let not_run = r.budget.as_ref().map_or(0, |b| b.not_run);
    let forked = r.runs - not_run;
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{} forked at {}: {} of {} forks succeeded (originals: {}), {} with a changed result, {} errors; tokens {} → {}, cost ${:.4} → ${:.4}",
        if not_run == 0 {
            format!("{} runs", r.runs)
        } else {
            format!("{forked} of {} runs", r.runs)
        },
        r.variant.at,
        r.fork_succeeded,
        forked,
        r.original_succeeded,
        r.changed_runs,
        r.errors,
        r.original_usage.tokens(),
        r.fork_usage.tokens(),
        r.original_usage.cost_usd,
        r.fork_usage.cost_usd
    );
    if let Some(j) = &r.judge {
        let _ = writeln!(
            out,
            "Judge {}: mean score {} over {} pairs, {} judge errors; judge tokens {}, cost {}",
            j.agent,
            j.mean_score
                .map_or_else(|| "-".to_owned(), |m| format!("{m:.2}")),
            j.judged,
            j.errors,
            j.usage.tokens(),
            usd(j.usage.cost_usd)
        );
    }
    if let Some(b) = &r.budget {
        let _ = writeln!(
            out,
            "Budget {}: spent {} tokens / {}; {}",
            b.limits.limits(),
            b.spent.tokens(),
            usd(b.spent.cost_usd),
            match &b.reason {
                Some(_) if b.not_run > 0 => {
                    format!("stopped by the budget, {} runs not run", b.not_run)
                }
                Some(_) => "reached with the last run".to_owned(),
                None => "not reached".to_owned(),
            }
        );
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_judges_answer_is_read_as_a_score() {
        assert_eq!(
            verdict(r#"{"score": 0.75, "reason": "close"}"#),
            Ok((0.75, Some("close".to_owned())))
        );
        assert_eq!(verdict(" 1 "), Ok((1.0, None)));
        assert_eq!(
            verdict("```json\n{\"score\": \"0.5\"}\n```"),
            Ok((0.5, None))
        );
        assert_eq!(
            verdict("Sure! {\"score\": 0, \"reason\": \"wrong\"} Hope that helps."),
            Ok((0.0, Some("wrong".to_owned())))
        );
        let garbage = verdict("no idea").expect_err("not a score");
        assert!(garbage.contains("not a score: \"no idea\""), "{garbage}");
        assert!(verdict(r#"{"score": 7}"#).is_err());
        assert!(verdict("NaN").is_err());
    }

    #[test]
    fn budget_flags_refuse_nothing_negatives_and_words() {
        assert_eq!(max_tokens_arg("200"), Ok(200));
        assert!(max_tokens_arg("0").is_err());
        assert!(max_tokens_arg("-5").is_err());
        assert!(max_tokens_arg("lots").is_err());
        assert_eq!(max_cost_arg("$0.25"), Ok(0.25));
        assert!(max_cost_arg("0").is_err());
        assert!(max_cost_arg("-1").is_err());
        assert!(max_cost_arg("inf").is_err());
        assert!(max_cost_arg("cheap").is_err());
    }

    #[test]
    fn a_budget_is_spent_once_either_limit_is_reached() {
        let b = Budget {
            max_tokens: Some(200),
            max_cost_usd: Some(0.01),
        };
        let mut u = UsageTotals {
            prompt_tokens: 100,
            completion_tokens: 20,
            ..UsageTotals::default()
        };
        assert_eq!(b.spent(&u), None);
        let once = u;
        u.add(&once);
        assert_eq!(
            b.spent(&u).as_deref(),
            Some("eval budget spent (240 tokens / $0.0000 of 200 tokens, $0.0100)")
        );
    }

    #[test]
    fn a_judge_run_id_is_the_same_for_the_same_fork_and_agent() {
        let fork = RunId::new();
        assert_eq!(judge_run_id(fork, "judge"), judge_run_id(fork, "judge"));
        assert_ne!(judge_run_id(fork, "judge"), judge_run_id(fork, "other"));
        assert_ne!(judge_run_id(fork, "judge"), fork);
    }
}
