//! The restart matrix on a lived-in deployment: every service — coordinator, worker,
//! supervisor, console, `flotilla up` — stopped with SIGTERM and with kill -9 on a deployment
//! with history ([`flotilla_testkit::lived_in`]: runs of every ending, approvals pending and
//! decided, a grant, trust pins and incidents, memory, teammates, failure records, a recruit,
//! paused and taken-over runs, pending webhook deliveries, workspace, mailboxes and session
//! state), then started again: it must be ready (`/readyz`) within 10 s, answer every read as
//! before, and new runs of every kind must succeed.
//!
//! The services are `flotilla` processes on a real nats-server; the agents are deterministic
//! (`scripted`, `exec`, workflow agents, and an LLM agent on the test kit's scripted
//! OpenAI-compatible server — a test double).

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use flotilla_client::Client;
use flotilla_model::approval::ApprovalStatus;
use flotilla_model::plan::Subtask;
use flotilla_model::run::RunStatus;
use flotilla_model::submit::SubmitRequest;
use flotilla_testkit::lived_in::{self, LivedIn, Reads};
use flotilla_testkit::openai::OpenAiServer;
use support::Processes;

/// How long a restarted service may take to say it is ready.
const READY_WITHIN: Duration = Duration::from_secs(10);

/// Bulk runs of history beside the runs of every kind.
const BULK: usize = 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Term,
    Kill,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Waits until `GET /readyz` on `port` answers 200; how long that took from `since`.
async fn ready(port: u16, since: Instant, log: impl Fn() -> String) -> anyhow::Result<Duration> {
    let addr = format!("127.0.0.1:{port}");
    let deadline = since + Duration::from_secs(60);
    let mut last;
    loop {
        match flotilla_testkit::http::request(&addr, "GET", "/readyz", &[], None).await {
            Ok((200, _)) => return Ok(since.elapsed()),
            Ok((s, b)) => last = format!("{s}: {b}"),
            Err(e) => last = e.to_string(),
        }
        ensure!(
            Instant::now() < deadline,
            "never ready; last /readyz: {last}\n{}",
            log()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Which service a cell restarts.
#[derive(Debug, Clone, Copy)]
enum Service {
    Coordinator,
    Worker,
    Supervisor,
    Console,
}

/// A lived-in deployment of separate processes, each with a readiness port.
struct Deployment {
    p: Processes,
    model: OpenAiServer,
    history: LivedIn,
    /// Process index and port of each service.
    coordinator: (usize, u16),
    worker: (usize, u16),
    supervisor: (usize, u16),
    console: (usize, u16),
    console_addr: String,
}

const TOKEN: &str = "lived-in-console-token-0123456789";

impl Deployment {
    async fn start() -> anyhow::Result<Self> {
        let model = OpenAiServer::start().await?;
        let console_addr = format!("127.0.0.1:{}", free_port()?);
        let config = format!(
            "{}\n[console]\nlisten = \"{console_addr}\"\noperators = [\"alice\"]\n[console.tokens]\nalice = \"{TOKEN}\"\n",
            lived_in::config(&model.base_url())
        );
        let mut p = Processes::start(&config).await?;
        let start = |p: &mut Processes, args: &[&str]| -> anyhow::Result<(usize, u16)> {
            let port = free_port()?;
            let addr = format!("127.0.0.1:{port}");
            let i = p.spawn_env(args, &[("FLOTILLA_TELEMETRY__HTTP_ADDR", addr.as_str())])?;
            Ok((i, port))
        };
        let coordinator = start(&mut p, &["coordinator"])?;
        let worker = start(&mut p, &["worker"])?;
        let supervisor = start(&mut p, &["supervisor"])?;
        let console = start(&mut p, &["console"])?;
        for (i, port) in [coordinator, worker, supervisor, console] {
            let log = p.log(i);
            ready(port, Instant::now(), || log.clone()).await?;
        }
        let history = match LivedIn::build(&p.client, &model, BULK).await {
            Ok(h) => h,
            Err(e) => bail!(
                "building the history: {e}\ncoordinator:\n{}\nworker:\n{}\nsupervisor:\n{}",
                p.log(coordinator.0),
                p.log(worker.0),
                p.log(supervisor.0)
            ),
        };
        Ok(Self {
            p,
            model,
            history,
            coordinator,
            worker,
            supervisor,
            console,
            console_addr,
        })
    }

    fn slot(&mut self, s: Service) -> &mut (usize, u16) {
        match s {
            Service::Coordinator => &mut self.coordinator,
            Service::Worker => &mut self.worker,
            Service::Supervisor => &mut self.supervisor,
            Service::Console => &mut self.console,
        }
    }

    fn logs(&self) -> String {
        [
            ("coordinator", self.coordinator.0),
            ("worker", self.worker.0),
            ("supervisor", self.supervisor.0),
            ("console", self.console.0),
        ]
        .iter()
        .map(|(n, i)| format!("--- {n}:\n{}", self.p.log(*i)))
        .collect::<Vec<_>>()
        .join("\n")
    }

    /// The console's answers about the history (its runs list, each run, the inbox).
    async fn console_reads(&self) -> anyhow::Result<Vec<(String, String)>> {
        let auth = format!("Bearer {TOKEN}");
        let headers = [("Authorization", auth.as_str())];
        let mut paths = vec!["/api/inbox".to_owned()];
        for run in self.history.runs.values() {
            paths.push(format!("/api/runs/{run}"));
        }
        let mut out = Vec::new();
        for path in paths {
            let (status, body) =
                flotilla_testkit::http::request(&self.console_addr, "GET", &path, &headers, None)
                    .await?;
            ensure!(status == 200, "console {path}: {status} {body}");
            out.push((path, normalise_console(&body)));
        }
        // The runs list holds every run of the history.
        let (status, body) = flotilla_testkit::http::request(
            &self.console_addr,
            "GET",
            "/api/runs?limit=1000",
            &headers,
            None,
        )
        .await?;
        ensure!(status == 200, "console /api/runs: {status} {body}");
        let missing: Vec<String> = self
            .history
            .runs
            .values()
            .chain(&self.history.bulk)
            .map(|r| r.to_string())
            .filter(|r| !body.contains(r.as_str()))
            .collect();
        out.push(("/api/runs (missing)".into(), missing.join(",")));
        Ok(out)
    }

    /// Reads again for a few seconds while only the members' presence differs from
    /// `before`: a restarted supervisor marks members by the registry entries it has seen
    /// refreshed, within a heartbeat.
    async fn presence_settled(&self, before: &Reads, mut after: Reads) -> anyhow::Result<Reads> {
        let deadline = Instant::now() + Duration::from_secs(5);
        while before != &after
            && before.clone().without_presence() == after.clone().without_presence()
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
            after = self.history.reads(&self.p.client).await?;
        }
        Ok(after)
    }

    /// Stops `service` with `stop`, starts it again and checks the cell: ready within
    /// [`READY_WITHIN`], every read as before, new runs of every kind succeed.
    async fn cell(&mut self, service: Service, stop: Stop) -> anyhow::Result<()> {
        let what = format!("{service:?} after {stop:?}");
        let client = self.p.client.clone();
        self.history.settled(&client).await?;
        let before = self.history.reads(&client).await?;
        let console_before = self.console_reads().await?;
        let (i, port) = *self.slot(service);
        match stop {
            Stop::Term => {
                self.p.terminate(i);
                self.p
                    .wait_exit(i, Duration::from_secs(30))
                    .await
                    .with_context(|| format!("{what}: stopping\n{}", self.p.log(i)))?;
            }
            Stop::Kill => self.p.kill(i),
        }
        let args: &[&str] = match service {
            Service::Coordinator => &["coordinator"],
            Service::Worker => &["worker"],
            Service::Supervisor => &["supervisor"],
            Service::Console => &["console"],
        };
        let addr = format!("127.0.0.1:{port}");
        let started = Instant::now();
        let j = self
            .p
            .spawn_env(args, &[("FLOTILLA_TELEMETRY__HTTP_ADDR", addr.as_str())])?;
        *self.slot(service) = (j, port);
        let log = self.p.log(j);
        let took = ready(port, started, || log.clone()).await?;
        ensure!(
            took <= READY_WITHIN,
            "{what}: ready only after {took:?}\n{}",
            self.p.log(j)
        );
        eprintln!("{what}: ready in {took:?}");
        let mut after = self.history.reads(&client).await?;
        let mut before = before;
        if matches!(service, Service::Worker | Service::Coordinator) {
            // The worker that comes back is another worker (a new id hosts the members); so
            // is a coordinator's embedded worker of the workflow pool.
            (before, after) = (before.without_presence(), after.without_presence());
        } else {
            // The roster's presence is computed again from the same live workers.
            after = self.presence_settled(&before, after).await?;
        }
        before
            .ensure_same(&after, &what)
            .with_context(|| self.logs())?;
        let console_after = self.console_reads().await?;
        ensure!(
            console_before == console_after,
            "{what}: the console answers differently:\nbefore: {console_before:#?}\nafter: {console_after:#?}"
        );
        let t = Instant::now();
        if let Err(e) = self.history.exercise(&client, &self.model).await {
            bail!("{what}: new runs: {e}\n{}", self.logs());
        }
        eprintln!("{what}: new runs of every kind in {:?}", t.elapsed());
        Ok(())
    }
}

/// The console's JSON with the fields that move by themselves blanked (a held run's
/// duration).
fn normalise_console(body: &str) -> String {
    let Ok(mut v) = serde_json::from_str::<serde_json::Value>(body) else {
        return body.to_owned();
    };
    fn walk(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(m) => {
                m.retain(|k, _| !matches!(k.as_str(), "duration_ms" | "now" | "worker"));
                m.values_mut().for_each(walk);
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut v);
    v.to_string()
}

async fn matrix(service: Service) -> anyhow::Result<()> {
    let mut d = Deployment::start().await?;
    for stop in [Stop::Term, Stop::Kill] {
        d.cell(service, stop).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_restarts_onto_history() -> anyhow::Result<()> {
    matrix(Service::Coordinator).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_restarts_onto_history() -> anyhow::Result<()> {
    matrix(Service::Worker).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_supervisor_restarts_onto_history() -> anyhow::Result<()> {
    matrix(Service::Supervisor).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_console_restarts_onto_history() -> anyhow::Result<()> {
    matrix(Service::Console).await
}

/// `flotilla up` in a directory: the embedded server's URL, once written.
async fn up_url(dir: &Path, up: &mut std::process::Child) -> anyhow::Result<String> {
    let file = dir.join(".flotilla/nats-url");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(text) = std::fs::read_to_string(&file)
            && let Some(url) = text.lines().next()
            && text.lines().nth(1) == Some(&up.id().to_string())
        {
            return Ok(url.to_owned());
        }
        if let Some(status) = up.try_wait()? {
            bail!("flotilla up exited with {status}");
        }
        ensure!(Instant::now() < deadline, "flotilla up never wrote its URL");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

fn spawn_up(dir: &Path, port: u16) -> anyhow::Result<std::process::Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("up.log"))?;
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"));
    for (k, _) in std::env::vars() {
        if k.starts_with("FLOTILLA_") {
            cmd.env_remove(k);
        }
    }
    Ok(cmd
        .args(["--config", "flotilla.toml", "up", "--workers", "1"])
        .args(["--http-addr", &format!("127.0.0.1:{port}")])
        .env("FLOTILLA_LOG", "info")
        .current_dir(dir)
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()?)
}

async fn client_of(url: &str) -> anyhow::Result<Client> {
    let opts = flotilla_bus::NatsOptions {
        urls: vec![url.to_owned()],
        ..flotilla_bus::NatsOptions::default()
    };
    Ok(Client::new(
        flotilla_bus::Bus::connect(&opts, "test").await?,
    ))
}

/// `flotilla up` running in a directory, restarted as a person would.
struct Up {
    dir: tempfile::TempDir,
    port: u16,
    child: std::process::Child,
    url: String,
}

impl Up {
    async fn start(config: &str) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("flotilla.toml"), config)?;
        let port = free_port()?;
        let mut child = spawn_up(dir.path(), port)?;
        let url = up_url(dir.path(), &mut child).await?;
        let mut up = Self {
            dir,
            port,
            child,
            url,
        };
        let log = up.log_fn();
        ready(port, Instant::now(), log).await?;
        up.url = up_url(up.dir.path(), &mut up.child).await?;
        Ok(up)
    }

    fn log_fn(&self) -> impl Fn() -> String + use<> {
        let path = self.dir.path().join("up.log");
        move || std::fs::read_to_string(&path).unwrap_or_default()
    }

    fn log(&self) -> String {
        (self.log_fn())()
    }

    /// Stops `up` with `stop` and starts it again on the same directory; how long until
    /// ready.
    async fn restart(&mut self, stop: Stop) -> anyhow::Result<Duration> {
        match stop {
            Stop::Term => {
                nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(self.child.id() as i32),
                    nix::sys::signal::Signal::SIGTERM,
                )?;
                let deadline = Instant::now() + Duration::from_secs(30);
                while self.child.try_wait()?.is_none() {
                    ensure!(Instant::now() < deadline, "up did not stop\n{}", self.log());
                    tokio::time::sleep(Duration::from_millis(25)).await;
                }
            }
            Stop::Kill => {
                self.child.kill()?;
                self.child.wait()?;
            }
        }
        let started = Instant::now();
        self.child = spawn_up(self.dir.path(), self.port)?;
        self.url = up_url(self.dir.path(), &mut self.child).await?;
        ready(self.port, started, self.log_fn()).await
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `flotilla up` on its data directory with history, stopped with SIGTERM and kill -9 and
/// started again: ready within 10 s, the same answers, new runs succeed. A second `up` in
/// the same directory meanwhile is refused at once and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_restarts_onto_its_data_dir() -> anyhow::Result<()> {
    let model = OpenAiServer::start().await?;
    let console = free_port()?;
    let mut up = Up::start(&format!(
        "{}\n[console]\nlisten = \"127.0.0.1:{console}\"\n",
        lived_in::config(&model.base_url())
    ))
    .await?;
    let mut client = client_of(&up.url).await?;
    let history = match LivedIn::build(&client, &model, BULK).await {
        Ok(h) => h,
        Err(e) => bail!("building the history: {e}\n{}", up.log()),
    };

    // A second `up` here is refused, naming the first; its nats-url stays.
    let second = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["--config", "flotilla.toml", "up", "--http-addr", "off"])
        .env_remove("FLOTILLA_CONFIG")
        .current_dir(up.dir.path())
        .output()?;
    let err = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(2), "{err}");
    assert!(err.contains(&format!("pid {}", up.child.id())), "{err}");
    assert!(err.contains(&up.url), "{err}");
    assert_eq!(up_url(up.dir.path(), &mut up.child).await?, up.url);

    for stop in [Stop::Term, Stop::Kill] {
        history.settled(&client).await?;
        // `up`'s worker comes back as another worker.
        let before = history.reads(&client).await?.without_presence();
        let took = up.restart(stop).await?;
        ensure!(
            took <= READY_WITHIN,
            "up after {stop:?}: ready only after {took:?}\n{}",
            up.log()
        );
        eprintln!("up after {stop:?}: ready in {took:?}");
        client = client_of(&up.url).await?;
        let after = history.reads(&client).await?.without_presence();
        before
            .ensure_same(&after, &format!("up after {stop:?}"))
            .with_context(|| up.log())?;
        if let Err(e) = history.exercise(&client, &model).await {
            bail!("up after {stop:?}: new runs: {e}\n{}", up.log());
        }
    }

    // Work in flight across a restart: a run whose first task is running continues, and an
    // approval whose deadline passes while `up` is down expires at that deadline.
    for stop in [Stop::Term, Stop::Kill] {
        let chain = support::plan(vec![
            Subtask::new("first", "slowly").with_agent("slow"),
            Subtask::new("second", "then").after(&["first"]),
        ]);
        let inflight = client.submit(SubmitRequest::new(chain)).await?;
        let mut gate = Subtask::new("gate", "publish").with_agent("echo");
        gate.action = Some("publish".into());
        let mut short = support::plan(vec![gate]);
        short.config.hitl = Some(flotilla_model::approval::PlanHitl {
            approval_timeout: Some(flotilla_model::time::Secs::from_secs(3)),
            ..Default::default()
        });
        let expiring = client.submit(SubmitRequest::new(short)).await?;
        support::task_started(&client, inflight, "first").await?;
        let asked = loop {
            let list = support::approvals_of(&client, expiring, false).await?;
            if let Some(a) = list.into_iter().next() {
                break a;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        };
        up.restart(stop).await?;
        client = client_of(&up.url).await?;
        let done = client.wait(inflight, support::WAIT).await?;
        ensure!(
            done.status == RunStatus::Succeeded,
            "up after {stop:?}: the run in flight ended {:?}\n{}",
            done.status,
            up.log()
        );
        let expired = client.wait(expiring, support::WAIT).await?;
        ensure!(
            expired.status == RunStatus::Failed,
            "up after {stop:?}: the expiring approval's run ended {:?}",
            expired.status
        );
        let settled = support::approvals_of(&client, expiring, true).await?;
        let record = settled
            .iter()
            .find(|a| a.request.approval_id == asked.request.approval_id)
            .context("the approval is gone")?;
        ensure!(
            record.status == ApprovalStatus::Expired
                && record.request.deadline == asked.request.deadline,
            "up after {stop:?}: the approval was not expired at its deadline: {record:?}"
        );
    }
    Ok(())
}
