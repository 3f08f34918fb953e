//! Team changes while a run runs: a recruit adds one subtask to the plan, a retirement hands a
//! member's tasks that have not started to their role or fails them.
//!
//! The supervisor checked its policy and validated the amended plan before it appended the
//! input; the plan may have changed since (another recruit took the task id), so the machine
//! checks again — structurally, with no deployment knowledge, so every replay decides alike —
//! and refuses what no longer fits, keeping the refusal as a team change.
//!
//! **Restoring.** The run's record keeps the recruited subtasks and, per retirement, the tasks
//! it reassigned ([`RunState::amend`]): the plan a restore runs with is the stored plan
//! amended by them, with no extra read of the run log. A recruit only appends a task (it may
//! depend on existing tasks, never the reverse), so existing task and topic indices do not
//! move and no cycle can appear.

use std::sync::Arc;

use flotilla_model::event::{WorkflowEvent, WorkflowPhase};
use flotilla_model::ids::TaskId;
use flotilla_model::plan::Plan;
use flotilla_model::recruit::{
    MAX_REASON, MAX_TEAM_CHANGES, RetirePolicy, TeamChange, TeamChangeKind,
};
use flotilla_model::run::TaskStatus;
use flotilla_model::runlog::{Recruited, Retired};
use flotilla_model::task::{TaskError, TaskErrorKind};
use flotilla_model::time::Timestamp;
use flotilla_model::validate::{ValidationContext, validate_plan};

use crate::{Action, RunGraph, RunMachine, RunState, TaskState, truncate_message};

impl RunState {
    /// `base` (the submitted or planned plan) amended by the run's team changes: the
    /// recruited subtasks appended, the reassigned tasks' agents cleared. What a restore and
    /// a reader must run and show.
    pub fn amend(&self, mut base: Plan) -> Plan {
        // An edited plan holds what came before the edit.
        let (recruited, team) = self
            .edit_mark
            .map_or((0, 0), |(r, t)| (r as usize, t as usize));
        base.subtasks
            .extend(self.recruited.iter().skip(recruited).cloned());
        for change in self.team.iter().skip(team) {
            for id in &change.reassigned {
                if let Some(t) = base.subtasks.iter_mut().find(|t| &t.id == id) {
                    t.agent = None;
                }
            }
        }
        base
    }

    /// The team change with this id (a recruit id, or a retired member).
    pub fn team_change(&self, kind: TeamChangeKind, id: &str) -> Option<&TeamChange> {
        self.team.iter().find(|c| {
            c.id == id
                && match kind {
                    TeamChangeKind::Retired => c.kind == TeamChangeKind::Retired,
                    _ => c.kind != TeamChangeKind::Retired,
                }
        })
    }
}

fn bounded(reason: &str) -> String {
    let mut r = reason.to_owned();
    truncate_message(&mut r, MAX_REASON);
    r
}

impl RunMachine {
    /// Applies a recruit: adds its subtask, or refuses it.
    pub(crate) fn on_recruited(
        &mut self,
        r: &Recruited,
        seq: u64,
        now_ms: i64,
        actions: &mut Vec<Action>,
    ) -> bool {
        if self
            .state
            .team_change(TeamChangeKind::Recruited, &r.recruit_id)
            .is_some()
        {
            return false;
        }
        self.state.applied += 1;
        let refusal = if self.unplanned() {
            Some("the run is still being planned".to_owned())
        } else if self.state.team.len() >= MAX_TEAM_CHANGES {
            Some(format!(
                "the run already has {MAX_TEAM_CHANGES} team changes, the most one run keeps"
            ))
        } else if r.subtask.agent.is_some() {
            Some("a recruit's subtask names a role, not an agent".to_owned())
        } else if self.graph.index_of(&r.subtask.id).is_some() {
            Some(format!("the run already has a task {}", r.subtask.id))
        } else {
            let mut plan = (*self.plan).clone();
            plan.subtasks.push(r.subtask.clone());
            // Structure only (ids, dependencies, producers, sizes): what the deployment
            // allows was checked by the supervisor, and must not make replays differ.
            let report = validate_plan(&plan, &ValidationContext::default());
            if report.is_valid() {
                self.add_task(plan, r, seq, now_ms, actions);
                return true;
            }
            let problems: Vec<String> = report
                .errors
                .iter()
                .take(5)
                .map(ToString::to_string)
                .collect();
            Some(format!(
                "the subtask no longer fits the plan: {}",
                problems.join("; ")
            ))
        };
        let refusal = refusal.unwrap_or_default();
        if self.state.team.len() < MAX_TEAM_CHANGES {
            self.state.team.push(TeamChange {
                kind: TeamChangeKind::Refused,
                id: r.recruit_id.clone(),
                member: member_of(r),
                task_id: Some(r.subtask.id.clone()),
                reassigned: Vec::new(),
                failed: Vec::new(),
                by: r.by.clone(),
                reason: bounded(&r.reason),
                refusal: Some(refusal.clone()),
                seq,
                at: Timestamp::from_unix_ms(now_ms),
            });
        }
        let event = WorkflowEvent {
            role: r.subtask.role.clone(),
            detail: Some(format!("recruit {} refused: {refusal}", r.recruit_id)),
            ..WorkflowEvent::phase(WorkflowPhase::RecruitRefused)
        };
        self.emit(None, None, now_ms, event, actions);
        true
    }

    fn add_task(
        &mut self,
        plan: Plan,
        r: &Recruited,
        seq: u64,
        now_ms: i64,
        actions: &mut Vec<Action>,
    ) {
        let plan = Arc::new(plan);
        let graph = Arc::new(RunGraph::new(&plan));
        let mut state = self.state.clone();
        state.tasks.push(TaskState::new());
        state.recruited.push(r.subtask.clone());
        state.team.push(TeamChange {
            kind: TeamChangeKind::Recruited,
            id: r.recruit_id.clone(),
            member: member_of(r),
            task_id: Some(r.subtask.id.clone()),
            reassigned: Vec::new(),
            failed: Vec::new(),
            by: r.by.clone(),
            reason: bounded(&r.reason),
            refusal: None,
            seq,
            at: Timestamp::from_unix_ms(now_ms),
        });
        *self = Self::restore_with_graph(plan, graph, state);
        // Its dependency deadline (and any other) is found by the next scan.
        self.rescan_deadlines = true;
        let i = (self.graph.len() - 1) as u32;
        self.emit(
            Some(i),
            None,
            now_ms,
            WorkflowEvent {
                role: r.subtask.role.clone(),
                tasks_total: Some(self.graph.len() as u32),
                detail: Some(bounded(&r.reason)),
                ..WorkflowEvent::phase(WorkflowPhase::MemberRecruited)
            },
            actions,
        );
        if !self.skip_if_dependency_ended(i, now_ms, actions)
            && self.remaining[i as usize] == 0
            && self.missing[i as usize] > 0
        {
            self.gate(i, now_ms, actions);
        }
    }

    /// Applies a retirement: the member's tasks that have not started go to their role or
    /// fail, per the policy. Attempts already running finish (their retries stay with the
    /// member).
    pub(crate) fn on_retired(
        &mut self,
        r: &Retired,
        seq: u64,
        now_ms: i64,
        actions: &mut Vec<Action>,
    ) -> bool {
        if self
            .state
            .team_change(TeamChangeKind::Retired, &r.member)
            .is_some()
            || self.state.team.len() >= MAX_TEAM_CHANGES
        {
            return false;
        }
        self.state.applied += 1;
        let mut reassigned: Vec<u32> = Vec::new();
        let mut failed: Vec<u32> = Vec::new();
        for (i, task) in self.plan.subtasks.iter().enumerate() {
            if task.agent.as_deref() != Some(r.member.as_str()) {
                continue;
            }
            if !matches!(
                self.state.tasks[i].status,
                TaskStatus::Waiting | TaskStatus::Retrying
            ) {
                continue;
            }
            if r.policy == RetirePolicy::Reassign && task.role.is_some() {
                reassigned.push(i as u32);
            } else {
                failed.push(i as u32);
            }
        }
        let ids = |v: &[u32], plan: &Plan| -> Vec<TaskId> {
            v.iter()
                .map(|&i| plan.subtasks[i as usize].id.clone())
                .collect()
        };
        let change = TeamChange {
            kind: TeamChangeKind::Retired,
            id: r.member.clone(),
            member: r.member.clone(),
            task_id: None,
            reassigned: ids(&reassigned, &self.plan),
            failed: ids(&failed, &self.plan),
            by: r.by.clone(),
            reason: bounded(&r.reason),
            refusal: None,
            seq,
            at: Timestamp::from_unix_ms(now_ms),
        };
        if !reassigned.is_empty() {
            let mut plan = (*self.plan).clone();
            for &i in &reassigned {
                plan.subtasks[i as usize].agent = None;
            }
            // The graph does not depend on agents: only the plan changes.
            self.plan = Arc::new(plan);
        }
        let detail = format!(
            "{} ({}: {} reassigned, {} failed)",
            change.reason,
            r.policy.as_str(),
            change.reassigned.len(),
            change.failed.len()
        );
        self.state.team.push(change);
        self.emit(
            None,
            None,
            now_ms,
            WorkflowEvent {
                agent: Some(r.member.clone()),
                detail: Some(detail),
                ..WorkflowEvent::phase(WorkflowPhase::MemberRetired)
            },
            actions,
        );
        for i in failed {
            let error = TaskError {
                kind: TaskErrorKind::MemberRetired,
                message: format!("{} was retired from the run's team: {}", r.member, r.reason),
            };
            self.fail(
                i,
                error,
                now_ms,
                WorkflowEvent::phase(WorkflowPhase::TaskFailed),
                actions,
            );
            if self.state.status.is_terminal() {
                break;
            }
        }
        true
    }
}

/// The member a recruit adds: its role.
fn member_of(r: &Recruited) -> String {
    match &r.subtask.role {
        Some(role) => format!("role:{role}"),
        None => "default".to_owned(),
    }
}
