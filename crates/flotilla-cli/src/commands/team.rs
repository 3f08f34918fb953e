//! `flotilla team [--role R]`, `team show MEMBER`, `team find ROLE`, `team stats [NAME]`:
//! the supervisor's team API (`<prefix>.api.team.*`); persistent teammates with
//! `team spawn NAME`, `team send NAME TEXT`, `team broadcast TEXT`, `team shutdown NAME`.
//! Inside a teammate's turn (an exec agent) `--team` defaults to `FLOTILLA_TEAM`, else
//! `FLOTILLA_SESSION_ID`, and the sender to `FLOTILLA_TASK_ID` (the teammate's name).

use std::process::ExitCode;
use std::time::Duration;

use flotilla_bus::Bus;
use flotilla_client::{Client, ClientErrorKind};
use flotilla_model::api::{ApiError, ApiRequest};
use flotilla_model::team::{
    FailureStats, MemberView, RecordScope, TeamFindRequest, TeamGetRequest, TeamList,
    TeamListRequest, TeamStatsRequest,
};
use flotilla_model::teammate::{
    TeamBroadcastRequest, TeamSendRequest, TeamSent, TeamShutdownRequest, TeamSpawnRequest,
    TeammateView,
};
use flotilla_model::time::Timestamp;

use crate::config::Config;

/// How long a team request may take.
const TIMEOUT: Duration = Duration::from_secs(10);

/// `flotilla team`.
#[derive(Debug, clap::Args)]
pub(crate) struct TeamArgs {
    #[command(subcommand)]
    command: Option<TeamCommand>,
    /// Only members filling this role.
    #[arg(long)]
    role: Option<String>,
    /// Machine-readable output.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Debug, clap::Subcommand)]
enum TeamCommand {
    /// One member: card, presence, attempts, failure figures.
    Show {
        /// The member (an agent definition's name).
        member: String,
    },
    /// The members of a role that can take work now, best first (idle, then working).
    Find {
        /// The role.
        role: String,
    },
    /// Failure records: every agent and role, or one.
    Stats {
        /// An agent or a role.
        name: Option<String>,
        /// Only records of agents or of roles.
        #[arg(long, value_enum)]
        scope: Option<Scope>,
    },
    /// Spawn a persistent teammate: idle until a message wakes it.
    Spawn {
        /// Its name (its mailbox address within the team).
        name: String,
        /// Its role.
        #[arg(long)]
        role: String,
        /// What it is for.
        #[arg(long)]
        instructions: String,
        /// The agent definition its turns run (default: a member filling the role).
        #[arg(long)]
        agent: Option<String>,
        /// The pool running its turns.
        #[arg(long)]
        pool: Option<String>,
        /// The team (default: `FLOTILLA_TEAM`, the session, else `default`).
        #[arg(long)]
        team: Option<String>,
    },
    /// Send a message to a teammate (wakes it).
    Send {
        /// The teammate.
        to: String,
        /// The message.
        text: String,
        /// The sender (default: the task this runs in, else `operator`).
        #[arg(long)]
        from: Option<String>,
        /// The team.
        #[arg(long)]
        team: Option<String>,
    },
    /// Send a message to every teammate of a team.
    Broadcast {
        /// The message.
        text: String,
        /// The sender.
        #[arg(long)]
        from: Option<String>,
        /// The team.
        #[arg(long)]
        team: Option<String>,
    },
    /// Shut a teammate down after its current turn.
    Shutdown {
        /// The teammate.
        name: String,
        /// The team.
        #[arg(long)]
        team: Option<String>,
    },
}

/// The team a verb acts in: `--team`, else the environment of a teammate's turn.
fn team_of(team: Option<String>) -> Option<String> {
    team.or_else(|| std::env::var("FLOTILLA_TEAM").ok())
        .or_else(|| std::env::var("FLOTILLA_SESSION_ID").ok())
        .filter(|t| !t.is_empty())
}

/// The sender of a verb: `--from`, else the task this runs in.
fn sender_of(from: Option<String>) -> Option<String> {
    from.or_else(|| std::env::var("FLOTILLA_TASK_ID").ok())
        .filter(|f| !f.is_empty())
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Scope {
    Agent,
    Role,
}

pub(crate) async fn team(config: &Config, args: TeamArgs) -> anyhow::Result<ExitCode> {
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    let client = Client::new(bus);
    let json = args.json;
    match args.command {
        None => {
            let r = TeamListRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                role: args.role,
            };
            answer(&client, &r, json, print_list).await
        }
        Some(TeamCommand::Find { role }) => {
            let r = TeamFindRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                role,
            };
            answer(&client, &r, json, print_list).await
        }
        Some(TeamCommand::Show { member }) => {
            let r = TeamGetRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                name: member,
            };
            answer(&client, &r, json, print_member).await
        }
        Some(TeamCommand::Stats { name, scope }) => {
            let r = TeamStatsRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                name,
                scope: scope.map(|s| match s {
                    Scope::Agent => RecordScope::Agent,
                    Scope::Role => RecordScope::Role,
                }),
            };
            answer(&client, &r, json, |s| print_stats(&s.records)).await
        }
        Some(TeamCommand::Spawn {
            name,
            role,
            instructions,
            agent,
            pool,
            team,
        }) => {
            let r = TeamSpawnRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                team: team_of(team),
                name,
                role,
                instructions,
                agent,
                pool,
                by: sender_of(None),
            };
            answer(&client, &r, json, print_mate).await
        }
        Some(TeamCommand::Send {
            to,
            text,
            from,
            team,
        }) => {
            let r = TeamSendRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                team: team_of(team),
                to,
                from: sender_of(from),
                text,
            };
            answer(&client, &r, json, print_sent).await
        }
        Some(TeamCommand::Broadcast { text, from, team }) => {
            let r = TeamBroadcastRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                team: team_of(team),
                from: sender_of(from),
                text,
            };
            answer(&client, &r, json, print_sent).await
        }
        Some(TeamCommand::Shutdown { name, team }) => {
            let r = TeamShutdownRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                team: team_of(team),
                name,
            };
            answer(&client, &r, json, print_mate).await
        }
    }
}

fn print_sent(s: &TeamSent) {
    for (name, seq) in s.delivered.iter().zip(&s.seqs) {
        outln!("sent to {name} (seq {seq})");
    }
}

fn print_mate(m: &TeammateView) {
    outln!(
        "teammate {} of team {}: {} (role {}, agent {}, pool {}, epoch {}, turns {}{})",
        m.name,
        m.team,
        m.status.as_str(),
        m.role,
        m.agent,
        m.pool,
        m.epoch,
        m.turns,
        if m.shutdown_requested && m.status.as_str() != "shutdown" {
            ", shutting down after this turn"
        } else {
            ""
        }
    );
}

fn print_mates(list: &[TeammateView]) {
    outln!(
        "{:<20}  {:<12}  {:<9}  {:<16}  {:>5}  {:<12}",
        "TEAMMATE",
        "TEAM",
        "STATUS",
        "ROLE",
        "TURNS",
        "PROGRESS"
    );
    for m in list {
        outln!(
            "{:<20}  {:<12}  {:<9}  {:<16}  {:>5}  {:<12}",
            m.name.chars().take(20).collect::<String>(),
            m.team.chars().take(12).collect::<String>(),
            m.status.as_str(),
            m.role.chars().take(16).collect::<String>(),
            m.turns,
            ago(m.last_progress),
        );
    }
}

/// Sends `request`; prints the answer as JSON or with `print`; a refusal is printed as
/// `error: <code>: <message>` (as JSON with `--json`) and exits 1.
async fn answer<R: ApiRequest>(
    client: &Client,
    request: &R,
    json: bool,
    print: impl FnOnce(&R::Reply),
) -> anyhow::Result<ExitCode> {
    let reply = match client.call(request, TIMEOUT).await {
        Ok(r) => r,
        Err(e) if e.kind() == ClientErrorKind::NoSupervisor => {
            errln!("error: {e}");
            return Ok(ExitCode::from(2));
        }
        Err(e) => return Err(e.into()),
    };
    match reply {
        Ok(reply) if json => {
            outln!("{}", serde_json::to_string_pretty(&reply)?);
            Ok(ExitCode::SUCCESS)
        }
        Ok(reply) => {
            print(&reply);
            Ok(ExitCode::SUCCESS)
        }
        Err(ApiError { code, message, .. }) if json => {
            outln!(
                "{}",
                serde_json::to_string_pretty(
                    &serde_json::json!({"error": code, "message": message})
                )?
            );
            Ok(ExitCode::from(1))
        }
        Err(ApiError { code, message, .. }) => {
            errln!("error: {code}: {message}");
            Ok(ExitCode::from(1))
        }
    }
}

/// `12.3s ago`, or `-`.
fn ago(t: Option<Timestamp>) -> String {
    t.map_or_else(
        || "-".to_owned(),
        |t| {
            let secs = (Timestamp::now().unix_ms() - t.unix_ms()).max(0) as f64 / 1000.0;
            format!("{secs:.1}s ago")
        },
    )
}

fn print_list(list: &TeamList) {
    outln!(
        "{:<20}  {:<8}  {:<24}  {:>7}  {:>5}  {:<12}  {:>9}  {:>5}",
        "MEMBER",
        "STATUS",
        "ROLES",
        "WORKERS",
        "TASKS",
        "PROGRESS",
        "FAIL 1H",
        "CONSEC"
    );
    for m in &list.members {
        let f = m.failures.as_ref();
        outln!(
            "{:<20}  {:<8}  {:<24}  {:>7}  {:>5}  {:<12}  {:>9}  {:>5}",
            m.name.chars().take(20).collect::<String>(),
            m.status.as_str(),
            if m.card.roles.is_empty() {
                "-".to_owned()
            } else {
                m.card.roles.join(",").chars().take(24).collect()
            },
            m.workers.len(),
            m.tasks.len(),
            ago(m.last_progress),
            f.map_or_else(
                || "-".to_owned(),
                |f| format!(
                    "{}/{}",
                    f.last_hour.failed,
                    f.last_hour.failed + f.last_hour.succeeded
                )
            ),
            f.map_or(0, |f| f.consecutive_failures),
        );
    }
    if list.members.is_empty() {
        outln!("(no members)");
    }
    if !list.teammates.is_empty() {
        outln!();
        print_mates(&list.teammates);
    }
    outln!(
        "roles: {}",
        if list.roles.is_empty() {
            "none".to_owned()
        } else {
            list.roles.join(", ")
        }
    );
}

fn print_member(m: &MemberView) {
    outln!("member          {}", m.name);
    outln!("status          {}", m.status.as_str());
    if let Some(d) = &m.card.description {
        outln!("description     {d}");
    }
    if !m.card.roles.is_empty() {
        outln!("roles           {}", m.card.roles.join(", "));
    }
    if !m.card.capabilities.is_empty() {
        outln!("capabilities    {}", m.card.capabilities.join(", "));
    }
    outln!(
        "workers         {}",
        if m.workers.is_empty() {
            "none live".to_owned()
        } else {
            m.workers.join(", ")
        }
    );
    if !m.pools.is_empty() {
        outln!("pools           {}", m.pools.join(", "));
    }
    outln!("last heartbeat  {}", ago(m.last_heartbeat));
    outln!("last progress   {}", ago(m.last_progress));
    outln!(
        "attempts        {} started, {} succeeded, {} failed",
        m.counters.started,
        m.counters.succeeded,
        m.counters.failed
    );
    for t in &m.tasks {
        outln!(
            "running         {}/{} attempt {} on {} since {}",
            t.run_id,
            t.task_id,
            t.attempt,
            t.worker,
            t.since
        );
    }
    if let Some(f) = &m.failures {
        outln!();
        print_stats(std::slice::from_ref(f));
    }
}

fn print_stats(records: &[FailureStats]) {
    outln!(
        "{:<6}  {:<20}  {:>6}  {:>11}  {:>11}  {:>11}  {:>15}  LAST INCIDENT",
        "SCOPE",
        "NAME",
        "CONSEC",
        "1H ok/fail",
        "24H ok/fail",
        "30D ok/fail",
        "TOTAL ok/fail"
    );
    for r in records {
        let w = |t: flotilla_model::team::WindowTotals| format!("{}/{}", t.succeeded, t.failed);
        outln!(
            "{:<6}  {:<20}  {:>6}  {:>11}  {:>11}  {:>11}  {:>15}  {}",
            r.scope.as_str(),
            r.name.chars().take(20).collect::<String>(),
            r.consecutive_failures,
            w(r.last_hour),
            w(r.last_day),
            w(r.last_30_days),
            format!("{}/{}", r.total_succeeded, r.total_failed),
            r.last_incident.as_ref().map_or_else(
                || "-".to_owned(),
                |i| format!(
                    "{} {}/{}#{}: {}",
                    i.kind.as_str(),
                    i.run_id,
                    i.task_id,
                    i.attempt,
                    i.message.chars().take(60).collect::<String>()
                )
            ),
        );
    }
    if records.is_empty() {
        outln!("(no records yet)");
    }
}
