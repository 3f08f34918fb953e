//! The agents of the negotiation example: a lead that puts a piece of work out to tender
//! over mailboxes (contract net) and analysts that bid for it.
//!
//! The analysts are deterministic: each bids the confidence its task's `input` gives it,
//! where a model would judge its own fitness for the request, and "does the work" with a
//! small calculation. What the example shows is the protocol and the machinery — requests,
//! offers, the award, the delegated work and its answer, all durable mailbox messages of one
//! run — not judgement.

use std::sync::Arc;
use std::time::Duration;

use flotilla_context::{Agent, AgentContext, AgentError, AgentReply};
use flotilla_model::mailbox::MailboxKind;
use flotilla_model::plan::{Plan, PlanConfig, Subtask};
use flotilla_model::task::TaskEnvelope;
use flotilla_worker::AgentRegistry;
use futures::future::BoxFuture;
use serde_json::{Value, json};

/// How long the lead waits for offers, and analysts for requests and awards.
const WAIT: Duration = Duration::from_secs(20);

/// The lead: asks the candidates named in its input for offers, delegates the work to the
/// most confident one (ties to the lowest id) and answers with the winner's result.
#[derive(Debug)]
pub(crate) struct Lead;

/// An analyst: waits for a call for offers, bids its input's `confidence`, and — when
/// awarded — computes the margin the delegation asks for and sends it back.
#[derive(Debug)]
pub(crate) struct Analyst;

fn failed(e: impl std::fmt::Display) -> AgentError {
    AgentError::failed(e.to_string())
}

impl Agent for Lead {
    fn run<'a>(
        &'a self,
        task: &'a TaskEnvelope,
        ctx: AgentContext,
    ) -> BoxFuture<'a, Result<AgentReply, AgentError>> {
        Box::pin(async move {
            let candidates: Vec<String> = task.input["candidates"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default();
            let mailbox = ctx.mailbox();
            let award = mailbox
                .negotiate(
                    &candidates,
                    json!({"task": task.description}),
                    task.input["work"].clone(),
                    WAIT,
                )
                .await
                .map_err(failed)?
                .ok_or_else(|| failed("no analyst offered before the deadline"))?;
            // The winner answers with an `info` message carrying the negotiation's id.
            let until = tokio::time::Instant::now() + WAIT;
            loop {
                let left = until.saturating_duration_since(tokio::time::Instant::now());
                if left.is_zero() {
                    return Err(failed(format!("{} never sent its result", award.winner)));
                }
                let page = mailbox.receive(None, left).await.map_err(failed)?;
                let answer = page.messages.into_iter().find(|m| {
                    m.kind == MailboxKind::Info
                        && m.from == award.winner
                        && m.correlation_id.as_deref() == Some(award.correlation_id.as_str())
                });
                if let Some(answer) = answer {
                    let offers: Vec<String> = award
                        .offers
                        .iter()
                        .map(|o| format!("{} {:.2}", o.from, o.confidence))
                        .collect();
                    return Ok(AgentReply {
                        response: format!(
                            "offers: {}; awarded to {}; result: {}",
                            offers.join(", "),
                            award.winner,
                            answer.payload["result"].as_str().unwrap_or_default()
                        ),
                        numeric_value: answer.payload["margin"].as_f64(),
                        ..AgentReply::default()
                    });
                }
            }
        })
    }
}

impl Agent for Analyst {
    fn run<'a>(
        &'a self,
        task: &'a TaskEnvelope,
        ctx: AgentContext,
    ) -> BoxFuture<'a, Result<AgentReply, AgentError>> {
        Box::pin(async move {
            let confidence = task.input["confidence"].as_f64().unwrap_or(0.5);
            let mailbox = ctx.mailbox();
            let request = mailbox
                .next_request(WAIT)
                .await
                .map_err(failed)?
                .ok_or_else(|| failed("no call for offers arrived"))?;
            mailbox
                .offer(&request, confidence, json!({"approach": task.description}))
                .await
                .map_err(failed)?;
            let Some(delegation) = mailbox.await_award(&request, WAIT).await.map_err(failed)?
            else {
                return Ok(AgentReply::text(format!(
                    "offered {confidence:.2}; not chosen"
                )));
            };
            let revenue = delegation.payload["revenue"].as_f64().unwrap_or(0.0);
            let cost = delegation.payload["cost"].as_f64().unwrap_or(0.0);
            let margin = if revenue == 0.0 {
                0.0
            } else {
                (revenue - cost) / revenue * 100.0
            };
            let margin = (margin * 10.0).round() / 10.0;
            let result = format!("gross margin {margin}%");
            mailbox
                .send(
                    &request.from,
                    MailboxKind::Info,
                    json!({"result": result, "margin": margin}),
                    request.correlation_id.as_deref(),
                )
                .await
                .map_err(failed)?;
            Ok(AgentReply {
                response: format!("offered {confidence:.2}; awarded; {result}"),
                numeric_value: Some(margin),
                ..AgentReply::default()
            })
        })
    }
}

/// The plan: the lead and two analysts run side by side (no dependencies); they meet in
/// their mailboxes.
pub(crate) fn plan() -> Plan {
    let mut lead = Subtask::new("lead", "work out the Q3 gross margin").with_agent("lead");
    lead.input = json!({
        "candidates": ["analyst_a", "analyst_b"],
        "work": {"quarter": "Q3", "revenue": 1250.0, "cost": 760.0},
    });
    let mut a = Subtask::new("analyst_a", "use the ledger totals").with_agent("analyst");
    a.input = json!({"confidence": 0.6});
    let mut b = Subtask::new("analyst_b", "use the audited statement").with_agent("analyst");
    b.input = json!({"confidence": 0.9});
    Plan {
        fork: None,
        name: Some("negotiation".into()),
        query: Some("What was the Q3 gross margin?".into()),
        subtasks: vec![lead, a, b],
        config: PlanConfig::default(),
    }
}

/// A worker's agents for the plan.
pub(crate) fn registry() -> AgentRegistry {
    let mut r = AgentRegistry::default();
    r.insert("lead", Arc::new(Lead));
    r.insert("analyst", Arc::new(Analyst));
    r
}
