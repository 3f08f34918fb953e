//! How risky a subtask's action is ([`Risk`]): declared on a plan's subtasks, carried on task
//! envelopes, and read by the escalation policy of `approval`, which depends on it and not on
//! the rest of the plan.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// How risky a subtask's action is.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Risk {
    /// Read-only or trivially reversible.
    #[default]
    Low,
    /// Has effects that can be undone with effort.
    Medium,
    /// Has effects that are hard to undo.
    High,
    /// Irreversible or costly.
    Critical,
}
