//! The installation's quotas at a root run's admission and at every run's end, through the
//! ledger of `<prefix>-usage` ([`flotilla_tenants::ledger`]), which every coordinator of the
//! installation shares.
//!
//! ```text
//! root run admitted (either door) ─► Quota::admit ─ no quotas ──────────► as before (no I/O)
//!                                      │ refused ─► a rejection with problem `quota_exceeded`
//!                                      │ full, and `concurrent_runs` queues ─► handed back
//!                                      │     (durable submissions, up to QUEUE_WAIT), then refused
//!                                      ▼ admitted: the run's budget scope narrowed to the
//!                                        tenant's tokens left today and cost left this month
//! run ended (Action::Finish) ─► Quota::ended ─► slot given back (root runs held one)
//!                                            └► its `usage` events counted once, by agent and model
//! ```
//!
//! **Children** are neither refused nor reserved: a tree is never stopped halfway by
//! `concurrent_runs` or `runs_per_hour`. They spend under the budget scopes of their tree
//! (the root's, narrowed at its admission), and their usage counts at their own end.
//!
//! **Slots lost** (a coordinator killed between taking a slot and recording the run, or
//! between a run's end and its release) are found when `concurrent_runs` refuses: at most
//! every [`SWEEP_EVERY`], the runs held longer than [`STALE_AFTER_MS`] whose run ended or never
//! started give their slot back.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use flotilla_bus::wire;
use flotilla_model::event::{Event, decode_events};
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::plan::Budget;
use flotilla_model::problem::Problem;
use flotilla_model::runlog::{RunInput, RunLogEntry, Submitted};
use flotilla_model::subjects::StreamKind;
use flotilla_model::task::BudgetScope;
use flotilla_model::tenant::QuotaKind;
use flotilla_model::time::Timestamp;
use flotilla_tenants::TenantError;
use flotilla_tenants::ledger::{Admission, Ledger, RunUsage};
use tracing::{debug, info, warn};

use crate::error::{StoreError, StoreErrorKind};
use crate::store::{First, FirstMessage, RunStore};

/// How long a durable submission waits for a slot when `concurrent_runs` queues
/// (`Quotas::queue`), counted from when it was stored; then it is refused.
pub(crate) const QUEUE_WAIT: Duration = Duration::from_secs(10 * 60);

/// How often a waiting submission tries again.
pub(crate) const QUEUE_RETRY: Duration = Duration::from_secs(1);

/// A slot held this long by a run that ended or never started is given back by a sweep.
const STALE_AFTER_MS: i64 = 2 * 60 * 1000;

/// Sweeps for lost slots at most this often per coordinator.
const SWEEP_EVERY: Duration = Duration::from_secs(30);

/// What admission decided about a run.
#[derive(Debug)]
pub(crate) enum Decision {
    /// Admitted; `reserved`: a slot was taken now (give it back if the run does not start).
    Admitted { reserved: bool },
    /// Refused: the problem to reject the submission with.
    Refused(Problem),
    /// Full, and its quota queues: hand the submission back and try again after this long.
    Wait(Duration),
}

/// The quotas of the coordinator's installation.
#[derive(Debug)]
pub(crate) struct Quota {
    ledger: Ledger,
    store: RunStore,
    last_sweep: Mutex<Option<tokio::time::Instant>>,
    /// Where a tenant's counted usage is also exposed (`flotilla_tenant_*_total`).
    metrics: Option<flotilla_telemetry::Metrics>,
}

fn store_error(e: TenantError) -> StoreError {
    StoreError::with_source(StoreErrorKind::Nats, "keeping the quotas", e)
}

impl Quota {
    /// The quotas of `ledger` (followed by the caller), with `store` to find lost slots.
    pub(crate) fn new(ledger: Ledger, store: RunStore) -> Self {
        Self {
            ledger,
            store,
            last_sweep: Mutex::new(None),
            metrics: None,
        }
    }

    /// Also exposes the usage it counts in `metrics`, by tenant, agent and model.
    pub(crate) fn with_metrics(mut self, metrics: flotilla_telemetry::Metrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Admits run `run` (`submitted`, stored at `submitted_ms`): a child run, or any run
    /// without quotas, as before; a root run under the quotas in force, its budget scope
    /// narrowed to what the tenant has left. `may_wait`: the submission can be handed back
    /// (a durable one) when its quota queues.
    pub(crate) async fn admit(
        &self,
        run: RunId,
        submitted: &mut Submitted,
        submitted_ms: i64,
        may_wait: bool,
    ) -> Result<Decision, StoreError> {
        if submitted.parent.is_some() || self.ledger.active().is_none() {
            return Ok(Decision::Admitted { reserved: false });
        }
        let now_ms = Timestamp::now().unix_ms();
        let mut admission = self.ledger.admit(run, now_ms).await.map_err(store_error)?;
        if let Admission::Refused { exceeded, .. } = &admission
            && exceeded.quota == QuotaKind::ConcurrentRuns
            && self.sweep(now_ms).await
        {
            admission = self.ledger.admit(run, now_ms).await.map_err(store_error)?;
        }
        Ok(match admission {
            Admission::Unlimited => Decision::Admitted { reserved: false },
            Admission::Admitted { reserved, budget } => {
                if let Some(budget) = budget {
                    narrow(&mut submitted.budget_scopes, run, budget);
                }
                Decision::Admitted { reserved }
            }
            Admission::Refused { exceeded, queue } => {
                if queue && may_wait && now_ms - submitted_ms < QUEUE_WAIT.as_millis() as i64 {
                    debug!(%run, quota = %exceeded.quota, "Submission waits for its quota");
                    Decision::Wait(QUEUE_RETRY)
                } else {
                    info!(%run, quota = %exceeded.quota, limit = exceeded.limit, used = exceeded.used, "Submission refused by its quota");
                    Decision::Refused(Problem::quota_exceeded(exceeded))
                }
            }
        })
    }

    /// The budget scope a root run rebuilt from its first message (a start performed but
    /// not recorded) is given: what the tenant has left now. Takes no slot (its admission
    /// took it).
    pub(crate) async fn rebuilt(&self, run: RunId, submitted: &mut Submitted) {
        if submitted.parent.is_some() || self.ledger.active().is_none() {
            return;
        }
        match self.ledger.left(Timestamp::now().unix_ms()).await {
            Ok(Some(budget)) => narrow(&mut submitted.budget_scopes, run, budget),
            Ok(None) => {}
            Err(e) => {
                warn!(%run, error = %e, "Cannot read what the tenant has left; the rebuilt run keeps its own budget")
            }
        }
    }

    /// Gives back the slot of a run admitted but not started after all (its first entry
    /// could not be written, or another submission decided the run).
    pub(crate) async fn unreserve(&self, run: RunId) {
        if let Err(e) = self.ledger.release(run).await {
            warn!(%run, error = %e, "Cannot give back a run's slot; a sweep will");
        }
    }

    /// Whether ended runs' usage is counted: while the installation has quotas, and always
    /// for a tenant's (its usage is what `flotilla tenant usage` reads).
    pub(crate) fn counts(&self) -> bool {
        self.ledger.active().is_some() || self.ledger.tenant().is_some()
    }

    /// A run ended: its slot is given back (`root`: a root run may hold one), before its end
    /// is told, so a client that sees the end and submits again finds the slot free. Best
    /// effort: a failure is logged (a lost slot is found by a sweep).
    pub(crate) async fn ended(&self, run: RunId, root: bool) {
        if root && let Err(e) = self.ledger.release(run).await {
            warn!(%run, error = %e, "Cannot give back an ended run's slot; a sweep will");
        }
    }

    /// Counts run `run`'s model usage (its `usage` events; `agents` names each task's agent)
    /// once, ended at `ended_ms` — off the run's path: its end is told meanwhile. Best
    /// effort: a failure is logged.
    pub(crate) fn count_later(
        self: &Arc<Self>,
        run: RunId,
        ended_ms: i64,
        agents: HashMap<TaskId, String>,
    ) {
        let me = Arc::clone(self);
        tokio::spawn(async move {
            let agent_of = |t: &TaskId| {
                agents
                    .get(t)
                    .cloned()
                    .unwrap_or_else(|| "default".to_owned())
            };
            let usage = match me.usage_of(run, agent_of).await {
                Ok(u) => u,
                Err(e) => {
                    warn!(%run, error = %e, "Cannot read an ended run's usage; it is not counted");
                    return;
                }
            };
            match me.ledger.account(run, &usage, ended_ms).await {
                Ok(counted) => {
                    debug!(%run, counted, tokens = usage.total().tokens, "Run usage counted");
                    if let (true, Some(metrics)) = (counted, &me.metrics) {
                        let tenant = me.ledger.tenant().map_or("default", |t| t.as_str());
                        for (agent, models) in &usage.by {
                            for (model, spend) in models {
                                metrics.tenant_usage(
                                    tenant,
                                    agent,
                                    model,
                                    spend.tokens,
                                    spend.cost_micros as f64 / 1e6,
                                );
                            }
                        }
                    }
                }
                Err(e) => warn!(%run, error = %e, "Cannot count an ended run's usage"),
            }
        });
    }

    /// A run's model usage: its `usage` events (each once), by agent and model.
    async fn usage_of(
        &self,
        run: RunId,
        agent_of: impl Fn(&TaskId) -> String,
    ) -> Result<RunUsage, StoreError> {
        let bus = self.store.bus();
        let filter = bus.names().event(run);
        let mut pages = bus.pages(StreamKind::Events, &filter, 0);
        let mut seen = HashSet::new();
        let mut usage = RunUsage::default();
        while let Some(page) = pages.next().await.map_err(|e| {
            StoreError::with_source(StoreErrorKind::Nats, "reading a run's usage", e)
        })? {
            for m in &page {
                let Ok(events) = decode_events(wire::codec_of(Some(&m.headers)), &m.payload) else {
                    continue;
                };
                for e in events {
                    if let Event::Usage {
                        prompt_tokens,
                        completion_tokens,
                        model,
                        cost_usd,
                        ..
                    } = &e.event
                        && seen.insert(e.id.clone())
                    {
                        let agent = e
                            .task_id
                            .as_ref()
                            .map_or_else(|| "default".to_owned(), &agent_of);
                        usage.add(
                            &agent,
                            model.as_deref().unwrap_or("unknown"),
                            prompt_tokens + completion_tokens,
                            *cost_usd,
                        );
                    }
                }
            }
        }
        Ok(usage)
    }

    /// Gives back the slots of runs held for over [`STALE_AFTER_MS`] that ended or never
    /// started (at most every [`SWEEP_EVERY`]); whether any was given back.
    async fn sweep(&self, now_ms: i64) -> bool {
        {
            let mut last = self
                .last_sweep
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let now = tokio::time::Instant::now();
            if last.is_some_and(|at| now.duration_since(at) < SWEEP_EVERY) {
                return false;
            }
            *last = Some(now);
        }
        let held = match self.ledger.held().await {
            Ok(h) => h,
            Err(e) => {
                warn!(error = %e, "Cannot read the runs holding slots");
                return false;
            }
        };
        let mut freed = false;
        for (run, at_ms) in held.runs {
            if now_ms - at_ms < STALE_AFTER_MS {
                continue;
            }
            let gone = match self.store.load(run).await {
                Ok(Some(stored)) => stored.snapshot.state.status.is_terminal(),
                Ok(None) => match self.store.first_message(run).await {
                    Ok(None) => true,
                    Ok(Some(First {
                        content:
                            FirstMessage::Entry(RunLogEntry {
                                input: RunInput::Rejected(_),
                                ..
                            }),
                        ..
                    })) => true,
                    Ok(Some(_)) | Err(_) => false,
                },
                Err(_) => false,
            };
            if gone && self.ledger.release(run).await.unwrap_or(false) {
                info!(%run, "A slot held by a run that ended or never started was given back");
                freed = true;
            }
        }
        freed
    }
}

/// Narrows run `run`'s own budget scope to `budget` (the tighter of each limit), adding it
/// when the run has none: its tasks' model calls, and its children's, count against it.
fn narrow(scopes: &mut Vec<BudgetScope>, run: RunId, budget: Budget) {
    fn tighter<T: PartialOrd>(a: Option<T>, b: Option<T>) -> Option<T> {
        match (a, b) {
            (Some(a), Some(b)) => Some(if b < a { b } else { a }),
            (a, b) => a.or(b),
        }
    }
    match scopes.iter_mut().find(|s| s.run_id == run) {
        Some(s) => {
            s.limits.max_tokens = tighter(s.limits.max_tokens, budget.max_tokens);
            s.limits.max_cost = tighter(s.limits.max_cost, budget.max_cost);
        }
        None => scopes.push(BudgetScope {
            run_id: run,
            limits: budget,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_spends_under_the_tighter_of_its_budget_and_the_tenants() {
        let run = RunId::new();
        let root = RunId::new();
        let mut scopes = vec![
            BudgetScope {
                run_id: root,
                limits: Budget {
                    max_tokens: Some(10),
                    max_cost: None,
                },
            },
            BudgetScope {
                run_id: run,
                limits: Budget {
                    max_tokens: Some(500),
                    max_cost: Some(2.0),
                },
            },
        ];
        narrow(
            &mut scopes,
            run,
            Budget {
                max_tokens: Some(100),
                max_cost: Some(5.0),
            },
        );
        assert_eq!(scopes[1].limits.max_tokens, Some(100));
        assert_eq!(scopes[1].limits.max_cost, Some(2.0));
        assert_eq!(
            scopes[0].limits.max_tokens,
            Some(10),
            "another run's is kept"
        );
        let mut none = Vec::new();
        narrow(
            &mut none,
            run,
            Budget {
                max_tokens: Some(7),
                max_cost: None,
            },
        );
        assert_eq!(none.len(), 1);
        assert_eq!(none[0].limits.max_tokens, Some(7));
    }
}
