//! One module per command group.

pub(crate) mod approvals;
pub(crate) mod collab;
pub(crate) mod console;
pub(crate) mod controls;
pub(crate) mod datadir;
pub(crate) mod memory;
pub(crate) mod nats;
pub(crate) mod plan;
pub(crate) mod runs;
pub(crate) mod schema;
pub(crate) mod services;
pub(crate) mod submit;
pub(crate) mod team;
pub(crate) mod trust;
pub(crate) mod watch;

/// Who a person's request is from: `--by`, else `$USER`.
pub(crate) fn caller(by: Option<String>) -> Option<String> {
    by.or_else(|| std::env::var("USER").ok())
}
