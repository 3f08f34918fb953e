//! Persistent teammates on the supervisor's side: the API verbs (`team.spawn`, `team.send`,
//! `team.broadcast`, `team.shutdown`, `team.mates`) and the **wake**.
//!
//! ```text
//!  team.send ──► <prefix>.tmbox.<team>.<to>.<from> (mailbox stream, stored)
//!      │                 │ consumer "worker-inbox": a worker takes the turn (flotilla-worker::inbox)
//!      │                 │ consumer "supervisor-inbox" (shared by the replicas)
//!      └── wake ◄────────┘
//!           │ CAS teammate.<team>.<to>: idle → working (epoch + 1)
//!           ▼
//!  <prefix>.turn.<pool>.<team>.<to>  (tasks stream, Nats-Msg-Id turn.<team>.<to>.<epoch>)
//!           └──► consumer "turns-<pool>", pulled by the pool's workers
//! ```
//!
//! While a live worker reads the teammate inboxes (its registry entry says
//! `reads_inboxes`), the send only stores the message: the worker it reaches takes the turn
//! itself, two hops from the send. The supervisors' shared durable consumer of every inbox
//! then wakes only mail still unread [`UNREAD_GRACE`] after it was stored (a worker killed
//! between pulling mail and claiming its turn, every reader gone), so nothing waits for the
//! next message.
//!
//! With no such worker (older workers, or `read-inboxes = false`), the send stores the
//! message and marks the teammate `working` at once (both after the one read its checks
//! need), publishes the turn once both are done, and answers (three round trips to
//! JetStream on the message's way to a worker); the inbox consumer wakes it too, so a replica
//! killed between storing a message and waking its teammate loses nothing. Waking twice is
//! harmless: the second finds it `working`. A teammate `working` without a host (dispatched,
//! not yet claimed) is dispatched again with the same message id, so a turn message lost
//! with a replica is published again and a duplicate is dropped by JetStream.
//!
//! An idle teammate costs one KV entry and one conversation entry: no consumer, no task, no
//! worker slot.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::AckKind;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::kv;
use async_nats::service::Request;
use flotilla_agents::teammate as exposing;
use flotilla_bus::SharedConsumer;
use flotilla_bus::liveness::Pulse;
use flotilla_bus::service::{parse, respond_error, respond_json};
use flotilla_model::ErrorCode;
use flotilla_model::subjects::StreamKind;
use flotilla_model::team::member_key;
use flotilla_model::teammate::{
    Conversation, TeamBroadcastRequest, TeamMates, TeamMatesRequest, TeamSendRequest, TeamSent,
    TeamShutdownRequest, TeamSpawnRequest, Teammate, TeammatePost, TeammateStatus, TeammateView,
    TurnEnvelope, conversation_key, team_or_default, teammate_key,
};
use flotilla_model::teammate_mail as mail;
use flotilla_model::time::Timestamp;
use flotilla_model::token::check_name;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::Team;
use crate::cas::{modify, modify_from};
use crate::error::SupervisorError;

/// The durable consumer the replicas share on the teammate inboxes.
pub(crate) const INBOX_CONSUMER: &str = "supervisor-inbox";

/// A refusal: status, code, message.
pub(crate) type Refusal = (u16, ErrorCode, String);

/// Whether `mate` is to be served: it opted in (or every teammate is) and takes messages.
pub(crate) fn wanted(team: &Team, mate: &Teammate) -> bool {
    served(team.agents.expose_teammates, mate)
}

/// [`wanted`] under `expose_teammates` (`[agents-protocol] expose-teammates`).
pub(crate) fn served(expose_teammates: bool, mate: &Teammate) -> bool {
    (mate.expose || expose_teammates) && counts_as_live(mate)
}

/// The owner token of this deployment's agents.
pub(crate) fn owner(team: &Team) -> String {
    team.agents.owner_for(team.bus.names().prefix())
}

/// `team.spawn` with `expose` (served by [`crate::exposed`]): the teammate's address must be free — not an exposed agent
/// definition's, not another exposed teammate's (names that differ only in case or `_`/`-`).
pub(crate) fn check_address(team: &Team, t: &str, name: &str) -> Result<(), Refusal> {
    let address = exposing::address(&owner(team), t, name).map_err(|e| {
        (
            400,
            ErrorCode::InvalidAddress,
            format!("teammate {name:?} of team {t:?}: {e}"),
        )
    })?;
    if team.exposed_definitions.contains(&address) {
        return Err((
            409,
            ErrorCode::AddressTaken,
            format!(
                "{} is the address of an exposed agent definition; name the teammate otherwise",
                address.display()
            ),
        ));
    }
    let other = team.mates.matching(|m| {
        m.team == t
            && m.name != name
            && wanted(team, m)
            && exposing::address(&owner(team), &m.team, &m.name).is_ok_and(|a| a == address)
    });
    if let Some((_, m)) = other.first() {
        return Err((
            409,
            ErrorCode::AddressTaken,
            format!(
                "{} is already teammate {:?}'s address",
                address.display(),
                m.name
            ),
        ));
    }
    Ok(())
}

fn check_team(team: &str) -> Result<(), Refusal> {
    mail::check_team(team).map_err(refusal)
}

fn check_mate_name(name: &str) -> Result<(), Refusal> {
    mail::check_teammate_name(name).map_err(refusal)
}

/// The senders a subject token can carry: names, else `operator`.
fn sender(from: &Option<String>) -> Result<String, Refusal> {
    mail::check_sender(from.as_deref()).map_err(refusal)
}

/// A refusal of the checks `team.send` shares with senders that store mail straight in the
/// inbox (`flotilla_model::teammate_mail`).
fn refusal(r: mail::MailRefused) -> Refusal {
    (r.status(), r.code, r.message)
}

async fn refuse(req: &Request, (status, code, message): Refusal) {
    respond_error(req, status, code, message).await;
}

fn view(t: &Teammate, updated_ms: Option<i64>) -> TeammateView {
    TeammateView::of(t, Timestamp::now(), updated_ms.map(Timestamp::from_unix_ms))
}

/// Reads a teammate's entry from the bucket (not the mirror: a send right after a spawn
/// must find it): the teammate, the entry's time and its revision.
pub(crate) async fn read(
    team: &Team,
    key: &str,
) -> Result<Option<(Teammate, i64, u64)>, SupervisorError> {
    match team
        .team_kv
        .entry(key)
        .await
        .map_err(|e| SupervisorError::store(format!("reading {key}"), e))?
    {
        Some(e) if e.operation == kv::Operation::Put => {
            let t = serde_json::from_slice::<Teammate>(&e.value).map_err(|err| {
                SupervisorError::Decode {
                    key: key.to_owned(),
                    message: err.to_string(),
                }
            })?;
            Ok(Some((
                t,
                flotilla_bus::mirror::unix_ms(e.created),
                e.revision,
            )))
        }
        _ => Ok(None),
    }
}

/// A teammate's entry and its revision for a send's checks: from the mirror (no round trip
/// on the path of every message), else from the bucket — a send right after a spawn by
/// another replica must find it. A mirror a moment behind can let through mail to a teammate
/// shut down or capped just now: its turn is refused like any wake, and the mail stays
/// unread.
async fn mirrored_or_read(team: &Team, key: &str) -> Result<Option<(Teammate, u64)>, Refusal> {
    if let Some(m) = team.mates.get(key) {
        return Ok(Some((m.value, m.revision)));
    }
    Ok(read(team, key)
        .await
        .map_err(failed)?
        .map(|(mate, _, revision)| (mate, revision)))
}

/// A refusal for trouble encoding or storing a teammate: `503 unavailable`.
fn internal(e: impl std::fmt::Display) -> Refusal {
    (503, ErrorCode::Unavailable, e.to_string())
}

/// A refusal for the supervisor's own trouble: its code and status (`503 unavailable`).
pub(crate) fn failed(e: SupervisorError) -> Refusal {
    (e.status(), e.code(), e.to_string())
}

pub(crate) async fn spawn(team: &Team, req: Request) {
    let Some(r) = parse::<TeamSpawnRequest>(&req).await else {
        return;
    };
    match do_spawn(team, &r).await {
        Ok(v) => respond_json(&req, team.bus.max_payload(), &v, "").await,
        Err(e) => refuse(&req, e).await,
    }
}

async fn do_spawn(team: &Team, r: &TeamSpawnRequest) -> Result<TeammateView, Refusal> {
    let t = team_or_default(&r.team);
    check_team(t)?;
    check_mate_name(&r.name)?;
    check_name(&r.role).map_err(|e| {
        (
            400,
            ErrorCode::InvalidRole,
            format!("role {:?} {e}", r.role),
        )
    })?;
    if r.instructions.len() > Teammate::MAX_INSTRUCTIONS {
        return Err((
            413,
            ErrorCode::InstructionsTooLarge,
            format!(
                "instructions are {} bytes; at most {} are allowed",
                r.instructions.len(),
                Teammate::MAX_INSTRUCTIONS
            ),
        ));
    }
    let known = known_agents(team);
    let agent = match &r.agent {
        Some(a) if known.iter().any(|k| k == a) => a.clone(),
        Some(a) => {
            return Err((
                404,
                ErrorCode::UnknownAgent,
                format!(
                    "no agent definition is named {a:?} (agents: {})",
                    list(&known)
                ),
            ));
        }
        None => agent_for_role(team, &r.role).ok_or_else(|| {
            (
                404,
                ErrorCode::UnknownAgent,
                format!(
                    "no agent definition fills the role {:?}: name one with `agent` (agents: {})",
                    r.role,
                    list(&known)
                ),
            )
        })?,
    };
    let pool = match &r.pool {
        Some(p) => {
            check_name(p).map_err(|e| (400, ErrorCode::InvalidPool, format!("pool {p:?} {e}")))?;
            p.clone()
        }
        None => team
            .roster
            .get(&member_key(&agent))
            .and_then(|m| m.value.pools.first().cloned())
            .unwrap_or_else(|| "default".to_owned()),
    };
    if r.expose {
        check_address(team, t, &r.name)?;
    }
    let key = teammate_key(t, &r.name);
    if read(team, &key).await.map_err(failed)?.is_some() {
        return Err(duplicate(t, &r.name));
    }
    let members = team
        .mates
        .matching(|m| m.team == t && m.status != TeammateStatus::Shutdown)
        .len();
    if members >= team.opts.team_size {
        return Err((
            409,
            ErrorCode::TeamFull,
            format!(
                "team {t:?} has {members} teammates; the team size cap (team-size) is {}",
                team.opts.team_size
            ),
        ));
    }
    let now = Timestamp::now();
    // `persistent_teammates`, held across every supervisor of the installation.
    let live: std::collections::BTreeSet<String> = team
        .mates
        .matching(counts_as_live)
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    if let Err(over) = team
        .quotas
        .take_teammate(&key, now.unix_ms(), &live)
        .await
        .map_err(internal)?
    {
        return Err((429, ErrorCode::QuotaExceeded, over.to_string()));
    }
    let mut mate = Teammate::spawn(t, &r.name, &r.role, &agent, &pool, &r.instructions, now);
    mate.spawned_by = r.by.clone();
    mate.turns_per_hour = team.opts.turns_per_hour;
    mate.expose = r.expose;
    mate.max_message_bytes = Some(team.opts.max_message_bytes);
    let bytes = serde_json::to_vec(&mate).map_err(internal)?;
    let revision = match team.team_kv.create(&key, bytes.into()).await {
        Ok(revision) => revision,
        Err(e) => {
            // The place taken for it is given back (the one that exists holds its own).
            if let Err(free) = team.quotas.free_teammate(&key).await {
                debug!(teammate = %key, error = %free, "Could not give a teammate's place back; it frees after the grace period");
            }
            return Err(if e.kind() == kv::CreateErrorKind::AlreadyExists {
                duplicate(t, &r.name)
            } else {
                internal(e)
            });
        }
    };
    team.mates.note(&key, mate.clone(), now.unix_ms(), revision);
    Ok(view(&mate, Some(now.unix_ms())))
}

fn duplicate(t: &str, name: &str) -> Refusal {
    (
        409,
        ErrorCode::DuplicateName,
        format!("team {t:?} already has a teammate named {name:?}"),
    )
}

fn list(names: &[String]) -> String {
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

/// The agent definitions a teammate may run: the configured members and those on the roster.
fn known_agents(team: &Team) -> Vec<String> {
    let mut names: Vec<String> = team.cards.keys().cloned().collect();
    names.extend(team.roster.all().into_iter().map(|(_, m)| m.value.name));
    names.sort();
    names.dedup();
    names
}

/// The first agent (by name) whose card fills `role`.
pub(crate) fn agent_for_role(team: &Team, role: &str) -> Option<String> {
    let mut agents: Vec<String> = team
        .cards
        .iter()
        .filter(|(_, c)| c.roles.iter().any(|r| r == role))
        .map(|(n, _)| n.clone())
        .collect();
    agents.extend(
        team.roster
            .matching(|m| m.has_role(role))
            .into_iter()
            .map(|(_, m)| m.name),
    );
    agents.sort();
    agents.into_iter().next()
}

pub(crate) fn check_text(team: &Team, text: &str) -> Result<(), Refusal> {
    mail::check_size(text, team.opts.max_message_bytes).map_err(refusal)
}

/// Whether `mate` may take one more message now.
pub(crate) fn check_accepts(mate: &Teammate) -> Result<(), Refusal> {
    mail::check_accepts(mate, Timestamp::now()).map_err(refusal)
}

/// Stores one message in `to`'s inbox and wakes it; the message's stream sequence. `known`:
/// `to`'s entry as just read, with its revision.
async fn deliver(
    team: &Team,
    t: &str,
    to: &str,
    from: &str,
    text: &str,
    known: Option<(Teammate, u64)>,
) -> Result<u64, Refusal> {
    post(team, t, to, from, text, None, known)
        .await
        .map_err(failed)
}

/// Stores one message in `to`'s inbox (de-duplicated by `msg_id` when given) and wakes it;
/// the message's stream sequence. What [`deliver`] does for a request, and the supervisor's
/// own mail to a run's lead. `known`: `to`'s entry as just read, with its revision.
///
/// The message is stored while the teammate is marked `working` (two round trips at once,
/// on the path of every message), and its turn is published only once both are done, so a
/// worker that claims the turn finds the message. A message that could not be stored still
/// gets its turn published (it finds nothing new and the teammate goes back to `idle`), so
/// no teammate is left `working` without a turn.
pub(crate) async fn post(
    team: &Team,
    t: &str,
    to: &str,
    from: &str,
    text: &str,
    msg_id: Option<&str>,
    known: Option<(Teammate, u64)>,
) -> Result<u64, SupervisorError> {
    let post = TeammatePost {
        protocol: flotilla_model::PROTOCOL_VERSION,
        from: from.to_owned(),
        text: text.to_owned(),
    };
    let subject = team.bus.names().teammate_inbox(t, to, from);
    if crate::presence::workers_read_inboxes(team, Timestamp::now().unix_ms()) {
        // The worker the message reaches takes the turn.
        return stored(team, t, to, team.bus.publish(subject, &post, msg_id).await).await;
    }
    let (ack, woken) = tokio::join!(
        team.bus.publish(subject, &post, msg_id),
        mark_working(team, t, to, known)
    );
    match woken {
        Ok(Some(mate)) => {
            if let Err(e) = dispatch(team, &mate).await {
                // Working without a turn: the next message, or the inbox consumer, dispatches
                // it again (same message id).
                debug!(team = t, teammate = to, error = %e, "Could not dispatch a turn at once");
            }
        }
        Ok(None) => {}
        // The inbox consumer wakes it in a moment.
        Err(e) => debug!(team = t, teammate = to, error = %e, "Could not wake a teammate at once"),
    }
    stored(team, t, to, ack).await
}

/// A message's stream sequence, or why it was not stored.
async fn stored(
    team: &Team,
    t: &str,
    to: &str,
    ack: Result<async_nats::jetstream::publish::PublishAck, flotilla_bus::PublishError>,
) -> Result<u64, SupervisorError> {
    match ack {
        Ok(ack) => Ok(ack.sequence),
        Err(e) if e.kind() == flotilla_bus::PublishErrorKind::StreamFull => {
            Err(SupervisorError::QuotaExceeded(format!(
                "the message to {t}.{to} is refused: {}",
                flotilla_tenants::space::refusal(&team.bus, StreamKind::Mailbox).await
            )))
        }
        Err(e) => Err(SupervisorError::store(format!("mailing {t}.{to}"), e)),
    }
}

pub(crate) async fn send(team: &Team, req: Request) {
    let Some(r) = parse::<TeamSendRequest>(&req).await else {
        return;
    };
    match do_send(team, &r).await {
        Ok(v) => respond_json(&req, team.bus.max_payload(), &v, "").await,
        Err(e) => refuse(&req, e).await,
    }
}

async fn do_send(team: &Team, r: &TeamSendRequest) -> Result<TeamSent, Refusal> {
    let t = team_or_default(&r.team);
    check_team(t)?;
    check_mate_name(&r.to)?;
    let from = sender(&r.from)?;
    let Some((mate, revision)) = mirrored_or_read(team, &teammate_key(t, &r.to)).await? else {
        return Err(not_found(team, t, &r.to));
    };
    // The cap the teammate was spawned with, as a sender that stores the message itself
    // checks it (`flotilla_client::Mailer`); this supervisor's for an entry without one.
    let cap = mate
        .max_message_bytes
        .unwrap_or(team.opts.max_message_bytes);
    mail::check_size(&r.text, cap).map_err(refusal)?;
    check_accepts(&mate)?;
    let seq = deliver(team, t, &r.to, &from, &r.text, Some((mate, revision))).await?;
    Ok(TeamSent {
        delivered: vec![r.to.clone()],
        seqs: vec![seq],
    })
}

fn not_found(team: &Team, t: &str, name: &str) -> Refusal {
    let mut names: Vec<String> = team
        .mates
        .matching(|m| m.team == t)
        .into_iter()
        .map(|(_, m)| m.name)
        .collect();
    names.sort();
    refusal(mail::not_found(t, name, &names))
}

pub(crate) async fn broadcast(team: &Team, req: Request) {
    let Some(r) = parse::<TeamBroadcastRequest>(&req).await else {
        return;
    };
    match do_broadcast(team, &r).await {
        Ok(v) => respond_json(&req, team.bus.max_payload(), &v, "").await,
        Err(e) => refuse(&req, e).await,
    }
}

async fn do_broadcast(team: &Team, r: &TeamBroadcastRequest) -> Result<TeamSent, Refusal> {
    let t = team_or_default(&r.team);
    check_team(t)?;
    let from = sender(&r.from)?;
    check_text(team, &r.text)?;
    let mut mates: Vec<Teammate> = team
        .mates
        .matching(|m| m.team == t && m.name != from)
        .into_iter()
        .map(|(_, m)| m)
        .collect();
    mates.sort_by(|a, b| a.name.cmp(&b.name));
    let open: Vec<&Teammate> = mates.iter().filter(|m| check_accepts(m).is_ok()).collect();
    if open.is_empty() {
        return Err((
            404,
            ErrorCode::NoTeammates,
            format!("team {t:?} has no teammate that takes messages"),
        ));
    }
    let mut sent = TeamSent {
        delivered: Vec::new(),
        seqs: Vec::new(),
    };
    for m in open {
        let seq = deliver(team, t, &m.name, &from, &r.text, None).await?;
        sent.delivered.push(m.name.clone());
        sent.seqs.push(seq);
    }
    Ok(sent)
}

pub(crate) async fn shutdown(team: &Team, req: Request) {
    let Some(r) = parse::<TeamShutdownRequest>(&req).await else {
        return;
    };
    let t = team_or_default(&r.team).to_owned();
    if let Err(e) = check_team(&t).and_then(|()| check_mate_name(&r.name)) {
        return refuse(&req, e).await;
    }
    let key = teammate_key(&t, &r.name);
    match read(team, &key).await {
        Ok(Some(_)) => {}
        Ok(None) => return refuse(&req, not_found(team, &t, &r.name)).await,
        Err(e) => return refuse(&req, failed(e)).await,
    }
    match end(team, &t, &r.name).await {
        Ok(Some(m)) => {
            respond_json(&req, team.bus.max_payload(), &view(&m, None), "").await;
        }
        Ok(None) => match read(team, &key).await {
            Ok(Some((m, at, _))) => {
                respond_json(&req, team.bus.max_payload(), &view(&m, Some(at)), "").await
            }
            Ok(None) => refuse(&req, not_found(team, &t, &r.name)).await,
            Err(e) => refuse(&req, failed(e)).await,
        },
        Err(e) => refuse(&req, failed(e)).await,
    }
}

/// Shuts `name` of `t` down (after its current turn): the entry written, or `None` when it
/// was already shut down (or is no teammate).
pub(crate) async fn end(
    team: &Team,
    t: &str,
    name: &str,
) -> Result<Option<Teammate>, SupervisorError> {
    let key = teammate_key(t, name);
    let now = Timestamp::now();
    let written = modify(
        &team.team_kv,
        &key,
        || Teammate::spawn(t, name, "", "", "", "", now),
        |m: &mut Teammate| !m.agent.is_empty() && m.shutdown(now),
        &team.metrics,
    )
    .await?;
    if written.is_some()
        && let Err(e) = team.quotas.free_teammate(&key).await
    {
        debug!(teammate = %key, error = %e, "Could not give a teammate's place back; the next spawn frees it");
    }
    Ok(written.map(|(m, revision)| {
        team.mates.note(&key, m.clone(), now.unix_ms(), revision);
        m
    }))
}

/// Whether `mate` is a teammate that takes messages — not shut down, nor asked to: what
/// holds a place under `persistent_teammates`.
fn counts_as_live(mate: &Teammate) -> bool {
    mate.status != TeammateStatus::Shutdown && !mate.shutdown_requested && !mate.agent.is_empty()
}

/// The teammates as views (of one team), by team then name.
pub(crate) fn views(team: &Team, only: Option<&str>) -> Vec<TeammateView> {
    let now = Timestamp::now();
    let mut out: Vec<TeammateView> = team
        .mates
        .all()
        .into_iter()
        .filter(|(_, m)| only.is_none_or(|t| m.value.team == t))
        .map(|(_, m)| TeammateView::of(&m.value, now, Some(Timestamp::from_unix_ms(m.at_ms))))
        .collect();
    out.sort_by(|a, b| a.team.cmp(&b.team).then(a.name.cmp(&b.name)));
    out
}

pub(crate) async fn mates(team: &Team, req: Request) {
    let Some(r) = parse::<TeamMatesRequest>(&req).await else {
        return;
    };
    if let Some(t) = &r.team
        && let Err(e) = check_team(t)
    {
        return refuse(&req, e).await;
    }
    let reply = TeamMates {
        teammates: views(team, r.team.as_deref()),
    };
    respond_json(
        &req,
        team.bus.max_payload(),
        &reply,
        "ask for one team (team.mates team)",
    )
    .await;
}

/// Wakes `name` of `t` if it is idle (or dispatched and not claimed: the turn is published
/// again, de-duplicated by its message id), starting from `known` when the caller has just
/// read the entry. Returns the epoch dispatched, if any.
pub(crate) async fn wake(
    team: &Team,
    t: &str,
    name: &str,
    known: Option<(Teammate, u64)>,
) -> Result<Option<u64>, SupervisorError> {
    match mark_working(team, t, name, known).await? {
        Some(mate) => dispatch(team, &mate).await.map(Some),
        None => Ok(None),
    }
}

/// How long mail may wait for a worker reading the inboxes to take its turn before a
/// supervisor wakes the teammate itself (through the turn queue).
pub(crate) const UNREAD_GRACE: Duration = Duration::from_secs(5);

/// Wakes `name` of `t` for mail `seq`, stored at `stored`, unless a worker has seen to it: a
/// turn claimed since the mail was stored (it read the inbox, or was given up visibly), or a
/// conversation that has read it. A teammate `working` is left to its turn, which reads the
/// mail.
async fn wake_unread(
    team: &Team,
    t: &str,
    name: &str,
    seq: u64,
    stored: Timestamp,
) -> Result<(), SupervisorError> {
    let Some((mate, _, revision)) = read(team, &teammate_key(t, name)).await? else {
        return Ok(());
    };
    let claimed_since = mate
        .transitions
        .iter()
        .any(|tr| tr.host.is_some() && tr.at >= stored);
    if claimed_since {
        return Ok(());
    }
    let key = conversation_key(t, name);
    let read = team
        .team_kv
        .entry(&key)
        .await
        .map_err(|e| SupervisorError::store(format!("reading {key}"), e))?;
    let cursor = match read {
        Some(e) if e.operation == kv::Operation::Put => {
            serde_json::from_slice::<Conversation>(&e.value)
                .map_err(|err| SupervisorError::Decode {
                    key: key.clone(),
                    message: err.to_string(),
                })?
                .cursor
        }
        _ => 0,
    };
    if cursor >= seq {
        return Ok(());
    }
    debug!(
        team = t,
        teammate = name,
        seq,
        "Mail still unread after the grace: waking the teammate"
    );
    wake(team, t, name, Some((mate, revision)))
        .await
        .map(|_| ())
}

/// The first half of a wake: marks `name` of `t` `working` if it is idle (compare-and-set,
/// starting from `known` when the caller has just read the entry). The teammate whose turn
/// is to be published: just woken, or dispatched earlier and not yet claimed.
async fn mark_working(
    team: &Team,
    t: &str,
    name: &str,
    known: Option<(Teammate, u64)>,
) -> Result<Option<Teammate>, SupervisorError> {
    let key = teammate_key(t, name);
    let now = Timestamp::now();
    let mut again: Option<Teammate> = None;
    let written = modify_from(
        &team.team_kv,
        &key,
        known,
        || Teammate::spawn(t, name, "", "", "", "", now),
        |m: &mut Teammate| {
            if m.agent.is_empty() {
                // No such teammate (the placeholder): nothing to wake.
                return false;
            }
            if m.status == TeammateStatus::Working && m.host.is_none() {
                again = Some(m.clone());
                return false;
            }
            again = None;
            let cap = m.turns_per_hour;
            m.wake(now, cap).is_ok()
        },
        &team.metrics,
    )
    .await?;
    Ok(match (written, again) {
        (Some((m, revision)), _) => {
            team.mates.note(&key, m.clone(), now.unix_ms(), revision);
            Some(m)
        }
        (None, Some(m)) => Some(m),
        (None, None) => None,
    })
}

/// The second half of a wake: publishes `mate`'s turn (de-duplicated by its dispatch).
/// Returns the epoch dispatched.
async fn dispatch(team: &Team, mate: &Teammate) -> Result<u64, SupervisorError> {
    let key = teammate_key(&mate.team, &mate.name);
    let turn = TurnEnvelope {
        protocol: flotilla_model::PROTOCOL_VERSION,
        team: mate.team.clone(),
        name: mate.name.clone(),
        epoch: mate.dispatch,
    };
    team.bus
        .publish(
            team.bus.names().turn(&mate.pool, &mate.team, &mate.name),
            &turn,
            Some(&turn.msg_id()),
        )
        .await
        .map_err(|e| SupervisorError::store(format!("dispatching a turn of {key}"), e))?;
    Ok(mate.dispatch)
}

/// Binds the shared durable consumer of the teammate inboxes.
pub(crate) async fn consumer(
    team: &Team,
    patience: &flotilla_bus::startup::Patience,
) -> Result<PullConsumer, SupervisorError> {
    let spec = SharedConsumer {
        stream: StreamKind::Mailbox,
        durable: INBOX_CONSUMER.to_owned(),
        description: "Flotilla supervisors: waking teammates on mail".to_owned(),
        filters: vec![team.bus.names().teammate_inbox_all()],
        ack_wait: team.opts.ack_wait,
        max_ack_pending: 10_000,
        only_new: false,
    };
    patience
        .ride_out("setting up the teammate inbox consumer", || {
            team.bus.shared_consumer(spec.clone())
        })
        .await
        .map_err(|e| SupervisorError::Setup(e.to_string()))
}

/// Wakes the teammates whose inboxes receive mail, until `stop`. `pulse` marks each message
/// for the stall check; waking is busy (the stream is not read meanwhile, on purpose).
pub(crate) async fn follow(
    team: Arc<Team>,
    consumer: PullConsumer,
    pulse: Pulse,
    stop: CancellationToken,
) -> Result<(), SupervisorError> {
    while !stop.is_cancelled() {
        // One life of the message stream: a new one after the stall check restarts it.
        let life = async {
            let Some(messages) = crate::messages::messages_of(
                &consumer,
                &pulse,
                &stop,
                "the teammate inboxes",
                None,
            )
            .await
            else {
                return;
            };
            let messages = messages.take_until(stop.cancelled());
            futures::pin_mut!(messages);
            while let Some(msg) = messages.next().await {
                pulse.pulled();
                let Ok(msg) = msg else { break };
                let _waking = pulse.busy();
                wake_on(&team, msg).await;
            }
        };
        let _ = pulse.attend(life).await;
    }
    Ok(())
}

/// Wakes the teammate a message on its inbox is for.
async fn wake_on(team: &Team, msg: async_nats::jetstream::Message) {
    // <prefix>.tmbox.<team>.<to>.<from>
    let tokens: Vec<&str> = msg.subject.split('.').collect();
    let (Some(t), Some(to)) = (tokens.get(2), tokens.get(3)) else {
        let _ = msg.ack_with(AckKind::Term).await;
        return;
    };
    let woken = if crate::presence::workers_read_inboxes(team, Timestamp::now().unix_ms()) {
        // The workers take turns from the inboxes: only mail still unread after the grace.
        let Ok(info) = msg.info() else {
            let _ = msg.ack_with(AckKind::Term).await;
            return;
        };
        let age = time::OffsetDateTime::now_utc() - info.published;
        let grace = time::Duration::try_from(UNREAD_GRACE).unwrap_or(time::Duration::ZERO);
        if age < grace {
            let left = Duration::try_from(grace - age).unwrap_or(UNREAD_GRACE);
            let _ = msg.ack_with(AckKind::Nak(Some(left))).await;
            return;
        }
        let stored = Timestamp::from_unix_ms(flotilla_bus::mirror::unix_ms(info.published));
        wake_unread(team, t, to, info.stream_sequence, stored).await
    } else {
        wake(team, t, to, None).await.map(|_| ())
    };
    match woken {
        Ok(()) => {
            let _ = msg.ack().await;
        }
        Err(e) => {
            let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
            if delivered >= crate::MAX_DELIVERIES {
                // The mail stays in its inbox: the next message (or `team send`) wakes it.
                tracing::error!(team = t, teammate = to, delivered, error = %e, "Could not wake a teammate, delivery after delivery; its mail waits for the next message");
                let _ = msg.ack_with(AckKind::Term).await;
                return;
            }
            let pause = flotilla_bus::consume::redelivery_delay(
                delivered,
                Duration::from_secs(1),
                crate::MAX_REDELIVERY_DELAY,
            );
            warn!(team = t, teammate = to, delivered, retry_in = ?pause, error = %e, "Could not wake a teammate; retrying");
            let _ = msg.ack_with(AckKind::Nak(Some(pause))).await;
        }
    }
}
