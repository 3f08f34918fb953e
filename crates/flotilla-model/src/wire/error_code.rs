//! The codes of the API's error answers ([`crate::api::ApiError`]): one [`ErrorCode`] per
//! stable code a coordinator or supervisor sends, or an agent's context reports.
//!
//! On the wire a code stays a string (`ApiError.code`), so a peer of another build may send a
//! code this build does not know: [`crate::api::ApiError::error_code`] reads it as `None`, never
//! as another code. Servers build errors from the enum (`ApiError::new(404,
//! ErrorCode::NotFound, …)`), clients match on it. `docs/protocol.md` ("API error codes")
//! lists every code with its statuses; a test keeps the list and the enum equal.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Declares [`ErrorCode`]: each variant with its wire code and its usual status.
macro_rules! error_codes {
    ($($(#[doc = $doc:literal])* $variant:ident = $code:literal, $status:literal;)*) => {
        /// A stable code of an API error answer ([`crate::api::ApiError`]`.code`), with the
        /// HTTP-like status it is usually sent with ([`ErrorCode::status`]).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum ErrorCode {
            $($(#[doc = $doc])* $variant,)*
        }

        impl ErrorCode {
            /// Every code, in declaration order.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant,)*];

            /// The code as it appears on the wire (`not_found`, …).
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $code,)*
                }
            }

            /// The HTTP-like status the code is usually sent with. A few codes are sent with
            /// another status by some endpoint (`unknown_task` is `400` on the collaboration
            /// endpoints, `recruit_refused` is `400` for `invalid_subtask`): the answer's own
            /// `status` is what was sent.
            pub const fn status(self) -> u16 {
                match self {
                    $(Self::$variant => $status,)*
                }
            }

            /// The code a wire string names, or `None` for a code this build does not know
            /// (a newer or an older peer's).
            pub fn from_wire(code: &str) -> Option<Self> {
                match code {
                    $($code => Some(Self::$variant),)*
                    _ => None,
                }
            }
        }
    };
}

error_codes! {
    // Any endpoint.
    /// `400`: the request body does not decode — bad JSON or MessagePack, a missing or
    /// unknown field, a wrong type — at any endpoint (`submit` and `plan.validate` answer a
    /// plan with wrong fields with its problems instead); also a `mbox.negotiate`
    /// `correlation_id` that is empty, too long or holds control characters, and stored data
    /// an agent's context could not read.
    Malformed = "malformed", 400;
    /// `400`: the request's `protocol` is 0 or newer than this build speaks, at any endpoint.
    UnsupportedProtocol = "unsupported_protocol", 400;
    /// `413`: the answer would not fit one NATS message (the message says what to ask for
    /// instead: a smaller page, fewer runs); `run.fork` of a run whose kept tasks left more
    /// workspace entries or mailbox posts than a fork copies.
    TooLarge = "too_large", 413;
    /// `500`: the service failed on its own: a stored record it cannot read, an answer it
    /// cannot encode.
    Internal = "internal", 500;
    /// `503`: NATS or JetStream did not answer (or a record is not written yet); ask again.
    Unavailable = "unavailable", 503;
    /// `504`: a `submit` with `wait` that duplicates a run still going waited 24 hours for
    /// that run's end.
    Timeout = "timeout", 504;
    /// `404`: the thing asked about does not exist: a run (`run.get`, `run.cancel`,
    /// `run.tree`, `watch`, the controls, `approval.ask`), an approval, a tool grant, an unset
    /// state key, a team member, teammate, agent or role, a trust record, a remembered run.
    NotFound = "not_found", 404;
    /// `409`: a compare-and-set lost (`state.set` with `expected_revision`): the answer's
    /// `current_revision` says where the key is.
    Conflict = "conflict", 409;
    /// `400`: a field is out of bounds (a text over its cap, an empty `by`, a value that is
    /// not a token), on the controls, `approval.ask`, `trust.*`, `team.recruit`,
    /// `team.retire`, `team.assign` and `team.finish`; `problems` or the message names each
    /// field.
    InvalidRequest = "invalid_request", 400;
    /// `400`: a `limit` (or `tasks_limit`) outside its range, or a `mbox.read` `wait_ms` over
    /// 30,000.
    InvalidLimit = "invalid_limit", 400;
    /// `400`: `memory.list`'s `limit` outside 1 to 1,000.
    Invalid = "invalid", 400;

    // Runs: reading, watching, controls.
    /// `400`: `run.tree`'s `max_runs` outside 1 to 1,000.
    InvalidMaxRuns = "invalid_max_runs", 400;
    /// `400`: `watch`'s `deliver_subject` is not a subject a message can be published to.
    InvalidDeliverSubject = "invalid_deliver_subject", 400;
    /// `400`: `watch`'s `lease_ms` outside 1,000 to 600,000.
    InvalidLease = "invalid_lease", 400;
    /// `400`: `run.pause` or `run.takeover` with a `timeout_ms` out of range.
    InvalidTimeout = "invalid_timeout", 400;
    /// `409`: a task control or `run.complete` on a run whose plan or start is not recorded
    /// yet (a query being planned).
    NotStarted = "not_started", 409;
    /// `404`: a task control or `run.complete` names a task the run does not have.
    TaskNotFound = "task_not_found", 404;
    /// `409`: a lead's resume of a task a person paused.
    PausedByPerson = "paused_by_person", 409;
    /// `409`: `run.complete` or `approval.ask` on a run that has ended.
    RunEnded = "run_ended", 409;
    /// `409`: `run.complete` of a task that runs on a worker or has ended.
    TaskNotPending = "task_not_pending", 409;
    /// `409`: `run.edit` of a run that is not taken over (`human_control`).
    NotTakenOver = "not_taken_over", 409;
    /// `400`: `run.edit`'s plan does not validate (every problem in `problems`).
    InvalidPlan = "invalid_plan", 400;
    /// `400`: `run.edit` changes what it may not (every rule it breaks in `problems`).
    InvalidEdit = "invalid_edit", 400;

    // Approvals.
    /// `403`: `approval.ask` from a person (a request that crossed a shared import).
    Forbidden = "forbidden", 403;
    /// `404`: `approval.ask` or `team.assign` names a task the run does not have; `400` on
    /// the collaboration endpoints (`ws.append`'s `task_id`, `child.start`'s parent task).
    UnknownTask = "unknown_task", 404;
    /// `409`: `approval.ask` by an attempt whose number is current but whose `attempt_id` is
    /// another's.
    NotTheAttempt = "not_the_attempt", 409;
    /// `409`: `approval.ask` by an attempt that is not the task's current one, or of a task
    /// that has ended.
    NotRunning = "not_running", 409;
    /// `400`: an `approval.answer` that is not valid (empty `by`, a bad approval id, text
    /// over its cap, `always` with a decision other than approve), or an `approval.revoke`
    /// without `by`.
    InvalidAnswer = "invalid_answer", 400;
    /// `409`: `approval.answer`'s `digest` is not the digest of the arguments asked about.
    DigestMismatch = "digest_mismatch", 409;
    /// `400`: `approval.answer` with `always` for an approval that is not a tool call a
    /// session grant covers.
    AlwaysNotApplicable = "always_not_applicable", 400;
    /// `400`: `approval.answer` with `edit` for an external agent's question.
    DecisionNotApplicable = "decision_not_applicable", 400;
    /// `400`: `approval.answer` with `incident` for an external agent's question.
    IncidentNotApplicable = "incident_not_applicable", 400;
    /// `400`: `approval.revoke` of a `tool` that is not a tool name.
    InvalidTool = "invalid_tool", 400;

    // Collaboration: workspace, mailboxes, session state, artifacts, child runs.
    /// `404`: a collaboration endpoint (`ws.*`, `mbox.*`, `state.*`, `child.start`,
    /// `approval.grants`, `approval.revoke`) names a run that does not exist.
    UnknownRun = "unknown_run", 404;
    /// `400`: a workspace topic, normalised, is not a subject token.
    InvalidTopic = "invalid_topic", 400;
    /// `400`: strict data flow: the writing task does not declare the topic in `produces`.
    UndeclaredTopic = "undeclared_topic", 400;
    /// `400`: a write's writer is not valid: `task_id` with `by`, `attempt` without a task
    /// or `attempt: 0`, a `by` that is not a name or is `coordinator`.
    InvalidWriter = "invalid_writer", 400;
    /// `400`: a mailbox address (`from`, `to`, `reader`, a negotiation candidate or role) or
    /// a teammate's protocol address is not valid; a negotiation without candidates or
    /// with its initiator among them.
    InvalidAddress = "invalid_address", 400;
    /// `400`: a session-state key is not valid (empty, over 128 bytes, a character outside
    /// letters, digits, `_`, `-`, or a leading `_`).
    InvalidKey = "invalid_key", 400;
    /// `400`: a request or an agent's context lacks the scope it needs: `state.*` without
    /// `run_id` or `session_id`, or with a run of another session; a child run naming
    /// another session; a context without a task to act as.
    InvalidScope = "invalid_scope", 400;
    /// `400`: a name is not valid: an artifact's (an agent's context), a teammate's
    /// (`team.spawn`: not a name, a leading `_`, over 64 bytes).
    InvalidName = "invalid_name", 400;
    /// `400`: `mbox.negotiate`'s `deadline_ms` outside 1 to 30,000.
    InvalidDeadline = "invalid_deadline", 400;
    /// `400`: `child.start`'s parent link is not valid (missing, naming the run itself,
    /// another root, an idempotency key instead of a run id).
    InvalidParent = "invalid_parent", 400;
    /// `404`: `mbox.role`, `mbox.negotiate` or `team.find`: no task of the run tree (no
    /// member of the team) plays the role; the message lists those that are played.
    UnknownRole = "unknown_role", 404;
    /// `413`: a workspace entry over the cap.
    EntryTooLarge = "entry_too_large", 413;
    /// `413`: a mailbox post over the cap.
    PayloadTooLarge = "payload_too_large", 413;
    /// `413`: a session-state value over 256 KiB.
    ValueTooLarge = "value_too_large", 413;
    /// `413`: `child.start`'s submission is larger than the deployment's max payload.
    PlanTooLarge = "plan_too_large", 413;
    /// `422`: a child run an agent started was rejected and never ran (its problems say
    /// why). An agent's context reports it; no endpoint answers it.
    ChildRejected = "child_rejected", 422;
    /// `429`: a root run refused by its installation's quota (a tenant's concurrent runs,
    /// runs per hour, tokens per day or cost per month). The submission's rejection carries
    /// it as a problem of the same code whose `quota` says which quota, its limit, what is
    /// used and when it resets; the code is one for problems and errors alike.
    QuotaExceeded = "quota_exceeded", 429;

    // The team (the supervisor).
    /// `400`: `team.*`'s `team` is not a name.
    InvalidTeam = "invalid_team", 400;
    /// `400`: `team.send` or `team.broadcast` from a sender that is not a name.
    InvalidSender = "invalid_sender", 400;
    /// `400`: `team.spawn`'s `role` is not a name.
    InvalidRole = "invalid_role", 400;
    /// `400`: `team.spawn`'s `pool` is not a name.
    InvalidPool = "invalid_pool", 400;
    /// `404`: `team.spawn` names no agent definition, or no agent fills its role.
    UnknownAgent = "unknown_agent", 404;
    /// `409`: `team.spawn` of a name the team already has.
    DuplicateName = "duplicate_name", 409;
    /// `409`: `team.spawn` into a team at its size cap (`team-size`).
    TeamFull = "team_full", 409;
    /// `409`: `team.spawn` with `expose` whose protocol address is an exposed agent
    /// definition's or another exposed teammate's.
    AddressTaken = "address_taken", 409;
    /// `413`: `team.spawn`'s `instructions` over 16 KiB.
    InstructionsTooLarge = "instructions_too_large", 413;
    /// `413`: a message to a teammate over `max-message-bytes`.
    MessageTooLarge = "message_too_large", 413;
    /// `409`: a message to a teammate that is shut down or shutting down.
    ShutDown = "shut_down", 409;
    /// `429`: a message to a teammate that ran `turns-per-hour` turns in the last hour.
    TurnsPerHour = "turns_per_hour", 429;
    /// `404`: `team.broadcast` to a team with no teammate that takes messages.
    NoTeammates = "no_teammates", 404;
    /// `409`: `team.assign` or `team.finish` on a run that is not led (its strategy is not
    /// `supervisor`).
    NotLed = "not_led", 409;
    /// `409`: `team.assign` or `team.finish` on a led run that has ended.
    RunNotRunning = "run_not_running", 409;
    /// `409`: `team.assign` of a task that has ended without running.
    TaskEnded = "task_ended", 409;
    /// `413`: `team.finish`'s `result` over its cap.
    ResultTooLarge = "result_too_large", 413;
    /// `403`: `team.recruit` or `team.retire` refused by the policy: `rule` names the rule;
    /// `400` for `invalid_subtask`, with `problems`.
    RecruitRefused = "recruit_refused", 403;
    /// `409`: `run.fork` of a run that has not ended (a fork point inside a running run).
    RunNotEnded = "run_not_ended", 409;
    /// `409`: `run.fork` of a run whose plan, or a result the fork would keep, can no longer
    /// be read from its log (the message names the task and the entry).
    ResultMissing = "result_missing", 409;
    /// `409`: `run.fork` at a step (`step`) of a fork point whose step journal lacks a step
    /// the fork would keep (the message names it and the steps it holds).
    JournalIncomplete = "journal_incomplete", 409;
    /// `409`: `run.fork` with a change a live worker of the fork point's pool cannot carry
    /// out (`model`, `step`): it runs an older version (the message names the workers and
    /// what they lack). Upgrade the pool's workers first.
    WorkersOutdated = "workers_outdated", 409;
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<ErrorCode> for String {
    fn from(code: ErrorCode) -> Self {
        code.as_str().to_owned()
    }
}

/// A code this build does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown error code {0:?}")]
pub struct UnknownErrorCode(pub String);

impl FromStr for ErrorCode {
    type Err = UnknownErrorCode;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::from_wire(s).ok_or_else(|| UnknownErrorCode(s.to_owned()))
    }
}

impl Serialize for ErrorCode {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let code = String::deserialize(deserializer)?;
        Self::from_wire(&code).ok_or_else(|| serde::de::Error::custom(UnknownErrorCode(code)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `NotFound` → `not_found`.
    fn snake_case(variant: &str) -> String {
        let mut out = String::new();
        for (i, c) in variant.chars().enumerate() {
            if c.is_ascii_uppercase() {
                if i > 0 {
                    out.push('_');
                }
                out.push(c.to_ascii_lowercase());
            } else {
                out.push(c);
            }
        }
        out
    }

    #[test]
    fn codes_are_the_variants_in_snake_case_and_distinct() {
        let mut seen = std::collections::BTreeSet::new();
        for &code in ErrorCode::ALL {
            assert_eq!(code.as_str(), snake_case(&format!("{code:?}")));
            assert!(seen.insert(code.as_str()), "{code} twice");
            assert_eq!(ErrorCode::from_wire(code.as_str()), Some(code));
            assert_eq!(code.as_str().parse::<ErrorCode>(), Ok(code));
            assert_eq!(String::from(code), code.to_string());
        }
    }

    #[test]
    fn statuses_are_error_statuses() {
        for &code in ErrorCode::ALL {
            assert!((400..600).contains(&code.status()), "{code}");
        }
        assert_eq!(ErrorCode::NotFound.status(), 404);
        assert_eq!(ErrorCode::Conflict.status(), 409);
        assert_eq!(ErrorCode::Unavailable.status(), 503);
    }

    #[test]
    fn serde_writes_the_wire_string() {
        for &code in ErrorCode::ALL {
            let json = serde_json::to_value(code).expect("encodes");
            assert_eq!(json, serde_json::Value::from(code.as_str()));
            let back: ErrorCode = serde_json::from_value(json).expect("decodes");
            assert_eq!(back, code);
        }
    }

    #[test]
    fn unknown_codes_are_none_never_another_code() {
        for unknown in [
            "",
            "Not_Found",
            "not_found ",
            "notfound",
            "some_future_code",
        ] {
            assert_eq!(ErrorCode::from_wire(unknown), None, "{unknown:?}");
            assert_eq!(
                unknown.parse::<ErrorCode>(),
                Err(UnknownErrorCode(unknown.to_owned()))
            );
            assert!(serde_json::from_value::<ErrorCode>(unknown.into()).is_err());
        }
    }
}
