//! Two runs compared: the engine behind `<prefix>.api.run.diff` and `flotilla runs diff`.
//!
//! Each side costs a record read, its tasks' results (one direct read per task with a
//! result, several at a time) and one paged read of its events (for model usage). Tasks are matched
//! by id.

use std::collections::{HashMap, HashSet};

use flotilla_model::RunId;
use flotilla_model::diff::{MAX_DIFF_BYTES, RunDiff, RunSide, TaskDiff, TaskSide};
use flotilla_model::event::Event;
use flotilla_model::ids::TaskId;
use flotilla_model::run::TaskStatus;
use flotilla_model::time::Timestamp;
use flotilla_model::tree::UsageTotals;

use futures::{StreamExt, TryStreamExt};

use crate::error::{StoreError, StoreErrorKind};
use crate::reader::RunReader;
use crate::snapshot::record_of;
use crate::tree::READS_IN_FLIGHT;

/// One run read for a comparison: its totals and its tasks in plan order.
struct Read {
    side: RunSide,
    tasks: Vec<(TaskId, TaskSide)>,
}

/// Compares run `a` with run `b`; `Ok(Err(run))` names the first of the two that does not
/// exist.
pub async fn run_diff(
    store: &RunReader,
    a: RunId,
    b: RunId,
) -> Result<Result<RunDiff, RunId>, StoreError> {
    let (ra, rb) = futures::join!(read(store, a), read(store, b));
    let Some(ra) = ra? else { return Ok(Err(a)) };
    let Some(rb) = rb? else { return Ok(Err(b)) };
    Ok(Ok(compare(ra, rb)))
}

fn compare(a: Read, b: Read) -> RunDiff {
    let b_order: Vec<TaskId> = b.tasks.iter().map(|(id, _)| id.clone()).collect();
    let mut b_tasks: HashMap<TaskId, TaskSide> = b.tasks.into_iter().collect();
    let mut tasks = Vec::new();
    for (id, ta) in a.tasks {
        let tb = b_tasks.remove(&id);
        tasks.push(task_diff(id, Some(ta), tb));
    }
    // What is left of `b` is only in `b`, in its plan's order.
    for id in b_order {
        if let Some(tb) = b_tasks.remove(&id) {
            tasks.push(task_diff(id, None, Some(tb)));
        }
    }
    let changed = u32::try_from(tasks.iter().filter(|t| t.changed).count()).unwrap_or(u32::MAX);
    RunDiff {
        a: a.side,
        b: b.side,
        changed,
        tasks,
    }
}

fn task_diff(task_id: TaskId, a: Option<TaskSide>, b: Option<TaskSide>) -> TaskDiff {
    let (changed, diff, diff_truncated) = match (&a, &b) {
        (Some(x), Some(y)) => {
            let (diff, cut) = match (&x.result, &y.result) {
                (Some(rx), Some(ry)) if rx != ry => {
                    let (d, cut) = line_diff(rx, ry);
                    (Some(d), cut)
                }
                _ => (None, false),
            };
            (x.status != y.status || x.result != y.result, diff, cut)
        }
        _ => (true, None, false),
    };
    TaskDiff {
        task_id,
        a,
        b,
        changed,
        diff,
        diff_truncated,
    }
}

/// The unified line diff of `a` to `b` (2 lines of context), cut at a line boundary to at
/// most [`MAX_DIFF_BYTES`]; `true` when cut.
pub fn line_diff(a: &str, b: &str) -> (String, bool) {
    let diff = similar::TextDiff::from_lines(a, b);
    let text = diff
        .unified_diff()
        .context_radius(2)
        .missing_newline_hint(false)
        .to_string();
    if text.len() <= MAX_DIFF_BYTES {
        return (text, false);
    }
    let mut end = 0;
    for line in text.split_inclusive('\n') {
        if end + line.len() > MAX_DIFF_BYTES {
            break;
        }
        end += line.len();
    }
    (text[..end].to_owned(), true)
}

/// Reads `run` for a comparison; `None` when it does not exist.
async fn read(store: &RunReader, run: RunId) -> Result<Option<Read>, StoreError> {
    let Some(state) = store.state(run).await? else {
        return Ok(None);
    };
    let record = record_of(&state);
    let plan = if state.tasks.is_empty() {
        None
    } else {
        store.plan_for(run, &state).await?
    };
    let (run_usage, usage) = usage_of(store, run).await?;
    let subtasks = plan.as_ref().map_or(&[][..], |p| &p.subtasks[..]);
    // Each task's result, read several at a time, in plan order.
    let wanted: Vec<(u64, i64)> = subtasks
        .iter()
        .zip(&state.tasks)
        .map(|(_, t)| (t.result_seq, t.dispatched_ms))
        .collect();
    let results: Vec<_> = futures::stream::iter(wanted)
        .map(|(seq, dispatched_ms)| async move {
            if seq == 0 {
                return Ok((None, None));
            }
            match store.result_stored_at(seq).await {
                Ok((r, stored_ms)) => {
                    let from = if dispatched_ms > 0 {
                        dispatched_ms
                    } else {
                        r.started_at.map_or(stored_ms, |t| t.unix_ms())
                    };
                    Ok((
                        Some(r.result.response),
                        u64::try_from(stored_ms - from).ok(),
                    ))
                }
                // A result whose entry is gone (the stream's limits) or unreadable: the task
                // compares by status alone.
                Err(e) if e.kind() == StoreErrorKind::Nats => Err(e),
                Err(_) => Ok((None, None)),
            }
        })
        .buffered(READS_IN_FLIGHT)
        .try_collect()
        .await?;
    let mut tasks = Vec::new();
    let (mut succeeded, mut failed, mut attempts) = (0, 0, 0);
    for ((sub, t), (result, latency_ms)) in subtasks.iter().zip(&state.tasks).zip(results) {
        match t.status {
            TaskStatus::Succeeded => succeeded += 1,
            TaskStatus::Failed => failed += 1,
            _ => {}
        }
        attempts += t.attempt;
        tasks.push((
            sub.id.clone(),
            TaskSide {
                status: t.status,
                attempts: t.attempt,
                latency_ms,
                usage: usage.get(&sub.id).copied().unwrap_or_default(),
                result,
            },
        ));
    }
    let end = record.finished_at.unwrap_or_else(Timestamp::now);
    let side = RunSide {
        run_id: run,
        name: record.name.clone(),
        status: record.status,
        reason: record.outcome.as_ref().and_then(|o| o.reason.clone()),
        duration_ms: u64::try_from(end.unix_ms() - record.created_at.unix_ms()).unwrap_or(0),
        tasks: u32::try_from(tasks.len()).unwrap_or(u32::MAX),
        succeeded,
        failed,
        attempts,
        usage: run_usage,
    };
    Ok(Some(Read { side, tasks }))
}

/// The model usage of `run` (every `usage` event of it, as its tree counts it) and of each of
/// its tasks, each event counted once.
async fn usage_of(
    store: &RunReader,
    run: RunId,
) -> Result<(UsageTotals, HashMap<TaskId, UsageTotals>), StoreError> {
    let mut total = UsageTotals::default();
    let mut by_task: HashMap<TaskId, UsageTotals> = HashMap::new();
    let mut seen = HashSet::new();
    crate::tree::each_event(store, run, |e| {
        if matches!(e.event, Event::Usage { .. }) && seen.insert(e.id.clone()) {
            total.count(&e.event);
            if let Some(task) = e.task_id {
                by_task.entry(task).or_default().count(&e.event);
            }
        }
    })
    .await?;
    Ok((total, by_task))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_diff_marks_removed_and_added_lines() {
        let (d, cut) = line_diff("one\ntwo\nthree\n", "one\n2\nthree\n");
        assert!(!cut);
        assert!(d.contains("-two\n"), "{d}");
        assert!(d.contains("+2\n"), "{d}");
        assert!(d.contains(" one\n"), "{d}");
    }

    #[test]
    fn a_long_diff_is_cut_at_a_line() {
        let a: String = (0..5000).map(|i| format!("line {i}\n")).collect();
        let b: String = (0..5000).map(|i| format!("LINE {i}\n")).collect();
        let (d, cut) = line_diff(&a, &b);
        assert!(cut);
        assert!(d.len() <= MAX_DIFF_BYTES);
        assert!(d.ends_with('\n'));
    }
}
