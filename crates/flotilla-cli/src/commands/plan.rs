//! `flotilla plan validate FILE`.

use std::path::Path;
use std::process::ExitCode;

use std::time::Duration;

use anyhow::Context;
use flotilla_bus::Bus;
use flotilla_client::Client;
use flotilla_model::Plan;
use flotilla_model::codec::Codec;
use flotilla_model::validate::{
    DEFAULT_MAX_PAYLOAD, MAX_REPORTED_PROBLEMS, PLAN_ENVELOPE_ROOM, ValidationContext,
    ValidationReport, truncate_problems, validate_plan,
};
use serde::Serialize;

use crate::config::Config;

#[derive(Serialize)]
struct Output<'a> {
    file: String,
    valid: bool,
    subtasks: usize,
    /// `deployment` (a coordinator validated it against the running installation) or
    /// `offline` (against the local config only).
    checked: &'static str,
    /// What an offline validation could not check.
    #[serde(skip_serializing_if = "Option::is_none")]
    note: Option<String>,
    #[serde(flatten)]
    report: &'a ValidationReport,
}

/// A plan file's bytes and how they are encoded (`.msgpack`: MessagePack, else JSON).
fn read_file(path: &Path) -> anyhow::Result<(Codec, Vec<u8>)> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let codec = if path.extension().is_some_and(|e| e == "msgpack") {
        Codec::MsgPack
    } else {
        Codec::Json
    };
    Ok((codec, bytes))
}

/// Reads a plan file. A document that does not decode is not an error but a report of every
/// problem in it: each field of the wrong type, unknown or missing, and what validation
/// against `ctx` finds in the rest.
pub(crate) fn read_plan(
    path: &Path,
    ctx: &ValidationContext,
) -> anyhow::Result<Result<Plan, ValidationReport>> {
    let (codec, bytes) = read_file(path)?;
    Ok(codec.decode::<Plan>(&bytes).map_err(|_| ValidationReport {
        errors: flotilla_model::lenient::plan_problems(codec, &bytes, ctx),
        warnings: Vec::new(),
    }))
}

/// Asks a coordinator of the deployment to validate `plan`; `Err` says why that was not
/// possible (no NATS, no coordinator).
async fn validate_online(config: &Config, plan: &Plan) -> Result<ValidationReport, String> {
    let mut nats = config.nats.clone();
    nats.connect_timeout = nats.connect_timeout.min(Duration::from_secs(2));
    let bus = Bus::connect(&nats, "flotilla-cli")
        .await
        .map_err(|e| e.to_string())?;
    let reply = Client::new(bus)
        .validate(plan)
        .await
        .map_err(|e| e.to_string())?;
    Ok(ValidationReport {
        errors: reply.errors,
        warnings: reply.warnings,
    })
}

/// What an offline validation knows: the default message size and — unless
/// `structure_only` — the local config's pools and agents.
fn offline_context(config: &Config, structure_only: bool) -> ValidationContext {
    let mut ctx = if structure_only {
        ValidationContext::default()
    } else {
        config.validation_context()
    };
    ctx.limits.max_plan_bytes = Some(DEFAULT_MAX_PAYLOAD - PLAN_ENVELOPE_ROOM);
    ctx
}

/// Validates without a coordinator: the plan's structure, the default message size and —
/// unless `structure_only` — the local config's pools and agents.
fn validate_offline(
    config: &Config,
    plan: &Plan,
    structure_only: bool,
) -> (ValidationReport, String) {
    let ctx = offline_context(config, structure_only);
    let mut unchecked = vec![
        "live workers".to_owned(),
        "the deployment's message size (assumed 1 MiB)".to_owned(),
    ];
    if structure_only {
        unchecked.insert(0, "pools and agents (--offline)".into());
    } else if ctx.agents.is_none() {
        unchecked.insert(0, "agent names (the local config defines no agents)".into());
    }
    (
        validate_plan(plan, &ctx),
        format!(
            "validated offline against the local config; not checked: {}",
            unchecked.join(", ")
        ),
    )
}

/// Validates a plan file. Exit code 0 when valid, 1 when not.
///
/// A file that does not decode is read field by field: the fields that cannot be read are
/// reported, and the rest of the plan (without them: their defaults apply) is validated like
/// any plan — against the deployment when a coordinator answers — so one wrong type hides
/// nothing else.
pub(crate) async fn validate(
    config: &Config,
    path: &Path,
    json: bool,
    offline: bool,
) -> anyhow::Result<ExitCode> {
    let (codec, bytes) = read_file(path)?;
    let (plan, unread) = match codec.decode::<Plan>(&bytes) {
        Ok(plan) => (Some(plan), Vec::new()),
        Err(_) => {
            let read = flotilla_model::lenient::read_plan(codec, &bytes);
            (read.plan, read.problems)
        }
    };
    let (report, subtasks, checked, note) = match plan {
        Some(plan) => {
            let online = if offline {
                Err("--offline".to_owned())
            } else {
                validate_online(config, &plan).await
            };
            let (mut report, checked, mut note) = match online {
                Ok(report) => (report, "deployment", None),
                Err(why) => {
                    let (report, mut note) = validate_offline(config, &plan, offline);
                    if !offline {
                        note = format!("{note} (no coordinator to ask: {why})");
                    }
                    (report, "offline", Some(note))
                }
            };
            if !unread.is_empty() {
                let mut errors = unread;
                flotilla_model::lenient::add_unreported(&mut errors, report.errors);
                report.errors = truncate_problems(errors, MAX_REPORTED_PROBLEMS);
                let left_out = "the fields that could not be read were left out (their defaults apply) to check the rest";
                note = Some(match note {
                    Some(n) => format!("{n}; {left_out}"),
                    None => left_out.to_owned(),
                });
            }
            (report, plan.subtasks.len(), checked, note)
        }
        None => (
            ValidationReport {
                errors: unread,
                warnings: Vec::new(),
            },
            0,
            "offline",
            Some(
                "the file holds no plan document (an object of plan fields), so nothing else in it could be checked, against the deployment or the local config"
                    .to_owned(),
            ),
        ),
    };
    let valid = report.is_valid();
    if json {
        let out = Output {
            file: path.display().to_string(),
            valid,
            subtasks,
            checked,
            note,
            report: &report,
        };
        outln!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        let name = path.display();
        if let Some(note) = &note {
            errln!("note: {note}");
        }
        if valid {
            outln!(
                "✓ {name}: valid ({subtasks} subtasks, {} warnings; checked {checked})",
                report.warnings.len()
            );
        } else {
            outln!(
                "✗ {name}: {} error(s), {} warning(s)",
                report.errors.len(),
                report.warnings.len()
            );
        }
        for p in &report.errors {
            outln!("  error   {p}");
        }
        for p in &report.warnings {
            outln!("  warning {p}");
        }
    }
    Ok(if valid {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
