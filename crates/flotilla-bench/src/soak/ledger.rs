//! The soak's record of what happened, kept in the bench process: every root run it submitted
//! (its scenario and submission time), and what the installation stored about every run —
//! read from the events stream and the run log by two followers (ordered consumers on the
//! server, one each for the whole soak). The drivers read it to know when to answer, pause or
//! assign; the report is computed from it at the end, so every figure is a count over stored
//! messages, not over what a driver believed.
//!
//! What is kept per run is what the checks need: its end events (by event id, with the
//! server's time), its tasks' `task_succeeded` event ids, its approvals' requested and decided
//! events, and, from the run log, every succeeded result (attempt, attempt id, stream
//! sequence) and every approval decision input. Nothing else of a message is kept.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use flotilla_bus::{Bus, wire};
use flotilla_model::approval::ApprovalStatus;
use flotilla_model::event::{Event, EventEnvelope, WorkflowPhase, decode_events};
use flotilla_model::ids::RunId;
use flotilla_model::runlog::{RunInput, RunLogEntry};
use flotilla_model::subjects::StreamKind;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::scenario::Scenario;

/// The ledger, shared by the followers, the drivers and the report.
pub(crate) type Shared = Arc<Mutex<Ledger>>;

/// Locks the ledger (a panicked holder leaves plain data behind: keep going with it).
pub(crate) fn lock(shared: &Shared) -> std::sync::MutexGuard<'_, Ledger> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A root run the bench submitted.
#[derive(Debug, Clone)]
pub(crate) struct Submission {
    pub(crate) scenario: Scenario,
    /// Unix ms just before the publish that JetStream acknowledged.
    pub(crate) submitted_ms: i64,
}

/// One run-terminal event.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct End {
    pub(crate) phase: WorkflowPhase,
    /// Server time the event message was stored (unix ms).
    pub(crate) stored_ms: i64,
}

/// What was stored about one approval of a run.
#[derive(Debug, Clone, Default)]
pub(crate) struct ApprovalSeen {
    /// An `approval_requested` event was stored.
    pub(crate) requested: bool,
    /// Distinct ids of its `approval_decided` events: the machine's decisions.
    pub(crate) decided_events: BTreeSet<String>,
    /// Its `approval_decided` inputs on the run log (stream sequences) with their status.
    pub(crate) decided_inputs: BTreeMap<u64, ApprovalStatus>,
}

/// A succeeded result on the run log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ResultSeen {
    pub(crate) attempt: u32,
    pub(crate) attempt_id: String,
    /// Run-log stream sequence.
    pub(crate) seq: u64,
}

/// What the installation stored about one run.
#[derive(Debug, Clone, Default)]
pub(crate) struct Observed {
    /// A `run_started` event was stored.
    pub(crate) started: bool,
    /// Run-terminal events by event id.
    pub(crate) ends: BTreeMap<String, End>,
    /// Distinct ids of `task_succeeded` events, by task.
    pub(crate) task_succeeded: HashMap<String, BTreeSet<String>>,
    /// Approvals by approval id.
    pub(crate) approvals: BTreeMap<String, ApprovalSeen>,
    /// Succeeded results on the run log, by task.
    pub(crate) results: HashMap<String, Vec<ResultSeen>>,
    /// The run was paused at some point (a `run_paused` event).
    pub(crate) paused: bool,
}

impl Observed {
    /// Whether an end of the run is stored.
    pub(crate) fn ended(&self) -> bool {
        !self.ends.is_empty()
    }

    /// The first end stored (by server time).
    pub(crate) fn first_end(&self) -> Option<&End> {
        self.ends.values().min_by_key(|e| e.stored_ms)
    }

    /// Whether `task` succeeded (its `task_succeeded` event is stored).
    pub(crate) fn succeeded(&self, task: &str) -> bool {
        self.task_succeeded.contains_key(task)
    }

    /// Approvals requested and not decided yet, in id order.
    pub(crate) fn pending_approvals(&self) -> Vec<String> {
        self.approvals
            .iter()
            .filter(|(_, a)| a.requested && a.decided_events.is_empty())
            .map(|(id, _)| id.clone())
            .collect()
    }
}

/// A teammate the bench spawned, and the messages it sent it (the ones `team.send`
/// confirmed with a sequence).
#[derive(Debug, Clone)]
pub(crate) struct TeammateRec {
    pub(crate) team: String,
    pub(crate) name: String,
    /// (text, inbox sequence) of each confirmed message; every text is unique.
    pub(crate) messages: Vec<(String, u64)>,
}

/// Two answers to one approval sent at once, and what each was told.
#[derive(Debug, Clone)]
pub(crate) struct ConflictRec {
    pub(crate) run: RunId,
    pub(crate) approval: String,
    /// Per answer: `decided`, `already_decided`, or the error.
    pub(crate) replies: Vec<String>,
}

/// Something a driver could not do before its deadline (the bench's side of a scenario).
#[derive(Debug, Clone)]
pub(crate) struct DriverError {
    pub(crate) scenario: Scenario,
    pub(crate) run: Option<RunId>,
    pub(crate) what: String,
    pub(crate) at_ms: i64,
}

/// Everything the soak recorded.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    /// Root runs the bench submitted and JetStream acknowledged.
    pub(crate) submitted: BTreeMap<RunId, Submission>,
    /// What was stored about each run (submitted ones, their children, anything else).
    pub(crate) runs: HashMap<RunId, Observed>,
    pub(crate) teammates: Vec<TeammateRec>,
    pub(crate) conflicts: Vec<ConflictRec>,
    pub(crate) driver_errors: Vec<DriverError>,
    /// Event messages and run-log entries read, and those that did not decode.
    pub(crate) messages_read: u64,
    pub(crate) undecodable: u64,
}

impl Ledger {
    /// Takes the events of one stored event message (`stored_ms`: its server time).
    pub(crate) fn on_events(&mut self, events: Vec<EventEnvelope>, stored_ms: i64) {
        for e in events {
            let run = self.runs.entry(e.run_id).or_default();
            let Event::Workflow(w) = e.event else {
                continue;
            };
            match w.phase {
                WorkflowPhase::RunStarted => run.started = true,
                WorkflowPhase::RunPaused => run.paused = true,
                p if p.ends_run() => {
                    run.ends.entry(e.id).or_insert(End {
                        phase: p,
                        stored_ms,
                    });
                }
                WorkflowPhase::TaskSucceeded => {
                    if let Some(task) = e.task_id {
                        run.task_succeeded
                            .entry(task.to_string())
                            .or_default()
                            .insert(e.id);
                    }
                }
                WorkflowPhase::ApprovalRequested => {
                    if let Some(id) = w.approval_id {
                        run.approvals.entry(id).or_default().requested = true;
                    }
                }
                WorkflowPhase::ApprovalDecided => {
                    // Without an id: a `human_on_the_loop` notice, not a decision.
                    if let Some(id) = w.approval_id {
                        run.approvals
                            .entry(id)
                            .or_default()
                            .decided_events
                            .insert(e.id);
                    }
                }
                _ => {}
            }
        }
    }

    /// Takes one run-log entry (`seq`: its stream sequence).
    pub(crate) fn on_input(&mut self, entry: RunLogEntry, seq: u64) {
        let run = self.runs.entry(entry.run_id).or_default();
        match entry.input {
            RunInput::TaskResult(r) if r.result.success => {
                let seen = run.results.entry(r.task_id.to_string()).or_default();
                if !seen.iter().any(|s| s.seq == seq) {
                    seen.push(ResultSeen {
                        attempt: r.attempt,
                        attempt_id: r.attempt_id.to_string(),
                        seq,
                    });
                }
            }
            RunInput::ApprovalDecided(d) => {
                run.approvals
                    .entry(d.approval_id.clone())
                    .or_default()
                    .decided_inputs
                    .insert(seq, d.status);
            }
            _ => {}
        }
    }
}

/// Follows a stream of the installation from its first message for the whole soak, handing
/// each message to `take` (its payload, headers, stream sequence and server time). Starts
/// again after the last sequence seen when the consumer fails.
async fn follow(
    bus: Bus,
    kind: StreamKind,
    filter: String,
    shutdown: CancellationToken,
    mut take: impl FnMut(&async_nats::jetstream::Message, u64, i64) + Send,
) {
    let mut next = 1u64;
    while !shutdown.is_cancelled() {
        let started = async {
            let stream = bus.js().get_stream(bus.names().stream(kind)).await?;
            let consumer = stream
                .create_consumer(pull::OrderedConfig {
                    filter_subject: filter.clone(),
                    deliver_policy: DeliverPolicy::ByStartSequence {
                        start_sequence: next,
                    },
                    ..Default::default()
                })
                .await?;
            anyhow::Ok(consumer.messages().await?)
        }
        .await;
        let mut messages = match started {
            Ok(m) => m,
            Err(e) => {
                errln!("soak: following {filter} failed ({e}); trying again");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        loop {
            let m = tokio::select! {
                () = shutdown.cancelled() => return,
                m = messages.next() => m,
            };
            match m {
                Some(Ok(m)) => {
                    let Ok(info) = m.info() else { continue };
                    let (seq, at) = (
                        info.stream_sequence,
                        (info.published.unix_timestamp_nanos() / 1_000_000) as i64,
                    );
                    next = seq + 1;
                    take(&m, seq, at);
                }
                Some(Err(e)) => {
                    errln!("soak: following {filter}: {e}; starting again at {next}");
                    break;
                }
                None => break,
            }
        }
    }
}

/// Starts the two followers (events and run log) feeding `ledger`; they stop on `shutdown`.
pub(crate) fn start_followers(
    bus: &Bus,
    ledger: &Shared,
    shutdown: &CancellationToken,
) -> Vec<tokio::task::JoinHandle<()>> {
    let events = {
        let ledger = Arc::clone(ledger);
        follow(
            bus.clone(),
            StreamKind::Events,
            bus.names().event_all(),
            shutdown.clone(),
            move |m, _, at| {
                let decoded = decode_events(wire::codec_of(m.headers.as_ref()), &m.payload);
                let mut l = lock(&ledger);
                l.messages_read += 1;
                match decoded {
                    Ok(events) => l.on_events(events, at),
                    Err(_) => l.undecodable += 1,
                }
            },
        )
    };
    let inputs = {
        let ledger = Arc::clone(ledger);
        follow(
            bus.clone(),
            StreamKind::RunLog,
            bus.names().runlog_all(),
            shutdown.clone(),
            move |m, seq, _| {
                let decoded = wire::decode::<RunLogEntry>(m.headers.as_ref(), &m.payload);
                let mut l = lock(&ledger);
                l.messages_read += 1;
                match decoded {
                    Ok(entry) => l.on_input(entry, seq),
                    Err(_) => l.undecodable += 1,
                }
            },
        )
    };
    vec![tokio::spawn(events), tokio::spawn(inputs)]
}
