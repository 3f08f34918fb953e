//! `flotilla init [DIR] [--force]`: a commented starter `flotilla.toml` with agents that work
//! on any machine (a deterministic scripted agent and an exec agent running `sh`; an LLM agent
//! commented out) and `hello.json`, a plan that runs on them — so `flotilla up --submit
//! hello.json` works outside the repository in the first minute.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;

/// The starter configuration.
pub(crate) const CONFIG: &str = include_str!("../starter/flotilla.toml");
/// A plan that runs on it.
pub(crate) const PLAN: &str = include_str!("../starter/hello.json");

/// Writes the starter files into `dir`; a file that exists is refused by name (exit 2, nothing
/// written) unless `force`.
pub(crate) fn init(dir: &Path, force: bool) -> anyhow::Result<ExitCode> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let files = [("flotilla.toml", CONFIG), ("hello.json", PLAN)];
    if !force {
        let existing: Vec<String> = files
            .iter()
            .map(|(name, _)| dir.join(name))
            .filter(|p| p.exists())
            .map(|p| p.display().to_string())
            .collect();
        if !existing.is_empty() {
            anyhow::bail!(
                "{} already {}; nothing was written (pass --force to overwrite)",
                existing.join(" and "),
                if existing.len() == 1 {
                    "exists"
                } else {
                    "exist"
                }
            );
        }
    }
    for (name, text) in files {
        let path = dir.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        outln!("wrote {}", path.display());
    }
    let cd = if dir == Path::new(".") {
        String::new()
    } else {
        format!("cd {} && ", dir.display())
    };
    outln!();
    outln!("Next: {cd}flotilla up --submit hello.json");
    outln!("      (a NATS server, a coordinator, a supervisor, workers and the console in one");
    outln!("      process; the run's progress, then its result)");
    Ok(ExitCode::SUCCESS)
}
