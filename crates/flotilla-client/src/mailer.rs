//! Messages to teammates stored straight in their inboxes: `team.send` without the
//! supervisor on the message's path.
//!
//! ```text
//!  team.send   client ──► supervisor (checks) ──► inbox ──► worker: claim (compare-and-set)
//!  Mailer      client (checks)                ──► inbox ──► worker: claim (compare-and-set)
//! ```
//!
//! A message sent through the supervisor crosses a connection five times before its turn is
//! claimed (to the server, to a supervisor, back to the server to be stored, to a worker, back
//! with the claim); a raw JetStream hop crosses twice. A [`Mailer`] makes the supervisor's
//! checks itself — the same ones, `flotilla_model::teammate_mail` — from its mirror of the
//! teammates' entries, and stores the message in the inbox at once: three crossings. The
//! worker the message reaches claims the turn as for any mail (`worker.read-inboxes`); with
//! no such worker live, the supervisors wake it from their inbox consumer.
//!
//! What the supervisor's `team.send` answers, a [`Mailer`] answers too: the same refusals
//! with the same codes (`not_found`, `shut_down`, `message_too_large`, `turns_per_hour`,
//! `invalid_*`), and nothing stored for them; [`TeamSent`] with the stored sequence otherwise.
//! Two differences, both of a mirror a moment behind, as the supervisor's own mirror is:
//! a teammate the mirror does not know yet is read from the bucket (a send right after a
//! spawn finds it), and a shutdown or a cap reached a moment ago may let one message in,
//! which the teammate's claim then refuses (the mail stays in the inbox for a later turn, as
//! for mail the supervisor stored in that moment). The message cap is the one the teammate
//! was spawned with (its entry's `max_message_bytes`), which `team.send` checks too; an
//! entry without one (spawned by an older supervisor, or written back by an older binary
//! during a rolling update) is checked against the supervisor's configuration, which only
//! the supervisor knows, so that message goes through `team.send`. The hourly cap is judged
//! by this process's clock.
//!
//! The NATS user needs to publish on `<prefix>.tmbox.>` and read the team bucket's
//! `teammate.>` keys (direct gets and a watch). In the shipped accounts
//! (`deploy/nats/accounts.conf`) those are the operator's and the supervisor's; other users
//! send through `team.send`.

use std::time::Duration;

use async_nats::jetstream::kv;
use flotilla_bus::Bus;
use flotilla_bus::mirror::KvMirror;
use flotilla_model::ErrorCode;
use flotilla_model::api::ApiError;
use flotilla_model::subjects::Bucket;
use flotilla_model::teammate::{
    DEFAULT_TEAM, TeamSendRequest, TeamSent, Teammate, TeammatePost, teammate_key,
};
use flotilla_model::teammate_mail as mail;
use flotilla_model::time::Timestamp;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::{ClientError, ClientErrorKind, nats};

/// How long [`Mailer::open`] waits for its mirror to hold every teammate; past it, sends read
/// the entries they do not find in it.
const SYNC_WAIT: Duration = Duration::from_secs(5);

/// Sends messages to teammates straight to their inboxes, checked from a mirror of the
/// teammates' entries (see the module's documentation). Cheap to clone; the mirror stops
/// following the bucket when the last clone is dropped.
#[derive(Clone)]
pub struct Mailer {
    bus: Bus,
    kv: kv::Store,
    mates: KvMirror<Teammate>,
    /// Stops the mirror's watch (none for [`Mailer::reading`]).
    _follow: Option<std::sync::Arc<DropGuard>>,
}

impl std::fmt::Debug for Mailer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mailer")
            .field("synced", &self.mates.is_synced())
            .finish_non_exhaustive()
    }
}

impl Mailer {
    /// Opens the team bucket and follows its teammates' entries; returns once the mirror
    /// holds them all (or after 5 s, sends reading what they do not find).
    pub async fn open(bus: Bus) -> Result<Self, ClientError> {
        let mut mailer = Self::reading(bus).await?;
        let stop = CancellationToken::new();
        // Guarded before the wait: an `open` given up meanwhile stops the watch too.
        mailer._follow = Some(std::sync::Arc::new(stop.clone().drop_guard()));
        mailer
            .mates
            .follow_keys(mailer.kv.clone(), "teammate.>", stop);
        let _ = tokio::time::timeout(SYNC_WAIT, mailer.mates.synced()).await;
        Ok(mailer)
    }

    /// A mailer without a mirror: each send reads its teammate's entry first (one round trip
    /// more), which suits a one-off send (`flotilla team send --direct`).
    pub async fn reading(bus: Bus) -> Result<Self, ClientError> {
        let kv = bus
            .kv(Bucket::Team)
            .await
            .map_err(|e| nats("opening the team bucket", e))?;
        Ok(Self {
            bus,
            kv,
            mates: KvMirror::new(),
            _follow: None,
        })
    }

    /// Sends `r` as `team.send` would: `Ok(Ok(sent))` with the message's stream sequence,
    /// `Ok(Err(refusal))` for a message refused (nothing stored), `Err` when NATS or
    /// JetStream failed (a message may have been stored when the acknowledgement was lost:
    /// the sequence is then unknown).
    pub async fn send(
        &self,
        r: &TeamSendRequest,
    ) -> Result<Result<TeamSent, ApiError>, ClientError> {
        if let Err(e) = flotilla_model::codec::check_protocol(r.protocol) {
            return Ok(Err(api_error(
                ErrorCode::UnsupportedProtocol,
                e.to_string(),
            )));
        }
        let team = r.team.as_deref().unwrap_or(DEFAULT_TEAM);
        let checked = mail::check_team(team)
            .and_then(|()| mail::check_teammate_name(&r.to))
            .and_then(|()| mail::check_sender(r.from.as_deref()));
        let from = match checked {
            Ok(from) => from,
            Err(e) => return Ok(Err(refused(e))),
        };
        let Some(mate) = self.teammate(team, &r.to).await? else {
            let names = self.names(team).await?;
            return Ok(Err(refused(mail::not_found(team, &r.to, &names))));
        };
        // An entry without its cap (spawned by an older supervisor, or written back by an
        // older worker or supervisor during a rolling update) is checked against the
        // supervisor's configured cap, which only the supervisor knows: it is sent there.
        let Some(cap) = mate.max_message_bytes else {
            return crate::Client::new(self.bus.clone())
                .call(r, crate::API_TIMEOUT)
                .await;
        };
        let accepted = mail::check_size(&r.text, cap)
            .and_then(|()| mail::check_accepts(&mate, Timestamp::now()));
        if let Err(e) = accepted {
            return Ok(Err(refused(e)));
        }
        let post = TeammatePost {
            protocol: flotilla_model::PROTOCOL_VERSION,
            from: from.clone(),
            text: r.text.clone(),
        };
        let subject = self.bus.names().teammate_inbox(team, &r.to, &from);
        match self.bus.publish(subject, &post, None).await {
            Ok(ack) => Ok(Ok(TeamSent {
                delivered: vec![r.to.clone()],
                seqs: vec![ack.sequence],
            })),
            Err(e) => stored_error(e),
        }
    }

    /// The teammate's entry: from the mirror, else read (one spawned a moment ago).
    async fn teammate(&self, team: &str, name: &str) -> Result<Option<Teammate>, ClientError> {
        let key = teammate_key(team, name);
        if let Some(m) = self.mates.get(&key) {
            return Ok(Some(m.value));
        }
        // A user that may not read the bucket is refused by the server, said at once (not
        // a timeout).
        let read = self
            .bus
            .refusable(
                |s| s.starts_with("$JS.API.DIRECT.GET.KV_"),
                self.kv.entry(&key),
            )
            .await
            .map_err(|refusal| {
                ClientError::new(
                    ClientErrorKind::PermissionDenied,
                    format!("reading {key}: {refusal}; this user sends through team.send instead"),
                )
            })?;
        match read.map_err(|e| nats(format!("reading {key}"), e))? {
            Some(e) if e.operation == kv::Operation::Put => {
                serde_json::from_slice(&e.value).map(Some).map_err(|err| {
                    ClientError::with_source(ClientErrorKind::Decode, format!("reading {key}"), err)
                })
            }
            _ => Ok(None),
        }
    }

    /// The names of `team`'s teammates, for a refusal: from the mirror, else from the
    /// bucket's keys.
    async fn names(&self, team: &str) -> Result<Vec<String>, ClientError> {
        let mut names: Vec<String> = if self.mates.is_synced() {
            self.mates
                .matching(|m| m.team == team)
                .into_iter()
                .map(|(_, m)| m.name)
                .collect()
        } else {
            use futures::TryStreamExt;
            let prefix = teammate_key(team, "");
            self.kv
                .keys()
                .await
                .map_err(|e| nats("listing the teammates", e))?
                .try_filter_map(|k| {
                    let name = k.strip_prefix(&prefix).map(str::to_owned);
                    async move { Ok(name) }
                })
                .try_collect()
                .await
                .map_err(|e| nats("listing the teammates", e))?
        };
        names.sort();
        Ok(names)
    }
}

fn refused(e: mail::MailRefused) -> ApiError {
    api_error(e.code, e.message)
}

/// A refusal with `code`'s own status.
fn api_error(code: ErrorCode, message: impl Into<String>) -> ApiError {
    ApiError::new(code.status(), code, message)
}

/// A message that could not be stored: the stream's limits are refusals, as `team.send`
/// answers them; the rest are errors.
fn stored_error(e: flotilla_bus::PublishError) -> Result<Result<TeamSent, ApiError>, ClientError> {
    use flotilla_bus::PublishErrorKind as K;
    match e.kind() {
        K::StreamFull => Ok(Err(api_error(
            ErrorCode::QuotaExceeded,
            "the message is refused: the mailbox stream is full",
        ))),
        K::TooLarge => Ok(Err(api_error(
            ErrorCode::MessageTooLarge,
            "the message is larger than this deployment's NATS accepts (max_payload)",
        ))),
        K::PermissionDenied => Err(ClientError::new(
            ClientErrorKind::PermissionDenied,
            format!(
                "{}; this user sends through team.send instead (see flotilla_client::mailer)",
                e.detail()
            ),
        )),
        K::NoStream => Err(ClientError::new(
            ClientErrorKind::NotProvisioned,
            flotilla_bus::error::Diagnosis::NotProvisioned.hint(),
        )),
        _ => Err(nats("storing the message in the inbox", e)),
    }
}
