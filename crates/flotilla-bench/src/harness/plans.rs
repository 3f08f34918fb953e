//! Plans several sections run, and the dependency hop read back from a chain's run log.

use std::collections::HashMap;

use flotilla_client::Client;
use flotilla_model::ids::RunId;
use flotilla_model::plan::{Plan, PlanConfig, Subtask};
use flotilla_model::runlog::RunInput;

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
        fork: None,
        name: Some("bench".into()),
        query: None,
        subtasks,
        config: PlanConfig::default(),
    }
}

/// `n` independent no-op tasks, all allowed to run at once.
pub(crate) fn independent_plan(n: usize) -> Plan {
    let mut p = Plan {
        fork: None,
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

/// The chain `s0 → s1 → … → s<n−1>` of no-op tasks.
pub(crate) fn chain_plan(n: usize) -> Plan {
    chain_of(n, "bench-chain", "no-op", |_| None)
}

/// The chain `s0 → s1 → … → s<n−1>` named `name`, each task described `description` and run
/// by `agent(i)` (the default agent for `None`).
pub(crate) fn chain_of(
    n: usize,
    name: &str,
    description: &str,
    agent: impl Fn(usize) -> Option<&'static str>,
) -> Plan {
    let subtasks = (0..n)
        .map(|i| {
            let mut t = Subtask::new(&format!("s{i}"), description);
            t.agent = agent(i).map(str::to_owned);
            if i == 0 {
                t
            } else {
                t.after(&[&format!("s{}", i - 1)])
            }
        })
        .collect();
    Plan {
        fork: None,
        name: Some(name.into()),
        query: None,
        subtasks,
        config: PlanConfig::default(),
    }
}

/// Hop latencies of a finished chain, from its run log: the server time the predecessor's
/// result was stored → the time the worker started the dependent (same host clock).
pub(crate) async fn chain_hops(client: &Client, run: RunId) -> anyhow::Result<Vec<f64>> {
    let store = flotilla_client::open_store(client.bus()).await?;
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
