//! The team: member cards, the roster with presence (`<prefix>-team` KV) and failure records
//! (`<prefix>-failures` KV), kept by the supervisor service (`flotilla supervisor`).
//!
//! A **member** is a configured agent definition (`[agents.NAME]` with its card: `roles`,
//! `description`, `capabilities`). Its roster entry says where it can run (the live workers
//! hosting it), what it is doing (the attempts it runs) and when it last made progress (an
//! event it emitted) — separate from when its hosts last sent a heartbeat, so a member whose
//! hosts are alive but whose attempts have gone quiet shows `stale`, not `working`.
//!
//! A **failure record** counts one agent's or one role's attempt outcomes: consecutive
//! failures, successes and failures over sliding windows (1 h, 24 h, 30 d), the last
//! incident. Each attempt outcome is counted once per record, across supervisor restarts
//! and replicas ([`FailureRecord::apply`] refuses an attempt it has counted).
//!
//! Everything here is pure: the supervisor reads and writes these values with
//! compare-and-set, so its replicas need no leader.

use std::collections::VecDeque;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::{RunId, TaskId};
use crate::task::TaskErrorKind;
use crate::time::Timestamp;

/// What the team knows of an agent definition besides how to run it (like an A2A
/// AgentCard): `roles = [...]`, `description`, `capabilities = [...]` in `[agents.NAME]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct MemberCard {
    /// The team roles it fills (names: `A-Z a-z 0-9 _ -`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub roles: Vec<String>,
    /// What it is for, in a sentence.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// What it can do, as short tags.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub capabilities: Vec<String>,
}

impl MemberCard {
    /// Longest description, in bytes.
    pub const MAX_DESCRIPTION: usize = 1024;
    /// Most roles or capabilities.
    pub const MAX_TAGS: usize = 32;

    /// Whether it says nothing.
    pub fn is_empty(&self) -> bool {
        self.roles.is_empty() && self.description.is_none() && self.capabilities.is_empty()
    }

    /// Checks names and sizes; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        for r in &self.roles {
            crate::token::check_name(r).map_err(|e| format!("roles: role {r:?} {e}"))?;
        }
        if self.roles.len() > Self::MAX_TAGS || self.capabilities.len() > Self::MAX_TAGS {
            return Err(format!(
                "at most {} roles and {} capabilities",
                Self::MAX_TAGS,
                Self::MAX_TAGS
            ));
        }
        if self
            .description
            .as_ref()
            .is_some_and(|d| d.len() > Self::MAX_DESCRIPTION)
        {
            return Err(format!(
                "description: longer than {} bytes",
                Self::MAX_DESCRIPTION
            ));
        }
        if let Some(c) = self
            .capabilities
            .iter()
            .find(|c| c.is_empty() || c.len() > 64)
        {
            return Err(format!("capabilities: {c:?} must be 1 to 64 bytes"));
        }
        Ok(())
    }
}

/// What a member is doing.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum MemberStatus {
    /// A live worker hosts it and it runs nothing.
    Idle,
    /// It runs at least one attempt and made progress recently.
    Working,
    /// It runs attempts, its hosts are alive, but none emitted anything for longer than the
    /// supervisor's `stale-after`: stuck, or a very long silent step.
    Stale,
    /// Waiting on a human, a child or a message. Reserved for the human-in-the-loop and
    /// teammate work: nothing sets it yet.
    Waiting,
    /// No live worker hosts it.
    Offline,
}

impl MemberStatus {
    /// The status as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Idle => "idle",
            Self::Working => "working",
            Self::Stale => "stale",
            Self::Waiting => "waiting",
            Self::Offline => "offline",
        }
    }
}

/// An attempt a member runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct MemberTask {
    /// The run.
    pub run_id: RunId,
    /// The task.
    pub task_id: TaskId,
    /// The attempt number.
    pub attempt: u32,
    /// The worker running it.
    pub worker: String,
    /// When the attempt started (worker clock).
    pub since: Timestamp,
}

impl MemberTask {
    /// The attempt's key: `<run>.<task>.<attempt>`.
    pub fn key(&self) -> String {
        attempt_key(self.run_id, &self.task_id, self.attempt)
    }
}

/// `<run>.<task>.<attempt>`: how records name an attempt.
pub fn attempt_key(run: RunId, task: &TaskId, attempt: u32) -> String {
    format!("{run}.{task}.{attempt}")
}

/// What the bounded de-duplication sets store of an attempt key: its 64-bit FNV-1a digest
/// as 16 hex digits (a third of the key's size; stable across builds and replicas, so a
/// rolling upgrade keeps recognising what was counted).
pub fn attempt_digest(key: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// One member's roster entry (`<prefix>-team`, key `agent.<name>`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Member {
    /// The agent definition's name.
    pub name: String,
    /// Its card.
    #[serde(default)]
    pub card: MemberCard,
    /// What it is doing (as of `updated_at`; readers apply [`Member::status_at`] for now).
    pub status: MemberStatus,
    /// The live workers that can run it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workers: Vec<String>,
    /// The pools of those workers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pools: Vec<String>,
    /// The attempts it runs (at most [`Member::MAX_TASKS`] are listed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tasks: Vec<MemberTask>,
    /// When one of its attempts last emitted an event (server time, to the supervisor's
    /// `progress-resolution`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_progress: Option<Timestamp>,
    /// Attempts it started, and how they ended, since the roster entry was created.
    #[serde(default)]
    pub counters: MemberCounters,
    /// Digests ([`attempt_digest`]) of the attempts that ended most recently (bounded): a
    /// late `task_started` or a repeated end of one of them changes nothing.
    #[serde(default, skip_serializing_if = "VecDeque::is_empty")]
    pub ended: VecDeque<String>,
    /// When the entry last changed (supervisor clock).
    pub updated_at: Timestamp,
}

/// A member's attempt counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct MemberCounters {
    /// Attempts whose start was announced (`task_started`; an attempt shorter than the
    /// workers' `started-event-delay` announces none).
    pub started: u64,
    /// Attempts that succeeded.
    pub succeeded: u64,
    /// Attempts that failed (including those retried).
    pub failed: u64,
}

impl Member {
    /// Most attempts listed in one entry.
    pub const MAX_TASKS: usize = 64;
    /// Ended attempts remembered.
    pub const MAX_ENDED: usize = 128;

    /// A new, offline entry.
    pub fn new(name: &str, card: MemberCard, now: Timestamp) -> Self {
        Self {
            name: name.to_owned(),
            card,
            status: MemberStatus::Offline,
            workers: Vec::new(),
            pools: Vec::new(),
            tasks: Vec::new(),
            last_progress: None,
            counters: MemberCounters::default(),
            ended: VecDeque::new(),
            updated_at: now,
        }
    }

    /// Whether it fills `role`.
    pub fn has_role(&self, role: &str) -> bool {
        self.card.roles.iter().any(|r| r == role)
    }

    /// An attempt started. `false`: nothing changed (already listed, or already ended).
    pub fn start(&mut self, task: MemberTask) -> bool {
        let key = task.key();
        if self.ended.contains(&attempt_digest(&key)) || self.tasks.iter().any(|t| t.key() == key) {
            return false;
        }
        self.counters.started += 1;
        if self.tasks.len() < Self::MAX_TASKS {
            self.tasks.push(task);
        }
        true
    }

    /// An attempt ended. `false`: it had already ended (a repeated event).
    pub fn end(&mut self, key: &str, success: bool) -> bool {
        let digest = attempt_digest(key);
        if self.ended.contains(&digest) {
            return false;
        }
        self.tasks.retain(|t| t.key() != key);
        if success {
            self.counters.succeeded += 1;
        } else {
            self.counters.failed += 1;
        }
        self.ended.push_back(digest);
        while self.ended.len() > Self::MAX_ENDED {
            self.ended.pop_front();
        }
        true
    }

    /// Drops the attempts of workers that are not live any more (their attempts are
    /// redelivered elsewhere). `true` when something was dropped.
    pub fn drop_tasks_off(&mut self, live: &[String]) -> bool {
        let before = self.tasks.len();
        self.tasks.retain(|t| live.contains(&t.worker));
        before != self.tasks.len()
    }

    /// The status at `now`, from the hosts and attempts recorded: `offline` without a live
    /// host, `stale` when running attempts made no progress for `stale_after_ms`.
    pub fn status_at(&self, now: Timestamp, stale_after_ms: i64) -> MemberStatus {
        if self.workers.is_empty() {
            return MemberStatus::Offline;
        }
        if self.tasks.is_empty() {
            return MemberStatus::Idle;
        }
        let newest = self
            .tasks
            .iter()
            .map(|t| t.since.unix_ms())
            .chain(self.last_progress.map(|p| p.unix_ms()))
            .max()
            .unwrap_or(0);
        if now.unix_ms() - newest > stale_after_ms {
            MemberStatus::Stale
        } else {
            MemberStatus::Working
        }
    }
}

/// What a failure record counts.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum RecordScope {
    /// One agent definition.
    Agent,
    /// Every agent filling one role.
    Role,
}

impl RecordScope {
    /// The scope as it appears in keys and on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Agent => "agent",
            Self::Role => "role",
        }
    }
}

/// The KV key of a failure record: `<scope>.<name>`.
pub fn record_key(scope: RecordScope, name: &str) -> String {
    format!("{}.{name}", scope.as_str())
}

/// The KV key of a roster entry: `agent.<name>`.
pub fn member_key(name: &str) -> String {
    format!("agent.{name}")
}

/// How an attempt ended, for a failure record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptOutcome {
    /// `<run>.<task>.<attempt>`.
    pub key: String,
    /// The run.
    pub run_id: RunId,
    /// The task.
    pub task_id: TaskId,
    /// The attempt.
    pub attempt: u32,
    /// Whether it succeeded.
    pub success: bool,
    /// Why it failed.
    pub error: Option<(TaskErrorKind, String)>,
    /// When it ended (server time of the event).
    pub at: Timestamp,
    /// The agent that ran it, when the event names one: a role's record notes who served
    /// the role ([`FailureRecord::agents`]).
    pub agent: Option<String>,
}

/// The last failure of a record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Incident {
    /// The run.
    pub run_id: RunId,
    /// The task.
    pub task_id: TaskId,
    /// The attempt.
    pub attempt: u32,
    /// The error kind.
    pub kind: TaskErrorKind,
    /// The error message (cut to 512 bytes).
    pub message: String,
    /// When.
    pub at: Timestamp,
}

/// Counts of one time slice of a window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Slice {
    /// Start of the slice (Unix ms, a multiple of the window's slice length).
    pub start_ms: i64,
    /// Successes in it.
    pub succeeded: u64,
    /// Failures in it.
    pub failed: u64,
}

/// A sliding window as time slices: 60 one-minute slices for 1 h, 24 one-hour slices for
/// 24 h, 30 one-day slices for 30 d. Counts are exact per slice, so a window's total is exact
/// to one slice at its old end.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Window {
    /// Non-empty slices, oldest first.
    #[serde(default)]
    pub slices: Vec<Slice>,
}

/// A window's totals at some time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct WindowTotals {
    /// Successes.
    pub succeeded: u64,
    /// Failures.
    pub failed: u64,
}

impl Window {
    fn add(&mut self, at_ms: i64, slice_ms: i64, count: usize, success: bool) {
        let start = at_ms.div_euclid(slice_ms) * slice_ms;
        let idx = match self.slices.iter().position(|s| s.start_ms == start) {
            Some(i) => i,
            None => {
                self.slices.push(Slice {
                    start_ms: start,
                    succeeded: 0,
                    failed: 0,
                });
                self.slices.sort_by_key(|s| s.start_ms);
                self.slices
                    .iter()
                    .position(|s| s.start_ms == start)
                    .unwrap_or(0)
            }
        };
        let s = &mut self.slices[idx];
        if success {
            s.succeeded += 1;
        } else {
            s.failed += 1;
        }
        // Keep the newest `count` slices' worth of time.
        let newest = self.slices.last().map(|s| s.start_ms).unwrap_or(start);
        let oldest_kept = newest - slice_ms * (count as i64 - 1);
        self.slices.retain(|s| s.start_ms >= oldest_kept);
    }

    fn totals(&self, now_ms: i64, slice_ms: i64, count: usize) -> WindowTotals {
        let current = now_ms.div_euclid(slice_ms) * slice_ms;
        let oldest = current - slice_ms * (count as i64 - 1);
        self.slices
            .iter()
            .filter(|s| s.start_ms >= oldest && s.start_ms <= current)
            .fold(WindowTotals::default(), |t, s| WindowTotals {
                succeeded: t.succeeded + s.succeeded,
                failed: t.failed + s.failed,
            })
    }
}

/// The three windows' shapes: (slice length in ms, slices).
const HOUR: (i64, usize) = (60_000, 60);
const DAY: (i64, usize) = (3_600_000, 24);
const MONTH: (i64, usize) = (86_400_000, 30);

/// One agent's or role's attempt outcomes (`<prefix>-failures`, key `<scope>.<name>`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FailureRecord {
    /// What it counts.
    pub scope: RecordScope,
    /// The agent's or role's name.
    pub name: String,
    /// Failures since the last success.
    pub consecutive_failures: u64,
    /// Every success counted.
    pub total_succeeded: u64,
    /// Every failure counted.
    pub total_failed: u64,
    /// The last hour, by minute.
    #[serde(default)]
    pub hour: Window,
    /// The last 24 hours, by hour.
    #[serde(default)]
    pub day: Window,
    /// The last 30 days, by day.
    #[serde(default)]
    pub month: Window,
    /// The last failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_incident: Option<Incident>,
    /// When the last outcome was counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_outcome_at: Option<Timestamp>,
    /// Digests ([`attempt_digest`]) of the attempts counted most recently (bounded to
    /// [`FailureRecord::MAX_RECENT`]): an outcome delivered again is not counted again.
    #[serde(default, skip_serializing_if = "VecDeque::is_empty")]
    pub recent: VecDeque<String>,
    /// A role's record: the agents whose attempts of a task with this role it counted, the
    /// one that served it last at the end (at most [`FailureRecord::MAX_AGENTS`]). What
    /// `team.find` finds a role's members by, besides the roles their cards declare. Empty
    /// for an agent's record, and in records written before it was kept.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub agents: Vec<String>,
}

/// A failure record's figures at one time, as the API answers them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FailureStats {
    /// What it counts.
    pub scope: RecordScope,
    /// The agent's or role's name.
    pub name: String,
    /// Failures since the last success.
    pub consecutive_failures: u64,
    /// Every success counted.
    pub total_succeeded: u64,
    /// Every failure counted.
    pub total_failed: u64,
    /// The last hour.
    pub last_hour: WindowTotals,
    /// The last 24 hours.
    pub last_day: WindowTotals,
    /// The last 30 days.
    pub last_30_days: WindowTotals,
    /// The last failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_incident: Option<Incident>,
    /// When the last outcome was counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_outcome_at: Option<Timestamp>,
    /// A role's record: the agents that served the role, the latest last (see
    /// [`FailureRecord::agents`]); omitted when none is known.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub agents: Vec<String>,
}

impl FailureRecord {
    /// Attempt keys remembered for de-duplication: far more than a redelivery window holds.
    pub const MAX_RECENT: usize = 512;
    /// Longest incident message kept, in bytes.
    pub const MAX_MESSAGE: usize = 512;
    /// Agents a role's record names.
    pub const MAX_AGENTS: usize = 32;

    /// An empty record.
    pub fn new(scope: RecordScope, name: &str) -> Self {
        Self {
            scope,
            name: name.to_owned(),
            consecutive_failures: 0,
            total_succeeded: 0,
            total_failed: 0,
            hour: Window::default(),
            day: Window::default(),
            month: Window::default(),
            last_incident: None,
            last_outcome_at: None,
            recent: VecDeque::new(),
            agents: Vec::new(),
        }
    }

    /// Counts `outcome` once. `false`: this attempt was already counted, nothing changed.
    pub fn apply(&mut self, outcome: &AttemptOutcome) -> bool {
        let digest = attempt_digest(&outcome.key);
        if self.recent.contains(&digest) {
            return false;
        }
        self.recent.push_back(digest);
        while self.recent.len() > Self::MAX_RECENT {
            self.recent.pop_front();
        }
        let at = outcome.at.unix_ms();
        for (w, (slice, count)) in [
            (&mut self.hour, HOUR),
            (&mut self.day, DAY),
            (&mut self.month, MONTH),
        ] {
            w.add(at, slice, count, outcome.success);
        }
        if outcome.success {
            self.total_succeeded += 1;
            self.consecutive_failures = 0;
        } else {
            self.total_failed += 1;
            self.consecutive_failures += 1;
            let (kind, message) = outcome
                .error
                .clone()
                .unwrap_or((TaskErrorKind::AgentFailed, String::new()));
            let mut message = message;
            if message.len() > Self::MAX_MESSAGE {
                let mut end = Self::MAX_MESSAGE;
                while !message.is_char_boundary(end) {
                    end -= 1;
                }
                message.truncate(end);
            }
            self.last_incident = Some(Incident {
                run_id: outcome.run_id,
                task_id: outcome.task_id.clone(),
                attempt: outcome.attempt,
                kind,
                message,
                at: outcome.at,
            });
        }
        if self.last_outcome_at.is_none_or(|t| t.unix_ms() < at) {
            self.last_outcome_at = Some(outcome.at);
        }
        if let Some(agent) = outcome
            .agent
            .as_ref()
            .filter(|_| self.scope == RecordScope::Role)
        {
            self.agents.retain(|a| a != agent);
            self.agents.push(agent.clone());
            if self.agents.len() > Self::MAX_AGENTS {
                self.agents.remove(0);
            }
        }
        true
    }

    /// The figures at `now`.
    pub fn stats_at(&self, now: Timestamp) -> FailureStats {
        let now = now.unix_ms();
        FailureStats {
            scope: self.scope,
            name: self.name.clone(),
            consecutive_failures: self.consecutive_failures,
            total_succeeded: self.total_succeeded,
            total_failed: self.total_failed,
            last_hour: self.hour.totals(now, HOUR.0, HOUR.1),
            last_day: self.day.totals(now, DAY.0, DAY.1),
            last_30_days: self.month.totals(now, MONTH.0, MONTH.1),
            last_incident: self.last_incident.clone(),
            last_outcome_at: self.last_outcome_at,
            agents: self.agents.clone(),
        }
    }
}

/// A member as the API shows it: its roster entry with the status at the time of the answer
/// and its agent's failure figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MemberView {
    /// The agent definition's name.
    pub name: String,
    /// Its card.
    pub card: MemberCard,
    /// What it is doing now.
    pub status: MemberStatus,
    /// The live workers that can run it.
    pub workers: Vec<String>,
    /// The pools of those workers.
    pub pools: Vec<String>,
    /// The attempts it runs.
    pub tasks: Vec<MemberTask>,
    /// When one of its attempts last emitted an event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_progress: Option<Timestamp>,
    /// The newest heartbeat of its workers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_heartbeat: Option<Timestamp>,
    /// Attempt counters.
    pub counters: MemberCounters,
    /// Its agent's failure record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failures: Option<FailureStats>,
    /// The roles it served: tasks with these roles ran on it (their roles' failure records
    /// name it), whether or not its card declares them; omitted when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub served: Vec<String>,
    /// Set for an agent of the NATS Agent Protocol found on this NATS (not one of this
    /// deployment's agent definitions): how to reach it. Its name is then
    /// `agents:<agent>.<owner>.<session>`, the target `flotilla call` and `call_agent` take.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external: Option<ExternalMember>,
}

/// What the roster knows of an external member: an agent of the NATS Agent Protocol,
/// discovered with `$SRV.INFO.agents`, alive while its heartbeat (`agents.hb.…`) is younger
/// than three of its intervals. Nothing of it is stored: every supervisor replica rebuilds
/// it from discovery and heartbeats.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ExternalMember {
    /// The `agent` token.
    pub agent: String,
    /// The `owner` token.
    pub owner: String,
    /// The `session` token.
    pub session: String,
    /// Its service instances (`$SRV.INFO` ids) that answered discovery.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub instances: Vec<String>,
    /// Its heartbeat interval, in seconds (from its last heartbeat or status answer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval_s: Option<u64>,
    /// The protocol version it says it speaks (`metadata.protocol_version`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol_version: Option<String>,
    /// Whether the last discovery round found it (an instance still registered).
    pub discovered: bool,
}

impl MemberView {
    /// The view of `member` at `now`.
    pub fn of(
        member: &Member,
        now: Timestamp,
        stale_after_ms: i64,
        last_heartbeat: Option<Timestamp>,
        failures: Option<FailureStats>,
    ) -> Self {
        Self {
            name: member.name.clone(),
            card: member.card.clone(),
            status: member.status_at(now, stale_after_ms),
            workers: member.workers.clone(),
            pools: member.pools.clone(),
            tasks: member.tasks.clone(),
            last_progress: member.last_progress,
            last_heartbeat,
            counters: member.counters,
            failures,
            served: Vec::new(),
            external: None,
        }
    }

    /// Whether it has role `role`: its card declares it, or it served it.
    pub fn has_role(&self, role: &str) -> bool {
        self.card.roles.iter().any(|r| r == role) || self.served.iter().any(|r| r == role)
    }

    /// Its roles: those its card declares, then those it served that it does not declare.
    pub fn roles(&self) -> Vec<&str> {
        let mut out: Vec<&str> = self.card.roles.iter().map(String::as_str).collect();
        for r in &self.served {
            if !out.contains(&r.as_str()) {
                out.push(r);
            }
        }
        out
    }
}

/// `team.list`: the roster, optionally of one role.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TeamListRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// Only members (and teammates) with this role: declared on the card, or served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
}

/// `team.find`: the members of a role that can take work now — those whose card declares it
/// or that served it (ran a task with that role), online, idle before working, then by name —
/// and the teammates of the role. `404 unknown_role` only for a role the team does not know
/// (see [`TeamList::roles`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TeamFindRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The role.
    pub role: String,
}

/// The answer of `team.list` and `team.find`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TeamList {
    /// The members, by name (`team.find`: best first).
    pub members: Vec<MemberView>,
    /// Every role the team knows, sorted. A role is what a plan task's `role` names; the
    /// team knows one that a task played (its failure record, `team.stats`), a member's card
    /// declares (`roles = […]`) or a teammate has.
    pub roles: Vec<String>,
    /// Persistent teammates, by team then name: `team.list` every one (of the role asked
    /// for), `team.find` those of the role.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub teammates: Vec<crate::teammate::TeammateView>,
}

/// `team.get`: one member.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TeamGetRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The member's name.
    pub name: String,
}

/// `team.stats`: failure records — every record, those of one agent or role (`name`), or of
/// one scope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TeamStatsRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// Only the records of this agent or role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Only records of this scope.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<RecordScope>,
}

/// The answer of `team.stats`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TeamStats {
    /// The records, agents first, then roles, by name.
    pub records: Vec<FailureStats>,
}

impl crate::api::ApiRequest for TeamListRequest {
    const ENDPOINT: &'static str = "team.list";
    type Reply = TeamList;
}

impl crate::api::ApiRequest for TeamFindRequest {
    const ENDPOINT: &'static str = "team.find";
    type Reply = TeamList;
}

impl crate::api::ApiRequest for TeamGetRequest {
    const ENDPOINT: &'static str = "team.get";
    type Reply = MemberView;
}

impl crate::api::ApiRequest for TeamStatsRequest {
    const ENDPOINT: &'static str = "team.stats";
    type Reply = TeamStats;
}

crate::api::has_protocol!(
    TeamListRequest,
    TeamFindRequest,
    TeamGetRequest,
    TeamStatsRequest
);

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(n: u32, success: bool, at_ms: i64) -> AttemptOutcome {
        let run = RunId::new();
        let task = TaskId::new("t");
        AttemptOutcome {
            key: attempt_key(run, &task, n),
            run_id: run,
            task_id: task,
            attempt: n,
            success,
            error: (!success).then(|| (TaskErrorKind::AgentFailed, "boom".into())),
            at: Timestamp::from_unix_ms(at_ms),
            agent: Some("bot".into()),
        }
    }

    #[test]
    fn an_outcome_counts_once() {
        let mut r = FailureRecord::new(RecordScope::Agent, "a");
        let o = outcome(1, false, 1_000_000);
        assert!(r.apply(&o));
        assert!(!r.apply(&o), "the same attempt again changes nothing");
        assert_eq!((r.total_failed, r.consecutive_failures), (1, 1));
        assert!(r.apply(&outcome(2, false, 1_000_500)));
        assert_eq!(r.consecutive_failures, 2);
        assert!(r.apply(&outcome(3, true, 1_001_000)));
        assert_eq!((r.consecutive_failures, r.total_succeeded), (0, 1));
        assert_eq!(r.last_incident.as_ref().map(|i| i.attempt), Some(2));
    }

    #[test]
    fn a_role_record_names_the_agents_that_served_it_latest_last() {
        let mut role = FailureRecord::new(RecordScope::Role, "analyst");
        let mut agent = FailureRecord::new(RecordScope::Agent, "bot");
        let by = |n: u32, who: &str| AttemptOutcome {
            agent: Some(who.into()),
            ..outcome(n, true, 1_000_000 + i64::from(n))
        };
        for (n, who) in [(1, "bot"), (2, "writer"), (3, "bot")] {
            assert!(role.apply(&by(n, who)));
            agent.apply(&by(n, who));
        }
        assert_eq!(role.agents, ["writer", "bot"]);
        assert_eq!(role.stats_at(Timestamp::now()).agents, ["writer", "bot"]);
        assert!(agent.agents.is_empty(), "an agent's record names no agents");
        for n in 0..(FailureRecord::MAX_AGENTS as u32 + 4) {
            role.apply(&by(10 + n, &format!("a{n}")));
        }
        assert_eq!(role.agents.len(), FailureRecord::MAX_AGENTS);
        assert_eq!(
            role.agents.last().map(String::as_str),
            Some(format!("a{}", FailureRecord::MAX_AGENTS + 3).as_str())
        );
        // Omitted from the wire when empty: records written before it read the same.
        let json = serde_json::to_value(agent.stats_at(Timestamp::now())).expect("json");
        assert!(json.get("agents").is_none(), "{json}");
    }

    #[test]
    fn digests_are_stable() {
        // Replicas of different builds must agree: the digest is part of stored records.
        assert_eq!(attempt_digest(""), "cbf29ce484222325");
        assert_eq!(attempt_digest("a"), "af63dc4c8601ec8c");
    }

    #[test]
    fn windows_slide() {
        let mut r = FailureRecord::new(RecordScope::Role, "analyst");
        let t0 = 10 * 86_400_000;
        r.apply(&outcome(1, false, t0));
        r.apply(&outcome(2, true, t0 + 30 * 60_000));
        let s = r.stats_at(Timestamp::from_unix_ms(t0 + 31 * 60_000));
        assert_eq!((s.last_hour.failed, s.last_hour.succeeded), (1, 1));
        // 61 minutes later the first outcome has left the hour but not the day.
        let s = r.stats_at(Timestamp::from_unix_ms(t0 + 61 * 60_000));
        assert_eq!((s.last_hour.failed, s.last_hour.succeeded), (0, 1));
        assert_eq!((s.last_day.failed, s.last_day.succeeded), (1, 1));
        // 25 hours later: only the 30-day window holds them.
        let s = r.stats_at(Timestamp::from_unix_ms(t0 + 25 * 3_600_000));
        assert_eq!(s.last_day, WindowTotals::default());
        assert_eq!((s.last_30_days.failed, s.last_30_days.succeeded), (1, 1));
        // 31 days later: none.
        let s = r.stats_at(Timestamp::from_unix_ms(t0 + 31 * 86_400_000));
        assert_eq!(s.last_30_days, WindowTotals::default());
        assert_eq!(s.total_failed, 1, "totals never expire");
    }

    #[test]
    fn windows_stay_bounded() {
        let mut r = FailureRecord::new(RecordScope::Agent, "a");
        for i in 0..5_000u32 {
            r.apply(&outcome(i, i % 3 == 0, i64::from(i) * 60_000));
        }
        assert!(r.hour.slices.len() <= 60);
        assert!(r.day.slices.len() <= 24);
        assert!(r.month.slices.len() <= 30);
        assert_eq!(r.recent.len(), FailureRecord::MAX_RECENT);
    }

    #[test]
    fn presence_from_hosts_and_progress() {
        let now = Timestamp::from_unix_ms(1_000_000);
        let mut m = Member::new("a", MemberCard::default(), now);
        assert_eq!(m.status_at(now, 60_000), MemberStatus::Offline);
        m.workers = vec!["w1".into()];
        assert_eq!(m.status_at(now, 60_000), MemberStatus::Idle);
        let task = MemberTask {
            run_id: RunId::new(),
            task_id: TaskId::new("t"),
            attempt: 1,
            worker: "w1".into(),
            since: now,
        };
        let key = task.key();
        assert!(m.start(task.clone()));
        assert!(!m.start(task), "a repeated start changes nothing");
        assert_eq!(m.status_at(now, 60_000), MemberStatus::Working);
        let later = Timestamp::from_unix_ms(now.unix_ms() + 61_000);
        assert_eq!(m.status_at(later, 60_000), MemberStatus::Stale);
        m.last_progress = Some(later);
        assert_eq!(m.status_at(later, 60_000), MemberStatus::Working);
        assert!(m.end(&key, true));
        assert!(!m.end(&key, true), "a repeated end changes nothing");
        assert_eq!(m.counters.succeeded, 1);
        assert_eq!(m.counters.started, 1);
        assert_eq!(m.status_at(later, 60_000), MemberStatus::Idle);
        assert!(!m.drop_tasks_off(&[]));
        m.workers.clear();
        assert_eq!(m.status_at(later, 60_000), MemberStatus::Offline);
    }
}
