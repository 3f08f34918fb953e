//! Projections of a run tree's events for one audience ([`flotilla_model::watch`]): the
//! engine behind the client library's `watch`, `flotilla watch` and the `api.watch` endpoint,
//! so all three show the same events in the same order.
//!
//! Every run's events are in one stream (`FLOTILLA_EVENTS`, subject per run), so the stream
//! sequence orders the events of a whole tree. The engine reads the runs it follows — the
//! watched run, and under `flatten` every descendant it has seen linked — through **one**
//! ordered consumer filtered on their subjects, and shows their events in stream order:
//! children running side by side are interleaved live, as they happen.
//!
//! A child's link (`agent_run_started`) is usually stored *after* the child's first events
//! (the parent announces a child once it has started). So when a link is read at position P
//! (the sequence of the last message the consumer delivered), the child's messages up to P are
//! read from the stream leader, one by one (few: the child has just started), and shown right
//! after the link; then the consumer is re-created from P + 1 with the child's subject added,
//! and from then on everything interleaves in stream order. Each followed run keeps the last
//! sequence read, so nothing is shown twice. Every decision depends only on what the stream
//! holds up to P, never on timing, so the same streams always give the same projection — the
//! client library and the server-side `api.watch` agree event for event.
//!
//! **`run_started` first.** A run's start is recorded lazily (with the run's next step), so
//! its workers' first events (`task_started`, a child's link, replies) may be stored before
//! its `run_started`. Until a run's `run_started` (or, for a run that never started, its end)
//! is read, its events are held back; then `run_started` is shown and the held events right
//! after it, in stream order. Whether an event is held depends only on the messages of its
//! run stored before it, so this too is the same on every read.
//!
//! The projection ends when every followed run has ended: the watched run and, under
//! `flatten`, each child shown (a child a failed parent left behind is cancelled, and its end
//! is shown). A run's events after its end (late events of a cancelled attempt) are not shown.
//!
//! **Resuming.** An event's cursor is `(seq, index)`: the stream sequence of its message and
//! its position in the message (a message carries every event of one step, so several share
//! a `seq`). The projection's order is not the stream's (`run_started` moves ahead of held
//! events; a child's earlier events follow its link), so a resumed watch replays the
//! projection from the start and shows nothing up to and including the cursor's event —
//! the same order either way, so exactly the events after it are shown. A cursor without an
//! index (older clients) stands for the last event of its message.

use std::collections::{HashMap, HashSet, VecDeque};

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use async_nats::jetstream::stream::{RawMessageErrorKind, Stream as JsStream};
use flotilla_bus::{Bus, wire};
use flotilla_model::RunId;
use flotilla_model::event::{Event, EventEnvelope, WorkflowPhase, decode_events};
use flotilla_model::subjects::StreamKind;
use flotilla_model::watch::{ChildPolicy, Profile, ProjectedEvent, shows};
use futures::{Stream, StreamExt};

use crate::error::{WatchError, WatchErrorKind};

/// What to project.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WatchOptions {
    /// Which events.
    pub profile: Profile,
    /// How children show.
    pub children: ChildPolicy,
    /// Resume after the event with this `seq` (that of the last event received; 0: from the
    /// start) ...
    pub since: u64,
    /// ... and this `index`; `None`: after the last event of message `since`.
    pub since_index: Option<u32>,
}

type Messages = async_nats::jetstream::consumer::pull::Ordered;

/// A run the projection follows.
struct Followed {
    depth: u32,
    agent: Option<String>,
    /// The stream sequence of the last message of this run read (shown or skipped): any
    /// message of the run at or below it is a repeat after a re-created consumer.
    read_upto: u64,
    /// Its run-terminal event was read.
    ended: bool,
    /// Its `run_started` (or its end) was read: its events are no longer held back.
    started: bool,
    /// Its events read before it started, in stream order: shown right after `run_started`.
    held: Vec<Item>,
    /// Event ids read, for de-duplication (a retried publish may store an event twice).
    seen: HashSet<String>,
}

/// An event read, with its position.
struct Item {
    /// The stream sequence of its message.
    seq: u64,
    /// Its position in the message.
    index: u32,
    /// It is the message's last event.
    last: bool,
    run: RunId,
    envelope: EventEnvelope,
}

/// Where a resumed projection starts showing: after the event at `seq` and `index` (`None`:
/// the last event of message `seq`).
#[derive(Debug, Clone, Copy)]
struct Cursor {
    seq: u64,
    index: Option<u32>,
}

impl Cursor {
    fn is(&self, item: &Item) -> bool {
        item.seq == self.seq && self.index.map_or(item.last, |i| i == item.index)
    }
}

struct State {
    bus: Bus,
    stream: JsStream,
    /// Names this projection's consumers, numbered by `serial`.
    watch_id: String,
    serial: u64,
    opts: WatchOptions,
    /// Resuming: nothing is shown until this event has been passed.
    resume_after: Option<Cursor>,
    runs: HashMap<RunId, Followed>,
    messages: Option<Messages>,
    /// Events read, in the projection's order, to be shown (or skipped).
    buffered: VecDeque<Item>,
    /// The sequence of the last message the consumer delivered.
    position: u64,
    /// Re-create the consumer from `position + 1` once the buffer is drained (a child was
    /// linked).
    reopen: bool,
    done: bool,
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> WatchError {
    WatchError::new(WatchErrorKind::Unavailable, format!("{what}: {e}"))
}

/// The event stream.
async fn event_stream(bus: &Bus) -> Result<JsStream, WatchError> {
    let name = bus.names().stream(StreamKind::Events);
    bus.js()
        .get_stream(&name)
        .await
        .map_err(|e| unavailable(&format!("opening {name}"), e))
}

/// An ordered consumer named `name` on `subjects` of the event stream, from stream sequence
/// `from`.
async fn open(
    stream: &JsStream,
    name: &str,
    subjects: Vec<String>,
    from: u64,
) -> Result<Messages, WatchError> {
    let mut config = pull::OrderedConfig {
        name: Some(name.to_owned()),
        deliver_policy: if from <= 1 {
            DeliverPolicy::All
        } else {
            DeliverPolicy::ByStartSequence {
                start_sequence: from,
            }
        },
        ..Default::default()
    };
    match <[String; 1]>::try_from(subjects) {
        Ok([one]) => config.filter_subject = one,
        Err(many) => config.filter_subjects = many,
    }
    let consumer = stream
        .create_consumer(config)
        .await
        .map_err(|e| unavailable("following a run tree's events", e))?;
    consumer
        .messages()
        .await
        .map_err(|e| unavailable("following a run tree's events", e))
}

impl Drop for State {
    fn drop(&mut self) {
        // The last consumer goes with the projection.
        if self.messages.take().is_some() {
            self.delete_consumer();
        }
    }
}

impl State {
    /// The name of the consumer now reading (`flwatch-<watch>-<n>`).
    fn consumer_name(&self) -> String {
        format!("flwatch-{}-{}", self.watch_id, self.serial)
    }

    /// Deletes the consumer now reading, in the background (best effort): the stream allows a
    /// limited number, and one the projection no longer reads would otherwise stay until the
    /// server's inactivity threshold. A reader without the right to delete is not held up.
    fn delete_consumer(&self) {
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (stream, name) = (self.stream.clone(), self.consumer_name());
            rt.spawn(async move {
                let _ = stream.delete_consumer(&name).await;
            });
        }
    }

    fn follow(&mut self, run: RunId, depth: u32, agent: Option<String>, read_upto: u64) {
        self.runs.insert(
            run,
            Followed {
                depth,
                agent,
                read_upto,
                ended: false,
                started: false,
                held: Vec::new(),
                seen: HashSet::new(),
            },
        );
    }

    /// Re-creates the consumer on the runs still followed, from `from`.
    async fn reopen(&mut self, from: u64) -> Result<(), WatchError> {
        let mut subjects: Vec<String> = self
            .runs
            .iter()
            .filter(|(_, f)| !f.ended)
            .map(|(run, _)| self.bus.names().event(*run))
            .collect();
        subjects.sort();
        self.messages = None;
        self.delete_consumer();
        if subjects.is_empty() {
            return Ok(());
        }
        self.serial += 1;
        self.messages = Some(open(&self.stream, &self.consumer_name(), subjects, from).await?);
        Ok(())
    }

    fn all_ended(&self) -> bool {
        self.runs.values().all(|f| f.ended)
    }

    /// Reads the next message of a followed run into the buffer.
    async fn read(&mut self) -> Result<(), WatchError> {
        let Some(messages) = self.messages.as_mut() else {
            return Err(unavailable(
                "following a run tree's events",
                "no run left to follow",
            ));
        };
        let m = match messages.next().await {
            None => {
                return Err(unavailable(
                    "following a run tree's events",
                    "the event stream ended",
                ));
            }
            Some(Err(e)) => return Err(unavailable("reading a run tree's events", e)),
            Some(Ok(m)) => m,
        };
        let seq = m.info().map(|i| i.stream_sequence).unwrap_or(0);
        self.position = self.position.max(seq);
        // `<prefix>.event.<run>`: the consumer reads followed runs' subjects only.
        if let Some(run) = m.subject.rsplit('.').next().and_then(|t| t.parse().ok()) {
            self.admit(run, seq, m.headers.as_ref(), &m.payload);
        }
        Ok(())
    }

    /// Reads `child`'s messages up to `position` from the stream leader (direct gets may be
    /// answered by a lagging replica), one by one: a child linked a moment ago has few.
    async fn catch_up(&mut self, child: RunId) -> Result<(), WatchError> {
        let subject = self.bus.names().event(child);
        let mut next = self.runs.get(&child).map_or(0, |f| f.read_upto) + 1;
        while next <= self.position {
            let m = match self
                .stream
                .raw_message_builder()
                .sequence(next)
                .next_by_subject(subject.clone())
                .send()
                .await
            {
                Ok(m) => m,
                Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => break,
                Err(e) => return Err(unavailable("reading a child run's events", e)),
            };
            if m.sequence > self.position {
                break;
            }
            next = m.sequence + 1;
            self.admit(child, m.sequence, Some(&m.headers), &m.payload);
        }
        Ok(())
    }

    /// Puts a message of followed run `run` into the buffer, unless it was read already or
    /// the run has ended. A run's events before its `run_started` are held back and follow
    /// it (a run that ends without starting — rejected — shows them before its end).
    fn admit(&mut self, run: RunId, seq: u64, headers: Option<&HeaderMap>, payload: &[u8]) {
        let Some(f) = self.runs.get_mut(&run) else {
            return;
        };
        if seq <= f.read_upto || f.ended {
            return;
        }
        f.read_upto = seq;
        let events = match decode_events(wire::codec_of(headers), payload) {
            Ok(events) => events,
            Err(e) => {
                tracing::warn!(%run, error = %e, "Skipping an undecodable event message");
                return;
            }
        };
        let count = events.len();
        for (index, envelope) in events.into_iter().enumerate() {
            let item = Item {
                seq,
                index: u32::try_from(index).unwrap_or(u32::MAX),
                last: index + 1 == count,
                run,
                envelope,
            };
            if f.started {
                self.buffered.push_back(item);
                continue;
            }
            match &item.envelope.event {
                Event::Workflow(w) if w.phase == WorkflowPhase::RunStarted => {
                    f.started = true;
                    self.buffered.push_back(item);
                    self.buffered.extend(f.held.drain(..));
                }
                Event::Workflow(w) if w.phase.ends_run() => {
                    f.started = true;
                    self.buffered.extend(f.held.drain(..));
                    self.buffered.push_back(item);
                }
                _ => f.held.push(item),
            }
        }
    }

    async fn next(&mut self) -> Option<Result<ProjectedEvent, WatchError>> {
        loop {
            if self.done {
                return None;
            }
            let Some(item) = self.buffered.pop_front() else {
                if self.all_ended() {
                    self.done = true;
                    return self.resume_after.take().map(|c| {
                        Err(WatchError::new(
                            WatchErrorKind::Unavailable,
                            format!(
                                "since {} (index {}) names no event of this projection: resume with the seq and index of an event it delivered",
                                c.seq,
                                c.index.map_or_else(|| "none".to_owned(), |i| i.to_string())
                            ),
                        ))
                    });
                }
                if std::mem::take(&mut self.reopen)
                    && let Err(e) = self.reopen(self.position + 1).await
                {
                    self.done = true;
                    return Some(Err(e));
                }
                if let Err(e) = self.read().await {
                    self.done = true;
                    return Some(Err(e));
                }
                continue;
            };
            // Resuming: the events up to the cursor's were delivered before. They still
            // count (links followed, ends), exactly as when they were shown.
            let shown = match self.resume_after {
                Some(c) => {
                    if c.is(&item) {
                        self.resume_after = None;
                    }
                    false
                }
                None => true,
            };
            let Some(f) = self.runs.get_mut(&item.run) else {
                continue;
            };
            if f.ended || !f.seen.insert(item.envelope.id.clone()) {
                continue;
            }
            let (depth, agent) = (f.depth, f.agent.clone());
            if matches!(&item.envelope.event, Event::Workflow(w) if w.phase.ends_run()) {
                f.ended = true;
            }
            if let Event::AgentRunStarted { child, agent } = &item.envelope.event
                && self.opts.children == ChildPolicy::Flatten
                && !self.runs.contains_key(&child.run_id)
            {
                // The child's messages up to the current position come right after its link
                // (read from the stream now, ahead of what is buffered: the rest of the
                // parent's message may hold later events, its end even), then the consumer
                // follows it too.
                let child = child.run_id;
                self.follow(child, depth + 1, agent.clone(), 0);
                let rest = std::mem::take(&mut self.buffered);
                if let Err(e) = self.catch_up(child).await {
                    self.done = true;
                    return Some(Err(e));
                }
                self.buffered.extend(rest);
                self.reopen = true;
            }
            if shown
                && shows(
                    self.opts.profile,
                    self.opts.children,
                    depth,
                    &item.envelope.event,
                )
            {
                return Some(Ok(ProjectedEvent {
                    run_id: item.run,
                    depth,
                    agent,
                    seq: item.seq,
                    index: item.index,
                    event: item.envelope,
                }));
            }
        }
    }
}

/// The projection of `run`'s tree under `opts`, live: it ends once the watched run and every
/// child it shows have ended.
pub async fn project(
    bus: Bus,
    run: RunId,
    opts: WatchOptions,
) -> Result<impl Stream<Item = Result<ProjectedEvent, WatchError>> + Send + use<>, WatchError> {
    let stream = event_stream(&bus).await?;
    // The projection's order is not the stream's, so a resumed projection is replayed from
    // the start, showing nothing up to the cursor.
    let resume_after = (opts.since > 0).then_some(Cursor {
        seq: opts.since,
        index: opts.since_index,
    });
    let watch_id = uuid::Uuid::new_v4().simple().to_string();
    let messages = open(
        &stream,
        &format!("flwatch-{watch_id}-0"),
        vec![bus.names().event(run)],
        1,
    )
    .await?;
    let mut state = State {
        bus,
        stream,
        watch_id,
        serial: 0,
        opts,
        resume_after,
        runs: HashMap::new(),
        messages: Some(messages),
        buffered: VecDeque::new(),
        position: 0,
        reopen: false,
        done: false,
    };
    state.follow(run, 0, None, 0);
    Ok(futures::stream::unfold(state, |mut s| async move {
        s.next().await.map(|item| (item, s))
    }))
}
