//! The `team` section: what the supervisor costs and how far behind it is. A coordinator and
//! worker processes with the no-op agent (under their own prefix, so the supervisor has only
//! this section's history to read):
//!
//! * throughput of 1-task runs (512 tasks in flight) without a supervisor, then with a
//!   `flotilla supervisor` process following the events (the ratio is the supervisor's cost
//!   to the runs: both share one nats-server), and the supervisor's CPU per run;
//! * catch-up: from the last run's end to the failure record counting every outcome;
//! * record lag with one run in flight: the run's outcome received → its agent's failure
//!   record updated (a KV watch), next to the raw JetStream round trip;
//! * anycast claim: the dependency hop of a chain whose tasks name a role (claimed from the
//!   role's queue by a free member) next to the hop of the same chain on the pool;
//! * recruit: a `team.recruit` request for a running run → the recruited task's first
//!   attempt claimed by a member of the role (its `claimed` entry on the run log), next to the
//!   pool's dependency hop;
//! * led runs (module [`led`]): `team.assign` → the task started, the dependency hop inside a
//!   led run, and a task's result → the lead woken by its mail, next to the pool's hop;
//! * supervisor memory (module [`memory`]): the lookup a bare query pays over 1,200 stored
//!   runs, next to the raw round trip;
//! * persistent teammates (module [`teammates`]): the supervisor's and workers' memory and
//!   the consumers with `--teammates` idle teammates against none; an idle teammate woken by
//!   a message → its turn started on a worker, next to the raw mailbox hop.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use flotilla_bus::{Bus, NatsOptions};
use flotilla_model::ids::RunId;
use flotilla_model::run::RunStatus;
use flotilla_model::subjects::Bucket;
use flotilla_model::submit::SubmitRequest;
use flotilla_model::team::{FailureRecord, RecordScope, record_key};
use futures::StreamExt;
use tokio::sync::Semaphore;

use crate::harness::plans::{chain_hops, chain_plan, independent_plan};
use crate::harness::processes::{Processes, cpu_seconds, peak_rss_kib};
use crate::harness::raw::RawFigures;
use crate::harness::services::{Services, section_config, spawn_service};
use crate::harness::stats::{ms, p50_p99};
use crate::harness::submit::{outcomes, spawn_submitter, submit_via};

mod led;
mod memory;
mod teammates;

/// Flags of the team section.
#[derive(Debug, clap::Args)]
pub(crate) struct TeamArgs {
    /// Team: 1-task runs in each throughput measurement (without, then with a supervisor).
    #[arg(long, default_value_t = 5_000)]
    team_runs: usize,
    /// Team: samples of the outcome → failure record lag.
    #[arg(long, default_value_t = 200)]
    team_lag_samples: usize,
    /// Team: chains of each kind (pool, anycast) in the claim-latency measurement.
    #[arg(long, default_value_t = 3)]
    team_chains: usize,
    /// Team: recruits in the recruit → first attempt measurement (one run each).
    #[arg(long, default_value_t = 30)]
    team_recruits: usize,
    /// Team: led runs (a 2-task chain each) in the lead's measurement.
    #[arg(long, default_value_t = 30)]
    team_leads: usize,
    /// Team: messages to one idle teammate in the message → turn started measurement.
    #[arg(long, default_value_t = 200)]
    team_wakes: usize,
    /// Team: idle teammates (each after one turn) in the memory and consumer measurement.
    #[arg(long, default_value_t = 1_000)]
    teammates: usize,
}

/// The role the no-op agent fills in this section.
const ROLE: &str = "member";

const PREFIX: &str = "flteam";
/// Tasks in flight in the throughput measurements, as in the raw one.
const IN_FLIGHT: usize = 512;

pub(crate) async fn run(
    args: &TeamArgs,
    services: &Services,
    url: &str,
    raw: Option<&RawFigures>,
) -> anyhow::Result<()> {
    let (_dir, config) = section_config(services, url, PREFIX, "team")?;
    let exe = &services.exe;
    // The no-op agent is a member of a role, so anycast tasks have someone to claim them.
    let text = std::fs::read_to_string(&config)?;
    std::fs::write(
        &config,
        text.replace(
            "reply = \"ok\"\n",
            &format!("reply = \"ok\"\nroles = [\"{ROLE}\"]\n"),
        ) + led::LEAD_AGENT
            + &teammate_caps(args),
    )?;
    let spawn = |role: &[&str]| spawn_service(exe, &config, role);
    let mut opts = NatsOptions::with_url(url);
    opts.prefix = PREFIX.into();
    let bus = Bus::connect(&opts, "flotilla-bench").await?;
    bus.provision(&Default::default()).await?;
    let mut procs = Processes(vec![("coordinator".into(), spawn(&["coordinator"])?)]);
    for i in 0..services.workers {
        procs.0.push((format!("worker {i}"), spawn(&["worker"])?));
    }
    let inbox = format!("_INBOX.flteam.{}", RunId::new());
    let mut ends = outcomes(&bus, inbox.clone()).await?;
    let via = services.via;
    let mut finished = 0u64;
    let warm = |bus: Bus, inbox: String| async move {
        let mut req = SubmitRequest::new(independent_plan(1));
        req.reply_to = Some(inbox);
        submit_via(&bus, req, via).await
    };
    warm(bus.clone(), inbox.clone()).await?;
    next_end(&mut ends).await?;
    finished += 1;
    outln!(
        "== team (supervisor following the events of a coordinator + {} worker process(es) × {} slots, no-op agent)",
        services.workers,
        services.concurrency
    );

    // Throughput without, then with a supervisor.
    let runs = args.team_runs.max(1);
    let without = throughput(&bus, &inbox, &mut ends, runs, via).await?;
    finished += runs as u64;
    procs.0.push(("supervisor".into(), spawn(&["supervisor"])?));
    let supervisor_pid = procs.0.last().map(|(_, c)| c.id());
    // The supervisor is up once it has counted what already ran.
    let kv = bus.kv(Bucket::Failures).await?;
    let key = record_key(RecordScope::Agent, "noop");
    wait_counted(&kv, &key, finished, Duration::from_secs(120))
        .await
        .context("the supervisor never counted the earlier runs")?;
    let cpu_before = supervisor_pid.and_then(cpu_seconds);
    let with = throughput(&bus, &inbox, &mut ends, runs, via).await?;
    let last_end = Instant::now();
    finished += runs as u64;
    wait_counted(&kv, &key, finished, Duration::from_secs(300))
        .await
        .context("the supervisor did not catch up")?;
    let catch_up = last_end.elapsed();
    let cpu = supervisor_pid
        .and_then(cpu_seconds)
        .zip(cpu_before)
        .map(|(a, b)| a - b);
    outln!(
        "   throughput, 1-task runs: {without:>8.0} tasks/s without a supervisor, {with:>8.0} with one: {:.3}× (target ≥ 0.90)",
        with / without
    );
    if let Some(cpu) = cpu {
        outln!(
            "      supervisor CPU per run: {:.0} µs (through catch-up)",
            cpu * 1e6 / runs as f64
        );
    }
    outln!(
        "   catch-up: last run's end → every outcome counted: {:.3} s",
        catch_up.as_secs_f64()
    );

    // Lag with one run in flight: outcome received → record updated.
    let mut watch = kv.watch(&key).await?;
    // The watch first delivers the current value.
    let _ = tokio::time::timeout(Duration::from_secs(5), watch.next()).await;
    let mut lags = Vec::with_capacity(args.team_lag_samples);
    for _ in 0..args.team_lag_samples.max(1) {
        warm(bus.clone(), inbox.clone()).await?;
        next_end(&mut ends).await?;
        let t0 = Instant::now();
        finished += 1;
        loop {
            let entry = tokio::time::timeout(Duration::from_secs(30), watch.next())
                .await
                .context("no record update within 30 s")?
                .context("the watch ended")??;
            let r: FailureRecord = serde_json::from_slice(&entry.value)?;
            if r.total_succeeded + r.total_failed >= finished {
                break;
            }
        }
        lags.push(ms(t0.elapsed()));
    }
    let (p50, p99) = p50_p99(&mut lags);
    outln!(
        "   record lag (1 run in flight, outcome received → failure record updated): p50 {p50:.3} ms   p99 {p99:.3} ms{}",
        raw.map_or_else(String::new, |r| format!(
            "   ({:.2}× the raw round trip p50 of {:.3} ms)",
            p50 / r.p50_ms,
            r.p50_ms
        ))
    );
    if let Some(kib) = supervisor_pid.and_then(peak_rss_kib) {
        outln!("   peak RSS supervisor {:>8.1} MiB", kib as f64 / 1024.0);
    }

    // Anycast claim: the same chain on the pool, then with every task naming the role.
    let client = flotilla_client::Client::new(bus.clone());
    let mut hops = [Vec::new(), Vec::new()];
    for _ in 0..args.team_chains.max(1) {
        for (k, anycast) in [false, true].into_iter().enumerate() {
            let mut plan = chain_plan(services.chain);
            // A DAG, as `auto` would choose without the section's lead.
            plan.config.strategy = flotilla_model::plan::Strategy::Dag;
            if anycast {
                for t in &mut plan.subtasks {
                    t.role = Some(ROLE.into());
                }
            }
            let run = submit_via(&bus, SubmitRequest::new(plan), via).await?;
            let outcome = client.wait(run, Duration::from_secs(300)).await?;
            anyhow::ensure!(
                outcome.status == RunStatus::Succeeded,
                "a chain {}",
                outcome.status
            );
            hops[k].extend(chain_hops(&client, run).await?);
        }
    }
    let [mut pool, mut role] = hops;
    let (pool50, pool99) = p50_p99(&mut pool);
    let (role50, role99) = p50_p99(&mut role);
    outln!(
        "   dependency hop on the pool:            p50 {pool50:.3} ms   p99 {pool99:.3} ms   ({} hops)",
        pool.len()
    );
    outln!(
        "   anycast hop (claimed from the role's queue): p50 {role50:.3} ms   p99 {role99:.3} ms   ({} hops): {:.2}× the pool hop (target ≤ 1.5×)",
        role.len(),
        role50 / pool50
    );

    // Recruit → the recruit's first attempt claimed, on runs held open by a task waiting for
    // a workspace topic nobody writes (cancelled after each sample).
    let store = flotilla_client::open_store(&bus).await?;
    let mut recruits = Vec::with_capacity(args.team_recruits);
    for i in 0..args.team_recruits.max(1) {
        let mut plan = independent_plan(1);
        plan.config.dataflow_validation = flotilla_model::plan::DataflowValidation::Lenient;
        plan.subtasks[0].consumes = vec!["gate".into()];
        let run = submit_via(&bus, SubmitRequest::new(plan), via).await?;
        let request = flotilla_model::recruit::RecruitRequest {
            protocol: flotilla_model::PROTOCOL_VERSION,
            run_id: run,
            recruit_id: format!("bench{i}"),
            role: ROLE.into(),
            description: "help".into(),
            reason: "bench".into(),
            task_id: None,
            dependencies: Vec::new(),
            produces: Vec::new(),
            consumes: Vec::new(),
            required: false,
            by_task: None,
        };
        // The run's start is recorded lazily: the supervisor waits for it, which is not what
        // this measures — ask once it is recorded.
        let deadline = Instant::now() + Duration::from_secs(30);
        while store.load(run).await?.is_none() {
            anyhow::ensure!(Instant::now() < deadline, "run {run} was never recorded");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let sent = flotilla_model::time::Timestamp::now();
        let reply = client
            .call(&request, Duration::from_secs(30))
            .await?
            .map_err(|e| anyhow::anyhow!("recruit refused: {e:?}"))?;
        anyhow::ensure!(
            reply.status == flotilla_model::recruit::RecruitStatus::Accepted,
            "recruit {reply:?}"
        );
        let claimed = loop {
            let found = store
                .history(run)
                .await?
                .into_iter()
                .find_map(|(_, ts, e)| {
                    matches!(e.input, flotilla_model::runlog::RunInput::Claimed(_)).then_some(ts)
                });
            if let Some(ts) = found {
                break ts;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the recruit of {run} was never claimed"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let ns = claimed.0.unix_timestamp_nanos() - sent.0.unix_timestamp_nanos();
        recruits.push((ns.max(0) as f64) / 1e6);
        client.cancel(run, Some("bench sample done".into())).await?;
    }
    let (r50, r99) = p50_p99(&mut recruits);
    outln!(
        "   recruit → first attempt claimed:       p50 {r50:.3} ms   p99 {r99:.3} ms   ({} recruits): {:.2}× the pool hop (target ≤ 2×)",
        recruits.len(),
        r50 / pool50
    );

    led::run(&bus, via, args.team_leads, pool50).await?;
    memory::lookup(&bus, raw, 20).await?;

    // Persistent teammates: memory and consumers with many idle, then one woken among them.
    let pids = teammates::Pids {
        supervisor: supervisor_pid,
        workers: procs
            .0
            .iter()
            .filter(|(name, _)| name.starts_with("worker"))
            .map(|(_, c)| c.id())
            .collect(),
    };
    let before = teammates::baseline(&bus, &pids).await?;
    teammates::idle(&bus, &pids, ROLE, args.teammates, before).await?;
    let reader = Bus::connect(&opts, "flotilla-bench-reader").await?;
    teammates::wake(&bus, &reader, &pids, ROLE, args.team_wakes).await?;
    drop(procs);
    Ok(())
}

/// `[supervisor]` caps that let the teammate measurements run: `--teammates` in one team
/// (plus the woken one's), twice `--team-wakes` turns of one teammate within the hour (woken
/// by `team.send`, then by mail published straight to its inbox).
fn teammate_caps(args: &TeamArgs) -> String {
    format!(
        "\n[supervisor]\nteam-size = {}\nturns-per-hour = {}\n",
        args.teammates.max(1) + 10,
        (2 * args.team_wakes + 100).min(u32::MAX as usize)
    )
}

async fn next_end(
    ends: &mut tokio::sync::mpsc::UnboundedReceiver<flotilla_model::run::RunOutcome>,
) -> anyhow::Result<RunStatus> {
    let status = tokio::time::timeout(Duration::from_secs(300), ends.recv())
        .await
        .context("runs did not finish in 5 minutes")?
        .context("outcome subscription ended")?
        .status;
    anyhow::ensure!(status == RunStatus::Succeeded, "a run {status}");
    Ok(status)
}

/// Tasks/s of `runs` 1-task runs with [`IN_FLIGHT`] in flight.
async fn throughput(
    bus: &Bus,
    inbox: &str,
    ends: &mut tokio::sync::mpsc::UnboundedReceiver<flotilla_model::run::RunOutcome>,
    runs: usize,
    via: crate::harness::submit::SubmitVia,
) -> anyhow::Result<f64> {
    let window = Arc::new(Semaphore::new(IN_FLIGHT));
    let start = Instant::now();
    let submitter = spawn_submitter(bus, inbox, runs, 1, via, Arc::clone(&window));
    for _ in 0..runs {
        next_end(ends).await?;
        window.add_permits(1);
    }
    let elapsed = start.elapsed();
    let _ = submitter.await;
    Ok(runs as f64 / elapsed.as_secs_f64())
}

/// Waits until the record at `key` has counted `n` outcomes.
async fn wait_counted(
    kv: &async_nats::jetstream::kv::Store,
    key: &str,
    n: u64,
    within: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = kv.get(key).await?
            && let Ok(r) = serde_json::from_slice::<FailureRecord>(&v)
            && r.total_succeeded + r.total_failed >= n
        {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{key} has not counted {n} outcomes"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
