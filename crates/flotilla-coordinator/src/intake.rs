//! Plan submissions: from the durable intake stream and from the request/reply endpoint.
//!
//! A submission is decoded, given its run id (the client's `run_id`, the run an idempotency
//! key names, or a fresh UUIDv7) and validated. Then its **first run-log entry** is appended
//! to the run's submission subject `<prefix>.submit.<run>` with
//! `Nats-Expected-Last-Subject-Sequence: 0` (and `Flotilla-Kind: runlog-entry`, to tell it
//! from a client's own submission on that subject):
//!
//! * `submitted` (the normalised plan) when it is valid — the run-log runtime starts the run;
//! * `rejected` (every problem) when it is not — a run record with status `rejected` and a
//!   `run_rejected` event are written, and nothing is dispatched.
//!
//! Only one first entry can ever be appended, so **the first writer decides a run's fate,
//! once**: a concurrent or later submission of the same run (same `run_id`, same idempotency
//! key) fails the append and is answered `duplicate` with the winner's status. An idempotency
//! key is claimed in KV before the append; if a coordinator dies between the claim and the
//! append, the redelivered submission finds the key, sees the run has no first entry yet, and
//! appends it — nothing acknowledged is lost.
//!
//! Every submission with a valid `reply_to` gets exactly one terminal answer there (at least
//! once): `rejected`, `duplicate`, or — from the runtime, when the run ends — `finished`.

use std::collections::BTreeMap;

use async_nats::HeaderMap;
use async_nats::header::NATS_MESSAGE_ID;
use flotilla_bus::{PublishErrorKind, wire};
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::codec::{Codec, CodecError, check_protocol};
use flotilla_model::event::{Event, EventEnvelope, WorkflowEvent, WorkflowPhase};
use flotilla_model::ids::RunId;
use flotilla_model::plan::Plan;
use flotilla_model::run::RunStatus;
use flotilla_model::runlog::{PlanningSpec, Rejected, RunInput, RunLogEntry};
use flotilla_model::submit::{SubmitReply, SubmitRequest, SubmitStatus};
use flotilla_model::task::TraceContext;
use flotilla_model::time::Timestamp;
use flotilla_model::token::check_subject;
use flotilla_model::validate::{Problem, ProblemCode, ValidationContext};
use flotilla_telemetry::events::{RunFinished, RunSubmitted};
use flotilla_telemetry::{InternalEvent, Metrics, spans, trace_context};
use tracing::{debug, info, warn};

pub(crate) use flotilla_runs::first::{header_trace, loose_fields, trace_from};

use crate::error::{StoreError, StoreErrorKind};
use crate::live::LiveWorkers;
use crate::machine::RunState;
use crate::planner::{PlannerOptions, planner_pools, planning_plan};
use crate::store::{RunStore, SnapshotRef};

/// Where a submission came from.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Source<'a> {
    /// The durable intake stream: its stream sequence, delivery count and server time.
    Intake { seq: u64, now_ms: i64 },
    /// The request/reply endpoint: the requester's reply subject, and the local time.
    /// `fork`: the submission is a fork `run.fork` built (its plan may say what it reuses).
    Api {
        inbox: Option<&'a str>,
        now_ms: i64,
        fork: bool,
    },
}

impl Source<'_> {
    fn now_ms(&self) -> i64 {
        match *self {
            Self::Intake { now_ms, .. } | Self::Api { now_ms, .. } => now_ms,
        }
    }

    fn intake_seq(&self) -> Option<u64> {
        match *self {
            Self::Intake { seq, .. } => Some(seq),
            Self::Api { .. } => None,
        }
    }
}

/// What to answer a request/reply submitter.
#[derive(Debug)]
pub(crate) enum Answer {
    /// Reply now.
    Now(Box<SubmitReply>),
    /// The run was accepted and the submitter waits: the runtime answers its inbox when the
    /// run ends.
    AtEnd,
    /// A duplicate whose submitter waits: answer when that run ends (or at once, if it has).
    WaitFor(RunId),
    /// Its installation's `concurrent_runs` is full and queues: hand the durable submission
    /// back, to be decided again after this long (nothing was written).
    Later(std::time::Duration),
}

/// Handles submissions.
#[derive(Debug)]
pub(crate) struct Intake {
    store: RunStore,
    ctx: ValidationContext,
    live: LiveWorkers,
    metrics: Metrics,
    planner: PlannerOptions,
    lineages: std::sync::Arc<crate::lineage::Lineages>,
    /// The supervisor's memory, consulted for bare queries (absent: planned without it).
    memory: Option<crate::memory::Memory>,
    /// The deployment's escalation policy, resolved with each plan's at admission.
    hitl: flotilla_machine::policy::HitlConfig,
    trust: crate::trust::Trust,
    /// The installation's quotas (absent: none apply).
    quota: Option<std::sync::Arc<crate::quota::Quota>>,
}

fn reply(run_id: Option<RunId>, status: SubmitStatus) -> SubmitReply {
    SubmitReply {
        protocol: PROTOCOL_VERSION,
        run_id,
        status,
        errors: Vec::new(),
        warnings: Vec::new(),
        outcome: None,
        run_status: None,
    }
}

impl Intake {
    pub(crate) fn new(
        store: RunStore,
        ctx: ValidationContext,
        live: LiveWorkers,
        metrics: Metrics,
        planner: PlannerOptions,
        lineages: std::sync::Arc<crate::lineage::Lineages>,
    ) -> Self {
        Self {
            store,
            ctx,
            live,
            metrics,
            planner,
            lineages,
            memory: None,
            hitl: flotilla_machine::policy::HitlConfig::default(),
            trust: crate::trust::Trust::default(),
            quota: None,
        }
    }

    /// Admits root runs under the installation's quotas.
    pub(crate) fn with_quota(mut self, quota: std::sync::Arc<crate::quota::Quota>) -> Self {
        self.quota = Some(quota);
        self
    }

    /// Admits runs with the deployment's escalation policy `hitl`.
    /// Admits runs with the earned trust levels of `trust`.
    pub(crate) fn with_trust(mut self, trust: crate::trust::Trust) -> Self {
        self.trust = trust;
        self
    }

    pub(crate) fn with_hitl(mut self, hitl: flotilla_machine::policy::HitlConfig) -> Self {
        self.hitl = hitl;
        self
    }

    /// Consults `memory` for bare queries (when it is enabled).
    pub(crate) fn with_memory(mut self, memory: crate::memory::Memory) -> Self {
        self.memory = memory.enabled().then_some(memory);
        self
    }

    /// Memory's advice for a bare query whose planning plan is `planning`: a past plan to
    /// run instead (with its warnings), or the planning plan — with examples added when
    /// memory has some — and the run starts by planning.
    async fn advised_by_memory(
        &self,
        run: RunId,
        query: &str,
        session: Option<flotilla_model::ids::SessionId>,
        mut planning: Plan,
    ) -> crate::admission::QueryPlan {
        let plans = |plan: Plan, memory| crate::admission::QueryPlan {
            plan,
            warnings: Vec::new(),
            planning: Some(PlanningSpec {
                query: query.to_owned(),
                max_repairs: self.planner.max_repairs,
            }),
            memory,
        };
        let Some(memory) = &self.memory else {
            return plans(planning, None);
        };
        let max_plan_bytes = self
            .store
            .bus()
            .max_payload()
            .saturating_sub(flotilla_model::validate::PLAN_ENVELOPE_ROOM);
        match memory
            .advise(run, query, session, &self.ctx, max_plan_bytes)
            .await
        {
            crate::memory::Advice::Reuse {
                plan,
                warnings,
                used,
            } => {
                info!(%run, source = ?used.source_run, confidence = ?used.confidence, "Plan reused from memory");
                crate::admission::QueryPlan {
                    plan: *plan,
                    warnings,
                    planning: None,
                    memory: Some(used),
                }
            }
            crate::memory::Advice::Plan { examples, used } => {
                if !examples.is_empty()
                    && let Some(task) = planning.subtasks.first_mut()
                {
                    task.description.push(' ');
                    task.description
                        .push_str(crate::memory::EXAMPLES_INSTRUCTION);
                    if let Some(input) = task.input.as_object_mut() {
                        input.insert("examples".into(), crate::memory::examples_input(&examples));
                    }
                }
                plans(planning, Some(used))
            }
        }
    }

    /// The planning plan of a bare query, or why this deployment cannot plan it.
    fn plan_for_query(&self, query: &str, now_ms: i64) -> Result<Plan, Problem> {
        let opts = &self.planner;
        let no_planner = |message: String| Problem::new(ProblemCode::NoPlanner, "query", message);
        let Some(agent) = &opts.agent else {
            return Err(no_planner(
                "this deployment has no planner for bare queries: set `[coordinator.planner] agent` to an LLM agent, or submit a plan".into(),
            ));
        };
        if let Some(agents) = &self.ctx.agents
            && !agents.names.contains(agent)
        {
            return Err(no_planner(format!(
                "the planner agent {agent:?} is not defined in [agents]"
            )));
        }
        if let Some(missing) = self.live.pools_without_workers(planner_pools(opts), now_ms)
            && !missing.is_empty()
        {
            return Err(no_planner(format!(
                "no live worker serves the planner's pool {:?}: start one (`flotilla worker --pool {}`) and submit again",
                opts.pool, opts.pool
            )));
        }
        Ok(planning_plan(query, opts, &self.ctx, 1, &[], None))
    }

    /// Handles one submission and says what to answer a request/reply submitter.
    pub(crate) async fn submit(
        &self,
        headers: Option<&HeaderMap>,
        payload: &[u8],
        source: Source<'_>,
    ) -> Result<Answer, StoreError> {
        let msg_id = wire::header(headers, NATS_MESSAGE_ID.as_ref()).map(str::to_owned);
        // The run's trace: the client's, or rooted here when it sent none.
        let span = spans::intake();
        trace_context::set_parent(&span, header_trace(headers).as_ref());
        let request: Result<SubmitRequest, CodecError> =
            wire::decode::<SubmitRequest>(headers, payload)
                .and_then(|r| check_protocol(r.protocol).map(|()| r));
        let request = match request {
            Ok(r) => r,
            Err(e) => {
                // Still find the run the client meant, so it can look the rejection up, and
                // where it waits for an answer.
                let loose = loose_fields(headers, payload, msg_id);
                let reply_to = loose.reply_to.filter(|s| check_subject(s).is_ok());
                let run = self.run_id_for(loose.run_id, loose.key.as_deref()).await?;
                // Every problem at once: each field of the wrong type, and what validation
                // finds in the rest.
                let errors = match e {
                    CodecError::UnsupportedProtocol { .. } => vec![e.to_problem()],
                    _ => flotilla_model::lenient::submission_problems(
                        wire::codec_of(headers),
                        payload,
                        run,
                        &self.ctx,
                    ),
                };
                let rejected = Rejected {
                    errors,
                    name: None,
                    labels: BTreeMap::new(),
                    reply_to,
                    intake_seq: source.intake_seq(),
                };
                return self.reject(run, rejected, source).await;
            }
        };
        // A synchronous submitter whose request has the wrong shape (plan and query, neither,
        // an empty query) learns it at once, and nothing is stored: no run, no key claimed.
        // A durable submission is recorded as rejected below, since its rejection is all its
        // submitter can look up.
        if let (Source::Api { .. }, Err(problem)) = (source, request.form()) {
            RunSubmitted {
                run: None,
                status: SubmitStatus::Rejected,
            }
            .emit(&self.metrics);
            let mut r = reply(None, SubmitStatus::Rejected);
            r.errors = vec![problem];
            return Ok(Answer::Now(Box::new(r)));
        }
        // A run id is its own idempotency key; a message id stands in only without one.
        let key = request
            .idempotency_key
            .clone()
            .or(if request.run_id.is_none() {
                msg_id
            } else {
                None
            });
        let run = self.run_id_for(request.run_id, key.as_deref()).await?;
        let facts = crate::admission::Facts {
            ctx: &self.ctx,
            lineages: &self.lineages,
            trust: &self.trust,
            hitl: &self.hitl,
        };
        let verdict = crate::admission::verdict(
            &facts,
            run,
            &request,
            crate::admission::Door::Intake {
                queries: self,
                forks: matches!(source, Source::Api { fork: true, .. }),
            },
            source.now_ms(),
            // The intake records the start it decides: the levels now are the run's for good.
            Timestamp::now(),
            admitted_trace(headers, run, &span),
        )
        .await?;
        let verdict = match verdict {
            Ok(submitted) => crate::admission::enter(&self.lineages, &request, submitted).await?,
            Err(rejected) => Err(rejected),
        };
        let mut submitted = match verdict {
            Ok(s) => s,
            Err(mut rejected) => {
                rejected.intake_seq = source.intake_seq();
                return self.reject(run, rejected, source).await;
            }
        };
        // The installation's quotas (root runs): the last check, so a refusal for any other
        // reason takes no slot.
        let mut reserved = false;
        if let Some(quota) = &self.quota {
            let durable = matches!(source, Source::Intake { .. });
            match quota
                .admit(run, &mut submitted, source.now_ms(), durable)
                .await?
            {
                crate::quota::Decision::Admitted { reserved: r } => reserved = r,
                crate::quota::Decision::Refused(problem) => {
                    let rejected = crate::admission::rejected(
                        &request,
                        vec![problem],
                        submitted.reply_to.clone(),
                        source.intake_seq(),
                    );
                    return self.reject(run, rejected, source).await;
                }
                crate::quota::Decision::Wait(pause) => return Ok(Answer::Later(pause)),
            }
        }
        submitted.warnings.extend(crate::admission::live_warnings(
            &self.live,
            &self.ctx,
            &submitted,
            source.now_ms(),
        ));
        let warnings = submitted.warnings.clone();
        let reply_to = submitted.reply_to.clone();
        let wait_inbox = match source {
            Source::Api { inbox, .. } if request.wait => inbox.map(str::to_owned),
            _ => None,
        };
        let waiting = wait_inbox.is_some();
        let name = submitted.plan.name.clone();
        submitted.wait_reply_to = wait_inbox;
        submitted.intake_seq = source.intake_seq();
        let entry = RunLogEntry {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            input: RunInput::Submitted(Box::new(submitted)),
        };
        match self.append_first(run, &entry).await {
            Ok(true) => {
                if let RunInput::Submitted(s) = &entry.input {
                    self.lineages.admitted(run, s);
                }
            }
            Ok(false) => {
                self.unreserve(reserved, run).await;
                return self
                    .duplicate(run, reply_to.as_deref(), request.wait, source)
                    .await;
            }
            Err(e) if e.kind() == StoreErrorKind::TooLarge => {
                self.unreserve(reserved, run).await;
                let rejected = Rejected {
                    errors: vec![Problem::new(
                        ProblemCode::PlanTooLarge,
                        "",
                        format!(
                            "the accepted plan does not fit in one message of this deployment: {e}"
                        ),
                    )],
                    name,
                    labels: BTreeMap::new(),
                    reply_to,
                    intake_seq: source.intake_seq(),
                };
                return self.reject(run, rejected, source).await;
            }
            Err(e) => {
                self.unreserve(reserved, run).await;
                return Err(e);
            }
        }
        info!(%run, "Plan accepted");
        RunSubmitted {
            run: Some(run),
            status: SubmitStatus::Accepted,
        }
        .emit(&self.metrics);
        if waiting {
            Ok(Answer::AtEnd)
        } else {
            let mut r = reply(Some(run), SubmitStatus::Accepted);
            r.warnings = warnings;
            Ok(Answer::Now(Box::new(r)))
        }
    }

    /// Gives back the slot taken for `run` (`reserved`) when it does not start after all.
    async fn unreserve(&self, reserved: bool, run: RunId) {
        if let (true, Some(q)) = (reserved, &self.quota) {
            q.unreserve(run).await;
        }
    }

    /// Appends a run's first run-log entry. `Ok(false)` when the run already has one.
    async fn append_first(&self, run: RunId, entry: &RunLogEntry) -> Result<bool, StoreError> {
        let bus = self.store.bus();
        let mut out = wire::encode(entry, Codec::Json, Some(&format!("submitted.{run}")))
            .map_err(|e| StoreError::with_source(StoreErrorKind::Decode, "encoding", e))?;
        // A run's first message, whoever writes it, is on its submission subject: only one can
        // ever be stored there.
        wire::expect_first(&mut out.headers);
        out.headers
            .insert(wire::KIND_HEADER, wire::KIND_RUNLOG_ENTRY);
        match bus.publish_encoded(bus.names().submit_run(run), out).await {
            Ok(ack) => Ok(!ack.duplicate),
            Err(e) if e.kind() == PublishErrorKind::NotFirst => Ok(false),
            Err(e) if e.kind() == PublishErrorKind::TooLarge => Err(StoreError::with_source(
                StoreErrorKind::TooLarge,
                format!("appending run {run}"),
                e,
            )),
            Err(e) => Err(StoreError::with_source(
                StoreErrorKind::Nats,
                format!("appending run {run}"),
                e,
            )),
        }
    }

    /// The run id of a submission: the requested one, the one an idempotency key already
    /// names, or a fresh one (claimed for the key).
    async fn run_id_for(
        &self,
        requested: Option<RunId>,
        key: Option<&str>,
    ) -> Result<RunId, StoreError> {
        let candidate = requested.unwrap_or_default();
        match key {
            Some(k) if !k.is_empty() => Ok(self.store.claim_idempotency_key(k, candidate).await?.0),
            _ => Ok(candidate),
        }
    }

    /// Rejects a submission: the rejection becomes the run's first entry (unless another
    /// submission already decided the run), then the record, event and `reply_to` answer.
    async fn reject(
        &self,
        run: RunId,
        rejected: Rejected,
        source: Source<'_>,
    ) -> Result<Answer, StoreError> {
        let entry = RunLogEntry {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            input: RunInput::Rejected(Box::new(rejected.clone())),
        };
        let first = match self.append_first(run, &entry).await {
            Ok(first) => first,
            Err(e) if e.kind() == StoreErrorKind::TooLarge => {
                // Even the bounded problem list does not fit (a tiny max payload): keep the
                // summary only.
                let mut small = rejected.clone();
                small.errors.truncate(1);
                small.errors[0].message.truncate(512);
                let entry = RunLogEntry {
                    protocol: PROTOCOL_VERSION,
                    run_id: run,
                    input: RunInput::Rejected(Box::new(small)),
                };
                self.append_first(run, &entry).await?
            }
            Err(e) => return Err(e),
        };
        if !first {
            return self
                .duplicate(run, rejected.reply_to.as_deref(), false, source)
                .await;
        }
        warn!(%run, problems = rejected.errors.len(), first = %rejected.errors.first().map(ToString::to_string).unwrap_or_default(), "Plan rejected");
        record_rejection(
            &self.store,
            &self.metrics,
            run,
            &rejected,
            source.now_ms(),
            false,
        )
        .await?;
        RunSubmitted {
            run: Some(run),
            status: SubmitStatus::Rejected,
        }
        .emit(&self.metrics);
        let mut r = reply(Some(run), SubmitStatus::Rejected);
        r.errors = rejected.errors;
        Ok(Answer::Now(Box::new(r)))
    }

    /// The submission names a run that already has its first entry. A redelivery of the
    /// submission that wrote it is answered as that submission was; any other is a
    /// `duplicate`, answered with the run's status (on `reply_to` too).
    async fn duplicate(
        &self,
        run: RunId,
        reply_to: Option<&str>,
        wait: bool,
        source: Source<'_>,
    ) -> Result<Answer, StoreError> {
        let first = self
            .store
            .first_message(run)
            .await?
            .and_then(|f| match f.content {
                crate::store::FirstMessage::Entry(e) => Some(e),
                crate::store::FirstMessage::Submission { .. }
                | crate::store::FirstMessage::Unreadable(_) => None,
            });
        if let (Some(seq), Some(first)) = (source.intake_seq(), &first) {
            match &first.input {
                RunInput::Submitted(s) if s.intake_seq == Some(seq) => {
                    debug!(%run, "Redelivered submission was already accepted");
                    return Ok(Answer::Now(Box::new(reply(
                        Some(run),
                        SubmitStatus::Accepted,
                    ))));
                }
                RunInput::Rejected(r) if r.intake_seq == Some(seq) => {
                    debug!(%run, "Redelivered submission was already rejected; answering again");
                    record_rejection(&self.store, &self.metrics, run, r, source.now_ms(), true)
                        .await?;
                    let mut answer = reply(Some(run), SubmitStatus::Rejected);
                    answer.errors = r.errors.clone();
                    return Ok(Answer::Now(Box::new(answer)));
                }
                _ => {}
            }
        }
        let status = match self.store.load(run).await? {
            Some(s) => s.snapshot.state.status,
            None => match first.map(|f| f.input) {
                Some(RunInput::Rejected(_)) => RunStatus::Rejected,
                _ => RunStatus::Pending,
            },
        };
        RunSubmitted {
            run: Some(run),
            status: SubmitStatus::Duplicate,
        }
        .emit(&self.metrics);
        let mut answer = reply(Some(run), SubmitStatus::Duplicate);
        answer.run_status = Some(status);
        if let Some(to) = reply_to {
            self.answer(to, &answer).await;
        }
        if wait && matches!(source, Source::Api { .. }) {
            return Ok(Answer::WaitFor(run));
        }
        Ok(Answer::Now(Box::new(answer)))
    }

    /// Publishes an answer on a client's `reply_to` (core NATS, best effort: at least once
    /// is achieved by answering again on redelivery).
    async fn answer(&self, to: &str, answer: &SubmitReply) {
        self.store.bus().publish_reply(to, answer, None).await;
    }
}

/// The intake plans bare queries: its planner's task, with memory's advice.
impl crate::admission::Queries for Intake {
    fn planning_plan(&self, query: &str, now_ms: i64) -> Result<Plan, Problem> {
        self.plan_for_query(query, now_ms)
    }

    fn advise<'a>(
        &'a self,
        run: RunId,
        query: &'a str,
        session: Option<flotilla_model::ids::SessionId>,
        planning: Plan,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = crate::admission::QueryPlan> + Send + 'a>>
    {
        Box::pin(self.advised_by_memory(run, query, session, planning))
    }
}

/// Makes a rejection visible: the run record (status `rejected`), the `run_rejected` event
/// and the answer on `reply_to`. Called by the intake right after the rejection is appended,
/// and by the runtime when it meets a rejection (in case the intake stopped in between):
/// whoever creates the record publishes the event and the answer, so they normally go out
/// once. `again` publishes them even if the record exists (a redelivered submission).
pub(crate) async fn record_rejection(
    store: &RunStore,
    metrics: &Metrics,
    run: RunId,
    rejected: &Rejected,
    now_ms: i64,
    again: bool,
) -> Result<(), StoreError> {
    let state = RunState::rejected(
        run,
        rejected.errors.clone(),
        now_ms,
        rejected.name.clone(),
        rejected.labels.clone(),
    );
    let snapshot = SnapshotRef {
        state: &state,
        outbox: &[],
        outbox_seqs: &[],
    };
    match store.create(run, &snapshot).await {
        Ok(_) => RunFinished {
            run,
            status: RunStatus::Rejected,
        }
        .emit(metrics),
        Err(e) if e.kind() == StoreErrorKind::AlreadyExists && !again => return Ok(()),
        Err(e) if e.kind() == StoreErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let bus = store.bus();
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
                rejected
                    .errors
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; "),
            ),
            outcome: state.outcome.clone().map(Box::new),
            problems: rejected.errors.clone(),
            ..WorkflowEvent::phase(WorkflowPhase::RunRejected)
        }),
    };
    if let Err(e) = crate::publish_event(bus, event).await {
        warn!(%run, error = %e, "Could not publish the rejection event");
    }
    if let Some(to) = &rejected.reply_to {
        let mut answer = reply(Some(run), SubmitStatus::Rejected);
        answer.errors = rejected.errors.clone();
        bus.publish_reply(to, &answer, Some(&format!("rejected.{run}")))
            .await;
    }
    Ok(())
}

/// The trace context of a run admitted within `span`: the submission's; else, while spans
/// are exported, that of `span` (the coordinator's span that admits the run becomes the
/// trace's root); else as [`trace_from`].
pub(crate) fn admitted_trace(
    headers: Option<&HeaderMap>,
    run: RunId,
    span: &tracing::Span,
) -> TraceContext {
    header_trace(headers)
        .or_else(|| trace_context::span_context(span))
        .unwrap_or_else(|| trace_from(headers, run))
}
