//! Tool calls that wait for a person, enforced here — never left to the model.
//!
//! Before a round of tool calls runs, each call is checked against the task's
//! [`ToolGate`](flotilla_model::task::ToolGate) (the run's escalation policy: every call under
//! `human_in_command`, tools named as sensitive actions, tools the agent does not have when
//! `out_of_scope` is on), against `ask_user` (a question to the user is always a person's to
//! answer) and against the client's tools (the client runs them and answers with the result;
//! their arguments are checked against the tool's schema first, so the client only sees
//! valid calls). A gated call that nobody has decided stops the attempt
//! ([`AgentContext::suspend`]): the worker reports the suspension and gives its slot back; the
//! coordinator asks a person. The decision dispatches the attempt again — on any worker — and
//! the agent replays its step journal up to this round (no model call paid twice, no tool run
//! twice) and applies it here:
//!
//! - `approve` runs the call as the model made it; `edit` runs it with the person's arguments;
//! - `respond` does not run it: the person's text is the tool's result;
//! - `reject` does not run it: the model reads the rejection (with its message).
//!
//! A decision applies only to the call it was asked about (call id and the digest of the tool
//! name and arguments); a call the journal no longer reproduces is asked about again. A
//! rejected tool is never executed, whatever the model does next: the check is here, before
//! the tool runs, on every delivery.

use flotilla_context::AgentContext;
use flotilla_context::agent::AgentError;
use flotilla_model::approval::{Decision, Trigger, digest_of};
use flotilla_model::runlog::SuspendedCall;
use flotilla_model::task::TaskEnvelope;
use serde_json::{Value, json};

pub use crate::config::ASK_USER;
use crate::provider::ToolCallRequest;
use crate::tools::ToolSet;

/// What to do with one call of a round.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum CallPlan {
    /// Run it, with these arguments (the model's, or a person's edit).
    Run(String),
    /// Do not run it: the model gets this text as the tool's result.
    Answer {
        /// The result.
        text: String,
        /// Whether it counts as a success in the call's `tool_end` event.
        ok: bool,
    },
}

/// The plan of a round: what runs and what a person answered. Stops the attempt (the
/// returned error, after [`AgentContext::suspend`]) at the first gated call nobody decided.
pub(crate) async fn plan_round(
    tools: &ToolSet,
    task: &TaskEnvelope,
    ctx: &AgentContext,
    calls: &[ToolCallRequest],
) -> Result<Vec<CallPlan>, AgentError> {
    let mut plan = Vec::with_capacity(calls.len());
    for call in calls {
        let trigger = if call.name == ASK_USER {
            Some(Trigger::Question)
        } else if tools.is_client(&call.name) {
            if let Err(problem) = tools.checked_arguments(&call.name, &call.arguments) {
                plan.push(CallPlan::Answer {
                    text: problem.text(),
                    ok: false,
                });
                continue;
            }
            Some(Trigger::ClientTool)
        } else {
            task.tool_gate
                .as_ref()
                .and_then(|g| g.trigger(&call.name, tools.has(&call.name)))
        };
        let Some(trigger) = trigger else {
            plan.push(CallPlan::Run(call.arguments.clone()));
            continue;
        };
        let arguments = arguments_value(&call.arguments);
        let digest = digest_of(&call.name, &arguments);
        let Some(decided) = task.decision_for(&call.id, &digest) else {
            // A tool a person approved for the session (`approve --always`) runs without
            // asking again, until the grant is revoked. Only Flotilla writes grants.
            if matches!(trigger, Trigger::SensitiveAction | Trigger::HumanInCommand)
                && granted(ctx, &call.name).await?
            {
                plan.push(CallPlan::Run(call.arguments.clone()));
                continue;
            }
            let question = (trigger == Trigger::Question).then(|| {
                arguments["question"]
                    .as_str()
                    .map_or_else(|| call.arguments.clone(), str::to_owned)
            });
            return Err(ctx.suspend(SuspendedCall {
                trigger,
                call_id: call.id.clone(),
                tool: call.name.clone(),
                arguments,
                digest,
                question,
            }));
        };
        let who = &decided.by;
        // A question and a client's tool are answered, never run here.
        let answered = matches!(trigger, Trigger::Question | Trigger::ClientTool);
        plan.push(match &decided.decision {
            Decision::Approve if answered => CallPlan::Answer {
                text: format!("{who} approved without answering"),
                ok: true,
            },
            Decision::Approve => CallPlan::Run(call.arguments.clone()),
            Decision::Edit { input } if answered => CallPlan::Answer {
                text: text_of(input),
                ok: true,
            },
            Decision::Edit { input } => CallPlan::Run(input.to_string()),
            Decision::Respond { result } => CallPlan::Answer {
                text: result.clone(),
                ok: true,
            },
            Decision::Reject { message } => CallPlan::Answer {
                text: json!({"error": {
                    "code": "rejected",
                    "message": if message.is_empty() {
                        format!("{who} rejected this call; it was not run")
                    } else {
                        format!("{who} rejected this call; it was not run: {message}")
                    },
                }})
                .to_string(),
                ok: false,
            },
        });
    }
    Ok(plan)
}

/// The name an approval gives a model call estimated above the cost limit (trigger `cost`).
pub const MODEL_CALL: &str = "model_call";
/// The name an approval gives a request to extend a budget (trigger `budget`).
pub const EXTEND_BUDGET: &str = "extend_budget";

/// A person's decision about something an attempt may not do on its own at step `step` — a
/// costly model call, a call past its budget — asked about like a tool call named `tool`,
/// showing the person `shown`; the decision is bound to `bound` (its digest), which must be
/// the same on every delivery. Stops the attempt (the returned error, after
/// [`AgentContext::suspend`]) when nobody decided yet.
pub(crate) fn decision_at_step<'t>(
    task: &'t TaskEnvelope,
    ctx: &AgentContext,
    (trigger, step, tool): (Trigger, u32, &str),
    shown: Value,
    bound: &Value,
) -> Result<&'t flotilla_model::task::ToolDecision, AgentError> {
    let call_id = format!("{}-{step}", trigger.as_str());
    let digest = digest_of(tool, bound);
    match task.decision_for(&call_id, &digest) {
        Some(d) => Ok(d),
        None => Err(ctx.suspend(SuspendedCall {
            trigger,
            call_id,
            tool: tool.to_owned(),
            arguments: shown,
            digest,
            question: None,
        })),
    }
}

/// Whether `tool` is approved for the session. A grant that cannot be read is no grant: the
/// call waits for a person (failing closed) — unless the state cannot be reached at all,
/// which fails the attempt to be retried rather than asking a person needlessly.
async fn granted(ctx: &AgentContext, tool: &str) -> Result<bool, AgentError> {
    match ctx.state().tool_grant(tool).await {
        Ok(g) => Ok(g.is_some()),
        Err(e) if e.kind() == flotilla_context::error::ErrorKind::Unavailable => {
            Err(AgentError::failed(format!(
                "reading the session's approval of tool {tool}: {e}"
            )))
        }
        Err(e) => {
            tracing::warn!(tool, error = %e, "Unreadable tool grant; the call waits for a person");
            Ok(false)
        }
    }
}

/// A call's arguments as JSON (a string when they are not JSON).
fn arguments_value(arguments: &str) -> Value {
    if arguments.trim().is_empty() {
        return json!({});
    }
    serde_json::from_str(arguments).unwrap_or_else(|_| Value::String(arguments.to_owned()))
}

fn text_of(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_that_are_not_json_are_kept_as_text() {
        assert_eq!(arguments_value(""), json!({}));
        assert_eq!(arguments_value("{\"a\":1}"), json!({"a": 1}));
        assert_eq!(arguments_value("nope"), json!("nope"));
    }
}
