//! JSON Schemas of the public messages, checked in under `docs/schema/`.

use schemars::{Schema, schema_for};

use crate::api::{
    ApiError, CancelRunReply, CancelRunRequest, GetRunRequest, ValidatePlanReply,
    ValidatePlanRequest,
};
use crate::event::{EventBatch, EventEnvelope};
use crate::mailbox::MailboxMessage;
use crate::plan::Plan;
use crate::run::{RunRecord, RunView};
use crate::runlog::RunLogEntry;
use crate::submit::{SubmitReply, SubmitRequest};
use crate::task::{TaskEnvelope, TaskResult};
use crate::worker::WorkerInfo;
use crate::workspace::WorkspaceEntry;

/// Every public message type with its schema file name.
pub fn public_schemas() -> Vec<(&'static str, Schema)> {
    vec![
        ("plan.json", schema_for!(Plan)),
        ("submit-request.json", schema_for!(SubmitRequest)),
        ("submit-reply.json", schema_for!(SubmitReply)),
        ("task-envelope.json", schema_for!(TaskEnvelope)),
        ("task-result.json", schema_for!(TaskResult)),
        ("runlog-entry.json", schema_for!(RunLogEntry)),
        ("event.json", schema_for!(EventEnvelope)),
        ("event-batch.json", schema_for!(EventBatch)),
        ("run-record.json", schema_for!(RunRecord)),
        ("run-view.json", schema_for!(RunView)),
        ("get-run-request.json", schema_for!(GetRunRequest)),
        ("api-error.json", schema_for!(ApiError)),
        ("cancel-run-request.json", schema_for!(CancelRunRequest)),
        ("cancel-run-reply.json", schema_for!(CancelRunReply)),
        (
            "validate-plan-request.json",
            schema_for!(ValidatePlanRequest),
        ),
        ("validate-plan-reply.json", schema_for!(ValidatePlanReply)),
        ("worker-info.json", schema_for!(WorkerInfo)),
        (
            "watch-request.json",
            schema_for!(crate::watch::WatchRequest),
        ),
        ("watch-reply.json", schema_for!(crate::watch::WatchReply)),
        ("watch-end.json", schema_for!(crate::watch::WatchEnd)),
        (
            "projected-event.json",
            schema_for!(crate::watch::ProjectedEvent),
        ),
        (
            "mailbox-post.json",
            schema_for!(crate::mailbox::MailboxPost),
        ),
        ("mailbox-message.json", schema_for!(MailboxMessage)),
        (
            "mailbox-page.json",
            schema_for!(crate::mailbox::MailboxPage),
        ),
        (
            "mailbox-stats.json",
            schema_for!(crate::mailbox::MailboxStats),
        ),
        (
            "workspace-write.json",
            schema_for!(crate::workspace::WorkspaceWrite),
        ),
        ("workspace-entry.json", schema_for!(WorkspaceEntry)),
        (
            "workspace-page.json",
            schema_for!(crate::workspace::WorkspacePage),
        ),
        ("state-value.json", schema_for!(crate::state::StateValue)),
        (
            "ws-append-request.json",
            schema_for!(crate::api::WsAppendRequest),
        ),
        (
            "ws-append-reply.json",
            schema_for!(crate::api::WsAppendReply),
        ),
        (
            "ws-read-request.json",
            schema_for!(crate::api::WsReadRequest),
        ),
        (
            "mbox-send-request.json",
            schema_for!(crate::api::MboxSendRequest),
        ),
        (
            "mbox-send-reply.json",
            schema_for!(crate::api::MboxSendReply),
        ),
        (
            "mbox-read-request.json",
            schema_for!(crate::api::MboxReadRequest),
        ),
        (
            "mbox-role-request.json",
            schema_for!(crate::api::MboxRoleRequest),
        ),
        (
            "mbox-role-reply.json",
            schema_for!(crate::api::MboxRoleReply),
        ),
        (
            "mbox-negotiate-request.json",
            schema_for!(crate::api::MboxNegotiateRequest),
        ),
        (
            "mbox-negotiate-reply.json",
            schema_for!(crate::api::MboxNegotiateReply),
        ),
        (
            "state-get-request.json",
            schema_for!(crate::api::StateGetRequest),
        ),
        (
            "state-list-request.json",
            schema_for!(crate::api::StateListRequest),
        ),
        ("state-keys.json", schema_for!(crate::api::StateKeys)),
        (
            "state-set-request.json",
            schema_for!(crate::api::StateSetRequest),
        ),
        (
            "state-set-reply.json",
            schema_for!(crate::api::StateSetReply),
        ),
        (
            "child-start-request.json",
            schema_for!(crate::api::ChildStartRequest),
        ),
        (
            "child-start-reply.json",
            schema_for!(crate::api::ChildStartReply),
        ),
        (
            "run-tree-request.json",
            schema_for!(crate::tree::RunTreeRequest),
        ),
        ("run-tree.json", schema_for!(crate::tree::RunTree)),
        (
            "run-diff-request.json",
            schema_for!(crate::diff::RunDiffRequest),
        ),
        ("run-diff.json", schema_for!(crate::diff::RunDiff)),
        (
            "run-fork-request.json",
            schema_for!(crate::fork::RunForkRequest),
        ),
        (
            "run-fork-reply.json",
            schema_for!(crate::fork::RunForkReply),
        ),
        (
            "session-request.json",
            schema_for!(crate::tree::SessionRequest),
        ),
        ("session-view.json", schema_for!(crate::tree::SessionView)),
        (
            "team-list-request.json",
            schema_for!(crate::team::TeamListRequest),
        ),
        (
            "team-find-request.json",
            schema_for!(crate::team::TeamFindRequest),
        ),
        ("team-list.json", schema_for!(crate::team::TeamList)),
        (
            "team-get-request.json",
            schema_for!(crate::team::TeamGetRequest),
        ),
        ("member-view.json", schema_for!(crate::team::MemberView)),
        (
            "team-stats-request.json",
            schema_for!(crate::team::TeamStatsRequest),
        ),
        ("team-stats.json", schema_for!(crate::team::TeamStats)),
        ("team-member.json", schema_for!(crate::team::Member)),
        (
            "failure-record.json",
            schema_for!(crate::team::FailureRecord),
        ),
        (
            "recruit-request.json",
            schema_for!(crate::recruit::RecruitRequest),
        ),
        (
            "recruit-reply.json",
            schema_for!(crate::recruit::RecruitReply),
        ),
        (
            "recruit-status-request.json",
            schema_for!(crate::recruit::RecruitStatusRequest),
        ),
        (
            "retire-request.json",
            schema_for!(crate::recruit::RetireRequest),
        ),
        (
            "retire-reply.json",
            schema_for!(crate::recruit::RetireReply),
        ),
        (
            "assign-request.json",
            schema_for!(crate::lead::AssignRequest),
        ),
        (
            "finish-request.json",
            schema_for!(crate::lead::FinishRequest),
        ),
        ("lead-reply.json", schema_for!(crate::lead::LeadReply)),
        ("team-change.json", schema_for!(crate::recruit::TeamChange)),
        ("teammate.json", schema_for!(crate::teammate::Teammate)),
        (
            "teammate-conversation.json",
            schema_for!(crate::teammate::Conversation),
        ),
        (
            "teammate-turn.json",
            schema_for!(crate::teammate::TurnEnvelope),
        ),
        (
            "teammate-post.json",
            schema_for!(crate::teammate::TeammatePost),
        ),
        (
            "teammate-view.json",
            schema_for!(crate::teammate::TeammateView),
        ),
        (
            "team-spawn-request.json",
            schema_for!(crate::teammate::TeamSpawnRequest),
        ),
        (
            "team-send-request.json",
            schema_for!(crate::teammate::TeamSendRequest),
        ),
        ("team-sent.json", schema_for!(crate::teammate::TeamSent)),
        (
            "team-broadcast-request.json",
            schema_for!(crate::teammate::TeamBroadcastRequest),
        ),
        (
            "team-shutdown-request.json",
            schema_for!(crate::teammate::TeamShutdownRequest),
        ),
        (
            "team-mates-request.json",
            schema_for!(crate::teammate::TeamMatesRequest),
        ),
        ("team-mates.json", schema_for!(crate::teammate::TeamMates)),
        ("memory-entry.json", schema_for!(crate::memory::MemoryEntry)),
        ("memory-use.json", schema_for!(crate::memory::MemoryUse)),
        (
            "memory-list-request.json",
            schema_for!(crate::memory::MemoryListRequest),
        ),
        ("memory-list.json", schema_for!(crate::memory::MemoryList)),
        (
            "memory-get-request.json",
            schema_for!(crate::memory::MemoryGetRequest),
        ),
        (
            "memory-forget-request.json",
            schema_for!(crate::memory::MemoryForgetRequest),
        ),
        (
            "memory-forgotten.json",
            schema_for!(crate::memory::MemoryForgotten),
        ),
        ("trust-record.json", schema_for!(crate::trust::TrustRecord)),
        ("trust-list.json", schema_for!(crate::trust::TrustList)),
        (
            "trust-list-request.json",
            schema_for!(crate::trust::TrustListRequest),
        ),
        (
            "trust-get-request.json",
            schema_for!(crate::trust::TrustGetRequest),
        ),
        (
            "trust-set-request.json",
            schema_for!(crate::trust::TrustSetRequest),
        ),
        (
            "trust-incident-request.json",
            schema_for!(crate::trust::TrustIncidentRequest),
        ),
        (
            "approval-record.json",
            schema_for!(crate::approval::ApprovalRecord),
        ),
        (
            "notification.json",
            schema_for!(crate::notify::Notification),
        ),
        (
            "approval-list-request.json",
            schema_for!(crate::approval::ApprovalListRequest),
        ),
        (
            "approval-list.json",
            schema_for!(crate::approval::ApprovalList),
        ),
        (
            "approval-get-request.json",
            schema_for!(crate::approval::ApprovalGetRequest),
        ),
        (
            "approval-view.json",
            schema_for!(crate::approval::ApprovalView),
        ),
        (
            "approval-ask-request.json",
            schema_for!(crate::approval::ApprovalAskRequest),
        ),
        (
            "approval-ask-reply.json",
            schema_for!(crate::approval::ApprovalAskReply),
        ),
        (
            "approval-answer-request.json",
            schema_for!(crate::approval::AnswerWire),
        ),
        (
            "approval-answer-reply.json",
            schema_for!(crate::approval::ApprovalAnswerReply),
        ),
        (
            "grant-list-request.json",
            schema_for!(crate::approval::GrantListRequest),
        ),
        ("grant-list.json", schema_for!(crate::approval::GrantList)),
        (
            "grant-revoke-request.json",
            schema_for!(crate::approval::GrantRevokeRequest),
        ),
        (
            "grant-revoke-reply.json",
            schema_for!(crate::approval::GrantRevokeReply),
        ),
        ("tool-grant.json", schema_for!(crate::approval::ToolGrant)),
        (
            "pause-run-request.json",
            schema_for!(crate::control::PauseRunRequest),
        ),
        (
            "resume-run-request.json",
            schema_for!(crate::control::ResumeRunRequest),
        ),
        (
            "takeover-run-request.json",
            schema_for!(crate::control::TakeoverRunRequest),
        ),
        (
            "control-run-reply.json",
            schema_for!(crate::control::ControlRunReply),
        ),
        (
            "control-verdict.json",
            schema_for!(crate::control::ControlVerdict),
        ),
        (
            "complete-task-request.json",
            schema_for!(crate::control::CompleteTaskRequest),
        ),
        (
            "complete-task-reply.json",
            schema_for!(crate::control::CompleteTaskReply),
        ),
        (
            "edit-plan-request.json",
            schema_for!(crate::control::EditPlanRequest),
        ),
        (
            "edit-plan-reply.json",
            schema_for!(crate::control::EditPlanReply),
        ),
    ]
}

/// Renders a schema as the checked-in text (pretty JSON, trailing newline).
pub fn render(schema: &Schema) -> String {
    let mut text = serde_json::to_string_pretty(schema).unwrap_or_default();
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `protocol` is optional on input (docs/protocol.md, conventions): no request, and no
    /// message a client or agent writes, requires it.
    #[test]
    fn no_request_requires_protocol() {
        let written = [
            "mailbox-post.json",
            "workspace-write.json",
            "runlog-entry.json",
            "task-envelope.json",
            "event.json",
        ];
        for (name, schema) in public_schemas() {
            if !(name.ends_with("-request.json") || written.contains(&name)) {
                continue;
            }
            let required = schema.as_value()["required"].clone();
            assert!(
                !required
                    .as_array()
                    .is_some_and(|r| r.iter().any(|f| f == "protocol")),
                "{name} requires protocol: {required}"
            );
        }
    }
}
