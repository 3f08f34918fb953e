//! The `validate` section: validating a 10,000-subtask plan (the layered DAG of
//! [`wide_plan`]), in process, no NATS.

use std::time::{Duration, Instant};

use flotilla_model::validate::{ValidationContext, validate_plan};

use crate::harness::plans::wide_plan;
use crate::harness::stats::ms;

/// Validates the plan `iterations` times (at least once) and prints min, p50 and max.
pub(crate) fn run(iterations: usize) {
    let plan = wide_plan(10_000);
    let ctx = ValidationContext::default();
    assert!(
        validate_plan(&plan, &ctx).is_valid(),
        "the synthetic plan is valid"
    );
    let mut times: Vec<Duration> = (0..iterations.max(1))
        .map(|_| {
            let start = Instant::now();
            std::hint::black_box(validate_plan(&plan, &ctx));
            start.elapsed()
        })
        .collect();
    times.sort();
    let edges: usize = plan.subtasks.iter().map(|t| t.dependencies.len()).sum();
    outln!(
        "== plan validation: 10,000 subtasks, {edges} dependencies, {} runs",
        times.len()
    );
    outln!("   min {:>8.2} ms", ms(times[0]));
    outln!("   p50 {:>8.2} ms", ms(times[times.len() / 2]));
    outln!(
        "   max {:>8.2} ms   (target: well under 50 ms)",
        ms(times[times.len() - 1])
    );
}
