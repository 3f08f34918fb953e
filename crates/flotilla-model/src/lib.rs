//! Flotilla's wire model: ids, plans, validation, messages, subjects and codecs.
//!
//! This crate does no I/O. Everything that crosses NATS is defined here, so the coordinator,
//! the workers, the CLI and clients in other languages (through the JSON Schemas in
//! `docs/schema/`) agree on one protocol, versioned by [`PROTOCOL_VERSION`].

pub mod agents;
pub mod collab;
pub mod people;
pub mod runs;
pub mod tenancy;
pub mod wire;

pub use agents::{lead, memory, recruit, team, teammate, teammate_mail, worker};
pub use collab::{artifact, mailbox, state, workspace};
pub use people::{approval, notify, trust};
pub use runs::{
    control, diff, event, fork, numeric, plan, rollback, run, runlog, submit, task, template, tree,
    validate, watch,
};
pub use tenancy::tenant;
use wire::endpoint;
pub use wire::{api, codec, error_code, ids, lenient, problem, schema, subjects, time, token};

pub use error_code::ErrorCode;
pub use ids::{AgentId, AttemptId, EscalationId, RunId, SessionId, TaskId};
pub use plan::{Plan, PlanConfig, Subtask};
pub use subjects::Names;

/// The protocol version every message carries in its `protocol` field.
pub const PROTOCOL_VERSION: u32 = 1;

pub(crate) const fn protocol_v1() -> u32 {
    1
}
