//! `flotilla up`'s data directory (`.flotilla` by default): one deployment per store.
//!
//! Two `up`s on one data directory would run two nats-servers on one JetStream store, and each
//! one's workers would take the other's tasks (an exec agent's side effects then happen
//! twice). So `up` holds an exclusive lock on `<data-dir>/up.lock` (`flock`, released by the
//! kernel when the process ends, however it ends) for as long as it runs, and writes into the
//! file who holds it: pid, NATS URL, console URL. A second `up` there is refused at once,
//! naming the running one, before it starts, writes or removes anything.
//!
//! `<data-dir>/nats-url` tells the other commands run in the same directory where the
//! embedded server listens (see `config::running_up_url`); it is written only by the holder
//! of the lock, and removed when it stops.

use std::fs::File;
use std::io::{Seek, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

/// The lock file's name inside the data directory.
const LOCK_FILE: &str = "up.lock";

/// Who holds a data directory: what the lock file says.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub(crate) struct Holder {
    pub(crate) pid: u32,
    /// The embedded (or given) NATS server, once known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) nats_url: Option<String>,
    /// The web console, once it listens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) console_url: Option<String>,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {}", self.pid)?;
        match &self.nats_url {
            Some(u) => write!(f, ", NATS {u}")?,
            None => write!(f, ", still starting")?,
        }
        if let Some(u) = &self.console_url {
            write!(f, ", console {u}")?;
        }
        Ok(())
    }
}

/// The exclusive hold of one data directory, for the life of this `up`.
#[derive(Debug)]
pub(crate) struct DataDirLock {
    file: Flock<File>,
    path: PathBuf,
    holder: Holder,
}

impl DataDirLock {
    /// Takes `dir` (created if missing) for this process, or refuses at once, naming the
    /// `up` that holds it. Nothing in `dir` is changed when refused.
    pub(crate) fn take(dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join(LOCK_FILE);
        // Opened without truncating: the holder's own record must survive the attempt.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        let file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(f) => f,
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
                let holder = std::fs::read_to_string(&path)
                    .ok()
                    .and_then(|t| serde_json::from_str::<Holder>(&t).ok());
                let who = match holder {
                    Some(h) => format!("another `flotilla up` ({h})"),
                    None => "another `flotilla up` (still starting)".to_owned(),
                };
                anyhow::bail!(
                    "{who} already runs on data directory {}: one deployment per store. Use that one (commands run in this directory find it), stop it first, or give this one its own `--data-dir`",
                    dir.display()
                );
            }
            Err((_, e)) => {
                return Err(e).with_context(|| format!("locking {}", path.display()));
            }
        };
        let mut lock = Self {
            file,
            path,
            holder: Holder {
                pid: std::process::id(),
                ..Holder::default()
            },
        };
        lock.write()?;
        Ok(lock)
    }

    /// Records the NATS URL this `up` serves.
    pub(crate) fn set_nats_url(&mut self, url: &str) -> anyhow::Result<()> {
        self.holder.nats_url = Some(url.to_owned());
        self.write()
    }

    /// Records the console's URL.
    pub(crate) fn set_console_url(&mut self, url: &str) -> anyhow::Result<()> {
        self.holder.console_url = Some(url.to_owned());
        self.write()
    }

    fn write(&mut self) -> anyhow::Result<()> {
        let text = serde_json::to_string(&self.holder)?;
        let file: &mut File = &mut self.file;
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| file.write_all(text.as_bytes()))
            .and_then(|()| file.flush())
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

/// `<data-dir>/nats-url`: the embedded server's URL and this process's id, so other commands
/// in the same directory find the server (see `config::running_up_url`). Removed on drop.
#[derive(Debug)]
pub(crate) struct UrlFile(PathBuf);

impl UrlFile {
    /// Written by the holder of `_lock` only: a refused `up` never touches it.
    pub(crate) fn write(_lock: &DataDirLock, dir: &Path, url: &str) -> anyhow::Result<Self> {
        let path = dir.join("nats-url");
        std::fs::write(&path, format!("{url}\n{}\n", std::process::id()))
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(Self(path))
    }
}

impl Drop for UrlFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_hold_of_one_directory_is_refused_naming_the_first() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let mut first = DataDirLock::take(dir.path())?;
        first.set_nats_url("nats://127.0.0.1:4222")?;
        first.set_console_url("http://127.0.0.1:9480/")?;
        // flock locks belong to the open file description: a second open in this process
        // conflicts like another process would.
        let err = DataDirLock::take(dir.path()).map(|_| ()).err();
        let err = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(
            err.contains(&format!("pid {}", std::process::id())),
            "{err}"
        );
        assert!(err.contains("NATS nats://127.0.0.1:4222"), "{err}");
        assert!(err.contains("console http://127.0.0.1:9480/"), "{err}");
        // The first's record is intact, and freed with it.
        let text = std::fs::read_to_string(dir.path().join(LOCK_FILE))?;
        assert!(text.contains("4222"), "{text}");
        drop(first);
        DataDirLock::take(dir.path())?;
        Ok(())
    }
}
