//! The supervisor's errors.

use thiserror::Error;

/// Why the supervisor could not start or go on.
#[derive(Debug, Error)]
pub enum SupervisorError {
    /// A stream, bucket or consumer could not be opened or created.
    #[error("setting up: {0}")]
    Setup(String),
    /// Reading or writing a bucket failed.
    #[error("{what}: {source}")]
    Store {
        /// What was being done.
        what: String,
        /// The NATS error.
        #[source]
        source: async_nats::Error,
    },
    /// A value in a bucket could not be read.
    #[error("{key}: {message}")]
    Decode {
        /// The key.
        key: String,
        /// What was wrong.
        message: String,
    },
}

impl SupervisorError {
    pub(crate) fn store(what: impl Into<String>, e: impl Into<async_nats::Error>) -> Self {
        Self::Store {
            what: what.into(),
            source: e.into(),
        }
    }
}
