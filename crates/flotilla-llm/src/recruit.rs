//! The `recruit` tool: an LLM agent asks the supervisor for help — a new member of a role,
//! given one subtask of the agent's own run (`<prefix>.api.team.recruit`).
//!
//! Opt-in: an agent gets it only when its `tools` lists `recruit` (a model that can grow its
//! own team is a deployment's choice). The supervisor's policy decides; a refusal comes back
//! to the model as the tool's error, naming the rule, so it can carry on alone.
//!
//! The recruit id is derived from the attempt and the model's tool call id, so a redelivered
//! attempt replaying the same call asks under the same id and cannot recruit twice. When the
//! answer is lost (no answer within the timeout) the outcome is `uncertain`: the model is
//! told the id and that the recruit may have happened — it is never re-issued automatically.

use flotilla_context::AgentContext;
use flotilla_model::ids::TaskId;
use flotilla_model::recruit::{RecruitReply, RecruitRequest};
use serde_json::{Value, json};

use crate::call::ToolOutcome;

pub use crate::config::RECRUIT;

/// The tool's description and parameters.
pub(crate) fn spec() -> (&'static str, Value) {
    (
        "Asks the supervisor for a new team member of a role to take one piece of work in this run (it runs as a new task; your run waits for it). The supervisor's policy may refuse (the error names the rule). Use it when the work needs a skill the team lacks.",
        json!({"type": "object", "properties": {
            "role": {"type": "string", "description": "The role wanted (e.g. patent_analyst)"},
            "description": {"type": "string", "description": "What the new member is to do"},
            "reason": {"type": "string", "description": "Why the team needs it"},
            "after": {"type": "array", "items": {"type": "string"}, "description": "Task ids it must wait for (their results are given to it)"},
            "produces": {"type": "array", "items": {"type": "string"}, "description": "Workspace topics it writes"}
        }, "required": ["role", "description", "reason"], "additionalProperties": false}),
    )
}

fn strings(args: &Value, key: &str) -> Vec<String> {
    args.get(key)
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// Runs the tool.
pub(crate) async fn recruit(ctx: &AgentContext, call_id: &str, args: &Value) -> ToolOutcome {
    let scope = ctx.clients().scope();
    let attempt = scope.attempt_id.map(|a| a.to_string()).unwrap_or_default();
    let digest = flotilla_model::team::attempt_digest(&format!("{attempt}\u{0}{call_id}"));
    let recruit_id = format!("r{}", &digest[..digest.len().min(16)]);
    let text = |k: &str| {
        args.get(k)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let request = RecruitRequest {
        protocol: flotilla_model::PROTOCOL_VERSION,
        run_id: scope.run_id,
        recruit_id: recruit_id.clone(),
        role: text("role"),
        description: text("description"),
        reason: text("reason"),
        task_id: None,
        dependencies: strings(args, "after")
            .into_iter()
            .map(TaskId::new)
            .collect(),
        produces: strings(args, "produces"),
        consumes: Vec::new(),
        required: false,
        by_task: scope.task_id.clone(),
    };
    let lost = format!(
        "recruit {recruit_id} may or may not have happened; watch for a task recruit-{recruit_id} and do not ask again for the same help"
    );
    let missing = "recruiting is not available; carry on with the team you have";
    let reply: RecruitReply = match crate::supervisor_api::ask(
        ctx,
        &request,
        missing,
        crate::supervisor_api::Lost {
            code: "uncertain",
            message: &lost,
        },
    )
    .await
    {
        Ok(r) => r,
        Err(outcome) => return outcome,
    };
    ToolOutcome::ok(json!({
        "recruit_id": reply.recruit_id,
        "status": reply.status.as_str(),
        "task_id": reply.task_id,
        "refusal": reply.refusal,
    }))
}
