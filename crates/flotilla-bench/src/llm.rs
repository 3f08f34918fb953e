//! The `llm` section (`flotilla bench --only llm`): LLM agents against a **simulated** OpenAI-compatible provider.
//!
//! The provider is the bench's test double (`harness::provider`, shared with the `agents`
//! section), not a model: it answers after a configurable delay with a short reply, streamed or
//! not, asks for one `state_get` tool call when offered that tool, and records the time each
//! request spent in its handler (the *server time*).
//!
//! Figures (against the bench's nats-server, prefix `flbllm`):
//!
//! * **orchestration overhead per model call** — an in-process [`LlmAgent`] with a real
//!   [`AgentContext`] on the bench's bus (as the worker builds it) answers fresh tasks one at
//!   a time, the provider answering at once; overhead = attempt wall time − server time.
//!   Everything the agent does per call is in it: prompt rendering, the HTTP round trip over
//!   loopback, SSE parsing, `usage`/`assistant_reply` events, and the journaled step (an
//!   awaited PubAck). Next to it: a bare HTTP round trip (a hand-written request on a kept-alive
//!   TCP connection, the same reply) and a bare JetStream publish → PubAck.
//! * **one worker, many concurrent LLM tasks** — a `flotilla coordinator` and one
//!   `flotilla worker --concurrency N` with a `kind = "llm"` agent pointing at the provider;
//!   independent 1-task runs kept N in flight (outcomes on `reply_to`); achieved tasks/s ÷
//!   the ideal N / delay. The worker's RSS idle and loaded → RSS per concurrent agent. Twice:
//!   the first N runs submitted at once (a herd: every later wave's N outcomes and
//!   submissions also come together, and the machine's cores take each wave in turn), then
//!   spread evenly over one delay (arrivals as independent clients send them). Each prints
//!   its sustained rate (the first wave and the drain left out) and the most calls the
//!   provider held at once, which shows the N agents were truly waiting together.
//! * **scaling 1 → 2 → 4 worker processes** — the same with k workers of a smaller
//!   concurrency: tasks/s with k workers ÷ (k × tasks/s with one). Slow tasks, exactly as
//!   many in flight as slots: a task a busy worker prefetched would wait there while another
//!   worker idles.
//! * **quick tasks on one-slot workers** — the other workload: two `flotilla worker
//!   --concurrency 1` with the provider answering at once and a backlog, where holding the
//!   next task saves a pull round trip per task.
//!
//! * **a pause of a running LLM attempt** — on the one worker of figure 2, 1-task runs of an
//!   agent with one `state_get` round (two model calls), paused while the first call is in
//!   flight: the run (`run.pause`), or its task alone (`run.pause` with `task_id`, as a lead's
//!   `pause_member`). Pause recorded → `suspended` recorded (the rest of the in-flight call
//!   and the tool included), the model calls started after the pause (target 0: the attempt
//!   stops at its next step), and after the resume the run's calls (exactly 2: none paid twice).
//!
//! Figures 3 and 4 run once per `worker.prefetch` setting (`--llm-scale-prefetch`, default
//! `1,0`): the default (1, applied only while a worker's attempts are short) should match the
//! better of the two on both workloads.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use flotilla_bus::Bus;
use flotilla_client::Client;
use flotilla_context::{Agent, AgentContext, Clients, EventEmitter, Scope};
use flotilla_llm::{LlmAgent, LlmConfig, Providers, Roles};
use flotilla_model::ids::{AttemptId, RunId};
use flotilla_model::run::{RunOutcome, RunStatus};
use flotilla_model::task::TaskEnvelope;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use crate::harness::processes::{Processes, peak_rss_kib, rss_kib};
use crate::harness::provider::{Provider, REPLY};
use crate::harness::services::{Services, has_listener, section_bus, spawn_service};
use crate::harness::stats::{ms, p50_p99};
use crate::harness::submit::{SubmitVia, outcomes, spawn_submitter};

/// Sizes of the LLM section.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct LlmArgs {
    /// LLM: measured attempts of each overhead figure (after warm-up).
    #[arg(long, default_value_t = 500)]
    llm_samples: usize,
    /// LLM: concurrent tasks (worker slots and in-flight runs) of the one-worker figure.
    #[arg(long, default_value_t = 256)]
    llm_concurrency: usize,
    /// LLM: simulated provider latency of the one-worker figure.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    llm_delay: Duration,
    /// LLM: rounds of the one-worker figure (runs = rounds × concurrency).
    #[arg(long, default_value_t = 3)]
    llm_rounds: usize,
    /// LLM: worker processes of the scaling figure, one measurement each.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2, 4])]
    llm_scale_workers: Vec<usize>,
    /// LLM: slots per worker in the scaling figure.
    #[arg(long, default_value_t = 32)]
    llm_scale_concurrency: usize,
    /// LLM: simulated provider latency of the scaling figure.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    llm_scale_delay: Duration,
    /// LLM: rounds of each scaling measurement (runs = rounds × workers × concurrency).
    #[arg(long, default_value_t = 4)]
    llm_scale_rounds: usize,
    /// LLM: the workers' `worker.prefetch` (tasks a worker holds beyond its slots, waiting
    /// for one, while its attempts are short) in the scaling and quick-task figures, one
    /// measurement each (1 is the worker's default).
    #[arg(long, value_delimiter = ',', default_values_t = [1, 0])]
    llm_scale_prefetch: Vec<usize>,
    /// LLM: runs of the quick-task figure (two one-slot workers, the provider answering at
    /// once, 16 runs in flight); 0 skips it.
    #[arg(long, default_value_t = 2000)]
    llm_quick_runs: usize,
    /// LLM: runs paused while their first model call is in flight, per kind of pause (the
    /// run, its task alone).
    #[arg(long, default_value_t = 10)]
    llm_pause_samples: usize,
    /// LLM: the services' agents speak HTTP/2 to the simulated provider
    /// (`http2-prior-knowledge = true`) instead of HTTP/1.1. The provider serves both, at most
    /// 100 requests at once on one HTTP/2 connection, as providers announce.
    #[arg(long)]
    llm_http2: bool,
}

/// Runs in flight in the quick-task figure: a backlog behind two one-slot workers.
const QUICK_IN_FLIGHT: usize = 16;

/// The bench's prefix for this section (its own streams, apart from the other sections').
const PREFIX: &str = "flbllm";
/// Attempts dropped before each overhead measurement (connections, streams, caches warm).
const WARM_UP: usize = 30;
/// The worker's default `worker.prefetch` (the one-worker figure runs with it).
const DEFAULT_PREFETCH: usize = 1;

// ---------------------------------------------------------------------------------------
// Figure 1: orchestration overhead per model call, in process.

/// A task envelope of a new run, as the worker receives it.
fn envelope(i: usize) -> anyhow::Result<TaskEnvelope> {
    let mut t: TaskEnvelope = serde_json::from_value(json!({
        "run_id": RunId::new(),
        "task_id": format!("t{i}"),
        "attempt": 1,
        "attempt_id": AttemptId::new(),
        "pool": "default",
        "required": true,
        "timeout": 60,
        "dispatched_at": "2026-01-01T00:00:00Z",
        "dataflow_validation": "lenient"
    }))
    .context("building a task envelope")?;
    t.description = "Report the quarter's figure in one sentence.".into();
    Ok(t)
}

/// Overheads (ms per attempt) of `samples` attempts, each making one model call, or two
/// with `tool_round`. Without `events` the attempt's event emitter has no bus: no events are
/// published and no step is journaled (a decomposition only; the worker always has both).
async fn attempt_overheads(
    bus: &Bus,
    provider: &Provider,
    samples: usize,
    tool_round: bool,
    events: bool,
) -> anyhow::Result<Vec<f64>> {
    let mut config = LlmConfig::new(provider.base_url(), "simulated");
    config.tools = if tool_round {
        vec!["state_get".into()]
    } else {
        Vec::new()
    };
    config.max_retries = 0;
    let agent = LlmAgent::new(
        "bench",
        &config,
        Arc::new(Roles::default()),
        &Providers::default(),
        Path::new("."),
    )
    .context("building the bench's LLM agent")?;
    let calls = if tool_round { 2 } else { 1 };
    let mut out = Vec::with_capacity(samples);
    for i in 0..WARM_UP + samples {
        let task = envelope(i)?;
        let scope = Scope::from_envelope(&task, 1, bus.names().clone());
        let clients = Clients::new(bus.clone(), scope)?;
        let events = EventEmitter::new(events.then(|| bus.clone()), &task, "bench-worker", 1);
        let ctx = AgentContext::new(
            clients,
            CancellationToken::new(),
            Instant::now() + Duration::from_secs(60),
            events,
            "bench-worker",
        );
        let (nanos0, requests0) = provider.totals();
        let t0 = Instant::now();
        let reply = agent.run(&task, ctx).await;
        let wall = t0.elapsed();
        let (nanos1, requests1) = provider.totals();
        if let Err(e) = reply {
            anyhow::bail!(
                "an LLM attempt against the simulated provider at {} failed: {} ({:?})",
                provider.base_url(),
                e.message,
                e.kind
            );
        }
        anyhow::ensure!(
            requests1 - requests0 == calls,
            "an attempt made {} model calls, expected {calls}",
            requests1 - requests0
        );
        if i >= WARM_UP {
            out.push((wall.as_nanos() as f64 - (nanos1 - nanos0) as f64) / 1e6);
        }
    }
    Ok(out)
}

/// One attempt with `stream = false` (a JSON reply per call), with a tool round: the
/// provider's non-streaming path works (not timed).
async fn check_non_streaming(bus: &Bus, provider: &Provider) -> anyhow::Result<()> {
    let mut config = LlmConfig::new(provider.base_url(), "simulated");
    config.tools = vec!["state_get".into()];
    config.max_retries = 0;
    config.stream = false;
    let agent = LlmAgent::new(
        "bench",
        &config,
        Arc::new(Roles::default()),
        &Providers::default(),
        Path::new("."),
    )
    .context("building the bench's non-streaming LLM agent")?;
    let task = envelope(0)?;
    let scope = Scope::from_envelope(&task, 1, bus.names().clone());
    let ctx = AgentContext::new(
        Clients::new(bus.clone(), scope)?,
        CancellationToken::new(),
        Instant::now() + Duration::from_secs(60),
        EventEmitter::new(Some(bus.clone()), &task, "bench-worker", 1),
        "bench-worker",
    );
    agent.run(&task, ctx).await.map_err(|e| {
        anyhow::anyhow!(
            "a non-streaming LLM attempt against the simulated provider at {} failed: {} ({:?})",
            provider.base_url(),
            e.message,
            e.kind
        )
    })?;
    Ok(())
}

/// A bare HTTP/1.1 round trip to the provider on one kept-alive connection, the same streamed
/// reply read to `[DONE]`: the floor of any HTTP client (ms, minus server time).
async fn bare_http(provider: &Provider, samples: usize) -> anyhow::Result<Vec<f64>> {
    let mut stream = tokio::net::TcpStream::connect(provider.addr)
        .await
        .with_context(|| format!("connecting to the simulated provider at {}", provider.addr))?;
    stream.set_nodelay(true)?;
    let body = json!({"model": "simulated", "stream": true, "stream_options": {"include_usage": true},
                      "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                   {"role": "user", "content": "Report the quarter's figure in one sentence."}]})
    .to_string();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        provider.addr,
        body.len()
    );
    let mut out = Vec::with_capacity(samples);
    let mut buf = vec![0u8; 64 * 1024];
    for i in 0..WARM_UP + samples {
        let (nanos0, _) = provider.totals();
        let t0 = Instant::now();
        stream.write_all(request.as_bytes()).await?;
        // Chunked transfer encoding: the response ends with the zero-length chunk.
        let mut got = Vec::new();
        loop {
            let n = stream.read(&mut buf).await?;
            anyhow::ensure!(n > 0, "the simulated provider closed the connection");
            got.extend_from_slice(&buf[..n]);
            if got.ends_with(b"\r\n0\r\n\r\n") {
                break;
            }
        }
        let wall = t0.elapsed();
        let (nanos1, _) = provider.totals();
        anyhow::ensure!(
            got.windows(6).any(|w| w == b"[DONE]"),
            "the simulated provider's reply did not end with [DONE]"
        );
        if i >= WARM_UP {
            out.push((wall.as_nanos() as f64 - (nanos1 - nanos0) as f64) / 1e6);
        }
    }
    Ok(out)
}

/// A bare JetStream publish → PubAck of a step-sized event (ms).
async fn bare_puback(bus: &Bus, samples: usize) -> anyhow::Result<Vec<f64>> {
    let js = bus.js();
    let name = "FLBENCH_LLM_RAW";
    let _ = js.delete_stream(name).await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: name.into(),
        subjects: vec!["flbllm-raw.>".into()],
        ..Default::default()
    })
    .await?;
    let payload = bytes::Bytes::from(
        json!({"type": "agent_step", "step": 0, "content": REPLY, "tool_calls": [],
               "usage": {"prompt_tokens": 100, "completion_tokens": 8}, "padding": "x".repeat(300)})
        .to_string(),
    );
    let mut out = Vec::with_capacity(samples);
    for i in 0..WARM_UP + samples {
        let t0 = Instant::now();
        js.publish(format!("flbllm-raw.{i}"), payload.clone())
            .await?
            .await?;
        if i >= WARM_UP {
            out.push(ms(t0.elapsed()));
        }
    }
    let _ = js.delete_stream(name).await;
    Ok(out)
}

// ---------------------------------------------------------------------------------------
// Figures 2 and 3: coordinator and worker processes.

/// The services' configuration: one `kind = "llm"` agent pointing at the provider.
fn llm_config(
    dir: &Path,
    nats_url: &str,
    base_url: &str,
    max_requests: usize,
    prefetch: usize,
    listener_off: bool,
    http2: bool,
) -> anyhow::Result<PathBuf> {
    let worker = format!("\n[worker]\nprefetch = {prefetch}\n");
    // Written only when asked: builds before the option refuse it (`--services-binary`).
    let http2 = if http2 {
        "http2-prior-knowledge = true\n"
    } else {
        ""
    };
    let path = dir.join(format!("bench-llm-prefetch-{prefetch}.toml"));
    let telemetry = if listener_off {
        "\n[telemetry]\nhttp-addr = \"off\"\n"
    } else {
        ""
    };
    std::fs::write(
        &path,
        format!(
            r#"# Generated by `flotilla bench --only llm`: an LLM agent against the bench's simulated
# OpenAI-compatible provider (a test double answering after a fixed delay, not a model).
pools = ["default"]
default-agent = "llm"

[nats]
urls = ["{nats_url}"]
prefix = "{PREFIX}"

[agents.llm]
kind = "llm"
base-url = "{base_url}"
model = "simulated"
tools = []
max-concurrent-requests = {max_requests}
{http2}
# Two model calls per task (one `state_get` round): a step boundary for the pause figure.
[agents.stepper]
kind = "llm"
base-url = "{base_url}"
model = "simulated"
tools = ["state_get"]
max-concurrent-requests = {max_requests}
{http2}{worker}{telemetry}"#
        ),
    )
    .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// How a closed loop of runs went.
struct Looped {
    /// From the first submission to the last outcome.
    elapsed: Duration,
    /// Runs that did not succeed.
    failed: usize,
    /// Runs finished per second once the first `in_flight` had finished and until the last
    /// run was submitted: the sustained rate, without the first wave's ramp (every run
    /// submitted at once) or the last one's drain. `None` when there are fewer than three
    /// waves.
    sustained: Option<f64>,
}

/// Submits `runs` 1-task runs kept `in_flight` at a time and waits for every outcome. The
/// first `in_flight` go out at once when `spread` is zero, else evenly over `spread`.
async fn closed_loop(
    bus: &Bus,
    inbox: &str,
    ends: &mut mpsc::UnboundedReceiver<RunOutcome>,
    runs: usize,
    in_flight: usize,
    via: SubmitVia,
    spread: Duration,
) -> anyhow::Result<Looped> {
    let in_flight = in_flight.max(1);
    let window = Arc::new(Semaphore::new(if spread.is_zero() { in_flight } else { 0 }));
    let start = Instant::now();
    let opener = (!spread.is_zero())
        .then(|| tokio::spawn(open_evenly(Arc::clone(&window), in_flight, spread)));
    let submitter = spawn_submitter(bus, inbox, runs, 1, via, Arc::clone(&window));
    let mut failed = 0;
    let mut finished_at = Vec::with_capacity(runs);
    for _ in 0..runs {
        let status = tokio::time::timeout(Duration::from_secs(120), ends.recv())
            .await
            .context(
                "no LLM run finished for 2 minutes (is the worker up and the provider answering?)",
            )?
            .context("outcome subscription ended")?
            .status;
        finished_at.push(Instant::now());
        if status != RunStatus::Succeeded {
            failed += 1;
        }
        window.add_permits(1);
    }
    let elapsed = start.elapsed();
    let _ = submitter.await;
    if let Some(opener) = opener {
        opener.abort();
    }
    // The run finishing as number `in_flight` ends the first wave; the one finishing as
    // number `runs - in_flight` lets the last run be submitted.
    let sustained = (runs >= 3 * in_flight).then(|| {
        let (from, to) = (in_flight - 1, runs - in_flight - 1);
        let secs = finished_at[to]
            .duration_since(finished_at[from])
            .as_secs_f64();
        (to - from) as f64 / secs.max(f64::EPSILON)
    });
    Ok(Looped {
        elapsed,
        failed,
        sustained,
    })
}

/// Opens `places` places of `window` evenly over `spread` (every 5 ms, the ones due).
async fn open_evenly(window: Arc<Semaphore>, places: usize, spread: Duration) {
    let start = Instant::now();
    let mut opened = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    while opened < places {
        tick.tick().await;
        let due = places_due(start.elapsed(), spread, places);
        if due > opened {
            window.add_permits(due - opened);
            opened = due;
        }
    }
}

/// How many of `places` opened evenly over `spread` are due `elapsed` after the start: all
/// of them once `spread` has passed (or at once when it is zero).
fn places_due(elapsed: Duration, spread: Duration, places: usize) -> usize {
    if elapsed >= spread {
        return places;
    }
    let due = (elapsed.as_secs_f64() / spread.as_secs_f64() * places as f64).ceil();
    (due as usize).min(places)
}

/// One scaling measurement: (worker processes, tasks/s, runs not succeeded).
type ScaleRow = (usize, f64, usize);

fn unix_nanos() -> i128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i128)
}

/// Waits until `k` workers registered after `since` (Unix ns; same host clock): the workers
/// killed before them stay in the registry until their entries expire.
async fn wait_for_workers(bus: &Bus, k: usize, since: i128) -> anyhow::Result<()> {
    let client = Client::new(bus.clone());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let live = client.live_workers().await?;
        let new = live
            .iter()
            .filter(|(_, at)| at.0.unix_timestamp_nanos() >= since)
            .count();
        if new >= k {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {new} of {k} LLM workers registered within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A closed loop on the one worker, watched.
struct Loaded {
    looped: Looped,
    /// The worker's most RSS sampled during the loop.
    rss_kib: u64,
    /// Model calls answered during the loop.
    requests: u64,
    /// The most calls held by the provider at once.
    peak_waiting: u64,
}

/// [`closed_loop`] with the worker's RSS sampled every 50 ms and the provider's calls
/// counted.
#[allow(clippy::too_many_arguments)]
async fn loaded_loop(
    bus: &Bus,
    inbox: &str,
    ends: &mut mpsc::UnboundedReceiver<RunOutcome>,
    provider: &Provider,
    worker_pid: u32,
    runs: usize,
    in_flight: usize,
    via: SubmitVia,
    spread: Duration,
) -> anyhow::Result<Loaded> {
    let peak = Arc::new(AtomicU64::new(0));
    let sampler = {
        let peak = Arc::clone(&peak);
        tokio::spawn(async move {
            loop {
                if let Some(kib) = rss_kib(worker_pid) {
                    peak.fetch_max(kib, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let requests0 = provider.totals().1;
    provider.take_peak_waiting();
    let looped = closed_loop(bus, inbox, ends, runs, in_flight, via, spread).await;
    sampler.abort();
    Ok(Loaded {
        looped: looped?,
        rss_kib: peak.load(Ordering::SeqCst),
        requests: provider.totals().1 - requests0,
        peak_waiting: provider.take_peak_waiting(),
    })
}

/// One pause of a running LLM attempt: (pause recorded → attempt stopped, ms; model calls
/// started after the pause was recorded; model calls of the whole run).
type PauseSample = (f64, u64, u64);

/// Figure 5: a run of one two-call LLM task (`stepper`), paused — the run, or its task alone
/// (`task`) — while its first model call is in flight, then resumed to the end.
async fn pause_sample(
    client: &Client,
    provider: &Provider,
    task: bool,
) -> anyhow::Result<PauseSample> {
    use flotilla_model::control::{PauseRunRequest, ResumeRunRequest};
    use flotilla_model::plan::{Plan, PlanConfig, Subtask};
    use flotilla_model::runlog::RunInput;
    use flotilla_model::submit::SubmitRequest;
    const ASK: Duration = Duration::from_secs(30);
    let plan = Plan {
        fork: None,
        name: Some("bench-llm-pause".into()),
        query: None,
        subtasks: vec![Subtask::new("step", "Report the quarter's figure.").with_agent("stepper")],
        config: PlanConfig::default(),
    };
    let arrived = || provider.arrived();
    let before = arrived();
    let run = client.submit(SubmitRequest::new(plan)).await?;
    let deadline = Instant::now() + ASK;
    while arrived() == before {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the LLM task never called the provider"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let task_id = task.then(|| flotilla_model::ids::TaskId::new("step"));
    client
        .call(
            &PauseRunRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                run_id: run,
                reason: Some("bench".into()),
                by: Some("bench".into()),
                timeout_ms: None,
                children: false,
                task_id: task_id.clone(),
            },
            ASK,
        )
        .await?
        .map_err(|e| anyhow::anyhow!("pause refused: {e:?}"))?;
    let store = flotilla_client::open_store(client.bus()).await?;
    let nanos = |t: &flotilla_model::time::Timestamp| t.0.unix_timestamp_nanos();
    let (paused, stopped, calls_then) = loop {
        let history = store.history(run).await?;
        let paused = history.iter().find_map(|(_, ts, e)| {
            matches!(&e.input, RunInput::Control(c) if c.action == flotilla_model::runlog::ControlAction::Pause)
                .then(|| nanos(ts))
        });
        let stopped = history
            .iter()
            .find_map(|(_, ts, e)| matches!(&e.input, RunInput::Suspended(_)).then(|| nanos(ts)));
        if let (Some(p), Some(s)) = (paused, stopped) {
            break (p, s, arrived());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the paused LLM attempt never stopped at its step (run {run}; its log: {:?})",
            history
                .iter()
                .map(|(_, _, e)| format!("{:?}", e.input)
                    .chars()
                    .take(60)
                    .collect::<String>())
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    client
        .call(
            &ResumeRunRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                run_id: run,
                reason: None,
                by: Some("bench".into()),
                children: false,
                task_id,
            },
            ASK,
        )
        .await?
        .map_err(|e| anyhow::anyhow!("resume refused: {e:?}"))?;
    let outcome = client.wait(run, ASK).await?;
    anyhow::ensure!(
        outcome.status == RunStatus::Succeeded,
        "the paused LLM run did not succeed: {outcome:?}"
    );
    let calls = arrived() - before;
    Ok((
        (stopped - paused).max(0) as f64 / 1e6,
        (calls_then - before).saturating_sub(1),
        calls,
    ))
}

fn not_succeeded(failed: usize) -> String {
    if failed > 0 {
        format!(", {failed} runs NOT succeeded")
    } else {
        String::new()
    }
}

/// Runs the section.
pub(crate) async fn run(args: &LlmArgs, services: &Services, url: &str) -> anyhow::Result<()> {
    let provider = Provider::start().await?;
    let bus = section_bus(url, PREFIX).await?;
    outln!(
        "== LLM agents against a SIMULATED OpenAI-compatible provider at {} (a test double in the bench answering after a fixed delay, not a model)",
        provider.base_url()
    );

    // Figure 1: overhead per model call, one attempt at a time, zero provider delay.
    provider.set_delay(Duration::ZERO);
    check_non_streaming(&bus, &provider).await?;
    let samples = args.llm_samples.max(1);
    let (o50, o99) = p50_p99(&mut attempt_overheads(&bus, &provider, samples, false, true).await?);
    let (t50, t99) = p50_p99(&mut attempt_overheads(&bus, &provider, samples, true, true).await?);
    let (n50, n99) = p50_p99(&mut attempt_overheads(&bus, &provider, samples, false, false).await?);
    let (h50, h99) = p50_p99(&mut bare_http(&provider, samples).await?);
    let (j50, j99) = p50_p99(&mut bare_puback(&bus, samples).await?);
    outln!(
        "   orchestration overhead per model call (attempt wall time − server time; in-process LlmAgent, 1 in flight, streaming, {samples} attempts each):"
    );
    outln!(
        "   1 call per task:                          p50 {o50:.3} ms   p99 {o99:.3} ms   per call"
    );
    outln!(
        "   2 calls per task (one state_get round):   p50 {:.3} ms   p99 {:.3} ms   per call   (per task {t50:.3} / {t99:.3} ms, the tool included)",
        t50 / 2.0,
        t99 / 2.0
    );
    outln!(
        "   decomposition — 1 call, no events and no journal (emitter without a bus; never so in a worker): p50 {n50:.3} ms   p99 {n99:.3} ms"
    );
    outln!(
        "   compared with: bare HTTP/1.1 round trip, same reply (kept-alive TCP, no client library): p50 {h50:.3} ms   p99 {h99:.3} ms"
    );
    outln!(
        "                  bare JetStream publish → PubAck (what journaling a step waits for): p50 {j50:.3} ms   p99 {j99:.3} ms"
    );

    // Figures 2 and 3: the services.
    let dir = tempfile::Builder::new()
        .prefix("flotilla-bench-llm-")
        .tempdir()?;
    let listener_off = has_listener(&services.exe);
    let max_requests = args.llm_concurrency.max(args.llm_scale_concurrency).max(1);
    let config = llm_config(
        dir.path(),
        url,
        &provider.base_url(),
        max_requests,
        DEFAULT_PREFETCH,
        listener_off,
        args.llm_http2,
    )?;
    let spawn = |role: &[&str]| spawn_service(&services.exe, &config, role);
    let mut procs = Processes(vec![("coordinator".into(), spawn(&["coordinator"])?)]);
    let inbox = format!("_INBOX.flbllm.{}", RunId::new());
    let mut ends = outcomes(&bus, inbox.clone()).await?;
    let via = services.via;

    // Figure 2: one worker, N concurrent tasks of `llm_delay`.
    let n = args.llm_concurrency.max(1);
    let conc = n.to_string();
    procs
        .0
        .push(("worker".into(), spawn(&["worker", "--concurrency", &conc])?));
    let worker_pid = procs.0[1].1.id();
    // Warm up with a short delay: proves both processes are ready, warms the connections.
    provider.set_delay(Duration::from_millis(10));
    let Looped { failed, .. } = closed_loop(&bus, &inbox, &mut ends, 4, 4, via, Duration::ZERO)
        .await
        .context("warming up the LLM worker")?;
    anyhow::ensure!(
        failed == 0,
        "the warm-up LLM runs did not succeed (see the worker's log above)"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle = rss_kib(worker_pid).unwrap_or(0);
    provider.set_delay(args.llm_delay);
    let runs = n * args.llm_rounds.max(1);
    let ideal = n as f64 / args.llm_delay.as_secs_f64();
    outln!(
        "   one worker × {n} slots, {n} LLM tasks in flight, {:?} simulated latency, {} to the provider (1-task runs, {runs} runs each):",
        args.llm_delay,
        if args.llm_http2 {
            "HTTP/2 (h2c)"
        } else {
            "HTTP/1.1"
        }
    );
    for spread in [Duration::ZERO, args.llm_delay] {
        let loaded = loaded_loop(
            &bus, &inbox, &mut ends, &provider, worker_pid, runs, n, via, spread,
        )
        .await?;
        let achieved = runs as f64 / loaded.looped.elapsed.as_secs_f64();
        if spread.is_zero() {
            outln!(
                "   – the first {n} submitted at once (a herd: each wave's {n} outcomes and submissions come together):"
            );
        } else {
            outln!(
                "   – the first {n} submitted evenly over {spread:?} (arrivals spread, as independent clients send them):"
            );
        }
        outln!(
            "     throughput {achieved:.1} tasks/s ÷ ideal {ideal:.1} ({n} / {:?}) = {:.3}, the first wave's ramp included ({runs} runs in {:.2} s, {} model calls, at most {} at the provider at once{})",
            args.llm_delay,
            achieved / ideal,
            loaded.looped.elapsed.as_secs_f64(),
            loaded.requests,
            loaded.peak_waiting,
            not_succeeded(loaded.looped.failed)
        );
        if let Some(rate) = loaded.looped.sustained {
            outln!(
                "     sustained, the first wave's ramp and the last one's drain left out: {rate:.1} tasks/s = {:.3} of ideal   (target ≥ 0.95)",
                rate / ideal
            );
        }
        outln!(
            "     worker RSS: idle {:.1} MiB, loaded {:.1} MiB (most sampled), peak {:.1} MiB → {:.1} KiB per concurrent agent   (target ≤ 50)",
            idle as f64 / 1024.0,
            loaded.rss_kib as f64 / 1024.0,
            peak_rss_kib(worker_pid).unwrap_or(0) as f64 / 1024.0,
            loaded.rss_kib.saturating_sub(idle) as f64 / n as f64
        );
    }
    for (name, child) in procs.0.iter() {
        if name == "coordinator"
            && let Some(kib) = peak_rss_kib(child.id())
        {
            outln!("   coordinator peak RSS {:.1} MiB", kib as f64 / 1024.0);
        }
    }

    // Figure 5: a pause of a running LLM attempt (the one worker of figure 2).
    let pause_delay = Duration::from_millis(100);
    provider.set_delay(pause_delay);
    let client = Client::new(bus.clone());
    let mut pauses: Vec<(&str, Vec<PauseSample>)> = Vec::new();
    for (what, task) in [("the run", false), ("its task alone", true)] {
        let mut samples = Vec::new();
        for _ in 0..args.llm_pause_samples {
            samples.push(pause_sample(&client, &provider, task).await?);
        }
        pauses.push((what, samples));
    }
    for (what, samples) in &pauses {
        if samples.is_empty() {
            continue;
        }
        let (s50, s99) = p50_p99(&mut samples.iter().map(|s| s.0).collect::<Vec<_>>());
        let after = samples.iter().map(|s| s.1).max().unwrap_or(0);
        let extra = samples.iter().filter(|s| s.2 != 2).count();
        outln!(
            "   pause of a running LLM attempt ({what}; 2 model calls per task, the first in flight, {pause_delay:?} simulated latency, {} runs): pause recorded → attempt stopped p50 {s50:.1} ms   p99 {s99:.1} ms (the rest of the in-flight call included); model calls started after the pause: at most {after} (target 0: it stops at its next step); runs whose calls were not exactly 2 after the resume: {extra} (target 0: no call paid twice)",
            samples.len()
        );
    }

    // Figure 3: 1 → 2 → 4 worker processes, for each prefetch setting.
    let per = args.llm_scale_concurrency.max(1);
    let per_s = per.to_string();
    let mut tables: Vec<(usize, Vec<ScaleRow>)> = Vec::new();
    for &prefetch in &args.llm_scale_prefetch {
        let config = llm_config(
            dir.path(),
            url,
            &provider.base_url(),
            max_requests,
            prefetch,
            listener_off,
            args.llm_http2,
        )?;
        let mut rows = Vec::new();
        for &k in &args.llm_scale_workers {
            let k = k.max(1);
            for (_, mut c) in procs.0.drain(1..) {
                let _ = c.kill();
                let _ = c.wait();
            }
            let spawned = unix_nanos();
            for i in 0..k {
                procs.0.push((
                    format!("worker {i}"),
                    spawn_service(&services.exe, &config, &["worker", "--concurrency", &per_s])?,
                ));
            }
            wait_for_workers(&bus, k, spawned).await?;
            // Warm up: a round of short tasks over every worker's slots.
            provider.set_delay(Duration::from_millis(200));
            let Looped { failed, .. } = closed_loop(
                &bus,
                &inbox,
                &mut ends,
                k * per,
                k * per,
                via,
                Duration::ZERO,
            )
            .await
            .context("warming up the LLM workers")?;
            anyhow::ensure!(failed == 0, "the warm-up LLM runs did not succeed");
            provider.set_delay(args.llm_scale_delay);
            let runs = k * per * args.llm_scale_rounds.max(1);
            let Looped {
                elapsed, failed, ..
            } = closed_loop(&bus, &inbox, &mut ends, runs, k * per, via, Duration::ZERO).await?;
            rows.push((k, runs as f64 / elapsed.as_secs_f64(), failed));
        }
        tables.push((prefetch, rows));
    }
    // Figure 4: quick tasks on two one-slot workers, for each prefetch setting.
    let mut quick: Vec<(usize, f64, usize)> = Vec::new();
    if args.llm_quick_runs > 0 {
        for &prefetch in &args.llm_scale_prefetch {
            let config = llm_config(
                dir.path(),
                url,
                &provider.base_url(),
                max_requests,
                prefetch,
                listener_off,
                args.llm_http2,
            )?;
            for (_, mut c) in procs.0.drain(1..) {
                let _ = c.kill();
                let _ = c.wait();
            }
            let spawned = unix_nanos();
            for i in 0..2 {
                procs.0.push((
                    format!("one-slot worker {i}"),
                    spawn_service(&services.exe, &config, &["worker", "--concurrency", "1"])?,
                ));
            }
            wait_for_workers(&bus, 2, spawned).await?;
            provider.set_delay(Duration::ZERO);
            let Looped { failed, .. } = closed_loop(
                &bus,
                &inbox,
                &mut ends,
                64,
                QUICK_IN_FLIGHT,
                via,
                Duration::ZERO,
            )
            .await
            .context("warming up the one-slot LLM workers")?;
            anyhow::ensure!(failed == 0, "the warm-up LLM runs did not succeed");
            let Looped {
                elapsed, failed, ..
            } = closed_loop(
                &bus,
                &inbox,
                &mut ends,
                args.llm_quick_runs,
                QUICK_IN_FLIGHT,
                via,
                Duration::ZERO,
            )
            .await?;
            quick.push((
                prefetch,
                args.llm_quick_runs as f64 / elapsed.as_secs_f64(),
                failed,
            ));
        }
    }
    drop(procs);
    for (prefetch, rows) in &tables {
        outln!(
            "   scaling: k worker processes × {per} slots, worker.prefetch = {prefetch}{}, {:?} simulated latency, k × {per} runs in flight, {} rounds:",
            if *prefetch == DEFAULT_PREFETCH {
                " (the default)"
            } else {
                ""
            },
            args.llm_scale_delay,
            args.llm_scale_rounds
        );
        let one = rows.iter().find(|(k, _, _)| *k == 1).map(|(_, t, _)| *t);
        for (k, throughput, failed) in rows {
            let ideal = (k * per) as f64 / args.llm_scale_delay.as_secs_f64();
            let vs_linear = one.map_or(String::new(), |one| {
                format!(
                    "; ÷ ({k} × one worker's {one:.1}) = {:.3} (target ≥ 0.8)",
                    throughput / (*k as f64 * one)
                )
            });
            outln!(
                "   {k} worker(s): {throughput:>7.1} tasks/s = {:.3} of ideal {ideal:.1}{vs_linear}{}",
                throughput / ideal,
                not_succeeded(*failed)
            );
        }
    }
    if !quick.is_empty() {
        outln!(
            "   quick tasks: 2 worker processes × 1 slot, the provider answering at once, {QUICK_IN_FLIGHT} runs in flight, {} runs:",
            args.llm_quick_runs
        );
        let best = quick.iter().map(|(_, t, _)| *t).fold(0.0, f64::max);
        for (prefetch, throughput, failed) in &quick {
            outln!(
                "   worker.prefetch = {prefetch}{}: {throughput:>7.1} tasks/s = {:.3} of the best setting{}",
                if *prefetch == DEFAULT_PREFETCH {
                    " (the default)"
                } else {
                    ""
                },
                throughput / best,
                not_succeeded(*failed)
            );
        }
    }
    let bad = provider.bad_requests();
    if bad > 0 {
        outln!("   the simulated provider received {bad} requests that were not JSON");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_open_evenly_and_all_by_the_end() {
        let spread = Duration::from_secs(5);
        assert_eq!(places_due(Duration::ZERO, spread, 10_000), 0);
        assert_eq!(places_due(Duration::from_millis(5), spread, 10_000), 10);
        assert_eq!(
            places_due(Duration::from_millis(2500), spread, 10_000),
            5_000
        );
        assert_eq!(
            places_due(Duration::from_millis(4999), spread, 10_000),
            9_998
        );
        assert_eq!(places_due(spread, spread, 10_000), 10_000);
        assert_eq!(places_due(Duration::from_secs(60), spread, 10_000), 10_000);
        // Fewer places than ticks: each opens once its share of the spread has begun.
        assert_eq!(places_due(Duration::from_millis(1), spread, 3), 1);
        assert_eq!(places_due(Duration::from_millis(1700), spread, 3), 2);
        assert_eq!(places_due(Duration::ZERO, Duration::ZERO, 3), 3);
    }
}
