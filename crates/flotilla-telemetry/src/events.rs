//! Internal events: each thing worth counting is a struct whose [`InternalEvent::emit`] writes
//! the log line and updates the metric in one call, so a log line never appears without its
//! metric (or the other way round) and both use the same field names.
//!
//! Events carry the high-cardinality identifiers (run, task, attempt) for the log line only;
//! the metric takes only the low-cardinality fields (pool, agent, outcome, status, model).
//! Log messages are capitalised and come after the structured fields. Per-task events log at
//! `debug` (a busy installation runs thousands of tasks a second); per-run events at `info`.
//!
//! ```
//! use flotilla_telemetry::{InternalEvent, Metrics};
//! use flotilla_telemetry::events::ConsumerLag;
//! let metrics = Metrics::new();
//! ConsumerLag { pool: "default", pending: 12, ack_pending: 3 }.emit(&metrics);
//! assert!(metrics.encode()?.contains("flotilla_pool_consumer_pending_messages{pool=\"default\"} 12"));
//! # Ok::<(), std::fmt::Error>(())
//! ```

use std::time::Duration;

use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::submit::SubmitStatus;
use tracing::{debug, info, trace, warn};

use crate::metrics::{
    AgentLabels, AgentOutcomeLabels, AttemptOutcome, ConsumerLabels, Metrics, ModelLabels,
    OutcomeLabels, PoolLabels, StatusLabels, TokenLabels,
};

/// Something that happened, recorded as a log line and a metric together.
pub trait InternalEvent {
    /// Writes the log line and updates the metric.
    fn emit(self, metrics: &Metrics);
}

fn submit_outcome(status: SubmitStatus) -> &'static str {
    match status {
        SubmitStatus::Accepted => "accepted",
        SubmitStatus::Duplicate => "duplicate",
        SubmitStatus::Rejected => "rejected",
        SubmitStatus::Finished => "finished",
    }
}

/// A coordinator's intake handled a submission.
#[derive(Debug, Clone, Copy)]
pub struct RunSubmitted {
    /// The run, when the submission named or created one.
    pub run: Option<RunId>,
    /// What the intake answered.
    pub status: SubmitStatus,
}

impl InternalEvent for RunSubmitted {
    fn emit(self, metrics: &Metrics) {
        let outcome = submit_outcome(self.status);
        debug!(run = ?self.run, status = outcome, "Submission handled");
        metrics
            .families()
            .runs_submitted
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }
}

/// A run reached a terminal status.
#[derive(Debug, Clone, Copy)]
pub struct RunFinished {
    /// The run.
    pub run: RunId,
    /// Its terminal status.
    pub status: RunStatus,
}

impl InternalEvent for RunFinished {
    fn emit(self, metrics: &Metrics) {
        let status = self.status.as_str();
        info!(run = %self.run, status, "Run finished");
        metrics
            .families()
            .runs_finished
            .get_or_create(&StatusLabels { status })
            .inc();
    }
}

/// A coordinator published a task attempt to its pool.
#[derive(Debug, Clone, Copy)]
pub struct TaskDispatched<'a> {
    /// The run.
    pub run: RunId,
    /// The task.
    pub task: &'a TaskId,
    /// 1 for the first attempt.
    pub attempt: u32,
    /// The pool it was published to.
    pub pool: &'a str,
    /// The agent that will run it (the default agent's name when the task names none).
    pub agent: &'a str,
}

impl InternalEvent for TaskDispatched<'_> {
    fn emit(self, metrics: &Metrics) {
        debug!(run = %self.run, task = %self.task, attempt = self.attempt, pool = self.pool, agent = self.agent, "Task dispatched");
        metrics
            .task_series(self.pool, self.agent)
            .dispatched(metrics.families())
            .inc();
    }
}

/// A task attempt failed and a coordinator scheduled another one.
#[derive(Debug, Clone, Copy)]
pub struct TaskRetried<'a> {
    /// The run.
    pub run: RunId,
    /// The task.
    pub task: &'a TaskId,
    /// The attempt that failed.
    pub attempt: u32,
    /// The task's pool.
    pub pool: &'a str,
    /// The task's agent.
    pub agent: &'a str,
    /// Backoff before the next attempt.
    pub delay: Duration,
}

impl InternalEvent for TaskRetried<'_> {
    fn emit(self, metrics: &Metrics) {
        debug!(run = %self.run, task = %self.task, attempt = self.attempt, pool = self.pool, agent = self.agent, delay_ms = self.delay.as_millis() as u64, "Task retry scheduled");
        metrics
            .task_series(self.pool, self.agent)
            .retried(metrics.families())
            .inc();
    }
}

/// A task reached a terminal status (succeeded, failed, skipped).
#[derive(Debug, Clone, Copy)]
pub struct TaskFinished<'a> {
    /// The run.
    pub run: RunId,
    /// The task.
    pub task: &'a TaskId,
    /// The task's pool.
    pub pool: &'a str,
    /// The task's agent.
    pub agent: &'a str,
    /// Its terminal status.
    pub status: TaskStatus,
}

impl InternalEvent for TaskFinished<'_> {
    fn emit(self, metrics: &Metrics) {
        let status = self.status.as_str();
        debug!(run = %self.run, task = %self.task, pool = self.pool, agent = self.agent, status, "Task finished");
        metrics
            .task_series(self.pool, self.agent)
            .finished(metrics.families(), self.status);
    }
}

/// A worker finished one attempt (its result stored, or the task handed back).
#[derive(Debug, Clone, Copy)]
pub struct TaskAttemptFinished<'a> {
    /// The run.
    pub run: RunId,
    /// The task.
    pub task: &'a TaskId,
    /// The attempt.
    pub attempt: u32,
    /// The worker's pool.
    pub pool: &'a str,
    /// The agent that ran it.
    pub agent: &'a str,
    /// How it ended.
    pub outcome: AttemptOutcome,
    /// From the worker starting it to its result being stored.
    pub duration: Duration,
}

impl InternalEvent for TaskAttemptFinished<'_> {
    fn emit(self, metrics: &Metrics) {
        debug!(
            run = %self.run,
            task = %self.task,
            attempt = self.attempt,
            pool = self.pool,
            agent = self.agent,
            outcome = self.outcome.as_str(),
            duration_ms = self.duration.as_millis() as u64,
            "Task attempt finished"
        );
        metrics.task_series(self.pool, self.agent).attempt_finished(
            metrics.families(),
            self.outcome,
            self.duration.as_secs_f64(),
        );
    }
}

/// A task was dispatched because the result it waited for arrived: the latency Flotilla adds
/// between two dependent tasks.
#[derive(Debug, Clone, Copy)]
pub struct DependencyHop<'a> {
    /// The run.
    pub run: RunId,
    /// The task that became ready.
    pub task: &'a TaskId,
    /// From the completing result's publication to the dependent's dispatch.
    pub duration: Duration,
}

impl InternalEvent for DependencyHop<'_> {
    fn emit(self, metrics: &Metrics) {
        trace!(run = %self.run, task = %self.task, duration_us = self.duration.as_micros() as u64, "Dependency hop");
        metrics
            .families()
            .dependency_hop
            .observe(self.duration.as_secs_f64());
    }
}

/// A coordinator lost a compare-and-set race on a run snapshot (another coordinator wrote it
/// first) and reapplies its inputs: normal with several coordinators, a problem when frequent.
#[derive(Debug, Clone, Copy)]
pub struct CasConflict {
    /// The run.
    pub run: RunId,
}

impl InternalEvent for CasConflict {
    fn emit(self, metrics: &Metrics) {
        debug!(run = %self.run, "Run changed concurrently; reloading");
        metrics.families().cas_conflicts.inc();
    }
}

/// A sample of a pool consumer's backlog (what KEDA scales on).
#[derive(Debug, Clone, Copy)]
pub struct ConsumerLag<'a> {
    /// The pool.
    pub pool: &'a str,
    /// Tasks not yet delivered to any worker.
    pub pending: u64,
    /// Tasks delivered and not yet acknowledged (running, or lost with a dead worker).
    pub ack_pending: u64,
}

impl InternalEvent for ConsumerLag<'_> {
    fn emit(self, metrics: &Metrics) {
        debug!(
            pool = self.pool,
            pending = self.pending,
            ack_pending = self.ack_pending,
            "Pool consumer backlog sampled"
        );
        let labels = PoolLabels {
            pool: self.pool.to_owned(),
        };
        let f = metrics.families();
        f.consumer_pending
            .get_or_create(&labels)
            .set(i64::try_from(self.pending).unwrap_or(i64::MAX));
        f.consumer_ack_pending
            .get_or_create(&labels)
            .set(i64::try_from(self.ack_pending).unwrap_or(i64::MAX));
    }
}

/// A pull loop stopped pulling while its durable consumer held messages, and was restarted
/// (`flotilla_bus::liveness`): messages were waiting on a process that no longer asked for
/// them. Rare by design; each one is worth a look (the log line says how long the loop had
/// been silent).
#[derive(Debug, Clone, Copy)]
pub struct ConsumerStalled<'a> {
    /// The stream the consumer reads (`FLOTILLA_TASKS`, …).
    pub stream: &'a str,
    /// The durable consumer's name (`pool-default`, `turns-default`, `coordinators`, …): a
    /// label from the deployment's configuration, never a run's.
    pub consumer: &'a str,
    /// Messages the consumer held, not yet delivered, when the stall was seen.
    pub pending: u64,
    /// How long the loop had made no pull.
    pub since_pull: Duration,
}

impl InternalEvent for ConsumerStalled<'_> {
    fn emit(self, metrics: &Metrics) {
        warn!(
            stream = self.stream,
            consumer = self.consumer,
            pending = self.pending,
            seconds_since_pull = self.since_pull.as_secs_f64(),
            "Pull loop stalled with messages pending; restarting it"
        );
        metrics
            .families()
            .consumer_stalls
            .get_or_create(&ConsumerLabels {
                stream: self.stream.to_owned(),
                consumer: self.consumer.to_owned(),
            })
            .inc();
    }
}

/// An LLM agent's model call spent tokens (and, where the price is known, money).
#[derive(Debug, Clone, Copy)]
pub struct LlmUsage<'a> {
    /// The model as requested (`gen_ai.request.model`).
    pub model: &'a str,
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Completion tokens.
    pub output_tokens: u64,
    /// Estimated cost in US dollars, when the model's price is configured.
    pub cost_usd: Option<f64>,
}

impl InternalEvent for LlmUsage<'_> {
    fn emit(self, metrics: &Metrics) {
        debug!(
            model = self.model,
            input_tokens = self.input_tokens,
            output_tokens = self.output_tokens,
            cost_usd = self.cost_usd,
            "Model usage recorded"
        );
        let f = metrics.families();
        for (kind, n) in [("input", self.input_tokens), ("output", self.output_tokens)] {
            f.llm_tokens
                .get_or_create(&TokenLabels {
                    model: self.model.to_owned(),
                    kind,
                })
                .inc_by(n);
        }
        if let Some(cost) = self.cost_usd.filter(|c| c.is_finite() && *c >= 0.0) {
            f.llm_cost_usd
                .get_or_create(&ModelLabels {
                    model: self.model.to_owned(),
                })
                .inc_by(cost);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_model::task::TaskErrorKind;

    fn line<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
        text.lines().find(|l| l.starts_with(prefix))
    }

    #[test]
    fn events_update_their_families_with_low_cardinality_labels() {
        let m = Metrics::new();
        let run = RunId::new();
        let task = TaskId::new("fetch");
        RunSubmitted {
            run: Some(run),
            status: SubmitStatus::Accepted,
        }
        .emit(&m);
        TaskDispatched {
            run,
            task: &task,
            attempt: 1,
            pool: "default",
            agent: "echo",
        }
        .emit(&m);
        TaskRetried {
            run,
            task: &task,
            attempt: 1,
            pool: "default",
            agent: "echo",
            delay: Duration::from_secs(1),
        }
        .emit(&m);
        TaskAttemptFinished {
            run,
            task: &task,
            attempt: 2,
            pool: "default",
            agent: "echo",
            outcome: AttemptOutcome::Failed(TaskErrorKind::Timeout),
            duration: Duration::from_millis(30),
        }
        .emit(&m);
        TaskFinished {
            run,
            task: &task,
            pool: "default",
            agent: "echo",
            status: TaskStatus::Succeeded,
        }
        .emit(&m);
        DependencyHop {
            run,
            task: &task,
            duration: Duration::from_micros(900),
        }
        .emit(&m);
        CasConflict { run }.emit(&m);
        RunFinished {
            run,
            status: RunStatus::Succeeded,
        }
        .emit(&m);
        LlmUsage {
            model: "gpt-test",
            input_tokens: 10,
            output_tokens: 5,
            cost_usd: Some(0.25),
        }
        .emit(&m);

        let text = m.encode().unwrap();
        for expected in [
            "flotilla_runs_submitted_total{outcome=\"accepted\"} 1",
            "flotilla_tasks_dispatched_total{pool=\"default\",agent=\"echo\"} 1",
            "flotilla_tasks_retried_total{pool=\"default\",agent=\"echo\"} 1",
            "flotilla_task_attempt_duration_seconds_count{pool=\"default\",agent=\"echo\",outcome=\"timeout\"} 1",
            "flotilla_task_attempt_duration_seconds_bucket{le=\"0.05\",pool=\"default\",agent=\"echo\",outcome=\"timeout\"} 1",
            "flotilla_tasks_finished_total{pool=\"default\",agent=\"echo\",status=\"succeeded\"} 1",
            "flotilla_dependency_hop_seconds_bucket{le=\"0.001\"} 1",
            "flotilla_coordinator_cas_conflicts_total 1",
            "flotilla_runs_finished_total{status=\"succeeded\"} 1",
            "flotilla_llm_tokens_total{model=\"gpt-test\",kind=\"input\"} 10",
            "flotilla_llm_tokens_total{model=\"gpt-test\",kind=\"output\"} 5",
            "flotilla_llm_cost_usd_total{model=\"gpt-test\"} 0.25",
        ] {
            assert!(line(&text, expected).is_some(), "{expected}:\n{text}");
        }
        // No identifier of a run, task or attempt ever becomes a label.
        assert!(!text.contains(&run.to_string()), "{text}");
        assert!(!text.contains("fetch"), "{text}");
    }

    #[test]
    fn consumer_lag_is_a_sample_not_a_sum() {
        let m = Metrics::new();
        for (pending, ack_pending) in [(12, 3), (4, 1)] {
            ConsumerLag {
                pool: "default",
                pending,
                ack_pending,
            }
            .emit(&m);
        }
        let text = m.encode().unwrap();
        assert!(
            line(
                &text,
                "flotilla_pool_consumer_pending_messages{pool=\"default\"} 4"
            )
            .is_some(),
            "{text}"
        );
        assert!(
            line(
                &text,
                "flotilla_pool_consumer_ack_pending_messages{pool=\"default\"} 1"
            )
            .is_some(),
            "{text}"
        );
    }
}

/// The supervisor counted an attempt outcome into its agent's failure record.
#[derive(Debug, Clone, Copy)]
pub struct AttemptCounted<'a> {
    /// The agent.
    pub agent: &'a str,
    /// The run.
    pub run: RunId,
    /// The task.
    pub task: &'a TaskId,
    /// The attempt.
    pub attempt: u32,
    /// Whether it succeeded.
    pub success: bool,
    /// The agent's failures since its last success, after this one.
    pub consecutive_failures: u64,
}

impl InternalEvent for AttemptCounted<'_> {
    fn emit(self, metrics: &Metrics) {
        debug!(
            agent = self.agent,
            run = %self.run,
            task = %self.task,
            attempt = self.attempt,
            success = self.success,
            consecutive_failures = self.consecutive_failures,
            "Attempt outcome counted"
        );
        let f = metrics.families();
        f.team_outcomes
            .get_or_create(&AgentOutcomeLabels {
                agent: self.agent.to_owned(),
                outcome: if self.success { "succeeded" } else { "failed" },
            })
            .inc();
        f.team_consecutive_failures
            .get_or_create(&AgentLabels {
                agent: self.agent.to_owned(),
            })
            .set(i64::try_from(self.consecutive_failures).unwrap_or(i64::MAX));
    }
}

/// The supervisor's count of team members by status, after a presence pass.
#[derive(Debug, Clone, Copy)]
pub struct TeamPresence<'a> {
    /// `(status, members)` for every status.
    pub counts: &'a [(&'static str, usize)],
}

impl InternalEvent for TeamPresence<'_> {
    fn emit(self, metrics: &Metrics) {
        let f = metrics.families();
        for (status, n) in self.counts {
            f.team_members
                .get_or_create(&StatusLabels { status })
                .set(i64::try_from(*n).unwrap_or(i64::MAX));
        }
    }
}

/// A supervisor lost a compare-and-set race on a team or failure-record value (another
/// replica wrote it first) and redoes its change: normal with several replicas.
#[derive(Debug, Clone, Copy)]
pub struct SupervisorCasConflict<'a> {
    /// The key.
    pub key: &'a str,
}

impl InternalEvent for SupervisorCasConflict<'_> {
    fn emit(self, metrics: &Metrics) {
        debug!(key = self.key, "Team value changed concurrently; redoing");
        metrics.families().supervisor_cas_conflicts.inc();
    }
}

/// One attempt to deliver a notice to a webhook ended: `delivered` (a 2xx answer), `retried`
/// (it failed and will be repeated after a pause) or `dropped` (its last attempt failed).
#[derive(Debug, Clone, Copy)]
pub struct WebhookDelivery<'a> {
    /// The webhook's name.
    pub webhook: &'a str,
    /// `delivered`, `retried` or `dropped`.
    pub outcome: &'static str,
}

impl InternalEvent for WebhookDelivery<'_> {
    fn emit(self, metrics: &Metrics) {
        metrics
            .families()
            .webhook_deliveries
            .get_or_create(&crate::metrics::WebhookLabels {
                webhook: self.webhook.to_owned(),
                outcome: self.outcome,
            })
            .inc();
    }
}

/// An agent's or role's trust level as the supervisor last wrote it (0 novice, 1 proficient,
/// 2 expert).
#[derive(Debug, Clone, Copy)]
pub struct TrustLevelSet<'a> {
    /// `agent` or `role`.
    pub scope: &'static str,
    /// The agent's or role's name.
    pub name: &'a str,
    /// 0, 1 or 2.
    pub level: i64,
}

impl InternalEvent for TrustLevelSet<'_> {
    fn emit(self, metrics: &Metrics) {
        metrics
            .families()
            .trust_level
            .get_or_create(&crate::metrics::ScopeNameLabels {
                scope: self.scope,
                name: self.name.to_owned(),
            })
            .set(self.level);
    }
}
