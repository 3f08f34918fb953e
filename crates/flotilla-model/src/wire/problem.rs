//! Problems: what is wrong with a submission, a plan or a run, as every answer, record and
//! event reports it — a stable [`ProblemCode`], the path of the offending value and a
//! message. [`crate::validate`] finds most of them; replies, run records, run-log entries and
//! events carry them.

use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Stable machine-readable problem codes.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum ProblemCode {
    /// The document is not valid JSON/MessagePack or does not match the schema.
    Malformed,
    /// The message declares a protocol version this build does not speak.
    UnsupportedProtocol,
    /// The plan has no subtasks.
    EmptyPlan,
    /// More subtasks than allowed.
    TooManySubtasks,
    /// Two subtasks share an id.
    DuplicateId,
    /// A task id is not a subject-safe token.
    InvalidTaskId,
    /// A dependency names no subtask of the plan.
    UnknownDependency,
    /// A subtask depends on itself.
    SelfDependency,
    /// Dependencies form a cycle.
    Cycle,
    /// A consumed topic has no producer.
    MissingProducer,
    /// A topic is not a subject-safe token after normalisation.
    InvalidTopic,
    /// A pool name is invalid.
    InvalidPool,
    /// No workers are configured for the pool.
    UnknownPool,
    /// An agent name is invalid or not defined.
    UnknownAgent,
    /// A subtask names no agent and there is no default agent.
    NoAgent,
    /// A description is too large.
    DescriptionTooLarge,
    /// An input is too large.
    InputTooLarge,
    /// A timeout is zero or too long.
    InvalidTimeout,
    /// A plan setting is out of range.
    InvalidConfig,
    /// The strategy cannot run in this deployment (`supervisor` without a lead agent).
    UnsupportedStrategy,
    /// A dependency is listed twice (warning).
    DuplicateDependency,
    /// A subtask's input is nested too deeply.
    InputTooDeep,
    /// The plan is larger than the deployment's message size allows.
    PlanTooLarge,
    /// `reply_to` is not a subject a message can be published to.
    InvalidReplyTo,
    /// No live worker serves a pool the plan uses (warning: tasks wait until one starts).
    NoLiveWorker,
    /// More problems than a rejection carries; this entry counts the rest.
    TooManyProblems,
    /// The submission could not be processed (it kept failing); it was set aside.
    Unprocessable,
    /// A submission on a run's own subject names another run in its body.
    RunIdMismatch,
    /// A submission on a run's own subject carries an idempotency key: there the run id is
    /// the key; keys are mapped to runs only on the intake subject.
    MisplacedIdempotencyKey,
    /// An `output_key` is not a valid state key.
    InvalidOutputKey,
    /// Two tasks that may run at the same time write the same `output_key` (warning: the
    /// later write wins).
    SharedOutputKey,
    /// A consumed topic can only be produced by the consumer itself or by tasks that wait
    /// for it: the consumer would wait forever (an error under strict data flow, a warning
    /// under lenient, where another writer may still provide the entry).
    UnsatisfiableConsumption,
    /// A child run's parent link names the run itself, or holds an invalid task or call id.
    InvalidParent,
    /// An `output_schema` is not a JSON Schema object.
    InvalidOutputSchema,
    /// A submission has both a `plan` and a `query`.
    PlanAndQuery,
    /// A submission has neither a `plan` nor a `query`.
    MissingPlan,
    /// A submission's `query` is empty.
    EmptyQuery,
    /// A bare query was submitted but this deployment has no planner: none is configured
    /// (`[coordinator.planner] agent`), or no live worker serves the planner's pool.
    NoPlanner,
    /// A bare query was published on a run's own submission subject, whose first message
    /// must be the run's plan; bare queries go to the intake subject or the API.
    QueryOnRunSubject,
    /// The planner's answer is not a plan (not JSON, or not of the plan schema).
    InvalidPlannerOutput,
    /// A submission subject's run id is not spelled canonically (lower-case, hyphenated):
    /// one run has one subject, so it is refused and the message names the canonical form.
    NonCanonicalRunId,
    /// A submission subject's last token is not a run id (a UUID).
    InvalidRunId,
    /// A child run would be deeper in its tree than `coordinator.max-depth` allows.
    TreeTooDeep,
    /// A child run would make its tree larger than `coordinator.max-runs-per-tree` allows.
    TreeTooLarge,
    /// A subtask names a `role` and no `agent` (anycast: one free member of the role claims
    /// it), but no member card of this deployment has that role.
    UnknownRole,
    /// A subtask's `model` is empty, too long, or holds whitespace or control characters.
    InvalidModel,
    /// A submitted plan sets `fork`, which only `run.fork` writes (it names results of
    /// another run the fork keeps).
    ForkReserved,
    /// A root run would pass one of its installation's quotas (a tenant's concurrent runs,
    /// runs per hour, tokens per day or cost per month): the problem's
    /// [`quota`](Problem::quota) says which, its limit, what is used and when it resets.
    QuotaExceeded,
}

impl ProblemCode {
    /// The code as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Malformed => "malformed",
            Self::UnsupportedProtocol => "unsupported_protocol",
            Self::EmptyPlan => "empty_plan",
            Self::TooManySubtasks => "too_many_subtasks",
            Self::DuplicateId => "duplicate_id",
            Self::InvalidTaskId => "invalid_task_id",
            Self::UnknownDependency => "unknown_dependency",
            Self::SelfDependency => "self_dependency",
            Self::Cycle => "cycle",
            Self::MissingProducer => "missing_producer",
            Self::InvalidTopic => "invalid_topic",
            Self::InvalidPool => "invalid_pool",
            Self::UnknownPool => "unknown_pool",
            Self::UnknownAgent => "unknown_agent",
            Self::NoAgent => "no_agent",
            Self::DescriptionTooLarge => "description_too_large",
            Self::InputTooLarge => "input_too_large",
            Self::InvalidTimeout => "invalid_timeout",
            Self::InvalidConfig => "invalid_config",
            Self::UnsupportedStrategy => "unsupported_strategy",
            Self::DuplicateDependency => "duplicate_dependency",
            Self::InputTooDeep => "input_too_deep",
            Self::PlanTooLarge => "plan_too_large",
            Self::InvalidReplyTo => "invalid_reply_to",
            Self::NoLiveWorker => "no_live_worker",
            Self::TooManyProblems => "too_many_problems",
            Self::Unprocessable => "unprocessable",
            Self::RunIdMismatch => "run_id_mismatch",
            Self::MisplacedIdempotencyKey => "misplaced_idempotency_key",
            Self::InvalidOutputKey => "invalid_output_key",
            Self::SharedOutputKey => "shared_output_key",
            Self::InvalidOutputSchema => "invalid_output_schema",
            Self::UnsatisfiableConsumption => "unsatisfiable_consumption",
            Self::InvalidParent => "invalid_parent",
            Self::PlanAndQuery => "plan_and_query",
            Self::MissingPlan => "missing_plan",
            Self::EmptyQuery => "empty_query",
            Self::NoPlanner => "no_planner",
            Self::QueryOnRunSubject => "query_on_run_subject",
            Self::InvalidPlannerOutput => "invalid_planner_output",
            Self::NonCanonicalRunId => "non_canonical_run_id",
            Self::InvalidRunId => "invalid_run_id",
            Self::TreeTooDeep => "tree_too_deep",
            Self::TreeTooLarge => "tree_too_large",
            Self::UnknownRole => "unknown_role",
            Self::InvalidModel => "invalid_model",
            Self::ForkReserved => "fork_reserved",
            Self::QuotaExceeded => "quota_exceeded",
        }
    }
}

impl fmt::Display for ProblemCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One thing wrong with a plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Problem {
    /// Stable code; match on this, not on the message.
    pub code: ProblemCode,
    /// Where in the document (`subtasks[2].dependencies[0]`); empty for the whole document.
    pub path: String,
    /// Human-readable explanation.
    pub message: String,
    /// Tasks involved (the tasks of a cycle, the consumers of a topic).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tasks: Vec<String>,
    /// The topic involved, for data-flow problems.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topic: Option<String>,
    /// For `quota_exceeded`: the quota, its limit, what is used and when it resets
    /// (`{"quota", "limit", "used", "resets_at_ms"}`, and `tenant` for a tenant's
    /// installation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<Box<crate::tenant::QuotaExceeded>>,
}

impl Problem {
    /// A problem with no tasks or topic attached.
    pub fn new(code: ProblemCode, path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            code,
            path: path.into(),
            message: message.into(),
            tasks: Vec::new(),
            topic: None,
            quota: None,
        }
    }

    /// The `quota_exceeded` problem of a submission refused by its installation's quota:
    /// the refusal in words, and as [`Problem::quota`].
    pub fn quota_exceeded(exceeded: crate::tenant::QuotaExceeded) -> Self {
        Self {
            message: exceeded.to_string(),
            quota: Some(Box::new(exceeded)),
            ..Self::new(ProblemCode::QuotaExceeded, "", "")
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "[{}] {}", self.code, self.message)
        } else {
            write!(f, "[{}] {}: {}", self.code, self.path, self.message)
        }
    }
}
