//! The lead's tools (the `supervisor` strategy): `assign_task` lets one of the run's held
//! subtasks run, `finish_run` ends the run with its final answer
//! (`<prefix>.api.team.assign`, `<prefix>.api.team.finish`).
//!
//! Opt-in: a lead's agent definition lists them in `tools` (with `recruit` to grow the team).
//! They act on the run of the agent's envelope — for a lead's turn, the run it leads. The
//! supervisor checks the run (led, running, the task waiting for an assignment); a refusal
//! reaches the model as the tool's error, naming its code. Both are idempotent (an assigned
//! task, a finished run), so a turn replayed after a lost host cannot double them.

use flotilla_context::AgentContext;
use flotilla_model::ids::TaskId;
use flotilla_model::lead::{AssignRequest, FinishRequest, LEAD_NAME};
use serde_json::{Value, json};

use crate::tools::ToolOutcome;

/// Runs one held subtask.
pub const ASSIGN_TASK: &str = "assign_task";
/// Ends the run.
pub const FINISH_RUN: &str = "finish_run";
/// The lead's tools.
pub const TOOLS: &[&str] = &[ASSIGN_TASK, FINISH_RUN];

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
        _ => None,
    }
}

fn text(args: &Value, key: &str) -> String {
    args.get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

/// Runs one of [`TOOLS`].
pub(crate) async fn call(ctx: &AgentContext, name: &str, args: &Value) -> ToolOutcome {
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
