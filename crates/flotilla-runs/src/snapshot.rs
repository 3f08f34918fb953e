//! A run's record in the `flotilla-runs` KV bucket (key `<run>`): the run machine's
//! [`RunState`] and the actions of its last change (the outbox), MessagePack with named
//! fields; and the public record and view of a run computed from it.

use flotilla_machine::{Action, RunState};
use flotilla_model::ids::RunId;
use flotilla_model::plan::Plan;
use flotilla_model::run::{PlanningView, RunHandle, RunRecord, RunView};
use flotilla_model::time::Timestamp;
use serde::{Deserialize, Serialize};

use crate::error::{StoreError, decode_err};

/// What is stored per run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// The state.
    pub state: RunState,
    /// Actions decided by the last change; re-performed (idempotently) when a coordinator
    /// cannot tell whether the writer performed them before it stopped.
    #[serde(default)]
    pub outbox: Vec<Action>,
    /// Run-log sequences of the inputs that produced the outbox.
    #[serde(default)]
    pub outbox_seqs: Vec<u64>,
    /// The outbox's `ProjectApproval` actions (since 0.3), kept apart from `outbox` so that a
    /// coordinator of 0.2, which knows no such action, reads the snapshot (it ignores this
    /// field and performs the rest). Performed with the outbox.
    #[serde(default)]
    pub projections: Vec<Action>,
}

/// A snapshot as read, with its revision and server write time.
#[derive(Debug, Clone)]
pub struct StoredSnapshot {
    /// The snapshot.
    pub snapshot: Snapshot,
    /// KV revision, for compare-and-set.
    pub revision: u64,
    /// Server time of the write, Unix ms.
    pub written_ms: i64,
}

/// A run's snapshot as stored at `revision`, written at `created` (both reads decode alike).
pub(crate) fn stored_snapshot(
    run: RunId,
    payload: &[u8],
    revision: u64,
    created: time::OffsetDateTime,
) -> Result<StoredSnapshot, StoreError> {
    let snapshot: Snapshot =
        rmp_serde::from_slice(payload).map_err(|e| decode_err(format!("run {run} snapshot"), e))?;
    Ok(StoredSnapshot {
        snapshot,
        revision,
        written_ms: unix_ms(created),
    })
}

/// Unix milliseconds of a server timestamp.
pub fn unix_ms(t: time::OffsetDateTime) -> i64 {
    (t.unix_timestamp_nanos() / 1_000_000) as i64
}

/// The client view of a run state, with the tasks from `offset`, at most `limit`.
pub fn view_of(state: &RunState, plan: Option<&Plan>, offset: usize, limit: usize) -> RunView {
    RunView {
        record: record_of(state),
        tasks: state.task_views(plan, offset, limit),
        tasks_offset: offset.min(u32::MAX as usize) as u32,
        plan: None,
        team: state.team.clone(),
    }
}

/// The public record of a run state.
pub fn record_of(state: &RunState) -> RunRecord {
    RunRecord {
        handle: state.parent.as_ref().map_or_else(
            || RunHandle::root(state.run_id),
            |p| RunHandle {
                run_id: state.run_id,
                agent_id: None,
                parent_run_id: Some(p.run_id),
                parent_tool_call_id: p.parent_tool_call_id.clone(),
                parent_task_id: p.parent_task_id.clone(),
                root_run_id: Some(p.root_run()),
            },
        ),
        name: state.name.clone(),
        status: state.status,
        labels: state.labels.clone(),
        session_id: state.session_id,
        created_at: Timestamp::from_unix_ms(state.created_ms),
        finished_at: state.finished_ms.map(Timestamp::from_unix_ms),
        tasks: state.counts(),
        errors: state.errors.clone(),
        warnings: state.warnings.clone(),
        outcome: state.outcome.clone(),
        strategy: state.strategy.clone(),
        planning: state.planning.as_ref().map(|p| PlanningView {
            round: p.round,
            max_repairs: p.max_repairs,
            status: p.status,
        }),
        memory: state.memory.clone(),
        fork_of: state.fork_of.clone(),
    }
}
