//! `flotilla bench`: Flotilla's performance, measured, not asserted. The figures are printed
//! for a person (and for `docs/performance.md`) to read; no figure fails the bench, and a
//! target printed next to a figure is what the design aims at, not a check.
//!
//! Every section that involves NATS runs against one nats-server (embedded unless
//! `--nats-url`), and the raw JetStream baseline is measured in the same run, so the printed
//! ratios compare like with like:
//!
//! * **raw** — the bench's own task round trip on plain JetStream: publish a task to a
//!   work-queue stream → a worker pulls it → publishes a result → a collector pulls that.
//!   Throughput with 512 in flight; latency (p50/p99) with 1 in flight (`harness::raw`).
//! * **flotilla** — a `flotilla coordinator` and `flotilla worker` processes with a no-op
//!   (`scripted`) agent: tasks/s across many independent runs; dependency hop latency on a
//!   100-step chain (predecessor's result stored → dependent's agent starts); makespan of a
//!   1 → 1000 → 1 fan-out/fan-in; peak RSS of each process (module `flotilla`).
//! * **validate** — validating a 10,000-subtask plan (module `validate`).
//! * **recovery** — `kill -9` of a worker running a task → the task started on another
//!   (module `recovery`).
//! * **collab** — the collaboration layer (module `collab`): dependency hop vs topic hop vs
//!   gated dispatch (an outside writer's entry → the consumer's agent starts); with the
//!   services stopped, workspace append → live watcher, paging through 100,000 entries and
//!   mailbox send → waiting receiver, each next to its plain JetStream baseline.
//! * **llm** — LLM agents against a simulated OpenAI-compatible provider (a test double in
//!   the bench, module `llm`): orchestration overhead per model call; one worker with many
//!   concurrent LLM tasks vs the ideal throughput; scaling over worker processes.
//! * **tree** — run trees (module `tree`): child spawn → the child's task started vs the
//!   dependency hop and the raw round trip; a depth-10 nested agent-as-tool chain vs ten
//!   dependency hops; the delivery lag of `flatten` projections (client library and
//!   `api.watch`) with 100 concurrent children, against `linked`. The agents that start
//!   children are deterministic Rust agents run by an in-process worker in the bench.
//! * **team** — the supervisor (module `team`): throughput of 1-task runs without and with a
//!   `flotilla supervisor` following the events; its CPU per run; catch-up after a burst;
//!   the lag from a run's outcome to its agent's failure record, next to the raw round trip;
//!   anycast and recruit latency next to the dependency hop; the supervisor's and workers'
//!   memory and the consumers with `--teammates` idle teammates; an idle teammate's message
//!   → its turn started, next to the raw mailbox hop.
//! * **hitl** — humans in the loop (module `hitl`): an approval's overhead next to the
//!   dependency hop, a pause, and what runs waiting for a person cost.
//! * **console** — the web console (module `console`): event stored → visible in the page
//!   (a headless Chromium, when one can be driven) and on the console's event stream, next
//!   to `flotilla watch` in the same run; the runs list with 10,000 runs; a 1,000-run tree;
//!   the console's memory with 100 open pages.
//! * **agents** — the NATS Agent Protocol (module `agents`): prompt → first streamed token
//!   over the protocol (the bench as its client) next to the same run submitted directly, in
//!   the same run; the idle coordinator's CPU and memory with 1 and with 100 exposed agents
//!   beating.
//! * **fork** — forks and replays of ended runs (module `fork`): a 10-task chain forked at
//!   its last task — the attempts the fork dispatches (one) and its time next to a one-task
//!   run — and replayed from its log, its time per task next to the chain's.
//! * **replay** — LLM run trees replayed and forked (module `replay`): an 11-run, 20-task tree
//!   of LLM conversations on the simulated provider replayed from its logs and journals (model
//!   requests: 0; time per task next to a dependency hop), and forked at its last task and at
//!   a step of its conversation (the model requests each makes).
//! * **tenants** — fair share of a shared pool (module `tenants`): one coordinator and one
//!   worker process serving two tenants; tenant b's one-task run p50 quiet and while tenant a
//!   has 10,000 runs queued (target ≤ 2×), and how busy the slots were meanwhile (target
//!   ≥ 0.95).
//! * **restart** — restarts onto history (module `restart`): each service's time to ready on
//!   an empty deployment, then restarted with SIGTERM and kill -9 onto 10,000 runs of history
//!   of every kind (the test kit's lived-in deployment), with its reads checked unchanged.
//!
//! Apart from the sections, [`soak`] (`flotilla soak`) runs hours of mixed work while every
//! service is stopped and started again in turn, and judges what it finds against targets
//! (runs lost, applied twice, approvals decided once, stuck consumers, memory growth): the
//! one part of this crate whose figures fail a command. It is not a section — `flotilla
//! bench` runs every section by default, and a soak takes an hour — and it uses the harness
//! the same way.
//!
//! The services run as child processes of the `flotilla` binary that runs the bench (or
//! `--services-binary`, to measure another build back to back), so the bench is a library
//! the CLI calls: `flotilla bench` takes [`BenchArgs`] as they are and hands them to
//! [`run`].
//!
//! # Layout
//!
//! `harness` holds what sections share: the processes a section starts and their CPU and
//! RSS readings (`processes`), the simulated OpenAI-compatible provider (`provider`), the
//! services' configurations and spawning (`services`), submitting and observing runs
//! (`submit`), shared plans and the dependency hop read from
//! a run log (`plans`), percentiles (`stats`), the raw JetStream round trip (`raw`) and the
//! output macros (`output`). Each section is one module that imports the harness and never
//! another section; the harness imports no section; [`run`] dispatches. New sections (team,
//! hitl, cluster, console) go here the same way: one module each, built on the harness, with
//! its own `clap::Args` flattened at the end of [`BenchArgs`] (each flag's help opening with
//! the section's name, as `Collab:`, `LLM:` and `Tree:` do), a variant of `--only`, and a
//! `run` that [`run`] calls. What two sections both need goes into the harness, not from one
//! section into the other.

// Every print goes through `harness::output` (`outln!`, `out!`, `errln!`).
#![deny(clippy::print_stdout, clippy::print_stderr)]

#[macro_use]
mod harness;
mod agents;
mod collab;
mod console;
mod flotilla;
mod fork;
mod hitl;
mod llm;
mod recovery;
mod replay;
mod restart;
mod soak;
mod team;
mod tenants;
mod tree;
mod validate;

use flotilla_bus::NatsOptions;
use flotilla_bus::server::LocalNatsServer;

pub use crate::soak::{SoakArgs, run as soak};

use crate::harness::services::Services;
use crate::harness::submit::SubmitVia;

/// Arguments of `flotilla bench` (the CLI takes them as they are: flags, defaults and help
/// are defined here).
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Sections to run (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<Section>,
    /// Tasks in the raw throughput measurement.
    #[arg(long, default_value_t = 20_000)]
    raw_tasks: usize,
    /// Round trips in the raw latency measurement.
    #[arg(long, default_value_t = 2_000)]
    raw_round_trips: usize,
    /// Tasks in each Flotilla throughput measurement (split into runs).
    #[arg(long, default_value_t = 20_000)]
    tasks: usize,
    /// Independent tasks per run, one measurement each: per-run costs (submission, run
    /// record, start and end events) amortise over a run's tasks.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 4, 10])]
    tasks_per_run: Vec<usize>,
    /// Length of each chain in the hop-latency measurement.
    #[arg(long, default_value_t = 100)]
    chain: usize,
    /// Chains to run (samples = chains × (chain − 1)).
    #[arg(long, default_value_t = 5)]
    chains: usize,
    /// Width of the fan-out.
    #[arg(long, default_value_t = 1_000)]
    fan: usize,
    /// Worker processes.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Slots per worker.
    #[arg(long, default_value_t = 128)]
    concurrency: usize,
    /// Repetitions of the validation section.
    #[arg(long, default_value_t = 30)]
    iterations: usize,
    /// Worker kills in the recovery section.
    #[arg(long, default_value_t = 3)]
    recovery_rounds: usize,
    /// Samples of each single-run latency measurement.
    #[arg(long, default_value_t = 300)]
    latency_runs: usize,
    /// Runs of the two-workers-with-one-slot measurement.
    #[arg(long, default_value_t = 4_000)]
    single_slot_runs: usize,
    /// The `flotilla` binary that runs the coordinator and workers (default: this one) — to
    /// measure another build with this bench, back to back.
    #[arg(long, value_name = "PATH")]
    services_binary: Option<std::path::PathBuf>,
    /// How the bench submits: `run-subject` (`<prefix>.submit.<run>`, the default path of
    /// the client library) or `intake` (`<prefix>.submit`, for builds without the former).
    #[arg(long, value_enum, default_value = "run-subject")]
    submit_via: SubmitVia,
    #[command(flatten)]
    collab: collab::CollabArgs,
    #[command(flatten)]
    llm: llm::LlmArgs,
    // Boxed: keeps `flotilla`'s command enum small.
    #[command(flatten)]
    tree: Box<tree::TreeArgs>,
    #[command(flatten)]
    team: team::TeamArgs,
    #[command(flatten)]
    hitl: hitl::HitlArgs,
    // Boxed, as `tree`.
    #[command(flatten)]
    console: Box<console::ConsoleArgs>,
    // Boxed, as `tree`.
    #[command(flatten)]
    agents: Box<agents::AgentsArgs>,
    #[command(flatten)]
    restart: restart::RestartArgs,
    #[command(flatten)]
    fork: fork::ForkArgs,
    #[command(flatten)]
    replay: replay::ReplayArgs,
    #[command(flatten)]
    tenants: tenants::TenantsArgs,
}

/// A section of the bench (`--only`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Section {
    /// Plain JetStream baseline.
    Raw,
    /// Flotilla with no-op agents (needs raw for ratios).
    Flotilla,
    /// Validating a 10,000-subtask plan.
    Validate,
    /// Crash recovery at the default heartbeat: kill -9 of a worker → its task running again
    /// on another worker.
    Recovery,
    /// Workspace topics, topic-gated dispatch and mailboxes, with their raw baselines.
    Collab,
    /// LLM agents against a simulated OpenAI-compatible provider: overhead per model call,
    /// concurrent tasks per worker, scaling over worker processes.
    Llm,
    /// Run trees: child spawn latency, nested agent-as-tool vs dependency hops, delivery lag
    /// of flattened projections with many concurrent children.
    Tree,
    /// The supervisor: its cost to run throughput, catch-up, outcome → failure record lag,
    /// anycast and recruit latency, idle teammates' memory, a teammate's wake.
    Team,
    /// Humans in the loop: an approval's overhead next to a dependency hop, and the cost of
    /// runs waiting for a person.
    Hitl,
    /// The web console: event stored → visible in the page next to `flotilla watch`, the
    /// runs list with 10,000 runs, a 1,000-run tree, the memory of 100 open pages.
    Console,
    /// The NATS Agent Protocol: prompt → first streamed token next to a direct submission,
    /// and the coordinator's cost of 100 exposed agents' heartbeats.
    Agents,
    /// Restarts onto history: each service's time to ready on an empty deployment and
    /// restarted (SIGTERM, kill -9) onto 10,000 runs of history of every kind.
    Restart,
    /// Forks and replays of ended runs: a 10-task chain forked at its last task — the
    /// attempts it dispatches and its time next to a one-task run — and replayed from its log.
    Fork,
    /// LLM run trees replayed from their logs and journals and forked at a task and at a
    /// step: model requests made (0 for a replay) and time per task.
    Replay,
    /// Fair share of a shared pool: one tenant's one-task run p50 while another has 10,000
    /// runs queued, next to its quiet p50, and how busy the slots were meanwhile.
    Tenants,
}

/// Runs the selected sections against the server at `nats_url` (the CLI's global
/// `--nats-url`), or an embedded nats-server when there is none.
pub async fn run(args: BenchArgs, nats_url: Option<&str>) -> anyhow::Result<()> {
    let all = args.only.is_empty();
    let want = |s: Section| all || args.only.contains(&s);
    if want(Section::Validate) {
        validate::run(args.iterations);
    }
    if !want(Section::Raw)
        && !want(Section::Flotilla)
        && !want(Section::Recovery)
        && !want(Section::Collab)
        && !want(Section::Llm)
        && !want(Section::Tree)
        && !want(Section::Team)
        && !want(Section::Hitl)
        && !want(Section::Console)
        && !want(Section::Agents)
        && !want(Section::Restart)
        && !want(Section::Fork)
        && !want(Section::Replay)
        && !want(Section::Tenants)
    {
        return Ok(());
    }
    let dir = tempfile::Builder::new()
        .prefix("flotilla-bench-nats-")
        .tempdir()?;
    let (_server, url) = match nats_url {
        Some(u) => (None, u.to_owned()),
        None => {
            let s = LocalNatsServer::start_in(dir.path()).await?;
            let url = s.url();
            outln!(
                "== nats-server: embedded at {url} (file storage in {})",
                dir.path().display()
            );
            (Some(s), url)
        }
    };
    let opts = NatsOptions::with_url(&url);
    let server_pid = _server.as_ref().and_then(LocalNatsServer::pid);
    let services = Services {
        exe: match &args.services_binary {
            Some(p) => p.clone(),
            None => std::env::current_exe()?,
        },
        workers: args.workers,
        concurrency: args.concurrency,
        chain: args.chain,
        via: args.submit_via,
    };
    if want(Section::Recovery) {
        recovery::run(&url, args.recovery_rounds).await?;
    }
    let raw = if want(Section::Raw)
        || want(Section::Flotilla)
        || want(Section::Tree)
        || want(Section::Team)
    {
        Some(
            harness::raw::round_trip(&opts, args.raw_tasks, args.raw_round_trips, server_pid)
                .await?,
        )
    } else {
        None
    };
    if want(Section::Flotilla) {
        let sizes = flotilla::Sizes {
            tasks: args.tasks,
            tasks_per_run: args.tasks_per_run.clone(),
            chains: args.chains,
            fan: args.fan,
            latency_runs: args.latency_runs,
            single_slot_runs: args.single_slot_runs,
        };
        flotilla::run(&sizes, &services, &url, raw.as_ref(), server_pid).await?;
    }
    if want(Section::Collab) {
        collab::run(&args.collab, &services, &url).await?;
    }
    if want(Section::Llm) {
        llm::run(&args.llm, &services, &url).await?;
    }
    if want(Section::Tree) {
        tree::run(&args.tree, &services, &url, raw.as_ref()).await?;
    }
    if want(Section::Team) {
        team::run(&args.team, &services, &url, raw.as_ref()).await?;
    }
    if want(Section::Hitl) {
        hitl::run(&args.hitl, &services, &url).await?;
    }
    if want(Section::Console) {
        console::run(&args.console, &services, &url).await?;
    }
    if want(Section::Agents) {
        agents::run(&args.agents, &services, &url).await?;
    }
    if want(Section::Restart) {
        restart::run(&args.restart, &services, &url).await?;
    }
    if want(Section::Fork) {
        fork::run(&args.fork, &services, &url).await?;
    }
    if want(Section::Replay) {
        replay::run(&args.replay, &services, &url).await?;
    }
    if want(Section::Tenants) {
        tenants::run(&args.tenants, &services, &url).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    /// `BenchArgs` as the CLI takes them.
    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    /// The sections' flags live together in one command: none may clash with another.
    #[test]
    fn the_flags_of_all_sections_form_one_valid_command() {
        Cli::command().debug_assert();
    }

    #[test]
    fn flags_reach_their_sections() {
        let cli = Cli::try_parse_from([
            "bench",
            "--only",
            "raw,tree",
            "--tasks-per-run",
            "2,8",
            "--tree-spawns",
            "20",
            "--llm-delay",
            "250ms",
            "--submit-via",
            "intake",
            "--teammates",
            "50",
            "--agents-samples",
            "7",
        ])
        .expect("valid flags");
        let b = cli.bench;
        assert_eq!(b.only, vec![Section::Raw, Section::Tree]);
        assert_eq!(b.tasks_per_run, vec![2, 8]);
        assert_eq!(b.tasks, 20_000);
        assert_eq!(b.submit_via, SubmitVia::Intake);
        // The sections' own fields are theirs; their Debug shows what they received.
        assert!(format!("{:?}", b.tree).contains("tree_spawns: 20,"));
        assert!(format!("{:?}", b.llm).contains("llm_delay: 250ms,"));
        assert!(format!("{:?}", b.collab).contains("page_entries: 100000,"));
        assert!(format!("{:?}", b.team).contains("teammates: 50 }"));
        assert!(format!("{:?}", b.team).contains("team_wakes: 200,"));
        assert!(format!("{:?}", b.agents).contains("agents_samples: 7,"));
    }
}
