//! Everything the bench prints goes through here, with the `flotilla` binary's rule for a
//! reader that goes away: `flotilla bench | head -3` closes the pipe, and the next write ends
//! the process at once with exit code 0 and nothing on stderr (instead of `println!`'s panic,
//! exit 101). Any other write error (a full disk) ends it with exit code 2 and says so.
//!
//! Stderr carries diagnostics: a write there that fails is dropped (there is nobody to tell).
//! The crate denies `clippy::print_stdout` and `clippy::print_stderr`, so every new print goes
//! through `outln!`, `out!` or `errln!`.

use std::fmt;
use std::io::{self, Write};

/// Writes to stdout like `println!`; a closed stdout ends the process quietly (exit 0).
macro_rules! outln {
    () => {
        $crate::harness::output::stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::harness::output::stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// Writes to stdout like `print!`; a closed stdout ends the process quietly (exit 0).
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::harness::output::stdout(format_args!($($arg)*))
    };
}

/// Writes a line to stderr like `eprintln!`, without panicking when stderr is closed.
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::harness::output::stderr(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// Writes `args` to stdout (see the module docs for a closed stdout).
pub(crate) fn stdout(args: fmt::Arguments<'_>) {
    let mut out = io::stdout().lock();
    if let Err(e) = out.write_fmt(args) {
        if e.kind() == io::ErrorKind::BrokenPipe {
            // The reader has what it wanted.
            std::process::exit(0);
        }
        stderr(format_args!("error: cannot write to stdout: {e}\n"));
        std::process::exit(2);
    }
}

/// Writes `args` to stderr; a failure is dropped.
pub(crate) fn stderr(args: fmt::Arguments<'_>) {
    let _ = io::stderr().lock().write_fmt(args);
}
