//! What a committed step decided, counted once however often it is performed: runs admitted
//! and finished, tasks dispatched, retried and finished, and dependency hops.

use std::time::Duration;

use flotilla_model::event::WorkflowPhase;
use flotilla_model::ids::RunId;
use flotilla_model::submit::SubmitStatus;
use flotilla_telemetry::InternalEvent;
use flotilla_telemetry::events::{
    DependencyHop, RunFinished, RunSubmitted, TaskDispatched, TaskFinished, TaskRetried,
};

use crate::machine::Action;

use super::{Cached, Runtime};

impl Runtime {
    /// Counts what a committed step decided: the run admitted, tasks dispatched, retried and
    /// finished, the run finished. Labels are the task's pool and agent; ids go to the log
    /// lines only.
    pub(super) fn record<'a>(
        &self,
        entry: &Cached,
        actions: impl IntoIterator<Item = &'a Action>,
        admitted: bool,
    ) {
        let state = entry.machine.state();
        let run = state.run_id;
        if admitted {
            RunSubmitted {
                run: Some(run),
                status: SubmitStatus::Accepted,
            }
            .emit(&self.metrics);
        }
        let plan = entry.machine.plan();
        let task = |i: u32| {
            let sub = &plan.subtasks[i as usize];
            let agent = sub
                .agent
                .as_deref()
                .or(self.default_agent.as_deref())
                .unwrap_or("default");
            (sub, agent)
        };
        for action in actions {
            match action {
                Action::Dispatch { task: i, attempt } => {
                    let (sub, agent) = task(*i);
                    TaskDispatched {
                        run,
                        task: &sub.id,
                        attempt: *attempt,
                        pool: &sub.pool,
                        agent,
                    }
                    .emit(&self.metrics);
                }
                Action::Emit(e) => {
                    let Some(i) = e.task else { continue };
                    let (sub, agent) = task(i);
                    let status = match e.event.phase {
                        WorkflowPhase::TaskRetrying => {
                            let delay = e.event.retry_at.map_or(0, |at| at.unix_ms() - e.at_ms);
                            TaskRetried {
                                run,
                                task: &sub.id,
                                attempt: e.attempt.unwrap_or_default(),
                                pool: &sub.pool,
                                agent,
                                delay: Duration::from_millis(delay.max(0) as u64),
                            }
                            .emit(&self.metrics);
                            continue;
                        }
                        WorkflowPhase::TaskSucceeded => flotilla_model::run::TaskStatus::Succeeded,
                        WorkflowPhase::TaskFailed => flotilla_model::run::TaskStatus::Failed,
                        WorkflowPhase::TaskSkipped => flotilla_model::run::TaskStatus::Skipped,
                        _ => continue,
                    };
                    TaskFinished {
                        run,
                        task: &sub.id,
                        pool: &sub.pool,
                        agent,
                        status,
                    }
                    .emit(&self.metrics);
                }
                Action::Finish => RunFinished {
                    run,
                    status: state.status,
                }
                .emit(&self.metrics),
                _ => {}
            }
        }
    }

    /// Records the dependency hops of a performed step: from the result that made a task
    /// ready being stored (server clock) to that task's dispatch being stored.
    pub(super) fn record_hops(&self, run: RunId, entry: &Cached, hops: &[(u32, i128)]) {
        if hops.is_empty() {
            return;
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i128);
        let plan = entry.machine.plan();
        for &(task, published_ns) in hops {
            let ns = u64::try_from(now - published_ns).unwrap_or(0);
            DependencyHop {
                run,
                task: &plan.subtasks[task as usize].id,
                duration: Duration::from_nanos(ns),
            }
            .emit(&self.metrics);
        }
    }
}
