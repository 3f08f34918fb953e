//! The runs list: every run's record, kept in memory from a watch of the `flotilla-runs`
//! bucket (the records the coordinators write), so listing 10,000 runs, filtering and paging
//! them costs no NATS request, and every change is pushed to the open pages.
//!
//! ```text
//! flotilla-runs KV ──watch (history, then live)──► RunIndex ──page──► GET /api/runs
//!                                                     └──broadcast──► SSE /api/runs/stream
//! ```
//!
//! A record is the same [`record_of`] projection `flotilla runs list` prints; nothing here
//! interprets a run differently. Next to the records it keeps the pending approvals (re-read
//! on every notice), so each row says what a person reads — `waiting` for a live run some
//! person must act on, as `flotilla runs list` says it ([`progress::run_label`]).
//!
//! The index keeps of each run only what a row shows and a filter reads ([`Listed`]: about
//! 200 bytes), never its result, problems, strategy, planning or memory use, which can be
//! large and which the run's page reads from its record. Holding whole records made the
//! console grow with every run the deployment ever ran (the soak measured ~13 MiB an hour).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_nats::jetstream::kv;
use flotilla_client::progress::{self, Wait};
use flotilla_model::RunId;
use flotilla_model::approval::ApprovalRecord;
use flotilla_model::ids::{AgentId, SessionId, TaskId};
use flotilla_model::run::{RunHandle, RunRecord, RunStatus, TaskCounts};
use flotilla_model::time::Timestamp;
use flotilla_runs::{RunReader, Snapshot, record_of};
use futures::StreamExt;
use serde::Serialize;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// How many changes an open page may lag before it is told to reload.
const CHANGES: usize = 4096;
/// Most runs one page of the list answers.
pub(crate) const MAX_PAGE: usize = 1000;

/// A run as the list shows it: its record, and what a person reads of it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Row {
    /// The record.
    #[serde(flatten)]
    pub(crate) record: RunRecord,
    /// `waiting` for a live run some person must act on (a pending approval, a question, a
    /// client tool, a pause, a takeover), else the record's status.
    pub(crate) label: &'static str,
    /// What it waits for, with the command that answers each.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) waiting: Vec<Wait>,
}

impl Row {
    fn of(listed: &Listed, pending: Option<&Vec<ApprovalRecord>>) -> Self {
        let record = listed.record();
        let waiting = progress::waits(&record, pending.map_or(&[][..], Vec::as_slice));
        Self {
            label: progress::run_label(record.status, &waiting),
            record,
            waiting,
        }
    }
}

/// What the index keeps of a run: the fields a row shows and a filter reads. A row is its
/// record without `outcome`, `errors`, `warnings`, `strategy`, `planning` and `memory`.
#[derive(Debug, Clone)]
pub(crate) struct Listed {
    run_id: RunId,
    parent_run_id: Option<RunId>,
    root_run_id: Option<RunId>,
    parent_task_id: Option<TaskId>,
    agent_id: Option<AgentId>,
    name: Option<Box<str>>,
    status: RunStatus,
    labels: std::collections::BTreeMap<String, String>,
    session_id: Option<SessionId>,
    created_at: Timestamp,
    finished_at: Option<Timestamp>,
    tasks: TaskCounts,
}

impl Listed {
    pub(crate) fn of(r: &RunRecord) -> Self {
        Self {
            run_id: r.handle.run_id,
            parent_run_id: r.handle.parent_run_id,
            root_run_id: r.handle.root_run_id,
            parent_task_id: r.handle.parent_task_id.clone(),
            agent_id: r.handle.agent_id,
            name: r.name.as_deref().map(Into::into),
            status: r.status,
            labels: r.labels.clone(),
            session_id: r.session_id,
            created_at: r.created_at,
            finished_at: r.finished_at,
            tasks: r.tasks.clone(),
        }
    }

    /// The record a row shows.
    fn record(&self) -> RunRecord {
        RunRecord {
            fork_of: None,
            handle: RunHandle {
                run_id: self.run_id,
                agent_id: self.agent_id,
                parent_run_id: self.parent_run_id,
                parent_tool_call_id: None,
                parent_task_id: self.parent_task_id.clone(),
                root_run_id: self.root_run_id,
            },
            name: self.name.as_deref().map(Into::into),
            status: self.status,
            labels: self.labels.clone(),
            session_id: self.session_id,
            created_at: self.created_at,
            finished_at: self.finished_at,
            tasks: self.tasks.clone(),
            errors: Vec::new(),
            warnings: Vec::new(),
            outcome: None,
            strategy: None,
            planning: None,
            memory: None,
        }
    }
}

/// A change of the runs list.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub(crate) enum Change {
    /// A run's record is new or changed, or what it waits for changed.
    Put {
        /// The row.
        record: Box<Row>,
    },
    /// A run's record was removed.
    Removed {
        /// The run.
        run_id: RunId,
    },
}

#[derive(Debug, Default)]
struct Inner {
    records: HashMap<RunId, Listed>,
    /// Pending approvals, by run.
    pending: HashMap<RunId, Vec<ApprovalRecord>>,
    /// The initial catch-up is done.
    loaded: bool,
}

/// Every run's record, live.
#[derive(Debug, Clone)]
pub(crate) struct RunIndex {
    inner: Arc<RwLock<Inner>>,
    changes: broadcast::Sender<Change>,
}

/// Which runs a page of the list shows.
#[derive(Debug, Clone, Default)]
pub(crate) struct Filter {
    /// Comma-separated statuses (`running,failed`), each a record's status or what a person
    /// reads (`waiting`).
    pub(crate) status: Option<String>,
    /// `key=value` (or just `key`) of a label.
    pub(crate) label: Option<String>,
    /// Only this session's runs.
    pub(crate) session: Option<SessionId>,
    /// Text in the name or id.
    pub(crate) q: Option<String>,
    /// Child runs too (default: root runs only; children are in their tree).
    pub(crate) children: bool,
}

impl Filter {
    pub(crate) fn matches(&self, r: &Listed, label: &str) -> bool {
        if !self.children && r.parent_run_id.is_some() {
            return false;
        }
        if let Some(s) = self.status.as_deref().filter(|s| !s.is_empty())
            && !s
                .split(',')
                .any(|s| s.trim() == r.status.as_str() || s.trim() == label)
        {
            return false;
        }
        if let Some(l) = self.label.as_deref().filter(|s| !s.is_empty()) {
            let ok = match l.split_once('=') {
                Some((k, v)) => r.labels.get(k).is_some_and(|x| x == v),
                None => r.labels.contains_key(l),
            };
            if !ok {
                return false;
            }
        }
        if let Some(s) = self.session
            && r.session_id != Some(s)
        {
            return false;
        }
        if let Some(q) = self.q.as_deref().filter(|s| !s.is_empty()) {
            let q = q.to_lowercase();
            let name = r.name.as_deref().unwrap_or_default().to_lowercase();
            if !name.contains(&q) && !r.run_id.to_string().contains(&q) {
                return false;
            }
        }
        true
    }
}

/// One page of the list.
#[derive(Debug, Serialize)]
pub(crate) struct Page {
    /// Runs matching the filter.
    pub(crate) total: usize,
    /// The first run's position.
    pub(crate) offset: usize,
    /// The runs, newest first.
    pub(crate) runs: Vec<Row>,
    /// Runs by what a person reads (`waiting`, else the status) over the whole list (before
    /// the filter).
    pub(crate) counts: HashMap<&'static str, usize>,
    /// How many trailing hex digits of a run id tell every run known apart (at least 8):
    /// the short id the pages show.
    pub(crate) short_len: usize,
    /// Still reading the bucket: more runs may appear.
    pub(crate) loading: bool,
}

impl RunIndex {
    /// An index fed by a watch of the runs bucket until `stop`.
    pub(crate) fn start(store: &RunReader, stop: CancellationToken) -> Self {
        let (changes, _) = broadcast::channel(CHANGES);
        let index = Self {
            inner: Arc::default(),
            changes,
        };
        let kv = store.runs_bucket().clone();
        let this = index.clone();
        tokio::spawn(async move {
            loop {
                if let Err(e) = this.follow(&kv, &stop).await {
                    warn!(error = %e, "The runs watch failed; watching again");
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        });
        index
    }

    async fn follow(
        &self,
        kv: &kv::Store,
        stop: &CancellationToken,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        if kv.status().await?.values() == 0 {
            self.set_loaded();
        }
        let mut watch = kv.watch_with_history(">").await?;
        loop {
            let entry = tokio::select! {
                _ = stop.cancelled() => return Ok(()),
                e = watch.next() => match e {
                    Some(e) => e?,
                    None => return Ok(()),
                },
            };
            if entry.delta == 0 {
                self.set_loaded();
            }
            let Ok(run) = entry.key.parse::<RunId>() else {
                continue; // a session index or idempotency key
            };
            match entry.operation {
                kv::Operation::Put => match rmp_serde::from_slice::<Snapshot>(&entry.value) {
                    Ok(s) => self.put(record_of(&s.state)),
                    Err(e) => debug!(%run, error = %e, "Unreadable run record"),
                },
                kv::Operation::Delete | kv::Operation::Purge => self.remove(run),
            }
        }
    }

    fn set_loaded(&self) {
        if let Ok(mut inner) = self.inner.write() {
            inner.loaded = true;
        }
    }

    pub(crate) fn put(&self, record: RunRecord) {
        let listed = Listed::of(&record);
        let row = match self.inner.write() {
            Ok(mut inner) => {
                let row = Row::of(&listed, inner.pending.get(&listed.run_id));
                inner.records.insert(listed.run_id, listed);
                row
            }
            Err(_) => Row::of(&listed, None),
        };
        let _ = self.changes.send(Change::Put {
            record: Box::new(row),
        });
    }

    /// The approvals pending now (every run's): the rows whose waits changed are sent again.
    pub(crate) fn set_pending(&self, approvals: Vec<ApprovalRecord>) {
        let mut pending: HashMap<RunId, Vec<ApprovalRecord>> = HashMap::new();
        for a in approvals {
            pending.entry(a.request.run_id).or_default().push(a);
        }
        let ids = |m: &HashMap<RunId, Vec<ApprovalRecord>>, run: &RunId| -> Vec<String> {
            m.get(run).map_or_else(Vec::new, |v| {
                v.iter().map(|a| a.request.approval_id.clone()).collect()
            })
        };
        let changed: Vec<Row> = match self.inner.write() {
            Ok(mut inner) => {
                let runs: std::collections::HashSet<RunId> = inner
                    .pending
                    .keys()
                    .chain(pending.keys())
                    .copied()
                    .collect();
                let changed: Vec<RunId> = runs
                    .into_iter()
                    .filter(|r| ids(&inner.pending, r) != ids(&pending, r))
                    .collect();
                inner.pending = pending;
                changed
                    .iter()
                    .filter_map(|r| {
                        inner
                            .records
                            .get(r)
                            .map(|rec| Row::of(rec, inner.pending.get(r)))
                    })
                    .collect()
            }
            Err(_) => Vec::new(),
        };
        for row in changed {
            let _ = self.changes.send(Change::Put {
                record: Box::new(row),
            });
        }
    }

    /// The plan name of each of `runs` that has one.
    pub(crate) fn names(&self, runs: impl Iterator<Item = RunId>) -> HashMap<RunId, String> {
        self.inner.read().map_or_else(
            |_| HashMap::new(),
            |inner| {
                runs.filter_map(|r| {
                    inner
                        .records
                        .get(&r)
                        .and_then(|rec| rec.name.as_deref())
                        .map(|n| (r, n.to_owned()))
                })
                .collect()
            },
        )
    }

    fn remove(&self, run: RunId) {
        if let Ok(mut inner) = self.inner.write() {
            inner.records.remove(&run);
        }
        let _ = self.changes.send(Change::Removed { run_id: run });
    }

    /// Changes from now on.
    pub(crate) fn subscribe(&self) -> broadcast::Receiver<Change> {
        self.changes.subscribe()
    }

    /// The runs matching `filter`, newest first, from `offset`, at most `limit`.
    pub(crate) fn page(&self, filter: &Filter, offset: usize, limit: usize) -> Page {
        let Ok(inner) = self.inner.read() else {
            return Page {
                total: 0,
                offset,
                runs: Vec::new(),
                counts: HashMap::new(),
                short_len: crate::monitor::MIN_SHORT,
                loading: true,
            };
        };
        let mut counts: HashMap<&'static str, usize> = HashMap::new();
        let mut matching: Vec<&Listed> = Vec::new();
        for r in inner.records.values() {
            // Only a live run's waits are worth a record: an ended run waits for nothing.
            let label = if r.status.is_terminal() {
                r.status.as_str()
            } else {
                let pending = inner.pending.get(&r.run_id).map_or(&[][..], Vec::as_slice);
                progress::run_label(r.status, &progress::waits(&r.record(), pending))
            };
            if r.parent_run_id.is_none() || filter.children {
                *counts.entry(label).or_default() += 1;
            }
            if filter.matches(r, label) {
                matching.push(r);
            }
        }
        matching.sort_by(|a, b| {
            b.created_at
                .unix_ms()
                .cmp(&a.created_at.unix_ms())
                .then(b.run_id.cmp(&a.run_id))
        });
        let total = matching.len();
        let runs = matching
            .into_iter()
            .skip(offset)
            .take(limit.min(MAX_PAGE))
            .map(|r| Row::of(r, inner.pending.get(&r.run_id)))
            .collect();
        Page {
            total,
            offset,
            runs,
            counts,
            short_len: crate::monitor::short_len(inner.records.keys()),
            loading: !inner.loaded,
        }
    }

    /// Runs not ended yet (for the overview).
    pub(crate) fn active(&self) -> usize {
        self.inner.read().map_or(0, |i| {
            i.records
                .values()
                .filter(|r| !r.status.is_terminal() && r.status != RunStatus::Rejected)
                .count()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn record(run: RunId, status: &str, response: &str) -> RunRecord {
        serde_json::from_value(json!({
            "handle": {"run_id": run},
            "name": "review",
            "status": status,
            "labels": {"team": "docs"},
            "created_at": "2026-11-28T10:00:00Z",
            "finished_at": "2026-11-28T10:00:01Z",
            "tasks": {"total": 2, "waiting": 0, "running": 0, "succeeded": 2, "failed": 0,
                      "skipped": 0, "cancelled": 0},
            "warnings": [{"code": "unknown_agent", "path": "tasks[0]", "message": "x".repeat(4096)}],
            "outcome": {"run_id": run, "status": status,
                        "final_result": {"response": response, "results": {}}},
        }))
        .expect("a record")
    }

    /// The index keeps what a row shows and no more: a run's result (here 1 MiB) and its
    /// problems stay in the bucket, so the console does not grow by every run's result.
    #[tokio::test]
    async fn the_list_keeps_a_rows_fields_and_not_the_runs_result() {
        let index = RunIndex {
            inner: Arc::default(),
            changes: broadcast::channel(CHANGES).0,
        };
        let mut changes = index.subscribe();
        let run = RunId::new();
        index.put(record(run, "succeeded", &"r".repeat(1 << 20)));
        let page = index.page(&Filter::default(), 0, 10);
        assert_eq!(page.total, 1);
        let row = &page.runs[0];
        assert_eq!(row.record.handle.run_id, run);
        assert_eq!(row.record.name.as_deref(), Some("review"));
        assert_eq!(row.label, "succeeded");
        assert_eq!(row.record.tasks.succeeded, 2);
        assert_eq!(
            row.record.labels.get("team").map(String::as_str),
            Some("docs")
        );
        assert!(row.record.finished_at.is_some());
        assert!(row.record.outcome.is_none() && row.record.warnings.is_empty());
        let Ok(Change::Put { record }) = changes.try_recv() else {
            panic!("a change");
        };
        assert!(
            record.record.outcome.is_none(),
            "the pushed row is the listed one"
        );
        // Filters read the kept fields.
        let by_label = Filter {
            label: Some("team=docs".into()),
            ..Filter::default()
        };
        assert_eq!(index.page(&by_label, 0, 10).total, 1);
        let by_name = Filter {
            q: Some("REV".into()),
            ..Filter::default()
        };
        assert_eq!(index.page(&by_name, 0, 10).total, 1);
        let other = Filter {
            status: Some("failed,waiting".into()),
            ..Filter::default()
        };
        assert_eq!(index.page(&other, 0, 10).total, 0);
        // What one run costs the index, beyond its name and labels.
        assert!(
            std::mem::size_of::<Listed>() <= 256,
            "{}",
            std::mem::size_of::<Listed>()
        );
    }
}
