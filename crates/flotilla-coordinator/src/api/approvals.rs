//! `approval.list`, `approval.get`, `approval.answer`: the operator's inbox. An answer
//! settles the approval in the escalations bucket (the first answer wins; a later one is
//! told `already_decided` with what decided) and is relayed to the run log, where the run
//! machine applies it. `approval.grants` and `approval.revoke`: the tools approved for a
//! session (an `approve` with `always`), kept in its session state.

use async_nats::service::Request;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::api::ApiError;
use flotilla_model::approval::{
    AnswerOutcome, ApprovalAnswer, ApprovalAnswerReply, ApprovalAnswerRequest, ApprovalGetRequest,
    ApprovalList, ApprovalListRequest, ApprovalRecord, ApprovalStatus, ApprovalView, GrantList,
    GrantListRequest, GrantRevokeReply, GrantRevokeRequest, MAX_LISTED_APPROVALS, ToolGrant,
    Trigger,
};
use flotilla_model::time::Timestamp;
use tracing::info;

use crate::approvals::{ApprovalError, settled};

use super::{Api, parse, respond_error, respond_json};

async fn respond_approval_error(req: &Request, e: ApprovalError) {
    let (status, code) = match &e {
        ApprovalError::NotFound(_) => (404, "not_found"),
        ApprovalError::Unreadable(_) => (500, "internal"),
        ApprovalError::Unavailable(_) => (503, "unavailable"),
    };
    respond_error(req, status, code, e.to_string()).await;
}

/// `404 not_found`: the run has no such approval.
async fn approval_not_found(req: &Request, run: flotilla_model::ids::RunId, approval: &str) {
    respond_error(
        req,
        404,
        "not_found",
        format!("run {run} has no approval {approval}"),
    )
    .await;
}

impl Api {
    pub(super) async fn approval_list(&self, req: Request) {
        let Some(r) = parse::<ApprovalListRequest>(&req).await else {
            return;
        };
        let limit = r
            .limit
            .unwrap_or(MAX_LISTED_APPROVALS)
            .min(MAX_LISTED_APPROVALS);
        if limit == 0 {
            return respond_error(
                &req,
                400,
                "invalid_limit",
                format!("limit must be between 1 and {MAX_LISTED_APPROVALS}"),
            )
            .await;
        }
        match self.escalations.list(r.run_id, r.all, limit as usize).await {
            Ok((approvals, truncated)) => {
                let reply = ApprovalList {
                    protocol: PROTOCOL_VERSION,
                    approvals,
                    truncated,
                };
                respond_json(&req, self.max_payload(), &reply).await;
            }
            Err(e) => respond_approval_error(&req, e).await,
        }
    }

    pub(super) async fn approval_get(&self, req: Request) {
        let Some(r) = parse::<ApprovalGetRequest>(&req).await else {
            return;
        };
        let record = match self.escalations.get(r.run_id, &r.approval_id).await {
            Ok(Some((record, _))) => record,
            Ok(None) => {
                return approval_not_found(&req, r.run_id, &r.approval_id).await;
            }
            Err(e) => return respond_approval_error(&req, e).await,
        };
        match self.escalations.history(r.run_id, &r.approval_id).await {
            Ok(history) => {
                let view = ApprovalView {
                    protocol: PROTOCOL_VERSION,
                    record,
                    history,
                };
                respond_json(&req, self.max_payload(), &view).await;
            }
            Err(e) => respond_approval_error(&req, e).await,
        }
    }

    pub(super) async fn approval_answer(&self, req: Request) {
        let Some(mut r) = parse::<ApprovalAnswerRequest>(&req).await else {
            return;
        };
        // A person calling through a shared import is who the NATS server says.
        if let Some(who) = flotilla_bus::service::requester(&req) {
            r.by = who;
        }
        let problems = r.problems();
        if !problems.is_empty() {
            return super::respond_problems(&req, "invalid_answer", problems).await;
        }
        // Bound to what was asked: an answer for other arguments does not apply.
        let known = match self.escalations.get(r.run_id, &r.approval_id).await {
            Ok(Some((record, revision))) => {
                if let Some(d) = r.digest.as_ref().filter(|d| **d != record.request.digest) {
                    return respond_error(
                        &req,
                        409,
                        "digest_mismatch",
                        format!(
                            "the answer is for arguments with digest {d}, but approval {} asks about {}",
                            r.approval_id, record.request.digest
                        ),
                    )
                    .await;
                }
                if r.always && !grantable(&record) {
                    return respond_error(
                        &req,
                        400,
                        "always_not_applicable",
                        format!(
                            "`always` approves a tool for the session; approval {} is {}, not a tool call of trigger sensitive_action or human_in_command",
                            r.approval_id,
                            match &record.request.tool_call {
                                Some(_) => format!("a tool call of trigger {}", record.request.trigger.as_str()),
                                None => "a task's dispatch".to_owned(),
                            }
                        ),
                    )
                    .await;
                }
                (record, revision)
            }
            Ok(None) => {
                return approval_not_found(&req, r.run_id, &r.approval_id).await;
            }
            Err(e) => return respond_approval_error(&req, e).await,
        };
        let answer = ApprovalAnswer {
            decision: r.decision.clone(),
            by: r.by.trim().to_owned(),
            comment: r.comment.clone(),
            at: Timestamp::now(),
            always: r.always,
            incident: r.incident,
        };
        let settled = self
            .escalations
            .settle(r.run_id, &r.approval_id, None, Some(known), |p| {
                settled(p, ApprovalStatus::Decided, answer.clone())
            })
            .await;
        let (record, ours) = match settled {
            Ok(s) => s,
            Err(e) => return respond_approval_error(&req, e).await,
        };
        if ours {
            info!(run = %r.run_id, approval = %r.approval_id, decision = r.decision.as_str(), by = %answer.by, always = r.always, "Approval answered");
        }
        // A decision with `always` grants the tool before it is relayed — written by whoever
        // reads the decided record (this answer, or its retry after a crash or a failed
        // write: the put is idempotent), so the grant is never lost behind the decision.
        if record.status == ApprovalStatus::Decided
            && let Some(a) = record.answer.as_ref().filter(|a| a.always)
            && let Some(call) = &record.request.tool_call
        {
            let grant = ToolGrant {
                tool: call.tool.clone(),
                by: a.by.clone(),
                run_id: record.request.run_id,
                approval_id: record.request.approval_id.clone(),
                at: a.at,
                comment: a.comment.clone(),
            };
            if let Err(e) = self.write_grant(&grant).await {
                return super::respond_api_error(&req, &e).await;
            }
        }
        // Relayed whoever settled it: a relay lost to a crash is made again by the next
        // reader (this answer's retry, or the deadline), and the run log keeps one.
        if let Err(e) = self.escalations.relay(&record).await {
            return respond_approval_error(&req, e).await;
        }
        let reply = ApprovalAnswerReply {
            protocol: PROTOCOL_VERSION,
            outcome: if ours {
                AnswerOutcome::Decided
            } else {
                AnswerOutcome::AlreadyDecided
            },
            record,
        };
        respond_json(&req, self.max_payload(), &reply).await;
    }
}

/// Whether `always` may go with an answer to this approval: a tool call that waits because of
/// what the tool is or who calls it. Questions, client tools and out-of-scope calls are
/// answered call by call.
fn grantable(record: &ApprovalRecord) -> bool {
    record
        .request
        .tool_call
        .as_ref()
        .is_some_and(|c| flotilla_model::plan::is_tool_name(&c.tool))
        && matches!(
            record.request.trigger,
            Trigger::SensitiveAction | Trigger::HumanInCommand
        )
}

impl Api {
    async fn write_grant(&self, grant: &ToolGrant) -> Result<(), ApiError> {
        let scope = self.session_scope(Some(grant.run_id), None).await?;
        self.clients(scope)?
            .state()
            .grant_tool(grant)
            .await
            .map_err(super::collab::context_error)?;
        info!(run = %grant.run_id, tool = %grant.tool, by = %grant.by, "Tool approved for the session");
        Ok(())
    }

    /// `approval.grants`.
    pub(super) async fn approval_grants(&self, req: Request) {
        let Some(r) = parse::<GrantListRequest>(&req).await else {
            return;
        };
        let answer = async {
            let scope = self.session_scope(r.run_id, r.session_id).await?;
            let session_id = scope.session.clone();
            let grants = self
                .clients(scope)?
                .state()
                .tool_grants()
                .await
                .map_err(super::collab::context_error)?;
            Ok(GrantList {
                protocol: PROTOCOL_VERSION,
                session_id,
                grants,
            })
        }
        .await;
        self.answer(&req, "approval.grants", answer).await;
    }

    /// `approval.revoke`.
    pub(super) async fn approval_revoke(&self, req: Request) {
        let Some(mut r) = parse::<GrantRevokeRequest>(&req).await else {
            return;
        };
        // A person calling through a shared import is who the NATS server says.
        if let Some(who) = flotilla_bus::service::requester(&req) {
            r.by = who;
        }
        let answer = async {
            if r.by.trim().is_empty() {
                return Err(super::collab::bad(
                    "invalid_answer",
                    "a revocation must say who gives it (`by`)",
                ));
            }
            if !flotilla_model::plan::is_tool_name(&r.tool) {
                return Err(super::collab::bad(
                    "invalid_tool",
                    format!(
                        "{:?} is not a tool name (1 to 64 letters, digits, `_` or `-`)",
                        r.tool
                    ),
                ));
            }
            let scope = self.session_scope(r.run_id, r.session_id).await?;
            let session = scope.session.clone();
            let revoked = self
                .clients(scope)?
                .state()
                .revoke_tool(&r.tool)
                .await
                .map_err(super::collab::context_error)?
                .ok_or_else(|| {
                    ApiError::new(
                        404,
                        "not_found",
                        format!("tool {} is not approved for session {session}", r.tool),
                    )
                })?;
            info!(tool = %r.tool, %session, by = %r.by.trim(), "Tool grant revoked");
            Ok(GrantRevokeReply {
                protocol: PROTOCOL_VERSION,
                revoked,
            })
        }
        .await;
        self.answer(&req, "approval.revoke", answer).await;
    }
}
