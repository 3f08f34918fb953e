//! An installation's quotas (`flotilla_tenants::ledger`), held by every coordinator of it
//! against a real nats-server with real `flotilla` processes. Quotas are per installation, so
//! they are set here on the deployment's own one with `Ledger::set_quotas` (what
//! `flotilla tenant add|set` calls for a tenant's):
//!
//! * `concurrent_runs` across two coordinators and three workers: of twelve runs submitted at
//!   once, exactly the limit is admitted and never more run at a time; the rest are refused
//!   `quota_exceeded` naming the quota, its limit and what is used; once the runs end, new
//!   ones are admitted again, and a quota that queues makes submissions wait instead.
//! * `runs_per_hour`: the run past the limit is refused until the next clock hour.
//! * `tokens_per_day`: a run is held to what the tenant has left (its budget scope), its usage
//!   is counted at its end by agent and model, and the next submission is refused.
//! * Nonsense quotas are refused and change nothing; without quotas nothing is written.
//! * Two ledgers (two coordinators' views) admitting forty runs at once never pass the limit;
//!   a run admitted again counts nothing, an end performed twice releases once, and a run's
//!   usage counts once.
//! * A tenant's cost is counted without quotas: an LLM run in tenant `acme`'s installation
//!   (`--tenant acme`) shows in `flotilla tenant usage acme` by agent and model.

mod support;

use std::path::Path;
use std::time::Duration;

use flotilla_model::ids::RunId;
use flotilla_model::plan::Subtask;
use flotilla_model::problem::ProblemCode;
use flotilla_model::run::RunStatus;
use flotilla_model::submit::SubmitRequest;
use flotilla_model::task::TaskErrorKind;
use flotilla_model::tenant::{QuotaExceeded, QuotaKind, Quotas};
use flotilla_tenants::TenantErrorKind;
use flotilla_tenants::ledger::Ledger;
use flotilla_testkit::openai::{OpenAiServer, Reply};
use futures::StreamExt;
use support::*;

/// An exec agent `slow` (the default) that logs `start <ns>` and `end <ns>` around a sleep of
/// `sleep` seconds.
fn slow_agent(log: &Path, sleep: &str) -> String {
    let log = log.display();
    format!(
        r#"
default-agent = "slow"
[agents.slow]
kind = "exec"
command = "sh"
args = ["-c", "echo start $(date +%s%N) >> {log}; sleep {sleep}; echo end $(date +%s%N) >> {log}"]
"#
    )
}

/// The most executions the log shows running at once.
fn most_at_once(log: &Path) -> anyhow::Result<usize> {
    let mut marks: Vec<(u128, i32)> = std::fs::read_to_string(log)?
        .lines()
        .filter_map(|l| {
            let (what, at) = l.split_once(' ')?;
            let at: u128 = at.trim().parse().ok()?;
            Some((at, if what == "start" { 1 } else { -1 }))
        })
        .collect();
    // At one instant an end comes before a start.
    marks.sort();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, d) in marks {
        now += d;
        most = most.max(now);
    }
    Ok(most as usize)
}

fn one_task() -> SubmitRequest {
    SubmitRequest::new(plan(vec![Subtask::new("work", "Do the work.")]))
}

/// Sets `quotas` and gives the coordinators' watches a moment to see them (they follow the
/// bucket; nothing answers when they have).
async fn set(ledger: &Ledger, quotas: &Quotas) -> anyhow::Result<()> {
    ledger.set_quotas(quotas).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(())
}

/// The `quota_exceeded` refusal of rejected run `run`.
async fn refusal(p: &Processes, run: RunId) -> anyhow::Result<QuotaExceeded> {
    let view = p.client.run(run).await?.expect("the rejected run's record");
    anyhow::ensure!(
        view.record.status == RunStatus::Rejected,
        "{run}: {:?}",
        view.record
    );
    let problem = view.record.errors.first().expect("a problem");
    assert_eq!(problem.code, ProblemCode::QuotaExceeded, "{problem:?}");
    let exceeded = *problem.quota.clone().expect("the quota's detail");
    assert_eq!(problem.message, exceeded.to_string());
    Ok(exceeded)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_runs_hold_across_coordinators_and_workers() -> anyhow::Result<()> {
    let log = tempfile::NamedTempFile::new()?;
    let mut p = Processes::start(&slow_agent(log.path(), "3")).await?;
    p.coordinator().await?;
    p.coordinator().await?;
    for _ in 0..3 {
        p.worker(&["--concurrency", "4"]).await?;
    }
    let ledger = Ledger::open(&p.bus).await?;
    set(
        &ledger,
        &Quotas {
            concurrent_runs: Some(2),
            ..Quotas::default()
        },
    )
    .await?;

    // Twelve at once, to both coordinators: two are admitted, ten refused.
    let runs = futures::future::try_join_all((0..12).map(|_| p.client.submit(one_task()))).await?;
    let outcomes =
        futures::future::try_join_all(runs.iter().map(|r| p.client.wait(*r, WAIT))).await?;
    let admitted: Vec<RunId> = outcomes
        .iter()
        .filter(|o| o.status == RunStatus::Succeeded)
        .map(|o| o.run_id)
        .collect();
    let refused: Vec<RunId> = outcomes
        .iter()
        .filter(|o| o.status == RunStatus::Rejected)
        .map(|o| o.run_id)
        .collect();
    assert_eq!(
        (admitted.len(), refused.len()),
        (2, 10),
        "{outcomes:#?}\n{}\n{}",
        p.log(0),
        p.log(1)
    );
    for run in &refused {
        let e = refusal(&p, *run).await?;
        assert_eq!(
            e,
            QuotaExceeded {
                tenant: None,
                quota: QuotaKind::ConcurrentRuns,
                limit: 2,
                used: 2,
                resets_at_ms: None
            }
        );
    }
    assert_eq!(most_at_once(log.path())?, 2);
    // Every slot is given back before the run's end is told.
    assert!(ledger.held().await?.runs.is_empty());
    assert_eq!(ledger.usage(0).await?.current.concurrent_runs, 0);

    // Slots free: new runs are admitted again.
    let more = futures::future::try_join_all((0..2).map(|_| p.client.submit(one_task()))).await?;
    for run in more {
        assert_eq!(p.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
    }

    // A quota that queues: submissions wait for a slot instead of being refused.
    std::fs::write(log.path(), "")?;
    set(
        &ledger,
        &Quotas {
            concurrent_runs: Some(1),
            queue: vec![QuotaKind::ConcurrentRuns],
            ..Quotas::default()
        },
    )
    .await?;
    let queued = futures::future::try_join_all((0..3).map(|_| p.client.submit(one_task()))).await?;
    for run in queued {
        let outcome = p.client.wait(run, WAIT).await?;
        assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    }
    assert_eq!(most_at_once(log.path())?, 1);
    assert!(ledger.held().await?.runs.is_empty());
    // No usage was counted: exec agents call no model.
    assert_eq!(ledger.usage(0).await?.days, Vec::new());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_per_hour_refuses_until_the_next_hour() -> anyhow::Result<()> {
    let log = tempfile::NamedTempFile::new()?;
    let mut p = Processes::start(&slow_agent(log.path(), "0")).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let ledger = Ledger::open(&p.bus).await?;
    // Not across an hour's end: the window would reset in between.
    let now = flotilla_model::time::Timestamp::now().unix_ms();
    let to_next_hour = 3_600_000 - now.rem_euclid(3_600_000);
    if to_next_hour < 60_000 {
        tokio::time::sleep(Duration::from_millis(to_next_hour as u64 + 100)).await;
    }
    set(
        &ledger,
        &Quotas {
            runs_per_hour: Some(3),
            ..Quotas::default()
        },
    )
    .await?;
    for _ in 0..3 {
        let run = p.client.submit(one_task()).await?;
        assert_eq!(p.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
    }
    let run = p.client.submit(one_task()).await?;
    assert_eq!(p.client.wait(run, WAIT).await?.status, RunStatus::Rejected);
    let e = refusal(&p, run).await?;
    assert_eq!((e.quota, e.limit, e.used), (QuotaKind::RunsPerHour, 3, 3));
    let now = flotilla_model::time::Timestamp::now().unix_ms();
    let resets = e.resets_at_ms.expect("when it resets");
    assert_eq!(resets % 3_600_000, 0, "at a clock hour");
    assert!(resets > now && resets <= now + 3_600_000, "the next one");
    assert!(
        e.to_string().contains("runs_per_hour quota: 3 used of 3"),
        "{e}"
    );
    let usage = ledger.usage(0).await?;
    assert_eq!(usage.current.runs_this_hour, 3);
    assert_eq!(usage.current.hour_resets_at_ms, resets);
    // Nothing holds a slot: `concurrent_runs` is not set.
    assert!(ledger.held().await?.runs.is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_per_day_bounds_a_run_and_refuses_the_next() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    let mut p = Processes::start(&researcher(&llm)).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let ledger = Ledger::open(&p.bus).await?;
    set(
        &ledger,
        &Quotas {
            tokens_per_day: Some(1000),
            cost_per_month_micros: Some(1_000_000),
            ..Quotas::default()
        },
    )
    .await?;

    // The first call spends 1,100 of the 1,000 tokens the tenant had left when the run was
    // admitted: the second call would pass them, and fails `budget_exhausted` (the run's
    // `on-budget-exhausted`, here the default: fail).
    llm.push(Reply::text("Revenue was 1250.").usage(900, 200));
    let first = Subtask::new("first", "Find the revenue.").with_agent("researcher");
    let second = Subtask::new("second", "Check it.")
        .with_agent("researcher")
        .after(&["first"]);
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![first, second])))
        .await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed, "{outcome:?}");
    assert_eq!(
        outcome.failed[0].error.kind,
        TaskErrorKind::BudgetExhausted,
        "{outcome:?}"
    );
    assert_eq!(llm.requests().len(), 1, "the second call was not made");

    // Its usage is counted once it ended (off the run's path: shortly after its end is
    // told): the day's tokens, the month's cost, by agent and model.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let usage = loop {
        let usage = ledger.usage(0).await?;
        if usage.current.tokens_today > 0 || tokio::time::Instant::now() > deadline {
            break usage;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(usage.current.tokens_today, 1100);
    assert_eq!(usage.current.cost_this_month_micros, 1300);
    assert_eq!(usage.days.len(), 1, "{usage:?}");
    let by = &usage.days[0].by;
    assert_eq!(by.len(), 1, "{by:?}");
    assert_eq!(
        (by[0].agent.as_str(), by[0].spend.tokens, by[0].spend.calls),
        ("researcher", 1100, 1)
    );
    assert_eq!(usage.quotas.tokens_per_day, Some(1000));

    // The day's tokens are spent: the next submission is refused until tomorrow (UTC).
    let next = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("quick", "Say hi.").with_agent("researcher"),
        ])))
        .await?;
    assert_eq!(p.client.wait(next, WAIT).await?.status, RunStatus::Rejected);
    let e = refusal(&p, next).await?;
    assert_eq!(
        (e.quota, e.limit, e.used),
        (QuotaKind::TokensPerDay, 1000, 1100)
    );
    let resets = e.resets_at_ms.expect("when it resets");
    assert_eq!(resets % 86_400_000, 0, "at midnight UTC");
    assert_eq!(llm.requests().len(), 1, "nothing ran");
    // Counted once: the ended run's end performed again changes nothing.
    assert!(!ledger.account(run, &usage_of_one_call(), 0).await?);
    Ok(())
}

/// Some usage (to count again a run counted already).
fn usage_of_one_call() -> flotilla_tenants::ledger::RunUsage {
    let mut u = flotilla_tenants::ledger::RunUsage::default();
    u.add("researcher", "scripted-model", 10, None);
    u
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nonsense_quotas_are_refused_and_change_nothing() -> anyhow::Result<()> {
    let server = flotilla_testkit::NatsServer::start().await?;
    let bus = server.provisioned_bus().await?;
    let ledger = Ledger::open(&bus).await?;
    assert_eq!(ledger.quotas().await?, None);
    let good = Quotas {
        concurrent_runs: Some(5),
        tokens_per_day: Some(100_000),
        ..Quotas::default()
    };
    ledger.set_quotas(&good).await?;
    for bad in [
        Quotas {
            concurrent_runs: Some(0),
            ..Quotas::default()
        },
        Quotas {
            tokens_per_day: Some(10),
            queue: vec![QuotaKind::TokensPerDay],
            ..Quotas::default()
        },
        Quotas {
            queue: vec![QuotaKind::ConcurrentRuns],
            ..Quotas::default()
        },
        Quotas {
            concurrent_runs: Some(1_000_000),
            ..Quotas::default()
        },
    ] {
        let e = ledger.set_quotas(&bad).await.expect_err("refused");
        assert_eq!(e.kind(), TenantErrorKind::InvalidQuotas, "{bad:?}: {e}");
        assert_eq!(ledger.quotas().await?, Some(good.clone()), "unchanged");
    }
    // Empty quotas remove them.
    ledger.set_quotas(&Quotas::default()).await?;
    assert_eq!(ledger.quotas().await?, None);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_quotas_nothing_is_written() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    let mut p = Processes::start(&format!(
        r#"
[agents.researcher]
kind = "llm"
base-url = "{}"
model = "scripted-model"
"#,
        llm.base_url()
    ))
    .await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    for _ in 0..3 {
        llm.push(Reply::text("Hi.").usage(10, 5));
        let run = p
            .client
            .submit(SubmitRequest::new(plan(vec![
                Subtask::new("quick", "Say hi.").with_agent("researcher"),
            ])))
            .await?;
        assert_eq!(p.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
    }
    let kv = p.bus.kv(flotilla_model::subjects::Bucket::Usage).await?;
    let keys: Vec<String> = kv
        .keys()
        .await?
        .filter_map(|k| async { k.ok() })
        .collect()
        .await;
    assert_eq!(keys, Vec::<String>::new(), "no ledger writes at all");
    let usage = Ledger::open(&p.bus).await?.usage(0).await?;
    assert!(
        usage.quotas.is_empty() && usage.days.is_empty(),
        "{usage:?}"
    );
    assert_eq!(usage.current.tokens_today, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_ledgers_never_pass_a_limit_and_release_and_count_once() -> anyhow::Result<()> {
    use flotilla_tenants::ledger::Admission;
    let server = flotilla_testkit::NatsServer::start().await?;
    let bus = server.provisioned_bus().await?;
    // Two coordinators' ledgers, on connections of their own.
    let a = Ledger::open(&bus).await?;
    let b = Ledger::open(&server.bus().await?).await?;
    a.set_quotas(&Quotas {
        concurrent_runs: Some(5),
        runs_per_hour: Some(1000),
        tokens_per_day: Some(1_000_000),
        ..Quotas::default()
    })
    .await?;
    let now = flotilla_model::time::Timestamp::now().unix_ms();
    let runs: Vec<RunId> = (0..40).map(|_| RunId::new()).collect();
    let admissions = futures::future::try_join_all(runs.iter().enumerate().map(|(i, run)| {
        let ledger = if i % 2 == 0 { &a } else { &b };
        ledger.admit(*run, now)
    }))
    .await?;
    let admitted: Vec<RunId> = runs
        .iter()
        .zip(&admissions)
        .filter(|(_, a)| matches!(a, Admission::Admitted { reserved: true, .. }))
        .map(|(r, _)| *r)
        .collect();
    assert_eq!(admitted.len(), 5, "{admissions:?}");
    for adm in &admissions {
        match adm {
            Admission::Admitted { budget, .. } => {
                assert_eq!(budget.and_then(|b| b.max_tokens), Some(1_000_000));
            }
            Admission::Refused { exceeded, queue } => {
                assert_eq!(
                    (exceeded.quota, exceeded.used, *queue),
                    (QuotaKind::ConcurrentRuns, 5, false)
                );
            }
            Admission::Unlimited => panic!("quotas are set"),
        }
    }
    assert_eq!(a.held().await?.runs.len(), 5);
    // Admitted again (a redelivery): nothing more is counted.
    for run in &admitted {
        assert!(matches!(
            b.admit(*run, now).await?,
            Admission::Admitted {
                reserved: false,
                ..
            }
        ));
    }
    assert_eq!(a.usage(0).await?.current.runs_this_hour, 5);
    // An end performed twice (by a successor) gives the slot back once.
    for run in &admitted {
        assert!(a.release(*run).await?);
        assert!(!b.release(*run).await?);
    }
    assert!(a.held().await?.runs.is_empty());
    // A run's usage is counted once, whoever counts it.
    let used = usage_of_one_call();
    assert!(a.account(admitted[0], &used, now).await?);
    assert!(!b.account(admitted[0], &used, now).await?);
    let usage = b.usage(now).await?;
    assert_eq!(usage.current.tokens_today, 10);
    assert_eq!(usage.days.len(), 1);
    assert_eq!(usage.days[0].total.calls, 1);
    Ok(())
}

/// A tenant's cost is counted without any quota: `flotilla tenant usage` shows an LLM run's
/// tokens, cost and calls by agent and model once it ended (the run ran in the tenant's
/// installation, `--tenant acme`, on the scripted OpenAI-compatible double).
// Multi-threaded: the scripted model server runs on the test's runtime while the test waits
// for CLI processes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_cost_is_counted_without_quotas() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    let mut p = Processes::start(&researcher(&llm)).await?;
    let out = p.cli(&["tenant", "add", "acme"])?;
    anyhow::ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let c = p.spawn(&["--tenant", "acme", "coordinator"])?;
    let w = p.spawn(&["--tenant", "acme", "worker"])?;
    let mut opts = flotilla_bus::NatsOptions::with_url(p.server.url());
    opts.tenant = Some("acme".into());
    let acme = flotilla_bus::Bus::connect(&opts, "quotas-test").await?;
    if let Err(e) = wait_for_api(&acme).await {
        anyhow::bail!("{e}\n{}", p.log(c));
    }
    llm.push(Reply::text("Revenue was 1250.").usage(900, 200));
    let plan = p.dir().join("plan.json");
    std::fs::write(
        &plan,
        r#"{"subtasks":[{"id":"look","agent":"researcher","description":"Find the revenue."}]}"#,
    )?;
    let out = p.cli(&[
        "--tenant",
        "acme",
        "submit",
        &plan.to_string_lossy(),
        "--wait",
        "--timeout",
        "60s",
    ])?;
    anyhow::ensure!(
        out.status.success(),
        "{}\n{}\ncoordinator:\n{}\nworker:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        p.log(c),
        p.log(w)
    );
    // Counted shortly after the run's end (off its path).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let usage = loop {
        let out = p.cli(&["tenant", "usage", "acme", "--json"])?;
        let usage: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        if usage["days"].as_array().is_some_and(|d| !d.is_empty())
            || tokio::time::Instant::now() > deadline
        {
            break usage;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(usage["tenant"], "acme", "{usage:#}");
    assert_eq!(
        usage["quotas"],
        serde_json::json!({}),
        "no quota: {usage:#}"
    );
    assert_eq!(usage["current"]["tokens_today"], 1100, "{usage:#}");
    assert_eq!(
        usage["current"]["cost_this_month_micros"], 1300,
        "{usage:#}"
    );
    let by = &usage["days"][0]["by"][0];
    assert_eq!(
        (
            &by["agent"],
            &by["tokens"],
            &by["cost_micros"],
            &by["calls"]
        ),
        (
            &serde_json::json!("researcher"),
            &serde_json::json!(1100),
            &serde_json::json!(1300),
            &serde_json::json!(1)
        ),
        "{usage:#}"
    );
    // The deployment's own installation, without quotas, counted nothing.
    let own = Ledger::open(&p.bus).await?.usage(0).await?;
    assert_eq!(own.days, Vec::new());
    Ok(())
}
