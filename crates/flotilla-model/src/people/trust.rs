//! Earned trust: how much a person oversees an agent or role, from what it has done.
//!
//! Levels rise `novice → proficient → expert` by the rules of `[hitl.trust]` (tasks counted,
//! success rate, days known, days since the last incident — the source's 50 tasks, 90 %,
//! 7 days, 7 incident-free days; 200, 98 %, 30, 30) and fall at once with an incident (a day
//! without one is needed again before any level above novice). The supervisor keeps one
//! [`TrustRecord`] per agent and per role in `<prefix>-trust` (`agent.<name>`,
//! `role.<name>`), re-evaluated whenever it counts an outcome into the failure records, and
//! answers `trust.list|get|set|incident`. With `[hitl.trust] enabled`, a run is admitted with
//! each level's mode (`flotilla_machine::policy::trust::mode_of_level`) for the agents and roles its tasks name — unless
//! the deployment pins their mode in `[hitl.agents]` / `[hitl.roles]`, or an operator pinned
//! their level (`trust set`).

use std::collections::VecDeque;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::team::RecordScope;
use crate::time::Timestamp;

/// How far an agent or role is trusted, least first.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum TrustLevel {
    /// New or recently at fault: every dispatch is approved (`human_in_command`).
    #[default]
    Novice,
    /// Escalation triggers wait for a person (`human_in_the_loop`).
    Proficient,
    /// Monitored only: escalations notify (`human_on_the_loop`).
    Expert,
}

impl TrustLevel {
    /// The level as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Novice => "novice",
            Self::Proficient => "proficient",
            Self::Expert => "expert",
        }
    }

    /// The level named `s`.
    pub fn parse(s: &str) -> Option<Self> {
        [Self::Novice, Self::Proficient, Self::Expert]
            .into_iter()
            .find(|l| l.as_str() == s)
    }

    /// As a number for metrics: 0, 1, 2.
    pub fn rank(self) -> i64 {
        self as i64
    }
}

/// Something that cost an agent or role its trust.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TrustIncident {
    /// When.
    pub at: Timestamp,
    /// What happened.
    pub reason: String,
    /// Who recorded it.
    pub by: String,
}

/// One change of level, for the record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TrustChange {
    /// When.
    pub at: Timestamp,
    /// The level before (the effective one: a pin counts).
    pub from: TrustLevel,
    /// The level after.
    pub to: TrustLevel,
    /// Why: `earned: …`, `incident: …`, `pinned: …`, `unpinned: …`.
    pub reason: String,
    /// Who: `supervisor` for levels earned or lost by the rules, else the operator.
    pub by: String,
}

/// An agent's or role's trust (`<prefix>-trust`, `<scope>.<name>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TrustRecord {
    /// What it is about.
    pub scope: RecordScope,
    /// The agent's or role's name.
    pub name: String,
    /// The level earned by the rules.
    pub earned: TrustLevel,
    /// A level an operator set; it wins over the earned one until unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned: Option<TrustLevel>,
    /// When it was first counted.
    pub first_seen: Timestamp,
    /// Incidents recorded.
    #[serde(default)]
    pub incidents: u64,
    /// The last incident.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_incident: Option<TrustIncident>,
    /// The latest changes, newest last (at most [`TrustRecord::MAX_HISTORY`]).
    #[serde(default, skip_serializing_if = "VecDeque::is_empty")]
    pub history: VecDeque<TrustChange>,
    /// When it last changed.
    pub updated_at: Timestamp,
    /// Outcomes counted in the failure record it was last evaluated from: an evaluation from
    /// an older copy (another replica counted more since) is skipped.
    #[serde(default)]
    pub counted: u64,
}

impl TrustRecord {
    /// Changes kept in [`TrustRecord::history`].
    pub const MAX_HISTORY: usize = 20;

    /// A record first seen at `now`: novice.
    pub fn new(scope: RecordScope, name: &str, now: Timestamp) -> Self {
        Self {
            scope,
            name: name.to_owned(),
            earned: TrustLevel::Novice,
            pinned: None,
            first_seen: now,
            incidents: 0,
            last_incident: None,
            history: VecDeque::new(),
            updated_at: now,
            counted: 0,
        }
    }

    /// The level that applies: the pin, else the earned level.
    pub fn level(&self) -> TrustLevel {
        self.pinned.unwrap_or(self.earned)
    }

    /// The level that applied at `at`, read back through the history: admitting a run at
    /// its submission's time gives the same answer whenever — and by whichever coordinator
    /// — the admission is computed again. Before the record existed: novice.
    pub fn level_at(&self, at: Timestamp) -> TrustLevel {
        if self.first_seen > at {
            return TrustLevel::Novice;
        }
        match self.history.iter().find(|c| c.at > at) {
            Some(c) => c.from,
            None => self.level(),
        }
    }

    /// Marks the record changed at `now` and keeps the change in the history when the level
    /// moved, or `always` (an incident or a pin is on the record whatever it changed).
    fn note(&mut self, from: TrustLevel, reason: String, by: &str, now: Timestamp, always: bool) {
        let to = self.level();
        self.updated_at = now;
        if from != to || always {
            self.history.push_back(TrustChange {
                at: now,
                from,
                to,
                reason,
                by: by.to_owned(),
            });
            while self.history.len() > Self::MAX_HISTORY {
                self.history.pop_front();
            }
        }
    }

    /// Records a level earned by the rules (`flotilla_machine::policy::trust::evaluate`
    /// decides it) from `counted` outcomes, with `reason` on the history.
    pub fn record_earned(
        &mut self,
        earned: TrustLevel,
        counted: u64,
        reason: String,
        now: Timestamp,
    ) {
        self.counted = counted;
        let from = self.level();
        self.earned = earned;
        self.note(from, reason, "supervisor", now, false);
    }

    /// Records an incident: the earned level falls to novice at once; the rules raise it
    /// again from the next counted outcome on (after `incident-free-days`).
    pub fn incident(&mut self, reason: &str, by: &str, now: Timestamp) {
        let from = self.level();
        self.incidents += 1;
        self.last_incident = Some(TrustIncident {
            at: now,
            reason: reason.to_owned(),
            by: by.to_owned(),
        });
        self.earned = TrustLevel::Novice;
        self.note(from, format!("incident: {reason}"), by, now, true);
    }

    /// Pins the level (`Some`) or returns to the earned one (`None`).
    pub fn pin(&mut self, level: Option<TrustLevel>, reason: &str, by: &str, now: Timestamp) {
        let from = self.level();
        self.pinned = level;
        let what = match level {
            Some(l) => format!("pinned {}: {reason}", l.as_str()),
            None => format!("unpinned: {reason}"),
        };
        self.note(from, what, by, now, level.is_some());
    }
}

/// The KV key of a trust record: `<scope>.<name>`.
pub fn trust_key(scope: RecordScope, name: &str) -> String {
    crate::team::record_key(scope, name)
}

/// `trust.list`: every trust record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TrustListRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
}

/// The answer of `trust.list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TrustList {
    /// Whether admissions use the levels (`[hitl.trust] enabled`).
    pub enabled: bool,
    /// Every record, agents then roles, by name.
    pub records: Vec<TrustRecord>,
}

/// `trust.get`: one agent's or role's record (`404 not_found` when nothing was counted for
/// it and nothing was set).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TrustGetRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// `agent` (default) or `role`.
    #[serde(default = "agent_scope")]
    pub scope: RecordScope,
    /// The agent's or role's name.
    pub name: String,
}

fn agent_scope() -> RecordScope {
    RecordScope::Agent
}

/// `trust.set`: pin a level (`level`), or go back to the earned one (`level` absent).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TrustSetRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// `agent` (default) or `role`.
    #[serde(default = "agent_scope")]
    pub scope: RecordScope,
    /// The agent's or role's name (a configured one).
    pub name: String,
    /// The level to pin; absent: the earned level applies again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub level: Option<TrustLevel>,
    /// Why (required, at most 1024 bytes).
    pub reason: String,
    /// Who (required, at most 1024 bytes).
    pub by: String,
}

/// `trust.incident`: record an incident (the earned level falls at once).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TrustIncidentRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// `agent` (default) or `role`.
    #[serde(default = "agent_scope")]
    pub scope: RecordScope,
    /// The agent's or role's name (a configured one).
    pub name: String,
    /// What happened (required, at most 1024 bytes).
    pub reason: String,
    /// Who records it (required, at most 1024 bytes).
    pub by: String,
}

/// Longest `reason` or `by`, in bytes.
pub const MAX_TRUST_TEXT: usize = 1024;

impl crate::api::ApiRequest for TrustListRequest {
    const ENDPOINT: &'static str = "trust.list";
    type Reply = TrustList;
}

impl crate::api::ApiRequest for TrustGetRequest {
    const ENDPOINT: &'static str = "trust.get";
    type Reply = TrustRecord;
}

impl crate::api::ApiRequest for TrustSetRequest {
    const ENDPOINT: &'static str = "trust.set";
    type Reply = TrustRecord;
}

impl crate::api::ApiRequest for TrustIncidentRequest {
    const ENDPOINT: &'static str = "trust.incident";
    type Reply = TrustRecord;
}

crate::api::has_protocol!(
    TrustListRequest,
    TrustGetRequest,
    TrustSetRequest,
    TrustIncidentRequest
);
