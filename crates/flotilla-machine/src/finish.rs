//! How a run ends: its status, outcome and the tasks its result is made of, decided once
//! every task is settled or the run is stopped (failure policy, cancel, budget).

use std::sync::Arc;

use flotilla_model::run::PlanningStatus;
use flotilla_model::run::{EndCause, FailedTask, RunOutcome, RunStatus, SkippedTask, TaskStatus};
use flotilla_model::task::{TaskError, TaskErrorKind, TaskResult};

use crate::{Action, Input, MAX_LISTED, RunMachine};

impl RunMachine {
    /// The confidence under which a success of `task` is held for a person's review
    /// (`[hitl] low-confidence`), if its results are reviewed at all.
    pub fn review_below(&self, task: u32) -> Option<f64> {
        self.review_threshold(task, Some(f64::NEG_INFINITY))
            .map(|(_, threshold)| threshold)
    }

    /// Whether a success of attempt `attempt` of `task`, applied next, would end the run
    /// succeeded with nothing more to do than its end — the run's final result being this
    /// task's result alone — whatever the result says: the condition under which the
    /// attempt's worker may answer the run's waiting submitters itself
    /// (`flotilla_model::task::TaskAnswer`). Found by applying such a success to a copy, so
    /// it holds exactly when the machine would act so — for a result without a confidence:
    /// one under [`RunMachine::review_below`] is held for review instead.
    pub fn success_ends_run(&self, task: u32, attempt: u32, now_ms: i64) -> bool {
        let s = &self.state;
        let i = task as usize;
        if s.status.is_terminal()
            || s.hold.is_some()
            || s.planning.is_some()
            || self.graph.finals() != [task]
            || s.tasks
                .get(i)
                .is_none_or(|t| t.status != TaskStatus::Dispatched || t.attempt != attempt)
            || s.tasks
                .iter()
                .enumerate()
                .any(|(j, t)| j != i && t.status != TaskStatus::Succeeded)
        {
            return false;
        }
        // The run's timer is on another subject than its log: its firing may come before the
        // result whatever the worker checks. It must find nothing to do, however late.
        if let Some(timer) = s.timer {
            let mut fired = self.clone();
            let actions = fired.apply(
                Input::Timer {
                    generation: timer.generation,
                },
                i64::MAX / 2,
            );
            if actions
                .iter()
                .any(|a| !matches!(a, Action::ArmTimer { .. }))
                || fired.state.status != s.status
                || fired
                    .state
                    .tasks
                    .iter()
                    .zip(&s.tasks)
                    .any(|(a, b)| a.status != b.status)
            {
                return false;
            }
        }
        let mut copy = self.clone();
        let id = self.plan.subtasks[i].id.clone();
        let result = TaskResult::success(String::new());
        let actions = copy.apply(
            Input::Result {
                task: &id,
                attempt,
                result: &result,
                seq: u64::MAX,
                worker: None,
                started_at: None,
                agent: None,
            },
            now_ms,
        );
        copy.state.status == RunStatus::Succeeded
            && actions
                .iter()
                .all(|a| matches!(a, Action::Emit(_) | Action::Finish))
    }

    pub(crate) fn finish(&mut self, now_ms: i64, actions: &mut Vec<Action>) {
        self.finish_with(None, now_ms, actions);
    }

    /// Ends the run. `forced` is the status and reason of an early stop; otherwise the status
    /// follows from the tasks (a required task failed or was skipped: failed).
    pub(crate) fn finish_with(
        &mut self,
        forced: Option<(RunStatus, String, EndCause)>,
        now_ms: i64,
        actions: &mut Vec<Action>,
    ) {
        if self.state.hold.is_some() {
            // Ending while held: the workers' hold on its attempts is lifted with it.
            actions.push(Action::HoldAttempts { held: false });
        }
        // Tasks paused by themselves: their holds end with the run.
        for (i, t) in self.state.tasks.iter_mut().enumerate() {
            t.paused_by_lead = false;
            if std::mem::take(&mut t.paused_until_ms) > 0 && t.attempt > 0 {
                actions.push(Action::HoldTask {
                    task: i as u32,
                    held: false,
                });
            }
        }
        let mut failed = Vec::new();
        let mut skipped = Vec::new();
        let (mut failed_omitted, mut skipped_omitted) = (0u32, 0u32);
        let mut blocking = None;
        let plan = Arc::clone(&self.plan);
        for (i, t) in self.state.tasks.iter().enumerate() {
            let sub = &plan.subtasks[i];
            if t.status == TaskStatus::Failed && failed.len() >= MAX_LISTED {
                failed_omitted += 1;
                if sub.required && blocking.is_none() {
                    blocking = Some((
                        EndCause::TaskFailed,
                        format!("required task {} failed", sub.id),
                    ));
                }
                continue;
            }
            if matches!(t.status, TaskStatus::Skipped | TaskStatus::Cancelled)
                && skipped.len() >= MAX_LISTED
            {
                skipped_omitted += 1;
                if sub.required && blocking.is_none() && t.status == TaskStatus::Skipped {
                    blocking = Some((
                        EndCause::TaskSkipped,
                        format!("required task {} was skipped", sub.id),
                    ));
                }
                continue;
            }
            match t.status {
                TaskStatus::Failed => {
                    let error = t.error.clone().unwrap_or(TaskError {
                        kind: TaskErrorKind::Internal,
                        message: "failed".into(),
                    });
                    if sub.required && blocking.is_none() {
                        blocking = Some((
                            EndCause::TaskFailed,
                            format!("required task {} failed: {error}", sub.id),
                        ));
                    }
                    failed.push(FailedTask {
                        task_id: sub.id.clone(),
                        attempts: t.attempt,
                        error,
                    });
                }
                TaskStatus::Skipped => {
                    let reason = self.state.skip_reason(i, Some(&plan)).unwrap_or_default();
                    if sub.required && blocking.is_none() {
                        blocking = Some((
                            EndCause::TaskSkipped,
                            format!("required task {} was skipped ({reason})", sub.id),
                        ));
                    }
                    skipped.push(SkippedTask {
                        task_id: sub.id.clone(),
                        reason,
                    });
                }
                TaskStatus::Cancelled => skipped.push(SkippedTask {
                    task_id: sub.id.clone(),
                    reason: forced
                        .as_ref()
                        .map_or_else(|| "cancelled".to_owned(), |(_, r, _)| r.clone()),
                }),
                _ => {}
            }
        }
        let mut cause = blocking.as_ref().map(|(c, _)| *c);
        let mut blocking = blocking.map(|(_, r)| r);
        if forced.is_none() && blocking.is_none() && self.state.failed >= self.abort_threshold() {
            // Every task ended, but too many failed (even if all of them were optional).
            blocking = Some(self.threshold_reached());
            cause = Some(EndCause::FailureThreshold);
        }
        let status = match &forced {
            Some((status, reason, c)) => {
                blocking = Some(reason.clone());
                cause = Some(*c);
                *status
            }
            None if blocking.is_some() => RunStatus::Failed,
            None => RunStatus::Succeeded,
        };
        // A run that failed because a model call was refused for its (or its tree's) budget
        // says so first: clients branch on `budget_exhausted` (to extend the budget, say).
        if status == RunStatus::Failed
            && matches!(
                cause,
                Some(EndCause::TaskFailed | EndCause::TaskSkipped | EndCause::FailureThreshold)
            )
            && self.state.tasks.iter().any(|t| {
                t.status == TaskStatus::Failed
                    && t.error
                        .as_ref()
                        .is_some_and(|e| e.kind == TaskErrorKind::BudgetExhausted)
            })
        {
            cause = Some(EndCause::BudgetExhausted);
            blocking = blocking.map(|r| format!("budget_exhausted: {r}"));
        }
        if let Some(p) = self.state.planning.as_mut()
            && p.status != PlanningStatus::Planned
        {
            // Ended before a plan was accepted: the planner failed, or the run was stopped.
            p.status = PlanningStatus::Failed;
        }
        self.state.status = status;
        self.state.finished_ms = Some(now_ms);
        self.state.timer = None;
        self.state.outcome = Some(RunOutcome {
            run_id: self.state.run_id,
            status,
            final_result: None,
            failed,
            skipped,
            failed_omitted,
            skipped_omitted,
            reason: blocking,
            cause,
            rollback_run_id: None,
        });
        actions.push(Action::Finish);
    }

    /// The tasks whose results make up the final result (succeeded ones only; none while a
    /// bare query is unplanned).
    pub fn final_tasks(&self) -> Vec<u32> {
        if self.unplanned() {
            return Vec::new();
        }
        self.graph
            .finals()
            .iter()
            .copied()
            .filter(|&i| self.state.tasks[i as usize].status == TaskStatus::Succeeded)
            .collect()
    }

    /// Whether the run stopped before its plan completed (cancelled or aborted): its final
    /// result is then the partial results of every task that succeeded.
    pub fn stopped_early(&self) -> bool {
        self.state
            .tasks
            .iter()
            .any(|t| t.status == TaskStatus::Cancelled)
    }

    /// Every task that succeeded, in plan order, as plan indexes (a bare query's planner
    /// task included).
    pub(crate) fn succeeded_tasks_all(&self) -> Vec<usize> {
        (0..self.graph.len())
            .filter(|&i| self.state.tasks[i].status == TaskStatus::Succeeded)
            .collect()
    }

    /// Every task that succeeded, in plan order (none while a bare query is unplanned).
    pub fn succeeded_tasks(&self) -> Vec<u32> {
        if self.unplanned() {
            return Vec::new();
        }
        (0..self.graph.len() as u32)
            .filter(|&i| self.state.tasks[i as usize].status == TaskStatus::Succeeded)
            .collect()
    }
}
