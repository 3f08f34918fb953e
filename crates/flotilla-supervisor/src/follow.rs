//! Following the event stream: task events move members between idle and working and feed
//! the failure records. The replicas share the durable consumer [`crate::CONSUMER`], so each
//! event message is handled by one of them.
//!
//! Messages are taken in batches (whatever has arrived, up to `batch`): a batch's changes are
//! gathered per key in memory and written with one compare-and-set per key — an agent that
//! finishes hundreds of attempts a second is one write per batch, not one per attempt racing
//! the others. The batch's messages are acknowledged only after its writes are stored; a
//! message delivered again (a replica died before acknowledging) changes nothing twice:
//! roster entries remember the attempts that ended, failure records the attempts they
//! counted.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::AckKind;
use async_nats::jetstream::consumer::PullConsumer;
use flotilla_bus::SharedConsumer;
use flotilla_bus::liveness::Pulse;
use flotilla_bus::wire;
use flotilla_model::event::{Event, EventEnvelope, WorkflowPhase, decode_events};
use flotilla_model::ids::RunId;
use flotilla_model::subjects::StreamKind;
use flotilla_model::task::TaskErrorKind;
use flotilla_model::team::{
    AttemptOutcome, FailureRecord, Member, MemberTask, RecordScope, attempt_key, member_key,
    record_key,
};
use flotilla_model::time::Timestamp;
use flotilla_telemetry::InternalEvent;
use flotilla_telemetry::events::AttemptCounted;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::cas::modify;
use crate::error::SupervisorError;
use crate::lead::LeadFeed;
use crate::{CONSUMER, Team};
use flotilla_bus::mirror::unix_ms;

/// Binds the shared durable consumer of the event stream (created on first use: from the
/// stream's first retained message, so a new supervisor counts the history still kept).
pub(crate) async fn consumer(
    team: &Team,
    patience: &flotilla_bus::startup::Patience,
) -> Result<PullConsumer, SupervisorError> {
    let max_ack_pending = i64::try_from(team.opts.batch * 4).unwrap_or(i64::MAX);
    let spec = SharedConsumer {
        stream: StreamKind::Events,
        durable: CONSUMER.to_owned(),
        description: "Flotilla supervisors: team presence and failure records".to_owned(),
        filters: vec![team.bus.names().event_all()],
        ack_wait: team.opts.ack_wait,
        max_ack_pending,
        only_new: false,
    };
    patience
        .ride_out("setting up the event consumer", || {
            team.bus.shared_consumer(spec.clone())
        })
        .await
        .map_err(|e| SupervisorError::Setup(e.to_string()))
}

/// Handles event messages in batches until `stop`. `pulse` marks each batch taken for the
/// stall check; writing a batch is busy (the stream is not read meanwhile, on purpose).
pub(crate) async fn run(
    team: Arc<Team>,
    consumer: PullConsumer,
    pulse: Pulse,
    stop: CancellationToken,
) -> Result<(), SupervisorError> {
    while !stop.is_cancelled() {
        // One life of the message stream: a new one after the stall check restarts it.
        let life = async {
            let Some(messages) =
                crate::messages::messages_of(&consumer, &pulse, &stop, "the event stream", None)
                    .await
            else {
                return;
            };
            let batches = messages
                .take_until(stop.cancelled())
                .ready_chunks(team.opts.batch);
            futures::pin_mut!(batches);
            while let Some(batch) = batches.next().await {
                pulse.pulled();
                let batch: Vec<async_nats::jetstream::Message> = batch
                    .into_iter()
                    .filter_map(|m| {
                        m.map_err(|e| debug!(error = %e, "Event stream read error"))
                            .ok()
                    })
                    .collect();
                let _writing = pulse.busy();
                handle(&team, batch).await;
            }
        };
        let _ = pulse.attend(life).await;
    }
    Ok(())
}

async fn handle(team: &Team, batch: Vec<async_nats::jetstream::Message>) {
    let mut changes = Changes::default();
    let mut ended = Vec::new();
    let mut leads = LeadFeed::default();
    let mut readable = Vec::with_capacity(batch.len());
    for msg in batch {
        let (at_ms, seq) = msg
            .info()
            .map(|i| (unix_ms(i.published), i.stream_sequence))
            .unwrap_or_else(|_| (Timestamp::now().unix_ms(), 0));
        match decode_events(wire::codec_of(msg.headers.as_ref()), &msg.payload) {
            Ok(events) => {
                changes.gather(&events, at_ms);
                crate::memory::ended_in(&events, at_ms, &mut ended);
                leads.gather(team, &events, seq);
                readable.push(msg);
            }
            Err(e) => {
                warn!(subject = %msg.subject, error = %e, "Skipping an unreadable event message");
                let _ = msg.ack_with(AckKind::Term).await;
            }
        }
    }
    let written = match changes.write(team).await {
        Ok(()) => match crate::memory::record_all(team, &ended).await {
            Ok(()) if !leads.is_empty() => leads.apply(team).await,
            other => other,
        },
        Err(e) => Err(e),
    };
    match written {
        Ok(()) => {
            for msg in readable {
                if let Err(e) = msg.ack().await {
                    debug!(error = %e, "Could not acknowledge an event message; it will be seen again");
                }
            }
        }
        Err(e) => {
            let mut set_aside = 0;
            for msg in &readable {
                let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
                if delivered >= crate::MAX_DELIVERIES {
                    set_aside += 1;
                    let _ = msg.ack_with(AckKind::Term).await;
                } else {
                    let pause = flotilla_bus::consume::redelivery_delay(
                        delivered,
                        Duration::from_secs(1),
                        crate::MAX_REDELIVERY_DELAY,
                    );
                    let _ = msg.ack_with(AckKind::Nak(Some(pause))).await;
                }
            }
            if set_aside > 0 {
                tracing::error!(messages = set_aside, error = %e, "Events could not be recorded, delivery after delivery: set aside, the team's records miss them");
            } else {
                warn!(messages = readable.len(), error = %e, "Could not record events; they will be delivered again");
            }
        }
    }
}

/// An attempt that ended, for its member.
#[derive(Debug)]
struct Ended {
    key: String,
    success: bool,
}

/// What a batch of events changes, by key.
#[derive(Debug, Default)]
pub(crate) struct Changes {
    /// Attempts that started, by agent.
    started: BTreeMap<String, Vec<MemberTask>>,
    /// Attempts that ended, by agent.
    ended: BTreeMap<String, Vec<Ended>>,
    /// Outcomes to count, by failure-record key.
    outcomes: BTreeMap<(RecordScope, String), Vec<AttemptOutcome>>,
    /// The latest event of each attempt that emitted any (progress).
    progress: BTreeMap<String, i64>,
    /// Runs that ended.
    runs_ended: BTreeSet<RunId>,
    /// Incidents Flotilla noticed (`incident` on an event): scope, name, reason.
    incidents: Vec<(RecordScope, String, String)>,
}

impl Changes {
    /// Adds what `events` (one message, published at `at_ms`) say about the team.
    pub(crate) fn gather(&mut self, events: &[EventEnvelope], at_ms: i64) {
        for e in events {
            if let Event::Workflow(w) = &e.event
                && let Some(reason) = &w.incident
            {
                let named = [
                    w.agent.as_deref().map(|a| (RecordScope::Agent, a)),
                    w.role.as_deref().map(|r| (RecordScope::Role, r)),
                ];
                for (scope, name) in named.into_iter().flatten() {
                    self.incidents
                        .push((scope, name.to_owned(), reason.clone()));
                }
            }
            let (Some(task), Some(attempt)) = (&e.task_id, e.attempt) else {
                if let Event::Workflow(w) = &e.event
                    && w.phase.ends_run()
                {
                    self.runs_ended.insert(e.run_id);
                }
                continue;
            };
            let key = attempt_key(e.run_id, task, attempt);
            match &e.event {
                Event::Workflow(w) => match w.phase {
                    WorkflowPhase::TaskStarted => {
                        if let (Some(agent), Some(worker)) = (&w.agent, &w.worker) {
                            self.started
                                .entry(agent.clone())
                                .or_default()
                                .push(MemberTask {
                                    run_id: e.run_id,
                                    task_id: task.clone(),
                                    attempt,
                                    worker: worker.clone(),
                                    since: Timestamp::from_unix_ms(at_ms),
                                });
                        }
                    }
                    WorkflowPhase::TaskSucceeded
                    | WorkflowPhase::TaskRetrying
                    | WorkflowPhase::TaskFailed
                        if attempt > 0 =>
                    {
                        let success = w.phase == WorkflowPhase::TaskSucceeded;
                        if let Some(agent) = &w.agent {
                            self.ended.entry(agent.clone()).or_default().push(Ended {
                                key: key.clone(),
                                success,
                            });
                        }
                        // A cancelled attempt says nothing about the agent.
                        if w.error
                            .as_ref()
                            .is_some_and(|x| x.kind == TaskErrorKind::Cancelled)
                        {
                            continue;
                        }
                        let outcome = AttemptOutcome {
                            key,
                            run_id: e.run_id,
                            task_id: task.clone(),
                            attempt,
                            success,
                            error: w.error.as_ref().map(|x| (x.kind, x.message.clone())),
                            at: Timestamp::from_unix_ms(at_ms),
                            agent: w.agent.clone(),
                        };
                        let records = [
                            w.agent.as_deref().map(|a| (RecordScope::Agent, a)),
                            w.role.as_deref().map(|r| (RecordScope::Role, r)),
                        ];
                        for (scope, name) in records.into_iter().flatten() {
                            self.outcomes
                                .entry((scope, name.to_owned()))
                                .or_default()
                                .push(outcome.clone());
                        }
                    }
                    _ => {}
                },
                _ if e.source.starts_with("worker/") => {
                    let at = self.progress.entry(key).or_insert(at_ms);
                    *at = (*at).max(at_ms);
                }
                _ => {}
            }
        }
    }

    /// Writes the changes: one compare-and-set per key, different keys at once.
    async fn write(self, team: &Team) -> Result<(), SupervisorError> {
        let Changes {
            started,
            ended,
            outcomes,
            progress,
            runs_ended,
            incidents,
        } = self;
        for (scope, name, reason) in &incidents {
            crate::trust::flotilla_incident(team, *scope, name, reason).await?;
        }
        // Members: everything the batch says about one member in one write.
        let mut agents: BTreeSet<String> = started.keys().cloned().collect();
        agents.extend(ended.keys().cloned());
        let mut progress_of: BTreeMap<String, Vec<(String, i64)>> = BTreeMap::new();
        for (attempt, at) in progress {
            if let Some((key, _)) = team
                .roster
                .matching(|m| m.tasks.iter().any(|t| t.key() == attempt))
                .into_iter()
                .next()
            {
                let agent = key.trim_start_matches("agent.").to_owned();
                agents.insert(agent.clone());
                progress_of.entry(agent).or_default().push((attempt, at));
            }
        }
        for (key, _) in team
            .roster
            .matching(|m| m.tasks.iter().any(|t| runs_ended.contains(&t.run_id)))
        {
            agents.insert(key.trim_start_matches("agent.").to_owned());
        }
        let member_writes = agents.iter().map(|agent| {
            member_changes(
                team,
                agent,
                started.get(agent).map(Vec::as_slice).unwrap_or(&[]),
                ended.get(agent).map(Vec::as_slice).unwrap_or(&[]),
                progress_of.get(agent).map(Vec::as_slice).unwrap_or(&[]),
                &runs_ended,
            )
        });
        let record_writes = outcomes
            .iter()
            .map(|((scope, name), list)| count(team, *scope, name, list));
        let (members, records) = futures::join!(
            futures::future::join_all(member_writes),
            futures::future::join_all(record_writes)
        );
        members.into_iter().chain(records).collect()
    }
}

/// Status and change time after a change.
fn touch(m: &mut Member, stale_after_ms: i64) {
    let now = Timestamp::now();
    m.status = m.status_at(now, stale_after_ms);
    m.updated_at = now;
}

/// One member's changes from one batch, in one write.
async fn member_changes(
    team: &Team,
    agent: &str,
    started: &[MemberTask],
    ended: &[Ended],
    progress: &[(String, i64)],
    runs_ended: &BTreeSet<RunId>,
) -> Result<(), SupervisorError> {
    let key = member_key(agent);
    let stale = team.stale_after_ms();
    let resolution = i64::try_from(team.opts.progress_resolution.as_millis()).unwrap_or(i64::MAX);
    let now = Timestamp::now();
    let written = modify(
        &team.team_kv,
        &key,
        || {
            Member::new(
                agent,
                team.cards.get(agent).cloned().unwrap_or_default(),
                now,
            )
        },
        |m| {
            let mut changed = false;
            for t in started {
                if m.start(t.clone()) {
                    // Its host is live (it just started an attempt), whatever the last
                    // presence pass saw.
                    if !m.workers.contains(&t.worker) {
                        m.workers.push(t.worker.clone());
                        m.workers.sort();
                    }
                    changed = true;
                }
            }
            for e in ended {
                changed |= m.end(&e.key, e.success);
            }
            let before = m.tasks.len();
            m.tasks.retain(|t| !runs_ended.contains(&t.run_id));
            changed |= before != m.tasks.len();
            // Progress of attempts it still runs, at most every `progress-resolution`.
            let newest = progress
                .iter()
                .filter(|(a, _)| m.tasks.iter().any(|t| t.key() == *a))
                .map(|(_, at)| *at)
                .max();
            if let Some(at) = newest
                && m.last_progress
                    .is_none_or(|p| p.unix_ms() <= at - resolution)
            {
                m.last_progress = Some(Timestamp::from_unix_ms(at));
                changed = true;
            }
            if changed {
                touch(m, stale);
            }
            changed
        },
        &team.metrics,
    )
    .await?;
    if let Some((m, revision)) = written {
        team.roster.note(&key, m, now.unix_ms(), revision);
    }
    Ok(())
}

/// Counts `outcomes` into one failure record, in one write.
async fn count(
    team: &Team,
    scope: RecordScope,
    name: &str,
    outcomes: &[AttemptOutcome],
) -> Result<(), SupervisorError> {
    let key = record_key(scope, name);
    let mut counted: Vec<&AttemptOutcome> = Vec::new();
    let written = modify(
        &team.failures_kv,
        &key,
        || FailureRecord::new(scope, name),
        |r| {
            counted.clear();
            for o in outcomes {
                if r.apply(o) {
                    counted.push(o);
                }
            }
            !counted.is_empty()
        },
        &team.metrics,
    )
    .await?;
    if let Some((r, revision)) = written {
        if scope == RecordScope::Agent {
            for o in &counted {
                AttemptCounted {
                    agent: name,
                    run: o.run_id,
                    task: &o.task_id,
                    attempt: o.attempt,
                    success: o.success,
                    consecutive_failures: r.consecutive_failures,
                }
                .emit(&team.metrics);
            }
        }
        // Trust follows the counts; a level not written now is written at the next outcome,
        // and never holds up the team's accounting.
        if let Err(e) = crate::trust::evaluate(team, &r).await {
            tracing::warn!(key, error = %e, "Could not re-evaluate a trust level");
        }
        team.failures
            .note(&key, r, Timestamp::now().unix_ms(), revision);
    }
    Ok(())
}
