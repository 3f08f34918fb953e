//! The `supervisor` strategy: a lead decides what runs.
//!
//! A led run holds every subtask of its plan ([`crate::TaskState::held`]) until the lead
//! assigns it ([`flotilla_model::runlog::Assigned`]); an assigned task then runs like any DAG
//! task, once its dependencies are met. Recruits join unheld: the lead (or a member) asked
//! for them to run. The run does not end when its tasks have: it waits for the lead's
//! [`flotilla_model::runlog::Finished`], whose result is the run's final result, bounded by
//! `lead_timeout` — every wait has a deadline, and this one's default is failure
//! (`lead_timeout`). The failure ratio aborts a led run as any other.
//!
//! The lead itself is not a task: it is a persistent teammate of the run, kept by the
//! supervisor service, whose tools append these inputs after checking its policy. The machine
//! checks again what the inputs may change, so a late or repeated input changes nothing.

use std::collections::BTreeMap;

use flotilla_model::event::{WorkflowEvent, WorkflowPhase};
use flotilla_model::numeric::extract_numeric_value;
use flotilla_model::plan::Strategy;
use flotilla_model::recruit::MAX_REASON;
use flotilla_model::run::{EndCause, FinalResult, RunStatus};
use flotilla_model::runlog::{Assigned, Finished};

use crate::{Action, RunMachine, truncate_message};

impl RunMachine {
    /// Whether the run is led now: the `supervisor` strategy, and planned.
    pub fn led(&self) -> bool {
        !self.unplanned()
            && self
                .state
                .strategy
                .as_ref()
                .is_some_and(|s| s.strategy == Strategy::Supervisor)
    }

    /// Starts the wait for the lead's finish (a led plan just started running).
    pub(crate) fn await_lead(&mut self, now_ms: i64, actions: &mut Vec<Action>) {
        let due = now_ms + self.plan.config.lead_timeout.get().as_millis() as i64;
        self.state.lead_deadline_ms = due;
        self.arm_if_earlier(due, actions);
    }

    /// When the wait for the lead's finish ends.
    pub(crate) fn lead_deadline(&self) -> Option<i64> {
        (self.led() && self.state.lead_deadline_ms > 0).then_some(self.state.lead_deadline_ms)
    }

    /// Ends the run `failed` when its lead did not finish it in time. `true`: it ended.
    pub(crate) fn lead_overdue(&mut self, now_ms: i64, actions: &mut Vec<Action>) -> bool {
        if self.lead_deadline().is_none_or(|d| d > now_ms) {
            return false;
        }
        let timeout = self.plan.config.lead_timeout.get();
        self.stop(
            RunStatus::Failed,
            format!(
                "lead_timeout: the lead did not finish the run within {}",
                crate::humantime_duration(timeout)
            ),
            EndCause::LeadTimeout,
            now_ms,
            actions,
        );
        true
    }

    /// Applies an assignment: the task runs once its dependencies are met. `false`: it
    /// changes nothing (not led, no such task, already assigned, or already ended).
    pub(crate) fn on_assigned(
        &mut self,
        a: &Assigned,
        now_ms: i64,
        actions: &mut Vec<Action>,
    ) -> bool {
        if !self.led() {
            return false;
        }
        let Some(i) = self.graph.index_of(&a.task_id) else {
            return false;
        };
        let t = &mut self.state.tasks[i as usize];
        if !t.held || t.status.is_terminal() {
            return false;
        }
        t.held = false;
        self.state.applied += 1;
        let mut detail = format!("assigned by {}", a.by);
        if !a.reason.is_empty() {
            detail.push_str(": ");
            detail.push_str(&a.reason);
        }
        truncate_message(&mut detail, MAX_REASON);
        self.emit(
            Some(i),
            None,
            now_ms,
            WorkflowEvent {
                detail: Some(detail),
                ..WorkflowEvent::phase(WorkflowPhase::TaskAssigned)
            },
            actions,
        );
        self.release(i, now_ms, actions);
        // Its dependency clock may run from now on.
        self.rescan_deadlines = true;
        true
    }

    /// Applies the lead's finish: unfinished tasks are cancelled and the run succeeds with the
    /// lead's result. `false`: it changes nothing (not led).
    pub(crate) fn on_finished(
        &mut self,
        f: &Finished,
        now_ms: i64,
        actions: &mut Vec<Action>,
    ) -> bool {
        if !self.led() {
            return false;
        }
        self.state.applied += 1;
        let mut response = f.result.clone();
        truncate_message(&mut response, Finished::MAX_RESULT);
        let mut by = f.by.clone();
        truncate_message(&mut by, MAX_REASON);
        self.stop(
            RunStatus::Succeeded,
            format!("finished by {by}"),
            EndCause::LeadFinished,
            now_ms,
            actions,
        );
        if let Some(outcome) = self.state.outcome.as_mut() {
            outcome.final_result = Some(FinalResult {
                numeric_value: extract_numeric_value(&response),
                response,
                results: BTreeMap::new(),
                partial: false,
                omitted: 0,
                artifact: None,
            });
        }
        true
    }
}
