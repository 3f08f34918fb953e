//! Shared set-up for end-to-end tests: a real nats-server from the test kit, with Flotilla
//! services either in this process (fast, for behaviour) or as separate `flotilla` processes
//! (for crashes and signals).
//!
//! Agents in these tests are the deterministic `scripted` and `exec` agents: they exercise
//! the machinery, not a model.

#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use flotilla_bus::{Bus, JetStreamOptions};
use flotilla_client::Client;
use flotilla_coordinator::{Coordinator, CoordinatorOptions};
use flotilla_model::plan::{Plan, PlanConfig, Subtask};
use flotilla_model::validate::{AgentCatalog, ValidationContext};
use flotilla_testkit::NatsServer;
use flotilla_worker::agents::{AgentDefinition, ScriptedConfig};
use flotilla_worker::{AgentRegistry, Worker, WorkerOptions};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The scripted model replies of an example (`config/examples/models/<name>.json`), read by
/// the loader `flotilla example` uses: the tests of an example run on the replies it ships.
pub fn example_script(name: &str) -> anyhow::Result<Vec<flotilla_testkit::openai::Reply>> {
    let path = root()
        .join("config/examples/models")
        .join(format!("{name}.json"));
    Ok(flotilla_testkit::openai::read_script(&path)?)
}

pub fn scripted(reply: &str) -> AgentDefinition {
    AgentDefinition::Scripted(ScriptedConfig {
        reply: reply.into(),
        ..ScriptedConfig::default()
    })
}

pub fn plan(tasks: Vec<Subtask>) -> Plan {
    Plan {
        fork: None,
        name: Some("test".into()),
        query: Some("a test query".into()),
        subtasks: tasks,
        config: PlanConfig::default(),
    }
}

/// A log of executions: the config of an exec agent `logged` (the default agent) that appends
/// its task id to the log and then sleeps `sleep` seconds, and the task ids it logged — for
/// tests that check an attempt ran exactly once across processes.
pub struct ExecutionLog(tempfile::NamedTempFile);

impl ExecutionLog {
    pub fn new() -> anyhow::Result<Self> {
        Ok(Self(tempfile::NamedTempFile::new()?))
    }

    /// The `[agents.logged]` config, sleeping `sleep` (a `sleep` argument, e.g. `"0.3"`).
    pub fn agent_config(&self, sleep: &str) -> String {
        format!(
            r#"
default-agent = "logged"
[agents.logged]
kind = "exec"
command = "sh"
args = ["-c", "echo $FLOTILLA_TASK_ID >> {}; sleep {sleep}"]
"#,
            self.0.path().display()
        )
    }

    /// Where the executions are logged.
    pub fn path(&self) -> &Path {
        self.0.path()
    }

    /// The task ids logged so far, in the order they ran.
    pub fn executions(&self) -> anyhow::Result<Vec<String>> {
        Ok(std::fs::read_to_string(self.0.path())?
            .lines()
            .map(str::to_owned)
            .collect())
    }
}

/// Flotilla services running inside the test process.
pub struct InProcess {
    pub server: NatsServer,
    pub bus: Bus,
    pub client: Client,
    pub agents: BTreeMap<String, AgentDefinition>,
    /// Settings of the coordinators `add_coordinator` starts.
    pub coordinator_opts: CoordinatorOptions,
    shutdown: CancellationToken,
    services: JoinSet<()>,
}

impl InProcess {
    pub async fn start(
        workers: usize,
        agents: BTreeMap<String, AgentDefinition>,
    ) -> anyhow::Result<Self> {
        // Tests observe task starts, so every attempt is announced.
        let opts = WorkerOptions {
            started_event_delay: Duration::ZERO,
            ..WorkerOptions::default()
        };
        Self::start_with(workers, agents, opts).await
    }

    pub async fn start_with(
        workers: usize,
        agents: BTreeMap<String, AgentDefinition>,
        worker_opts: WorkerOptions,
    ) -> anyhow::Result<Self> {
        Self::start_configured(workers, agents, worker_opts, CoordinatorOptions::default()).await
    }

    pub async fn start_configured(
        workers: usize,
        agents: BTreeMap<String, AgentDefinition>,
        worker_opts: WorkerOptions,
        coordinator_opts: CoordinatorOptions,
    ) -> anyhow::Result<Self> {
        let mut this = Self::without_services(agents, coordinator_opts).await?;
        this.add_coordinator().await?;
        for _ in 0..workers {
            this.add_worker(worker_opts.clone()).await?;
        }
        Ok(this)
    }

    /// A provisioned server and nothing serving it yet: start services with
    /// [`InProcess::add_coordinator`] and [`InProcess::add_worker`] when the test needs them.
    pub async fn without_services(
        agents: BTreeMap<String, AgentDefinition>,
        coordinator_opts: CoordinatorOptions,
    ) -> anyhow::Result<Self> {
        let server = NatsServer::start().await?;
        let bus = server.provisioned_bus().await?;
        Ok(Self {
            client: Client::new(bus.clone()),
            server,
            bus,
            agents,
            coordinator_opts,
            shutdown: CancellationToken::new(),
            services: JoinSet::new(),
        })
    }

    pub fn context(&self) -> ValidationContext {
        ValidationContext {
            pools: Some(["default".to_string(), "gpu".to_string()].into()),
            agents: Some(AgentCatalog {
                names: self.agents.keys().cloned().collect(),
                default: self.agents.keys().next().cloned(),
                workflows: Default::default(),
                roles: Default::default(),
                compensations: Default::default(),
            }),
            ..ValidationContext::default()
        }
    }

    pub async fn add_coordinator(&mut self) -> anyhow::Result<()> {
        let bus = self.server.bus().await?;
        let c = Coordinator::new(
            bus,
            self.coordinator_opts.clone(),
            self.context(),
            JetStreamOptions::default(),
        );
        let token = self.shutdown.clone();
        self.services.spawn(async move {
            if let Err(e) = c.run(token).await {
                panic!("coordinator failed: {e}");
            }
        });
        wait_for_api(&self.bus).await
    }

    pub async fn add_worker(&mut self, opts: WorkerOptions) -> anyhow::Result<()> {
        let bus = self.server.bus().await?;
        let registry = AgentRegistry::from_definitions(
            &self.agents,
            self.agents.keys().next().cloned(),
            &root().join("config"),
        )
        .map_err(anyhow::Error::msg)?;
        let w = Worker::new(bus, opts, registry);
        let token = self.shutdown.clone();
        self.services.spawn(async move {
            if let Err(e) = w.run(token).await {
                panic!("worker failed: {e}");
            }
        });
        Ok(())
    }

    /// A worker running the agents of `registry` (Rust agents of a test or an example) rather
    /// than those defined in `self.agents`, which then only name them for validation.
    pub async fn add_worker_with_registry(
        &mut self,
        opts: WorkerOptions,
        registry: AgentRegistry,
    ) -> anyhow::Result<()> {
        let bus = self.server.bus().await?;
        let w = Worker::new(bus, opts, registry);
        let token = self.shutdown.clone();
        self.services.spawn(async move {
            if let Err(e) = w.run(token).await {
                panic!("worker failed: {e}");
            }
        });
        Ok(())
    }

    pub async fn stop(mut self) {
        self.shutdown.cancel();
        while self.services.join_next().await.is_some() {}
    }
}

pub const WAIT: Duration = Duration::from_secs(60);

/// Waits until a coordinator answers the micro-service ping (`$SRV.PING.<prefix>`).
pub async fn wait_for_api(bus: &Bus) -> anyhow::Result<()> {
    let subject = format!("$SRV.PING.{}", bus.names().service());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(Ok(_)) = tokio::time::timeout(
            Duration::from_millis(500),
            bus.client().request(subject.clone(), "".into()),
        )
        .await
        {
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "no coordinator answered {subject}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Flotilla services as separate `flotilla` processes, for crashes and signals.
pub struct Processes {
    pub server: NatsServer,
    pub client: Client,
    pub bus: Bus,
    pub config: PathBuf,
    dir: tempfile::TempDir,
    children: Vec<Option<std::process::Child>>,
    /// Arguments after `--config` of every process (`--nats-url` with a config file of its own).
    global_args: Vec<String>,
    /// Configuration overrides (`FLOTILLA_*`) of every process.
    env: Vec<(String, String)>,
}

impl Processes {
    /// `extra` is appended to a config whose NATS URL points at a fresh test server and whose
    /// failover times are short (coordinator ack wait 2 s, worker heartbeat 300 ms).
    pub async fn start(extra: &str) -> anyhow::Result<Self> {
        let server = NatsServer::start().await?;
        Self::with_server(server, extra).await
    }

    pub async fn with_server(server: NatsServer, extra: &str) -> anyhow::Result<Self> {
        server.provisioned_bus().await?;
        Self::on(server, extra).await
    }

    /// As [`Processes::start`], on a server where nothing is provisioned yet (a fresh
    /// install: workers started before any coordinator).
    pub async fn unprovisioned(extra: &str) -> anyhow::Result<Self> {
        Self::on(NatsServer::start().await?, extra).await
    }

    async fn on(server: NatsServer, extra: &str) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let config = dir.path().join("flotilla.toml");
        std::fs::write(
            &config,
            format!(
                "{}{extra}\n\n[nats]\nurls = [\"{}\"]\n\n[coordinator]\nack-wait = \"2s\"\n\n[worker]\nheartbeat = \"300ms\"\nshutdown-grace = \"10s\"\nstarted-event-delay = \"0s\"\n",
                if extra.contains("pools =") {
                    ""
                } else {
                    "pools = [\"default\"]\n"
                },
                server.url()
            ),
        )?;
        let bus = server.bus().await?;
        Ok(Self {
            client: Client::new(bus.clone()),
            bus,
            server,
            config,
            dir,
            children: Vec::new(),
            global_args: Vec::new(),
            env: Vec::new(),
        })
    }

    /// Flotilla processes on an existing config file (a shipped example), unchanged: every
    /// process gets `--nats-url` of a fresh test server and the configuration overrides in
    /// `env` (`FLOTILLA_AGENTS__<NAME>__BASE_URL`, …), the way `scripts/demo-llm` points an
    /// example at a model. Failover times are short, as with [`Processes::start`].
    pub async fn with_config_file(config: &Path, env: &[(&str, &str)]) -> anyhow::Result<Self> {
        let server = NatsServer::start().await?;
        let bus = server.provisioned_bus().await?;
        // Later entries win (`Command::envs`): the caller's overrides come last.
        let overrides: Vec<(String, String)> = [
            ("FLOTILLA_COORDINATOR__ACK_WAIT", "2s"),
            ("FLOTILLA_WORKER__HEARTBEAT", "300ms"),
            ("FLOTILLA_WORKER__SHUTDOWN_GRACE", "10s"),
            ("FLOTILLA_WORKER__STARTED_EVENT_DELAY", "0s"),
        ]
        .iter()
        .chain(env)
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
        Ok(Self {
            client: Client::new(bus.clone()),
            bus,
            global_args: vec!["--nats-url".into(), server.url()],
            server,
            config: config.to_path_buf(),
            dir: tempfile::tempdir()?,
            children: Vec::new(),
            env: overrides,
        })
    }

    /// `flotilla <args>` as an operator would run it against these services (same config,
    /// NATS URL and overrides; none of the test's own `FLOTILLA_*` variables), to the end.
    pub fn cli(&self, args: &[&str]) -> anyhow::Result<std::process::Output> {
        self.cli_of(Path::new(env!("CARGO_BIN_EXE_flotilla")), args)
    }

    /// [`Processes::cli`] with the environment variables `unset` removed (`USER`, as in a
    /// container).
    #[allow(dead_code)]
    pub fn cli_without(
        &self,
        unset: &[&str],
        args: &[&str],
    ) -> anyhow::Result<std::process::Output> {
        self.cli_full(Path::new(env!("CARGO_BIN_EXE_flotilla")), unset, args)
    }

    /// [`Processes::cli`] with another build of `flotilla` (an older release's binary, for
    /// a rolling upgrade's old client).
    pub fn cli_of(&self, bin: &Path, args: &[&str]) -> anyhow::Result<std::process::Output> {
        self.cli_full(bin, &[], args)
    }

    fn cli_full(
        &self,
        bin: &Path,
        unset: &[&str],
        args: &[&str],
    ) -> anyhow::Result<std::process::Output> {
        let mut cmd = std::process::Command::new(bin);
        for k in unset {
            cmd.env_remove(k);
        }
        for (k, _) in std::env::vars() {
            if k.starts_with("FLOTILLA_") {
                cmd.env_remove(k);
            }
        }
        Ok(cmd
            .arg("--config")
            .arg(&self.config)
            .args(&self.global_args)
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .current_dir(self.dir.path())
            .stdin(std::process::Stdio::null())
            .output()?)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Starts `flotilla <args>` and returns its index.
    pub fn spawn(&mut self, args: &[&str]) -> anyhow::Result<usize> {
        self.spawn_env(args, &[])
    }

    /// Starts `flotilla <args>` with extra environment variables (config overrides such as
    /// `FLOTILLA_WORKER__SHUTDOWN_GRACE`).
    pub fn spawn_env(&mut self, args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<usize> {
        self.spawn_with(args, env, false)
    }

    /// Starts a worker with a config file of its own (another pool's agents, as the Helm
    /// chart gives each pool) instead of the shared one, and waits until it has registered.
    pub async fn worker_with_config(
        &mut self,
        config: &Path,
        extra: &[&str],
    ) -> anyhow::Result<usize> {
        let mut args = vec!["worker"];
        args.extend_from_slice(extra);
        let i = self.spawn_full(&args, &[], false, Some(config), None)?;
        self.wait_registered(i).await?;
        Ok(i)
    }

    /// Starts `flotilla <args>` with the HTTP listener the configuration gives it — the
    /// default, unless `args` or `env` say otherwise — as a person would start it (other
    /// processes of the tests start with none).
    pub fn spawn_listening(
        &mut self,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<usize> {
        self.spawn_with(args, env, true)
    }

    fn spawn_with(
        &mut self,
        args: &[&str],
        env: &[(&str, &str)],
        default_listener: bool,
    ) -> anyhow::Result<usize> {
        self.spawn_full(args, env, default_listener, None, None)
    }

    /// Starts `bin <args>` — another build of `flotilla` (an older release's binary, for a
    /// rolling upgrade) — on this deployment's config, as [`Processes::spawn_env`] does.
    pub fn spawn_bin(
        &mut self,
        bin: &Path,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<usize> {
        self.spawn_full(args, env, false, None, Some(bin))
    }

    fn spawn_full(
        &mut self,
        args: &[&str],
        env: &[(&str, &str)],
        default_listener: bool,
        config: Option<&Path>,
        bin: Option<&Path>,
    ) -> anyhow::Result<usize> {
        let log = std::fs::File::create(
            self.dir
                .path()
                .join(format!("p{}.log", self.children.len())),
        )?;
        let mut cmd = std::process::Command::new(
            bin.unwrap_or_else(|| Path::new(env!("CARGO_BIN_EXE_flotilla"))),
        );
        // The upgrade tests' own setting (which binary is the old release) is none of the
        // processes' configuration.
        cmd.env_remove("FLOTILLA_OLD_BIN")
            .arg("--config")
            .arg(config.unwrap_or(&self.config))
            .args(&self.global_args)
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env(
                "FLOTILLA_LOG",
                std::env::var("TEST_FLOTILLA_LOG").unwrap_or_else(|_| "info".into()),
            );
        if default_listener {
            cmd.env_remove("FLOTILLA_TELEMETRY__HTTP_ADDR");
        } else {
            // Tests run many services at once: no HTTP listener unless a test asks for one
            // (`--http-addr`), so none holds a port another test's process expects.
            cmd.env("FLOTILLA_TELEMETRY__HTTP_ADDR", "off");
        }
        let child = cmd
            .envs(env.iter().copied())
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.children.push(Some(child));
        Ok(self.children.len() - 1)
    }

    /// Starts a coordinator and waits until its API answers.
    pub async fn coordinator(&mut self) -> anyhow::Result<usize> {
        let i = self.spawn(&["coordinator"])?;
        self.ready(i, |bus, _| async move { wait_for_api(&bus).await.is_ok() })
            .await?;
        Ok(i)
    }

    /// Starts `flotilla supervisor` and waits until its team API answers with the roster.
    pub async fn supervisor(&mut self) -> anyhow::Result<usize> {
        self.supervisor_env(&[]).await
    }

    /// A supervisor with extra environment variables (a webhook's secret), once it answers.
    pub async fn supervisor_env(&mut self, env: &[(&str, &str)]) -> anyhow::Result<usize> {
        let i = self.spawn_env(&["supervisor"], env)?;
        self.ready(i, |bus, _| async move {
            let request = flotilla_model::team::TeamListRequest {
                protocol: 1,
                role: None,
            };
            Client::new(bus)
                .request(&request, Duration::from_secs(5))
                .await
                .is_ok_and(|list| !list.members.is_empty())
        })
        .await?;
        Ok(i)
    }

    /// Starts a worker and waits until it has registered.
    pub async fn worker(&mut self, extra: &[&str]) -> anyhow::Result<usize> {
        let mut args = vec!["worker"];
        args.extend_from_slice(extra);
        let i = self.spawn(&args)?;
        self.wait_registered(i).await?;
        Ok(i)
    }

    /// Waits until process `i` (a worker) is in the workers bucket.
    pub async fn wait_registered(&mut self, i: usize) -> anyhow::Result<()> {
        self.ready(i, |bus, pid| async move {
            let Ok(kv) = bus.kv(flotilla_model::subjects::Bucket::Workers).await else {
                return false;
            };
            let Ok(mut keys) = kv.keys().await else {
                return false;
            };
            use futures::StreamExt;
            while let Some(Ok(k)) = keys.next().await {
                if let Ok(Some(v)) = kv.get(&k).await
                    && let Ok(info) = serde_json::from_slice::<flotilla_worker::WorkerInfo>(&v)
                    && Some(info.pid) == pid
                {
                    return true;
                }
            }
            false
        })
        .await
    }

    async fn ready<F, Fut>(&mut self, i: usize, check: F) -> anyhow::Result<()>
    where
        F: Fn(Bus, Option<u32>) -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(Some(c)) = self.children.get_mut(i)
                && let Some(status) = c.try_wait()?
            {
                anyhow::bail!("process {i} exited with {status}:\n{}", self.log(i));
            }
            if check(self.bus.clone(), self.pid(i)).await {
                return Ok(());
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "process {i} never became ready:\n{}",
                self.log(i)
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    pub fn pid(&self, i: usize) -> Option<u32> {
        self.children
            .get(i)
            .and_then(|c| c.as_ref())
            .map(std::process::Child::id)
    }

    /// SIGKILL, as a crash.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.children.get_mut(i).and_then(Option::take) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, as Kubernetes does on scale-down.
    pub fn terminate(&mut self, i: usize) {
        if let Some(pid) = self.pid(i) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
    }

    /// Waits for a process to exit and returns its exit code.
    pub async fn wait_exit(&mut self, i: usize, timeout: Duration) -> anyhow::Result<Option<i32>> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(Some(c)) = self.children.get_mut(i) {
                if let Some(status) = c.try_wait()? {
                    self.children[i] = None;
                    return Ok(status.code());
                }
            } else {
                return Ok(None);
            }
            if tokio::time::Instant::now() > deadline {
                anyhow::bail!("process {i} did not exit within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The combined log of process `i` (for assertion messages).
    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("p{i}.log"))).unwrap_or_default()
    }
}

impl Drop for Processes {
    fn drop(&mut self) {
        for c in self.children.iter_mut().filter_map(Option::take) {
            let mut c = c;
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Waits until a task of `run` has been started by a worker; returns the worker id.
pub async fn task_started(
    client: &Client,
    run: flotilla_model::RunId,
    task: &str,
) -> anyhow::Result<String> {
    use flotilla_model::event::{Event, WorkflowPhase};
    use futures::StreamExt;
    let events = client.events(run).await?;
    futures::pin_mut!(events);
    let found = tokio::time::timeout(WAIT, async {
        while let Some(e) = events.next().await {
            let e = e?;
            if let Event::Workflow(w) = &e.event
                && w.phase == WorkflowPhase::TaskStarted
                && e.task_id.as_ref().is_some_and(|t| t.as_str() == task)
            {
                return Ok::<_, anyhow::Error>(w.worker.clone().unwrap_or_default());
            }
        }
        anyhow::bail!("event stream ended")
    })
    .await??;
    Ok(found)
}

/// Every stored task result of a run: task, attempt, success. Read again for up to 30 s
/// while JetStream does not answer (a cluster whose leaders were just killed is still
/// settling; what the run did is already stored).
pub async fn results_of(
    bus: &Bus,
    run: flotilla_model::RunId,
) -> anyhow::Result<Vec<(String, u32, bool)>> {
    use flotilla_model::runlog::RunInput;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let history = loop {
        let read = async {
            let store = flotilla_coordinator::store::RunStore::open(bus).await?;
            anyhow::Ok(store.history(run).await?)
        };
        match read.await {
            Ok(h) => break h,
            Err(_) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e),
        }
    };
    Ok(history
        .into_iter()
        .filter_map(|(_, _, e)| match e.input {
            RunInput::TaskResult(r) => Some((r.task_id.to_string(), r.attempt, r.result.success)),
            _ => None,
        })
        .collect())
}

/// The child run a `transfer_to_agent` handed `run`'s conversation to: the `run_link` of the
/// transfer's successful `tool_end` on `run`'s event stream.
pub async fn transfer_link(
    client: &Client,
    run: flotilla_model::RunId,
) -> anyhow::Result<flotilla_model::RunId> {
    use flotilla_model::event::Event;
    use futures::StreamExt;
    let events = client.events(run).await?;
    futures::pin_mut!(events);
    tokio::time::timeout(WAIT, async {
        while let Some(e) = events.next().await {
            if let Event::ToolEnd {
                run_link: Some(h),
                tool: Some(t),
                ok: true,
                ..
            } = e?.event
                && t == "transfer_to_agent"
            {
                return Ok(h.run_id);
            }
        }
        anyhow::bail!("no transfer on run {run}'s event stream")
    })
    .await?
}

/// Every event of a projection of `run`'s tree (the client library's), until it ends.
pub async fn projection(
    client: &Client,
    run: flotilla_model::RunId,
    opts: flotilla_coordinator::watch::WatchOptions,
) -> anyhow::Result<Vec<flotilla_model::watch::ProjectedEvent>> {
    use futures::StreamExt;
    let stream = client.watch(run, opts).await?;
    futures::pin_mut!(stream);
    let mut out = Vec::new();
    tokio::time::timeout(WAIT, async {
        while let Some(e) = stream.next().await {
            out.push(e?);
        }
        Ok::<_, anyhow::Error>(())
    })
    .await??;
    Ok(out)
}

/// The approvals of `run` as `approval.list` answers them (settled ones too with `all`).
pub async fn approvals_of(
    client: &Client,
    run: flotilla_model::ids::RunId,
    all: bool,
) -> anyhow::Result<Vec<flotilla_model::approval::ApprovalRecord>> {
    let list = client
        .request(
            &flotilla_model::approval::ApprovalListRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                run_id: Some(run),
                all,
                limit: None,
            },
            Duration::from_secs(5),
        )
        .await?;
    Ok(list.approvals)
}

/// An LLM agent `researcher` on the scripted OpenAI-compatible double `llm`, with a price (so
/// its calls have a cost).
pub fn researcher(llm: &flotilla_testkit::openai::OpenAiServer) -> String {
    priced_llm_agent("researcher", llm)
}

/// An LLM agent `name` on the scripted OpenAI-compatible double `llm`, with a price (so its
/// calls have a cost).
pub fn priced_llm_agent(name: &str, llm: &flotilla_testkit::openai::OpenAiServer) -> String {
    format!(
        r#"
[agents.{name}]
kind = "llm"
base-url = "{}"
model = "scripted-model"
price = {{ input-per-mtok = 1.0, output-per-mtok = 2.0 }}
"#,
        llm.base_url()
    )
}
