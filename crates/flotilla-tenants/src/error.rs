//! Errors of tenant records and quotas.

use std::fmt;

/// What went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TenantErrorKind {
    /// NATS failed (unreachable, refused).
    Nats,
    /// No tenant was ever added (no bucket).
    NoTenants,
    /// A tenant of that name exists.
    AlreadyExists,
    /// A record cannot be encoded or decoded.
    Decode,
    /// Quotas that make no sense (a limit of 0, a queue for a quota that cannot wait):
    /// refused, nothing written.
    InvalidQuotas,
    /// A compare-and-set of the usage bucket lost too many races in a row.
    Conflict,
}

/// An error of this crate: its kind and what happened.
#[derive(Debug, thiserror::Error)]
pub struct TenantError {
    kind: TenantErrorKind,
    message: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl TenantError {
    /// An error of `kind`.
    pub fn new(kind: TenantErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// A NATS failure while doing `what`.
    pub fn nats(
        what: impl Into<String>,
        e: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        let what = what.into();
        Self {
            kind: TenantErrorKind::Nats,
            message: format!("{what}: {e}"),
            source: Some(Box::new(e)),
        }
    }

    /// Its kind.
    pub fn kind(&self) -> TenantErrorKind {
        self.kind
    }
}

impl fmt::Display for TenantError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}
