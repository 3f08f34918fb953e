//! Projections of a run tree's events for one audience ([`flotilla_model::watch`]): the
//! engine behind the client library's `watch`, `flotilla watch` and the `api.watch` endpoint,
//! so all three show the same events in the same order.
//!
//! One ordered consumer per run being read. Under `flatten`, the reader keeps a stack: the
//! run on top is read until its end; a child's link (`agent_run_started`) pushes the child,
//! whose events are shown — one level deeper — until its run-terminal event pops it. The
//! watched run's terminal event ends the projection.

use std::collections::{HashSet, VecDeque};

use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use flotilla_bus::{Bus, wire};
use flotilla_model::RunId;
use flotilla_model::event::{Event, EventEnvelope, decode_events};
use flotilla_model::subjects::StreamKind;
use flotilla_model::watch::{ChildPolicy, Profile, ProjectedEvent, shows};
use futures::{Stream, StreamExt};

use crate::error::{CoordinatorError, CoordinatorErrorKind};

/// What to project.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WatchOptions {
    /// Which events.
    pub profile: Profile,
    /// How children show.
    pub children: ChildPolicy,
    /// Start after this sequence of the watched run's stream (0: from its start).
    pub since: u64,
}

type Messages = async_nats::jetstream::consumer::pull::Ordered;

/// One run being read.
struct Reader {
    run: RunId,
    depth: u32,
    agent: Option<String>,
    messages: Messages,
    buffered: VecDeque<(u64, EventEnvelope)>,
    seen: HashSet<String>,
}

struct State {
    bus: Bus,
    opts: WatchOptions,
    stack: Vec<Reader>,
    followed: HashSet<RunId>,
    done: bool,
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> CoordinatorError {
    CoordinatorError::new(CoordinatorErrorKind::Watch, format!("{what}: {e}"))
}

async fn open(bus: &Bus, run: RunId, since: u64) -> Result<Messages, CoordinatorError> {
    let name = bus.names().stream(StreamKind::Events);
    let stream = bus
        .js()
        .get_stream(&name)
        .await
        .map_err(|e| unavailable(&format!("opening {name}"), e))?;
    let consumer = stream
        .create_consumer(pull::OrderedConfig {
            filter_subject: bus.names().event(run),
            deliver_policy: if since == 0 {
                DeliverPolicy::All
            } else {
                DeliverPolicy::ByStartSequence {
                    start_sequence: since + 1,
                }
            },
            ..Default::default()
        })
        .await
        .map_err(|e| unavailable("following a run's events", e))?;
    consumer
        .messages()
        .await
        .map_err(|e| unavailable("following a run's events", e))
}

impl State {
    async fn next(&mut self) -> Option<Result<ProjectedEvent, CoordinatorError>> {
        loop {
            if self.done {
                return None;
            }
            let top = self.stack.last_mut()?;
            let Some((seq, envelope)) = top.buffered.pop_front() else {
                match top.messages.next().await {
                    None => {
                        return Some(Err(unavailable(
                            "following a run's events",
                            "the event stream ended",
                        )));
                    }
                    Some(Err(e)) => return Some(Err(unavailable("reading a run's events", e))),
                    Some(Ok(m)) => {
                        let seq = m.info().map(|i| i.stream_sequence).unwrap_or(0);
                        match decode_events(wire::codec_of(m.headers.as_ref()), &m.payload) {
                            Ok(events) => top.buffered.extend(events.into_iter().map(|e| (seq, e))),
                            Err(e) => {
                                tracing::warn!(run = %top.run, error = %e, "Skipping an undecodable event message");
                            }
                        }
                    }
                }
                continue;
            };
            if !top.seen.insert(envelope.id.clone()) {
                continue;
            }
            let (run, depth, agent) = (top.run, top.depth, top.agent.clone());
            let ends = matches!(&envelope.event, Event::Workflow(w) if w.phase.ends_run());
            let child = match &envelope.event {
                Event::AgentRunStarted { child, agent }
                    if self.opts.children == ChildPolicy::Flatten
                        && self.followed.insert(child.run_id) =>
                {
                    Some((child.clone(), agent.clone()))
                }
                _ => None,
            };
            let show = shows(
                self.opts.profile,
                self.opts.children,
                depth,
                &envelope.event,
            );
            if ends {
                self.stack.pop();
                if depth == 0 {
                    self.done = true;
                }
            }
            if let Some((child, child_agent)) = child {
                match open(&self.bus, child.run_id, 0).await {
                    Ok(messages) => self.stack.push(Reader {
                        run: child.run_id,
                        depth: depth + 1,
                        agent: child_agent,
                        messages,
                        buffered: VecDeque::new(),
                        seen: HashSet::new(),
                    }),
                    Err(e) => return Some(Err(e)),
                }
            }
            if show {
                return Some(Ok(ProjectedEvent {
                    run_id: run,
                    depth,
                    agent,
                    seq,
                    event: envelope,
                }));
            }
        }
    }
}

/// The projection of `run`'s tree under `opts`, live: it ends after the watched run's end.
pub async fn project(
    bus: Bus,
    run: RunId,
    opts: WatchOptions,
) -> Result<
    impl Stream<Item = Result<ProjectedEvent, CoordinatorError>> + Send + use<>,
    CoordinatorError,
> {
    let messages = open(&bus, run, opts.since).await?;
    let state = State {
        bus,
        opts,
        stack: vec![Reader {
            run,
            depth: 0,
            agent: None,
            messages,
            buffered: VecDeque::new(),
            seen: HashSet::new(),
        }],
        followed: HashSet::from([run]),
        done: false,
    };
    Ok(futures::stream::unfold(state, |mut s| async move {
        s.next().await.map(|item| (item, s))
    }))
}
