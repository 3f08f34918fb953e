//! Contract-net as tools: an LLM agent negotiates with its teammates (`negotiate`) or answers
//! a call for offers (`next_request`, `offer`, `await_award`) over the run tree's mailboxes,
//! with the same library the CLI and the API use ([`flotilla_context::negotiate`]).
//!
//! | Tool | Arguments | Result |
//! |---|---|---|
//! | `negotiate` | `candidates` (task ids, `role:<name>`), `request`, `work`, `deadline_ms`? (default 5,000, at most 30,000) | `{outcome: "awarded" \| "no_offers", correlation_id, candidates, winner?, confidence?, offers, delegation_seq?}` |
//! | `next_request` | `wait_ms`? (at most 30,000) | `{request: MESSAGE or null}` |
//! | `offer` | `correlation_id`, `confidence` (number), `payload`? | `{seq, n, duplicate}` |
//! | `await_award` | `correlation_id`, `wait_ms`? (at most 30,000) | `{awarded, delegation: MESSAGE or null}` |
//!
//! Three responder tools rather than one: a model decides between them (whether to offer at
//! all, and how confidently) after reading the request, which a combined tool would hide.
//! Every wait is bounded (30 s), and every problem — no candidates, a role nobody plays
//! (`unknown_role`), a request that does not exist — comes back as the tool's
//! `{"error": {"code", "message"}}`. No offers in time is not an error: the result says
//! `outcome: "no_offers"` and the candidates were told the negotiation is closed.
//!
//! A negotiation's correlation id is the attempt's id and the model's tool call id, so a
//! redelivered attempt that replays the call reuses its requests and finds the offers made.

use std::time::Duration;

use flotilla_context::{AgentContext, ContextError};
use serde_json::{Value, json};

use crate::call::child_call_key;

/// The contract-net tools (opt-in built-in tools, listed in [`crate::config::OPT_IN_TOOLS`]).
pub const TOOLS: [&str; 4] = ["negotiate", "next_request", "offer", "await_award"];

/// Longest wait of any contract-net tool, in milliseconds.
pub const MAX_WAIT_MS: u64 = 30_000;

/// `negotiate`'s deadline when the model gives none.
const DEFAULT_DEADLINE_MS: u64 = 5_000;

/// The description and parameter schema of `name`, when it is a contract-net tool.
pub(crate) fn spec(name: &str) -> Option<(&'static str, Value)> {
    Some(match name {
        "negotiate" => (
            "Asks other tasks of the team for offers on a piece of work and delegates it to the most confident one (contract-net). Candidates are task ids, or role:<name> for every task playing that role. Waits up to deadline_ms for the offers.",
            json!({"type": "object", "properties": {
                "candidates": {"type": "array", "items": {"type": "string"}, "minItems": 1, "description": "Task ids, or role:<name> for every task playing the role"},
                "request": {"description": "What you need done, sent to every candidate (any JSON)"},
                "work": {"description": "The work handed to the winner (any JSON)"},
                "deadline_ms": {"type": "integer", "minimum": 1, "maximum": MAX_WAIT_MS, "description": "How long to collect offers (default 5000)"}
            }, "required": ["candidates", "request", "work"], "additionalProperties": false}),
        ),
        "next_request" => (
            "Returns the next call for offers another task sent you (a message of type request), or null when there is none within wait_ms.",
            json!({"type": "object", "properties": {
                "wait_ms": {"type": "integer", "minimum": 0, "maximum": MAX_WAIT_MS, "description": "Wait this long for one (default 0)"}
            }, "additionalProperties": false}),
        ),
        "offer" => (
            "Offers to do the work of a call for offers, with how confident you are (the highest confidence wins).",
            json!({"type": "object", "properties": {
                "correlation_id": {"type": "string", "minLength": 1, "description": "The request's correlation_id"},
                "confidence": {"type": "number", "description": "How well you can do it, e.g. 0 to 1"},
                "payload": {"description": "Anything the requester should know (any JSON)"}
            }, "required": ["correlation_id", "confidence"], "additionalProperties": false}),
        ),
        "await_award" => (
            "Waits for the outcome of a request you offered on: awarded true with the delegated work, or false when another task won or nothing was decided within wait_ms.",
            json!({"type": "object", "properties": {
                "correlation_id": {"type": "string", "minLength": 1, "description": "The request's correlation_id"},
                "wait_ms": {"type": "integer", "minimum": 0, "maximum": MAX_WAIT_MS, "description": "Wait this long (default 0)"}
            }, "required": ["correlation_id"], "additionalProperties": false}),
        ),
        _ => return None,
    })
}

fn wait_of(args: &Value, key: &str, default: u64) -> Duration {
    Duration::from_millis(
        args.get(key)
            .and_then(Value::as_u64)
            .unwrap_or(default)
            .min(MAX_WAIT_MS),
    )
}

fn str_arg<'a>(args: &'a Value, key: &str) -> &'a str {
    args.get(key).and_then(Value::as_str).unwrap_or_default()
}

/// Runs contract-net tool `name` (its arguments already checked against its schema).
pub(crate) async fn call(
    ctx: &AgentContext,
    call_id: &str,
    name: &str,
    args: &Value,
) -> Result<Value, ContextError> {
    let mbox = ctx.mailbox();
    Ok(match name {
        "negotiate" => {
            let candidates: Vec<String> = args
                .get("candidates")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default();
            let correlation = ctx
                .clients()
                .scope()
                .attempt_id
                .map(|a| format!("{a}.neg-{}", child_call_key(call_id)));
            let negotiated = mbox
                .run_negotiation(
                    correlation.as_deref(),
                    &candidates,
                    args.get("request").cloned().unwrap_or(Value::Null),
                    args.get("work").cloned().unwrap_or(Value::Null),
                    wait_of(args, "deadline_ms", DEFAULT_DEADLINE_MS),
                )
                .await?;
            serde_json::to_value(negotiated.reply()).unwrap_or(Value::Null)
        }
        "next_request" => {
            let request = mbox.next_request(wait_of(args, "wait_ms", 0)).await?;
            json!({ "request": request })
        }
        "offer" => {
            let request = mbox.find_request(str_arg(args, "correlation_id")).await?;
            let confidence = args
                .get("confidence")
                .and_then(Value::as_f64)
                .unwrap_or(f64::NAN);
            let sent = mbox
                .offer(
                    &request,
                    confidence,
                    args.get("payload").cloned().unwrap_or(Value::Null),
                )
                .await?;
            serde_json::to_value(sent).unwrap_or(Value::Null)
        }
        _ => {
            let request = mbox.find_request(str_arg(args, "correlation_id")).await?;
            let delegation = mbox
                .await_award(&request, wait_of(args, "wait_ms", 0))
                .await?;
            json!({ "awarded": delegation.is_some(), "delegation": delegation })
        }
    })
}
