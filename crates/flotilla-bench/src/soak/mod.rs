//! `flotilla soak`: hours of mixed work while every service is restarted, and a report of
//! what was lost, applied twice, stuck, or grew. Unlike the bench's sections it judges: each
//! figure is printed next to its target, and the command exits 1 when one is missed.
//!
//! ```text
//!  start ─► deployment up ─► workload + chaos for --minutes ─► drain ─► checks ─► report
//!             │                 │            │                  (--drain: every run
//!             │                 │            └─ a service stopped every --chaos-every,
//!             │                 │               SIGTERM / kill -9 in turn, started again
//!             │                 └─ a scenario every --every, ≤ --max-in-flight at once
//!             └─ nats-server (file storage), 2 coordinators, 2 workers + an LLM pool worker,
//!                2 supervisors, the console: each its own process
//! ```
//!
//! Meanwhile the bench samples every service's resident memory (`--sample-every`) and the
//! installation's durable consumers (every 2 s), and follows the events stream and the run
//! log into its [ledger](ledger). Modules: [`config`] (the deployment's configuration and the
//! exec agents' script), [`deployment`] (the service processes), [`workload`] (the scenarios
//! and their drivers), [`chaos`] (stops and starts, and services that exit on their own),
//! [`consumers`] (stuck consumers), [`report`] (the arithmetic and its rendering).

mod chaos;
mod config;
mod consumers;
mod deployment;
mod ledger;
mod report;
mod scenario;
mod workload;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;
use flotilla_bus::server::LocalNatsServer;
use flotilla_bus::{Bus, NatsOptions};
use flotilla_client::Client;
use flotilla_model::subjects::Bucket;
use tokio_util::sync::CancellationToken;

use self::chaos::SharedDeployment;
use self::deployment::{Deployment, ready, unix_ms};
use self::ledger::Shared;
use self::report::{RssSample, Service};
use self::scenario::Scenario;
use self::workload::Workload;
use crate::harness::processes::rss_kib;
use crate::harness::provider::Provider;

/// Arguments of `flotilla soak` (the CLI takes them as they are).
#[derive(Debug, clap::Args)]
pub struct SoakArgs {
    /// How long the workload and the chaos run, in minutes (then the drain).
    #[arg(long, default_value_t = 60.0)]
    minutes: f64,
    /// Also write the report (markdown) to this file.
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,
    /// Print the report as JSON on stdout instead of markdown.
    #[arg(long)]
    json: bool,
    /// A new scenario this often.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    every: Duration,
    /// Most scenarios running at once (a tick that finds this many starts none).
    #[arg(long, default_value_t = 32)]
    max_in_flight: usize,
    /// Only these scenarios, in the cycle's order (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    scenarios: Vec<Scenario>,
    /// Stop a service this often.
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    chaos_every: Duration,
    /// How long a stopped service stays down.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    down_for: Duration,
    /// No chaos: the same workload on services left alone (a baseline).
    #[arg(long)]
    no_chaos: bool,
    /// After the workload: how long runs still in flight get to end.
    #[arg(long, default_value = "3m", value_parser = humantime::parse_duration)]
    drain: Duration,
    /// How long one scenario may take (its run's end included) before its driver gives up.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    scenario_deadline: Duration,
    /// Width of the report's windows (latency, memory).
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    window: Duration,
    /// Read each service's resident memory this often.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    sample_every: Duration,
    /// Samples of each process's first this long are left out of its memory slope.
    #[arg(long, default_value = "3m", value_parser = humantime::parse_duration)]
    rss_warm_up: Duration,
    /// The sustained memory growth each service must stay under, MiB per hour: the slope
    /// fitted with level shifts beside it, one per `--rss-min-span` of a process's life (an
    /// allocator's one-time step is not growth that goes on); the slope over the whole run
    /// must stay under three times it.
    #[arg(long, default_value_t = 5.0)]
    rss_slope_target: f64,
    /// Only incarnations that lived at least this long past their warm-up are fitted and
    /// judged: over a few minutes an allocator's steps read as tens of MiB per hour. A soak
    /// that restarts each service more often reports its memory without judging it; the
    /// soak without stops (`--no-chaos`) judges it.
    #[arg(long, default_value = "20m", value_parser = humantime::parse_duration)]
    rss_min_span: Duration,
    /// A consumer with messages pending, no pull waiting and no ack progress for longer than
    /// this while its services are up is stuck (default: two worker heartbeats).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    stuck_after: Duration,
    /// Slots of each worker of pool `default`.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Slots of the LLM pool's worker.
    #[arg(long, default_value_t = 8)]
    llm_concurrency: usize,
    /// The simulated model's answer time (per call; an LLM task makes two).
    #[arg(long, default_value = "200ms", value_parser = humantime::parse_duration)]
    llm_delay: Duration,
    /// The services' log filter (`FLOTILLA_LOG`).
    #[arg(long, default_value = "info")]
    log_level: String,
    /// Keep the soak's files here (configuration, the services' logs, the nats-server's
    /// store); default: a temporary directory, kept only when a target is missed.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// The `flotilla` binary that runs the services (default: this one).
    #[arg(long, value_name = "PATH")]
    services_binary: Option<PathBuf>,
}

/// The soak's shared state while it runs.
struct Running {
    ledger: Shared,
    rss: Arc<Mutex<Vec<RssSample>>>,
    stuck: Arc<Mutex<consumers::StuckTracker>>,
    chaos: Arc<Mutex<Vec<chaos::ChaosEvent>>>,
    exits: Arc<Mutex<Vec<chaos::UnexpectedExit>>>,
}

fn take<T: Clone>(m: &Mutex<Vec<T>>) -> Vec<T> {
    m.lock().unwrap_or_else(PoisonError::into_inner).clone()
}

/// Runs the soak against an embedded nats-server (or the server at `nats_url`, the CLI's
/// global `--nats-url`) and prints its report. `Ok(true)` when every target was met.
pub async fn run(args: SoakArgs, nats_url: Option<&str>) -> anyhow::Result<bool> {
    anyhow::ensure!(
        args.minutes > 0.0 && args.minutes.is_finite(),
        "--minutes must be a positive number, not {}",
        args.minutes
    );
    anyhow::ensure!(args.max_in_flight > 0, "--max-in-flight must be at least 1");
    anyhow::ensure!(!args.every.is_zero(), "--every must be longer than 0");
    let temp = match &args.dir {
        Some(_) => None,
        None => Some(
            tempfile::Builder::new()
                .prefix("flotilla-soak-")
                .tempdir()?,
        ),
    };
    let dir = match (&args.dir, &temp) {
        (Some(d), _) => {
            std::fs::create_dir_all(d)?;
            d.clone()
        }
        (None, Some(t)) => t.path().to_path_buf(),
        (None, None) => anyhow::bail!("no directory for the soak"),
    };
    let outcome = soak(&args, nats_url, &dir).await;
    let keep = !matches!(outcome, Ok(true));
    if let Some(t) = temp
        && keep
    {
        let kept = t.keep();
        errln!(
            "soak: its files (configuration, service logs in logs/, the effects file, runs.tsv) are kept in {}",
            kept.display()
        );
    }
    outcome
}

async fn soak(
    args: &SoakArgs,
    nats_url: Option<&str>,
    dir: &std::path::Path,
) -> anyhow::Result<bool> {
    let (server, url) = match nats_url {
        Some(u) => (None, u.to_owned()),
        None => {
            let s = LocalNatsServer::start_in(&dir.join("nats")).await?;
            let url = s.url();
            (Some(s), url)
        }
    };
    let provider = Provider::start().await?;
    provider.set_delay(args.llm_delay);
    let console = deployment::free_port()?;
    let files = config::write(
        dir,
        &config::Settings {
            nats_url: &url,
            provider_url: &provider.base_url(),
            console_listen: console,
            concurrency: args.concurrency,
        },
    )?;
    let mut opts = NatsOptions::with_url(&url);
    opts.prefix = config::PREFIX.into();
    let bus = Bus::connect(&opts, "flotilla-soak").await?;
    bus.provision(&Default::default())
        .await
        .context("provisioning the soak's streams")?;
    let nats_version = format!("nats-server {}", bus.client().server_info().version);
    let exe = match &args.services_binary {
        Some(p) => p.clone(),
        None => std::env::current_exe()?,
    };
    let dep = Deployment::new(
        &exe,
        &files.config,
        &dir.join("logs"),
        &args.log_level,
        args.llm_concurrency,
    )?;
    let dep: SharedDeployment = Arc::new(Mutex::new(dep));
    let services: Vec<Service> = {
        let d = chaos::lock(&dep);
        d.slots
            .iter()
            .map(|s| Service {
                name: s.name.clone(),
                kind: Some(s.kind),
            })
            .chain(server.iter().map(|_| Service {
                name: "nats-server".into(),
                kind: None,
            }))
            .collect()
    };
    errln!(
        "soak: {} for {} min in {} ({})",
        services
            .iter()
            .map(|s| s.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        args.minutes,
        dir.display(),
        nats_version
    );
    start_all(&dep, true).await?;

    let shutdown = CancellationToken::new();
    let ledger: Shared = Arc::default();
    let followers = ledger::start_followers(&bus, &ledger, &shutdown);
    let w = Arc::new(Workload {
        client: Client::new(bus.clone()),
        ledger: Arc::clone(&ledger),
        console,
        team: bus.kv(Bucket::Team).await?,
        deadline: args.scenario_deadline,
        started: Default::default(),
        saturated: Default::default(),
        peak_in_flight: Default::default(),
        console_requests: Default::default(),
        console_failures: Default::default(),
    });
    let r = Running {
        ledger: Arc::clone(&ledger),
        rss: Arc::default(),
        stuck: Arc::new(Mutex::new(consumers::StuckTracker::new(args.stuck_after))),
        chaos: Arc::default(),
        exits: Arc::default(),
    };
    let started_ms = unix_ms();
    let nats_pid = server.as_ref().and_then(LocalNatsServer::pid);
    let mut background = vec![
        tokio::spawn(sample_rss(
            Arc::clone(&dep),
            nats_pid,
            started_ms,
            args.sample_every,
            Arc::clone(&r.rss),
            shutdown.clone(),
        )),
        tokio::spawn(sample_consumers(
            bus.clone(),
            Arc::clone(&dep),
            Arc::clone(&r.stuck),
            shutdown.clone(),
        )),
        tokio::spawn(chaos::watch_exits(
            Arc::clone(&dep),
            Arc::clone(&r.exits),
            shutdown.clone(),
        )),
        tokio::spawn(workload::console_reader(Arc::clone(&w), shutdown.clone())),
        tokio::spawn(progress(Arc::clone(&w), started_ms, shutdown.clone())),
    ];
    background.extend(followers);

    // The workload and the chaos, for --minutes (or until Ctrl-C or SIGTERM).
    let stop = CancellationToken::new();
    let cycle: Vec<Scenario> = Scenario::CYCLE
        .into_iter()
        .filter(|s| args.scenarios.is_empty() || args.scenarios.contains(s))
        .collect();
    let scheduler = tokio::spawn(workload::schedule(
        Arc::clone(&w),
        cycle,
        args.every,
        args.max_in_flight,
        stop.clone(),
    ));
    let chaos_task = (!args.no_chaos).then(|| {
        tokio::spawn(chaos::run(
            Arc::clone(&dep),
            args.chaos_every,
            args.down_for,
            stop.clone(),
            Arc::clone(&r.chaos),
        ))
    });
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        () = tokio::time::sleep(Duration::from_secs_f64(args.minutes * 60.0)) => {}
        _ = tokio::signal::ctrl_c() => errln!("soak: interrupted: draining and reporting what ran"),
        _ = term.recv() => errln!("soak: SIGTERM: draining and reporting what ran"),
    }
    stop.cancel();
    let workload_end_ms = unix_ms();
    let mut drivers = scheduler.await?;
    if let Some(c) = chaos_task {
        // A stop under way finishes (the service is started again).
        c.await?;
    }
    start_all(&dep, false).await?;
    errln!(
        "soak: workload and chaos stopped; draining for up to {:.0} s",
        args.drain.as_secs_f64()
    );

    // The drain: the drivers finish, every submitted run ends, or the drain's time is up.
    let drain_until = Instant::now() + args.drain;
    loop {
        while drivers.try_join_next().is_some() {}
        let open = {
            let l = ledger::lock(&ledger);
            l.submitted
                .keys()
                .filter(|run| !l.runs.get(run).is_some_and(ledger::Observed::ended))
                .count()
        };
        if (drivers.is_empty() && open == 0) || Instant::now() >= drain_until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    drivers.abort_all();
    let end_ms = unix_ms();

    // What the records say of runs without an end event, and the teammates' conversations.
    let open: Vec<flotilla_model::ids::RunId> = {
        let l = ledger::lock(&ledger);
        l.submitted
            .keys()
            .filter(|run| !l.runs.get(run).is_some_and(ledger::Observed::ended))
            .copied()
            .collect()
    };
    let mut records = HashMap::new();
    for run in open {
        if let Ok(view) = w.client.run(run).await {
            records.insert(run, view.map(|v| v.record.status));
        }
    }
    let teammates = ledger::lock(&ledger).teammates.clone();
    let mut checks = Vec::new();
    for t in &teammates {
        let c = workload::conversation(&w.team, &t.team, &t.name)
            .await
            .unwrap_or_default();
        let texts: Vec<String> = t.messages.iter().map(|(m, _)| m.clone()).collect();
        checks.push(report::TeammateCheck {
            name: t.name.clone(),
            received: workload::received_counts(&c, &texts),
        });
    }
    let (effects, effects_unparsed) =
        report::parse_effects(&std::fs::read_to_string(&files.effects).unwrap_or_default());

    shutdown.cancel();
    for b in background {
        let _ = b.await;
    }
    chaos::lock(&dep).stop_all(Duration::from_secs(30));
    drop(server);

    let (stuck, sampling) = {
        let t = r.stuck.lock().unwrap_or_else(PoisonError::into_inner);
        (
            t.episodes.clone(),
            report::ConsumerSampling {
                rounds: t.rounds,
                failed_rounds: t.failed_rounds,
                consumers: t.consumers(),
            },
        )
    };
    let settings = report::Settings {
        minutes: (workload_end_ms - started_ms) as f64 / 60_000.0,
        build: format!(
            "{}{}",
            if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            },
            args.services_binary
                .as_ref()
                .map_or(String::new(), |p| format!(", services {}", p.display()))
        ),
        every_ms: args.every.as_millis() as u64,
        max_in_flight: args.max_in_flight,
        chaos_every_s: if args.no_chaos {
            0.0
        } else {
            args.chaos_every.as_secs_f64()
        },
        down_for_s: args.down_for.as_secs_f64(),
        window_s: args.window.as_secs_f64(),
        rss_warm_up_s: args.rss_warm_up.as_secs_f64(),
        stuck_after_s: args.stuck_after.as_secs_f64(),
        drain_s: args.drain.as_secs_f64(),
        rss_slope_target: args.rss_slope_target,
        rss_min_span_s: args.rss_min_span.as_secs_f64(),
        worker_concurrency: args.concurrency,
        started_ms,
        workload_end_ms,
        end_ms,
        nats_server: nats_version,
    };
    let l = ledger::lock(&r.ledger);
    let rss = take(&r.rss);
    let chaos_log = take(&r.chaos);
    let exits = take(&r.exits);
    let report = report::compute(&report::Inputs {
        settings,
        ledger: &l,
        effects: &effects,
        effects_unparsed,
        records: &records,
        teammates: &checks,
        services: &services,
        rss: &rss,
        chaos: &chaos_log,
        exits: &exits,
        stuck: &stuck,
        sampling,
        saturated_ticks: w.saturated.load(Ordering::Relaxed),
        peak_in_flight: w.peak_in_flight.load(Ordering::Relaxed),
        console_requests: w.console_requests.load(Ordering::Relaxed),
        console_failures: w.console_failures.load(Ordering::Relaxed),
    });
    std::fs::write(dir.join("runs.tsv"), report::runs_tsv(&l, &records))
        .context("writing runs.tsv")?;
    std::fs::write(dir.join("rss.tsv"), report::rss_tsv(&services, &rss))
        .context("writing rss.tsv")?;
    let md = report::markdown(&report);
    if let Some(path) = &args.report {
        std::fs::write(path, &md).with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        out!("{md}");
    }
    let passed = report.passed();
    errln!(
        "soak: {}",
        if passed {
            "every target met".to_owned()
        } else {
            let missed: Vec<&str> = report
                .targets
                .iter()
                .filter(|t| t.pass == Some(false))
                .map(|t| t.check.as_str())
                .collect();
            format!("targets missed: {}", missed.join(", "))
        }
    );
    Ok(passed)
}

/// Starts every slot that is not running and waits until each says it is ready. `strict`
/// (the first start): one that does not is an error; else it is said, and the soak goes on.
async fn start_all(dep: &SharedDeployment, strict: bool) -> anyhow::Result<()> {
    let addrs: Vec<(usize, String, std::net::SocketAddr)> = {
        let mut d = chaos::lock(dep);
        let mut out = Vec::new();
        for i in 0..d.slots.len() {
            if !d.running(i) {
                d.start(i)?;
            }
            d.slots[i].held = false;
            out.push((i, d.slots[i].name.clone(), d.slots[i].health));
        }
        out
    };
    for (i, name, addr) in addrs {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if ready(addr).await {
                chaos::lock(dep).slots[i].ready_ms.get_or_insert(unix_ms());
                break;
            }
            if Instant::now() >= deadline {
                anyhow::ensure!(
                    !strict,
                    "{name} did not say it was ready within 2 minutes (its log is in the soak's logs/)"
                );
                errln!("soak: {name} is still not ready; going on without it");
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    Ok(())
}

/// Every `every`: each running service's resident memory (and the nats-server's).
async fn sample_rss(
    dep: SharedDeployment,
    nats_pid: Option<u32>,
    started_ms: i64,
    every: Duration,
    out: Arc<Mutex<Vec<RssSample>>>,
    stop: CancellationToken,
) {
    loop {
        let at = unix_ms();
        let mut batch = Vec::new();
        {
            let d = chaos::lock(&dep);
            for (i, slot) in d.slots.iter().enumerate() {
                if let Some(kib) = d.pid(i).and_then(rss_kib) {
                    batch.push(RssSample {
                        service: i,
                        incarnation: slot.incarnation,
                        started_ms: slot.started_ms,
                        at_ms: at,
                        kib,
                    });
                }
            }
            if let Some(kib) = nats_pid.and_then(rss_kib) {
                batch.push(RssSample {
                    service: d.slots.len(),
                    incarnation: 1,
                    started_ms,
                    at_ms: at,
                    kib,
                });
            }
        }
        out.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(batch);
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}

/// Every 2 s: the durable consumers, judged against when their services were last all up.
async fn sample_consumers(
    bus: Bus,
    dep: SharedDeployment,
    stuck: Arc<Mutex<consumers::StuckTracker>>,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
        // Services started by the exit watcher are not waited for: ask them here.
        let unconfirmed: Vec<(usize, std::net::SocketAddr)> = {
            let d = chaos::lock(&dep);
            d.slots
                .iter()
                .enumerate()
                .filter(|(i, s)| !s.held && s.ready_ms.is_none() && d.running(*i))
                .map(|(i, s)| (i, s.health))
                .collect()
        };
        for (i, addr) in unconfirmed {
            if ready(addr).await {
                chaos::lock(&dep).slots[i].ready_ms.get_or_insert(unix_ms());
            }
        }
        let Ok(samples) = consumers::sample(&bus).await else {
            stuck
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .failed_rounds += 1;
            continue;
        };
        let at = unix_ms();
        let d = chaos::lock(&dep);
        let mut t = stuck.lock().unwrap_or_else(PoisonError::into_inner);
        t.rounds += 1;
        for s in &samples {
            let owners = consumers::owners(s.stream, &s.name);
            let quiet = d
                .slots
                .iter()
                .enumerate()
                .filter(|(_, slot)| owners.contains(&slot.kind))
                .map(|(i, slot)| match slot.ready_ms {
                    Some(r) if !slot.held && d.running(i) => r,
                    _ => at,
                })
                .max()
                .unwrap_or(at);
            let was = t.episodes.len();
            t.observe(at, s, quiet);
            if t.episodes.len() > was {
                errln!(
                    "soak: consumer {} looks stuck: {} pending, no pull waiting, ack floor {} unmoved",
                    s.key(),
                    s.pending,
                    s.ack_floor
                );
            }
        }
    }
}

/// A line on stderr every minute: what was submitted and ended so far.
async fn progress(w: Arc<Workload>, started_ms: i64, stop: CancellationToken) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(Duration::from_secs(60)) => {}
        }
        let (submitted, ended, errors) = {
            let l = ledger::lock(&w.ledger);
            let ended = l
                .submitted
                .keys()
                .filter(|r| l.runs.get(r).is_some_and(ledger::Observed::ended))
                .count();
            (l.submitted.len(), ended, l.driver_errors.len())
        };
        errln!(
            "soak: {:.0} min: {} scenarios started, {submitted} runs submitted, {ended} ended, {errors} driver errors",
            (unix_ms() - started_ms) as f64 / 60_000.0,
            w.started.load(Ordering::Relaxed)
        );
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    /// `SoakArgs` as the CLI takes them.
    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        soak: SoakArgs,
    }

    #[test]
    fn the_flags_form_one_valid_command_and_reach_the_soak() {
        Cli::command().debug_assert();
        let a = Cli::try_parse_from([
            "soak",
            "--minutes",
            "5",
            "--json",
            "--report",
            "soak.md",
            "--scenarios",
            "single,task-pause",
            "--chaos-every",
            "30s",
        ])
        .expect("valid flags")
        .soak;
        assert_eq!(a.minutes, 5.0);
        assert!(a.json);
        assert_eq!(a.report, Some(PathBuf::from("soak.md")));
        assert_eq!(a.scenarios, vec![Scenario::Single, Scenario::TaskPause]);
        assert_eq!(a.chaos_every, Duration::from_secs(30));
        // The defaults the docs promise.
        assert_eq!(a.every, Duration::from_secs(1));
        assert_eq!(a.drain, Duration::from_secs(180));
        assert_eq!(a.rss_warm_up, Duration::from_secs(180));
        assert_eq!(a.rss_min_span, Duration::from_secs(1200));
        assert_eq!(a.stuck_after, Duration::from_secs(10));
        assert_eq!(a.rss_slope_target, 5.0);
        assert_eq!(a.max_in_flight, 32);
    }
}
