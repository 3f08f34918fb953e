//! Presence: which members live workers host, recomputed every `presence-interval` from the
//! worker registry, and the status that follows (`offline` without a live host, `stale`
//! when running attempts went quiet). A worker's entry counts as live while its last
//! refresh is younger than `presence-timeout` (two heartbeats by default), so a killed
//! worker's members turn `offline` within two heartbeats and an interval, well before the
//! registry's TTL removes the entry.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use flotilla_model::team::{Member, MemberCard, MemberStatus, member_key};
use flotilla_model::time::Timestamp;
use flotilla_telemetry::InternalEvent;
use flotilla_telemetry::events::TeamPresence;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::Team;
use crate::cas::modify;
use crate::error::SupervisorError;

/// A live worker hosting a member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Host {
    pub(crate) worker: String,
    pub(crate) pool: String,
    /// Its last refresh (server time, Unix ms).
    pub(crate) seen_ms: i64,
}

/// Whether a worker whose registry entry was last refreshed at `seen_ms` counts as live at
/// `now_ms`: refreshed within the presence timeout.
fn live(team: &Team, seen_ms: i64, now_ms: i64) -> bool {
    let timeout_ms = i64::try_from(team.presence_timeout.as_millis()).unwrap_or(i64::MAX);
    now_ms - seen_ms <= timeout_ms
}

/// The live hosts of every agent named by a live worker at `now_ms`: workers whose registry
/// entry was refreshed within the presence timeout.
pub(crate) fn hosts(team: &Team, now_ms: i64) -> BTreeMap<String, Vec<Host>> {
    let mut by_agent: BTreeMap<String, Vec<Host>> = BTreeMap::new();
    for (id, w) in team.workers.all() {
        if !live(team, w.at_ms, now_ms) {
            continue;
        }
        for agent in &w.value.agents {
            by_agent.entry(agent.clone()).or_default().push(Host {
                worker: id.clone(),
                pool: w.value.pool.clone(),
                seen_ms: w.at_ms,
            });
        }
    }
    by_agent
}

/// Whether a live worker (refreshed within the presence timeout at `now_ms`) takes teammate
/// turns straight from the inboxes ([`FEATURE_READS_INBOXES`]): then the workers wake
/// teammates on mail, and the supervisor only wakes mail still unread a little later.
///
/// [`FEATURE_READS_INBOXES`]: flotilla_model::worker::FEATURE_READS_INBOXES
pub(crate) fn workers_read_inboxes(team: &Team, now_ms: i64) -> bool {
    team.workers.read(|all| {
        all.values().any(|w| {
            live(team, w.at_ms, now_ms)
                && w.value
                    .features
                    .iter()
                    .any(|f| f == flotilla_model::worker::FEATURE_READS_INBOXES)
        })
    })
}

/// Brings a member's hosts, card and status up to date. `false`: already up to date.
pub(crate) fn update(
    m: &mut Member,
    card: Option<&MemberCard>,
    hosts: &[Host],
    now: Timestamp,
    stale_after_ms: i64,
) -> bool {
    let mut changed = false;
    if let Some(c) = card
        && m.card != *c
    {
        m.card = c.clone();
        changed = true;
    }
    let workers: Vec<String> = hosts
        .iter()
        .map(|h| h.worker.clone())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let pools: Vec<String> = hosts
        .iter()
        .map(|h| h.pool.clone())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    if m.workers != workers {
        m.workers = workers;
        changed = true;
    }
    if m.pools != pools {
        m.pools = pools;
        changed = true;
    }
    // Attempts of a worker that is gone are redelivered to another one.
    let live = m.workers.clone();
    changed |= m.drop_tasks_off(&live);
    let status = m.status_at(now, stale_after_ms);
    if m.status != status {
        m.status = status;
        changed = true;
    }
    if changed {
        m.updated_at = now;
    }
    changed
}

/// Recomputes presence every `presence-interval` until `stop`.
pub(crate) async fn run(team: Arc<Team>, stop: CancellationToken) -> Result<(), SupervisorError> {
    let mut tick = tokio::time::interval(team.opts.presence_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            _ = tick.tick() => {}
        }
        if let Err(e) = refresh(&team).await {
            warn!(error = %e, "Could not update presence; trying again next interval");
        }
    }
}

/// One presence pass: every configured member, every agent a live worker hosts, and every
/// member already on the roster.
pub(crate) async fn refresh(team: &Team) -> Result<(), SupervisorError> {
    let now = Timestamp::now();
    let hosts = hosts(team, now.unix_ms());
    let mut names: BTreeSet<String> = team.cards.keys().cloned().collect();
    names.extend(hosts.keys().cloned());
    names.extend(team.roster.all().into_iter().map(|(_, m)| m.value.name));
    let stale = team.stale_after_ms();
    let mut counts: BTreeMap<MemberStatus, usize> = BTreeMap::new();
    for name in names {
        let key = member_key(&name);
        let card = team.cards.get(&name);
        let mine = hosts.get(&name).map(Vec::as_slice).unwrap_or(&[]);
        let current = team.roster.get(&key).map(|m| m.value);
        let needed = match &current {
            None => true,
            Some(m) => update(&mut m.clone(), card, mine, now, stale),
        };
        let status = if needed {
            let written = modify(
                &team.team_kv,
                &key,
                || Member::new(&name, card.cloned().unwrap_or_default(), now),
                |m| update(m, card, mine, now, stale) || current.is_none(),
                &team.metrics,
            )
            .await?;
            match written {
                Some((m, revision)) => {
                    let status = m.status;
                    team.roster.note(&key, m, now.unix_ms(), revision);
                    status
                }
                None => current.map_or(MemberStatus::Offline, |m| m.status),
            }
        } else {
            current.map_or(MemberStatus::Offline, |m| m.status)
        };
        *counts.entry(status).or_default() += 1;
    }
    let all = [
        MemberStatus::Idle,
        MemberStatus::Working,
        MemberStatus::Stale,
        MemberStatus::Waiting,
        MemberStatus::Offline,
    ];
    let counts: Vec<(&'static str, usize)> = all
        .iter()
        .map(|s| (s.as_str(), counts.get(s).copied().unwrap_or(0)))
        .collect();
    TeamPresence { counts: &counts }.emit(&team.metrics);
    Ok(())
}
