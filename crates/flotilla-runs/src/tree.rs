//! Reading run trees and sessions: the engine behind `<prefix>.api.run.tree`,
//! `<prefix>.api.session.get`, `flotilla runs tree` and `flotilla sessions show`.
//!
//! A run's children are the links (`agent_run_started`) on its event stream, in the order
//! they were stored; its model usage is the sum of its `usage` events. Both come from one read
//! of the run's events, so the tree costs, per run, a record read and a paged read of its
//! events — done breadth first, several runs at a time, up to a cap on the runs listed.
//!
//! A session's runs are found through an index the coordinators keep in the runs bucket: a
//! key `session.<session>.<run>` written before the record of every run that has a session
//! (runs submitted with `session_id`, and every child run, which carries its tree's
//! session). Listing a session reads those keys' subjects, not every record. A run submitted
//! without a session has none in the index, though its children carry its id as their
//! session: a session id that names such a run lists the run itself too.

use std::collections::{HashMap, HashSet};

use flotilla_bus::wire;
use flotilla_model::RunId;
use flotilla_model::event::{Event, EventEnvelope, decode_events};
use flotilla_model::ids::SessionId;
use flotilla_model::run::{RunHandle, RunRecord};
use flotilla_model::subjects::StreamKind;
use flotilla_model::time::Timestamp;
use flotilla_model::tree::{
    MAX_RUNS_PER_ANSWER, RunSummary, RunTree, RunTreeNode, SessionView, UsageTotals,
};
use futures::StreamExt;

use crate::error::{StoreError, StoreErrorKind};
use crate::reader::RunReader;

/// Runs read at once while walking a tree.
pub(crate) const READS_IN_FLIGHT: usize = 16;

/// What one read of a run's events says about the tree.
#[derive(Debug, Default)]
struct RunEvents {
    /// Children in the order their links were stored, with the agent each was started for.
    children: Vec<(RunHandle, Option<String>)>,
    usage: UsageTotals,
}

/// Reads `run`'s events once: its children and its usage.
async fn run_events(store: &RunReader, run: RunId) -> Result<RunEvents, StoreError> {
    let mut out = RunEvents::default();
    let mut seen_children = HashSet::new();
    let mut seen_usage = HashSet::new();
    each_event(store, run, |e| match e.event {
        Event::AgentRunStarted { child, agent } if seen_children.insert(child.run_id) => {
            out.children.push((child, agent));
        }
        Event::Usage { .. } if seen_usage.insert(e.id.clone()) => out.usage.count(&e.event),
        _ => {}
    })
    .await?;
    Ok(out)
}

/// Calls `f` with every event stored for `run` (one paged read of its subject; a message
/// that does not decode is skipped).
pub(crate) async fn each_event(
    store: &RunReader,
    run: RunId,
    mut f: impl FnMut(EventEnvelope),
) -> Result<(), StoreError> {
    let bus = store.bus();
    let filter = bus.names().event(run);
    let mut pages = bus.pages(StreamKind::Events, &filter, 0);
    while let Some(page) = pages
        .next()
        .await
        .map_err(|e| StoreError::with_source(StoreErrorKind::Nats, "reading a run's events", e))?
    {
        for m in &page {
            let Ok(events) = decode_events(wire::codec_of(Some(&m.headers)), &m.payload) else {
                continue;
            };
            events.into_iter().for_each(&mut f);
        }
    }
    Ok(())
}

/// A run read for the tree, before its children are attached.
struct Read {
    record: RunRecord,
    agent: Option<String>,
    events: RunEvents,
}

fn duration_ms(record: &RunRecord, now: Timestamp) -> u64 {
    let end = record.finished_at.unwrap_or(now);
    u64::try_from(end.unix_ms() - record.created_at.unix_ms()).unwrap_or(0)
}

/// The tree under `run`: the run and, recursively, the child runs its agents started, with
/// status, duration, tokens and cost per run. At most `max_runs` runs (capped at 1000) are
/// listed, breadth first. `None` when `run` does not exist.
pub async fn run_tree(
    store: &RunReader,
    run: RunId,
    max_runs: usize,
) -> Result<Option<RunTree>, StoreError> {
    let max_runs = max_runs.clamp(1, MAX_RUNS_PER_ANSWER as usize);
    let Some(record) = store.record(run).await? else {
        return Ok(None);
    };
    let mut agent = record.handle.agent_id.as_ref().map(|a| a.to_string());
    if agent.is_none() && record.tasks.total == 1 {
        // A one-task run (a child, or a single-agent submission): its task's agent.
        agent = store
            .plan(run)
            .await?
            .and_then(|p| p.subtasks.first().and_then(|t| t.agent.clone()));
    }
    let mut reads: HashMap<RunId, Read> = HashMap::new();
    reads.insert(
        run,
        Read {
            record,
            agent,
            events: run_events(store, run).await?,
        },
    );
    let mut omitted = 0u32;
    let mut level = vec![run];
    while !level.is_empty() {
        let mut next: Vec<(RunHandle, Option<String>)> = Vec::new();
        for parent in &level {
            for (child, agent) in &reads[parent].events.children {
                if !reads.contains_key(&child.run_id)
                    && !next.iter().any(|(c, _)| c.run_id == child.run_id)
                {
                    next.push((child.clone(), agent.clone()));
                }
            }
        }
        let room = max_runs.saturating_sub(reads.len());
        if next.len() > room {
            omitted += u32::try_from(next.len() - room).unwrap_or(u32::MAX);
            next.truncate(room);
        }
        let fetched: Vec<_> = futures::stream::iter(next)
            .map(|(child, agent)| async move {
                let record = store.record(child.run_id).await?;
                let events = match &record {
                    Some(_) => run_events(store, child.run_id).await?,
                    None => RunEvents::default(),
                };
                Ok::<_, StoreError>((child, agent, record, events))
            })
            .buffered(READS_IN_FLIGHT)
            .collect()
            .await;
        level = Vec::new();
        for f in fetched {
            let (child, agent, record, events) = f?;
            let Some(record) = record else {
                omitted += 1;
                continue;
            };
            level.push(child.run_id);
            reads.insert(
                child.run_id,
                Read {
                    record,
                    agent: agent.or_else(|| child.agent_id.as_ref().map(|a| a.to_string())),
                    events,
                },
            );
        }
    }
    let runs = u32::try_from(reads.len()).unwrap_or(u32::MAX);
    let now = Timestamp::now();
    let mut placed = HashSet::new();
    let root = assemble(run, &mut reads, &mut placed, now);
    Ok(root.map(|root| RunTree {
        root,
        runs,
        omitted,
    }))
}

/// Builds the node of `run` from the runs read, children first (a run is placed once, under
/// the first parent that links it).
fn assemble(
    run: RunId,
    reads: &mut HashMap<RunId, Read>,
    placed: &mut HashSet<RunId>,
    now: Timestamp,
) -> Option<RunTreeNode> {
    if !placed.insert(run) {
        return None;
    }
    let read = reads.remove(&run)?;
    let mut children = Vec::new();
    let mut subtree_usage = read.events.usage;
    for (child, _) in &read.events.children {
        if let Some(node) = assemble(child.run_id, reads, placed, now) {
            subtree_usage.add(&node.subtree_usage);
            children.push(node);
        }
    }
    let record = read.record;
    Some(RunTreeNode {
        run_id: run,
        agent: read.agent,
        name: record.name.clone(),
        status: record.status,
        parent_task_id: record.handle.parent_task_id.clone(),
        parent_tool_call_id: record.handle.parent_tool_call_id.clone(),
        created_at: record.created_at,
        finished_at: record.finished_at,
        duration_ms: duration_ms(&record, now),
        tasks: record.tasks.clone(),
        usage: read.events.usage,
        subtree_usage,
        fork_of: record.fork_of.clone(),
        children,
    })
}

/// The runs of `session`, oldest first (at most 1000: the newest). Runs whose record is not
/// written yet are left out.
///
/// A run submitted without a session has its own id as its tree's session (its children
/// carry it), but no index key of its own: when `session` names such a run, it is listed
/// too, first.
pub async fn session_view(
    store: &RunReader,
    session: SessionId,
) -> Result<SessionView, StoreError> {
    let mut runs = store.session_runs(session).await?;
    let root = RunId::from_uuid(*session.as_uuid());
    if !runs.contains(&root)
        && let Some(record) = store.record(root).await?
        && record.session_id.is_none()
    {
        runs.insert(0, root);
    }
    // Index keys are stored in creation order: the newest are last.
    let max = MAX_RUNS_PER_ANSWER as usize;
    let omitted = runs.len().saturating_sub(max);
    runs.drain(..omitted);
    let fetched: Vec<_> = futures::stream::iter(runs)
        .map(|run| async move { store.record(run).await })
        .buffered(READS_IN_FLIGHT)
        .collect()
        .await;
    let mut summaries = Vec::new();
    for record in fetched {
        if let Some(record) = record? {
            summaries.push(RunSummary::from(&record));
        }
    }
    summaries.sort_by(|a, b| {
        a.created_at
            .unix_ms()
            .cmp(&b.created_at.unix_ms())
            .then(a.handle.run_id.cmp(&b.handle.run_id))
    });
    Ok(SessionView {
        session_id: session,
        runs: summaries,
        omitted: u32::try_from(omitted).unwrap_or(u32::MAX),
    })
}
