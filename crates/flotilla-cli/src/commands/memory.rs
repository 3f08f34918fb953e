//! `flotilla memory list [--session S]`, `memory show RUN`, `memory forget RUN`: the
//! supervisor's memory of finished runs (`<prefix>.api.memory.*`), which bare queries'
//! planners reuse and learn from. Exit 0 done, 1 refused (`not_found`, a malformed request),
//! 2 no supervisor.

use std::process::ExitCode;

use flotilla_model::ids::{RunId, SessionId};
use flotilla_model::memory::{
    MemoryEntry, MemoryForgetRequest, MemoryForgotten, MemoryGetRequest, MemoryList,
    MemoryListRequest,
};

use super::team::{answer, connect};
use crate::config::Config;

/// `flotilla memory`.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum MemoryCommand {
    /// Remembered runs, newest first.
    List {
        /// Only runs of this session.
        #[arg(long)]
        session: Option<SessionId>,
        /// Most runs listed (1 to 1000).
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// One remembered run: query, plan shape, team, outcome, duration, cost.
    Show {
        /// The run.
        run: RunId,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Delete a run's entry: no later query reuses or learns from it.
    Forget {
        /// The run.
        run: RunId,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
}

pub(crate) async fn memory(config: &Config, command: MemoryCommand) -> anyhow::Result<ExitCode> {
    let client = connect(config).await?;
    let protocol = flotilla_model::PROTOCOL_VERSION;
    match command {
        MemoryCommand::List {
            session,
            limit,
            json,
        } => {
            let r = MemoryListRequest {
                protocol,
                session_id: session,
                limit: Some(limit),
            };
            answer(&client, &r, json, print_list).await
        }
        MemoryCommand::Show { run, json } => {
            let r = MemoryGetRequest {
                protocol,
                run_id: run,
            };
            answer(&client, &r, json, print_entry).await
        }
        MemoryCommand::Forget { run, json } => {
            let r = MemoryForgetRequest {
                protocol,
                run_id: run,
            };
            answer(&client, &r, json, |f: &MemoryForgotten| {
                outln!("forgot run {}", f.run_id)
            })
            .await
        }
    }
}

fn print_list(list: &MemoryList) {
    outln!(
        "{:<36}  {:<9}  {:>5}  {:>9}  QUERY",
        "RUN",
        "OUTCOME",
        "TASKS",
        "SECONDS"
    );
    for e in &list.entries {
        outln!(
            "{:<36}  {:<9}  {:>5}  {:>9.1}  {}{}",
            e.run_id,
            e.outcome.as_str(),
            e.subtasks,
            e.duration_ms as f64 / 1000.0,
            e.query.replace('\n', " "),
            e.reused_from
                .map(|r| format!("  (reused {r})"))
                .unwrap_or_default()
        );
    }
    outln!("{} shown, {} scanned", list.entries.len(), list.scanned);
}

fn print_entry(e: &MemoryEntry) {
    outln!("run       {}", e.run_id);
    if let Some(s) = e.session_id {
        outln!("session   {s}");
    }
    outln!("query     {}", e.query.replace('\n', " "));
    outln!(
        "outcome   {}{}",
        e.outcome.as_str(),
        e.cause.map(|c| format!(" ({c})")).unwrap_or_default()
    );
    outln!("duration  {:.1}s", e.duration_ms as f64 / 1000.0);
    if e.tokens.is_some() || e.cost_usd.is_some() {
        outln!(
            "spent     {} tokens, ${:.4}",
            e.tokens.unwrap_or(0),
            e.cost_usd.unwrap_or(0.0)
        );
    }
    outln!(
        "strategy  {}{}",
        e.plan.strategy.as_str(),
        e.plan
            .chosen
            .map(|c| format!(" (ran as {})", c.as_str()))
            .unwrap_or_default()
    );
    if !e.team.agents.is_empty() || !e.team.roles.is_empty() {
        outln!(
            "team      agents: {}; roles: {}",
            e.team.agents.join(", "),
            e.team.roles.join(", ")
        );
    }
    if let Some(r) = e.reused_from {
        outln!("reused    the plan of run {r}");
    }
    if e.truncated {
        outln!("truncated long texts were cut (not reused as it stands)");
    }
    outln!("plan:");
    for t in &e.plan.subtasks {
        let deps: Vec<&str> = t.dependencies.iter().map(|d| d.as_str()).collect();
        outln!(
            "  {}{}{}: {}",
            t.id,
            t.role
                .as_ref()
                .map(|r| format!(" [{r}]"))
                .unwrap_or_default(),
            if deps.is_empty() {
                String::new()
            } else {
                format!(" after {}", deps.join(", "))
            },
            t.description.replace('\n', " ")
        );
    }
}
