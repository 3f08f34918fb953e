//! The `flotilla` section: a `flotilla coordinator` and `flotilla worker` processes with a
//! no-op (`scripted`) agent. Tasks/s across many independent runs (per run size, with the CPU
//! seconds of every process and the messages stored per task); dependency hop latency on a
//! 100-step chain (predecessor's result stored → dependent's agent starts); single-run
//! latency (submit → outcome) of a 1-task run and a diamond; makespan of a 1 → 1000 → 1
//! fan-out/fan-in; peak RSS of each process; two one-slot workers. With the raw round trip
//! of the same run, each figure is also printed as a ratio to it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use flotilla_bus::{Bus, NatsOptions};
use flotilla_client::Client;
use flotilla_model::ids::RunId;
use flotilla_model::plan::{Plan, PlanConfig, Subtask};
use flotilla_model::run::RunStatus;
use flotilla_model::submit::SubmitRequest;
use futures::StreamExt;
use tokio::sync::Semaphore;

use crate::harness::plans::{chain_hops, chain_plan, independent_plan};
use crate::harness::processes::{Processes, cpu_seconds, peak_rss_kib};
use crate::harness::raw::RawFigures;
use crate::harness::services::{Services, has_listener, noop_config, spawn_service};
use crate::harness::stats::{ms, percentile};
use crate::harness::submit::{outcomes, spawn_submitter, submit_via};

/// Sizes of the section (the worker processes, their slots and the chain length are the
/// [`Services`]').
pub(crate) struct Sizes {
    /// Tasks in each throughput measurement (split into runs).
    pub(crate) tasks: usize,
    /// Independent tasks per run, one throughput measurement each.
    pub(crate) tasks_per_run: Vec<usize>,
    /// Chains to run (samples = chains × (chain − 1)).
    pub(crate) chains: usize,
    /// Width of the fan-out.
    pub(crate) fan: usize,
    /// Samples of each single-run latency measurement.
    pub(crate) latency_runs: usize,
    /// Runs of the two-workers-with-one-slot measurement.
    pub(crate) single_slot_runs: usize,
}

/// Runs the section against the server at `url`; `raw` is the raw round trip of the same
/// run (ratios are printed when present), `server_pid` the embedded nats-server's.
pub(crate) async fn run(
    sizes: &Sizes,
    services: &Services,
    url: &str,
    raw: Option<&RawFigures>,
    server_pid: Option<u32>,
) -> anyhow::Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("flotilla-bench-")
        .tempdir()?;
    let exe = &services.exe;
    let config = noop_config(dir.path(), url, services.concurrency, has_listener(exe))?;
    let spawn = |role: &[&str]| spawn_service(exe, &config, role);
    let mut opts = NatsOptions::with_url(url);
    opts.prefix = "flbench".into();
    let bus = Bus::connect(&opts, "flotilla-bench").await?;
    bus.provision(&Default::default()).await?;
    let mut procs = Processes(vec![("coordinator".into(), spawn(&["coordinator"])?)]);
    for i in 0..services.workers {
        procs.0.push((format!("worker {i}"), spawn(&["worker"])?));
    }
    let client = Client::new(bus.clone());
    let inbox = format!("_INBOX.flbench.{}", RunId::new());
    let mut ends = outcomes(&bus, inbox.clone()).await?;
    let via = services.via;
    // Warm up: one small run proves every process is ready.
    let warm = submit_via(&bus, SubmitRequest::new(independent_plan(2)), via).await?;
    client.wait(warm, Duration::from_secs(60)).await?;

    outln!(
        "== flotilla (coordinator + {} worker process(es) × {} slots, no-op scripted agent)",
        services.workers,
        services.concurrency
    );
    // Latency first, on a settled system; then throughput.
    // Dependency hop latency on chains.
    let mut hops = Vec::new();
    for _ in 0..sizes.chains {
        let run = submit_via(&bus, SubmitRequest::new(chain_plan(services.chain)), via).await?;
        client.wait(run, Duration::from_secs(300)).await?;
        hops.extend(chain_hops(&client, run).await?);
    }
    hops.sort_by(f64::total_cmp);
    let (hop50, hop99) = (percentile(&hops, 0.5), percentile(&hops, 0.99));
    outln!(
        "   dependency hop (result stored → dependent starts): p50 {hop50:.3} ms   p99 {hop99:.3} ms   ({} hops; target p50 ≤ 1.5 ms, p99 ≤ 5 ms)",
        hops.len()
    );

    // Single-run latency: one run in flight, submit → its outcome on reply_to.
    let mut latencies = Vec::new();
    for (name, plan) in [
        ("1-task run", independent_plan(1)),
        ("diamond", diamond_plan()),
    ] {
        let mut samples = Vec::with_capacity(sizes.latency_runs);
        for _ in 0..sizes.latency_runs {
            let mut req = SubmitRequest::new(plan.clone());
            req.reply_to = Some(inbox.clone());
            let t0 = Instant::now();
            submit_via(&bus, req, via).await?;
            let status = tokio::time::timeout(Duration::from_secs(30), ends.recv())
                .await
                .context("a latency run did not finish in 30 s")?
                .context("outcome subscription ended")?
                .status;
            anyhow::ensure!(status == RunStatus::Succeeded, "a latency run {status}");
            samples.push(ms(t0.elapsed()));
        }
        samples.sort_by(f64::total_cmp);
        let (p50, p99) = (percentile(&samples, 0.5), percentile(&samples, 0.99));
        outln!(
            "   latency, {name:<10} (1 in flight, submit → outcome): p50 {p50:.3} ms   p99 {p99:.3} ms   ({} runs)",
            samples.len()
        );
        latencies.push((name, p50, p99));
    }

    // Fan-out / fan-in makespan.
    let t0 = Instant::now();
    let run = submit_via(&bus, SubmitRequest::new(fan_plan(sizes.fan)), via).await?;
    let outcome = client.wait(run, Duration::from_secs(300)).await?;
    let makespan = t0.elapsed();
    outln!(
        "   makespan 1 → {} → 1: {:.3} s ({:?})",
        sizes.fan,
        makespan.as_secs_f64(),
        outcome.status
    );

    // Throughput across many independent runs, per run size.
    let mut pids: Vec<(String, u32)> = procs.0.iter().map(|(n, c)| (n.clone(), c.id())).collect();
    if let Some(pid) = server_pid {
        pids.push(("nats-server".into(), pid));
    }
    pids.push(("bench client".into(), std::process::id()));
    let mut rows = Vec::new();
    for &per_run in &sizes.tasks_per_run {
        let per_run = per_run.max(1);
        let runs = (sizes.tasks / per_run).max(1);
        let total = runs * per_run;
        let cpu_before: Vec<Option<f64>> = pids.iter().map(|(_, p)| cpu_seconds(*p)).collect();
        let seq_before = stream_sequences(&bus, "FLBENCH").await?;
        let start = Instant::now();
        // As many tasks in flight as the raw measurement (512): a steady state, not a queue
        // that grows for as long as the bench submits.
        let window = Arc::new(Semaphore::new((IN_FLIGHT_TASKS / per_run).max(1)));
        let submitter = spawn_submitter(&bus, &inbox, runs, per_run, via, Arc::clone(&window));
        let mut failed = 0;
        for _ in 0..runs {
            let status = tokio::time::timeout(Duration::from_secs(300), ends.recv())
                .await
                .context("throughput runs did not finish in 5 minutes")?
                .context("outcome subscription ended")?
                .status;
            window.add_permits(1);
            if status != RunStatus::Succeeded {
                failed += 1;
            }
        }
        let elapsed = start.elapsed();
        let _ = submitter.await;
        let cpu: Vec<String> = pids
            .iter()
            .zip(&cpu_before)
            .filter_map(|((name, pid), before)| {
                Some(format!("{name} {:.2}", cpu_seconds(*pid)? - (*before)?))
            })
            .collect();
        let seq_after = stream_sequences(&bus, "FLBENCH").await?;
        let stored: Vec<(String, f64)> = seq_after
            .iter()
            .filter_map(|(name, after)| {
                let before = seq_before
                    .iter()
                    .find(|(n, _)| n == name)
                    .map_or(0, |(_, b)| *b);
                (after > &before).then(|| {
                    (
                        name.trim_start_matches("FLBENCH_").to_owned(),
                        (after - before) as f64 / total as f64,
                    )
                })
            })
            .collect();
        let throughput = total as f64 / elapsed.as_secs_f64();
        outln!(
            "   throughput, {per_run:>2} task(s)/run: {:>8.0} tasks/s   ({runs} runs in {:.2} s{})",
            throughput,
            elapsed.as_secs_f64(),
            if failed > 0 {
                format!(", {failed} runs not succeeded")
            } else {
                String::new()
            }
        );
        outln!("      CPU s: {}", cpu.join(", "));
        if let (Some(pid), Some(Some(before))) = (pids.first().map(|(_, p)| *p), cpu_before.first())
            && let Some(after) = cpu_seconds(pid)
        {
            outln!(
                "      coordinator CPU per run: {:.0} µs",
                (after - before) * 1e6 / runs as f64
            );
        }
        outln!(
            "      stored messages per task: {:.2} ({})",
            stored.iter().map(|(_, n)| n).sum::<f64>(),
            stored
                .iter()
                .map(|(s, n)| format!("{s} {n:.2}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        rows.push((per_run, throughput));
    }

    for (name, child) in &procs.0 {
        if let Some(kib) = peak_rss_kib(child.id()) {
            outln!("   peak RSS {name:<12} {:>8.1} MiB", kib as f64 / 1024.0);
        }
    }

    // Two workers that run one task at a time: what a one-slot worker loses between tasks
    // (storing a result, pulling the next) shows here.
    for (_, c) in procs.0.iter_mut().skip(1) {
        let _ = c.kill();
        let _ = c.wait();
    }
    procs.0.truncate(1);
    for i in 0..2 {
        procs.0.push((
            format!("one-slot worker {i}"),
            spawn(&["worker", "--concurrency", "1"])?,
        ));
    }
    let warm = submit_via(&bus, SubmitRequest::new(independent_plan(2)), via).await?;
    client.wait(warm, Duration::from_secs(60)).await?;
    let runs = sizes.single_slot_runs.max(1);
    let start = Instant::now();
    // 32 runs in flight, as a client keeping two one-slot workers busy would.
    let window = Arc::new(Semaphore::new(32));
    let submitter = spawn_submitter(&bus, &inbox, runs, 1, via, Arc::clone(&window));
    for _ in 0..runs {
        tokio::time::timeout(Duration::from_secs(300), ends.recv())
            .await
            .context("one-slot runs did not finish in 5 minutes")?
            .context("outcome subscription ended")?;
        window.add_permits(1);
    }
    let single_slot = runs as f64 / start.elapsed().as_secs_f64();
    let _ = submitter.await;
    outln!(
        "   throughput, 2 workers × 1 slot, 1-task runs: {single_slot:.0} tasks/s   ({runs} runs)"
    );
    if let Some(raw) = raw {
        outln!(
            "== ratios to raw JetStream (same server, same run; targets: 1-task ≥ 40 %, 4-task ≥ 60 %, 10-task ≥ 70 %)"
        );
        for (per_run, throughput) in &rows {
            outln!(
                "   throughput, {per_run:>2} task(s)/run: {:>5.1} % of raw ({:.0} / {:.0} tasks/s)",
                100.0 * throughput / raw.throughput,
                throughput,
                raw.throughput
            );
        }
        outln!(
            "   hop p50 / raw round-trip p50: {:.2}×   ({hop50:.3} ms / {:.3} ms)",
            hop50 / raw.p50_ms,
            raw.p50_ms
        );
        outln!(
            "   hop p99 / raw round-trip p99: {:.2}×   ({hop99:.3} ms / {:.3} ms)",
            hop99 / raw.p99_ms,
            raw.p99_ms
        );
        for (name, p50, _) in &latencies {
            let target = if *name == "diamond" { 6.0 } else { 3.0 };
            outln!(
                "   latency {name} p50 / raw round-trip p50: {:.2}×   ({p50:.3} ms / {:.3} ms; target ≤ {target}×)",
                p50 / raw.p50_ms,
                raw.p50_ms
            );
        }
        outln!(
            "   2 workers × 1 slot: {:.1} % of raw ({single_slot:.0} / {:.0} tasks/s)",
            100.0 * single_slot / raw.throughput,
            raw.throughput
        );
    }
    drop(procs);
    Ok(())
}

/// Tasks in flight in the throughput measurements, as in the raw one.
const IN_FLIGHT_TASKS: usize = 512;

/// a → (b ∥ c) → d.
fn diamond_plan() -> Plan {
    Plan {
        fork: None,
        name: Some("bench-diamond".into()),
        query: None,
        subtasks: vec![
            Subtask::new("a", "no-op"),
            Subtask::new("b", "no-op").after(&["a"]),
            Subtask::new("c", "no-op").after(&["a"]),
            Subtask::new("d", "no-op").after(&["b", "c"]),
        ],
        config: PlanConfig::default(),
    }
}

fn fan_plan(n: usize) -> Plan {
    let mut subtasks = vec![Subtask::new("root", "no-op")];
    let middle: Vec<String> = (0..n).map(|i| format!("m{i}")).collect();
    subtasks.extend(
        middle
            .iter()
            .map(|m| Subtask::new(m, "no-op").after(&["root"])),
    );
    let refs: Vec<&str> = middle.iter().map(String::as_str).collect();
    subtasks.push(Subtask::new("sink", "no-op").after(&refs));
    let mut p = Plan {
        fork: None,
        name: Some("bench-fan".into()),
        query: None,
        subtasks,
        config: PlanConfig::default(),
    };
    p.config.max_concurrency = n as u32;
    p
}

/// Last sequence of every stream with the given name prefix: differences between two
/// readings are the messages stored in between (work-queue streams delete, but never reuse,
/// sequences).
async fn stream_sequences(bus: &Bus, prefix: &str) -> anyhow::Result<Vec<(String, u64)>> {
    let mut names = bus.js().stream_names();
    let mut out = Vec::new();
    while let Some(name) = names.next().await {
        let name = name?;
        if name.starts_with(prefix) || name.starts_with(&format!("KV_{}", prefix.to_lowercase())) {
            let mut s = bus.js().get_stream(&name).await?;
            out.push((name, s.info().await?.state.last_sequence));
        }
    }
    out.sort();
    Ok(out)
}
