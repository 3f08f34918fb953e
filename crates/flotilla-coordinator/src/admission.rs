//! The admission of a submission: one set of checks and one way a run is admitted, whichever
//! way it came in — the intake subject (`<prefix>.submit`, the `submit` endpoint; `intake.rs`)
//! or a client's own first message of its run (`<prefix>.submit.<run>`, decided again by
//! every coordinator that reads it; `runtime/admission.rs`).
//!
//! [`verdict`] is the one decision, in one order: the request's own fields ([`screen`]), its
//! plan (a plan is prepared; a bare query is planned by the intake's [`Queries`] and refused
//! on a run's own subject), its place in its tree (read from its parent, once the rest
//! holds), memory's advice for a query, then the run's escalation policy from the trust
//! levels. It writes nothing. [`enter`] then counts an admitted child in its tree — the one
//! write of admission, done once by whoever records the verdict (not by a coordinator that
//! only reads a start again). So every coordinator that decides a submission reaches the same
//! problems in the same order, and the run admitted carries the same fields from either door.

use std::future::Future;
use std::pin::Pin;

use flotilla_machine::policy::HitlConfig;
use flotilla_model::approval::HitlPolicy;
use flotilla_model::codec::check_protocol;
use flotilla_model::ids::{RunId, SessionId};
use flotilla_model::memory::MemoryUse;
use flotilla_model::plan::Plan;
use flotilla_model::problem::{Problem, ProblemCode};
use flotilla_model::run::RunHandle;
use flotilla_model::runlog::{PlanningSpec, Rejected, Submitted};
use flotilla_model::submit::{SubmitForm, SubmitRequest};
use flotilla_model::task::TraceContext;
use flotilla_model::time::Timestamp;
use flotilla_model::token::check_subject;
use flotilla_model::validate::{
    AgentCatalog, MAX_REPORTED_PROBLEMS, ValidationContext, prepare_plan, truncate_problems,
};

use crate::error::StoreError;
use crate::lineage::{Lineage, Lineages};
use crate::live::LiveWorkers;
use crate::trust::Trust;

/// Which door a submission came through: what its subject already says about it, and how
/// it plans a bare query.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Door<'a> {
    /// The intake subject or the `submit` endpoint: the run id is the submission's own, its
    /// key's, or a new one; `queries` plans a bare query. `forks`: the submission is a fork
    /// built by `run.fork`, whose plan alone may say what it reuses (`fork`).
    Intake {
        queries: &'a dyn Queries,
        forks: bool,
    },
    /// A run's own subject: the subject names the run, so the body may name no other and
    /// carries no idempotency key, nor a bare query (its planning plan is fixed at admission
    /// and stored in the run's first entry, which a client-written first message cannot
    /// carry). `prefix` and `intake` name the subjects in the refusals.
    RunSubject { prefix: &'a str, intake: &'a str },
}

/// What is wrong with `request` for run `run` before its plan is read, in the order a client
/// is told: its `reply_to` (kept only when it is a subject a message can be published to),
/// its protocol, its parent, and — on a run's own subject — a body naming another run or
/// carrying an idempotency key.
pub(crate) fn screen(
    run: RunId,
    request: &SubmitRequest,
    door: Door<'_>,
) -> (Option<String>, Vec<Problem>) {
    let mut errors = Vec::new();
    let reply_to = match &request.reply_to {
        Some(s) => match check_subject(s) {
            Ok(()) => Some(s.clone()),
            Err(e) => {
                errors.push(Problem::new(
                    ProblemCode::InvalidReplyTo,
                    "reply_to",
                    format!("reply_to {s:?} {e}"),
                ));
                None
            }
        },
        None => None,
    };
    if let Err(e) = check_protocol(request.protocol) {
        errors.push(e.to_problem());
    }
    if let Some(parent) = &request.parent {
        errors.extend(flotilla_model::validate::check_parent(parent, run));
    }
    if request.plan.as_ref().is_some_and(|p| p.fork.is_some())
        && !matches!(door, Door::Intake { forks: true, .. })
    {
        errors.push(Problem::new(
            ProblemCode::ForkReserved,
            "plan.fork",
            "a plan's `fork` is written by run.fork only: fork a run with `flotilla runs fork RUN --at TASK` or the run.fork endpoint",
        ));
    }
    if let Door::RunSubject { prefix, intake } = door {
        if let Some(named) = request.run_id.filter(|named| *named != run) {
            errors.push(Problem::new(
                ProblemCode::RunIdMismatch,
                "run_id",
                format!("the submission was published for run {run} but names run {named}"),
            ));
        }
        if request.idempotency_key.is_some() {
            errors.push(Problem::new(
                ProblemCode::MisplacedIdempotencyKey,
                "idempotency_key",
                format!(
                    "a submission on {prefix}.submit.<run> is identified by its run id; publish submissions with an idempotency_key to {intake}"
                ),
            ));
        }
    }
    (reply_to, errors)
}

/// The refusal of `request`: its problems (at most [`MAX_REPORTED_PROBLEMS`], the last
/// counting the rest), its plan's name and labels, and where its submitter waits.
pub(crate) fn rejected(
    request: &SubmitRequest,
    errors: Vec<Problem>,
    reply_to: Option<String>,
    intake_seq: Option<u64>,
) -> Rejected {
    Rejected {
        errors: truncate_problems(errors, MAX_REPORTED_PROBLEMS),
        name: request.plan_name(),
        labels: request.labels.clone(),
        reply_to,
        intake_seq,
    }
}

/// What an admitted run is given besides its request: facts gathered by the caller.
pub(crate) struct Admitted<'a> {
    /// The plan as accepted (defaults applied), and the warnings about it.
    pub(crate) plan: Plan,
    pub(crate) warnings: Vec<Problem>,
    /// From [`screen`].
    pub(crate) reply_to: Option<String>,
    /// Its place in its tree.
    pub(crate) lineage: Lineage,
    pub(crate) trace: TraceContext,
    /// The deployment's agents (roles make anycast tasks; a lead agent leads runs).
    pub(crate) agents: Option<&'a AgentCatalog>,
    /// Its escalation policy (`crate::trust::Trust::policy`).
    pub(crate) hitl: Option<HitlPolicy>,
}

/// The run `request` starts, admitted with `a`. The intake path sets what only it knows
/// afterwards (where a waiting submitter is answered, its intake sequence, a bare query's
/// planning and the memory that advised it).
pub(crate) fn submitted(request: &SubmitRequest, a: Admitted<'_>) -> Submitted {
    Submitted {
        plan: a.plan,
        labels: request.labels.clone(),
        session_id: a.lineage.session_id,
        parent: request.parent.clone(),
        reply_to: a.reply_to,
        wait_reply_to: None,
        intake_seq: None,
        warnings: a.warnings,
        trace: Some(a.trace),
        planning: None,
        depth: a.lineage.depth,
        budget_scopes: a.lineage.budget_scopes,
        anycast: a.agents.is_some_and(AgentCatalog::has_roles),
        memory: None,
        lead: a.agents.and_then(AgentCatalog::lead).map(str::to_owned),
        hitl: a.hitl,
    }
}

/// What admission reads besides the request: the same facts at both doors.
pub(crate) struct Facts<'a> {
    pub(crate) ctx: &'a ValidationContext,
    pub(crate) lineages: &'a Lineages,
    pub(crate) trust: &'a Trust,
    pub(crate) hitl: &'a HitlConfig,
}

/// A bare query's plan at admission, with what it came from.
pub(crate) struct QueryPlan {
    pub(crate) plan: Plan,
    pub(crate) warnings: Vec<Problem>,
    /// Set when the run starts by planning (not when memory's plan is reused).
    pub(crate) planning: Option<PlanningSpec>,
    /// The memory that advised it.
    pub(crate) memory: Option<MemoryUse>,
}

/// How a door plans bare queries.
pub(crate) trait Queries: Sync + std::fmt::Debug {
    /// The plan a query starts with (its planner's task), or why there is none.
    fn planning_plan(&self, query: &str, now_ms: i64) -> Result<Plan, Problem>;
    /// For a query otherwise admitted: memory's advice on `planning` — a past plan reused,
    /// or `planning` with examples.
    fn advise<'a>(
        &'a self,
        run: RunId,
        query: &'a str,
        session: Option<SessionId>,
        planning: Plan,
    ) -> Pin<Box<dyn Future<Output = QueryPlan> + Send + 'a>>;
}

/// The verdict on `request` for run `run` through `door`: the run as admitted (less the
/// fields only the intake knows: where a waiting submitter is answered, its intake
/// sequence), or its refusal with every problem found. Reads the parent of a child run and,
/// for a query, what the intake's [`Queries`] reads; writes nothing. `now_ms` is the submission's time
/// (a query's planner must have a live worker then); `policy_at` is when the trust levels
/// are read for its escalation policy — the intake, which records the start it decides,
/// reads them as it decides; a run's own subject, decided again by every coordinator, at
/// the submission's stored time, so all reach the same policy.
pub(crate) async fn verdict(
    facts: &Facts<'_>,
    run: RunId,
    request: &SubmitRequest,
    door: Door<'_>,
    now_ms: i64,
    policy_at: Timestamp,
    trace: TraceContext,
) -> Result<Result<Submitted, Rejected>, StoreError> {
    let (reply_to, mut errors) = screen(run, request, door);
    let query = match request.form() {
        Ok(SubmitForm::Query(q)) => Some(q),
        _ => None,
    };
    let prepared = match request.form() {
        Err(problem) => Err(vec![problem]),
        Ok(SubmitForm::Plan(plan)) => prepare_plan(plan, facts.ctx).map_err(|r| r.errors),
        Ok(SubmitForm::Query(q)) => match door {
            Door::Intake { queries, .. } => queries
                .planning_plan(q, now_ms)
                .map(|plan| (plan, Vec::new()))
                .map_err(|p| vec![p]),
            Door::RunSubject { prefix, intake } => Err(vec![Problem::new(
                ProblemCode::QueryOnRunSubject,
                "query",
                format!(
                    "a bare query cannot be the first message of {prefix}.submit.<run>; publish it to {intake} or send it to the submit endpoint"
                ),
            )]),
        },
    };
    let (mut plan, mut warnings) = match prepared {
        Ok(p) => p,
        Err(problems) => {
            errors.extend(problems);
            (Plan::empty(), Vec::new())
        }
    };
    // The run's place in its tree (depth, budgets, session): a parent that names no run
    // refuses it, as an invalid plan does. Its own budget is the one it was submitted with.
    let own_budget = request.plan.as_ref().and_then(|p| p.config.budget());
    let lineage = if errors.is_empty() {
        match facts
            .lineages
            .lineage(run, request.parent.as_ref(), request.session_id, own_budget)
            .await?
        {
            Ok(l) => l,
            Err(problem) => {
                errors.push(problem);
                Lineage::default()
            }
        }
    } else {
        Lineage::default()
    };
    if !errors.is_empty() {
        return Ok(Err(rejected(request, errors, reply_to, None)));
    }
    let (mut planning, mut memory) = (None, None);
    if let (Some(query), Door::Intake { queries, .. }) = (query, door) {
        let advised = queries.advise(run, query, lineage.session_id, plan).await;
        plan = advised.plan;
        warnings.extend(advised.warnings);
        (planning, memory) = (advised.planning, advised.memory);
    }
    let hitl = facts.trust.policy(
        facts.hitl,
        &plan,
        facts.ctx.agents.as_ref().and_then(|a| a.default.as_deref()),
        policy_at,
    );
    let mut submitted = submitted(
        request,
        Admitted {
            plan,
            warnings,
            reply_to,
            lineage,
            trace,
            agents: facts.ctx.agents.as_ref(),
            hitl,
        },
    );
    submitted.planning = planning;
    submitted.memory = memory;
    Ok(Ok(submitted))
}

/// Counts admitted run `submitted` in its tree — admission's one write, made once by
/// whoever records the verdict — or turns it into a refusal when its tree is full
/// (`tree_too_large`).
pub(crate) async fn enter(
    lineages: &Lineages,
    request: &SubmitRequest,
    submitted: Submitted,
) -> Result<Result<Submitted, Rejected>, StoreError> {
    let lineage = Lineage {
        tree: submitted.parent.as_ref().map(RunHandle::root_run),
        ..Default::default()
    };
    Ok(match lineages.enter(&lineage).await? {
        Ok(()) => Ok(submitted),
        Err(problem) => Err(rejected(
            request,
            vec![problem],
            submitted.reply_to,
            submitted.intake_seq,
        )),
    })
}

/// What an admitted run is told about the workers live now (not part of the verdict: it
/// changes from moment to moment): a pool no live worker serves (its tasks wait for one)
/// and, in a deployment that defines no agents, a task whose agent no live worker offers.
/// Anycast tasks wait in their role's queue, whatever their pool.
pub(crate) fn live_warnings(
    live: &LiveWorkers,
    ctx: &ValidationContext,
    submitted: &Submitted,
    now_ms: i64,
) -> Vec<Problem> {
    let pooled = || {
        submitted
            .plan
            .subtasks
            .iter()
            .filter(|t| t.anycast_role(submitted.anycast).is_none())
    };
    let pools: std::collections::BTreeSet<&str> = pooled().map(|t| t.pool.as_str()).collect();
    let mut warnings: Vec<Problem> = live
        .pools_without_workers(pools, now_ms)
        .into_iter()
        .flatten()
        .map(|pool| {
            Problem::new(
                ProblemCode::NoLiveWorker,
                "subtasks",
                format!(
                    "no live worker serves pool {pool:?}: its tasks wait until one starts (`flotilla worker --pool {pool}`)"
                ),
            )
        })
        .collect();
    if ctx.agents.is_none() {
        warnings.extend(live.unserved_agents(
            pooled().map(|t| (t.id.as_str(), t.pool.as_str(), t.agent.as_deref())),
            now_ms,
        ));
    }
    warnings
}

#[cfg(test)]
mod tests {
    use flotilla_model::plan::Subtask;

    use super::*;

    fn request() -> SubmitRequest {
        let mut plan = Plan::empty();
        plan.name = Some("weekly".into());
        plan.subtasks = vec![Subtask::new("a", "do it")];
        SubmitRequest::new(plan)
    }

    fn codes(errors: &[Problem]) -> Vec<ProblemCode> {
        errors.iter().map(|p| p.code).collect()
    }

    /// An intake that plans no query (screening never asks it).
    #[derive(Debug)]
    struct Planless;

    impl Queries for Planless {
        fn planning_plan(&self, _query: &str, _now_ms: i64) -> Result<Plan, Problem> {
            Err(Problem::new(ProblemCode::NoPlanner, "query", "no planner"))
        }

        fn advise<'a>(
            &'a self,
            _run: RunId,
            _query: &'a str,
            _session: Option<SessionId>,
            planning: Plan,
        ) -> Pin<Box<dyn Future<Output = QueryPlan> + Send + 'a>> {
            Box::pin(std::future::ready(QueryPlan {
                plan: planning,
                warnings: Vec::new(),
                planning: None,
                memory: None,
            }))
        }
    }

    #[test]
    fn both_doors_screen_alike_and_a_runs_subject_also_checks_what_it_names() {
        let run = RunId::new();
        let mut r = request();
        r.reply_to = Some("not a subject".into());
        r.run_id = Some(RunId::new());
        r.idempotency_key = Some("k".into());
        r.protocol = 999;
        let (reply_to, errors) = screen(
            run,
            &r,
            Door::Intake {
                queries: &Planless,
                forks: false,
            },
        );
        assert_eq!(reply_to, None);
        assert_eq!(
            codes(&errors),
            [
                ProblemCode::InvalidReplyTo,
                ProblemCode::UnsupportedProtocol
            ]
        );
        let door = Door::RunSubject {
            prefix: "flotilla",
            intake: "flotilla.submit",
        };
        let (_, errors) = screen(run, &r, door);
        assert_eq!(
            codes(&errors),
            [
                ProblemCode::InvalidReplyTo,
                ProblemCode::UnsupportedProtocol,
                ProblemCode::RunIdMismatch,
                ProblemCode::MisplacedIdempotencyKey
            ]
        );
        assert!(errors[3].message.contains("flotilla.submit"), "{errors:?}");
        // A clean request: nothing, and its reply subject kept.
        let mut ok = request();
        ok.reply_to = Some("_INBOX.a".into());
        ok.run_id = Some(run);
        let (reply_to, errors) = screen(run, &ok, door);
        assert_eq!((reply_to.as_deref(), errors.len()), (Some("_INBOX.a"), 0));
    }

    #[test]
    fn a_refusal_names_the_plan_and_counts_what_it_leaves_out() {
        let r = request();
        let many: Vec<Problem> = (0..MAX_REPORTED_PROBLEMS + 5)
            .map(|i| Problem::new(ProblemCode::Cycle, format!("subtasks[{i}]"), "cycle"))
            .collect();
        let rejected = rejected(&r, many, Some("_INBOX.b".into()), Some(7));
        assert_eq!(rejected.name.as_deref(), Some("weekly"));
        assert_eq!(rejected.errors.len(), MAX_REPORTED_PROBLEMS);
        assert_eq!(
            rejected.errors.last().map(|p| p.code),
            Some(ProblemCode::TooManyProblems)
        );
        assert_eq!(rejected.intake_seq, Some(7));
    }

    #[test]
    fn an_admitted_run_takes_its_lineage_and_the_deployments_agents() {
        let mut r = request();
        r.labels.insert("team".into(), "ops".into());
        let lineage = Lineage {
            depth: 2,
            ..Lineage::default()
        };
        let s = submitted(
            &r,
            Admitted {
                plan: r.plan.clone().unwrap_or_else(Plan::empty),
                warnings: Vec::new(),
                reply_to: Some("_INBOX.c".into()),
                lineage,
                trace: TraceContext {
                    traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
                    tracestate: None,
                },
                agents: None,
                hitl: None,
            },
        );
        assert_eq!(s.depth, 2);
        assert_eq!(s.labels.get("team").map(String::as_str), Some("ops"));
        assert_eq!(s.reply_to.as_deref(), Some("_INBOX.c"));
        assert!(!s.anycast);
        assert_eq!(s.lead, None);
    }
}
