//! Policy: every rule that decides whether something of a run waits for a person, and what a
//! control may do — each in one place, pure, so the run machine (and every replay of a run
//! log) decides alike.
//!
//! * [`hitl`]: the escalation policy a run is admitted with ([`hitl::resolve_trusted`]), which task
//!   waits before its dispatch ([`hitl::gate`]), which tool calls wait ([`hitl::tool_gate`]),
//!   and the mode of the agent or role that runs a task ([`hitl::mode_of`]).
//! * [`trust`]: the level an agent or role earns from its counted outcomes
//!   ([`trust::earned`], [`trust::evaluate`]) and that level's effect on the mode
//!   ([`trust::mode_of_level`], [`trust::trusted_modes`]).
//! * [`control`]: what a pause, resume or takeover may do ([`control::may_resume_task`]).
//!
//! * [`config`]: the deployment's `[hitl]` and `[hitl.trust]` sections these rules read when
//!   a run is admitted ([`HitlConfig`], [`TrustConfig`]), with their defaults and checks.
//!
//! The run's own data these rules read (`HitlPolicy`, `TrustRecord`) are wire types of
//! `flotilla-model`; the decisions are here. The coordinator and the supervisor only gather
//! the facts (the deployment's configuration, the trust records, the run's state) and append
//! what was decided.

pub mod config;
pub mod control;
pub mod hitl;
pub mod trust;

pub use config::{HitlConfig, LevelRule, OnBudgetExhausted, TrustConfig};
