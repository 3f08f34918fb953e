//! The `flotilla` binary. Sub-commands pick the role; this file only parses arguments and
//! dispatches.
//!
//! Output goes through [`output`] (a closed stdout ends a command quietly), and an error ends
//! a command with one line on stderr: the error with each cause once, then what to do when
//! the cause is one a person fixes (no NATS server, no streams, no coordinator).

// Every print goes through `output` (`outln!`, `out!`, `errln!`).
#![deny(clippy::print_stdout, clippy::print_stderr)]

#[macro_use]
mod output;
mod commands;
mod config;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use flotilla_model::ids::RunId;
use flotilla_telemetry::logging::{self, LogFormat, LoggingConfig};
use flotilla_telemetry::{HttpAddr, TelemetryGuard};

/// Services allocate many small, short-lived buffers per message; mimalloc handles that
/// pattern with far less CPU than glibc's allocator (measured with `flotilla bench`, see
/// docs/performance.md). The `system-allocator` feature leaves it out, for heap profilers
/// that intercept `malloc` (heaptrack).
#[cfg(not(feature = "system-allocator"))]
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
    /// Act for this tenant (`flotilla tenant add`): its names, its user (`<user>@<tenant>`)
    /// and its inboxes; overrides nats.tenant.
    #[arg(long, global = true, value_name = "NAME")]
    tenant: Option<String>,
    /// Log line format on stderr, `plain` or `json` (services: overrides telemetry.log-format).
    /// The filter is $FLOTILLA_LOG (default: info for services, warn otherwise).
    #[arg(long, global = true, value_name = "FORMAT")]
    log_format: Option<LogFormat>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a coordinator: plan intake, validation, scheduling.
    Coordinator {
        /// Serve these tenants of a shared deployment, each as `--tenant` would, in one
        /// process (comma separated; see docs/guide/tenants.md).
        #[arg(long, value_delimiter = ',', value_name = "NAMES")]
        tenants: Vec<String>,
        /// Serve /healthz, /readyz and /metrics here, `auto` or `off` (overrides
        /// telemetry.http-addr; default auto: port 9464, or the next free one when another
        /// service on this host has it).
        #[arg(long, value_name = "ADDR|auto|off")]
        http_addr: Option<HttpAddr>,
    },
    /// Run a worker for one pool.
    Worker {
        /// Serve these tenants of a shared deployment, each as `--tenant` would, in one
        /// process whose slots they share fairly (comma separated; see docs/guide/tenants.md).
        #[arg(long, value_delimiter = ',', value_name = "NAMES")]
        tenants: Vec<String>,
        /// Pool to serve (overrides worker.pool).
        #[arg(long)]
        pool: Option<String>,
        /// Tasks at once (overrides worker.concurrency).
        #[arg(long)]
        concurrency: Option<usize>,
        /// Serve /healthz, /readyz and /metrics here, `auto` or `off` (overrides
        /// telemetry.http-addr; default auto: port 9464, or the next free one when another
        /// service on this host has it).
        #[arg(long, value_name = "ADDR|auto|off")]
        http_addr: Option<HttpAddr>,
    },
    /// Run a supervisor: the team roster with presence, failure records, the team API.
    Supervisor {
        /// Serve these tenants of a shared deployment, each as `--tenant` would, in one
        /// process (comma separated; see docs/guide/tenants.md).
        #[arg(long, value_delimiter = ',', value_name = "NAMES")]
        tenants: Vec<String>,
        /// Serve /healthz, /readyz and /metrics here, `auto` or `off` (overrides
        /// telemetry.http-addr; default auto: port 9464, or the next free one when another
        /// service on this host has it).
        #[arg(long, value_name = "ADDR|auto|off")]
        http_addr: Option<HttpAddr>,
    },
    /// The web console: run trees, events, the inbox, the team and workers, live in a
    /// browser (`[console]` configures where it listens and who may act).
    Console {
        /// Serve these tenants' installations, each through its own connection as
        /// `console@<tenant>`: a person sees the tenants that list them in `people`,
        /// `console.administrators` see all (comma separated; see docs/guide/tenants.md).
        #[arg(long, value_delimiter = ',', value_name = "NAMES")]
        tenants: Vec<String>,
        /// As --tenants, for every tenant of the deployment, those added later too.
        #[arg(long, conflicts_with = "tenants")]
        all_tenants: bool,
        /// Listen here (overrides console.listen; default 127.0.0.1:9480).
        #[arg(long, value_name = "ADDR")]
        listen: Option<std::net::SocketAddr>,
        /// Serve /healthz, /readyz and /metrics here, `auto` or `off` (overrides
        /// telemetry.http-addr).
        #[arg(long, value_name = "ADDR|auto|off")]
        http_addr: Option<HttpAddr>,
    },
    /// Everything in one process: embedded nats-server (unless --nats-url), a coordinator,
    /// a supervisor, workers and the web console (its URL is printed).
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
        /// The embedded nats-server's client port (default: a free one). Not with --nats-url,
        /// which replaces the embedded server.
        #[arg(long, value_name = "PORT")]
        nats_port: Option<u16>,
        /// Where the web console listens (overrides console.listen; default 127.0.0.1:9480,
        /// or a free port when that one is taken — not when this flag names it).
        #[arg(long, value_name = "ADDR")]
        console_listen: Option<std::net::SocketAddr>,
        /// Run this plan to the end, print its result and exit with its status.
        #[arg(long, value_name = "PLAN")]
        submit: Option<PathBuf>,
        /// With --submit: start the web console too (its URL is printed before the run
        /// starts, to follow it there) and stay up after the run ends, until Ctrl-C; the exit
        /// status is still the run's.
        #[arg(long, requires = "submit")]
        stay: bool,
        /// Serve /healthz, /readyz and /metrics here, `auto` or `off` (overrides
        /// telemetry.http-addr; default auto: port 9464, or the next free one; with --submit,
        /// off unless given).
        #[arg(long, value_name = "ADDR|auto|off")]
        http_addr: Option<HttpAddr>,
    },
    /// Submit a plan, or a bare query for the deployment's planner (`--query`).
    Submit {
        /// Plan file (.json or .msgpack).
        #[arg(required_unless_present = "query", conflicts_with = "query")]
        plan: Option<PathBuf>,
        /// A bare query instead of a plan: the deployment's planner agent plans it inside the
        /// run (`[coordinator.planner]`), then the run carries the plan out.
        #[arg(long)]
        query: Option<String>,
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
        /// The session the run belongs to (a UUID): runs of one session share session state,
        /// and `flotilla sessions show` lists them.
        #[arg(long)]
        session: Option<flotilla_model::ids::SessionId>,
        /// Give up waiting after this long (e.g. 10m).
        #[arg(long, value_parser = humantime_duration)]
        timeout: Option<Duration>,
    },
    /// Inspect runs.
    #[command(subcommand)]
    Runs(RunsCommand),
    /// Inspect sessions.
    #[command(subcommand)]
    Sessions(SessionsCommand),
    /// Follow a run tree live as one audience sees it (profiles user | debug | metrics;
    /// children off | linked | flatten).
    Watch(commands::watch::WatchArgs),
    /// Try a change on many past runs: fork each selected ended run with the variant (the
    /// fork point and its changes, a JSON or TOML file: `at`, `agent`, `description`,
    /// `input`), a few at a time, wait for the forks and compare each with its original;
    /// with --judge, an agent scores each pair. A Markdown table per run and totals (or
    /// --json). Run again, it finds the forks and judgements it made and does not pay for
    /// them twice. Exit 0 when every run was forked, compared (and judged), 1 when one was
    /// not, 3 when the budget stopped the eval before every run was forked.
    Eval {
        /// The variant file.
        #[arg(long, value_name = "FILE")]
        variant: std::path::PathBuf,
        /// These runs (ids, comma-separated or repeated).
        #[arg(long, value_name = "IDS")]
        runs: Vec<String>,
        /// The ended runs with this label (KEY=VALUE).
        #[arg(long, value_name = "KEY=VALUE")]
        label: Option<String>,
        /// The ended runs of the plan with this name.
        #[arg(long, value_name = "NAME")]
        plan: Option<String>,
        /// The ended runs of this session.
        #[arg(long)]
        session: Option<flotilla_model::ids::SessionId>,
        /// At most this many runs, oldest first.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Forks in flight at once.
        #[arg(long, default_value_t = 4)]
        concurrency: usize,
        /// Score each pair with this agent: a one-task run given both final answers, which
        /// answers {"score": 0..1, "reason": "…"} or a number.
        #[arg(long, value_name = "AGENT")]
        judge: Option<String>,
        /// Start no more forks once the forks and judge runs have used this many tokens.
        #[arg(long, value_name = "N", allow_negative_numbers = true,
              value_parser = commands::eval::max_tokens_arg)]
        max_tokens: Option<u64>,
        /// Start no more forks once the forks and judge runs have cost this much (US dollars).
        #[arg(long, value_name = "USD", allow_negative_numbers = true,
              value_parser = commands::eval::max_cost_arg)]
        max_cost: Option<f64>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// The team: members with their presence (`team`), one member (`team show`), failure
    /// records (`team stats`). Served by `flotilla supervisor`.
    Team(commands::team::TeamArgs),
    /// Remembered runs (`memory list`, `memory show RUN`, `memory forget RUN`): what bare
    /// queries' planners learn from. Served by `flotilla supervisor`.
    #[command(subcommand)]
    Memory(commands::memory::MemoryCommand),
    /// Earned trust of agents and roles (`trust show [NAME]`, `trust set NAME LEVEL`, `trust
    /// incident NAME`). Served by `flotilla supervisor`.
    #[command(subcommand)]
    Trust(commands::trust::TrustCommand),
    /// The deployment's tenants (`add`, `list`, `show`, `set`, `remove`), their usage
    /// (`usage`) and the NATS configuration that keeps them apart (`nats-config`). For the
    /// platform's operator.
    #[command(subcommand)]
    Tenant(commands::tenant::TenantCommand),
    /// Tasks waiting for a person (`approvals list [--watch]`, `show`, `history`) and the
    /// answers (`approve`, `reject`, `edit`, `respond`). Served by `flotilla coordinator`.
    #[command(subcommand)]
    Approvals(commands::approvals::ApprovalsCommand),
    /// Write a commented starter `flotilla.toml` (agents that work on any machine) and
    /// `hello.json`, a plan that runs on it: then `flotilla up --submit hello.json`.
    Init {
        /// Where (default: here).
        #[arg(default_value = ".")]
        dir: PathBuf,
        /// Overwrite files that exist.
        #[arg(long)]
        force: bool,
    },
    /// The deployment at a glance: NATS, which coordinators and supervisors answer, pools
    /// and their live workers, pending approvals, consumers nobody pulls. Exit 0 when nothing
    /// needs attention, 1 when something does, 2 when NATS is unreachable.
    Status {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// List live workers.
    Workers {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// The example plans of config/examples/, each on the config it names: list them, or run
    /// one with `example NAME` (LLM agents on a scripted test double unless --model-url).
    Example(commands::example::ExampleArgs),
    /// Work with plan files.
    #[command(subcommand)]
    Plan(PlanCommand),
    /// Manage NATS resources.
    #[command(subcommand)]
    Nats(NatsCommand),
    /// JSON Schemas of the wire protocol.
    #[command(subcommand)]
    Schema(SchemaCommand),
    /// Measure performance against raw JetStream in the same run (figures are printed, not
    /// asserted), on a nats-server of its own in a temporary directory — not the
    /// configuration's `nats.urls` — unless --nats-url names one.
    Bench(Box<flotilla_bench::BenchArgs>),
    /// Hours of mixed work while every service is stopped and started again: reports runs
    /// lost and applied twice, approvals decided once, stuck consumers and memory growth
    /// against their targets (exit 1 when one is missed). On a nats-server of its own
    /// unless --nats-url names one.
    Soak(flotilla_bench::SoakArgs),
    /// Workspace topics of a run: write, read, watch entries (inside an exec agent: its own
    /// run, no flags needed).
    #[command(after_long_help = commands::collab::EXIT_CODES)]
    Ws(commands::collab::WsArgs),
    /// Mailboxes between the tasks of a run: send, read, stats, commit.
    #[command(after_long_help = commands::collab::EXIT_CODES)]
    Mbox(commands::collab::MboxArgs),
    /// Session state: small JSON values shared by the runs of a session.
    #[command(after_long_help = commands::collab::EXIT_CODES)]
    State(commands::collab::StateArgs),
    /// Artifacts of a run: payloads too large for a message.
    #[command(after_long_help = commands::collab::EXIT_CODES)]
    Artifacts(commands::collab::ArtifactsArgs),
    /// Inside an exec agent: run another agent as a child run of this task and print its
    /// outcome (agent-as-tool; a retried delivery re-attaches to the same child).
    #[command(after_long_help = commands::collab::EXIT_CODES)]
    Call(commands::collab::CallArgs),
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
    /// The run and, recursively, the child runs its agents started (agent-as-tool,
    /// transfers, workflow steps), with agent, status, duration, tokens and cost per run.
    Tree {
        run: RunId,
        /// Most runs to list, breadth first (1 to 1000).
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=1000))]
        max_runs: u32,
        /// Machine-readable output (nested).
        #[arg(long)]
        json: bool,
    },
    /// Compare two runs task by task: whether each result changed (with a line diff),
    /// tokens, cost, latency and attempts; per run, totals and outcome. Exit 0 when nothing
    /// changed, 1 when something did (or a run does not exist).
    Diff {
        /// The run compared from (the original).
        a: RunId,
        /// The run compared to (the variant).
        b: RunId,
        /// Machine-readable output (the `run.diff` answer).
        #[arg(long)]
        json: bool,
    },
    /// Fork an ended run at a task: a new run of its plan in which TASK (with the changes
    /// given) and everything downstream of it run afresh, and every other task that succeeded
    /// keeps the original's result without running. Prints the fork's run id (with --wait,
    /// its outcome). Exit 0 when accepted (or, with --wait, succeeded), 1 otherwise.
    Fork {
        /// The run to fork (it must have ended).
        run: RunId,
        /// The fork point: a task of the run's plan; TASK:STEP keeps the task's conversation
        /// (an LLM agent's model replies and tool results) before step STEP and goes on from
        /// there (`runs events` shows the steps as `agent_step`).
        #[arg(long, value_name = "TASK[:STEP]")]
        at: String,
        /// Run the fork point with this agent.
        #[arg(long)]
        agent: Option<String>,
        /// Run the fork point with this model instead of its agent's (an LLM agent).
        #[arg(long)]
        model: Option<String>,
        /// Edit the plan: a JSON file holding a subtask, or a list of them, each replacing the
        /// task of its id; an edited task runs afresh with what follows it.
        #[arg(long = "edit", value_name = "FILE")]
        edit: Option<std::path::PathBuf>,
        /// Run the fork point with the instructions in this file (its description).
        #[arg(long, value_name = "FILE", conflicts_with = "description")]
        instructions: Option<std::path::PathBuf>,
        /// Run the fork point with this description.
        #[arg(long)]
        description: Option<String>,
        /// Run the fork point with this input (JSON).
        #[arg(long, value_name = "JSON")]
        input: Option<String>,
        /// The fork's run id (forking again with it answers `duplicate`).
        #[arg(long = "id", value_name = "RUN")]
        fork_run_id: Option<RunId>,
        /// Wait for the fork to end and print its outcome.
        #[arg(long)]
        wait: bool,
        /// Machine-readable output (the `run.fork` answer).
        #[arg(long)]
        json: bool,
    },
    /// Replay an ended run from its log through the run machine alone — every task served
    /// from its recorded result: no model call, no tool run — and check it reaches the same
    /// decisions and state as recorded, or say where it first did not. Exit 0 when the same,
    /// 1 when it diverged or the run does not exist.
    Replay {
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
        /// Then undo the succeeded tasks that declare a compensation (`compensate`), in
        /// reverse dependency order, in a rollback run (a child of the run); waits for it too
        /// and exits 1 if a compensation failed.
        #[arg(long)]
        rollback: bool,
        /// Return once the cancellation is recorded.
        #[arg(long)]
        no_wait: bool,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    #[command(flatten)]
    Control(commands::controls::ControlCommand),
}

#[derive(Debug, Subcommand)]
enum SessionsCommand {
    /// The runs of a session, oldest first: runs submitted with the session id and the
    /// child runs of their trees.
    Show {
        session: flotilla_model::ids::SessionId,
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
        /// Also create these pools' consumers (`pool-<name>`) ahead of their workers, for
        /// autoscalers that read a pool's backlog (KEDA's nats-jetstream scaler).
        #[arg(long, value_delimiter = ',', value_name = "POOL,...")]
        pools: Vec<String>,
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

/// The global flags the collaboration commands connect with (they load the configuration
/// themselves: inside an exec agent the worker's environment replaces it).
fn collab_global<'a>(
    config: &'a Option<PathBuf>,
    nats_url: &'a Option<String>,
) -> commands::collab::Global<'a> {
    commands::collab::Global {
        config: config.as_deref(),
        nats_url: nats_url.as_deref(),
    }
}

fn humantime_duration(s: &str) -> Result<Duration, String> {
    humantime_serde::re::humantime::parse_duration(s).map_err(|e| e.to_string())
}

/// The `service.name` of exported spans for a command; `Some` only for long-running services.
fn service_name(command: &Command) -> Option<&'static str> {
    match command {
        Command::Coordinator { .. } => Some("flotilla-coordinator"),
        Command::Worker { .. } => Some("flotilla-worker"),
        Command::Supervisor { .. } => Some("flotilla-supervisor"),
        Command::Console { .. } => Some("flotilla-console"),
        Command::Up { submit: None, .. } | Command::Up { stay: true, .. } => Some("flotilla-up"),
        _ => None,
    }
}

/// Logging (and OTLP export when `OTEL_*` asks for it). The gRPC exporter needs the runtime,
/// so this runs inside it; the returned guard must be dropped outside `block_on`.
fn init_logging(
    runtime: &tokio::runtime::Runtime,
    cli: &Cli,
    config: Option<&config::Config>,
) -> Result<TelemetryGuard, logging::InitError> {
    let service = service_name(&cli.command);
    let format = cli
        .log_format
        .or(config.map(|c| c.telemetry.log_format))
        .unwrap_or_default();
    let logging = LoggingConfig::new(
        // Services report their life at info; client commands speak through their output.
        // The NATS client's own info lines (each connection's "connected", an "IO error" when
        // a connection closes at shutdown) say again what Flotilla's own lines say
        // (`Connected to NATS`, `Lost the connection…`, `Reconnected…`), so only its warnings
        // show unless FLOTILLA_LOG asks.
        // `up` runs every service on one embedded server it has just named: each of its
        // connections saying "Connected to NATS" again is noise (a lost link still warns).
        if matches!(cli.command, Command::Up { .. }) {
            "info,async_nats=warn,flotilla_bus::connect=warn"
        } else if service.is_some() {
            "info,async_nats=warn"
        } else {
            "warn"
        },
        format,
        service.unwrap_or(match cli.command {
            Command::Up { .. } => "flotilla-up",
            _ => "flotilla-cli",
        }),
    );
    let _in_runtime = runtime.enter();
    logging::init(&logging)
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
    if let Some(t) = &cli.tenant {
        config::set_tenant_flag(t);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            errln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    // Services read their config before logging starts: `[telemetry]` sets the log format.
    let config = match service_name(&cli.command) {
        Some(_) => match config::load(cli.config.as_deref(), cli.nats_url.as_deref()) {
            Ok(c) => Some(c),
            Err(e) => {
                errln!("error: {}", error_line(&e));
                return ExitCode::from(2);
            }
        },
        None => None,
    };
    let guard = match init_logging(&runtime, &cli, config.as_ref()) {
        Ok(g) => g,
        Err(e) => {
            errln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let code = match runtime.block_on(run(cli, config)) {
        Ok(code) => code,
        Err(e) if output::is_closed_pipe(&e) => output::reader_gone(),
        Err(e) => {
            errln!("error: {}", error_line(&e));
            ExitCode::from(2)
        }
    };
    // Flushes buffered spans while the runtime (which the gRPC exporter uses) still runs.
    drop(guard);
    code
}

/// How an error that ends a command reads: each cause once
/// ([`flotilla_bus::error::report`]), then what to do when the root cause is one a person
/// fixes and the message does not say it already.
fn error_line(e: &anyhow::Error) -> String {
    let text = flotilla_bus::error::report(e.as_ref());
    match flotilla_bus::error::diagnose(e.as_ref()) {
        Some(d) if !text.contains(d.names()) => format!("{text}; {}", d.hint()),
        _ => text,
    }
}

/// `preloaded`: the configuration, when `main` already loaded it (services).
async fn run(cli: Cli, preloaded: Option<config::Config>) -> anyhow::Result<ExitCode> {
    config::warn_unknown_env();
    let mut preloaded = preloaded;
    let mut load = || match preloaded.take() {
        Some(c) => Ok(c),
        None => config::load(cli.config.as_deref(), cli.nats_url.as_deref()),
    };
    match cli.command {
        Command::Coordinator { http_addr, tenants } => {
            let mut c = load()?;
            if let Some(a) = http_addr {
                c.telemetry.http_addr = a;
            }
            if tenants.is_empty() {
                commands::services::coordinator(&c).await
            } else {
                commands::tenant_services::coordinators(&c, &tenants).await
            }
        }
        Command::Supervisor { http_addr, tenants } => {
            let mut c = load()?;
            if let Some(a) = http_addr {
                c.telemetry.http_addr = a;
            }
            if tenants.is_empty() {
                commands::services::supervisor(&c).await
            } else {
                commands::tenant_services::supervisors(&c, &tenants).await
            }
        }
        Command::Console {
            listen,
            http_addr,
            tenants,
            all_tenants,
        } => {
            let mut c = load()?;
            if let Some(a) = listen {
                c.console.listen = a;
            }
            if let Some(a) = http_addr {
                c.telemetry.http_addr = a;
            }
            c.validate()?;
            let tenants = if all_tenants {
                commands::tenant_services::tenant_names(&c, &[])?;
                Some(flotilla_console::Tenants::All)
            } else if tenants.is_empty() {
                None
            } else {
                Some(flotilla_console::Tenants::Named(
                    commands::tenant_services::tenant_names(&c, &tenants)?,
                ))
            };
            commands::console::console(&c, tenants).await
        }
        Command::Worker {
            pool,
            concurrency,
            http_addr,
            tenants,
        } => {
            let mut c = load()?;
            if let Some(p) = pool {
                c.worker.pool = p;
            }
            if let Some(n) = concurrency {
                c.worker.concurrency = n;
            }
            if let Some(a) = http_addr {
                c.telemetry.http_addr = a;
            }
            c.validate()?;
            if tenants.is_empty() {
                commands::services::worker(&c).await
            } else {
                commands::tenant_services::workers(&c, &tenants).await
            }
        }
        Command::Up {
            workers,
            concurrency,
            data_dir,
            nats_port,
            console_listen,
            submit,
            stay,
            http_addr,
        } => {
            if nats_port.is_some() && cli.nats_url.is_some() {
                anyhow::bail!(
                    "--nats-port sets the port of up's embedded nats-server, and --nats-url replaces that server: give one of them"
                );
            }
            let mut c = load()?;
            if let Some(listen) = console_listen {
                c.console.listen = listen;
            }
            if let Some(n) = concurrency {
                c.worker.concurrency = n;
                c.validate()?;
            }
            // A one-shot `up --submit` is a command, not a service: it listens only when asked.
            // (`--stay` makes it a service again.)
            c.telemetry.http_addr = match (http_addr, &submit) {
                (Some(a), _) => a,
                (None, Some(_)) if !stay => HttpAddr::Off,
                (None, _) => c.telemetry.http_addr,
            };
            let embedded = cli.nats_url.is_none();
            let opts = commands::services::UpOptions {
                workers,
                data_dir,
                nats_port,
                console_port_fallback: console_listen.is_none(),
                submit,
                stay,
                embedded,
            };
            commands::services::up(c, opts).await
        }
        Command::Submit {
            plan,
            query,
            follow,
            wait,
            json,
            run_id,
            idempotency_key,
            labels,
            session,
            timeout,
        } => {
            let opts = commands::submit::SubmitOptions {
                follow,
                wait,
                json,
                run_id,
                idempotency_key,
                labels: labels.into_iter().collect::<BTreeMap<_, _>>(),
                session,
                timeout,
                query,
            };
            commands::submit::submit(&load()?, plan.as_deref(), opts).await
        }
        Command::Runs(RunsCommand::List { limit, json }) => {
            commands::runs::list(&load()?, limit, json).await
        }
        Command::Runs(RunsCommand::Show { run, json }) => {
            commands::runs::show(&load()?, run, json).await
        }
        Command::Runs(RunsCommand::Tree {
            run,
            max_runs,
            json,
        }) => commands::runs::tree(&load()?, run, max_runs as usize, json).await,
        Command::Sessions(SessionsCommand::Show { session, json }) => {
            commands::runs::session(&load()?, session, json).await
        }
        Command::Runs(RunsCommand::Diff { a, b, json }) => {
            commands::diff::diff(&load()?, a, b, json).await
        }
        Command::Runs(RunsCommand::Fork {
            run,
            at,
            agent,
            model,
            edit,
            instructions,
            description,
            input,
            fork_run_id,
            wait,
            json,
        }) => {
            let changes = commands::fork::Changes {
                agent,
                model,
                edit,
                instructions,
                description,
                input,
            };
            commands::fork::fork(&load()?, run, at, changes, fork_run_id, wait, json).await
        }
        Command::Runs(RunsCommand::Replay { run, json }) => {
            commands::fork::replay(&load()?, run, json).await
        }
        Command::Runs(RunsCommand::History { run, json }) => {
            commands::runs::history(&load()?, run, json).await
        }
        Command::Runs(RunsCommand::Cancel {
            run,
            reason,
            rollback,
            no_wait,
            json,
        }) => {
            let how = commands::runs::CancelHow {
                rollback,
                wait: !no_wait,
                json,
            };
            commands::runs::cancel(&load()?, run, reason, how).await
        }
        Command::Runs(RunsCommand::Control(command)) => {
            commands::controls::control(&load()?, command).await
        }
        Command::Team(args) => commands::team::team(&load()?, args).await,
        Command::Memory(command) => commands::memory::memory(&load()?, command).await,
        Command::Trust(command) => commands::trust::trust(&load()?, command).await,
        Command::Tenant(command) => commands::tenant::tenant(&load()?, command).await,
        Command::Approvals(command) => commands::approvals::approvals(&load()?, command).await,
        Command::Init { dir, force } => commands::init::init(&dir, force),
        Command::Example(args) => {
            commands::example::example(args, cli.config.as_deref(), cli.nats_url.as_deref()).await
        }
        Command::Status { json } => commands::status::status(&load()?, json).await,
        Command::Workers { json } => commands::runs::workers(&load()?, json).await,
        Command::Watch(args) => commands::watch::watch(&load()?, args).await,
        Command::Plan(PlanCommand::Validate {
            file,
            json,
            offline,
        }) => commands::plan::validate(&load()?, &file, json, offline).await,
        Command::Nats(NatsCommand::Provision {
            dry_run,
            json,
            pools,
        }) => commands::nats::provision(&load()?, dry_run, json, &pools).await,
        Command::Schema(SchemaCommand::Write { dir }) => commands::schema::write(&dir),
        Command::Schema(SchemaCommand::Check { dir }) => commands::schema::check(&dir),
        Command::Eval {
            variant,
            runs,
            label,
            plan,
            session,
            limit,
            concurrency,
            judge,
            max_tokens,
            max_cost,
            json,
        } => {
            let selector = commands::eval::Selector {
                runs: commands::eval::run_ids(&runs)?,
                label,
                plan,
                session,
                limit,
            };
            let opts = commands::eval::EvalOptions {
                concurrency,
                json,
                judge,
                budget: commands::eval::Budget {
                    max_tokens,
                    max_cost_usd: max_cost,
                },
            };
            commands::eval::eval(&load()?, &variant, selector, opts).await
        }
        Command::Bench(args) => {
            flotilla_bench::run(*args, cli.nats_url.as_deref()).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Soak(args) => Ok(
            if flotilla_bench::soak(args, cli.nats_url.as_deref()).await? {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            },
        ),
        Command::Ws(args) => {
            commands::collab::ws(collab_global(&cli.config, &cli.nats_url), args).await
        }
        Command::Mbox(args) => {
            commands::collab::mbox(collab_global(&cli.config, &cli.nats_url), args).await
        }
        Command::State(args) => {
            commands::collab::state(collab_global(&cli.config, &cli.nats_url), args).await
        }
        Command::Artifacts(args) => {
            commands::collab::artifacts(collab_global(&cli.config, &cli.nats_url), args).await
        }
        Command::Call(args) => {
            commands::collab::call(collab_global(&cli.config, &cli.nats_url), args).await
        }
    }
}
