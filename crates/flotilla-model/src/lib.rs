//! Flotilla's wire model: ids, plans, validation, messages, subjects and codecs.
//!
//! This crate does no I/O. Everything that crosses NATS is defined here, so the coordinator,
//! the workers, the CLI and clients in other languages (through the JSON Schemas in
//! `docs/schema/`) agree on one protocol, versioned by [`PROTOCOL_VERSION`].

pub mod api;
pub mod approval;
pub mod artifact;
pub mod codec;
pub mod control;
mod endpoint;
pub mod error_code;
pub mod event;
pub mod ids;
pub mod lead;
pub mod lenient;
pub mod mailbox;
pub mod memory;
pub mod notify;
pub mod numeric;
pub mod plan;
pub mod problem;
pub mod recruit;
pub mod rollback;
pub mod run;
pub mod runlog;
pub mod schema;
pub mod state;
pub mod subjects;
pub mod submit;
pub mod task;
pub mod team;
pub mod teammate;
pub mod template;
pub mod time;
pub mod token;
pub mod tree;
pub mod trust;
pub mod validate;
pub mod watch;
pub mod worker;
pub mod workspace;

pub use error_code::ErrorCode;
pub use ids::{AgentId, AttemptId, EscalationId, RunId, SessionId, TaskId};
pub use plan::{Plan, PlanConfig, Subtask};
pub use subjects::Names;

/// The protocol version every message carries in its `protocol` field.
pub const PROTOCOL_VERSION: u32 = 1;

pub(crate) const fn protocol_v1() -> u32 {
    1
}
