//! The check of a child run's parent link (a submission's `parent`): it names other runs, and
//! its task and call ids are subject-safe tokens.

use crate::problem::{Problem, ProblemCode};

/// Checks a submission's parent link (`parent`, the parent run's handle) for run `run`: the
/// parent and the root are other runs, and the task and call ids are subject-safe tokens.
pub fn check_parent(parent: &crate::run::RunHandle, run: crate::ids::RunId) -> Vec<Problem> {
    let mut out = Vec::new();
    let mut bad = |path: &str, message: String| {
        out.push(Problem::new(ProblemCode::InvalidParent, path, message));
    };
    if parent.run_id == run {
        bad(
            "parent.run_id",
            format!("run {run} cannot be its own parent"),
        );
    }
    if parent.root_run() == run {
        bad(
            "parent.root_run_id",
            format!("run {run} cannot be the root of its own tree"),
        );
    }
    if let Some(t) = &parent.parent_task_id
        && let Err(e) = crate::token::check_token(t.as_str())
    {
        bad(
            "parent.parent_task_id",
            format!("task id {:?} {e}", t.as_str()),
        );
    }
    if let Some(c) = &parent.parent_tool_call_id
        && let Err(e) = crate::token::check_token(c)
    {
        bad("parent.parent_tool_call_id", format!("call id {c:?} {e}"));
    }
    out
}
