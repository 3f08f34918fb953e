//! The soak's deployment: every Flotilla service a separate child process of the bench's
//! `flotilla` binary (or `--services-binary`), so each can be stopped and started again on
//! its own — two coordinators, two workers of pool `default`, one worker of the LLM pool, two
//! supervisors and the console. A *slot* is one service of the deployment; each start of it
//! is a new *incarnation* (a new process). Each slot serves its health endpoints on a
//! loopback port chosen once (`--http-addr`), so the bench asks `/readyz` when it starts
//! again, and writes its log, every incarnation after the other, to `logs/<slot>.log`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::config::LLM_POOL;

/// What a slot runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Kind {
    Coordinator,
    Worker,
    LlmWorker,
    Supervisor,
    Console,
}

/// How a service is stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) enum Stop {
    /// SIGTERM: the service drains and exits.
    #[serde(rename = "SIGTERM")]
    Term,
    /// SIGKILL, as a crash.
    #[serde(rename = "SIGKILL")]
    Kill,
}

impl Stop {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Term => "SIGTERM",
            Self::Kill => "kill -9",
        }
    }
}

/// One service of the deployment.
#[derive(Debug)]
pub(crate) struct Slot {
    pub(crate) name: String,
    pub(crate) kind: Kind,
    args: Vec<String>,
    /// Its health listener.
    pub(crate) health: SocketAddr,
    child: Option<Child>,
    /// Starts so far (the incarnation running is this one).
    pub(crate) incarnation: u32,
    /// When the incarnation running started (unix ms).
    pub(crate) started_ms: i64,
    /// Being stopped, or down, on purpose: its exit is not unexpected.
    pub(crate) held: bool,
    /// When the incarnation running said it was ready (unix ms); absent until it has.
    pub(crate) ready_ms: Option<i64>,
    log: PathBuf,
}

/// The deployment's services.
#[derive(Debug)]
pub(crate) struct Deployment {
    exe: PathBuf,
    config: PathBuf,
    log_level: String,
    pub(crate) slots: Vec<Slot>,
}

/// A free loopback port (free now; the slot keeps it for the soak).
pub(crate) fn free_port() -> anyhow::Result<SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

pub(crate) fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

impl Deployment {
    /// The deployment's slots (none started). `concurrency`: the LLM worker's slots.
    pub(crate) fn new(
        exe: &Path,
        config: &Path,
        logs: &Path,
        log_level: &str,
        llm_concurrency: usize,
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(logs)?;
        let plan: [(&str, Kind, Vec<String>); 8] = [
            (
                "coordinator-1",
                Kind::Coordinator,
                vec!["coordinator".into()],
            ),
            (
                "coordinator-2",
                Kind::Coordinator,
                vec!["coordinator".into()],
            ),
            ("worker-1", Kind::Worker, vec!["worker".into()]),
            ("worker-2", Kind::Worker, vec!["worker".into()]),
            (
                "worker-llm",
                Kind::LlmWorker,
                vec![
                    "worker".into(),
                    "--pool".into(),
                    LLM_POOL.into(),
                    "--concurrency".into(),
                    llm_concurrency.to_string(),
                ],
            ),
            ("supervisor-1", Kind::Supervisor, vec!["supervisor".into()]),
            ("supervisor-2", Kind::Supervisor, vec!["supervisor".into()]),
            ("console", Kind::Console, vec!["console".into()]),
        ];
        let mut slots = Vec::new();
        for (name, kind, args) in plan {
            slots.push(Slot {
                name: name.into(),
                kind,
                args,
                health: free_port()?,
                child: None,
                incarnation: 0,
                started_ms: 0,
                held: false,
                ready_ms: None,
                log: logs.join(format!("{name}.log")),
            });
        }
        Ok(Self {
            exe: exe.to_path_buf(),
            config: config.to_path_buf(),
            log_level: log_level.into(),
            slots,
        })
    }

    /// Starts slot `i` (a new incarnation), its stderr appended to its log.
    pub(crate) fn start(&mut self, i: usize) -> anyhow::Result<()> {
        let slot = &mut self.slots[i];
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&slot.log)?;
        slot.incarnation += 1;
        std::io::Write::write_all(
            &mut log,
            format!(
                "=== flotilla soak: {} incarnation {} started at unix ms {}\n",
                slot.name,
                slot.incarnation,
                unix_ms()
            )
            .as_bytes(),
        )?;
        let child = Command::new(&self.exe)
            .arg("--config")
            .arg(&self.config)
            .args(&slot.args)
            .arg("--http-addr")
            .arg(slot.health.to_string())
            .env("FLOTILLA_LOG", &self.log_level)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()?;
        slot.child = Some(child);
        slot.started_ms = unix_ms();
        slot.ready_ms = None;
        Ok(())
    }

    /// The running process of slot `i`.
    pub(crate) fn pid(&self, i: usize) -> Option<u32> {
        self.slots[i].child.as_ref().map(Child::id)
    }

    /// Sends slot `i` its stop signal (nothing when it is not running).
    pub(crate) fn signal(&mut self, i: usize, how: Stop) -> anyhow::Result<()> {
        let Some(child) = self.slots[i].child.as_mut() else {
            return Ok(());
        };
        match how {
            Stop::Kill => child.kill()?,
            Stop::Term => nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            )?,
        }
        Ok(())
    }

    /// How slot `i`'s process ended, once it has (the process is then reaped and gone).
    pub(crate) fn exited(&mut self, i: usize) -> Option<String> {
        let child = self.slots[i].child.as_mut()?;
        match child.try_wait() {
            Ok(Some(status)) => {
                self.slots[i].child = None;
                Some(status.to_string())
            }
            Ok(None) => None,
            Err(e) => {
                self.slots[i].child = None;
                Some(format!("unknown ({e})"))
            }
        }
    }

    /// Whether slot `i` has a process.
    pub(crate) fn running(&self, i: usize) -> bool {
        self.slots[i].child.is_some()
    }

    /// Stops every service: SIGTERM, then SIGKILL for those still running after `grace`.
    pub(crate) fn stop_all(&mut self, grace: Duration) {
        for i in 0..self.slots.len() {
            self.slots[i].held = true;
            let _ = self.signal(i, Stop::Term);
        }
        let deadline = std::time::Instant::now() + grace;
        while std::time::Instant::now() < deadline
            && (0..self.slots.len()).any(|i| self.running(i) && self.exited(i).is_none())
        {
            std::thread::sleep(Duration::from_millis(100));
        }
        for slot in &mut self.slots {
            if let Some(mut c) = slot.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

impl Drop for Deployment {
    fn drop(&mut self) {
        for slot in &mut self.slots {
            if let Some(mut c) = slot.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// One HTTP/1.1 request on a new connection (`Connection: close`): the status and the body.
/// The bench's plain client for the services' health endpoints and the console's API.
pub(crate) async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
    within: Duration,
) -> anyhow::Result<(u16, String)> {
    tokio::time::timeout(within, async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        let body = body.unwrap_or_default();
        if !body.is_empty() {
            req.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                body.len()
            ));
        }
        req.push_str("\r\n");
        req.push_str(body);
        s.write_all(req.as_bytes()).await?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await?;
        let text = String::from_utf8_lossy(&out).into_owned();
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("no HTTP status from {addr}"))?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        anyhow::Ok((status, body))
    })
    .await
    .map_err(|_| anyhow::anyhow!("{method} {path} on {addr}: no answer within {within:?}"))?
}

/// Whether the service listening for health at `addr` says it is ready.
pub(crate) async fn ready(addr: SocketAddr) -> bool {
    matches!(
        http(addr, "GET", "/readyz", &[], None, Duration::from_secs(2)).await,
        Ok((200, _))
    )
}
