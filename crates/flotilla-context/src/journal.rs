//! The step journal of an attempt: what earlier deliveries of the same attempt recorded.
//!
//! An LLM agent records every model reply and every round of tool results as an
//! `agent_step` event on the run's event stream (stored before it goes on, see
//! [`crate::EventEmitter::record`]). When its worker dies, the task message is delivered
//! again — same attempt, same attempt id — and the new delivery reads the steps back here, so
//! it resumes where the dead one stopped instead of paying for the same model calls again or
//! repeating the tools' side effects.
//!
//! Reading scans the run's event subject once (an ordered consumer up to the last stored
//! message). That costs in proportion to the run's events, and only on a redelivery: the
//! first delivery of an attempt never reads.

use std::collections::BTreeMap;

use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use flotilla_bus::wire;
use flotilla_model::event::{Event, StepEntry, decode_events};
use flotilla_model::subjects::StreamKind;
use futures::StreamExt;
use tracing::warn;

use crate::Clients;
use crate::error::{ContextError, ErrorKind};

/// The `id` of step `step` of attempt `attempt_id` of run `run`: the same on every delivery,
/// so a step recorded twice is stored once.
pub fn step_event_id(
    run: flotilla_model::RunId,
    attempt_id: flotilla_model::ids::AttemptId,
    step: u32,
) -> String {
    format!("{run}.{attempt_id}.step.{step}")
}

impl Clients {
    /// The steps earlier deliveries of this attempt recorded, by step number. Empty for an
    /// operator scope or a first delivery (nothing can have been recorded) — unless
    /// `resumed`: the attempt suspended at a tool call earlier and continues now, so its
    /// first delivery follows steps recorded by an earlier one.
    pub async fn journal(&self, resumed: bool) -> Result<BTreeMap<u32, StepEntry>, ContextError> {
        let scope = self.scope();
        let Some(attempt_id) = scope.attempt_id else {
            return Ok(BTreeMap::new());
        };
        if !resumed && scope.delivery.is_none_or(|d| d <= 1) {
            return Ok(BTreeMap::new());
        }
        attempt_steps(self.bus(), scope.run_id, attempt_id).await
    }
}

/// The steps attempt `attempt_id` of run `run` recorded, by step number: what a redelivery
/// resumes from, what a fork at a step keeps, what a replay checks. Reads the run's event
/// subject once.
pub async fn attempt_steps(
    bus: &flotilla_bus::Bus,
    run: flotilla_model::RunId,
    attempt_id: flotilla_model::ids::AttemptId,
) -> Result<BTreeMap<u32, StepEntry>, ContextError> {
    Ok(attempt_steps_timed(bus, run, attempt_id)
        .await?
        .into_iter()
        .map(|(step, (entry, _))| (step, entry))
        .collect())
}

/// [`attempt_steps`] with the time each step was stored (Unix ms, server clock): what a fork
/// at a step copies of the fork point's own writes is what came before its first new step.
pub async fn attempt_steps_timed(
    bus: &flotilla_bus::Bus,
    run: flotilla_model::RunId,
    attempt_id: flotilla_model::ids::AttemptId,
) -> Result<BTreeMap<u32, (StepEntry, i64)>, ContextError> {
    let mut steps = BTreeMap::new();
    let unavailable = |what: &str, e: &dyn std::fmt::Display| {
        ContextError::new(ErrorKind::Unavailable, format!("{what}: {e}"))
    };
    let name = bus.names().stream(StreamKind::Events);
    let stream = bus
        .js()
        .get_stream(&name)
        .await
        .map_err(|e| unavailable(&format!("opening {name}"), &e))?;
    let mut consumer = stream
        .create_consumer(pull::OrderedConfig {
            filter_subject: bus.names().event(run),
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .map_err(|e| unavailable("reading the run's events", &e))?;
    let pending = consumer
        .info()
        .await
        .map_err(|e| unavailable("reading the run's events", &e))?
        .num_pending;
    if pending == 0 {
        return Ok(steps);
    }
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| unavailable("reading the run's events", &e))?;
    while let Some(msg) = messages.next().await {
        let msg = msg.map_err(|e| unavailable("reading the run's events", &e))?;
        let (remaining, stored_ms) = msg.info().map_or((0, 0), |i| {
            (
                i.pending,
                (i.published.unix_timestamp_nanos() / 1_000_000) as i64,
            )
        });
        match decode_events(wire::codec_of(msg.headers.as_ref()), &msg.payload) {
            Ok(events) => {
                for e in events {
                    if let Event::AgentStep {
                        attempt_id: a,
                        step,
                        entry,
                    } = e.event
                        && a == attempt_id
                    {
                        // The first record of a step wins; a repeat is the same step.
                        steps.entry(step).or_insert((entry, stored_ms));
                    }
                }
            }
            Err(e) => warn!(error = %e, "Skipping an undecodable event message"),
        }
        if remaining == 0 {
            break;
        }
    }
    Ok(steps)
}
