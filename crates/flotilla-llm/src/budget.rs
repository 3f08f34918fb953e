//! Run budgets: the plan's `max_tokens` and `max_cost`, kept across every task and worker of
//! the run.
//!
//! What a run has spent lives in one KV entry, `budget.<run>` in the `<prefix>-cursors`
//! bucket: `{"tokens": …, "cost": …}`. Every model call goes through three steps, each a
//! compare-and-set on that entry, so concurrent calls on any number of workers never pass
//! the budget together:
//!
//! ```text
//! reserve(estimate) ── spent + estimate > limit? ──yes──► budget_exhausted, no call made
//!        │ no: spent += estimate
//!        ▼
//!   model call ──► settle: spent += actual − estimate   (failed call: spent −= estimate)
//! ```
//!
//! The estimate of a call is its prompt (characters ÷ 4, rounded up) plus `max-output-tokens`
//! — set `max-output-tokens` for a hard limit; without it the reservation covers the prompt
//! only and one reply may pass the limit by its own length. Cost uses the agent's `price`
//! (US dollars per million input and output tokens); a run with `max_cost` fails on an agent
//! without a price rather than spend blindly. A worker that dies during a call leaves its
//! reservation counted (the safe side).

use std::time::Duration;

use async_nats::jetstream::kv;
use flotilla_context::{AgentContext, AgentError};
use flotilla_model::subjects::Bucket;
use flotilla_model::task::{Budget, TaskErrorKind};
use serde::{Deserialize, Serialize};

use crate::config::Price;

/// Compare-and-set tries before giving up on a contended entry.
const MAX_TRIES: u32 = 50;

/// What a run has spent (and reserved).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Spent {
    /// Tokens.
    pub tokens: u64,
    /// US dollars.
    pub cost: f64,
}

/// A call's reservation, to settle or release.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reservation {
    tokens: u64,
    cost: f64,
}

/// The budget of one run, as one attempt sees it.
#[derive(Debug)]
pub struct BudgetGuard {
    kv: kv::Store,
    key: String,
    budget: Budget,
    price: Option<Price>,
}

fn exhausted(message: String) -> AgentError {
    AgentError {
        kind: TaskErrorKind::BudgetExhausted,
        message,
    }
}

impl BudgetGuard {
    /// The guard of the attempt's run, or `None` when the run has no budget.
    pub async fn open(
        ctx: &AgentContext,
        budget: Option<Budget>,
        price: Option<Price>,
        agent: &str,
    ) -> Result<Option<Self>, AgentError> {
        let Some(budget) = budget else {
            return Ok(None);
        };
        if budget.max_cost.is_some() && price.is_none() {
            return Err(exhausted(format!(
                "the run has a max_cost but agent {agent} has no price, so the cost of its calls is unknown; set price = {{ input-per-mtok = …, output-per-mtok = … }}"
            )));
        }
        let kv = ctx
            .clients()
            .bus()
            .kv(Bucket::Cursors)
            .await
            .map_err(|e| AgentError::failed(format!("opening the budget bucket: {e}")))?;
        Ok(Some(Self {
            kv,
            key: format!("budget.{}", ctx.scope.run_id),
            budget,
            price,
        }))
    }

    /// What the run has spent and reserved so far.
    pub async fn spent(&self) -> Result<Spent, AgentError> {
        Ok(self.read().await?.0)
    }

    async fn read(&self) -> Result<(Spent, u64), AgentError> {
        let entry = self
            .kv
            .entry(&self.key)
            .await
            .map_err(|e| AgentError::failed(format!("reading the run's budget: {e}")))?;
        match entry.filter(|e| e.operation == kv::Operation::Put) {
            None => Ok((Spent::default(), 0)),
            Some(e) => Ok((
                serde_json::from_slice(&e.value).unwrap_or_default(),
                e.revision,
            )),
        }
    }

    /// Applies `change` to the spent entry with compare-and-set; `change` may refuse.
    async fn update(
        &self,
        change: impl Fn(Spent) -> Result<Spent, AgentError>,
    ) -> Result<Spent, AgentError> {
        for _ in 0..MAX_TRIES {
            let (spent, revision) = self.read().await?;
            let next = change(spent)?;
            let body = serde_json::to_vec(&next).unwrap_or_default();
            let written = if revision == 0 {
                self.kv
                    .create(&self.key, body.into())
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            } else {
                self.kv
                    .update(&self.key, body.into(), revision)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            };
            match written {
                Ok(()) => return Ok(next),
                // Another call changed it first: read again.
                Err(_) => tokio::time::sleep(Duration::from_millis(2)).await,
            }
        }
        Err(AgentError::failed(
            "could not update the run's budget: too many concurrent changes",
        ))
    }

    /// The cost of `input` and `output` tokens.
    pub fn cost(&self, input: u64, output: u64) -> f64 {
        self.price.map_or(0.0, |p| p.cost(input, output))
    }

    /// Reserves a call of `prompt_tokens` (estimated) and at most `max_output` tokens, or
    /// fails with `budget_exhausted` when that could pass the budget.
    pub async fn reserve(
        &self,
        prompt_tokens: u64,
        max_output: u64,
    ) -> Result<Reservation, AgentError> {
        let r = Reservation {
            tokens: prompt_tokens + max_output,
            cost: self.cost(prompt_tokens, max_output),
        };
        let budget = self.budget;
        self.update(|spent| {
            if let Some(max) = budget.max_tokens
                && spent.tokens + r.tokens > max
            {
                return Err(exhausted(format!(
                    "the run's max_tokens ({max}) would be passed: {} spent or reserved, the next model call needs up to {} ({prompt_tokens} prompt, estimated, + {max_output} max-output-tokens); the call was not made",
                    spent.tokens, r.tokens
                )));
            }
            if let Some(max) = budget.max_cost
                && spent.cost + r.cost > max
            {
                return Err(exhausted(format!(
                    "the run's max_cost (${max}) would be passed: ${:.6} spent or reserved, the next model call may cost up to ${:.6}; the call was not made",
                    spent.cost, r.cost
                )));
            }
            Ok(Spent {
                tokens: spent.tokens + r.tokens,
                cost: spent.cost + r.cost,
            })
        })
        .await?;
        Ok(r)
    }

    /// Replaces a reservation by what the call actually used.
    pub async fn settle(
        &self,
        r: Reservation,
        input: u64,
        output: u64,
    ) -> Result<Spent, AgentError> {
        let cost = self.cost(input, output);
        self.update(|spent| {
            Ok(Spent {
                tokens: (spent.tokens + input + output).saturating_sub(r.tokens),
                cost: (spent.cost + cost - r.cost).max(0.0),
            })
        })
        .await
    }

    /// Gives a reservation back (the call failed or was not made).
    pub async fn release(&self, r: Reservation) {
        if let Err(e) = self.settle(r, 0, 0).await {
            tracing::warn!(error = %e, "Could not release a budget reservation; it stays counted");
        }
    }
}
