//! The lead's tools (the `supervisor` strategy): `assign_task` lets one of the run's held
//! subtasks run, `finish_run` ends the run with its final answer
//! (`<prefix>.api.team.assign`, `<prefix>.api.team.finish`), and `pause_member` /
//! `resume_member` hold one member's task and let it go again (`<prefix>.api.run.pause` and
//! `run.resume` with `task_id`, by `lead`).
//!
//! Opt-in: a lead's agent definition lists them in `tools` (with `recruit` to grow the team).
//! They act on the run of the agent's envelope — for a lead's turn, the run it leads. The
//! supervisor checks the run (led, running, the task waiting for an assignment), the
//! coordinator a pause (the task is the run's, not ended); a refusal reaches the model as the
//! tool's error, naming its code. All are idempotent (an assigned task, a finished run, a
//! paused or resumed task), so a turn replayed after a lost host cannot double them.

use flotilla_context::AgentContext;
use flotilla_model::control::{PauseRunRequest, ResumeRunRequest};
use flotilla_model::ids::TaskId;
use flotilla_model::lead::{AssignRequest, FinishRequest, LEAD_NAME};
use serde_json::{Value, json};

use crate::call::ToolOutcome;

pub use crate::config::{ASSIGN_TASK, FINISH_RUN, PAUSE_MEMBER, RESUME_MEMBER};
/// The lead's tools.
pub const TOOLS: &[&str] = &[ASSIGN_TASK, FINISH_RUN, PAUSE_MEMBER, RESUME_MEMBER];

/// Longest pause a lead may ask for, in seconds (a person's `run.pause` may ask for more).
const MAX_PAUSE_SECONDS: u64 = 24 * 3600;

/// The tool's description and parameters.
pub(crate) fn spec(name: &str) -> Option<(&'static str, Value)> {
    match name {
        ASSIGN_TASK => Some((
            "Lets one task of the plan you lead run (it starts once its dependencies succeeded). You are mailed when it ends.",
            json!({"type": "object", "properties": {
                "task_id": {"type": "string", "description": "The task to run"},
                "reason": {"type": "string", "description": "Why now (recorded)"}
            }, "required": ["task_id"], "additionalProperties": false}),
        )),
        FINISH_RUN => Some((
            "Ends the run you lead with its final answer. Tasks not assigned are skipped; running ones are cancelled.",
            json!({"type": "object", "properties": {
                "result": {"type": "string", "description": "The run's final answer"}
            }, "required": ["result"], "additionalProperties": false}),
        )),
        PAUSE_MEMBER => Some((
            "Pauses one task of the run you lead (a member's work): it is not started, and if it is running its agent stops at its next step and waits; the rest of the run goes on. It resumes when you call resume_member, or by itself after `seconds`.",
            json!({"type": "object", "properties": {
                "task_id": {"type": "string", "description": "The task to pause"},
                "reason": {"type": "string", "description": "Why (recorded)"},
                "seconds": {"type": "integer", "minimum": 1, "maximum": MAX_PAUSE_SECONDS, "description": "How long at most (default 24 hours)"}
            }, "required": ["task_id"], "additionalProperties": false}),
        )),
        RESUME_MEMBER => Some((
            "Resumes a task you paused with pause_member: it runs once its dependencies are met, a stopped agent from where it stopped.",
            json!({"type": "object", "properties": {
                "task_id": {"type": "string", "description": "The task to resume"},
                "reason": {"type": "string", "description": "Why (recorded)"}
            }, "required": ["task_id"], "additionalProperties": false}),
        )),
        _ => None,
    }
}

fn text(args: &Value, key: &str) -> String {
    args.get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

/// Pauses or resumes one member's task of the lead's run through the coordinator.
async fn hold_member(ctx: &AgentContext, name: &str, args: &Value) -> ToolOutcome {
    let run_id = ctx.clients().scope().run_id;
    let task_id = TaskId::new(text(args, "task_id"));
    let reason = Some(text(args, "reason")).filter(|r| !r.is_empty());
    let by = Some(LEAD_NAME.to_owned());
    let missing = "no coordinator answers in this deployment";
    let lost = crate::supervisor_api::Lost {
        code: "uncertain",
        message: "the request may have been recorded; asking again is safe",
    };
    let reply = if name == PAUSE_MEMBER {
        let timeout_ms = match args.get("seconds") {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_u64().filter(|s| (1..=MAX_PAUSE_SECONDS).contains(s)) {
                Some(s) => Some(s * 1000),
                None => {
                    return ToolOutcome::err(
                        "invalid_arguments",
                        format!("seconds must be a whole number from 1 to {MAX_PAUSE_SECONDS}"),
                    );
                }
            },
        };
        let request = PauseRunRequest {
            protocol: flotilla_model::PROTOCOL_VERSION,
            run_id,
            reason,
            by,
            timeout_ms,
            children: false,
            task_id: Some(task_id.clone()),
        };
        crate::supervisor_api::ask(ctx, &request, missing, lost).await
    } else {
        let request = ResumeRunRequest {
            protocol: flotilla_model::PROTOCOL_VERSION,
            run_id,
            reason,
            by,
            children: false,
            task_id: Some(task_id.clone()),
        };
        crate::supervisor_api::ask(ctx, &request, missing, lost).await
    };
    match reply {
        // `applied` false: the task was already so, or has ended.
        Ok(r) => ToolOutcome::ok(json!({
            "task_id": task_id,
            "changed": r.applied,
            "run_status": r.status.as_str(),
        })),
        Err(outcome) => outcome,
    }
}

/// Runs one of [`TOOLS`].
pub(crate) async fn call(ctx: &AgentContext, name: &str, args: &Value) -> ToolOutcome {
    if name == PAUSE_MEMBER || name == RESUME_MEMBER {
        return hold_member(ctx, name, args).await;
    }
    let run_id = ctx.clients().scope().run_id;
    let missing = "there is no supervisor to lead through; answer directly";
    let reply = if name == ASSIGN_TASK {
        let request = AssignRequest {
            protocol: flotilla_model::PROTOCOL_VERSION,
            run_id,
            task_id: TaskId::new(text(args, "task_id")),
            reason: text(args, "reason"),
            by: Some(LEAD_NAME.to_owned()),
        };
        crate::supervisor_api::ask(
            ctx,
            &request,
            missing,
            crate::supervisor_api::Lost {
                code: "uncertain",
                message: "the assignment may have been recorded; assigning the same task again is safe",
            },
        )
        .await
    } else {
        let request = FinishRequest {
            protocol: flotilla_model::PROTOCOL_VERSION,
            run_id,
            result: text(args, "result"),
            by: Some(LEAD_NAME.to_owned()),
        };
        crate::supervisor_api::ask(
            ctx,
            &request,
            missing,
            crate::supervisor_api::Lost {
                code: "uncertain",
                message: "the finish may have been recorded; finishing again is safe",
            },
        )
        .await
    };
    match reply {
        Ok(r) => ToolOutcome::ok(json!({
            "status": r.status.as_str(),
            "task_id": r.task_id,
        })),
        Err(outcome) => outcome,
    }
}
