//! The supervisor's errors.

use flotilla_model::ErrorCode;
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
    /// A quota of the tenant refuses it (`persistent_teammates`, `mailbox_bytes`): the
    /// message names the quota, its limit and the use.
    #[error("{0}")]
    QuotaExceeded(String),
}

impl SupervisorError {
    /// The API error code a team request that fails on it is answered with: `unavailable`
    /// for a stream, a bucket or a stored value that could not be had now (asking again may
    /// pass), `quota_exceeded` for a quota.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Setup(_) | Self::Store { .. } | Self::Decode { .. } => ErrorCode::Unavailable,
            Self::QuotaExceeded(_) => ErrorCode::QuotaExceeded,
        }
    }

    /// Its status: the code's (`503`, `429`).
    pub fn status(&self) -> u16 {
        self.code().status()
    }

    pub(crate) fn store(what: impl Into<String>, e: impl Into<async_nats::Error>) -> Self {
        Self::Store {
            what: what.into(),
            source: e.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quota_is_answered_429() {
        let e = SupervisorError::QuotaExceeded("tenant a is over its mailbox_bytes quota".into());
        assert_eq!((e.status(), e.code().as_str()), (429, "quota_exceeded"));
    }

    #[test]
    fn every_store_kind_is_answered_unavailable() {
        for e in [
            SupervisorError::Setup("x".into()),
            SupervisorError::store("reading k", "gone"),
            SupervisorError::Decode {
                key: "k".into(),
                message: "not JSON".into(),
            },
        ] {
            assert_eq!((e.status(), e.code().as_str()), (503, "unavailable"), "{e}");
        }
    }
}
