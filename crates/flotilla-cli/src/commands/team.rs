//! `flotilla team [--role R]`, `team show MEMBER`, `team find ROLE`, `team stats [NAME]`,
//! `team recruit`, `team recruit-status`, `team retire`, `team assign`, `team finish`: the supervisor's team API
//! (`<prefix>.api.team.*`); persistent teammates with `team spawn NAME`, `team send NAME
//! TEXT`, `team broadcast TEXT`, `team shutdown NAME`.
//!
//! Inside an exec agent (its environment names the run and task), `recruit` and `retire`
//! act for the agent's task on its own run and connection; elsewhere they need `--run` and
//! act as an operator. Inside a teammate's turn `--team` defaults to `FLOTILLA_TEAM`, else
//! `FLOTILLA_SESSION_ID`, and the sender to `FLOTILLA_TASK_ID` (the teammate's name).

use std::process::ExitCode;
use std::time::Duration;

use flotilla_bus::Bus;
use flotilla_client::{Client, ClientErrorKind};
use flotilla_model::ErrorCode;
use flotilla_model::api::{ApiError, ApiRequest};
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::lead::{AssignRequest, FinishRequest, LeadReply};
use flotilla_model::recruit::{
    RecruitReply, RecruitRequest, RecruitStatus, RecruitStatusRequest, RetirePolicy, RetireReply,
    RetireRequest,
};
use flotilla_model::team::{
    FailureStats, MemberView, RecordScope, TeamFindRequest, TeamGetRequest, TeamList,
    TeamListRequest, TeamStatsRequest,
};
use flotilla_model::teammate::{
    Conversation, TeamBroadcastRequest, TeamMatesRequest, TeamSendRequest, TeamSent,
    TeamShutdownRequest, TeamSpawnRequest, TeammateView,
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
    /// Only members (and teammates) with this role: a plan task's `role`, which a member
    /// has when its card declares it or it ran a task with that role.
    #[arg(long)]
    role: Option<String>,
    /// Machine-readable output.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Debug, clap::Subcommand)]
enum TeamCommand {
    /// One member: card, presence, attempts, failure figures — or, when no member has the
    /// name, the persistent teammate(s) of that name: status, turns, last reply, and why its
    /// last turn could not run.
    Show {
        /// The member (an agent definition's name) or teammate.
        member: String,
        /// The teammate's team, when several teams have one of that name.
        #[arg(long)]
        team: Option<String>,
    },
    /// The members of a role that can take work now, best first (idle, then working): those
    /// whose card declares it and those that ran a task with that role; and the teammates of
    /// the role. A role the team does not know is `unknown_role` (exit 1).
    Find {
        /// The role.
        role: String,
    },
    /// Ask the supervisor for a new member of a role to take one subtask of a running run.
    /// Exit 0 accepted or recorded, 1 refused (the rule is printed), 2 no supervisor,
    /// 3 uncertain (no answer: ask `recruit-status` with the printed id; never repeat it
    /// under a new id).
    Recruit(RecruitArgs),
    /// What became of a recruit: accepted, refused or unknown.
    RecruitStatus {
        /// The run.
        run: RunId,
        /// The recruit id.
        recruit_id: String,
    },
    /// Retire a member from a running run's team: its tasks that have not started go to their
    /// role, or fail (`--policy fail`).
    Retire {
        /// The member (an agent definition the run's tasks name).
        member: String,
        /// Why (recorded).
        #[arg(long)]
        reason: String,
        /// The run (default inside an exec agent: the agent's run).
        #[arg(long)]
        run: Option<RunId>,
        /// What becomes of its tasks that have not started.
        #[arg(long, value_enum, default_value = "reassign")]
        policy: Policy,
    },
    /// Under the supervisor strategy: let one of a led run's held tasks run (it still waits
    /// for its dependencies). Inside a lead's turn it acts for the lead on its run.
    Assign {
        /// The task.
        task: TaskId,
        /// Why (recorded).
        #[arg(long, default_value = "")]
        reason: String,
        /// The run (default inside an agent: the agent's run).
        #[arg(long)]
        run: Option<RunId>,
    },
    /// Under the supervisor strategy: end a led run with its final result (tasks not
    /// assigned are skipped, running ones cancelled).
    Finish {
        /// The run's final result.
        #[arg(long)]
        result: String,
        /// The run (default inside an agent: the agent's run).
        #[arg(long)]
        run: Option<RunId>,
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
        /// Serve it as an agent of the NATS Agent Protocol
        /// (`agents.prompt.<name>.<owner>.<team>`): a prompt is a message to it, and its
        /// turn's reply the answer.
        #[arg(long)]
        expose: bool,
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
        /// Wait for the teammate's reply to this message and print it (exit 1 when its turn
        /// failed or no reply came within --timeout).
        #[arg(long)]
        wait: bool,
        /// How long --wait waits.
        #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
        timeout: Duration,
        /// Store the message straight in the teammate's inbox, with `team.send`'s checks made
        /// here from the teammate's entry, instead of through the supervisor: the same answers
        /// and refusals, and no supervisor on the message's path (an entry written by an older
        /// version still goes through it). The NATS user must be allowed to read the team
        /// bucket and publish on the inbox subjects (`<prefix>.tmbox.>`). With --wait, the
        /// teammate is first looked up through the supervisor.
        #[arg(long)]
        direct: bool,
    },
    /// A teammate's conversation: the messages it received and its replies, oldest first
    /// (its newest 64 lines; older ones are compacted away and counted).
    Log {
        /// The teammate.
        name: String,
        /// Its team, when several teams have one of that name.
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

/// `flotilla team recruit`.
#[derive(Debug, clap::Args)]
struct RecruitArgs {
    /// The role wanted.
    #[arg(long)]
    role: String,
    /// What the recruit is to do (its subtask's description).
    #[arg(long)]
    description: String,
    /// Why the team needs it (recorded).
    #[arg(long)]
    reason: String,
    /// The run (default inside an exec agent: the agent's run).
    #[arg(long)]
    run: Option<RunId>,
    /// The recruit's id (default: derived from the agent's attempt and the request inside an
    /// agent, so a repeated attempt asks again under the same id; random for an operator).
    #[arg(long)]
    id: Option<String>,
    /// The new task's id (default `recruit-<id>`).
    #[arg(long)]
    task_id: Option<TaskId>,
    /// Tasks it waits for (comma-separated).
    #[arg(long, value_delimiter = ',')]
    after: Vec<TaskId>,
    /// Workspace topics it writes (comma-separated).
    #[arg(long, value_delimiter = ',')]
    produces: Vec<String>,
    /// Workspace topics it reads (comma-separated).
    #[arg(long, value_delimiter = ',')]
    consumes: Vec<String>,
    /// The run fails if the recruit's task fails.
    #[arg(long)]
    required: bool,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Policy {
    Reassign,
    Fail,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Scope {
    Agent,
    Role,
}

pub(crate) async fn team(config: &Config, args: TeamArgs) -> anyhow::Result<ExitCode> {
    let json = args.json;
    let command = match args.command {
        Some(TeamCommand::Recruit(r)) => return recruit(config, r, json).await,
        Some(TeamCommand::Retire {
            member,
            reason,
            run,
            policy,
        }) => {
            let (client, run, by_task) = acting(config, run).await?;
            let r = RetireRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                run_id: run,
                member,
                reason,
                policy: match policy {
                    Policy::Reassign => RetirePolicy::Reassign,
                    Policy::Fail => RetirePolicy::Fail,
                },
                by_task,
            };
            return answer(&client, &r, json, print_retire).await;
        }
        Some(TeamCommand::Assign { task, reason, run }) => {
            let (client, run, by_task) = acting(config, run).await?;
            let r = AssignRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                run_id: run,
                task_id: task,
                reason,
                by: by_task.map(|t| t.to_string()),
            };
            return answer(&client, &r, json, print_lead).await;
        }
        Some(TeamCommand::Finish { result, run }) => {
            let (client, run, by_task) = acting(config, run).await?;
            let r = FinishRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                run_id: run,
                result,
                by: by_task.map(|t| t.to_string()),
            };
            return answer(&client, &r, json, print_lead).await;
        }
        other => other,
    };
    let client = connect(config).await?;
    match command {
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
        Some(TeamCommand::Show { member, team }) => {
            let r = TeamGetRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                name: member.clone(),
            };
            // A member first; a teammate of that name when no member has it.
            if let Ok(Err(e)) = client.call(&r, TIMEOUT).await
                && e.is(ErrorCode::NotFound)
                && let Some(mates) = teammates_named(&client, &member, team.as_deref()).await?
            {
                if json {
                    outln!("{}", serde_json::to_string_pretty(&mates)?);
                } else {
                    for m in &mates {
                        print_mate(m);
                    }
                }
                return Ok(ExitCode::SUCCESS);
            }
            answer(&client, &r, json, print_member).await
        }
        Some(TeamCommand::RecruitStatus { run, recruit_id }) => {
            let r = RecruitStatusRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                run_id: run,
                recruit_id,
            };
            answer(&client, &r, json, print_recruit).await
        }
        // Answered above: they act for the agent's task.
        Some(TeamCommand::Recruit(_))
        | Some(TeamCommand::Retire { .. })
        | Some(TeamCommand::Assign { .. })
        | Some(TeamCommand::Finish { .. }) => Ok(ExitCode::SUCCESS),
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
            expose,
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
                expose,
            };
            answer(&client, &r, json, print_mate).await
        }
        Some(TeamCommand::Send {
            to,
            text,
            from,
            team,
            wait,
            timeout,
            direct,
        }) => {
            let team = team_of(team);
            let from = sender_of(from);
            if wait {
                return send_and_wait(&client, to, text, from, team, timeout, direct, json).await;
            }
            let r = TeamSendRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                team,
                to,
                from,
                text,
            };
            if direct {
                let sent = send_direct(&client, &r).await?;
                return print_answer(sent, json, print_sent, |_| ExitCode::SUCCESS);
            }
            answer(&client, &r, json, print_sent).await
        }
        Some(TeamCommand::Log { name, team }) => log(&client, &name, team_of(team), json).await,
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

/// The teammates named `name` (of `team`, when given); `None` when there are none.
async fn teammates_named(
    client: &Client,
    name: &str,
    team: Option<&str>,
) -> anyhow::Result<Option<Vec<TeammateView>>> {
    let r = TeamMatesRequest {
        protocol: flotilla_model::PROTOCOL_VERSION,
        team: team.map(str::to_owned),
    };
    let Ok(list) = client.call(&r, TIMEOUT).await? else {
        return Ok(None);
    };
    let found: Vec<TeammateView> = list
        .teammates
        .into_iter()
        .filter(|m| m.name == name)
        .collect();
    Ok((!found.is_empty()).then_some(found))
}

fn print_mate(m: &TeammateView) {
    outln!(
        "teammate {} of team {}: {} (role {}, agent {}, pool {}, epoch {}, turns {}{}{})",
        m.name,
        m.team,
        m.status.as_str(),
        m.role,
        m.agent,
        m.pool,
        m.epoch,
        m.turns,
        if m.expose {
            ", exposed on the NATS Agent Protocol"
        } else {
            ""
        },
        if m.shutdown_requested && m.status.as_str() != "shutdown" {
            ", shutting down after this turn"
        } else {
            ""
        }
    );
    if let Some(reply) = &m.last_reply {
        outln!("  last reply: {reply}");
    }
    if let Some(error) = &m.last_error {
        outln!("  last turn failed: {error}");
    }
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
    for m in list {
        if let Some(error) = &m.last_error {
            outln!("{} of team {}: last turn failed: {error}", m.name, m.team);
        }
    }
}

/// A client on the agent's own connection inside an exec agent (its environment names the
/// worker's NATS and prefix), else on the configuration's.
pub(super) async fn connect(config: &Config) -> anyhow::Result<Client> {
    // The prefix comes with it (`FLOTILLA_PREFIX`).
    if let Some(opts) = flotilla_context::connection_from_env()? {
        return Ok(Client::new(Bus::connect(&opts, "flotilla-cli").await?));
    }
    Ok(Client::new(
        Bus::connect(&config.nats, "flotilla-cli").await?,
    ))
}

/// The client, run and asking task of `recruit` / `retire`: inside an exec agent (without
/// `--run`) the agent's connection, run and task; otherwise the configuration's connection,
/// `--run`, and no task (an operator).
async fn acting(
    config: &Config,
    run: Option<RunId>,
) -> anyhow::Result<(Client, RunId, Option<TaskId>)> {
    let Some(run) = run else {
        if flotilla_context::connection_from_env()?.is_none() {
            anyhow::bail!(
                "--run is needed outside an agent (no FLOTILLA_NATS_URL in the environment)"
            );
        }
        let scope = flotilla_context::Scope::from_env()?;
        return Ok((connect(config).await?, scope.run_id, scope.task_id));
    };
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    Ok((Client::new(bus), run, None))
}

/// `flotilla team recruit`.
async fn recruit(config: &Config, a: RecruitArgs, json: bool) -> anyhow::Result<ExitCode> {
    let (client, run, by_task) = acting(config, a.run).await?;
    let recruit_id = match a.id {
        Some(id) => id,
        None => match std::env::var(flotilla_context::scope::ENV_ATTEMPT_ID) {
            // The same request of the same attempt gets the same id: asking again (a
            // redelivered attempt) cannot recruit twice.
            Ok(attempt) if by_task.is_some() => format!(
                "r{}",
                &flotilla_model::team::attempt_digest(&format!(
                    "{attempt}\u{0}{}\u{0}{}\u{0}{}",
                    a.role, a.description, a.reason
                ))[..12]
            ),
            _ => {
                // The random tail of a fresh UUIDv7.
                let u = RunId::new().to_string().replace('-', "");
                format!("r{}", &u[u.len() - 12..])
            }
        },
    };
    let r = RecruitRequest {
        protocol: flotilla_model::PROTOCOL_VERSION,
        run_id: run,
        recruit_id: recruit_id.clone(),
        role: a.role,
        description: a.description,
        reason: a.reason,
        task_id: a.task_id,
        dependencies: a.after,
        produces: a.produces,
        consumes: a.consumes,
        required: a.required,
        by_task,
    };
    match client.call(&r, TIMEOUT).await {
        Err(e) if e.kind() == ClientErrorKind::TimedOut => {
            if json {
                outln!(
                    "{}",
                    serde_json::to_string_pretty(&serde_json::json!({
                        "status": "uncertain", "recruit_id": recruit_id, "run_id": run,
                        "message": e.to_string(),
                    }))?
                );
            } else {
                errln!(
                    "uncertain: recruit {recruit_id} of run {run}: {e}; it may have been recorded. Ask `flotilla team recruit-status {run} {recruit_id}`; do not repeat it under a new id"
                );
            }
            Ok(ExitCode::from(3))
        }
        _ => answer(&client, &r, json, print_recruit).await,
    }
}

fn print_recruit(r: &RecruitReply) {
    match r.status {
        RecruitStatus::Accepted => outln!(
            "accepted: recruit {} joined the run as task {} (run-log seq {})",
            r.recruit_id,
            r.task_id,
            r.seq.unwrap_or_default()
        ),
        RecruitStatus::Recorded => outln!(
            "recorded: recruit {} (task {}) is on the run log; the run has not applied it yet",
            r.recruit_id,
            r.task_id
        ),
        RecruitStatus::Refused => outln!(
            "refused: recruit {} was refused by the run: {}",
            r.recruit_id,
            r.refusal.as_deref().unwrap_or("-")
        ),
        RecruitStatus::Unknown => outln!(
            "unknown: the run has not applied recruit {} (never recorded, or not applied yet); asking again with the same id is safe",
            r.recruit_id
        ),
    }
}

fn print_lead(r: &LeadReply) {
    let what = r.task_id.as_ref().map_or_else(
        || format!("run {}", r.run_id),
        |t| format!("task {t} of run {}", r.run_id),
    );
    match r.status {
        RecruitStatus::Recorded => outln!(
            "recorded: the change to {what} is on the run log; the run has not applied it yet"
        ),
        _ => outln!(
            "{}: {what}",
            if r.task_id.is_some() {
                "assigned"
            } else {
                "finished"
            }
        ),
    }
}

fn print_retire(r: &RetireReply) {
    match &r.change {
        Some(c) => outln!(
            "retired: {} ({} reassigned: {}; {} failed: {})",
            r.member,
            c.reassigned.len(),
            join_ids(&c.reassigned),
            c.failed.len(),
            join_ids(&c.failed)
        ),
        None => outln!(
            "recorded: the retirement of {} is on the run log; the run has not applied it yet",
            r.member
        ),
    }
}

fn join_ids(ids: &[TaskId]) -> String {
    if ids.is_empty() {
        return "-".to_owned();
    }
    ids.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Sends `request`; prints the answer as JSON or with `print`; a refusal is printed as
/// `error: <code>: <message>` (as JSON with `--json`) and exits 1.
pub(super) async fn answer<R: ApiRequest>(
    client: &Client,
    request: &R,
    json: bool,
    print: impl FnOnce(&R::Reply),
) -> anyhow::Result<ExitCode> {
    answer_with(client, request, json, print, |_| ExitCode::SUCCESS).await
}

/// [`answer`], with the exit code of an answered request taken from its reply (a decision
/// that lost to an earlier one is answered, and is not success).
pub(super) async fn answer_with<R: ApiRequest>(
    client: &Client,
    request: &R,
    json: bool,
    print: impl FnOnce(&R::Reply),
    exit_of: impl FnOnce(&R::Reply) -> ExitCode,
) -> anyhow::Result<ExitCode> {
    let reply = match client.call(request, TIMEOUT).await {
        Ok(r) => r,
        Err(e) if e.kind() == ClientErrorKind::NoSupervisor => {
            errln!("error: {e}");
            return Ok(ExitCode::from(2));
        }
        Err(e) => return Err(e.into()),
    };
    print_answer(reply, json, print, exit_of)
}

/// Stores `r` straight in the teammate's inbox (`--direct`): checked from its entry, read
/// first, as the supervisor checks it.
async fn send_direct(
    client: &Client,
    r: &TeamSendRequest,
) -> anyhow::Result<Result<TeamSent, ApiError>> {
    let mailer = flotilla_client::Mailer::reading(client.bus().clone()).await?;
    Ok(mailer.send(r).await?)
}

/// Prints an answer or a refusal (as JSON with `--json`); a refusal exits 1.
fn print_answer<T: serde::Serialize>(
    reply: Result<T, ApiError>,
    json: bool,
    print: impl FnOnce(&T),
    exit_of: impl FnOnce(&T) -> ExitCode,
) -> anyhow::Result<ExitCode> {
    match reply {
        Ok(reply) if json => {
            outln!("{}", serde_json::to_string_pretty(&reply)?);
            Ok(exit_of(&reply))
        }
        Ok(reply) => {
            print(&reply);
            Ok(exit_of(&reply))
        }
        Err(e) if json => {
            let mut out = serde_json::json!({"error": e.code, "message": e.message});
            if let Some(rule) = &e.rule {
                out["rule"] = serde_json::json!(rule);
            }
            if !e.problems.is_empty() {
                out["problems"] = serde_json::to_value(&e.problems)?;
            }
            outln!("{}", serde_json::to_string_pretty(&out)?);
            Ok(ExitCode::from(1))
        }
        Err(ApiError {
            code,
            message,
            rule,
            problems,
            ..
        }) => {
            match rule {
                Some(rule) => errln!("error: {code} ({rule}): {message}"),
                None => errln!("error: {code}: {message}"),
            }
            for p in problems {
                errln!("  {p}");
            }
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
            if m.roles().is_empty() {
                "-".to_owned()
            } else {
                m.roles().join(",").chars().take(24).collect()
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
            "none yet (a role is what a plan task's `role` names: known once such a task ran, or declared by a member's card, roles = [\"…\"], or a teammate)".to_owned()
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
    if !m.served.is_empty() {
        outln!("served roles    {}", m.served.join(", "));
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
    // Progress is reported by attempts still running; an idle member shows when it last did.
    outln!(
        "last progress   {}",
        match m.last_progress {
            Some(_) => ago(m.last_progress),
            None => "none reported while running".to_owned(),
        }
    );
    // An attempt shorter than the workers' `started-event-delay` announces no start, so
    // "started" would undercount: the ended attempts are what a person reads.
    outln!(
        "attempts        {} ended: {} succeeded, {} failed; {} running",
        m.counters.succeeded + m.counters.failed,
        m.counters.succeeded,
        m.counters.failed,
        m.tasks.len()
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
    for r in records.iter().filter(|r| !r.agents.is_empty()) {
        outln!("role {} served by: {}", r.name, r.agents.join(", "));
    }
}

/// The one teammate named `name` (of `team`, when given), or what a person reads instead
/// (exit 1): none of that name, or several teams have one (name them).
async fn the_teammate(
    client: &Client,
    name: &str,
    team: Option<&str>,
) -> anyhow::Result<Result<TeammateView, String>> {
    let Some(mut found) = teammates_named(client, name, team).await? else {
        return Ok(Err(format!(
            "not_found: no teammate {name:?}{} (flotilla team lists them)",
            team.map(|t| format!(" in team {t:?}")).unwrap_or_default()
        )));
    };
    if found.len() > 1 {
        let teams: Vec<&str> = found.iter().map(|m| m.team.as_str()).collect();
        return Ok(Err(format!(
            "teams {} each have a teammate {name:?}: pass --team",
            teams.join(", ")
        )));
    }
    Ok(Ok(found.remove(0)))
}

/// Reads a teammate's conversation from the team bucket (empty before its first turn).
async fn conversation_of(
    bus: &Bus,
    team: &str,
    name: &str,
) -> anyhow::Result<(Option<async_nats::jetstream::kv::Store>, Conversation)> {
    let kv = bus.kv(flotilla_model::subjects::Bucket::Team).await?;
    let conv = match kv
        .get(flotilla_model::teammate::conversation_key(team, name))
        .await?
    {
        Some(v) => serde_json::from_slice(&v)?,
        None => Conversation::default(),
    };
    Ok((Some(kv), conv))
}

/// `flotilla team log NAME`.
async fn log(
    client: &Client,
    name: &str,
    team: Option<String>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let mate = match the_teammate(client, name, team.as_deref()).await? {
        Ok(m) => m,
        Err(why) => {
            errln!("error: {why}");
            return Ok(ExitCode::from(1));
        }
    };
    let (_, conv) = conversation_of(client.bus(), &mate.team, &mate.name).await?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&conv)?);
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "teammate {} of team {}: {} turn(s){}",
        mate.name,
        mate.team,
        conv.turns,
        if conv.dropped > 0 {
            format!(", {} older line(s) compacted away", conv.dropped)
        } else {
            String::new()
        }
    );
    if conv.lines.is_empty() {
        outln!("(no messages yet)");
    }
    for l in &conv.lines {
        let who = match l.speaker {
            flotilla_model::teammate::Speaker::User => {
                format!("{} →", l.from.as_deref().unwrap_or("?"))
            }
            flotilla_model::teammate::Speaker::Assistant if l.failed => {
                format!("{} (turn failed):", mate.name)
            }
            flotilla_model::teammate::Speaker::Assistant => format!("{}:", mate.name),
        };
        outln!("{}  {who} {}", l.at, l.text);
    }
    Ok(ExitCode::SUCCESS)
}

/// `flotilla team send NAME TEXT --wait`: sends, then follows the teammate's conversation
/// until the turn that read this message saved its reply.
#[allow(clippy::too_many_arguments)]
async fn send_and_wait(
    client: &Client,
    to: String,
    text: String,
    from: Option<String>,
    team: Option<String>,
    timeout: Duration,
    direct: bool,
    json: bool,
) -> anyhow::Result<ExitCode> {
    use flotilla_agents::teammate::{TurnOutcome, outcome};
    use futures::StreamExt;
    let mate = match the_teammate(client, &to, team.as_deref()).await? {
        Ok(m) => m,
        Err(why) => {
            errln!("error: {why}");
            return Ok(ExitCode::from(1));
        }
    };
    // Watch before sending: no revision after the message is missed.
    let (kv, _) = conversation_of(client.bus(), &mate.team, &mate.name).await?;
    let kv = kv.ok_or_else(|| anyhow::anyhow!("the team bucket is not provisioned"))?;
    let key = flotilla_model::teammate::conversation_key(&mate.team, &mate.name);
    let mut watch = kv.watch(&key).await?;
    let sender = from.clone().unwrap_or_else(|| "operator".to_owned());
    let r = TeamSendRequest {
        protocol: flotilla_model::PROTOCOL_VERSION,
        team: Some(mate.team.clone()),
        to,
        from,
        text: text.clone(),
    };
    let sent = if direct {
        send_direct(client, &r).await
    } else {
        client.call(&r, TIMEOUT).await.map_err(anyhow::Error::from)
    };
    let sent = match sent {
        Ok(Ok(sent)) => sent,
        Ok(Err(e)) => {
            errln!("error: {}: {}", e.code, e.message);
            return Ok(ExitCode::from(1));
        }
        Err(e) => return Err(e),
    };
    let Some(&seq) = sent.seqs.first() else {
        errln!("error: the message was not delivered to {}", mate.name);
        return Ok(ExitCode::from(1));
    };
    if !json {
        errln!("sent to {} (seq {seq}); waiting for the reply…", mate.name);
    }
    let deadline = tokio::time::Instant::now() + timeout;
    let (reply, failed) = loop {
        let entry = match tokio::time::timeout_at(deadline, watch.next()).await {
            Err(_) => {
                errln!(
                    "error: {} did not reply within {}; the message stays in its conversation (flotilla team log {})",
                    mate.name,
                    humantime::format_duration(timeout),
                    mate.name
                );
                return Ok(ExitCode::from(1));
            }
            Ok(None) => anyhow::bail!("the conversation's watch ended"),
            Ok(Some(e)) => e?,
        };
        if entry.operation != async_nats::jetstream::kv::Operation::Put {
            continue;
        }
        let Ok(conv) = serde_json::from_slice::<Conversation>(&entry.value) else {
            continue;
        };
        match outcome(&conv, seq, &sender, &text) {
            TurnOutcome::Pending => {}
            TurnOutcome::Replied(r) => break (r, false),
            TurnOutcome::Failed(r) => break (r, true),
        }
    };
    if json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "teammate": mate.name, "team": mate.team, "seq": seq,
                "reply": reply, "failed": failed,
            }))?
        );
    } else if failed {
        errln!("error: {}'s turn failed: {reply}", mate.name);
    } else {
        outln!("{reply}");
    }
    Ok(if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}
