//! The lead of a run under the `supervisor` strategy: its name, and the requests its tools
//! (and operators) send to the supervisor — `team.assign` (run one of the plan's subtasks) and
//! `team.finish` (end the run with a result).
//!
//! The lead is a persistent teammate named [`LEAD_NAME`] in the team named by the run's id
//! (`teammate.<run>.lead` in the team bucket), spawned by the supervisor when the run starts
//! and shut down when it ends. The supervisor mails it the run's task list and then every
//! task that ends, every recruit and every retirement; each message wakes it for one turn.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::{RunId, TaskId};
use crate::recruit::RecruitStatus;

/// The lead's teammate name (and the `by` of what it does).
pub const LEAD_NAME: &str = "lead";

/// `team.assign`: let one held subtask of a led run run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AssignRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The led run.
    pub run_id: RunId,
    /// The subtask to run (it still waits for its dependencies).
    pub task_id: TaskId,
    /// Why (recorded; at most 1,024 bytes).
    #[serde(default)]
    pub reason: String,
    /// Who assigns: `lead` (its tool) or `operator` (default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
}

/// `team.finish`: end a led run with its final result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FinishRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The led run.
    pub run_id: RunId,
    /// The run's final result (at most 64 KiB).
    pub result: String,
    /// Who finishes: `lead` (its tool) or `operator` (default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
}

/// The answer to `team.assign` and `team.finish`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct LeadReply {
    /// The run.
    pub run_id: RunId,
    /// `accepted` (the run applied it) or `recorded` (on the run log, not applied within
    /// the supervisor's `answer-wait`; it will be).
    pub status: RecruitStatus,
    /// The task assigned (`team.assign`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<TaskId>,
    /// The input's run-log sequence.
    pub seq: u64,
}

impl crate::api::ApiRequest for AssignRequest {
    const ENDPOINT: &'static str = "team.assign";
    type Reply = LeadReply;
}

impl crate::api::ApiRequest for FinishRequest {
    const ENDPOINT: &'static str = "team.finish";
    type Reply = LeadReply;
}

/// Message id of an assignment on the run log: one per task.
pub fn assigned_msg_id(run: RunId, task: &TaskId) -> String {
    format!("assigned.{run}.{task}")
}

/// Message id of a led run's finish on the run log: one per run.
pub fn finished_msg_id(run: RunId) -> String {
    format!("finished.{run}")
}
