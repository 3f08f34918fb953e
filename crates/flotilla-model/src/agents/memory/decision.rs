//! What a bare query's coordinator decided with memory, recorded on the run ([`MemoryUse`]),
//! and the name of the measure it scored with ([`SIMILARITY_MEASURE`]): kept apart from the
//! entries and the API of memory, which read run records.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::RunId;
use crate::problem::Problem;

/// The similarity measure's name, as recorded on a run that consulted memory.
pub const SIMILARITY_MEASURE: &str = "cosine-words-v1";

/// A past run that matched a query.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MemoryMatch {
    /// The past run.
    pub run_id: RunId,
    /// How alike its query is, in [0, 1].
    pub confidence: f64,
    /// It belongs to the new run's session.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub same_session: bool,
}

/// What a bare query's coordinator did with memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum MemoryDecision {
    /// A past plan was reused; the planner was not called.
    Reused,
    /// The planner was called (with the matches as examples, if any).
    Planner,
}

/// Why it decided so.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum MemoryReason {
    /// The best match reached the threshold and its plan validated.
    AboveThreshold,
    /// No successful past run matched at or above the threshold.
    BelowThreshold,
    /// Memory holds no successful past run sharing a word with the query.
    NoMatch,
    /// The run explores: the planner is called even though a match reached the threshold.
    Explore,
    /// The best match's plan no longer validates in this deployment (`problems`).
    InvalidPlan,
    /// Memory could not be read (`detail`); planned as without memory.
    Unavailable,
}

impl MemoryReason {
    /// The reason as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AboveThreshold => "above_threshold",
            Self::BelowThreshold => "below_threshold",
            Self::NoMatch => "no_match",
            Self::Explore => "explore",
            Self::InvalidPlan => "invalid_plan",
            Self::Unavailable => "unavailable",
        }
    }
}

/// What a bare query's coordinator decided with memory, recorded on the run (`submitted`
/// input, run record, `run_started` event): replays read it, never recompute it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MemoryUse {
    /// Reused a plan, or called the planner.
    pub decision: MemoryDecision,
    /// Why.
    pub reason: MemoryReason,
    /// The similarity measure ([`SIMILARITY_MEASURE`]).
    pub measure: String,
    /// The confidence at or above which a plan is reused.
    pub threshold: f64,
    /// The run whose plan was reused (or, for `explore` and `invalid_plan`, would have been).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_run: Option<RunId>,
    /// The best match's confidence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confidence: Option<f64>,
    /// The matches given to the planner as examples, best first (at most 3).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub examples: Vec<MemoryMatch>,
    /// Why the best match's plan did not validate.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<Problem>,
    /// Entries scanned.
    #[serde(default)]
    pub scanned: u32,
    /// More detail (why memory was unavailable).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl MemoryUse {
    /// One line for people: `plan reused from run … (confidence 0.93, cosine-words-v1)`.
    pub fn summary(&self) -> String {
        let conf = self
            .confidence
            .map(|c| format!("confidence {c:.3}, "))
            .unwrap_or_default();
        match (self.decision, self.source_run) {
            (MemoryDecision::Reused, Some(run)) => {
                format!("plan reused from run {run} ({conf}{})", self.measure)
            }
            _ => format!(
                "planner called: {} ({conf}{} example{})",
                self.reason.as_str(),
                self.examples.len(),
                if self.examples.len() == 1 { "" } else { "s" }
            ),
        }
    }
}
