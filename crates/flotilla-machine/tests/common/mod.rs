//! Shared helpers of the run machine's tests: a plan and its submission, task results and
//! the inputs that carry them, and what a step's actions dispatch and emit.

#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::sync::Arc;

use flotilla_machine::{Action, Input};
use flotilla_model::event::WorkflowPhase;
use flotilla_model::ids::TaskId;
use flotilla_model::plan::{Plan, PlanConfig, Subtask};
use flotilla_model::runlog::Submitted;
use flotilla_model::task::{TaskErrorKind, TaskResult};

pub fn plan(tasks: Vec<Subtask>, config: PlanConfig) -> Arc<Plan> {
    Arc::new(Plan {
        fork: None,
        name: Some("t".into()),
        query: None,
        subtasks: tasks,
        config,
    })
}

pub fn submitted(p: &Plan) -> Submitted {
    Submitted {
        plan: p.clone(),
        labels: BTreeMap::new(),
        session_id: None,
        parent: None,
        reply_to: None,
        wait_reply_to: None,
        intake_seq: None,
        warnings: Vec::new(),
        trace: None,
        planning: None,
        depth: 0,
        budget_scopes: Vec::new(),
        anycast: false,
        memory: None,
        lead: None,
        hitl: None,
    }
}

pub fn diamond() -> Vec<Subtask> {
    vec![
        Subtask::new("a", ""),
        Subtask::new("b", "").after(&["a"]),
        Subtask::new("c", "").after(&["a"]),
        Subtask::new("d", "").after(&["b", "c"]),
    ]
}

pub fn dispatched(actions: &[Action]) -> Vec<(u32, u32)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Dispatch { task, attempt } => Some((*task, *attempt)),
            _ => None,
        })
        .collect()
}

pub fn phases(actions: &[Action]) -> Vec<WorkflowPhase> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Emit(e) => Some(e.event.phase),
            _ => None,
        })
        .collect()
}

pub fn ok(id: &str) -> (TaskId, TaskResult) {
    (TaskId::new(id), TaskResult::success(format!("{id} done")))
}

pub fn result<'a>(t: &'a (TaskId, TaskResult), attempt: u32, seq: u64) -> Input<'a> {
    Input::Result {
        task: &t.0,
        attempt,
        result: &t.1,
        seq,
        worker: None,
        started_at: None,
        agent: None,
    }
}

pub fn fail(id: &str) -> (TaskId, TaskResult) {
    (
        TaskId::new(id),
        TaskResult::failure(TaskErrorKind::AgentFailed, "scripted failure"),
    )
}
