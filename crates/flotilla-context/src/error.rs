//! One error type for every capability of the context, with stable codes.
//!
//! Agents, the CLI (`flotilla ws …` prints `error [code]: …`) and the coordinator's API
//! endpoints (which turn a code into an `ApiError`) all see the same codes, so a client in any
//! language can branch on them. Messages name the problem: the value, the size and the cap,
//! the declared topics.

use std::error::Error as StdError;
use std::fmt;

use flotilla_bus::Retry;
use flotilla_model::ErrorCode;
use flotilla_model::run::RunHandle;
use flotilla_model::validate::Problem;

type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// What went wrong, for matching. [`ErrorKind::code`] is the stable wire form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// A workspace topic is not a valid subject token after normalisation.
    InvalidTopic,
    /// Strict data flow: the task does not declare the topic in `produces`.
    UndeclaredTopic,
    /// A workspace entry is larger than the cap.
    EntryTooLarge,
    /// A mailbox address is not a task id (or `*` for a broadcast).
    InvalidAddress,
    /// A mailbox payload is larger than the cap.
    PayloadTooLarge,
    /// A session-state key is not valid.
    InvalidKey,
    /// A session-state value is larger than the cap.
    ValueTooLarge,
    /// A compare-and-set lost: the key is at another revision.
    Conflict,
    /// The key, artifact or run does not exist.
    NotFound,
    /// Stored data or input could not be read (bad JSON, a checksum mismatch).
    Malformed,
    /// NATS or JetStream did not answer (not provisioned, connection lost, timeout).
    Unavailable,
    /// The scope lacks what the operation needs (no task to read a mailbox as, bad
    /// `FLOTILLA_*` variables).
    InvalidScope,
    /// An artifact name is not valid.
    InvalidName,
    /// A child run was rejected: its submission had problems (an unknown agent, or the
    /// tree's limits: `tree_too_deep`, `tree_too_large`), so it never ran.
    /// [`ContextError::problems`] lists them. Asking again is refused alike.
    ChildRejected,
    /// A negotiation candidate `role:<name>` names a role no task of the run tree plays.
    UnknownRole,
    /// The tenant's `workspace_bytes` or `mailbox_bytes` quota is used: the stream refuses
    /// new entries until older ones age out or runs are purged. The message names the
    /// quota, its limit and the use.
    QuotaExceeded,
}

impl ErrorKind {
    /// The stable code, as the API's error answers carry it ([`ErrorCode`]).
    pub fn error_code(self) -> ErrorCode {
        match self {
            Self::InvalidTopic => ErrorCode::InvalidTopic,
            Self::UndeclaredTopic => ErrorCode::UndeclaredTopic,
            Self::EntryTooLarge => ErrorCode::EntryTooLarge,
            Self::InvalidAddress => ErrorCode::InvalidAddress,
            Self::PayloadTooLarge => ErrorCode::PayloadTooLarge,
            Self::InvalidKey => ErrorCode::InvalidKey,
            Self::ValueTooLarge => ErrorCode::ValueTooLarge,
            Self::Conflict => ErrorCode::Conflict,
            Self::NotFound => ErrorCode::NotFound,
            Self::Malformed => ErrorCode::Malformed,
            Self::Unavailable => ErrorCode::Unavailable,
            Self::InvalidScope => ErrorCode::InvalidScope,
            Self::InvalidName => ErrorCode::InvalidName,
            Self::ChildRejected => ErrorCode::ChildRejected,
            Self::UnknownRole => ErrorCode::UnknownRole,
            Self::QuotaExceeded => ErrorCode::QuotaExceeded,
        }
    }

    /// The stable code (`invalid_topic`, …).
    pub fn code(self) -> &'static str {
        self.error_code().as_str()
    }

    /// An HTTP-like status for API answers, the code's: 400 bad input, 404 not found,
    /// 409 conflict, 413 too large, 422 a rejected child run, 503 unavailable.
    pub fn status(self) -> u16 {
        self.error_code().status()
    }

    /// Whether the same call may succeed later: only `unavailable` (and a `conflict`, after
    /// re-reading the current revision) can.
    pub fn retry(self) -> Retry {
        match self {
            Self::Unavailable | Self::Conflict => Retry::Retryable,
            _ => Retry::Terminal,
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

/// An operation of the context failed.
pub struct ContextError {
    kind: ErrorKind,
    message: String,
    current_revision: Option<u64>,
    /// For `child_rejected`: the child and why it was rejected.
    rejected: Option<Box<Rejected>>,
    source: Option<BoxError>,
}

/// A rejected child run and its problems.
#[derive(Debug)]
struct Rejected {
    child: RunHandle,
    problems: Vec<Problem>,
}

impl ContextError {
    /// An error of `kind` with a message naming the problem.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            current_revision: None,
            rejected: None,
            source: None,
        }
    }

    /// `child_rejected`: child run `child` was rejected with `problems` and never ran. The
    /// message names the child and every problem's code.
    pub fn child_rejected(child: RunHandle, problems: Vec<Problem>) -> Self {
        let listed = if problems.is_empty() {
            "no problems given".to_owned()
        } else {
            problems
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        };
        Self {
            rejected: Some(Box::new(Rejected {
                child: child.clone(),
                problems,
            })),
            ..Self::new(
                ErrorKind::ChildRejected,
                format!("child run {} was rejected: {listed}", child.run_id),
            )
        }
    }

    /// An error caused by `source`.
    pub fn with_source(
        kind: ErrorKind,
        message: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        Self {
            source: Some(source.into()),
            ..Self::new(kind, message)
        }
    }

    /// A lost compare-and-set: `current` is the key's revision now (0: it does not exist).
    pub fn conflict(message: impl Into<String>, current: u64) -> Self {
        Self {
            current_revision: Some(current),
            ..Self::new(ErrorKind::Conflict, message)
        }
    }

    /// What went wrong.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The stable code (`invalid_topic`, …).
    pub fn code(&self) -> &'static str {
        self.kind.code()
    }

    /// The human-readable message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// For a `conflict`: the key's current revision (0: it does not exist).
    pub fn current_revision(&self) -> Option<u64> {
        self.current_revision
    }

    /// For `child_rejected`: why the child was rejected (each problem with its stable code).
    pub fn problems(&self) -> &[Problem] {
        self.rejected.as_ref().map_or(&[], |r| &r.problems)
    }

    /// For `child_rejected`: the rejected child run.
    pub fn rejected_child(&self) -> Option<&RunHandle> {
        self.rejected.as_ref().map(|r| &r.child)
    }
}

impl fmt::Display for ContextError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.code(), self.message)?;
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for ContextError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ContextError")
            .field("kind", &self.kind)
            .field("message", &self.message)
            .field("current_revision", &self.current_revision)
            .field("rejected", &self.rejected)
            .field("source", &self.source)
            .finish()
    }
}

impl StdError for ContextError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}

/// NATS trouble while doing `what`: `unavailable`.
pub(crate) fn unavailable(
    what: impl Into<String>,
    e: impl StdError + Send + Sync + 'static,
) -> ContextError {
    ContextError::with_source(ErrorKind::Unavailable, what, e)
}

/// A write refused because its stream holds its `max_bytes` (`StreamFull`): the
/// installation's byte quota of that stream (`workspace_bytes`, `mailbox_bytes`), with its
/// limit and use ([`flotilla_tenants::space::refusal`]).
pub(crate) async fn stream_full(
    bus: &flotilla_bus::Bus,
    kind: flotilla_model::subjects::StreamKind,
    e: flotilla_bus::PublishError,
) -> ContextError {
    ContextError::with_source(
        ErrorKind::QuotaExceeded,
        flotilla_tenants::space::refusal(bus, kind).await,
        e,
    )
}

impl From<flotilla_bus::ReadError> for ContextError {
    fn from(e: flotilla_bus::ReadError) -> Self {
        let what = e.detail().to_owned();
        ContextError::with_source(ErrorKind::Unavailable, what, e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_stable_and_shown() {
        let e = ContextError::new(ErrorKind::UndeclaredTopic, "topic x is not declared");
        assert_eq!(e.code(), "undeclared_topic");
        assert_eq!(e.to_string(), "undeclared_topic: topic x is not declared");
        let c = ContextError::conflict("lost", 7);
        assert_eq!(c.current_revision(), Some(7));
        assert_eq!(c.kind().status(), 409);
        assert_eq!(ErrorKind::EntryTooLarge.status(), 413);
    }

    #[test]
    fn every_kind_keeps_its_code_and_status() {
        use ErrorKind::*;
        for (kind, code, status) in [
            (InvalidTopic, "invalid_topic", 400),
            (UndeclaredTopic, "undeclared_topic", 400),
            (EntryTooLarge, "entry_too_large", 413),
            (InvalidAddress, "invalid_address", 400),
            (PayloadTooLarge, "payload_too_large", 413),
            (InvalidKey, "invalid_key", 400),
            (ValueTooLarge, "value_too_large", 413),
            (Conflict, "conflict", 409),
            (NotFound, "not_found", 404),
            (Malformed, "malformed", 400),
            (Unavailable, "unavailable", 503),
            (InvalidScope, "invalid_scope", 400),
            (InvalidName, "invalid_name", 400),
            (ChildRejected, "child_rejected", 422),
            (UnknownRole, "unknown_role", 404),
            (QuotaExceeded, "quota_exceeded", 429),
        ] {
            assert_eq!((kind.code(), kind.status()), (code, status), "{kind:?}");
            assert_eq!(kind.error_code().as_str(), code);
        }
    }
}
