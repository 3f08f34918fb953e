//! The `flotilla` binary. Sub-commands pick the role; this file only parses arguments and
//! dispatches.

mod commands;
mod config;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
    Bench {
        /// Sections to run.
        #[arg(long, value_enum, default_values_t = [BenchSection::Validate])]
        only: Vec<BenchSection>,
        /// Repetitions of the validation section.
        #[arg(long, default_value_t = 30)]
        iterations: usize,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BenchSection {
    /// Validating a 10,000-subtask plan.
    Validate,
}

#[derive(Debug, Subcommand)]
enum PlanCommand {
    /// Check a plan and list every problem (exit 0 valid, 1 invalid).
    Validate {
        /// Plan file (.json, or .msgpack).
        file: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Skip installation checks (known pools).
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

fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("FLOTILLA_LOG").unwrap_or_else(|_| EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
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
    match &cli.command {
        Command::Plan(PlanCommand::Validate {
            file,
            json,
            offline,
        }) => {
            let ctx = if *offline {
                Default::default()
            } else {
                load()?.validation_context()
            };
            commands::plan::validate(file, *json, &ctx)
        }
        Command::Nats(NatsCommand::Provision { dry_run, json }) => {
            commands::nats::provision(&load()?, *dry_run, *json).await
        }
        Command::Schema(SchemaCommand::Write { dir }) => commands::schema::write(dir),
        Command::Schema(SchemaCommand::Check { dir }) => commands::schema::check(dir),
        Command::Bench { only, iterations } => {
            if only.contains(&BenchSection::Validate) {
                commands::bench::validate_section(*iterations);
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
