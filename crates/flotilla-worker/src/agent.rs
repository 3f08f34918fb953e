//! The [`Agent`] trait and the [`AgentContext`] an agent runs with.
//!
//! They are defined in `flotilla-context` (so agents elsewhere, such as the LLM agent, need
//! not depend on the worker) and re-exported here, where the worker's built-in agents and
//! embedders have always found them.

pub use flotilla_context::agent::{Agent, AgentContext, AgentError, AgentReply, EventEmitter};
