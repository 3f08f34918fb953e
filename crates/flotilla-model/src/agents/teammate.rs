//! Persistent teammates: named agents of a team that keep a conversation between turns and
//! cost nothing while idle.
//!
//! A teammate is one entry in the team bucket (`<prefix>-team`, key
//! `teammate.<team>.<name>`, [`Teammate`]) and one conversation (same bucket, key
//! `conv.<team>.<name>`, [`Conversation`]). Its lifecycle is
//! `spawned → working → idle → working … → shutdown`: a message to its inbox
//! (`<prefix>.tmbox.<team>.<name>.<from>` on the mailbox stream) wakes it — the entry is
//! compare-and-set from `idle` to `working` with the next **epoch**, and one turn message
//! ([`TurnEnvelope`], `Nats-Msg-Id: turn.<team>.<name>.<epoch>`) goes to the pool's turn
//! queue (`<prefix>.turn.<pool>.<team>.<name>` on the tasks stream). The worker that pulls
//! it **claims** the turn (the epoch moves on again, naming it the host), loads the
//! conversation, runs the agent on the new messages, saves, and sets the entry back to
//! `idle`. Every write after the claim is fenced: it is refused unless the entry still
//! holds the host's epoch, so a host that lost its turn (killed, or too slow and the turn
//! redelivered) changes nothing.
//!
//! Everything here is pure; the supervisor and the workers apply these changes with
//! compare-and-set.

use std::collections::VecDeque;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::time::Timestamp;

/// Where a teammate is in its lifecycle.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum TeammateStatus {
    /// Created; no turn has run yet (its first message wakes it like an idle one).
    Spawned,
    /// A turn is dispatched or running.
    Working,
    /// Waiting for mail: holds no worker slot, no process and no consumer.
    Idle,
    /// Ended: refuses mail; its entry stays for the record.
    Shutdown,
}

impl TeammateStatus {
    /// The status as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Spawned => "spawned",
            Self::Working => "working",
            Self::Idle => "idle",
            Self::Shutdown => "shutdown",
        }
    }
}

/// One lifecycle transition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Transition {
    /// The status entered.
    pub status: TeammateStatus,
    /// The epoch from then on.
    pub epoch: u64,
    /// When (the writer's clock; the entry's own server time is its KV revision's).
    pub at: Timestamp,
    /// The worker hosting the turn (`working` after a claim).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
}

/// The default cap of one message to a teammate, in bytes (the supervisor's
/// `max-message-bytes`).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// A teammate's entry (`<prefix>-team`, key [`teammate_key`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Teammate {
    /// Its name: its mailbox address within the team.
    pub name: String,
    /// The team (a session id by default).
    pub team: String,
    /// Its role.
    pub role: String,
    /// The agent definition its turns run.
    pub agent: String,
    /// The pool whose workers run its turns.
    pub pool: String,
    /// What it is for: given to the agent on every turn.
    pub instructions: String,
    /// Where it is in its lifecycle.
    pub status: TeammateStatus,
    /// Moves on with every dispatch and every claim: the fence of its writes.
    pub epoch: u64,
    /// The epoch its current turn was dispatched with (what the turn message carries).
    #[serde(default)]
    pub dispatch: u64,
    /// The worker running its turn, once claimed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// The mailbox stream sequence of the message whose delivery carries the current turn,
    /// when a worker took the turn straight from the inbox ([`Teammate::take_mail`]) instead
    /// of from a turn message: a redelivery of that message (its host died or stalled)
    /// claims the turn again. Absent for a turn from the turn queue, and when no turn runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub carried_by: Option<u64>,
    /// Shut down after the current turn.
    #[serde(default)]
    pub shutdown_requested: bool,
    /// Turns finished.
    #[serde(default)]
    pub turns: u64,
    /// Turns whose agent failed.
    #[serde(default)]
    pub turns_failed: u64,
    /// Its cap of turns per hour (the supervisor's `turns-per-hour` when it was spawned).
    #[serde(default = "default_turns_per_hour")]
    pub turns_per_hour: u32,
    /// Start times (Unix ms) of the turns dispatched in the last hour: the hourly cap.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recent_turns: Vec<i64>,
    /// The newest transitions (at most [`Teammate::MAX_TRANSITIONS`]).
    #[serde(default)]
    pub transitions: VecDeque<Transition>,
    /// When its last turn ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_progress: Option<Timestamp>,
    /// The start of its last reply (at most [`Teammate::MAX_REPLY`] bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_reply: Option<String>,
    /// Why its last turn could not run at all (its conversation or mail could not be read or
    /// written, delivery after delivery): the turn was given up and it went back to `idle`,
    /// its mail still unread. Cleared by the next turn that runs. At most
    /// [`Teammate::MAX_REPLY`] bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// Who spawned it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spawned_by: Option<String>,
    /// The run it leads (the lead of a run under the `supervisor` strategy): its turns act in
    /// that run — their events join the run's stream, and its tools assign, recruit and
    /// finish there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<crate::ids::RunId>,
    /// Served as an agent of the NATS Agent Protocol by the supervisors (`team.spawn` with
    /// `expose`; `[agents-protocol] expose-teammates` exposes every teammate whatever this
    /// says).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub expose: bool,
    /// The cap of one message to it, in bytes: the supervisor's `max-message-bytes` when it
    /// was spawned. `team.send` and a sender that stores mail straight in the inbox both
    /// check it. Absent in entries spawned by older supervisors, or written back by older
    /// workers or supervisors: `team.send` then checks its own `max-message-bytes`, and a
    /// direct sender leaves the message to `team.send`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_message_bytes: Option<usize>,
}

/// Why a lifecycle change was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// It is shut down (or shutting down, for a wake).
    Shutdown,
    /// Its turns of the last hour reached the cap.
    TurnsPerHour(u32),
    /// Nothing to do: it is already working.
    Busy,
    /// The writer's epoch is not the entry's: another host owns it now.
    StaleEpoch {
        /// The writer's.
        mine: u64,
        /// The entry's.
        current: u64,
    },
}

impl Teammate {
    /// Transitions kept.
    pub const MAX_TRANSITIONS: usize = 32;
    /// Longest reply excerpt kept.
    pub const MAX_REPLY: usize = 1024;
    /// Longest instructions, in bytes.
    pub const MAX_INSTRUCTIONS: usize = 16 * 1024;

    /// A new teammate, `spawned` at `now`.
    pub fn spawn(
        team: &str,
        name: &str,
        role: &str,
        agent: &str,
        pool: &str,
        instructions: &str,
        now: Timestamp,
    ) -> Self {
        let mut t = Self {
            name: name.to_owned(),
            team: team.to_owned(),
            role: role.to_owned(),
            agent: agent.to_owned(),
            pool: pool.to_owned(),
            instructions: instructions.to_owned(),
            status: TeammateStatus::Spawned,
            epoch: 0,
            dispatch: 0,
            host: None,
            carried_by: None,
            shutdown_requested: false,
            turns: 0,
            turns_failed: 0,
            turns_per_hour: default_turns_per_hour(),
            recent_turns: Vec::new(),
            transitions: VecDeque::new(),
            last_progress: None,
            last_reply: None,
            last_error: None,
            spawned_by: None,
            run: None,
            expose: false,
            max_message_bytes: None,
        };
        t.record(TeammateStatus::Spawned, now);
        t
    }

    fn record(&mut self, status: TeammateStatus, now: Timestamp) {
        self.status = status;
        self.transitions.push_back(Transition {
            status,
            epoch: self.epoch,
            at: now,
            host: self.host.clone(),
        });
        while self.transitions.len() > Self::MAX_TRANSITIONS {
            self.transitions.pop_front();
        }
    }

    /// Turns dispatched within the hour before `now`.
    pub fn turns_last_hour(&self, now: Timestamp) -> usize {
        let since = now.unix_ms() - 3_600_000;
        self.recent_turns.iter().filter(|t| **t > since).count()
    }

    /// Whether another turn fits the hourly cap at `now`.
    pub fn check_rate(&self, now: Timestamp, per_hour: u32) -> Result<(), Refused> {
        if self.turns_last_hour(now) >= per_hour as usize {
            return Err(Refused::TurnsPerHour(per_hour));
        }
        Ok(())
    }

    /// Mail arrived: `spawned`/`idle` → `working` with the next epoch (the epoch of the turn
    /// to dispatch, returned).
    pub fn wake(&mut self, now: Timestamp, per_hour: u32) -> Result<u64, Refused> {
        match self.status {
            TeammateStatus::Shutdown => return Err(Refused::Shutdown),
            TeammateStatus::Working => return Err(Refused::Busy),
            TeammateStatus::Idle | TeammateStatus::Spawned => {}
        }
        if self.shutdown_requested {
            return Err(Refused::Shutdown);
        }
        self.check_rate(now, per_hour)?;
        let since = now.unix_ms() - 3_600_000;
        self.recent_turns.retain(|t| *t > since);
        self.recent_turns.push(now.unix_ms());
        self.epoch += 1;
        self.dispatch = self.epoch;
        self.host = None;
        self.carried_by = None;
        self.record(TeammateStatus::Working, now);
        Ok(self.epoch)
    }

    /// Mail `seq` reached `host`, which takes the turn it wakes at once, carried by that
    /// message's delivery — what [`wake`](Self::wake) and [`claim`](Self::claim) do, in one
    /// write, with no turn message. When the turn `seq` carries is already the current one
    /// (the message came again: its host died or stalled), it is claimed again, fencing the
    /// first host out. Refused as a wake is: shut down, at the hourly cap, or `Busy` with
    /// another turn (which reads the mail: a turn reads its inbox after its claim, and looks
    /// again when it ends). Returns the host's epoch.
    pub fn take_mail(
        &mut self,
        seq: u64,
        host: &str,
        now: Timestamp,
        per_hour: u32,
    ) -> Result<u64, Refused> {
        if self.status == TeammateStatus::Working && self.carried_by == Some(seq) {
            let dispatched = self.dispatch;
            return self.claim(dispatched, host, now);
        }
        let dispatched = self.wake(now, per_hour)?;
        self.carried_by = Some(seq);
        self.claim(dispatched, host, now)
    }

    /// Whether the turn now running is the one mail `seq` carries (see
    /// [`take_mail`](Self::take_mail)).
    pub fn carries(&self, seq: u64) -> bool {
        self.status == TeammateStatus::Working && self.carried_by == Some(seq)
    }

    /// A worker took the turn dispatched with `dispatched`: the epoch moves on and names it
    /// the host (a redelivered turn claimed by another worker fences out the first). Returns
    /// the host's epoch.
    pub fn claim(&mut self, dispatched: u64, host: &str, now: Timestamp) -> Result<u64, Refused> {
        // The current dispatch, claimed first or again (a redelivery).
        if self.status != TeammateStatus::Working || self.dispatch != dispatched {
            return Err(Refused::StaleEpoch {
                mine: dispatched,
                current: self.epoch,
            });
        }
        self.epoch += 1;
        self.host = Some(host.to_owned());
        self.record(TeammateStatus::Working, now);
        Ok(self.epoch)
    }

    /// Checks that `epoch` (a host's) is the entry's.
    pub fn fence(&self, epoch: u64) -> Result<(), Refused> {
        if self.epoch != epoch || self.status != TeammateStatus::Working {
            return Err(Refused::StaleEpoch {
                mine: epoch,
                current: self.epoch,
            });
        }
        Ok(())
    }

    /// The host's turn ended: back to `idle`, or `shutdown` when it was asked for.
    pub fn finish(
        &mut self,
        epoch: u64,
        success: bool,
        reply: Option<&str>,
        now: Timestamp,
    ) -> Result<(), Refused> {
        self.fence(epoch)?;
        self.turns += 1;
        if !success {
            self.turns_failed += 1;
        }
        if let Some(r) = reply {
            self.last_reply = Some(cut(r, Self::MAX_REPLY));
        }
        self.last_error = None;
        self.last_progress = Some(now);
        self.host = None;
        self.carried_by = None;
        let next = if self.shutdown_requested {
            TeammateStatus::Shutdown
        } else {
            TeammateStatus::Idle
        };
        self.record(next, now);
        Ok(())
    }

    /// A turn woke it but there was nothing new to read: back to `idle` without counting a
    /// turn.
    pub fn nothing_to_do(&mut self, epoch: u64, now: Timestamp) -> Result<(), Refused> {
        self.fence(epoch)?;
        self.host = None;
        self.carried_by = None;
        self.last_error = None;
        self.recent_turns.pop();
        let next = if self.shutdown_requested {
            TeammateStatus::Shutdown
        } else {
            TeammateStatus::Idle
        };
        self.record(next, now);
        Ok(())
    }

    /// The turn dispatched with `dispatched` could not run at all (see
    /// [`last_error`](Self::last_error)), and `host` gives it up: back to `idle` (or
    /// `shutdown` when asked for) with `reason`; its mail stays unread for the next turn, and
    /// the turn counts as failed. Refused unless that turn is still the current one and no
    /// other worker holds it.
    pub fn give_up_turn(
        &mut self,
        dispatched: u64,
        host: &str,
        reason: &str,
        now: Timestamp,
    ) -> Result<(), Refused> {
        let held_elsewhere = self.host.as_deref().is_some_and(|h| h != host);
        if self.status != TeammateStatus::Working || self.dispatch != dispatched || held_elsewhere {
            return Err(Refused::StaleEpoch {
                mine: dispatched,
                current: self.epoch,
            });
        }
        self.turns_failed += 1;
        self.last_error = Some(cut(reason, Self::MAX_REPLY));
        self.last_progress = Some(now);
        self.host = None;
        self.carried_by = None;
        let next = if self.shutdown_requested {
            TeammateStatus::Shutdown
        } else {
            TeammateStatus::Idle
        };
        self.record(next, now);
        Ok(())
    }

    /// Shut it down: at once when no turn runs, else after the current turn. `false`: it
    /// already was (or is about to be).
    pub fn shutdown(&mut self, now: Timestamp) -> bool {
        match self.status {
            TeammateStatus::Shutdown => false,
            TeammateStatus::Working => {
                let changed = !self.shutdown_requested;
                self.shutdown_requested = true;
                changed
            }
            TeammateStatus::Idle | TeammateStatus::Spawned => {
                self.shutdown_requested = true;
                self.host = None;
                self.carried_by = None;
                self.record(TeammateStatus::Shutdown, now);
                true
            }
        }
    }
}

fn default_turns_per_hour() -> u32 {
    120
}

fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// The key of a teammate's entry: `teammate.<team>.<name>`.
pub fn teammate_key(team: &str, name: &str) -> String {
    format!("teammate.{team}.{name}")
}

/// The key filter of a team's teammates: `teammate.<team>.*`.
pub fn team_filter(team: &str) -> String {
    format!("teammate.{team}.*")
}

/// The key of a teammate's conversation: `conv.<team>.<name>`.
pub fn conversation_key(team: &str, name: &str) -> String {
    format!("conv.{team}.{name}")
}

/// Who said one line of a conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Speaker {
    /// A message it received (the sender is `from`).
    User,
    /// Its own reply.
    Assistant,
}

/// One line of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Line {
    /// Who.
    pub speaker: Speaker,
    /// The sender of a received message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// The text.
    pub text: String,
    /// When it was stored (server time of the message; the worker's clock for replies).
    pub at: Timestamp,
    /// A reply whose turn failed: `text` is why (what the agent said instead of a reply).
    /// Tells a waiting caller (an agents-protocol prompt) that its turn failed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub failed: bool,
}

/// A teammate's memory (`<prefix>-team`, key [`conversation_key`]): its newest lines, bounded
/// in count and bytes; older lines are dropped and counted (compaction).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Conversation {
    /// The epoch of the host that wrote it last: a host of an older epoch must not write.
    pub epoch: u64,
    /// The inbox sequence read up to (mailbox stream).
    pub cursor: u64,
    /// Turns recorded.
    pub turns: u64,
    /// Lines dropped by compaction.
    #[serde(default)]
    pub dropped: u64,
    /// The newest lines, oldest first.
    #[serde(default)]
    pub lines: Vec<Line>,
}

impl Conversation {
    /// Lines kept.
    pub const MAX_LINES: usize = 64;
    /// Bytes of text kept.
    pub const MAX_BYTES: usize = 128 * 1024;

    /// Drops the oldest lines beyond the bounds.
    pub fn compact(&mut self) {
        let mut bytes: usize = self.lines.iter().map(|l| l.text.len()).sum();
        let mut drop = 0;
        while self.lines.len() - drop > Self::MAX_LINES
            || (bytes > Self::MAX_BYTES && self.lines.len() - drop > 1)
        {
            bytes -= self.lines[drop].text.len();
            drop += 1;
        }
        if drop > 0 {
            self.lines.drain(..drop);
            self.dropped += drop as u64;
        }
    }
}

/// A turn to run (`<prefix>.turn.<pool>.<team>.<name>`, `Nats-Msg-Id:
/// turn.<team>.<name>.<epoch>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TurnEnvelope {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The team.
    pub team: String,
    /// The teammate.
    pub name: String,
    /// The epoch of the dispatch (the claim compares it).
    pub epoch: u64,
}

impl TurnEnvelope {
    /// Its message id: one turn per teammate and epoch, whoever dispatches it.
    pub fn msg_id(&self) -> String {
        format!("turn.{}.{}.{}", self.team, self.name, self.epoch)
    }
}

/// A message to a teammate's inbox (`<prefix>.tmbox.<team>.<to>.<from>`, mailbox stream).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TeammatePost {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The sender (a teammate's name, a task id, `operator`).
    pub from: String,
    /// The text.
    pub text: String,
}

/// A teammate as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TeammateView {
    /// Its name.
    pub name: String,
    /// Its team.
    pub team: String,
    /// Its role.
    pub role: String,
    /// Its agent definition.
    pub agent: String,
    /// The pool running its turns.
    pub pool: String,
    /// Its lifecycle status.
    pub status: TeammateStatus,
    /// Its epoch.
    pub epoch: u64,
    /// The worker running its turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Shutting down after the current turn.
    pub shutdown_requested: bool,
    /// Turns finished.
    pub turns: u64,
    /// Turns whose agent failed.
    pub turns_failed: u64,
    /// Turns dispatched in the last hour.
    pub turns_last_hour: u64,
    /// When its last turn ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_progress: Option<Timestamp>,
    /// The start of its last reply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_reply: Option<String>,
    /// Why its last turn could not run at all (given up after its deliveries); absent once a
    /// turn runs again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// Its newest transitions.
    pub transitions: Vec<Transition>,
    /// When the entry was last written (server time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<Timestamp>,
    /// Spawned with `expose`: served as an agent of the NATS Agent Protocol.
    #[serde(default)]
    pub expose: bool,
}

impl TeammateView {
    /// The view of `t` at `now`.
    pub fn of(t: &Teammate, now: Timestamp, updated_at: Option<Timestamp>) -> Self {
        Self {
            name: t.name.clone(),
            team: t.team.clone(),
            role: t.role.clone(),
            agent: t.agent.clone(),
            pool: t.pool.clone(),
            status: t.status,
            epoch: t.epoch,
            host: t.host.clone(),
            shutdown_requested: t.shutdown_requested,
            turns: t.turns,
            turns_failed: t.turns_failed,
            turns_last_hour: t.turns_last_hour(now) as u64,
            last_progress: t.last_progress,
            last_reply: t.last_reply.clone(),
            last_error: t.last_error.clone(),
            transitions: t.transitions.iter().cloned().collect(),
            updated_at,
            expose: t.expose,
        }
    }
}

/// `team.spawn`: creates a teammate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TeamSpawnRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The team (default `default`; agents pass their session).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team: Option<String>,
    /// Its name (`A-Z a-z 0-9 _ -`, not starting with `_`).
    pub name: String,
    /// Its role.
    pub role: String,
    /// What it is for.
    pub instructions: String,
    /// The agent definition its turns run (default: the first configured member filling
    /// `role`, else the supervisor's `default-agent`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// The pool running its turns (default: a pool hosting the agent, else `default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Who asks (recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// Serve it as an agent of the NATS Agent Protocol (`agents.prompt.<name>.<owner>.<team>`,
    /// names made tokens): a prompt is a message to it and its turn's reply the answer.
    /// Default `false`; `[agents-protocol] expose-teammates` exposes every teammate.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub expose: bool,
}

/// `team.send`: a message to a teammate's inbox; wakes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TeamSendRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The team (default `default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team: Option<String>,
    /// The teammate.
    pub to: String,
    /// The sender (default `operator`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// The text.
    pub text: String,
}

/// The answer of `team.send`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TeamSent {
    /// The teammates it went to.
    pub delivered: Vec<String>,
    /// Mailbox stream sequences, in the same order.
    pub seqs: Vec<u64>,
}

/// `team.broadcast`: one message to every teammate of a team that is not shut down.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TeamBroadcastRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The team (default `default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team: Option<String>,
    /// The sender (default `operator`; a teammate does not receive its own broadcast).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// The text.
    pub text: String,
}

/// `team.shutdown`: ends a teammate after its current turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TeamShutdownRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The team (default `default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team: Option<String>,
    /// The teammate.
    pub name: String,
}

/// `team.mates`: the teammates, of one team or all.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TeamMatesRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// Only this team's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team: Option<String>,
}

/// The answer of `team.mates`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TeamMates {
    /// The teammates, by team then name.
    pub teammates: Vec<TeammateView>,
}

/// The team of a request: `default` when none is named.
pub fn team_or_default(team: &Option<String>) -> &str {
    team.as_deref().unwrap_or(DEFAULT_TEAM)
}

/// The team of requests that name none.
pub const DEFAULT_TEAM: &str = "default";

impl crate::api::ApiRequest for TeamSpawnRequest {
    const ENDPOINT: &'static str = "team.spawn";
    type Reply = TeammateView;
}

impl crate::api::ApiRequest for TeamSendRequest {
    const ENDPOINT: &'static str = "team.send";
    type Reply = TeamSent;
}

impl crate::api::ApiRequest for TeamBroadcastRequest {
    const ENDPOINT: &'static str = "team.broadcast";
    type Reply = TeamSent;
}

impl crate::api::ApiRequest for TeamShutdownRequest {
    const ENDPOINT: &'static str = "team.shutdown";
    type Reply = TeammateView;
}

impl crate::api::ApiRequest for TeamMatesRequest {
    const ENDPOINT: &'static str = "team.mates";
    type Reply = TeamMates;
}

crate::api::has_protocol!(
    TeamSpawnRequest,
    TeamSendRequest,
    TeamBroadcastRequest,
    TeamShutdownRequest,
    TeamMatesRequest
);

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: i64) -> Timestamp {
        Timestamp::from_unix_ms(ms)
    }

    #[test]
    fn mail_taken_straight_from_the_inbox() {
        let mut t = Teammate::spawn("s", "ann", "analyst", "good", "default", "help", at(0));
        // Mail 7 reaches w1, which wakes and claims it in one change.
        let a = t.take_mail(7, "w1", at(1), 10).expect("taken");
        assert_eq!(
            (t.status, t.host.as_deref(), t.carried_by),
            (TeammateStatus::Working, Some("w1"), Some(7))
        );
        assert_eq!(t.epoch, a);
        assert!(t.carries(7) && !t.carries(8));
        // Other mail finds it busy: the running turn reads it.
        assert_eq!(t.take_mail(8, "w2", at(2), 10), Err(Refused::Busy));
        // Mail 7 comes again (w1 died): w2 claims the turn, fencing w1 out.
        let b = t.take_mail(7, "w2", at(3), 10).expect("claimed again");
        assert!(b > a);
        assert!(matches!(
            t.finish(a, true, None, at(4)),
            Err(Refused::StaleEpoch { .. })
        ));
        t.finish(b, true, Some("done"), at(5)).expect("finished");
        assert_eq!(
            (t.status, t.carried_by, t.turns),
            (TeammateStatus::Idle, None, 1)
        );
        // A late delivery of mail 7 after its turn ended is a new turn (it finds nothing new).
        let c = t.take_mail(7, "w3", at(6), 10).expect("a new turn");
        t.nothing_to_do(c, at(7)).expect("back to idle");
        assert_eq!((t.turns, t.recent_turns.len(), t.carried_by), (1, 1, None));
        // A turn from the queue is not carried by mail.
        let d = t.wake(at(8), 10).expect("woken");
        assert!(!t.carries(7));
        assert_eq!(t.take_mail(9, "w1", at(9), 10), Err(Refused::Busy));
        let e = t.claim(d, "w1", at(10)).expect("claimed");
        t.finish(e, true, None, at(11)).expect("finished");
        // Caps hold as for a wake.
        assert_eq!(
            t.take_mail(10, "w1", at(12), 2),
            Err(Refused::TurnsPerHour(2))
        );
        t.shutdown(at(13));
        assert_eq!(t.take_mail(11, "w1", at(14), 10), Err(Refused::Shutdown));
        let mut u = Teammate::spawn("s", "bo", "analyst", "good", "default", "help", at(0));
        u.take_mail(1, "w1", at(1), 10).expect("taken");
        let dispatched = u.dispatch;
        u.give_up_turn(dispatched, "w1", "unreadable", at(2))
            .expect("given up");
        assert_eq!((u.status, u.carried_by), (TeammateStatus::Idle, None));
    }

    #[test]
    fn lifecycle_and_fencing() {
        let mut t = Teammate::spawn("s", "ann", "analyst", "good", "default", "help", at(0));
        assert_eq!(t.status, TeammateStatus::Spawned);
        let d = t.wake(at(1), 10).expect("wakes");
        assert_eq!(t.wake(at(2), 10), Err(Refused::Busy));
        let a = t.claim(d, "w1", at(3)).expect("claimed");
        // The turn is redelivered to w2: it claims the same dispatch, fencing out w1.
        let b = t.claim(d, "w2", at(4)).expect("claimed again");
        assert!(b > a);
        assert!(matches!(
            t.finish(a, true, Some("late"), at(5)),
            Err(Refused::StaleEpoch { .. })
        ));
        assert_eq!(t.turns, 0, "a stale host changed nothing");
        t.finish(b, true, Some("done"), at(6)).expect("finished");
        assert_eq!((t.status, t.turns), (TeammateStatus::Idle, 1));
        assert!(t.claim(d, "w3", at(7)).is_err(), "an old dispatch is over");
        let statuses: Vec<_> = t.transitions.iter().map(|t| t.status.as_str()).collect();
        assert_eq!(
            statuses,
            ["spawned", "working", "working", "working", "idle"]
        );
    }

    #[test]
    fn a_turn_given_up_says_why_and_the_next_one_that_runs_clears_it() {
        let mut t = Teammate::spawn("s", "ann", "analyst", "good", "default", "help", at(0));
        let d = t.wake(at(1), 10).expect("wakes");
        let epoch = t.claim(d, "w1", at(2)).expect("claimed");
        // Another worker may not give up a turn w1 holds, nor anybody an older dispatch.
        assert!(t.give_up_turn(d, "w2", "x", at(3)).is_err());
        assert!(t.give_up_turn(d - 1, "w1", "x", at(3)).is_err());
        t.give_up_turn(d, "w1", "conv.s.ann unreadable", at(4))
            .expect("given up");
        assert_eq!(
            (t.status, t.turns, t.turns_failed, t.host.as_deref()),
            (TeammateStatus::Idle, 0, 1, None)
        );
        assert_eq!(t.last_error.as_deref(), Some("conv.s.ann unreadable"));
        assert!(
            matches!(
                t.finish(epoch, true, None, at(5)),
                Err(Refused::StaleEpoch { .. })
            ),
            "the host's turn is over"
        );
        // A turn nobody claimed (the conversation failed before the claim) can be given up too.
        let d = t.wake(at(6), 10).expect("wakes");
        t.give_up_turn(d, "w2", "again", at(7)).expect("given up");
        assert_eq!(t.last_error.as_deref(), Some("again"));
        // The view shows it; the next turn that runs clears it.
        let view = TeammateView::of(&t, at(8), None);
        assert_eq!(view.last_error.as_deref(), Some("again"));
        let d = t.wake(at(9), 10).expect("wakes");
        let epoch = t.claim(d, "w1", at(10)).expect("claimed");
        t.finish(epoch, true, Some("fine"), at(11))
            .expect("finished");
        assert_eq!(t.last_error, None);
        let json = serde_json::to_value(TeammateView::of(&t, at(12), None)).expect("json");
        assert!(
            json.get("last_error").is_none(),
            "omitted when absent: {json}"
        );
    }

    #[test]
    fn shutdown_waits_for_the_turn() {
        let mut t = Teammate::spawn("s", "ann", "r", "a", "p", "", at(0));
        let d = t.wake(at(1), 10).expect("wakes");
        let e = t.claim(d, "w", at(2)).expect("claimed");
        assert!(t.shutdown(at(3)));
        assert_eq!(t.status, TeammateStatus::Working);
        t.finish(e, true, None, at(4)).expect("finished");
        assert_eq!(t.status, TeammateStatus::Shutdown);
        assert_eq!(t.wake(at(5), 10), Err(Refused::Shutdown));
        assert!(!t.shutdown(at(6)));
    }

    #[test]
    fn hourly_cap() {
        let mut t = Teammate::spawn("s", "ann", "r", "a", "p", "", at(0));
        for i in 0..2 {
            let d = t.wake(at(10 + i), 2).expect("wakes");
            let e = t.claim(d, "w", at(10 + i)).expect("claimed");
            t.finish(e, true, None, at(10 + i)).expect("finished");
        }
        assert_eq!(t.wake(at(20), 2), Err(Refused::TurnsPerHour(2)));
        assert!(t.wake(at(3_600_011), 2).is_ok(), "an hour later it may run");
    }

    #[test]
    fn conversations_stay_bounded() {
        let mut c = Conversation::default();
        for i in 0..200 {
            c.lines.push(Line {
                speaker: Speaker::User,
                from: None,
                text: format!("{i}"),
                at: at(i),
                failed: false,
            });
        }
        c.compact();
        assert_eq!(c.lines.len(), Conversation::MAX_LINES);
        assert_eq!(c.dropped, 200 - Conversation::MAX_LINES as u64);
        assert_eq!(c.lines[0].text, "136");
    }
}
