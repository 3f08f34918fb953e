//! Errors in the async-nats style: one generic [`Error`] carrying a `kind` that callers match
//! on, plus the underlying cause. Each operation has its own kind enum, and each kind says
//! whether retrying can help.
//!
//! Like async-nats' errors, an [`Error`]'s `Display` includes its cause (so a log line with
//! `%e` is complete) and [`source`](std::error::Error::source) returns it too (so callers can
//! downcast). Printing the whole chain — anyhow's `{:#}` — would therefore say every cause
//! several times; [`report`] prints each once, and [`diagnose`] names the few root causes a
//! person can fix, with what to do.

use std::error::Error as StdError;
use std::fmt;

type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// An error of some operation, classified by `K`.
pub struct Error<K> {
    kind: K,
    detail: String,
    source: Option<BoxError>,
}

impl<K: Copy> Error<K> {
    /// A new error with a human-readable detail.
    pub fn new(kind: K, detail: impl Into<String>) -> Self {
        Self {
            kind,
            detail: detail.into(),
            source: None,
        }
    }

    /// A new error caused by `source`.
    pub fn with_source(kind: K, detail: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Self {
            kind,
            detail: detail.into(),
            source: Some(source.into()),
        }
    }

    /// What went wrong, for matching.
    pub fn kind(&self) -> K {
        self.kind
    }

    /// The human-readable detail.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The same failure, classified again once more is known (a missing stream confirmed,
    /// say); the cause is kept, so the message names it once.
    pub fn reclassified(self, kind: K, detail: impl Into<String>) -> Self {
        Self {
            kind,
            detail: detail.into(),
            source: self.source,
        }
    }
}

impl<K: fmt::Display> fmt::Display for Error<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.detail)?;
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl<K: fmt::Debug> fmt::Debug for Error<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Error")
            .field("kind", &self.kind)
            .field("detail", &self.detail)
            .field("source", &self.source)
            .finish()
    }
}

impl<K: fmt::Debug + fmt::Display> StdError for Error<K> {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}

/// Whether an operation may succeed if tried again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// A transient condition (timeout, server restarting).
    Retryable,
    /// Trying again will fail the same way.
    Terminal,
}

/// Declares an error-kind enum with a `Display` text and a [`Retry`] class per kind, for
/// use with [`Error`].
#[macro_export]
macro_rules! error_kinds {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $text:literal, $retry:ident;)* }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vmeta])* $variant,)*
        }

        impl $name {
            /// Whether retrying may help.
            pub fn retry(self) -> $crate::error::Retry {
                match self {
                    $(Self::$variant => $crate::error::Retry::$retry,)*
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(match self {
                    $(Self::$variant => $text,)*
                })
            }
        }
    };
}

error_kinds!(
    /// Why connecting to NATS failed.
    ConnectErrorKind {
        /// The options are invalid (bad URL, half a TLS key pair, bad prefix).
        InvalidOptions => "invalid NATS options", Terminal;
        /// The credentials file could not be read.
        Credentials => "cannot read NATS credentials", Terminal;
        /// The server rejected the credentials.
        Authentication => "NATS authentication failed", Terminal;
        /// TLS setup failed.
        Tls => "NATS TLS setup failed", Terminal;
        /// No server could be reached.
        Unreachable => "NATS server unreachable", Retryable;
    }
);

error_kinds!(
    /// Why provisioning streams and buckets failed.
    ProvisionErrorKind {
        /// Existing resources differ in ways that cannot be changed without losing data.
        Incompatible => "incompatible JetStream resources", Terminal;
        /// JetStream is not enabled for this account.
        JetStreamUnavailable => "JetStream unavailable", Retryable;
        /// The server refused a request.
        Server => "JetStream request failed", Retryable;
        /// The NATS user's permissions do not allow it (the server reported a permissions
        /// violation): the message names the subject, the user and, for a shared consumer,
        /// the lines its permissions need.
        PermissionDenied => "permission_denied", Terminal;
    }
);

error_kinds!(
    /// Why a publish failed.
    PublishErrorKind {
        /// The message could not be encoded.
        Encode => "cannot encode message", Terminal;
        /// The message is larger than the server's max payload or the stream's message
        /// limit: sending it again fails the same way.
        TooLarge => "message too large", Terminal;
        /// JetStream confirmed that no stream captures the subject: the streams are not
        /// provisioned.
        NoStream => "no stream for the subject", Terminal;
        /// No stream took the message, and nothing says none exists: in a cluster, the
        /// subject's stream has no leader for a few seconds after a node dies (a leader
        /// election), and JetStream answers "no responders" or "temporarily unavailable".
        /// Nothing was stored, so sending again is safe and rides the election out.
        Unavailable => "stream unavailable", Retryable;
        /// The stream holds its `max_bytes` and refuses new messages (discard new: a
        /// tenant's `workspace_bytes` or `mailbox_bytes` quota): sending again fails alike
        /// until entries age out or are purged.
        StreamFull => "the stream is full", Terminal;
        /// The subject already has messages and the publish expected none (a run's first
        /// run-log entry decides its fate, once).
        NotFirst => "the subject already has a first message", Terminal;
        /// The NATS user may not publish to the subject (the server reported a permissions
        /// violation; the message names the subject and the user).
        PermissionDenied => "permission_denied", Terminal;
        /// The message could not be sent or no stream acknowledged it (connection lost,
        /// timeout, server restarting).
        Publish => "publish failed", Retryable;
    }
);

error_kinds!(
    /// Why reading stored messages (direct gets) failed.
    ReadErrorKind {
        /// The stream does not exist or does not answer direct gets (not provisioned).
        NoStream => "stream unavailable for reads", Terminal;
        /// The server refused the request (an invalid filter subject).
        BadRequest => "read request refused", Terminal;
        /// The server did not answer in time.
        TimedOut => "read timed out", Retryable;
        /// The request could not be sent or the connection dropped.
        Request => "read failed", Retryable;
        /// A reply lacked the headers every stored message has.
        Malformed => "malformed read reply", Retryable;
    }
);

error_kinds!(
    /// Why a local nats-server could not be run.
    ServerErrorKind {
        /// No `nats-server` executable was found.
        BinaryNotFound => "nats-server not found", Terminal;
        /// The process could not be started.
        Spawn => "cannot start nats-server", Terminal;
        /// It started but did not become ready.
        NotReady => "nats-server did not become ready", Retryable;
    }
);

/// Connecting failed.
pub type ConnectError = Error<ConnectErrorKind>;
/// Provisioning failed.
pub type ProvisionError = Error<ProvisionErrorKind>;
/// Publishing failed.
pub type PublishError = Error<PublishErrorKind>;
/// Reading stored messages failed.
pub type ReadError = Error<ReadErrorKind>;
/// Running a local server failed.
pub type ServerError = Error<ServerErrorKind>;

/// An error and its causes for a person: each cause said once. Error types that include their
/// source in their own message (async-nats', [`Error`]) would otherwise repeat it at every
/// level of the chain (`no responders: no responders: no responders`). A cause whose text is
/// already part of what was said is skipped.
pub fn report(error: &(dyn StdError + 'static)) -> String {
    let mut out = String::new();
    let mut next = Some(error);
    while let Some(e) = next {
        let text = e.to_string();
        if !text.is_empty() && !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
        next = e.source();
    }
    out
}

/// A root cause a person can fix, found in an error's chain by [`diagnose`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Diagnosis {
    /// No NATS server answered at the configured URLs.
    Unreachable,
    /// A stream or bucket Flotilla needs does not exist: the deployment is not provisioned
    /// (or runs under another prefix).
    NotProvisioned,
    /// Nothing serves the API subject: no coordinator runs.
    NoCoordinator,
}

impl Diagnosis {
    /// What to do about it, in one clause.
    pub fn hint(self) -> &'static str {
        match self {
            Self::Unreachable => {
                "start nats-server there, or run `flotilla up` (it embeds one), or point --nats-url at a running server"
            }
            Self::NotProvisioned => {
                "Flotilla's streams and buckets do not exist on this NATS under this prefix: start `flotilla coordinator` (it creates them) or run `flotilla nats provision`"
            }
            Self::NoCoordinator => {
                "no coordinator is running: start `flotilla coordinator` or `flotilla up`"
            }
        }
    }

    /// A command the hint names: a message that already names it needs no hint.
    pub fn names(self) -> &'static str {
        match self {
            Self::Unreachable => "`flotilla up`",
            Self::NotProvisioned | Self::NoCoordinator => "`flotilla coordinator`",
        }
    }
}

/// The JetStream API error code of "stream not found" (async-nats prints it as
/// `(code 404, error code 10059)`; opening a missing KV bucket reports it too).
const STREAM_NOT_FOUND: &str = "error code 10059";

/// The root cause of `error` that a person can fix, if its chain shows one: an unreachable
/// server, missing streams or buckets, or no coordinator on an API subject.
pub fn diagnose(error: &(dyn StdError + 'static)) -> Option<Diagnosis> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(c) = e.downcast_ref::<ConnectError>()
            && c.kind() == ConnectErrorKind::Unreachable
        {
            return Some(Diagnosis::Unreachable);
        }
        if e.downcast_ref::<PublishError>()
            .is_some_and(|p| p.kind() == PublishErrorKind::NoStream)
            || e.downcast_ref::<ReadError>()
                .is_some_and(|r| r.kind() == ReadErrorKind::NoStream)
            || e.downcast_ref::<async_nats::jetstream::Error>()
                .is_some_and(|j| j.error_code() == async_nats::jetstream::ErrorCode::STREAM_NOT_FOUND)
            // async-nats keeps the API error inside its error kinds, not as a source.
            || e.to_string().contains(STREAM_NOT_FOUND)
        {
            return Some(Diagnosis::NotProvisioned);
        }
        if e.downcast_ref::<async_nats::RequestError>()
            .is_some_and(|r| r.kind() == async_nats::RequestErrorKind::NoResponders)
        {
            return Some(Diagnosis::NoCoordinator);
        }
        next = e.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Leaf;

    impl fmt::Display for Leaf {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("no stream found for given subject")
        }
    }

    impl StdError for Leaf {}

    #[test]
    fn a_report_says_each_cause_once() {
        let inner =
            PublishError::with_source(PublishErrorKind::NoStream, "no stream captures x", Leaf);
        let outer = ProvisionError::with_source(ProvisionErrorKind::Server, "submitting", inner);
        // The chain repeats: `outer` includes `inner`, which includes `Leaf`.
        assert_eq!(
            report(&outer),
            "JetStream request failed: submitting: no stream for the subject: no stream captures x: no stream found for given subject"
        );
        assert_eq!(report(&Leaf), "no stream found for given subject");
    }

    #[test]
    fn root_causes_are_diagnosed_through_the_chain() {
        let missing = PublishError::with_source(PublishErrorKind::NoStream, "x", Leaf);
        let wrapped = ProvisionError::with_source(ProvisionErrorKind::Server, "y", missing);
        assert_eq!(diagnose(&wrapped), Some(Diagnosis::NotProvisioned));
        let refused = ConnectError::new(ConnectErrorKind::Unreachable, "connecting to nats://x");
        assert_eq!(diagnose(&refused), Some(Diagnosis::Unreachable));
        let denied = ConnectError::new(ConnectErrorKind::Authentication, "connecting");
        assert_eq!(diagnose(&denied), None);
        let kv = PublishError::new(
            PublishErrorKind::Publish,
            "failed to get the bucket: jetstream error: stream not found (code 404, error code 10059)",
        );
        assert_eq!(diagnose(&kv), Some(Diagnosis::NotProvisioned));
        for d in [
            Diagnosis::Unreachable,
            Diagnosis::NotProvisioned,
            Diagnosis::NoCoordinator,
        ] {
            assert!(d.hint().contains(d.names()), "{d:?}");
        }
    }
}
