//! Undoing a cancelled run's work: `cancel` with `rollback`.
//!
//! When a run is cancelled with `rollback`, the tasks that had succeeded and declare a
//! compensation (`compensate` on the subtask, or the agent's `[agents.NAME] compensate`) are
//! undone by a **rollback run**: a child run of the cancelled one, with one subtask per
//! compensated task, ordered in reverse dependency order — the compensation of a task runs
//! only after the compensations of every compensated task that depended on it succeeded.
//!
//! The rollback run is an ordinary run: every compensation is a recorded task (its attempts,
//! result or error are on the rollback run's log and events), a failed compensation fails the
//! rollback run and skips the compensations of what came before it (undoing a foundation while
//! what was built on it is still there would make things worse), and it appears in the run
//! tree under the cancelled run. Its id is derived from the cancelled run's
//! ([`rollback_run_id`]), so a coordinator that performs the cancellation again submits the
//! same run, which the intake answers `duplicate`.
//!
//! ```text
//! plan:      fetch ──► transform ──► publish          (all three succeeded, then cancel --rollback)
//! rollback:  undo-publish ──► undo-transform ──► undo-fetch
//! ```

use std::collections::BTreeSet;

use serde_json::json;

use crate::ids::{RunId, TaskId};
use crate::plan::{Plan, PlanConfig, Subtask};
use crate::token::MAX_TOKEN_LEN;

/// The label a rollback run carries, whose value is the cancelled run's id.
pub const ROLLBACK_OF_LABEL: &str = "rollback_of";

/// Longest part of a compensated task's result (and description, and input) handed to its
/// compensation, in bytes (the whole stays on the cancelled run's log and plan); less when
/// the rollback plan would not fit in one message otherwise.
pub const MAX_COMPENSATED_RESULT: usize = 16 * 1024;

/// The id of the run that rolls `run` back: a UUIDv7 with `run`'s timestamp (so it sorts next
/// to it) and bits hashed from it — the same on every coordinator and every replay.
pub fn rollback_run_id(run: RunId) -> RunId {
    crate::ids::derived_run_id(run, 0x726f_6c6c_6261_636b) // "rollback"
}

/// The id of the subtask that undoes `task` (at plan index `index`): `undo-<task>`, or
/// `undo-<index>` when that would be too long for a task id.
pub fn undo_task_id(task: &TaskId, index: usize) -> TaskId {
    let id = format!("undo-{task}");
    if id.len() <= MAX_TOKEN_LEN {
        TaskId::new(id)
    } else {
        TaskId::new(format!("undo-{index}"))
    }
}

/// A succeeded task of the cancelled run, to be undone.
#[derive(Debug, Clone, PartialEq)]
pub struct Compensated {
    /// Its index in the cancelled run's plan.
    pub index: usize,
    /// Its result's response (cut to [`MAX_COMPENSATED_RESULT`] bytes).
    pub result: String,
}

/// The indexes of the tasks of `plan` that a rollback undoes: those in `succeeded` that name
/// a compensation.
pub fn compensated_tasks(plan: &Plan, succeeded: &[usize]) -> Vec<usize> {
    succeeded
        .iter()
        .copied()
        .filter(|&i| plan.subtasks.get(i).is_some_and(|t| t.compensate.is_some()))
        .collect()
}

/// The plan of the run that rolls back `run` (whose plan is `plan`): one subtask per
/// compensated task, run by its compensation agent in the task's pool, with the task's
/// description, input and result as its input (each cut to `max_text` bytes), after the
/// compensations of the compensated tasks downstream of it — its dependents, and the
/// consumers of the topics it produces. `None` when nothing is to be undone.
///
/// The rollback keeps going on independent branches when a compensation fails
/// (`failure_ratio` 1); the plan's retry settings and task timeout are the cancelled plan's.
pub fn rollback_plan(
    run: RunId,
    plan: &Plan,
    undo: &[Compensated],
    max_text: usize,
) -> Option<Plan> {
    if undo.is_empty() {
        return None;
    }
    let index_of = |id: &TaskId| plan.subtasks.iter().position(|t| &t.id == id);
    // What is built on each task: its dependents, and the consumers of what it produces.
    let mut dependents: Vec<Vec<usize>> = vec![Vec::new(); plan.subtasks.len()];
    for (i, t) in plan.subtasks.iter().enumerate() {
        for d in &t.dependencies {
            if let Some(d) = index_of(d) {
                dependents[d].push(i);
            }
        }
        for (p, producer) in plan.subtasks.iter().enumerate() {
            if p != i && t.consumes.iter().any(|c| producer.produces.contains(c)) {
                dependents[p].push(i);
            }
        }
    }
    let undone: BTreeSet<usize> = undo.iter().map(|c| c.index).collect();
    let mut subtasks = Vec::with_capacity(undo.len());
    for c in undo {
        let task = &plan.subtasks[c.index];
        // The first compensated tasks on every path downstream: their compensations go
        // first (what lies beyond them is ordered by their own).
        let mut after = BTreeSet::new();
        let mut seen = BTreeSet::new();
        let mut stack = dependents[c.index].clone();
        while let Some(d) = stack.pop() {
            if !seen.insert(d) {
                continue;
            }
            if undone.contains(&d) {
                after.insert(d);
            } else {
                stack.extend(dependents[d].iter().copied());
            }
        }
        let result = cut(c.result.clone(), max_text, "result");
        let input_text = task.input.to_string();
        let input = if input_text.len() > max_text {
            json!({"omitted": format!("the task's input, {} bytes as JSON, is on the cancelled run's plan", input_text.len())})
        } else {
            task.input.clone()
        };
        let mut sub = Subtask::new(
            undo_task_id(&task.id, c.index).as_str(),
            &format!(
                "Undo what task {} of run {run} did (the run was cancelled with rollback). The task was: {}",
                task.id,
                cut(task.description.clone(), max_text, "description")
            ),
        );
        sub.agent = task.compensate.clone();
        sub.pool = task.pool.clone();
        sub.timeout = task.timeout;
        sub.dependencies = after
            .iter()
            .map(|&d| undo_task_id(&plan.subtasks[d].id, d))
            .collect();
        sub.input = json!({
            "compensates": {
                "run_id": run,
                "task_id": task.id,
                "description": cut(task.description.clone(), max_text, "description"),
                "action": task.action,
                "agent": task.agent,
                "input": input,
                "result": result,
            }
        });
        subtasks.push(sub);
    }
    Some(Plan {
        name: Some(rollback_name(plan.name.as_deref(), run)),
        query: None,
        subtasks,
        config: PlanConfig {
            failure_ratio: 1.0,
            max_retries: plan.config.max_retries,
            task_timeout: plan.config.task_timeout,
            ..PlanConfig::default()
        },
        fork: None,
    })
}

/// The name of the rollback run of `run`, named `name`: `rollback of "<name>"`, quoted so
/// that it reads once whatever the name says (a plan named `rollback` is not a rollback's
/// rollback), or `rollback of run <id>` for a run without a name.
pub fn rollback_name(name: Option<&str>, run: RunId) -> String {
    match name {
        Some(n) => format!("rollback of {n:?}"),
        None => format!("rollback of run {run}"),
    }
}

/// `text` cut to about `max` bytes, saying so.
fn cut(mut text: String, max: usize, what: &str) -> String {
    if text.len() > max {
        let total = text.len();
        let mut at = max;
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        text.truncate(at);
        text.push_str(&format!(" ({what} cut from {total} bytes)"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(id: &str, after: &[&str], undo: Option<&str>) -> Subtask {
        let mut t = Subtask::new(id, &format!("do {id}")).after(after);
        t.compensate = undo.map(str::to_owned);
        t
    }

    fn plan(subtasks: Vec<Subtask>) -> Plan {
        Plan {
            subtasks,
            ..Plan::empty()
        }
    }

    fn ids(p: &Plan, i: usize) -> (String, Vec<String>) {
        let t = &p.subtasks[i];
        (
            t.id.to_string(),
            t.dependencies.iter().map(ToString::to_string).collect(),
        )
    }

    #[test]
    fn a_rollback_names_the_run_it_undoes_once_quoted() {
        let run = RunId::new();
        let mut p = plan(vec![task("a", &[], Some("undo"))]);
        p.name = Some("rollback".into());
        let undo = [Compensated {
            index: 0,
            result: "done".into(),
        }];
        let rb = rollback_plan(run, &p, &undo, MAX_COMPENSATED_RESULT).expect("a rollback plan");
        assert_eq!(rb.name.as_deref(), Some(r#"rollback of "rollback""#));
        assert_eq!(
            rollback_name(Some(r#"the "q" report"#), run),
            r#"rollback of "the \"q\" report""#
        );
        assert_eq!(rollback_name(None, run), format!("rollback of run {run}"));
    }

    #[test]
    fn compensations_run_in_reverse_dependency_order() {
        // fetch ─► transform ─► publish, and notify (no compensation) after publish.
        let p = plan(vec![
            task("fetch", &[], Some("unfetch")),
            task("transform", &["fetch"], Some("untransform")),
            task("publish", &["transform"], Some("retract")),
            task("notify", &["publish"], None),
        ]);
        let run = RunId::new();
        let undo: Vec<Compensated> = compensated_tasks(&p, &[0, 1, 2, 3])
            .into_iter()
            .map(|index| Compensated {
                index,
                result: format!("result {index}"),
            })
            .collect();
        assert_eq!(undo.len(), 3, "notify declares nothing");
        let r = rollback_plan(run, &p, &undo, MAX_COMPENSATED_RESULT).expect("a plan");
        assert_eq!(
            ids(&r, 0),
            ("undo-fetch".into(), vec!["undo-transform".into()])
        );
        assert_eq!(
            ids(&r, 1),
            ("undo-transform".into(), vec!["undo-publish".into()])
        );
        assert_eq!(ids(&r, 2), ("undo-publish".into(), vec![]));
        assert_eq!(r.subtasks[2].agent.as_deref(), Some("retract"));
        assert_eq!(r.subtasks[2].input["compensates"]["result"], "result 2");
        assert_eq!(r.subtasks[2].input["compensates"]["task_id"], "publish");
        assert_eq!(r.config.failure_ratio, 1.0);
        let report = crate::validate::validate_plan(&r, &Default::default());
        assert!(report.is_valid(), "{:?}", report.errors);
    }

    #[test]
    fn order_passes_through_tasks_without_a_compensation() {
        // a ─► b (nothing to undo) ─► c: undo-a waits for undo-c.
        let p = plan(vec![
            task("a", &[], Some("x")),
            task("b", &["a"], None),
            task("c", &["b"], Some("y")),
        ]);
        let undo = [0, 2].map(|index| Compensated {
            index,
            result: String::new(),
        });
        let r = rollback_plan(RunId::new(), &p, &undo, MAX_COMPENSATED_RESULT).expect("a plan");
        assert_eq!(ids(&r, 0), ("undo-a".into(), vec!["undo-c".into()]));
        assert!(rollback_plan(RunId::new(), &p, &[], MAX_COMPENSATED_RESULT).is_none());
    }

    #[test]
    fn consumers_of_a_topic_are_undone_before_its_producer() {
        let mut writer = task("writer", &[], Some("x"));
        writer.produces = vec!["draft".into()];
        let mut reader = task("reader", &[], Some("y"));
        reader.consumes = vec!["draft".into()];
        let p = plan(vec![writer, reader]);
        let undo = [0, 1].map(|index| Compensated {
            index,
            result: String::new(),
        });
        let r = rollback_plan(RunId::new(), &p, &undo, MAX_COMPENSATED_RESULT).expect("a plan");
        assert_eq!(
            ids(&r, 0),
            ("undo-writer".into(), vec!["undo-reader".into()])
        );
    }

    #[test]
    fn the_rollback_id_is_derived_and_long_results_are_cut() {
        let run = RunId::new();
        assert_eq!(rollback_run_id(run), rollback_run_id(run));
        assert_ne!(rollback_run_id(run), run);
        assert_ne!(rollback_run_id(run), rollback_run_id(RunId::new()));
        assert_eq!(
            rollback_run_id(run)
                .as_uuid()
                .get_timestamp()
                .map(|t| t.to_unix().0),
            run.as_uuid().get_timestamp().map(|t| t.to_unix().0)
        );
        let p = plan(vec![task("a", &[], Some("x"))]);
        let undo = [Compensated {
            index: 0,
            result: "é".repeat(MAX_COMPENSATED_RESULT),
        }];
        let r = rollback_plan(run, &p, &undo, MAX_COMPENSATED_RESULT).expect("a plan");
        let result = r.subtasks[0].input["compensates"]["result"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(
            result.len() < MAX_COMPENSATED_RESULT + 64,
            "{}",
            result.len()
        );
        assert!(result.ends_with("bytes)"), "cut noted");
        let long = TaskId::new("t".repeat(MAX_TOKEN_LEN));
        assert_eq!(undo_task_id(&long, 7).as_str(), "undo-7");
    }
}
