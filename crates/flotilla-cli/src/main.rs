//! The `flotilla` binary. Sub-commands pick the role; this file only parses arguments and
//! dispatches.

mod commands;
mod config;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use flotilla_model::ids::RunId;

/// Services allocate many small, short-lived buffers per message; mimalloc handles that
/// pattern with far less CPU than glibc's allocator (measured with `flotilla bench`, see
/// docs/performance.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Flotilla: teams of AI agents as distributed workers on NATS JetStream.
#[derive(Debug, Parser)]
#[command(name = "flotilla", version, about, propagate_version = true)]
struct Cli {
    /// Config file (default: $FLOTILLA_CONFIG, ./flotilla.toml, ./config/flotilla.toml).
    #[arg(long, global = true, value_name = "PATH")]
    config: Option<PathBuf>,
    /// NATS server URL(s), comma separated; overrides nats.urls.
    #[arg(long, global = true, value_name = "URL")]
    nats_url: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a coordinator: plan intake, validation, scheduling.
    Coordinator,
    /// Run a worker for one pool.
    Worker {
        /// Pool to serve (overrides worker.pool).
        #[arg(long)]
        pool: Option<String>,
        /// Tasks at once (overrides worker.concurrency).
        #[arg(long)]
        concurrency: Option<usize>,
    },
    /// Everything in one process: embedded nats-server (unless --nats-url), a coordinator and
    /// workers.
    Up {
        /// Workers to run.
        #[arg(long, default_value_t = 2)]
        workers: usize,
        /// Tasks at once per worker (overrides worker.concurrency).
        #[arg(long)]
        concurrency: Option<usize>,
        /// Where the embedded nats-server keeps its data.
        #[arg(long, default_value = ".flotilla")]
        data_dir: PathBuf,
        /// Run this plan to the end, print its result and exit with its status.
        #[arg(long, value_name = "PLAN")]
        submit: Option<PathBuf>,
    },
    /// Submit a plan.
    Submit {
        /// Plan file (.json or .msgpack).
        plan: PathBuf,
        /// Show live progress, then the final result.
        #[arg(long)]
        follow: bool,
        /// Wait for the end, then print the final result.
        #[arg(long)]
        wait: bool,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Use this run id (resubmitting it yields the same run).
        #[arg(long)]
        run_id: Option<RunId>,
        /// Idempotency key (resubmitting it yields the same run).
        #[arg(long)]
        idempotency_key: Option<String>,
        /// Label the run (repeatable).
        #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
        labels: Vec<(String, String)>,
        /// Give up waiting after this long (e.g. 10m).
        #[arg(long, value_parser = humantime_duration)]
        timeout: Option<Duration>,
    },
    /// Inspect runs.
    #[command(subcommand)]
    Runs(RunsCommand),
    /// List live workers.
    Workers {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Work with plan files.
    #[command(subcommand)]
    Plan(PlanCommand),
    /// Manage NATS resources.
    #[command(subcommand)]
    Nats(NatsCommand),
    /// JSON Schemas of the wire protocol.
    #[command(subcommand)]
    Schema(SchemaCommand),
    /// Measure performance (figures are printed, not asserted).
    Bench(commands::bench::BenchArgs),
}

#[derive(Debug, Subcommand)]
enum RunsCommand {
    /// The most recent runs.
    List {
        /// How many.
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// One run with its tasks and result.
    Show {
        run: RunId,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// The run log: every input that changed the run.
    History {
        run: RunId,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Cancel a run: nothing new starts, running attempts are cancelled on their workers,
    /// and the run ends `cancelled`. Waits for the end unless --no-wait.
    Cancel {
        run: RunId,
        /// Why (recorded in the outcome).
        #[arg(long)]
        reason: Option<String>,
        /// Return once the cancellation is recorded.
        #[arg(long)]
        no_wait: bool,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum PlanCommand {
    /// Check a plan and list every problem (exit 0 valid, 1 invalid). Asks a running
    /// coordinator to validate against the deployment (pools, agents, live workers, message
    /// size); without one, validates offline against the local config and says so.
    Validate {
        /// Plan file (.json, or .msgpack).
        file: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Do not contact NATS; check the plan's structure only (no pools, agents).
        #[arg(long)]
        offline: bool,
    },
}

#[derive(Debug, Subcommand)]
enum NatsCommand {
    /// Create missing streams and buckets; update compatible drift; report incompatible drift.
    Provision {
        /// Show what would change without changing it.
        #[arg(long)]
        dry_run: bool,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum SchemaCommand {
    /// Write the schemas (default: docs/schema).
    Write {
        #[arg(long, default_value = "docs/schema")]
        dir: PathBuf,
    },
    /// Fail when the checked-in schemas are stale.
    Check {
        #[arg(long, default_value = "docs/schema")]
        dir: PathBuf,
    },
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("expected KEY=VALUE, got {s:?}"))
}

fn humantime_duration(s: &str) -> Result<Duration, String> {
    humantime_serde::re::humantime::parse_duration(s).map_err(|e| e.to_string())
}

fn init_tracing(default: &str) {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_env("FLOTILLA_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    // Colours only for a person at a terminal: log collectors get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .try_init();
}

fn main() -> ExitCode {
    // The exec shim runs before anything else: no runtime, no logging, no config.
    let mut args = std::env::args_os();
    if args
        .nth(1)
        .is_some_and(|a| a == flotilla_worker::agents::shim::SHIM_SUBCOMMAND)
    {
        let mut rest = args.peekable();
        if rest.peek().is_some_and(|a| a == "--") {
            rest.next();
        }
        let code = flotilla_worker::agents::shim::run_shim(rest);
        return ExitCode::from(code.clamp(0, 255) as u8);
    }
    // Exec agents run under this binary's shim, so they die with their worker.
    if let Ok(exe) = std::env::current_exe() {
        flotilla_worker::agents::shim::set_exec_shim(vec![
            exe.into_os_string(),
            flotilla_worker::agents::shim::SHIM_SUBCOMMAND.into(),
        ]);
    }
    let cli = Cli::parse();
    let service = matches!(
        cli.command,
        Command::Coordinator | Command::Worker { .. } | Command::Up { submit: None, .. }
    );
    init_tracing(if service { "info" } else { "warn" });
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let load = || config::load(cli.config.as_deref(), cli.nats_url.as_deref());
    match cli.command {
        Command::Coordinator => commands::services::coordinator(&load()?).await,
        Command::Worker { pool, concurrency } => {
            let mut c = load()?;
            if let Some(p) = pool {
                c.worker.pool = p;
            }
            if let Some(n) = concurrency {
                c.worker.concurrency = n;
            }
            c.validate()?;
            commands::services::worker(&c).await
        }
        Command::Up {
            workers,
            concurrency,
            data_dir,
            submit,
        } => {
            let mut c = load()?;
            if let Some(n) = concurrency {
                c.worker.concurrency = n;
                c.validate()?;
            }
            let embedded = cli.nats_url.is_none();
            let opts = commands::services::UpOptions {
                workers,
                data_dir,
                submit,
                embedded,
            };
            commands::services::up(c, opts).await
        }
        Command::Submit {
            plan,
            follow,
            wait,
            json,
            run_id,
            idempotency_key,
            labels,
            timeout,
        } => {
            let opts = commands::submit::SubmitOptions {
                follow,
                wait,
                json,
                run_id,
                idempotency_key,
                labels: labels.into_iter().collect::<BTreeMap<_, _>>(),
                timeout,
            };
            commands::submit::submit(&load()?, &plan, opts).await
        }
        Command::Runs(RunsCommand::List { limit, json }) => {
            commands::runs::list(&load()?, limit, json).await
        }
        Command::Runs(RunsCommand::Show { run, json }) => {
            commands::runs::show(&load()?, run, json).await
        }
        Command::Runs(RunsCommand::History { run, json }) => {
            commands::runs::history(&load()?, run, json).await
        }
        Command::Runs(RunsCommand::Cancel {
            run,
            reason,
            no_wait,
            json,
        }) => commands::runs::cancel(&load()?, run, reason, !no_wait, json).await,
        Command::Workers { json } => commands::runs::workers(&load()?, json).await,
        Command::Plan(PlanCommand::Validate {
            file,
            json,
            offline,
        }) => commands::plan::validate(&load()?, &file, json, offline).await,
        Command::Nats(NatsCommand::Provision { dry_run, json }) => {
            commands::nats::provision(&load()?, dry_run, json).await
        }
        Command::Schema(SchemaCommand::Write { dir }) => commands::schema::write(&dir),
        Command::Schema(SchemaCommand::Check { dir }) => commands::schema::check(&dir),
        Command::Bench(args) => {
            commands::bench::run(cli.config.as_deref(), cli.nats_url.as_deref(), args).await
        }
    }
}
