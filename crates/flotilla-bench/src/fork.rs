//! The `fork` section: what a fork of an ended run costs and runs. Services are a coordinator
//! and one worker process with the no-op `scripted` agent (no model). Each sample is a
//! 10-task chain run to its end, then forked at its last task (`run.fork` with `wait`):
//!
//! * how many attempts the fork dispatched (target: exactly 1 — the nine kept tasks are
//!   never dispatched, so they call no model and run no tool), read from its record;
//! * the fork's time, request sent → answered with its outcome, next to a one-task run in
//!   the same round (the fork runs one task too) submitted through the same door — the
//!   submit endpoint, answered at the end — and on its run's own subject (the client
//!   library's fast path), and next to the original chain's;
//! * the original replayed from its log (`runs replay`): its time per task next to the
//!   chain's own time per task, about a dependency hop (target ≤ 2×), and that it reached the
//!   same decisions.

use std::time::{Duration, Instant};

use anyhow::Context;
use flotilla_client::Client;
use flotilla_model::fork::RunForkRequest;
use flotilla_model::ids::TaskId;
use flotilla_model::run::RunStatus;
use flotilla_model::submit::{SubmitRequest, SubmitStatus};

use crate::harness::plans::chain_plan;
use crate::harness::services::{Services, coordinator_and_worker, section_bus, section_config};
use crate::harness::stats::p50_p99;
use crate::harness::submit::{attempts_of, submit_via};

/// `flotilla bench --only fork` settings.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ForkArgs {
    /// Fork: samples (a 10-task chain, its fork at the last task, a one-task run each).
    #[arg(long, default_value_t = 20)]
    fork_samples: usize,
}

const PREFIX: &str = "flfork";
const WAIT: Duration = Duration::from_secs(60);
const CHAIN: usize = 10;

pub(crate) async fn run(args: &ForkArgs, services: &Services, url: &str) -> anyhow::Result<()> {
    let (_dir, config) = section_config(services, url, PREFIX, "fork")?;
    let exe = &services.exe;
    let bus = section_bus(url, PREFIX).await?;
    let procs = coordinator_and_worker(exe, &config)?;
    let client = Client::new(bus.clone());
    let warm = submit_via(&bus, SubmitRequest::new(chain_plan(1)), services.via).await?;
    client.wait(warm, WAIT).await?;
    outln!(
        "== fork (a coordinator + 1 worker process × {} slots, no-op agent): a {CHAIN}-task chain forked at its last task",
        services.concurrency
    );
    let (mut chains, mut forks, mut singles) = (Vec::new(), Vec::new(), Vec::new());
    let mut endpoint = Vec::new();
    let mut replays = Vec::new();
    let mut replay_attempts = 0usize;
    let (mut dispatched, mut samples) = (0usize, 0usize);
    for _ in 0..args.fork_samples.max(1) {
        let sent = Instant::now();
        let original =
            submit_via(&bus, SubmitRequest::new(chain_plan(CHAIN)), services.via).await?;
        let o = client.wait(original, WAIT).await?;
        anyhow::ensure!(o.status == RunStatus::Succeeded, "the chain failed: {o:?}");
        chains.push(sent.elapsed().as_secs_f64() * 1e3);

        let sent = Instant::now();
        let single = submit_via(&bus, SubmitRequest::new(chain_plan(1)), services.via).await?;
        client.wait(single, WAIT).await?;
        singles.push(sent.elapsed().as_secs_f64() * 1e3);

        // The fork's own door: the submit endpoint, answered at the run's end.
        let mut waited = SubmitRequest::new(chain_plan(1));
        waited.wait = true;
        let sent = Instant::now();
        let reply = client.submit_request(&waited, WAIT).await?;
        anyhow::ensure!(reply.status == SubmitStatus::Finished, "{reply:?}");
        endpoint.push(sent.elapsed().as_secs_f64() * 1e3);

        let mut request = RunForkRequest::new(original, TaskId::new(format!("s{}", CHAIN - 1)));
        request.wait = true;
        let sent = Instant::now();
        let reply = client.request(&request, WAIT).await?;
        forks.push(sent.elapsed().as_secs_f64() * 1e3);
        anyhow::ensure!(
            reply.status == SubmitStatus::Finished
                && reply.outcome.as_ref().map(|o| o.status) == Some(RunStatus::Succeeded),
            "the fork did not succeed: {reply:?}"
        );
        anyhow::ensure!(
            reply.reused.len() == CHAIN - 1,
            "the fork kept {} results, not {}",
            reply.reused.len(),
            CHAIN - 1
        );
        let fork = reply.run_id.context("the fork's id")?;
        dispatched += attempts_of(&client, fork).await?;
        samples += 1;

        // The original replayed from its log: every task served its recorded result.
        let before = attempts_of(&client, original).await?;
        let sent = Instant::now();
        let report = client.replay(original).await?.context("the chain exists")?;
        replays.push(sent.elapsed().as_secs_f64() * 1e3);
        anyhow::ensure!(report.same, "the chain's replay diverged: {report:?}");
        replay_attempts += attempts_of(&client, original).await? - before;
    }
    let (c50, _) = p50_p99(&mut chains);
    let (s50, s99) = p50_p99(&mut singles);
    let (f50, f99) = p50_p99(&mut forks);
    let (e50, e99) = p50_p99(&mut endpoint);
    let (r50, r99) = p50_p99(&mut replays);
    outln!(
        "   attempts dispatched by {samples} forks: {dispatched} ({:.2} per fork, target 1; the {} kept tasks per fork: 0)",
        dispatched as f64 / samples as f64,
        CHAIN - 1
    );
    outln!("   {CHAIN}-task chain submitted → ended:   p50 {c50:.3} ms");
    outln!("   one-task run submitted → ended:      p50 {s50:.3} ms   p99 {s99:.3} ms");
    outln!(
        "   one-task run, submit endpoint waited: p50 {e50:.3} ms   p99 {e99:.3} ms (the fork's door)"
    );
    outln!(
        "   fork at the last task sent → ended:  p50 {f50:.3} ms   p99 {f99:.3} ms: {:.2}× a one-task run through the same door, {:.2}× one submitted on its run's subject, {:.2}× the chain",
        f50 / e50.max(f64::EPSILON),
        f50 / s50.max(f64::EPSILON),
        f50 / c50.max(f64::EPSILON)
    );
    outln!(
        "   replay of the {CHAIN}-task chain (read its log, events and record; the machine decides again; checked): p50 {r50:.3} ms   p99 {r99:.3} ms = {:.3} ms per task, {:.2}× the chain's time per task (target ≤ 2×); attempts the replays added: {replay_attempts}",
        r50 / CHAIN as f64,
        (r50 / CHAIN as f64) / (c50 / CHAIN as f64).max(f64::EPSILON)
    );
    drop(procs);
    Ok(())
}
