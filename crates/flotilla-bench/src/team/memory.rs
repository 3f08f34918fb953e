//! Supervisor memory: what a bare query pays before it is planned. The bucket is filled with
//! 1,200 entries of a realistic size (a query, four subtasks); each lookup is the
//! coordinator's own code (`Memory::newest` then `decide`): one stream-info request and batch direct
//! gets of the newest `scan-limit` (1,000) entries, decoded and scored.

use std::time::Instant;

use flotilla_bus::Bus;
use flotilla_coordinator::memory::{Advice, Memory, MemoryOptions, decide};
use flotilla_model::ids::RunId;
use flotilla_model::memory::{MemoryEntry, QuerySource, memory_key};
use flotilla_model::plan::{Plan, Subtask};
use flotilla_model::run::RunStatus;
use flotilla_model::subjects::Bucket;
use flotilla_model::time::Timestamp;

use crate::harness::raw::RawFigures;
use crate::harness::stats::{ms, p50_p99};

/// Entries stored: more than the scan limit, so the lookup reads the newest only.
const STORED: usize = 1_200;

/// Fills the memory bucket and prints the lookup's latency over `samples` lookups.
pub(crate) async fn lookup(
    bus: &Bus,
    raw: Option<&RawFigures>,
    samples: usize,
) -> anyhow::Result<()> {
    let kv = bus.kv(Bucket::Memory).await?;
    let mut plan = Plan::empty();
    for (i, d) in [
        "Find the figures.",
        "Compare with last year.",
        "Check the sources.",
        "Write the report.",
    ]
    .iter()
    .enumerate()
    {
        plan.subtasks.push(Subtask::new(&format!("t{i}"), d));
    }
    let (shape, team) = MemoryEntry::shape_of(&plan);
    for i in 0..STORED {
        let run = RunId::new();
        let now = Timestamp::now();
        let e = MemoryEntry {
            run_id: run,
            session_id: None,
            query: format!("Summarise the quarterly revenue report number {i} for customer {i}"),
            query_source: QuerySource::Query,
            name: None,
            plan: shape.clone(),
            team: team.clone(),
            outcome: RunStatus::Succeeded,
            cause: None,
            duration_ms: 1000,
            tokens: Some(1234),
            cost_usd: None,
            created_at: now,
            finished_at: now,
            recorded_at: now,
            reused_from: None,
            truncated: false,
        };
        kv.create(memory_key(run), serde_json::to_vec(&e)?.into())
            .await?;
    }
    let opts = MemoryOptions::default();
    let memory = Memory::new(bus.clone(), opts.clone());
    let mut times = Vec::with_capacity(samples);
    let mut scanned = 0;
    for _ in 0..samples.max(1) {
        let t = Instant::now();
        let entries = memory.newest().await?;
        let advice = decide(
            RunId::new(),
            "Summarise the quarterly revenue report for ACME",
            None,
            &entries,
            &opts,
            |p| Ok((p.clone(), Vec::new())),
        );
        times.push(ms(t.elapsed()));
        anyhow::ensure!(
            matches!(advice, Advice::Plan { .. }),
            "the lookup reused a plan below the threshold"
        );
        scanned = entries.len();
    }
    let (p50, p99) = p50_p99(&mut times);
    outln!(
        "   memory lookup before a bare query is planned ({scanned} newest of {STORED} entries read and scored, {} lookups): p50 {p50:.3} ms   p99 {p99:.3} ms{}",
        times.len(),
        raw.map_or_else(String::new, |r| format!(
            ": {:.1}× the raw round trip p50",
            p50 / r.p50_ms
        ))
    );
    Ok(())
}
