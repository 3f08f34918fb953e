//! The soak's report, computed from what was recorded — pure arithmetic over the ledger, the
//! samples and the chaos log, so it is unit-tested on synthetic input — and rendered as
//! markdown (`--report FILE`, and stdout) or JSON (`--json`).
//!
//! Definitions:
//!
//! * **submitted**: root runs whose submission JetStream acknowledged. **Lost**: submitted,
//!   and by the end of the drain neither a run-terminal event stored nor a terminal status in
//!   the run's record. A run whose record is terminal without its end event is listed apart
//!   (*ended without an end event*). A teammate message `team.send` confirmed and never
//!   received in the teammate's conversation is lost too.
//! * **Applied twice**, any of: a run with two run-terminal events of different ids (the
//!   machine ended it twice; a repeat of one id is a re-published step, which followers drop
//!   by id); a task with two `task_succeeded` events of different ids; a task with succeeded
//!   results of two different attempts (attempt ids) on its run log; an exec side effect
//!   executed by two different attempts that both stored a succeeded result; a teammate
//!   message received twice in its conversation. Listed for information, not counted: a
//!   succeeded result of one attempt stored twice (the machine drops the second), and a side
//!   effect executed again by the same attempt (a redelivery after its worker was killed:
//!   at-least-once execution).
//! * **Approvals decided once**: each approval requested has exactly one `approval_decided`
//!   event (distinct ids); of two answers sent at once, exactly one was told `decided`.
//! * **RSS growth**: per service, a least-squares line through its resident-memory samples
//!   after each incarnation's warm-up (`--rss-warm-up` after its start), one slope shared by
//!   all incarnations and an intercept per incarnation (the *within* estimator): a restarted
//!   process starts from its own baseline, and only growth inside a process counts. Only
//!   incarnations that lived at least `--rss-min-span` past their warm-up are fitted: over a
//!   few minutes an allocator's steps read as tens of MiB per hour (measured: ±10–17 MiB/h
//!   on 10-minute fits of one build), so a soak that restarts each service every quarter hour
//!   reports its memory and judges none of it, and the soak without stops judges it. The
//!   slope over every incarnation is told beside it.
//!   The target judges *sustained* growth: the same slope fitted together with level
//!   shifts, one per `--rss-min-span` of an incarnation's judged life, each placed where it
//!   explains the samples best ([`sustained_slope`], [`steps_allowed`]). A leak is a slope
//!   whatever steps are fitted beside it; an allocator's one-time step (a new arena, a page
//!   cache kept) is taken up by a step. Steps still count against the whole-run slope,
//!   which must stay under three times the target: a step or two is allowed, a staircase
//!   is not.
//! * **Latency**: a root run's submission (the bench's clock, just before the acknowledged
//!   publish) → its end event stored (the server's clock; same host), p50 and p99 per
//!   `--window` of submission time, over the *plain* scenarios (no person, pause or lead).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;

use flotilla_model::event::WorkflowPhase;
use flotilla_model::ids::RunId;
use flotilla_model::run::RunStatus;
use serde::Serialize;

use super::chaos::{ChaosEvent, UnexpectedExit};
use super::consumers::StuckEpisode;
use super::deployment::Kind;
use super::ledger::Ledger;
use super::scenario::Scenario;
use crate::harness::stats::percentile;

/// One execution of an exec agent's side effect (a line of the effects file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Effect {
    pub(crate) run: String,
    pub(crate) task: String,
    pub(crate) attempt: u32,
    pub(crate) attempt_id: String,
}

/// Parses the effects file: `run task attempt attempt_id delivery` per line; a line that
/// does not parse (one cut by a crash mid-write) is skipped and counted.
pub(crate) fn parse_effects(text: &str) -> (Vec<Effect>, usize) {
    let mut out = Vec::new();
    let mut bad = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        match (
            f.first(),
            f.get(1),
            f.get(2).and_then(|a| a.parse().ok()),
            f.get(3),
        ) {
            (Some(run), Some(task), Some(attempt), Some(id)) if f.len() == 5 => out.push(Effect {
                run: (*run).into(),
                task: (*task).into(),
                attempt,
                attempt_id: (*id).into(),
            }),
            _ => bad += 1,
        }
    }
    (out, bad)
}

/// One resident-memory reading of a service.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct RssSample {
    /// Index of the service in [`Inputs::services`].
    pub(crate) service: usize,
    pub(crate) incarnation: u32,
    /// When the incarnation started (unix ms).
    pub(crate) started_ms: i64,
    pub(crate) at_ms: i64,
    pub(crate) kib: u64,
}

/// What one teammate's conversation showed at the end.
#[derive(Debug, Clone)]
pub(crate) struct TeammateCheck {
    pub(crate) name: String,
    /// Times each confirmed message was received (in the order sent).
    pub(crate) received: Vec<usize>,
}

/// The soak's settings, as the report states them.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Settings {
    pub(crate) minutes: f64,
    pub(crate) build: String,
    pub(crate) every_ms: u64,
    pub(crate) max_in_flight: usize,
    pub(crate) chaos_every_s: f64,
    pub(crate) down_for_s: f64,
    pub(crate) window_s: f64,
    pub(crate) rss_warm_up_s: f64,
    pub(crate) stuck_after_s: f64,
    pub(crate) drain_s: f64,
    pub(crate) rss_slope_target: f64,
    /// Least fitted span (summed over incarnations) for a slope to be judged, seconds.
    pub(crate) rss_min_span_s: f64,
    pub(crate) worker_concurrency: usize,
    pub(crate) started_ms: i64,
    /// When the workload and the chaos stopped (the drain began).
    pub(crate) workload_end_ms: i64,
    /// When the drain ended.
    pub(crate) end_ms: i64,
    pub(crate) nats_server: String,
}

/// A service, as the report names it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Service {
    pub(crate) name: String,
    /// Absent for the nats-server (no target: its memory holds the streams' caches).
    pub(crate) kind: Option<Kind>,
}

/// How the durable consumers were sampled.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct ConsumerSampling {
    pub(crate) rounds: u64,
    pub(crate) failed_rounds: u64,
    /// `STREAM_SUFFIX/name` of each durable consumer seen.
    pub(crate) consumers: Vec<String>,
}

/// Everything the report is computed from.
#[derive(Debug)]
pub(crate) struct Inputs<'a> {
    pub(crate) settings: Settings,
    pub(crate) ledger: &'a Ledger,
    pub(crate) effects: &'a [Effect],
    pub(crate) effects_unparsed: usize,
    /// For submitted runs without a stored end: the record's status at the end (absent: no
    /// record).
    pub(crate) records: &'a HashMap<RunId, Option<RunStatus>>,
    pub(crate) teammates: &'a [TeammateCheck],
    pub(crate) services: &'a [Service],
    pub(crate) rss: &'a [RssSample],
    pub(crate) chaos: &'a [ChaosEvent],
    pub(crate) exits: &'a [UnexpectedExit],
    pub(crate) stuck: &'a [StuckEpisode],
    pub(crate) sampling: ConsumerSampling,
    pub(crate) saturated_ticks: u64,
    pub(crate) peak_in_flight: u64,
    pub(crate) console_requests: u64,
    pub(crate) console_failures: u64,
}

/// A run named in the report.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RunNote {
    pub(crate) run: String,
    pub(crate) scenario: String,
    /// Minutes after the start it was submitted.
    pub(crate) submitted_min: f64,
    pub(crate) what: String,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct ScenarioRow {
    pub(crate) scenario: String,
    pub(crate) submitted: usize,
    pub(crate) ended: usize,
    pub(crate) succeeded: usize,
    pub(crate) lost: usize,
    pub(crate) p50_ms: Option<f64>,
    pub(crate) p99_ms: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Runs {
    pub(crate) submitted: usize,
    pub(crate) ended: usize,
    pub(crate) succeeded: usize,
    pub(crate) lost: Vec<RunNote>,
    pub(crate) ended_without_end_event: Vec<RunNote>,
    /// Ended otherwise than `succeeded` (every scenario's right outcome).
    pub(crate) other_outcome: Vec<RunNote>,
    pub(crate) by_scenario: Vec<ScenarioRow>,
    /// Runs the installation started that the bench did not submit (child runs, workflow
    /// steps), and how many of them ended.
    pub(crate) children: usize,
    pub(crate) children_ended: usize,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Twice {
    pub(crate) runs_ended_twice: Vec<String>,
    pub(crate) successes_applied_twice: Vec<String>,
    pub(crate) tasks_succeeded_by_two_attempts: Vec<String>,
    pub(crate) effects_of_two_successful_attempts: Vec<String>,
    pub(crate) teammate_messages_received_twice: Vec<String>,
    /// Not counted: one attempt's success stored twice on the run log.
    pub(crate) results_stored_twice: usize,
    /// Not counted: side effects executed again by the same attempt (redeliveries).
    pub(crate) effects_executed_again: usize,
    pub(crate) effects: usize,
    pub(crate) effects_unparsed: usize,
}

impl Twice {
    pub(crate) fn count(&self) -> usize {
        self.runs_ended_twice.len()
            + self.successes_applied_twice.len()
            + self.tasks_succeeded_by_two_attempts.len()
            + self.effects_of_two_successful_attempts.len()
            + self.teammate_messages_received_twice.len()
    }
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Approvals {
    pub(crate) requested: usize,
    pub(crate) decided_once: usize,
    pub(crate) never_decided: Vec<String>,
    pub(crate) decided_more_than_once: Vec<String>,
    /// Not counted: decisions stored twice on the run log (the machine applies the first).
    pub(crate) decision_inputs_stored_twice: usize,
    /// Approvals of `expire` runs, and those the deadline decided.
    pub(crate) to_expire: usize,
    pub(crate) expired: usize,
    pub(crate) conflicts: usize,
    pub(crate) conflicts_one_decided: usize,
    pub(crate) conflicts_both_decided: Vec<String>,
    pub(crate) conflicts_unanswered: usize,
}

impl Approvals {
    pub(crate) fn not_once(&self) -> usize {
        self.never_decided.len()
            + self.decided_more_than_once.len()
            + self.conflicts_both_decided.len()
    }
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Teammates {
    pub(crate) spawned: usize,
    pub(crate) messages: usize,
    pub(crate) received_once: usize,
    pub(crate) lost: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Window {
    pub(crate) from_min: f64,
    pub(crate) to_min: f64,
    pub(crate) submitted: usize,
    pub(crate) ended: usize,
    pub(crate) plain: usize,
    pub(crate) p50_ms: Option<f64>,
    pub(crate) p99_ms: Option<f64>,
    pub(crate) chaos: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Rss {
    pub(crate) service: String,
    pub(crate) incarnations: u32,
    /// Mean resident memory per window (MiB), absent where there was no sample.
    pub(crate) mean_mib: Vec<Option<f64>>,
    pub(crate) max_mib: Option<f64>,
    /// Samples the slope is fitted on (after the warm-up of each incarnation that lived at
    /// least `--rss-min-span` past it), and the time they span, summed over those
    /// incarnations (minutes).
    pub(crate) samples_fitted: usize,
    pub(crate) span_min: f64,
    /// Incarnations judged: those that lived at least `--rss-min-span` past their warm-up.
    pub(crate) judged_incarnations: u32,
    /// The longest incarnation's span past its warm-up (minutes).
    pub(crate) longest_min: f64,
    /// The slope over the judged incarnations.
    pub(crate) slope_mib_per_h: Option<f64>,
    /// The slope with level shifts taken out ([`sustained_slope`]), over the judged
    /// incarnations.
    pub(crate) sustained_mib_per_h: Option<f64>,
    /// The slope over every incarnation, however short: told, not judged.
    pub(crate) every_incarnation_mib_per_h: Option<f64>,
    /// Whether the target applies (not to the nats-server).
    pub(crate) targeted: bool,
}

/// One target and how the soak did.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Target {
    pub(crate) check: String,
    pub(crate) figure: String,
    pub(crate) target: String,
    /// `None`: no data to judge (an RSS slope without samples after the warm-up).
    pub(crate) pass: Option<bool>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Report {
    pub(crate) settings: Settings,
    pub(crate) targets: Vec<Target>,
    pub(crate) runs: Runs,
    pub(crate) twice: Twice,
    pub(crate) approvals: Approvals,
    pub(crate) teammates: Teammates,
    pub(crate) windows: Vec<Window>,
    pub(crate) rss: Vec<Rss>,
    pub(crate) stuck: Vec<StuckEpisode>,
    pub(crate) consumer_sampling: ConsumerSampling,
    pub(crate) chaos: Vec<ChaosEvent>,
    pub(crate) unexpected_exits: Vec<UnexpectedExit>,
    pub(crate) driver_errors: Vec<String>,
    pub(crate) saturated_ticks: u64,
    pub(crate) peak_in_flight: u64,
    pub(crate) console_requests: u64,
    pub(crate) console_failures: u64,
    pub(crate) messages_read: u64,
    pub(crate) undecodable: u64,
}

impl Report {
    /// Whether every target with data was met.
    pub(crate) fn passed(&self) -> bool {
        self.targets.iter().all(|t| t.pass != Some(false))
    }
}

/// The least-squares slope shared by every group (`(group, x, y)`), each with its own
/// intercept: Σ(x − x̄ᵍ)(y − ȳᵍ) / Σ(x − x̄ᵍ)². `None` without two distinct x in one group.
pub(crate) fn within_slope(points: &[(u32, f64, f64)]) -> Option<f64> {
    let mut groups: BTreeMap<u32, (f64, f64, f64)> = BTreeMap::new();
    for &(g, x, y) in points {
        let e = groups.entry(g).or_insert((0.0, 0.0, 0.0));
        e.0 += x;
        e.1 += y;
        e.2 += 1.0;
    }
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for &(g, x, y) in points {
        let (sx, sy, n) = groups[&g];
        let (dx, dy) = (x - sx / n, y - sy / n);
        sxy += dx * dy;
        sxx += dx * dx;
    }
    (sxx > 0.0).then(|| sxy / sxx)
}

/// The whole-run slope may be this many times the target: room for an allocator's step or
/// two in an hour, not for a staircase.
pub(crate) const RSS_STEP_ALLOWANCE: f64 = 3.0;

/// Least points on each side of a step [`sustained_slope`] considers (a minute of samples
/// at the default 5 s).
const STEP_SIDE: usize = 12;

/// How many level shifts [`sustained_slope`] may take out of an incarnation that lived
/// `span_min` minutes past its warm-up: one per `min_span_min` of life, and at least one.
/// An allocator keeps a new arena or a cached page run for good, and over an hour a
/// long-lived service took two such steps (+2.5 MiB at minute 22 and +8 MiB at minute 54,
/// flat between); a leak is a slope between steps, whatever their number, and the
/// whole-run cap bounds a staircase.
pub(crate) fn steps_allowed(span_min: f64, min_span_min: f64) -> usize {
    if min_span_min <= 0.0 {
        return 1;
    }
    // A millisecond's rounding of hours is not a shorter life.
    ((span_min + 1e-6) / min_span_min).floor().max(1.0) as usize
}

/// The growth that goes on through the run, told apart from level shifts: the
/// [`within_slope`] fitted together with up to `steps` steps — each a jump at one time
/// inside one incarnation — placed one after another where each explains the samples best
/// (least squares over every place at least [`STEP_SIDE`] points from either end of its
/// incarnation and from another step; a step is kept only if it lowers the residual). A
/// leak is a slope whatever steps are fitted beside it (the slope is then read between
/// them); an allocator's one-time step (a new arena, a page cache kept) is taken up by a
/// step and leaves the slope flat. `None` when [`within_slope`] is.
pub(crate) fn sustained_slope(points: &[(u32, f64, f64)], steps: usize) -> Option<f64> {
    let mut by_group: BTreeMap<u32, Vec<(f64, f64)>> = BTreeMap::new();
    for &(g, x, y) in points {
        by_group.entry(g).or_default().push((x, y));
    }
    // Per group, in time order: its size and the suffix sums of the centred x and y, from
    // which every product of the within-transformed columns follows in O(1).
    struct Group {
        n: usize,
        /// `sx[k]` = Σ_{i≥k} (xᵢ − x̄), `sy[k]` = Σ_{i≥k} (yᵢ − ȳ).
        sx: Vec<f64>,
        sy: Vec<f64>,
    }
    let (mut sxx, mut sxy, mut syy) = (0.0, 0.0, 0.0);
    let mut groups: Vec<Group> = Vec::new();
    for v in by_group.values_mut() {
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        let n = v.len();
        let mx = v.iter().map(|p| p.0).sum::<f64>() / n as f64;
        let my = v.iter().map(|p| p.1).sum::<f64>() / n as f64;
        let (mut sx, mut sy) = (vec![0.0; n + 1], vec![0.0; n + 1]);
        for i in (0..n).rev() {
            let (dx, dy) = (v[i].0 - mx, v[i].1 - my);
            sxx += dx * dx;
            sxy += dx * dy;
            syy += dy * dy;
            sx[i] = sx[i + 1] + dx;
            sy[i] = sy[i + 1] + dy;
        }
        groups.push(Group { n, sx, sy });
    }
    if sxx <= 0.0 {
        return None;
    }
    // A step at (group g, index k) is the column s = 1 for g's points from the k-th on,
    // within-transformed (minus its group mean (n − k)/n). Products with it:
    //   x̃·s̃ = sx[k], ỹ·s̃ = sy[k], s̃ₐ·s̃_b (one group, a ≤ b) = (n − b) − (n − a)(n − b)/n,
    //   and 0 across groups.
    let dot = |a: (usize, usize), b: (usize, usize)| -> f64 {
        if a.0 != b.0 {
            return 0.0;
        }
        let n = groups[a.0].n as f64;
        let (lo, hi) = (a.1.min(b.1) as f64, a.1.max(b.1) as f64);
        (n - hi) - (n - lo) * (n - hi) / n
    };
    // Least squares of ỹ on [x̃, s̃…]: the slope and the residual.
    let solve = |chosen: &[(usize, usize)]| -> Option<(f64, f64)> {
        let m = chosen.len() + 1;
        let mut a = vec![vec![0.0; m + 1]; m];
        a[0][0] = sxx;
        a[0][m] = sxy;
        for (j, &c) in chosen.iter().enumerate() {
            let sxc = groups[c.0].sx[c.1];
            a[0][j + 1] = sxc;
            a[j + 1][0] = sxc;
            a[j + 1][m] = groups[c.0].sy[c.1];
            for (l, &d) in chosen.iter().enumerate() {
                a[j + 1][l + 1] = dot(c, d);
            }
        }
        let rhs: Vec<f64> = a.iter().map(|r| r[m]).collect();
        let coef = gauss(a)?;
        let explained: f64 = coef.iter().zip(&rhs).map(|(c, g)| c * g).sum();
        Some((coef[0], syy - explained))
    };
    let (mut slope, mut residual) = (sxy / sxx, syy - sxy * sxy / sxx);
    let mut chosen: Vec<(usize, usize)> = Vec::new();
    for _ in 0..steps {
        let mut best: Option<(f64, f64, (usize, usize))> = None;
        for (g, group) in groups.iter().enumerate() {
            if group.n < 2 * STEP_SIDE {
                continue;
            }
            for k in STEP_SIDE..=group.n - STEP_SIDE {
                let near = chosen
                    .iter()
                    .any(|&(cg, ck)| cg == g && ck.abs_diff(k) < STEP_SIDE);
                if near {
                    continue;
                }
                let mut with = chosen.clone();
                with.push((g, k));
                let Some((b, r)) = solve(&with) else { continue };
                if best.is_none_or(|(_, br, _)| r < br) {
                    best = Some((b, r, (g, k)));
                }
            }
        }
        match best {
            Some((b, r, at)) if r < residual => {
                (slope, residual) = (b, r);
                chosen.push(at);
            }
            _ => break,
        }
    }
    Some(slope)
}

/// Solves the square system whose rows are `[coefficients…, right-hand side]` by Gaussian
/// elimination with partial pivoting; `None` if it is singular.
fn gauss(mut a: Vec<Vec<f64>>) -> Option<Vec<f64>> {
    let m = a.len();
    let scale = a
        .iter()
        .flat_map(|r| r[..m].iter())
        .fold(0.0f64, |s, v| s.max(v.abs()));
    for col in 0..m {
        let pivot = (col..m).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() <= 1e-12 * scale {
            return None;
        }
        a.swap(col, pivot);
        let (top, rest) = a.split_at_mut(col + 1);
        let pivot_row = &top[col];
        for row in rest.iter_mut() {
            let f = row[col] / pivot_row[col];
            for (v, p) in row.iter_mut().zip(pivot_row).skip(col) {
                *v -= f * p;
            }
        }
    }
    let mut x = vec![0.0; m];
    for row in (0..m).rev() {
        let tail: f64 = (row + 1..m).map(|c| a[row][c] * x[c]).sum();
        x[row] = (a[row][m] - tail) / a[row][row];
    }
    Some(x)
}

/// p50 and p99 of unsorted samples (`None` without samples).
pub(crate) fn p50_p99(samples: &mut [f64]) -> (Option<f64>, Option<f64>) {
    if samples.is_empty() {
        return (None, None);
    }
    samples.sort_by(f64::total_cmp);
    (
        Some(percentile(samples, 0.5)),
        Some(percentile(samples, 0.99)),
    )
}

fn minutes(s: &Settings, at_ms: i64) -> f64 {
    (at_ms - s.started_ms) as f64 / 60_000.0
}

/// Computes the report.
pub(crate) fn compute(i: &Inputs<'_>) -> Report {
    let s = &i.settings;
    let l = i.ledger;
    let note = |run: &RunId, what: String| {
        let sub = l.submitted.get(run);
        RunNote {
            run: run.to_string(),
            scenario: sub.map_or("child", |x| x.scenario.name()).into(),
            submitted_min: sub.map_or(f64::NAN, |x| minutes(s, x.submitted_ms)),
            what,
        }
    };

    // Runs.
    let mut lost = Vec::new();
    let mut no_end_event = Vec::new();
    let mut other = Vec::new();
    let mut rows: BTreeMap<Scenario, (ScenarioRow, Vec<f64>)> = BTreeMap::new();
    let (mut ended, mut succeeded) = (0, 0);
    for (run, sub) in &l.submitted {
        let row = &mut rows.entry(sub.scenario).or_insert_with(|| {
            (
                ScenarioRow {
                    scenario: sub.scenario.name().into(),
                    submitted: 0,
                    ended: 0,
                    succeeded: 0,
                    lost: 0,
                    p50_ms: None,
                    p99_ms: None,
                },
                Vec::new(),
            )
        });
        row.0.submitted += 1;
        match l.runs.get(run).and_then(|o| o.first_end()) {
            Some(end) => {
                ended += 1;
                row.0.ended += 1;
                row.1.push((end.stored_ms - sub.submitted_ms).max(0) as f64);
                if end.phase == WorkflowPhase::RunSucceeded {
                    succeeded += 1;
                    row.0.succeeded += 1;
                } else {
                    other.push(note(run, format!("{:?}", end.phase)));
                }
            }
            None => match i.records.get(run) {
                Some(Some(status)) if status.is_terminal() => {
                    no_end_event.push(note(run, format!("record says {status}")));
                }
                record => {
                    row.0.lost += 1;
                    let observed = l.runs.get(run);
                    let mut what = match record {
                        Some(Some(status)) => format!("record says {status}"),
                        Some(None) => "no record".to_owned(),
                        None => "record not read".to_owned(),
                    };
                    if let Some(o) = observed {
                        if !o.started {
                            what.push_str(", no run_started event");
                        }
                        let pending = o.pending_approvals();
                        if !pending.is_empty() {
                            what.push_str(&format!(", approvals pending: {}", pending.join(" ")));
                        }
                    } else {
                        what.push_str(", nothing stored");
                    }
                    lost.push(note(run, what));
                }
            },
        }
    }
    let by_scenario = rows
        .into_values()
        .map(|(mut row, mut lat)| {
            (row.p50_ms, row.p99_ms) = p50_p99(&mut lat);
            row
        })
        .collect();
    let children: Vec<&RunId> = l
        .runs
        .iter()
        .filter(|(r, o)| o.started && !l.submitted.contains_key(r))
        .map(|(r, _)| r)
        .collect();
    let children_ended = children
        .iter()
        .filter(|r| l.runs.get(r).is_some_and(|o| o.ended()))
        .count();
    let runs = Runs {
        submitted: l.submitted.len(),
        ended,
        succeeded,
        lost,
        ended_without_end_event: no_end_event,
        other_outcome: other,
        by_scenario,
        children: children.len(),
        children_ended,
    };

    // Applied twice.
    let mut twice = Twice {
        runs_ended_twice: Vec::new(),
        successes_applied_twice: Vec::new(),
        tasks_succeeded_by_two_attempts: Vec::new(),
        effects_of_two_successful_attempts: Vec::new(),
        teammate_messages_received_twice: Vec::new(),
        results_stored_twice: 0,
        effects_executed_again: 0,
        effects: i.effects.len(),
        effects_unparsed: i.effects_unparsed,
    };
    let mut succeeded_attempts: HashMap<(String, String), HashSet<String>> = HashMap::new();
    let mut sorted_runs: Vec<(&RunId, &super::ledger::Observed)> = l.runs.iter().collect();
    sorted_runs.sort_by_key(|(r, _)| **r);
    for (run, o) in sorted_runs {
        if o.ends.len() > 1 {
            let phases: Vec<String> = o.ends.values().map(|e| format!("{:?}", e.phase)).collect();
            twice
                .runs_ended_twice
                .push(format!("{run} ({})", phases.join(", ")));
        }
        let mut tasks: Vec<&String> = o.task_succeeded.keys().collect();
        tasks.sort();
        for task in tasks {
            let ids = &o.task_succeeded[task];
            if ids.len() > 1 {
                twice.successes_applied_twice.push(format!(
                    "{run} {task} ({} task_succeeded events)",
                    ids.len()
                ));
            }
        }
        let mut tasks: Vec<&String> = o.results.keys().collect();
        tasks.sort();
        for task in tasks {
            let results = &o.results[task];
            let ids: HashSet<String> = results.iter().map(|r| r.attempt_id.clone()).collect();
            twice.results_stored_twice += results.len() - ids.len();
            if ids.len() > 1 {
                let mut attempts: Vec<u32> = results.iter().map(|r| r.attempt).collect();
                attempts.sort_unstable();
                attempts.dedup();
                twice
                    .tasks_succeeded_by_two_attempts
                    .push(format!("{run} {task} (attempts {attempts:?})"));
            }
            succeeded_attempts.insert((run.to_string(), task.clone()), ids);
        }
    }
    let mut executed: BTreeMap<(String, String), Vec<&Effect>> = BTreeMap::new();
    for e in i.effects {
        executed
            .entry((e.run.clone(), e.task.clone()))
            .or_default()
            .push(e);
    }
    for ((run, task), effects) in &executed {
        let distinct: HashSet<&str> = effects.iter().map(|e| e.attempt_id.as_str()).collect();
        twice.effects_executed_again += effects.len() - distinct.len();
        if let Some(ok) = succeeded_attempts.get(&(run.clone(), task.clone())) {
            let both: Vec<&&str> = distinct.iter().filter(|a| ok.contains(**a)).collect();
            if both.len() > 1 {
                twice
                    .effects_of_two_successful_attempts
                    .push(format!("{run} {task} ({} attempts)", both.len()));
            }
        }
    }

    // Approvals.
    let mut approvals = Approvals {
        requested: 0,
        decided_once: 0,
        never_decided: Vec::new(),
        decided_more_than_once: Vec::new(),
        decision_inputs_stored_twice: 0,
        to_expire: 0,
        expired: 0,
        conflicts: l.conflicts.len(),
        conflicts_one_decided: 0,
        conflicts_both_decided: Vec::new(),
        conflicts_unanswered: 0,
    };
    let mut approval_runs: Vec<(&RunId, &super::ledger::Observed)> = l
        .runs
        .iter()
        .filter(|(_, o)| !o.approvals.is_empty())
        .collect();
    approval_runs.sort_by_key(|(r, _)| **r);
    for (run, o) in approval_runs {
        let expiring = l
            .submitted
            .get(run)
            .is_some_and(|x| x.scenario == Scenario::Expire);
        for (id, a) in &o.approvals {
            if !a.requested {
                continue;
            }
            approvals.requested += 1;
            match a.decided_events.len() {
                0 => approvals.never_decided.push(format!("{run} {id}")),
                1 => approvals.decided_once += 1,
                n => approvals
                    .decided_more_than_once
                    .push(format!("{run} {id} ({n} decisions)")),
            }
            approvals.decision_inputs_stored_twice += a.decided_inputs.len().saturating_sub(1);
            if expiring {
                approvals.to_expire += 1;
                if a.decided_inputs
                    .values()
                    .any(|st| *st == flotilla_model::approval::ApprovalStatus::Expired)
                {
                    approvals.expired += 1;
                }
            }
        }
    }
    for c in &l.conflicts {
        let decided = c.replies.iter().filter(|r| *r == "decided").count();
        if c.replies.iter().all(|r| r.starts_with("error")) {
            approvals.conflicts_unanswered += 1;
        } else if decided == 1 {
            approvals.conflicts_one_decided += 1;
        } else if decided > 1 {
            approvals
                .conflicts_both_decided
                .push(format!("{} {}", c.run, c.approval));
        }
    }

    // Teammates.
    let mut teammates = Teammates {
        spawned: l.teammates.len(),
        messages: 0,
        received_once: 0,
        lost: Vec::new(),
    };
    for t in i.teammates {
        for (k, n) in t.received.iter().enumerate() {
            teammates.messages += 1;
            match n {
                0 => teammates.lost.push(format!("{} message {}", t.name, k + 1)),
                1 => teammates.received_once += 1,
                n => twice.teammate_messages_received_twice.push(format!(
                    "{} message {} ({n} times)",
                    t.name,
                    k + 1
                )),
            }
        }
    }

    // Windows.
    let width = (s.window_s * 1000.0).max(1.0) as i64;
    let mut windows = Vec::new();
    let mut from = s.started_ms;
    while from < s.workload_end_ms {
        let mut to = (from + width).min(s.workload_end_ms);
        // A tail shorter than a quarter window joins the window before it.
        if s.workload_end_ms - to < width / 4 {
            to = s.workload_end_ms;
        }
        let mut lat = Vec::new();
        let (mut submitted, mut ended_n) = (0, 0);
        for (run, sub) in &l.submitted {
            if sub.submitted_ms < from || sub.submitted_ms >= to {
                continue;
            }
            submitted += 1;
            if let Some(end) = l.runs.get(run).and_then(|o| o.first_end()) {
                ended_n += 1;
                if sub.scenario.plain() {
                    lat.push((end.stored_ms - sub.submitted_ms).max(0) as f64);
                }
            }
        }
        let plain = lat.len();
        let (p50, p99) = p50_p99(&mut lat);
        windows.push(Window {
            from_min: minutes(s, from),
            to_min: minutes(s, to),
            submitted,
            ended: ended_n,
            plain,
            p50_ms: p50,
            p99_ms: p99,
            chaos: i
                .chaos
                .iter()
                .filter(|c| c.at_ms >= from && c.at_ms < to)
                .map(|c| format!("{} {}", c.service, c.how.as_str()))
                .collect(),
        });
        from = to;
    }

    // Memory.
    let warm_up = (s.rss_warm_up_s * 1000.0) as i64;
    let rss: Vec<Rss> = i
        .services
        .iter()
        .enumerate()
        .map(|(k, svc)| {
            let mine: Vec<&RssSample> = i.rss.iter().filter(|r| r.service == k).collect();
            let mib = |r: &RssSample| r.kib as f64 / 1024.0;
            let mean_mib = windows
                .iter()
                .map(|w| {
                    let from = s.started_ms + (w.from_min * 60_000.0).round() as i64;
                    let to = s.started_ms + (w.to_min * 60_000.0).round() as i64;
                    let v: Vec<f64> = mine
                        .iter()
                        .filter(|r| r.at_ms >= from && r.at_ms < to)
                        .map(|r| mib(r))
                        .collect();
                    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
                })
                .collect();
            let fitted: Vec<(u32, f64, f64)> = mine
                .iter()
                .filter(|r| r.at_ms - r.started_ms >= warm_up)
                .map(|r| (r.incarnation, r.at_ms as f64 / 3_600_000.0, mib(r)))
                .collect();
            let mut spans: BTreeMap<u32, (f64, f64)> = BTreeMap::new();
            for (inc, h, _) in &fitted {
                let e = spans.entry(*inc).or_insert((*h, *h));
                e.0 = e.0.min(*h);
                e.1 = e.1.max(*h);
            }
            let span_min = |inc: &u32| spans.get(inc).map_or(0.0, |(a, b)| (b - a) * 60.0);
            // A millisecond's rounding of hours is not a shorter life.
            let long_enough = |inc: &u32| span_min(inc) * 60.0 + 1e-3 >= s.rss_min_span_s;
            // Only an incarnation that lived long enough is judged: over a few minutes an
            // allocator's steps read as tens of MiB per hour.
            let long: Vec<(u32, f64, f64)> = fitted
                .iter()
                .copied()
                .filter(|(inc, _, _)| long_enough(inc))
                .collect();
            let judged: BTreeMap<u32, f64> = spans
                .keys()
                .filter(|inc| long_enough(inc))
                .map(|inc| (*inc, span_min(inc)))
                .collect();
            Rss {
                service: svc.name.clone(),
                incarnations: mine.iter().map(|r| r.incarnation).max().unwrap_or(0),
                mean_mib,
                max_mib: mine.iter().map(|r| mib(r)).reduce(f64::max),
                samples_fitted: long.len(),
                span_min: judged.values().sum(),
                judged_incarnations: judged.len() as u32,
                longest_min: spans.keys().map(span_min).reduce(f64::max).unwrap_or(0.0),
                slope_mib_per_h: within_slope(&long),
                sustained_mib_per_h: sustained_slope(
                    &long,
                    judged
                        .values()
                        .map(|m| steps_allowed(*m, s.rss_min_span_s / 60.0))
                        .sum(),
                ),
                every_incarnation_mib_per_h: within_slope(&fitted),
                targeted: svc.kind.is_some(),
            }
        })
        .collect();

    // Targets.
    let pass = |ok: bool| Some(ok);
    let mut targets = vec![
        Target {
            check: "runs lost".into(),
            figure: format!("{} of {}", runs.lost.len(), runs.submitted),
            target: "0".into(),
            pass: pass(runs.lost.is_empty()),
        },
        Target {
            check: "teammate messages lost".into(),
            figure: format!("{} of {}", teammates.lost.len(), teammates.messages),
            target: "0".into(),
            pass: pass(teammates.lost.is_empty()),
        },
        Target {
            check: "applied twice".into(),
            figure: twice.count().to_string(),
            target: "0".into(),
            pass: pass(twice.count() == 0),
        },
        Target {
            check: "approvals not decided exactly once".into(),
            figure: format!("{} of {}", approvals.not_once(), approvals.requested),
            target: "0".into(),
            pass: pass(approvals.not_once() == 0),
        },
        Target {
            check: "stuck consumers".into(),
            figure: format!(
                "{} ({} durable consumers sampled {} times)",
                i.stuck.len(),
                i.sampling.consumers.len(),
                i.sampling.rounds
            ),
            target: "0".into(),
            // Nothing sampled is no evidence.
            pass: (i.sampling.rounds > 0).then_some(i.stuck.is_empty()),
        },
        Target {
            check: "services not ready again within 2 min of a restart".into(),
            figure: format!(
                "{} of {}",
                i.chaos.iter().filter(|c| c.ready_ms.is_none()).count(),
                i.chaos.len()
            ),
            target: "0".into(),
            pass: pass(i.chaos.iter().all(|c| c.ready_ms.is_some())),
        },
        Target {
            check: "services that exited on their own".into(),
            figure: i.exits.len().to_string(),
            target: "0".into(),
            pass: pass(i.exits.is_empty()),
        },
    ];
    for r in rss.iter().filter(|r| r.targeted) {
        let step_cap = RSS_STEP_ALLOWANCE * s.rss_slope_target;
        let min_span = s.rss_min_span_s / 60.0;
        targets.push(Target {
            check: format!("RSS growth, {}", r.service),
            figure: match (r.sustained_mib_per_h, r.slope_mib_per_h) {
                (Some(q), Some(v)) => format!(
                    "sustained {q:+.2} MiB/h, whole run {v:+.2} MiB/h ({} of {} incarnations, {:.0} min)",
                    r.judged_incarnations, r.incarnations, r.span_min
                ),
                (None, Some(v)) => format!("{v:+.2} MiB/h"),
                (_, None) if r.samples_fitted == 0 && r.every_incarnation_mib_per_h.is_none() => {
                    "no samples after the warm-up".into()
                }
                (_, None) => format!(
                    "not judged: no incarnation lived {min_span:.0} min past its warm-up \
                     ({} incarnations, the longest {:.0} min; over all of them {})",
                    r.incarnations,
                    r.longest_min,
                    r.every_incarnation_mib_per_h
                        .map_or("—".into(), |v| format!("{v:+.2} MiB/h"))
                ),
            },
            target: format!(
                "sustained ≤ {} MiB/h, whole run ≤ {step_cap} MiB/h, over incarnations that lived ≥ {min_span:.0} min",
                s.rss_slope_target
            ),
            pass: match (r.sustained_mib_per_h, r.slope_mib_per_h) {
                (_, None) => None,
                (Some(q), Some(v)) => Some(q <= s.rss_slope_target && v <= step_cap),
                (None, Some(v)) => Some(v <= s.rss_slope_target),
            },
        });
    }
    let driver_errors = l
        .driver_errors
        .iter()
        .map(|e| {
            format!(
                "{:.1} min, {}{}: {}",
                minutes(s, e.at_ms),
                e.scenario.name(),
                e.run.map_or(String::new(), |r| format!(" {r}")),
                e.what
            )
        })
        .collect();
    Report {
        settings: s.clone(),
        targets,
        runs,
        twice,
        approvals,
        teammates,
        windows,
        rss,
        stuck: i.stuck.to_vec(),
        consumer_sampling: i.sampling.clone(),
        chaos: i.chaos.to_vec(),
        unexpected_exits: i.exits.to_vec(),
        driver_errors,
        saturated_ticks: i.saturated_ticks,
        peak_in_flight: i.peak_in_flight,
        console_requests: i.console_requests,
        console_failures: i.console_failures,
        messages_read: l.messages_read,
        undecodable: l.undecodable,
    }
}

/// Every submitted run, one line each (`runs.tsv` in the soak's directory): run id, scenario,
/// submitted (unix ms), how it ended (its first end event's phase, or what its record said,
/// or `lost`), and submission → end in ms.
pub(crate) fn runs_tsv(l: &Ledger, records: &HashMap<RunId, Option<RunStatus>>) -> String {
    let mut out = String::from("run\tscenario\tsubmitted_ms\tend\tlatency_ms\n");
    for (run, sub) in &l.submitted {
        let (end, latency) = match l.runs.get(run).and_then(|o| o.first_end()) {
            Some(e) => (
                format!("{:?}", e.phase),
                (e.stored_ms - sub.submitted_ms).to_string(),
            ),
            None => (
                match records.get(run) {
                    Some(Some(status)) if status.is_terminal() => format!("record:{status}"),
                    _ => "lost".to_owned(),
                },
                String::new(),
            ),
        };
        let _ = writeln!(
            out,
            "{run}\t{}\t{}\t{end}\t{latency}",
            sub.scenario.name(),
            sub.submitted_ms
        );
    }
    out
}

/// Every resident-memory sample, one per line (`service incarnation started_ms at_ms kib`,
/// tab-separated, with a header): the raw data the memory rows are computed from, kept in
/// the soak's directory so a report can be judged again.
pub(crate) fn rss_tsv(services: &[Service], rss: &[RssSample]) -> String {
    let mut out = String::from("service\tincarnation\tstarted_ms\tat_ms\tkib\n");
    for r in rss {
        let name = services.get(r.service).map_or("?", |s| s.name.as_str());
        let _ = writeln!(
            out,
            "{name}\t{}\t{}\t{}\t{}",
            r.incarnation, r.started_ms, r.at_ms, r.kib
        );
    }
    out
}

fn ms(v: Option<f64>) -> String {
    v.map_or("—".into(), |v| {
        if v >= 10_000.0 {
            format!("{:.1} s", v / 1000.0)
        } else {
            format!("{v:.0} ms")
        }
    })
}

fn list(out: &mut String, title: &str, items: &[String]) {
    if items.is_empty() {
        return;
    }
    let _ = writeln!(out, "\n{title} ({}):\n", items.len());
    for it in items.iter().take(50) {
        let _ = writeln!(out, "- {it}");
    }
    if items.len() > 50 {
        let _ = writeln!(
            out,
            "- … and {} more (`--json` lists all)",
            items.len() - 50
        );
    }
}

/// The report as markdown, for `docs/performance.md`.
pub(crate) fn markdown(r: &Report) -> String {
    let s = &r.settings;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "### Soak: {:.0} minutes ({} build, {})\n",
        s.minutes, s.build, s.nats_server
    );
    let _ = writeln!(
        out,
        "One scenario every {} ms (at most {} in flight, {} at the most; {} ticks found the \
         limit reached); a service stopped every {:.0} s (SIGTERM and kill -9 alternately), down \
         {:.0} s; drain {:.0} s. Workers of pool `default`: {} slots each.\n",
        s.every_ms,
        s.max_in_flight,
        r.peak_in_flight,
        r.saturated_ticks,
        s.chaos_every_s,
        s.down_for_s,
        s.drain_s,
        s.worker_concurrency
    );
    let _ = writeln!(out, "| Check | Figure | Target | |\n|---|---|---|---|");
    for t in &r.targets {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} |",
            t.check,
            t.figure,
            t.target,
            match t.pass {
                Some(true) => "pass",
                Some(false) => "**fail**",
                None => "no data",
            }
        );
    }
    let _ = writeln!(
        out,
        "\n**Runs**: {} submitted, {} ended ({} succeeded), {} lost, {} ended without an end event, \
         {} ended otherwise than succeeded; {} child runs seen ({} ended).\n",
        r.runs.submitted,
        r.runs.ended,
        r.runs.succeeded,
        r.runs.lost.len(),
        r.runs.ended_without_end_event.len(),
        r.runs.other_outcome.len(),
        r.runs.children,
        r.runs.children_ended
    );
    let _ = writeln!(
        out,
        "| Scenario | submitted | ended | succeeded | lost | p50 | p99 |\n|---|---|---|---|---|---|---|"
    );
    for row in &r.runs.by_scenario {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} |",
            row.scenario,
            row.submitted,
            row.ended,
            row.succeeded,
            row.lost,
            ms(row.p50_ms),
            ms(row.p99_ms)
        );
    }
    let t = &r.twice;
    let _ = writeln!(
        out,
        "\n**Applied twice**: runs ended twice {}, task successes applied twice {}, tasks succeeded \
         by two attempts {}, exec side effects of two successful attempts {} (of {} executions), \
         teammate messages received twice {}. Not counted: one attempt's success stored twice {}, \
         side effects executed again by the same attempt (redeliveries) {}.",
        t.runs_ended_twice.len(),
        t.successes_applied_twice.len(),
        t.tasks_succeeded_by_two_attempts.len(),
        t.effects_of_two_successful_attempts.len(),
        t.effects,
        t.teammate_messages_received_twice.len(),
        t.results_stored_twice,
        t.effects_executed_again
    );
    let a = &r.approvals;
    let _ = writeln!(
        out,
        "\n**Approvals**: {} requested, {} decided exactly once, {} never decided, {} decided more \
         than once; of the `expire` runs' {} approvals the deadline decided {}; {} pairs of \
         answers sent at once: {} with exactly one told `decided`, {} with both, {} that reached \
         nobody. Decisions stored twice on the run log (not counted): {}.",
        a.requested,
        a.decided_once,
        a.never_decided.len(),
        a.decided_more_than_once.len(),
        a.to_expire,
        a.expired,
        a.conflicts,
        a.conflicts_one_decided,
        a.conflicts_both_decided.len(),
        a.conflicts_unanswered,
        a.decision_inputs_stored_twice
    );
    let tm = &r.teammates;
    let _ = writeln!(
        out,
        "\n**Teammates**: {} spawned, {} messages confirmed, {} received exactly once, {} lost.",
        tm.spawned,
        tm.messages,
        tm.received_once,
        tm.lost.len()
    );
    let _ = writeln!(
        out,
        "\n**Run latency** (plain scenarios: submission → end event stored), per window of \
         submission time:\n\n| Window (min) | submitted | ended | plain | p50 | p99 | chaos |\n|---|---|---|---|---|---|---|"
    );
    for w in &r.windows {
        let _ = writeln!(
            out,
            "| {:.0}–{:.0} | {} | {} | {} | {} | {} | {} |",
            w.from_min,
            w.to_min,
            w.submitted,
            w.ended,
            w.plain,
            ms(w.p50_ms),
            ms(w.p99_ms),
            w.chaos.join(", ")
        );
    }
    let _ = writeln!(
        out,
        "\n**Resident memory** (MiB, mean per window) and its slope after each incarnation's \
         first {:.0} s — judged over the incarnations that lived at least {:.0} min past it, \
         and told over every incarnation:\n",
        s.rss_warm_up_s,
        s.rss_min_span_s / 60.0
    );
    let header: Vec<String> = r
        .windows
        .iter()
        .map(|w| format!("{:.0}–{:.0}", w.from_min, w.to_min))
        .collect();
    let _ = writeln!(
        out,
        "| Service | incarnations | {} | max | slope | sustained | every incarnation |\n|---|---|{}---|---|---|---|",
        header.join(" | "),
        "---|".repeat(header.len())
    );
    for row in &r.rss {
        let cells: Vec<String> = row
            .mean_mib
            .iter()
            .map(|v| v.map_or("—".into(), |v| format!("{v:.1}")))
            .collect();
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} |",
            row.service,
            row.incarnations,
            cells.join(" | "),
            row.max_mib.map_or("—".into(), |v| format!("{v:.1}")),
            row.slope_mib_per_h.map_or(
                format!("not judged (longest {:.0} min)", row.longest_min),
                |v| format!(
                    "{v:+.2} MiB/h ({} samples, {} incarnation{}, {:.0} min)",
                    row.samples_fitted,
                    row.judged_incarnations,
                    if row.judged_incarnations == 1 {
                        ""
                    } else {
                        "s"
                    },
                    row.span_min
                )
            ),
            row.sustained_mib_per_h
                .map_or("—".into(), |v| format!("{v:+.2} MiB/h")),
            row.every_incarnation_mib_per_h
                .map_or("—".into(), |v| format!("{v:+.2} MiB/h"))
        );
    }
    if !r.chaos.is_empty() {
        let _ = writeln!(
            out,
            "\n**Chaos** ({} stops):\n\n| At (min) | service | signal | exited after | ready after | |\n|---|---|---|---|---|---|",
            r.chaos.len()
        );
        for c in &r.chaos {
            let secs = |t: Option<i64>| {
                t.map_or("—".into(), |t| {
                    format!("{:.1} s", (t - c.at_ms) as f64 / 1000.0)
                })
            };
            let _ = writeln!(
                out,
                "| {:.1} | {} | {} | {} | {} | {}{} |",
                minutes(s, c.at_ms),
                c.service,
                c.how.as_str(),
                secs(c.exited_ms),
                secs(c.ready_ms),
                if c.killed_after_term {
                    "killed after the grace; "
                } else {
                    ""
                },
                c.error.as_deref().unwrap_or("")
            );
        }
    }
    list(
        &mut out,
        "Lost runs",
        &r.runs
            .lost
            .iter()
            .map(|n| {
                format!(
                    "{} ({}, submitted at {:.1} min): {}",
                    n.run, n.scenario, n.submitted_min, n.what
                )
            })
            .collect::<Vec<_>>(),
    );
    let notes = |v: &[RunNote]| -> Vec<String> {
        v.iter()
            .map(|n| {
                format!(
                    "{} ({}, {:.1} min): {}",
                    n.run, n.scenario, n.submitted_min, n.what
                )
            })
            .collect()
    };
    list(
        &mut out,
        "Ended without an end event",
        &notes(&r.runs.ended_without_end_event),
    );
    list(
        &mut out,
        "Ended otherwise than succeeded",
        &notes(&r.runs.other_outcome),
    );
    list(&mut out, "Runs ended twice", &t.runs_ended_twice);
    list(
        &mut out,
        "Task successes applied twice",
        &t.successes_applied_twice,
    );
    list(
        &mut out,
        "Tasks succeeded by two attempts",
        &t.tasks_succeeded_by_two_attempts,
    );
    list(
        &mut out,
        "Side effects of two successful attempts",
        &t.effects_of_two_successful_attempts,
    );
    list(
        &mut out,
        "Teammate messages received twice",
        &t.teammate_messages_received_twice,
    );
    list(&mut out, "Teammate messages lost", &tm.lost);
    list(&mut out, "Approvals never decided", &a.never_decided);
    list(
        &mut out,
        "Approvals decided more than once",
        &a.decided_more_than_once,
    );
    list(
        &mut out,
        "Answers sent at once both told decided",
        &a.conflicts_both_decided,
    );
    list(
        &mut out,
        "Stuck consumers",
        &r.stuck
            .iter()
            .map(|e| {
                format!(
                    "{}: stuck from {:.1} min (seen {:.1} min) to {}, up to {} pending, ack floor {}",
                    e.consumer,
                    minutes(s, e.since_ms),
                    minutes(s, e.seen_ms),
                    e.until_ms
                        .map_or("the end".into(), |u| format!("{:.1} min", minutes(s, u))),
                    e.max_pending,
                    e.ack_floor
                )
            })
            .collect::<Vec<_>>(),
    );
    list(
        &mut out,
        "Services that exited on their own",
        &r.unexpected_exits
            .iter()
            .map(|e| {
                format!(
                    "{} (incarnation {}) at {:.1} min: {}",
                    e.service,
                    e.incarnation,
                    minutes(s, e.at_ms),
                    e.status
                )
            })
            .collect::<Vec<_>>(),
    );
    list(
        &mut out,
        "What the bench could not drive (its requests went unanswered until the scenario's deadline)",
        &r.driver_errors,
    );
    let c = &r.consumer_sampling;
    let _ = writeln!(
        out,
        "\nThe bench read {} stored messages ({} undecodable), sampled the durable consumers {} \
         times ({} rounds failed; {}), and sent the console {} requests ({} failed or refused, \
         mostly while it was down).",
        r.messages_read,
        r.undecodable,
        c.rounds,
        c.failed_rounds,
        c.consumers.join(", "),
        r.console_requests,
        r.console_failures
    );
    out
}

#[cfg(test)]
mod tests;
