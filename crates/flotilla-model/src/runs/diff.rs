//! Two runs compared (`<prefix>.api.run.diff`, `flotilla runs diff A B`): per task, whether
//! its result changed (with a line diff of the text), its tokens, cost, latency and attempts
//! on each side; per run, totals and outcome. Tasks are matched by id, so the two runs are
//! typically the same plan run twice, or a run and a variant of it.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::api::ApiRequest;
use crate::ids::{RunId, TaskId};
use crate::run::{RunStatus, TaskStatus};
use crate::tree::UsageTotals;

/// Longest line diff of one task's results carried in an answer, in bytes; a longer diff is
/// cut at a line and says so (`diff_truncated`).
pub const MAX_DIFF_BYTES: usize = 16 * 1024;

/// `<prefix>.api.run.diff`: compare run `a` with run `b`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunDiffRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run compared from (the original).
    pub a: RunId,
    /// The run compared to (the variant).
    pub b: RunId,
}

impl RunDiffRequest {
    /// A request comparing `a` with `b`.
    pub fn new(a: RunId, b: RunId) -> Self {
        Self {
            protocol: crate::PROTOCOL_VERSION,
            a,
            b,
        }
    }
}

impl ApiRequest for RunDiffRequest {
    const ENDPOINT: &'static str = "run.diff";
    type Reply = RunDiff;
}

/// One run's side of a comparison: its totals and outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunSide {
    /// The run.
    pub run_id: RunId,
    /// The plan's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Its status (a run still going is compared as far as it got).
    pub status: RunStatus,
    /// Why it ended so, when it failed or was cancelled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// From acceptance to its end (or to now, while it runs), in milliseconds.
    pub duration_ms: u64,
    /// Its tasks.
    pub tasks: u32,
    /// Tasks that succeeded.
    pub succeeded: u32,
    /// Tasks that failed.
    pub failed: u32,
    /// Attempts of all its tasks.
    pub attempts: u32,
    /// Its model usage (its `usage` events; its child runs' are theirs).
    pub usage: UsageTotals,
}

/// One task of either run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TaskSide {
    /// Its status.
    pub status: TaskStatus,
    /// Attempts made.
    pub attempts: u32,
    /// From its last attempt's dispatch to its result, in milliseconds (none without a
    /// result).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<u64>,
    /// Model usage of its attempts (its `usage` events).
    pub usage: UsageTotals,
    /// Its result's text (none without a result).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
}

/// How one task compares.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TaskDiff {
    /// The task's id.
    pub task_id: TaskId,
    /// The task in run `a`; none when only `b` has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub a: Option<TaskSide>,
    /// The task in run `b`; none when only `a` has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub b: Option<TaskSide>,
    /// Whether its result, or its status, differs (a task in one run only has changed).
    pub changed: bool,
    /// The result text's line diff, `-` lines from `a` and `+` lines from `b` (unified, 2
    /// lines of context), when both have a result and the texts differ.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diff: Option<String>,
    /// The diff was cut at [`MAX_DIFF_BYTES`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub diff_truncated: bool,
}

/// The answer to a [`RunDiffRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunDiff {
    /// Run `a`.
    pub a: RunSide,
    /// Run `b`.
    pub b: RunSide,
    /// Tasks changed (a task in one run only counts).
    pub changed: u32,
    /// Every task of either run: `a`'s in its plan's order, then those only `b` has.
    pub tasks: Vec<TaskDiff>,
}
