//! Why a worker could not run: its configuration, or setting up its streams, consumer and
//! registry.

flotilla_bus::error_kinds!(
    /// Why a worker could not run.
    WorkerErrorKind {
        /// Invalid settings or agent definitions.
        Config => "invalid worker configuration", Terminal;
        /// Streams, consumer or registry could not be set up.
        Setup => "worker setup failed", Retryable;
    }
);

/// A worker could not run.
pub type WorkerError = flotilla_bus::error::Error<WorkerErrorKind>;

pub(crate) fn setup(
    detail: impl Into<String>,
    e: impl std::error::Error + Send + Sync + 'static,
) -> WorkerError {
    WorkerError::with_source(WorkerErrorKind::Setup, detail, e)
}
