//! One request of an LLM tool to Flotilla's API — the supervisor's (`<prefix>.api.team.*`),
//! or the coordinators' for a lead's member pause — over the agent's own connection, with
//! every way it can go wrong turned into the tool's error for the model: a refusal names its
//! rule or code, a missing service says so (the model carries on without), and a lost answer
//! says what may already have happened.

use std::time::Duration;

use flotilla_context::AgentContext;
use flotilla_model::api::{ApiError, ApiRequest};

use crate::call::ToolOutcome;

/// How long a tool waits for the supervisor's answer.
pub(crate) const TIMEOUT: Duration = Duration::from_secs(15);

/// What a tool tells the model when its request got no answer: the error `code` and what may
/// have happened (`message`).
pub(crate) struct Lost<'a> {
    pub(crate) code: &'a str,
    pub(crate) message: &'a str,
}

/// The service that answers `endpoint`: `team.*` is the supervisor's, the rest the
/// coordinators'.
fn service_of(endpoint: &str) -> &'static str {
    if endpoint.starts_with("team.") {
        "supervisor"
    } else {
        "coordinator"
    }
}

/// Sends `request`: the service's reply, or the tool's error. `missing` says what is not
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
    // A request the agent's NATS user may not make gets no answer: the server's refusal,
    // reported on the side, is the answer, at once and by name.
    let sent = tokio::time::timeout(TIMEOUT, bus.client().request(subject.clone(), body.into()));
    let reply = match bus.refusable(|s| s == subject, sent).await {
        Err(refusal) => {
            return Err(ToolOutcome::err(
                "permission_denied",
                format!("{}: {refusal}", R::ENDPOINT),
            ));
        }
        Ok(sent) => sent,
    };
    let reply = match reply {
        Err(_) => {
            return Err(ToolOutcome::err(
                lost.code,
                format!(
                    "no answer from the {} within {TIMEOUT:?}: {}",
                    service_of(R::ENDPOINT),
                    lost.message
                ),
            ));
        }
        Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
            let service = service_of(R::ENDPOINT);
            return Err(ToolOutcome::err(
                &format!("no_{service}"),
                format!("no {service} runs in this deployment: {missing}"),
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
