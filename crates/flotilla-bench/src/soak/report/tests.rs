//! The soak report's tests: memory fitted per incarnation, runs lost or applied twice, approvals
//! decided once, effects lines read back.

use super::*;
use crate::soak::ledger::{ApprovalSeen, ConflictRec, End, ResultSeen, Submission};
use flotilla_model::approval::ApprovalStatus;

/// The report of a soak that recorded only resident memory: `rss` of `services`.
fn memory_report(settings: Settings, services: &[Service], rss: &[RssSample]) -> Report {
    compute(&Inputs {
        settings,
        ledger: &Ledger::default(),
        effects: &[],
        effects_unparsed: 0,
        records: &HashMap::new(),
        teammates: &[],
        services,
        rss,
        chaos: &[],
        exits: &[],
        stuck: &[],
        sampling: ConsumerSampling::default(),
        saturated_ticks: 0,
        peak_in_flight: 0,
        console_requests: 0,
        console_failures: 0,
    })
}

fn settings() -> Settings {
    Settings {
        minutes: 10.0,
        build: "debug".into(),
        every_ms: 1000,
        max_in_flight: 32,
        chaos_every_s: 120.0,
        down_for_s: 3.0,
        window_s: 300.0,
        rss_warm_up_s: 60.0,
        stuck_after_s: 10.0,
        drain_s: 120.0,
        rss_slope_target: 5.0,
        rss_min_span_s: 600.0,
        worker_concurrency: 16,
        started_ms: 1_000_000,
        workload_end_ms: 1_000_000 + 600_000,
        end_ms: 1_000_000 + 720_000,
        nats_server: "nats-server".into(),
    }
}

#[test]
fn the_within_slope_ignores_restarts() {
    // Two incarnations growing 2 MiB/h from different baselines, a restart between.
    let mut points = Vec::new();
    for k in 0..10 {
        let x = k as f64 * 0.1;
        points.push((1, x, 100.0 + 2.0 * x));
        points.push((2, 2.0 + x, 40.0 + 2.0 * (2.0 + x)));
    }
    let slope = within_slope(&points).expect("a slope");
    assert!((slope - 2.0).abs() < 1e-9, "{slope}");
    // Pooled naively, the drop at the restart would read as shrinking.
    assert!(within_slope(&[(1, 0.0, 1.0)]).is_none());
    assert!(within_slope(&[(1, 0.0, 1.0), (2, 1.0, 5.0)]).is_none());
    let flat = [(1, 0.0, 7.0), (1, 1.0, 7.0), (1, 2.0, 7.0)];
    assert_eq!(within_slope(&flat), Some(0.0));
}

/// A one-time step (61 → 68 MiB at minute 30 of a flat hour, as the allocator of a
/// coordinator did in a soak) reads as +13 MiB/h fitted over the whole run, but it is not
/// growth that goes on; nor are two steps with a flat stretch between (as a supervisor's
/// allocator took in an hour). A leak of 6 MiB/h is judged as one, with a restart, with
/// steps beside it, and with as many steps allowed as an hour has; a staircase's steps are
/// taken out, and its whole-run slope is over the cap.
#[test]
fn sustained_growth_is_told_from_a_one_time_step() {
    let minute = |m: f64| m / 60.0;
    // A small wobble, as resident memory has.
    let wobble = |k: usize| [0.0, 0.6, -0.4, 0.3, -0.5][k % 5];
    let hour = |f: &dyn Fn(f64) -> (u32, f64)| -> Vec<(u32, f64, f64)> {
        (0..720)
            .map(|k| {
                let m = k as f64 / 12.0;
                let (inc, y) = f(m);
                (inc, minute(m), y + wobble(k))
            })
            .collect()
    };
    let step = hour(&|m| (1, if m < 30.0 { 61.0 } else { 68.0 }));
    let whole = within_slope(&step).expect("a slope");
    assert!(whole > 10.0, "{whole}");
    let sustained = sustained_slope(&step, 1).expect("a slope");
    assert!(sustained.abs() < 0.5, "{sustained}");
    // Steps allowed beyond those there are change nothing.
    let more = sustained_slope(&step, 3).expect("a slope");
    assert!(more.abs() < 0.5, "{more}");
    // Two steps, flat between: one step taken out leaves a slope, two leave none.
    let two = hour(&|m| {
        (
            1,
            60.0 + if m >= 22.0 { 2.5 } else { 0.0 } + if m >= 54.0 { 8.0 } else { 0.0 },
        )
    });
    let one_out = sustained_slope(&two, 1).expect("a slope");
    assert!(one_out > 3.0, "{one_out}");
    let both_out = sustained_slope(&two, 2).expect("a slope");
    assert!(both_out.abs() < 0.5, "{both_out}");
    // A leak, restarted at minute 40 from a lower baseline.
    let leak = hour(&|m| {
        if m < 40.0 {
            (1, 50.0 + 6.0 * minute(m))
        } else {
            (2, 30.0 + 6.0 * minute(m))
        }
    });
    for steps in [1, 3] {
        let sustained = sustained_slope(&leak, steps).expect("a slope");
        assert!((sustained - 6.0).abs() < 0.5, "{steps}: {sustained}");
    }
    // A leak and two steps: the leak is read between them, however many are allowed.
    let both = hour(&|m| {
        (
            1,
            50.0 + 6.0 * minute(m)
                + if m < 20.0 { 0.0 } else { 9.0 }
                + if m < 45.0 { 0.0 } else { 4.0 },
        )
    });
    for steps in [2, 3] {
        let sustained = sustained_slope(&both, steps).expect("a slope");
        assert!((sustained - 6.0).abs() < 0.5, "{steps}: {sustained}");
    }
    // A staircase: 3 MiB every 10 minutes is 18 MiB/h. With one step taken out it still
    // reads as growth; with three taken out (an hour's allowance) less so, and the
    // whole-run slope is what refuses it.
    let stairs = hour(&|m| (1, 50.0 + 3.0 * (m / 10.0).floor()));
    let sustained = sustained_slope(&stairs, 1).expect("a slope");
    assert!(sustained > 10.0, "{sustained}");
    let whole = within_slope(&stairs).expect("a slope");
    assert!(whole > RSS_STEP_ALLOWANCE * 5.0, "{whole}");
    // Too few points for a step: the plain slope.
    let few = [(1, 0.0, 1.0), (1, 1.0, 2.0), (1, 2.0, 3.0)];
    assert_eq!(sustained_slope(&few, 1), within_slope(&few));
    assert_eq!(sustained_slope(&[(1, 0.0, 1.0)], 1), None);
}

/// One step per `--rss-min-span` of judged life, and at least one.
#[test]
fn steps_are_allowed_by_length_of_life() {
    assert_eq!(steps_allowed(20.0, 20.0), 1);
    assert_eq!(steps_allowed(39.9, 20.0), 1);
    assert_eq!(steps_allowed(57.0, 20.0), 2);
    assert_eq!(steps_allowed(60.0, 20.0), 3);
    assert_eq!(steps_allowed(5.0, 20.0), 1);
    assert_eq!(steps_allowed(30.0, 0.0), 1);
}

#[test]
fn memory_is_fitted_after_each_incarnations_warm_up() {
    let s = settings();
    let hour = 3_600_000i64;
    // Incarnation 1 starts flat at 50 MiB but jumps during its first minute (warm-up),
    // then grows 4 MiB/h; incarnation 2 the same from 30 MiB.
    let mut rss = Vec::new();
    for (inc, start, base) in [
        (1u32, s.started_ms, 50.0),
        (2, s.started_ms + 300_000, 30.0),
    ] {
        for k in 0..=60 {
            let at = start + k * 5_000;
            let warm = at - start < 60_000;
            let mib = if warm {
                base / 2.0
            } else {
                base + 4.0 * (at - start) as f64 / hour as f64
            };
            rss.push(RssSample {
                service: 0,
                incarnation: inc,
                started_ms: start,
                at_ms: at,
                kib: (mib * 1024.0).round() as u64,
            });
        }
    }
    let services = [Service {
        name: "worker-1".into(),
        kind: Some(Kind::Worker),
    }];
    let judged = |min_span_s: f64| {
        let mut s = s.clone();
        s.rss_min_span_s = min_span_s;
        memory_report(s, &services, &rss)
            .targets
            .iter()
            .find(|t| t.check == "RSS growth, worker-1")
            .and_then(|t| t.pass)
    };
    // Each incarnation is fitted over 4 minutes: judged against a 4-minute least span,
    // not a 5-minute one (a least span is per incarnation, not summed over them).
    assert_eq!(judged(240.0), Some(true));
    assert_eq!(judged(300.0), None);
    let mut s = s;
    s.rss_min_span_s = 240.0;
    let r = memory_report(s, &services, &rss);
    let slope = r.rss[0].slope_mib_per_h.expect("a slope");
    // KiB rounding only.
    assert!((slope - 4.0).abs() < 0.2, "{slope}");
    assert_eq!(r.rss[0].incarnations, 2);
    assert_eq!(r.rss[0].samples_fitted, 2 * 49);
    assert!(
        (r.rss[0].span_min - 8.0).abs() < 1e-9,
        "{}",
        r.rss[0].span_min
    );
    assert!(r.passed());
}

#[test]
fn a_short_incarnation_is_told_and_not_judged() {
    let s = settings(); // warm-up 1 min, least span 10 min, target 5 MiB/h
    let hour = 3_600_000f64;
    // Incarnation 1 lives 30 minutes, flat at 40 MiB; incarnation 2 lives 6 minutes and
    // climbs 60 MiB/h (an allocator's steps over a short life read like this).
    let mut rss = Vec::new();
    for (inc, start, minutes, per_h) in [
        (1u32, s.started_ms, 30i64, 0.0),
        (2, s.started_ms + 31 * 60_000, 6, 60.0),
    ] {
        for k in 0..=minutes * 12 {
            let at = start + k * 5_000;
            rss.push(RssSample {
                service: 0,
                incarnation: inc,
                started_ms: start,
                at_ms: at,
                kib: ((40.0 + per_h * (at - start) as f64 / hour) * 1024.0).round() as u64,
            });
        }
    }
    let services = [Service {
        name: "supervisor-1".into(),
        kind: Some(Kind::Supervisor),
    }];
    let report = |rss: &[RssSample]| memory_report(s.clone(), &services, rss);
    let target = |r: &Report| {
        r.targets
            .iter()
            .find(|t| t.check == "RSS growth, supervisor-1")
            .cloned()
            .expect("a memory target")
    };
    // Both: only the long one is judged, and it is flat; the steep one is told.
    let r = report(&rss);
    assert_eq!(r.rss[0].judged_incarnations, 1);
    assert!(r.rss[0].slope_mib_per_h.expect("judged").abs() < 0.1);
    // Told over both (the long flat life weighs most, so it is small, but not flat).
    assert!(r.rss[0].every_incarnation_mib_per_h.expect("told") > 0.1);
    assert_eq!(target(&r).pass, Some(true));
    // The short one alone: told, not judged, and the report says why.
    let short: Vec<RssSample> = rss.iter().filter(|r| r.incarnation == 2).cloned().collect();
    let r = report(&short);
    assert_eq!(r.rss[0].judged_incarnations, 0);
    let t = target(&r);
    assert_eq!(t.pass, None);
    assert!(
        t.figure
            .starts_with("not judged: no incarnation lived 10 min"),
        "{}",
        t.figure
    );
    assert!(t.figure.contains("+60.0"), "{}", t.figure);
    assert!(markdown(&r).contains("not judged (longest 5 min)"));
}

fn run_id(n: u128) -> RunId {
    serde_json::from_value(serde_json::json!(format!(
        "0190f0c4-8a3e-7cc1-9a39-{:012x}",
        n
    )))
    .expect("a run id")
}

fn end(phase: WorkflowPhase, at: i64) -> End {
    End {
        phase,
        stored_ms: at,
    }
}

#[test]
fn runs_are_counted_lost_and_twice_as_defined() {
    let s = settings();
    let t0 = s.started_ms;
    let mut l = Ledger::default();
    let submit = |l: &mut Ledger, n: u128, sc: Scenario, at: i64| {
        l.submitted.insert(
            run_id(n),
            Submission {
                scenario: sc,
                submitted_ms: at,
            },
        );
    };
    // 1: ended once, plain, 200 ms. 2: ended twice (two ids). 3: no end, record running
    // (lost). 4: no end, record succeeded (no end event). 5: ended, one end id seen twice
    // is still one end. 6: failed.
    for (n, sc) in [
        (1, Scenario::Single),
        (2, Scenario::Chain),
        (3, Scenario::Fan),
        (4, Scenario::Single),
        (5, Scenario::Diamond),
        (6, Scenario::Approve),
    ] {
        submit(&mut l, n, sc, t0 + 1_000 * n as i64);
    }
    let o1 = l.runs.entry(run_id(1)).or_default();
    o1.started = true;
    o1.ends
        .insert("e1".into(), end(WorkflowPhase::RunSucceeded, t0 + 1_200));
    // Task a: one attempt's success stored twice (not counted); task b: two attempts.
    o1.results.insert(
        "a".into(),
        vec![
            ResultSeen {
                attempt: 1,
                attempt_id: "x".into(),
                seq: 10,
            },
            ResultSeen {
                attempt: 1,
                attempt_id: "x".into(),
                seq: 11,
            },
        ],
    );
    o1.results.insert(
        "b".into(),
        vec![
            ResultSeen {
                attempt: 1,
                attempt_id: "y1".into(),
                seq: 12,
            },
            ResultSeen {
                attempt: 2,
                attempt_id: "y2".into(),
                seq: 13,
            },
        ],
    );
    o1.task_succeeded
        .entry("a".into())
        .or_default()
        .extend(["s1".to_owned(), "s2".to_owned()]);
    let o2 = l.runs.entry(run_id(2)).or_default();
    o2.started = true;
    o2.ends
        .insert("e2".into(), end(WorkflowPhase::RunSucceeded, t0 + 3_000));
    o2.ends
        .insert("e2b".into(), end(WorkflowPhase::RunFailed, t0 + 4_000));
    l.runs.entry(run_id(3)).or_default().started = true;
    let o5 = l.runs.entry(run_id(5)).or_default();
    o5.ends
        .insert("e5".into(), end(WorkflowPhase::RunSucceeded, t0 + 9_000));
    l.runs
        .entry(run_id(6))
        .or_default()
        .ends
        .insert("e6".into(), end(WorkflowPhase::RunFailed, t0 + 8_000));
    // A child run the bench did not submit, ended.
    let child = l.runs.entry(run_id(99)).or_default();
    child.started = true;
    child
        .ends
        .insert("c".into(), end(WorkflowPhase::RunSucceeded, t0 + 5_000));
    let mut records = HashMap::new();
    records.insert(run_id(3), Some(RunStatus::Running));
    records.insert(run_id(4), Some(RunStatus::Succeeded));
    // Effects: task b of run 1 executed by both successful attempts (counted); task a
    // executed twice by attempt x (a redelivery: not counted).
    let r1 = run_id(1).to_string();
    let effect = |task: &str, attempt: u32, id: &str| Effect {
        run: r1.clone(),
        task: task.into(),
        attempt,
        attempt_id: id.into(),
    };
    let effects = vec![
        effect("a", 1, "x"),
        effect("a", 1, "x"),
        effect("b", 1, "y1"),
        effect("b", 2, "y2"),
    ];
    let r = compute(&Inputs {
        settings: s,
        ledger: &l,
        effects: &effects,
        effects_unparsed: 0,
        records: &records,
        teammates: &[TeammateCheck {
            name: "tm1".into(),
            received: vec![1, 0, 2],
        }],
        services: &[],
        rss: &[],
        chaos: &[],
        exits: &[],
        stuck: &[],
        sampling: ConsumerSampling::default(),
        saturated_ticks: 0,
        peak_in_flight: 0,
        console_requests: 0,
        console_failures: 0,
    });
    assert_eq!(r.runs.submitted, 6);
    assert_eq!(r.runs.ended, 4);
    assert_eq!(r.runs.succeeded, 3);
    assert_eq!(r.runs.lost.len(), 1);
    assert!(r.runs.lost[0].run == run_id(3).to_string());
    assert!(
        r.runs.lost[0].what.contains("record says running"),
        "{:?}",
        r.runs.lost
    );
    assert_eq!(r.runs.ended_without_end_event.len(), 1);
    assert_eq!(r.runs.other_outcome.len(), 1);
    assert_eq!((r.runs.children, r.runs.children_ended), (1, 1));
    assert_eq!(r.twice.runs_ended_twice.len(), 1);
    assert_eq!(r.twice.successes_applied_twice.len(), 1);
    assert_eq!(r.twice.tasks_succeeded_by_two_attempts.len(), 1);
    assert_eq!(r.twice.effects_of_two_successful_attempts.len(), 1);
    assert_eq!(r.twice.teammate_messages_received_twice.len(), 1);
    assert_eq!(r.twice.count(), 5);
    assert_eq!(r.twice.results_stored_twice, 1);
    assert_eq!(r.twice.effects_executed_again, 1);
    assert_eq!(r.teammates.lost.len(), 1);
    assert_eq!(r.teammates.received_once, 1);
    // Latency of run 1: 200 ms, in the first window, plain.
    let single = r
        .runs
        .by_scenario
        .iter()
        .find(|x| x.scenario == "single")
        .expect("a row");
    assert_eq!((single.submitted, single.ended), (2, 1));
    assert_eq!(single.p50_ms, Some(200.0));
    assert_eq!(r.windows.len(), 2);
    assert_eq!(r.windows[0].submitted, 6);
    assert_eq!(r.windows[0].plain, 3);
    let failed: Vec<&str> = r
        .targets
        .iter()
        .filter(|t| t.pass == Some(false))
        .map(|t| t.check.as_str())
        .collect();
    assert_eq!(
        failed,
        ["runs lost", "teammate messages lost", "applied twice"]
    );
    assert!(!r.passed());
    let md = markdown(&r);
    assert!(md.contains("| runs lost | 1 of 6 | 0 | **fail** |"), "{md}");
    let tsv = runs_tsv(&l, &records);
    assert_eq!(tsv.lines().count(), 7);
    assert!(
        tsv.contains(&format!(
            "{}\tsingle\t{}\tRunSucceeded\t200\n",
            run_id(1),
            t0 + 1_000
        )),
        "{tsv}"
    );
    assert!(
        tsv.contains(&format!("{}\tfan\t{}\tlost\t\n", run_id(3), t0 + 3_000)),
        "{tsv}"
    );
    assert!(tsv.contains("\trecord:succeeded\t"), "{tsv}");
}

#[test]
fn approvals_are_decided_once_or_counted() {
    let s = settings();
    let mut l = Ledger::default();
    l.submitted.insert(
        run_id(1),
        Submission {
            scenario: Scenario::Expire,
            submitted_ms: s.started_ms,
        },
    );
    let seen = |ids: &[&str], status: Option<ApprovalStatus>| {
        let mut a = ApprovalSeen {
            requested: true,
            ..Default::default()
        };
        a.decided_events.extend(ids.iter().map(|i| (*i).to_owned()));
        if let Some(st) = status {
            a.decided_inputs.insert(1, st);
            a.decided_inputs.insert(2, st);
        }
        a
    };
    let o = l.runs.entry(run_id(1)).or_default();
    o.approvals
        .insert("t0a1".into(), seen(&["d1"], Some(ApprovalStatus::Expired)));
    let o = l.runs.entry(run_id(2)).or_default();
    o.approvals.insert("t0a1".into(), seen(&[], None));
    o.approvals.insert("t1a1".into(), seen(&["d1", "d2"], None));
    o.approvals.insert(
        "t2a1".into(),
        ApprovalSeen {
            requested: false,
            ..Default::default()
        },
    );
    for replies in [
        vec!["decided", "already_decided"],
        vec!["decided", "decided"],
        vec!["error: timed out", "error: timed out"],
    ] {
        l.conflicts.push(ConflictRec {
            run: run_id(3),
            approval: "t0a1".into(),
            replies: replies.into_iter().map(String::from).collect(),
        });
    }
    let r = compute(&Inputs {
        settings: s,
        ledger: &l,
        effects: &[],
        effects_unparsed: 0,
        records: &HashMap::new(),
        teammates: &[],
        services: &[],
        rss: &[],
        chaos: &[],
        exits: &[],
        stuck: &[],
        sampling: ConsumerSampling::default(),
        saturated_ticks: 0,
        peak_in_flight: 0,
        console_requests: 0,
        console_failures: 0,
    });
    let a = &r.approvals;
    assert_eq!(a.requested, 3);
    assert_eq!(a.decided_once, 1);
    assert_eq!(a.never_decided.len(), 1);
    assert_eq!(a.decided_more_than_once.len(), 1);
    assert_eq!(a.decision_inputs_stored_twice, 1);
    assert_eq!((a.to_expire, a.expired), (1, 1));
    assert_eq!(a.conflicts, 3);
    assert_eq!(a.conflicts_one_decided, 1);
    assert_eq!(a.conflicts_both_decided.len(), 1);
    assert_eq!(a.conflicts_unanswered, 1);
    assert_eq!(a.not_once(), 3);
    // No consumer was sampled: no evidence either way.
    let stuck = r.targets.iter().find(|t| t.check == "stuck consumers");
    assert_eq!(stuck.map(|t| t.pass), Some(None));
}

#[test]
fn effects_lines_parse_and_torn_ones_are_counted() {
    let (e, bad) = parse_effects("r1 t 1 a1 1\nr1 t 2 a2\n\nr2 u 1 b1 3\n");
    assert_eq!(bad, 1);
    assert_eq!(e.len(), 2);
    assert_eq!(e[1].attempt_id, "b1");
}
