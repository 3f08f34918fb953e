//! Coordinator errors.

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
    /// Why the coordinator stopped.
    CoordinatorErrorKind {
        /// Streams, buckets or consumers could not be set up.
        Setup => "coordinator setup failed", Retryable;
        /// The configuration is invalid.
        Config => "invalid coordinator configuration", Terminal;
        /// Following a run's events failed (a watch).
        Watch => "following a run's events failed", Retryable;
    }
);

/// The coordinator could not run.
pub type CoordinatorError = Error<CoordinatorErrorKind>;
