//! Run state in JetStream.
//!
//! * `flotilla-runs` KV, key `<run>`: the [`Snapshot`] (MessagePack) — scheduling state plus
//!   the actions of the last change (the outbox). Updated with compare-and-set on the KV
//!   revision, so two coordinators can never both apply a change to the same run.
//! * `flotilla-runs` KV, key `idem.<hash>`: idempotency key → run id.
//! * The run log: the plan is the first entry of `<prefix>.runlog.<run>` (`submitted`), and
//!   task results are read back by sequence number with direct get.

use async_nats::jetstream::kv;
use async_nats::jetstream::stream::Stream;
use bytes::Bytes;
use flotilla_bus::Bus;
use flotilla_bus::wire;
use flotilla_model::ids::{RunId, SessionId};
use flotilla_model::plan::Plan;
use flotilla_model::run::{PlanningStatus, PlanningView, RunHandle, RunRecord, RunView};
use flotilla_model::runlog::{PlanDecision, RunInput, RunLogEntry, TaskResultInput};
use flotilla_model::subjects::{Bucket, StreamKind};
use flotilla_model::submit::SubmitRequest;
use flotilla_model::time::Timestamp;
use futures::StreamExt;
use serde::{Deserialize, Serialize};

use crate::error::{StoreError, StoreErrorKind};
use crate::machine::{Action, RunState};

/// What is stored per run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// The state.
    pub state: RunState,
    /// Actions decided by the last change; re-performed (idempotently) when a coordinator
    /// cannot tell whether the writer performed them before it stopped.
    #[serde(default)]
    pub outbox: Vec<Action>,
    /// Run-log sequences of the inputs that produced the outbox.
    #[serde(default)]
    pub outbox_seqs: Vec<u64>,
}

/// A snapshot to write, borrowed from the live state (same encoding as [`Snapshot`]).
#[derive(Debug, Serialize)]
pub struct SnapshotRef<'a> {
    /// The state.
    pub state: &'a RunState,
    /// The outbox.
    pub outbox: &'a [Action],
    /// Inputs that produced it.
    pub outbox_seqs: &'a [u64],
}

/// The first message of a run's history.
#[derive(Debug, Clone)]
pub struct First {
    /// Its stream sequence.
    pub seq: u64,
    /// Its server time, Unix ms.
    pub ts_ms: i64,
    /// What it is.
    pub content: FirstMessage,
}

/// What a run's first message is.
#[derive(Debug, Clone)]
pub enum FirstMessage {
    /// A durable submission on `<prefix>.submit.<run>`, with the trace it came with.
    Submission {
        /// The submission.
        request: Box<SubmitRequest>,
        /// Its trace context.
        trace: flotilla_model::task::TraceContext,
    },
    /// A run-log entry (`submitted` or `rejected`).
    Entry(RunLogEntry),
    /// A client's own submission that cannot be decoded: the run is rejected with these
    /// problems.
    Unreadable(UnreadableSubmission),
}

/// A client's submission on `<prefix>.submit.<run>` that does not decode, with what can
/// still be read of it.
#[derive(Debug, Clone, PartialEq)]
pub struct UnreadableSubmission {
    /// Its codec.
    pub codec: flotilla_model::codec::Codec,
    /// Its bytes, for the full list of its problems
    /// ([`flotilla_model::submit::decode_problems`], which needs the deployment's validation
    /// context).
    pub payload: Bytes,
    /// Where its submitter waits for the answer (a publishable subject), if it says.
    pub reply_to: Option<String>,
}

impl UnreadableSubmission {
    /// Reads what can be read of an undecodable submission.
    pub fn of(headers: Option<&async_nats::HeaderMap>, payload: &Bytes) -> Self {
        let loose = crate::intake::loose_fields(headers, payload, None);
        Self {
            codec: wire::codec_of(headers),
            payload: payload.clone(),
            reply_to: loose
                .reply_to
                .filter(|s| flotilla_model::token::check_subject(s).is_ok()),
        }
    }
}

/// A snapshot as read, with its revision and server write time.
#[derive(Debug, Clone)]
pub struct StoredSnapshot {
    /// The snapshot.
    pub snapshot: Snapshot,
    /// KV revision, for compare-and-set.
    pub revision: u64,
    /// Server time of the write, Unix ms.
    pub written_ms: i64,
}

/// Most entries one batch read of a consumed topic asks for.
const TOPIC_PAGE: usize = 256;

/// Most bytes one batch read of a consumed topic asks for.
const TOPIC_PAGE_BYTES: usize = 4 * 1024 * 1024;

/// Access to run state.
#[derive(Clone, Debug)]
pub struct RunStore {
    kv: kv::Store,
    runlog: Stream,
    state: kv::Store,
    bus: Bus,
}

fn nats(
    detail: impl Into<String>,
    e: impl std::error::Error + Send + Sync + 'static,
) -> StoreError {
    StoreError::with_source(StoreErrorKind::Nats, detail, e)
}

/// A run's snapshot as stored at `revision`, written at `created` (both reads decode alike).
fn stored_snapshot(
    run: RunId,
    payload: &[u8],
    revision: u64,
    created: time::OffsetDateTime,
) -> Result<StoredSnapshot, StoreError> {
    let snapshot: Snapshot =
        rmp_serde::from_slice(payload).map_err(|e| decode_err(format!("run {run} snapshot"), e))?;
    Ok(StoredSnapshot {
        snapshot,
        revision,
        written_ms: unix_ms(created),
    })
}

fn decode_err(
    detail: impl Into<String>,
    e: impl std::error::Error + Send + Sync + 'static,
) -> StoreError {
    StoreError::with_source(StoreErrorKind::Decode, detail, e)
}

/// The session-index key of `run` in `session`.
fn session_key(session: SessionId, run: RunId) -> String {
    format!("session.{session}.{run}")
}

/// Unix milliseconds of a server timestamp.
pub fn unix_ms(t: time::OffsetDateTime) -> i64 {
    (t.unix_timestamp_nanos() / 1_000_000) as i64
}

impl RunStore {
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

    /// The runs bucket (tree counters live beside the records).
    pub(crate) fn runs_bucket(&self) -> &kv::Store {
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

    fn encode<T: Serialize>(&self, snapshot: &T) -> Result<bytes::Bytes, StoreError> {
        let bytes = rmp_serde::to_vec_named(snapshot)
            .map(bytes::Bytes::from)
            .map_err(|e| decode_err("encoding a snapshot", e))?;
        let max = self.bus.max_payload().saturating_sub(1024);
        if bytes.len() > max {
            return Err(StoreError::new(
                StoreErrorKind::TooLarge,
                format!(
                    "the run record is {} bytes; this deployment's messages hold at most {max}",
                    bytes.len()
                ),
            ));
        }
        Ok(bytes)
    }

    /// Creates a run's snapshot; fails with `AlreadyExists` if there is one. A run with a
    /// session is entered in the session index first, so no recorded run is missing from it
    /// (a crash in between leaves an index key whose run is recorded on the retry).
    pub async fn create(&self, run: RunId, snapshot: &SnapshotRef<'_>) -> Result<u64, StoreError> {
        if let Some(session) = snapshot.state.session_id {
            self.index_session(session, run).await?;
        }
        self.kv
            .create(run.to_string(), self.encode(snapshot)?)
            .await
            .map_err(|e| {
                if e.kind() == kv::CreateErrorKind::AlreadyExists {
                    StoreError::with_source(StoreErrorKind::AlreadyExists, format!("run {run}"), e)
                } else {
                    nats(format!("creating run {run}"), e)
                }
            })
    }

    /// Enters `run` in `session`'s index (`session.<session>.<run>` in the runs bucket). A
    /// repeat (a replayed start) leaves the key where it is, so the index stays in creation
    /// order.
    pub async fn index_session(&self, session: SessionId, run: RunId) -> Result<(), StoreError> {
        match self
            .kv
            .create(session_key(session, run), Bytes::new())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(nats(format!("indexing run {run} in session {session}"), e)),
        }
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

    /// Replaces a run's snapshot if it is still at `revision`; `Conflict` otherwise.
    pub async fn update<T: Serialize>(
        &self,
        run: RunId,
        snapshot: &T,
        revision: u64,
    ) -> Result<u64, StoreError> {
        self.kv
            .update(run.to_string(), self.encode(snapshot)?, revision)
            .await
            .map_err(|e| {
                if e.kind() == kv::UpdateErrorKind::WrongLastRevision {
                    StoreError::with_source(StoreErrorKind::Conflict, format!("run {run}"), e)
                } else {
                    nats(format!("updating run {run}"), e)
                }
            })
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
                    trace: crate::intake::trace_from(Some(&msg.headers), run),
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
        let msg = self
            .runlog
            .direct_get(plan_seq)
            .await
            .map_err(|e| nats(format!("reading run-log entry {plan_seq}"), e))?;
        let entry: RunLogEntry = wire::decode(Some(&msg.headers), &msg.payload)
            .map_err(|e| decode_err(format!("run-log entry {plan_seq}"), e))?;
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
            _ => Err(StoreError::new(
                StoreErrorKind::Decode,
                format!("run-log entry {plan_seq} is not a planned plan of {run}"),
            )),
        }
    }

    /// A task result by run-log sequence.
    pub async fn result_at(&self, seq: u64) -> Result<TaskResultInput, StoreError> {
        let msg = self
            .runlog
            .direct_get(seq)
            .await
            .map_err(|e| nats(format!("reading run-log entry {seq}"), e))?;
        let entry: RunLogEntry = wire::decode(Some(&msg.headers), &msg.payload)
            .map_err(|e| decode_err(format!("run-log entry {seq}"), e))?;
        match entry.input {
            RunInput::TaskResult(r) => Ok(*r),
            _ => Err(StoreError::new(
                StoreErrorKind::Decode,
                format!("run-log entry {seq} is not a task result"),
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
            self.plan_of(run, state.plan_seq).await?
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

    /// The view of a run that has a first message but no record yet. A coordinator's
    /// `submitted` entry was validated: the run is rebuilt as a coordinator would rebuild it
    /// (status `running`). A client's own submission is not validated yet, so nothing about its
    /// fate is known: the run is `pending`, with no tasks.
    async fn unrecorded_view(
        &self,
        run: RunId,
        offset: usize,
        limit: usize,
    ) -> Result<Option<RunView>, StoreError> {
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
                return Ok(Some(view_of(&state, None, offset, limit)));
            }
            FirstMessage::Unreadable(_) => {
                let state =
                    RunState::pending(run, first.ts_ms, None, Default::default(), None, None);
                return Ok(Some(view_of(&state, None, offset, limit)));
            }
            FirstMessage::Entry(RunLogEntry {
                input: RunInput::Submitted(s),
                ..
            }) => *s,
            FirstMessage::Entry(_) => return Ok(None),
        };
        let plan = std::sync::Arc::new(submitted.plan.clone());
        let (machine, _) = crate::machine::RunMachine::start(run, &submitted, plan, first.ts_ms);
        Ok(Some(view_of(
            machine.state(),
            Some(&submitted.plan),
            offset,
            limit,
        )))
    }

    /// The run an idempotency key names, if it was claimed.
    pub async fn idempotency_run(&self, key: &str) -> Result<Option<RunId>, StoreError> {
        let hashed = uuid::Uuid::new_v5(&IDEMPOTENCY_NAMESPACE, key.as_bytes());
        let value = self
            .kv
            .get(format!("idem.{}", hashed.simple()))
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

    /// Maps an idempotency key to a run id: the first caller's `candidate` wins; later callers
    /// get that id back. Returns `(run id, whether it was new)`.
    pub async fn claim_idempotency_key(
        &self,
        key: &str,
        candidate: RunId,
    ) -> Result<(RunId, bool), StoreError> {
        let hashed = uuid::Uuid::new_v5(&IDEMPOTENCY_NAMESPACE, key.as_bytes());
        let kv_key = format!("idem.{}", hashed.simple());
        match self.kv.create(&kv_key, candidate.to_string().into()).await {
            Ok(_) => Ok((candidate, true)),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                let existing = self
                    .kv
                    .get(&kv_key)
                    .await
                    .map_err(|e| nats("reading an idempotency key", e))?
                    .ok_or_else(|| {
                        StoreError::new(StoreErrorKind::NotFound, "idempotency key vanished")
                    })?;
                let text = String::from_utf8_lossy(&existing).into_owned();
                let id = text
                    .parse::<RunId>()
                    .map_err(|e| decode_err("idempotency key value", e))?;
                Ok((id, false))
            }
            Err(e) => Err(nats("claiming an idempotency key", e)),
        }
    }

    /// The bus.
    pub fn bus(&self) -> &Bus {
        &self.bus
    }

    /// Stores `bytes` as object `name` in the artifacts store and returns its reference.
    /// Idempotent: the same name and content give the same reference.
    pub async fn put_artifact(
        &self,
        name: &str,
        bytes: Vec<u8>,
    ) -> Result<flotilla_model::artifact::ArtifactRef, StoreError> {
        use sha2::Digest;
        let bucket = self.bus.names().artifacts_bucket();
        let store = self
            .bus
            .js()
            .get_object_store(&bucket)
            .await
            .map_err(|e| nats(format!("opening object store {bucket}"), e))?;
        let sha256 = format!("{:x}", sha2::Sha256::digest(&bytes));
        let size = bytes.len() as u64;
        let mut reader = std::io::Cursor::new(bytes);
        store
            .put(name, &mut reader)
            .await
            .map_err(|e| nats(format!("storing artifact {name}"), e))?;
        Ok(flotilla_model::artifact::ArtifactRef {
            bucket,
            name: name.to_owned(),
            size,
            sha256,
        })
    }
}

/// Namespace of idempotency-key hashes.
const IDEMPOTENCY_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x6c0f_5a1e_7b1d_4e8a_9f3c_2d1a_0b9e_8f7d);

/// The client view of a run state, with the tasks from `offset`, at most `limit`.
pub fn view_of(state: &RunState, plan: Option<&Plan>, offset: usize, limit: usize) -> RunView {
    RunView {
        record: record_of(state),
        tasks: state.task_views(plan, offset, limit),
        tasks_offset: offset.min(u32::MAX as usize) as u32,
        plan: None,
    }
}

/// The public record of a run state.
pub fn record_of(state: &RunState) -> RunRecord {
    RunRecord {
        handle: state.parent.as_ref().map_or_else(
            || RunHandle::root(state.run_id),
            |p| RunHandle {
                run_id: state.run_id,
                agent_id: None,
                parent_run_id: Some(p.run_id),
                parent_tool_call_id: p.parent_tool_call_id.clone(),
                parent_task_id: p.parent_task_id.clone(),
                root_run_id: Some(p.root_run()),
            },
        ),
        name: state.name.clone(),
        status: state.status,
        labels: state.labels.clone(),
        session_id: state.session_id,
        created_at: Timestamp::from_unix_ms(state.created_ms),
        finished_at: state.finished_ms.map(Timestamp::from_unix_ms),
        tasks: state.counts(),
        errors: state.errors.clone(),
        warnings: state.warnings.clone(),
        outcome: state.outcome.clone(),
        strategy: state.strategy.clone(),
        planning: state.planning.as_ref().map(|p| PlanningView {
            round: p.round,
            max_repairs: p.max_repairs,
            status: p.status,
        }),
    }
}
