//! Plan submissions: from the durable intake stream and from the request/reply endpoint.
//!
//! A submission is decoded, given its run id (the client's `run_id`, the run an idempotency
//! key already names, or a fresh UUIDv7), validated, and then either
//!
//! * **rejected**: a run record with status `rejected` and every problem is created, a
//!   `run_rejected` event is published, and nothing is dispatched; or
//! * **accepted**: a `submitted` entry (the normalised plan) is appended to the run log with
//!   `Nats-Msg-Id: submitted.<run>`; the run-log runtime takes it from there.
//!
//! Resubmitting the same run id or idempotency key never creates a second run.

use std::collections::BTreeMap;

use async_nats::HeaderMap;
use async_nats::header::NATS_MESSAGE_ID;
use flotilla_bus::wire;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::codec::{CodecError, check_protocol};
use flotilla_model::event::{Event, EventEnvelope, WorkflowEvent, WorkflowPhase};
use flotilla_model::ids::RunId;
use flotilla_model::runlog::{RunInput, RunLogEntry, Submitted};
use flotilla_model::submit::{SubmitReply, SubmitRequest, SubmitStatus};
use flotilla_model::task::TraceContext;
use flotilla_model::time::Timestamp;
use flotilla_model::validate::{Problem, ValidationContext, prepare_plan};
use tracing::{info, warn};

use crate::error::{StoreError, StoreErrorKind};
use crate::machine::RunState;
use crate::store::{RunStore, SnapshotRef};

/// What to answer.
#[derive(Debug)]
pub(crate) enum Answer {
    /// Reply now.
    Now(Box<SubmitReply>),
    /// The run was accepted and the submitter waits: the reply comes when the run ends.
    AtEnd,
}

/// Handles submissions.
#[derive(Debug)]
pub(crate) struct Intake {
    store: RunStore,
    ctx: ValidationContext,
}

fn reply(
    run_id: Option<RunId>,
    status: SubmitStatus,
    errors: Vec<Problem>,
    warnings: Vec<Problem>,
) -> SubmitReply {
    SubmitReply {
        protocol: PROTOCOL_VERSION,
        run_id,
        status,
        errors,
        warnings,
        outcome: None,
    }
}

impl Intake {
    pub(crate) fn new(store: RunStore, ctx: ValidationContext) -> Self {
        Self { store, ctx }
    }

    /// Handles one submission. `wait_reply` is the subject of a request/reply submitter that
    /// may ask to wait for the end of the run. `now_ms` is the server time of an intake
    /// message, or the local time for requests.
    pub(crate) async fn submit(
        &self,
        headers: Option<&HeaderMap>,
        payload: &[u8],
        wait_reply: Option<&str>,
        now_ms: i64,
    ) -> Result<Answer, StoreError> {
        let msg_id = wire::header(headers, NATS_MESSAGE_ID.as_ref()).map(str::to_owned);
        let request: Result<SubmitRequest, CodecError> =
            wire::decode::<SubmitRequest>(headers, payload)
                .and_then(|r| check_protocol(r.protocol).map(|()| r));
        let request = match request {
            Ok(r) => r,
            Err(e) => {
                // Still find the run the client meant, so it can look the rejection up.
                let loose = wire::decode::<serde_json::Value>(headers, payload).ok();
                let field = |name: &str| loose.as_ref().and_then(|v| v.get(name)?.as_str());
                let hinted = field("run_id").and_then(|r| r.parse().ok());
                let key = msg_id.or_else(|| field("idempotency_key").map(str::to_owned));
                let run = self.run_id_for(hinted, key.as_deref()).await?.0;
                return self
                    .reject(run, vec![e.to_problem()], None, BTreeMap::new(), now_ms)
                    .await;
            }
        };
        // A run id is its own idempotency key; a message id stands in only without one.
        let key = request
            .idempotency_key
            .clone()
            .or(if request.run_id.is_none() {
                msg_id
            } else {
                None
            });
        let (run, fresh) = self.run_id_for(request.run_id, key.as_deref()).await?;
        if !fresh || self.store.load(run).await?.is_some() {
            return Ok(Answer::Now(Box::new(reply(
                Some(run),
                SubmitStatus::Duplicate,
                Vec::new(),
                Vec::new(),
            ))));
        }
        let (plan, warnings) = match prepare_plan(&request.plan, &self.ctx) {
            Ok(p) => p,
            Err(report) => {
                return self
                    .reject(
                        run,
                        report.errors,
                        request.plan.name.clone(),
                        request.labels.clone(),
                        now_ms,
                    )
                    .await;
            }
        };
        let waiting = request.wait && wait_reply.is_some();
        let submitted = Submitted {
            plan,
            labels: request.labels,
            session_id: request.session_id,
            parent: request.parent,
            reply_to: if waiting {
                wait_reply.map(str::to_owned)
            } else {
                request.reply_to
            },
            warnings: warnings.clone(),
            trace: Some(trace_from(headers, run)),
        };
        let entry = RunLogEntry {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            input: RunInput::Submitted(Box::new(submitted)),
        };
        let bus = self.store.bus();
        let ack = bus
            .publish(
                bus.names().runlog(run),
                &entry,
                Some(&format!("submitted.{run}")),
            )
            .await
            .map_err(|e| {
                StoreError::with_source(StoreErrorKind::Nats, format!("appending run {run}"), e)
            })?;
        if ack.duplicate {
            return Ok(Answer::Now(Box::new(reply(
                Some(run),
                SubmitStatus::Duplicate,
                Vec::new(),
                Vec::new(),
            ))));
        }
        info!(%run, "Plan accepted");
        if waiting {
            Ok(Answer::AtEnd)
        } else {
            Ok(Answer::Now(Box::new(reply(
                Some(run),
                SubmitStatus::Accepted,
                Vec::new(),
                warnings,
            ))))
        }
    }

    /// The run id of a submission and whether it is new.
    async fn run_id_for(
        &self,
        requested: Option<RunId>,
        key: Option<&str>,
    ) -> Result<(RunId, bool), StoreError> {
        let candidate = requested.unwrap_or_default();
        match key {
            Some(k) if !k.is_empty() => self.store.claim_idempotency_key(k, candidate).await,
            _ => Ok((candidate, true)),
        }
    }

    async fn reject(
        &self,
        run: RunId,
        errors: Vec<Problem>,
        name: Option<String>,
        labels: BTreeMap<String, String>,
        now_ms: i64,
    ) -> Result<Answer, StoreError> {
        warn!(%run, problems = errors.len(), first = %errors.first().map(ToString::to_string).unwrap_or_default(), "Plan rejected");
        let state = RunState::rejected(run, errors.clone(), now_ms, name, labels);
        let snapshot = SnapshotRef {
            state: &state,
            outbox: &[],
            outbox_seqs: &[],
        };
        match self.store.create(run, &snapshot).await {
            Ok(_) => {}
            Err(e) if e.kind() == StoreErrorKind::AlreadyExists => {
                return Ok(Answer::Now(Box::new(reply(
                    Some(run),
                    SubmitStatus::Duplicate,
                    Vec::new(),
                    Vec::new(),
                ))));
            }
            Err(e) => return Err(e),
        }
        let bus = self.store.bus();
        let event = EventEnvelope {
            protocol: PROTOCOL_VERSION,
            id: format!("{run}.rejected"),
            run_id: run,
            task_id: None,
            attempt: None,
            ts: Timestamp::from_unix_ms(now_ms),
            source: "coordinator".into(),
            event: Event::Workflow(WorkflowEvent {
                detail: Some(
                    errors
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join("; "),
                ),
                outcome: state.outcome.clone(),
                ..WorkflowEvent::phase(WorkflowPhase::RunRejected)
            }),
        };
        if let Err(e) = bus
            .publish(bus.names().event(run), &event, Some(&event.id))
            .await
        {
            warn!(%run, error = %e, "Could not publish the rejection event");
        }
        Ok(Answer::Now(Box::new(reply(
            Some(run),
            SubmitStatus::Rejected,
            errors,
            Vec::new(),
        ))))
    }
}

/// The submission's trace context, or a new trace rooted at the run.
fn trace_from(headers: Option<&HeaderMap>, run: RunId) -> TraceContext {
    if let Some(tp) = wire::header(headers, wire::TRACEPARENT)
        && tp.split('-').count() == 4
    {
        return TraceContext {
            traceparent: tp.to_owned(),
            tracestate: wire::header(headers, "tracestate").map(str::to_owned),
        };
    }
    let trace_id = run.as_uuid().simple().to_string();
    TraceContext {
        traceparent: format!("00-{trace_id}-{}-01", &trace_id[..16]),
        tracestate: None,
    }
}
