//! `flotilla plan validate FILE`.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;
use flotilla_model::Plan;
use flotilla_model::codec::Codec;
use flotilla_model::validate::{
    Problem, ProblemCode, ValidationContext, ValidationReport, validate_plan,
};
use serde::Serialize;

#[derive(Serialize)]
struct Output<'a> {
    file: String,
    valid: bool,
    subtasks: usize,
    #[serde(flatten)]
    report: &'a ValidationReport,
}

/// Reads a plan file; a malformed document becomes a `malformed` problem, not an error.
pub(crate) fn read_plan(path: &Path) -> anyhow::Result<Result<Plan, ValidationReport>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let codec = if path.extension().is_some_and(|e| e == "msgpack") {
        Codec::MsgPack
    } else {
        Codec::Json
    };
    Ok(codec.decode::<Plan>(&bytes).map_err(|e| {
        ValidationReport::single(Problem::new(ProblemCode::Malformed, "", e.to_string()))
    }))
}

/// Validates a plan file. Exit code 0 when valid, 1 when not.
pub(crate) fn validate(
    path: &Path,
    json: bool,
    ctx: &ValidationContext,
) -> anyhow::Result<ExitCode> {
    let (report, subtasks) = match read_plan(path)? {
        Ok(plan) => (validate_plan(&plan, ctx), plan.subtasks.len()),
        Err(report) => (report, 0),
    };
    let valid = report.is_valid();
    if json {
        let out = Output {
            file: path.display().to_string(),
            valid,
            subtasks,
            report: &report,
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        let name = path.display();
        if valid {
            println!(
                "✓ {name}: valid ({subtasks} subtasks, {} warnings)",
                report.warnings.len()
            );
        } else {
            println!(
                "✗ {name}: {} error(s), {} warning(s)",
                report.errors.len(),
                report.warnings.len()
            );
        }
        for p in &report.errors {
            println!("  error   {p}");
        }
        for p in &report.warnings {
            println!("  warning {p}");
        }
    }
    Ok(if valid {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
