//! One module per command group.

pub(crate) mod approvals;
pub(crate) mod collab;
pub(crate) mod console;
pub(crate) mod controls;
pub(crate) mod datadir;
pub(crate) mod diff;
pub(crate) mod eval;
pub(crate) mod example;
pub(crate) mod fork;
pub(crate) mod init;
pub(crate) mod memory;
pub(crate) mod nats;
pub(crate) mod plan;
pub(crate) mod runs;
pub(crate) mod schema;
pub(crate) mod services;
pub(crate) mod signals;
pub(crate) mod status;
pub(crate) mod submit;
pub(crate) mod team;
pub(crate) mod tenant;
pub(crate) mod tenant_services;
pub(crate) mod trust;
pub(crate) mod watch;

/// Who a person's request is from: `--by`, else `$USER`, else `$LOGNAME`, else the operating
/// system's name of the user running the command (containers, CI and Kubernetes pods often
/// set neither variable). `None` when none of them names anyone.
pub(crate) fn caller(by: Option<String>) -> Option<String> {
    let named = |v: String| {
        let v = v.trim().to_owned();
        (!v.is_empty()).then_some(v)
    };
    // An explicit `--by` is sent as given: an empty one is refused by name (`by is required`).
    by.or_else(|| std::env::var("USER").ok().and_then(named))
        .or_else(|| std::env::var("LOGNAME").ok().and_then(named))
        .or_else(|| {
            nix::unistd::User::from_uid(nix::unistd::getuid())
                .ok()
                .flatten()
                .map(|u| u.name)
                .and_then(named)
        })
}

/// [`caller`] for a decision that must name a person (an answer, a trust change): an error
/// naming `--by` when nothing names one.
pub(crate) fn person(by: Option<String>) -> anyhow::Result<String> {
    caller(by).ok_or_else(|| {
        anyhow::anyhow!(
            "who decides is unknown: pass --by NAME (no $USER or $LOGNAME is set, and user id {} has no name)",
            nix::unistd::getuid()
        )
    })
}
