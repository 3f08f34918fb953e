//! A run's place in its tree, fixed once when the run is admitted: how deep it sits, the
//! budgets its model calls spend under and the session it shares — all read from its parent —
//! and the bounds that keep a tree from running away.
//!
//! ```text
//! submission with a parent link ──► parent's facts (record, else its first message,
//!                                   recursively up to a recorded ancestor; cached)
//!      │ none / rejected / another tree ──► invalid_parent
//!      │ parent.depth + 1 > max-depth ────► tree_too_deep
//!      │ runs in the tree ≥ max-runs ─────► tree_too_large   (`tree.<root>` counter, CAS)
//!      ▼
//!   Lineage { depth, budget scopes (the parent's, then the run's own), session }
//! ```
//!
//! **Budgets bind the whole tree.** A run's budget scopes are its ancestors' scopes followed
//! by its own budget (if its plan sets one); every task envelope carries them and an LLM
//! agent reserves each model call against every scope. A child may therefore only narrow
//! what its tree may spend, never escape it.
//!
//! **Counting a tree.** The first admission of a child increments `tree.<root>` in the runs
//! bucket with compare-and-set; a run rebuilt from its first message (a replay) is not
//! counted again. A coordinator that dies between the increment and the run's record may
//! count a run twice when its redelivered submission is admitted again: the tree then gets
//! one run fewer, never one more.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use async_nats::jetstream::kv;
use flotilla_model::ids::{RunId, SessionId};
use flotilla_model::run::{RunHandle, RunStatus};
use flotilla_model::runlog::{RunInput, RunLogEntry};
use flotilla_model::task::{Budget, BudgetScope};
use flotilla_model::validate::{Problem, ProblemCode};

use crate::error::{StoreError, StoreErrorKind};
use crate::store::{First, FirstMessage, RunStore};

/// Parents whose facts are kept (a parent usually starts several children).
const CACHE_RUNS: usize = 4096;

/// Compare-and-set tries on a tree's counter before giving up (contended only by siblings
/// admitted at the same moment).
const MAX_COUNT_TRIES: usize = 32;

/// The bounds of a run tree (`[coordinator]` `max-depth`, `max-runs-per-tree`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TreeLimits {
    /// Deepest a child may sit below its root (the root is at depth 0).
    pub max_depth: u32,
    /// Most runs a tree may hold, its root included.
    pub max_runs: u32,
}

impl TreeLimits {
    /// The limits a coordinator's settings set.
    pub(crate) fn of(opts: &crate::CoordinatorOptions) -> Self {
        Self {
            max_depth: opts.max_depth,
            max_runs: opts.max_runs_per_tree,
        }
    }
}

/// What a run inherits from its tree.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Lineage {
    /// Depth below the root.
    pub depth: u32,
    /// Budgets its model calls count against, root first.
    pub budget_scopes: Vec<BudgetScope>,
    /// Its session (a child shares its parent's).
    pub session_id: Option<SessionId>,
    /// The root of its tree, for a child run (a root run is its own).
    pub tree: Option<RunId>,
}

impl Lineage {
    /// The lineage of a root run.
    pub(crate) fn root(run: RunId, own: Option<Budget>, session_id: Option<SessionId>) -> Self {
        Self {
            depth: 0,
            budget_scopes: own
                .map(|limits| BudgetScope {
                    run_id: run,
                    limits,
                })
                .into_iter()
                .collect(),
            session_id,
            tree: None,
        }
    }
}

/// The facts of a run that its children need.
#[derive(Debug, Clone, PartialEq)]
struct Parentage {
    root: RunId,
    depth: u32,
    budget_scopes: Vec<BudgetScope>,
    /// The session its children share: its session id, else its root's id.
    session: SessionId,
}

/// Reads parents' facts (cached: they never change once a run is admitted) and counts trees.
#[derive(Debug)]
pub(crate) struct Lineages {
    store: RunStore,
    limits: TreeLimits,
    cache: Mutex<HashMap<RunId, Arc<Parentage>>>,
    /// The last count and revision of `tree.<root>` this coordinator read or wrote: the
    /// next admission in that tree tries its compare-and-set straight away, without reading
    /// the counter first (a stale revision only costs the read it saved).
    counts: Mutex<HashMap<RunId, (u32, u64)>>,
}

/// Why a lineage could not be given.
type Refusal = Problem;

impl Lineages {
    pub(crate) fn new(store: RunStore, limits: TreeLimits) -> Self {
        Self {
            store,
            limits,
            cache: Mutex::new(HashMap::new()),
            counts: Mutex::new(HashMap::new()),
        }
    }

    /// Notes the facts of a run this coordinator has just admitted, so its own children
    /// find them without reading the store: a run's start is recorded lazily, and until
    /// then its facts would be read from its first message and up its tree, level by level,
    /// on every child it starts.
    pub(crate) fn admitted(&self, run: RunId, submitted: &flotilla_model::runlog::Submitted) {
        let root = submitted.parent.as_ref().map_or(run, RunHandle::root_run);
        self.remember(
            run,
            Arc::new(Parentage {
                root,
                depth: submitted.depth,
                budget_scopes: submitted.budget_scopes.clone(),
                session: submitted
                    .session_id
                    .unwrap_or_else(|| session_of_root(root)),
            }),
        );
    }

    /// The lineage of run `run`, submitted with `parent` (if any), `session` and its own
    /// budget `own`; a refusal names the problem (`invalid_parent`, `tree_too_deep`). Reads
    /// only: a child is counted in its tree by [`Lineages::enter`] once it is admitted.
    pub(crate) async fn lineage(
        &self,
        run: RunId,
        parent: Option<&RunHandle>,
        session: Option<SessionId>,
        own: Option<Budget>,
    ) -> Result<Result<Lineage, Refusal>, StoreError> {
        let Some(parent) = parent else {
            return Ok(Ok(Lineage::root(run, own, session)));
        };
        let facts = match self.parentage(parent.run_id, 0).await? {
            Ok(f) => f,
            Err(p) => return Ok(Err(p)),
        };
        if parent.root_run() != facts.root {
            return Ok(Err(Problem::new(
                ProblemCode::InvalidParent,
                "parent.root_run_id",
                format!(
                    "the parent link names root {} but run {} belongs to the tree of {}",
                    parent.root_run(),
                    parent.run_id,
                    facts.root
                ),
            )));
        }
        if let Some(s) = session.filter(|s| *s != facts.session) {
            return Ok(Err(Problem::new(
                ProblemCode::InvalidParent,
                "session_id",
                format!(
                    "a child run shares its parent's session {}, not {s}",
                    facts.session
                ),
            )));
        }
        let depth = facts.depth + 1;
        if depth > self.limits.max_depth {
            return Ok(Err(Problem::new(
                ProblemCode::TreeTooDeep,
                "parent",
                format!(
                    "run {run} would sit {depth} levels below its root {}; this deployment allows {} (coordinator.max-depth)",
                    facts.root, self.limits.max_depth
                ),
            )));
        }
        let mut budget_scopes = facts.budget_scopes.clone();
        budget_scopes.extend(own.map(|limits| BudgetScope {
            run_id: run,
            limits,
        }));
        Ok(Ok(Lineage {
            depth,
            budget_scopes,
            session_id: Some(facts.session),
            tree: Some(facts.root),
        }))
    }

    /// Counts an admitted child run in its tree: `tree_too_large` when the tree is full. A
    /// root run needs no count.
    pub(crate) async fn enter(&self, lineage: &Lineage) -> Result<Result<(), Refusal>, StoreError> {
        let Some(root) = lineage.tree else {
            return Ok(Ok(()));
        };
        if self.count(root).await? {
            return Ok(Ok(()));
        }
        Ok(Err(Problem::new(
            ProblemCode::TreeTooLarge,
            "parent",
            format!(
                "the tree of {root} already holds {} runs, as many as this deployment allows (coordinator.max-runs-per-tree)",
                self.limits.max_runs
            ),
        )))
    }

    /// The facts of `run` as a parent: from its record, else from its first message (an
    /// accepted run whose start is not recorded yet), reading up the tree as far as needed.
    async fn parentage(
        &self,
        run: RunId,
        hops: u32,
    ) -> Result<Result<Arc<Parentage>, Refusal>, StoreError> {
        if let Some(f) = self.cached(run) {
            return Ok(Ok(f));
        }
        let missing = |why: String| {
            Ok(Err(Problem::new(
                ProblemCode::InvalidParent,
                "parent.run_id",
                why,
            )))
        };
        if hops > self.limits.max_depth {
            return Ok(Err(Problem::new(
                ProblemCode::TreeTooDeep,
                "parent",
                format!(
                    "run {run}'s tree is deeper than this deployment allows ({} levels, coordinator.max-depth)",
                    self.limits.max_depth
                ),
            )));
        }
        if let Some(stored) = self.store.load(run).await? {
            let s = &stored.snapshot.state;
            if s.status == RunStatus::Rejected {
                return missing(format!("the parent run {run} was rejected"));
            }
            let root = root_of(s);
            let facts = Arc::new(Parentage {
                root,
                depth: s.depth,
                budget_scopes: s.budget_scopes.clone(),
                session: s.session_id.unwrap_or_else(|| session_of_root(root)),
            });
            self.remember(run, Arc::clone(&facts));
            return Ok(Ok(facts));
        }
        let first = match self.store.first_message(run).await {
            Ok(f) => f,
            Err(e) if e.kind() == StoreErrorKind::Decode => None,
            Err(e) => return Err(e),
        };
        let (parent, session, own, depth, scopes) = match first {
            None => return missing(format!("the parent run {run} does not exist")),
            Some(First {
                content:
                    FirstMessage::Entry(RunLogEntry {
                        input: RunInput::Submitted(s),
                        ..
                    }),
                ..
            }) => {
                // Admitted by the intake: its lineage is in the entry.
                let root = s.parent.as_ref().map_or(run, RunHandle::root_run);
                return Ok(Ok(Arc::new(Parentage {
                    root,
                    depth: s.depth,
                    budget_scopes: s.budget_scopes.clone(),
                    session: s.session_id.unwrap_or_else(|| session_of_root(root)),
                })));
            }
            Some(First {
                content: FirstMessage::Submission { request, .. },
                ..
            }) => (
                request.parent.clone(),
                request.session_id,
                request.plan.as_ref().and_then(|p| p.config.budget()),
                0,
                Vec::new(),
            ),
            Some(_) => return missing(format!("the parent run {run} was rejected")),
        };
        // A client's own submission whose start is not recorded yet: its lineage follows
        // from its parent's, as its coordinator computed it.
        let Some(grandparent) = parent else {
            let facts = Lineage::root(run, own, session);
            return Ok(Ok(Arc::new(Parentage {
                root: run,
                depth,
                budget_scopes: facts.budget_scopes,
                session: session.unwrap_or_else(|| session_of_root(run)),
            })));
        };
        let up = match Box::pin(self.parentage(grandparent.run_id, hops + 1)).await? {
            Ok(up) => up,
            Err(p) => return Ok(Err(p)),
        };
        let mut budget_scopes = if scopes.is_empty() {
            up.budget_scopes.clone()
        } else {
            scopes
        };
        budget_scopes.extend(own.map(|limits| BudgetScope {
            run_id: run,
            limits,
        }));
        Ok(Ok(Arc::new(Parentage {
            root: up.root,
            depth: up.depth + 1,
            budget_scopes,
            session: session.unwrap_or(up.session),
        })))
    }

    fn cached(&self, run: RunId) -> Option<Arc<Parentage>> {
        self.cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&run)
            .cloned()
    }

    fn remember(&self, run: RunId, facts: Arc<Parentage>) {
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if cache.len() >= CACHE_RUNS {
            cache.clear();
        }
        cache.insert(run, facts);
    }

    /// Enters one more run in the tree of `root`; `false` when the tree is full.
    async fn count(&self, root: RunId) -> Result<bool, StoreError> {
        let kv = self.store.runs_bucket();
        let key = format!("tree.{root}");
        let mut known = self
            .counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&root)
            .copied();
        for _ in 0..MAX_COUNT_TRIES {
            let (children, revision) = match known.take() {
                Some(k) => k,
                None => {
                    let entry = kv.entry(&key).await.map_err(|e| {
                        StoreError::with_source(StoreErrorKind::Nats, "reading a tree's count", e)
                    })?;
                    match entry.filter(|e| e.operation == kv::Operation::Put) {
                        Some(e) => (
                            std::str::from_utf8(&e.value)
                                .ok()
                                .and_then(|s| s.parse::<u32>().ok())
                                .unwrap_or(0),
                            e.revision,
                        ),
                        None => (0, 0),
                    }
                }
            };
            // The root and its children so far, and this one.
            if children.saturating_add(2) > self.limits.max_runs {
                return Ok(false);
            }
            let next = (children + 1).to_string().into_bytes().into();
            let written = if revision == 0 {
                kv.create(&key, next).await.map_err(|e| {
                    (
                        e.kind() == kv::CreateErrorKind::AlreadyExists,
                        e.to_string(),
                    )
                })
            } else {
                kv.update(&key, next, revision).await.map_err(|e| {
                    (
                        e.kind() == kv::UpdateErrorKind::WrongLastRevision,
                        e.to_string(),
                    )
                })
            };
            match written {
                Ok(revision) => {
                    let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
                    if counts.len() >= CACHE_RUNS {
                        counts.clear();
                    }
                    counts.insert(root, (children + 1, revision));
                    return Ok(true);
                }
                Err((true, _)) => continue,
                Err((false, e)) => {
                    return Err(StoreError::new(
                        StoreErrorKind::Nats,
                        format!("counting the runs of tree {root}: {e}"),
                    ));
                }
            }
        }
        Err(StoreError::new(
            StoreErrorKind::Conflict,
            format!("counting the runs of tree {root}: too many concurrent admissions"),
        ))
    }
}

/// The session of a tree without a session id: its root's id.
fn session_of_root(root: RunId) -> SessionId {
    SessionId::from_uuid(*root.as_uuid())
}

/// The root of a run's tree, whose workspace and mailboxes its tasks share: a child run's
/// parent link names it; a run without a parent is its own root.
pub(crate) fn root_of(state: &crate::machine::RunState) -> RunId {
    state
        .parent
        .as_ref()
        .map_or(state.run_id, RunHandle::root_run)
}

/// The key prefix of a run's session state: its session id, else its root run's id.
pub(crate) fn session_of(state: &crate::machine::RunState) -> String {
    state
        .session_id
        .map_or_else(|| root_of(state).to_string(), |s| s.to_string())
}
