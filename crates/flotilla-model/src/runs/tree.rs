//! Run trees and sessions as clients read them: a run with the child runs its agents started,
//! recursively, with status, duration, tokens and cost per run (`<prefix>.api.run.tree`), and
//! the runs of a session (`<prefix>.api.session.get`).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::api::ApiRequest;
use crate::ids::{RunId, SessionId, TaskId};
use crate::run::{RunHandle, RunStatus, TaskCounts};
use crate::time::Timestamp;

/// Most runs a tree or a session answer lists (the answer says how many it left out).
pub const MAX_RUNS_PER_ANSWER: u32 = 1000;

/// `<prefix>.api.run.tree`: a run and the child runs its agents started, recursively.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunTreeRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run at the top of the answer (any run of a tree; its ancestors are not shown).
    pub run_id: RunId,
    /// Most runs to include, breadth first (default and maximum 1000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_runs: Option<u32>,
}

impl RunTreeRequest {
    /// A request for the tree under `run_id`.
    pub fn new(run_id: RunId) -> Self {
        Self {
            protocol: crate::PROTOCOL_VERSION,
            run_id,
            max_runs: None,
        }
    }
}

impl ApiRequest for RunTreeRequest {
    const ENDPOINT: &'static str = "run.tree";
    type Reply = RunTree;
}

/// Model usage of a run (from its `usage` events), or of a subtree.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct UsageTotals {
    /// Model calls.
    pub calls: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Completion tokens.
    pub completion_tokens: u64,
    /// Cost in US dollars of the calls whose agent has a price.
    pub cost_usd: f64,
}

impl UsageTotals {
    /// Counts a `usage` event in (any other event changes nothing).
    pub fn count(&mut self, event: &crate::event::Event) {
        if let crate::event::Event::Usage {
            prompt_tokens,
            completion_tokens,
            cost_usd,
            ..
        } = event
        {
            self.calls += 1;
            self.prompt_tokens += prompt_tokens;
            self.completion_tokens += completion_tokens;
            self.cost_usd += cost_usd.unwrap_or(0.0);
        }
    }

    /// Prompt and completion tokens.
    pub fn tokens(&self) -> u64 {
        self.prompt_tokens + self.completion_tokens
    }

    /// Adds `other` to these totals.
    pub fn add(&mut self, other: &UsageTotals) {
        self.calls += other.calls;
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
        self.cost_usd += other.cost_usd;
    }
}

/// One run of a run tree.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunTreeNode {
    /// The run.
    pub run_id: RunId,
    /// The agent the run was started for (children: as named in the parent's link; a root
    /// run of one task: that task's agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// The plan's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Status.
    pub status: RunStatus,
    /// The parent's task whose attempt started this run (children).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_task_id: Option<TaskId>,
    /// The parent's call that started it (a tool call id, a workflow step).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_tool_call_id: Option<String>,
    /// When the run was accepted (server time).
    pub created_at: Timestamp,
    /// When it ended (server time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Timestamp>,
    /// From acceptance to the end, or to now for a running run, in milliseconds.
    pub duration_ms: u64,
    /// Task counts.
    pub tasks: TaskCounts,
    /// This run's own model usage (its tasks' `usage` events).
    pub usage: UsageTotals,
    /// This run's and all its descendants' usage (as far as the answer lists them).
    pub subtree_usage: UsageTotals,
    /// When the run is a fork (`run.fork`): the run it forks and the fork point.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork_of: Option<crate::run::ForkRef>,
    /// The child runs, in the order they were started.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<RunTreeNode>,
}

/// The answer to a [`RunTreeRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunTree {
    /// The requested run and its descendants.
    pub root: RunTreeNode,
    /// Runs listed.
    pub runs: u32,
    /// Children known from links but left out (`max_runs` reached, or their records are
    /// gone).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub omitted: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// `<prefix>.api.session.get`: the runs of a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The session.
    pub session_id: SessionId,
}

impl SessionRequest {
    /// A request for `session_id`'s runs.
    pub fn new(session_id: SessionId) -> Self {
        Self {
            protocol: crate::PROTOCOL_VERSION,
            session_id,
        }
    }
}

impl ApiRequest for SessionRequest {
    const ENDPOINT: &'static str = "session.get";
    type Reply = SessionView;
}

/// A run as a list shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunSummary {
    /// Position in the run tree.
    pub handle: RunHandle,
    /// The plan's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Status.
    pub status: RunStatus,
    /// When it was accepted (server time).
    pub created_at: Timestamp,
    /// When it ended (server time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Timestamp>,
    /// Task counts.
    pub tasks: TaskCounts,
}

impl From<&crate::run::RunRecord> for RunSummary {
    fn from(r: &crate::run::RunRecord) -> Self {
        Self {
            handle: r.handle.clone(),
            name: r.name.clone(),
            status: r.status,
            created_at: r.created_at,
            finished_at: r.finished_at,
            tasks: r.tasks.clone(),
        }
    }
}

/// The answer to a [`SessionRequest`]: the session's runs, oldest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SessionView {
    /// The session.
    pub session_id: SessionId,
    /// Its runs (submitted with the session id, and the child runs in its run trees), by
    /// creation time.
    pub runs: Vec<RunSummary>,
    /// Runs left out (the answer lists at most 1000: the newest).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub omitted: u32,
}
