//! Persistent teammates as agents of the NATS Agent Protocol.
//!
//! Every replica registers one instance of the `agents` micro service per exposed teammate
//! that is not shut down (`expose` on its entry, or `[agents-protocol] expose-teammates`),
//! at `agents.prompt.<name>.<owner>.<team>` (see [`flotilla_agents::teammate`]), with the
//! machinery the coordinators' exposer uses ([`flotilla_agents::serve`]). The set follows the
//! teammates' mirror: an instance appears when a teammate is spawned and leaves when it is
//! shut down. The prompt endpoints share the queue group `agents`, so one replica takes each
//! prompt; nothing is kept between prompts.
//!
//! A prompt's life:
//!
//! ```text
//!  prompt ──► the caps of team.send (413 message_too_large, 429 turns_per_hour, 409 shut_down)
//!         ──► the message posted to the inbox (from `agents-protocol`) ──► ack
//!         ──► watch conv.<team>.<name> until its cursor reaches the message's sequence
//!             (keep-alive acks meanwhile; a caller gone changes nothing: the turn is the
//!             teammate's and runs to its end)
//!         ──► the turn's reply: one response chunk, the end
//!             failed turn: 500 turn_failed; shut down before reading it: 409 shut_down;
//!             prompt-timeout: 500 timeout
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv;
use flotilla_agents::serve::{Ending, Instance, Outbox, Prompter, Registration, UnknownAgents};
use flotilla_agents::teammate::{self as exposing, SENDER, TurnOutcome};
use flotilla_agents::wire::{AgentAddress, Chunk, Envelope};
use flotilla_model::teammate::{
    Conversation, Teammate, TeammateStatus, conversation_key, teammate_key,
};
use futures::StreamExt;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::Team;
use crate::error::SupervisorError;
use crate::teammates::{Refusal, check_accepts, check_text, failed, owner, post, read, wanted};

/// How often the served set is compared with the teammates' mirror, and how often a waiting
/// prompt looks whether its teammate was shut down.
const EVERY: Duration = Duration::from_millis(250);

/// The teammates to serve now, by address: the first by entry key keeps an address two
/// names share; an exposed definition's address is never a teammate's.
fn desired(
    team: &Team,
    owner: &str,
    warned: &mut BTreeSet<String>,
) -> BTreeMap<AgentAddress, (String, Teammate)> {
    let mut mates = team.mates.matching(|m| wanted(team, m));
    mates.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out: BTreeMap<AgentAddress, (String, Teammate)> = BTreeMap::new();
    for (key, mate) in mates {
        let address = match exposing::address(owner, &mate.team, &mate.name) {
            Ok(a) => a,
            Err(e) => {
                if warned.insert(key.clone()) {
                    warn!(teammate = %key, error = %e, "A teammate cannot be exposed");
                }
                continue;
            }
        };
        let taken = if team.exposed_definitions.contains(&address) {
            Some("an exposed agent definition".to_owned())
        } else {
            out.get(&address).map(|(k, _)| format!("teammate {k}"))
        };
        if let Some(by) = taken {
            if warned.insert(key.clone()) {
                warn!(
                    teammate = %key,
                    address = %address.display(),
                    taken_by = %by,
                    "A teammate is not exposed: its address is taken"
                );
            }
            continue;
        }
        out.insert(address, (key, mate));
    }
    out
}

/// One served teammate.
struct Served {
    key: String,
    stop: CancellationToken,
}

/// Serves the exposed teammates until `shutdown`, following the mirror.
pub(crate) async fn run(
    team: Arc<Team>,
    shutdown: CancellationToken,
) -> Result<(), SupervisorError> {
    let nats = team.bus.client().clone();
    let owner = owner(&team);
    // Prompts for this owner that no instance serves (a teammate shut down, a name nobody
    // has) are answered `404 unknown_agent`, by whichever process of the deployment sees
    // them first (the coordinators answer them too).
    let unknown = UnknownAgents::subscribe(&nats, &owner, BTreeSet::new())
        .await
        .map_err(|e| SupervisorError::Setup(e.to_string()))?;
    let mut tasks = JoinSet::new();
    tasks.spawn(unknown.run(shutdown.clone()));
    let mut served: BTreeMap<AgentAddress, Served> = BTreeMap::new();
    let mut warned = BTreeSet::new();
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {}
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
        }
        let want = desired(&team, &owner, &mut warned);
        served.retain(|address, s| {
            let keep = want.get(address).is_some_and(|(k, _)| *k == s.key);
            if !keep {
                info!(teammate = %s.key, address = %address.display(), "A teammate left the NATS Agent Protocol");
                s.stop.cancel();
            }
            keep
        });
        for (address, (key, mate)) in want {
            if served.contains_key(&address) {
                continue;
            }
            let spec = exposing::spec(&mate, address.clone(), team.bus.names().prefix());
            let instance = match Instance::start(
                &nats,
                spec,
                team.bus.max_payload(),
                team.agents.heartbeat,
            )
            .await
            {
                Ok(i) => i,
                Err(e) => {
                    warn!(teammate = %key, error = %e, "A teammate could not be exposed; trying again");
                    continue;
                }
            };
            info!(teammate = %key, address = %address.display(), "A teammate is exposed on the NATS Agent Protocol");
            let stop = shutdown.child_token();
            let prompter = TeammatePrompter {
                team: Arc::clone(&team),
                team_name: mate.team.clone(),
                name: mate.name.clone(),
                shutdown: shutdown.clone(),
            };
            tasks.spawn(instance.serve(prompter, stop.clone(), shutdown.clone()));
            served.insert(address, Served { key, stop });
        }
    }
    while tasks.join_next().await.is_some() {}
    Ok(())
}

/// What a prompt for a teammate does: a message to it, answered with its turn's reply.
#[derive(Clone)]
struct TeammatePrompter {
    team: Arc<Team>,
    team_name: String,
    name: String,
    shutdown: CancellationToken,
}

impl Prompter for TeammatePrompter {
    fn prompt(
        &self,
        _agent: Registration,
        envelope: Envelope,
        out: Outbox,
    ) -> impl std::future::Future<Output = Ending> + Send {
        let this = self.clone();
        async move { this.answer(envelope, out).await }
    }
}

fn refused((status, code, message): Refusal) -> Ending {
    Ending::error(status, code.as_str(), message)
}

impl TeammatePrompter {
    async fn answer(&self, envelope: Envelope, out: Outbox) -> Ending {
        let team = &*self.team;
        let (t, name) = (self.team_name.as_str(), self.name.as_str());
        let text = envelope.prompt;
        if let Err(e) = check_text(team, &text) {
            return refused(e);
        }
        let key = teammate_key(t, name);
        let (mate, revision) = match read(team, &key).await {
            Ok(Some((m, _, rev))) => (m, rev),
            Ok(None) => {
                return Ending::error(
                    404,
                    "unknown_agent",
                    format!("team {t:?} has no teammate {name:?}"),
                );
            }
            Err(e) => return refused(failed(e)),
        };
        if let Err(e) = check_accepts(&mate) {
            return refused(e);
        }
        // Watch the conversation before posting: no revision after the message is missed.
        let conv_key = conversation_key(t, name);
        let mut watch = match team.team_kv.watch(&conv_key).await {
            Ok(w) => Some(w),
            Err(e) => {
                debug!(error = %e, key = %conv_key, "Cannot watch a conversation; polling it");
                None
            }
        };
        let seq = match post(team, t, name, SENDER, &text, None, Some((mate, revision))).await {
            Ok(seq) => seq,
            Err(e) => return Ending::error(500, "send_failed", e.to_string()),
        };
        out.ack().await;
        debug!(teammate = %key, seq, "Prompt posted to a teammate");
        let (_keepalive, mut gone) = out.keepalive(team.agents.keepalive);
        let mut caller_gone = false;
        let deadline = tokio::time::sleep(team.agents.prompt_timeout);
        tokio::pin!(deadline);
        let mut tick = tokio::time::interval(EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let outcome = loop {
            tokio::select! {
                entry = async {
                    match watch.as_mut() {
                        Some(w) => w.next().await,
                        None => std::future::pending().await,
                    }
                } => match entry {
                    Some(Ok(e)) if e.operation == kv::Operation::Put => {
                        match serde_json::from_slice::<Conversation>(&e.value) {
                            Ok(conv) => match exposing::outcome(&conv, seq, SENDER, &text) {
                                TurnOutcome::Pending => {}
                                done => break done,
                            },
                            Err(err) => debug!(error = %err, key = %conv_key, "An unreadable conversation"),
                        }
                    }
                    Some(Ok(_)) => {}
                    // The watch ended: the ticks read the conversation instead.
                    Some(Err(_)) | None => watch = None,
                },
                _ = tick.tick() => {
                    let shut = team
                        .mates
                        .get(&key)
                        .is_some_and(|m| m.value.status == TeammateStatus::Shutdown);
                    if watch.is_none() || shut {
                        match self.now(&conv_key, seq, &text).await {
                            TurnOutcome::Pending if shut => break TurnOutcome::Pending,
                            TurnOutcome::Pending => {}
                            done => break done,
                        }
                    }
                }
                _ = &mut gone, if !caller_gone => {
                    // Nothing to cancel: the message is the teammate's and its turn runs to
                    // its end; the stream stops.
                    info!(teammate = %key, seq, "The caller of a teammate's prompt went away");
                    caller_gone = true;
                    break TurnOutcome::Pending;
                }
                _ = &mut deadline => {
                    return Ending::error(
                        500,
                        "timeout",
                        format!(
                            "teammate {name:?} of team {t:?} did not answer within {:?} (prompt-timeout); the message stays in its conversation",
                            team.agents.prompt_timeout
                        ),
                    );
                }
                _ = self.shutdown.cancelled() => {
                    return Ending::error(
                        500,
                        "unavailable",
                        format!("the process serving this prompt is stopping; teammate {name:?} of team {t:?} still has the message"),
                    );
                }
            }
        };
        if caller_gone {
            return Ending::Gone;
        }
        match outcome {
            TurnOutcome::Replied(reply) => {
                if !reply.is_empty() {
                    out.chunk(&Chunk::text(reply)).await;
                }
                Ending::End
            }
            TurnOutcome::Failed(why) => Ending::error(500, "turn_failed", why),
            TurnOutcome::Pending => Ending::error(
                409,
                "shut_down",
                format!("teammate {name:?} of team {t:?} was shut down before it read the message"),
            ),
        }
    }

    /// The outcome as the conversation says it now (read from the bucket, not the watch).
    async fn now(&self, conv_key: &str, seq: u64, text: &str) -> TurnOutcome {
        match self.team.team_kv.get(conv_key).await {
            Ok(Some(v)) => serde_json::from_slice::<Conversation>(&v)
                .map(|c| exposing::outcome(&c, seq, SENDER, text))
                .unwrap_or(TurnOutcome::Pending),
            _ => TurnOutcome::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use flotilla_model::time::Timestamp;

    use super::*;
    use crate::teammates::served;

    #[test]
    fn served_while_opted_in_and_taking_messages() {
        let now = Timestamp::from_unix_ms(0);
        let mut m = Teammate::spawn("crew", "ann", "analyst", "mate", "default", "", now);
        assert!(!served(false, &m), "not without expose");
        assert!(served(true, &m), "expose-teammates exposes every teammate");
        m.expose = true;
        assert!(served(false, &m));
        m.wake(now, 10).expect("wakes");
        assert!(m.shutdown(now), "asked to shut down after its turn");
        assert!(!served(true, &m), "leaves once shutdown is asked");
    }
}
