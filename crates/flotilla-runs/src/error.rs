//! Errors of reading runs.

use flotilla_bus::error::Error;

flotilla_bus::error_kinds!(
    /// Why reading or writing run state failed.
    StoreErrorKind {
        /// No such run.
        NotFound => "run not found", Terminal;
        /// Another writer changed the run since it was read (compare-and-set lost).
        Conflict => "run changed concurrently", Retryable;
        /// The run already exists.
        AlreadyExists => "run already exists", Terminal;
        /// Stored data could not be decoded.
        Decode => "stored data is unreadable", Terminal;
        /// A record or message is larger than the deployment's max payload.
        TooLarge => "too large for one message", Terminal;
        /// NATS or JetStream failed.
        Nats => "NATS request failed", Retryable;
    }
);

/// Reading or writing run state failed.
pub type StoreError = Error<StoreErrorKind>;

flotilla_bus::error_kinds!(
    /// Why following a run's events stopped.
    WatchErrorKind {
        /// The event stream could not be read (NATS down, the stream missing, a consumer
        /// lost): the watch may be opened again from the last position it delivered.
        Unavailable => "following a run's events failed", Retryable;
    }
);

/// Following a run's events failed.
pub type WatchError = Error<WatchErrorKind>;

/// A NATS or JetStream failure while reading or writing runs.
pub fn nats(
    detail: impl Into<String>,
    e: impl std::error::Error + Send + Sync + 'static,
) -> StoreError {
    StoreError::with_source(StoreErrorKind::Nats, detail, e)
}

/// Stored data that could not be decoded (or encoded).
pub fn decode_err(
    detail: impl Into<String>,
    e: impl std::error::Error + Send + Sync + 'static,
) -> StoreError {
    StoreError::with_source(StoreErrorKind::Decode, detail, e)
}
