//! Reading runs from JetStream — what a client, the API and the coordinator itself read.
//!
//! * `flotilla-runs` KV, key `<run>`: the [`Snapshot`](crate::Snapshot) (MessagePack).
//! * `flotilla-runs` KV, key `idem.<hash>`: idempotency key → run id.
//! * `flotilla-runs` KV, key `session.<session>.<run>`: the session index.
//! * The run log: a run's first message on `<prefix>.submit.<run>` (its submission, or the
//!   coordinator's `submitted`/`rejected` entry), the plan, and task results read back by
//!   sequence number with direct get.
//!
//! Writing them (compare-and-set of records, claiming keys) is the coordinator's.

use async_nats::jetstream::kv;
use async_nats::jetstream::stream::Stream;
use flotilla_bus::Bus;
use flotilla_bus::wire;
use flotilla_model::ids::{RunId, SessionId};
use flotilla_model::plan::Plan;
use flotilla_model::run::{PlanningStatus, RunRecord, RunView};
use flotilla_model::runlog::{PlanDecision, RunInput, RunLogEntry, TaskResultInput};
use flotilla_model::subjects::{Bucket, StreamKind};
use flotilla_model::submit::SubmitRequest;
use flotilla_model::time::Timestamp;
use futures::StreamExt;

use flotilla_machine::RunState;

use crate::error::{StoreError, StoreErrorKind, decode_err, nats};
use crate::first::{First, FirstMessage, UnreadableSubmission};
use crate::snapshot::{StoredSnapshot, record_of, stored_snapshot, unix_ms, view_of};

/// Most entries one batch read of a consumed topic asks for.
const TOPIC_PAGE: usize = 256;

/// Most bytes one batch read of a consumed topic asks for.
const TOPIC_PAGE_BYTES: usize = 4 * 1024 * 1024;

/// Reads run state: records, first messages, plans, results, histories, sessions.
#[derive(Clone, Debug)]
pub struct RunReader {
    kv: kv::Store,
    runlog: Stream,
    state: kv::Store,
    bus: Bus,
}

/// The session-index key of `run` in `session`.
pub fn session_key(session: SessionId, run: RunId) -> String {
    format!("session.{session}.{run}")
}

/// The key of an idempotency key's entry in the runs bucket (`idem.<hash>`).
pub fn idempotency_kv_key(key: &str) -> String {
    let hashed = uuid::Uuid::new_v5(&IDEMPOTENCY_NAMESPACE, key.as_bytes());
    format!("idem.{}", hashed.simple())
}

/// Namespace of idempotency-key hashes.
const IDEMPOTENCY_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x6c0f_5a1e_7b1d_4e8a_9f3c_2d1a_0b9e_8f7d);

impl RunReader {
    /// Opens the bucket and the run-log stream (they must be provisioned).
    pub async fn open(bus: &Bus) -> Result<Self, StoreError> {
        let kv = bus
            .kv(Bucket::Runs)
            .await
            .map_err(|e| nats("opening the runs bucket", e))?;
        let name = bus.names().stream(StreamKind::RunLog);
        let runlog = bus
            .js()
            .get_stream(&name)
            .await
            .map_err(|e| nats(format!("opening stream {name}"), e))?;
        // Workspace reads go through batch direct gets; opening the stream checks it exists.
        let name = bus.names().stream(StreamKind::Workspace);
        bus.js()
            .get_stream(&name)
            .await
            .map_err(|e| nats(format!("opening stream {name}"), e))?;
        let state = bus
            .kv(Bucket::State)
            .await
            .map_err(|e| nats("opening the state bucket", e))?;
        Ok(Self {
            kv,
            runlog,
            state,
            bus: bus.clone(),
        })
    }

    /// A session-state value (`None` when the key is not set).
    pub async fn state_value(
        &self,
        session: &str,
        key: &str,
    ) -> Result<Option<serde_json::Value>, StoreError> {
        let k = self.bus.names().state_key(session, key);
        match self.state.get(&k).await {
            Ok(None) => Ok(None),
            Ok(Some(bytes)) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| decode_err(format!("state key {k}"), e)),
            Err(e) => Err(nats(format!("reading state key {k}"), e)),
        }
    }

    /// Entries of one workspace topic of a run tree, oldest first, after `after_seq`, until
    /// `budget` bytes of entry data or `max` entries: `(entries, next_since_seq, truncated)`.
    /// Messages that are not workspace writes are skipped.
    pub async fn topic_entries(
        &self,
        root: RunId,
        topic: &str,
        after_seq: u64,
        budget: usize,
        max: usize,
    ) -> Result<(Vec<flotilla_model::workspace::WorkspaceEntry>, u64, bool), StoreError> {
        use flotilla_model::workspace::{WorkspaceEntry, WorkspaceWrite};
        let subject = self.bus.names().workspace(root, topic);
        let mut out = Vec::new();
        let mut next = after_seq;
        let mut used = 0usize;
        loop {
            if out.len() >= max {
                return Ok((out, next, true));
            }
            // One batch read per page; `max_bytes` keeps a page near the remaining budget
            // (the server always sends at least one message).
            let page = self
                .bus
                .direct_batch(
                    StreamKind::Workspace,
                    &subject,
                    next,
                    (max - out.len()).min(TOPIC_PAGE),
                    Some(budget.saturating_sub(used).clamp(1, TOPIC_PAGE_BYTES)),
                )
                .await
                .map_err(|e| nats(format!("reading workspace topic {topic}"), e))?;
            let Some(last) = page.last() else {
                return Ok((out, next, false));
            };
            let more = last.num_pending > 0;
            for msg in page {
                let write: WorkspaceWrite = match wire::decode(Some(&msg.headers), &msg.payload) {
                    Ok(w) => w,
                    Err(e) => {
                        tracing::warn!(%root, topic, seq = msg.seq, error = %e, "Skipping a workspace message that is not a workspace write");
                        next = msg.seq;
                        continue;
                    }
                };
                let size = msg.payload.len();
                if used + size > budget {
                    // The budget is spent: hand over the cursor to continue from.
                    return Ok((out, next, true));
                }
                used += size;
                next = msg.seq;
                out.push(WorkspaceEntry {
                    seq: msg.seq,
                    topic: topic.to_owned(),
                    entry: write.entry,
                    writer: write.writer,
                    ts: Timestamp::from_unix_ms(msg.ts_ms),
                });
                if out.len() >= max {
                    return Ok((out, next, true));
                }
            }
            if !more {
                return Ok((out, next, false));
            }
        }
    }

    /// The runs bucket: records, idempotency keys, session indexes and tree counters (the
    /// coordinator writes them).
    pub fn runs_bucket(&self) -> &kv::Store {
        &self.kv
    }

    /// Reads a run's snapshot from the bucket's leader. [`load`](Self::load) is a direct get,
    /// which any replica answers — on a cluster, possibly one still catching up after a
    /// restart, with an older revision. That is harmless before a write (compare-and-set
    /// refuses it) but not before acknowledging an input that changed nothing: an input is
    /// dropped as stale only against the leader's copy.
    pub async fn load_from_leader(&self, run: RunId) -> Result<Option<StoredSnapshot>, StoreError> {
        use async_nats::jetstream::stream::LastRawMessageErrorKind;
        let subject = format!("{}{run}", self.kv.prefix);
        let msg = match self
            .kv
            .stream
            .get_last_raw_message_by_subject(&subject)
            .await
        {
            Ok(msg) => msg,
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => return Ok(None),
            Err(e) => return Err(nats(format!("reading run {run} from the leader"), e)),
        };
        // A delete or purge marker (`KV-Operation: DEL|PURGE`) is no record.
        if msg.headers.get("KV-Operation").is_some() {
            return Ok(None);
        }
        stored_snapshot(run, &msg.payload, msg.sequence, msg.time).map(Some)
    }

    /// Reads a run's snapshot (a direct get: see [`load_from_leader`](Self::load_from_leader)).
    pub async fn load(&self, run: RunId) -> Result<Option<StoredSnapshot>, StoreError> {
        let entry = self
            .kv
            .entry(run.to_string())
            .await
            .map_err(|e| nats(format!("reading run {run}"), e))?;
        let Some(entry) = entry else { return Ok(None) };
        if entry.operation != kv::Operation::Put {
            return Ok(None);
        }
        stored_snapshot(run, &entry.value, entry.revision, entry.created).map(Some)
    }

    /// The runs entered in `session`'s index, in the order they were entered.
    pub async fn session_runs(&self, session: SessionId) -> Result<Vec<RunId>, StoreError> {
        let keys = self
            .bus
            .kv_keys_under(Bucket::Runs, &format!("session.{session}."))
            .await
            .map_err(|e| nats(format!("listing session {session}"), e))?;
        Ok(keys.iter().filter_map(|k| k.parse().ok()).collect())
    }

    /// The first message of a run's history: its durable submission
    /// (`<prefix>.submit.<run>`) or its first run-log entry (`submitted` or `rejected`). It
    /// decided the run's fate.
    pub async fn first_message(&self, run: RunId) -> Result<Option<First>, StoreError> {
        // Every run's first message is on its submission subject (an exact subject: a
        // constant-time lookup for the server).
        let subject = self.bus.names().submit_run(run);
        let msg = match self.runlog.direct_get_first_for_subject(&subject).await {
            Ok(msg) => msg,
            Err(e) if e.kind() == async_nats::jetstream::stream::DirectGetErrorKind::NotFound => {
                // Any replica answers a direct get; one catching up (a cluster node back from
                // a crash) may not have the message yet. "None" decides a run's fate (a
                // submission is taken as the first), so it is asked of the leader.
                use async_nats::jetstream::stream::RawMessageErrorKind;
                match self.runlog.get_next_raw_message_by_subject(&subject).await {
                    Ok(msg) => msg,
                    Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => return Ok(None),
                    Err(e) => return Err(nats(format!("reading the run log of {run}"), e)),
                }
            }
            Err(e) => return Err(nats(format!("reading the run log of {run}"), e)),
        };
        let content = if wire::header(Some(&msg.headers), wire::KIND_HEADER)
            != Some(wire::KIND_RUNLOG_ENTRY)
        {
            match wire::decode::<SubmitRequest>(Some(&msg.headers), &msg.payload) {
                Ok(request) => FirstMessage::Submission {
                    request: Box::new(request),
                    trace: crate::first::trace_from(Some(&msg.headers), run),
                },
                Err(_) => FirstMessage::Unreadable(UnreadableSubmission::of(
                    Some(&msg.headers),
                    &msg.payload,
                )),
            }
        } else {
            FirstMessage::Entry(
                wire::decode(Some(&msg.headers), &msg.payload)
                    .map_err(|e| decode_err(format!("run log of {run}"), e))?,
            )
        };
        Ok(Some(First {
            seq: msg.sequence,
            ts_ms: unix_ms(msg.time),
            content,
        }))
    }

    /// The plan of an accepted run, as it runs: from its first message.
    pub async fn plan(&self, run: RunId) -> Result<Option<Plan>, StoreError> {
        match self.first_message(run).await? {
            None => Ok(None),
            Some(First {
                content: FirstMessage::Submission { request, .. },
                ..
            }) => Ok(Some(flotilla_model::validate::normalize_plan(
                request.plan.unwrap_or_else(Plan::empty),
            ))),
            Some(First {
                content:
                    FirstMessage::Entry(RunLogEntry {
                        input: RunInput::Submitted(s),
                        ..
                    }),
                ..
            }) => Ok(Some(s.plan)),
            Some(_) => Err(StoreError::new(
                StoreErrorKind::Decode,
                format!("the run log of {run} does not start with its submission"),
            )),
        }
    }

    /// The plan a run follows: the submission's when `plan_seq` is 0, else the one in the
    /// `planned` entry at `plan_seq` (a planned bare query, or a planner repair round).
    pub async fn plan_of(&self, run: RunId, plan_seq: u64) -> Result<Option<Plan>, StoreError> {
        if plan_seq == 0 {
            return self.plan(run).await;
        }
        let (entry, _) = self.entry_at(plan_seq).await?;
        match entry.input {
            RunInput::Planned(p) if entry.run_id == run => match p.decision {
                PlanDecision::Accepted { plan, .. } | PlanDecision::Repair { plan, .. } => {
                    Ok(Some(plan))
                }
                PlanDecision::Failed { .. } => Err(StoreError::new(
                    StoreErrorKind::Decode,
                    format!("run-log entry {plan_seq} of {run} holds no plan"),
                )),
            },
            RunInput::PlanEdited(e) if entry.run_id == run => Ok(Some(e.plan)),
            _ => Err(StoreError::new(
                StoreErrorKind::Decode,
                format!("run-log entry {plan_seq} is not a planned plan of {run}"),
            )),
        }
    }

    /// The plan a run follows now: [`Self::plan_of`] its `plan_seq`, amended by the run's
    /// team changes (recruited subtasks, reassigned tasks).
    pub async fn plan_for(
        &self,
        run: RunId,
        state: &flotilla_machine::RunState,
    ) -> Result<Option<Plan>, StoreError> {
        Ok(self
            .plan_of(run, state.plan_seq)
            .await?
            .map(|base| state.amend(base)))
    }

    /// The run-log entry at `seq`, with the server's time of it (Unix ms, whole seconds as
    /// the readers of results and decisions have always had it).
    async fn entry_at(&self, seq: u64) -> Result<(RunLogEntry, i64), StoreError> {
        let (entry, at_ms, _) = self.entry_stored_at(seq).await?;
        Ok((entry, at_ms))
    }

    /// [`Self::entry_at`], with when it was stored to the millisecond.
    async fn entry_stored_at(&self, seq: u64) -> Result<(RunLogEntry, i64, i64), StoreError> {
        let msg = self
            .runlog
            .direct_get(seq)
            .await
            .map_err(|e| nats(format!("reading run-log entry {seq}"), e))?;
        let entry: RunLogEntry = wire::decode(Some(&msg.headers), &msg.payload)
            .map_err(|e| decode_err(format!("run-log entry {seq}"), e))?;
        Ok((
            entry,
            msg.time.unix_timestamp() * 1000,
            crate::snapshot::unix_ms(msg.time),
        ))
    }

    /// A task result by run-log sequence: a worker's, or one a person supplied — in answer to
    /// an approval (`respond`) or by completing the task by hand (`completed`) — recorded as
    /// worker `human:<who>`.
    pub async fn result_at(&self, seq: u64) -> Result<TaskResultInput, StoreError> {
        Ok(self.result_stored_at(seq).await?.0)
    }

    /// [`Self::result_at`], with when the run log stored it (server time, Unix ms).
    pub async fn result_stored_at(&self, seq: u64) -> Result<(TaskResultInput, i64), StoreError> {
        let (entry, at_ms, stored_ms) = self.entry_stored_at(seq).await?;
        // A result a person gave, as the task's attempt `attempt`.
        let by_person = |task_id, attempt, by: &str, text| TaskResultInput {
            task_id,
            attempt,
            attempt_id: flotilla_machine::attempt_id(entry.run_id, 0, attempt, at_ms),
            worker: format!("human:{by}"),
            started_at: None,
            agent: None,
            result: flotilla_model::task::TaskResult::success(text),
            answered: false,
        };
        let result = match entry.input {
            RunInput::TaskResult(r) => Ok(*r),
            RunInput::ApprovalDecided(d) => match d.decision {
                flotilla_model::approval::Decision::Respond { result } => {
                    Ok(by_person(d.task_id, d.attempt, &d.by, result))
                }
                // A held result replaced on review with the person's edit.
                flotilla_model::approval::Decision::Edit { input } => {
                    let text = match input {
                        serde_json::Value::String(s) => s,
                        other => other.to_string(),
                    };
                    Ok(by_person(d.task_id, d.attempt, &d.by, text))
                }
                _ => Err(StoreError::new(
                    StoreErrorKind::Decode,
                    format!("run-log entry {seq} is an approval without a result"),
                )),
            },
            RunInput::Completed(c) => Ok(by_person(c.task_id, 0, &c.by, c.result)),
            _ => Err(StoreError::new(
                StoreErrorKind::Decode,
                format!("run-log entry {seq} is not a task result"),
            )),
        }?;
        Ok((result, stored_ms))
    }

    /// An approval's decision by run-log sequence (where an edited input is read).
    pub async fn approval_at(
        &self,
        seq: u64,
    ) -> Result<flotilla_model::approval::ApprovalDecided, StoreError> {
        Ok(self.decision_at(seq).await?.0)
    }

    /// An approval's decision by run-log sequence, with the entry's server time (Unix ms).
    pub async fn decision_at(
        &self,
        seq: u64,
    ) -> Result<(flotilla_model::approval::ApprovalDecided, i64), StoreError> {
        match self.entry_at(seq).await? {
            (
                RunLogEntry {
                    input: RunInput::ApprovalDecided(d),
                    ..
                },
                at_ms,
            ) => Ok((*d, at_ms)),
            _ => Err(StoreError::new(
                StoreErrorKind::Decode,
                format!("run-log entry {seq} is not an approval's decision"),
            )),
        }
    }

    /// An attempt's suspension by run-log sequence (the tool call it waits at).
    pub async fn suspension_at(
        &self,
        seq: u64,
    ) -> Result<flotilla_model::runlog::Suspended, StoreError> {
        match self.entry_at(seq).await?.0.input {
            RunInput::Suspended(s) => Ok(*s),
            _ => Err(StoreError::new(
                StoreErrorKind::Decode,
                format!("run-log entry {seq} is not an attempt's suspension"),
            )),
        }
    }

    /// Every entry of a run's log with its sequence and server time.
    pub async fn history(
        &self,
        run: RunId,
    ) -> Result<Vec<(u64, Timestamp, RunLogEntry)>, StoreError> {
        use async_nats::jetstream::consumer::{DeliverPolicy, pull};
        let submit_subject = self.bus.names().submit_run(run);
        let consumer = self
            .runlog
            .create_consumer(pull::OrderedConfig {
                filter_subjects: vec![submit_subject.clone(), self.bus.names().runlog(run)],
                deliver_policy: DeliverPolicy::All,
                ..Default::default()
            })
            .await
            .map_err(|e| nats("creating an ordered consumer", e))?;
        let mut out = Vec::new();
        if consumer.cached_info().num_pending == 0 {
            return Ok(out);
        }
        let mut messages = consumer
            .messages()
            .await
            .map_err(|e| nats("reading the run log", e))?;
        while let Some(msg) = messages.next().await {
            let msg = msg.map_err(|e| nats("reading the run log", e))?;
            let (seq, ts, pending) = {
                let i = msg.info().map_err(|e| {
                    decode_err("message info", std::io::Error::other(e.to_string()))
                })?;
                (i.stream_sequence, Timestamp(i.published), i.pending)
            };
            let entry: RunLogEntry = if msg.subject.as_str() == submit_subject
                && wire::header(msg.headers.as_ref(), wire::KIND_HEADER)
                    != Some(wire::KIND_RUNLOG_ENTRY)
            {
                // A durable submission: shown as the run's `submitted` entry (a `rejected`
                // entry follows when it was refused). One that cannot be decoded is left out:
                // the `rejected` entry after it names its problems.
                let Ok(request) = wire::decode::<SubmitRequest>(msg.headers.as_ref(), &msg.payload)
                else {
                    if pending == 0 {
                        break;
                    }
                    continue;
                };
                RunLogEntry {
                    protocol: flotilla_model::PROTOCOL_VERSION,
                    run_id: run,
                    input: RunInput::Submitted(Box::new(flotilla_model::runlog::Submitted {
                        plan: flotilla_model::validate::normalize_plan(
                            request.plan.unwrap_or_else(Plan::empty),
                        ),
                        labels: request.labels,
                        session_id: request.session_id,
                        parent: request.parent,
                        reply_to: request.reply_to,
                        wait_reply_to: None,
                        intake_seq: None,
                        warnings: Vec::new(),
                        trace: None,
                        planning: None,
                        depth: 0,
                        budget_scopes: Vec::new(),
                        anycast: false,
                        memory: None,
                        lead: None,
                        hitl: None,
                    })),
                }
            } else {
                wire::decode(msg.headers.as_ref(), &msg.payload)
                    .map_err(|e| decode_err(format!("run-log entry {seq}"), e))?
            };
            out.push((seq, ts, entry));
            if pending == 0 {
                break;
            }
        }
        Ok(out)
    }

    /// Ids of every run with a record (in no particular order).
    pub async fn list(&self) -> Result<Vec<RunId>, StoreError> {
        let mut keys = self.kv.keys().await.map_err(|e| nats("listing runs", e))?;
        let mut runs = Vec::new();
        while let Some(k) = keys.next().await {
            let k = k.map_err(|e| nats("listing runs", e))?;
            if let Ok(id) = k.parse::<RunId>() {
                runs.push(id);
            }
        }
        Ok(runs)
    }

    /// The `limit` most recently submitted runs, newest first, by the records' creation time
    /// (server time) — not by id, since clients may choose any UUID.
    pub async fn recent(&self, limit: usize) -> Result<Vec<RunRecord>, StoreError> {
        let mut records = Vec::new();
        for id in self.list().await? {
            if let Some(s) = self.load(id).await? {
                records.push(record_of(&s.snapshot.state));
            }
        }
        records.sort_by(|a, b| {
            b.created_at
                .unix_ms()
                .cmp(&a.created_at.unix_ms())
                .then(b.handle.run_id.cmp(&a.handle.run_id))
        });
        records.truncate(limit);
        Ok(records)
    }

    /// A run's record alone (no tasks, no plan read); `None` when the run does not exist.
    pub async fn record(&self, run: RunId) -> Result<Option<RunRecord>, StoreError> {
        match self.load(run).await? {
            Some(stored) => Ok(Some(record_of(&stored.snapshot.state))),
            None => Ok(self.unrecorded_view(run, 0, 0).await?.map(|v| v.record)),
        }
    }

    /// The client view of a run: its record and the tasks from `offset`, at most `limit`.
    pub async fn view(
        &self,
        run: RunId,
        offset: usize,
        limit: usize,
    ) -> Result<Option<RunView>, StoreError> {
        let Some(stored) = self.load(run).await? else {
            return self.unrecorded_view(run, offset, limit).await;
        };
        let state = &stored.snapshot.state;
        let plan = if state.tasks.is_empty() {
            None
        } else {
            self.plan_for(run, state).await?
        };
        let mut view = view_of(state, plan.as_ref(), offset, limit);
        if state
            .planning
            .as_ref()
            .is_some_and(|p| p.status == PlanningStatus::Planned)
        {
            // The planned plan is what a client of a bare query wants to see.
            view.plan = plan;
        }
        Ok(Some(view))
    }

    /// The view of a run that has a first message but no record yet (see
    /// [`Self::unrecorded_state`]).
    async fn unrecorded_view(
        &self,
        run: RunId,
        offset: usize,
        limit: usize,
    ) -> Result<Option<RunView>, StoreError> {
        Ok(self
            .unrecorded_state(run)
            .await?
            .map(|(state, plan)| view_of(&state, plan.as_ref(), offset, limit)))
    }

    /// A run's state: its record or, when it has none yet, [`Self::unrecorded_state`].
    pub async fn state(&self, run: RunId) -> Result<Option<RunState>, StoreError> {
        match self.load(run).await? {
            Some(stored) => Ok(Some(stored.snapshot.state)),
            None => Ok(self.unrecorded_state(run).await?.map(|(state, _)| state)),
        }
    }

    /// The state of a run that has a first message but no record yet, with its plan. A
    /// coordinator's `submitted` entry was validated: the run is rebuilt as a coordinator
    /// would rebuild it (status `running`; its start is performed before it is recorded). A
    /// client's own submission is not validated yet, so nothing about its fate is known: the
    /// run is `pending`, with no tasks.
    async fn unrecorded_state(
        &self,
        run: RunId,
    ) -> Result<Option<(RunState, Option<Plan>)>, StoreError> {
        let Some(first) = self.first_message(run).await? else {
            return Ok(None);
        };
        let submitted = match first.content {
            FirstMessage::Submission { request, .. } => {
                let state = RunState::pending(
                    run,
                    first.ts_ms,
                    request.plan_name(),
                    request.labels,
                    request.session_id,
                    request.parent,
                );
                return Ok(Some((state, None)));
            }
            FirstMessage::Unreadable(_) => {
                let state =
                    RunState::pending(run, first.ts_ms, None, Default::default(), None, None);
                return Ok(Some((state, None)));
            }
            FirstMessage::Entry(RunLogEntry {
                input: RunInput::Submitted(s),
                ..
            }) => *s,
            FirstMessage::Entry(_) => return Ok(None),
        };
        let plan = std::sync::Arc::new(submitted.plan.clone());
        let (machine, _) = flotilla_machine::RunMachine::start(run, &submitted, plan, first.ts_ms);
        Ok(Some((machine.state().clone(), Some(submitted.plan))))
    }

    /// The run an idempotency key names, if it was claimed.
    pub async fn idempotency_run(&self, key: &str) -> Result<Option<RunId>, StoreError> {
        let value = self
            .kv
            .get(idempotency_kv_key(key))
            .await
            .map_err(|e| nats("reading an idempotency key", e))?;
        value
            .map(|v| {
                String::from_utf8_lossy(&v)
                    .parse::<RunId>()
                    .map_err(|e| decode_err("idempotency key value", e))
            })
            .transpose()
    }

    /// The bus.
    pub fn bus(&self) -> &Bus {
        &self.bus
    }
}
