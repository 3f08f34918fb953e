//! Errors in the async-nats style: one generic [`Error`] carrying a `kind` that callers match
//! on, plus the underlying cause. Each operation has its own kind enum, and each kind says
//! whether retrying can help.

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
        /// The subject already has messages and the publish expected none (a run's first
        /// run-log entry decides its fate, once).
        NotFirst => "the subject already has a first message", Terminal;
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
