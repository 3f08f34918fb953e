//! Humans in the loop: what a person's approval adds to a run, beyond the person's own time,
//! and what waiting approvals cost. Services are a coordinator, a supervisor and one worker
//! process with
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
//! * a pause: runs of a 30-task chain paused once their third task succeeded: `run.pause`
//!   sent → answered (the control appended to the run log; the machine applies it, and
//!   writes the workers' hold, after), and how many tasks were
//!   dispatched after the pause entry's server time (target: none — the one attempt in
//!   flight finishes, nothing new starts: at most one step), then resumed to the end;
//! * then `pending` runs left waiting: the coordinator's and the supervisor's resident memory
//!   before and after, and the server's consumer count (a wait holds none).

use std::time::{Duration, Instant};

use anyhow::Context;
use flotilla_bus::Bus;
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
use crate::harness::services::{Services, section_bus, section_config, spawn_service};
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
    let (_dir, config) = section_config(services, url, PREFIX, "hitl")?;
    let exe = &services.exe;
    let bus = section_bus(url, PREFIX).await?;
    let mut procs = Processes(vec![(
        "coordinator".into(),
        spawn_service(exe, &config, &["coordinator"])?,
    )]);
    let coordinator = procs.0[0].1.id();
    procs
        .0
        .push(("worker".into(), spawn_service(exe, &config, &["worker"])?));
    // The supervisor follows every run's events (the team's records, trust, notices'
    // webhooks): its memory while approvals wait is measured too.
    procs.0.push((
        "supervisor".into(),
        spawn_service(exe, &config, &["supervisor"])?,
    ));
    let supervisor = procs.0[2].1.id();
    let client = Client::new(bus.clone());
    let store = flotilla_client::open_store(&bus).await?;
    // Warm up: one plain run.
    let warm = submit_via(&bus, SubmitRequest::new(chain_plan(1)), services.via).await?;
    client.wait(warm, ASK).await?;
    outln!(
        "== hitl (a coordinator, a supervisor + 1 worker process × {} slots, no-op agent; the bench answers each approval at once)",
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

    // A pause: nothing new is dispatched after it is stored.
    let mut pause_ms = Vec::new();
    let (mut dispatched_after, mut finished_after) = (0usize, 0usize);
    let pauses = args.hitl_samples.clamp(1, 10);
    for _ in 0..pauses {
        let (ms, dispatched, finished) = paused_sample(&bus, &client, &store, services).await?;
        pause_ms.push(ms);
        dispatched_after += dispatched;
        finished_after += finished;
    }
    let (p50, p99) = p50_p99(&mut pause_ms);
    outln!(
        "   pause sent → answered: p50 {p50:.3} ms   p99 {p99:.3} ms; after the pause entry, over {pauses} runs: {dispatched_after} tasks dispatched (target 0), {finished_after} in-flight attempts finished (≤ 1 per run)"
    );

    // Waiting costs nothing: runs left waiting for a person.
    let before = rss_kib(coordinator).unwrap_or(0);
    let supervisor_before = rss_kib(supervisor).unwrap_or(0);
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
    let supervisor_after = rss_kib(supervisor).unwrap_or(0);
    let consumers_after = consumers(&bus).await?;
    outln!(
        "   {} runs waiting for approval (submitted and asked in {:.1} s): coordinator RSS {:.1} → {:.1} MiB, supervisor RSS {:.1} → {:.1} MiB, consumers {consumers_before} → {consumers_after}",
        waiting.len(),
        took.as_secs_f64(),
        before as f64 / 1024.0,
        after as f64 / 1024.0,
        supervisor_before as f64 / 1024.0,
        supervisor_after as f64 / 1024.0
    );
    for run in waiting {
        let _ = client.cancel(run, Some("bench".into())).await;
    }
    drop(procs);
    Ok(())
}

/// A 30-task chain paused once its third task succeeded: how long `run.pause` took to
/// answer, how many tasks were dispatched after the pause entry's server time, and how many
/// results arrived after it; then resumed, it must succeed.
async fn paused_sample(
    bus: &Bus,
    client: &Client,
    store: &flotilla_runs::RunReader,
    services: &Services,
) -> anyhow::Result<(f64, usize, usize)> {
    use flotilla_model::control::{PauseRunRequest, ResumeRunRequest};
    use flotilla_model::run::TaskStatus;
    use flotilla_model::runlog::ControlAction;
    let run = submit_via(bus, SubmitRequest::new(chain_plan(30)), services.via).await?;
    let deadline = Instant::now() + ASK;
    loop {
        let view = client.run(run).await?.context("the run exists")?;
        if view.tasks.get(2).map(|t| t.status) == Some(TaskStatus::Succeeded) {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "run {run} never reached s2");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let sent = Instant::now();
    client
        .call(
            &PauseRunRequest {
                protocol: PROTOCOL_VERSION,
                run_id: run,
                reason: Some("bench".into()),
                by: Some("bench".into()),
                timeout_ms: None,
                children: false,
                task_id: None,
            },
            ASK,
        )
        .await?
        .map_err(|e| anyhow::anyhow!("pause refused: {e:?}"))?;
    let took = sent.elapsed().as_secs_f64() * 1e3;
    // Long enough for a chain step to run several times over, were anything dispatched.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let history = store.history(run).await?;
    let paused_at = history
        .iter()
        .find_map(|(_, ts, e)| match &e.input {
            RunInput::Control(c) if c.action == ControlAction::Pause => Some(nanos(ts)),
            _ => None,
        })
        .context("no pause on the run log")?;
    let finished = history
        .iter()
        .filter(|(_, ts, e)| matches!(e.input, RunInput::TaskResult(_)) && nanos(ts) > paused_at)
        .count();
    let view = client.run(run).await?.context("the run exists")?;
    let dispatched = view
        .tasks
        .iter()
        .filter(|t| {
            t.dispatched_at
                .as_ref()
                .is_some_and(|d| nanos(d) > paused_at)
        })
        .count();
    client
        .call(
            &ResumeRunRequest {
                protocol: PROTOCOL_VERSION,
                run_id: run,
                reason: None,
                by: Some("bench".into()),
                children: false,
                task_id: None,
            },
            ASK,
        )
        .await?
        .map_err(|e| anyhow::anyhow!("resume refused: {e:?}"))?;
    let outcome = client.wait(run, ASK).await?;
    anyhow::ensure!(outcome.status == RunStatus::Succeeded, "{outcome:?}");
    Ok((took, dispatched, finished))
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
        // The coordinator's API may still be subscribing (its runtime took the warm-up run
        // first): "no responders" is asked again until the deadline, like a pending request.
        match client.call(&r, ASK).await {
            Ok(Ok(view)) => {
                if let Some(first) = view.history.first() {
                    return Ok(nanos(&first.at));
                }
            }
            Ok(Err(_)) => {}
            Err(_) if Instant::now() < deadline => {}
            Err(e) => return Err(e.into()),
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
        incident: false,
    };
    client
        .call(&answer, ASK)
        .await?
        .map_err(|e| anyhow::anyhow!("answer refused: {e:?}"))?;
    let outcome = match client.wait(run, ASK).await {
        Ok(o) => o,
        Err(e) => anyhow::bail!("{e}\n{}", what_the_run_did(client, store, run).await),
    };
    anyhow::ensure!(outcome.status == RunStatus::Succeeded, "{outcome:?}");
    let (stored0, started1) = times(store, run).await?;
    Ok((ms_between(stored0, requested), ms_between(sent, started1)))
}

/// What a run that did not end (as far as its events say) did: its run-log inputs, its
/// record's status and the events stored for it — a bench that went wrong says why.
async fn what_the_run_did(client: &Client, store: &flotilla_runs::RunReader, run: RunId) -> String {
    use futures::StreamExt;
    let mut out = String::new();
    match store.history(run).await {
        Ok(h) => {
            for (seq, _, e) in h {
                let kind = serde_json::to_value(&e.input)
                    .ok()
                    .and_then(|v| v.get("type").and_then(|t| t.as_str()).map(str::to_owned))
                    .unwrap_or_default();
                out.push_str(&format!("  run log {seq}: {kind}\n"));
            }
        }
        Err(e) => out.push_str(&format!("  run log unreadable: {e}\n")),
    }
    match store.state(run).await {
        Ok(Some(s)) => out.push_str(&format!(
            "  record: {:?}, applied {}\n",
            s.status, s.applied
        )),
        Ok(None) => out.push_str("  no record\n"),
        Err(e) => out.push_str(&format!("  record unreadable: {e}\n")),
    }
    match client.events(run).await {
        Ok(events) => {
            let mut events = Box::pin(events);
            while let Ok(Some(e)) =
                tokio::time::timeout(Duration::from_secs(2), events.next()).await
            {
                match e {
                    Ok(e) => out.push_str(&format!("  event {}: {:?}\n", e.id, e.event)),
                    Err(e) => out.push_str(&format!("  event unreadable: {e}\n")),
                }
            }
        }
        Err(e) => out.push_str(&format!("  events unreadable: {e}\n")),
    }
    out
}
