//! A service cut off from its NATS node — packets dropped, no socket closed, as in a network
//! partition — notices within three pings (9 s at the default `nats.ping-interval`, under
//! two worker heartbeats), says so, and reconnects to another node of the cluster; runs keep
//! succeeding.
//!
//! A coordinator and a worker, separate `flotilla` processes, run on a three-node cluster.
//! Each reaches every node through a proxy of its own (the test kit's `TcpProxy`), and
//! `nats.discover-servers = false` keeps them to those (the nodes advertise their direct
//! addresses, which a real cut would not spare). The test blackholes the proxy each service
//! is connected through: the services see nothing close, only silence.

mod support;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, anyhow, ensure};
use flotilla_bus::{Bus, JetStreamOptions};
use flotilla_client::Client;
use flotilla_model::ids::RunId;
use flotilla_model::plan::Subtask;
use flotilla_model::run::RunStatus;
use flotilla_model::submit::SubmitRequest;
use flotilla_testkit::NatsCluster;
use flotilla_testkit::proxy::TcpProxy;
use support::{plan, wait_for_api};
use tokio::time::Instant;

const CONFIG: &str = r#"
pools = ["default"]
default-agent = "step"

[agents.step]
kind = "scripted"
reply = "{task_id} ok"
delay = "50ms"

[nats]
# Only the URLs given (one proxy per node), not the addresses the nodes advertise.
discover-servers = false

[jetstream]
replicas = 3
"#;

/// Generous bounds for conditions polled on a shared machine (never asserted as timings).
const WAIT: Duration = Duration::from_secs(90);

/// `flotilla` processes, each with NATS URLs of its own.
struct Services {
    config: PathBuf,
    dir: tempfile::TempDir,
    children: Vec<std::process::Child>,
}

impl Services {
    fn new() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let config = dir.path().join("flotilla.toml");
        std::fs::write(&config, CONFIG)?;
        Ok(Self {
            config,
            dir,
            children: Vec::new(),
        })
    }

    /// Starts `flotilla <role>` connecting through `proxies`.
    fn spawn(&mut self, role: &str, proxies: &[TcpProxy]) -> anyhow::Result<usize> {
        let i = self.children.len();
        let log = std::fs::File::create(self.dir.path().join(format!("p{i}.log")))?;
        let urls: Vec<String> = proxies.iter().map(TcpProxy::url).collect();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
            .arg("--config")
            .arg(&self.config)
            .arg(role)
            .env("FLOTILLA_NATS__URLS", urls.join(","))
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

    fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("p{i}.log"))).unwrap_or_default()
    }

    /// Whether process `i` logged a line with every one of `parts`.
    fn logged(&self, i: usize, parts: &[&str]) -> bool {
        self.log(i)
            .lines()
            .any(|l| parts.iter().all(|p| l.contains(p)))
    }
}

impl Drop for Services {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Submits a one-task run and waits for its outcome.
async fn one_task_run(client: &Client) -> anyhow::Result<(RunId, RunStatus)> {
    let run = client
        .submit(SubmitRequest::new(plan(vec![Subtask::new("only", "step")])))
        .await?;
    let outcome = client.wait(run, WAIT).await?;
    Ok((run, outcome.status))
}

/// The proxy of `proxies` carrying the service's connection, once it has one.
async fn connected_through(proxies: &[TcpProxy], what: &str) -> anyhow::Result<usize> {
    let deadline = Instant::now() + WAIT;
    loop {
        let busy: Vec<usize> = (0..proxies.len())
            .filter(|&i| proxies[i].connections() > 0)
            .collect();
        match busy.as_slice() {
            [one] => return Ok(*one),
            [] => {}
            many => {
                return Err(anyhow!(
                    "{what} is connected through {many:?}: one expected"
                ));
            }
        }
        ensure!(Instant::now() < deadline, "{what} never connected");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_cut_coordinator_and_worker_reconnect_to_other_nodes_and_runs_go_on() -> anyhow::Result<()>
{
    let cluster = NatsCluster::start(3).await?;
    cluster
        .bus()
        .provision(&JetStreamOptions {
            replicas: 3,
            ..JetStreamOptions::default()
        })
        .await?;
    let mut coordinator_proxies = Vec::new();
    let mut worker_proxies = Vec::new();
    for url in cluster.urls() {
        coordinator_proxies.push(TcpProxy::start(&url).await?);
        worker_proxies.push(TcpProxy::start(&url).await?);
    }
    let mut services = Services::new()?;
    let coordinator = services.spawn("coordinator", &coordinator_proxies)?;
    let worker = services.spawn("worker", &worker_proxies)?;
    let bus: &Bus = cluster.bus();
    wait_for_api(bus).await?;
    let client = Client::new(bus.clone());
    let (run, status) = one_task_run(&client).await?;
    ensure!(
        status == RunStatus::Succeeded,
        "{run} before the cut: {status:?}\n{}\n{}",
        services.log(coordinator),
        services.log(worker)
    );

    // Cut each service's link to its node.
    let c = connected_through(&coordinator_proxies, "the coordinator").await?;
    let w = connected_through(&worker_proxies, "the worker").await?;
    coordinator_proxies[c].blackhole();
    worker_proxies[w].blackhole();
    let cut = Instant::now();
    // A run submitted while they are cut off runs once they are back.
    let during = tokio::spawn({
        let client = client.clone();
        async move { one_task_run(&client).await }
    });

    // Each says it lost its server and reconnected to another one, by address.
    for (i, proxies, lost, what) in [
        (coordinator, &coordinator_proxies, c, "coordinator"),
        (worker, &worker_proxies, w, "worker"),
    ] {
        let lost_addr = proxies[lost].addr().to_string();
        let others: Vec<String> = (0..proxies.len())
            .filter(|&j| j != lost)
            .map(|j| proxies[j].addr().to_string())
            .collect();
        let deadline = Instant::now() + WAIT;
        while !(services.logged(i, &["Lost the connection to NATS", &lost_addr])
            && others
                .iter()
                .any(|o| services.logged(i, &["Reconnected to NATS", o])))
        {
            ensure!(
                Instant::now() < deadline,
                "the {what} did not reconnect elsewhere:\n{}",
                services.log(i)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        eprintln!(
            "{what}: reconnected to another node {:?} after the cut",
            cut.elapsed()
        );
        ensure!(
            (0..proxies.len()).any(|j| j != lost && proxies[j].connections() > 0),
            "the {what} holds no connection through another proxy"
        );
    }

    // Runs go on once both are back (a run's time is printed, not asserted).
    let started = Instant::now();
    let (run, status) = one_task_run(&client).await?;
    ensure!(
        status == RunStatus::Succeeded,
        "{run} right after the reconnect: {status:?}\n{}\n{}",
        services.log(coordinator),
        services.log(worker)
    );
    eprintln!(
        "a run submitted right after the reconnect took {:?}",
        started.elapsed()
    );
    let (run, status) = during.await.context("the run submitted during the cut")??;
    ensure!(
        status == RunStatus::Succeeded,
        "{run} submitted during the cut: {status:?}\n{}\n{}",
        services.log(coordinator),
        services.log(worker)
    );
    eprintln!(
        "a run submitted during the cut ended {:?} after it",
        cut.elapsed()
    );
    for _ in 0..3 {
        let started = Instant::now();
        let (run, status) = one_task_run(&client).await?;
        eprintln!("a later run took {:?}", started.elapsed());
        ensure!(
            status == RunStatus::Succeeded,
            "{run} after the reconnect: {status:?}\n{}\n{}",
            services.log(coordinator),
            services.log(worker)
        );
    }
    Ok(())
}
