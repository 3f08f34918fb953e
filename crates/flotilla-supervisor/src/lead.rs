//! Leads of runs under the `supervisor` strategy: their policy endpoints (`team.assign`,
//! `team.finish`) and their feed.
//!
//! ```text
//! run_started (strategy supervisor) ──► spawn teammate `lead` in team <run> (create-if-absent),
//!                                       and one teammate per agent of the plan (its members)
//!                                       mail the lead the plan: tasks, roles, dependencies, team
//! task ended / member recruited, retired / recruit refused ──► mail it what happened,
//!                                       with the run's task states (each mail wakes it);
//!                                       a recruit's agent joins the team as a teammate
//! lead's tools ──► team.assign / team.recruit / team.finish ──► run-log inputs
//!                  send_message / list_team ──► its teammates (members answer between tasks)
//! run ended ──► shut the lead and the members down
//! ```
//!
//! A member teammate is the conversational side of a plan agent: its tasks run as tasks (on
//! the lead's assignment), and between them the lead can message it, which wakes it for a
//! turn like any teammate. Idle members hold nothing but their entry.
//!
//! The lead is a persistent teammate like any other: idle between messages (no worker slot,
//! no process), hosted turn by turn on its pool's workers, fenced by its epoch. The feed runs
//! in the event follower, so its mail is sent by whichever replica handles an event message;
//! each mail carries a message id derived from the event message's stream sequence, so an
//! event delivered again (a replica died before acknowledging) is not mailed twice.
//!
//! The supervisor decides policy only. `team.assign` and `team.finish` check the run (led,
//! running, the task held) and append one run-log input each; the run machine applies it or
//! ignores it.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

use async_nats::jetstream::kv;
use flotilla_machine::RunState;
use flotilla_model::ErrorCode;
use flotilla_model::api::ApiError;
use flotilla_model::event::{Event, EventEnvelope, WorkflowPhase};
use flotilla_model::ids::RunId;
use flotilla_model::lead::{
    AssignRequest, FinishRequest, LEAD_NAME, LeadReply, assigned_msg_id, finished_msg_id,
};
use flotilla_model::plan::{LEAD_ROLE, Strategy, Subtask};
use flotilla_model::recruit::{MAX_REASON, RecruitStatus};
use flotilla_model::run::{EndCause, TaskStatus};
use flotilla_model::runlog::{Assigned, Finished, RunInput};
use flotilla_model::teammate::{Teammate, TeammateStatus, teammate_key};
use flotilla_model::time::Timestamp;
use flotilla_model::token::check_token;
use tracing::info;

use crate::Team;
use crate::error::SupervisorError;
use crate::recruit::{Running, append_and_wait, invalid, is_led, load};

/// Longest excerpt of a task's result mailed to the lead.
const MAX_EXCERPT: usize = 1500;

fn conflict(code: ErrorCode, message: impl Into<String>) -> ApiError {
    ApiError::new(409, code, message)
}

fn check_by(by: &Option<String>) -> Result<String, ApiError> {
    let by = by.clone().unwrap_or_else(|| "operator".to_owned());
    check_token(&by).map_err(|e| invalid(format!("by {by:?} {e}")))?;
    Ok(by)
}

fn check_led(run: &Running) -> Result<(), ApiError> {
    let s = &run.state;
    if !is_led(s) {
        return Err(conflict(
            ErrorCode::NotLed,
            format!(
                "run {} is not led: its strategy is {} (a lead exists only under the supervisor strategy)",
                s.run_id,
                s.strategy
                    .as_ref()
                    .map_or("not chosen yet", |c| c.strategy.as_str())
            ),
        ));
    }
    if s.status.is_terminal() {
        return Err(conflict(
            ErrorCode::RunNotRunning,
            format!("run {} has ended ({})", s.run_id, s.status.as_str()),
        ));
    }
    Ok(())
}

/// `team.assign`.
pub(crate) async fn assign(team: Arc<Team>, r: AssignRequest) -> Result<LeadReply, ApiError> {
    let team = &*team;
    let by = check_by(&r.by)?;
    if r.reason.len() > MAX_REASON {
        return Err(invalid(format!(
            "reason is {} bytes, more than {MAX_REASON}",
            r.reason.len()
        )));
    }
    let run = load(team, r.run_id).await?;
    check_led(&run)?;
    let Some(i) = run.plan.subtasks.iter().position(|t| t.id == r.task_id) else {
        let held: Vec<&str> = held_tasks(&run).collect();
        return Err(ApiError::new(
            404,
            ErrorCode::UnknownTask,
            format!(
                "run {} has no task {}; tasks waiting for an assignment: {}",
                r.run_id,
                r.task_id,
                if held.is_empty() {
                    "none".to_owned()
                } else {
                    held.join(", ")
                }
            ),
        ));
    };
    let t = &run.state.tasks[i];
    if !t.held {
        // Assigned before (this request repeated, or another): nothing to do.
        return Ok(LeadReply {
            run_id: r.run_id,
            status: RecruitStatus::Accepted,
            task_id: Some(r.task_id),
            seq: 0,
        });
    }
    if t.status.is_terminal() {
        return Err(conflict(
            ErrorCode::TaskEnded,
            format!(
                "task {} of run {} has ended ({}) without running: a dependency failed",
                r.task_id,
                r.run_id,
                t.status.as_str()
            ),
        ));
    }
    let input = RunInput::Assigned(Box::new(Assigned {
        task_id: r.task_id.clone(),
        by,
        reason: r.reason.clone(),
    }));
    let msg_id = assigned_msg_id(r.run_id, &r.task_id);
    let (applied, seq) = append_and_wait(team, r.run_id, input, &msg_id, |s| {
        s.tasks.get(i).is_some_and(|t| !t.held).then_some(())
    })
    .await?;
    info!(run = %r.run_id, task = %r.task_id, "Assignment recorded");
    Ok(LeadReply {
        run_id: r.run_id,
        status: if applied.is_some() {
            RecruitStatus::Accepted
        } else {
            RecruitStatus::Recorded
        },
        task_id: Some(r.task_id),
        seq,
    })
}

/// `team.finish`.
pub(crate) async fn finish(team: Arc<Team>, r: FinishRequest) -> Result<LeadReply, ApiError> {
    let team = &*team;
    let by = check_by(&r.by)?;
    if r.result.trim().is_empty() {
        return Err(invalid("result must hold the run's final answer"));
    }
    if r.result.len() > Finished::MAX_RESULT {
        return Err(ApiError::new(
            413,
            ErrorCode::ResultTooLarge,
            format!(
                "the result is {} bytes; a lead's result holds at most {} (put more in the workspace and cite it)",
                r.result.len(),
                Finished::MAX_RESULT
            ),
        ));
    }
    let run = load(team, r.run_id).await?;
    let finished_by_lead =
        |s: &RunState| s.outcome.as_ref().and_then(|o| o.cause) == Some(EndCause::LeadFinished);
    if finished_by_lead(&run.state) {
        return Ok(LeadReply {
            run_id: r.run_id,
            status: RecruitStatus::Accepted,
            task_id: None,
            seq: 0,
        });
    }
    check_led(&run)?;
    let input = RunInput::Finished(Box::new(Finished {
        result: r.result.clone(),
        by,
    }));
    let (applied, seq) = append_and_wait(team, r.run_id, input, &finished_msg_id(r.run_id), |s| {
        finished_by_lead(s).then_some(())
    })
    .await?;
    info!(run = %r.run_id, "Finish recorded");
    Ok(LeadReply {
        run_id: r.run_id,
        status: if applied.is_some() {
            RecruitStatus::Accepted
        } else {
            RecruitStatus::Recorded
        },
        task_id: None,
        seq,
    })
}

fn held_tasks(run: &Running) -> impl Iterator<Item = &str> {
    run.plan
        .subtasks
        .iter()
        .zip(&run.state.tasks)
        .filter(|(_, t)| t.held && !t.status.is_terminal())
        .map(|(s, _)| s.id.as_str())
}

/// What a batch of events means for leads: runs to lead, mail to send, leads to end.
#[derive(Debug, Default)]
pub(crate) struct LeadFeed {
    /// Led runs that started (or were planned) in the batch.
    starts: Vec<RunId>,
    /// Mail per run: (message id, text).
    notes: BTreeMap<RunId, Vec<(String, String)>>,
    /// Runs that ended.
    ended: Vec<RunId>,
    /// Tasks recruited into led runs (their agents join the team).
    recruits: Vec<(RunId, String)>,
}

impl LeadFeed {
    /// Adds what one event message (stream sequence `seq`) means for leads.
    pub(crate) fn gather(&mut self, team: &Team, events: &[EventEnvelope], seq: u64) {
        for (k, e) in events.iter().enumerate() {
            let Event::Workflow(w) = &e.event else {
                continue;
            };
            let run = e.run_id;
            let led_start = matches!(
                w.phase,
                WorkflowPhase::RunStarted | WorkflowPhase::RunPlanned
            ) && w
                .strategy
                .as_ref()
                .is_some_and(|s| s.strategy == Strategy::Supervisor);
            if led_start {
                self.starts.push(run);
                continue;
            }
            // Only these concern a lead: look the lead up for nothing else (most events).
            let relevant = w.phase.ends_run()
                || matches!(
                    w.phase,
                    WorkflowPhase::TaskSucceeded
                        | WorkflowPhase::TaskFailed
                        | WorkflowPhase::TaskSkipped
                        | WorkflowPhase::MemberRecruited
                        | WorkflowPhase::RecruitRefused
                        | WorkflowPhase::MemberRetired
                );
            if !relevant {
                continue;
            }
            let led = self.starts.contains(&run)
                || team
                    .mates
                    .get(&teammate_key(&run.to_string(), LEAD_NAME))
                    .is_some();
            if !led {
                continue;
            }
            if w.phase.ends_run() {
                self.ended.push(run);
                continue;
            }
            let task = e.task_id.as_ref().map(|t| t.as_str()).unwrap_or("-");
            let text = match w.phase {
                WorkflowPhase::TaskSucceeded => format!("Task {task} succeeded."),
                WorkflowPhase::TaskFailed => format!(
                    "Task {task} failed: {}",
                    w.error
                        .as_ref()
                        .map(ToString::to_string)
                        .unwrap_or_default()
                ),
                WorkflowPhase::TaskSkipped => format!(
                    "Task {task} was skipped: {}",
                    w.detail.clone().unwrap_or_default()
                ),
                WorkflowPhase::MemberRecruited => {
                    self.recruits.push((run, task.to_owned()));
                    format!(
                        "A member of role {} was recruited as task {task}: {} (it is on your team \
                         now; assign {task} to run it)",
                        w.role.clone().unwrap_or_default(),
                        w.detail.clone().unwrap_or_default()
                    )
                }
                WorkflowPhase::RecruitRefused | WorkflowPhase::MemberRetired => {
                    w.detail.clone().unwrap_or_default()
                }
                _ => continue,
            };
            self.notes
                .entry(run)
                .or_default()
                .push((format!("lead.{run}.{seq}.{k}"), text));
        }
    }

    /// Whether the batch concerns no lead.
    pub(crate) fn is_empty(&self) -> bool {
        self.starts.is_empty() && self.notes.is_empty() && self.ended.is_empty()
    }

    /// Spawns leads, mails them, ends them. An error leaves the batch unacknowledged, so it
    /// is done again (each step is idempotent).
    pub(crate) async fn apply(self, team: &Team) -> Result<(), SupervisorError> {
        for run in &self.starts {
            start_lead(team, *run).await?;
        }
        for (run, task) in &self.recruits {
            join_recruit(team, *run, task).await?;
        }
        for (run, notes) in self.notes {
            let loaded = load(team, run).await.ok();
            let n = notes.len();
            for (k, (id, mut text)) in notes.into_iter().enumerate() {
                if k + 1 == n
                    && let Some(r) = &loaded
                {
                    text.push_str("\n\n");
                    text.push_str(&status_of(team, r).await);
                }
                mail(team, run, &id, &text).await?;
            }
        }
        for run in self.ended {
            end_lead(team, run).await?;
        }
        Ok(())
    }
}

fn store_err(what: &str, e: impl std::fmt::Display) -> SupervisorError {
    SupervisorError::store(what.to_owned(), e.to_string())
}

/// The lead's standing instructions.
fn instructions(run: RunId) -> String {
    format!(
        "You lead run {run}. None of the plan's tasks runs until you assign it with assign_task \
         (it then waits for its dependencies). Flotilla mails you whenever a task ends or the team \
         changes, with the state of every task. Assign the tasks the goal needs, in the order you \
         choose; if the plan lacks a skill, recruit a member of a role (recruit) for a new task; \
         when the work is done, call finish_run with the final answer: that ends the run, and \
         tasks you never assigned are skipped. Be brief."
    )
}

/// Spawns a teammate of a led run's team (create-if-absent): whether it is new.
async fn spawn_mate(
    team: &Team,
    run: RunId,
    name: &str,
    role: &str,
    agent: &str,
    instructions: &str,
) -> Result<bool, SupervisorError> {
    let pool = team
        .roster
        .get(&flotilla_model::team::member_key(agent))
        .and_then(|m| m.value.pools.first().cloned())
        .unwrap_or_else(|| "default".to_owned());
    let t = run.to_string();
    let key = teammate_key(&t, name);
    let now = Timestamp::now();
    let mut mate = Teammate::spawn(&t, name, role, agent, &pool, instructions, now);
    mate.spawned_by = Some("supervisor".to_owned());
    mate.turns_per_hour = team.opts.turns_per_hour;
    mate.max_message_bytes = Some(team.opts.max_message_bytes);
    mate.run = Some(run);
    let bytes = serde_json::to_vec(&mate).map_err(|e| store_err("encoding a teammate", e))?;
    match team.team_kv.create(&key, bytes.into()).await {
        Ok(revision) => {
            team.mates.note(&key, mate, now.unix_ms(), revision);
            info!(%run, name, agent, pool, "Teammate of a led run spawned");
            Ok(true)
        }
        Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(store_err("spawning a teammate of a led run", e)),
    }
}

/// The agent that runs a subtask: the one it names, else the first that fills its role.
fn agent_of(team: &Team, s: &Subtask) -> Option<String> {
    s.agent.clone().or_else(|| {
        s.role
            .as_deref()
            .and_then(|r| crate::teammates::agent_for_role(team, r))
    })
}

/// A plan's members: each agent that runs one of its subtasks, with its role and its tasks,
/// by first appearance. The name `lead` is the lead's, so an agent of that name is left out.
fn members_of<'a>(team: &Team, subtasks: impl Iterator<Item = &'a Subtask>) -> Vec<Member> {
    let mut out: Vec<Member> = Vec::new();
    for s in subtasks {
        let Some(agent) = agent_of(team, s) else {
            continue;
        };
        if agent == LEAD_NAME || check_token(&agent).is_err() {
            continue;
        }
        match out.iter_mut().find(|m| m.agent == agent) {
            Some(m) => m.tasks.push(s.id.to_string()),
            None => {
                let role = s
                    .role
                    .clone()
                    .or_else(|| {
                        team.cards
                            .get(&agent)
                            .and_then(|c| c.roles.first().cloned())
                    })
                    .unwrap_or_else(|| "member".to_owned());
                out.push(Member {
                    agent,
                    role,
                    tasks: vec![s.id.to_string()],
                });
            }
        }
    }
    out
}

/// One member of a led run's team.
#[derive(Debug)]
struct Member {
    agent: String,
    role: String,
    tasks: Vec<String>,
}

/// A led run's record, or `None` when it is gone (nothing to do for it).
async fn load_led(team: &Team, run: RunId) -> Result<Option<Running>, SupervisorError> {
    match load(team, run).await {
        Ok(r) => Ok(Some(r)),
        Err(e) if e.status == 404 => Ok(None),
        Err(e) => Err(store_err("reading a led run", e.message)),
    }
}

/// Spawns one member of a led run's team, named after its agent (create-if-absent).
async fn spawn_member(team: &Team, run: RunId, m: &Member) -> Result<bool, SupervisorError> {
    spawn_mate(
        team,
        run,
        &m.agent,
        &m.role,
        &m.agent,
        &member_instructions(run, m),
    )
    .await
}

/// A member teammate's standing instructions.
fn member_instructions(run: RunId, m: &Member) -> String {
    format!(
        "You are a member of the team of run {run}, led by the teammate `lead`. Your tasks in its \
         plan ({}) run as tasks of their own when the lead assigns them. Between them, the lead or \
         a teammate may message you: answer what you are asked with send_message to the sender, \
         briefly.",
        m.tasks.join(", ")
    )
}

/// Spawns the run's lead and its members (once each) and mails the lead the plan.
async fn start_lead(team: &Team, run: RunId) -> Result<(), SupervisorError> {
    let Some(loaded) = load_led(team, run).await? else {
        return Ok(());
    };
    let agent = loaded
        .state
        .lead
        .clone()
        .or_else(|| {
            team.validation
                .agents
                .as_ref()
                .and_then(|a| a.lead().map(str::to_owned))
        })
        .unwrap_or_else(|| LEAD_ROLE.to_owned());
    spawn_mate(team, run, LEAD_NAME, LEAD_ROLE, &agent, &instructions(run)).await?;
    // The lead counts against the team size cap, as every teammate does.
    let room = team.opts.team_size.saturating_sub(1);
    let members = members_of(team, loaded.plan.subtasks.iter());
    let mut joined = Vec::new();
    for m in members.iter().take(room) {
        spawn_member(team, run, m).await?;
        joined.push(m);
    }
    if members.len() > room {
        info!(%run, members = members.len(), room, "A led run has more agents than the team size cap; the rest work by tasks only");
    }
    let mut text = format!(
        "Run {run} started{}. Its plan:\n",
        loaded
            .plan
            .name
            .as_ref()
            .map(|n| format!(" ({n})"))
            .unwrap_or_default()
    );
    if let Some(q) = &loaded.plan.query {
        let _ = writeln!(text, "Goal: {q}");
    }
    for s in &loaded.plan.subtasks {
        let _ = write!(text, "- {}", s.id);
        if let Some(r) = &s.role {
            let _ = write!(text, " [role {r}]");
        }
        if !s.dependencies.is_empty() {
            let deps: Vec<&str> = s.dependencies.iter().map(|d| d.as_str()).collect();
            let _ = write!(text, " after {}", deps.join(", "));
        }
        let _ = writeln!(text, ": {}", s.description);
    }
    if !joined.is_empty() {
        text.push_str("Your team (message a member with send_message):");
        for m in &joined {
            let _ = write!(text, " {} ({}: {});", m.agent, m.role, m.tasks.join(", "));
        }
        text.push('\n');
    }
    text.push_str("Assign what should run first.");
    mail(team, run, &format!("lead.{run}.start"), &text).await
}

/// Adds the agent of a task recruited into a led run to its team (if it is not on it yet).
async fn join_recruit(team: &Team, run: RunId, task: &str) -> Result<(), SupervisorError> {
    let Some(loaded) = load_led(team, run).await? else {
        return Ok(());
    };
    let t = run.to_string();
    let on_team = team
        .mates
        .matching(|m| m.team == t && m.status != TeammateStatus::Shutdown)
        .len();
    if on_team >= team.opts.team_size {
        return Ok(());
    }
    let Some(s) = loaded.plan.subtasks.iter().find(|s| s.id.as_str() == task) else {
        return Ok(());
    };
    if let Some(m) = members_of(team, std::iter::once(s)).first() {
        spawn_member(team, run, m).await?;
    }
    Ok(())
}

/// Each task's state, and the results of those that succeeded (excerpts).
async fn status_of(team: &Team, run: &Running) -> String {
    let mut groups: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    let mut results = String::new();
    for (s, t) in run.plan.subtasks.iter().zip(&run.state.tasks) {
        let group = if t.held && !t.status.is_terminal() {
            "not assigned"
        } else {
            t.status.as_str()
        };
        groups.entry(group).or_default().push(s.id.to_string());
        if t.status == TaskStatus::Succeeded
            && t.result_seq > 0
            && let Ok(r) = team.runs.result_at(t.result_seq).await
        {
            let mut excerpt = r.result.response.clone();
            flotilla_machine::truncate_message(&mut excerpt, MAX_EXCERPT);
            let _ = writeln!(results, "Result of {}: {excerpt}", s.id);
        }
    }
    let mut text = String::from("Tasks now:");
    for (group, ids) in groups {
        let _ = write!(text, " {group}: {};", ids.join(", "));
    }
    if !results.is_empty() {
        text.push('\n');
        text.push_str(&results);
    }
    text
}

/// Mails the run's lead (de-duplicated by `id`) and wakes it.
async fn mail(team: &Team, run: RunId, id: &str, text: &str) -> Result<(), SupervisorError> {
    crate::teammates::post(
        team,
        &run.to_string(),
        LEAD_NAME,
        "flotilla",
        text,
        Some(id),
        None,
    )
    .await?;
    Ok(())
}

/// Shuts the run's lead and members down (each after its current turn).
async fn end_lead(team: &Team, run: RunId) -> Result<(), SupervisorError> {
    let t = run.to_string();
    let mut names: Vec<String> = team
        .mates
        .matching(|m| m.team == t && m.status != TeammateStatus::Shutdown)
        .into_iter()
        .map(|(_, m)| m.name)
        .collect();
    if !names.iter().any(|n| n == LEAD_NAME) {
        // The mirror may lag behind the lead's spawn: end it by name regardless.
        names.push(LEAD_NAME.to_owned());
    }
    for name in names {
        if crate::teammates::end(team, &t, &name).await?.is_some() {
            info!(%run, name, "Teammate of a led run shut down: its run ended");
        }
    }
    Ok(())
}
