//! Why an attempt or task failed ([`TaskError`], [`TaskErrorKind`]): read by the team's
//! failure records and the run records without the rest of the task messages.

use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Why an attempt or task failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TaskError {
    /// Machine-readable kind.
    pub kind: TaskErrorKind,
    /// Human-readable detail (stderr tail, timeout length…).
    pub message: String,
}

impl fmt::Display for TaskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.as_str(), self.message)
    }
}

/// Kinds of task failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TaskErrorKind {
    /// The agent ran and reported failure (non-zero exit, error reply).
    AgentFailed,
    /// The attempt exceeded its time budget and was cancelled.
    Timeout,
    /// The task's dependencies did not finish within `dependency_timeout`.
    DependencyTimeout,
    /// Workers kept dying on this attempt; the worker gave up after the redelivery limit.
    RedeliveriesExhausted,
    /// The worker has no agent definition with that name.
    UnknownAgent,
    /// The task envelope could not be read.
    BadEnvelope,
    /// The attempt was cancelled (run cancelled or aborted, worker stopping).
    Cancelled,
    /// The result is larger than the deployment's NATS max payload allows; pass large outputs
    /// as artifacts or workspace entries and return a reference.
    ResultTooLarge,
    /// A fault inside Flotilla.
    Internal,
    /// The description names a session-state key (`{key}`) that is not set.
    MissingStateKey,
    /// The agent's answer does not match the task's `output_schema`, also after a repair.
    InvalidOutput,
    /// The run's `max_tokens` or `max_cost` (or an ancestor run's) would be passed: the
    /// model call was not made.
    BudgetExhausted,
    /// The attempt gave up after a child run it needed was refused: the child's submission
    /// was rejected (`tree_too_deep`, `tree_too_large`, or any other plan problem), or a
    /// transfer would have looped (`transfer_loop`). Another attempt would be refused alike.
    ChildRejected,
    /// An anycast task (a `role` and no `agent`) was not claimed by any member of its role
    /// within the plan's `dependency_timeout` after its dispatch: no member was online, or
    /// all were busy. Its queued message is withdrawn.
    RoleUnclaimed,
    /// The member that was to run the task was retired from the run's team (policy `fail`,
    /// or `reassign` for a task without a role to hand it to).
    MemberRetired,
    /// A person declined a model call the attempt needed (it was estimated above
    /// `[hitl] cost-limit`): the call was not made. Not retried: another attempt would ask
    /// for the same call.
    CallDeclined,
}

impl TaskErrorKind {
    /// The kind as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AgentFailed => "agent_failed",
            Self::Timeout => "timeout",
            Self::DependencyTimeout => "dependency_timeout",
            Self::RedeliveriesExhausted => "redeliveries_exhausted",
            Self::UnknownAgent => "unknown_agent",
            Self::BadEnvelope => "bad_envelope",
            Self::Cancelled => "cancelled",
            Self::ResultTooLarge => "result_too_large",
            Self::Internal => "internal",
            Self::MissingStateKey => "missing_state_key",
            Self::InvalidOutput => "invalid_output",
            Self::BudgetExhausted => "budget_exhausted",
            Self::ChildRejected => "child_rejected",
            Self::RoleUnclaimed => "role_unclaimed",
            Self::MemberRetired => "member_retired",
            Self::CallDeclined => "call_declined",
        }
    }

    /// Whether another attempt may succeed. Failures of the agent (`agent_failed`,
    /// `timeout`), of a worker (`redeliveries_exhausted`) and of Flotilla (`internal`) are
    /// retried; configuration and input errors (`unknown_agent`, `bad_envelope`,
    /// `result_too_large`, `missing_state_key`), an answer that stayed invalid after a repair
    /// (`invalid_output`), a spent budget (`budget_exhausted`), a refused child run
    /// (`child_rejected`), dependency timeouts, an anycast task no member claimed
    /// (`role_unclaimed`) and cancellation are final: another attempt would fail the same way.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            Self::AgentFailed | Self::Timeout | Self::RedeliveriesExhausted | Self::Internal
        )
    }
}

impl fmt::Display for TaskErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
