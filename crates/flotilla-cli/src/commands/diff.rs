//! `flotilla runs diff A B`: two runs compared task by task.

use std::process::ExitCode;

use flotilla_bus::Bus;
use flotilla_model::diff::{RunDiff, RunSide, TaskSide};
use flotilla_model::ids::RunId;
use flotilla_model::tree::UsageTotals;

use super::runs::{fit, format_cost as cost, format_duration_ms as ms};
use crate::config::Config;

/// Prints the comparison of `a` with `b`: exit 0 when no task changed, 1 when one did or a
/// run does not exist.
pub(crate) async fn diff(
    config: &Config,
    a: RunId,
    b: RunId,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    let client = flotilla_client::Client::new(bus);
    let diff = match client.diff(a, b).await? {
        Ok(d) => d,
        Err(missing) => {
            errln!("error: run {missing} does not exist");
            return Ok(ExitCode::from(1));
        }
    };
    if json {
        outln!("{}", serde_json::to_string_pretty(&diff)?);
    } else {
        outln!("{}", render(&diff).trim_end_matches('\n'));
    }
    Ok(if diff.changed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// The comparison as a person reads it: the two runs' totals side by side, a row per task,
/// then each changed result's line diff.
pub(crate) fn render(d: &RunDiff) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(out, "{:<10} {:<38} {:<38}", "", "A", "B");
    let row = |out: &mut String, what: &str, x: String, y: String| {
        let mark = if x == y { "" } else { "  *" };
        let _ = writeln!(out, "{what:<10} {x:<38} {y:<38}{mark}");
    };
    row(
        &mut out,
        "run",
        d.a.run_id.to_string(),
        d.b.run_id.to_string(),
    );
    row(
        &mut out,
        "plan",
        d.a.name.clone().unwrap_or_default(),
        d.b.name.clone().unwrap_or_default(),
    );
    row(&mut out, "status", status(&d.a), status(&d.b));
    row(&mut out, "tasks", tasks(&d.a), tasks(&d.b));
    row(
        &mut out,
        "attempts",
        d.a.attempts.to_string(),
        d.b.attempts.to_string(),
    );
    row(
        &mut out,
        "duration",
        ms(d.a.duration_ms),
        ms(d.b.duration_ms),
    );
    row(&mut out, "tokens", usage(&d.a.usage), usage(&d.b.usage));
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<24} {:<22} {:>9} {:>9} {:>13} {:>13}",
        "TASK", "STATUS", "ATTEMPTS", "LATENCY", "TOKENS", "COST"
    );
    for t in &d.tasks {
        let mark = if t.changed { "*" } else { " " };
        let pair = |f: &dyn Fn(&TaskSide) -> String| {
            format!(
                "{}→{}",
                t.a.as_ref().map_or("-".into(), f),
                t.b.as_ref().map_or("-".into(), f)
            )
        };
        let _ = writeln!(
            out,
            "{mark}{:<23} {:<22} {:>9} {:>9} {:>13} {:>13}",
            fit(t.task_id.as_str(), 23),
            pair(&|s| s.status.as_str().to_owned()),
            pair(&|s| s.attempts.to_string()),
            pair(&|s| s.latency_ms.map_or("-".into(), ms)),
            pair(&|s| s.usage.tokens().to_string()),
            pair(&|s| cost(s.usage.cost_usd)),
        );
    }
    let _ = writeln!(
        out,
        "{} of {} task{} changed",
        d.changed,
        d.tasks.len(),
        if d.tasks.len() == 1 { "" } else { "s" }
    );
    for t in d.tasks.iter().filter(|t| t.diff.is_some()) {
        let _ = writeln!(out, "\n--- {} (A)\n+++ {} (B)", t.task_id, t.task_id);
        out.push_str(t.diff.as_deref().unwrap_or_default());
        if t.diff_truncated {
            let _ = writeln!(
                out,
                "… (cut: `--json` has the same; read both results with `runs show`)"
            );
        }
    }
    out
}

fn status(s: &RunSide) -> String {
    match &s.reason {
        Some(r) => fit(&format!("{}: {r}", s.status.as_str()), 38),
        None => s.status.as_str().to_owned(),
    }
}

fn tasks(s: &RunSide) -> String {
    format!("{} ({} ok, {} failed)", s.tasks, s.succeeded, s.failed)
}

fn usage(u: &UsageTotals) -> String {
    let mut s = format!(
        "{} in {} call{}",
        u.tokens(),
        u.calls,
        if u.calls == 1 { "" } else { "s" }
    );
    if u.cost_usd > 0.0 {
        s.push_str(&format!(", {}", cost(u.cost_usd)));
    }
    s
}
