//! Teammate turns taken straight from the inboxes (`worker.read-inboxes`, on by default).
//!
//! ```text
//!  team.send ──► <prefix>.tmbox.<team>.<to>.<from>   (mailbox stream, stored)
//!                     │ consumer "worker-inbox", shared by every worker of every pool
//!                     ▼
//!  a worker of the teammate's pool with a free slot:
//!      CAS teammate.<team>.<to>: idle → working, this worker the host, carried by the mail
//!      ──► the turn runs here, the mail's delivery kept alive like an attempt's task
//!  any other worker (another pool's teammate, every slot taken):
//!      CAS idle → working (a dispatch) ──► <prefix>.turn.<pool>.<team>.<to>   (as before)
//! ```
//!
//! A message to an idle teammate is two hops from its send to the claim: stored, then
//! delivered to a worker that claims it with one compare-and-set — where the supervisor's
//! wake is five round trips (the entry read, the message stored while the entry is marked
//! `working`, the turn published, the turn delivered, the claim's read and write).
//!
//! The turn is carried by the message's delivery: in-progress acknowledgements while the agent
//! runs, acknowledged at the end. A worker killed mid-turn leaves it unacknowledged, so it is
//! delivered again after the ack wait, and the worker that gets it claims the same turn again
//! (the entry's `carried_by` names the message), fencing the first host out — what a
//! redelivered turn message does.
//!
//! Mail for a teammate that is already `working` is acknowledged: the running (or dispatched)
//! turn reads its inbox after its claim, and again when it ends (`turn::wake_if_pending`).
//! Refusals are as for a wake: a teammate shut down or at its hourly cap keeps its mail for a
//! later turn.
//!
//! Supervisors see from the worker registry that a live worker reads the inboxes
//! ([`FEATURE_READS_INBOXES`](flotilla_model::worker::FEATURE_READS_INBOXES)) and leave the
//! wake to the workers, waking only mail still unread a few seconds later; with no such
//! worker (older workers, or `read-inboxes = false` everywhere) they wake every message at
//! once, as before.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, AckKind, kv};
use flotilla_bus::SharedConsumer;
use flotilla_bus::liveness::Pulse;
use flotilla_bus::mirror::KvMirror;
use flotilla_model::subjects::StreamKind;
use flotilla_model::teammate::{Teammate, TeammateStatus, teammate_key};
use flotilla_model::time::Timestamp;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::options::WorkerOptions;
use crate::shared::Shared;
use crate::turn::{Carrier, TurnError, cas_from, fenced, publish_turn, run_claimed, settle, store};

/// The durable consumer every worker shares on the teammate inboxes.
pub const INBOX_CONSUMER: &str = "worker-inbox";

/// Messages asked for in one pull: taking or dispatching a turn is quick (the turn itself
/// runs in a task of its own).
const BATCH: usize = 64;

/// How long mail for a turn held by another host, which this worker cannot take over now
/// (every slot taken), waits before it is delivered again.
const RETRY_TAKE_OVER: Duration = Duration::from_secs(1);

/// The shared durable consumer of every teammate inbox. It starts at the mail stored from its
/// creation on: older mail was the supervisors' to wake.
pub fn inbox_consumer(names: &flotilla_model::Names, opts: &WorkerOptions) -> SharedConsumer {
    SharedConsumer {
        stream: StreamKind::Mailbox,
        durable: INBOX_CONSUMER.to_owned(),
        description: "Flotilla workers: teammate turns taken from the inboxes".to_owned(),
        filters: vec![names.teammate_inbox_all()],
        ack_wait: opts.ack_wait(),
        // A turn holds its mail unacknowledged while it runs.
        max_ack_pending: 100_000,
        only_new: true,
    }
}

/// Pulls the teammate inboxes until `shutdown`; each message becomes a turn here, a turn
/// dispatched to its pool's queue, or nothing (the teammate is busy, shut down or capped).
pub(crate) async fn pull_inboxes(
    shared: Arc<Shared>,
    consumer: PullConsumer,
    kv: kv::Store,
    pulse: Pulse,
    shutdown: CancellationToken,
) {
    // The teammates' entries, so a claim needs no read first (a value a moment behind only
    // costs the read after all: the compare-and-set fails and is redone from a fresh read).
    let mates: KvMirror<Teammate> = KvMirror::new();
    mates.follow_keys(kv.clone(), "teammate.>", shutdown.clone());
    let mut running = tokio::task::JoinSet::new();
    while !shutdown.is_cancelled() {
        let pull = crate::pull::pull_each(&consumer, BATCH, &pulse, &shutdown, |msg| {
            let (shared, kv, mates, stop) = (
                Arc::clone(&shared),
                kv.clone(),
                mates.clone(),
                shutdown.clone(),
            );
            running.spawn(async move { on_mail(&shared, &kv, &mates, msg, &stop).await });
        });
        if pulse.attend(pull).await == Some(false) {
            break;
        }
        while running.try_join_next().is_some() {}
    }
    while running.join_next().await.is_some() {}
}

/// Reads a teammate's entry with its revision (`None`: no such teammate).
async fn read(kv: &kv::Store, key: &str) -> Result<Option<(Teammate, u64)>, TurnError> {
    match kv.entry(key).await.map_err(store)? {
        Some(e) if e.operation == kv::Operation::Put => {
            let mate = serde_json::from_slice::<Teammate>(&e.value)
                .map_err(|err| TurnError::Store(format!("{key} could not be read: {err}")))?;
            Ok(Some((mate, e.revision)))
        }
        _ => Ok(None),
    }
}

/// One message on a teammate's inbox.
async fn on_mail(
    shared: &Shared,
    kv: &kv::Store,
    mates: &KvMirror<Teammate>,
    msg: jetstream::Message,
    stopping: &CancellationToken,
) {
    let names = shared.bus.names();
    let Some((team, name)) = names
        .teammate_inbox_parts(&msg.subject)
        .map(|(t, n)| (t.to_owned(), n.to_owned()))
    else {
        let _ = msg.ack_with(AckKind::Term).await;
        return;
    };
    let Ok(seq) = msg.info().map(|i| i.stream_sequence) else {
        let _ = msg.ack_with(AckKind::Term).await;
        return;
    };
    if stopping.is_cancelled() {
        let _ = msg.ack_with(AckKind::Nak(None)).await;
        return;
    }
    let key = teammate_key(&team, &name);
    let known = match mates.get(&key) {
        Some(m) => Ok(Some((m.value, m.revision))),
        None => read(kv, &key).await,
    };
    let known = match known {
        Ok(Some(k)) => k,
        // No such teammate: its mail stays in the inbox, read by nobody.
        Ok(None) => {
            let _ = msg.ack().await;
            return;
        }
        Err(e) => {
            let ran = Err(e);
            return settle(shared, kv, &msg, &team, &name, Carrier::Mail(seq), ran).await;
        }
    };
    let runs_here =
        known.0.pool == shared.opts.pool && shared.agents.resolve(Some(&known.0.agent)).is_ok();
    // A teammate already in another turn is not taken here: the turn queue's path finds it
    // busy (after a fresh read) without the conversation read a turn starts with.
    let in_another_turn = known.0.status == TeammateStatus::Working && !known.0.carries(seq);
    let slot = if runs_here && !in_another_turn {
        Arc::clone(&shared.run_slots).try_acquire_owned().ok()
    } else {
        None
    };
    let Some(_slot) = slot else {
        return dispatch(shared, kv, &msg, &team, &name, seq, known).await;
    };
    let host = shared.id.clone();
    let taking = async {
        let now = Timestamp::now();
        let (mate, _) = cas_from(kv, &key, Some((Some(known.0), known.1)), |m| {
            let mut m = m
                .flatten()
                .ok_or_else(|| TurnError::NotFound(key.clone()))?;
            let cap = m.turns_per_hour;
            m.take_mail(seq, &host, now, cap).map_err(fenced)?;
            Ok(Some(m))
        })
        .await?;
        let mate = mate.ok_or_else(|| TurnError::NotFound(key.clone()))?;
        let epoch = mate.epoch;
        Ok((mate, epoch))
    };
    let ran = run_claimed(shared, kv, &msg, &team, &name, taking).await;
    settle(shared, kv, &msg, &team, &name, Carrier::Mail(seq), ran).await;
}

/// Mail this worker does not take itself (another pool's teammate, no free slot here, or a
/// teammate in another turn): the teammate is woken through its pool's turn queue — marked
/// `working` with a new dispatch, and the turn published — as the supervisor would; one in
/// another turn is left to it, the mail acknowledged. A teammate dispatched and not
/// yet claimed has its turn published again (de-duplicated). A turn this mail carries whose
/// host is gone waits for a worker with a free slot to take it over.
async fn dispatch(
    shared: &Shared,
    kv: &kv::Store,
    msg: &jetstream::Message,
    team: &str,
    name: &str,
    seq: u64,
    known: (Teammate, u64),
) {
    let key = teammate_key(team, name);
    let now = Timestamp::now();
    let mut carried = false;
    let mut again: Option<Teammate> = None;
    let woken = cas_from(kv, &key, Some((Some(known.0), known.1)), |m| {
        let mut m = m
            .flatten()
            .ok_or_else(|| TurnError::NotFound(key.clone()))?;
        carried = m.carries(seq);
        again = (m.status == TeammateStatus::Working && m.host.is_none() && !carried)
            .then(|| m.clone());
        let cap = m.turns_per_hour;
        m.wake(now, cap).map_err(fenced)?;
        Ok(Some(m))
    })
    .await;
    let to_publish = match woken {
        Ok((Some(m), _)) => Some(m),
        Ok((None, _)) => None,
        Err(TurnError::Fenced(_)) | Err(TurnError::NotFound(_)) if carried => {
            let _ = msg.ack_with(AckKind::Nak(Some(RETRY_TAKE_OVER))).await;
            return;
        }
        Err(TurnError::Fenced(_)) | Err(TurnError::NotFound(_)) => again,
        Err(e) => return settle(shared, kv, msg, team, name, Carrier::Mail(seq), Err(e)).await,
    };
    if let Some(m) = to_publish
        && let Err(e) = publish_turn(&shared.bus, &m).await
    {
        // Working without a turn: this mail comes again and publishes it (same message id).
        warn!(team, teammate = name, error = %e, "Could not dispatch a teammate's turn; retrying");
        let ran = Err(store(e));
        return settle(shared, kv, msg, team, name, Carrier::Mail(seq), ran).await;
    }
    let _ = msg.ack().await;
}
