//! Everything the binary prints goes through here, so a reader that goes away ends the
//! command the same way for every command.
//!
//! `flotilla runs list | head -1` closes the pipe after one line. Rust ignores SIGPIPE, so
//! the next write fails with `EPIPE`, and `println!` panics on that ("failed printing to
//! stdout: Broken pipe", exit 101). Restoring SIGPIPE's default action instead would also
//! kill the process when a NATS connection breaks mid-write (async-nats writes with
//! `writev`, which raises SIGPIPE), so the rule lives at the writes: a closed stdout ends the
//! process at once with exit code 0 — the reader has what it wanted — and nothing on stderr.
//! Any other write error (a full disk) ends it with exit code 2 and says so.
//!
//! Stderr carries diagnostics: a write there that fails is dropped (there is nobody to tell).
//! The crate denies `clippy::print_stdout` and `clippy::print_stderr`, so every new print goes
//! through [`outln!`], [`out!`] or [`errln!`].

use std::fmt;
use std::io::{self, Write};

/// Writes to stdout like `println!`; a closed stdout ends the process quietly (exit 0).
macro_rules! outln {
    () => {
        $crate::output::stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::output::stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// Writes to stdout like `print!`; a closed stdout ends the process quietly (exit 0).
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::output::stdout(format_args!($($arg)*))
    };
}

/// Writes a line to stderr like `eprintln!`, without panicking when stderr is closed.
macro_rules! errln {
    () => {
        $crate::output::stderr(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::output::stderr(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// Writes `args` to stdout (see the module docs for a closed stdout).
pub(crate) fn stdout(args: fmt::Arguments<'_>) {
    let mut out = io::stdout().lock();
    if let Err(e) = out.write_fmt(args) {
        stdout_failed(&e);
    }
}

/// Writes raw bytes to stdout and flushes (see the module docs for a closed stdout).
pub(crate) fn stdout_bytes(bytes: &[u8]) {
    let mut out = io::stdout().lock();
    if let Err(e) = out.write_all(bytes).and_then(|()| out.flush()) {
        stdout_failed(&e);
    }
}

/// Writes `args` to stderr; a failure is dropped.
pub(crate) fn stderr(args: fmt::Arguments<'_>) {
    let _ = io::stderr().lock().write_fmt(args);
}

/// A write to stdout failed with `e`: the process ends.
fn stdout_failed(e: &io::Error) -> ! {
    if e.kind() == io::ErrorKind::BrokenPipe {
        reader_gone();
    }
    stderr(format_args!("error: cannot write to stdout: {e}\n"));
    std::process::exit(2);
}

/// The reader of stdout went away: end now, successfully and silently. Nothing is left to
/// clean up that the process's end does not: NATS connections close with it, and the
/// embedded nats-server of `flotilla up` dies with its parent (`PR_SET_PDEATHSIG`).
pub(crate) fn reader_gone() -> ! {
    std::process::exit(0)
}

/// Whether `error` (or one of its causes) is a write to a closed pipe: a command that wrote
/// to stdout through a writer of its own and passed the failure up.
pub(crate) fn is_closed_pipe(error: &anyhow::Error) -> bool {
    error.chain().any(|c| {
        c.downcast_ref::<io::Error>()
            .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
    })
}
