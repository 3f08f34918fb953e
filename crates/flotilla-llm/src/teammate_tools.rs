//! The persistent-teammate tools: `spawn_teammate`, `send_message`, `broadcast`, `list_team`,
//! `shutdown_teammate` — an LLM agent builds and talks to a team of named agents that keep
//! their conversation between turns, through the supervisor's team API
//! (`<prefix>.api.team.spawn | send | broadcast | mates | shutdown`).
//!
//! Opt-in: an agent gets each only when its `tools` lists it (a model that grows a standing
//! team spends turns of other agents; that is a deployment's choice).
//!
//! **The team** is the one `flotilla team ...` picks inside an exec agent: the agent's session
//! key (`FLOTILLA_SESSION_ID`) — the run's session id, else its root run id; inside a
//! teammate's turn, the teammate's own team (the worker runs a turn with the team as its
//! session key). So the tasks of one session, and the teammates they spawn, form one team.
//! **The sender** (`from` of a message, `by` of a spawn) is the agent's task id — inside a
//! teammate's turn, the teammate's name — so a teammate can answer it.
//!
//! Refusals of the supervisor (`duplicate_name`, `unknown_agent`, `not_found`, `shut_down`,
//! `team_full`, …) come back to the model as the tool's error naming the code and change
//! nothing; no supervisor → `no_supervisor`; no answer within the timeout → `timeout`, with
//! what to check before asking again (the request may have been applied).

use flotilla_context::AgentContext;
use flotilla_model::api::ApiRequest;
use flotilla_model::teammate::{
    TeamBroadcastRequest, TeamMatesRequest, TeamSendRequest, TeamShutdownRequest, TeamSpawnRequest,
    TeammateView,
};
use serde_json::{Value, json};

use crate::call::ToolOutcome;

pub use crate::config::{BROADCAST, LIST_TEAM, SEND_MESSAGE, SHUTDOWN_TEAMMATE, SPAWN_TEAMMATE};

/// The tools of this module.
pub const TOOLS: &[&str] = &[
    SPAWN_TEAMMATE,
    SEND_MESSAGE,
    BROADCAST,
    LIST_TEAM,
    SHUTDOWN_TEAMMATE,
];

/// The tool's description and parameters; `None` for a name not of this module.
pub(crate) fn spec(name: &str) -> Option<(&'static str, Value)> {
    Some(match name {
        SPAWN_TEAMMATE => (
            "Spawns a persistent teammate in your team (the team of your session; inside a teammate's turn, that teammate's team): a named agent that keeps its conversation between turns, runs a turn whenever a message reaches it, and costs nothing while idle. Refused (the error names the code) for a name already taken (duplicate_name), an unknown agent (unknown_agent) or a full team (team_full).",
            json!({"type": "object", "properties": {
                "name": {"type": "string", "description": "Its name, its address in the team (letters, digits, _ and -)"},
                "role": {"type": "string", "description": "Its role (e.g. analyst)"},
                "instructions": {"type": "string", "description": "What it is for: given to it on every turn"},
                "agent": {"type": "string", "description": "The agent definition its turns run (default: one filling the role)"}
            }, "required": ["name", "role", "instructions"], "additionalProperties": false}),
        ),
        SEND_MESSAGE => (
            "Sends a message to a teammate of your team by name; it wakes and runs a turn, seeing the message as from your task id. Does not wait for its answer: its reply shows in list_team (last_reply), and it may message you back. Refused for an unknown (not_found) or shut-down (shut_down) teammate.",
            json!({"type": "object", "properties": {
                "to": {"type": "string", "description": "The teammate's name"},
                "text": {"type": "string", "description": "The message"}
            }, "required": ["to", "text"], "additionalProperties": false}),
        ),
        BROADCAST => (
            "Sends one message to every teammate of your team that takes mail (not to yourself); each wakes and runs a turn. Refused when the team has none (no_teammates).",
            json!({"type": "object", "properties": {
                "text": {"type": "string", "description": "The message"}
            }, "required": ["text"], "additionalProperties": false}),
        ),
        LIST_TEAM => (
            "Lists the teammates of your team: name, role, agent, status (spawned, working, idle, shutdown), turns and the start of each one's last reply.",
            json!({"type": "object", "properties": {}, "additionalProperties": false}),
        ),
        SHUTDOWN_TEAMMATE => (
            "Shuts a teammate of your team down: at once when it is idle, else after its current turn. It then refuses mail. Refused for an unknown teammate (not_found).",
            json!({"type": "object", "properties": {
                "name": {"type": "string", "description": "The teammate's name"}
            }, "required": ["name"], "additionalProperties": false}),
        ),
        _ => return None,
    })
}

/// Runs tool `name` (one of [`TOOLS`]) with `args` (already checked against its schema).
pub(crate) async fn call(ctx: &AgentContext, name: &str, args: &Value) -> ToolOutcome {
    let scope = ctx.clients().scope();
    let team = scope.session.clone();
    let me = scope.task_id.as_ref().map(|t| t.as_str().to_owned());
    let text = |k: &str| {
        args.get(k)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let protocol = flotilla_model::PROTOCOL_VERSION;
    let outcome = match name {
        SPAWN_TEAMMATE => {
            let r = TeamSpawnRequest {
                protocol,
                team: Some(team.clone()),
                name: text("name"),
                role: text("role"),
                instructions: text("instructions"),
                agent: args.get("agent").and_then(Value::as_str).map(str::to_owned),
                pool: None,
                by: me,
                expose: false,
            };
            ask(
                ctx,
                &r,
                "the teammate may have been spawned: call list_team before spawning it again",
            )
            .await
            .map(|v| mate(&v, false))
        }
        SEND_MESSAGE => {
            let r = TeamSendRequest {
                protocol,
                team: Some(team.clone()),
                to: text("to"),
                from: me,
                text: text("text"),
            };
            ask(
                ctx,
                &r,
                "the message may have been delivered: sending it again may deliver it twice",
            )
            .await
            .map(|s| json!({"team": team, "delivered": s.delivered, "seqs": s.seqs}))
        }
        BROADCAST => {
            let r = TeamBroadcastRequest {
                protocol,
                team: Some(team.clone()),
                from: me,
                text: text("text"),
            };
            ask(
                ctx,
                &r,
                "the message may have been delivered: broadcasting it again may deliver it twice",
            )
            .await
            .map(|s| json!({"team": team, "delivered": s.delivered, "seqs": s.seqs}))
        }
        LIST_TEAM => {
            let r = TeamMatesRequest {
                protocol,
                team: Some(team.clone()),
            };
            ask(ctx, &r, "nothing changed; ask again later")
                .await
                .map(|m| {
                    json!({
                        "team": team,
                        "teammates": m.teammates.iter().map(|v| mate(v, true)).collect::<Vec<_>>(),
                    })
                })
        }
        SHUTDOWN_TEAMMATE => {
            let r = TeamShutdownRequest {
                protocol,
                team: Some(team.clone()),
                name: text("name"),
            };
            ask(
                ctx,
                &r,
                "the teammate may have been shut down: call list_team to see",
            )
            .await
            .map(|v| mate(&v, false))
        }
        other => Err(ToolOutcome::err(
            "unknown_tool",
            format!("{other:?} is not a teammate tool"),
        )),
    };
    outcome.map_or_else(|e| e, ToolOutcome::ok)
}

/// What the model is shown of a teammate: no transitions, epochs or hosts (the API's
/// `TeammateView` has them for operators).
fn mate(v: &TeammateView, listing: bool) -> Value {
    let mut out = json!({
        "name": v.name,
        "team": v.team,
        "role": v.role,
        "agent": v.agent,
        "status": v.status.as_str(),
        "shutdown_requested": v.shutdown_requested,
    });
    if listing {
        out["turns"] = json!(v.turns);
        out["turns_failed"] = json!(v.turns_failed);
        if let Some(r) = &v.last_reply {
            out["last_reply"] = json!(r);
        }
        if let Some(e) = &v.last_error {
            out["last_error"] = json!(e);
        }
    }
    out
}

/// Asks the supervisor: its answer, or the tool's error (a refusal names its code; `lost`
/// says what a lost answer may mean).
async fn ask<R: ApiRequest>(
    ctx: &AgentContext,
    request: &R,
    lost: &str,
) -> Result<R::Reply, ToolOutcome> {
    crate::supervisor_api::ask(
        ctx,
        request,
        "teammates are not available; carry on without them",
        crate::supervisor_api::Lost {
            code: "timeout",
            message: lost,
        },
    )
    .await
}
