//! Submitting a plan: the intake message and the request/reply endpoint.
//!
//! A submission carries either a `plan` or a bare `query` (exactly one of them). A query is
//! planned by the deployment's planner agent inside the run (see `docs/protocol.md`, "Bare
//! queries").

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::{RunId, SessionId};
use crate::plan::Plan;
use crate::problem::{Problem, ProblemCode};
use crate::run::{RunHandle, RunOutcome};

/// A plan submission. Publish it to the intake subject `<prefix>.submit` (JetStream, durable)
/// or send it as a request to `<prefix>.api.submit` (synchronous answer).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SubmitRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run id to use. Submitting the same id again yields the same run. Optional: the
    /// coordinator mints a UUIDv7 when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<RunId>,
    /// Any client key that makes resubmission idempotent (like `Nats-Msg-Id`, without its
    /// two-minute window).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// Labels copied onto the run record.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Session the run belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<SessionId>,
    /// Parent link, for child runs: the **parent** run's handle — `run_id` is the parent run,
    /// not this one (elsewhere a `RunHandle` names its own run) — with `parent_task_id` /
    /// `parent_tool_call_id` = the parent's task and call that start this run and
    /// `root_run_id` = the tree's root. The child shares the root's workspace and mailboxes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<RunHandle>,
    /// A subject on which the coordinator publishes exactly one terminal submit reply
    /// (at least once): `rejected`, `duplicate` (with the original run's id and status), or
    /// `finished` with the outcome when the run ends. Must be a valid subject for publishing
    /// (tokens separated by `.`, no wildcards or whitespace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_to: Option<String>,
    /// On the request/reply endpoint: answer when the run ends instead of when it is
    /// accepted. A duplicate waits for the original run's end too. Works together with
    /// `reply_to`: both get the outcome.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub wait: bool,
    /// The plan. Absent when the submission is a bare `query`: then the deployment's planner
    /// agent writes the plan inside the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<Plan>,
    /// A bare query, instead of a plan: the run starts with a planner task whose plan is
    /// validated (and repaired) before it runs in the same run. Exactly one of `plan` and
    /// `query` must be given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query: Option<String>,
}

/// What a submission asks for: a plan to run, or a query to plan first.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SubmitForm<'a> {
    /// A plan written by the client.
    Plan(&'a Plan),
    /// A bare query (trimmed, not empty) for the planner.
    Query(&'a str),
}

impl SubmitRequest {
    /// A submission of `plan` with every option at its default.
    pub fn new(plan: Plan) -> Self {
        Self {
            protocol: crate::PROTOCOL_VERSION,
            run_id: None,
            idempotency_key: None,
            labels: BTreeMap::new(),
            session_id: None,
            parent: None,
            reply_to: None,
            wait: false,
            plan: Some(plan),
            query: None,
        }
    }

    /// A bare query for the deployment's planner, with every option at its default.
    pub fn query(query: impl Into<String>) -> Self {
        Self {
            plan: None,
            query: Some(query.into()),
            ..Self::new(Plan::empty())
        }
    }

    /// Which form the submission has. Both forms at once, neither, or an empty query is a
    /// problem a client can fix, so it is reported as one (and the submission rejected).
    pub fn form(&self) -> Result<SubmitForm<'_>, Problem> {
        match (&self.plan, &self.query) {
            (Some(_), Some(_)) => Err(Problem::new(
                ProblemCode::PlanAndQuery,
                "query",
                "the submission has both a plan and a query: send exactly one of them",
            )),
            (None, None) => Err(Problem::new(
                ProblemCode::MissingPlan,
                "plan",
                "the submission has neither a plan nor a query: send exactly one of them",
            )),
            (Some(plan), None) => Ok(SubmitForm::Plan(plan)),
            (None, Some(q)) if q.trim().is_empty() => Err(Problem::new(
                ProblemCode::EmptyQuery,
                "query",
                "the query is empty: say what the run should answer",
            )),
            (None, Some(q)) => Ok(SubmitForm::Query(q.trim())),
        }
    }

    /// The plan's name, when the submission has a plan with one.
    pub fn plan_name(&self) -> Option<String> {
        self.plan.as_ref().and_then(|p| p.name.clone())
    }
}

/// The coordinator's answer to a submission.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SubmitReply {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run, when one exists (accepted, duplicate, or rejected with a known id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<RunId>,
    /// What happened.
    pub status: SubmitStatus,
    /// Why it was rejected.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<Problem>,
    /// Tolerated problems.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<Problem>,
    /// On `duplicate`: the status of the run the submission duplicates (the first
    /// submission's fate: `running`, `succeeded`, `rejected`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_status: Option<crate::run::RunStatus>,
    /// The outcome, when the submitter asked to wait.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<RunOutcome>,
}

impl SubmitReply {
    /// The terminal answer of a run that ended with `outcome` (status `finished`).
    pub fn finished(outcome: RunOutcome) -> Self {
        Self {
            protocol: crate::PROTOCOL_VERSION,
            run_id: Some(outcome.run_id),
            status: SubmitStatus::Finished,
            errors: Vec::new(),
            warnings: Vec::new(),
            run_status: None,
            outcome: Some(outcome),
        }
    }

    /// The message id a run's terminal `finished` answer carries, whoever sends it — a
    /// coordinator, or the worker whose stored result ended the run: `finished.<run>`.
    pub fn finished_id(run: RunId) -> String {
        format!("finished.{run}")
    }
}

/// Submission result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SubmitStatus {
    /// A new run was created.
    Accepted,
    /// The run already existed (same run id or idempotency key); nothing new was created.
    Duplicate,
    /// The submission is invalid; nothing was dispatched. `errors` says why.
    Rejected,
    /// The run ended (reply to a waiting submitter); see `outcome`.
    Finished,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form_code(json: &str) -> Option<ProblemCode> {
        let r: SubmitRequest = serde_json::from_str(json).expect("parses");
        r.form().err().map(|p| p.code)
    }

    #[test]
    fn exactly_one_of_plan_and_query() {
        let plan = r#""plan":{"subtasks":[{"id":"a"}]}"#;
        assert_eq!(form_code(&format!("{{{plan}}}")), None);
        assert_eq!(form_code(r#"{"query":"why?"}"#), None);
        assert_eq!(
            form_code(&format!(r#"{{{plan},"query":"why?"}}"#)),
            Some(ProblemCode::PlanAndQuery)
        );
        assert_eq!(form_code("{}"), Some(ProblemCode::MissingPlan));
        assert_eq!(
            form_code(r#"{"query":"  "}"#),
            Some(ProblemCode::EmptyQuery)
        );
    }

    #[test]
    fn a_plan_submission_encodes_as_before() {
        let r = SubmitRequest::new(Plan::empty());
        let v = serde_json::to_value(&r).expect("encodes");
        assert!(v.get("plan").is_some());
        assert!(v.get("query").is_none());
        // Settings added later stay out of the encoding while they are the defaults, so
        // older coordinators read the plan as before.
        assert_eq!(
            v["plan"]["config"]
                .as_object()
                .map(|c| c.contains_key("lead_timeout")),
            Some(false),
            "{v}"
        );
    }
}
