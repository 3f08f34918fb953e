//! Supervisor memory: what finished runs did, kept so that later bare queries can reuse a
//! decomposition that worked (issue 18 §8, DESIGN §9).
//!
//! The supervisor records every finished **root** run (succeeded, failed or cancelled; a
//! child run of a tree is not an entry) once, in the KV bucket `<prefix>-memory` under
//! `run.<run_id>` ([`memory_key`]), written with create-if-absent so a redelivered event or a
//! second supervisor replica never records it twice. An entry ([`MemoryEntry`]) holds the
//! query, the plan's shape, the team, the outcome, the duration, the tokens and cost spent
//! (when the run had a budget entry) and the session; it is bounded ([`MAX_ENTRY_BYTES`]):
//! long texts are cut and `truncated` says so.
//!
//! For a bare query the coordinator scores past entries with [`similarity`] — a pure,
//! deterministic lexical measure ([`SIMILARITY_MEASURE`]) — and records what it decided on the
//! run ([`MemoryUse`]): the past plan reused without a planner call, or the planner called
//! with the best matches as examples. The API (`memory.list|get|forget`) is answered by the
//! supervisor.

use std::collections::{BTreeMap, BTreeSet};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::{RunId, SessionId, TaskId};
use crate::plan::{Plan, PlanConfig, Strategy, Subtask};
use crate::run::{EndCause, RunStatus};
use crate::time::Timestamp;

mod decision;
pub use decision::{MemoryDecision, MemoryMatch, MemoryReason, MemoryUse, SIMILARITY_MEASURE};

/// Key prefix of run entries in the memory bucket.
pub const KEY_PREFIX: &str = "run.";

/// The key of a run's entry: `run.<run_id>`.
pub fn memory_key(run: RunId) -> String {
    format!("{KEY_PREFIX}{run}")
}

/// Longest query kept, in characters (longer ones are cut, `truncated` set).
pub const MAX_QUERY_CHARS: usize = 2000;
/// Longest subtask description kept, in characters.
pub const MAX_DESCRIPTION_CHARS: usize = 1000;
/// Most subtasks kept in an entry's plan shape.
pub const MAX_SUBTASKS: usize = 64;
/// Largest encoded entry, in bytes: descriptions are cut further until it fits.
pub const MAX_ENTRY_BYTES: usize = 32 * 1024;

/// Where an entry's `query` came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum QuerySource {
    /// The run was a bare query: its text.
    Query,
    /// The run was submitted as a plan: its `query` if it had one, else its name and its
    /// subtasks' descriptions.
    Plan,
}

fn default_pool() -> String {
    crate::plan::DEFAULT_POOL.to_owned()
}

/// One subtask of a remembered plan: its shape, not its inputs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct MemorySubtask {
    /// The subtask's id.
    pub id: TaskId,
    /// Its role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// Its agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// Its pool.
    #[serde(default = "default_pool")]
    pub pool: String,
    /// What it does (cut to [`MAX_DESCRIPTION_CHARS`]).
    #[serde(default)]
    pub description: String,
    /// Subtasks it waits for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dependencies: Vec<TaskId>,
    /// Workspace topics it writes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub produces: Vec<String>,
    /// Workspace topics it reads.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub consumes: Vec<String>,
}

/// The shape of a remembered plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct MemoryPlan {
    /// The strategy the plan asked for (`auto` when it left the choice to the run).
    pub strategy: Strategy,
    /// The strategy the run was scheduled with, when it got that far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chosen: Option<Strategy>,
    /// The subtasks (at most [`MAX_SUBTASKS`]; empty when planning failed).
    #[serde(default)]
    pub subtasks: Vec<MemorySubtask>,
}

/// The members a run used.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct MemoryTeam {
    /// Agents the plan named.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub agents: Vec<String>,
    /// Roles the plan named.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub roles: Vec<String>,
}

/// A remembered run (`run.<run_id>` in `<prefix>-memory`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MemoryEntry {
    /// The run.
    pub run_id: RunId,
    /// Its session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<SessionId>,
    /// The query (cut to [`MAX_QUERY_CHARS`]).
    pub query: String,
    /// Where `query` came from.
    pub query_source: QuerySource,
    /// The run's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The plan's shape.
    pub plan: MemoryPlan,
    /// The members it used.
    #[serde(default)]
    pub team: MemoryTeam,
    /// How it ended: `succeeded`, `failed` or `cancelled`.
    pub outcome: RunStatus,
    /// Why it did not succeed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<EndCause>,
    /// From acceptance to its end, in milliseconds.
    pub duration_ms: u64,
    /// Tokens spent, as recorded on the run's budget entry (absent: the run kept none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// US dollars spent, as recorded on the run's budget entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
    /// When the run was accepted.
    pub created_at: Timestamp,
    /// When it ended.
    pub finished_at: Timestamp,
    /// When the entry was written.
    pub recorded_at: Timestamp,
    /// The run whose remembered plan this run reused, if it reused one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reused_from: Option<RunId>,
    /// Something was cut to keep the entry bounded (the query, descriptions, subtasks). A
    /// truncated plan is never reused as it stands; it can still be an example.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

fn cut(s: &mut String, max_chars: usize) -> bool {
    match s.char_indices().nth(max_chars) {
        Some((at, _)) => {
            s.truncate(at);
            s.push('…');
            true
        }
        None => false,
    }
}

impl MemoryEntry {
    /// Cuts the entry to the limits (query, descriptions, subtasks, then the encoded size),
    /// setting `truncated` when anything was cut.
    pub fn bound(&mut self) {
        let mut cut_any = cut(&mut self.query, MAX_QUERY_CHARS);
        if self.plan.subtasks.len() > MAX_SUBTASKS {
            self.plan.subtasks.truncate(MAX_SUBTASKS);
            cut_any = true;
        }
        for t in &mut self.plan.subtasks {
            cut_any |= cut(&mut t.description, MAX_DESCRIPTION_CHARS);
        }
        let mut limit = MAX_DESCRIPTION_CHARS;
        while serde_json::to_vec(self).map_or(0, |v| v.len()) > MAX_ENTRY_BYTES && limit > 16 {
            limit /= 2;
            for t in &mut self.plan.subtasks {
                cut_any |= cut(&mut t.description, limit);
            }
            cut_any |= cut(&mut self.query, limit.max(200));
        }
        self.truncated |= cut_any;
    }

    /// Whether the entry's plan may be reused: the run succeeded, had a plan, and nothing of
    /// it was cut.
    pub fn reusable(&self) -> bool {
        self.outcome == RunStatus::Succeeded && !self.truncated && !self.plan.subtasks.is_empty()
    }

    /// The remembered plan as a plan for `query` (to be validated like any plan).
    pub fn to_plan(&self, query: &str, name: String) -> Plan {
        Plan {
            name: Some(name),
            query: Some(query.to_owned()),
            subtasks: self
                .plan
                .subtasks
                .iter()
                .map(|t| {
                    let mut s = Subtask::new(t.id.as_str(), &t.description);
                    s.role = t.role.clone();
                    s.agent = t.agent.clone();
                    s.pool = t.pool.clone();
                    s.dependencies = t.dependencies.clone();
                    s.produces = t.produces.clone();
                    s.consumes = t.consumes.clone();
                    s
                })
                .collect(),
            config: PlanConfig {
                strategy: self.plan.strategy,
                ..PlanConfig::default()
            },
            fork: None,
        }
    }

    /// The plan's shape of `plan` with the team it names.
    pub fn shape_of(plan: &Plan) -> (MemoryPlan, MemoryTeam) {
        let subtasks: Vec<MemorySubtask> = plan
            .subtasks
            .iter()
            .map(|t| MemorySubtask {
                id: t.id.clone(),
                role: t.role.clone(),
                agent: t.agent.clone(),
                pool: t.pool.clone(),
                description: t.description.clone(),
                dependencies: t.dependencies.clone(),
                produces: t.produces.clone(),
                consumes: t.consumes.clone(),
            })
            .collect();
        let agents: BTreeSet<String> = plan
            .subtasks
            .iter()
            .filter_map(|t| t.agent.clone())
            .collect();
        let roles: BTreeSet<String> = plan
            .subtasks
            .iter()
            .filter_map(|t| t.role.clone())
            .collect();
        (
            MemoryPlan {
                strategy: plan.config.strategy,
                chosen: None,
                subtasks,
            },
            MemoryTeam {
                agents: agents.into_iter().collect(),
                roles: roles.into_iter().collect(),
            },
        )
    }

    /// The text a plan submission is remembered (and matched) by: its `query`, else its name
    /// and its subtasks' descriptions.
    pub fn plan_text(plan: &Plan) -> String {
        if let Some(q) = &plan.query {
            return q.clone();
        }
        let mut parts: Vec<&str> = plan.name.iter().map(String::as_str).collect();
        parts.extend(plan.subtasks.iter().map(|t| t.description.as_str()));
        parts.join("\n")
    }
}

/// Words that say nothing about what a query asks (left out of [`similarity`]).
const STOP_WORDS: &[&str] = &[
    "a", "about", "an", "and", "are", "as", "at", "be", "by", "can", "could", "do", "does", "for",
    "from", "has", "have", "how", "i", "in", "into", "is", "it", "its", "me", "my", "of", "on",
    "or", "our", "please", "should", "so", "that", "the", "their", "them", "then", "there",
    "these", "this", "to", "us", "was", "we", "were", "what", "when", "where", "which", "who",
    "why", "will", "with", "would", "you", "your",
];

/// The word counts of `text`: lowercased runs of letters and digits, stop words left out.
pub fn word_counts(text: &str) -> BTreeMap<String, u32> {
    let mut counts = BTreeMap::new();
    for word in text
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
    {
        let w = word.to_lowercase();
        if STOP_WORDS.binary_search(&w.as_str()).is_ok() {
            continue;
        }
        *counts.entry(w).or_insert(0) += 1;
    }
    counts
}

/// How alike two texts are, in [0, 1] ([`SIMILARITY_MEASURE`]): the cosine of their word
/// count vectors ([`word_counts`]: lowercased words, stop words removed), rounded to three
/// decimals. 1 for the same words in any order and case, 0 when they share no word (or
/// either has none). Pure and deterministic: a replay, another coordinator or another
/// language computes the same value.
pub fn similarity(a: &str, b: &str) -> f64 {
    similarity_of(&word_counts(a), &word_counts(b))
}

/// [`similarity`] of texts already counted (a lookup counts the query once).
pub fn similarity_of(a: &BTreeMap<String, u32>, b: &BTreeMap<String, u32>) -> f64 {
    if a.is_empty() || b.is_empty() {
        return 0.0;
    }
    let dot: f64 = a
        .iter()
        .filter_map(|(w, n)| b.get(w).map(|m| f64::from(*n) * f64::from(*m)))
        .sum();
    let norm = |v: &BTreeMap<String, u32>| {
        v.values()
            .map(|n| f64::from(*n) * f64::from(*n))
            .sum::<f64>()
            .sqrt()
    };
    let cos = dot / (norm(a) * norm(b));
    ((cos * 1000.0).round() / 1000.0).clamp(0.0, 1.0)
}

/// Whether run `run` explores (calls the planner even above the threshold): a hash of its id
/// (FNV-1a over its 16 bytes) mod 100 is below `percent`. Deterministic per run.
pub fn explores(run: RunId, percent: u8) -> bool {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in run.as_uuid().as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h % 100 < u64::from(percent)
}

/// `memory.list`: remembered runs, newest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MemoryListRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// Only runs of this session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<SessionId>,
    /// Most entries listed (default 100, at most 1,000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

/// One remembered run in a list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MemorySummary {
    /// The run.
    pub run_id: RunId,
    /// Its session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<SessionId>,
    /// The query (cut to 200 characters).
    pub query: String,
    /// How it ended.
    pub outcome: RunStatus,
    /// Subtasks in its plan.
    pub subtasks: u32,
    /// Duration in milliseconds.
    pub duration_ms: u64,
    /// When it ended.
    pub finished_at: Timestamp,
    /// The run whose plan it reused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reused_from: Option<RunId>,
}

impl MemorySummary {
    /// The summary of an entry.
    pub fn of(e: &MemoryEntry) -> Self {
        let mut query = e.query.clone();
        cut(&mut query, 200);
        Self {
            run_id: e.run_id,
            session_id: e.session_id,
            query,
            outcome: e.outcome,
            subtasks: e.plan.subtasks.len() as u32,
            duration_ms: e.duration_ms,
            finished_at: e.finished_at,
            reused_from: e.reused_from,
        }
    }
}

/// The answer of `memory.list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MemoryList {
    /// The entries, newest first.
    pub entries: Vec<MemorySummary>,
    /// Entries read to answer (the newest stored, at most the scan limit).
    pub scanned: u32,
}

/// `memory.get`: one remembered run (`404 not_found` when it has no entry).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MemoryGetRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
}

/// `memory.forget`: delete a run's entry (`404 not_found` when it has none).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MemoryForgetRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run.
    pub run_id: RunId,
}

/// The answer of `memory.forget`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct MemoryForgotten {
    /// The run whose entry was deleted.
    pub run_id: RunId,
}

impl crate::api::ApiRequest for MemoryListRequest {
    const ENDPOINT: &'static str = "memory.list";
    type Reply = MemoryList;
}

impl crate::api::ApiRequest for MemoryGetRequest {
    const ENDPOINT: &'static str = "memory.get";
    type Reply = MemoryEntry;
}

impl crate::api::ApiRequest for MemoryForgetRequest {
    const ENDPOINT: &'static str = "memory.forget";
    type Reply = MemoryForgotten;
}

crate::api::has_protocol!(MemoryListRequest, MemoryGetRequest, MemoryForgetRequest);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_words_are_sorted_for_the_binary_search() {
        let mut sorted = STOP_WORDS.to_vec();
        sorted.sort_unstable();
        assert_eq!(sorted, STOP_WORDS);
    }

    #[test]
    fn the_same_words_in_any_case_and_order_are_identical() {
        assert_eq!(
            similarity("How did revenue develop?", "revenue DEVELOP, how did"),
            1.0
        );
        assert_eq!(similarity("the of a", "revenue"), 0.0);
        assert_eq!(similarity("", ""), 0.0);
        assert_eq!(similarity("revenue", "weather"), 0.0);
    }

    #[test]
    fn similar_queries_score_high_and_dissimilar_low() {
        let a = "Summarise the quarterly revenue report for ACME";
        let b = "Summarise the quarterly revenue report for Globex";
        let c = "Write a poem about autumn leaves";
        let ab = similarity(a, b);
        assert!((0.7..1.0).contains(&ab), "{ab}");
        assert_eq!(ab, similarity(b, a), "symmetric");
        assert_eq!(similarity(a, c), 0.0);
        // Counted words: a repeated word weighs more.
        assert!(similarity("tax tax tax law", "tax") > similarity("tax law law law", "tax"));
    }

    #[test]
    fn exploring_is_deterministic_and_proportional() {
        let runs: Vec<RunId> = (0..2000).map(|_| RunId::new()).collect();
        let n = runs.iter().filter(|r| explores(**r, 10)).count();
        assert!((100..300).contains(&n), "{n} of 2000 explore at 10%");
        assert!(runs.iter().all(|r| explores(*r, 10) == explores(*r, 10)));
        assert!(runs.iter().all(|r| !explores(*r, 0) && explores(*r, 100)));
    }

    fn entry(descriptions: &[&str]) -> MemoryEntry {
        let mut plan = Plan::empty();
        for (i, d) in descriptions.iter().enumerate() {
            plan.subtasks.push(Subtask::new(&format!("t{i}"), d));
        }
        let (shape, team) = MemoryEntry::shape_of(&plan);
        MemoryEntry {
            run_id: RunId::new(),
            session_id: None,
            query: "q".into(),
            query_source: QuerySource::Query,
            name: None,
            plan: shape,
            team,
            outcome: RunStatus::Succeeded,
            cause: None,
            duration_ms: 1,
            tokens: None,
            cost_usd: None,
            created_at: Timestamp::from_unix_ms(0),
            finished_at: Timestamp::from_unix_ms(1),
            recorded_at: Timestamp::from_unix_ms(2),
            reused_from: None,
            truncated: false,
        }
    }

    #[test]
    fn entries_are_bounded_and_say_so() {
        let mut small = entry(&["one", "two"]);
        small.bound();
        assert!(!small.truncated && small.reusable());
        let long = "x".repeat(5000);
        let many: Vec<&str> = (0..100).map(|_| long.as_str()).collect();
        let mut big = entry(&many);
        big.bound();
        assert!(big.truncated && !big.reusable());
        assert_eq!(big.plan.subtasks.len(), MAX_SUBTASKS);
        assert!(
            serde_json::to_vec(&big)
                .map(|v| v.len())
                .unwrap_or(usize::MAX)
                <= MAX_ENTRY_BYTES
        );
        let mut failed = entry(&["one"]);
        failed.outcome = RunStatus::Failed;
        assert!(!failed.reusable());
    }

    #[test]
    fn a_remembered_plan_becomes_a_plan_for_the_new_query() {
        let e = entry(&["research", "write"]);
        let p = e.to_plan("new query", "new".into());
        assert_eq!(p.query.as_deref(), Some("new query"));
        assert_eq!(p.subtasks.len(), 2);
        assert_eq!(p.subtasks[1].description, "write");
    }
}
