//! Admission of a run's first message: the verdict on a client's own durable submission
//! (validated again by every coordinator, so all reach the same one), the rejections that
//! verdict, a misaddressed subject or an unreadable first entry turn into (a run-log entry, a
//! record, an event and an answer), and the answers to duplicate submissions.

use flotilla_bus::wire;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::codec::Codec;
use flotilla_model::event::{Event, EventEnvelope, WorkflowEvent, WorkflowPhase};
use flotilla_model::ids::RunId;
use flotilla_model::run::RunStatus;
use flotilla_model::runlog::{Rejected, RunInput, RunLogEntry, Submitted};
use flotilla_model::submit::{SubmitReply, SubmitRequest, SubmitStatus};
use flotilla_model::task::TraceContext;
use flotilla_model::time::Timestamp;
use flotilla_telemetry::InternalEvent;
use flotilla_telemetry::events::{RunFinished, RunSubmitted};
use tracing::{info, warn};

use crate::error::StoreErrorKind;
use crate::machine::Emission;
use crate::store::{SnapshotRef, UnreadableSubmission};

use super::{Decoded, Runtime, StepError};

impl Runtime {
    /// The verdict on a client's own submission (the first message of its run): the run as
    /// accepted, or its rejection with every problem. Pure but for reading the parent of a
    /// child run, so every coordinator reaches the same verdict on the same submission.
    pub(super) async fn verdict(
        &self,
        run: RunId,
        submission: Result<&SubmitRequest, &UnreadableSubmission>,
        trace: TraceContext,
        submitted_ms: i64,
    ) -> Result<Result<Submitted, Rejected>, StepError> {
        let request = match submission {
            Ok(r) => r,
            Err(unreadable) => return Ok(Err(self.rejection_of(run, unreadable))),
        };
        let names = self.bus.names();
        let intake = names.submit();
        let facts = crate::admission::Facts {
            ctx: &self.ctx,
            lineages: &self.lineages,
            trust: &self.trust,
            hitl: &self.opts.hitl,
        };
        Ok(crate::admission::verdict(
            &facts,
            run,
            request,
            crate::admission::Door::RunSubject {
                prefix: names.prefix(),
                intake: &intake,
            },
            submitted_ms,
            Timestamp::from_unix_ms(submitted_ms),
            trace,
        )
        .await?)
    }

    /// The rejection of a submission that cannot be decoded: every problem of it at once
    /// (fields of the wrong type, unknown or missing, then what validation finds in the rest).
    pub(super) fn rejection_of(&self, run: RunId, unreadable: &UnreadableSubmission) -> Rejected {
        Rejected {
            errors: flotilla_model::lenient::submission_problems(
                unreadable.codec,
                &unreadable.payload,
                run,
                &self.ctx,
            ),
            name: None,
            labels: Default::default(),
            reply_to: unreadable.reply_to.clone(),
            intake_seq: None,
        }
    }

    /// Makes a rejection of a client's own submission the run's decision: a `rejected` entry
    /// on its run log (message id `rejected.<run>`, so every coordinator that reaches the
    /// verdict appends it once), then the record, the `run_rejected` event and the answer on
    /// `reply_to` (each once: whoever creates the record publishes them).
    pub(super) async fn reject(
        &self,
        run: RunId,
        rejected: &Rejected,
        now_ms: i64,
    ) -> Result<(), StepError> {
        warn!(%run, problems = rejected.errors.len(), first = %rejected.errors.first().map(ToString::to_string).unwrap_or_default(), "Plan rejected");
        let entry = RunLogEntry {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            input: RunInput::Rejected(Box::new(rejected.clone())),
        };
        self.bus
            .publish(
                self.bus.names().runlog(run),
                &entry,
                Some(&format!("rejected.{run}")),
            )
            .await?;
        crate::intake::record_rejection(&self.store, &self.metrics, run, rejected, now_ms, false)
            .await?;
        Ok(())
    }

    /// Refuses a submission published on `<prefix>.submit.<token>` where the token is not a
    /// canonical run id: it becomes the first message of the run `run` derived from the token
    /// (a `rejected` entry), with a record, an event and the answer on its `reply_to`.
    pub(super) async fn refuse_misaddressed(
        &self,
        run: RunId,
        rejected: &Rejected,
        now_ms: i64,
    ) -> Result<(), StepError> {
        warn!(%run, problem = %rejected.errors.first().map(ToString::to_string).unwrap_or_default(), "Submission on a subject that names no run refused");
        let entry = RunLogEntry {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            input: RunInput::Rejected(Box::new(rejected.clone())),
        };
        let mut out = wire::encode(&entry, Codec::Json, Some(&format!("rejected.{run}")))?;
        wire::expect_first(&mut out.headers);
        out.headers
            .insert(wire::KIND_HEADER, wire::KIND_RUNLOG_ENTRY);
        match self
            .bus
            .publish_encoded(self.bus.names().submit_run(run), out)
            .await
        {
            Ok(_) => {}
            // Another submission on the same token decided it already.
            Err(e) if e.kind() == flotilla_bus::PublishErrorKind::NotFirst => {}
            Err(e) => return Err(e.into()),
        }
        crate::intake::record_rejection(&self.store, &self.metrics, run, rejected, now_ms, false)
            .await?;
        RunSubmitted {
            run: Some(run),
            status: SubmitStatus::Rejected,
        }
        .emit(&self.metrics);
        Ok(())
    }

    /// Validates a durable submission (the run's first message, delivered for the first time
    /// or redelivered before its start was recorded) and starts its run, or records its
    /// rejection. `Ok(None)`: rejected (recorded, answered).
    pub(super) async fn admit(
        &self,
        run: RunId,
        request: Result<&SubmitRequest, &UnreadableSubmission>,
        d: &Decoded,
        span: &tracing::Span,
    ) -> Result<Option<Submitted>, StepError> {
        let trace = crate::intake::admitted_trace(d.msg.headers.as_ref(), run, span);
        // An unreadable submission's verdict is its refusal.
        let verdict = match (self.verdict(run, request, trace, d.ts_ms).await?, request) {
            (Ok(submitted), Ok(request)) => {
                match crate::admission::enter(&self.lineages, request, submitted).await? {
                    Ok(submitted) => self.within_quota(run, request, submitted, d).await?,
                    refused => refused,
                }
            }
            (verdict, _) => verdict,
        };
        let mut submitted = match verdict {
            Ok(s) => s,
            Err(rejected) => {
                self.reject(run, &rejected, d.ts_ms).await?;
                RunSubmitted {
                    run: Some(run),
                    status: SubmitStatus::Rejected,
                }
                .emit(&self.metrics);
                return Ok(None);
            }
        };
        let warnings = crate::admission::live_warnings(&self.live, &self.ctx, &submitted, d.ts_ms);
        submitted.warnings.extend(warnings);
        self.lineages.admitted(run, &submitted);
        info!(%run, "Plan accepted");
        Ok(Some(submitted))
    }

    /// Admits a root run under the installation's quotas (a child run, or any run without
    /// quotas, passes as it is): its refusal, or a wait ([`StepError::Wait`]) when its quota
    /// queues and it has not waited `quota::QUEUE_WAIT` since it was stored. A slot is taken
    /// once per run: admitted again (a redelivery, a step retried), it takes none.
    async fn within_quota(
        &self,
        run: RunId,
        request: &SubmitRequest,
        mut submitted: Submitted,
        d: &Decoded,
    ) -> Result<Result<Submitted, Rejected>, StepError> {
        let Some(quota) = &self.quota else {
            return Ok(Ok(submitted));
        };
        match quota.admit(run, &mut submitted, d.ts_ms, true).await? {
            crate::quota::Decision::Admitted { .. } => Ok(Ok(submitted)),
            crate::quota::Decision::Refused(problem) => Ok(Err(crate::admission::rejected(
                request,
                vec![problem],
                submitted.reply_to,
                None,
            ))),
            crate::quota::Decision::Wait(pause) => Err(StepError::Wait(pause)),
        }
    }

    /// Whether the message at `seq` is the first of the run's history (for submissions whose
    /// publisher did not make sure of it).
    pub(super) async fn is_first(&self, run: RunId, seq: u64) -> Result<bool, StepError> {
        Ok(self
            .store
            .first_message(run)
            .await
            .map_err(StepError::from)?
            .is_none_or(|f| f.seq == seq))
    }

    /// Answers a duplicate durable submission on its `reply_to`.
    pub(super) async fn answer_duplicate(
        &self,
        run: RunId,
        reply_to: Option<&str>,
        status: RunStatus,
    ) {
        RunSubmitted {
            run: Some(run),
            status: SubmitStatus::Duplicate,
        }
        .emit(&self.metrics);
        if let Some(to) = reply_to.filter(|s| flotilla_model::token::check_subject(s).is_ok()) {
            let answer = SubmitReply {
                protocol: PROTOCOL_VERSION,
                run_id: Some(run),
                status: SubmitStatus::Duplicate,
                errors: Vec::new(),
                warnings: Vec::new(),
                outcome: None,
                run_status: Some(status),
            };
            self.bus.publish_reply(to, &answer, None).await;
        }
    }

    /// A run whose first run-log entry cannot be read never starts: record it `failed` with
    /// the reason, so it is visible instead of silently missing.
    pub(super) async fn record_unstartable(
        &self,
        run: RunId,
        reason: &str,
        now_ms: i64,
    ) -> Result<(), StepError> {
        let mut state = crate::machine::RunState::rejected(
            run,
            Vec::new(),
            now_ms,
            None,
            std::collections::BTreeMap::new(),
        );
        state.status = RunStatus::Failed;
        if let Some(o) = state.outcome.as_mut() {
            o.status = RunStatus::Failed;
            o.reason = Some(reason.to_owned());
            o.cause = Some(flotilla_model::run::EndCause::Aborted);
        }
        let snapshot = SnapshotRef {
            state: &state,
            outbox: &[],
            outbox_seqs: &[],
        };
        match self.store.create(run, &snapshot).await {
            Ok(_) => RunFinished {
                run,
                status: RunStatus::Failed,
            }
            .emit(&self.metrics),
            Err(e) if e.kind() == StoreErrorKind::AlreadyExists => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let e = Emission {
            id: format!("{run}.end"),
            task: None,
            attempt: None,
            at_ms: now_ms,
            event: WorkflowEvent {
                outcome: state.outcome.clone().map(Box::new),
                detail: Some(reason.to_owned()),
                ..WorkflowEvent::phase(WorkflowPhase::RunFailed)
            },
        };
        let ev = EventEnvelope {
            protocol: PROTOCOL_VERSION,
            id: e.id.clone(),
            run_id: run,
            task_id: None,
            attempt: None,
            ts: Timestamp::from_unix_ms(now_ms),
            source: "coordinator".into(),
            event: Event::Workflow(e.event),
        };
        crate::publish_event(&self.bus, ev).await?;
        Ok(())
    }
}
