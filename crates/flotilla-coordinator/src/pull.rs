//! How the coordinator's consumers pull: the idle heartbeat of a pull request, and the longest
//! pause before a message handed back is delivered again.

/// Idle heartbeat of the coordinator's pull requests: after a NATS restart or a lost
/// connection, two missed heartbeats make the consumer loop re-issue its pull, so failover
/// takes seconds. The cost is one tiny message per second per idle pull.
pub(crate) const PULL_HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(1);

/// The longest pause before a message handed back is delivered again.
pub(crate) const MAX_REDELIVERY_DELAY: std::time::Duration = std::time::Duration::from_secs(30);
