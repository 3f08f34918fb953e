//! Following the event stream: task events move members between idle and working and feed
//! the failure records. The replicas share the durable consumer [`crate::CONSUMER`], so each
//! event message is handled by one of them; a message is acknowledged only after its writes
//! are stored, and a message delivered again (a replica died before acknowledging) changes
//! nothing twice: roster entries remember the attempts that ended, failure records the
//! attempts they counted.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::AckKind;
use async_nats::jetstream::consumer::PullConsumer;
use flotilla_bus::SharedConsumer;
use flotilla_bus::wire;
use flotilla_model::event::{Event, EventEnvelope, WorkflowEvent, WorkflowPhase, decode_events};
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
use crate::mirror::unix_ms;
use crate::{CONSUMER, Team};

/// Binds the shared durable consumer of the event stream (created on first use: from the
/// stream's first retained message, so a new supervisor counts the history still kept).
pub(crate) async fn consumer(team: &Team) -> Result<PullConsumer, SupervisorError> {
    let max_ack_pending = i64::try_from(team.opts.concurrency * 8).unwrap_or(i64::MAX);
    team.bus
        .shared_consumer(SharedConsumer {
            stream: StreamKind::Events,
            durable: CONSUMER.to_owned(),
            description: "Flotilla supervisors: team presence and failure records".to_owned(),
            filters: vec![team.bus.names().event_all()],
            ack_wait: team.opts.ack_wait,
            max_ack_pending,
        })
        .await
        .map_err(|e| SupervisorError::Setup(e.to_string()))
}

/// Handles event messages until `stop`, `concurrency` at a time.
pub(crate) async fn run(
    team: Arc<Team>,
    consumer: PullConsumer,
    stop: CancellationToken,
) -> Result<(), SupervisorError> {
    while !stop.is_cancelled() {
        let messages = match consumer.messages().await {
            Ok(m) => m,
            Err(e) => {
                warn!(error = %e, "Cannot read the event stream; retrying");
                tokio::select! {
                    _ = stop.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                }
            }
        };
        messages
            .take_until(stop.cancelled())
            .for_each_concurrent(team.opts.concurrency, |m| {
                let team = Arc::clone(&team);
                async move {
                    match m {
                        Ok(msg) => handle(&team, msg).await,
                        Err(e) => debug!(error = %e, "Event stream read error"),
                    }
                }
            })
            .await;
    }
    Ok(())
}

async fn handle(team: &Team, msg: async_nats::jetstream::Message) {
    let at_ms = msg
        .info()
        .map(|i| unix_ms(i.published))
        .unwrap_or_else(|_| Timestamp::now().unix_ms());
    let events = match decode_events(wire::codec_of(msg.headers.as_ref()), &msg.payload) {
        Ok(e) => e,
        Err(e) => {
            warn!(subject = %msg.subject, error = %e, "Skipping an unreadable event message");
            let _ = msg.ack_with(AckKind::Term).await;
            return;
        }
    };
    match apply(team, &events, at_ms).await {
        Ok(()) => {
            if let Err(e) = msg.ack().await {
                debug!(error = %e, "Could not acknowledge an event message; it will be seen again");
            }
        }
        Err(e) => {
            warn!(subject = %msg.subject, error = %e, "Could not record events; they will be delivered again");
            let _ = msg
                .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                .await;
        }
    }
}

/// Records what `events` (one message, published at `at_ms`) say about the team.
pub(crate) async fn apply(
    team: &Team,
    events: &[EventEnvelope],
    at_ms: i64,
) -> Result<(), SupervisorError> {
    let mut progress: BTreeMap<String, i64> = BTreeMap::new();
    for e in events {
        let (Some(task), Some(attempt)) = (&e.task_id, e.attempt) else {
            if let Event::Workflow(w) = &e.event
                && w.phase.ends_run()
            {
                end_run(team, e.run_id, at_ms).await?;
            }
            continue;
        };
        match &e.event {
            Event::Workflow(w) => match w.phase {
                WorkflowPhase::TaskStarted => {
                    if let (Some(agent), Some(worker)) = (&w.agent, &w.worker) {
                        let t = MemberTask {
                            run_id: e.run_id,
                            task_id: task.clone(),
                            attempt,
                            worker: worker.clone(),
                            since: Timestamp::from_unix_ms(at_ms),
                        };
                        started(team, agent, t, at_ms).await?;
                    }
                }
                WorkflowPhase::TaskSucceeded
                | WorkflowPhase::TaskRetrying
                | WorkflowPhase::TaskFailed
                    if attempt > 0 =>
                {
                    ended(team, e, w, attempt, at_ms).await?;
                }
                _ => {}
            },
            _ if e.source.starts_with("worker/") => {
                progress.insert(attempt_key(e.run_id, task, attempt), at_ms);
            }
            _ => {}
        }
    }
    for (key, at) in progress {
        progressed(team, &key, at).await?;
    }
    Ok(())
}

/// Status and change time after a change.
fn touch(m: &mut Member, stale_after_ms: i64) {
    let now = Timestamp::now();
    m.status = m.status_at(now, stale_after_ms);
    m.updated_at = now;
}

fn new_member<'a>(team: &'a Team, agent: &'a str, at_ms: i64) -> impl Fn() -> Member + 'a {
    move || {
        Member::new(
            agent,
            team.cards.get(agent).cloned().unwrap_or_default(),
            Timestamp::from_unix_ms(at_ms),
        )
    }
}

async fn started(
    team: &Team,
    agent: &str,
    task: MemberTask,
    at_ms: i64,
) -> Result<(), SupervisorError> {
    let key = member_key(agent);
    let stale = team.stale_after_ms();
    let written = modify(
        &team.team_kv,
        &key,
        new_member(team, agent, at_ms),
        |m| {
            if !m.start(task.clone()) {
                return false;
            }
            // Its host is live (it just started an attempt), whatever the last presence
            // pass saw.
            if !m.workers.contains(&task.worker) {
                m.workers.push(task.worker.clone());
                m.workers.sort();
            }
            touch(m, stale);
            true
        },
        &team.metrics,
    )
    .await?;
    if let Some(m) = written {
        team.roster.note(&key, m, at_ms);
    }
    Ok(())
}

async fn ended(
    team: &Team,
    e: &EventEnvelope,
    w: &WorkflowEvent,
    attempt: u32,
    at_ms: i64,
) -> Result<(), SupervisorError> {
    let Some(task) = &e.task_id else {
        return Ok(());
    };
    let key = attempt_key(e.run_id, task, attempt);
    let success = w.phase == WorkflowPhase::TaskSucceeded;
    let cancelled = w
        .error
        .as_ref()
        .is_some_and(|x| x.kind == TaskErrorKind::Cancelled);
    let stale = team.stale_after_ms();
    if let Some(agent) = &w.agent {
        let mkey = member_key(agent);
        let written = modify(
            &team.team_kv,
            &mkey,
            new_member(team, agent, at_ms),
            |m| {
                if !m.end(&key, success) {
                    return false;
                }
                touch(m, stale);
                true
            },
            &team.metrics,
        )
        .await?;
        if let Some(m) = written {
            team.roster.note(&mkey, m, at_ms);
        }
    }
    // A cancelled attempt says nothing about the agent.
    if cancelled {
        return Ok(());
    }
    let outcome = AttemptOutcome {
        key,
        run_id: e.run_id,
        task_id: task.clone(),
        attempt,
        success,
        error: w.error.as_ref().map(|x| (x.kind, x.message.clone())),
        at: Timestamp::from_unix_ms(at_ms),
    };
    let records = [
        w.agent.as_deref().map(|a| (RecordScope::Agent, a)),
        w.role.as_deref().map(|r| (RecordScope::Role, r)),
    ];
    for (scope, name) in records.into_iter().flatten() {
        let rkey = record_key(scope, name);
        let written = modify(
            &team.failures_kv,
            &rkey,
            || FailureRecord::new(scope, name),
            |r| r.apply(&outcome),
            &team.metrics,
        )
        .await?;
        if let Some(r) = written {
            if scope == RecordScope::Agent {
                AttemptCounted {
                    agent: name,
                    run: e.run_id,
                    task,
                    attempt,
                    success,
                    consecutive_failures: r.consecutive_failures,
                }
                .emit(&team.metrics);
            }
            team.failures.note(&rkey, r, at_ms);
        }
    }
    Ok(())
}

/// An attempt emitted events at `at_ms`: its member made progress.
async fn progressed(team: &Team, attempt: &str, at_ms: i64) -> Result<(), SupervisorError> {
    let resolution = i64::try_from(team.opts.progress_resolution.as_millis()).unwrap_or(i64::MAX);
    let fresh = |m: &Member| {
        m.last_progress
            .is_some_and(|p| p.unix_ms() > at_ms - resolution)
    };
    let member = team
        .roster
        .matching(|m| !fresh(m) && m.tasks.iter().any(|t| t.key() == attempt))
        .into_iter()
        .next();
    let Some((key, m)) = member else {
        return Ok(());
    };
    let stale = team.stale_after_ms();
    let written = modify(
        &team.team_kv,
        &key,
        || m.clone(),
        |m| {
            if fresh(m) || !m.tasks.iter().any(|t| t.key() == attempt) {
                return false;
            }
            m.last_progress = Some(Timestamp::from_unix_ms(at_ms));
            touch(m, stale);
            true
        },
        &team.metrics,
    )
    .await?;
    if let Some(m) = written {
        team.roster.note(&key, m, at_ms);
    }
    Ok(())
}

/// A run ended: its attempts still listed (cancelled with the run) are no longer running.
async fn end_run(team: &Team, run: RunId, at_ms: i64) -> Result<(), SupervisorError> {
    let stale = team.stale_after_ms();
    for (key, m) in team
        .roster
        .matching(|m| m.tasks.iter().any(|t| t.run_id == run))
    {
        let written = modify(
            &team.team_kv,
            &key,
            || m.clone(),
            |m| {
                let before = m.tasks.len();
                m.tasks.retain(|t| t.run_id != run);
                if before == m.tasks.len() {
                    return false;
                }
                touch(m, stale);
                true
            },
            &team.metrics,
        )
        .await?;
        if let Some(m) = written {
            team.roster.note(&key, m, at_ms);
        }
    }
    Ok(())
}
