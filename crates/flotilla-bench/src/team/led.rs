//! Led runs (the `supervisor` strategy): what the lead's path adds to a run. Each sample is a
//! run of a two-task chain (`s0`, then `s1` after it) under `"strategy": "supervisor"`, led by
//! the section's `scripted` lead (a deterministic reply: no model). The bench assigns both
//! tasks through `team.assign` as an operator would, then finishes the run with `team.finish`,
//! and reads the server times off the run log and the lead's teammate entry:
//!
//! * assignment: `team.assign` sent → the task's first attempt started on a worker (its
//!   result's `started_at`; the same host's clock);
//! * the dependency hop inside a led run (`s0`'s result stored → `s1` started);
//! * the lead's mail: `s0`'s result stored → the lead's turn claimed by a worker (the event
//!   reaches the supervisor's follower, which mails the lead with the run's task states and
//!   wakes it);
//! * `team.finish` sent → answered (applied by the run machine).

use std::time::{Duration, Instant};

use anyhow::Context;
use flotilla_bus::Bus;
use flotilla_client::Client;
use flotilla_model::ids::TaskId;
use flotilla_model::lead::{AssignRequest, FinishRequest, LEAD_NAME};
use flotilla_model::plan::Strategy;
use flotilla_model::recruit::RecruitStatus;
use flotilla_model::run::RunStatus;
use flotilla_model::runlog::RunInput;
use flotilla_model::subjects::Bucket;
use flotilla_model::submit::SubmitRequest;
use flotilla_model::teammate::{Teammate, TeammateStatus, teammate_key};
use flotilla_model::time::Timestamp;

use crate::harness::plans::chain_plan;
use crate::harness::stats::p50_p99;
use crate::harness::submit::{SubmitVia, submit_via};

/// How long one request or wait may take.
const ASK: Duration = Duration::from_secs(30);

fn nanos(t: &Timestamp) -> i128 {
    t.0.unix_timestamp_nanos()
}

fn ms_between(from: i128, to: i128) -> f64 {
    (to - from).max(0) as f64 / 1e6
}

/// Samples of one led run.
struct Sample {
    assign: f64,
    hop: f64,
    mail: f64,
    finish: f64,
}

/// Runs `samples` led runs and prints the figures next to `pool_hop` (the pool's dependency
/// hop p50, ms, measured in the same section).
pub(crate) async fn run(
    bus: &Bus,
    via: SubmitVia,
    samples: usize,
    pool_hop: f64,
) -> anyhow::Result<()> {
    let client = Client::new(bus.clone());
    let store = flotilla_client::open_store(bus).await?;
    let kv = bus.kv(Bucket::Team).await?;
    let mut out = Vec::with_capacity(samples);
    for _ in 0..samples.max(1) {
        out.push(sample(bus, &client, &store, &kv, via).await?);
    }
    let step = |f: fn(&Sample) -> f64| {
        let mut v: Vec<f64> = out.iter().map(f).collect();
        p50_p99(&mut v)
    };
    let (a50, a99) = step(|s| s.assign);
    let (h50, h99) = step(|s| s.hop);
    let (m50, m99) = step(|s| s.mail);
    let (f50, f99) = step(|s| s.finish);
    outln!(
        "   led runs ({} runs of a 2-task chain, scripted lead; assigned and finished through the API):",
        out.len()
    );
    outln!(
        "      team.assign → the task's first attempt started: p50 {a50:.3} ms   p99 {a99:.3} ms: {:.2}× the pool hop",
        a50 / pool_hop
    );
    outln!(
        "      dependency hop inside a led run:                p50 {h50:.3} ms   p99 {h99:.3} ms: {:.2}× the pool hop",
        h50 / pool_hop
    );
    outln!(
        "      a task's result stored → the lead's turn claimed (mailed the task states, woken): p50 {m50:.3} ms   p99 {m99:.3} ms: {:.2}× the pool hop",
        m50 / pool_hop
    );
    outln!("      team.finish → answered (applied):             p50 {f50:.3} ms   p99 {f99:.3} ms");
    Ok(())
}

async fn sample(
    bus: &Bus,
    client: &Client,
    store: &flotilla_runs::RunReader,
    kv: &async_nats::jetstream::kv::Store,
    via: SubmitVia,
) -> anyhow::Result<Sample> {
    let mut plan = chain_plan(2);
    plan.config.strategy = Strategy::Supervisor;
    let run = submit_via(bus, SubmitRequest::new(plan), via).await?;
    // The run's start is recorded lazily: the supervisor waits for it, which is not what
    // this measures — assign once it is recorded.
    let deadline = Instant::now() + ASK;
    while store.load(run).await?.is_none() {
        anyhow::ensure!(Instant::now() < deadline, "run {run} was never recorded");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let assign = |task: &str| AssignRequest {
        protocol: flotilla_model::PROTOCOL_VERSION,
        run_id: run,
        task_id: TaskId::from(task),
        reason: "bench".into(),
        by: None,
    };
    // s1 first: assigned, it waits for s0, so its start measures the hop from s0's result
    // (assigned second, a no-op s0 could end before s1's assignment arrived).
    let mut sent = 0;
    for task in ["s1", "s0"] {
        sent = nanos(&Timestamp::now());
        let reply = client
            .call(&assign(task), ASK)
            .await?
            .map_err(|e| anyhow::anyhow!("assign refused: {e:?}"))?;
        anyhow::ensure!(reply.status == RecruitStatus::Accepted, "assign {reply:?}");
    }
    // Both tasks ran: s0's result, then s1's.
    let (mut started0, mut stored0, mut started1) = (None, None, None);
    while started1.is_none() {
        for (_, ts, e) in store.history(run).await? {
            match e.input {
                RunInput::TaskResult(r) if r.task_id.as_str() == "s0" => {
                    stored0.get_or_insert(nanos(&ts));
                    started0 = r.started_at.as_ref().map(nanos);
                }
                RunInput::TaskResult(r) if r.task_id.as_str() == "s1" => {
                    started1 = r.started_at.as_ref().map(nanos);
                }
                _ => {}
            }
        }
        anyhow::ensure!(Instant::now() < deadline, "the tasks of {run} never ran");
        if started1.is_none() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let started0 = started0.context("s0 ran without a start time")?;
    let stored0 = stored0.context("s1 ran before s0's result")?;
    let started1 = started1.context("s1 never started")?;
    // The lead's turns: the first claimed after s0's result.
    let key = teammate_key(&run.to_string(), LEAD_NAME);
    let mail = loop {
        let lead: Option<Teammate> = match kv.get(&key).await? {
            Some(b) => Some(serde_json::from_slice(&b)?),
            None => None,
        };
        let claim = lead.as_ref().and_then(|m| {
            m.transitions
                .iter()
                .filter(|t| t.status == TeammateStatus::Working && t.host.is_some())
                .map(|t| nanos(&t.at))
                .find(|at| *at >= stored0)
        });
        if let Some(at) = claim {
            break at;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the lead of {run} was never woken after s0"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let finish_sent = Instant::now();
    let reply = client
        .call(
            &FinishRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                run_id: run,
                result: "done".into(),
                by: None,
            },
            ASK,
        )
        .await?
        .map_err(|e| anyhow::anyhow!("finish refused: {e:?}"))?;
    let finish = finish_sent.elapsed().as_secs_f64() * 1e3;
    anyhow::ensure!(reply.status == RecruitStatus::Accepted, "finish {reply:?}");
    let outcome = client.wait(run, ASK).await?;
    anyhow::ensure!(
        outcome.status == RunStatus::Succeeded,
        "a led run {}",
        outcome.status
    );
    Ok(Sample {
        assign: ms_between(sent, started0),
        hop: ms_between(stored0, started1),
        mail: ms_between(stored0, mail),
        finish,
    })
}

/// The scripted lead of the section's deployment (a card with the role `supervisor`).
pub(crate) const LEAD_AGENT: &str =
    "\n[agents.chief]\nkind = \"scripted\"\nreply = \"noted\"\nroles = [\"supervisor\"]\n";
