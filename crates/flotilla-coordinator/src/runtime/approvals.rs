//! Performing the machine's approval actions: asking (the request in the escalations bucket
//! and its notice), appending the deadline's default once the machine decided it, writing
//! each decision the machine applied to the bucket (with a tool's grant), and withdrawing
//! the approvals the run no longer waits for (its end, a task completed by hand), with an
//! `approval_decided` event that says `withdrawn`.

use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::approval::{
    ApprovalAnswer, ApprovalDecided, ApprovalRecord, ApprovalRequest, ApprovalStatus, Decision,
    DefaultDecision, ToolCallRef, Trigger, digest_of, expired_msg_id, wait_id,
};
use flotilla_model::runlog::{RunInput, RunLogEntry};
use flotilla_model::time::Timestamp;
use tracing::info;

use flotilla_model::event::EventEnvelope;

use crate::approval_store::{approval_event_id, decided_record, grant_of, settled, settled_detail};

use super::{Cached, Runtime, StepError};

/// One wait for a person: a dispatch's (`call` 0) or a suspended tool call's.
#[derive(Debug, Clone, Copy)]
pub(super) struct Wait {
    pub(super) task: u32,
    pub(super) attempt: u32,
    pub(super) call: u32,
    /// For a tool call: the run-log sequence of the suspension.
    pub(super) from_seq: u64,
}

impl Runtime {
    /// The request of `wait`, as a pending record.
    async fn approval_record(
        &self,
        entry: &Cached,
        wait: Wait,
        trigger: Trigger,
        deadline_ms: i64,
    ) -> Result<ApprovalRecord, StepError> {
        let state = entry.machine.state();
        let sub = &entry.machine.plan().subtasks[wait.task as usize];
        let policy = state.hitl.as_ref();
        let timeout_ms = policy.map_or(
            flotilla_model::approval::DEFAULT_APPROVAL_TIMEOUT
                .get()
                .as_millis() as i64,
            |p| p.timeout.get().as_millis() as i64,
        );
        let mut request = ApprovalRequest {
            approval_id: wait_id(wait.task, wait.attempt, wait.call),
            run_id: state.run_id,
            task_id: sub.id.clone(),
            attempt: wait.attempt,
            trigger,
            mode: policy
                .map(|p| flotilla_machine::policy::hitl::mode_of(p, sub))
                .unwrap_or_default(),
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
            tool_call: None,
        };
        if wait.call == flotilla_model::approval::REVIEW_CALL {
            // A held result: what is asked about is the result itself.
            let r = self.store.result_at(wait.from_seq).await?;
            let confidence = r
                .result
                .confidence
                .map_or_else(String::new, |c| format!(" (confidence {c:.2})"));
            request.description = format!(
                "review the result of task {}{confidence} before its dependents run: {}",
                sub.id, sub.description
            );
            request.input = serde_json::Value::String(r.result.response);
            request.digest = digest_of(&sub.description, &request.input);
        } else if wait.call > 0 {
            // The call the attempt suspended at: what is asked is about it.
            let s = self.store.suspension_at(wait.from_seq).await?;
            let Some(call) = s.call else {
                return Err(StepError::Failed(format!(
                    "run-log entry {} is a held run's suspension, not a tool call's",
                    wait.from_seq
                )));
            };
            request.description = match &call.question {
                Some(q) => q.clone(),
                None => format!(
                    "{} calls tool {} (task {}: {})",
                    request.agent.as_deref().unwrap_or("the agent"),
                    call.tool,
                    sub.id,
                    sub.description
                ),
            };
            request.input = call.arguments;
            request.digest = call.digest;
            request.tool_call = Some(ToolCallRef {
                call_id: call.call_id,
                tool: call.tool,
            });
        }
        Ok(ApprovalRecord {
            protocol: PROTOCOL_VERSION,
            status: ApprovalStatus::Pending,
            request,
            answer: None,
        })
    }

    pub(super) async fn request_approval(
        &self,
        entry: &Cached,
        wait: Wait,
        trigger: Trigger,
        deadline_ms: i64,
        notify_only: bool,
    ) -> Result<Option<ApprovalRecord>, StepError> {
        let record = self
            .approval_record(entry, wait, trigger, deadline_ms)
            .await?;
        let pending = self
            .approvals
            .request(&record, notify_only)
            .await
            .map_err(StepError::from)?;
        // Settled already (the step performed again after an answer): nothing waits.
        Ok(pending.then_some(record))
    }

    /// The run's `await_clarification` / `await_external_tools` event for a question or a
    /// client's tool call, published with the step's events — after the request is stored,
    /// so whoever reads the event can answer its token at once; not once it is settled. Its
    /// id is the approval's: a step performed again within the event stream's duplicate
    /// window publishes it again and the repeat is dropped (later, readers drop it by id).
    pub(super) fn await_event(
        &self,
        entry: &Cached,
        record: &ApprovalRecord,
    ) -> Option<flotilla_model::event::EventEnvelope> {
        use flotilla_model::event::{Event, ExternalToolCall};
        let r = &record.request;
        let call = r.tool_call.as_ref()?;
        let event = match r.trigger {
            Trigger::Question => Event::AwaitClarification {
                question: r.description.clone(),
                token: r.approval_id.clone(),
            },
            Trigger::ClientTool => Event::AwaitExternalTools {
                calls: vec![ExternalToolCall {
                    call_id: call.call_id.clone(),
                    tool: call.tool.clone(),
                    input: r.input.clone(),
                    token: r.approval_id.clone(),
                }],
            },
            _ => return None,
        };
        let run = entry.machine.state().run_id;
        Some(EventEnvelope {
            protocol: PROTOCOL_VERSION,
            id: format!("{run}.await.{}", r.approval_id),
            run_id: run,
            task_id: Some(r.task_id.clone()),
            attempt: Some(r.attempt),
            ts: r.requested_at,
            source: "coordinator".into(),
            event,
        })
    }

    /// The machine decided that the deadline's default settles a wait (its timer fired
    /// before any answer in log order): append that decision to the run log — the record a
    /// resumed attempt reads its decision from, and the entry the machine applies. Once per
    /// approval (its message id); the bucket is written when the machine applies it.
    pub(super) async fn expire_approval(
        &self,
        entry: &Cached,
        wait: Wait,
        default: Option<DefaultDecision>,
    ) -> Result<Option<(String, flotilla_bus::wire::Outgoing)>, StepError> {
        let state = entry.machine.state();
        let run = state.run_id;
        let Some(pending) = state.tasks[wait.task as usize]
            .approval
            .filter(|p| p.attempt == wait.attempt && p.call == wait.call)
        else {
            return Ok(None);
        };
        let wait = Wait {
            from_seq: pending.from_seq,
            ..wait
        };
        let record = self
            .approval_record(entry, wait, pending.trigger, pending.deadline_ms)
            .await?;
        let timeout = state
            .hitl
            .as_ref()
            .map(|p| p.timeout)
            .unwrap_or(flotilla_model::approval::DEFAULT_APPROVAL_TIMEOUT);
        // Outboxes written before 0.3 carry no default: the run's policy gives it, as the
        // record does.
        let default = default.unwrap_or(record.request.default);
        let r = &record.request;
        let decided = ApprovalDecided {
            approval_id: r.approval_id.clone(),
            task_id: r.task_id.clone(),
            attempt: r.attempt,
            status: ApprovalStatus::Expired,
            decision: Decision::of_default(default, timeout),
            by: "deadline".into(),
            tool_call: r.tool_call.clone(),
            digest: r.tool_call.is_some().then(|| r.digest.clone()),
            incident: false,
            comment: None,
            at: Some(r.deadline),
            always: false,
            reply_to: None,
        };
        let body = RunLogEntry {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            input: RunInput::ApprovalDecided(Box::new(decided)),
        };
        let out = flotilla_bus::wire::encode(
            &body,
            flotilla_model::codec::Codec::Json,
            Some(&expired_msg_id(run, &r.approval_id)),
        )?;
        info!(%run, approval = %r.approval_id, decision = ?default, "Approval expired: its default decides");
        Ok(Some((self.bus.names().runlog(run), out)))
    }

    /// The machine applied the decision at run-log `seq` to a wait: the approval's record
    /// in the bucket says so (its projection of the log), and an answer that approved the
    /// tool `always` grants it for the session.
    pub(super) async fn project_approval(
        &self,
        entry: &Cached,
        wait: Wait,
        trigger: Trigger,
        deadline_ms: i64,
        seq: u64,
    ) -> Result<(), StepError> {
        let run = entry.machine.state().run_id;
        let (decided, at_ms) = self.store.decision_at(seq).await?;
        let id = wait_id(wait.task, wait.attempt, wait.call);
        let pending = match self.approvals.get(run, &id).await? {
            Some((record, _)) => record,
            None => {
                self.approval_record(entry, wait, trigger, deadline_ms)
                    .await?
            }
        };
        let record = decided_record(&pending, decided, at_ms);
        if self.approvals.project(run, &id, &record).await? {
            info!(%run, approval = %id, status = record.status.as_str(), decision = record.answer.as_ref().map_or("", |a| a.decision.as_str()), "Approval decided");
        }
        if let Some(grant) = grant_of(&record) {
            let state = entry.machine.state();
            let scope = flotilla_context::Scope::operator(
                self.bus.names().clone(),
                run,
                crate::lineage::root_of(state),
                crate::lineage::session_of(state),
            );
            let clients = flotilla_context::Clients::new(self.bus.clone(), scope)
                .map_err(|e| StepError::Failed(format!("granting tool {}: {e}", grant.tool)))?;
            clients
                .state()
                .grant_tool(&grant)
                .await
                .map_err(|e| StepError::Failed(format!("granting tool {}: {e}", grant.tool)))?;
            info!(%run, tool = %grant.tool, by = %grant.by, "Tool approved for the session");
        }
        Ok(())
    }

    /// The run no longer waits for task `task`'s approval — the run ended, or a person
    /// completed the task by hand — so it is withdrawn unless settled first. Returns the
    /// run's `approval_decided` event saying so when the approval reads withdrawn (published
    /// with the step's events; its id is the approval's, so a step performed again publishes
    /// it once).
    pub(super) async fn withdraw_approval(
        &self,
        entry: &Cached,
        task: u32,
        attempt: u32,
        call: u32,
    ) -> Result<Option<EventEnvelope>, StepError> {
        let state = entry.machine.state();
        let run = state.run_id;
        let reason = withdrawal_reason(entry, task);
        let id = wait_id(task, attempt, call);
        match self.settle_withdrawn(run, &id, &reason).await {
            Ok(record) => Ok(withdrawn_event(&record)),
            Err(crate::approval_store::ApprovalError::NotFound(_)) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Settles approval `id` of `run` withdrawn (by `run`, rejecting with `reason`) unless
    /// something settled it first; returns the approval as it now reads.
    async fn settle_withdrawn(
        &self,
        run: flotilla_model::ids::RunId,
        id: &str,
        reason: &str,
    ) -> Result<ApprovalRecord, crate::approval_store::ApprovalError> {
        let (record, ours) = self
            .approvals
            .settle(run, id, None, None, |p| {
                settled(
                    p,
                    ApprovalStatus::Withdrawn,
                    ApprovalAnswer {
                        decision: Decision::Reject {
                            message: reason.to_owned(),
                        },
                        by: "run".into(),
                        comment: None,
                        at: Timestamp::now(),
                        always: false,
                        incident: false,
                    },
                )
            })
            .await?;
        if ours {
            info!(%run, approval = %id, reason, "Approval withdrawn: the run no longer waits for it");
        }
        Ok(record)
    }
}

/// Why the run no longer waits for task `task`'s approval, in words for the person who
/// reads the withdrawn approval: the run's end, or the task completed by hand.
fn withdrawal_reason(entry: &Cached, task: u32) -> String {
    let state = entry.machine.state();
    if state.status.is_terminal() {
        return ended_reason(entry);
    }
    let sub = &entry.machine.plan().subtasks[task as usize];
    match state.tasks.get(task as usize).map(|t| t.status) {
        Some(flotilla_model::run::TaskStatus::Succeeded) => {
            format!("task {} was completed by hand", sub.id)
        }
        _ => format!("the run no longer waits for task {}", sub.id),
    }
}

/// The run's end, in words: its status and why it stopped early, if it did.
fn ended_reason(entry: &Cached) -> String {
    let state = entry.machine.state();
    match &state.stop_reason {
        Some(r) => format!("the run ended: {r}"),
        None => format!("the run ended ({})", state.status),
    }
}

/// The run's `approval_decided` event of an approval that reads withdrawn; none otherwise
/// (an answer or the deadline settled it first, and says so itself).
fn withdrawn_event(record: &ApprovalRecord) -> Option<EventEnvelope> {
    use flotilla_model::event::{Event, WorkflowEvent, WorkflowPhase};
    if record.status != ApprovalStatus::Withdrawn {
        return None;
    }
    let r = &record.request;
    Some(EventEnvelope {
        protocol: PROTOCOL_VERSION,
        id: approval_event_id(r.run_id, &r.approval_id, "decided"),
        run_id: r.run_id,
        task_id: Some(r.task_id.clone()),
        attempt: Some(r.attempt),
        ts: record.answer.as_ref().map_or_else(Timestamp::now, |a| a.at),
        source: "coordinator".into(),
        event: Event::Workflow(WorkflowEvent {
            agent: r.agent.clone(),
            role: r.role.clone(),
            detail: Some(settled_detail(record)),
            approval_id: Some(r.approval_id.clone()),
            ..WorkflowEvent::phase(WorkflowPhase::ApprovalDecided)
        }),
    })
}
