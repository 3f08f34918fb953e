//! The Prometheus metric families of Flotilla.
//!
//! Every family is named `flotilla_*` with its unit in the name (`_seconds`, `_total`), and is
//! labelled only by values from small, fixed sets: pool and agent names (from the
//! installation's config), model names, and outcome or status enums. Never run ids, task ids,
//! worker ids or error messages: those belong in logs and traces, where each value costs one
//! line rather than one time series forever. Which process is which is the scrape target's
//! business (`instance`, `pod` labels), so worker ids are not labels either.
//!
//! [`Metrics`] is a handle (an `Arc`), not a process-global registry. `flotilla up` creates one
//! and gives a clone to its coordinator and every worker, so they share one `/metrics` and
//! sum where they should (in-flight attempts of a pool); tests that run many services in one
//! process each get their own, so counts asserted by one test are not polluted by another.
//!
//! | Family | Type | Labels |
//! |---|---|---|
//! | `flotilla_runs_submitted_total` | counter | `outcome` (accepted, duplicate, rejected) |
//! | `flotilla_runs_finished_total` | counter | `status` (succeeded, failed, cancelled, rejected) |
//! | `flotilla_tasks_dispatched_total` | counter | `pool`, `agent` |
//! | `flotilla_tasks_retried_total` | counter | `pool`, `agent` |
//! | `flotilla_tasks_finished_total` | counter | `pool`, `agent`, `status` (succeeded, failed, skipped) |
//! | `flotilla_task_attempt_duration_seconds` | histogram | `pool`, `agent`, `outcome` |
//! | `flotilla_dependency_hop_seconds` | histogram | — |
//! | `flotilla_worker_in_flight_attempts` | gauge | `pool` |
//! | `flotilla_worker_free_slots` | gauge | `pool` |
//! | `flotilla_pool_consumer_pending_messages` | gauge | `pool` |
//! | `flotilla_pool_consumer_ack_pending_messages` | gauge | `pool` |
//! | `flotilla_coordinator_cas_conflicts_total` | counter | — |
//! | `flotilla_coordinator_cached_runs` | gauge | — |
//! | `flotilla_consumer_stalls_total` | counter | `stream`, `consumer` (a durable consumer's name) |
//! | `flotilla_llm_tokens_total` | counter | `model`, `kind` (input, output) |
//! | `flotilla_llm_cost_usd_total` | counter | `model` |
//! | `flotilla_tenant_tokens_total` | counter | `tenant`, `agent`, `model` (at most 256 agent/model pairs per process, the rest `_other`) |
//! | `flotilla_tenant_cost_usd_total` | counter | `tenant`, `agent`, `model` (likewise) |
//! | `flotilla_build_info` | info | `version` |

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock, PoisonError, RwLock};

use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::task::TaskErrorKind;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};

/// The `Content-Type` of [`Metrics::encode`]'s output (OpenMetrics text, which Prometheus
/// scrapes natively).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Attempt durations: agents range from milliseconds (scripted, cached) to many minutes (model
/// calls with tools).
const ATTEMPT_BUCKETS: [f64; 17] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    1800.0,
];

/// Dependency hops: about a millisecond when healthy (docs/performance.md), seconds when a
/// coordinator is overloaded or failing over.
const HOP_BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// How a worker's attempt ended: the `outcome` label of
/// `flotilla_task_attempt_duration_seconds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttemptOutcome {
    /// The agent answered.
    Succeeded,
    /// The attempt failed; the kind is the label (`agent_failed`, `timeout`, …).
    Failed(TaskErrorKind),
    /// The worker stopped and handed the task back for another worker.
    HandedBack,
    /// The agent stopped at a tool call that waits for a person; the attempt continues
    /// later (on any worker) once it is decided.
    Suspended,
}

impl AttemptOutcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Succeeded => "succeeded",
            Self::Failed(kind) => kind.as_str(),
            Self::HandedBack => "handed_back",
            Self::Suspended => "suspended",
        }
    }
}

impl fmt::Display for AttemptOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl EncodeLabelValue for AttemptOutcome {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        fmt::Write::write_str(encoder, self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct OutcomeLabels {
    pub(crate) outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct StatusLabels {
    pub(crate) status: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct PoolLabels {
    pub(crate) pool: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct PoolAgentLabels {
    pub(crate) pool: String,
    pub(crate) agent: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct PoolAgentStatusLabels {
    pub(crate) pool: String,
    pub(crate) agent: String,
    pub(crate) status: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct AttemptLabels {
    pub(crate) pool: String,
    pub(crate) agent: String,
    pub(crate) outcome: AttemptOutcome,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct AgentOutcomeLabels {
    pub(crate) agent: String,
    pub(crate) outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct ScopeNameLabels {
    pub(crate) scope: &'static str,
    pub(crate) name: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct WebhookLabels {
    pub(crate) webhook: String,
    pub(crate) outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct ConsumerLabels {
    pub(crate) stream: String,
    pub(crate) consumer: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct AgentLabels {
    pub(crate) agent: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct ModelLabels {
    pub(crate) model: String,
}

/// A tenant's model use by agent and model.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct TenantUsageLabels {
    pub(crate) tenant: String,
    pub(crate) agent: String,
    pub(crate) model: String,
}

/// The most (tenant, agent, model) series a process exposes; past it, `_other`.
const MAX_TENANT_USAGE_SERIES: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct TokenLabels {
    pub(crate) model: String,
    pub(crate) kind: &'static str,
}

fn attempt_histogram() -> Histogram {
    Histogram::new(ATTEMPT_BUCKETS)
}

/// The typed handles of every family. Fields are crate-visible: events in
/// [`crate::events`] update them; other crates go through those events.
pub(crate) struct Families {
    pub(crate) runs_submitted: Family<OutcomeLabels, Counter>,
    pub(crate) runs_finished: Family<StatusLabels, Counter>,
    pub(crate) tasks_dispatched: Family<PoolAgentLabels, Counter>,
    pub(crate) tasks_retried: Family<PoolAgentLabels, Counter>,
    pub(crate) tasks_finished: Family<PoolAgentStatusLabels, Counter>,
    pub(crate) attempt_duration: Family<AttemptLabels, Histogram, fn() -> Histogram>,
    pub(crate) dependency_hop: Histogram,
    pub(crate) in_flight: Family<PoolLabels, Gauge>,
    pub(crate) free_slots: Family<PoolLabels, Gauge>,
    pub(crate) consumer_pending: Family<PoolLabels, Gauge>,
    pub(crate) consumer_ack_pending: Family<PoolLabels, Gauge>,
    pub(crate) cas_conflicts: Counter,
    pub(crate) cached_runs: Gauge,
    pub(crate) consumer_stalls: Family<ConsumerLabels, Counter>,
    pub(crate) llm_tokens: Family<TokenLabels, Counter>,
    pub(crate) llm_cost_usd: Family<ModelLabels, Counter<f64, AtomicU64>>,
    pub(crate) tenant_tokens: Family<TenantUsageLabels, Counter>,
    pub(crate) tenant_cost_usd: Family<TenantUsageLabels, Counter<f64, AtomicU64>>,
    /// The (tenant, agent, model) series created so far (bounded by
    /// [`MAX_TENANT_USAGE_SERIES`]).
    pub(crate) tenant_series: Arc<std::sync::Mutex<std::collections::HashSet<TenantUsageLabels>>>,
    pub(crate) team_outcomes: Family<AgentOutcomeLabels, Counter>,
    pub(crate) team_consecutive_failures: Family<AgentLabels, Gauge>,
    pub(crate) team_members: Family<StatusLabels, Gauge>,
    pub(crate) supervisor_cas_conflicts: Counter,
    pub(crate) webhook_deliveries: Family<WebhookLabels, Counter>,
    pub(crate) trust_level: Family<ScopeNameLabels, Gauge>,
}

/// The series of one (pool, agent) pair, resolved once: recording a task is then an atomic
/// add, with no label allocation or family lookup on the hot path. Each series is created on
/// its first use, so a coordinator never exposes the workers' histograms and the other way
/// round.
pub(crate) struct TaskSeries {
    pool: String,
    agent: String,
    dispatched: OnceLock<Counter>,
    retried: OnceLock<Counter>,
    /// `tasks_finished` by status: succeeded, failed, skipped.
    finished: [OnceLock<Counter>; 3],
    /// `task_attempt_duration_seconds{outcome="succeeded"}` (the common outcome; the others
    /// go through the family).
    attempt_succeeded: OnceLock<Histogram>,
}

impl TaskSeries {
    fn new(pool: &str, agent: &str) -> Self {
        Self {
            pool: pool.to_owned(),
            agent: agent.to_owned(),
            dispatched: OnceLock::new(),
            retried: OnceLock::new(),
            finished: [OnceLock::new(), OnceLock::new(), OnceLock::new()],
            attempt_succeeded: OnceLock::new(),
        }
    }

    fn labels(&self) -> PoolAgentLabels {
        PoolAgentLabels {
            pool: self.pool.clone(),
            agent: self.agent.clone(),
        }
    }

    pub(crate) fn dispatched(&self, f: &Families) -> &Counter {
        self.dispatched
            .get_or_init(|| f.tasks_dispatched.get_or_create_owned(&self.labels()))
    }

    pub(crate) fn retried(&self, f: &Families) -> &Counter {
        self.retried
            .get_or_init(|| f.tasks_retried.get_or_create_owned(&self.labels()))
    }

    /// Counts a task that ended with `status` (the usual three statuses are cached).
    pub(crate) fn finished(&self, f: &Families, status: TaskStatus) {
        let slot = match status {
            TaskStatus::Succeeded => &self.finished[0],
            TaskStatus::Failed => &self.finished[1],
            TaskStatus::Skipped => &self.finished[2],
            other => {
                f.tasks_finished
                    .get_or_create(&self.status_labels(other))
                    .inc();
                return;
            }
        };
        slot.get_or_init(|| {
            f.tasks_finished
                .get_or_create_owned(&self.status_labels(status))
        })
        .inc();
    }

    fn status_labels(&self, status: TaskStatus) -> PoolAgentStatusLabels {
        PoolAgentStatusLabels {
            pool: self.pool.clone(),
            agent: self.agent.clone(),
            status: status.as_str(),
        }
    }

    /// Records an attempt's duration under its outcome (successes are cached; failures and
    /// hand-backs are rare enough to look their series up).
    pub(crate) fn attempt_finished(&self, f: &Families, outcome: AttemptOutcome, seconds: f64) {
        let labels = || AttemptLabels {
            pool: self.pool.clone(),
            agent: self.agent.clone(),
            outcome,
        };
        match outcome {
            AttemptOutcome::Succeeded => self
                .attempt_succeeded
                .get_or_init(|| f.attempt_duration.get_or_create_owned(&labels()))
                .observe(seconds),
            _ => f.attempt_duration.get_or_create(&labels()).observe(seconds),
        }
    }
}

/// Pool → agent → series.
type SeriesIndex = HashMap<String, HashMap<String, Arc<TaskSeries>>>;

struct Inner {
    registry: Registry,
    families: Families,
    series: RwLock<SeriesIndex>,
}

/// The metric registry of a process (or of one test): cheap to clone, shared by every
/// component that records and by the `/metrics` listener.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every Flotilla family, all at zero.
    pub fn new() -> Self {
        let families = Families {
            runs_submitted: Family::default(),
            runs_finished: Family::default(),
            tasks_dispatched: Family::default(),
            tasks_retried: Family::default(),
            tasks_finished: Family::default(),
            attempt_duration: Family::new_with_constructor(attempt_histogram),
            dependency_hop: Histogram::new(HOP_BUCKETS),
            in_flight: Family::default(),
            free_slots: Family::default(),
            consumer_pending: Family::default(),
            consumer_ack_pending: Family::default(),
            cas_conflicts: Counter::default(),
            cached_runs: Gauge::default(),
            consumer_stalls: Family::default(),
            llm_tokens: Family::default(),
            llm_cost_usd: Family::default(),
            tenant_tokens: Family::default(),
            tenant_cost_usd: Family::default(),
            tenant_series: Default::default(),
            team_outcomes: Family::default(),
            team_consecutive_failures: Family::default(),
            team_members: Family::default(),
            supervisor_cas_conflicts: Counter::default(),
            webhook_deliveries: Family::default(),
            trust_level: Family::default(),
        };
        // Series of a fixed label set exist from the start (at 0), so dashboards and rate()
        // see them before the first event; pool and agent series appear with their first
        // sample (or with `init_pool`).
        for outcome in ["accepted", "duplicate", "rejected"] {
            let _ = families
                .runs_submitted
                .get_or_create(&OutcomeLabels { outcome });
        }
        for status in [
            RunStatus::Succeeded,
            RunStatus::Failed,
            RunStatus::Cancelled,
            RunStatus::Rejected,
        ] {
            let _ = families.runs_finished.get_or_create(&StatusLabels {
                status: status.as_str(),
            });
        }
        let mut r = Registry::with_prefix("flotilla");
        let f = &families;
        r.register(
            "runs_submitted",
            "Submissions handled by coordinators, by outcome (accepted, duplicate, rejected)",
            f.runs_submitted.clone(),
        );
        r.register(
            "runs_finished",
            "Runs that reached a terminal status, by status",
            f.runs_finished.clone(),
        );
        r.register(
            "tasks_dispatched",
            "Task attempts published to a pool by coordinators, by pool and agent",
            f.tasks_dispatched.clone(),
        );
        r.register(
            "tasks_retried",
            "Failed task attempts for which a coordinator scheduled another attempt",
            f.tasks_retried.clone(),
        );
        r.register(
            "tasks_finished",
            "Tasks that reached a terminal status (succeeded, failed, skipped), by pool and agent",
            f.tasks_finished.clone(),
        );
        r.register_with_unit(
            "task_attempt_duration",
            "Time workers spent on one task attempt, from start to stored result, by outcome",
            Unit::Seconds,
            f.attempt_duration.clone(),
        );
        r.register_with_unit(
            "dependency_hop",
            "Time from the result that completed a task's dependencies to that task's dispatch",
            Unit::Seconds,
            f.dependency_hop.clone(),
        );
        r.register(
            "worker_in_flight_attempts",
            "Task attempts running on this process's workers, by pool",
            f.in_flight.clone(),
        );
        r.register(
            "worker_free_slots",
            "Idle task slots of this process's workers, by pool",
            f.free_slots.clone(),
        );
        r.register(
            "pool_consumer_pending_messages",
            "Tasks queued for a pool and not yet delivered to any worker (sampled)",
            f.consumer_pending.clone(),
        );
        r.register(
            "pool_consumer_ack_pending_messages",
            "Tasks delivered to a pool's workers and not yet acknowledged (sampled)",
            f.consumer_ack_pending.clone(),
        );
        r.register(
            "coordinator_cas_conflicts",
            "Run snapshot writes that lost a compare-and-set race and were reapplied",
            f.cas_conflicts.clone(),
        );
        r.register(
            "coordinator_cached_runs",
            "Runs whose state a coordinator holds in memory (its run cache: live runs touched within cache-idle)",
            f.cached_runs.clone(),
        );
        r.register(
            "consumer_stalls",
            "Pull loops restarted because they stopped pulling while their consumer held messages, by stream and durable consumer",
            f.consumer_stalls.clone(),
        );
        r.register(
            "llm_tokens",
            "Model tokens spent by LLM agents, by model and kind (input, output)",
            f.llm_tokens.clone(),
        );
        r.register(
            "llm_cost_usd",
            "Estimated model cost in US dollars, by model",
            f.llm_cost_usd.clone(),
        );
        r.register(
            "tenant_tokens",
            "Model tokens of a tenant's ended runs, by tenant, agent and model (counted by its coordinators)",
            f.tenant_tokens.clone(),
        );
        r.register(
            "tenant_cost_usd",
            "Model cost in US dollars of a tenant's ended runs, by tenant, agent and model",
            f.tenant_cost_usd.clone(),
        );
        r.register(
            "team_attempt_outcomes",
            "Attempt outcomes the supervisor counted into failure records, by agent and outcome (succeeded, failed)",
            f.team_outcomes.clone(),
        );
        r.register(
            "team_consecutive_failures",
            "Failures since the last success, by agent (as of the supervisor's last count)",
            f.team_consecutive_failures.clone(),
        );
        r.register(
            "team_members",
            "Team members by status (idle, working, stale, waiting, offline), as this supervisor last saw them",
            f.team_members.clone(),
        );
        r.register(
            "supervisor_cas_conflicts",
            "Team and failure-record writes that lost a compare-and-set race and were redone",
            f.supervisor_cas_conflicts.clone(),
        );
        r.register(
            "webhook_deliveries",
            "Notice deliveries to webhooks, by webhook and outcome (delivered, retried: an attempt failed and will be repeated, dropped: the last attempt failed)",
            f.webhook_deliveries.clone(),
        );
        r.register(
            "trust_level",
            "Trust level of an agent or role as the supervisor last wrote it (0 novice, 1 proficient, 2 expert), by scope and name",
            f.trust_level.clone(),
        );
        r.register(
            "build",
            "Flotilla version of this process",
            Info::new(vec![(
                "version".to_owned(),
                env!("CARGO_PKG_VERSION").to_owned(),
            )]),
        );
        Self {
            inner: Arc::new(Inner {
                registry: r,
                families,
                series: RwLock::new(HashMap::new()),
            }),
        }
    }

    /// Counts a tenant's model use of one ended run: `tokens` and `cost_usd` of `agent`
    /// answered by `model`. The label sets are bounded: past 256 (tenant, agent, model)
    /// series, agent and model read `_other`.
    pub fn tenant_usage(&self, tenant: &str, agent: &str, model: &str, tokens: u64, cost_usd: f64) {
        let f = self.families();
        let mut labels = TenantUsageLabels {
            tenant: tenant.to_owned(),
            agent: agent.to_owned(),
            model: model.to_owned(),
        };
        {
            let mut seen = f
                .tenant_series
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if !seen.contains(&labels) {
                if seen.len() >= MAX_TENANT_USAGE_SERIES {
                    labels.agent = "_other".into();
                    labels.model = "_other".into();
                }
                seen.insert(labels.clone());
            }
        }
        f.tenant_tokens.get_or_create(&labels).inc_by(tokens);
        if cost_usd > 0.0 && cost_usd.is_finite() {
            f.tenant_cost_usd.get_or_create(&labels).inc_by(cost_usd);
        }
    }

    /// The coordinator's run-cache size gauge (its shards add and remove their runs).
    pub fn cached_runs(&self) -> Gauge {
        self.families().cached_runs.clone()
    }

    pub(crate) fn families(&self) -> &Families {
        &self.inner.families
    }

    /// The series of tasks of `pool` run by `agent`: looked up by reference (no allocation)
    /// after the first call for the pair.
    pub(crate) fn task_series(&self, pool: &str, agent: &str) -> Arc<TaskSeries> {
        if let Some(s) = self
            .inner
            .series
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(pool)
            .and_then(|agents| agents.get(agent))
        {
            return Arc::clone(s);
        }
        let mut index = self
            .inner
            .series
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        Arc::clone(
            index
                .entry(pool.to_owned())
                .or_default()
                .entry(agent.to_owned())
                .or_insert_with(|| Arc::new(TaskSeries::new(pool, agent))),
        )
    }

    /// Every family in the OpenMetrics text format ([`CONTENT_TYPE`]).
    pub fn encode(&self) -> Result<String, fmt::Error> {
        let mut out = String::with_capacity(4096);
        prometheus_client::encoding::text::encode(&mut out, &self.inner.registry)?;
        Ok(out)
    }

    /// Creates a pool's consumer-backlog gauges at 0, so `/metrics` shows the pool before the
    /// first sample. (The slot gauges appear with [`worker_slots`](Self::worker_slots): a
    /// premature 0 free slots would read as a saturated worker.)
    pub fn init_pool(&self, pool: &str) {
        let labels = PoolLabels {
            pool: pool.to_owned(),
        };
        let f = self.families();
        for family in [&f.consumer_pending, &f.consumer_ack_pending] {
            let _ = family.get_or_create(&labels);
        }
    }

    /// Counts a worker's slots into `flotilla_worker_free_slots` for as long as the returned
    /// handle lives; [`WorkerSlots::attempt`] moves one slot to in-flight while an attempt runs.
    pub fn worker_slots(&self, pool: &str, concurrency: usize) -> WorkerSlots {
        let labels = PoolLabels {
            pool: pool.to_owned(),
        };
        let f = self.families();
        let in_flight = f.in_flight.get_or_create_owned(&labels);
        let free = f.free_slots.get_or_create_owned(&labels);
        let concurrency = i64::try_from(concurrency).unwrap_or(i64::MAX);
        free.inc_by(concurrency);
        WorkerSlots {
            in_flight,
            free,
            concurrency,
        }
    }
}

/// A worker's share of the slot gauges (added on creation, removed on drop), so several
/// workers of one pool in one process (`flotilla up`) sum correctly.
#[derive(Debug)]
pub struct WorkerSlots {
    in_flight: Gauge,
    free: Gauge,
    concurrency: i64,
}

impl WorkerSlots {
    /// One attempt started: a slot moves from free to in flight until the guard drops.
    pub fn attempt(&self) -> InFlight {
        self.gauges().attempt()
    }

    /// A handle that moves slots between free and in flight, for an attempt that gives its
    /// slot back while it waits and takes one again.
    pub fn gauges(&self) -> SlotGauges {
        SlotGauges {
            in_flight: self.in_flight.clone(),
            free: self.free.clone(),
        }
    }
}

/// Moves a worker's slots between free and in flight ([`WorkerSlots::gauges`]).
#[derive(Debug, Clone)]
pub struct SlotGauges {
    in_flight: Gauge,
    free: Gauge,
}

impl SlotGauges {
    /// A slot taken: it moves from free to in flight until the guard drops.
    pub fn attempt(&self) -> InFlight {
        self.free.dec();
        self.in_flight.inc();
        InFlight {
            in_flight: self.in_flight.clone(),
            free: self.free.clone(),
        }
    }
}

impl Drop for WorkerSlots {
    fn drop(&mut self) {
        self.free.dec_by(self.concurrency);
    }
}

/// A running attempt's slot (see [`WorkerSlots::attempt`]).
#[derive(Debug)]
pub struct InFlight {
    in_flight: Gauge,
    free: Gauge,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.in_flight.dec();
        self.free.inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenants_usage_is_exposed_by_agent_and_model_with_bounded_labels() {
        let m = Metrics::new();
        m.tenant_usage("acme", "researcher", "gpt-x", 1100, 0.0013);
        m.tenant_usage("acme", "researcher", "gpt-x", 100, 0.0);
        let text = m.encode().unwrap();
        assert!(
            text.contains(
                "flotilla_tenant_tokens_total{tenant=\"acme\",agent=\"researcher\",model=\"gpt-x\"} 1200"
            ),
            "{text}"
        );
        assert!(text.contains("flotilla_tenant_cost_usd_total{tenant=\"acme\",agent=\"researcher\",model=\"gpt-x\"} 0.0013"), "{text}");
        for i in 0..300 {
            m.tenant_usage("acme", &format!("a{i}"), "m", 1, 0.0);
        }
        let text = m.encode().unwrap();
        let series = text
            .lines()
            .filter(|l| l.starts_with("flotilla_tenant_tokens_total{"))
            .count();
        assert_eq!(series, 257, "256 series and `_other`");
        assert!(
            text.contains("agent=\"_other\",model=\"_other\"} 45"),
            "{text}"
        );
    }

    /// Every family's `# TYPE` line, as Prometheus sees it.
    const FAMILIES: [(&str, &str); 17] = [
        ("flotilla_runs_submitted", "counter"),
        ("flotilla_runs_finished", "counter"),
        ("flotilla_tasks_dispatched", "counter"),
        ("flotilla_tasks_retried", "counter"),
        ("flotilla_tasks_finished", "counter"),
        ("flotilla_task_attempt_duration_seconds", "histogram"),
        ("flotilla_dependency_hop_seconds", "histogram"),
        ("flotilla_worker_in_flight_attempts", "gauge"),
        ("flotilla_worker_free_slots", "gauge"),
        ("flotilla_pool_consumer_pending_messages", "gauge"),
        ("flotilla_pool_consumer_ack_pending_messages", "gauge"),
        ("flotilla_coordinator_cas_conflicts", "counter"),
        ("flotilla_coordinator_cached_runs", "gauge"),
        ("flotilla_consumer_stalls", "counter"),
        ("flotilla_llm_tokens", "counter"),
        ("flotilla_llm_cost_usd", "counter"),
        ("flotilla_build", "info"),
    ];

    /// Families with a fixed label set (or none) are exposed from the start.
    const ALWAYS: [&str; 6] = [
        "flotilla_runs_submitted",
        "flotilla_runs_finished",
        "flotilla_dependency_hop_seconds",
        "flotilla_coordinator_cas_conflicts",
        "flotilla_coordinator_cached_runs",
        "flotilla_build",
    ];

    #[test]
    fn fixed_label_sets_start_at_zero() {
        let text = Metrics::new().encode().unwrap();
        for (name, kind) in FAMILIES.iter().filter(|(n, _)| ALWAYS.contains(n)) {
            assert!(
                text.contains(&format!("# TYPE {name} {kind}\n")),
                "{name}: {text}"
            );
        }
        for line in [
            "flotilla_runs_submitted_total{outcome=\"rejected\"} 0\n",
            "flotilla_runs_finished_total{status=\"cancelled\"} 0\n",
            "flotilla_coordinator_cas_conflicts_total 0\n",
        ] {
            assert!(text.contains(line), "{line}: {text}");
        }
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn every_family_is_exposed_with_help_once_recorded() {
        use crate::InternalEvent;
        use crate::events::{
            ConsumerStalled, LlmUsage, RunFinished, TaskAttemptFinished, TaskDispatched,
        };
        use crate::events::{TaskFinished, TaskRetried};
        use flotilla_model::ids::{RunId, TaskId};
        use flotilla_model::run::TaskStatus;
        use std::time::Duration;

        let metrics = Metrics::new();
        metrics.init_pool("default");
        let _slots = metrics.worker_slots("default", 2);
        let (run, task) = (RunId::new(), TaskId::new("t"));
        let (pool, agent) = ("default", "echo");
        TaskDispatched {
            run,
            task: &task,
            attempt: 1,
            pool,
            agent,
        }
        .emit(&metrics);
        let delay = Duration::ZERO;
        TaskRetried {
            run,
            task: &task,
            attempt: 1,
            pool,
            agent,
            delay,
        }
        .emit(&metrics);
        let status = TaskStatus::Failed;
        TaskFinished {
            run,
            task: &task,
            pool,
            agent,
            status,
        }
        .emit(&metrics);
        let (outcome, duration) = (AttemptOutcome::Succeeded, Duration::from_millis(5));
        TaskAttemptFinished {
            run,
            task: &task,
            attempt: 1,
            pool,
            agent,
            outcome,
            duration,
        }
        .emit(&metrics);
        RunFinished {
            run,
            status: RunStatus::Failed,
        }
        .emit(&metrics);
        let (input_tokens, output_tokens) = (1, 1);
        LlmUsage {
            model: "m",
            input_tokens,
            output_tokens,
            cost_usd: Some(0.1),
        }
        .emit(&metrics);
        ConsumerStalled {
            stream: "FLOTILLA_TASKS",
            consumer: "pool-default",
            pending: 2,
            since_pull: Duration::from_secs(11),
        }
        .emit(&metrics);

        let text = metrics.encode().unwrap();
        for (name, kind) in FAMILIES {
            assert!(
                text.contains(&format!("# TYPE {name} {kind}\n")),
                "{name}: {text}"
            );
            assert!(text.contains(&format!("# HELP {name} ")), "{name}: {text}");
        }
        assert!(text.contains(&format!(
            "flotilla_build_info{{version=\"{}\"}} 1\n",
            env!("CARGO_PKG_VERSION")
        )));
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn slots_move_between_free_and_in_flight_and_sum_across_workers() {
        let metrics = Metrics::new();
        let a = metrics.worker_slots("gpu", 4);
        let b = metrics.worker_slots("gpu", 2);
        let running = a.attempt();
        let text = metrics.encode().unwrap();
        assert!(
            text.contains("flotilla_worker_free_slots{pool=\"gpu\"} 5\n"),
            "{text}"
        );
        assert!(
            text.contains("flotilla_worker_in_flight_attempts{pool=\"gpu\"} 1\n"),
            "{text}"
        );
        drop(running);
        drop(b);
        let text = metrics.encode().unwrap();
        assert!(
            text.contains("flotilla_worker_free_slots{pool=\"gpu\"} 4\n"),
            "{text}"
        );
        assert!(
            text.contains("flotilla_worker_in_flight_attempts{pool=\"gpu\"} 0\n"),
            "{text}"
        );
    }

    #[test]
    fn attempt_outcomes_are_wire_names() {
        assert_eq!(AttemptOutcome::Succeeded.as_str(), "succeeded");
        assert_eq!(
            AttemptOutcome::Failed(TaskErrorKind::Timeout).as_str(),
            "timeout"
        );
        assert_eq!(AttemptOutcome::HandedBack.as_str(), "handed_back");
    }
}
