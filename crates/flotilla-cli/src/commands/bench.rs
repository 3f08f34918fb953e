//! `flotilla bench`: measured, not asserted.
//!
//! Each section prints its figures; sections that involve NATS also measure raw JetStream in
//! the same run and print the ratio.

use std::time::{Duration, Instant};

use flotilla_model::plan::{Plan, PlanConfig, Subtask};
use flotilla_model::validate::{ValidationContext, validate_plan};

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

/// Times validation of a 10,000-subtask plan.
pub(crate) fn validate_section(iterations: usize) {
    let plan = wide_plan(10_000);
    let ctx = ValidationContext::default();
    let report = validate_plan(&plan, &ctx);
    assert!(report.is_valid(), "the synthetic plan is valid");
    let mut times: Vec<Duration> = (0..iterations.max(1))
        .map(|_| {
            let start = Instant::now();
            let r = validate_plan(&plan, &ctx);
            let t = start.elapsed();
            std::hint::black_box(r);
            t
        })
        .collect();
    times.sort();
    let edges: usize = plan.subtasks.iter().map(|t| t.dependencies.len()).sum();
    println!(
        "== plan validation: 10,000 subtasks, {edges} dependencies, {} runs",
        times.len()
    );
    println!("   min {:>8.2} ms", ms(times[0]));
    println!("   p50 {:>8.2} ms", ms(times[times.len() / 2]));
    println!(
        "   max {:>8.2} ms   (target: well under 50 ms)",
        ms(times[times.len() - 1])
    );
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
