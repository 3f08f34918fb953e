//! The `tree` section (`flotilla bench --only tree`): run trees — child runs (agent-as-tool) and the projections
//! that show a tree's events — next to the dependency hop and the raw JetStream round trip
//! measured in the same run.
//!
//! Everything runs against the bench's nats-server under its own prefix (`flbtree`):
//!
//! * a `flotilla coordinator` process and `--tree-workers` `flotilla worker` processes
//!   (`--tree-concurrency` slots each, pool `default`) running the deterministic `scripted`
//!   agent, no model: `noop` answers at once, `pause` after `--tree-child-delay`;
//! * the agents that **start** children are small deterministic Rust agents of this bench
//!   (no model either): `spawner`, `nest` and `fanout`, run by a worker *inside the bench
//!   process* (`flotilla_worker::Worker` with an `AgentRegistry` holding them, pool `tree`,
//!   32 slots), which also runs `noop` for the chain compared with `nest`. The coordinator's
//!   configuration names them (as scripted agents that never run there) so plans naming them
//!   validate.
//!
//! Figures:
//!
//! 1. **Child spawn → the child's task started.** `spawner` calls `noop` as a child run, one
//!    call at a time, 10 calls per parent run, doing what `AgentContext::call_agent` does step
//!    by step (`start_child`: the child's marker, then `child.start` at a coordinator, which
//!    stores the child's submission; the announcement; waiting for the outcome) so each step
//!    can be timed. Per call: the bench's clock just before `start_child` → the child task's
//!    `started_at` in the child's run log (stamped by the worker process; same host clock, as
//!    the dependency hop), split at `start_child`'s return. Alternating with it, 2-task
//!    chains `s0 → s1` on the worker processes: s0's result stored (the run-log entry's server
//!    time) → s1's agent started, as [`chain_hops`](crate::harness::plans::chain_hops) reads
//!    it. Next to both, the raw JetStream round trip of the `raw` section (publish → pull →
//!    publish → pull, one in flight), measured in the same run.
//! 2. **Depth-N nested agent-as-tool vs N dependency hops.** `nest` with input depth *d*
//!    calls `nest` with *d* − 1 as a child run (timed as in 1) and answers with the child's
//!    answer; at *d* = 0 it answers at once. Submit (with `reply_to`) → the root's outcome
//!    received, for *d* = N (`--tree-depth`): N + 1 runs of one task each, nested. Against an
//!    (N + 1)-task chain of `noop` tasks (N dependency hops, one run) on the same in-process
//!    worker, and the same chain on the worker processes; the three alternate run by run. Per
//!    level = (nested − chain on the same worker) / N, and split: *down* (the call → the
//!    child's task started) and *up* (the child's result stored → the calling agent holds
//!    the child's outcome), next to the in-process chain's hops.
//! 3. **Projected-stream delivery lag with many concurrent children.** `fanout` starts
//!    `--tree-children` children of `pause` at once (concurrent `call_agent`s) and waits for
//!    them all. Four watchers are live before it starts them (it waits for the bench's go):
//!    the client library (`Client::watch`, profile `debug`, children `flatten`, since 0;
//!    opened before the parent is submitted) and `api.watch` (the same, delivered to an
//!    inbox, the lease renewed every second; opened once the submission is stored, since the
//!    endpoint refuses a run it cannot find), and both again with children `linked` — the
//!    parent's own events, the baseline. Per delivered event: its arrival at the watcher −
//!    the JetStream timestamp of its event message (read back by sequence; same host clock).
//!    Delivered events are counted against every event stored in the tree's streams (lost or
//!    doubled events show); events stored before the watchers were live are left out of the
//!    lag.
//!
//! Consumers: waits for a run's end (`call_agent`, client waits) hold none on the server;
//! each live projection holds one ordered consumer on the events stream (replaced, and the old
//! one deleted, when a child is linked). The bench prints the peak count it saw; before each
//! step it checks that its consumers fit the stream's limit (`jetstream.max-consumers`) and
//! would wait for idle ones to expire if not (the time waited is printed, and is not part of
//! any figure).
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use flotilla_bus::{Bus, NatsOptions, wire};
use flotilla_client::Client;
use flotilla_client::WatchOptions;
use flotilla_context::{Agent, AgentContext, AgentError, AgentReply, ChildCall};
use flotilla_model::event::{Event, decode_events};
use flotilla_model::ids::RunId;
use flotilla_model::plan::{Plan, PlanConfig, Subtask};
use flotilla_model::run::{RunOutcome, RunStatus};
use flotilla_model::runlog::{RunInput, RunLogEntry};
use flotilla_model::subjects::StreamKind;
use flotilla_model::submit::SubmitRequest;
use flotilla_model::task::TaskEnvelope;
use flotilla_model::time::Timestamp;
use flotilla_model::watch::{
    ChildPolicy, Profile, ProjectedEvent, WatchEnd, WatchReply, WatchRequest,
};
use flotilla_worker::agents::{ScriptedAgent, ScriptedConfig};
use flotilla_worker::{AgentRegistry, Worker, WorkerOptions};
use futures::StreamExt;
use futures::future::BoxFuture;
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::harness::plans::chain_plan;
use crate::harness::processes::Processes;
use crate::harness::raw::RawFigures;
use crate::harness::services::{Services, has_listener, spawn_service};
use crate::harness::stats::{ms, percentile};
use crate::harness::submit::{SubmitVia, outcomes, submit_via};

/// Sizes of the run-tree section.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct TreeArgs {
    /// Tree: samples of child spawn → child started (and as many 2-task chains, alternating).
    #[arg(long, default_value_t = 300)]
    tree_spawns: usize,
    /// Tree: depth of the nested agent-as-tool chain (child runs below the root).
    #[arg(long, default_value_t = 10)]
    tree_depth: usize,
    /// Tree: repetitions of the nested chain (and of each plain chain it is compared with).
    #[arg(long, default_value_t = 30)]
    tree_nested_runs: usize,
    /// Tree: children the fan-out parent starts at once.
    #[arg(long, default_value_t = 100)]
    tree_children: usize,
    /// Tree: fan-out parents, one after the other, each watched live by four watchers.
    #[arg(long, default_value_t = 3)]
    tree_waves: usize,
    /// Tree: how long each fan-out child's scripted agent waits before it answers.
    #[arg(long, default_value = "500ms", value_parser = humantime::parse_duration)]
    tree_child_delay: Duration,
    /// Tree: worker processes (scripted agents, pool `default`).
    #[arg(long, default_value_t = 2)]
    tree_workers: usize,
    /// Tree: slots per worker process.
    #[arg(long, default_value_t = 64)]
    tree_concurrency: usize,
}

/// The section's prefix (its own streams, apart from the other sections').
const PREFIX: &str = "flbtree";
/// The pool of the bench's in-process worker (the Rust agents).
const POOL: &str = "tree";
/// Slots of the in-process worker: a nested chain holds one per level while it waits.
const IN_PROCESS_SLOTS: usize = 32;
/// Child calls per `spawner` run (the chains alternate with the parents).
const CALLS_PER_PARENT: usize = 10;
/// How long one wave (a fan-out parent, its children, its watchers) may take.
const WAVE_TIMEOUT: Duration = Duration::from_secs(120);
/// The server-side watches' lease; renewed every [`RENEW_EVERY`].
const LEASE_MS: u64 = 5_000;
const RENEW_EVERY: Duration = Duration::from_secs(1);

fn unix_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

fn micros(t: &Timestamp) -> i64 {
    (t.0.unix_timestamp_nanos() / 1000) as i64
}

/// p50, p99 and max of unsorted samples.
fn summary(samples: &mut [f64]) -> (f64, f64, f64) {
    samples.sort_by(f64::total_cmp);
    (
        percentile(samples, 0.5),
        percentile(samples, 0.99),
        samples.last().copied().unwrap_or(f64::NAN),
    )
}

// ---------------------------------------------------------------------------------------
// The bench's deterministic Rust agents (no model).

/// One child call an agent of the bench made, timed by the bench's clock (Unix µs).
#[derive(Debug, Clone, Copy)]
struct TimedCall {
    child: RunId,
    /// Just before `start_child`.
    called: i64,
    /// `start_child` returned (the marker stored, `child.start` answered).
    started: i64,
    /// The child's outcome in the agent's hands.
    answered: i64,
}

type CallLog = Arc<Mutex<Vec<TimedCall>>>;

/// `AgentContext::call_agent`, step by step (start the child, announce it, wait for its
/// outcome or the attempt's cancellation), noting the time of each step in `log`.
async fn timed_call(
    ctx: &AgentContext,
    call: &ChildCall,
    log: &CallLog,
) -> Result<flotilla_model::run::RunOutcome, AgentError> {
    let clients = ctx.clients();
    let called = unix_micros();
    let child = clients
        .start_child(call)
        .await
        .map_err(|e| AgentError::failed(e.to_string()))?;
    let started = unix_micros();
    clients.announce_child(&child.handle, &call.agent).await;
    let until = tokio::time::Instant::from_std(ctx.deadline);
    let outcome = tokio::select! {
        o = clients.wait_child(child.handle.run_id, until) => {
            o.map_err(|e| AgentError::failed(e.to_string()))?
        }
        () = ctx.cancel.cancelled() => return Err(AgentError::cancelled("cancelled while a child ran")),
    };
    let answered = unix_micros();
    if outcome.status != RunStatus::Succeeded {
        return Err(AgentError::failed(format!(
            "child {} ended {}",
            child.handle.run_id,
            outcome.status.as_str()
        )));
    }
    if let Ok(mut log) = log.lock() {
        log.push(TimedCall {
            child: child.handle.run_id,
            called,
            started,
            answered,
        });
    }
    Ok(outcome)
}

/// Calls `noop` as a child run `{"calls": k}` times, one at a time.
#[derive(Debug)]
struct Spawner {
    log: CallLog,
}

impl Agent for Spawner {
    fn run<'a>(
        &'a self,
        task: &'a TaskEnvelope,
        ctx: AgentContext,
    ) -> BoxFuture<'a, Result<AgentReply, AgentError>> {
        Box::pin(async move {
            let calls = task.input["calls"].as_u64().unwrap_or(1);
            for i in 0..calls {
                let call = ChildCall {
                    agent: "noop".into(),
                    description: "no-op".into(),
                    call_id: Some(format!("spawn{i}")),
                    ..ChildCall::default()
                };
                timed_call(&ctx, &call, &self.log).await?;
            }
            Ok(AgentReply::text(format!("{calls} children")))
        })
    }
}

/// With input `{"depth": d}`: calls itself with d − 1 as a child run (pool `tree`) and
/// answers with the child's answer; at 0 it answers at once.
#[derive(Debug)]
struct Nest {
    log: CallLog,
}

impl Agent for Nest {
    fn run<'a>(
        &'a self,
        task: &'a TaskEnvelope,
        ctx: AgentContext,
    ) -> BoxFuture<'a, Result<AgentReply, AgentError>> {
        Box::pin(async move {
            let depth = task.input["depth"].as_u64().unwrap_or(0);
            if depth == 0 {
                return Ok(AgentReply::text("leaf"));
            }
            let call = ChildCall {
                agent: "nest".into(),
                description: format!("depth {}", depth - 1),
                input: json!({"depth": depth - 1}),
                pool: Some(POOL.into()),
                call_id: Some("down".into()),
                ..ChildCall::default()
            };
            let outcome = timed_call(&ctx, &call, &self.log).await?;
            let answer = outcome.final_result.map(|r| r.response).unwrap_or_default();
            Ok(AgentReply::text(answer))
        })
    }
}

/// Waits for the bench's go (its run among the released ones), then starts
/// `{"children": n}` children of `pause` at once and waits for them all.
#[derive(Debug)]
struct Fanout {
    go: watch::Receiver<HashSet<RunId>>,
}

impl Agent for Fanout {
    fn run<'a>(
        &'a self,
        task: &'a TaskEnvelope,
        ctx: AgentContext,
    ) -> BoxFuture<'a, Result<AgentReply, AgentError>> {
        Box::pin(async move {
            let n = task.input["children"].as_u64().unwrap_or(1);
            let mut go = self.go.clone();
            tokio::select! {
                r = go.wait_for(|released| released.contains(&task.run_id)) => {
                    r.map_err(|_| AgentError::failed("the bench stopped before the go"))?;
                }
                () = ctx.cancel.cancelled() => return Err(AgentError::cancelled("cancelled before the go")),
            }
            let calls: Vec<ChildCall> = (0..n)
                .map(|i| ChildCall {
                    agent: "pause".into(),
                    description: "pause".into(),
                    call_id: Some(format!("c{i}")),
                    ..ChildCall::default()
                })
                .collect();
            let results = futures::future::join_all(calls.iter().map(|c| ctx.call_agent(c))).await;
            let mut problems = Vec::new();
            for r in results {
                match r {
                    Ok((_, o)) if o.status == RunStatus::Succeeded => {}
                    Ok((child, o)) => problems.push(format!(
                        "child {} ended {}",
                        child.handle.run_id,
                        o.status.as_str()
                    )),
                    Err(e) => problems.push(e.to_string()),
                }
            }
            if let Some(first) = problems.first() {
                return Err(AgentError::failed(format!(
                    "{} of {n} children did not succeed; first: {first}",
                    problems.len()
                )));
            }
            Ok(AgentReply::text(format!("{n} children")))
        })
    }
}

/// The bench's in-process worker (pool `tree`); stopped by [`InProcessWorker::stop`] or on
/// drop.
struct InProcessWorker {
    shutdown: CancellationToken,
    handle: Option<tokio::task::JoinHandle<()>>,
}

impl InProcessWorker {
    async fn start(
        opts: &NatsOptions,
        spawns: CallLog,
        nests: CallLog,
        go: watch::Receiver<HashSet<RunId>>,
    ) -> anyhow::Result<Self> {
        let bus = Bus::connect(opts, "flotilla-bench-tree-worker").await?;
        let mut registry = AgentRegistry::default();
        registry.insert(
            "noop",
            Arc::new(ScriptedAgent::new(ScriptedConfig {
                reply: "ok".into(),
                ..ScriptedConfig::default()
            })),
        );
        registry.insert("spawner", Arc::new(Spawner { log: spawns }));
        registry.insert("nest", Arc::new(Nest { log: nests }));
        registry.insert("fanout", Arc::new(Fanout { go }));
        registry.set_default(Some("noop".into()));
        let worker_opts = WorkerOptions {
            pool: POOL.into(),
            concurrency: IN_PROCESS_SLOTS,
            shutdown_grace: Duration::from_secs(1),
            ..WorkerOptions::default()
        };
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let worker = Worker::new(bus, worker_opts, registry).on_ready(ready_tx);
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        let handle = tokio::spawn(async move {
            if let Err(e) = worker.run(token).await {
                errln!("flotilla bench: the in-process worker stopped: {e}");
            }
        });
        let this = Self {
            shutdown,
            handle: Some(handle),
        };
        tokio::time::timeout(Duration::from_secs(30), ready_rx)
            .await
            .context("the in-process worker was not ready within 30 s")?
            .context("the in-process worker stopped while starting")?;
        Ok(this)
    }

    async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(h) = self.handle.take() {
            let _ = tokio::time::timeout(Duration::from_secs(10), h).await;
        }
    }
}

impl Drop for InProcessWorker {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

// ---------------------------------------------------------------------------------------
// Services and plans.

/// The tree bounds the bench's coordinator runs with: deep and wide enough for the trees
/// it is asked to build (the deployment defaults, 8 deep and 100 runs, would refuse the
/// default depth-10 chain and a parent with 100 children).
#[derive(Debug, Clone, Copy)]
struct TreeBounds {
    max_depth: usize,
    max_runs: usize,
}

impl TreeBounds {
    /// The `[coordinator]` section, written only when the trees need more than the
    /// defaults (so a build from before the bounds existed can serve the default sizes).
    fn section(self) -> String {
        let defaults = Self::defaults();
        if self.max_depth <= defaults.max_depth && self.max_runs <= defaults.max_runs {
            return String::new();
        }
        format!(
            "\n# Sized for the bench's trees: a nested chain --tree-depth deep, a parent with\n# --tree-children children.\n[coordinator]\nmax-depth = {}\nmax-runs-per-tree = {}\n",
            self.max_depth, self.max_runs
        )
    }

    /// The deployment's defaults (`[coordinator]` `max-depth`, `max-runs-per-tree`).
    fn defaults() -> Self {
        let opts = flotilla_coordinator::CoordinatorOptions::default();
        Self {
            max_depth: opts.max_depth as usize,
            max_runs: opts.max_runs_per_tree as usize,
        }
    }

    fn for_args(args: &TreeArgs) -> Self {
        let defaults = Self::defaults();
        Self {
            // The chain's root sits at depth 0; its deepest child at --tree-depth.
            max_depth: args.tree_depth.max(defaults.max_depth),
            // A fan-out parent with its children.
            max_runs: (args.tree_children + 1).max(defaults.max_runs),
        }
    }
}

fn tree_config(
    dir: &Path,
    url: &str,
    concurrency: usize,
    child_delay: Duration,
    listener_off: bool,
    bounds: TreeBounds,
) -> anyhow::Result<PathBuf> {
    let path = dir.join("bench-tree.toml");
    let telemetry = if listener_off {
        "\n[telemetry]\nhttp-addr = \"off\"\n"
    } else {
        ""
    };
    std::fs::write(
        &path,
        format!(
            r#"# Generated by `flotilla bench --only tree`: scripted agents (no model calls).
pools = ["default", "{POOL}"]
default-agent = "noop"

[nats]
urls = ["{url}"]
prefix = "{PREFIX}"
{bounds}
[agents.noop]
kind = "scripted"
reply = "ok"

[agents.pause]
kind = "scripted"
reply = "paused"
delay = "{delay}ms"

# Named for validation only: the bench's in-process worker (pool "{POOL}") runs these as
# deterministic Rust agents that start child runs.
[agents.spawner]
kind = "scripted"
reply = "unused"

[agents.nest]
kind = "scripted"
reply = "unused"

[agents.fanout]
kind = "scripted"
reply = "unused"

[worker]
concurrency = {concurrency}
{telemetry}"#,
            delay = child_delay.as_millis(),
            bounds = bounds.section(),
        ),
    )
    .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// A one-task plan of `agent` on the in-process worker's pool.
fn agent_plan(agent: &str, input: serde_json::Value) -> Plan {
    let mut t = Subtask::new(agent, agent).with_agent(agent);
    t.pool = POOL.into();
    t.input = input;
    // A failure shows as one, not as a retry that starts another set of children.
    Plan {
        fork: None,
        name: Some(format!("bench-tree-{agent}")),
        query: None,
        subtasks: vec![t],
        config: PlanConfig {
            max_retries: 0,
            ..PlanConfig::default()
        },
    }
}

/// A run's log read with batch direct gets (no consumer): (stored at, Unix µs, server clock;
/// the entry), oldest first.
async fn run_log(bus: &Bus, run: RunId) -> anyhow::Result<Vec<(i64, RunLogEntry)>> {
    let filter = bus.names().runlog(run);
    let mut out = Vec::new();
    let mut pages = bus.pages(StreamKind::RunLog, &filter, 0);
    while let Some(page) = pages.next().await? {
        for m in &page {
            let entry: RunLogEntry = wire::decode(Some(&m.headers), &m.payload)
                .with_context(|| format!("decoding run-log entry {} of run {run}", m.seq))?;
            out.push((stored_micros(&m.headers)?, entry));
        }
    }
    Ok(out)
}

/// The server time a message was stored (its `Nats-Time-Stamp`, Unix µs).
fn stored_micros(headers: &async_nats::HeaderMap) -> anyhow::Result<i64> {
    let stamp = headers
        .get("Nats-Time-Stamp")
        .map(|v| v.as_str().to_owned())
        .context("a stored message has no Nats-Time-Stamp")?;
    let at: Timestamp = serde_json::from_value(serde_json::Value::String(stamp))?;
    Ok(micros(&at))
}

/// Per task of a finished run: (its result stored, server clock; its agent started, the
/// worker's clock), Unix µs.
async fn task_times(bus: &Bus, run: RunId) -> anyhow::Result<HashMap<String, (i64, i64)>> {
    let mut out = HashMap::new();
    for (stored, entry) in run_log(bus, run).await? {
        if let RunInput::TaskResult(r) = entry.input
            && let Some(s) = &r.started_at
        {
            out.insert(r.task_id.to_string(), (stored, micros(s)));
        }
    }
    Ok(out)
}

/// (result stored, agent started) of a child run's one task.
async fn child_task_times(bus: &Bus, child: RunId) -> anyhow::Result<(i64, i64)> {
    task_times(bus, child)
        .await?
        .into_values()
        .next()
        .with_context(|| format!("child run {child} has no task result"))
}

/// The hops of a finished `chain_plan(n)` run (ms): `s<i−1>`'s result stored → `s<i>`'s
/// agent started, as [`chain_hops`](crate::harness::plans::chain_hops) reads them.
async fn chain_hop_times(bus: &Bus, run: RunId, n: usize) -> anyhow::Result<Vec<f64>> {
    let times = task_times(bus, run).await?;
    (1..n)
        .map(|i| {
            let prev = times.get(&format!("s{}", i - 1));
            let next = times.get(&format!("s{i}"));
            match (prev, next) {
                (Some((stored, _)), Some((_, started))) => Ok((started - stored) as f64 / 1000.0),
                _ => anyhow::bail!("chain {run} lacks the times of s{i}"),
            }
        })
        .collect()
}

/// Submits `req` with `reply_to = inbox` and waits for its outcome (one run in flight):
/// the run and ms from the submission to the outcome. Anything but success is an error.
async fn run_to_end(
    bus: &Bus,
    inbox: &str,
    ends: &mut mpsc::UnboundedReceiver<RunOutcome>,
    mut req: SubmitRequest,
    via: SubmitVia,
    timeout: Duration,
    what: &str,
) -> anyhow::Result<(RunId, f64)> {
    req.reply_to = Some(inbox.to_owned());
    let t0 = Instant::now();
    let run = submit_via(bus, req, via).await?;
    let outcome = tokio::time::timeout(timeout, ends.recv())
        .await
        .with_context(|| format!("{what} {run} did not finish within {timeout:?}"))?
        .context("outcome subscription ended")?;
    let elapsed = ms(t0.elapsed());
    anyhow::ensure!(
        outcome.run_id == run,
        "{what}: an outcome of run {} arrived while waiting for {run}",
        outcome.run_id
    );
    if outcome.status != RunStatus::Succeeded {
        let why = outcome
            .failed
            .first()
            .map(|f| format!("task {}: {}", f.task_id, f.error.message))
            .unwrap_or_default();
        anyhow::bail!("{what} {run} ended {}: {why}", outcome.status);
    }
    Ok((run, elapsed))
}

/// The consumer limit nats-server (2.15 and later) gives a stream without one of its own.
const SERVER_CONSUMER_LIMIT: usize = 1000;

/// Consumers on the events stream: each live projection holds one (waits hold none). The
/// bench checks that `need` more fit the stream's limit before each step that creates them,
/// so what it measures is latency, not that limit.
struct Pacer {
    bus: Bus,
    peak: usize,
    waited: Duration,
    limit: usize,
}

impl Pacer {
    async fn count(&mut self) -> anyhow::Result<usize> {
        let info = self
            .bus
            .js()
            .get_stream(self.bus.names().stream(StreamKind::Events))
            .await?
            .info()
            .await?
            .clone();
        self.limit = usize::try_from(info.config.max_consumers)
            .ok()
            .filter(|&l| l > 0)
            .unwrap_or(SERVER_CONSUMER_LIMIT);
        let n = info.state.consumer_count;
        self.peak = self.peak.max(n);
        Ok(n)
    }

    async fn room_for(&mut self, need: usize) -> anyhow::Result<()> {
        let t0 = Instant::now();
        while self.count().await? + need > self.limit {
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(90),
                "the events stream's consumers did not fall below {} within 90 s",
                self.limit.saturating_sub(need)
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        self.waited += t0.elapsed();
        Ok(())
    }
}

/// Waits until `n` workers are in the registry (the section's prefix is its own, so all of
/// them are this section's).
async fn wait_for_workers(bus: &Bus, n: usize) -> anyhow::Result<()> {
    let client = Client::new(bus.clone());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let live = client.live_workers().await?.len();
        if live >= n {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {live} of {n} workers registered within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------------------
// Watchers (figure 3).

/// What a watcher received: (arrival, Unix µs; the event), and how its watch ended.
#[derive(Default)]
struct Received {
    events: Vec<(i64, ProjectedEvent)>,
    end: String,
}

/// A watcher running in the background; [`Watcher::finish`] waits for its end.
struct Watcher {
    name: &'static str,
    handle: tokio::task::JoinHandle<Received>,
}

impl Watcher {
    /// The client library's projection, opened now (the run may not exist yet).
    async fn library(
        name: &'static str,
        client: &Client,
        run: RunId,
        children: ChildPolicy,
    ) -> anyhow::Result<Self> {
        let stream = client
            .watch(
                run,
                WatchOptions {
                    profile: Profile::Debug,
                    children,
                    ..WatchOptions::default()
                },
            )
            .await?;
        let handle = tokio::spawn(async move {
            futures::pin_mut!(stream);
            let mut got = Received::default();
            let deadline = tokio::time::Instant::now() + WAVE_TIMEOUT;
            got.end = loop {
                match tokio::time::timeout_at(deadline, stream.next()).await {
                    Err(_) => break "timed out".into(),
                    Ok(None) => break "ended".into(),
                    Ok(Some(Err(e))) => break format!("error: {e}"),
                    Ok(Some(Ok(ev))) => got.events.push((unix_micros(), ev)),
                }
            };
            got
        });
        Ok(Self { name, handle })
    }

    /// `api.watch` delivering to an inbox, its lease renewed every second. The run must have
    /// been submitted (the endpoint answers `not_found` until its first message is stored).
    async fn server(
        name: &'static str,
        bus: &Bus,
        run: RunId,
        children: ChildPolicy,
    ) -> anyhow::Result<Self> {
        let client = bus.client().clone();
        let inbox = client.new_inbox();
        let mut sub = client.subscribe(inbox.clone()).await?;
        let request = WatchRequest {
            protocol: flotilla_model::PROTOCOL_VERSION,
            run_id: run,
            profile: Profile::Debug,
            children,
            since: 0,
            since_index: None,
            deliver_subject: inbox,
            lease_ms: LEASE_MS,
        };
        let body = Bytes::from(serde_json::to_vec(&request)?);
        let subject = bus.names().api("watch");
        let answer = tokio::time::timeout(Duration::from_secs(10), client.request(subject, body))
            .await
            .context("api.watch did not answer in 10 s")??;
        let refused = answer
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Service-Error-Code"))
            .map(|v| v.to_string());
        if let Some(code) = refused {
            anyhow::bail!(
                "api.watch refused the watch ({code}): {}",
                String::from_utf8_lossy(&answer.payload)
            );
        }
        let reply: WatchReply = serde_json::from_slice(&answer.payload).with_context(|| {
            format!(
                "api.watch answered {}",
                String::from_utf8_lossy(&answer.payload)
            )
        })?;
        let handle = tokio::spawn(async move {
            let mut got = Received::default();
            let deadline = tokio::time::Instant::now() + WAVE_TIMEOUT;
            let mut renew = tokio::time::interval(RENEW_EVERY);
            renew.tick().await;
            got.end = loop {
                tokio::select! {
                    m = sub.next() => {
                        let Some(m) = m else { break "the subscription ended".into() };
                        let at = unix_micros();
                        if let Ok(end) = serde_json::from_slice::<WatchEnd>(&m.payload) {
                            break match end.message {
                                Some(msg) => format!("{}: {msg}", end.end),
                                None => end.end,
                            };
                        }
                        match serde_json::from_slice::<ProjectedEvent>(&m.payload) {
                            Ok(ev) => got.events.push((at, ev)),
                            Err(e) => break format!("undecodable message: {e}"),
                        }
                    }
                    _ = renew.tick() => {
                        let _ = client.publish(reply.renew_subject.clone(), Bytes::new()).await;
                    }
                    () = tokio::time::sleep_until(deadline) => break "timed out".into(),
                }
            };
            got
        });
        Ok(Self { name, handle })
    }

    async fn finish(self) -> (&'static str, Received) {
        let got = self.handle.await.unwrap_or_else(|e| Received {
            events: Vec::new(),
            end: format!("the watcher task failed: {e}"),
        });
        (self.name, got)
    }
}

/// Opens `api.watch`, retrying while the run is not found yet (a submission through the
/// intake stream exists only once a coordinator has started the run).
async fn server_watcher(
    name: &'static str,
    bus: &Bus,
    run: RunId,
    children: ChildPolicy,
) -> anyhow::Result<Watcher> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match Watcher::server(name, bus, run, children).await {
            Ok(w) => return Ok(w),
            Err(e) if e.to_string().contains("not_found") && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// One run's stored events: (message sequence, stored at (Unix µs, server clock), event ids,
/// whether one of them ends the run, children it announces).
struct StoredRun {
    messages: Vec<(u64, i64)>,
    event_ids: HashSet<String>,
    ended: bool,
    children: Vec<RunId>,
}

async fn stored_run(bus: &Bus, run: RunId) -> anyhow::Result<StoredRun> {
    let filter = bus.names().event(run);
    let mut out = StoredRun {
        messages: Vec::new(),
        event_ids: HashSet::new(),
        ended: false,
        children: Vec::new(),
    };
    let mut pages = bus.pages(StreamKind::Events, &filter, 0);
    while let Some(page) = pages.next().await? {
        for m in &page {
            out.messages.push((m.seq, stored_micros(&m.headers)?));
            let events = decode_events(wire::codec_of(Some(&m.headers)), &m.payload)
                .with_context(|| format!("decoding event message {} of run {run}", m.seq))?;
            for e in events {
                match &e.event {
                    Event::Workflow(w) if w.phase.ends_run() => out.ended = true,
                    Event::AgentRunStarted { child, .. } => out.children.push(child.run_id),
                    _ => {}
                }
                out.event_ids.insert(e.id);
            }
        }
    }
    out.children.sort();
    out.children.dedup();
    Ok(out)
}

/// The lags of one watcher over all waves.
#[derive(Default)]
struct Lags {
    /// ms, every event stored after the watchers were live.
    all: Vec<f64>,
    /// ms, the watched run's own events among them.
    own: Vec<f64>,
    delivered: usize,
    expected: usize,
    /// Events delivered twice (same run and event id).
    doubled: usize,
    /// Delivered events stored before the watchers were live (not in the lag).
    before_live: usize,
    /// Delivered events whose message was not found among the tree's.
    unknown: usize,
    /// How each wave's watch ended.
    ends: BTreeMap<String, usize>,
}

// ---------------------------------------------------------------------------------------
// The section.

/// Runs the section. `raw` is the raw JetStream round trip of the same run.
pub(crate) async fn run(
    args: &TreeArgs,
    services: &Services,
    url: &str,
    raw: Option<&RawFigures>,
) -> anyhow::Result<()> {
    let mut opts = NatsOptions::with_url(url);
    opts.prefix = PREFIX.into();
    let bus = Bus::connect(&opts, "flotilla-bench").await?;
    bus.provision(&Default::default()).await?;
    let dir = tempfile::Builder::new()
        .prefix("flotilla-bench-tree-")
        .tempdir()?;
    let config = tree_config(
        dir.path(),
        url,
        args.tree_concurrency.max(1),
        args.tree_child_delay,
        has_listener(&services.exe),
        TreeBounds::for_args(args),
    )?;
    let mut procs = Processes(vec![(
        "coordinator".into(),
        spawn_service(&services.exe, &config, &["coordinator"])?,
    )]);
    for i in 0..args.tree_workers.max(1) {
        procs.0.push((
            format!("worker {i}"),
            spawn_service(&services.exe, &config, &["worker"])?,
        ));
    }
    let (spawns, nests): (CallLog, CallLog) = Default::default();
    let (release, go) = watch::channel(HashSet::new());
    let worker = InProcessWorker::start(&opts, Arc::clone(&spawns), Arc::clone(&nests), go).await?;
    let via = services.via;
    let inbox = format!("_INBOX.flbtree.{}", RunId::new());
    let mut ends = outcomes(&bus, inbox.clone()).await?;
    let mut pacer = Pacer {
        bus: bus.clone(),
        peak: 0,
        waited: Duration::ZERO,
        limit: SERVER_CONSUMER_LIMIT,
    };
    let minute = Duration::from_secs(60);
    let take = |log: &CallLog| -> Vec<TimedCall> {
        log.lock()
            .map(|mut l| std::mem::take(&mut *l))
            .unwrap_or_default()
    };

    // Warm up: a chain on the worker processes and a parent with two children prove every
    // process is ready; then every worker is in the registry.
    for (plan, what) in [
        (chain_plan(2), "a warm-up chain"),
        (
            agent_plan("spawner", json!({"calls": 2})),
            "a warm-up spawner",
        ),
    ] {
        let req = SubmitRequest::new(plan);
        run_to_end(&bus, &inbox, &mut ends, req, via, minute, what).await?;
    }
    wait_for_workers(&bus, args.tree_workers.max(1) + 1).await?;
    take(&spawns);

    outln!(
        "== run trees (coordinator + {} worker process(es) × {} slots, scripted agents; the agents that start children are deterministic Rust agents of the bench, run by an in-process worker, pool `{POOL}`)",
        args.tree_workers.max(1),
        args.tree_concurrency.max(1)
    );

    // Figure 1: child spawn → child started, alternating with 2-task chains.
    let (mut spawn, mut start_call, mut after_start, mut hops) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // `start_child` of a parent's first call and of its later ones (`child.start` reads the
    // parent run's facts once per run and coordinator).
    let (mut first_call, mut later_calls) = (Vec::new(), Vec::new());
    let mut left = args.tree_spawns.max(1);
    while left > 0 {
        let k = left.min(CALLS_PER_PARENT);
        pacer.room_for(k + 10).await?;
        let req = SubmitRequest::new(agent_plan("spawner", json!({"calls": k})));
        run_to_end(&bus, &inbox, &mut ends, req, via, minute, "a spawner run").await?;
        let calls = take(&spawns);
        anyhow::ensure!(
            calls.len() == k,
            "the spawner noted {} calls of {k}",
            calls.len()
        );
        for (i, c) in calls.into_iter().enumerate() {
            let (_, started) = child_task_times(&bus, c.child).await?;
            spawn.push((started - c.called) as f64 / 1000.0);
            let call = (c.started - c.called) as f64 / 1000.0;
            start_call.push(call);
            if i == 0 {
                first_call.push(call);
            } else {
                later_calls.push(call);
            }
            after_start.push((started - c.started) as f64 / 1000.0);
        }
        for _ in 0..k {
            let req = SubmitRequest::new(chain_plan(2));
            let (run, _) = run_to_end(&bus, &inbox, &mut ends, req, via, minute, "a chain").await?;
            hops.extend(chain_hop_times(&bus, run, 2).await?);
        }
        left -= k;
    }
    let (s50, s99, _) = summary(&mut spawn);
    let (sc50, sc99, _) = summary(&mut start_call);
    let (sa50, sa99, _) = summary(&mut after_start);
    let (f50, _, _) = summary(&mut first_call);
    let (o50, _, _) = summary(&mut later_calls);
    let (h50, h99, _) = summary(&mut hops);
    outln!(
        "   child spawn → child's task started (one call at a time): p50 {s50:.3} ms   p99 {s99:.3} ms   ({} children)",
        spawn.len()
    );
    outln!(
        "     of which start_child (marker stored, child.start answered): p50 {sc50:.3} ms   p99 {sc99:.3} ms   (a parent's first call p50 {f50:.3} ms, its later calls {o50:.3} ms)"
    );
    outln!(
        "     and start_child returned → child's task started:           p50 {sa50:.3} ms   p99 {sa99:.3} ms"
    );
    outln!(
        "   dependency hop (2-task chains, result stored → dependent started): p50 {h50:.3} ms   p99 {h99:.3} ms   ({} hops)",
        hops.len()
    );
    if let Some(raw) = raw {
        outln!(
            "   raw JetStream round trip (this run, 1 in flight):              p50 {:.3} ms   p99 {:.3} ms",
            raw.p50_ms,
            raw.p99_ms
        );
    }
    out!(
        "   spawn / dependency hop: {:.2}× / {:.2}× (p50 / p99)",
        s50 / h50,
        s99 / h99
    );
    if let Some(raw) = raw {
        out!(
            "   spawn / raw: {:.2}× / {:.2}×   hop / raw: {:.2}× / {:.2}×",
            s50 / raw.p50_ms,
            s99 / raw.p99_ms,
            h50 / raw.p50_ms,
            h99 / raw.p99_ms
        );
    }
    outln!();

    // Figure 2: depth-N nested agent-as-tool vs N dependency hops.
    let depth = args.tree_depth.max(1);
    let mut local_chain = chain_plan(depth + 1);
    for t in &mut local_chain.subtasks {
        t.pool = POOL.into();
    }
    let (mut nested, mut chain_local, mut chain_procs) = (Vec::new(), Vec::new(), Vec::new());
    let (mut down, mut up, mut local_hops) = (Vec::new(), Vec::new(), Vec::new());
    let (mut down_call, mut down_after) = (Vec::new(), Vec::new());
    for _ in 0..args.tree_nested_runs.max(1) {
        pacer.room_for(depth + 10).await?;
        let req = SubmitRequest::new(agent_plan("nest", json!({"depth": depth})));
        let (_, t) = run_to_end(&bus, &inbox, &mut ends, req, via, minute, "a nested run").await?;
        nested.push(t);
        let levels = take(&nests);
        anyhow::ensure!(
            levels.len() == depth,
            "the nested run noted {} calls of {depth}",
            levels.len()
        );
        for c in levels {
            let (stored, started) = child_task_times(&bus, c.child).await?;
            down.push((started - c.called) as f64 / 1000.0);
            down_call.push((c.started - c.called) as f64 / 1000.0);
            down_after.push((started - c.started) as f64 / 1000.0);
            up.push((c.answered - stored) as f64 / 1000.0);
        }
        let req = SubmitRequest::new(local_chain.clone());
        let what = "a chain (in-process worker)";
        let (run, t) = run_to_end(&bus, &inbox, &mut ends, req, via, minute, what).await?;
        chain_local.push(t);
        local_hops.extend(chain_hop_times(&bus, run, depth + 1).await?);
        let req = SubmitRequest::new(chain_plan(depth + 1));
        let what = "a chain (worker processes)";
        let (_, t) = run_to_end(&bus, &inbox, &mut ends, req, via, minute, what).await?;
        chain_procs.push(t);
    }
    let (n50, n99, _) = summary(&mut nested);
    let (c50, c99, _) = summary(&mut chain_local);
    let (p50, p99, _) = summary(&mut chain_procs);
    let (d50, d99, _) = summary(&mut down);
    let (u50, u99, _) = summary(&mut up);
    let (dc50, _, _) = summary(&mut down_call);
    let (da50, _, _) = summary(&mut down_after);
    let (l50, l99, _) = summary(&mut local_hops);
    outln!(
        "   depth-{depth} nested agent-as-tool, submit → root outcome ({} runs of one task, in-process worker): p50 {n50:.3} ms   p99 {n99:.3} ms   ({} repetitions)",
        depth + 1,
        nested.len()
    );
    outln!(
        "   {}-task chain ({depth} dependency hops), same in-process worker:        p50 {c50:.3} ms   p99 {c99:.3} ms   → nested / chain {:.2}× / {:.2}×",
        depth + 1,
        n50 / c50,
        n99 / c99
    );
    outln!(
        "   {}-task chain ({depth} dependency hops), worker processes:              p50 {p50:.3} ms   p99 {p99:.3} ms",
        depth + 1
    );
    outln!(
        "   per nesting level, (nested − chain) / {depth}: p50 {:.3} ms   p99 {:.3} ms — what a level costs beyond a dependency hop",
        (n50 - c50) / depth as f64,
        (n99 - c99) / depth as f64
    );
    outln!(
        "     per level, down (call → child's task started):                 p50 {d50:.3} ms   p99 {d99:.3} ms   ({} levels; start_child p50 {dc50:.3} ms, then {da50:.3} ms to the start)",
        down.len()
    );
    outln!(
        "     per level, up (child's result stored → the caller has its outcome): p50 {u50:.3} ms   p99 {u99:.3} ms"
    );
    outln!(
        "     a dependency hop of the in-process chain:                       p50 {l50:.3} ms   p99 {l99:.3} ms   → down + up − hop = {:.3} ms (p50)",
        d50 + u50 - l50
    );

    // Figure 3: delivery lag of projected streams, many concurrent children.
    let watch_bus = Bus::connect(&opts, "flotilla-bench-watcher").await?;
    let watch_client = Client::new(watch_bus.clone());
    let children = args.tree_children.max(1);
    let names = [
        "flatten, client library (Client::watch)",
        "flatten, server (api.watch → inbox)",
        "linked, client library (the parent's own events)",
        "linked, server (the parent's own events)",
    ];
    let mut lags: BTreeMap<&'static str, Lags> = BTreeMap::new();
    let (mut started_children, mut ended_children) = (0, 0);
    let mut wave_times = Vec::new();
    // Per child: the go → its task started (ms; the worker's clock, same host).
    let mut child_starts = Vec::new();
    for _ in 0..args.tree_waves.max(1) {
        // The children's waits, and one consumer per projected run for each flatten watcher.
        pacer.room_for(3 * children + 20).await?;
        let run = RunId::new();
        let mut req = SubmitRequest::new(agent_plan("fanout", json!({"children": children})));
        req.run_id = Some(run);
        req.reply_to = Some(inbox.clone());
        // Watches are opened once the run is submitted (a watch of a run that does not
        // exist is `not_found`) and before it is released: each replays from the start.
        submit_via(&bus, req, via).await?;
        let mut watchers = vec![
            Watcher::library(names[0], &watch_client, run, ChildPolicy::Flatten).await?,
            Watcher::library(names[2], &watch_client, run, ChildPolicy::Linked).await?,
        ];
        watchers.push(server_watcher(names[1], &watch_bus, run, ChildPolicy::Flatten).await?);
        watchers.push(server_watcher(names[3], &watch_bus, run, ChildPolicy::Linked).await?);
        let live = unix_micros();
        let t0 = Instant::now();
        release.send_modify(|released| {
            released.insert(run);
        });
        let outcome = tokio::time::timeout(WAVE_TIMEOUT, ends.recv())
            .await
            .with_context(|| {
                format!("the fan-out parent {run} did not end within {WAVE_TIMEOUT:?}")
            })?
            .context("outcome subscription ended")?;
        wave_times.push(t0.elapsed().as_secs_f64());
        if outcome.status != RunStatus::Succeeded {
            let why = outcome
                .failed
                .first()
                .map(|f| format!("task {}: {}", f.task_id, f.error.message))
                .unwrap_or_default();
            anyhow::bail!("the fan-out parent {run} ended {}: {why}", outcome.status);
        }
        let mut received = Vec::new();
        for w in watchers {
            received.push(w.finish().await);
        }

        // The tree as stored: every message's server time, every event.
        let parent = stored_run(&bus, run).await?;
        let mut stored_at: HashMap<u64, i64> = parent.messages.iter().copied().collect();
        let mut tree_events = parent.event_ids.len();
        started_children += parent.children.len();
        for child in &parent.children {
            let c = stored_run(&bus, *child).await?;
            stored_at.extend(c.messages.iter().copied());
            tree_events += c.event_ids.len();
            if c.ended {
                ended_children += 1;
            }
            let (_, started) = child_task_times(&bus, *child).await?;
            child_starts.push((started - live) as f64 / 1000.0);
        }
        for (name, got) in received {
            let l = lags.entry(name).or_default();
            let flatten = name.starts_with("flatten");
            l.expected += if flatten {
                tree_events
            } else {
                parent.event_ids.len()
            };
            l.delivered += got.events.len();
            *l.ends.entry(got.end).or_default() += 1;
            let mut seen = HashSet::new();
            for (at, ev) in &got.events {
                if !seen.insert((ev.run_id, ev.event.id.clone())) {
                    l.doubled += 1;
                }
                let Some(stored) = stored_at.get(&ev.seq) else {
                    l.unknown += 1;
                    continue;
                };
                if *stored < live {
                    l.before_live += 1;
                    continue;
                }
                let lag = (at - stored) as f64 / 1000.0;
                l.all.push(lag);
                if ev.depth == 0 {
                    l.own.push(lag);
                }
            }
        }
    }
    let consumers = pacer.count().await?;
    worker.stop().await;
    drop(procs);

    wave_times.sort_by(f64::total_cmp);
    outln!(
        "   projected-stream delivery lag (event message stored → at the watcher; profile debug), {} waves × {children} concurrent children (scripted, {:?} each, on {} × {} slots); wave go → parent's outcome: median {:.2} s:",
        args.tree_waves.max(1),
        args.tree_child_delay,
        args.tree_workers.max(1),
        args.tree_concurrency.max(1),
        percentile(&wave_times, 0.5)
    );
    let mut p50s = HashMap::new();
    for name in names {
        let Some(l) = lags.get_mut(name) else {
            continue;
        };
        let (a50, a99, amax) = summary(&mut l.all);
        p50s.insert(name, (a50, a99));
        let ends = l
            .ends
            .iter()
            .map(|(e, n)| format!("{e} ×{n}"))
            .collect::<Vec<_>>()
            .join(", ");
        let mut notes = Vec::new();
        if l.doubled > 0 {
            notes.push(format!("{} DOUBLED", l.doubled));
        }
        if l.unknown > 0 {
            notes.push(format!("{} not found among the tree's messages", l.unknown));
        }
        if l.before_live > 0 {
            notes.push(format!(
                "{} stored before the watch was live",
                l.before_live
            ));
        }
        let missing = if l.delivered < l.expected {
            format!(" — {} MISSING", l.expected - l.delivered)
        } else {
            String::new()
        };
        outln!(
            "   {name:<48} p50 {a50:>8.3} ms   p99 {a99:>8.3} ms   max {amax:>8.3} ms   ({} of {} stored events delivered{missing}; end: {ends}{})",
            l.delivered,
            l.expected,
            if notes.is_empty() {
                String::new()
            } else {
                format!("; {}", notes.join(", "))
            }
        );
        if name.starts_with("flatten") {
            let (o50, o99, omax) = summary(&mut l.own);
            outln!(
                "   {:<48} p50 {o50:>8.3} ms   p99 {o99:>8.3} ms   max {omax:>8.3} ms   ({} events)",
                "  — of which the parent's own events",
                l.own.len()
            );
        }
    }
    for (flat, linked, what) in [
        (names[0], names[2], "client library"),
        (names[1], names[3], "server"),
    ] {
        if let (Some(f), Some(b)) = (p50s.get(flat), p50s.get(linked)) {
            outln!(
                "   flatten / linked, {what}: {:.1}× / {:.1}× (p50 / p99)",
                f.0 / b.0,
                f.1 / b.1
            );
        }
    }
    let (g50, g99, gmax) = summary(&mut child_starts);
    outln!(
        "   children: {started_children} announced, {ended_children} ended in their streams; go → a child's task started: p50 {g50:.1} ms   p99 {g99:.1} ms   max {gmax:.1} ms"
    );
    outln!(
        "   consumers on the events stream: {consumers} right after the waves, peak seen {} (limit {}: jetstream.max-consumers); the bench waited {:.1} s in all for room",
        pacer.peak,
        pacer.limit,
        pacer.waited.as_secs_f64()
    );
    Ok(())
}
