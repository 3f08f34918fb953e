//! Performing the machine's approval actions: asking (the request in the escalations bucket
//! and its notice), settling an expired approval with its default — or relaying the answer
//! that won the race — and withdrawing the approvals of a run that ended.

use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::approval::{
    ApprovalAnswer, ApprovalRecord, ApprovalRequest, ApprovalStatus, Decision, Trigger,
    approval_id, digest_of,
};
use flotilla_model::time::Timestamp;
use tracing::info;

use crate::approvals::settled;

use super::{Cached, Runtime, StepError};

impl Runtime {
    /// The request of attempt `attempt` of task `task`, as a pending record.
    fn approval_record(
        &self,
        entry: &Cached,
        task: u32,
        attempt: u32,
        trigger: Trigger,
        deadline_ms: i64,
    ) -> ApprovalRecord {
        let state = entry.machine.state();
        let sub = &entry.machine.plan().subtasks[task as usize];
        let policy = state.hitl.as_ref();
        let timeout_ms = policy.map_or(0, |p| p.timeout.get().as_millis() as i64);
        ApprovalRecord {
            protocol: PROTOCOL_VERSION,
            status: ApprovalStatus::Pending,
            request: ApprovalRequest {
                approval_id: approval_id(task, attempt),
                run_id: state.run_id,
                task_id: sub.id.clone(),
                attempt,
                trigger,
                mode: policy.map(|p| p.mode_of(sub)).unwrap_or_default(),
                action: sub.action.clone(),
                risk: sub.risk,
                agent: sub.agent.clone().or_else(|| self.default_agent.clone()),
                role: sub.role.clone(),
                description: sub.description.clone(),
                input: sub.input.clone(),
                digest: digest_of(&sub.description, &sub.input),
                requested_at: Timestamp::from_unix_ms(deadline_ms - timeout_ms),
                deadline: Timestamp::from_unix_ms(deadline_ms),
                default: policy.map(|p| p.on_timeout.of(trigger)).unwrap_or_default(),
            },
            answer: None,
        }
    }

    pub(super) async fn request_approval(
        &self,
        entry: &Cached,
        task: u32,
        attempt: u32,
        trigger: Trigger,
        deadline_ms: i64,
        notify_only: bool,
    ) -> Result<(), StepError> {
        let record = self.approval_record(entry, task, attempt, trigger, deadline_ms);
        self.escalations
            .request(&record, notify_only)
            .await
            .map_err(StepError::from)
    }

    /// The deadline passed: the default settles the approval unless an answer came first;
    /// either way the winner goes to the run log.
    pub(super) async fn expire_approval(
        &self,
        entry: &Cached,
        task: u32,
        attempt: u32,
    ) -> Result<(), StepError> {
        let state = entry.machine.state();
        let run = state.run_id;
        let Some(pending) = state.tasks[task as usize].approval else {
            return Ok(());
        };
        let missing =
            self.approval_record(entry, task, attempt, pending.trigger, pending.deadline_ms);
        let timeout = state
            .hitl
            .as_ref()
            .map(|p| p.timeout)
            .unwrap_or(flotilla_model::approval::DEFAULT_APPROVAL_TIMEOUT);
        let id = approval_id(task, attempt);
        let (record, ours) = self
            .escalations
            .settle(run, &id, Some(&missing), None, |p| {
                settled(
                    p,
                    ApprovalStatus::Expired,
                    ApprovalAnswer {
                        decision: Decision::of_default(p.request.default, timeout),
                        by: "deadline".into(),
                        comment: None,
                        at: Timestamp::from_unix_ms(pending.deadline_ms),
                    },
                )
            })
            .await?;
        if ours {
            info!(%run, approval = %id, decision = record.answer.as_ref().map_or("", |a| a.decision.as_str()), "Approval expired: its default decides");
        }
        self.escalations
            .relay(&record)
            .await
            .map_err(StepError::from)
    }

    /// The run ended while the task waited: its approval is withdrawn unless settled first.
    pub(super) async fn withdraw_approval(
        &self,
        entry: &Cached,
        task: u32,
        attempt: u32,
    ) -> Result<(), StepError> {
        let state = entry.machine.state();
        let run = state.run_id;
        let reason = state
            .stop_reason
            .clone()
            .unwrap_or_else(|| "the run ended".into());
        let id = approval_id(task, attempt);
        let result = self
            .escalations
            .settle(run, &id, None, None, |p| {
                settled(
                    p,
                    ApprovalStatus::Withdrawn,
                    ApprovalAnswer {
                        decision: Decision::Reject {
                            message: reason.clone(),
                        },
                        by: "run".into(),
                        comment: None,
                        at: Timestamp::now(),
                    },
                )
            })
            .await;
        match result {
            Ok(_) | Err(crate::approvals::ApprovalError::NotFound(_)) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}
