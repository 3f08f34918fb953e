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

use std::time::Duration;

use flotilla_context::AgentContext;
use flotilla_model::api::{ApiError, ApiRequest};
use flotilla_model::ids::TaskId;
use flotilla_model::recruit::{RecruitReply, RecruitRequest};
use serde_json::{Value, json};

use crate::tools::ToolOutcome;

/// The tool's name, as `tools` lists it.
pub const RECRUIT: &str = "recruit";

/// How long the tool waits for the supervisor's answer.
const TIMEOUT: Duration = Duration::from_secs(15);

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
    let body = match serde_json::to_vec(&request) {
        Ok(b) => b,
        Err(e) => return ToolOutcome::err("internal", e.to_string()),
    };
    let bus = ctx.clients().bus();
    let subject = bus.names().api(RecruitRequest::ENDPOINT);
    let reply = match tokio::time::timeout(TIMEOUT, bus.client().request(subject, body.into()))
        .await
    {
        Err(_) => {
            return ToolOutcome::err(
                "uncertain",
                format!(
                    "no answer from the supervisor within {TIMEOUT:?}: recruit {recruit_id} may or may not have happened; watch for a task recruit-{recruit_id} and do not ask again for the same help"
                ),
            );
        }
        Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
            return ToolOutcome::err(
                "no_supervisor",
                "no supervisor runs in this deployment: recruiting is not available; carry on with the team you have",
            );
        }
        Ok(Err(e)) => return ToolOutcome::err("unavailable", e.to_string()),
        Ok(Ok(reply)) => reply,
    };
    if reply
        .headers
        .as_ref()
        .is_some_and(|h| h.get("Nats-Service-Error-Code").is_some())
    {
        let e: ApiError = match serde_json::from_slice(&reply.payload) {
            Ok(e) => e,
            Err(e) => return ToolOutcome::err("internal", e.to_string()),
        };
        let code = e.rule.as_deref().unwrap_or(&e.code).to_owned();
        return ToolOutcome::err(&code, e.message);
    }
    match serde_json::from_slice::<RecruitReply>(&reply.payload) {
        Ok(r) => ToolOutcome::ok(json!({
            "recruit_id": r.recruit_id,
            "status": r.status.as_str(),
            "task_id": r.task_id,
            "refusal": r.refusal,
        })),
        Err(e) => ToolOutcome::err("internal", e.to_string()),
    }
}
