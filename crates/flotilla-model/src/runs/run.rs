//! Run records: what clients read about a run.

use std::collections::BTreeMap;
use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::artifact::ArtifactRef;
use crate::ids::{AgentId, RunId, SessionId, TaskId};
use crate::plan::StrategyChoice;
use crate::problem::Problem;
use crate::task::{DependencyResult, TaskError};
use crate::time::Timestamp;

/// Where a run sits in the run tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RunHandle {
    /// The run.
    pub run_id: RunId,
    /// The agent that owns the run, when it is an agent run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<AgentId>,
    /// The parent run, for nested runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_run_id: Option<RunId>,
    /// The tool call of the parent that started this run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_tool_call_id: Option<String>,
    /// The task of the parent run whose attempt started this run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_task_id: Option<TaskId>,
    /// The root of the run tree: its workspace and mailboxes are this run's. Absent on a root
    /// run; children started by agents always carry it (a client submitting a child itself
    /// may leave it out when the parent is the root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root_run_id: Option<RunId>,
}

impl RunHandle {
    /// A root run handle.
    pub fn root(run_id: RunId) -> Self {
        Self {
            run_id,
            agent_id: None,
            parent_run_id: None,
            parent_tool_call_id: None,
            parent_task_id: None,
            root_run_id: None,
        }
    }

    /// The root of the run tree this handle's run belongs to: `root_run_id`, else the parent,
    /// else the run itself. (A submission's `parent` is the parent's handle, so a child's root
    /// is `parent.root_run()`.)
    pub fn root_run(&self) -> RunId {
        self.root_run_id
            .or(self.parent_run_id)
            .unwrap_or(self.run_id)
    }

    /// The run id of the child that call `call` of attempt `attempt` starts: the same for
    /// every delivery of the attempt, so a redelivered attempt re-attaches to its child
    /// instead of starting another (UUIDv5 in a Flotilla namespace).
    pub fn child_run_id(attempt: crate::ids::AttemptId, call: &str) -> RunId {
        /// The UUIDv5 namespace of child run ids.
        const NAMESPACE: uuid::Uuid =
            uuid::Uuid::from_u128(0x6c0f_0b7e_4d1a_5b4e_9a57_f107_111a_c41d);
        RunId::from_uuid(uuid::Uuid::new_v5(
            &NAMESPACE,
            format!("{attempt}/{call}").as_bytes(),
        ))
    }
}

/// Lifecycle of a run.
///
/// ```text
/// pending ──► running ──► succeeded | failed | cancelled
///    │          ▲  │
///    │          │  └──pause / takeover──► paused | human_control (held by a person)
///    │          └──────resume─────────────────┘
///    └──► rejected (invalid plan, nothing dispatched)
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    /// Accepted, not yet scheduled.
    Pending,
    /// Tasks are being scheduled.
    Running,
    /// Every required task succeeded (some optional ones may have failed or been skipped).
    Succeeded,
    /// A required task failed or was skipped.
    Failed,
    /// The plan was invalid; nothing ran.
    Rejected,
    /// Cancelled by a person or a policy.
    Cancelled,
    /// Held by a person (`pause`): nothing new is dispatched until `resume` (or the pause's
    /// deadline).
    Paused,
    /// Taken over by a person (`takeover`): the agents dispatch nothing; the person completes
    /// tasks, resumes or cancels (at the takeover's deadline the run is cancelled).
    HumanControl,
}

impl RunStatus {
    /// Whether the run has ended.
    pub fn is_terminal(self) -> bool {
        !matches!(
            self,
            Self::Pending | Self::Running | Self::Paused | Self::HumanControl
        )
    }

    /// Whether a person holds the run (paused, or under human control).
    pub fn is_held(self) -> bool {
        matches!(self, Self::Paused | Self::HumanControl)
    }

    /// The status as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Rejected => "rejected",
            Self::Cancelled => "cancelled",
            Self::Paused => "paused",
            Self::HumanControl => "human_control",
        }
    }
}

impl fmt::Display for RunStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Lifecycle of one task inside a run.
///
/// ```text
/// waiting ──► dispatched ──► succeeded
///    │            │   └────► retrying ──► dispatched …
///    │            └────────► failed
///    └──► skipped (a dependency failed) | failed (dependency timeout)
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TaskStatus {
    /// Waiting for dependencies or a concurrency slot.
    Waiting,
    /// Queued for or running on a worker.
    Dispatched,
    /// Waiting out a retry backoff.
    Retrying,
    /// Waiting for a person's approval before it is dispatched (no worker slot held).
    AwaitingApproval,
    /// Done.
    Succeeded,
    /// Failed for good.
    Failed,
    /// Never ran because a dependency failed.
    Skipped,
    /// Stopped or never started because the run was cancelled or aborted.
    Cancelled,
}

impl TaskStatus {
    /// Whether the task has ended.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Succeeded | Self::Failed | Self::Skipped | Self::Cancelled
        )
    }

    /// The status as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Waiting => "waiting",
            Self::Dispatched => "dispatched",
            Self::Retrying => "retrying",
            Self::AwaitingApproval => "awaiting_approval",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Skipped => "skipped",
            Self::Cancelled => "cancelled",
        }
    }
}

/// Task counts by status.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TaskCounts {
    /// All tasks.
    pub total: u32,
    /// Waiting or retrying.
    pub waiting: u32,
    /// Dispatched.
    pub running: u32,
    /// Succeeded.
    pub succeeded: u32,
    /// Failed.
    pub failed: u32,
    /// Skipped.
    pub skipped: u32,
    /// Cancelled (the run was cancelled or aborted).
    #[serde(default)]
    pub cancelled: u32,
}

/// The persistent record of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunRecord {
    /// Position in the run tree.
    pub handle: RunHandle,
    /// The plan's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Current status.
    pub status: RunStatus,
    /// Client labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Session the run belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<SessionId>,
    /// When the coordinator accepted (or rejected) it, by JetStream server time.
    pub created_at: Timestamp,
    /// When it reached a terminal status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Timestamp>,
    /// Task counts.
    pub tasks: TaskCounts,
    /// Validation errors of a rejected run.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<Problem>,
    /// Validation warnings.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<Problem>,
    /// The outcome, once terminal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<RunOutcome>,
    /// The strategy the run is scheduled with and why (`auto` resolved). Absent while a bare
    /// query is still being planned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<StrategyChoice>,
    /// For runs submitted as a bare query: how planning went.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planning: Option<PlanningView>,
    /// For runs submitted as a bare query: what memory gave — a past plan reused (with the
    /// source run, confidence and measure) or the planner called, and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<crate::memory::MemoryUse>,
    /// When the run is a fork (`run.fork`): the run it forks, the fork point, and how many
    /// of the original's results it kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork_of: Option<ForkRef>,
}

/// Planning of a run submitted as a bare query.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PlanningView {
    /// Planner rounds so far (1 + repairs).
    pub round: u32,
    /// Most repairs allowed.
    pub max_repairs: u32,
    /// Where planning stands.
    pub status: PlanningStatus,
}

/// Where planning of a bare query stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PlanningStatus {
    /// The planner task runs (or waits for a worker).
    Planning,
    /// The planner answered; the coordinator reviews the answer.
    Reviewing,
    /// A plan was accepted; the run runs it (`RunView.plan`).
    Planned,
    /// No valid plan came out of planning, or the planner task failed.
    Failed,
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunOutcome {
    /// The run.
    pub run_id: RunId,
    /// Terminal status.
    pub status: RunStatus,
    /// The final result: the `synthesis` task's output, or the sink tasks' outputs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_result: Option<FinalResult>,
    /// Tasks that failed for good.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed: Vec<FailedTask>,
    /// Tasks that never ran or were cancelled, with the reason.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<SkippedTask>,
    /// Failed tasks not listed in `failed` (it lists at most 100; the run record has all).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub failed_omitted: u32,
    /// Skipped or cancelled tasks not listed in `skipped` (at most 100 are listed).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub skipped_omitted: u32,
    /// Why the run failed, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Why the run did not succeed, as a code clients can branch on (`reason` says it in
    /// words); absent when it succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<EndCause>,
    /// A run cancelled with `rollback` whose succeeded tasks declare compensations: the child
    /// run that undoes them (its own outcome says whether every compensation succeeded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollback_run_id: Option<RunId>,
}

/// Why a run did not succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum EndCause {
    /// A required task failed.
    TaskFailed,
    /// A required task was skipped: something it depended on failed.
    TaskSkipped,
    /// The budget of the run or of its tree (`max_tokens`, `max_cost`) was spent: a model
    /// call was refused with `budget_exhausted`, and the run could not finish without it.
    BudgetExhausted,
    /// Failed tasks reached the failure threshold (`failure_ratio`) and the run was aborted.
    FailureThreshold,
    /// The run was cancelled.
    Cancelled,
    /// A bare query's planner gave no valid plan.
    PlanningFailed,
    /// The submission was invalid: nothing ran.
    Rejected,
    /// The run could not continue: an input could not be read, or an action can never
    /// succeed in this deployment (a message too large for it).
    Aborted,
    /// Under the `supervisor` strategy, the lead ended the run with its result (the run
    /// succeeded; tasks it never assigned, or that still ran, are listed as skipped).
    LeadFinished,
    /// Under the `supervisor` strategy, the lead did not finish the run within its
    /// `lead_timeout`.
    LeadTimeout,
    /// A person rejected a required task (or its approval's deadline defaulted to reject).
    ApprovalRejected,
}

impl EndCause {
    /// The cause as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::TaskFailed => "task_failed",
            Self::TaskSkipped => "task_skipped",
            Self::BudgetExhausted => "budget_exhausted",
            Self::FailureThreshold => "failure_threshold",
            Self::Cancelled => "cancelled",
            Self::PlanningFailed => "planning_failed",
            Self::Rejected => "rejected",
            Self::Aborted => "aborted",
            Self::LeadFinished => "lead_finished",
            Self::LeadTimeout => "lead_timeout",
            Self::ApprovalRejected => "approval_rejected",
        }
    }
}

impl std::fmt::Display for EndCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The run's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FinalResult {
    /// The answer text: the synthesis task's response, or the sinks' responses.
    pub response: String,
    /// Its salient number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numeric_value: Option<f64>,
    /// The tasks the answer comes from, with their results (within a byte budget; see
    /// `omitted` and `artifact`).
    pub results: BTreeMap<TaskId, DependencyResult>,
    /// True when the run did not complete (aborted or cancelled): the results are those of
    /// every task that succeeded before it stopped.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub partial: bool,
    /// Results left out of `results` (and text cut from `response`) to keep the outcome
    /// within the deployment's message size; the whole final result is in `artifact`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub omitted: u32,
    /// Where the complete final result is stored when it was too large to carry inline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact: Option<ArtifactRef>,
}

impl FinalResult {
    /// The final result made of `results` (the synthesis task's, or the sinks', in plan
    /// order; or, `partial`, every result of a run stopped early): one result's response as
    /// it is, several as `## <task>` sections; nothing omitted, no artifact.
    pub fn of<'a>(
        results: impl IntoIterator<Item = (&'a TaskId, &'a crate::task::TaskResult)>,
        partial: bool,
    ) -> Self {
        let mut parts = Vec::new();
        let mut by_task = BTreeMap::new();
        for (id, r) in results {
            parts.push((id, r.response.as_str(), r.numeric_value));
            by_task.insert(id.clone(), r.as_dependency());
        }
        let (response, numeric_value) = match parts.as_slice() {
            [(_, response, numeric)] => ((*response).to_owned(), *numeric),
            _ => (
                parts
                    .iter()
                    .map(|(id, response, _)| format!("## {id}\n{response}"))
                    .collect::<Vec<_>>()
                    .join("\n\n"),
                None,
            ),
        };
        Self {
            response,
            numeric_value,
            results: by_task,
            partial,
            omitted: 0,
            artifact: None,
        }
    }

    /// Its size as estimated without encoding it: within half a budget it is carried inline
    /// as it is; above, it is encoded to measure it, and over the budget stored whole as an
    /// artifact and shortened.
    pub fn estimated_len(&self) -> usize {
        self.response.len()
            + self
                .results
                .iter()
                .map(|(id, r)| id.as_str().len() + r.response.len() + 256)
                .sum::<usize>()
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A task that failed for good.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct FailedTask {
    /// The task.
    pub task_id: TaskId,
    /// Attempts made.
    pub attempts: u32,
    /// The last error.
    pub error: TaskError,
}

/// A task that never ran.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SkippedTask {
    /// The task.
    pub task_id: TaskId,
    /// Why, e.g. `dependency_failed: fetch_data`.
    pub reason: String,
}

/// One task's state as shown to clients.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TaskView {
    /// The task.
    pub task_id: TaskId,
    /// Status.
    pub status: TaskStatus,
    /// Attempts started so far.
    pub attempts: u32,
    /// The last error, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<TaskError>,
    /// Why the task was skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_reason: Option<String>,
    /// When the latest attempt was dispatched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatched_at: Option<Timestamp>,
    /// The worker pool the task runs in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Paused by itself (`run.pause` with `task_id`, a lead's `pause_member`): until when,
    /// unless resumed first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_until: Option<Timestamp>,
}

/// A run record with its tasks (the reply of the `run.get` endpoint).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunView {
    /// The record.
    pub record: RunRecord,
    /// The run's tasks in plan order, from `tasks_offset` (at most the request's
    /// `tasks_limit`; `record.tasks.total` says how many there are).
    pub tasks: Vec<TaskView>,
    /// Index of the first task in `tasks`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tasks_offset: u32,
    /// For runs submitted as a bare query, once planned: the plan the planner wrote (as
    /// validated and normalised), which the run's tasks follow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<crate::plan::Plan>,
    /// How the run's team changed while it ran (recruits, retirements, refused recruits),
    /// in order, with who asked and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub team: Vec<crate::recruit::TeamChange>,
}

/// Where a run was forked from, as its record shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ForkRef {
    /// The run forked.
    pub run_id: RunId,
    /// The fork point.
    pub task_id: TaskId,
    /// How many tasks kept the original's result.
    #[serde(default)]
    pub reused: u32,
}
