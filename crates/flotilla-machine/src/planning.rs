//! The planning phase of a bare query: the review of a planner's answer (accepted, repair,
//! failed) and switching the run to the plan it produced.

use std::sync::Arc;

use flotilla_model::event::{WorkflowEvent, WorkflowPhase};
use flotilla_model::plan::{Plan, Strategy, StrategyChoice};
use flotilla_model::run::PlanningStatus;
use flotilla_model::run::{EndCause, RunStatus};
use flotilla_model::runlog::PlanDecision;

use crate::{Action, RunGraph, RunMachine, TaskState};

impl RunMachine {
    /// Applies the review of the current planner round.
    pub(crate) fn on_planned(
        &mut self,
        decision: &PlanDecision,
        seq: u64,
        now_ms: i64,
        actions: &mut Vec<Action>,
    ) {
        match decision {
            PlanDecision::Accepted { plan, warnings } => {
                let choice = StrategyChoice::resolve(plan, self.state.lead.is_some());
                let led = choice.strategy == Strategy::Supervisor;
                self.replan(Arc::new(plan.clone()), seq, led, now_ms, actions);
                self.state.warnings.extend(warnings.iter().cloned());
                self.state.strategy = Some(choice.clone());
                if let Some(p) = self.state.planning.as_mut() {
                    p.status = PlanningStatus::Planned;
                }
                if led {
                    self.await_lead(now_ms, actions);
                }
                let event = WorkflowEvent {
                    tasks_total: Some(self.graph.len() as u32),
                    strategy: Some(choice),
                    detail: self.plan.name.clone(),
                    ..WorkflowEvent::phase(WorkflowPhase::RunPlanned)
                };
                self.emit(None, None, now_ms, event, actions);
            }
            PlanDecision::Repair { plan, problems } => {
                self.replan(Arc::new(plan.clone()), seq, false, now_ms, actions);
                let round = self.state.planning.as_ref().map_or(1, |p| p.round);
                if let Some(p) = self.state.planning.as_mut() {
                    p.round += 1;
                    p.status = PlanningStatus::Planning;
                }
                let event = WorkflowEvent {
                    detail: Some(format!(
                        "planner answer {round} has {} problem(s); asking for a repair",
                        problems.len()
                    )),
                    problems: problems.clone(),
                    ..WorkflowEvent::phase(WorkflowPhase::PlanRepairing)
                };
                self.emit(None, None, now_ms, event, actions);
            }
            PlanDecision::Failed { problems } => {
                let rounds = self.state.planning.as_ref().map_or(1, |p| p.round);
                let shown: Vec<String> = problems.iter().take(5).map(ToString::to_string).collect();
                let more = problems.len().saturating_sub(shown.len());
                let mut reason = format!(
                    "planning_failed: the planner gave no valid plan in {rounds} answer(s): {}",
                    shown.join("; ")
                );
                if more > 0 {
                    reason.push_str(&format!("; and {more} more"));
                }
                self.state.errors = problems.clone();
                self.stop(
                    RunStatus::Failed,
                    reason,
                    EndCause::PlanningFailed,
                    now_ms,
                    actions,
                );
            }
        }
    }

    /// Switches the run to `plan` (the planned plan, or the next planning plan) stored at
    /// run-log sequence `seq`: fresh tasks (`held` for the lead's assignment), same run.
    pub(crate) fn replan(
        &mut self,
        plan: Arc<Plan>,
        seq: u64,
        held: bool,
        now_ms: i64,
        actions: &mut Vec<Action>,
    ) {
        let graph = Arc::new(RunGraph::new(&plan));
        let mut state = self.state.clone();
        state.tasks = vec![TaskState::held(held); plan.subtasks.len()];
        state.topics_ready.clear();
        // Timers of the previous plan are stale: their firings no longer match.
        state.timer = None;
        state.failed = 0;
        state.stop_reason = None;
        state.plan_seq = seq;
        if plan.name.is_some() {
            state.name = plan.name.clone();
        }
        *self = Self::restore_with_graph(plan, graph, state);
        for i in 0..self.graph.len() as u32 {
            if self.remaining[i as usize] == 0 && self.missing[i as usize] > 0 && !held {
                self.gate(i, now_ms, actions);
            }
        }
    }

    /// Whether the run follows a planning plan (a bare query not planned yet): its planner
    /// answer is not a result of the run.
    pub(crate) fn unplanned(&self) -> bool {
        self.state
            .planning
            .as_ref()
            .is_some_and(|p| p.status != PlanningStatus::Planned)
    }
}
