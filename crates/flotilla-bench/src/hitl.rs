//! Humans in the loop: what a person's approval adds to a run, beyond the person's own time,
//! and what waiting approvals cost. Services are a coordinator and one worker process with
//! the no-op `scripted` agent (no model) and the default `[hitl]` policy (`publish` is a
//! sensitive action). Each sample is a run of a two-task chain (`s0`, then `s1` after it):
//!
//! * the dependency hop of a chain without approval (`s0`'s result stored → `s1` started),
//!   the baseline;
//! * with `s1`'s action `publish`: `s0`'s result stored → the approval request stored in the
//!   escalations bucket (its first revision's server time);
//! * the answer sent (`approval.answer`, the bench answering at once, as a person's click
//!   would) → `s1` started on the worker (its result's `started_at`; the same host's clock):
//!   the overhead of the approval's path, target ≤ 2× the dependency hop;
//! * then `pending` runs left waiting: the coordinator's resident memory before and after,
//!   and the server's consumer count (a wait holds none).

use std::time::{Duration, Instant};

use anyhow::Context;
use flotilla_bus::{Bus, NatsOptions};
use flotilla_client::Client;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::approval::{ApprovalAnswerRequest, ApprovalGetRequest, Decision};
use flotilla_model::ids::RunId;
use flotilla_model::run::RunStatus;
use flotilla_model::runlog::RunInput;
use flotilla_model::submit::SubmitRequest;
use flotilla_model::time::Timestamp;

use crate::harness::plans::chain_plan;
use crate::harness::processes::{Processes, rss_kib};
use crate::harness::services::{Services, has_listener, noop_config_under, spawn_service};
use crate::harness::stats::p50_p99;
use crate::harness::submit::submit_via;

/// `flotilla bench --only hitl` settings.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct HitlArgs {
    /// Hitl: runs in each latency measurement (without, then with an approval).
    #[arg(long, default_value_t = 30)]
    hitl_samples: usize,
    /// Hitl: runs left waiting for an approval in the memory measurement.
    #[arg(long, default_value_t = 1_000)]
    hitl_pending: usize,
}

const PREFIX: &str = "flhitl";
const ASK: Duration = Duration::from_secs(30);

fn nanos(t: &Timestamp) -> i128 {
    t.0.unix_timestamp_nanos()
}

fn ms_between(from: i128, to: i128) -> f64 {
    (to - from).max(0) as f64 / 1e6
}

pub(crate) async fn run(args: &HitlArgs, services: &Services, url: &str) -> anyhow::Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("flotilla-bench-hitl-")
        .tempdir()?;
    let exe = &services.exe;
    let config = noop_config_under(
        dir.path(),
        url,
        PREFIX,
        services.concurrency,
        has_listener(exe),
    )?;
    let mut opts = NatsOptions::with_url(url);
    opts.prefix = PREFIX.into();
    let bus = Bus::connect(&opts, "flotilla-bench").await?;
    bus.provision(&Default::default()).await?;
    let mut procs = Processes(vec![(
        "coordinator".into(),
        spawn_service(exe, &config, &["coordinator"])?,
    )]);
    let coordinator = procs.0[0].1.id();
    procs
        .0
        .push(("worker".into(), spawn_service(exe, &config, &["worker"])?));
    let client = Client::new(bus.clone());
    let store = flotilla_client::open_store(&bus).await?;
    // Warm up: one plain run.
    let warm = submit_via(&bus, SubmitRequest::new(chain_plan(1)), services.via).await?;
    client.wait(warm, ASK).await?;
    outln!(
        "== hitl (a coordinator + 1 worker process × {} slots, no-op agent; the bench answers each approval at once)",
        services.concurrency
    );
    let mut hops = Vec::new();
    let mut asks = Vec::new();
    let mut overheads = Vec::new();
    for _ in 0..args.hitl_samples.max(1) {
        let run = submit_via(&bus, SubmitRequest::new(chain_plan(2)), services.via).await?;
        client.wait(run, ASK).await?;
        let (stored0, started1) = times(&store, run).await?;
        hops.push(ms_between(stored0, started1));
        let (ask, overhead) = approved_sample(&bus, &client, &store, services).await?;
        asks.push(ask);
        overheads.push(overhead);
    }
    let (h50, h99) = p50_p99(&mut hops);
    let (a50, a99) = p50_p99(&mut asks);
    let (o50, o99) = p50_p99(&mut overheads);
    outln!(
        "   dependency hop (s0 stored → s1 started), no approval: p50 {h50:.3} ms   p99 {h99:.3} ms"
    );
    outln!(
        "   s0 stored → s1's approval request stored:            p50 {a50:.3} ms   p99 {a99:.3} ms"
    );
    outln!(
        "   answer sent → s1 started (the approval's overhead):   p50 {o50:.3} ms   p99 {o99:.3} ms: {:.2}× the dependency hop (target ≤ 2×)",
        o50 / h50.max(f64::EPSILON)
    );

    // Waiting costs nothing: runs left waiting for a person.
    let before = rss_kib(coordinator).unwrap_or(0);
    let consumers_before = consumers(&bus).await?;
    let started = Instant::now();
    let mut waiting = Vec::with_capacity(args.hitl_pending);
    for _ in 0..args.hitl_pending {
        waiting.push(submit_via(&bus, SubmitRequest::new(gated(1)), services.via).await?);
    }
    // Every request stored (the last run's asked last).
    if let Some(last) = waiting.last() {
        wait_requested(&client, *last, "t0a1").await?;
    }
    let took = started.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = rss_kib(coordinator).unwrap_or(0);
    let consumers_after = consumers(&bus).await?;
    outln!(
        "   {} runs waiting for approval (submitted and asked in {:.1} s): coordinator RSS {:.1} → {:.1} MiB, consumers {consumers_before} → {consumers_after}",
        waiting.len(),
        took.as_secs_f64(),
        before as f64 / 1024.0,
        after as f64 / 1024.0
    );
    for run in waiting {
        let _ = client.cancel(run, Some("bench".into())).await;
    }
    drop(procs);
    Ok(())
}

/// A chain of `n` tasks whose last is a sensitive action (`publish`).
fn gated(n: usize) -> flotilla_model::Plan {
    let mut p = chain_plan(n);
    if let Some(last) = p.subtasks.last_mut() {
        last.action = Some("publish".into());
    }
    p
}

async fn consumers(bus: &Bus) -> anyhow::Result<usize> {
    let mut n = 0;
    for kind in flotilla_model::subjects::StreamKind::ALL {
        let mut s = bus.js().get_stream(bus.names().stream(kind)).await?;
        n += s.info().await?.state.consumer_count;
    }
    Ok(n)
}

/// `s0`'s result stored and `s1`'s start, from the run log.
async fn times(store: &flotilla_runs::RunReader, run: RunId) -> anyhow::Result<(i128, i128)> {
    let (mut stored0, mut started1) = (None, None);
    for (_, ts, e) in store.history(run).await? {
        match e.input {
            RunInput::TaskResult(r) if r.task_id.as_str() == "s0" => {
                stored0.get_or_insert(nanos(&ts));
            }
            RunInput::TaskResult(r) if r.task_id.as_str() == "s1" => {
                started1 = r.started_at.as_ref().map(nanos);
            }
            _ => {}
        }
    }
    Ok((
        stored0.context("no result of s0")?,
        started1.context("no start of s1")?,
    ))
}

/// The server time the approval was requested at, once it is.
async fn wait_requested(client: &Client, run: RunId, id: &str) -> anyhow::Result<i128> {
    let deadline = Instant::now() + ASK;
    loop {
        let r = ApprovalGetRequest {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            approval_id: id.into(),
        };
        if let Ok(view) = client.call(&r, ASK).await?
            && let Some(first) = view.history.first()
        {
            return Ok(nanos(&first.at));
        }
        anyhow::ensure!(Instant::now() < deadline, "run {run} never asked");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn approved_sample(
    bus: &Bus,
    client: &Client,
    store: &flotilla_runs::RunReader,
    services: &Services,
) -> anyhow::Result<(f64, f64)> {
    let run = submit_via(bus, SubmitRequest::new(gated(2)), services.via).await?;
    let requested = wait_requested(client, run, "t1a1").await?;
    let sent = nanos(&Timestamp::now());
    let answer = ApprovalAnswerRequest {
        protocol: PROTOCOL_VERSION,
        run_id: run,
        approval_id: "t1a1".into(),
        decision: Decision::Approve,
        by: "bench".into(),
        comment: None,
        digest: None,
        always: false,
    };
    client
        .call(&answer, ASK)
        .await?
        .map_err(|e| anyhow::anyhow!("answer refused: {e:?}"))?;
    let outcome = client.wait(run, ASK).await?;
    anyhow::ensure!(outcome.status == RunStatus::Succeeded, "{outcome:?}");
    let (stored0, started1) = times(store, run).await?;
    Ok((ms_between(stored0, requested), ms_between(sent, started1)))
}
