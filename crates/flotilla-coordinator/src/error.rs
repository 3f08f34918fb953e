//! Coordinator errors.

use flotilla_bus::error::Error;

pub use flotilla_runs::error::{StoreError, StoreErrorKind};

flotilla_bus::error_kinds!(
    /// Why the coordinator stopped.
    CoordinatorErrorKind {
        /// Streams, buckets or consumers could not be set up.
        Setup => "coordinator setup failed", Retryable;
        /// The configuration is invalid.
        Config => "invalid coordinator configuration", Terminal;
    }
);

/// The coordinator could not run.
pub type CoordinatorError = Error<CoordinatorErrorKind>;
