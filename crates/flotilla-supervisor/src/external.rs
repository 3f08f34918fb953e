//! External members: agents of the NATS Agent Protocol on this NATS that are not this
//! deployment's own (Flotilla's exposed agents and exposed teammates carry
//! `metadata.flotilla_prefix`; those of this prefix are already members as agent definitions
//! and teammates).
//!
//! ```text
//!  every `agents-discovery` ─► $SRV.INFO.agents ─► one entry per agent address
//!  agents.hb.>  ─► the entry's last heartbeat and interval (an unknown address asks for a
//!                  discovery round at once, so a new agent shows up within a heartbeat)
//!  a newly discovered agent ─► its `status` endpoint (its answer counts as a heartbeat, so a
//!                  replica that just started knows at once who is alive)
//! ```
//!
//! Presence, in the roster's words: `idle` while the last heartbeat is younger than three
//! intervals (the protocol's alive); `stale` when it is older but an instance still answers
//! discovery (registered, not beating: stuck); `offline` when neither, until
//! [`FORGET_AFTER`] has passed since it was last seen, then it leaves the roster.
//!
//! Nothing is written to a bucket: each supervisor replica keeps this in memory from
//! discovery and heartbeats, so replicas agree without coordinating (a replica started after
//! an agent left never lists it, which is the only difference).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use flotilla_agents::call::{Discovered, discover, status};
use flotilla_agents::wire::{self, AgentAddress, Heartbeat};
use flotilla_model::team::{ExternalMember, MemberCard, MemberCounters, MemberStatus, MemberView};
use flotilla_model::time::Timestamp;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::Team;
use crate::error::SupervisorError;

/// The prefix of an external member's name: the same target `flotilla call` takes.
pub(crate) const NAME_PREFIX: &str = "agents:";

/// The metadata key Flotilla's exposed agents carry their deployment's prefix in.
pub(crate) const FLOTILLA_PREFIX_KEY: &str = "flotilla_prefix";

/// How long one discovery round waits for `$SRV.INFO.agents` answers.
const DISCOVERY_WAIT: Duration = Duration::from_millis(500);

/// Fewest time between two discovery rounds that heartbeats of unknown agents ask for.
const MIN_ROUND_GAP: Duration = Duration::from_secs(1);

/// How long an agent neither discovered nor beating stays listed (`offline`).
pub(crate) const FORGET_AFTER: Duration = Duration::from_secs(300);

/// One external agent as this replica knows it.
#[derive(Debug, Clone)]
struct Entry {
    found: Discovered,
    /// Instances that answered the last round.
    instances: Vec<String>,
    /// Its last heartbeat (or status answer), Unix ms of this clock.
    beat_ms: Option<i64>,
    interval_s: Option<u64>,
    discovered: bool,
    /// When discovery or a heartbeat last saw it.
    seen_ms: i64,
}

/// The external agents this replica knows, by address.
#[derive(Debug, Default)]
pub(crate) struct External {
    agents: Mutex<BTreeMap<AgentAddress, Entry>>,
    /// This deployment's own exposed agents, as the last round found them: their heartbeats
    /// ask for no round (without this, every one of them would, every interval).
    own: Mutex<std::collections::BTreeSet<AgentAddress>>,
}

impl External {
    fn with<T>(&self, f: impl FnOnce(&mut BTreeMap<AgentAddress, Entry>) -> T) -> T {
        match self.agents.lock() {
            Ok(mut g) => f(&mut g),
            Err(poisoned) => f(&mut poisoned.into_inner()),
        }
    }

    /// Whether `address` is one of this deployment's own agents (last round).
    fn is_own(&self, address: &AgentAddress) -> bool {
        self.own.lock().is_ok_and(|o| o.contains(address))
    }

    fn set_own(&self, own: std::collections::BTreeSet<AgentAddress>) {
        if let Ok(mut o) = self.own.lock() {
            *o = own;
        }
    }

    /// A heartbeat (or status answer) of `address`. `false`: no such agent was discovered.
    fn beat(&self, address: &AgentAddress, interval_s: u64, now_ms: i64) -> bool {
        self.with(|m| match m.get_mut(address) {
            Some(e) => {
                e.beat_ms = Some(now_ms);
                e.interval_s = Some(interval_s.max(1));
                e.seen_ms = now_ms;
                true
            }
            None => false,
        })
    }

    /// A discovery round's result: found agents are (re)listed, the others marked not
    /// discovered, and those unseen for [`FORGET_AFTER`] dropped. Returns the addresses new
    /// to this replica.
    fn discovered(&self, found: Vec<Discovered>, now_ms: i64) -> Vec<AgentAddress> {
        let mut by_address: BTreeMap<AgentAddress, (Discovered, Vec<String>)> = BTreeMap::new();
        for d in found {
            by_address
                .entry(d.address.clone())
                .or_insert_with(|| (d.clone(), Vec::new()))
                .1
                .push(d.instance_id);
        }
        self.with(|m| {
            for e in m.values_mut() {
                e.discovered = false;
                e.instances.clear();
            }
            let mut new = Vec::new();
            for (address, (found, instances)) in by_address {
                match m.get_mut(&address) {
                    Some(e) => {
                        e.found = found;
                        e.instances = instances;
                        e.discovered = true;
                        e.seen_ms = now_ms;
                    }
                    None => {
                        new.push(address.clone());
                        m.insert(
                            address,
                            Entry {
                                found,
                                instances,
                                beat_ms: None,
                                interval_s: None,
                                discovered: true,
                                seen_ms: now_ms,
                            },
                        );
                    }
                }
            }
            let forget = i64::try_from(FORGET_AFTER.as_millis()).unwrap_or(i64::MAX);
            m.retain(|_, e| e.discovered || now_ms - e.seen_ms <= forget);
            new
        })
    }

    /// The roster views of every external agent at `now`.
    pub(crate) fn views(&self, now: Timestamp) -> Vec<MemberView> {
        let now_ms = now.unix_ms();
        self.with(|m| m.values().map(|e| view(e, now_ms)).collect())
    }
}

/// An external member's name: `agents:<agent>.<owner>.<session>`.
pub(crate) fn member_name(address: &AgentAddress) -> String {
    format!(
        "{NAME_PREFIX}{}.{}.{}",
        address.agent, address.owner, address.session
    )
}

/// `idle` while alive (a heartbeat younger than three intervals), `stale` when registered
/// but silent, `offline` when neither.
fn presence(e: &Entry, now_ms: i64) -> MemberStatus {
    let interval_ms = e
        .interval_s
        .unwrap_or(wire::DEFAULT_HEARTBEAT_SECS)
        .saturating_mul(1000);
    let alive = e.beat_ms.is_some_and(|b| {
        now_ms - b
            < i64::try_from(interval_ms.saturating_mul(u64::from(wire::LIVENESS_INTERVALS)))
                .unwrap_or(i64::MAX)
    });
    if alive {
        MemberStatus::Idle
    } else if e.discovered {
        MemberStatus::Stale
    } else {
        MemberStatus::Offline
    }
}

fn view(e: &Entry, now_ms: i64) -> MemberView {
    let capabilities = e.found.capabilities();
    // Capabilities that are role names are its roles (team.find, team.list --role).
    let roles = capabilities
        .iter()
        .filter(|c| flotilla_model::token::check_name(c).is_ok())
        .take(MemberCard::MAX_TAGS)
        .cloned()
        .collect();
    let description = (!e.found.description.is_empty()).then(|| {
        let mut d = e.found.description.clone();
        if d.len() > MemberCard::MAX_DESCRIPTION {
            let mut cut = MemberCard::MAX_DESCRIPTION;
            while !d.is_char_boundary(cut) {
                cut -= 1;
            }
            d.truncate(cut);
        }
        d
    });
    let a = &e.found.address;
    MemberView {
        name: member_name(a),
        card: MemberCard {
            roles,
            description,
            capabilities: capabilities
                .into_iter()
                .take(MemberCard::MAX_TAGS)
                .collect(),
        },
        status: presence(e, now_ms),
        workers: Vec::new(),
        pools: Vec::new(),
        tasks: Vec::new(),
        last_progress: None,
        last_heartbeat: e.beat_ms.map(Timestamp::from_unix_ms),
        counters: MemberCounters::default(),
        failures: None,
        served: Vec::new(),
        external: Some(ExternalMember {
            agent: a.agent.clone(),
            owner: a.owner.clone(),
            session: a.session.clone(),
            instances: e.instances.clone(),
            interval_s: e.interval_s,
            protocol_version: e
                .found
                .metadata
                .get(wire::metadata::PROTOCOL_VERSION)
                .cloned(),
            discovered: e.discovered,
        }),
    }
}

/// Whether `d` is one of this deployment's own exposed agents (already a member).
fn own(d: &Discovered, prefix: &str) -> bool {
    d.metadata
        .get(FLOTILLA_PREFIX_KEY)
        .is_some_and(|p| p == prefix)
}

/// One discovery round: lists what answers, and asks newly found agents their status.
async fn round(team: &Team) -> Result<(), SupervisorError> {
    let nats = team.bus.client();
    let prefix = team.bus.names().prefix();
    let (mine, found): (Vec<Discovered>, Vec<Discovered>) = discover(nats, DISCOVERY_WAIT)
        .await
        .map_err(|e| SupervisorError::Setup(format!("discovering agents: {e}")))?
        .into_iter()
        .partition(|d| own(d, prefix));
    team.external
        .set_own(mine.into_iter().map(|d| d.address).collect());
    let new = team.external.discovered(found, Timestamp::now().unix_ms());
    let asked = new.iter().map(|address| async move {
        if let Some(hb) = status(nats, address).await {
            team.external
                .beat(address, hb.interval_s, Timestamp::now().unix_ms());
        }
    });
    futures::future::join_all(asked).await;
    Ok(())
}

/// Keeps the external members until `stop`: discovery every `agents-discovery`, heartbeats
/// as they come.
pub(crate) async fn run(
    team: std::sync::Arc<Team>,
    stop: CancellationToken,
) -> Result<(), SupervisorError> {
    let subject = format!("{}.{}.>", wire::ROOT, wire::VERB_HEARTBEAT);
    let mut beats = team
        .bus
        .client()
        .subscribe(subject)
        .await
        .map_err(|e| SupervisorError::Setup(format!("subscribing to heartbeats: {e}")))?;
    let mut tick = tokio::time::interval(team.opts.agents_discovery);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_round = tokio::time::Instant::now();
    let mut wanted = false;
    let mut tried = std::collections::BTreeSet::new();
    let mut soon = tokio::time::interval(MIN_ROUND_GAP);
    soon.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let go = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            _ = tick.tick() => {
                tried.clear();
                true
            }
            _ = soon.tick() => wanted && last_round.elapsed() >= MIN_ROUND_GAP,
            Some(msg) = beats.next() => {
                let Some(address) = AgentAddress::parse(&msg.subject, wire::VERB_HEARTBEAT) else {
                    continue;
                };
                let interval = serde_json::from_slice::<Heartbeat>(&msg.payload)
                    .map(|hb| hb.interval_s)
                    .unwrap_or(wire::DEFAULT_HEARTBEAT_SECS);
                if !team.external.beat(&address, interval, Timestamp::now().unix_ms())
                    && !team.external.is_own(&address)
                    && tried.insert(address)
                {
                    // Not listed yet: a new agent. Once per address between regular rounds,
                    // so one that beats without answering discovery costs no round a beat.
                    wanted = true;
                }
                false
            }
        };
        if go {
            wanted = false;
            last_round = tokio::time::Instant::now();
            if let Err(e) = round(&team).await {
                warn!(error = %e, "Could not discover external agents; trying again next round");
            }
            debug!("External agents discovered");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(agent: &str, instance: &str, caps: &str) -> Discovered {
        let address = AgentAddress::new(agent, "ext", "default").expect("address");
        Discovered {
            instance_id: instance.into(),
            prompt_subject: address.prompt(),
            address,
            description: "an agent".into(),
            metadata: BTreeMap::from([("capabilities".into(), caps.into())]),
        }
    }

    #[test]
    fn presence_follows_heartbeats_and_discovery() {
        let x = External::default();
        let t0 = 1_000_000;
        let new = x.discovered(
            vec![
                found("coder", "i1", "code, review, not a role"),
                found("coder", "i2", "code"),
            ],
            t0,
        );
        assert_eq!(new.len(), 1);
        let v = &x.views(Timestamp::from_unix_ms(t0))[0];
        assert_eq!(v.name, "agents:coder.ext.default");
        // Discovered, never heard: registered but not known alive.
        assert_eq!(v.status, MemberStatus::Stale);
        assert_eq!(v.card.roles, ["code", "review"]);
        assert_eq!(
            v.external.as_ref().map(|e| e.instances.len()),
            Some(2),
            "both instances"
        );
        let address = new[0].clone();
        assert!(x.beat(&address, 2, t0));
        let at = |ms: i64| x.views(Timestamp::from_unix_ms(ms))[0].status;
        assert_eq!(at(t0 + 5_999), MemberStatus::Idle);
        assert_eq!(at(t0 + 6_000), MemberStatus::Stale);
        // Gone from discovery too: offline, then forgotten.
        assert!(x.discovered(Vec::new(), t0 + 7_000).is_empty());
        assert_eq!(at(t0 + 7_000), MemberStatus::Offline);
        let forget = i64::try_from(FORGET_AFTER.as_millis()).expect("ms");
        // Last seen at its heartbeat (t0).
        x.discovered(Vec::new(), t0 + forget);
        assert_eq!(x.views(Timestamp::from_unix_ms(t0)).len(), 1);
        x.discovered(Vec::new(), t0 + 1 + forget);
        assert!(x.views(Timestamp::from_unix_ms(t0)).is_empty());
        // An unknown address's heartbeat changes nothing.
        assert!(!x.beat(&address, 1, t0));
    }

    #[test]
    fn own_agents_are_told_apart_by_their_prefix() {
        let mut d = found("writer", "i", "");
        assert!(!own(&d, "flotilla"));
        d.metadata
            .insert(FLOTILLA_PREFIX_KEY.into(), "flotilla".into());
        assert!(own(&d, "flotilla"));
        assert!(!own(&d, "other"));
        // An exposed teammate carries the prefix too: a member as a teammate, not external.
        let mate = flotilla_model::teammate::Teammate::spawn(
            "crew",
            "ann",
            "analyst",
            "mate",
            "default",
            "",
            Timestamp::from_unix_ms(0),
        );
        let address = flotilla_agents::teammate::address("flotilla", "crew", "ann").expect("ok");
        let mut t = found("ann", "j", "analyst");
        t.metadata = flotilla_agents::teammate::spec(&mate, address, "flotilla")
            .metadata
            .into_iter()
            .collect();
        assert!(own(&t, "flotilla"));
    }
}
