//! Run budgets: the plan's `max_tokens` and `max_cost`, kept across every task and worker of
//! the run — and across its whole run tree.
//!
//! What a run has spent lives in one KV entry, `budget.<run>` in the `<prefix>-cursors`
//! bucket: `{"tokens": …, "cost": …}`. A task's envelope lists every budget its model calls
//! count against (`budget_scopes`: the tree's root first, each ancestor run with a budget,
//! then the run's own), so the children a run starts (agent-as-tool, transfers, workflow
//! steps) spend under their root's budget too, and a child's own budget can only narrow it.
//! Every model call goes through three steps, each a compare-and-set on the entry of every
//! scope, so concurrent calls on any number of workers never pass a budget together:
//!
//! ```text
//! reserve(estimate) on every scope ── one would pass its limit? ──yes──► release the others,
//!        │ no: spent += estimate on each                               budget_exhausted naming
//!        ▼                                                              that run; no call made
//!   model call ──► settle each: spent += actual − estimate   (failed call: spent −= estimate)
//! ```
//!
//! The estimate of a call is its prompt (characters ÷ 4, rounded up) plus `max-output-tokens`
//! — set `max-output-tokens` for a hard limit; without it the reservation covers the prompt
//! only and one reply may pass the limit by its own length. Cost uses the agent's `price`
//! (US dollars per million input and output tokens); a run with `max_cost` (or an ancestor
//! with one) fails on an agent without a price rather than spend blindly. A worker that dies
//! during a call leaves its reservation counted (the safe side).
//!
//! A person may extend a budget (`[hitl] on-budget-exhausted = "ask"`, trigger `budget`):
//! [`BudgetGuard::extend`] adds to the entry's `extra_tokens` / `extra_cost`, once per
//! approval (`extended_by`), and every reservation is checked against the limits plus them.
//!
//! An envelope without `budget_scopes` (from a coordinator that does not fill them) counts
//! against its own run's `budget` only, under `budget.<run>`, as before.

use std::time::Duration;

use async_nats::jetstream::kv;
use flotilla_context::{AgentContext, AgentError};
use flotilla_model::RunId;
use flotilla_model::subjects::Bucket;
use flotilla_model::task::{Budget, BudgetScope, TaskEnvelope, TaskErrorKind};
use serde::{Deserialize, Serialize};

use crate::config::Price;

/// Compare-and-set tries before giving up on a contended entry.
const MAX_TRIES: u32 = 50;

/// What a run has spent (and reserved), and what people added to its limits.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Spent {
    /// Tokens.
    pub tokens: u64,
    /// US dollars.
    pub cost: f64,
    /// Tokens people added to the run's `max_tokens` (trigger `budget`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub extra_tokens: u64,
    /// US dollars people added to the run's `max_cost`.
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub extra_cost: f64,
    /// The approvals whose extensions are counted (each counts once, however often the
    /// attempt that applies it is delivered).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extended_by: Vec<String>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_zero_f64(n: &f64) -> bool {
    *n == 0.0
}

/// A model call that would pass a budget: the run whose budget it is and that budget's
/// limits (a person may be asked to extend them), and the error that fails the task.
#[derive(Debug)]
pub struct Refusal {
    /// The run whose budget would be passed (none: no scope could be read, say).
    pub run: Option<RunId>,
    /// Its limits as the attempt knows them.
    pub limits: Budget,
    /// `budget_exhausted`, in words.
    pub error: AgentError,
}

impl From<Refusal> for AgentError {
    fn from(r: Refusal) -> Self {
        r.error
    }
}

/// A call's reservation (the same on every scope), to settle or release.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reservation {
    tokens: u64,
    cost: f64,
}

/// The budgets an attempt's model calls count against, as one attempt sees them.
#[derive(Debug)]
pub struct BudgetGuard {
    kv: kv::Store,
    scopes: Vec<Scope>,
    price: Option<Price>,
}

/// One budget: a run's limits and the key of its spending.
#[derive(Debug)]
struct Scope {
    run: RunId,
    key: String,
    limits: Budget,
    /// Whose budget it is, for messages: `this run`, `the tree's root`, `an ancestor`.
    whose: &'static str,
}

fn exhausted(message: String) -> AgentError {
    AgentError {
        kind: TaskErrorKind::BudgetExhausted,
        message,
    }
}

/// The budgets `task`'s model calls count against, root first: its `budget_scopes`, else its
/// own run's `budget`. Scopes without a limit are left out (nothing to keep), and a run
/// listed twice counts once, under the tighter of its limits.
pub fn scopes(task: &TaskEnvelope) -> Vec<BudgetScope> {
    let listed: Vec<BudgetScope> = if task.budget_scopes.is_empty() {
        task.budget
            .map(|limits| BudgetScope {
                run_id: task.run_id,
                limits,
            })
            .into_iter()
            .collect()
    } else {
        task.budget_scopes.clone()
    };
    let mut out: Vec<BudgetScope> = Vec::with_capacity(listed.len());
    for s in listed {
        if s.limits.max_tokens.is_none() && s.limits.max_cost.is_none() {
            continue;
        }
        match out.iter_mut().find(|o| o.run_id == s.run_id) {
            Some(o) => {
                o.limits.max_tokens = tighter(o.limits.max_tokens, s.limits.max_tokens);
                o.limits.max_cost = tighter(o.limits.max_cost, s.limits.max_cost);
            }
            None => out.push(s),
        }
    }
    out
}

fn tighter<T: PartialOrd>(a: Option<T>, b: Option<T>) -> Option<T> {
    match (a, b) {
        (Some(a), Some(b)) => Some(if b < a { b } else { a }),
        (a, b) => a.or(b),
    }
}

impl BudgetGuard {
    /// The guard of the attempt's budgets ([`scopes`]), or `None` when no budget applies.
    pub async fn open(
        ctx: &AgentContext,
        task: &TaskEnvelope,
        price: Option<Price>,
        agent: &str,
    ) -> Result<Option<Self>, AgentError> {
        let listed = scopes(task);
        if listed.is_empty() {
            return Ok(None);
        }
        let scopes: Vec<Scope> = listed
            .into_iter()
            .map(|s| Scope {
                run: s.run_id,
                key: format!("budget.{}", s.run_id),
                limits: s.limits,
                whose: if s.run_id == task.run_id {
                    "this run"
                } else if s.run_id == task.root_run() {
                    "the tree's root"
                } else {
                    "an ancestor"
                },
            })
            .collect();
        if price.is_none()
            && let Some(s) = scopes.iter().find(|s| s.limits.max_cost.is_some())
        {
            return Err(exhausted(format!(
                "run {} ({}) has a max_cost but agent {agent} has no price, so the cost of its calls is unknown; set price = {{ input-per-mtok = …, output-per-mtok = … }}",
                s.run, s.whose
            )));
        }
        let kv = ctx
            .clients()
            .bus()
            .kv(Bucket::Cursors)
            .await
            .map_err(|e| AgentError::failed(format!("opening the budget bucket: {e}")))?;
        Ok(Some(Self { kv, scopes, price }))
    }

    /// What each budget's run has spent and reserved so far, root first.
    pub async fn spent(&self) -> Result<Vec<(RunId, Spent)>, AgentError> {
        let mut out = Vec::with_capacity(self.scopes.len());
        for s in &self.scopes {
            out.push((s.run, self.read(s).await?.0));
        }
        Ok(out)
    }

    /// Adds `tokens` and `cost` to the limits of run `run`'s budget, once per `approval`
    /// (a person's decision to extend it): every call of the run tree counts against the
    /// extended limits from now on.
    pub async fn extend(
        &self,
        run: RunId,
        approval: &str,
        tokens: u64,
        cost: f64,
    ) -> Result<(), AgentError> {
        let Some(scope) = self.scopes.iter().find(|s| s.run == run) else {
            return Err(AgentError::failed(format!(
                "run {run} is not one of the attempt's budgets"
            )));
        };
        self.update(scope, |mut spent| {
            if !spent.extended_by.iter().any(|a| a == approval) {
                spent.extended_by.push(approval.to_owned());
                spent.extra_tokens += tokens;
                spent.extra_cost += cost;
            }
            Ok(spent)
        })
        .await
        .map(|_| ())
    }

    async fn read(&self, scope: &Scope) -> Result<(Spent, u64), AgentError> {
        let entry = self.kv.entry(&scope.key).await.map_err(|e| {
            AgentError::failed(format!("reading the budget of run {}: {e}", scope.run))
        })?;
        match entry.filter(|e| e.operation == kv::Operation::Put) {
            None => Ok((Spent::default(), 0)),
            Some(e) => Ok((
                serde_json::from_slice(&e.value).unwrap_or_default(),
                e.revision,
            )),
        }
    }

    /// Applies `change` to a scope's spent entry with compare-and-set; `change` may refuse.
    async fn update(
        &self,
        scope: &Scope,
        change: impl Fn(Spent) -> Result<Spent, AgentError>,
    ) -> Result<Spent, AgentError> {
        for _ in 0..MAX_TRIES {
            let (spent, revision) = self.read(scope).await?;
            let next = change(spent)?;
            let body = serde_json::to_vec(&next).unwrap_or_default();
            let written = if revision == 0 {
                self.kv
                    .create(&scope.key, body.into())
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            } else {
                self.kv
                    .update(&scope.key, body.into(), revision)
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
        Err(AgentError::failed(format!(
            "could not update the budget of run {}: too many concurrent changes",
            scope.run
        )))
    }

    /// The cost of `input` and `output` tokens.
    pub fn cost(&self, input: u64, output: u64) -> f64 {
        self.price.map_or(0.0, |p| p.cost(input, output))
    }

    /// Reserves a call of `prompt_tokens` (estimated) and at most `max_output` tokens on every
    /// budget, or fails with `budget_exhausted`, naming the run whose budget it could pass,
    /// after giving back what it reserved on the others.
    pub async fn reserve(
        &self,
        prompt_tokens: u64,
        max_output: u64,
    ) -> Result<Reservation, Refusal> {
        let r = Reservation {
            tokens: prompt_tokens + max_output,
            cost: self.cost(prompt_tokens, max_output),
        };
        let results = futures::future::join_all(
            self.scopes
                .iter()
                .map(|s| self.reserve_on(s, r, prompt_tokens, max_output)),
        )
        .await;
        let Some(refused) = results.iter().position(Result::is_err) else {
            return Ok(r);
        };
        // Give back what the other scopes took (their reservation succeeded).
        futures::future::join_all(
            self.scopes
                .iter()
                .zip(&results)
                .filter(|(_, res)| res.is_ok())
                .map(|(s, _)| self.release_on(s, r)),
        )
        .await;
        let mut results = results;
        let scope = &self.scopes[refused];
        Err(Refusal {
            run: Some(scope.run),
            limits: scope.limits,
            error: results.swap_remove(refused).err().unwrap_or_else(|| {
                AgentError::failed("a budget reservation failed without an error")
            }),
        })
    }

    async fn reserve_on(
        &self,
        scope: &Scope,
        r: Reservation,
        prompt_tokens: u64,
        max_output: u64,
    ) -> Result<(), AgentError> {
        let limits = scope.limits;
        self.update(scope, |spent| {
            if let Some(max) = limits.max_tokens.map(|m| m + spent.extra_tokens)
                && spent.tokens + r.tokens > max
            {
                return Err(exhausted(format!(
                    "the max_tokens ({max}) of run {} ({}) would be passed: {} spent or reserved in its run tree, the next model call needs up to {} ({prompt_tokens} prompt, estimated, + {max_output} max-output-tokens); the call was not made",
                    scope.run, scope.whose, spent.tokens, r.tokens
                )));
            }
            if let Some(max) = limits.max_cost.map(|m| m + spent.extra_cost)
                && spent.cost + r.cost > max
            {
                return Err(exhausted(format!(
                    "the max_cost (${max}) of run {} ({}) would be passed: ${:.6} spent or reserved in its run tree, the next model call may cost up to ${:.6}; the call was not made",
                    scope.run, scope.whose, spent.cost, r.cost
                )));
            }
            Ok(Spent {
                tokens: spent.tokens + r.tokens,
                cost: spent.cost + r.cost,
                ..spent
            })
        })
        .await
        .map(|_| ())
    }

    /// Replaces a reservation by what the call actually used, on every budget.
    pub async fn settle(&self, r: Reservation, input: u64, output: u64) -> Result<(), AgentError> {
        let cost = self.cost(input, output);
        let results = futures::future::join_all(self.scopes.iter().map(|s| {
            self.update(s, move |spent| {
                Ok(Spent {
                    tokens: (spent.tokens + input + output).saturating_sub(r.tokens),
                    cost: (spent.cost + cost - r.cost).max(0.0),
                    ..spent
                })
            })
        }))
        .await;
        results
            .into_iter()
            .find(Result::is_err)
            .unwrap_or(Ok(Spent::default()))?;
        Ok(())
    }

    async fn release_on(&self, scope: &Scope, r: Reservation) {
        let given_back = self
            .update(scope, |spent| {
                Ok(Spent {
                    tokens: spent.tokens.saturating_sub(r.tokens),
                    cost: (spent.cost - r.cost).max(0.0),
                    ..spent
                })
            })
            .await;
        if let Err(e) = given_back {
            tracing::warn!(run = %scope.run, error = %e, "Could not release a budget reservation; it stays counted");
        }
    }

    /// Gives a reservation back on every budget (the call failed or was not made).
    pub async fn release(&self, r: Reservation) {
        futures::future::join_all(self.scopes.iter().map(|s| self.release_on(s, r))).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task() -> TaskEnvelope {
        serde_json::from_value(serde_json::json!({
            "run_id": RunId::new(),
            "task_id": "t",
            "attempt": 1,
            "attempt_id": flotilla_model::ids::AttemptId::new(),
            "pool": "default",
            "required": true,
            "timeout": 60,
            "dispatched_at": "2026-01-01T00:00:00Z"
        }))
        .expect("envelope")
    }

    fn limits(max_tokens: Option<u64>, max_cost: Option<f64>) -> Budget {
        Budget {
            max_tokens,
            max_cost,
        }
    }

    #[test]
    fn scopes_fall_back_to_the_runs_budget_and_merge_repeats() {
        let mut t = task();
        assert!(scopes(&t).is_empty(), "no budget");
        t.budget = Some(limits(Some(100), None));
        assert_eq!(
            scopes(&t),
            vec![BudgetScope {
                run_id: t.run_id,
                limits: limits(Some(100), None)
            }]
        );
        // With scopes, the envelope's own `budget` is not added again.
        let root = RunId::new();
        t.budget_scopes = vec![
            BudgetScope {
                run_id: root,
                limits: limits(Some(1000), Some(2.0)),
            },
            BudgetScope {
                run_id: RunId::new(),
                limits: limits(None, None),
            },
            BudgetScope {
                run_id: root,
                limits: limits(Some(500), None),
            },
        ];
        assert_eq!(
            scopes(&t),
            vec![BudgetScope {
                run_id: root,
                limits: limits(Some(500), Some(2.0))
            }],
            "a scope without limits is left out; a repeated run takes the tighter limits"
        );
    }
}
