//! Memory: every finished root run, remembered once in `<prefix>-memory` for the planners
//! ([`flotilla_model::memory`]), and the API that lists, shows and forgets entries.
//!
//! The event follower ([`crate::follow`]) hands over the runs whose terminal event
//! (`run_succeeded`, `run_failed`, `run_cancelled`) it read; a rejected run never ran and is
//! not remembered. For each, the run's record and the plan it followed are read with the
//! run reader (`RunReader::load`, `RunReader::plan_for` — the same reads as `run.get`), and
//! the entry is written with **create-if-absent** under `run.<run_id>`: a redelivered event
//! or a second replica finds the key and writes nothing, so each run is recorded once. A child
//! run of a tree is skipped (its root is the run people asked for). A key that was forgotten
//! keeps its delete marker, so a late redelivery does not bring the entry back.
//!
//! | Subject | Request | Reply |
//! |---|---|---|
//! | `<prefix>.api.memory.list` | `MemoryListRequest` | `MemoryList` (newest first) |
//! | `<prefix>.api.memory.get` | `MemoryGetRequest` | `MemoryEntry` (`404 not_found`) |
//! | `<prefix>.api.memory.forget` | `MemoryForgetRequest` | `MemoryForgotten` (`404 not_found`) |

use std::sync::Arc;

use async_nats::jetstream::kv;
use flotilla_model::ErrorCode;
use flotilla_model::api::ApiError;
use flotilla_model::ids::RunId;
use flotilla_model::memory::{
    KEY_PREFIX, MemoryEntry, MemoryForgetRequest, MemoryForgotten, MemoryGetRequest, MemoryList,
    MemoryListRequest, MemorySummary, QuerySource, memory_key,
};
use flotilla_model::run::{PlanningStatus, RunStatus};
use flotilla_model::subjects::Bucket;
use flotilla_model::time::Timestamp;
use tracing::{debug, info, warn};

use crate::Team;
use crate::error::SupervisorError;

/// How long after its terminal event a run's record may still say it runs (the coordinator
/// writes the record and the events of one step close together) before the run is given up.
const RECORD_GRACE_MS: i64 = 60_000;

/// A run whose end an event message announced, and when that message was published.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ended {
    pub(crate) run: RunId,
    pub(crate) at_ms: i64,
}

/// The runs that ended for good (not rejected) in `events`.
pub(crate) fn ended_in(
    events: &[flotilla_model::event::EventEnvelope],
    at_ms: i64,
    out: &mut Vec<Ended>,
) {
    use flotilla_model::event::{Event, WorkflowPhase};
    for e in events {
        if let Event::Workflow(w) = &e.event
            && e.task_id.is_none()
            && matches!(
                w.phase,
                WorkflowPhase::RunSucceeded
                    | WorkflowPhase::RunFailed
                    | WorkflowPhase::RunCancelled
            )
        {
            out.push(Ended {
                run: e.run_id,
                at_ms,
            });
        }
    }
}

/// Records every run of `ended` (each once). An error means some could not be recorded yet:
/// the event messages are delivered again.
pub(crate) async fn record_all(team: &Team, ended: &[Ended]) -> Result<(), SupervisorError> {
    if !team.opts.memory.enabled || ended.is_empty() {
        return Ok(());
    }
    let results = futures::future::join_all(ended.iter().map(|e| record(team, *e))).await;
    results.into_iter().collect()
}

/// Records one run, unless it is recorded (or was forgotten) already, is a child, or its record
/// is gone.
async fn record(team: &Team, ended: Ended) -> Result<(), SupervisorError> {
    let run = ended.run;
    let key = memory_key(run);
    // Both reads at once: the entry's absence is the common case.
    let (existing, stored) = tokio::join!(team.memory_kv.entry(&key), team.runs.load(run));
    if existing
        .map_err(|e| SupervisorError::store(format!("reading {key}"), e))?
        .is_some()
    {
        return Ok(());
    }
    let stored = stored.map_err(|e| SupervisorError::store(format!("reading run {run}"), e))?;
    let Some(stored) = stored else {
        warn!(%run, "A finished run has no record; not remembered");
        return Ok(());
    };
    let state = &stored.snapshot.state;
    // A child run is its parent's; a fork tries a variant of another run's plan — neither is
    // a plan a bare query should learn from.
    if state.parent.is_some() || state.fork_of.is_some() {
        return Ok(());
    }
    if !state.status.is_terminal() {
        if Timestamp::now().unix_ms() - ended.at_ms > RECORD_GRACE_MS {
            warn!(%run, status = %state.status, "A run's record never showed its end; not remembered");
            return Ok(());
        }
        return Err(SupervisorError::Setup(format!(
            "run {run} ended but its record says {}: it is read again",
            state.status
        )));
    }
    if state.status == RunStatus::Rejected {
        return Ok(());
    }
    let planning_failed = state
        .planning
        .as_ref()
        .is_some_and(|p| p.status != PlanningStatus::Planned);
    // The plan and the spending at once; only a run with a budget of its own has a budget
    // entry to read.
    let has_budget = state.budget_scopes.iter().any(|s| s.run_id == run);
    let (plan, (tokens, cost_usd)) = tokio::join!(
        async {
            if planning_failed {
                Ok(None)
            } else {
                team.runs.plan_for(run, state).await
            }
        },
        async {
            if has_budget {
                spent(team, run).await
            } else {
                (None, None)
            }
        }
    );
    let plan =
        plan.map_err(|e| SupervisorError::store(format!("reading the plan of run {run}"), e))?;
    let (mut shape, members) = plan
        .as_ref()
        .map(MemoryEntry::shape_of)
        .unwrap_or_else(|| MemoryEntry::shape_of(&flotilla_model::plan::Plan::empty()));
    shape.chosen = state.strategy.as_ref().map(|s| s.strategy);
    let bare_query = state.planning.is_some() || state.memory.is_some();
    let query = plan
        .as_ref()
        .map(MemoryEntry::plan_text)
        .unwrap_or_default();
    let finished_ms = state.finished_ms.unwrap_or(ended.at_ms);
    let mut entry = MemoryEntry {
        run_id: run,
        session_id: state.session_id,
        query,
        query_source: if bare_query {
            QuerySource::Query
        } else {
            QuerySource::Plan
        },
        name: state.name.clone(),
        plan: shape,
        team: members,
        outcome: state.status,
        cause: state.outcome.as_ref().and_then(|o| o.cause),
        duration_ms: u64::try_from(finished_ms - state.created_ms).unwrap_or(0),
        tokens,
        cost_usd,
        created_at: Timestamp::from_unix_ms(state.created_ms),
        finished_at: Timestamp::from_unix_ms(finished_ms),
        recorded_at: Timestamp::now(),
        reused_from: state.memory.as_ref().and_then(|m| {
            (m.decision == flotilla_model::memory::MemoryDecision::Reused)
                .then_some(m.source_run)
                .flatten()
        }),
        truncated: false,
    };
    if planning_failed {
        // Its plan never existed; the query is still worth remembering as a failure.
        entry.query = state
            .name
            .clone()
            .unwrap_or_else(|| "(planning failed)".to_owned());
    }
    entry.bound();
    let bytes = serde_json::to_vec(&entry).map_err(|e| SupervisorError::Decode {
        key: key.clone(),
        message: e.to_string(),
    })?;
    match team.memory_kv.create(&key, bytes.into()).await {
        Ok(_) => {
            debug!(%run, outcome = %entry.outcome, subtasks = entry.plan.subtasks.len(), "Run remembered");
            Ok(())
        }
        Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
            debug!(%run, "Run already remembered");
            Ok(())
        }
        Err(e) => Err(SupervisorError::store(format!("writing {key}"), e)),
    }
}

/// Tokens and cost the run's budget entry records (`budget.<run>`), if it has one.
async fn spent(team: &Team, run: RunId) -> (Option<u64>, Option<f64>) {
    let Ok(Some(entry)) = team.cursors_kv.entry(format!("budget.{run}")).await else {
        return (None, None);
    };
    if entry.operation != kv::Operation::Put {
        return (None, None);
    }
    let v: serde_json::Value = serde_json::from_slice(&entry.value).unwrap_or_default();
    (
        v.get("tokens").and_then(serde_json::Value::as_u64),
        v.get("cost").and_then(serde_json::Value::as_f64),
    )
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> ApiError {
    ApiError::new(503, ErrorCode::Unavailable, format!("{what}: {e}"))
}

fn not_found(run: RunId) -> ApiError {
    ApiError::new(
        404,
        ErrorCode::NotFound,
        format!(
            "run {run} is not remembered (it has not finished as a root run, was forgotten, or is older than [supervisor.memory] max-age)"
        ),
    )
}

/// Most entries one list returns.
const MAX_LIST: u32 = 1000;

/// `memory.list`.
pub(crate) async fn list(team: Arc<Team>, r: MemoryListRequest) -> Result<MemoryList, ApiError> {
    let limit = r.limit.unwrap_or(100);
    if !(1..=MAX_LIST).contains(&limit) {
        return Err(ApiError::new(
            400,
            ErrorCode::Invalid,
            format!("limit must be 1 to {MAX_LIST}, not {limit}"),
        ));
    }
    let stored = team
        .bus
        .kv_newest(Bucket::Memory, KEY_PREFIX, team.opts.memory.scan_limit)
        .await
        .map_err(|e| unavailable("reading the memory bucket", e))?;
    let scanned = u32::try_from(stored.len()).unwrap_or(u32::MAX);
    let entries = stored
        .iter()
        .filter_map(|m| serde_json::from_slice::<MemoryEntry>(&m.payload).ok())
        .filter(|e| r.session_id.is_none_or(|s| e.session_id == Some(s)))
        .take(limit as usize)
        .map(|e| MemorySummary::of(&e))
        .collect();
    Ok(MemoryList { entries, scanned })
}

/// The entry of `run`, if one is stored.
async fn entry_of(team: &Team, run: RunId) -> Result<Option<MemoryEntry>, ApiError> {
    let key = memory_key(run);
    let entry = team
        .memory_kv
        .entry(&key)
        .await
        .map_err(|e| unavailable("reading the memory bucket", e))?;
    match entry {
        Some(e) if e.operation == kv::Operation::Put => {
            serde_json::from_slice(&e.value).map(Some).map_err(|e| {
                ApiError::new(
                    500,
                    ErrorCode::Internal,
                    format!("{key} is unreadable: {e}"),
                )
            })
        }
        _ => Ok(None),
    }
}

/// `memory.get`.
pub(crate) async fn get(team: Arc<Team>, r: MemoryGetRequest) -> Result<MemoryEntry, ApiError> {
    entry_of(&team, r.run_id)
        .await?
        .ok_or_else(|| not_found(r.run_id))
}

/// `memory.forget`: purges the entry (its marker stays, so the run is not recorded again).
pub(crate) async fn forget(
    team: Arc<Team>,
    r: MemoryForgetRequest,
) -> Result<MemoryForgotten, ApiError> {
    if entry_of(&team, r.run_id).await?.is_none() {
        return Err(not_found(r.run_id));
    }
    team.memory_kv
        .purge(memory_key(r.run_id))
        .await
        .map_err(|e| unavailable("forgetting the entry", e))?;
    info!(run = %r.run_id, "Run forgotten");
    Ok(MemoryForgotten { run_id: r.run_id })
}
