//! `approval.ask`: a running attempt asks a person on behalf of an agent of the NATS Agent
//! Protocol it called (trigger `external_agent`; the attempt waits, not the run machine).
//! `approval.list`, `approval.get`, `approval.answer`: the operator's inbox. An answer
//! settles the approval in the escalations bucket (the first answer wins; a later one is
//! told `already_decided` with what decided) and is relayed to the run log, where the run
//! machine applies it. `approval.grants` and `approval.revoke`: the tools approved for a
//! session (an `approve` with `always`), kept in its session state.

use async_nats::service::Request;
use flotilla_model::ErrorCode;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::api::ApiError;
use flotilla_model::approval::{
    AnswerOutcome, ApprovalAnswer, ApprovalAnswerReply, ApprovalAnswerRequest, ApprovalAskReply,
    ApprovalAskRequest, ApprovalDecided, ApprovalGetRequest, ApprovalList, ApprovalListRequest,
    ApprovalRecord, ApprovalRequest, ApprovalStatus, ApprovalView, DEFAULT_ASK_TIMEOUT_S, Decision,
    DefaultDecision, GrantList, GrantListRequest, GrantRevokeReply, GrantRevokeRequest,
    MAX_LISTED_APPROVALS, Trigger, answer_msg_id,
};
use flotilla_model::control::ControlVerdict;
use flotilla_model::runlog::{RunInput, RunLogEntry};
use flotilla_model::time::Timestamp;
use futures::StreamExt;
use tracing::info;

use super::controls::VERDICT_WAIT;

/// How long an answer waits for its verdict before it also reads the run log, then between
/// reads (see [`Api::decided_without_verdict`]).
const VERDICT_SLICE_FIRST: std::time::Duration = std::time::Duration::from_secs(1);
const VERDICT_SLICE: std::time::Duration = std::time::Duration::from_millis(500);

use crate::approval_store::{ApprovalError, decided_record, grant_of, grantable, settled};

use super::{Api, parse, respond_error, respond_json};

async fn respond_approval_error(req: &Request, e: ApprovalError) {
    respond_error(req, e.status(), e.code(), e.to_string()).await;
}

/// `404 not_found`: the run has no such approval.
async fn approval_not_found(req: &Request, run: flotilla_model::ids::RunId, approval: &str) {
    respond_error(
        req,
        404,
        ErrorCode::NotFound,
        format!("run {run} has no approval {approval}"),
    )
    .await;
}

impl Api {
    /// `approval.ask`: stores the question of an external agent as a pending approval of
    /// the calling attempt (create-if-absent: asking again answers the same record), or —
    /// asked again once it is due — settles it first (see [`Api::settle_if_due`]). Refused
    /// unless the task's current attempt is the caller and the run goes on: nothing is
    /// stored then.
    pub(super) async fn approval_ask(&self, req: Request) {
        let Some(r) = parse::<ApprovalAskRequest>(&req).await else {
            return;
        };
        // Asked by the attempt that called the agent (a worker, inside Flotilla's account),
        // never by a person: a request that crossed the people's shared import says who sent
        // it, and is refused.
        if let Some(who) = flotilla_bus::service::requester(&req) {
            return respond_error(
                &req,
                403,
                ErrorCode::Forbidden,
                format!(
                    "approval.ask is asked by the running attempt that called an external agent, not by a person ({who})"
                ),
            )
            .await;
        }
        let problems = r.problems();
        if !problems.is_empty() {
            return super::respond_problems(&req, ErrorCode::InvalidRequest, problems).await;
        }
        let run = r.run_id;
        let state = match self.store.state(run).await {
            Ok(Some(s)) => s,
            Ok(None) => return super::run_not_found(&req, run).await,
            Err(e) => return respond_error(&req, 503, ErrorCode::Unavailable, e.to_string()).await,
        };
        let plan = match self.store.plan_for(run, &state).await {
            Ok(p) => p,
            Err(e) => return respond_error(&req, 503, ErrorCode::Unavailable, e.to_string()).await,
        };
        let Some((index, sub)) = plan.as_ref().and_then(|p| {
            p.subtasks
                .iter()
                .enumerate()
                .find(|(_, t)| t.id == r.task_id)
        }) else {
            return respond_error(
                &req,
                404,
                ErrorCode::UnknownTask,
                format!("run {run} has no task {}", r.task_id),
            )
            .await;
        };
        // The attempt's id (its envelope's) names the attempt that asks: a caller holding
        // another attempt's envelope (an earlier, retried one) is not it.
        if let Some(t) = state.tasks.get(index)
            && t.attempt == r.attempt
        {
            let current =
                flotilla_machine::attempt_id(run, index as u32, t.attempt, t.attempt_started_ms());
            if current != r.attempt_id {
                return respond_error(
                    &req,
                    409,
                    ErrorCode::NotTheAttempt,
                    format!(
                        "attempt {} of task {} has another id: {} is not the attempt running",
                        r.attempt, r.task_id, r.attempt_id
                    ),
                )
                .await;
            }
        }
        let id = r.approval_id(index as u32);
        match self.approvals.get(run, &id).await {
            Ok(Some((record, revision))) => {
                return self.answer_ask(&req, record, revision, state.status).await;
            }
            Ok(None) => {}
            Err(e) => return respond_approval_error(&req, e).await,
        }
        if state.status.is_terminal() {
            return respond_error(
                &req,
                409,
                ErrorCode::RunEnded,
                format!(
                    "run {run} ended ({:?}): nobody is waiting for an answer",
                    state.status
                ),
            )
            .await;
        }
        let task = state.tasks.get(index);
        if task.is_none_or(|t| t.attempt != r.attempt || t.status.is_terminal()) {
            return respond_error(
                &req,
                409,
                ErrorCode::NotRunning,
                format!(
                    "attempt {} of task {} is not running (the task is {}, attempt {})",
                    r.attempt,
                    r.task_id,
                    task.map_or("unknown".into(), |t| format!("{:?}", t.status)
                        .to_lowercase()),
                    task.map_or(0, |t| t.attempt)
                ),
            )
            .await;
        }
        let now = Timestamp::now();
        let timeout_s = r.timeout_s.unwrap_or(DEFAULT_ASK_TIMEOUT_S);
        let input = serde_json::json!({
            "agent": r.agent,
            "query_id": r.query_id,
            "question": r.question,
            "context": r.context,
        });
        let description = format!("{} asks: {}", r.agent, r.question);
        let record = ApprovalRecord {
            protocol: PROTOCOL_VERSION,
            status: ApprovalStatus::Pending,
            request: ApprovalRequest {
                approval_id: id.clone(),
                run_id: run,
                task_id: r.task_id.clone(),
                attempt: r.attempt,
                trigger: Trigger::ExternalAgent,
                mode: Default::default(),
                action: sub.action.clone(),
                risk: sub.risk,
                agent: sub.agent.clone(),
                role: sub.role.clone(),
                digest: flotilla_model::approval::digest_of(&description, &input),
                description,
                input,
                tool_call: None,
                requested_at: now,
                deadline: Timestamp::from_unix_ms(now.unix_ms() + (timeout_s as i64) * 1000),
                default: DefaultDecision::Reject,
            },
            answer: None,
        };
        if let Err(e) = self.approvals.request(&record, false).await {
            return respond_approval_error(&req, e).await;
        }
        info!(%run, approval = %id, agent = %r.agent, "An external agent's question asked of a person");
        self.external_event(&record).await;
        match self.approvals.get(run, &id).await {
            Ok(Some((record, revision))) => {
                self.answer_ask(&req, record, revision, state.status).await
            }
            Ok(None) => approval_not_found(&req, run, &id).await,
            Err(e) => respond_approval_error(&req, e).await,
        }
    }

    /// Answers `approval.ask` with the approval, settled first when it is due.
    async fn answer_ask(
        &self,
        req: &Request,
        record: ApprovalRecord,
        revision: u64,
        run_status: flotilla_model::run::RunStatus,
    ) {
        match self.settle_if_due(record, revision, run_status).await {
            Ok(record) => {
                let reply = ApprovalAskReply {
                    protocol: PROTOCOL_VERSION,
                    record,
                };
                respond_json(req, self.max_payload(), &reply).await;
            }
            Err(e) => respond_approval_error(req, e).await,
        }
    }

    /// An `external_agent` approval nobody but its asker waits for, settled when it is due:
    /// `withdrawn` once its run has ended, `expired` (its default, reject) past its deadline
    /// — unless something settled it first. No timer does this: the asker asks again at the
    /// deadline, and an answer that comes late reads the approval through here too.
    async fn settle_if_due(
        &self,
        record: ApprovalRecord,
        revision: u64,
        run_status: flotilla_model::run::RunStatus,
    ) -> Result<ApprovalRecord, ApprovalError> {
        if record.status != ApprovalStatus::Pending
            || record.request.trigger != Trigger::ExternalAgent
        {
            return Ok(record);
        }
        let now = Timestamp::now();
        let (status, by, message) = if run_status.is_terminal() {
            (
                ApprovalStatus::Withdrawn,
                "run",
                format!("the run ended ({run_status:?}) before anyone answered"),
            )
        } else if now >= record.request.deadline {
            (
                ApprovalStatus::Expired,
                "deadline",
                "nobody answered before the deadline; the default is reject".to_owned(),
            )
        } else {
            return Ok(record);
        };
        let run = record.request.run_id;
        let id = record.request.approval_id.clone();
        let at = if status == ApprovalStatus::Expired {
            record.request.deadline
        } else {
            now
        };
        let (settled_record, ours) = self
            .approvals
            .settle(run, &id, None, Some((record, revision)), |p| {
                settled(
                    p,
                    status,
                    ApprovalAnswer {
                        decision: Decision::Reject {
                            message: message.clone(),
                        },
                        by: by.into(),
                        comment: None,
                        at,
                        always: false,
                        incident: false,
                    },
                )
            })
            .await?;
        if ours {
            info!(%run, approval = %id, status = status.as_str(), "An external agent's question settled without an answer");
            self.external_event(&settled_record).await;
        }
        Ok(settled_record)
    }

    /// Settles the external agents' questions that are due — past their deadline
    /// (`expired`, the default: reject) or of a run that ended (`withdrawn`) — whoever asked:
    /// the attempt that asked settles its own at its deadline, but one whose worker died
    /// (or whose call ended without asking again) leaves it pending. At most
    /// [`MAX_LISTED_APPROVALS`] pending approvals are looked at per sweep.
    pub(super) async fn sweep_external_questions(&self) {
        let pending = match self
            .approvals
            .list(None, false, MAX_LISTED_APPROVALS as usize)
            .await
        {
            Ok((list, _)) => list,
            Err(e) => {
                tracing::debug!(error = %e, "Could not list approvals to sweep");
                return;
            }
        };
        let now = Timestamp::now();
        for record in pending
            .into_iter()
            .filter(|r| r.request.trigger == Trigger::ExternalAgent)
        {
            let run = record.request.run_id;
            let status = match self.store.state(run).await {
                Ok(Some(s)) => s.status,
                Ok(None) => continue,
                Err(e) => {
                    tracing::debug!(%run, error = %e, "Could not read a run to sweep its question");
                    continue;
                }
            };
            if !status.is_terminal() && now < record.request.deadline {
                continue;
            }
            let id = record.request.approval_id.clone();
            let current = match self.approvals.get(run, &id).await {
                Ok(Some(k)) => k,
                Ok(None) => continue,
                Err(e) => {
                    tracing::debug!(%run, approval = %id, error = %e, "Could not read a question to sweep");
                    continue;
                }
            };
            if let Err(e) = self.settle_if_due(current.0, current.1, status).await {
                tracing::debug!(%run, approval = %id, error = %e, "Could not settle a question; the next sweep tries again");
            }
        }
    }

    /// The calling run's event for an external agent's question: `approval_requested` while
    /// it waits, `approval_decided` once settled (the run machine emits these for the waits
    /// it decides; this one is the attempt's, so the API says it). Published once per
    /// approval and phase (its message id), on the run's events with the task and attempt.
    pub(super) async fn external_event(&self, record: &ApprovalRecord) {
        use flotilla_model::event::{Event, EventEnvelope, WorkflowEvent, WorkflowPhase};
        let r = &record.request;
        let (phase, name, detail) = match (&record.status, &record.answer) {
            (ApprovalStatus::Pending, _) | (_, None) => (
                WorkflowPhase::ApprovalRequested,
                "requested",
                format!(
                    "external_agent: {} waits for a person until {}",
                    r.description, r.deadline
                ),
            ),
            (_, Some(_)) => (
                WorkflowPhase::ApprovalDecided,
                "decided",
                crate::approval_store::settled_detail(record),
            ),
        };
        let event = EventEnvelope {
            protocol: PROTOCOL_VERSION,
            id: crate::approval_store::approval_event_id(r.run_id, &r.approval_id, name),
            run_id: r.run_id,
            task_id: Some(r.task_id.clone()),
            attempt: Some(r.attempt),
            ts: Timestamp::now(),
            source: "coordinator".into(),
            event: Event::Workflow(WorkflowEvent {
                agent: r.agent.clone(),
                role: r.role.clone(),
                detail: Some(detail),
                approval_id: Some(r.approval_id.clone()),
                ..WorkflowEvent::phase(phase)
            }),
        };
        if let Err(e) = crate::publish_event(self.store.bus(), event).await {
            tracing::warn!(run = %r.run_id, approval = %r.approval_id, error = %e, "Could not publish an external agent's question's event");
        }
    }

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
                ErrorCode::InvalidLimit,
                format!("limit must be between 1 and {MAX_LISTED_APPROVALS}"),
            )
            .await;
        }
        match self.approvals.list(r.run_id, r.all, limit as usize).await {
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
        let record = match self.approvals.get(r.run_id, &r.approval_id).await {
            Ok(Some((record, _))) => record,
            Ok(None) => {
                return approval_not_found(&req, r.run_id, &r.approval_id).await;
            }
            Err(e) => return respond_approval_error(&req, e).await,
        };
        match self.approvals.history(r.run_id, &r.approval_id).await {
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
            return super::respond_problems(&req, ErrorCode::InvalidAnswer, problems).await;
        }
        // Bound to what was asked: an answer for other arguments does not apply.
        let known = match self.approvals.get(r.run_id, &r.approval_id).await {
            Ok(Some((record, revision))) => {
                if let Some(d) = r.digest.as_ref().filter(|d| **d != record.request.digest) {
                    return respond_error(
                        &req,
                        409,
                        ErrorCode::DigestMismatch,
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
                        ErrorCode::AlwaysNotApplicable,
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
        // An external agent's question: its wait has no timer of its own, so an answer that
        // comes after its run ended or past its deadline finds it settled here first.
        if known.0.request.trigger != Trigger::ExternalAgent {
            return self.answer_on_log(&req, &r, known.0).await;
        }
        let known = {
            if matches!(r.decision, Decision::Edit { .. }) {
                return respond_error(
                    &req,
                    400,
                    ErrorCode::DecisionNotApplicable,
                    format!(
                        "approval {} is an external agent's question: approve (answered yes), reject (no) or respond (your text), not edit",
                        r.approval_id
                    ),
                )
                .await;
            }
            // Incidents count against this deployment's agents and roles (their trust); the
            // external agent is none of them, and the calling attempt did nothing wrong.
            if r.incident {
                return respond_error(
                    &req,
                    400,
                    ErrorCode::IncidentNotApplicable,
                    format!(
                        "approval {} is an external agent's question: it cannot be rejected as an incident (incidents count against this deployment's agents and roles, and {} is not one); reject it without incident",
                        r.approval_id,
                        known.0.request.input["agent"].as_str().unwrap_or("the agent")
                    ),
                )
                .await;
            }
            let status = match self.store.state(r.run_id).await {
                Ok(Some(s)) => s.status,
                Ok(None) => flotilla_model::run::RunStatus::Running,
                Err(e) => {
                    return respond_error(&req, 503, ErrorCode::Unavailable, e.to_string()).await;
                }
            };
            match self.settle_if_due(known.0, known.1, status).await {
                Ok(record) if record.status != ApprovalStatus::Pending => {
                    let reply = ApprovalAnswerReply {
                        protocol: PROTOCOL_VERSION,
                        outcome: AnswerOutcome::AlreadyDecided,
                        record,
                    };
                    return respond_json(&req, self.max_payload(), &reply).await;
                }
                Ok(record) => match self.approvals.get(r.run_id, &r.approval_id).await {
                    Ok(Some(k)) => k,
                    Ok(None) => {
                        return approval_not_found(&req, r.run_id, &record.request.approval_id)
                            .await;
                    }
                    Err(e) => return respond_approval_error(&req, e).await,
                },
                Err(e) => return respond_approval_error(&req, e).await,
            }
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
            .approvals
            .settle(r.run_id, &r.approval_id, None, Some(known), |p| {
                settled(p, ApprovalStatus::Decided, answer.clone())
            })
            .await;
        let (record, ours) = match settled {
            Ok(s) => s,
            Err(e) => return respond_approval_error(&req, e).await,
        };
        if ours {
            info!(run = %r.run_id, approval = %r.approval_id, decision = r.decision.as_str(), by = %answer.by, "An external agent's question answered");
            self.external_event(&record).await;
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

    /// An answer to a wait of the run machine (a dispatch, a tool call, a result's review):
    /// appended to the run log as its own `approval_decided` entry, where the machine
    /// applies the first answer in log order — or the deadline's default, when its timer
    /// fired first — and answered with what the machine decided: `decided` when this entry
    /// did, `already_decided` with the decision otherwise. The entry names an inbox as its
    /// `reply_to`, where the coordinator that applies it says whether it decided; without
    /// that verdict within [`VERDICT_WAIT`] the answer is `503 unavailable` (it is on the log
    /// and applies when a coordinator gets to it; the approval's record then says so).
    async fn answer_on_log(
        &self,
        req: &Request,
        r: &ApprovalAnswerRequest,
        record: ApprovalRecord,
    ) {
        if record.status != ApprovalStatus::Pending {
            let reply = ApprovalAnswerReply {
                protocol: PROTOCOL_VERSION,
                outcome: AnswerOutcome::AlreadyDecided,
                record,
            };
            return respond_json(req, self.max_payload(), &reply).await;
        }
        let run = r.run_id;
        let id = &r.approval_id;
        let nats = self.store.bus().client();
        let inbox = nats.new_inbox();
        // Subscribed before the append: the verdict cannot come before anyone listens.
        let mut verdicts = match nats.subscribe(inbox.clone()).await {
            Ok(v) => v,
            Err(e) => {
                return respond_error(req, 503, ErrorCode::Unavailable, e.to_string()).await;
            }
        };
        let asked = &record.request;
        let by = r.by.trim().to_owned();
        let entry = RunLogEntry {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            input: RunInput::ApprovalDecided(Box::new(ApprovalDecided {
                approval_id: id.clone(),
                task_id: asked.task_id.clone(),
                attempt: asked.attempt,
                status: ApprovalStatus::Decided,
                decision: r.decision.clone(),
                by: by.clone(),
                tool_call: asked.tool_call.clone(),
                digest: asked.tool_call.is_some().then(|| asked.digest.clone()),
                incident: r.incident,
                comment: r.comment.clone(),
                at: Some(Timestamp::now()),
                always: r.always,
                reply_to: Some(inbox),
            })),
        };
        let msg_id = answer_msg_id(run, id, &uuid::Uuid::new_v4().simple().to_string());
        let bus = self.store.bus();
        let seq = match bus
            .publish(bus.names().runlog(run), &entry, Some(&msg_id))
            .await
        {
            Ok(ack) => ack.sequence,
            Err(e) => {
                return respond_error(
                    req,
                    503,
                    ErrorCode::Unavailable,
                    format!("appending the answer to the run log: {e}"),
                )
                .await;
            }
        };
        let waited = tokio::time::Instant::now();
        // A coordinator answers within milliseconds; after a second without a verdict the
        // log is read too, twice a second: a 0.2 coordinator applies without a verdict.
        let mut verdict = None;
        let mut slice = VERDICT_SLICE_FIRST;
        while verdict.is_none() && waited.elapsed() < VERDICT_WAIT {
            let heard = tokio::time::timeout(slice, async {
                while let Some(m) = verdicts.next().await {
                    match serde_json::from_slice::<ControlVerdict>(&m.payload) {
                        Ok(v) if v.run_id == run && v.seq == seq => return Some(v),
                        _ => {}
                    }
                }
                None
            })
            .await;
            verdict = match heard {
                Ok(Some(v)) => Some(v),
                Ok(None) => {
                    // The inbox's subscription ended: only the log can say.
                    tokio::time::sleep(slice).await;
                    self.decided_without_verdict(run, id, seq, &record).await
                }
                Err(_) => self.decided_without_verdict(run, id, seq, &record).await,
            };
            slice = VERDICT_SLICE;
        }
        let Some(verdict) = verdict else {
            tracing::warn!(%run, approval = %id, seq, "No coordinator applied an answer in time");
            return respond_error(
                req,
                503,
                ErrorCode::Unavailable,
                format!(
                    "the answer is on the run log (sequence {seq}), but no coordinator applied it within {} s: it applies when one does, unless the approval is decided before; approval.get says what decided",
                    VERDICT_WAIT.as_secs()
                ),
            )
            .await;
        };
        if verdict.applied {
            info!(%run, approval = %id, decision = r.decision.as_str(), %by, always = r.always, "Approval answered");
        }
        // The record is written before the verdict is sent; an answer that lost to the
        // deadline waits for the default's record a moment longer.
        let record = loop {
            match self.approvals.get(run, id).await {
                Ok(Some((record, _))) if record.status != ApprovalStatus::Pending => break record,
                Ok(_) if waited.elapsed() < VERDICT_WAIT => {
                    tokio::time::sleep(std::time::Duration::from_millis(25)).await;
                }
                Ok(_) => {
                    return respond_error(
                        req,
                        503,
                        ErrorCode::Unavailable,
                        format!(
                            "the answer is on the run log (sequence {seq}) but did not decide, and approval {id} reads pending: the run may no longer wait for it; approval.get says what decided"
                        ),
                    )
                    .await;
                }
                Err(e) => return respond_approval_error(req, e).await,
            }
        };
        let reply = ApprovalAnswerReply {
            protocol: PROTOCOL_VERSION,
            outcome: if verdict.applied {
                AnswerOutcome::Decided
            } else {
                AnswerOutcome::AlreadyDecided
            },
            record,
        };
        respond_json(req, self.max_payload(), &reply).await;
    }
}

impl Api {
    /// No verdict came for the answer at `seq`: a coordinator of 0.2 (during a rolling
    /// update) applies the run's log — it sends no verdict and does not write the bucket —
    /// or none does. When the run's record no longer waits for the approval, a machine
    /// applied a decision: the first `approval_decided` of the approval in log order, as the
    /// 0.2 machine takes it, unless the run had ended before it (its end withdrew the
    /// approval). It is written to the bucket (the projection a 0.3 coordinator would have
    /// written) and stands as the verdict. `None`: the run still waits (nobody applied the
    /// log yet), it ended first, or it cannot be read.
    async fn decided_without_verdict(
        &self,
        run: flotilla_model::ids::RunId,
        id: &str,
        seq: u64,
        pending: &ApprovalRecord,
    ) -> Option<ControlVerdict> {
        let state = self.store.state(run).await.ok()??;
        let waits = state
            .tasks
            .iter()
            .enumerate()
            .any(|(i, t)| t.approval.is_some_and(|p| p.id(i as u32) == id));
        if waits {
            return None;
        }
        let history = self.store.history(run).await.ok()?;
        let (first, at, d) = history.into_iter().find_map(|(s, at, e)| match e.input {
            RunInput::ApprovalDecided(d) if d.approval_id == id => Some((s, at, d)),
            _ => None,
        })?;
        if state
            .finished_ms
            .is_some_and(|finished| at.unix_ms() > finished)
        {
            // The run had ended before the first answer: its end withdrew the approval (and
            // says so itself). A decision that ended the run is as old as the end.
            return None;
        }
        let record = decided_record(pending, *d, at.unix_ms());
        if let Err(e) = self.approvals.project(run, id, &record).await {
            tracing::warn!(%run, approval = %id, error = %e, "Could not write an approval's decision read from the run log");
            return None;
        }
        info!(%run, approval = %id, seq = first, "Approval decided by a coordinator that sent no verdict; its record written from the run log");
        // The grant a 0.3 coordinator writes with the decision.
        if let Some(grant) = grant_of(&record).filter(|_| first == seq) {
            let written = async {
                let scope = self.session_scope(Some(run), None).await?;
                self.clients(scope)?
                    .state()
                    .grant_tool(&grant)
                    .await
                    .map_err(super::collab::context_error)
            }
            .await;
            if let Err(e) = written {
                tracing::warn!(%run, tool = %grant.tool, error = %e.message, "Could not write a tool's grant");
                return None;
            }
        }
        Some(ControlVerdict {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            seq,
            applied: first == seq,
            status: state.status,
            detail: None,
        })
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
                    ErrorCode::InvalidAnswer,
                    "a revocation must say who gives it (`by`)",
                ));
            }
            if !flotilla_model::plan::is_tool_name(&r.tool) {
                return Err(super::collab::bad(
                    ErrorCode::InvalidTool,
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
                        ErrorCode::NotFound,
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
