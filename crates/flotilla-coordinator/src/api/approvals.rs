//! `approval.list`, `approval.get`, `approval.answer`: the operator's inbox. An answer
//! settles the approval in the escalations bucket (the first answer wins; a later one is
//! told `already_decided` with what decided) and is relayed to the run log, where the run
//! machine applies it.

use async_nats::service::Request;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::approval::{
    AnswerOutcome, ApprovalAnswer, ApprovalAnswerReply, ApprovalAnswerRequest, ApprovalGetRequest,
    ApprovalList, ApprovalListRequest, ApprovalStatus, ApprovalView, MAX_LISTED_APPROVALS,
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
        let Some(r) = parse::<ApprovalAnswerRequest>(&req).await else {
            return;
        };
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
            info!(run = %r.run_id, approval = %r.approval_id, decision = r.decision.as_str(), by = %answer.by, "Approval answered");
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
