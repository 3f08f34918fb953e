//! The exec shim: makes an `exec` agent's processes die with their worker.
//!
//! Without it, `kill -9` of a worker leaves the agent's command running: its processes are
//! re-parented to init and run to the end while the redelivered attempt already runs on
//! another worker — the same attempt twice at once. So the worker does not start the command
//! itself but a small shim (the `flotilla` binary, hidden sub-command `__exec-shim`):
//!
//! ```text
//! worker ──spawn (own process group)──► shim ──spawn (same group)──► command ──► its children
//!   │ dies                               │ PR_SET_PDEATHSIG = SIGTERM
//!   └───────────── SIGTERM ─────────────►│ kills every other process of its group, exits
//! ```
//!
//! * The shim asks the kernel for SIGTERM when its parent dies (`PR_SET_PDEATHSIG`), and
//!   checks its parent is still the worker that started it (the worker could die before the
//!   request is made).
//! * On SIGTERM, SIGINT or SIGHUP it kills its whole process group — the command and
//!   everything the command forked — and exits.
//! * When the command exits on its own, the shim kills what the command left running in the
//!   group, then exits with the command's status: an attempt's processes end with it.
//! * Cancellation and timeouts are unchanged: the worker kills the whole group.
//!
//! Linux only (`PR_SET_PDEATHSIG`); elsewhere the command runs without the shim.

use std::ffi::OsString;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::sys::signal::{SigSet, Signal, kill};
use nix::unistd::{Pid, getpgid, getpgrp, getpid, getppid};

/// The hidden sub-command of the `flotilla` binary that runs the shim.
pub const SHIM_SUBCOMMAND: &str = "__exec-shim";

/// Environment variable carrying the worker's process id to the shim.
pub const SHIM_PARENT_ENV: &str = "FLOTILLA_SHIM_PARENT";

static SHIM: OnceLock<Vec<OsString>> = OnceLock::new();

/// Sets the program (and leading arguments) that runs the shim, e.g. the `flotilla` binary
/// and `__exec-shim`. The binary calls this at start; embedders without a shim run commands
/// directly (their processes then do not die with a killed worker).
pub fn set_exec_shim(program_and_args: Vec<OsString>) {
    let _ = SHIM.set(program_and_args);
}

/// The shim command line, when one is set.
pub(crate) fn exec_shim() -> Option<&'static [OsString]> {
    SHIM.get().map(Vec::as_slice).filter(|v| !v.is_empty())
}

/// Runs the shim: `args` is the command and its arguments. Returns the exit code.
pub fn run_shim(mut args: impl Iterator<Item = OsString>) -> i32 {
    let Some(program) = args.next() else {
        eprintln!("flotilla exec shim: no command given");
        return 2;
    };
    // Die with the worker, and make sure it did not die already.
    #[cfg(target_os = "linux")]
    if let Err(e) = nix::sys::prctl::set_pdeathsig(Signal::SIGTERM) {
        eprintln!("flotilla exec shim: cannot ask for a parent-death signal: {e}");
    }
    if let Some(parent) = std::env::var(SHIM_PARENT_ENV)
        .ok()
        .and_then(|p| p.parse::<i32>().ok())
        && getppid().as_raw() != parent
    {
        return 137;
    }
    // Termination signals are taken by a waiting thread, not by default handlers. The
    // command gets an empty signal mask (std resets it in the child).
    let mut signals = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        signals.add(s);
    }
    if let Err(e) = signals.thread_block() {
        eprintln!("flotilla exec shim: cannot block signals: {e}");
    }
    let mut child = match std::process::Command::new(&program)
        .args(args)
        .env_remove(SHIM_PARENT_ENV)
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cannot run {}: {e}", program.to_string_lossy());
            return 127;
        }
    };
    let group = getpgrp();
    let me = getpid();
    let done = Arc::new(AtomicBool::new(false));
    let watching = Arc::clone(&done);
    std::thread::spawn(move || {
        if let Ok(sig) = signals.wait()
            && !watching.load(Ordering::SeqCst)
        {
            kill_group_except(group, me);
            std::process::exit(128 + sig as i32);
        }
    });
    let status = child.wait();
    done.store(true, Ordering::SeqCst);
    // What the command left running ends with the attempt.
    kill_group_except(group, me);
    match status {
        Ok(s) => s.code().unwrap_or_else(|| {
            use std::os::unix::process::ExitStatusExt;
            128 + s.signal().unwrap_or(9)
        }),
        Err(e) => {
            eprintln!("flotilla exec shim: waiting for the command failed: {e}");
            1
        }
    }
}

/// SIGKILLs every process of process group `group` except `me`.
fn kill_group_except(group: Pid, me: Pid) {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
            .map(Pid::from_raw)
        else {
            continue;
        };
        if pid != me && getpgid(Some(pid)).is_ok_and(|g| g == group) {
            let _ = kill(pid, Signal::SIGKILL);
        }
    }
}
