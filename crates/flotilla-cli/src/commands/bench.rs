//! `flotilla bench`: measured, not asserted.
//!
//! Every section that involves NATS runs against one nats-server (embedded unless
//! `--nats-url`), and the raw JetStream baseline is measured in the same run, so the printed
//! ratios compare like with like:
//!
//! * **raw** — the bench's own task round trip on plain JetStream: publish a task to a
//!   work-queue stream → a worker pulls it → publishes a result → a collector pulls that.
//!   Throughput with 512 in flight; latency (p50/p99) with 1 in flight.
//! * **flotilla** — a `flotilla coordinator` and `flotilla worker` processes with a no-op
//!   (`scripted`) agent: tasks/s across many independent runs; dependency hop latency on a
//!   100-step chain (predecessor's result stored → dependent's agent starts); makespan of a
//!   1 → 1000 → 1 fan-out/fan-in; peak RSS of each process.
//! * **validate** — validating a 10,000-subtask plan.
//! * **recovery** — `kill -9` of a worker running a task → the task started on another.
//! * **collab** — the collaboration layer ([`super::bench_collab`]): dependency hop vs topic
//!   hop vs gated dispatch (an outside writer's entry → the consumer's agent starts); with the
//!   services stopped, workspace append → live watcher, paging through 100,000 entries and
//!   mailbox send → waiting receiver, each next to its plain JetStream baseline.
//! * **llm** — LLM agents against a simulated OpenAI-compatible provider (a test double in
//!   the bench, [`super::bench_llm`]): orchestration overhead per model call; one worker with
//!   many concurrent LLM tasks vs the ideal throughput; scaling over worker processes.
//! * **tree** — run trees ([`super::bench_tree`]): child spawn → the child's task started vs
//!   the dependency hop and the raw round trip; a depth-10 nested agent-as-tool chain vs ten
//!   dependency hops; the delivery lag of `flatten` projections (client library and
//!   `api.watch`) with 100 concurrent children, against `linked`. The agents that start
//!   children are deterministic Rust agents run by an in-process worker in the bench.

use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use async_nats::jetstream::consumer::{AckPolicy, pull};
use async_nats::jetstream::stream::{Config as StreamConfig, RetentionPolicy};
use flotilla_bus::{Bus, NatsOptions};
use flotilla_client::Client;
use flotilla_model::ids::RunId;
use flotilla_model::plan::{Plan, PlanConfig, Subtask};
use flotilla_model::run::RunStatus;
use flotilla_model::runlog::RunInput;
use flotilla_model::submit::{SubmitReply, SubmitRequest};
use flotilla_model::validate::{ValidationContext, validate_plan};
use std::future::IntoFuture;

use futures::StreamExt;
use tokio::sync::{Semaphore, mpsc};

/// Arguments of `flotilla bench`.
#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {
    /// Sections to run (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<Section>,
    /// Tasks in the raw throughput measurement.
    #[arg(long, default_value_t = 20_000)]
    raw_tasks: usize,
    /// Round trips in the raw latency measurement.
    #[arg(long, default_value_t = 2_000)]
    raw_round_trips: usize,
    /// Tasks in each Flotilla throughput measurement (split into runs).
    #[arg(long, default_value_t = 20_000)]
    tasks: usize,
    /// Independent tasks per run, one measurement each: per-run costs (submission, run
    /// record, start and end events) amortise over a run's tasks.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 4, 10])]
    tasks_per_run: Vec<usize>,
    /// Length of each chain in the hop-latency measurement.
    #[arg(long, default_value_t = 100)]
    chain: usize,
    /// Chains to run (samples = chains × (chain − 1)).
    #[arg(long, default_value_t = 5)]
    chains: usize,
    /// Width of the fan-out.
    #[arg(long, default_value_t = 1_000)]
    fan: usize,
    /// Worker processes.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Slots per worker.
    #[arg(long, default_value_t = 128)]
    concurrency: usize,
    /// Repetitions of the validation section.
    #[arg(long, default_value_t = 30)]
    iterations: usize,
    /// Worker kills in the recovery section.
    #[arg(long, default_value_t = 3)]
    recovery_rounds: usize,
    /// Samples of each single-run latency measurement.
    #[arg(long, default_value_t = 300)]
    latency_runs: usize,
    /// Runs of the two-workers-with-one-slot measurement.
    #[arg(long, default_value_t = 4_000)]
    single_slot_runs: usize,
    /// The `flotilla` binary that runs the coordinator and workers (default: this one) — to
    /// measure another build with this bench, back to back.
    #[arg(long, value_name = "PATH")]
    services_binary: Option<std::path::PathBuf>,
    /// How the bench submits: `run-subject` (`<prefix>.submit.<run>`, the default path of
    /// the client library) or `intake` (`<prefix>.submit`, for builds without the former).
    #[arg(long, value_enum, default_value = "run-subject")]
    submit_via: SubmitVia,
    #[command(flatten)]
    collab: super::bench_collab::CollabArgs,
    #[command(flatten)]
    llm: super::bench_llm::LlmArgs,
    // Boxed: keeps `flotilla`'s command enum small.
    #[command(flatten)]
    tree: Box<super::bench_tree::TreeArgs>,
}

/// Where the bench publishes its durable submissions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum SubmitVia {
    /// `<prefix>.submit.<run>`: the submission is the run's first message.
    RunSubject,
    /// `<prefix>.submit`: the intake stream.
    Intake,
}

/// Publishes a durable submission the chosen way and waits for its PubAck.
pub(super) async fn submit_via(
    bus: &Bus,
    request: SubmitRequest,
    via: SubmitVia,
) -> anyhow::Result<RunId> {
    match via {
        SubmitVia::RunSubject => Ok(Client::new(bus.clone()).submit(request).await?),
        SubmitVia::Intake => {
            let mut request = request;
            let run = *request.run_id.get_or_insert_with(RunId::new);
            bus.publish(bus.names().submit(), &request, Some(&format!("run.{run}")))
                .await?;
            Ok(run)
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Section {
    /// Plain JetStream baseline.
    Raw,
    /// Flotilla with no-op agents (needs raw for ratios).
    Flotilla,
    /// Validating a 10,000-subtask plan.
    Validate,
    /// Crash recovery at the default heartbeat: kill -9 of a worker → its task running again
    /// on another worker.
    Recovery,
    /// Workspace topics, topic-gated dispatch and mailboxes, with their raw baselines.
    Collab,
    /// LLM agents against a simulated OpenAI-compatible provider: overhead per model call,
    /// concurrent tasks per worker, scaling over worker processes.
    Llm,
    /// Run trees: child spawn latency, nested agent-as-tool vs dependency hops, delivery lag
    /// of flattened projections with many concurrent children.
    Tree,
}

/// A layered DAG of `n` subtasks: each depends on up to three tasks of the previous layer and
/// consumes a topic produced there — the shape planners emit, at scale.
pub(crate) fn wide_plan(n: usize) -> Plan {
    let width = 100;
    let subtasks = (0..n)
        .map(|i| {
            let mut t = Subtask::new(
                &format!("t{i}"),
                "a synthetic task with a realistic description length",
            );
            t.produces = vec![format!("topic {i}")];
            if i >= width {
                let layer_start = (i / width - 1) * width;
                let deps: Vec<String> = (0..3)
                    .map(|k| format!("t{}", layer_start + (i + k * 7) % width))
                    .collect();
                t.dependencies = deps.iter().map(|d| d.as_str().into()).collect();
                t.consumes = vec![format!("Topic {}", layer_start + i % width)];
            }
            t
        })
        .collect();
    Plan {
        name: Some("bench".into()),
        query: None,
        subtasks,
        config: PlanConfig::default(),
    }
}

fn validate_section(iterations: usize) {
    let plan = wide_plan(10_000);
    let ctx = ValidationContext::default();
    assert!(
        validate_plan(&plan, &ctx).is_valid(),
        "the synthetic plan is valid"
    );
    let mut times: Vec<Duration> = (0..iterations.max(1))
        .map(|_| {
            let start = Instant::now();
            std::hint::black_box(validate_plan(&plan, &ctx));
            start.elapsed()
        })
        .collect();
    times.sort();
    let edges: usize = plan.subtasks.iter().map(|t| t.dependencies.len()).sum();
    outln!(
        "== plan validation: 10,000 subtasks, {edges} dependencies, {} runs",
        times.len()
    );
    outln!("   min {:>8.2} ms", ms(times[0]));
    outln!("   p50 {:>8.2} ms", ms(times[times.len() / 2]));
    outln!(
        "   max {:>8.2} ms   (target: well under 50 ms)",
        ms(times[times.len() - 1])
    );
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

pub(super) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// A payload the size of a typical task envelope.
fn payload() -> bytes::Bytes {
    let body = serde_json::json!({
        "protocol": 1, "run_id": RunId::new(), "task_id": "calc_growth", "attempt": 1,
        "attempt_id": RunId::new(), "pool": "default", "description": "Compute quarter-over-quarter revenue growth.",
        "required": true, "timeout": 600, "dispatched_at": "2026-01-01T00:00:00Z",
        "dependency_results": {"fetch_data": {"response": "x".repeat(200), "tokens": 0, "success": true}}
    });
    bytes::Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
}

pub(super) struct RawFigures {
    pub(super) throughput: f64,
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
}

/// The raw JetStream task round trip.
async fn raw_section(
    opts: &NatsOptions,
    tasks: usize,
    round_trips: usize,
    server_pid: Option<u32>,
) -> anyhow::Result<RawFigures> {
    let connect = || flotilla_bus::connect::connect(opts, "flotilla-bench");
    let producer = connect().await?;
    let worker_conn = connect().await?;
    let collector_conn = connect().await?;
    let js = async_nats::jetstream::new(producer.clone());
    for name in ["FLBENCH_RAW_TASKS", "FLBENCH_RAW_RESULTS"] {
        let _ = js.delete_stream(name).await;
    }
    js.create_stream(StreamConfig {
        name: "FLBENCH_RAW_TASKS".into(),
        subjects: vec!["flbench-raw.task.>".into()],
        retention: RetentionPolicy::WorkQueue,
        ..Default::default()
    })
    .await?;
    js.create_stream(StreamConfig {
        name: "FLBENCH_RAW_RESULTS".into(),
        subjects: vec!["flbench-raw.result.>".into()],
        ..Default::default()
    })
    .await?;
    let consumer_config = |name: &str| pull::Config {
        durable_name: Some(name.into()),
        ack_policy: AckPolicy::Explicit,
        max_ack_pending: 10_000,
        ..Default::default()
    };
    let wjs = async_nats::jetstream::new(worker_conn);
    let task_consumer = wjs
        .get_stream("FLBENCH_RAW_TASKS")
        .await?
        .create_consumer(consumer_config("w"))
        .await?;
    let cjs = async_nats::jetstream::new(collector_conn);
    let result_consumer = cjs
        .get_stream("FLBENCH_RAW_RESULTS")
        .await?
        .create_consumer(consumer_config("c"))
        .await?;

    // Worker: pull a task, publish its result, ack the task.
    let worker = tokio::spawn(async move {
        let Ok(messages) = task_consumer
            .stream()
            .max_messages_per_batch(512)
            .messages()
            .await
        else {
            return;
        };
        messages
            .for_each_concurrent(512, |m| {
                let wjs = wjs.clone();
                async move {
                    let Ok(m) = m else { return };
                    let subject = format!(
                        "flbench-raw.result.{}",
                        m.subject.rsplit('.').next().unwrap_or("x")
                    );
                    if let Ok(ack) = wjs.publish(subject, m.payload.clone()).await {
                        let _ = ack.await;
                    }
                    let _ = m.ack().await;
                }
            })
            .await;
    });
    // Collector: pull results, ack, report.
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<()>();
    let collector = tokio::spawn(async move {
        let Ok(messages) = result_consumer
            .stream()
            .max_messages_per_batch(512)
            .messages()
            .await
        else {
            return;
        };
        messages
            .for_each_concurrent(512, |m| {
                let done_tx = done_tx.clone();
                async move {
                    if let Ok(m) = m {
                        let _ = m.ack().await;
                        let _ = done_tx.send(());
                    }
                }
            })
            .await;
    });
    let body = payload();

    // Latency: one in flight.
    let mut samples = Vec::with_capacity(round_trips);
    for i in 0..round_trips {
        let t0 = Instant::now();
        js.publish(format!("flbench-raw.task.l{i}"), body.clone())
            .await?
            .await?;
        done_rx.recv().await.context("collector stopped")?;
        samples.push(ms(t0.elapsed()));
    }
    samples.sort_by(f64::total_cmp);

    // Throughput: 512 in flight.
    let window = Arc::new(Semaphore::new(512));
    let cpu_before = (
        server_pid.and_then(cpu_seconds),
        cpu_seconds(std::process::id()),
    );
    let start = Instant::now();
    let feeder = {
        let js = js.clone();
        let window = Arc::clone(&window);
        let body = body.clone();
        tokio::spawn(async move {
            let mut acks = futures::stream::FuturesUnordered::new();
            for i in 0..tasks {
                let Ok(p) = Arc::clone(&window).acquire_owned().await else {
                    break;
                };
                p.forget();
                if let Ok(ack) = js
                    .publish(format!("flbench-raw.task.t{i}"), body.clone())
                    .await
                {
                    acks.push(ack.into_future());
                }
                while let Some(Some(_)) = futures::FutureExt::now_or_never(acks.next()) {}
            }
            while acks.next().await.is_some() {}
        })
    };
    for _ in 0..tasks {
        done_rx.recv().await.context("collector stopped")?;
        window.add_permits(1);
    }
    let elapsed = start.elapsed();
    let cpu_server = server_pid
        .and_then(cpu_seconds)
        .zip(cpu_before.0)
        .map(|(a, b)| a - b);
    let cpu_bench = cpu_seconds(std::process::id())
        .zip(cpu_before.1)
        .map(|(a, b)| a - b);
    let _ = feeder.await;
    worker.abort();
    collector.abort();
    for name in ["FLBENCH_RAW_TASKS", "FLBENCH_RAW_RESULTS"] {
        let _ = js.delete_stream(name).await;
    }
    let f = RawFigures {
        throughput: tasks as f64 / elapsed.as_secs_f64(),
        p50_ms: percentile(&samples, 0.50),
        p99_ms: percentile(&samples, 0.99),
    };
    outln!("== raw JetStream task round trip (publish → pull → result publish → pull)");
    outln!(
        "   throughput, 512 in flight: {:>10.0} tasks/s   ({tasks} tasks)",
        f.throughput
    );
    outln!(
        "   latency, 1 in flight:      p50 {:.3} ms   p99 {:.3} ms   ({round_trips} round trips)",
        f.p50_ms,
        f.p99_ms
    );
    if let (Some(s), Some(b)) = (cpu_server, cpu_bench) {
        outln!(
            "   CPU seconds during throughput: nats-server {s:.2}, bench (producer, worker, collector) {b:.2}"
        );
    }
    Ok(f)
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

/// Child processes of the Flotilla section; killed on drop.
pub(super) struct Processes(pub(super) Vec<(String, Child)>);

impl Drop for Processes {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// CPU seconds (user + system) a process has used, from `/proc/<pid>/stat` (USER_HZ = 100).
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

pub(super) fn noop_config(
    dir: &Path,
    url: &str,
    concurrency: usize,
    listener_off: bool,
) -> anyhow::Result<std::path::PathBuf> {
    let path = dir.join("bench.toml");
    // Several processes on one host: no health listener (for builds that have one).
    let telemetry = if listener_off {
        "\n[telemetry]\nhttp-addr = \"off\"\n"
    } else {
        ""
    };
    std::fs::write(
        &path,
        format!(
            r#"# Generated by `flotilla bench`: a no-op scripted agent (no model calls).
pools = ["default"]
default-agent = "noop"

[nats]
urls = ["{url}"]
prefix = "flbench"

[agents.noop]
kind = "scripted"
reply = "ok"

[worker]
concurrency = {concurrency}
{telemetry}"#
        ),
    )?;
    Ok(path)
}

/// Starts `exe <role…>` with the bench's generated `config`, logging warnings to stderr.
pub(super) fn spawn_service(exe: &Path, config: &Path, role: &[&str]) -> anyhow::Result<Child> {
    Ok(Command::new(exe)
        .arg("--config")
        .arg(config)
        .args(role)
        .env("FLOTILLA_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()?)
}

/// Whether a `flotilla` binary has the health listener (and so the `[telemetry]` section).
pub(super) fn has_listener(binary: &Path) -> bool {
    Command::new(binary)
        .args(["coordinator", "--help"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("--http-addr"))
}

/// Outcomes of runs submitted with `reply_to = inbox`: one core message per finished run,
/// so observing completion costs the server nothing beyond the run itself.
pub(super) async fn outcomes(
    bus: &Bus,
    inbox: String,
) -> anyhow::Result<mpsc::UnboundedReceiver<RunStatus>> {
    let mut sub = bus.client().subscribe(inbox).await?;
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            if let Ok(reply) = serde_json::from_slice::<SubmitReply>(&m.payload)
                && let Some(o) = reply.outcome
            {
                let _ = tx.send(o.status);
            }
        }
    });
    Ok(rx)
}

async fn flotilla_section(
    args: &BenchArgs,
    url: &str,
    raw: Option<&RawFigures>,
    server_pid: Option<u32>,
) -> anyhow::Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("flotilla-bench-")
        .tempdir()?;
    let exe = match &args.services_binary {
        Some(p) => p.clone(),
        None => std::env::current_exe()?,
    };
    let config = noop_config(dir.path(), url, args.concurrency, has_listener(&exe))?;
    let spawn = |role: &[&str]| spawn_service(&exe, &config, role);
    let mut opts = NatsOptions::with_url(url);
    opts.prefix = "flbench".into();
    let bus = Bus::connect(&opts, "flotilla-bench").await?;
    bus.provision(&Default::default()).await?;
    let mut procs = Processes(vec![("coordinator".into(), spawn(&["coordinator"])?)]);
    for i in 0..args.workers {
        procs.0.push((format!("worker {i}"), spawn(&["worker"])?));
    }
    let client = Client::new(bus.clone());
    let inbox = format!("_INBOX.flbench.{}", RunId::new());
    let mut ends = outcomes(&bus, inbox.clone()).await?;
    let via = args.submit_via;
    // Warm up: one small run proves every process is ready.
    let warm = submit_via(&bus, SubmitRequest::new(independent_plan(2)), via).await?;
    client.wait(warm, Duration::from_secs(60)).await?;

    outln!(
        "== flotilla (coordinator + {} worker process(es) × {} slots, no-op scripted agent)",
        args.workers,
        args.concurrency
    );
    // Latency first, on a settled system; then throughput.
    // Dependency hop latency on chains.
    let mut hops = Vec::new();
    for _ in 0..args.chains {
        let run = submit_via(&bus, SubmitRequest::new(chain_plan(args.chain)), via).await?;
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
        let mut samples = Vec::with_capacity(args.latency_runs);
        for _ in 0..args.latency_runs {
            let mut req = SubmitRequest::new(plan.clone());
            req.reply_to = Some(inbox.clone());
            let t0 = Instant::now();
            submit_via(&bus, req, via).await?;
            let status = tokio::time::timeout(Duration::from_secs(30), ends.recv())
                .await
                .context("a latency run did not finish in 30 s")?
                .context("outcome subscription ended")?;
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
    let run = submit_via(&bus, SubmitRequest::new(fan_plan(args.fan)), via).await?;
    let outcome = client.wait(run, Duration::from_secs(300)).await?;
    let makespan = t0.elapsed();
    outln!(
        "   makespan 1 → {} → 1: {:.3} s ({:?})",
        args.fan,
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
    for &per_run in &args.tasks_per_run {
        let per_run = per_run.max(1);
        let runs = (args.tasks / per_run).max(1);
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
                .context("outcome subscription ended")?;
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
    let runs = args.single_slot_runs.max(1);
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

/// Submits `runs` runs of `per_run` independent tasks with `reply_to = inbox`, each once a
/// permit of `window` is free (the caller adds one per finished run).
pub(super) fn spawn_submitter(
    bus: &Bus,
    inbox: &str,
    runs: usize,
    per_run: usize,
    via: SubmitVia,
    window: Arc<Semaphore>,
) -> tokio::task::JoinHandle<()> {
    let bus = bus.clone();
    let inbox = inbox.to_owned();
    tokio::spawn(async move {
        let mut acks = futures::stream::FuturesUnordered::new();
        for _ in 0..runs {
            let Ok(permit) = Arc::clone(&window).acquire_owned().await else {
                break;
            };
            permit.forget();
            let mut req = SubmitRequest::new(independent_plan(per_run));
            req.reply_to = Some(inbox.clone());
            let bus = bus.clone();
            acks.push(async move { submit_via(&bus, req, via).await });
            while let Some(Some(_)) = futures::FutureExt::now_or_never(acks.next()) {}
        }
        while acks.next().await.is_some() {}
    })
}

fn independent_plan(n: usize) -> Plan {
    let mut p = Plan {
        name: Some("bench-independent".into()),
        query: None,
        subtasks: (0..n)
            .map(|i| Subtask::new(&format!("t{i}"), "no-op"))
            .collect(),
        config: PlanConfig::default(),
    };
    p.config.max_concurrency = n as u32;
    p
}

/// a → (b ∥ c) → d.
fn diamond_plan() -> Plan {
    Plan {
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

pub(super) fn chain_plan(n: usize) -> Plan {
    let subtasks = (0..n)
        .map(|i| {
            let t = Subtask::new(&format!("s{i}"), "no-op");
            if i == 0 {
                t
            } else {
                t.after(&[&format!("s{}", i - 1)])
            }
        })
        .collect();
    Plan {
        name: Some("bench-chain".into()),
        query: None,
        subtasks,
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
        name: Some("bench-fan".into()),
        query: None,
        subtasks,
        config: PlanConfig::default(),
    };
    p.config.max_concurrency = n as u32;
    p
}

/// Hop latencies of a finished chain, from its run log: the server time the predecessor's
/// result was stored → the time the worker started the dependent (same host clock).
pub(super) async fn chain_hops(client: &Client, run: RunId) -> anyhow::Result<Vec<f64>> {
    let store = flotilla_coordinator::store::RunStore::open(client.bus()).await?;
    let micros = |t: &flotilla_model::time::Timestamp| (t.0.unix_timestamp_nanos() / 1000) as i64;
    let mut stored: HashMap<String, i64> = HashMap::new();
    let mut started: HashMap<String, i64> = HashMap::new();
    for (_, ts, entry) in store.history(run).await? {
        if let RunInput::TaskResult(r) = entry.input {
            stored.insert(r.task_id.to_string(), micros(&ts));
            if let Some(s) = &r.started_at {
                started.insert(r.task_id.to_string(), micros(s));
            }
        }
    }
    let mut hops = Vec::new();
    let mut i = 1;
    while let (Some(prev), Some(next)) = (
        stored.get(&format!("s{}", i - 1)),
        started.get(&format!("s{i}")),
    ) {
        hops.push((next - prev) as f64 / 1000.0);
        i += 1;
    }
    Ok(hops)
}

/// Runs the selected sections.
/// Crash recovery at the default worker heartbeat (5 s): a worker running a long task is
/// killed with SIGKILL; measured is the time until another worker starts the task.
async fn recovery_section(url: &str, rounds: usize) -> anyhow::Result<()> {
    use flotilla_model::event::{Event, WorkflowPhase};
    let dir = tempfile::Builder::new()
        .prefix("flotilla-bench-recovery-")
        .tempdir()?;
    let config = dir.path().join("recovery.toml");
    std::fs::write(
        &config,
        format!(
            r#"# Generated by `flotilla bench`: a long scripted task (no model calls).
pools = ["default"]
default-agent = "long"

[nats]
urls = ["{url}"]
prefix = "flrecov"

[agents.long]
kind = "scripted"
delay = "120s"

[worker]
concurrency = 1
started-event-delay = "0s"

[telemetry]
http-addr = "off"
"#
        ),
    )?;
    let exe = std::env::current_exe()?;
    let spawn = |role: &str| -> anyhow::Result<Child> {
        Ok(Command::new(&exe)
            .arg("--config")
            .arg(&config)
            .arg(role)
            .env("FLOTILLA_LOG", "error")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()?)
    };
    let mut opts = NatsOptions::with_url(url);
    opts.prefix = "flrecov".into();
    let bus = Bus::connect(&opts, "flotilla-bench").await?;
    bus.provision(&Default::default()).await?;
    let client = Client::new(bus.clone());
    let mut procs = Processes(vec![("coordinator".into(), spawn("coordinator")?)]);
    let heartbeat = flotilla_worker::WorkerOptions::default().heartbeat;
    outln!(
        "== crash recovery (heartbeat {:?}, the default): kill -9 of a worker → its task started on another",
        heartbeat
    );
    let mut samples = Vec::new();
    for _ in 0..rounds.max(1) {
        procs.0.push(("victim".into(), spawn("worker")?));
        let run = client
            .submit(SubmitRequest::new(Plan {
                name: Some("recovery".into()),
                query: None,
                subtasks: vec![Subtask::new("long", "")],
                config: PlanConfig::default(),
            }))
            .await?;
        let events = client.events(run).await?;
        futures::pin_mut!(events);
        let first = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(e) = events.next().await {
                if let Event::Workflow(w) = e?.event
                    && w.phase == WorkflowPhase::TaskStarted
                {
                    return Ok::<_, anyhow::Error>(w.worker.unwrap_or_default());
                }
            }
            anyhow::bail!("event stream ended")
        })
        .await
        .context("the task never started")??;
        procs.0.push(("survivor".into(), spawn("worker")?));
        // Let the survivor register and pull before the kill.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let victim = procs.0.len() - 2;
        let _ = procs.0[victim].1.kill();
        let killed = Instant::now();
        let again = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(e) = events.next().await {
                if let Event::Workflow(w) = e?.event
                    && w.phase == WorkflowPhase::TaskStarted
                    && w.worker.as_deref() != Some(first.as_str())
                {
                    return Ok::<_, anyhow::Error>(killed.elapsed());
                }
            }
            anyhow::bail!("event stream ended")
        })
        .await
        .context("the task was not recovered within 60 s")??;
        samples.push(again.as_secs_f64());
        let _ = client.cancel(run, Some("bench round over".into())).await;
        for (_, c) in procs.0.drain(1..) {
            let mut c = c;
            let _ = c.kill();
            let _ = c.wait();
        }
    }
    samples.sort_by(f64::total_cmp);
    let hb = heartbeat.as_secs_f64();
    outln!(
        "   recovery: median {:.2} s, max {:.2} s over {} kills = {:.2} / {:.2} heartbeats (target ≤ 2)",
        percentile(&samples, 0.5),
        samples[samples.len() - 1],
        samples.len(),
        percentile(&samples, 0.5) / hb,
        samples[samples.len() - 1] / hb
    );
    Ok(())
}

pub(crate) async fn run(
    _config: Option<&Path>,
    nats_url: Option<&str>,
    args: BenchArgs,
) -> anyhow::Result<ExitCode> {
    let all = args.only.is_empty();
    let want = |s: Section| all || args.only.contains(&s);
    if want(Section::Validate) {
        validate_section(args.iterations);
    }
    if !want(Section::Raw)
        && !want(Section::Flotilla)
        && !want(Section::Recovery)
        && !want(Section::Collab)
        && !want(Section::Llm)
        && !want(Section::Tree)
    {
        return Ok(ExitCode::SUCCESS);
    }
    let dir = tempfile::Builder::new()
        .prefix("flotilla-bench-nats-")
        .tempdir()?;
    let (_server, url) = match nats_url {
        Some(u) => (None, u.to_owned()),
        None => {
            let s = super::services::embedded_nats(dir.path()).await?;
            let url = s.url();
            outln!(
                "== nats-server: embedded at {url} (file storage in {})",
                dir.path().display()
            );
            (Some(s), url)
        }
    };
    let opts = NatsOptions::with_url(&url);
    let server_pid = _server
        .as_ref()
        .and_then(flotilla_bus::server::LocalNatsServer::pid);
    if want(Section::Recovery) {
        recovery_section(&url, args.recovery_rounds).await?;
    }
    let raw = if want(Section::Raw) || want(Section::Flotilla) || want(Section::Tree) {
        Some(raw_section(&opts, args.raw_tasks, args.raw_round_trips, server_pid).await?)
    } else {
        None
    };
    if want(Section::Flotilla) {
        flotilla_section(&args, &url, raw.as_ref(), server_pid).await?;
    }
    if want(Section::Collab) {
        let services = super::bench_collab::Services {
            exe: match &args.services_binary {
                Some(p) => p.clone(),
                None => std::env::current_exe()?,
            },
            workers: args.workers,
            concurrency: args.concurrency,
            chain: args.chain,
            via: args.submit_via,
        };
        super::bench_collab::collab_section(&args.collab, &services, &url).await?;
    }
    if want(Section::Llm) {
        let services = super::bench_llm::Services {
            exe: match &args.services_binary {
                Some(p) => p.clone(),
                None => std::env::current_exe()?,
            },
            via: args.submit_via,
        };
        super::bench_llm::llm_section(&args.llm, &services, &url).await?;
    }
    if want(Section::Tree) {
        let services = super::bench_tree::Services {
            exe: match &args.services_binary {
                Some(p) => p.clone(),
                None => std::env::current_exe()?,
            },
            via: args.submit_via,
        };
        super::bench_tree::tree_section(&args.tree, &services, &url, raw.as_ref()).await?;
    }
    Ok(ExitCode::SUCCESS)
}
