//! Recruitment and retirement: how a run's team changes while it runs.
//!
//! A running agent (or an operator) asks the supervisor to **recruit** help — a new member of
//! a role, given one subtask — with [`RecruitRequest`] (`<prefix>.api.team.recruit`). The
//! supervisor checks its policy (allowed roles, team size, recruits per run, who may recruit,
//! the run's remaining budget) and validates the amended plan like a submitted one; a refusal
//! names the rule and changes nothing. An accepted recruit is appended to the run log as a
//! [`crate::runlog::RunInput::Recruited`] input (message id [`recruited_msg_id`]), which the
//! run machine applies: it checks the subtask against the plan as it is then (ids,
//! dependencies, producers), adds it, and dispatches it when it is ready. The supervisor
//! decides *policy*; the machine alone changes the run.
//!
//! **Retiring** a member ([`RetireRequest`], `team.retire`) removes it from one run's team: its
//! tasks that have not started are reassigned to their role (claimed by another member of
//! it) or failed, per [`RetirePolicy`]; an attempt already running finishes.
//!
//! Every change — and every refusal the machine makes — is kept on the run as a
//! [`TeamChange`], listed by `flotilla runs show`.
//!
//! **Idempotent by recruit id.** The caller names each recruit (`recruit_id`, a token); asking
//! again with the same id answers the recorded outcome and never recruits twice. A recruit
//! whose answer was lost (the supervisor died between recording and answering, the request
//! timed out) is reported `uncertain` by the client, never re-issued automatically:
//! [`RecruitStatusRequest`] tells what happened.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::{RunId, TaskId};
use crate::plan::Subtask;
use crate::problem::Problem;
use crate::time::Timestamp;

/// `Nats-Msg-Id` of a recruit on the run log: one append per recruit id.
pub fn recruited_msg_id(run: RunId, recruit_id: &str) -> String {
    format!("recruited.{run}.{recruit_id}")
}

/// `Nats-Msg-Id` of a retirement on the run log: one per member and run.
pub fn retired_msg_id(run: RunId, member: &str) -> String {
    format!("retired.{run}.{member}")
}

/// What happens to a retired member's tasks that have not started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RetirePolicy {
    /// Tasks with a `role` go to the role (claimed by another member of it); tasks without
    /// one fail `member_retired`.
    #[default]
    Reassign,
    /// They fail `member_retired` (their dependents are skipped, as for any failure).
    Fail,
}

impl RetirePolicy {
    /// The policy as on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reassign => "reassign",
            Self::Fail => "fail",
        }
    }
}

/// Kinds of team change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TeamChangeKind {
    /// A member was recruited: a subtask was added to the run.
    Recruited,
    /// A member was retired from the run's team.
    Retired,
    /// A recruit reached the run log but the run machine refused it (the plan changed since
    /// the supervisor checked it, or the run could not take it).
    Refused,
}

/// One change of a run's team, as the run keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TeamChange {
    /// What happened.
    pub kind: TeamChangeKind,
    /// The recruit id (recruits and refusals), or the retired member (retirements).
    pub id: String,
    /// The member: `role:<name>` for a recruit of a role, an agent name otherwise.
    pub member: String,
    /// The task a recruit added.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<TaskId>,
    /// Tasks a retirement handed to their role.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reassigned: Vec<TaskId>,
    /// Tasks a retirement failed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed: Vec<TaskId>,
    /// Who asked: `task:<id>` for an agent of the run, `operator` or the operator's name.
    pub by: String,
    /// Why, in the asker's words.
    pub reason: String,
    /// Why the machine refused it (refusals).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal: Option<String>,
    /// Run-log sequence of the input.
    pub seq: u64,
    /// When it was applied (server time).
    pub at: Timestamp,
}

/// Most team changes one run keeps (recruits, retirements, refusals); later ones are refused
/// by the machine, so a run's record stays bounded.
pub const MAX_TEAM_CHANGES: usize = 64;

/// Longest `reason` kept, in bytes.
pub const MAX_REASON: usize = 1024;

/// `api.team.recruit`: ask for a new member of a role to take one subtask of a running run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RecruitRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// Names this recruit (a token, unique within the run): asking again with the same id
    /// answers the recorded outcome.
    pub recruit_id: String,
    /// The role wanted. The new subtask names it (and no agent), so one member of the role
    /// claims it — or, in a deployment whose member cards define no roles, the default agent
    /// runs it with the role's prompt.
    pub role: String,
    /// The work: the new subtask's description.
    pub description: String,
    /// Why the team needs it (recorded, shown by `flotilla runs show`).
    pub reason: String,
    /// The new subtask's id (default: `recruit-<recruit_id>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<TaskId>,
    /// Tasks of the run it waits for (their results are injected, as for any dependency).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dependencies: Vec<TaskId>,
    /// Workspace topics it writes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub produces: Vec<String>,
    /// Workspace topics it reads.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub consumes: Vec<String>,
    /// Whether the run fails when the recruit's task fails (default false: help that fails
    /// does not fail the run; its dependents are skipped).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub required: bool,
    /// The task of the run asking (an agent recruiting help); absent for an operator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by_task: Option<TaskId>,
}

/// The answer to a recruit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RecruitReply {
    /// The recruit id.
    pub recruit_id: String,
    /// `accepted` (the task is part of the run), `recorded` (on the run log, not applied
    /// yet: its `member_recruited` or `recruit_refused` event follows) or `refused` (by the
    /// run machine: `refusal` says why).
    pub status: RecruitStatus,
    /// The task added.
    pub task_id: TaskId,
    /// Why the machine refused it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal: Option<String>,
    /// Run-log sequence of the recruit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
}

/// Where a recruit stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RecruitStatus {
    /// The run took it: its task is part of the plan.
    Accepted,
    /// On the run log; the run has not applied it yet.
    Recorded,
    /// The run machine refused it.
    Refused,
    /// Nothing is known of it: never recorded (asking again with the same id is safe).
    Unknown,
}

impl RecruitStatus {
    /// The status as on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Accepted => "accepted",
            Self::Recorded => "recorded",
            Self::Refused => "refused",
            Self::Unknown => "unknown",
        }
    }
}

/// `api.team.recruit_status`: what became of a recruit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RecruitStatusRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// The recruit id.
    pub recruit_id: String,
}

/// `api.team.retire`: remove a member from a run's team.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RetireRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
    /// The member (an agent definition the run's tasks name).
    pub member: String,
    /// Why (recorded).
    pub reason: String,
    /// What becomes of its tasks that have not started (default `reassign`).
    #[serde(default)]
    pub policy: RetirePolicy,
    /// The task of the run asking; absent for an operator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by_task: Option<TaskId>,
}

/// The answer to a retirement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RetireReply {
    /// The member.
    pub member: String,
    /// `accepted` (applied: see `change`) or `recorded` (on the run log, not applied yet).
    pub status: RecruitStatus,
    /// The change as the run keeps it, once applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub change: Option<TeamChange>,
}

/// The rules a recruit or retirement can be refused by (`403 recruit_refused`, the rule in
/// the error's `rule` field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RecruitRule {
    /// The role is not among the roles recruits may name (the deployment's `allowed-roles`,
    /// narrowed by the plan's `recruit_roles`).
    RoleNotAllowed,
    /// The run's team would pass `max-team` members.
    TeamFull,
    /// The run already has `max-recruits` recruits (or the plan's `max_recruits`).
    TooManyRecruits,
    /// The asking task's agent and role are not among `recruiters`.
    NotARecruiter,
    /// A budget the run counts against is spent.
    BudgetExhausted,
    /// The run is not running (ended, or a bare query still being planned).
    RunNotRunning,
    /// The amended plan does not validate: `problems` lists why.
    InvalidSubtask,
    /// The asking task is not a running task of the run.
    UnknownRecruiter,
    /// The member to retire runs no task of the run.
    NotAMember,
}

impl RecruitRule {
    /// The rule as on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RoleNotAllowed => "role_not_allowed",
            Self::TeamFull => "team_full",
            Self::TooManyRecruits => "too_many_recruits",
            Self::NotARecruiter => "not_a_recruiter",
            Self::BudgetExhausted => "budget_exhausted",
            Self::RunNotRunning => "run_not_running",
            Self::InvalidSubtask => "invalid_subtask",
            Self::UnknownRecruiter => "unknown_recruiter",
            Self::NotAMember => "not_a_member",
        }
    }
}

/// A refusal's details (the `details` of the `403 recruit_refused` error).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RecruitRefusal {
    /// The rule.
    pub rule: RecruitRule,
    /// Validation problems (`invalid_subtask`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<Problem>,
}

impl crate::api::ApiRequest for RecruitRequest {
    const ENDPOINT: &'static str = "team.recruit";
    type Reply = RecruitReply;
}

impl crate::api::ApiRequest for RecruitStatusRequest {
    const ENDPOINT: &'static str = "team.recruit_status";
    type Reply = RecruitReply;
}

impl crate::api::ApiRequest for RetireRequest {
    const ENDPOINT: &'static str = "team.retire";
    type Reply = RetireReply;
}

crate::api::has_protocol!(RecruitRequest, RecruitStatusRequest, RetireRequest);

/// The subtask a recruit adds, before validation: a `role` and no `agent`.
pub fn recruit_subtask(request: &RecruitRequest) -> Subtask {
    let id = request
        .task_id
        .clone()
        .unwrap_or_else(|| TaskId::new(format!("recruit-{}", request.recruit_id)));
    let mut task = Subtask::new(id.as_str(), &request.description);
    task.required = request.required;
    task.role = Some(request.role.clone());
    task.dependencies = request.dependencies.clone();
    task.produces = request.produces.clone();
    task.consumes = request.consumes.clone();
    task
}
