//! The thin runtime around [`RunMachine`]: reads the run log, applies inputs, stores the
//! state with compare-and-set, then performs the actions.
//!
//! ```text
//! run log ──► router ──(hash of run id)──► shard 0..N ──► per run: load (cache or KV)
//!                                                          apply inputs (pure)
//!                                                          CAS-write snapshot + outbox
//!                                                          perform actions (idempotent)
//!                                                          ack inputs
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

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind};
use flotilla_bus::{Bus, wire};
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::codec::Codec;
use flotilla_model::event::{Event, EventEnvelope, WorkflowEvent, WorkflowPhase};
use flotilla_model::ids::RunId;
use flotilla_model::run::{FinalResult, RunStatus};
use flotilla_model::runlog::{ControlAction, RunInput, RunLogEntry};
use flotilla_model::submit::{SubmitReply, SubmitStatus};
use flotilla_model::task::{DependencyResult, TaskEnvelope, TaskResult, TraceContext};
use flotilla_model::time::Timestamp;
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::PULL_HEARTBEAT;
use crate::error::{StoreError, StoreErrorKind};
use crate::machine::{Action, Emission, Input, RunMachine, attempt_id};
use crate::options::CoordinatorOptions;
use crate::store::{RunStore, SnapshotRef, unix_ms};

/// How often a run is reloaded and re-applied after losing compare-and-set races in a row.
const MAX_CAS_ATTEMPTS: usize = 8;

/// A run held in memory by its shard.
struct Cached {
    machine: RunMachine,
    revision: u64,
    /// Results of succeeded tasks, for building dependents' envelopes.
    results: HashMap<u32, TaskResult>,
    last_used: u64,
}

/// What a run-log message says.
enum Inbound {
    /// A readable entry.
    Entry(RunLogEntry),
    /// An entry that cannot be decoded: the run cannot continue, and ends with this reason.
    Unreadable(String),
}

/// A decoded run-log message.
struct Decoded {
    msg: jetstream::Message,
    seq: u64,
    ts_ms: i64,
    delivered: i64,
    inbound: Inbound,
}

/// Why processing a run's inputs stopped.
enum StepError {
    /// Compare-and-set lost: reload and try again.
    Conflict,
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
        match e.kind().retry() {
            flotilla_bus::Retry::Terminal => Self::Terminal(e.to_string()),
            flotilla_bus::Retry::Retryable => Self::Failed(e.to_string()),
        }
    }
}

/// Applies run-log inputs.
pub(crate) struct Runtime {
    store: RunStore,
    bus: Bus,
    opts: CoordinatorOptions,
    duplicate_window_ms: i64,
}

impl Runtime {
    pub(crate) fn new(
        store: RunStore,
        bus: Bus,
        opts: CoordinatorOptions,
        duplicate_window: Duration,
    ) -> Self {
        Self {
            store,
            bus,
            opts,
            duplicate_window_ms: duplicate_window.as_millis() as i64,
        }
    }

    /// Consumes the run log until `shutdown`.
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
        let prefix_len = format!("{}.runlog.", self.bus.names().prefix()).len();
        'outer: while !shutdown.is_cancelled() {
            let stream = consumer
                .stream()
                .max_messages_per_batch(self.opts.batch)
                .heartbeat(PULL_HEARTBEAT)
                .messages()
                .await;
            let mut messages = match stream {
                Ok(m) => m,
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
                        let run = msg
                            .subject
                            .get(prefix_len..)
                            .and_then(|s| s.parse::<RunId>().ok());
                        let Some(run) = run else {
                            warn!(subject = %msg.subject, "Run-log message on an unexpected subject; dropping");
                            let _ = msg.ack_with(AckKind::Term).await;
                            continue;
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
        let mut tick: u64 = 0;
        let per_shard_cap = (self.opts.cache_runs / self.opts.shards).max(16);
        while let Some(first) = rx.recv().await {
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
                Some(async move { (run, this.process(run, cached, msgs).await) })
            });
            for (run, entry) in futures::future::join_all(work).await {
                if let Some(mut e) = entry {
                    tick += 1;
                    e.last_used = tick;
                    cache.insert(run, e);
                }
            }
            if cache.len() > per_shard_cap {
                // Drop the least recently used tenth.
                let mut ages: Vec<(u64, RunId)> =
                    cache.iter().map(|(r, c)| (c.last_used, *r)).collect();
                ages.sort_unstable();
                for (_, r) in ages.into_iter().take(per_shard_cap / 10 + 1) {
                    cache.remove(&r);
                }
            }
        }
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
                Ok(i) => (i.stream_sequence, unix_ms(i.published), i.delivered),
                Err(e) => {
                    warn!(error = %e, "Run-log message without JetStream metadata; dropping");
                    continue;
                }
            };
            let inbound = match wire::decode::<RunLogEntry>(msg.headers.as_ref(), &msg.payload) {
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
                    Inbound::Unreadable(format!("run-log entry {} could not be read: {e}", info.0))
                }
            };
            inputs.push(Decoded {
                seq: info.0,
                ts_ms: info.1,
                delivered: info.2,
                inbound,
                msg,
            });
        }
        if inputs.is_empty() {
            return cached;
        }
        for _ in 0..MAX_CAS_ATTEMPTS {
            match self.step(run, cached.take(), &inputs, None).await {
                Ok(entry) => {
                    self.ack_all(run, &inputs).await;
                    return entry;
                }
                Err(StepError::Conflict) => {
                    debug!(%run, "Run changed concurrently; reloading");
                }
                Err(StepError::Failed(reason)) => {
                    warn!(%run, %reason, "Applying run-log inputs failed; they will be redelivered");
                    break;
                }
                Err(StepError::Terminal(reason)) => {
                    // Retrying would fail the same way: end the run with the reason.
                    warn!(%run, %reason, "Applying run-log inputs failed for good; ending the run");
                    for _ in 0..MAX_CAS_ATTEMPTS {
                        match self.step(run, None, &inputs, Some(&reason)).await {
                            Ok(_) => {
                                self.ack_all(run, &inputs).await;
                                return None;
                            }
                            Err(StepError::Conflict) => continue,
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
        for d in &inputs {
            let _ = d
                .msg
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

    /// Applies `inputs` to the run and performs the resulting actions. With `abort`, the run
    /// is ended with that reason instead (after a terminal failure).
    async fn step(
        &self,
        run: RunId,
        cached: Option<Cached>,
        inputs: &[Decoded],
        abort: Option<&str>,
    ) -> Result<Option<Cached>, StepError> {
        let now_ms = inputs.iter().map(|d| d.ts_ms).max().unwrap_or_default();
        let mut reperform = Vec::new();
        let from_cache = cached.is_some();
        let mut entry = match cached {
            Some(c) => Some(c),
            None => match self.store.load(run).await? {
                None => None,
                Some(stored) => {
                    let state = stored.snapshot.state;
                    if state.tasks.is_empty() {
                        // Rejected, or ended before it could start: nothing more to apply.
                        return Ok(None);
                    }
                    let plan = match self.store.plan(run).await {
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
                    let produced_by_these = inputs
                        .iter()
                        .any(|d| d.delivered > 1 && stored.snapshot.outbox_seqs.contains(&d.seq));
                    let recent = now_ms - stored.written_ms < self.duplicate_window_ms / 2;
                    if produced_by_these || recent {
                        reperform = stored.snapshot.outbox;
                    }
                    Some(Cached {
                        machine: RunMachine::restore(Arc::new(plan), state),
                        revision: stored.revision,
                        results: HashMap::new(),
                        last_used: 0,
                    })
                }
            },
        };
        let applied_before = entry.as_ref().map(|e| e.machine.state().applied);
        let mut created = false;
        let mut actions = Vec::new();
        for d in inputs {
            let input = match &d.inbound {
                Inbound::Entry(e) => &e.input,
                Inbound::Unreadable(reason) => {
                    match entry.as_mut() {
                        Some(e) => {
                            actions.extend(e.machine.apply(Input::Abort { reason }, d.ts_ms))
                        }
                        None => {
                            self.record_unstartable(run, reason, d.ts_ms).await?;
                            return Ok(None);
                        }
                    }
                    continue;
                }
            };
            match input {
                RunInput::Rejected(r) => {
                    if entry.is_none() {
                        // The intake records its rejections; this covers an intake that
                        // stopped between the append and the record.
                        crate::intake::record_rejection(&self.store, run, r, d.ts_ms, false)
                            .await?;
                        return Ok(None);
                    }
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
                        let (machine, a) =
                            RunMachine::start(run, s, Arc::new(s.plan.clone()), d.ts_ms);
                        info!(%run, tasks = s.plan.subtasks.len(), "Run started");
                        entry = Some(Cached {
                            machine,
                            revision: 0,
                            results: HashMap::new(),
                            last_used: 0,
                        });
                        created = true;
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
                    if !a.is_empty()
                        && r.result.success
                        && let Some(i) = e.machine.graph().index_of(&r.task_id)
                    {
                        e.results.insert(i, r.result.clone());
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
            warn!(%run, "Run-log input for a run that does not exist; dropping");
            return Ok(None);
        };
        if let Some(reason) = abort {
            actions.extend(entry.machine.apply(Input::Abort { reason }, now_ms));
        }
        let changed = created || applied_before != Some(entry.machine.state().applied);
        if !changed && from_cache {
            // A no-op against cached state is only trustworthy if the cache is current:
            // another coordinator may have moved the run on (a result can look stale to an
            // old state). Without a write there is no compare-and-set to catch that, so
            // confirm against a fresh load before acknowledging.
            return Err(StepError::Conflict);
        }
        let mut to_perform: Vec<Action> = reperform
            .into_iter()
            .filter(|a| still_relevant(a, &entry.machine))
            .collect();
        to_perform.extend(actions);
        if to_perform.contains(&Action::Finish) {
            self.complete_outcome(&mut entry).await?;
        }
        if changed {
            let seqs: Vec<u64> = inputs.iter().map(|d| d.seq).collect();
            let snapshot = SnapshotRef {
                state: entry.machine.state(),
                outbox: &to_perform,
                outbox_seqs: &seqs,
            };
            let written = if created {
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
                    if created {
                        self.store.create(run, &snapshot).await?
                    } else {
                        self.store.update(run, &snapshot, entry.revision).await?
                    }
                }
                Err(e) => return Err(e.into()),
            };
        }
        self.perform(&mut entry, &to_perform).await?;
        if entry.machine.state().status.is_terminal() {
            if changed {
                info!(%run, status = %entry.machine.state().status, "Run finished");
            }
            return Ok(None);
        }
        Ok(Some(entry))
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
        let encoded = serde_json::to_vec(&final_result)
            .map_err(|e| StepError::Terminal(format!("encoding the final result: {e}")))?;
        if encoded.len() > budget {
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

    async fn result_of(&self, entry: &mut Cached, task: u32) -> Result<TaskResult, StepError> {
        if let Some(r) = entry.results.get(&task) {
            return Ok(r.clone());
        }
        let seq = entry.machine.state().tasks[task as usize].result_seq;
        let r = self.store.result_at(seq).await?.result;
        entry.results.insert(task, r.clone());
        Ok(r)
    }

    async fn envelope(
        &self,
        entry: &mut Cached,
        task: u32,
        attempt: u32,
    ) -> Result<TaskEnvelope, StepError> {
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
        Ok(TaskEnvelope {
            protocol: PROTOCOL_VERSION,
            run_id,
            task_id: sub.id.clone(),
            attempt,
            attempt_id: attempt_id(run_id, task, attempt, dispatched_ms),
            agent: sub.agent.clone(),
            pool: sub.pool.clone(),
            role: sub.role.clone(),
            description: sub.description.clone(),
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
            dispatched_at: Timestamp::from_unix_ms(dispatched_ms),
            trace: trace.map(|t| child_trace(&t, run_id, task, attempt)),
        })
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
    async fn perform(&self, entry: &mut Cached, actions: &[Action]) -> Result<(), StepError> {
        let js = self.bus.js();
        let names = self.bus.names().clone();
        let run = entry.machine.state().run_id;
        let mut pending = Vec::new();
        for action in actions {
            let (subject, out) = match action {
                Action::Dispatch { task, attempt } => {
                    let env = self.envelope(entry, *task, *attempt).await?;
                    let mut out = wire::encode(&env, Codec::Json, Some(&env.msg_id()))?;
                    if let Some(t) = &env.trace {
                        out.headers
                            .insert(wire::TRACEPARENT, t.traceparent.as_str());
                    }
                    (names.task(&env.pool, run, &env.task_id), out)
                }
                Action::Emit(e) => {
                    let ev = self.event_of(entry, e);
                    (
                        names.event(run),
                        wire::encode(&ev, Codec::Json, Some(&ev.id))?,
                    )
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
                    self.cancel_attempts(entry).await?;
                    continue;
                }
                Action::Finish => {
                    let state = entry.machine.state();
                    let outcome = state.outcome.clone();
                    let phase = match state.status {
                        RunStatus::Succeeded => WorkflowPhase::RunSucceeded,
                        RunStatus::Cancelled => WorkflowPhase::RunCancelled,
                        _ => WorkflowPhase::RunFailed,
                    };
                    if let Some(o) = &outcome {
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
                            crate::intake::publish_reply(&self.bus, to, &reply).await;
                        }
                    }
                    let e = Emission {
                        id: format!("{run}.end"),
                        task: None,
                        attempt: None,
                        at_ms: state.finished_ms.unwrap_or_default(),
                        event: WorkflowEvent {
                            outcome: outcome.map(Box::new),
                            ..WorkflowEvent::phase(phase)
                        },
                    };
                    let ev = self.event_of(entry, &e);
                    (
                        names.event(run),
                        wire::encode(&ev, Codec::Json, Some(&ev.id))?,
                    )
                }
            };
            let size = out.payload.len();
            let max = self.bus.max_payload();
            let ack = js
                .publish_with_headers(subject.clone(), out.headers, out.payload)
                .await
                .map_err(|e| flotilla_bus::classify_publish_error(&subject, size, max, e))?;
            pending.push((subject, size, ack));
        }
        for (subject, size, ack) in pending {
            ack.await.map_err(|e| {
                flotilla_bus::classify_publish_error(&subject, size, self.bus.max_payload(), e)
            })?;
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
        }
        let snapshot = SnapshotRef {
            state: &state,
            outbox: &[],
            outbox_seqs: &[],
        };
        match self.store.create(run, &snapshot).await {
            Ok(_) => {}
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
        self.bus
            .publish(self.bus.names().event(run), &ev, Some(&ev.id))
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

/// Whether a stored outbox action still applies to the current state.
fn still_relevant(action: &Action, machine: &RunMachine) -> bool {
    let s = machine.state();
    match action {
        Action::Dispatch { task, attempt } => s.tasks.get(*task as usize).is_some_and(|t| {
            t.status == flotilla_model::run::TaskStatus::Dispatched && t.attempt == *attempt
        }),
        Action::ArmTimer { generation, .. } => s.timer.is_some_and(|t| t.generation == *generation),
        Action::Emit(_) | Action::CancelAttempts => true,
        Action::Finish => s.status.is_terminal(),
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

fn shard_of(run: RunId, shards: usize) -> usize {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    run.hash(&mut h);
    (h.finish() % shards as u64) as usize
}
