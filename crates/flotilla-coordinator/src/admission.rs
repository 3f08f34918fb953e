//! The admission of a submission: one set of checks and one way a run is admitted, whichever
//! way it came in — the intake subject (`<prefix>.submit`, the `submit` endpoint; `intake.rs`)
//! or a client's own first message of its run (`<prefix>.submit.<run>`, decided again by
//! every coordinator that reads it; `runtime/admission.rs`).
//!
//! Pure: the callers gather the facts that take I/O (the run's lineage from its parent, a bare
//! query's planning plan, the trust levels) and make what is decided here durable. So every
//! coordinator that screens a submission reaches the same problems in the same order, and the
//! run admitted carries the same fields from either door.

use flotilla_model::approval::HitlPolicy;
use flotilla_model::codec::check_protocol;
use flotilla_model::ids::RunId;
use flotilla_model::plan::Plan;
use flotilla_model::problem::{Problem, ProblemCode};
use flotilla_model::runlog::{Rejected, Submitted};
use flotilla_model::submit::SubmitRequest;
use flotilla_model::task::TraceContext;
use flotilla_model::token::check_subject;
use flotilla_model::validate::{AgentCatalog, MAX_REPORTED_PROBLEMS, truncate_problems};

use crate::lineage::Lineage;

/// Which door a submission came through: what its subject already says about it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Door<'a> {
    /// The intake subject or the `submit` endpoint: the run id is the submission's own, its
    /// key's, or a new one.
    Intake,
    /// A run's own subject: the subject names the run, so the body may name no other and
    /// carries no idempotency key. `prefix` and `intake` name the subjects in the refusal.
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

    #[test]
    fn both_doors_screen_alike_and_a_runs_subject_also_checks_what_it_names() {
        let run = RunId::new();
        let mut r = request();
        r.reply_to = Some("not a subject".into());
        r.run_id = Some(RunId::new());
        r.idempotency_key = Some("k".into());
        r.protocol = 999;
        let (reply_to, errors) = screen(run, &r, Door::Intake);
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
