//! Planning from memory: before a bare query is planned, the coordinator looks for past runs
//! that answered a similar query and succeeded ([`flotilla_model::memory`], written by the
//! supervisor).
//!
//! ```text
//! query ──► newest ≤ scan-limit entries of <prefix>-memory ──► confidence per successful run
//!             (similarity: cosine over lowercased words, stop words removed)
//!   best reusable match ≥ reuse-threshold ──explores? (hash(run) mod 100 < explore-percent)──► planner + examples
//!        │ no: its plan, validated like any plan ──invalid──► planner + examples (invalid_plan)
//!        ▼ valid
//!   `submitted` with that plan: no planner call
//!   otherwise: the planner, with the best ≤ 3 matches and their confidence as examples
//! ```
//!
//! Ranking: reusable matches at or above the threshold first, then the run's own session's
//! before the deployment's, then by confidence, then the newest. Whatever is decided is
//! recorded on the `submitted` input ([`MemoryUse`]): the machine never looks memory up, so a
//! replay decides alike whatever memory holds by then. [`decide`] is pure; [`Memory::advise`]
//! reads the bucket (one stream-info request and batch direct gets of at most `scan-limit`
//! messages; no consumer, no key listing).

use flotilla_bus::Bus;
use flotilla_model::ids::{RunId, SessionId};
use flotilla_model::memory::{
    KEY_PREFIX, MemoryDecision, MemoryEntry, MemoryMatch, MemoryReason, MemoryUse,
    SIMILARITY_MEASURE, explores, similarity_of, word_counts,
};
use flotilla_model::plan::Plan;
use flotilla_model::subjects::Bucket;
use flotilla_model::validate::{
    MAX_REPORTED_PROBLEMS, Problem, ValidationContext, check_plan_size, prepare_plan,
    truncate_problems,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// `[coordinator.memory]`: whether and how bare queries use the supervisor's memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct MemoryOptions {
    /// Look memory up for bare queries.
    pub enabled: bool,
    /// Confidence (0 to 1) at or above which a past plan is reused without a planner call.
    pub reuse_threshold: f64,
    /// Percent of runs (by a hash of the run id) that call the planner even above the
    /// threshold, so plans keep being rediscovered.
    pub explore_percent: u8,
    /// Most entries scanned per lookup: the newest stored.
    pub scan_limit: usize,
    /// Most matches given to the planner as examples.
    pub examples: usize,
}

impl Eq for MemoryOptions {}

impl Default for MemoryOptions {
    fn default() -> Self {
        Self {
            enabled: true,
            reuse_threshold: 0.8,
            explore_percent: 10,
            // A month of a busy deployment's distinct questions, read in a few milliseconds.
            scan_limit: 1000,
            examples: 3,
        }
    }
}

impl MemoryOptions {
    /// Checks the settings without I/O.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.reuse_threshold) {
            return Err("coordinator.memory.reuse-threshold must be between 0 and 1".into());
        }
        if self.explore_percent > 100 {
            return Err("coordinator.memory.explore-percent must be 0 to 100".into());
        }
        if !(1..=100_000).contains(&self.scan_limit) {
            return Err("coordinator.memory.scan-limit must be 1 to 100000".into());
        }
        if self.examples > 3 {
            return Err("coordinator.memory.examples must be at most 3".into());
        }
        Ok(())
    }
}

/// What memory advises for a bare query.
#[derive(Debug)]
pub enum Advice {
    /// Run this past plan (validated) instead of planning.
    Reuse {
        /// The plan, validated and normalised (boxed: a plan is far larger than the other
        /// variant).
        plan: Box<Plan>,
        /// Its tolerated validation problems.
        warnings: Vec<Problem>,
        /// What to record.
        used: MemoryUse,
    },
    /// Call the planner, with these examples (best first).
    Plan {
        /// The examples' entries.
        examples: Vec<(MemoryMatch, MemoryEntry)>,
        /// What to record.
        used: MemoryUse,
    },
}

/// Decides for `query` of run `run` in `session` from `entries` (newest first). `validate`
/// checks a remembered plan as any submitted plan is checked. Pure.
pub fn decide(
    run: RunId,
    query: &str,
    session: Option<SessionId>,
    entries: &[MemoryEntry],
    opts: &MemoryOptions,
    validate: impl Fn(&Plan) -> Result<(Plan, Vec<Problem>), Vec<Problem>>,
) -> Advice {
    let words = word_counts(query);
    let mut matches: Vec<(usize, MemoryMatch)> = entries
        .iter()
        .enumerate()
        .filter(|(_, e)| e.outcome == flotilla_model::run::RunStatus::Succeeded)
        .filter_map(|(i, e)| {
            let confidence = similarity_of(&words, &word_counts(&e.query));
            (confidence > 0.0).then(|| {
                (
                    i,
                    MemoryMatch {
                        run_id: e.run_id,
                        confidence,
                        same_session: session.is_some() && e.session_id == session,
                    },
                )
            })
        })
        .collect();
    let reusable =
        |i: usize, m: &MemoryMatch| entries[i].reusable() && m.confidence >= opts.reuse_threshold;
    // Entries are newest first, so the index breaks ties towards the newest.
    matches.sort_by(|(i, a), (j, b)| {
        reusable(*j, b)
            .cmp(&reusable(*i, a))
            .then(b.same_session.cmp(&a.same_session))
            .then(b.confidence.total_cmp(&a.confidence))
            .then(i.cmp(j))
    });
    let mut used = MemoryUse {
        decision: MemoryDecision::Planner,
        reason: MemoryReason::NoMatch,
        measure: SIMILARITY_MEASURE.to_owned(),
        threshold: opts.reuse_threshold,
        source_run: None,
        confidence: None,
        examples: Vec::new(),
        problems: Vec::new(),
        scanned: u32::try_from(entries.len()).unwrap_or(u32::MAX),
        detail: None,
    };
    let examples: Vec<(MemoryMatch, MemoryEntry)> = matches
        .iter()
        .take(opts.examples)
        .map(|(i, m)| (m.clone(), entries[*i].clone()))
        .collect();
    let planner = |mut used: MemoryUse, reason| {
        used.reason = reason;
        used.examples = examples.iter().map(|(m, _)| m.clone()).collect();
        Advice::Plan {
            examples: examples.clone(),
            used,
        }
    };
    let Some((best_i, best)) = matches.first() else {
        return planner(used, MemoryReason::NoMatch);
    };
    used.confidence = Some(best.confidence);
    if !reusable(*best_i, best) {
        return planner(used, MemoryReason::BelowThreshold);
    }
    used.source_run = Some(best.run_id);
    if explores(run, opts.explore_percent) {
        return planner(used, MemoryReason::Explore);
    }
    let plan = entries[*best_i].to_plan(query, crate::planner::short_name(query));
    match validate(&plan) {
        Ok((plan, warnings)) => {
            used.decision = MemoryDecision::Reused;
            used.reason = MemoryReason::AboveThreshold;
            Advice::Reuse {
                plan: Box::new(plan),
                warnings,
                used,
            }
        }
        Err(problems) => {
            used.problems = truncate_problems(problems, MAX_REPORTED_PROBLEMS);
            planner(used, MemoryReason::InvalidPlan)
        }
    }
}

/// The examples as the planner's input shows them.
pub fn examples_input(examples: &[(MemoryMatch, MemoryEntry)]) -> Value {
    Value::Array(
        examples
            .iter()
            .map(|(m, e)| {
                json!({
                    "query": e.query,
                    "confidence": m.confidence,
                    "plan": {"subtasks": e.plan.subtasks},
                })
            })
            .collect(),
    )
}

/// Added to the planner's description when it is given examples.
pub const EXAMPLES_INSTRUCTION: &str = "The input's `examples` are plans of similar past queries that succeeded, with how alike each query is to this one (`confidence`, 0 to 1): follow them where they fit this query.";

/// The coordinator's view of the memory bucket (public for the bench and tests, which time
/// the lookup a bare query pays).
#[derive(Debug, Clone)]
pub struct Memory {
    bus: Bus,
    opts: MemoryOptions,
}

impl Memory {
    pub fn new(bus: Bus, opts: MemoryOptions) -> Self {
        Self { bus, opts }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.opts.enabled
    }

    /// The newest entries (at most `scan-limit`), newest first.
    pub async fn newest(&self) -> Result<Vec<MemoryEntry>, flotilla_bus::ReadError> {
        let stored = self
            .bus
            .kv_newest(Bucket::Memory, KEY_PREFIX, self.opts.scan_limit)
            .await?;
        Ok(stored
            .iter()
            .filter_map(|m| serde_json::from_slice::<MemoryEntry>(&m.payload).ok())
            .collect())
    }

    /// What memory advises for `query` of run `run`: read, then [`decide`]. An unreadable
    /// bucket advises the planner (`unavailable`), never fails the submission.
    pub(crate) async fn advise(
        &self,
        run: RunId,
        query: &str,
        session: Option<SessionId>,
        ctx: &ValidationContext,
        max_plan_bytes: usize,
    ) -> Advice {
        let entries = match self.newest().await {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(%run, error = %e, "Cannot read memory; planning without it");
                let used = MemoryUse {
                    decision: MemoryDecision::Planner,
                    reason: MemoryReason::Unavailable,
                    measure: SIMILARITY_MEASURE.to_owned(),
                    threshold: self.opts.reuse_threshold,
                    source_run: None,
                    confidence: None,
                    examples: Vec::new(),
                    problems: Vec::new(),
                    scanned: 0,
                    detail: Some(e.to_string()),
                };
                return Advice::Plan {
                    examples: Vec::new(),
                    used,
                };
            }
        };
        decide(run, query, session, &entries, &self.opts, |plan| {
            let mut problems: Vec<Problem> =
                check_plan_size(plan, max_plan_bytes).into_iter().collect();
            match prepare_plan(plan, ctx) {
                Ok(p) if problems.is_empty() => Ok(p),
                Ok(_) => Err(problems),
                Err(report) => {
                    problems.extend(report.errors);
                    Err(problems)
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_model::memory::{MemoryPlan, MemoryTeam, QuerySource};
    use flotilla_model::plan::Subtask;
    use flotilla_model::run::RunStatus;
    use flotilla_model::time::Timestamp;

    fn entry(query: &str, outcome: RunStatus, session: Option<SessionId>) -> MemoryEntry {
        let mut plan = Plan::empty();
        plan.subtasks
            .push(Subtask::new("research", "Find the facts."));
        plan.subtasks
            .push(Subtask::new("report", "Write it.").after(&["research"]));
        let (shape, team): (MemoryPlan, MemoryTeam) = MemoryEntry::shape_of(&plan);
        MemoryEntry {
            run_id: RunId::new(),
            session_id: session,
            query: query.into(),
            query_source: QuerySource::Query,
            name: None,
            plan: shape,
            team,
            outcome,
            cause: None,
            duration_ms: 10,
            tokens: None,
            cost_usd: None,
            created_at: Timestamp::from_unix_ms(0),
            finished_at: Timestamp::from_unix_ms(10),
            recorded_at: Timestamp::from_unix_ms(11),
            reused_from: None,
            truncated: false,
        }
    }

    fn opts(explore: u8) -> MemoryOptions {
        MemoryOptions {
            explore_percent: explore,
            ..MemoryOptions::default()
        }
    }

    fn valid(p: &Plan) -> Result<(Plan, Vec<Problem>), Vec<Problem>> {
        Ok((p.clone(), Vec::new()))
    }

    const Q: &str = "Summarise the quarterly revenue report for ACME";

    #[test]
    fn an_identical_successful_query_is_reused() {
        let old = entry(Q, RunStatus::Succeeded, None);
        let a = decide(
            RunId::new(),
            Q,
            None,
            std::slice::from_ref(&old),
            &opts(0),
            valid,
        );
        let Advice::Reuse { plan, used, .. } = a else {
            panic!("{a:?}")
        };
        assert_eq!(used.decision, MemoryDecision::Reused);
        assert_eq!(used.reason, MemoryReason::AboveThreshold);
        assert_eq!(used.source_run, Some(old.run_id));
        assert_eq!(used.confidence, Some(1.0));
        assert_eq!(used.measure, SIMILARITY_MEASURE);
        assert_eq!(plan.query.as_deref(), Some(Q));
        assert_eq!(plan.subtasks.len(), 2);
    }

    #[test]
    fn failed_dissimilar_and_truncated_runs_are_not_reused() {
        let failed = entry(Q, RunStatus::Failed, None);
        let a = decide(RunId::new(), Q, None, &[failed], &opts(0), valid);
        assert!(
            matches!(&a, Advice::Plan { used, examples } if used.reason == MemoryReason::NoMatch && examples.is_empty()),
            "{a:?}"
        );
        let other = entry("Write a poem about autumn", RunStatus::Succeeded, None);
        let near = entry(
            "quarterly revenue of Globex and Initech compared",
            RunStatus::Succeeded,
            None,
        );
        let a = decide(
            RunId::new(),
            Q,
            None,
            &[other, near.clone()],
            &opts(0),
            valid,
        );
        let Advice::Plan { used, examples } = a else {
            panic!("{a:?}")
        };
        assert_eq!(used.reason, MemoryReason::BelowThreshold);
        assert_eq!(examples.len(), 1, "only the one sharing words");
        assert_eq!(examples[0].0.run_id, near.run_id);
        let mut cut = entry(Q, RunStatus::Succeeded, None);
        cut.truncated = true;
        let a = decide(RunId::new(), Q, None, &[cut], &opts(0), valid);
        assert!(
            matches!(&a, Advice::Plan { used, .. } if used.reason == MemoryReason::BelowThreshold),
            "{a:?}"
        );
    }

    #[test]
    fn exploring_runs_call_the_planner_with_the_match() {
        let old = entry(Q, RunStatus::Succeeded, None);
        let a = decide(
            RunId::new(),
            Q,
            None,
            std::slice::from_ref(&old),
            &opts(100),
            valid,
        );
        let Advice::Plan { used, examples } = a else {
            panic!("{a:?}")
        };
        assert_eq!(used.reason, MemoryReason::Explore);
        assert_eq!(used.source_run, Some(old.run_id));
        assert_eq!(examples.len(), 1);
    }

    #[test]
    fn an_invalid_remembered_plan_falls_back_with_its_problems() {
        let old = entry(Q, RunStatus::Succeeded, None);
        let a = decide(RunId::new(), Q, None, &[old], &opts(0), |_| {
            Err(vec![Problem::new(
                flotilla_model::validate::ProblemCode::UnknownAgent,
                "subtasks[0].agent",
                "gone",
            )])
        });
        let Advice::Plan { used, .. } = a else {
            panic!("{a:?}")
        };
        assert_eq!(used.reason, MemoryReason::InvalidPlan);
        assert_eq!(used.problems.len(), 1);
    }

    #[test]
    fn the_sessions_own_match_ranks_first_then_confidence_then_newest() {
        let s = SessionId::new();
        let elsewhere = entry(Q, RunStatus::Succeeded, None);
        let mine = entry(Q, RunStatus::Succeeded, Some(s));
        let a = decide(
            RunId::new(),
            Q,
            Some(s),
            &[elsewhere.clone(), mine.clone()],
            &opts(0),
            valid,
        );
        let Advice::Reuse { used, .. } = a else {
            panic!("{a:?}")
        };
        assert_eq!(used.source_run, Some(mine.run_id));
        // Without a session, the newest of equals (entries come newest first).
        let a = decide(
            RunId::new(),
            Q,
            None,
            &[elsewhere.clone(), mine],
            &opts(0),
            valid,
        );
        let Advice::Reuse { used, .. } = a else {
            panic!("{a:?}")
        };
        assert_eq!(used.source_run, Some(elsewhere.run_id));
    }
}
