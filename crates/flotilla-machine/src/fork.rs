//! A fork's start (`run.fork`): the tasks its plan keeps succeed with the original's results.

use std::sync::Arc;

use flotilla_model::event::{WorkflowEvent, WorkflowPhase};
use flotilla_model::run::TaskStatus;

use crate::{Action, RunMachine};

impl RunMachine {
    /// A fork's start: each task it reuses succeeds with the original's result (read where
    /// the original stored it, by run-log sequence), in plan order, without a dispatch. Its
    /// produced topics and output are written as a result's are, and its dependents are
    /// released as by a result.
    pub(crate) fn reuse(&mut self, now_ms: i64, actions: &mut Vec<Action>) {
        let plan = Arc::clone(&self.plan);
        let Some(fork) = plan.fork.as_ref() else {
            return;
        };
        for r in &fork.reused {
            let Some(i) = self.graph.index_of(&r.task_id) else {
                continue;
            };
            if self.state.tasks[i as usize].status != TaskStatus::Waiting {
                continue;
            }
            self.ready.remove(&i);
            let t = &mut self.state.tasks[i as usize];
            t.held = false;
            self.succeed(
                i,
                r.seq,
                now_ms,
                WorkflowEvent {
                    detail: Some(format!("reused from run {}", fork.run_id)),
                    ..WorkflowEvent::phase(WorkflowPhase::TaskSucceeded)
                },
                actions,
            );
        }
    }
}
