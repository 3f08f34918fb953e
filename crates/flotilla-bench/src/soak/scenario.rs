//! The kinds of work the soak submits ([`Scenario`]), in the cycle the workload submits them;
//! the ledger records each submission's kind and the report groups by it.

use serde::Serialize;

/// A kind of work the soak submits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Scenario {
    Single,
    Chain,
    Fan,
    Diamond,
    Topics,
    Child,
    Workflow,
    Llm,
    Approve,
    Reject,
    Conflict,
    Expire,
    Apprentice,
    Pause,
    TaskPause,
    Led,
    Teammate,
}

impl Scenario {
    /// The cycle the workload submits in: plain plans alternating with the others.
    pub(crate) const CYCLE: [Scenario; 17] = [
        Self::Single,
        Self::Approve,
        Self::Chain,
        Self::Pause,
        Self::Fan,
        Self::Conflict,
        Self::Diamond,
        Self::Led,
        Self::Topics,
        Self::Reject,
        Self::Child,
        Self::Expire,
        Self::Workflow,
        Self::Apprentice,
        Self::Llm,
        Self::TaskPause,
        Self::Teammate,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Single => "single",
            Self::Chain => "chain",
            Self::Fan => "fan",
            Self::Diamond => "diamond",
            Self::Topics => "topics",
            Self::Child => "child",
            Self::Workflow => "workflow",
            Self::Llm => "llm",
            Self::Approve => "approve",
            Self::Reject => "reject",
            Self::Conflict => "conflict",
            Self::Expire => "expire",
            Self::Apprentice => "apprentice",
            Self::Pause => "pause",
            Self::TaskPause => "task_pause",
            Self::Led => "led",
            Self::Teammate => "teammate",
        }
    }

    /// Nothing in it waits for a person, a pause or a lead: its latency is the machinery's.
    pub(crate) fn plain(self) -> bool {
        matches!(
            self,
            Self::Single
                | Self::Chain
                | Self::Fan
                | Self::Diamond
                | Self::Topics
                | Self::Child
                | Self::Workflow
                | Self::Llm
        )
    }
}
