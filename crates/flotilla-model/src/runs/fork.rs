//! Forking a finished run (`<prefix>.api.run.fork`, `flotilla runs fork RUN --at TASK`): a
//! new run of the same plan in which the fork point — with its changes: another agent, other
//! instructions, another input — and every task downstream of it run afresh, and every other
//! task that succeeded in the original keeps the original's result without being dispatched.
//!
//! "Downstream" is what could see the fork point's work: its dependents, their dependents,
//! and the consumers of topics any of them produce, transitively. The plan a fork runs says
//! what it reuses ([`Plan::fork`](crate::plan::Plan::fork)): the original run, the fork point
//! and, per reused task, the run-log sequence of the result it keeps. Run-log sequences are
//! global to the run-log stream, so the fork's tasks read those results where the original
//! stored them — nothing is copied, and the original is never written.
//!
//! ```text
//! original:  fetch ──► analyse ──► report
//! fork --at analyse --agent careful:
//!            fetch (reused) ──► analyse (afresh, agent careful) ──► report (afresh)
//! ```

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::api::ApiRequest;
use crate::ids::{RunId, TaskId};
use crate::problem::Problem;
use crate::run::RunOutcome;
use crate::submit::SubmitStatus;

/// Longest `description` a fork may give its fork point, in bytes.
pub const MAX_FORK_DESCRIPTION: usize = 64 * 1024;

pub use crate::plan::{ForkOrigin, KeptSteps, ReusedResult};
pub use crate::run::ForkRef;

/// `<prefix>.api.run.fork`: fork finished run `run_id` at task `at`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunForkRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run to fork; it must have ended.
    pub run_id: RunId,
    /// The fork point: a task of the run's plan.
    pub at: TaskId,
    /// Run the fork point with this agent instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// Run the fork point with these instructions (its `description`) instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Run the fork point with this `input` instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<serde_json::Value>,
    /// Run the fork point with this model instead of its agent's (an LLM agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Edits of the plan: each replaces the subtask of the same id (a whole subtask, as a
    /// plan writes it). An edited task runs afresh with what is downstream of it, as the fork
    /// point does.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub edits: Vec<crate::plan::Subtask>,
    /// Fork inside the fork point's conversation: its last attempt's steps before `step`
    /// (model replies and tool rounds, numbered from 0, as `agent_step` events number them)
    /// are kept, and the fork point goes on from step `step`, which must be a model call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u32>,
    /// The fork's run id (fork again with the same id: the same run, `duplicate`). Minted
    /// when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork_run_id: Option<RunId>,
    /// Answer when the fork has ended, with its outcome, instead of when it is accepted.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub wait: bool,
}

impl RunForkRequest {
    /// A fork of `run` at `at` with no changes.
    pub fn new(run: RunId, at: TaskId) -> Self {
        Self {
            protocol: crate::PROTOCOL_VERSION,
            run_id: run,
            at,
            agent: None,
            description: None,
            input: None,
            model: None,
            edits: Vec::new(),
            step: None,
            fork_run_id: None,
            wait: false,
        }
    }
}

impl ApiRequest for RunForkRequest {
    const ENDPOINT: &'static str = "run.fork";
    type Reply = RunForkReply;
}

/// The answer to `run.fork`: the submission of the fork, as `submit` answers it, and what it
/// reuses and runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunForkReply {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The fork's run id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<RunId>,
    /// `accepted`, `duplicate` (a fork with this `fork_run_id` exists), `rejected` (the
    /// changed plan does not validate: `errors`), or `finished` (with `wait`).
    pub status: SubmitStatus,
    /// Why the fork's plan was rejected.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<Problem>,
    /// Tolerated problems of the fork's plan.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<Problem>,
    /// With `wait`: the fork's outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<RunOutcome>,
    /// The run forked.
    pub fork_of: RunId,
    /// The fork point.
    pub at: TaskId,
    /// Tasks that keep the original's result, in plan order.
    pub reused: Vec<TaskId>,
    /// Tasks that run afresh (the fork point and what is downstream of it, and tasks that
    /// had not succeeded in the original), in plan order.
    pub rerun: Vec<TaskId>,
}

/// A fork's run id derived from the run it forks and a key saying what changes (an
/// evaluation's variant): the same on every attempt, so forking again with it answers
/// `duplicate` instead of running the fork twice. A UUIDv7 with `run`'s timestamp (it sorts
/// next to the original) and bits hashed from both.
pub fn derived_fork_id(run: RunId, key: &str) -> RunId {
    // FNV-1a over the key, mixed with "fork".
    let mut h = 0xcbf2_9ce4_8422_2325_u64;
    for b in key.as_bytes() {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    crate::ids::derived_run_id(run, crate::ids::splitmix64(h ^ 0x666f_726b))
}

/// A fork point as people write it: `TASK`, or `TASK:STEP` for a step of the task's
/// conversation (`runs fork --at`, an evaluation's variant). Only digits after the last `:`
/// make a step (a task id may itself hold a `:`); the wire keeps the two apart (`at`, `step`).
pub fn parse_fork_point(text: &str) -> Result<(TaskId, Option<u32>), String> {
    let (task, step) = match text.rsplit_once(':') {
        Some((task, step)) if !step.is_empty() && step.bytes().all(|b| b.is_ascii_digit()) => {
            let step = step
                .parse::<u32>()
                .map_err(|_| format!("fork point {text:?}: step {step} is too large"))?;
            (task, Some(step))
        }
        _ => (text, None),
    };
    if task.is_empty() {
        return Err(format!(
            "fork point {text:?} names no task (TASK or TASK:STEP)"
        ));
    }
    Ok((TaskId::new(task), step))
}

/// Replaces the subtasks of `plan` that `edits` name (by id) and answers the mask of what
/// runs afresh: downstream of `at` and of every edited task, in the edited plan. `Err` names
/// an edit or fork point that is no task of the plan.
pub fn apply_edits(
    plan: &mut crate::plan::Plan,
    at: &TaskId,
    edits: &[crate::plan::Subtask],
) -> Result<Vec<bool>, TaskId> {
    for edit in edits {
        let Some(sub) = plan.subtasks.iter_mut().find(|s| s.id == edit.id) else {
            return Err(edit.id.clone());
        };
        *sub = edit.clone();
    }
    let mut mask = downstream(plan, at).ok_or_else(|| at.clone())?;
    for edit in edits {
        if let Some(more) = downstream(plan, &edit.id) {
            mask.iter_mut().zip(more).for_each(|(m, d)| *m |= d);
        }
    }
    Ok(mask)
}

/// The tasks downstream of `at` in `plan`, `at` included, as a mask over `plan.subtasks`:
/// its dependents and the consumers of topics they produce, transitively. `None` when the
/// plan has no task `at`.
pub fn downstream(plan: &crate::plan::Plan, at: &TaskId) -> Option<Vec<bool>> {
    let start = plan.subtasks.iter().position(|s| &s.id == at)?;
    let mut mask = vec![false; plan.subtasks.len()];
    mask[start] = true;
    let mut stack = vec![start];
    while let Some(i) = stack.pop() {
        let sub = &plan.subtasks[i];
        for (j, other) in plan.subtasks.iter().enumerate() {
            if mask[j] {
                continue;
            }
            let depends = other.dependencies.contains(&sub.id);
            let consumes = other.consumes.iter().any(|t| sub.produces.contains(t));
            if depends || consumes {
                mask[j] = true;
                stack.push(j);
            }
        }
    }
    Some(mask)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Plan, Subtask};

    #[test]
    fn downstream_follows_dependencies_and_topics() {
        let mut plan = Plan::empty();
        plan.subtasks = vec![
            Subtask::new("a", "root"),
            Subtask::new("b", "left").after(&["a"]),
            Subtask::new("c", "right").after(&["a"]),
            Subtask::new("d", "join").after(&["b"]),
            Subtask::new("e", "reads"),
        ];
        plan.subtasks[2].produces = vec!["notes".into()];
        plan.subtasks[4].consumes = vec!["notes".into()];
        let ids = |m: Vec<bool>| -> Vec<String> {
            m.iter()
                .enumerate()
                .filter(|(_, d)| **d)
                .map(|(i, _)| plan.subtasks[i].id.to_string())
                .collect()
        };
        let at = |t: &str| TaskId::new(t);
        assert_eq!(ids(downstream(&plan, &at("b")).expect("b")), ["b", "d"]);
        assert_eq!(ids(downstream(&plan, &at("c")).expect("c")), ["c", "e"]);
        assert_eq!(
            downstream(&plan, &at("a")).map(ids).map(|v| v.len()),
            Some(5)
        );
        assert!(downstream(&plan, &at("zz")).is_none());
    }

    #[test]
    fn an_edited_task_runs_afresh_with_what_follows_it() {
        let mut plan = Plan::empty();
        plan.subtasks = vec![
            Subtask::new("a", "root"),
            Subtask::new("b", "left").after(&["a"]),
            Subtask::new("c", "right").after(&["a"]),
            Subtask::new("d", "join").after(&["b", "c"]),
        ];
        let edit = Subtask::new("b", "left, done better").after(&["a"]);
        let mask = apply_edits(&mut plan, &TaskId::new("d"), &[edit]).expect("edits apply");
        assert_eq!(mask, [false, true, false, true]);
        assert_eq!(plan.subtasks[1].description, "left, done better");
        let ghost = Subtask::new("zz", "nothing");
        assert_eq!(
            apply_edits(&mut plan, &TaskId::new("d"), &[ghost]),
            Err(TaskId::new("zz"))
        );
    }

    #[test]
    fn a_fork_point_is_a_task_or_a_task_and_a_step() {
        assert_eq!(parse_fork_point("draft"), Ok((TaskId::new("draft"), None)));
        assert_eq!(
            parse_fork_point("draft:4"),
            Ok((TaskId::new("draft"), Some(4)))
        );
        assert_eq!(
            parse_fork_point("a:b"),
            Ok((TaskId::new("a:b"), None)),
            "a task id may hold a colon"
        );
        for bad in [":3", "", "draft:99999999999"] {
            assert!(parse_fork_point(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_derived_fork_id_is_stable_per_run_and_key() {
        let run = RunId::new();
        assert_eq!(derived_fork_id(run, "v1"), derived_fork_id(run, "v1"));
        assert_ne!(derived_fork_id(run, "v1"), derived_fork_id(run, "v2"));
        assert_ne!(
            derived_fork_id(run, "v1"),
            derived_fork_id(RunId::new(), "v1")
        );
        assert_ne!(derived_fork_id(run, "v1"), run);
    }
}
