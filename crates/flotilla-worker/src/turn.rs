//! Teammate turns: a worker pulls its pool's turn queue (`turns-<pool>` on the tasks stream,
//! filter `<prefix>.turn.<pool>.>`), shared by the pool's workers, while it has a free agent
//! slot — or, every slot taken, in line with the tasks waiting for one here, so a worker kept
//! busy by its pool's tasks still takes turns (the turn it pulls waits for a slot, kept
//! alive). A turn taken straight from the inbox ([`crate::inbox`]) runs the same way from its
//! claim on (`run_claimed`), carried by the mail's delivery instead of a turn message.
//!
//! One turn, fenced by the teammate's epoch (see `flotilla_model::teammate`):
//!
//! 1. **claim** — compare-and-set the entry: the dispatch the message carries must still be
//!    the current one; the epoch moves on and names this worker the host. A redelivered turn
//!    (its first host died or stalled) is claimed again by the next worker, which fences the
//!    first out.
//! 2. **fence the conversation** — write it back with the host's epoch (compare-and-set on its
//!    revision): a stale host's later save, based on an older revision, is refused.
//! 3. read the inbox after the conversation's cursor; nothing new → back to `idle`.
//!
//! Steps 1–3 take two round trips to JetStream after the claim's read, not five: the
//! conversation is read while the claim is written (the fence is conditional on the revision
//! read, so a write in between is noticed and the fence redone from a fresh read), and the
//! inbox is read while the fence is written (again after a redone fence that moved the
//! cursor). A turn's start is on the path of every message to an idle teammate.
//!
//! 4. run the agent (the teammate's definition) on its instructions, its conversation and the
//!    new messages, under in-progress acknowledgements (heartbeats) like an attempt.
//! 5. **save** the conversation (bounded, compacted), then **finish**: `idle` (or `shutdown`
//!    when asked for), both refused unless the epoch is still this host's.
//! 6. acknowledge; if mail arrived meanwhile, wake it again (compare-and-set, de-duplicated
//!    turn message).
//!
//! A turn whose conversation or mail cannot be read or stored is delivered again, pausing
//! 1 s doubling to 30 s, up to `worker.max-deliveries` in all; then it is given up: the
//! teammate goes back to `idle` with the reason as its `last_error` (shown by the team API
//! and `flotilla team`), its mail unread for the next turn, and the turn message is
//! terminated.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, AckKind, kv};
use flotilla_bus::liveness::Pulse;
use flotilla_bus::{Bus, SharedConsumer, wire};
use flotilla_context::{Clients, Scope};
use flotilla_model::subjects::StreamKind;
use flotilla_model::task::TaskEnvelope;
use flotilla_model::teammate::{
    Conversation, Line, Refused, Speaker, Teammate, TeammatePost, TurnEnvelope, conversation_key,
    teammate_key,
};
use flotilla_model::time::Timestamp;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::agent::{AgentContext, EventEmitter};
use crate::options::WorkerOptions;
use crate::shared::Shared;

/// How long one turn's agent may run.
pub const TURN_TIMEOUT: Duration = Duration::from_secs(600);

/// Messages read into one turn at most (the rest wait for the next turn).
const MAX_MESSAGES: usize = 100;

/// Compare-and-set attempts before a write gives up.
const MAX_TRIES: usize = 20;

/// The shared durable consumer of `pool`'s teammate turns.
pub fn turn_consumer(
    names: &flotilla_model::Names,
    pool: &str,
    opts: &WorkerOptions,
) -> SharedConsumer {
    SharedConsumer {
        stream: StreamKind::Tasks,
        durable: names.turn_consumer(pool),
        description: format!("Flotilla teammate turns of pool {pool}"),
        filters: vec![names.turn_filter(pool)],
        ack_wait: opts.ack_wait(),
        max_ack_pending: 100_000,
        only_new: false,
    }
}

/// Why a fenced write was not made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TurnError {
    /// Another host owns the teammate now (or the turn is over).
    #[error("fenced: {0}")]
    Fenced(String),
    /// The teammate does not exist.
    #[error("no teammate {0}")]
    NotFound(String),
    /// The bucket could not be read or written.
    #[error("{0}")]
    Store(String),
}

pub(crate) fn store(e: impl std::fmt::Display) -> TurnError {
    TurnError::Store(e.to_string())
}

/// A stored value of `key` that does not decode.
fn unreadable(key: &str, e: impl std::fmt::Display) -> TurnError {
    TurnError::Store(format!("{key} could not be read: {e}"))
}

/// Read-modify-write of one JSON value with compare-and-set. `change` returns `Err` to stop
/// without writing.
async fn cas<T, F>(kv: &kv::Store, key: &str, change: F) -> Result<(T, u64), TurnError>
where
    T: serde::Serialize + serde::de::DeserializeOwned + Default,
    F: FnMut(Option<T>) -> Result<T, TurnError>,
{
    cas_from(kv, key, None, change).await
}

/// [`cas`] starting from `known` (a value and its revision, from a mirror) instead of a
/// read: no read when it is current. `change` refusing a known value is not final — the
/// value is read and `change` asked again — so a stale mirror decides nothing.
pub(crate) async fn cas_from<T, F>(
    kv: &kv::Store,
    key: &str,
    mut known: Option<(T, u64)>,
    mut change: F,
) -> Result<(T, u64), TurnError>
where
    T: serde::Serialize + serde::de::DeserializeOwned + Default,
    F: FnMut(Option<T>) -> Result<T, TurnError>,
{
    for _ in 0..MAX_TRIES {
        let (next, revision) = match known.take() {
            Some((value, revision)) => match change(Some(value)) {
                Ok(next) => (next, Some(revision)),
                Err(_) => continue,
            },
            None => {
                let entry = kv.entry(key).await.map_err(store)?;
                let (current, revision) = match entry {
                    Some(e) if e.operation == kv::Operation::Put => (
                        Some(
                            serde_json::from_slice::<T>(&e.value)
                                .map_err(|e| unreadable(key, e))?,
                        ),
                        Some(e.revision),
                    ),
                    Some(e) => (None, Some(e.revision)),
                    None => (None, None),
                };
                (change(current)?, revision)
            }
        };
        let bytes = serde_json::to_vec(&next).map_err(store)?;
        let written = match revision {
            Some(rev) => match kv.update(key, bytes.into(), rev).await {
                Ok(r) => Some(r),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => None,
                Err(e) => return Err(store(e)),
            },
            None => match kv.create(key, bytes.into()).await {
                Ok(r) => Some(r),
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => None,
                Err(e) => return Err(store(e)),
            },
        };
        if let Some(rev) = written {
            return Ok((next, rev));
        }
    }
    Err(TurnError::Store(format!("{key} kept changing")))
}

pub(crate) fn fenced(r: Refused) -> TurnError {
    TurnError::Fenced(format!("{r:?}"))
}

/// Claims the turn dispatched with `dispatched` for `host`: the host's epoch.
pub async fn claim(
    kv: &kv::Store,
    team: &str,
    name: &str,
    dispatched: u64,
    host: &str,
) -> Result<(Teammate, u64), TurnError> {
    let key = teammate_key(team, name);
    let now = Timestamp::now();
    let (mate, _) = cas::<Option<Teammate>, _>(kv, &key, |m| {
        let mut m = m
            .flatten()
            .ok_or_else(|| TurnError::NotFound(key.clone()))?;
        m.claim(dispatched, host, now).map_err(fenced)?;
        Ok(Some(m))
    })
    .await?;
    let mate = mate.ok_or_else(|| TurnError::NotFound(key.clone()))?;
    let epoch = mate.epoch;
    Ok((mate, epoch))
}

/// Writes the conversation as the host of `epoch`: refused when it holds a later epoch, and
/// (with `revision`) when anybody wrote it since that revision. Returns the new revision.
pub async fn save_conversation(
    kv: &kv::Store,
    team: &str,
    name: &str,
    epoch: u64,
    revision: Option<u64>,
    mut conversation: Conversation,
) -> Result<u64, TurnError> {
    let key = conversation_key(team, name);
    if let Some(rev) = revision {
        conversation.epoch = epoch;
        let bytes = serde_json::to_vec(&conversation).map_err(store)?;
        return match kv.update(&key, bytes.into(), rev).await {
            Ok(r) => Ok(r),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Err(TurnError::Fenced(
                format!("{key} changed since revision {rev}"),
            )),
            Err(e) => Err(store(e)),
        };
    }
    let (_, rev) = cas::<Conversation, _>(kv, &key, |c| {
        let c = c.unwrap_or_default();
        if c.epoch > epoch {
            return Err(TurnError::Fenced(format!(
                "{key} was written by epoch {} (mine: {epoch})",
                c.epoch
            )));
        }
        let mut next = conversation.clone();
        next.epoch = epoch;
        Ok(next)
    })
    .await?;
    Ok(rev)
}

/// Reads the conversation with its revision (`None`: the key was never written).
async fn load_conversation(
    kv: &kv::Store,
    team: &str,
    name: &str,
) -> Result<(Conversation, Option<u64>), TurnError> {
    let key = conversation_key(team, name);
    match kv.entry(&key).await.map_err(store)? {
        Some(e) if e.operation == kv::Operation::Put => Ok((
            serde_json::from_slice(&e.value).map_err(|e| unreadable(&key, e))?,
            Some(e.revision),
        )),
        Some(e) => Ok((Conversation::default(), Some(e.revision))),
        None => Ok((Conversation::default(), None)),
    }
}

/// The fence: writes `conv`, read at `read_at` (see [`load_conversation`]), back with the
/// host's `epoch`. The write is conditional on that revision, so it needs no second read;
/// when somebody wrote the conversation since, it is done by compare-and-set from a fresh
/// read instead ([`save_conversation`]'s rule: refused when a later epoch wrote it), and the
/// conversation as it is now comes back too. Returns the new revision.
async fn fence(
    kv: &kv::Store,
    team: &str,
    name: &str,
    epoch: u64,
    conv: &Conversation,
    read_at: Option<u64>,
) -> Result<(u64, Option<Conversation>), TurnError> {
    let key = conversation_key(team, name);
    if conv.epoch > epoch {
        return Err(TurnError::Fenced(format!(
            "{key} was written by epoch {} (mine: {epoch})",
            conv.epoch
        )));
    }
    let mut mine = conv.clone();
    mine.epoch = epoch;
    let bytes = serde_json::to_vec(&mine).map_err(store)?;
    let written = match read_at {
        Some(rev) => match kv.update(&key, bytes.into(), rev).await {
            Ok(r) => Some(r),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => None,
            Err(e) => return Err(store(e)),
        },
        None => match kv.create(&key, bytes.into()).await {
            Ok(r) => Some(r),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => None,
            Err(e) => return Err(store(e)),
        },
    };
    if let Some(rev) = written {
        return Ok((rev, None));
    }
    let (now, rev) = cas::<Conversation, _>(kv, &key, |c| {
        let mut c = c.unwrap_or_default();
        if c.epoch > epoch {
            return Err(TurnError::Fenced(format!(
                "{key} was written by epoch {} (mine: {epoch})",
                c.epoch
            )));
        }
        c.epoch = epoch;
        Ok(c)
    })
    .await?;
    Ok((rev, Some(now)))
}

/// Ends the host's turn: `idle` (or `shutdown`), refused unless `epoch` is still the entry's.
/// `ran: false`: there was nothing to read; no turn is counted.
pub async fn finish(
    kv: &kv::Store,
    team: &str,
    name: &str,
    epoch: u64,
    ran: Option<(bool, &str)>,
) -> Result<Teammate, TurnError> {
    let key = teammate_key(team, name);
    let now = Timestamp::now();
    let (m, _) = cas::<Option<Teammate>, _>(kv, &key, |m| {
        let mut m = m
            .flatten()
            .ok_or_else(|| TurnError::NotFound(key.clone()))?;
        match ran {
            Some((success, reply)) => m.finish(epoch, success, Some(reply), now),
            None => m.nothing_to_do(epoch, now),
        }
        .map_err(fenced)?;
        Ok(Some(m))
    })
    .await?;
    m.ok_or(TurnError::NotFound(key))
}

/// Wakes an idle teammate whose inbox holds mail after `cursor` (what the supervisor does on
/// mail, done here for mail that came during a turn). The turn dispatched, if any.
async fn wake_if_pending(bus: &Bus, kv: &kv::Store, mate: &Teammate, cursor: u64) {
    let names = bus.names();
    let filter = names.teammate_inbox_filter(&mate.team, &mate.name);
    match bus
        .direct_batch(StreamKind::Mailbox, &filter, cursor, 1, None)
        .await
    {
        Ok(m) if !m.is_empty() => {}
        Ok(_) => return,
        Err(e) => {
            debug!(error = %e, "Cannot look for pending teammate mail");
            return;
        }
    }
    let key = teammate_key(&mate.team, &mate.name);
    let now = Timestamp::now();
    let woken = cas::<Option<Teammate>, _>(kv, &key, |m| {
        let mut m = m
            .flatten()
            .ok_or_else(|| TurnError::NotFound(key.clone()))?;
        let cap = m.turns_per_hour;
        m.wake(now, cap).map_err(fenced)?;
        Ok(Some(m))
    })
    .await;
    let Ok((Some(m), _)) = woken else { return };
    if let Err(e) = publish_turn(bus, &m).await {
        warn!(teammate = %key, error = %e, "Could not dispatch the next turn; the next message dispatches it again, or a supervisor for mail still unread");
    }
}

/// Publishes the turn `mate` was dispatched with to its pool's turn queue (de-duplicated by
/// the dispatch: publishing it again is harmless).
pub(crate) async fn publish_turn(
    bus: &Bus,
    mate: &Teammate,
) -> Result<(), flotilla_bus::PublishError> {
    let turn = TurnEnvelope {
        protocol: flotilla_model::PROTOCOL_VERSION,
        team: mate.team.clone(),
        name: mate.name.clone(),
        epoch: mate.dispatch,
    };
    bus.publish(
        bus.names().turn(&mate.pool, &mate.team, &mate.name),
        &turn,
        Some(&turn.msg_id()),
    )
    .await
    .map(|_| ())
}

/// Pulls `pool`'s turns while this worker has a free slot (or, all taken, in turn with what
/// waits for one here: [`Shared::wait_for_turn`]), until `shutdown`.
pub(crate) async fn pull_turns(
    shared: Arc<Shared>,
    consumer: PullConsumer,
    kv: kv::Store,
    pulse: Pulse,
    shutdown: CancellationToken,
) {
    let mut running = tokio::task::JoinSet::new();
    while !shutdown.is_cancelled() {
        let pull = async {
            let waiting = pulse.busy();
            if !shared.wait_for_turn(&shutdown).await {
                return false;
            }
            drop(waiting);
            let max = shared.run_slots.available_permits().max(1);
            crate::pull::pull_each(&consumer, max, &pulse, &shutdown, |msg| {
                let (shared, kv, stop) = (Arc::clone(&shared), kv.clone(), shutdown.clone());
                running.spawn(async move { run_turn(&shared, &kv, msg, &stop).await });
            })
            .await
        };
        if pulse.attend(pull).await == Some(false) {
            break;
        }
        while running.try_join_next().is_some() {}
    }
    while running.join_next().await.is_some() {}
}

async fn run_turn(
    shared: &Shared,
    kv: &kv::Store,
    msg: jetstream::Message,
    stopping: &CancellationToken,
) {
    let turn: TurnEnvelope = match wire::decode(msg.headers.as_ref(), &msg.payload) {
        Ok(t) => t,
        Err(e) => {
            warn!(error = %e, "Unreadable turn message; dropping it");
            let _ = msg.ack_with(AckKind::Term).await;
            return;
        }
    };
    // A turn pulled while every slot was taken waits for one, kept alive like a prefetched
    // task; a stopping worker hands it back.
    let Some(_slot) = crate::attempt::wait_for_slot(shared, &msg, stopping).await else {
        let _ = msg.ack_with(AckKind::Nak(None)).await;
        return;
    };
    let (team, name) = (turn.team.as_str(), turn.name.as_str());
    let claiming = claim(kv, team, name, turn.epoch, &shared.id);
    let ran = run_claimed(shared, kv, &msg, team, name, claiming).await;
    settle(
        shared,
        kv,
        &msg,
        team,
        name,
        Carrier::Dispatched(turn.epoch),
        ran,
    )
    .await;
}

/// Which turn a worker holds: one dispatched through the turn queue (the dispatch its turn
/// message carries), or one taken straight from the inbox (the mailbox stream sequence of the
/// message whose delivery carries it, [`Teammate::take_mail`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Carrier {
    Dispatched(u64),
    Mail(u64),
}

/// Acknowledges the message that carried a turn by how the turn went: fenced out or over
/// (nothing changes), or — its conversation or mail could not be read or stored — delivered
/// again, pausing 1 s doubling to 30 s, until `worker.max-deliveries`, then given up visibly.
pub(crate) async fn settle(
    shared: &Shared,
    kv: &kv::Store,
    msg: &jetstream::Message,
    team: &str,
    name: &str,
    carrier: Carrier,
    ran: Result<(), TurnError>,
) {
    match ran {
        Ok(()) => {}
        Err(TurnError::Fenced(why)) | Err(TurnError::NotFound(why)) => {
            // Another host owns it, or the turn is over: this delivery changes nothing.
            info!(team, teammate = name, why, "Turn fenced out");
            let _ = msg.ack().await;
        }
        Err(TurnError::Store(e)) => {
            let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
            if delivered < shared.opts.max_deliveries {
                let pause = flotilla_bus::consume::redelivery_delay(
                    delivered,
                    Duration::from_secs(1),
                    MAX_REDELIVERY_DELAY,
                );
                warn!(team, teammate = name, delivered, retry_in = ?pause, error = %e, "Turn could not be read or stored; it will be delivered again");
                let _ = msg.ack_with(AckKind::Nak(Some(pause))).await;
                return;
            }
            // It failed the same way delivery after delivery: give the turn up, visibly.
            let reason = format!("its turn could not run, {delivered} deliveries: {e}");
            match give_up(kv, team, name, carrier, &shared.id, &reason).await {
                Ok(_) => {
                    warn!(team, teammate = name, delivered, error = %e, "Turn given up: the teammate is idle again with the reason, its mail unread")
                }
                Err(not_recorded) => {
                    tracing::error!(team, teammate = name, delivered, error = %e, not_recorded = %not_recorded, "Turn given up, and the teammate's entry could not say why")
                }
            }
            let _ = msg.ack_with(AckKind::Term).await;
        }
    }
}

/// The longest pause before a turn that could not be read or stored is delivered again.
const MAX_REDELIVERY_DELAY: Duration = Duration::from_secs(30);

/// Gives up the turn `carrier` names as `host`, which could not run it at all: the teammate
/// goes back to `idle` with `reason` as its `last_error` (see [`Teammate::give_up_turn`]);
/// refused when another host holds the turn or it is over.
pub(crate) async fn give_up(
    kv: &kv::Store,
    team: &str,
    name: &str,
    carrier: Carrier,
    host: &str,
    reason: &str,
) -> Result<Teammate, TurnError> {
    let key = teammate_key(team, name);
    let now = Timestamp::now();
    let (m, _) = cas::<Option<Teammate>, _>(kv, &key, |m| {
        let mut m = m
            .flatten()
            .ok_or_else(|| TurnError::NotFound(key.clone()))?;
        let dispatched = match carrier {
            Carrier::Dispatched(d) => d,
            Carrier::Mail(seq) if m.carries(seq) => m.dispatch,
            Carrier::Mail(_) => return Err(TurnError::Fenced(format!("{key}: the turn is over"))),
        };
        m.give_up_turn(dispatched, host, reason, now)
            .map_err(fenced)?;
        Ok(Some(m))
    })
    .await?;
    m.ok_or(TurnError::NotFound(key))
}

/// One turn from its claim (`claiming`: the turn queue's [`claim`], or the inbox's take) to
/// its end, the carrying message `msg` acknowledged once the teammate is idle again.
pub(crate) async fn run_claimed(
    shared: &Shared,
    kv: &kv::Store,
    msg: &jetstream::Message,
    team: &str,
    name: &str,
    claiming: impl std::future::Future<Output = Result<(Teammate, u64), TurnError>>,
) -> Result<(), TurnError> {
    // The claim and the conversation's read at once: the fence below is conditional on the
    // revision read, so a write between the read and the claim (a stale host's) is noticed.
    let (claimed, loaded) = tokio::join!(claiming, load_conversation(kv, team, name));
    let (mate, epoch) = claimed?;
    let (mut conv, read_at) = loaded?;
    // The fence (from here on an older host's save of the conversation is refused) and the
    // inbox read after the conversation's cursor at once; the read is repeated only when the
    // conversation had changed and its cursor with it.
    let filter = shared.bus.names().teammate_inbox_filter(team, name);
    let inbox = |cursor: u64| {
        shared.bus.direct_batch(
            StreamKind::Mailbox,
            &filter,
            cursor,
            MAX_MESSAGES,
            Some(1 << 20),
        )
    };
    let (fenced, stored) = tokio::join!(
        fence(kv, team, name, epoch, &conv, read_at),
        inbox(conv.cursor)
    );
    let (rev, fresh) = fenced?;
    let mut stored = stored.map_err(store)?;
    if let Some(fresh) = fresh {
        if fresh.cursor != conv.cursor {
            stored = inbox(fresh.cursor).await.map_err(store)?;
        }
        conv = fresh;
    }
    conv.epoch = epoch;
    let Some(last) = stored.last().map(|m| m.seq) else {
        let m = finish(kv, team, name, epoch, None).await?;
        let _ = msg.ack().await;
        wake_if_pending(&shared.bus, kv, &m, conv.cursor).await;
        return Ok(());
    };
    let new: Vec<Line> = stored
        .iter()
        .map(|m| {
            let post = serde_json::from_slice::<TeammatePost>(&m.payload);
            let at = Timestamp::from_unix_ms(m.ts_ms);
            match post {
                Ok(p) => Line {
                    speaker: Speaker::User,
                    from: Some(p.from),
                    text: p.text,
                    at,
                    failed: false,
                },
                Err(e) => Line {
                    speaker: Speaker::User,
                    from: None,
                    text: format!("(an unreadable message: {e})"),
                    at,
                    failed: false,
                },
            }
        })
        .collect();
    let (success, reply) = run_agent(shared, msg, &mate, &conv, &new).await;
    conv.lines.extend(new);
    conv.lines.push(Line {
        speaker: Speaker::Assistant,
        from: None,
        text: reply.clone(),
        at: Timestamp::now(),
        // Marked, so a caller waiting for this turn (an agents-protocol prompt) knows.
        failed: !success,
    });
    conv.cursor = last;
    conv.turns += 1;
    conv.compact();
    save_conversation(kv, team, name, epoch, Some(rev), conv).await?;
    let m = finish(kv, team, name, epoch, Some((success, &reply))).await?;
    let _ = msg.ack().await;
    wake_if_pending(&shared.bus, kv, &m, last).await;
    Ok(())
}

fn render(mate: &Teammate, conv: &Conversation, new: &[Line]) -> (String, String) {
    let line = |l: &Line| match (l.speaker, &l.from) {
        (Speaker::Assistant, _) => format!("you: {}", l.text),
        (Speaker::User, Some(f)) => format!("{f}: {}", l.text),
        (Speaker::User, None) => l.text.clone(),
    };
    let mut description = format!(
        "You are {}, a persistent teammate with the role {} in team {}.\n{}\n",
        mate.name, mate.role, mate.team, mate.instructions
    );
    if !conv.lines.is_empty() {
        description.push_str("\nConversation so far");
        if conv.dropped > 0 {
            description.push_str(&format!(" ({} older lines dropped)", conv.dropped));
        }
        description.push_str(":\n");
        for l in &conv.lines {
            description.push_str(&line(l));
            description.push('\n');
        }
    }
    let query: Vec<String> = new.iter().map(line).collect();
    (description, query.join("\n"))
}

/// Runs the teammate's agent on one turn: `(success, reply or error)`.
async fn run_agent(
    shared: &Shared,
    msg: &jetstream::Message,
    mate: &Teammate,
    conv: &Conversation,
    new: &[Line],
) -> (bool, String) {
    let (description, query) = render(mate, conv, new);
    let envelope = serde_json::json!({
        // A run's lead acts in its run; another teammate's turn is a run of its own.
        "run_id": mate.run.unwrap_or_default(),
        "session_id": mate.team.parse::<flotilla_model::SessionId>().ok(),
        "task_id": mate.name,
        "attempt": conv.turns + 1,
        "attempt_id": flotilla_model::ids::AttemptId::new(),
        "agent": mate.agent,
        "pool": mate.pool,
        "role": mate.role,
        "required": true,
        "timeout": TURN_TIMEOUT.as_secs(),
        "description": description,
        "query": query,
        "input": {
            "teammate": {"name": mate.name, "team": mate.team, "role": mate.role, "epoch": mate.epoch},
            "turn": conv.turns + 1,
            "conversation": conv.lines,
            "dropped": conv.dropped,
            "messages": new,
        },
        "dispatched_at": Timestamp::now(),
    });
    let task: TaskEnvelope = match serde_json::from_value(envelope) {
        Ok(t) => t,
        Err(e) => return (false, format!("cannot build the turn's envelope: {e}")),
    };
    let agent = match shared.agents.resolve(Some(&mate.agent)) {
        Ok((_, a)) => Arc::clone(a),
        Err(e) => return (false, e),
    };
    let mut scope = Scope::from_envelope(&task, 1, shared.bus.names().clone());
    // The team is the turn's session key (also when it is not a session id): its session
    // state lasts across turns, and `flotilla team ...` (`FLOTILLA_SESSION_ID`) and the LLM
    // teammate tools act in the teammate's own team.
    scope.session = mate.team.clone();
    let clients = match Clients::new(shared.bus.clone(), scope) {
        Ok(c) => c,
        Err(e) => return (false, e.to_string()),
    };
    let cancel = shared.hard_stop.child_token();
    let events = EventEmitter::new(Some(shared.bus.clone()), &task, &shared.id, 1);
    let ctx = AgentContext::new(
        clients,
        cancel.clone(),
        Instant::now() + TURN_TIMEOUT,
        events,
        shared.id.clone(),
    );
    let run = agent.run(&task, ctx);
    tokio::pin!(run);
    let deadline = tokio::time::sleep(TURN_TIMEOUT);
    tokio::pin!(deadline);
    let mut heartbeat = tokio::time::interval_at(
        tokio::time::Instant::now() + shared.opts.progress_interval(),
        shared.opts.progress_interval(),
    );
    loop {
        tokio::select! {
            biased;
            r = &mut run => {
                return match r {
                    Ok(reply) => (true, reply.response),
                    Err(e) => (false, e.to_string()),
                };
            }
            _ = heartbeat.tick() => {
                let _ = msg.ack_with(AckKind::Progress).await;
            }
            _ = &mut deadline => {
                cancel.cancel();
                return (false, format!("the turn exceeded {}s", TURN_TIMEOUT.as_secs()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The fence against a real nats-server: written on the revision read in one round
    //! trip; redone from a fresh read when the conversation changed since; refused, changing
    //! nothing, when a later epoch wrote it.

    use flotilla_model::subjects::Bucket;
    use flotilla_testkit::NatsServer;

    use super::*;

    fn line(text: &str) -> Line {
        Line {
            speaker: Speaker::User,
            from: Some("op".into()),
            text: text.into(),
            at: Timestamp::now(),
            failed: false,
        }
    }

    async fn stored(kv: &kv::Store) -> anyhow::Result<(Conversation, u64)> {
        let e = kv
            .entry(conversation_key("t", "ann"))
            .await?
            .ok_or_else(|| anyhow::anyhow!("no conversation"))?;
        Ok((serde_json::from_slice(&e.value)?, e.revision))
    }

    #[tokio::test]
    async fn the_fence_writes_on_the_revision_read_or_redoes_it_from_a_fresh_read()
    -> anyhow::Result<()> {
        let server = NatsServer::start().await?;
        let bus = server.provisioned_bus().await?;
        let kv = bus.kv(Bucket::Team).await?;

        // Never written: created with the host's epoch.
        let (conv, read_at) = load_conversation(&kv, "t", "ann").await?;
        assert_eq!(read_at, None);
        let (rev, fresh) = fence(&kv, "t", "ann", 2, &conv, read_at).await?;
        assert!(fresh.is_none(), "nothing changed since the read");
        let (now, at) = stored(&kv).await?;
        assert_eq!((now.epoch, at), (2, rev));

        // Read, then written by someone else (a stale host's save): the fence notices and
        // fences what is there now, returning it (its cursor moved).
        let (conv, read_at) = load_conversation(&kv, "t", "ann").await?;
        assert_eq!(read_at, Some(rev));
        let mut other = conv.clone();
        other.lines.push(line("late save"));
        other.cursor = 7;
        let other_rev = save_conversation(&kv, "t", "ann", 2, Some(rev), other).await?;
        let (rev, fresh) = fence(&kv, "t", "ann", 3, &conv, read_at).await?;
        let fresh = fresh.ok_or_else(|| anyhow::anyhow!("the fence should have re-read"))?;
        assert_eq!((fresh.cursor, fresh.epoch, fresh.lines.len()), (7, 3, 1));
        assert!(rev > other_rev);
        let (now, _) = stored(&kv).await?;
        assert_eq!(
            (now.cursor, now.epoch, now.lines.len()),
            (7, 3, 1),
            "the late save is kept"
        );

        // A later epoch wrote it: refused, nothing written — read before, and read after
        // the later write.
        let (conv, read_at) = load_conversation(&kv, "t", "ann").await?;
        let before = stored(&kv).await?.1;
        let refused = fence(&kv, "t", "ann", 2, &conv, read_at).await;
        assert!(matches!(refused, Err(TurnError::Fenced(_))), "{refused:?}");
        let mut stale = conv.clone();
        stale.epoch = 1;
        let refused = fence(&kv, "t", "ann", 2, &stale, Some(before - 1)).await;
        assert!(matches!(refused, Err(TurnError::Fenced(_))), "{refused:?}");
        assert_eq!(stored(&kv).await?.1, before, "nothing changed");
        Ok(())
    }
}
