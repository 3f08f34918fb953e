//! Random plans, random failures, duplicate deliveries and timer firings, checked against
//! the invariants a simple model of the scheduler must keep.

mod common;

use flotilla_machine::{Action, Input, RunMachine};
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::plan::{PlanConfig, Subtask};
use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::task::{TaskErrorKind, TaskResult};
use flotilla_model::time::Secs;

use common::{plan, submitted};
use proptest::prelude::{ProptestConfig, any, prop, prop_assert, prop_assert_eq, proptest};
use proptest::strategy::Strategy as _;

#[derive(Debug, Clone)]
struct Case {
    deps: Vec<Vec<usize>>,
    required: Vec<bool>,
    /// Attempt outcomes per task: true = success. Missing entries succeed.
    script: Vec<Vec<bool>>,
    max_concurrency: u32,
    max_retries: u32,
    failure_ratio: f64,
    /// Cancel the run at this step (if it is still running then).
    cancel_at: Option<usize>,
    choices: Vec<u32>,
    /// Task i produces topic `p<i>`.
    produces: Vec<bool>,
    /// Topics each task consumes: `p<j>` of earlier producers, and `ext` (no producer in
    /// the plan: only an outside writer opens it).
    consumes: Vec<Vec<usize>>,
    consumes_ext: Vec<bool>,
    /// Announce `ext` at this step (never, if absent).
    ext_written_at: Option<usize>,
    /// Task i names a role and no agent: anycast, claimed by a member (or not in time).
    anycast: Vec<bool>,
}

fn case() -> impl proptest::strategy::Strategy<Value = Case> {
    (1usize..14).prop_flat_map(|n| {
        (
            (0..n)
                .map(|i| proptest::collection::btree_set(0..i.max(1), 0..=i.min(3)))
                .collect::<Vec<_>>(),
            proptest::collection::vec(any::<bool>(), n),
            proptest::collection::vec(
                proptest::collection::vec(prop::bool::weighted(0.7), 0..5),
                n,
            ),
            1u32..4,
            0u32..3,
            prop::sample::select(vec![0.0, 0.25, 0.5, 1.0]),
            proptest::option::weighted(0.2, 0usize..30),
            proptest::collection::vec(any::<u32>(), 200),
            (
                proptest::collection::vec(prop::bool::weighted(0.4), n),
                (0..n)
                    .map(|i| proptest::collection::btree_set(0..i.max(1), 0..=i.min(2)))
                    .collect::<Vec<_>>(),
                proptest::collection::vec(prop::bool::weighted(0.1), n),
                proptest::option::weighted(0.5, 0usize..40),
                proptest::collection::vec(prop::bool::weighted(0.3), n),
            ),
        )
            .prop_map(
                move |(
                    sets,
                    required,
                    script,
                    max_concurrency,
                    max_retries,
                    failure_ratio,
                    cancel_at,
                    choices,
                    (produces, consume_sets, consumes_ext, ext_written_at, anycast),
                )| Case {
                    anycast,
                    consumes: consume_sets
                        .into_iter()
                        .enumerate()
                        .map(|(i, s)| s.into_iter().filter(|&j| j < i && produces[j]).collect())
                        .collect(),
                    produces,
                    consumes_ext,
                    ext_written_at,
                    deps: sets
                        .into_iter()
                        .enumerate()
                        .map(|(i, s)| s.into_iter().filter(|&d| d < i).collect())
                        .collect(),
                    required,
                    script,
                    max_concurrency,
                    max_retries,
                    failure_ratio,
                    cancel_at,
                    choices,
                },
            )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn scheduler_keeps_its_invariants(c in case()) {
        let names: Vec<String> = (0..c.deps.len()).map(|i| format!("t{i}")).collect();
        let tasks: Vec<Subtask> = c.deps.iter().enumerate().map(|(i, ds)| {
            let refs: Vec<&str> = ds.iter().map(|&d| names[d].as_str()).collect();
            let mut t = Subtask::new(&names[i], "").after(&refs);
            t.required = c.required[i];
            if c.produces[i] {
                t.produces = vec![format!("p{i}")];
            }
            t.consumes = c.consumes[i].iter().map(|j| format!("p{j}")).collect();
            if c.consumes_ext[i] {
                t.consumes.push("ext".into());
            }
            if c.anycast[i] {
                t.role = Some("r".into());
            }
            t
        }).collect();
        let p = plan(tasks, PlanConfig {
            max_concurrency: c.max_concurrency,
            max_retries: c.max_retries,
            failure_ratio: c.failure_ratio,
            dependency_timeout: Secs::from_secs(100_000),
            dataflow_validation: flotilla_model::plan::DataflowValidation::Lenient,
            ..PlanConfig::default()
        });
        // Topics with an entry, by the model: a producer succeeded (the machine asked for
        // its entries to be written), or the outside writer wrote `ext`.
        let mut written: std::collections::BTreeSet<String> = Default::default();
        let mut produced_by: Vec<u32> = vec![0; c.deps.len()];
        let mut timed_out: Vec<bool> = vec![false; c.deps.len()];
        let n = c.deps.len();
        let threshold = (n as f64 * c.failure_ratio).floor() as usize + 1;
        let mut cancelled_by_input = false;
        let mut cancel_attempts = 0;
        let mut s = submitted(&p);
        s.anycast = true;
        let (mut m, mut actions) = RunMachine::start(RunId::new(), &s, p.clone(), 0);
        // Anycast attempts a member claimed, and tasks whose attempt nobody claimed in time.
        let mut claimed: std::collections::BTreeSet<(u32, u32)> = Default::default();
        let mut unclaimed: Vec<bool> = vec![false; c.deps.len()];
        let mut now: i64 = 0;
        let mut in_flight: Vec<(u32, u32)> = Vec::new();
        let mut delivered: Vec<(TaskId, u32, TaskResult)> = Vec::new();
        let mut finishes = 0;
        let mut seq = 0u64;
        let mut choice = c.choices.iter().cycle();
        for step in 0..2_000 {
            for a in &actions {
                match a {
                    Action::Dispatch { task, attempt } => {
                        // Dispatched only once every dependency succeeded.
                        for &d in &c.deps[*task as usize] {
                            prop_assert_eq!(m.state().tasks[d].status, TaskStatus::Succeeded);
                        }
                        // ... and every consumed topic has an entry.
                        for topic in &p.subtasks[*task as usize].consumes {
                            prop_assert!(written.contains(topic), "{} dispatched before {} had an entry", task, topic);
                        }
                        prop_assert!(*attempt <= c.max_retries + 1);
                        in_flight.push((*task, *attempt));
                    }
                    Action::Finish => finishes += 1,
                    Action::Produce { task } => {
                        let i = *task as usize;
                        prop_assert!(c.produces[i]);
                        prop_assert_eq!(m.state().tasks[i].status, TaskStatus::Succeeded);
                        produced_by[i] += 1;
                        written.insert(format!("p{i}"));
                    }
                    Action::CancelAttempts => {
                        cancel_attempts += 1;
                        // Everything in flight is cancelled: results for it are stale.
                        in_flight.clear();
                    }
                    Action::Withdraw { task, attempt } => {
                        // Only an anycast attempt in flight, unclaimed, past its bound.
                        let i = *task as usize;
                        prop_assert!(c.anycast[i]);
                        prop_assert!(!claimed.contains(&(*task, *attempt)));
                        let at = in_flight.iter().position(|x| *x == (*task, *attempt));
                        prop_assert!(at.is_some(), "withdrew {:?}, not in flight", (task, attempt));
                        in_flight.retain(|x| *x != (*task, *attempt));
                        let t = &m.state().tasks[i];
                        prop_assert!(now - t.dispatched_ms >= p.config.dependency_timeout.get().as_millis() as i64);
                        prop_assert_eq!(t.error.as_ref().map(|e| e.kind), Some(TaskErrorKind::RoleUnclaimed));
                        unclaimed[i] = true;
                    }
                    _ => {}
                }
            }
            prop_assert!(m.in_flight() <= c.max_concurrency);
            prop_assert_eq!(m.in_flight() as usize, in_flight.len());
            // A task that fails without ever starting timed out waiting: a dependency had
            // not succeeded or a consumed topic had no entry when it failed.
            for (i, t) in m.state().tasks.iter().enumerate() {
                if t.status == TaskStatus::Failed && t.attempt == 0 && !timed_out[i] {
                    timed_out[i] = true;
                    prop_assert_eq!(t.error.as_ref().map(|e| e.kind), Some(TaskErrorKind::DependencyTimeout));
                    let waiting_dep = c.deps[i].iter().any(|&d| m.state().tasks[d].status != TaskStatus::Succeeded);
                    let waiting_topic = p.subtasks[i].consumes.iter().any(|t| !written.contains(t));
                    prop_assert!(waiting_dep || waiting_topic, "t{} timed out with nothing to wait for", i);
                }
            }
            if m.state().status.is_terminal() {
                break;
            }
            if c.cancel_at == Some(step) {
                cancelled_by_input = true;
                actions = m.apply(Input::Cancel { reason: "test", rollback: false }, now);
                continue;
            }
            if c.ext_written_at == Some(step) {
                written.insert("ext".into());
                actions = m.apply(Input::TopicWritten { topic: "ext" }, now);
                continue;
            }
            let pick = *choice.next().unwrap_or(&0);
            now += 1 + i64::from(pick % 500);
            // Now and then a member claims an anycast attempt in flight (a claim of an
            // attempt already claimed, or of a pool task, changes nothing).
            if pick % 5 == 1 && !in_flight.is_empty() {
                let (task, attempt) = in_flight[pick as usize % in_flight.len()];
                let id = TaskId::new(names[task as usize].as_str());
                let before = m.state().clone();
                let a = m.apply(Input::Claimed { task: &id, attempt }, now);
                prop_assert!(a.is_empty(), "a claim decides nothing: {:?}", a);
                if c.anycast[task as usize] && claimed.insert((task, attempt)) {
                    prop_assert_eq!(m.state().tasks[task as usize].claimed, attempt);
                } else {
                    prop_assert_eq!(m.state(), &before);
                }
                actions = Vec::new();
                continue;
            }
            // And now and then the run's timer fires while attempts are in flight.
            if pick % 13 == 0 && let Some(t) = m.state().timer {
                now = now.max(t.due_ms);
                actions = m.apply(Input::Timer { generation: t.generation }, now);
                continue;
            }
            if !in_flight.is_empty() {
                let (task, attempt) = in_flight.remove(pick as usize % in_flight.len());
                let success = c.script[task as usize].get(attempt as usize - 1).copied().unwrap_or(true);
                let r = if success {
                    TaskResult::success("ok")
                } else {
                    TaskResult::failure(TaskErrorKind::AgentFailed, "scripted failure")
                };
                let id = TaskId::new(names[task as usize].as_str());
                seq += 1;
                actions = m.apply(Input::Result { task: &id, attempt, result: &r, seq, worker: None, started_at: None, agent: None }, now);
                delivered.push((id, attempt, r));
                // Redeliver an old result now and then: it must change nothing.
                if pick % 3 == 0 {
                    let (id, attempt, r) = &delivered[pick as usize % delivered.len()];
                    let before = m.state().clone();
                    let dup = m.apply(Input::Result { task: id, attempt: *attempt, result: r, seq: 999_999, worker: None, started_at: None, agent: None }, now);
                    prop_assert!(dup.is_empty());
                    prop_assert_eq!(m.state(), &before);
                }
            } else if let Some(t) = m.state().timer {
                now = now.max(t.due_ms);
                actions = m.apply(Input::Timer { generation: t.generation }, now);
            } else {
                prop_assert!(false, "stuck: nothing in flight, no timer, run not terminal: {:?}", m.state());
            }
        }
        let s = m.state();
        prop_assert!(s.status.is_terminal(), "run ended");
        prop_assert_eq!(finishes, 1);
        prop_assert!(cancel_attempts <= 1);
        let failed = s.tasks.iter().filter(|t| t.status == TaskStatus::Failed).count();
        let cancelled = s.tasks.iter().filter(|t| t.status == TaskStatus::Cancelled).count();
        // Model: the failure policy aborts exactly when failures reach the threshold, and
        // then no more tasks fail.
        let aborted = failed >= threshold;
        prop_assert!(failed <= threshold, "no failure after the abort: {} > {}", failed, threshold);
        if s.status == RunStatus::Cancelled {
            prop_assert!(cancelled_by_input);
            prop_assert!(!aborted);
        } else if aborted {
            prop_assert_eq!(s.status, RunStatus::Failed);
            let reason = s.outcome.as_ref().and_then(|o| o.reason.clone()).unwrap_or_default();
            // Stopped early (tasks were left and got cancelled), or at the very end.
            prop_assert_eq!(reason.starts_with("aborted:"), cancelled > 0, "{}", reason);
            prop_assert!(reason.contains("failure threshold") || s.tasks.iter().zip(&c.required).any(|(t, &r)| r && matches!(t.status, TaskStatus::Failed | TaskStatus::Skipped)), "{}", reason);
        } else {
            // The run fails exactly when a required task failed or was skipped.
            prop_assert_eq!(cancelled, 0, "only cancel and abort cancel tasks");
            let doomed = s.tasks.iter().zip(&c.required).any(|(t, &req)| req && matches!(t.status, TaskStatus::Failed | TaskStatus::Skipped));
            prop_assert_eq!(s.status == RunStatus::Failed, doomed);
        }
        for (i, t) in s.tasks.iter().enumerate() {
            prop_assert!(t.status.is_terminal());
            // Automatic produce happens exactly once per succeeded producer.
            let produced = u32::from(c.produces[i] && t.status == TaskStatus::Succeeded);
            prop_assert_eq!(produced_by[i], produced, "produce count of t{}", i);
            if t.status == TaskStatus::Failed && t.attempt == 0 {
                // Never started: checked when it timed out (above).
                prop_assert!(timed_out[i]);
            } else if t.status == TaskStatus::Failed && unclaimed[i] {
                // No member claimed its last attempt in time (checked when withdrawn).
                prop_assert_eq!(t.error.as_ref().map(|e| e.kind), Some(TaskErrorKind::RoleUnclaimed));
            } else if t.status == TaskStatus::Failed {
                // A task fails only after exhausting its script's failures within the retry budget.
                prop_assert_eq!(t.attempt, c.max_retries + 1);
                prop_assert!(c.script[i].iter().take(t.attempt as usize).all(|ok| !ok));
            }
            // Skipped tasks depend (transitively, through dependencies or topics) on a
            // failed one and never ran.
            if t.status == TaskStatus::Skipped {
                prop_assert_eq!(t.attempt, 0);
                prop_assert!(t.cause.is_some_and(|c| s.tasks[c as usize].status == TaskStatus::Failed));
            }
        }
    }
}
