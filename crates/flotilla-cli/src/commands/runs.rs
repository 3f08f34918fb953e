//! `flotilla runs list|show|history`, `flotilla workers`.

use std::process::ExitCode;

use flotilla_bus::Bus;
use flotilla_coordinator::store::{RunStore, record_of};
use flotilla_model::ids::RunId;
use flotilla_model::runlog::RunInput;
use flotilla_model::subjects::Bucket;
use flotilla_worker::WorkerInfo;
use futures::StreamExt;

use crate::config::Config;

async fn store(config: &Config) -> anyhow::Result<RunStore> {
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    Ok(RunStore::open(&bus).await?)
}

pub(crate) async fn list(config: &Config, limit: usize, json: bool) -> anyhow::Result<ExitCode> {
    let store = store(config).await?;
    let ids = store.list().await?;
    // UUIDv7 ids sort by creation: the newest are last.
    let newest: Vec<RunId> = ids.into_iter().rev().take(limit).collect();
    let mut records = Vec::new();
    for id in newest {
        if let Some(s) = store.load(id).await? {
            records.push(record_of(&s.snapshot.state));
        }
    }
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
            r.handle.run_id,
            r.status,
            r.name
                .as_deref()
                .unwrap_or("-")
                .chars()
                .take(20)
                .collect::<String>(),
            format!("{}/{}", c.succeeded, c.total),
            r.created_at
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) async fn show(config: &Config, run: RunId, json: bool) -> anyhow::Result<ExitCode> {
    let store = store(config).await?;
    let Some(view) = store.view(run).await? else {
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
    for p in &r.errors {
        println!("error     {p}");
    }
    for p in &r.warnings {
        println!("warning   {p}");
    }
    if !view.tasks.is_empty() {
        println!();
        println!(
            "{:<24}  {:<10}  {:>8}  DETAIL",
            "TASK", "STATUS", "ATTEMPTS"
        );
        for t in &view.tasks {
            let detail = t
                .error
                .as_ref()
                .map(ToString::to_string)
                .or_else(|| t.skip_reason.clone())
                .unwrap_or_default();
            println!(
                "{:<24}  {:<10}  {:>8}  {detail}",
                t.task_id.as_str(),
                t.status.as_str(),
                t.attempts
            );
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
            RunInput::Submitted(s) => ("submitted", format!("{} subtasks", s.plan.subtasks.len())),
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
        };
        println!("{seq:>8}  {:<30}  {kind:<13}  {detail}", ts.to_rfc3339());
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) async fn workers(config: &Config, json: bool) -> anyhow::Result<ExitCode> {
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    let kv = bus.kv(Bucket::Workers).await?;
    let mut keys = kv.keys().await?;
    let mut infos: Vec<WorkerInfo> = Vec::new();
    while let Some(k) = keys.next().await {
        let k = k?;
        if let Some(v) = kv.get(&k).await?
            && let Ok(info) = serde_json::from_slice::<WorkerInfo>(&v)
        {
            infos.push(info);
        }
    }
    infos.sort_by(|a, b| (&a.pool, &a.id).cmp(&(&b.pool, &b.id)));
    if json {
        println!("{}", serde_json::to_string_pretty(&infos)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<28}  {:<10}  {:<20}  {:>8}  {:>8}  STARTED",
        "WORKER", "POOL", "HOST", "PID", "BUSY"
    );
    for w in infos {
        println!(
            "{:<28}  {:<10}  {:<20}  {:>8}  {:>8}  {}",
            w.id,
            w.pool,
            w.host.chars().take(20).collect::<String>(),
            w.pid,
            format!("{}/{}", w.in_flight, w.concurrency),
            w.started_at
        );
    }
    Ok(ExitCode::SUCCESS)
}
