//! The thin runtime around [`RunMachine`]: reads the run log, applies inputs, stores the
//! state with compare-and-set, then performs the actions.
//!
//! ```text
//! run-log stream ──► router ──(hash of run id)──► shard 0..N ──► per run: load (cache, KV,
//!   submit.<run>, runlog.<run>                                   or replay its first entry)
//!                                                                 apply inputs (pure)
//!                                                                 CAS-write snapshot + outbox
//!                                                                 perform actions (idempotent)
//!                                                                 ack inputs
//! ```
//!
//! **Exactly-once effect.** Inputs are idempotent in the machine. A change is written with
//! compare-and-set before any action is performed, so two coordinators can never both act on
//! the same state: the loser reloads and re-applies. Every action is idempotent to perform
//! (deterministic `Nats-Msg-Id`s, one subject per timer). If a coordinator dies between the
//! write and the acks, the inputs are redelivered; the next coordinator sees that they
//! produced the stored outbox and performs it again — JetStream drops what was already
//! published. An outbox written recently (within half the duplicate window) is also
//! re-performed whenever a coordinator loads a run it did not write, which covers a crash
//! followed by other inputs of the same run arriving first.
//!
//! **A run's start is recorded lazily.** The start step is a pure function of the run's first
//! message (its submission), so its record is not written at once: the start's tasks are
//! dispatched, and its record and events are written with the run's next step — for short
//! tasks, one write and one event message for the whole run — or after
//! `coordinator.start-flush-delay` at the latest. The message that started the run is
//! acknowledged only once the start is recorded, so a coordinator that dies before is
//! replaced within the ack wait, well inside JetStream's duplicate window: a coordinator that
//! finds no record rebuilds the start from the run's first message and performs it again,
//! and JetStream drops what was already published.

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE;
use async_nats::jetstream::{self, AckKind};
use flotilla_bus::{Bus, wire};
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::codec::Codec;
use flotilla_model::event::{Event, EventBatch, EventEnvelope, WorkflowEvent, WorkflowPhase};
use flotilla_model::ids::RunId;
use flotilla_model::run::{FinalResult, RunHandle, RunStatus};
use flotilla_model::runlog::{
    ControlAction, PlanDecision, Planned, Rejected, RunInput, RunLogEntry, Submitted,
};
use flotilla_model::subjects::WORKFLOW_POOL;
use flotilla_model::submit::{SubmitReply, SubmitRequest, SubmitStatus};
use flotilla_model::task::{DependencyResult, TaskEnvelope, TaskError, TaskResult, TraceContext};
use flotilla_model::template::{fill, placeholders};
use flotilla_model::time::Timestamp;
use flotilla_model::validate::{
    MAX_REPORTED_PROBLEMS, Problem, ProblemCode, ValidationContext, prepare_plan, truncate_problems,
};
use flotilla_telemetry::events::{
    CasConflict, DependencyHop, RunFinished, RunSubmitted, TaskDispatched, TaskFinished,
    TaskRetried,
};
use flotilla_telemetry::{InternalEvent, Metrics, spans, trace_context};
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::PULL_HEARTBEAT;
use crate::error::{StoreError, StoreErrorKind};
use crate::live::LiveWorkers;
use crate::machine::{Action, Emission, Input, RunMachine, attempt_id};
use crate::options::CoordinatorOptions;
use crate::store::{FirstMessage, RunStore, SnapshotRef, UnreadableSubmission, unix_ms};

/// The run-log sequences of `inputs` (for debug logs).
fn seqs_of(inputs: &[Decoded]) -> Vec<(u64, i64)> {
    inputs.iter().map(|d| (d.seq, d.delivered)).collect()
}

/// How often a run is reloaded and re-applied after losing compare-and-set races in a row.
const MAX_CAS_ATTEMPTS: usize = 8;

/// A run held in memory by its shard.
struct Cached {
    machine: RunMachine,
    /// KV revision of the record; 0 while the run's start is not recorded yet.
    revision: u64,
    /// Results of succeeded tasks, for building dependents' envelopes.
    results: HashMap<u32, TaskResult>,
    last_used: u64,
    /// The start step, performed but not recorded yet.
    unflushed: Option<Unflushed>,
}

/// What a performed-but-unrecorded start still owes: its record, its events, and the ack of
/// the message that started the run.
struct Unflushed {
    /// The start step's events, published with the next step's (one message) or at the flush.
    events: Vec<Action>,
    /// The message that started the run; acknowledged once the start is recorded.
    msgs: Vec<jetstream::Message>,
}

/// What a run-log-stream message says.
enum Inbound {
    /// A run-log entry (`<prefix>.runlog.<run>`).
    Entry(RunLogEntry),
    /// A durable submission (`<prefix>.submit.<run>`), not yet validated (or not even
    /// decodable); `first` when its publisher made sure it was the run's first message.
    Submission {
        request: Result<Box<SubmitRequest>, Box<UnreadableSubmission>>,
        first: bool,
    },
    /// A submission on `<prefix>.submit.<token>` whose token is not a canonical run id: it is
    /// refused, recorded as a rejected run under the id derived from the token.
    Misaddressed(Box<Rejected>),
    /// A message that cannot be decoded: the run cannot continue, and ends with this reason.
    Unreadable(String),
}

/// A decoded run-log message.
struct Decoded {
    msg: jetstream::Message,
    seq: u64,
    ts_ms: i64,
    /// When the stream stored it (Unix ns, server clock): the start of a dependency hop.
    published_ns: i128,
    delivered: i64,
    inbound: Inbound,
}

/// How a step ended.
enum Stepped {
    /// Done: the inputs can be acknowledged; the run stays cached when `Some`.
    Done(Option<Cached>),
    /// The run started and its start is not recorded yet: the inputs are acknowledged at the
    /// flush, and the run must stay cached.
    Deferred(Cached),
}

/// Why processing a run's inputs stopped.
enum StepError {
    /// Compare-and-set lost: reload and try again.
    Conflict,
    /// Nothing changed against cached state, which may be stale: reload and try again (not a
    /// conflict).
    Stale,
    /// Something failed that may work later (NATS unavailable); the inputs are handed back
    /// for redelivery.
    Failed(String),
    /// Something failed that will fail the same way every time (a message too large for the
    /// deployment): the run is ended with this reason instead of retrying forever.
    Terminal(String),
}

impl From<StoreError> for StepError {
    fn from(e: StoreError) -> Self {
        match e.kind() {
            StoreErrorKind::Conflict | StoreErrorKind::AlreadyExists => Self::Conflict,
            StoreErrorKind::TooLarge | StoreErrorKind::Decode => Self::Terminal(e.to_string()),
            _ => Self::Failed(e.to_string()),
        }
    }
}

impl From<flotilla_bus::PublishError> for StepError {
    fn from(e: flotilla_bus::PublishError) -> Self {
        match e.kind() {
            // A stream the deployment has can be briefly unknown while a cluster elects its
            // leader (a node was killed): the step is retried, the run never ends on it. A
            // stream that is really gone stops every run alike, visibly, in the logs.
            flotilla_bus::PublishErrorKind::NoStream => Self::Failed(e.to_string()),
            kind => match kind.retry() {
                flotilla_bus::Retry::Terminal => Self::Terminal(e.to_string()),
                flotilla_bus::Retry::Retryable => Self::Failed(e.to_string()),
            },
        }
    }
}

/// Applies run-log inputs.
pub(crate) struct Runtime {
    store: RunStore,
    bus: Bus,
    opts: CoordinatorOptions,
    ctx: ValidationContext,
    live: LiveWorkers,
    duplicate_window_ms: i64,
    /// `<prefix>.submit.`: messages on it are durable submissions.
    submit_prefix: String,
    metrics: Metrics,
    /// The `agent` label of tasks that name none.
    default_agent: String,
    /// Parents' facts and tree counts, for admitting child runs.
    lineages: Arc<crate::lineage::Lineages>,
}

impl Runtime {
    pub(crate) fn new(
        store: RunStore,
        bus: Bus,
        opts: CoordinatorOptions,
        ctx: ValidationContext,
        live: LiveWorkers,
        duplicate_window: Duration,
        metrics: Metrics,
    ) -> Self {
        let submit_prefix = format!("{}.submit.", bus.names().prefix());
        let default_agent = ctx
            .agents
            .as_ref()
            .and_then(|a| a.default.clone())
            .unwrap_or_else(|| "default".into());
        let lineages = Arc::new(crate::lineage::Lineages::new(
            store.clone(),
            crate::lineage::TreeLimits::of(&opts),
        ));
        Self {
            metrics,
            default_agent,
            lineages,
            store,
            bus,
            opts,
            ctx,
            live,
            duplicate_window_ms: duplicate_window.as_millis() as i64,
            submit_prefix,
        }
    }

    /// Consumes the run-log stream until `shutdown`.
    pub(crate) async fn run(
        self: Arc<Self>,
        consumer: jetstream::consumer::PullConsumer,
        shutdown: CancellationToken,
    ) {
        let mut lanes = Vec::with_capacity(self.opts.shards);
        let mut tasks = Vec::with_capacity(self.opts.shards);
        for _ in 0..self.opts.shards {
            let (tx, rx) = mpsc::channel::<(RunId, jetstream::Message)>(self.opts.batch * 4);
            lanes.push(tx);
            tasks.push(tokio::spawn(Arc::clone(&self).shard(rx)));
        }
        'outer: while !shutdown.is_cancelled() {
            let stream = consumer
                .stream()
                .max_messages_per_batch(self.opts.batch)
                .heartbeat(PULL_HEARTBEAT)
                .messages()
                .await;
            let mut messages = match stream {
                // A lost pull request (its consumer's leader died) ends the stream: pull again.
                Ok(m) => Box::pin(flotilla_bus::consume::until_stalled(m)),
                Err(e) => {
                    warn!(error = %e, "Cannot pull from the run log; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => break 'outer,
                        _ = tokio::time::sleep(Duration::from_millis(500)) => continue,
                    }
                }
            };
            loop {
                let next = tokio::select! {
                    _ = shutdown.cancelled() => break 'outer,
                    next = messages.next() => next,
                };
                match next {
                    Some(Ok(msg)) => {
                        // `<prefix>.runlog.<run>` or `<prefix>.submit.<run>`: the run is the
                        // last token, spelled canonically (one run, one subject).
                        let token = msg.subject.rsplit('.').next().unwrap_or_default();
                        let run = match canonical_run_id(token) {
                            Some(run) => run,
                            // A submission on a subject that is not a run's: refused visibly,
                            // as a rejected run under an id derived from the token.
                            None if msg.subject.starts_with(self.submit_prefix.as_str()) => {
                                misaddressed_run_id(token)
                            }
                            None => {
                                warn!(subject = %msg.subject, "Run-log message on a subject that names no run; dropping");
                                let _ = msg.ack_with(AckKind::Term).await;
                                continue;
                            }
                        };
                        let lane = shard_of(run, lanes.len());
                        if lanes[lane].send((run, msg)).await.is_err() {
                            break 'outer;
                        }
                    }
                    Some(Err(e)) => {
                        debug!(error = %e, "Run-log pull interrupted");
                        if matches!(
                            e.kind(),
                            jetstream::consumer::pull::MessagesErrorKind::ConsumerDeleted
                                | jetstream::consumer::pull::MessagesErrorKind::NoResponders
                        ) {
                            break;
                        }
                    }
                    None => break,
                }
            }
        }
        drop(lanes);
        for t in tasks {
            let _ = t.await;
        }
    }

    async fn shard(self: Arc<Self>, mut rx: mpsc::Receiver<(RunId, jetstream::Message)>) {
        let mut cache: HashMap<RunId, Cached> = HashMap::new();
        // Runs whose start is not recorded, oldest first (the delay is constant, so this is
        // also the order they fall due).
        let mut due: VecDeque<(tokio::time::Instant, RunId)> = VecDeque::new();
        let mut tick: u64 = 0;
        let per_shard_cap = (self.opts.cache_runs / self.opts.shards).max(16);
        loop {
            let next_due = due.front().map(|(at, _)| *at);
            let first = tokio::select! {
                m = rx.recv() => m,
                _ = sleep_until(next_due) => {
                    let now = tokio::time::Instant::now();
                    while due.front().is_some_and(|(at, _)| *at <= now) {
                        let Some((_, run)) = due.pop_front() else { break };
                        if let Some(entry) = cache.remove(&run)
                            && let Some(entry) = self.flush(run, entry).await
                        {
                            cache.insert(run, entry);
                        }
                    }
                    continue;
                }
            };
            let Some(first) = first else { break };
            let mut batch = vec![first];
            while batch.len() < self.opts.batch {
                match rx.try_recv() {
                    Ok(m) => batch.push(m),
                    Err(_) => break,
                }
            }
            // Group by run, keeping each run's inputs in arrival order.
            let mut order: Vec<RunId> = Vec::new();
            let mut groups: HashMap<RunId, Vec<jetstream::Message>> = HashMap::new();
            for (run, msg) in batch {
                groups
                    .entry(run)
                    .or_insert_with(|| {
                        order.push(run);
                        Vec::new()
                    })
                    .push(msg);
            }
            let work = order.into_iter().filter_map(|run| {
                let msgs = groups.remove(&run)?;
                let cached = cache.remove(&run);
                let this = Arc::clone(&self);
                // Boxed: a run's processing is a large future, and the batch collects many.
                Some(Box::pin(async move {
                    (run, this.process(run, cached, msgs).await)
                }))
            });
            let delay = self.opts.start_flush_delay;
            for (run, entry) in futures::future::join_all(work).await {
                if let Some(mut e) = entry {
                    tick += 1;
                    e.last_used = tick;
                    if e.unflushed.is_some() && e.revision == 0 {
                        due.push_back((tokio::time::Instant::now() + delay, run));
                    }
                    cache.insert(run, e);
                }
            }
            if cache.len() > per_shard_cap {
                // Drop the least recently used tenth (never a run whose start is unrecorded).
                let mut ages: Vec<(u64, RunId)> = cache
                    .iter()
                    .filter(|(_, c)| c.unflushed.is_none())
                    .map(|(r, c)| (c.last_used, *r))
                    .collect();
                ages.sort_unstable();
                for (_, r) in ages.into_iter().take(per_shard_cap / 10 + 1) {
                    cache.remove(&r);
                }
            }
        }
        // Stopping: record every start still owed.
        for (run, entry) in cache.drain() {
            if entry.unflushed.is_some() {
                self.flush(run, entry).await;
            }
        }
    }

    /// Records a run's start (its record, then its events) and acknowledges the message that
    /// started it. Returns the entry to keep cached.
    async fn flush(&self, run: RunId, mut entry: Cached) -> Option<Cached> {
        let Some(unflushed) = entry.unflushed.take() else {
            return Some(entry);
        };
        // The messages that started the run produced this outbox: if its events cannot be
        // published now, their redelivery finds the record and publishes them.
        let seqs: Vec<u64> = unflushed
            .msgs
            .iter()
            .filter_map(|m| m.info().ok().map(|i| i.stream_sequence))
            .collect();
        let snapshot = SnapshotRef {
            state: entry.machine.state(),
            outbox: &unflushed.events,
            outbox_seqs: &seqs,
        };
        match self.store.create(run, &snapshot).await {
            Ok(revision) => entry.revision = revision,
            Err(e) if e.kind() == StoreErrorKind::AlreadyExists => {
                // Another coordinator rebuilt and recorded the start (and performed it again):
                // its record covers this message. Forget the cached copy.
                debug!(%run, seqs = ?seqs, "Start recorded elsewhere; acknowledging its inputs");
                for m in &unflushed.msgs {
                    let _ = m.ack().await;
                }
                return None;
            }
            Err(e) => {
                // Handed back to the consumer: its redelivery finds the run cached (or
                // rebuilds it) and records the start then.
                warn!(%run, error = %e, "Cannot record a run's start yet; retrying soon");
                for m in &unflushed.msgs {
                    let _ = m
                        .ack_with(AckKind::Nak(Some(Duration::from_millis(500))))
                        .await;
                }
                entry.unflushed = Some(Unflushed {
                    events: unflushed.events,
                    msgs: Vec::new(),
                });
                return Some(entry);
            }
        }
        if let Err(e) = self
            .perform(
                &mut entry,
                &unflushed.events,
                &tracing::Span::none(),
                Replies::Send,
            )
            .await
        {
            let reason = match e {
                StepError::Failed(r) | StepError::Terminal(r) => r,
                StepError::Conflict | StepError::Stale => "conflict".into(),
            };
            // The record's outbox holds the events: a redelivery re-performs them.
            warn!(%run, %reason, "Publishing a run's start events failed; they will be re-published");
            for m in &unflushed.msgs {
                let _ = m
                    .ack_with(AckKind::Nak(Some(Duration::from_millis(250))))
                    .await;
            }
            return Some(entry);
        }
        for m in &unflushed.msgs {
            let _ = m.ack().await;
        }
        Some(entry)
    }

    /// Applies one run's inputs; acks them when done, hands them back on failure.
    async fn process(
        &self,
        run: RunId,
        mut cached: Option<Cached>,
        msgs: Vec<jetstream::Message>,
    ) -> Option<Cached> {
        let mut inputs = Vec::with_capacity(msgs.len());
        for msg in msgs {
            let info = match msg.info() {
                Ok(i) => (
                    i.stream_sequence,
                    unix_ms(i.published),
                    i.delivered,
                    i.published.unix_timestamp_nanos(),
                ),
                Err(e) => {
                    warn!(error = %e, "Run-log message without JetStream metadata; dropping");
                    continue;
                }
            };
            let on_submit_subject = msg.subject.starts_with(self.submit_prefix.as_str());
            let client_submission = on_submit_subject
                && wire::header(msg.headers.as_ref(), wire::KIND_HEADER)
                    != Some(wire::KIND_RUNLOG_ENTRY);
            let token = msg.subject.rsplit('.').next().unwrap_or_default();
            let inbound = if on_submit_subject && canonical_run_id(token).is_none() {
                let request = wire::decode::<SubmitRequest>(msg.headers.as_ref(), &msg.payload);
                let (reply_to, name, labels) = match request {
                    Ok(r) => (r.reply_to.clone(), r.plan_name(), r.labels),
                    Err(_) => (
                        crate::intake::loose_fields(msg.headers.as_ref(), &msg.payload, None)
                            .reply_to,
                        None,
                        Default::default(),
                    ),
                };
                Inbound::Misaddressed(Box::new(Rejected {
                    errors: vec![misaddressed_problem(token)],
                    name,
                    labels,
                    reply_to: reply_to.filter(|s| flotilla_model::token::check_subject(s).is_ok()),
                    intake_seq: None,
                }))
            } else if client_submission {
                // Stored with "expected last subject sequence 0" on the run's submission
                // subject, where every first message goes: it is the run's first.
                let first = wire::header(
                    msg.headers.as_ref(),
                    NATS_EXPECTED_LAST_SUBJECT_SEQUENCE.as_ref(),
                ) == Some("0");
                let request = wire::decode::<SubmitRequest>(msg.headers.as_ref(), &msg.payload)
                    .map(Box::new)
                    .map_err(|_| {
                        Box::new(UnreadableSubmission::of(msg.headers.as_ref(), &msg.payload))
                    });
                Inbound::Submission { request, first }
            } else {
                match wire::decode::<RunLogEntry>(msg.headers.as_ref(), &msg.payload) {
                    Ok(entry) if entry.run_id == run => Inbound::Entry(entry),
                    Ok(_) => {
                        warn!(%run, seq = info.0, "Run-log entry names another run; dropping");
                        let _ = msg.ack_with(AckKind::Term).await;
                        continue;
                    }
                    Err(e) => {
                        // Bytes do not change: this entry will never be readable. End the run
                        // visibly instead of stalling it.
                        warn!(%run, seq = info.0, error = %e, "Unreadable run-log entry; the run cannot continue");
                        Inbound::Unreadable(format!(
                            "run-log entry {} could not be read: {e}",
                            info.0
                        ))
                    }
                }
            };
            inputs.push(Decoded {
                seq: info.0,
                ts_ms: info.1,
                published_ns: info.3,
                delivered: info.2,
                inbound,
                msg,
            });
        }
        if inputs.is_empty() {
            return cached;
        }
        // In the run log's order: a redelivered message (a submission whose start another
        // coordinator has not recorded yet) can arrive after later ones, and an input is
        // applied only once the run it belongs to has started.
        inputs.sort_by_key(|d| d.seq);
        // Messages of a start recorded by this step are acknowledged with its inputs.
        let mut owed: Vec<jetstream::Message> = cached
            .as_mut()
            .and_then(|c| c.unflushed.as_mut())
            .map(|u| std::mem::take(&mut u.msgs))
            .unwrap_or_default();
        // Set once a step changed nothing on a copy that may be stale: the next reads the run
        // from the leader.
        let mut from_leader = false;
        for _ in 0..MAX_CAS_ATTEMPTS {
            // Boxed: the step is a large future; moving it costs more than allocating it.
            match Box::pin(self.step(run, cached.take(), &inputs, None, from_leader)).await {
                Ok(Stepped::Done(entry)) => {
                    debug!(%run, seqs = ?seqs_of(&inputs), owed = owed.len(), "Inputs applied; acknowledging");
                    self.ack_all(run, &inputs).await;
                    for m in &owed {
                        let _ = m.ack().await;
                    }
                    return entry;
                }
                Ok(Stepped::Deferred(mut entry)) => {
                    debug!(%run, seqs = ?seqs_of(&inputs), "Start performed; its inputs are acknowledged once it is recorded");
                    // The start is owed: these messages are acknowledged when it is recorded.
                    if let Some(u) = entry.unflushed.as_mut() {
                        u.msgs.extend(inputs.into_iter().map(|d| d.msg));
                        u.msgs.append(&mut owed);
                    }
                    return Some(entry);
                }
                Err(StepError::Conflict) => CasConflict { run }.emit(&self.metrics),
                Err(StepError::Stale) => {
                    debug!(%run, "The run's copy may be stale; reading it from the leader");
                    from_leader = true;
                }
                Err(StepError::Failed(reason)) => {
                    warn!(%run, %reason, "Applying run-log inputs failed; they will be redelivered");
                    break;
                }
                Err(StepError::Terminal(reason)) => {
                    // Retrying would fail the same way: end the run with the reason.
                    warn!(%run, %reason, "Applying run-log inputs failed for good; ending the run");
                    for _ in 0..MAX_CAS_ATTEMPTS {
                        match Box::pin(self.step(run, None, &inputs, Some(&reason), true)).await {
                            Ok(_) => {
                                self.ack_all(run, &inputs).await;
                                for m in &owed {
                                    let _ = m.ack().await;
                                }
                                return None;
                            }
                            Err(StepError::Conflict | StepError::Stale) => continue,
                            Err(StepError::Failed(r)) => {
                                warn!(%run, reason = %r, "Ending the run failed; the inputs will be redelivered");
                                break;
                            }
                            Err(StepError::Terminal(r)) => {
                                tracing::error!(%run, reason = %r, "The run cannot even be ended; setting its inputs aside");
                                for d in &inputs {
                                    let _ = d.msg.ack_with(AckKind::Term).await;
                                }
                                return None;
                            }
                        }
                    }
                    break;
                }
            }
        }
        // Handed back with a delay that grows with each delivery (250 ms doubling to 5 s), so
        // a fault that lasts (a leader election, NATS restarting) is retried without a storm.
        for d in &inputs {
            let _ = d
                .msg
                .ack_with(AckKind::Nak(Some(redelivery_delay(d.delivered))))
                .await;
        }
        for m in &owed {
            let _ = m
                .ack_with(AckKind::Nak(Some(Duration::from_millis(250))))
                .await;
        }
        None
    }

    async fn ack_all(&self, run: RunId, inputs: &[Decoded]) {
        for d in inputs {
            if let Err(e) = d.msg.ack().await {
                debug!(%run, error = %e, "Ack failed; the input will be redelivered and ignored");
            }
        }
    }

    /// A run that is neither cached nor recorded: rebuilt from its first message (a start
    /// that was performed but not yet recorded), with the start's actions to perform again.
    /// `None` when the run has no first message, when the first message is among `inputs`
    /// (the run starts now), or when it is a client's submission that turns out invalid: a
    /// client's own submission is validated again, exactly as its coordinator validated it,
    /// so no coordinator ever starts a run that another rejected (or is rejecting).
    async fn replay(
        &self,
        run: RunId,
        inputs: &[Decoded],
    ) -> Result<Option<(Cached, Vec<Action>)>, StepError> {
        let first = match self.store.first_message(run).await {
            Ok(f) => f,
            Err(e) if e.kind() == StoreErrorKind::Decode => {
                return Err(StepError::Terminal(e.to_string()));
            }
            Err(e) => return Err(e.into()),
        };
        let Some(first) = first else { return Ok(None) };
        if inputs.iter().any(|d| d.seq == first.seq) {
            return Ok(None);
        }
        let submitted = match first.content {
            FirstMessage::Submission { request, trace } => {
                match self.verdict(run, Ok(&request), trace).await? {
                    Ok(submitted) => submitted,
                    Err(rejected) => {
                        self.reject(run, &rejected, first.ts_ms).await?;
                        return Ok(None);
                    }
                }
            }
            FirstMessage::Unreadable(unreadable) => {
                self.reject(run, &self.rejection_of(run, &unreadable), first.ts_ms)
                    .await?;
                return Ok(None);
            }
            FirstMessage::Entry(RunLogEntry {
                input: RunInput::Submitted(s),
                ..
            }) => *s,
            FirstMessage::Entry(RunLogEntry {
                input: RunInput::Rejected(r),
                ..
            }) => {
                crate::intake::record_rejection(
                    &self.store,
                    &self.metrics,
                    run,
                    &r,
                    first.ts_ms,
                    false,
                )
                .await?;
                return Ok(None);
            }
            FirstMessage::Entry(_) => {
                return Err(StepError::Terminal(format!(
                    "the run log of {run} does not start with its submission"
                )));
            }
        };
        debug!(%run, "Rebuilding an unrecorded start from the run's first message");
        let plan = Arc::new(submitted.plan.clone());
        let (mut machine, actions) = RunMachine::start(run, &submitted, plan, first.ts_ms);
        machine.set_first_seq(first.seq);
        Ok(Some((
            Cached {
                machine,
                revision: 0,
                results: HashMap::new(),
                last_used: 0,
                unflushed: None,
            },
            actions,
        )))
    }

    /// The verdict on a client's own submission (the first message of its run): the run as
    /// accepted, or its rejection with every problem. Pure but for reading the parent of a
    /// child run, so every coordinator reaches the same verdict on the same submission.
    async fn verdict(
        &self,
        run: RunId,
        submission: Result<&SubmitRequest, &UnreadableSubmission>,
        trace: TraceContext,
    ) -> Result<Result<Submitted, Rejected>, StepError> {
        let request = match submission {
            Ok(r) => r,
            Err(unreadable) => return Ok(Err(self.rejection_of(run, unreadable))),
        };
        let mut errors = Vec::new();
        let reply_to = match &request.reply_to {
            Some(s) => match flotilla_model::token::check_subject(s) {
                Ok(()) => Some(s.clone()),
                Err(e) => {
                    errors.push(Problem::new(
                        ProblemCode::InvalidReplyTo,
                        "reply_to",
                        format!("reply_to {s:?} {e}"),
                    ));
                    None
                }
            },
            None => None,
        };
        if let Err(e) = flotilla_model::codec::check_protocol(request.protocol) {
            errors.push(e.to_problem());
        }
        if let Some(parent) = &request.parent {
            errors.extend(flotilla_model::validate::check_parent(parent, run));
        }
        if let Some(named) = request.run_id.filter(|named| *named != run) {
            errors.push(Problem::new(
                ProblemCode::RunIdMismatch,
                "run_id",
                format!("the submission was published for run {run} but names run {named}"),
            ));
        }
        if request.idempotency_key.is_some() {
            errors.push(Problem::new(
                ProblemCode::MisplacedIdempotencyKey,
                "idempotency_key",
                format!(
                    "a submission on {}.submit.<run> is identified by its run id; publish submissions with an idempotency_key to {}",
                    self.bus.names().prefix(),
                    self.bus.names().submit()
                ),
            ));
        }
        let prepared = match request.form() {
            Ok(flotilla_model::submit::SubmitForm::Plan(plan)) => prepare_plan(plan, &self.ctx),
            // A bare query's planning plan is fixed at admission and stored in the run's
            // first entry; a client-written first message cannot carry it.
            Ok(flotilla_model::submit::SubmitForm::Query(_)) => Err(
                flotilla_model::validate::ValidationReport::single(Problem::new(
                    ProblemCode::QueryOnRunSubject,
                    "query",
                    format!(
                        "a bare query cannot be the first message of {}.submit.<run>; publish it to {} or send it to the submit endpoint",
                        self.bus.names().prefix(),
                        self.bus.names().submit()
                    ),
                )),
            ),
            Err(problem) => Err(flotilla_model::validate::ValidationReport::single(problem)),
        };
        let (plan, warnings) = match prepared {
            Ok(p) => p,
            Err(report) => {
                errors.extend(report.errors);
                (flotilla_model::Plan::empty(), Vec::new())
            }
        };
        // The run's place in its tree (depth, budgets, session): a parent that names no run
        // refuses it, as an invalid plan does.
        let lineage = if errors.is_empty() {
            match self
                .lineages
                .lineage(
                    run,
                    request.parent.as_ref(),
                    request.session_id,
                    plan.config.budget(),
                )
                .await?
            {
                Ok(l) => l,
                Err(problem) => {
                    errors.push(problem);
                    crate::lineage::Lineage::default()
                }
            }
        } else {
            crate::lineage::Lineage::default()
        };
        if !errors.is_empty() {
            return Ok(Err(Rejected {
                errors: truncate_problems(errors, MAX_REPORTED_PROBLEMS),
                name: request.plan_name(),
                labels: request.labels.clone(),
                reply_to,
                intake_seq: None,
            }));
        }
        let mut submitted = submitted_of(request, plan, warnings, trace);
        submitted.session_id = lineage.session_id;
        submitted.depth = lineage.depth;
        submitted.budget_scopes = lineage.budget_scopes;
        Ok(Ok(submitted))
    }

    /// The rejection of a submission that cannot be decoded: every problem of it at once
    /// (fields of the wrong type, unknown or missing, then what validation finds in the rest).
    fn rejection_of(&self, run: RunId, unreadable: &UnreadableSubmission) -> Rejected {
        Rejected {
            errors: flotilla_model::submit::decode_problems(
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
    async fn reject(&self, run: RunId, rejected: &Rejected, now_ms: i64) -> Result<(), StepError> {
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
    async fn refuse_misaddressed(
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
    async fn admit(
        &self,
        run: RunId,
        request: Result<&SubmitRequest, &UnreadableSubmission>,
        d: &Decoded,
        span: &tracing::Span,
    ) -> Result<Option<Submitted>, StepError> {
        let trace = crate::intake::admitted_trace(d.msg.headers.as_ref(), run, span);
        let mut verdict = self.verdict(run, request, trace).await?;
        if let Ok(submitted) = &verdict {
            let lineage = crate::lineage::Lineage {
                tree: submitted.parent.as_ref().map(RunHandle::root_run),
                ..Default::default()
            };
            if let Err(problem) = self.lineages.enter(&lineage).await? {
                verdict = Err(Rejected {
                    errors: vec![problem],
                    name: submitted.plan.name.clone(),
                    labels: submitted.labels.clone(),
                    reply_to: submitted.reply_to.clone(),
                    intake_seq: None,
                });
            }
        }
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
        let pools: std::collections::BTreeSet<&str> = submitted
            .plan
            .subtasks
            .iter()
            .map(|t| t.pool.as_str())
            .collect();
        if let Some(missing) = self.live.pools_without_workers(pools, d.ts_ms) {
            submitted.warnings.extend(missing.into_iter().map(|pool| {
                Problem::new(
                    ProblemCode::NoLiveWorker,
                    "subtasks",
                    format!("no live worker serves pool {pool:?}: its tasks wait until one starts"),
                )
            }));
        }
        self.lineages.admitted(run, &submitted);
        info!(%run, "Plan accepted");
        Ok(Some(submitted))
    }

    /// Applies `inputs` to the run and performs the resulting actions. With `abort`, the run
    /// is ended with that reason instead (after a terminal failure). `from_leader` reads the
    /// run from the bucket's leader rather than any replica: inputs that change nothing are
    /// acknowledged only against that copy ([`StepError::Stale`] otherwise).
    async fn step(
        &self,
        run: RunId,
        cached: Option<Cached>,
        inputs: &[Decoded],
        abort: Option<&str>,
        from_leader: bool,
    ) -> Result<Stepped, StepError> {
        let now_ms = inputs.iter().map(|d| d.ts_ms).max().unwrap_or_default();
        // Submissions on a subject that names no run: refused under the derived id.
        if inputs
            .iter()
            .any(|d| matches!(d.inbound, Inbound::Misaddressed(_)))
        {
            for d in inputs {
                if let Inbound::Misaddressed(rejected) = &d.inbound {
                    self.refuse_misaddressed(run, rejected, d.ts_ms).await?;
                }
            }
            return Ok(Stepped::Done(None));
        }
        let mut reperform = Vec::new();
        // Started below as a child of the run's trace (or, for a run admitted now without a
        // client trace, as its root).
        let span = spans::step(run, inputs.len());
        // Dispatches made ready by a result: (task, when the result was stored).
        let mut hops: Vec<(u32, i128)> = Vec::new();
        let mut admitted = false;
        // A run's first message, delivered for the first time, starts a run nobody has seen:
        // there is nothing to load (its record is written only after this step).
        let fresh_start = inputs.first().is_some_and(|d| {
            d.delivered == 1
                && match &d.inbound {
                    Inbound::Submission { first, .. } => *first,
                    Inbound::Entry(RunLogEntry {
                        input: RunInput::Submitted(_),
                        ..
                    }) => d.msg.subject.starts_with(self.submit_prefix.as_str()),
                    _ => false,
                }
        });
        let mut entry = match cached {
            Some(c) => Some(c),
            None if fresh_start => None,
            None => match Box::pin(async {
                if from_leader {
                    self.store.load_from_leader(run).await
                } else {
                    self.store.load(run).await
                }
            })
            .await?
            {
                None => match Box::pin(self.replay(run, inputs)).await? {
                    Some((entry, start)) => {
                        reperform = start;
                        Some(entry)
                    }
                    None => None,
                },
                Some(stored) => {
                    let state = stored.snapshot.state;
                    if state.tasks.is_empty() {
                        // Rejected, or ended before it could start: nothing more to apply.
                        for d in inputs {
                            if let Inbound::Submission { request, .. } = &d.inbound
                                && state.first_seq != d.seq
                            {
                                self.answer_duplicate(run, reply_to_of(request), state.status)
                                    .await;
                            }
                        }
                        return Ok(Stepped::Done(None));
                    }
                    let plan = match self.store.plan_of(run, state.plan_seq).await {
                        Ok(Some(plan)) => plan,
                        Ok(None) => {
                            return Err(StepError::Failed(format!(
                                "run {run} has a snapshot but no submission in its run log"
                            )));
                        }
                        Err(e) if e.kind() == StoreErrorKind::Decode => {
                            return Err(StepError::Terminal(e.to_string()));
                        }
                        Err(e) => return Err(e.into()),
                    };
                    let mut loaded = Cached {
                        machine: RunMachine::restore(Arc::new(plan), state),
                        revision: stored.revision,
                        results: HashMap::new(),
                        last_used: 0,
                        unflushed: None,
                    };
                    // The stored outbox may not have been performed: its writer may have died
                    // after the write (its inputs come back), or other inputs of the run may
                    // arrive first (a recent write). It is performed again now, as it was —
                    // the same messages under the same ids, which JetStream drops — and before
                    // anything new, so the next record's outbox holds only the next step's
                    // actions: a step's events are never carried into later steps' messages.
                    // The answers to waiting submitters go out again only when the inputs
                    // that decided the end come back (their coordinator may have died before
                    // answering): a late input of an ended run never repeats the answer.
                    let produced_by_these = inputs
                        .iter()
                        .any(|d| d.delivered > 1 && stored.snapshot.outbox_seqs.contains(&d.seq));
                    let recent = now_ms - stored.written_ms < self.duplicate_window_ms / 2;
                    if produced_by_these || recent {
                        let outbox: Vec<Action> = stored
                            .snapshot
                            .outbox
                            .into_iter()
                            .filter(|a| still_relevant(a, &loaded.machine))
                            .collect();
                        if !outbox.is_empty() {
                            let replies = if produced_by_these {
                                Replies::Send
                            } else {
                                Replies::Skip
                            };
                            Box::pin(self.perform(&mut loaded, &outbox, &span, replies)).await?;
                        }
                    }
                    Some(loaded)
                }
            },
        };
        let applied_before = entry.as_ref().map(|e| e.machine.state().applied);
        let mut started = false;
        let mut actions = Vec::new();
        for d in inputs {
            let input = match &d.inbound {
                Inbound::Entry(e) => &e.input,
                Inbound::Misaddressed(_) => continue,
                Inbound::Submission { request, first } => {
                    if let Some(e) = &entry {
                        if e.machine.state().first_seq != d.seq {
                            let status = e.machine.state().status;
                            self.answer_duplicate(run, reply_to_of(request), status)
                                .await;
                        }
                        continue;
                    }
                    if !first && !self.is_first(run, d.seq).await? {
                        // A second submission of the run whose first message is elsewhere.
                        self.answer_duplicate(run, reply_to_of(request), RunStatus::Pending)
                            .await;
                        continue;
                    }
                    let request = request.as_deref().map_err(|e| &**e);
                    let Some(submitted) = Box::pin(self.admit(run, request, d, &span)).await?
                    else {
                        return Ok(Stepped::Done(None));
                    };
                    admitted = true;
                    let mut submitted = submitted;
                    let plan = Arc::new(std::mem::replace(
                        &mut submitted.plan,
                        flotilla_model::Plan {
                            name: None,
                            query: None,
                            subtasks: Vec::new(),
                            config: Default::default(),
                        },
                    ));
                    let (mut machine, a) = RunMachine::start(run, &submitted, plan, d.ts_ms);
                    machine.set_first_seq(d.seq);
                    info!(%run, tasks = machine.plan().subtasks.len(), "Run started");
                    entry = Some(Cached {
                        machine,
                        revision: 0,
                        results: HashMap::new(),
                        last_used: 0,
                        unflushed: None,
                    });
                    started = true;
                    actions.extend(a);
                    continue;
                }
                Inbound::Unreadable(reason) => {
                    match entry.as_mut() {
                        Some(e) => {
                            actions.extend(e.machine.apply(Input::Abort { reason }, d.ts_ms))
                        }
                        None => {
                            Box::pin(self.record_unstartable(run, reason, d.ts_ms)).await?;
                            return Ok(Stepped::Done(None));
                        }
                    }
                    continue;
                }
            };
            match input {
                RunInput::Rejected(r) => match entry.as_mut() {
                    None => {
                        // The intake records its rejections; this covers an intake that
                        // stopped between the append and the record.
                        crate::intake::record_rejection(
                            &self.store,
                            &self.metrics,
                            run,
                            r,
                            d.ts_ms,
                            false,
                        )
                        .await?;
                        return Ok(Stepped::Done(None));
                    }
                    Some(e) => {
                        // A coordinator rejected the run's submission after another started
                        // it (their configurations differ): the run log says rejected, so
                        // the run stops.
                        let reason = format!(
                            "rejected: {}",
                            r.errors
                                .iter()
                                .map(ToString::to_string)
                                .collect::<Vec<_>>()
                                .join("; ")
                        );
                        warn!(%run, %reason, "A started run's submission was rejected; stopping it");
                        actions.extend(e.machine.apply(Input::Abort { reason: &reason }, d.ts_ms));
                    }
                },
                RunInput::TopicWritten { topic, .. } => {
                    let Some(e) = entry.as_mut() else { continue };
                    actions.extend(e.machine.apply(Input::TopicWritten { topic }, d.ts_ms));
                }
                RunInput::Control(c) => {
                    let Some(e) = entry.as_mut() else { continue };
                    match c.action {
                        ControlAction::Cancel => {
                            let reason = c.reason.as_deref().unwrap_or_default();
                            info!(%run, reason, by = c.by.as_deref().unwrap_or("-"), "Cancelling the run");
                            actions.extend(e.machine.apply(Input::Cancel { reason }, d.ts_ms));
                        }
                    }
                }
                RunInput::Submitted(s) => {
                    if entry.is_none() {
                        let (mut machine, a) =
                            RunMachine::start(run, s, Arc::new(s.plan.clone()), d.ts_ms);
                        machine.set_first_seq(d.seq);
                        info!(%run, tasks = s.plan.subtasks.len(), "Run started");
                        entry = Some(Cached {
                            machine,
                            revision: 0,
                            results: HashMap::new(),
                            last_used: 0,
                            unflushed: None,
                        });
                        started = true;
                        actions.extend(a);
                    }
                }
                RunInput::TaskResult(r) => {
                    let Some(e) = entry.as_mut() else { continue };
                    let input = Input::Result {
                        task: &r.task_id,
                        attempt: r.attempt,
                        result: &r.result,
                        seq: d.seq,
                        worker: Some(&r.worker),
                        started_at: r.started_at,
                    };
                    let a = e.machine.apply(input, d.ts_ms);
                    hops.extend(a.iter().filter_map(|a| match a {
                        Action::Dispatch { task, attempt: 1 } => Some((*task, d.published_ns)),
                        _ => None,
                    }));
                    if !a.is_empty()
                        && r.result.success
                        && let Some(i) = e.machine.graph().index_of(&r.task_id)
                    {
                        e.results.insert(i, r.result.clone());
                    }
                    actions.extend(a);
                }
                RunInput::Planned(p) => {
                    let Some(e) = entry.as_mut() else { continue };
                    let a = e.machine.apply(
                        Input::Planned {
                            round: p.round,
                            decision: &p.decision,
                            seq: d.seq,
                        },
                        d.ts_ms,
                    );
                    if !a.is_empty() {
                        // Task indices now name the new plan's tasks.
                        e.results.clear();
                        info!(%run, round = p.round, decision = p.decision.as_str(), tasks = e.machine.plan().subtasks.len(), "Planner answer reviewed");
                    }
                    actions.extend(a);
                }
                RunInput::TimerFired { generation } => {
                    let Some(e) = entry.as_mut() else { continue };
                    actions.extend(e.machine.apply(
                        Input::Timer {
                            generation: *generation,
                        },
                        d.ts_ms,
                    ));
                }
            }
        }
        let Some(mut entry) = entry else {
            if inputs
                .iter()
                .all(|d| matches!(d.inbound, Inbound::Submission { .. }))
            {
                return Ok(Stepped::Done(None));
            }
            if !from_leader {
                // Any replica answered "no record": the leader may know better.
                return Err(StepError::Stale);
            }
            warn!(%run, "Run-log input for a run that does not exist; dropping");
            return Ok(Stepped::Done(None));
        };
        if let Some(reason) = abort {
            actions.extend(entry.machine.apply(Input::Abort { reason }, now_ms));
        }
        trace_context::set_parent(&span, entry.machine.state().trace.as_ref());
        let unrecorded = entry.revision == 0;
        let changed =
            started || unrecorded || applied_before != Some(entry.machine.state().applied);
        if !changed && !from_leader {
            // A no-op is only trustworthy against the current state: another coordinator may
            // have moved the run on since it was cached, and a direct get may be answered by
            // a replica still catching up (a cluster node back from a crash) — a result then
            // looks stale to an old state. Without a write there is no compare-and-set to
            // catch that, so confirm against the leader's copy before acknowledging.
            return Err(StepError::Stale);
        }
        // The start alone changed the run: perform it now, record it later. Only when the
        // step holds nothing but the start's messages: they are acknowledged once the start
        // is recorded — by this coordinator or, found already recorded, by another — so an
        // input that changed nothing here (a result for a later task, seen against a start
        // rebuilt from a stale read) must go the way of every input, through the record.
        let only_start = started
            && inputs.iter().all(|d| match &d.inbound {
                Inbound::Submission { .. } => true,
                Inbound::Entry(e) => matches!(e.input, RunInput::Submitted(_)),
                _ => false,
            })
            && applied_before.is_none()
            && entry.machine.state().applied == 1
            && !entry.machine.state().status.is_terminal();
        if only_start {
            let (events, now): (Vec<Action>, Vec<Action>) = actions
                .into_iter()
                .partition(|a| matches!(a, Action::Emit(_)));
            Box::pin(self.perform(&mut entry, &now, &span, Replies::Send)).await?;
            self.record(&entry, now.iter().chain(&events), admitted);
            self.record_hops(run, &entry, &hops);
            entry.unflushed = Some(Unflushed {
                events,
                msgs: Vec::new(),
            });
            return Ok(Stepped::Deferred(entry));
        }
        let mut to_perform: Vec<Action> =
            entry.unflushed.take().map(|u| u.events).unwrap_or_default();
        to_perform.extend(
            reperform
                .into_iter()
                .filter(|a| still_relevant(a, &entry.machine)),
        );
        let new_from = to_perform.len();
        to_perform.extend(actions);
        if to_perform.contains(&Action::Finish) {
            Box::pin(self.complete_outcome(&mut entry)).await?;
        }
        if changed {
            let seqs: Vec<u64> = inputs.iter().map(|d| d.seq).collect();
            let snapshot = SnapshotRef {
                state: entry.machine.state(),
                outbox: &to_perform,
                outbox_seqs: &seqs,
            };
            let written = if unrecorded {
                self.store.create(run, &snapshot).await
            } else {
                self.store.update(run, &snapshot, entry.revision).await
            };
            entry.revision = match written {
                Ok(revision) => revision,
                Err(e) if e.kind() == StoreErrorKind::TooLarge => {
                    // The outbox's events made the record too large. Keep the actions that
                    // matter for progress; those events are lost only if this coordinator
                    // dies before publishing them.
                    warn!(%run, error = %e, "Run record too large with its events; storing it without them");
                    let slim: Vec<Action> = to_perform
                        .iter()
                        .filter(|a| !matches!(a, Action::Emit(_)))
                        .cloned()
                        .collect();
                    let snapshot = SnapshotRef {
                        state: entry.machine.state(),
                        outbox: &slim,
                        outbox_seqs: &seqs,
                    };
                    if unrecorded {
                        self.store.create(run, &snapshot).await?
                    } else {
                        self.store.update(run, &snapshot, entry.revision).await?
                    }
                }
                Err(e) => return Err(e.into()),
            };
        }
        // Committed: what this step decided is counted once, however often it is performed.
        self.record(&entry, &to_perform[new_from..], admitted);
        Box::pin(self.perform(&mut entry, &to_perform, &span, Replies::Send)).await?;
        self.record_hops(run, &entry, &hops);
        if entry.machine.state().status.is_terminal() {
            return Ok(Stepped::Done(None));
        }
        Ok(Stepped::Done(Some(entry)))
    }

    /// Counts what a committed step decided: the run admitted, tasks dispatched, retried and
    /// finished, the run finished. Labels are the task's pool and agent; ids go to the log
    /// lines only.
    fn record<'a>(
        &self,
        entry: &Cached,
        actions: impl IntoIterator<Item = &'a Action>,
        admitted: bool,
    ) {
        let state = entry.machine.state();
        let run = state.run_id;
        if admitted {
            RunSubmitted {
                run: Some(run),
                status: SubmitStatus::Accepted,
            }
            .emit(&self.metrics);
        }
        let plan = entry.machine.plan();
        let task = |i: u32| {
            let sub = &plan.subtasks[i as usize];
            let agent = sub.agent.as_deref().unwrap_or(&self.default_agent);
            (sub, agent)
        };
        for action in actions {
            match action {
                Action::Dispatch { task: i, attempt } => {
                    let (sub, agent) = task(*i);
                    TaskDispatched {
                        run,
                        task: &sub.id,
                        attempt: *attempt,
                        pool: &sub.pool,
                        agent,
                    }
                    .emit(&self.metrics);
                }
                Action::Emit(e) => {
                    let Some(i) = e.task else { continue };
                    let (sub, agent) = task(i);
                    let status = match e.event.phase {
                        WorkflowPhase::TaskRetrying => {
                            let delay = e.event.retry_at.map_or(0, |at| at.unix_ms() - e.at_ms);
                            TaskRetried {
                                run,
                                task: &sub.id,
                                attempt: e.attempt.unwrap_or_default(),
                                pool: &sub.pool,
                                agent,
                                delay: Duration::from_millis(delay.max(0) as u64),
                            }
                            .emit(&self.metrics);
                            continue;
                        }
                        WorkflowPhase::TaskSucceeded => flotilla_model::run::TaskStatus::Succeeded,
                        WorkflowPhase::TaskFailed => flotilla_model::run::TaskStatus::Failed,
                        WorkflowPhase::TaskSkipped => flotilla_model::run::TaskStatus::Skipped,
                        _ => continue,
                    };
                    TaskFinished {
                        run,
                        task: &sub.id,
                        pool: &sub.pool,
                        agent,
                        status,
                    }
                    .emit(&self.metrics);
                }
                Action::Finish => RunFinished {
                    run,
                    status: state.status,
                }
                .emit(&self.metrics),
                _ => {}
            }
        }
    }

    /// Records the dependency hops of a performed step: from the result that made a task
    /// ready being stored (server clock) to that task's dispatch being stored.
    fn record_hops(&self, run: RunId, entry: &Cached, hops: &[(u32, i128)]) {
        if hops.is_empty() {
            return;
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i128);
        let plan = entry.machine.plan();
        for &(task, published_ns) in hops {
            let ns = u64::try_from(now - published_ns).unwrap_or(0);
            DependencyHop {
                run,
                task: &plan.subtasks[task as usize].id,
                duration: Duration::from_nanos(ns),
            }
            .emit(&self.metrics);
        }
    }

    /// Whether the message at `seq` is the first of the run's history (for submissions whose
    /// publisher did not make sure of it).
    async fn is_first(&self, run: RunId, seq: u64) -> Result<bool, StepError> {
        Ok(self
            .store
            .first_message(run)
            .await
            .map_err(StepError::from)?
            .is_none_or(|f| f.seq == seq))
    }

    /// Answers a duplicate durable submission on its `reply_to`.
    async fn answer_duplicate(&self, run: RunId, reply_to: Option<&str>, status: RunStatus) {
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
            crate::intake::publish_reply(&self.bus, to, &answer, None).await;
        }
    }

    /// Fills in the final result of a finished run: the synthesis task's (or the sinks')
    /// results, or — for a run that stopped early — every result it got. A final result
    /// larger than the budget is stored whole as an artifact, and the outcome carries a
    /// shortened copy with the reference.
    async fn complete_outcome(&self, entry: &mut Cached) -> Result<(), StepError> {
        let Some(mut outcome) = entry.machine.state().outcome.clone() else {
            return Ok(());
        };
        if outcome.final_result.is_some() {
            return Ok(());
        }
        let partial = entry.machine.stopped_early();
        let finals = if partial {
            entry.machine.succeeded_tasks()
        } else {
            entry.machine.final_tasks()
        };
        if finals.is_empty() {
            return Ok(());
        }
        let plan = Arc::clone(entry.machine.plan());
        let mut results = std::collections::BTreeMap::new();
        let mut parts = Vec::new();
        for &i in &finals {
            let r = self.result_of(entry, i).await?;
            let id = plan.subtasks[i as usize].id.clone();
            parts.push((id.clone(), r.response.clone(), r.numeric_value));
            results.insert(id, r.as_dependency());
        }
        let (response, numeric_value) = if parts.len() == 1 {
            (parts[0].1.clone(), parts[0].2)
        } else {
            let text = parts
                .iter()
                .map(|(id, resp, _)| format!("## {id}\n{resp}"))
                .collect::<Vec<_>>()
                .join("\n\n");
            (text, None)
        };
        let mut final_result = FinalResult {
            response,
            numeric_value,
            results,
            partial,
            omitted: 0,
            artifact: None,
        };
        let budget = self.final_result_budget();
        // Only a final result that may be near the budget is encoded to measure it.
        let estimate = final_result.response.len()
            + final_result
                .results
                .iter()
                .map(|(id, r)| id.as_str().len() + r.response.len() + 256)
                .sum::<usize>();
        if estimate > budget / 2
            && let encoded = serde_json::to_vec(&final_result)
                .map_err(|e| StepError::Terminal(format!("encoding the final result: {e}")))?
            && encoded.len() > budget
        {
            let run = entry.machine.state().run_id;
            let artifact = self
                .store
                .put_artifact(&format!("runs/{run}/final-result.json"), encoded)
                .await?;
            shrink_final_result(&mut final_result, budget);
            final_result.artifact = Some(artifact);
        }
        outcome.final_result = Some(final_result);
        entry.machine.set_outcome(outcome);
        Ok(())
    }

    /// Bytes of final result carried inline in outcomes, events and replies.
    fn final_result_budget(&self) -> usize {
        self.opts
            .final_result_budget
            .min(self.bus.max_payload() / 4)
    }

    /// Reviews the planner's answer of `round` (see [`crate::planner`]): the run-log entry
    /// that records the decision.
    async fn review_plan(&self, entry: &mut Cached, round: u32) -> Result<RunLogEntry, StepError> {
        let answer = self.result_of(entry, 0).await?;
        let state = entry.machine.state();
        let run = state.run_id;
        let max_repairs = state.planning.as_ref().map_or(0, |p| p.max_repairs);
        let planning = Arc::clone(entry.machine.plan());
        let query = planning.query.clone().unwrap_or_default();
        let mut ctx = self.ctx.clone();
        ctx.limits.max_plan_bytes = Some(
            self.bus
                .max_payload()
                .saturating_sub(flotilla_model::validate::PLAN_ENVELOPE_ROOM),
        );
        let decision = crate::planner::review(
            &answer.response,
            &query,
            round,
            max_repairs,
            &self.opts.planner,
            &ctx,
            &planning,
        );
        match &decision {
            PlanDecision::Accepted { plan, .. } => {
                info!(%run, round, tasks = plan.subtasks.len(), "Planner answer accepted")
            }
            PlanDecision::Repair { problems, .. } | PlanDecision::Failed { problems } => {
                warn!(%run, round, problems = problems.len(), first = %problems.first().map(ToString::to_string).unwrap_or_default(), decision = decision.as_str(), "Planner answer has problems")
            }
        }
        Ok(RunLogEntry {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            input: RunInput::Planned(Box::new(Planned { round, decision })),
        })
    }

    async fn result_of(&self, entry: &mut Cached, task: u32) -> Result<TaskResult, StepError> {
        if let Some(r) = entry.results.get(&task) {
            return Ok(r.clone());
        }
        let seq = entry.machine.state().tasks[task as usize].result_seq;
        let r = self.store.result_at(seq).await?.result;
        entry.results.insert(task, r.clone());
        Ok(r)
    }

    /// The task message of an attempt, or — when the task cannot start (its description
    /// names a state key that is not set) — the error its attempt fails with.
    async fn envelope(
        &self,
        entry: &mut Cached,
        task: u32,
        attempt: u32,
    ) -> Result<Result<TaskEnvelope, TaskError>, StepError> {
        let plan = Arc::clone(entry.machine.plan());
        let graph = Arc::clone(entry.machine.graph());
        let sub = &plan.subtasks[task as usize];
        let (run_id, dispatched_ms, trace) = {
            let s = entry.machine.state();
            (
                s.run_id,
                s.tasks[task as usize].dispatched_ms,
                s.trace.clone(),
            )
        };
        let mut previous_results = std::collections::BTreeMap::new();
        let mut dependency_results = std::collections::BTreeMap::new();
        if plan.config.pass_dependency_results {
            let direct = graph.deps(task).to_vec();
            for &d in &direct {
                let r = self.result_of(entry, d).await?.as_dependency();
                let id = plan.subtasks[d as usize].id.clone();
                previous_results.insert(id.clone(), r.clone());
                dependency_results.insert(id, r);
            }
            let mut budget = self.opts.previous_results_budget;
            // Direct dependencies' results are always passed; when together they would not
            // fit in a task message, each is cut to an equal share, marked as cut.
            let share = (self.bus.max_payload() / 2) / direct.len().max(1);
            for r in dependency_results
                .values_mut()
                .chain(previous_results.values_mut())
            {
                shorten_response(&mut r.response, share);
            }
            for a in graph.ancestors(task) {
                if direct.contains(&a) {
                    continue;
                }
                let r: DependencyResult = self.result_of(entry, a).await?.as_dependency();
                let size = r.response.len() + 64;
                if size > budget {
                    break;
                }
                budget -= size;
                previous_results.insert(plan.subtasks[a as usize].id.clone(), r);
            }
        }
        let root = root_of(entry.machine.state());
        let session = session_of(entry.machine.state());
        let description = match self.fill_placeholders(&sub.description, &session).await? {
            Ok(d) => d,
            Err(e) => return Ok(Err(e)),
        };
        let mut consumed = flotilla_model::workspace::ConsumedTopics::new();
        let mut budget = self.opts.consumed_budget;
        for topic in &sub.consumes {
            let (entries, next_since_seq, truncated) = self
                .store
                .topic_entries(
                    root,
                    topic,
                    0,
                    budget,
                    flotilla_model::workspace::MAX_READ_LIMIT,
                )
                .await?;
            let used: usize = entries
                .iter()
                .map(|e| serde_json::to_vec(&e.entry).map_or(0, |v| v.len()) + 128)
                .sum();
            budget = budget.saturating_sub(used);
            consumed.insert(
                topic.clone(),
                flotilla_model::workspace::ConsumedTopic {
                    entries,
                    next_since_seq,
                    truncated,
                },
            );
        }
        Ok(Ok(TaskEnvelope {
            protocol: PROTOCOL_VERSION,
            run_id,
            root_run_id: (root != run_id).then_some(root),
            session_id: entry.machine.state().session_id,
            task_id: sub.id.clone(),
            attempt,
            attempt_id: attempt_id(run_id, task, attempt, dispatched_ms),
            agent: sub.agent.clone(),
            pool: sub.pool.clone(),
            role: sub.role.clone(),
            description,
            action: sub.action.clone(),
            risk: sub.risk,
            required: sub.required,
            query: plan.query.clone(),
            input: sub.input.clone(),
            timeout: sub.timeout.unwrap_or(plan.config.task_timeout),
            previous_results,
            dependency_results,
            consumes: sub.consumes.clone(),
            produces: sub.produces.clone(),
            budget: plan.config.budget(),
            budget_scopes: entry.machine.state().budget_scopes.clone(),
            output_schema: sub.output_schema.clone(),
            consumed,
            dataflow_validation: plan.config.dataflow_validation,
            dispatched_at: Timestamp::from_unix_ms(dispatched_ms),
            trace: trace.map(|t| child_trace(&t, run_id, task, attempt)),
        }))
    }

    /// Fills `{key}` placeholders of a description from session state (`{key?}`: empty when
    /// unset). A missing required key is the task's `missing_state_key` failure.
    async fn fill_placeholders(
        &self,
        description: &str,
        session: &str,
    ) -> Result<Result<String, TaskError>, StepError> {
        let keys = placeholders(description);
        if keys.is_empty() {
            return Ok(Ok(description.to_owned()));
        }
        let mut values = HashMap::new();
        let mut missing = Vec::new();
        for (key, optional) in &keys {
            if values.contains_key(*key) {
                continue;
            }
            match self.store.state_value(session, key).await? {
                Some(v) => {
                    let text = match v {
                        serde_json::Value::String(s) => s,
                        other => other.to_string(),
                    };
                    values.insert(*key, text);
                }
                None if *optional => {
                    values.insert(*key, String::new());
                }
                None => missing.push(*key),
            }
        }
        if !missing.is_empty() {
            return Ok(Err(TaskError {
                kind: flotilla_model::task::TaskErrorKind::MissingStateKey,
                message: format!(
                    "the description needs session-state key(s) {} (session {session}), which are not set; a task's output_key sets one, as do `flotilla state set` and the state.set endpoint; write {{key?}} for an optional value",
                    missing.join(", ")
                ),
            }));
        }
        Ok(Ok(fill(description, &values)))
    }

    /// A failed result the coordinator records for an attempt it could not start.
    fn coordinator_failure(
        &self,
        entry: &Cached,
        task: u32,
        attempt: u32,
        error: TaskError,
    ) -> Result<(String, wire::Outgoing), StepError> {
        let s = entry.machine.state();
        let run = s.run_id;
        let task_id = entry.machine.plan().subtasks[task as usize].id.clone();
        warn!(%run, task = %task_id, attempt, error = %error, "Task cannot start");
        let body = RunLogEntry {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            input: RunInput::TaskResult(Box::new(flotilla_model::runlog::TaskResultInput {
                task_id: task_id.clone(),
                attempt,
                attempt_id: attempt_id(run, task, attempt, s.tasks[task as usize].dispatched_ms),
                worker: "coordinator".into(),
                started_at: None,
                result: TaskResult {
                    response: String::new(),
                    tokens: 0,
                    success: false,
                    tools_used: Vec::new(),
                    numeric_value: None,
                    error: Some(error),
                },
            })),
        };
        let out = wire::encode(
            &body,
            Codec::Json,
            Some(&flotilla_model::task::result_msg_id(run, &task_id, attempt)),
        )?;
        Ok((self.bus.names().runlog(run), out))
    }

    /// Automatic produce: the succeeded task's result as an entry on each topic it produces.
    async fn produced_entries(
        &self,
        entry: &mut Cached,
        task: u32,
    ) -> Result<Vec<(String, wire::Outgoing)>, StepError> {
        let result = self.result_of(entry, task).await?;
        let plan = Arc::clone(entry.machine.plan());
        let sub = &plan.subtasks[task as usize];
        let s = entry.machine.state();
        let (run, root) = (s.run_id, root_of(s));
        let mut summary = result.response;
        // Leave room for the entry's other fields and the writer.
        let room = flotilla_model::workspace::MAX_ENTRY_BYTES
            .min(self.bus.max_payload())
            .saturating_sub(8 * 1024);
        shorten_response(&mut summary, room);
        let write = flotilla_model::workspace::WorkspaceWrite {
            protocol: PROTOCOL_VERSION,
            entry: flotilla_model::workspace::produced_entry(
                &sub.id,
                &summary,
                result.numeric_value,
            ),
            writer: Some(flotilla_model::workspace::Writer {
                run_id: run,
                task_id: Some(sub.id.clone()),
                attempt: Some(s.tasks[task as usize].attempt),
                by: Some("coordinator".into()),
            }),
        };
        let mut out = Vec::with_capacity(sub.produces.len());
        for topic in &sub.produces {
            let mut msg = wire::encode(
                &write,
                Codec::Json,
                Some(&format!("produce.{run}.{}.{topic}", sub.id)),
            )?;
            msg.headers.insert(
                flotilla_model::workspace::PRODUCED_BY_HEADER,
                sub.id.as_str(),
            );
            out.push((self.bus.names().workspace(root, topic), msg));
        }
        Ok(out)
    }

    /// The succeeded task's response as its `output_key` value in session state: a KV put
    /// with a message id, so a re-performed step does not write it again.
    async fn output_value(
        &self,
        entry: &mut Cached,
        task: u32,
    ) -> Result<(String, wire::Outgoing), StepError> {
        let result = self.result_of(entry, task).await?;
        let plan = Arc::clone(entry.machine.plan());
        let sub = &plan.subtasks[task as usize];
        let s = entry.machine.state();
        let run = s.run_id;
        let key = sub.output_key.clone().unwrap_or_default();
        let mut response = result.response;
        let room = flotilla_model::state::MAX_VALUE_BYTES - 64;
        if response.len() > room {
            warn!(%run, task = %sub.id, key, bytes = response.len(), "The response is larger than a state value; its output_key value is cut");
            shorten_response(&mut response, room);
        }
        let value = serde_json::Value::String(response);
        let body = serde_json::to_vec(&value)
            .map_err(|e| StepError::Failed(format!("encoding state value: {e}")))?;
        let mut headers = HeaderMap::new();
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            format!("output.{run}.{}", sub.id).as_str(),
        );
        let names = self.bus.names();
        let subject = format!(
            "$KV.{}.{}",
            names.bucket(flotilla_model::subjects::Bucket::State),
            names.state_key(&session_of(s), &key)
        );
        Ok((
            subject,
            wire::Outgoing {
                headers,
                payload: body.into(),
            },
        ))
    }

    fn event_of(&self, entry: &Cached, e: &Emission) -> EventEnvelope {
        let plan = entry.machine.plan();
        EventEnvelope {
            protocol: PROTOCOL_VERSION,
            id: e.id.clone(),
            run_id: entry.machine.state().run_id,
            task_id: e.task.map(|i| plan.subtasks[i as usize].id.clone()),
            attempt: e.attempt,
            ts: Timestamp::from_unix_ms(e.at_ms),
            source: "coordinator".into(),
            event: Event::Workflow(e.event.clone()),
        }
    }

    /// Performs actions: every publish is sent first, then all acknowledgements are awaited.
    /// The step's events (workflow events and the run's end) go out as one message, after its
    /// tasks and timers; the outcome's answer to a waiting submitter goes out first of all.
    async fn perform(
        &self,
        entry: &mut Cached,
        actions: &[Action],
        step: &tracing::Span,
        replies: Replies,
    ) -> Result<(), StepError> {
        let js = self.bus.js();
        let names = self.bus.names().clone();
        let run = entry.machine.state().run_id;
        let max = self.bus.max_payload();
        let mut pending: Vec<(
            String,
            usize,
            async_nats::jetstream::context::PublishAckFuture,
        )> = Vec::new();
        let mut events: Vec<EventEnvelope> = Vec::new();
        // The end's answers to waiting submitters: sent last, once everything else of the
        // step is stored, so a step that fails part-way and is performed again does not
        // answer twice.
        let mut answers: Vec<(String, SubmitReply)> = Vec::new();
        // Workspace entries and state values this step writes; a dispatch that reads the
        // workspace or state waits for them to be stored first.
        let mut unflushed_writes = false;
        for action in actions {
            let (subject, out) = match action {
                Action::Dispatch { task, attempt } => {
                    let sub = &entry.machine.plan().subtasks[*task as usize];
                    if unflushed_writes
                        && (!sub.consumes.is_empty() || sub.description.contains('{'))
                    {
                        for (subject, size, ack) in pending.drain(..) {
                            ack.await.map_err(|e| {
                                flotilla_bus::classify_publish_error(&subject, size, max, e)
                            })?;
                        }
                        unflushed_writes = false;
                    }
                    let span = spans::dispatch(
                        step,
                        run,
                        &sub.id,
                        *attempt,
                        &sub.pool,
                        sub.agent.as_deref().unwrap_or(&self.default_agent),
                    );
                    let env = match Box::pin(self.envelope(entry, *task, *attempt)).await? {
                        // The attempt's trace parent is this dispatch (when spans are exported).
                        Ok(mut env) => {
                            if let Some(t) = trace_context::span_context(&span) {
                                env.trace = Some(t);
                            }
                            // Workflow agents run on the coordinators' own pool: a workflow
                            // waiting on its children holds no worker slot.
                            if self
                                .ctx
                                .agents
                                .as_ref()
                                .is_some_and(|a| a.is_workflow(env.agent.as_deref()))
                            {
                                env.pool = WORKFLOW_POOL.to_owned();
                            }
                            env
                        }
                        Err(failure) => {
                            // The task cannot start (a state key its description needs is
                            // not set): its attempt fails through the run log like any other.
                            let (subject, out) =
                                self.coordinator_failure(entry, *task, *attempt, failure)?;
                            let size = out.payload.len();
                            let ack = js
                                .publish_with_headers(subject.clone(), out.headers, out.payload)
                                .await
                                .map_err(|e| {
                                    flotilla_bus::classify_publish_error(&subject, size, max, e)
                                })?;
                            pending.push((subject, size, ack));
                            continue;
                        }
                    };
                    let mut out = wire::encode(&env, Codec::Json, Some(&env.msg_id()))?;
                    if let Some(t) = &env.trace {
                        out.headers
                            .insert(wire::TRACEPARENT, t.traceparent.as_str());
                    }
                    (names.task(&env.pool, run, &env.task_id), out)
                }
                Action::Produce { task } => {
                    for (subject, out) in self.produced_entries(entry, *task).await? {
                        let size = out.payload.len();
                        let ack = js
                            .publish_with_headers(subject.clone(), out.headers, out.payload)
                            .await
                            .map_err(|e| {
                                flotilla_bus::classify_publish_error(&subject, size, max, e)
                            })?;
                        pending.push((subject, size, ack));
                    }
                    unflushed_writes = true;
                    continue;
                }
                Action::StoreOutput { task } => {
                    unflushed_writes = true;
                    self.output_value(entry, *task).await?
                }
                Action::Emit(e) => {
                    events.push(self.event_of(entry, e));
                    continue;
                }
                Action::ArmTimer { generation, due_ms } => {
                    let body = RunLogEntry {
                        protocol: PROTOCOL_VERSION,
                        run_id: run,
                        input: RunInput::TimerFired {
                            generation: *generation,
                        },
                    };
                    let mut out = wire::encode(
                        &body,
                        Codec::Json,
                        Some(&format!("timer.{run}.{generation}")),
                    )?;
                    schedule_headers(&mut out.headers, *due_ms, &names.runlog(run));
                    (names.timer(run, *generation), out)
                }
                Action::CancelAttempts => {
                    Box::pin(self.cancel_attempts(entry)).await?;
                    continue;
                }
                Action::ReviewPlan { round } => {
                    let body = self.review_plan(entry, *round).await?;
                    let out =
                        wire::encode(&body, Codec::Json, Some(&format!("planned.{run}.{round}")))?;
                    (names.runlog(run), out)
                }
                Action::Finish => {
                    let state = entry.machine.state();
                    let outcome = state.outcome.clone();
                    let phase = match state.status {
                        RunStatus::Succeeded => WorkflowPhase::RunSucceeded,
                        RunStatus::Cancelled => WorkflowPhase::RunCancelled,
                        _ => WorkflowPhase::RunFailed,
                    };
                    if let Some(o) = outcome.as_ref().filter(|_| replies == Replies::Send) {
                        let reply = SubmitReply {
                            protocol: PROTOCOL_VERSION,
                            run_id: Some(run),
                            status: SubmitStatus::Finished,
                            errors: Vec::new(),
                            warnings: Vec::new(),
                            outcome: Some(o.clone()),
                            run_status: None,
                        };
                        for to in [&state.reply_to, &state.wait_reply_to]
                            .into_iter()
                            .flatten()
                        {
                            answers.push((to.clone(), reply.clone()));
                        }
                    }
                    let e = Emission {
                        id: format!("{run}.end"),
                        task: None,
                        attempt: None,
                        at_ms: state.finished_ms.unwrap_or_default(),
                        event: WorkflowEvent {
                            outcome: outcome.map(Box::new),
                            // A bare query whose planning failed: the last answer's problems.
                            problems: if state.planning.is_some() {
                                state.errors.clone()
                            } else {
                                Vec::new()
                            },
                            ..WorkflowEvent::phase(phase)
                        },
                    };
                    events.push(self.event_of(entry, &e));
                    continue;
                }
            };
            let size = out.payload.len();
            let ack = js
                .publish_with_headers(subject.clone(), out.headers, out.payload)
                .await
                .map_err(|e| flotilla_bus::classify_publish_error(&subject, size, max, e))?;
            pending.push((subject, size, ack));
        }
        // One message per step; split only when it would not fit in one.
        let subject = names.event(run);
        for out in encode_event_batches(run, events, max / 2)? {
            let size = out.payload.len();
            let ack = js
                .publish_with_headers(subject.clone(), out.headers, out.payload)
                .await
                .map_err(|e| flotilla_bus::classify_publish_error(&subject, size, max, e))?;
            pending.push((subject.clone(), size, ack));
        }
        for (subject, size, ack) in pending {
            ack.await
                .map_err(|e| flotilla_bus::classify_publish_error(&subject, size, max, e))?;
        }
        let answer_id = format!("finished.{run}");
        for (to, reply) in &answers {
            crate::intake::publish_reply(&self.bus, to, reply, Some(&answer_id)).await;
        }
        Ok(())
    }

    /// A run whose first run-log entry cannot be read never starts: record it `failed` with
    /// the reason, so it is visible instead of silently missing.
    async fn record_unstartable(
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
        let batch = flotilla_model::event::EventBatch::new(run, vec![ev]);
        self.bus
            .publish(self.bus.names().event(run), &batch, Some(&batch.msg_id()))
            .await?;
        Ok(())
    }
}

impl Runtime {
    /// Tells the workers running attempts of a stopped run to cancel them: a notice in the
    /// control bucket (workers watch it, so they react at once), and the run's queued tasks
    /// are removed from the task stream so no worker starts them.
    async fn cancel_attempts(&self, entry: &Cached) -> Result<(), StepError> {
        let state = entry.machine.state();
        let run = state.run_id;
        let names = self.bus.names();
        let kv = self
            .bus
            .kv(flotilla_model::subjects::Bucket::Control)
            .await
            .map_err(|e| StepError::Failed(e.to_string()))?;
        let notice = serde_json::json!({
            "run_id": run,
            "action": "cancel",
            "reason": state.stop_reason,
        });
        kv.put(names.cancel_key(run), notice.to_string().into())
            .await
            .map_err(|e| StepError::Failed(format!("writing the cancel notice of {run}: {e}")))?;
        let stream_name = names.stream(flotilla_model::subjects::StreamKind::Tasks);
        let stream = self
            .bus
            .js()
            .get_stream(&stream_name)
            .await
            .map_err(|e| StepError::Failed(format!("opening {stream_name}: {e}")))?;
        stream
            .purge()
            .filter(format!("{}.task.*.{run}.*", names.prefix()))
            .await
            .map_err(|e| StepError::Failed(format!("removing the queued tasks of {run}: {e}")))?;
        Ok(())
    }
}

/// Cuts a response to at most `max` bytes, saying so in the text.
fn shorten_response(response: &mut String, max: usize) {
    if response.len() > max {
        let total = response.len();
        crate::machine::truncate_message(response, max.saturating_sub(96));
        response.push_str(&format!(" (response cut from {total} bytes)"));
    }
}

/// Shrinks a final result to about `budget` bytes: the text is cut and results are left out
/// (counted in `omitted`) until it fits.
fn shrink_final_result(fr: &mut FinalResult, budget: usize) {
    shorten_response(&mut fr.response, budget / 2);
    let mut room = budget / 2;
    let mut kept = std::collections::BTreeMap::new();
    let total = fr.results.len();
    for (id, mut r) in std::mem::take(&mut fr.results) {
        shorten_response(&mut r.response, room.min(budget / 8));
        let size = r.response.len() + id.as_str().len() + 128;
        if size > room {
            continue;
        }
        room -= size;
        kept.insert(id, r);
    }
    fr.omitted = (total - kept.len()) as u32;
    fr.results = kept;
}

/// The root of a run's tree, whose workspace and mailboxes its tasks share: a child run's
/// parent link names it; a run without a parent is its own root.
pub(crate) fn root_of(state: &crate::machine::RunState) -> RunId {
    state
        .parent
        .as_ref()
        .map_or(state.run_id, RunHandle::root_run)
}

/// The key prefix of a run's session state: its session id, else its root run's id.
pub(crate) fn session_of(state: &crate::machine::RunState) -> String {
    state
        .session_id
        .map_or_else(|| root_of(state).to_string(), |s| s.to_string())
}

/// Whether a stored outbox action still applies to the current state.
fn still_relevant(action: &Action, machine: &RunMachine) -> bool {
    let s = machine.state();
    match action {
        Action::Dispatch { task, attempt } => s.tasks.get(*task as usize).is_some_and(|t| {
            t.status == flotilla_model::run::TaskStatus::Dispatched && t.attempt == *attempt
        }),
        Action::ArmTimer { generation, .. } => s.timer.is_some_and(|t| t.generation == *generation),
        Action::Emit(_)
        | Action::CancelAttempts
        | Action::Produce { .. }
        | Action::StoreOutput { .. } => true,
        Action::Finish => s.status.is_terminal(),
        Action::ReviewPlan { round } => s.planning.as_ref().is_some_and(|p| {
            p.round == *round && p.status == flotilla_model::run::PlanningStatus::Reviewing
        }),
    }
}

/// Headers that turn a run-log message into a durable timer (JetStream message scheduler).
fn schedule_headers(headers: &mut HeaderMap, due_ms: i64, target: &str) {
    let at = Timestamp::from_unix_ms(due_ms).to_rfc3339();
    headers.insert("Nats-Schedule", format!("@at {at}").as_str());
    headers.insert("Nats-Schedule-Target", target);
}

/// The trace context of a task: same trace, a span id derived from run, task and attempt.
fn child_trace(parent: &TraceContext, run: RunId, task: u32, attempt: u32) -> TraceContext {
    let mut parts = parent.traceparent.split('-');
    let (version, trace_id) = (
        parts.next().unwrap_or("00"),
        parts.next().unwrap_or_default(),
    );
    let flags = parts.nth(1).unwrap_or("01");
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (run, task, attempt).hash(&mut h);
    TraceContext {
        traceparent: format!("{version}-{trace_id}-{:016x}-{flags}", h.finish() | 1),
        tracestate: parent.tracestate.clone(),
    }
}

/// Encodes a step's events as few messages as fit `budget` bytes each (one, normally): the
/// whole step is encoded once, and only a step too large for one message is split by the
/// sizes of its events (measuring every event of every step would cost more than sending it).
fn encode_event_batches(
    run: RunId,
    events: Vec<EventEnvelope>,
    budget: usize,
) -> Result<Vec<wire::Outgoing>, flotilla_bus::PublishError> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let whole = EventBatch::new(run, events);
    let out = wire::encode(&whole, Codec::Json, Some(&whole.msg_id()))?;
    if out.payload.len() <= budget || whole.events.len() == 1 {
        return Ok(vec![out]);
    }
    split_batches(run, whole.events, budget)
        .iter()
        .map(|batch| wire::encode(batch, Codec::Json, Some(&batch.msg_id())))
        .collect()
}

/// Groups a step's events into as few messages as fit `budget` bytes each.
fn split_batches(run: RunId, events: Vec<EventEnvelope>, budget: usize) -> Vec<EventBatch> {
    if events.is_empty() {
        return Vec::new();
    }
    let mut batches = Vec::new();
    let mut current = Vec::new();
    let mut size = 0;
    for e in events {
        let e_size = serde_json::to_vec(&e).map(|v| v.len()).unwrap_or(0);
        if !current.is_empty() && size + e_size > budget {
            batches.push(EventBatch::new(run, std::mem::take(&mut current)));
            size = 0;
        }
        size += e_size;
        current.push(e);
    }
    batches.push(EventBatch::new(run, current));
    batches
}

/// Where a durable submission's submitter waits for answers, as far as it can be read.
fn reply_to_of(request: &Result<Box<SubmitRequest>, Box<UnreadableSubmission>>) -> Option<&str> {
    match request {
        Ok(r) => r.reply_to.as_deref(),
        Err(u) => u.reply_to.as_deref(),
    }
}

/// Whether performing a run's end answers its waiting submitters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Replies {
    /// Yes: the step that decided the end (or its inputs, redelivered).
    Send,
    /// No: an end performed again for its events only.
    Skip,
}

/// A submission as the run log records an accepted one.
fn submitted_of(
    request: &SubmitRequest,
    plan: flotilla_model::Plan,
    warnings: Vec<Problem>,
    trace: TraceContext,
) -> Submitted {
    Submitted {
        plan,
        labels: request.labels.clone(),
        session_id: request.session_id,
        parent: request.parent.clone(),
        reply_to: request
            .reply_to
            .clone()
            .filter(|s| flotilla_model::token::check_subject(s).is_ok()),
        wait_reply_to: None,
        intake_seq: None,
        warnings,
        trace: Some(trace),
        planning: None,
        depth: 0,
        budget_scopes: Vec::new(),
    }
}

/// How long a run-log input handed back after a failed step waits before its next delivery:
/// 250 ms, doubling per delivery, at most 5 s.
fn redelivery_delay(delivered: i64) -> Duration {
    let exp = u32::try_from(delivered.saturating_sub(1).clamp(0, 5)).unwrap_or(5);
    Duration::from_millis(250 << exp).min(Duration::from_secs(5))
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The run a subject token names when it is a run id in canonical form (lower-case,
/// hyphenated): any other spelling of a UUID would be a second subject for the same run.
fn canonical_run_id(token: &str) -> Option<RunId> {
    let canonical = token.len() == 36
        && token.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_digit() || (b'a'..=b'f').contains(&b),
        });
    canonical.then(|| token.parse().ok()).flatten()
}

/// Namespace of the ids under which misaddressed submissions are recorded.
const MISADDRESSED_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x3f6d_1c2b_8a4e_4f0d_9b7a_5e2c_1d0f_6a83);

/// The run id a misaddressed submission (`<prefix>.submit.<token>` where the token is not a
/// canonical run id) is recorded under: `UUIDv5(MISADDRESSED_NAMESPACE, token)`, so a client
/// can find its rejection and a redelivery lands on the same record.
pub(crate) fn misaddressed_run_id(token: &str) -> RunId {
    RunId::from_uuid(uuid::Uuid::new_v5(
        &MISADDRESSED_NAMESPACE,
        token.as_bytes(),
    ))
}

/// The problem of a submission published on `<prefix>.submit.<token>` with a token that is
/// not a canonical run id.
fn misaddressed_problem(token: &str) -> Problem {
    match token.parse::<RunId>() {
        Ok(run) => Problem::new(
            ProblemCode::NonCanonicalRunId,
            "subject",
            format!(
                "the submission subject names run {token:?}, which is not spelled canonically; one run has one subject: publish it on the canonical form {run} (lower-case, hyphenated)"
            ),
        ),
        Err(_) => Problem::new(
            ProblemCode::InvalidRunId,
            "subject",
            format!(
                "the submission subject's last token {token:?} is not a run id; publish a submission on <prefix>.submit.<run> with a UUID in canonical form (lower-case, hyphenated), or without a run id on <prefix>.submit"
            ),
        ),
    }
}

fn shard_of(run: RunId, shards: usize) -> usize {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    run.hash(&mut h);
    (h.finish() % shards as u64) as usize
}
