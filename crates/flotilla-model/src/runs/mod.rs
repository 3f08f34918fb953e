//! Runs: plans and their validation, submissions, the run log, tasks and their results, events and how audiences follow them, controls, rollbacks, run trees.
//!
//! Each module is re-exported at the crate's root (`flotilla_model::plan`), its public
//! path.

pub mod control;
pub mod diff;
pub mod event;
pub mod fork;
pub mod numeric;
pub mod plan;
pub mod rollback;
pub mod run;
pub mod runlog;
pub mod submit;
pub mod task;
pub mod template;
pub mod tree;
pub mod validate;
pub mod watch;
