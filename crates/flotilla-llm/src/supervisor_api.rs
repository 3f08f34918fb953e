//! One request of an LLM tool to the supervisor's API (`<prefix>.api.team.*`) over the
//! agent's own connection, with every way it can go wrong turned into the tool's error for the
//! model: a refusal names its rule or code, no supervisor says so (the model carries on
//! without), and a lost answer says what may already have happened.

use std::time::Duration;

use flotilla_context::AgentContext;
use flotilla_model::api::{ApiError, ApiRequest};

use crate::tools::ToolOutcome;

/// How long a tool waits for the supervisor's answer.
pub(crate) const TIMEOUT: Duration = Duration::from_secs(15);

/// What a tool tells the model when its request got no answer: the error `code` and what may
/// have happened (`message`).
pub(crate) struct Lost<'a> {
    pub(crate) code: &'a str,
    pub(crate) message: &'a str,
}

/// Sends `request`: the supervisor's reply, or the tool's error. `missing` says what is not
/// available without a supervisor.
pub(crate) async fn ask<R: ApiRequest>(
    ctx: &AgentContext,
    request: &R,
    missing: &str,
    lost: Lost<'_>,
) -> Result<R::Reply, ToolOutcome> {
    let body =
        serde_json::to_vec(request).map_err(|e| ToolOutcome::err("internal", e.to_string()))?;
    let bus = ctx.clients().bus();
    let subject = bus.names().api(R::ENDPOINT);
    let reply =
        match tokio::time::timeout(TIMEOUT, bus.client().request(subject, body.into())).await {
            Err(_) => {
                return Err(ToolOutcome::err(
                    lost.code,
                    format!(
                        "no answer from the supervisor within {TIMEOUT:?}: {}",
                        lost.message
                    ),
                ));
            }
            Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
                return Err(ToolOutcome::err(
                    "no_supervisor",
                    format!("no supervisor runs in this deployment: {missing}"),
                ));
            }
            Ok(Err(e)) => return Err(ToolOutcome::err("unavailable", e.to_string())),
            Ok(Ok(reply)) => reply,
        };
    if reply
        .headers
        .as_ref()
        .is_some_and(|h| h.get("Nats-Service-Error-Code").is_some())
    {
        let e: ApiError = serde_json::from_slice(&reply.payload)
            .map_err(|e| ToolOutcome::err("internal", e.to_string()))?;
        let code = e.rule.as_deref().unwrap_or(&e.code).to_owned();
        return Err(ToolOutcome::err(&code, e.message));
    }
    serde_json::from_slice(&reply.payload).map_err(|e| ToolOutcome::err("internal", e.to_string()))
}
