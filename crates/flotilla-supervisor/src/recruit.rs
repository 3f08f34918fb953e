//! Recruitment and retirement under policy: `team.recruit`, `team.recruit_status` and
//! `team.retire`.
//!
//! ```text
//! request ──► shape checks (400) ──► load the run, its plan as amended so far
//!         ──► same recruit id already applied? answer what happened (idempotent)
//!         ──► policy: running? recruiter? role allowed? recruits left? team size? budget?
//!               └─ refused: 403 recruit_refused {rule}; nothing is written
//!         ──► validate the amended plan with the deployment's context
//!               └─ problems: 400 recruit_refused {rule: invalid_subtask, problems}
//!         ──► append `recruited` to the run log (Nats-Msg-Id recruited.<run>.<id>)
//!         ──► wait (answer-wait) for the run's record to show it: accepted | refused,
//!             else `recorded`
//! ```
//!
//! The supervisor decides policy and writes one run-log input; the run machine decides the
//! run. Replicas need no coordination: the message id makes a repeated append of one recruit
//! a no-op within the stream's duplicate window, and the machine ignores a recruit id it has
//! already applied beyond it. A supervisor that dies after the append and before its answer
//! leaves the caller without an answer: the caller reports the recruit `uncertain` and asks
//! `team.recruit_status` (or repeats the recruit with the same id, which cannot double it).

use async_nats::jetstream::kv;
use flotilla_bus::wire;
use flotilla_machine::RunState;
use flotilla_model::ErrorCode;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::api::ApiError;
use flotilla_model::codec::Codec;
use flotilla_model::ids::RunId;
use flotilla_model::lead::LEAD_NAME;
use flotilla_model::plan::Plan;
use flotilla_model::problem::Problem;
use flotilla_model::recruit::{
    MAX_REASON, RecruitReply, RecruitRequest, RecruitRule, RecruitStatus, RecruitStatusRequest,
    RetireReply, RetireRequest, TeamChange, TeamChangeKind, recruit_subtask, recruited_msg_id,
    retired_msg_id,
};
use flotilla_model::run::{PlanningStatus, TaskStatus};
use flotilla_model::runlog::{Recruited, Retired, RunInput, RunLogEntry};
use flotilla_model::token::check_token;
use flotilla_model::validate::{normalize_plan, validate_plan};
use futures::StreamExt;
use std::collections::BTreeSet;
use tracing::info;

use std::sync::Arc;

use crate::Team;

pub(crate) fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::new(400, ErrorCode::InvalidRequest, message)
}

fn refused(rule: RecruitRule, message: impl Into<String>) -> ApiError {
    ApiError {
        rule: Some(rule.as_str().to_owned()),
        ..ApiError::new(403, ErrorCode::RecruitRefused, message)
    }
}

pub(crate) fn unavailable(what: &str, e: impl std::fmt::Display) -> ApiError {
    ApiError::new(503, ErrorCode::Unavailable, format!("{what}: {e}"))
}

fn check_reason(reason: &str) -> Result<(), ApiError> {
    if reason.trim().is_empty() {
        return Err(invalid("reason must say why (it is recorded)"));
    }
    if reason.len() > MAX_REASON {
        return Err(invalid(format!(
            "reason is {} bytes, more than {MAX_REASON}",
            reason.len()
        )));
    }
    Ok(())
}

/// A run as the supervisor checks it: its record and the plan it follows now.
pub(crate) struct Running {
    pub(crate) state: RunState,
    pub(crate) plan: Plan,
}

/// The run's record. A run started a moment ago may not be recorded yet (a coordinator
/// records a start lazily, `start-flush-delay` later): when its first message exists, the
/// record is awaited (bounded by `answer-wait`) rather than the run called unknown.
async fn state_of(team: &Team, run: RunId) -> Result<RunState, ApiError> {
    let read = |e| unavailable("reading the run", e);
    if let Some(stored) = team.runs.load(run).await.map_err(read)? {
        return Ok(stored.snapshot.state);
    }
    if team.runs.first_message(run).await.map_err(read)?.is_none() {
        return Err(ApiError::new(
            404,
            ErrorCode::NotFound,
            format!("no run {run} (or it was never accepted)"),
        ));
    }
    watch_record(team, run, |state| Some(state.clone()))
        .await?
        .ok_or_else(|| {
            ApiError::new(
                503,
                ErrorCode::Unavailable,
                format!("run {run} exists but is not recorded yet; ask again"),
            )
        })
}

/// Follows the run's record for up to `answer-wait`: the first `Some` that `decide` returns
/// for a stored state, else `None`. The watch starts with the key's latest value
/// (`watch_with_history`; a plain `watch` delivers only later changes), so a change made
/// before the watch began is seen too; a record that cannot be read is taken as no news (the
/// deadline bounds the wait).
async fn watch_record<T>(
    team: &Team,
    run: RunId,
    decide: impl Fn(&RunState) -> Option<T>,
) -> Result<Option<T>, ApiError> {
    let mut watch = team
        .runs
        .runs_bucket()
        .watch_with_history(run.to_string())
        .await
        .map_err(|e| unavailable("watching the run", e))?;
    let deadline = tokio::time::Instant::now() + team.opts.recruit.answer_wait;
    loop {
        match tokio::time::timeout_at(deadline, watch.next()).await {
            Ok(Some(Ok(_))) => {
                if let Ok(Some(stored)) = team.runs.load(run).await
                    && let Some(found) = decide(&stored.snapshot.state)
                {
                    return Ok(Some(found));
                }
            }
            Ok(Some(Err(_))) => continue,
            Ok(None) | Err(_) => return Ok(None),
        }
    }
}

pub(crate) async fn load(team: &Team, run: RunId) -> Result<Running, ApiError> {
    let state = state_of(team, run).await?;
    let plan = if state.tasks.is_empty() {
        None
    } else {
        team.runs
            .plan_for(run, &state)
            .await
            .map_err(|e| unavailable("reading the run's plan", e))?
    };
    let Some(plan) = plan else {
        return Err(refused(
            RecruitRule::RunNotRunning,
            format!("run {run} has no plan to join (rejected)"),
        ));
    };
    Ok(Running { state, plan })
}

fn answer(change: &TeamChange) -> RecruitReply {
    RecruitReply {
        recruit_id: change.id.clone(),
        status: if change.kind == TeamChangeKind::Refused {
            RecruitStatus::Refused
        } else {
            RecruitStatus::Accepted
        },
        task_id: change
            .task_id
            .clone()
            .unwrap_or_else(|| flotilla_model::TaskId::new("")),
        refusal: change.refusal.clone(),
        seq: Some(change.seq),
    }
}

fn check_running(run: &Running) -> Result<(), ApiError> {
    let s = &run.state;
    if s.status.is_terminal() {
        return Err(refused(
            RecruitRule::RunNotRunning,
            format!("run {} has ended ({})", s.run_id, s.status.as_str()),
        ));
    }
    if s.planning
        .as_ref()
        .is_some_and(|p| p.status != PlanningStatus::Planned)
    {
        return Err(refused(
            RecruitRule::RunNotRunning,
            format!("run {} is still being planned", s.run_id),
        ));
    }
    Ok(())
}

/// Whether a run is led: the `supervisor` strategy, and planned.
pub(crate) fn is_led(state: &RunState) -> bool {
    state
        .strategy
        .as_ref()
        .is_some_and(|s| s.strategy == flotilla_model::plan::Strategy::Supervisor)
}

/// Who asks: `task:<id>` for a running task of the run (checked against `recruiters`), else
/// `operator`.
fn recruiter(
    team: &Team,
    run: &Running,
    by_task: Option<&flotilla_model::TaskId>,
) -> Result<String, ApiError> {
    let Some(task) = by_task else {
        return Ok("operator".to_owned());
    };
    if task.as_str() == LEAD_NAME && is_led(&run.state) {
        // The run's lead: it directs the team, so it may always ask.
        return Ok(LEAD_NAME.to_owned());
    }
    let i = run.plan.subtasks.iter().position(|t| &t.id == task);
    let running = i.is_some_and(|i| {
        run.state
            .tasks
            .get(i)
            .is_some_and(|t| t.status == TaskStatus::Dispatched)
    });
    let Some(i) = i.filter(|_| running) else {
        return Err(refused(
            RecruitRule::UnknownRecruiter,
            format!("{task} is not a running task of run {}", run.state.run_id),
        ));
    };
    let allowed = &team.opts.recruit.recruiters;
    if !allowed.is_empty() {
        let t = &run.plan.subtasks[i];
        let agent = t.agent.clone().or_else(|| {
            team.validation
                .agents
                .as_ref()
                .and_then(|a| a.default.clone())
        });
        let as_role = t.role.as_ref().map(|r| format!("role:{r}"));
        let ok = allowed
            .iter()
            .any(|w| Some(w) == agent.as_ref() || Some(w) == as_role.as_ref());
        if !ok {
            return Err(refused(
                RecruitRule::NotARecruiter,
                format!(
                    "{task} (agent {}, role {}) may not recruit; recruiters: {}",
                    agent.as_deref().unwrap_or("-"),
                    t.role.as_deref().unwrap_or("-"),
                    allowed.join(", ")
                ),
            ));
        }
    }
    Ok(format!("task:{task}"))
}

/// The run's team: the distinct members its tasks name (an agent, or `role:<name>` for a
/// task claimed by a member of its role, or the default agent).
fn members(team: &Team, run: &Running) -> BTreeSet<String> {
    let default = team
        .validation
        .agents
        .as_ref()
        .and_then(|a| a.default.clone())
        .unwrap_or_else(|| "default".to_owned());
    run.plan
        .subtasks
        .iter()
        .map(|t| match (&t.agent, &t.role) {
            (Some(a), _) => a.clone(),
            (None, Some(r)) if run.state.anycast => format!("role:{r}"),
            _ => default.clone(),
        })
        .collect()
}

/// A budget the run counts against that is spent, if any.
async fn spent_budget(team: &Team, state: &RunState) -> Result<Option<String>, ApiError> {
    for scope in &state.budget_scopes {
        let key = format!("budget.{}", scope.run_id);
        let entry = team
            .cursors_kv
            .entry(key)
            .await
            .map_err(|e| unavailable("reading the run's budget", e))?;
        let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else {
            continue;
        };
        let spent: serde_json::Value = serde_json::from_slice(&entry.value).unwrap_or_default();
        let tokens = spent
            .get("tokens")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0);
        let cost = spent
            .get("cost")
            .and_then(serde_json::Value::as_f64)
            .unwrap_or(0.0);
        if let Some(max) = scope.limits.max_tokens
            && tokens >= max
        {
            return Ok(Some(format!(
                "run {} has spent {tokens} of its {max} tokens",
                scope.run_id
            )));
        }
        if let Some(max) = scope.limits.max_cost
            && cost >= max
        {
            return Ok(Some(format!(
                "run {} has spent ${cost:.4} of its ${max}",
                scope.run_id
            )));
        }
    }
    Ok(None)
}

/// `team.recruit`.
pub(crate) async fn recruit(team: Arc<Team>, r: RecruitRequest) -> Result<RecruitReply, ApiError> {
    let team = &*team;
    check_token(&r.recruit_id)
        .map_err(|e| invalid(format!("recruit_id {:?} {e}", r.recruit_id)))?;
    check_token(&r.role).map_err(|e| invalid(format!("role {:?} {e}", r.role)))?;
    if r.description.trim().is_empty() {
        return Err(invalid("description must say what the recruit is to do"));
    }
    check_reason(&r.reason)?;
    let run = load(team, r.run_id).await?;
    if let Some(change) = run
        .state
        .team_change(TeamChangeKind::Recruited, &r.recruit_id)
    {
        return Ok(answer(change));
    }
    check_running(&run)?;
    let by = recruiter(team, &run, r.by_task.as_ref())?;
    let policy = &team.opts.recruit;
    if !policy.allowed_roles.is_empty() && !policy.allowed_roles.contains(&r.role) {
        return Err(refused(
            RecruitRule::RoleNotAllowed,
            format!(
                "role {} may not be recruited; allowed: {}",
                r.role,
                policy.allowed_roles.join(", ")
            ),
        ));
    }
    if let Some(roles) = &run.plan.config.recruit_roles
        && !roles.contains(&r.role)
    {
        return Err(refused(
            RecruitRule::RoleNotAllowed,
            format!(
                "the plan allows recruits of {} only, not {}",
                if roles.is_empty() {
                    "no role".to_owned()
                } else {
                    roles.join(", ")
                },
                r.role
            ),
        ));
    }
    let max = run
        .plan
        .config
        .max_recruits
        .map_or(policy.max_recruits, |m| m.min(policy.max_recruits));
    let recruited = run
        .state
        .team
        .iter()
        .filter(|c| c.kind == TeamChangeKind::Recruited)
        .count();
    if recruited >= max as usize {
        return Err(refused(
            RecruitRule::TooManyRecruits,
            format!(
                "run {} has {recruited} recruits, the most it may take is {max}",
                r.run_id
            ),
        ));
    }
    let mut team_now = members(team, &run);
    let size = team_now.len();
    team_now.insert(if run.state.anycast {
        format!("role:{}", r.role)
    } else {
        team.validation
            .agents
            .as_ref()
            .and_then(|a| a.default.clone())
            .unwrap_or_else(|| "default".to_owned())
    });
    if team_now.len() > policy.max_team {
        return Err(refused(
            RecruitRule::TeamFull,
            format!(
                "run {}'s team has {size} members; a {} would pass max-team {}",
                r.run_id, r.role, policy.max_team
            ),
        ));
    }
    if let Some(why) = spent_budget(team, &run.state).await? {
        return Err(refused(RecruitRule::BudgetExhausted, why));
    }
    let subtask = recruit_subtask(&r);
    let mut amended = run.plan.clone();
    amended.subtasks.push(subtask);
    let before: BTreeSet<String> = validate_plan(&run.plan, &team.validation)
        .errors
        .iter()
        .map(ToString::to_string)
        .collect();
    let problems: Vec<Problem> = validate_plan(&amended, &team.validation)
        .errors
        .into_iter()
        .filter(|p| !before.contains(&p.to_string()))
        .collect();
    if !problems.is_empty() {
        let first = problems[0].to_string();
        return Err(ApiError {
            rule: Some(RecruitRule::InvalidSubtask.as_str().to_owned()),
            problems,
            ..ApiError::new(
                400,
                ErrorCode::RecruitRefused,
                format!("the recruit's subtask does not fit the plan: {first}"),
            )
        });
    }
    let subtask = normalize_plan(amended).subtasks.pop().ok_or_else(|| {
        ApiError::new(
            500,
            ErrorCode::Internal,
            "the amended plan lost its last task",
        )
    })?;
    let task_id = subtask.id.clone();
    let input = RunInput::Recruited(Box::new(Recruited {
        recruit_id: r.recruit_id.clone(),
        subtask,
        by,
        reason: r.reason.clone(),
    }));
    let msg_id = recruited_msg_id(r.run_id, &r.recruit_id);
    let id = r.recruit_id.clone();
    let applied = append_and_wait(team, r.run_id, input, &msg_id, |s| {
        s.team_change(TeamChangeKind::Recruited, &id).cloned()
    })
    .await?;
    info!(run = %r.run_id, recruit = %r.recruit_id, role = %r.role, task = %task_id, "Recruit recorded");
    Ok(match applied {
        (Some(change), _) => answer(&change),
        (None, seq) => RecruitReply {
            recruit_id: r.recruit_id,
            status: RecruitStatus::Recorded,
            task_id,
            refusal: None,
            seq: Some(seq),
        },
    })
}

/// `team.recruit_status`.
pub(crate) async fn status(
    team: Arc<Team>,
    r: RecruitStatusRequest,
) -> Result<RecruitReply, ApiError> {
    let team = &*team;
    check_token(&r.recruit_id)
        .map_err(|e| invalid(format!("recruit_id {:?} {e}", r.recruit_id)))?;
    let state = state_of(team, r.run_id).await?;
    Ok(
        match state.team_change(TeamChangeKind::Recruited, &r.recruit_id) {
            Some(change) => answer(change),
            None => RecruitReply {
                task_id: flotilla_model::TaskId::new(""),
                recruit_id: r.recruit_id,
                status: RecruitStatus::Unknown,
                refusal: None,
                seq: None,
            },
        },
    )
}

/// `team.retire`.
pub(crate) async fn retire(team: Arc<Team>, r: RetireRequest) -> Result<RetireReply, ApiError> {
    let team = &*team;
    check_token(&r.member).map_err(|e| invalid(format!("member {:?} {e}", r.member)))?;
    check_reason(&r.reason)?;
    let run = load(team, r.run_id).await?;
    if let Some(change) = run.state.team_change(TeamChangeKind::Retired, &r.member) {
        return Ok(RetireReply {
            member: r.member,
            status: RecruitStatus::Accepted,
            change: Some(change.clone()),
        });
    }
    check_running(&run)?;
    let by = recruiter(team, &run, r.by_task.as_ref())?;
    if !run
        .plan
        .subtasks
        .iter()
        .any(|t| t.agent.as_deref() == Some(r.member.as_str()))
    {
        let named: BTreeSet<&str> = run
            .plan
            .subtasks
            .iter()
            .filter_map(|t| t.agent.as_deref())
            .collect();
        return Err(refused(
            RecruitRule::NotAMember,
            format!(
                "no task of run {} names agent {}; its tasks name: {}",
                r.run_id,
                r.member,
                if named.is_empty() {
                    "no agent".to_owned()
                } else {
                    named.into_iter().collect::<Vec<_>>().join(", ")
                }
            ),
        ));
    }
    let input = RunInput::Retired(Box::new(Retired {
        member: r.member.clone(),
        policy: r.policy,
        by,
        reason: r.reason.clone(),
    }));
    let msg_id = retired_msg_id(r.run_id, &r.member);
    let member = r.member.clone();
    let (change, _) = append_and_wait(team, r.run_id, input, &msg_id, |s| {
        s.team_change(TeamChangeKind::Retired, &member).cloned()
    })
    .await?;
    info!(run = %r.run_id, member = %r.member, policy = r.policy.as_str(), "Retirement recorded");
    Ok(RetireReply {
        member: r.member,
        status: if change.is_some() {
            RecruitStatus::Accepted
        } else {
            RecruitStatus::Recorded
        },
        change,
    })
}

/// Appends `input` to the run's log under `msg_id`, then waits up to `answer-wait` for the
/// run's record to show it (`applied`). Returns what `applied` found, and the input's
/// run-log sequence.
pub(crate) async fn append_and_wait<T>(
    team: &Team,
    run: RunId,
    input: RunInput,
    msg_id: &str,
    applied: impl Fn(&RunState) -> Option<T>,
) -> Result<(Option<T>, u64), ApiError> {
    let entry = RunLogEntry {
        protocol: PROTOCOL_VERSION,
        run_id: run,
        input,
    };
    let out = wire::encode(&entry, Codec::Json, Some(msg_id))
        .map_err(|e| ApiError::new(500, ErrorCode::Internal, e.to_string()))?;
    let ack = team
        .bus
        .js()
        .publish_with_headers(team.bus.names().runlog(run), out.headers, out.payload)
        .await
        .map_err(|e| unavailable("appending to the run log", e))?
        .await
        .map_err(|e| unavailable("appending to the run log", e))?;
    // Watched after the append, off the recruit's path (the watch sees an earlier
    // application all the same).
    let decided = watch_record(team, run, |state| {
        if let Some(change) = applied(state) {
            return Some(Ok(change));
        }
        // Ended before it got to the input: it never will.
        state.status.is_terminal().then(|| {
            Err(refused(
                RecruitRule::RunNotRunning,
                format!(
                    "run {run} ended ({}) before it applied the change",
                    state.status.as_str()
                ),
            ))
        })
    })
    .await?;
    match decided {
        Some(Ok(change)) => Ok((Some(change), ack.sequence)),
        Some(Err(e)) => Err(e),
        None => Ok((None, ack.sequence)),
    }
}
