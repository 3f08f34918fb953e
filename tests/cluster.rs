//! Flotilla on a three-node JetStream cluster (streams and buckets at replicas 3, every node
//! with `sync_interval: always`), with nodes killed by SIGKILL mid-run — the leaders of the
//! run-log and event streams and of the runs bucket — and started again after a moment.
//!
//! A node kill is a transient fault: for a few seconds the streams it led have no leader and
//! JetStream answers publishes with "no responders" (what an unprovisioned stream answers
//! too). Nothing may end a run on it. Checked for every acknowledged submission: the run ends
//! `succeeded`, none is lost, every task attempt's result is applied once, and the run's end
//! event is stored (a follower of the event stream sees the end).
//!
//! The coordinator and the workers are separate `flotilla` processes, connected to all three
//! nodes. The CI test is small (three kills, about a minute); the long run
//! (`scripts/cluster-chaos`, an ignored test here) takes its sizes from the environment and
//! prints the figures `docs/performance.md` reports.

mod support;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use flotilla_bus::{Bus, JetStreamOptions};
use flotilla_client::Client;
use flotilla_model::ids::RunId;
use flotilla_model::plan::Subtask;
use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::subjects::{Bucket, StreamKind};
use flotilla_model::submit::SubmitRequest;
use flotilla_model::time::Timestamp;
use flotilla_testkit::NatsCluster;
use support::{plan, results_of, wait_for_api};
use tokio::sync::Mutex;
use tokio::time::Instant;

const AGENTS: &str = r#"
default-agent = "step"
[agents.step]
kind = "scripted"
reply = "{task_id} ok"
delay = "50ms"
"#;

/// `flotilla` processes against the cluster.
struct Services {
    config: PathBuf,
    dir: tempfile::TempDir,
    children: Vec<std::process::Child>,
}

impl Services {
    fn new(cluster: &NatsCluster) -> anyhow::Result<Self> {
        Self::with_nats(cluster, "")
    }

    /// Services whose `[nats]` section also has `nats` (one `key = value` per line).
    fn with_nats(cluster: &NatsCluster, nats: &str) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let config = dir.path().join("flotilla.toml");
        let urls: Vec<String> = cluster.urls().iter().map(|u| format!("{u:?}")).collect();
        std::fs::write(
            &config,
            format!(
                "pools = [\"default\"]\n{AGENTS}\n[nats]\nurls = [{}]\n{nats}\n\n[jetstream]\nreplicas = 3\n\n[coordinator]\nack-wait = \"2s\"\n\n[worker]\nheartbeat = \"300ms\"\nshutdown-grace = \"10s\"\nstarted-event-delay = \"0s\"\n",
                urls.join(", ")
            ),
        )?;
        Ok(Self {
            config,
            dir,
            children: Vec::new(),
        })
    }

    fn spawn(&mut self, args: &[&str]) -> anyhow::Result<usize> {
        let i = self.children.len();
        let log = std::fs::File::create(self.dir.path().join(format!("p{i}.log")))?;
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
            .arg("--config")
            .arg(&self.config)
            .args(args)
            .env(
                "FLOTILLA_LOG",
                std::env::var("TEST_FLOTILLA_LOG").unwrap_or_else(|_| "info".into()),
            )
            .env("FLOTILLA_TELEMETRY__HTTP_ADDR", "off")
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.children.push(child);
        Ok(i)
    }

    /// How process `i` exited, if it did.
    fn exited(&mut self, i: usize) -> anyhow::Result<Option<std::process::ExitStatus>> {
        Ok(self.children[i].try_wait()?)
    }

    fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("p{i}.log"))).unwrap_or_default()
    }

    /// Every process's log lines at WARN and above (what a failure report needs).
    fn warnings(&self) -> String {
        (0..self.children.len())
            .flat_map(|i| {
                self.log(i)
                    .lines()
                    .filter(|l| l.contains("WARN") || l.contains("ERROR"))
                    .map(|l| format!("p{i}: {l}"))
                    .collect::<Vec<_>>()
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Services {
    fn drop(&mut self) {
        // `CHAOS_KEEP_LOGS=<dir>` keeps every process's log for a closer look.
        if let Some(to) = std::env::var_os("CHAOS_KEEP_LOGS") {
            let to = PathBuf::from(to);
            let _ = std::fs::create_dir_all(&to);
            for i in 0..self.children.len() {
                let name = format!("p{i}.log");
                let _ = std::fs::copy(self.dir.path().join(&name), to.join(name));
            }
        }
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// What a chaos run does.
#[derive(Debug, Clone)]
struct Chaos {
    /// Runs submitted, evenly over the kills.
    runs: usize,
    /// How many node kills, cycling through [`TARGETS`].
    kills: usize,
    /// How long a killed node stays down, cycling.
    down: Vec<Duration>,
    /// A new run every …
    every: Duration,
    /// Tasks per run (a chain).
    chain: usize,
    coordinators: usize,
    workers: usize,
}

/// Which node each kill takes: the leader of …
const TARGETS: [Target; 4] = [
    Target::Stream(StreamKind::RunLog),
    Target::Stream(StreamKind::Events),
    Target::Bucket(Bucket::Runs),
    Target::Stream(StreamKind::Tasks),
];

#[derive(Debug, Clone, Copy)]
enum Target {
    Stream(StreamKind),
    Bucket(Bucket),
}

impl Target {
    fn stream(self, bus: &Bus) -> String {
        match self {
            Self::Stream(k) => bus.names().stream(k),
            Self::Bucket(b) => format!("KV_{}", bus.names().bucket(b)),
        }
    }
}

/// One kill: which stream's leader, how long the election took, when the node was down.
#[derive(Debug)]
struct Kill {
    stream: String,
    node: usize,
    new_leader: Duration,
    from: Instant,
    /// When the restarted node was healthy again.
    to: Instant,
}

/// One acknowledged run: submitted at, ended at (end event seen), its outcome.
#[derive(Debug)]
struct Done {
    run: RunId,
    submitted: Instant,
    /// The same moment on the wall clock (Unix ms), for timelines against server times.
    submitted_ms: i64,
    latency: Duration,
    status: RunStatus,
    reason: Option<String>,
}

#[derive(Debug, Default)]
struct Report {
    acknowledged: usize,
    /// Submissions that needed more than one publish (refused or unanswered during a kill).
    submit_retries: usize,
    done: Vec<Done>,
    /// Runs whose end was not seen in time (lost, or an end without its event).
    unended: Vec<(RunId, String)>,
    kills: Vec<Kill>,
    /// Exactly-once violations.
    violations: Vec<String>,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

impl Report {
    fn failures(&self) -> Vec<&Done> {
        self.done
            .iter()
            .filter(|d| d.status != RunStatus::Succeeded)
            .collect()
    }

    /// Latencies of runs alive during a kill (submitted before the node was healthy again and
    /// ended after it died) and of the others.
    fn latencies(&self) -> (Vec<Duration>, Vec<Duration>) {
        let (mut with, mut without) = (Vec::new(), Vec::new());
        for d in &self.done {
            let end = d.submitted + d.latency;
            if self
                .kills
                .iter()
                .any(|k| d.submitted < k.to && end > k.from)
            {
                with.push(d.latency);
            } else {
                without.push(d.latency);
            }
        }
        with.sort();
        without.sort();
        (with, without)
    }

    fn summary(&self) -> String {
        let (with, without) = self.latencies();
        let mut elections: Vec<Duration> = self.kills.iter().map(|k| k.new_leader).collect();
        elections.sort();
        let mut out = format!(
            "cluster chaos: {} runs acknowledged ({} submissions retried), {} kills, {} not succeeded, {} without an end, {} exactly-once violations\n",
            self.acknowledged,
            self.submit_retries,
            self.kills.len(),
            self.failures().len(),
            self.unended.len(),
            self.violations.len()
        );
        out += &format!(
            "run latency without a kill: n={} p50={:.1} ms p99={:.1} ms\n",
            without.len(),
            ms(percentile(&without, 0.5)),
            ms(percentile(&without, 0.99))
        );
        out += &format!(
            "run latency across a kill:  n={} p50={:.1} ms p99={:.1} ms max={:.1} ms\n",
            with.len(),
            ms(percentile(&with, 0.5)),
            ms(percentile(&with, 0.99)),
            ms(with.last().copied().unwrap_or_default())
        );
        out += &format!(
            "time to a new leader: p50={:.0} ms max={:.0} ms\n",
            ms(percentile(&elections, 0.5)),
            ms(elections.last().copied().unwrap_or_default())
        );
        for k in &self.kills {
            out += &format!(
                "  kill n{} (leader of {}): new leader after {:.0} ms, back and current after {:.1} s\n",
                k.node,
                k.stream,
                ms(k.new_leader),
                (k.to - k.from).as_secs_f64()
            );
        }
        for d in self.failures() {
            out += &format!("  run {} {:?}: {:?}\n", d.run, d.status, d.reason);
        }
        for (run, why) in &self.unended {
            out += &format!("  run {run}: {why}\n");
        }
        for v in &self.violations {
            out += &format!("  {v}\n");
        }
        out
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn chain(n: usize) -> flotilla_model::Plan {
    plan(
        (0..n)
            .map(|i| {
                let t = Subtask::new(&format!("s{i}"), "step");
                if i == 0 {
                    t
                } else {
                    t.after(&[&format!("s{}", i - 1)])
                }
            })
            .collect(),
    )
}

/// Submits `req` until JetStream acknowledges it (the same run id each time: a repeat is a
/// no-op). Returns how many publishes it took.
async fn submit_acknowledged(client: &Client, req: SubmitRequest) -> anyhow::Result<usize> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut tries = 0;
    loop {
        tries += 1;
        match client.submit(req.clone()).await {
            Ok(_) => return Ok(tries),
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Every task succeeded with one stored result per attempt, applied once.
async fn exactly_once(bus: &Bus, run: RunId) -> anyhow::Result<Option<String>> {
    let results = results_of(bus, run).await?;
    let mut per_attempt: HashMap<(String, u32), usize> = HashMap::new();
    for (task, attempt, _) in &results {
        *per_attempt.entry((task.clone(), *attempt)).or_default() += 1;
    }
    if let Some(((task, attempt), n)) = per_attempt.iter().find(|(_, n)| **n > 1) {
        return Ok(Some(format!(
            "run {run}: task {task} attempt {attempt} has {n} stored results"
        )));
    }
    let store = flotilla_coordinator::store::RunStore::open(bus).await?;
    let Some(view) = store.view(run, 0, usize::MAX).await? else {
        return Ok(Some(format!("run {run}: no record")));
    };
    if view.record.status != RunStatus::Succeeded {
        return Ok(Some(format!(
            "run {run}: its end event said succeeded, its record says {:?}",
            view.record.status
        )));
    }
    if let Some(t) = view
        .tasks
        .iter()
        .find(|t| t.status != TaskStatus::Succeeded)
    {
        return Ok(Some(format!(
            "run {run}: task {} is {:?}",
            t.task_id, t.status
        )));
    }
    let state = store
        .load(run)
        .await?
        .map(|s| s.snapshot.state)
        .ok_or_else(|| anyhow::anyhow!("run {run}: no snapshot"))?;
    let attempts: u32 = state.tasks.iter().map(|t| t.attempt).sum();
    if state.applied != 1 + u64::from(attempts) {
        return Ok(Some(format!(
            "run {run}: {} inputs applied for {attempts} attempts (an input applied twice)",
            state.applied
        )));
    }
    Ok(None)
}

/// What happened to `run`, in milliseconds after its submission: its run-log entries (server
/// time) and its events (publisher time). For the report on the slowest run.
async fn timeline(
    client: &Client,
    bus: &Bus,
    done: &Done,
    kills: &[Kill],
) -> anyhow::Result<String> {
    use flotilla_model::runlog::RunInput;
    use futures::StreamExt;
    let at = |ms: i64| ms - done.submitted_ms;
    let since = |t: Instant| match t.checked_duration_since(done.submitted) {
        Some(d) => d.as_millis() as i64,
        None => -(done.submitted.duration_since(t).as_millis() as i64),
    };
    let mut lines = Vec::new();
    for k in kills {
        lines.push((
            since(k.from),
            format!("node n{} killed (leader of {})", k.node, k.stream),
        ));
        lines.push((
            since(k.from + k.new_leader),
            format!("{} has a new leader", k.stream),
        ));
        lines.push((since(k.to), format!("node n{} back and current", k.node)));
    }
    let store = flotilla_coordinator::store::RunStore::open(bus).await?;
    for (seq, ts, entry) in store.history(done.run).await? {
        let what = match &entry.input {
            RunInput::TaskResult(r) => format!(
                "result {} attempt {} ok={} by {}",
                r.task_id, r.attempt, r.result.success, r.worker
            ),
            other => format!("{other:?}").chars().take(40).collect(),
        };
        lines.push((at(ts.unix_ms()), format!("runlog #{seq}: {what}")));
    }
    let events = client.events(done.run).await?;
    futures::pin_mut!(events);
    while let Ok(Some(Ok(e))) = tokio::time::timeout(Duration::from_secs(2), events.next()).await {
        let what: String = format!("{:?}", e.event).chars().take(60).collect();
        lines.push((
            at(e.ts.unix_ms()),
            format!(
                "event {} {what}",
                e.task_id.map(|t| t.to_string()).unwrap_or_default()
            ),
        ));
    }
    lines.sort();
    // Without a submission time (a run whose end was not seen), times count from its first
    // record.
    if done.submitted_ms == 0
        && let Some(&(first, _)) = lines.first()
    {
        for l in &mut lines {
            l.0 -= first;
        }
    }
    Ok(lines
        .into_iter()
        .map(|(ms, l)| format!("  +{ms:>6} ms {l}"))
        .collect::<Vec<_>>()
        .join("\n"))
}

/// Runs `chaos` on a fresh cluster and reports what happened.
async fn run_chaos(chaos: Chaos) -> anyhow::Result<(Report, Services)> {
    let mut cluster = NatsCluster::builder().sync_always(true).start().await?;
    let bus = Bus::connect(&cluster.nats_options(), "flotilla-test").await?;
    bus.provision(&JetStreamOptions {
        replicas: 3,
        ..JetStreamOptions::default()
    })
    .await?;
    let client = Client::new(bus.clone());
    let mut services = Services::new(&cluster)?;
    for _ in 0..chaos.coordinators {
        services.spawn(&["coordinator"])?;
    }
    wait_for_api(&bus).await?;
    for _ in 0..chaos.workers {
        services.spawn(&["worker", "--concurrency", "16"])?;
    }
    // Warm-up: a run through every process before any fault.
    let warm = SubmitRequest::new(chain(1));
    let warm_id = client.submit(warm).await?;
    anyhow::ensure!(
        client.wait(warm_id, Duration::from_secs(60)).await?.status == RunStatus::Succeeded,
        "warm-up run failed:\n{}",
        services.warnings()
    );

    let report = Arc::new(Mutex::new(Report::default()));
    let submitting = {
        let (client, report, chaos) = (client.clone(), Arc::clone(&report), chaos.clone());
        tokio::spawn(async move {
            let mut waits = tokio::task::JoinSet::new();
            let mut tick = tokio::time::interval(chaos.every);
            for _ in 0..chaos.runs {
                tick.tick().await;
                let run = RunId::new();
                let mut req = SubmitRequest::new(chain(chaos.chain));
                req.run_id = Some(run);
                let submitted = Instant::now();
                let submitted_ms = Timestamp::now().unix_ms();
                let (client, report) = (client.clone(), Arc::clone(&report));
                waits.spawn(async move {
                    let tries = match submit_acknowledged(&client, req).await {
                        Ok(t) => t,
                        Err(e) => {
                            eprintln!("run {run} never acknowledged: {e}");
                            return;
                        }
                    };
                    {
                        let mut r = report.lock().await;
                        r.acknowledged += 1;
                        r.submit_retries += usize::from(tries > 1);
                    }
                    let outcome = client.wait(run, Duration::from_secs(90)).await;
                    let mut r = report.lock().await;
                    match outcome {
                        Ok(o) => r.done.push(Done {
                            run,
                            submitted,
                            submitted_ms,
                            latency: submitted.elapsed(),
                            status: o.status,
                            reason: o.reason,
                        }),
                        Err(e) => r.unended.push((run, e.to_string())),
                    }
                });
            }
            while waits.join_next().await.is_some() {}
        })
    };

    // Kills spread over the submission period, each after a quiet spell.
    let period = chaos.every * chaos.runs as u32;
    let gap = period / (chaos.kills as u32 + 1);
    for k in 0..chaos.kills {
        tokio::time::sleep(gap.saturating_sub(Duration::from_secs(2))).await;
        let target = TARGETS[k % TARGETS.len()];
        let stream = target.stream(&bus);
        let (node, from) = cluster.kill_stream_leader(&stream).await?;
        let (_, new_leader) = cluster
            .wait_for_stream_leader(&stream, Some(node), from, Duration::from_secs(30))
            .await?;
        let down = chaos.down[k % chaos.down.len()];
        tokio::time::sleep(down.saturating_sub(from.elapsed())).await;
        cluster.start_node(node).await?;
        eprintln!(
            "killed n{node} (leader of {stream}): a new leader after {new_leader:?}, back after {:?}",
            from.elapsed()
        );
        report.lock().await.kills.push(Kill {
            stream,
            node,
            new_leader,
            from,
            to: Instant::now(),
        });
    }
    submitting.await?;
    let mut report = Arc::try_unwrap(report)
        .map_err(|_| anyhow::anyhow!("report still shared"))?
        .into_inner();
    let succeeded: Vec<RunId> = report
        .done
        .iter()
        .filter(|d| d.status == RunStatus::Succeeded)
        .map(|d| d.run)
        .collect();
    for run in succeeded {
        if let Some(v) = exactly_once(&bus, run).await? {
            report.violations.push(v);
        }
    }
    // What the store says of runs whose end was not seen: for the report.
    for (run, _) in report.unended.iter().take(3) {
        let view = client.run(*run).await;
        let status = match &view {
            Ok(Some(v)) => format!(
                "record {:?}, tasks {:?}",
                v.record.status,
                v.tasks
                    .iter()
                    .map(|t| (t.task_id.to_string(), t.status, t.attempts))
                    .collect::<Vec<_>>()
            ),
            Ok(None) => "no record".into(),
            Err(e) => format!("unreadable: {e}"),
        };
        let unended = Done {
            run: *run,
            submitted: Instant::now(),
            submitted_ms: 0,
            latency: Duration::ZERO,
            status: RunStatus::Running,
            reason: None,
        };
        eprintln!(
            "run {run} without an end: {status}\n{}",
            timeline(&client, &bus, &unended, &[]).await?
        );
    }
    if let Some(slowest) = report.done.iter().max_by_key(|d| d.latency) {
        eprintln!(
            "the slowest run, {} ({:?}):\n{}",
            slowest.run,
            slowest.latency,
            timeline(&client, &bus, slowest, &report.kills).await?
        );
    }
    drop(cluster);
    Ok((report, services))
}

fn check(report: &Report, services: &Services, runs: usize) {
    let summary = report.summary();
    eprintln!("{summary}");
    let ok = report.acknowledged == runs
        && report.done.len() == runs
        && report.failures().is_empty()
        && report.unended.is_empty()
        && report.violations.is_empty();
    assert!(
        ok,
        "{summary}\nwarnings and errors of the services:\n{}",
        services.warnings()
    );
}

#[tokio::test]
async fn killing_stream_leaders_fails_no_run() -> anyhow::Result<()> {
    let runs = 60;
    let (report, services) = run_chaos(Chaos {
        runs,
        kills: 3,
        down: vec![Duration::from_millis(1_500)],
        every: Duration::from_millis(250),
        chain: 3,
        // Two, as deployed: runs whose messages alternate between coordinators, starts
        // rebuilt by one while the other has not recorded them, reads of a replica behind.
        coordinators: 2,
        workers: 2,
    })
    .await?;
    assert_eq!(report.kills.len(), 3);
    check(&report, &services, runs);
    Ok(())
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The long run behind `scripts/cluster-chaos`: sizes from `CHAOS_RUNS`, `CHAOS_KILLS`,
/// `CHAOS_EVERY_MS`, `CHAOS_CHAIN`, `CHAOS_COORDINATORS`, `CHAOS_WORKERS`; nodes stay down
/// 1–4 s.
#[tokio::test]
#[ignore = "the long run: scripts/cluster-chaos"]
async fn cluster_chaos_long_run() -> anyhow::Result<()> {
    let runs = env_or("CHAOS_RUNS", 420);
    let chaos = Chaos {
        runs,
        kills: env_or("CHAOS_KILLS", 7),
        down: [1_000, 2_500, 4_000, 1_500]
            .into_iter()
            .map(Duration::from_millis)
            .collect(),
        every: Duration::from_millis(env_or("CHAOS_EVERY_MS", 250)),
        chain: env_or("CHAOS_CHAIN", 3),
        coordinators: env_or("CHAOS_COORDINATORS", 2),
        workers: env_or("CHAOS_WORKERS", 2),
    };
    eprintln!("{chaos:?}");
    let (report, services) = run_chaos(chaos).await?;
    check(&report, &services, runs);
    Ok(())
}

/// Takes `subject` out of the subjects `stream` captures, so publishes to it find no stream
/// (the "no responders" a stream without a leader answers during an election), or puts it
/// back.
async fn capture(bus: &Bus, stream: &str, subject: &str, yes: bool) -> anyhow::Result<()> {
    let info = bus.js().get_stream(stream).await?.info().await?.clone();
    let mut config = info.config;
    config.subjects.retain(|s| s != subject);
    if yes {
        config.subjects.push(subject.to_owned());
    }
    bus.js().update_stream(config).await?;
    Ok(())
}

#[tokio::test]
async fn a_result_waiting_for_its_stream_keeps_its_task() -> anyhow::Result<()> {
    // While a result cannot be stored (the run log has no leader for a few seconds), the
    // worker holding the task must keep its message alive: were the ack wait (1.5 heartbeats:
    // 450 ms here) to pass, the task would be redelivered and the attempt run a second time.
    // One server; results find no stream for 3 s, as during an election.
    let log = support::ExecutionLog::new()?;
    let mut p = support::Processes::start(&log.agent_config("0.3")).await?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "1"]).await?;
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![Subtask::new("t", "")])))
        .await?;
    support::task_started(&p.client, run, "t").await?;
    let runlog = p.bus.names().stream(StreamKind::RunLog);
    let results = format!("{}.runlog.*", p.bus.names().prefix());
    capture(&p.bus, &runlog, &results, false).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    capture(&p.bus, &runlog, &results, true).await?;
    let outcome = p.client.wait(run, support::WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded);
    assert_eq!(log.executions()?, vec!["t"], "the attempt ran once");
    Ok(())
}

/// A coordinator and a worker started while the cluster has no quorum — two of its three
/// nodes down, so no stream has a leader and JetStream answers nothing, or "temporarily
/// unavailable" — wait, saying what they wait for, instead of exiting; once the nodes are
/// back both come up and a run succeeds (issue 38: both exited with code 2 after a request
/// timed out, "reading stream FLOTILLA_… timed out").
#[tokio::test]
async fn services_started_while_the_cluster_has_no_leader_wait_and_come_up() -> anyhow::Result<()> {
    let mut cluster = NatsCluster::builder().sync_always(true).start().await?;
    // A deployment that ran before: provisioned at replicas 3.
    let opts = JetStreamOptions {
        replicas: 3,
        ..JetStreamOptions::default()
    };
    cluster.bus().provision(&opts).await?;
    cluster.kill_node(1);
    cluster.kill_node(2);
    // Requests time out quickly here: without waiting, each service would give up at once.
    let mut services = Services::with_nats(&cluster, "request-timeout = \"2s\"")?;
    let coordinator = services.spawn(&["coordinator"])?;
    let worker = services.spawn(&["worker"])?;
    let supervisor = services.spawn(&["supervisor"])?;
    let deadline = Instant::now() + Duration::from_secs(60);
    for i in [coordinator, worker, supervisor] {
        while !services.log(i).contains("not answering for now") {
            if let Some(status) = services.exited(i)? {
                anyhow::bail!("process {i} exited with {status}:\n{}", services.log(i));
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "process {i} never said what it waits for:\n{}",
                services.log(i)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    for i in [coordinator, worker, supervisor] {
        if let Some(status) = services.exited(i)? {
            anyhow::bail!("process {i} exited with {status}:\n{}", services.log(i));
        }
    }

    cluster.start_node(1).await?;
    cluster.start_node(2).await?;
    let client = Client::new(cluster.bus().clone());
    let run = RunId::new();
    let mut req = SubmitRequest::new(chain(2));
    req.run_id = Some(run);
    submit_acknowledged(&client, req).await?;
    let outcome = client
        .wait(run, Duration::from_secs(60))
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "{e}\ncoordinator:\n{}\nworker:\n{}",
                services.log(coordinator),
                services.log(worker)
            )
        })?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    // The supervisor came up too: the team answers.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let asked = client
            .request(
                &flotilla_model::team::TeamListRequest {
                    protocol: flotilla_model::PROTOCOL_VERSION,
                    role: None,
                },
                Duration::from_secs(5),
            )
            .await;
        if asked.is_ok() {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the supervisor never answered: {asked:?}\n{}",
            services.log(supervisor)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for i in [coordinator, worker, supervisor] {
        assert!(services.exited(i)?.is_none(), "{}", services.log(i));
    }
    Ok(())
}
