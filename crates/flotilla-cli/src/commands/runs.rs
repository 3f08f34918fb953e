//! `flotilla runs list|show|history|cancel`, `flotilla workers`.

use std::process::ExitCode;

use flotilla_bus::Bus;
use flotilla_coordinator::store::RunStore;
use flotilla_model::ids::RunId;
use flotilla_model::runlog::{PlanDecision, RunInput};
use flotilla_model::subjects::Bucket;
use flotilla_model::time::Timestamp;
use flotilla_model::worker::WorkerInfo;
use futures::StreamExt;

use crate::config::Config;

async fn store(config: &Config) -> anyhow::Result<RunStore> {
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    Ok(RunStore::open(&bus).await?)
}

pub(crate) async fn list(config: &Config, limit: usize, json: bool) -> anyhow::Result<ExitCode> {
    let store = store(config).await?;
    // Newest first, by submission time (clients may choose any UUID as run id).
    let records = store.recent(limit).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&records)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<36}  {:<10}  {:<20}  {:>9}  {:<24}",
        "RUN", "STATUS", "NAME", "TASKS", "CREATED"
    );
    for r in records {
        let c = &r.tasks;
        println!(
            "{:<36}  {:<10}  {:<20}  {:>9}  {:<24}",
            r.handle.run_id.to_string(),
            r.status.as_str(),
            r.name
                .as_deref()
                .unwrap_or("-")
                .chars()
                .take(20)
                .collect::<String>(),
            format!("{}/{}", c.succeeded, c.total),
            r.created_at.to_string()
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) async fn show(config: &Config, run: RunId, json: bool) -> anyhow::Result<ExitCode> {
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    let store = RunStore::open(&bus).await?;
    let Some(view) = store.view(run, 0, usize::MAX).await? else {
        eprintln!("error: run {run} does not exist");
        return Ok(ExitCode::from(1));
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&view)?);
        return Ok(ExitCode::SUCCESS);
    }
    let r = &view.record;
    println!("run       {}", r.handle.run_id);
    if let Some(n) = &r.name {
        println!("name      {n}");
    }
    println!("status    {}", r.status);
    println!("created   {}", r.created_at);
    if let Some(f) = r.finished_at {
        println!("finished  {f}");
    }
    for (k, v) in &r.labels {
        println!("label     {k}={v}");
    }
    if let Some(s) = &r.strategy {
        println!("strategy  {} ({})", s.strategy.as_str(), s.reason);
    }
    if let Some(p) = &r.planning {
        println!(
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
            println!("query     {q}");
        }
        println!("planned plan:");
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
            println!("{line}");
            if !t.description.is_empty() {
                println!("      {}", t.description);
            }
        }
    }
    for p in &r.errors {
        println!("error     {p}");
    }
    for p in &r.warnings {
        println!("warning   {p}");
    }
    if !view.tasks.is_empty() {
        println!();
        println!(
            "{:<24}  {:<10}  {:<10}  {:>8}  DETAIL",
            "TASK", "STATUS", "POOL", "ATTEMPTS"
        );
        for t in &view.tasks {
            let detail = t
                .error
                .as_ref()
                .map(ToString::to_string)
                .or_else(|| t.skip_reason.clone())
                .unwrap_or_default();
            println!(
                "{:<24}  {:<10}  {:<10}  {:>8}  {detail}",
                t.task_id.as_str(),
                t.status.as_str(),
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
            println!("\nreason    {reason}");
        }
        if let Some(fr) = &o.final_result {
            println!("\n{}", fr.response);
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) async fn history(config: &Config, run: RunId, json: bool) -> anyhow::Result<ExitCode> {
    let store = store(config).await?;
    let entries = store.history(run).await?;
    if entries.is_empty() && store.load(run).await?.is_none() {
        eprintln!("error: run {run} does not exist");
        return Ok(ExitCode::from(1));
    }
    if json {
        let items: Vec<_> = entries
            .iter()
            .map(|(seq, ts, e)| serde_json::json!({ "seq": seq, "ts": ts, "entry": e }))
            .collect();
        println!("{}", serde_json::to_string_pretty(&items)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!("{:>8}  {:<30}  {:<13}  DETAIL", "SEQ", "TIME", "INPUT");
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
                    "{:?}{}{}",
                    c.action,
                    c.reason
                        .as_deref()
                        .map(|r| format!(": {r}"))
                        .unwrap_or_default(),
                    c.by.as_deref()
                        .map(|b| format!(" (by {b})"))
                        .unwrap_or_default()
                )
                .to_lowercase(),
            ),
        };
        println!("{seq:>8}  {:<30}  {kind:<13}  {detail}", ts.to_rfc3339());
    }
    Ok(ExitCode::SUCCESS)
}

/// Live workers with the time of their last registry refresh (server time).
pub(crate) async fn live_workers(bus: &Bus) -> anyhow::Result<Vec<(WorkerInfo, Timestamp)>> {
    let kv = bus.kv(Bucket::Workers).await?;
    let mut keys = kv.keys().await?;
    let mut infos = Vec::new();
    while let Some(k) = keys.next().await {
        let k = k?;
        if let Some(entry) = kv.entry(&k).await?
            && entry.operation == async_nats::jetstream::kv::Operation::Put
            && let Ok(info) = serde_json::from_slice::<WorkerInfo>(&entry.value)
        {
            infos.push((info, Timestamp(entry.created)));
        }
    }
    infos.sort_by(|(a, _), (b, _)| (&a.pool, &a.id).cmp(&(&b.pool, &b.id)));
    Ok(infos)
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
    let live = live_workers(bus).await.unwrap_or_default();
    println!();
    for pool in pools {
        let n = live.iter().filter(|(w, _)| w.pool == pool).count();
        if n == 0 {
            println!(
                "waiting   pool {pool}: tasks are queued, and NO live worker serves this pool (start `flotilla worker --pool {pool}`)"
            );
        } else {
            println!("pool      {pool}: {n} live worker(s)");
        }
    }
}

pub(crate) async fn workers(config: &Config, json: bool) -> anyhow::Result<ExitCode> {
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    let infos = live_workers(&bus).await?;
    let now = Timestamp::now().unix_ms();
    if json {
        let items: Vec<_> = infos
            .iter()
            .map(|(w, seen)| {
                serde_json::json!({ "worker": w, "last_seen": seen, "last_seen_secs_ago": (now - seen.unix_ms()).max(0) as f64 / 1000.0 })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&items)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<28}  {:<10}  {:<20}  {:>8}  {:>8}  {:>10}  STARTED",
        "WORKER", "POOL", "HOST", "PID", "BUSY", "LAST SEEN"
    );
    for (w, seen) in infos {
        let ago = (now - seen.unix_ms()).max(0) as f64 / 1000.0;
        println!(
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

/// `flotilla runs cancel RUN [--reason] [--no-wait]`: asks the coordinators to cancel, then
/// (by default) waits for the run to end.
pub(crate) async fn cancel(
    config: &Config,
    run: RunId,
    reason: Option<String>,
    wait: bool,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    let client = flotilla_client::Client::new(bus);
    let reply = match client.cancel(run, reason).await {
        Ok(r) => r,
        Err(e) if e.kind() == flotilla_client::ClientErrorKind::Api => {
            eprintln!("error: {e}");
            return Ok(ExitCode::from(1));
        }
        Err(e) => return Err(e.into()),
    };
    if !reply.cancelling {
        if json {
            println!("{}", serde_json::to_string_pretty(&reply)?);
        } else {
            eprintln!("Run {run} had already ended: {}", reply.status);
        }
        return Ok(ExitCode::SUCCESS);
    }
    if !wait {
        if json {
            println!("{}", serde_json::to_string_pretty(&reply)?);
        } else {
            eprintln!("Cancelling run {run}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    eprintln!("Cancelling run {run}…");
    let outcome = client
        .wait(run, std::time::Duration::from_secs(120))
        .await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&outcome)?);
    } else {
        eprintln!("Run {run} {}", outcome.status);
        if let Some(reason) = &outcome.reason {
            eprintln!("  reason: {reason}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// One run of a run tree, with the children it started.
#[derive(Debug, serde::Serialize)]
struct TreeNode {
    run_id: RunId,
    status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parent_task_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    call: Option<String>,
    children: Vec<TreeNode>,
}

/// Most runs `runs tree` shows.
const MAX_TREE_RUNS: usize = 1000;

/// The children a run announced on its event stream (`agent_run_started`), in order.
async fn announced_children(
    bus: &Bus,
    run: RunId,
) -> anyhow::Result<Vec<flotilla_model::run::RunHandle>> {
    use flotilla_model::event::{Event, decode_events};
    use flotilla_model::subjects::StreamKind;
    let filter = bus.names().event(run);
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let page = bus
            .direct_batch(StreamKind::Events, &filter, after, 1000, Some(4 << 20))
            .await?;
        let Some(last) = page.last() else { break };
        after = last.seq;
        let more = last.num_pending > 0;
        for m in &page {
            let Ok(events) =
                decode_events(flotilla_bus::wire::codec_of(Some(&m.headers)), &m.payload)
            else {
                continue;
            };
            for e in events {
                if let Event::AgentRunStarted { child, .. } = e.event
                    && !out
                        .iter()
                        .any(|c: &flotilla_model::run::RunHandle| c.run_id == child.run_id)
                {
                    out.push(child);
                }
            }
        }
        if !more {
            break;
        }
    }
    Ok(out)
}

/// `flotilla runs tree RUN`: the run and, recursively, the child runs its agents started.
pub(crate) async fn tree(config: &Config, run: RunId, json: bool) -> anyhow::Result<ExitCode> {
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    let store = RunStore::open(&bus).await?;
    let mut seen = 0usize;
    let Some(root) = tree_node(&bus, &store, run, None, &mut seen).await? else {
        eprintln!("error: run {run} does not exist");
        return Ok(ExitCode::from(1));
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&root)?);
    } else {
        print_tree(&root, 0);
        if seen >= MAX_TREE_RUNS {
            println!("(stopped after {MAX_TREE_RUNS} runs)");
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn tree_node<'a>(
    bus: &'a Bus,
    store: &'a RunStore,
    run: RunId,
    link: Option<&'a flotilla_model::run::RunHandle>,
    seen: &'a mut usize,
) -> futures::future::BoxFuture<'a, anyhow::Result<Option<TreeNode>>> {
    Box::pin(async move {
        let Some(view) = store.view(run, 0, 0).await? else {
            return Ok(None);
        };
        *seen += 1;
        let mut node = TreeNode {
            run_id: run,
            status: view.record.status.as_str(),
            name: view.record.name.clone(),
            parent_task_id: link
                .and_then(|l| l.parent_task_id.as_ref())
                .map(|t| t.as_str().to_owned()),
            call: link.and_then(|l| l.parent_tool_call_id.clone()),
            children: Vec::new(),
        };
        for child in announced_children(bus, run).await? {
            if *seen >= MAX_TREE_RUNS {
                break;
            }
            if let Some(c) = tree_node(bus, store, child.run_id, Some(&child), seen).await? {
                node.children.push(c);
            }
        }
        Ok(Some(node))
    })
}

fn print_tree(node: &TreeNode, depth: usize) {
    let via = match (&node.parent_task_id, &node.call) {
        (Some(t), Some(c)) => format!("  ← {t} ({c})"),
        (Some(t), None) => format!("  ← {t}"),
        _ => String::new(),
    };
    println!(
        "{}{}  {:<10}  {}{}",
        "  ".repeat(depth),
        node.run_id,
        node.status,
        node.name.as_deref().unwrap_or("-"),
        via
    );
    for c in &node.children {
        print_tree(c, depth + 1);
    }
}
