//! Start-up steps that ride out a cluster's leader election.
//!
//! A service opens its streams, buckets and consumers once, when it starts. On a cluster
//! those requests can fail for a few seconds for reasons that pass by themselves: a node
//! restarting, a stream without a leader until its election ends, JetStream's API not
//! answered (a timeout, "no responders") or refusing for now ("temporarily unavailable",
//! "no leader", 503). A node kill is a transient fault for a running service; it is one for a
//! starting service too. [`Patience::ride_out`] runs such a step again with backoff until the
//! service's start-up bound passes, saying every few seconds what it waits for; an error
//! that will not pass — a permissions refusal, incompatible resources, a stream that does not
//! exist — is returned at once.

use std::error::Error as StdError;
use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::{self, context as js};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::{PublishError, PublishErrorKind, ReadError, ReadErrorKind};

/// The first pause between two tries of a step; it doubles up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(100);
/// The longest pause between two tries.
const MAX_PAUSE: Duration = Duration::from_secs(2);
/// How often a waiting step says what it waits for.
const LOG_EVERY: Duration = Duration::from_secs(5);

/// Whether `error` is a JetStream fault that passes by itself (see the module docs): a
/// request that timed out or found no responders, or an API answer that the cluster or the
/// stream has no leader for now. A refusal of permissions is never transient, whatever else
/// its chain says (an unanswered request is how a refused one often looks).
pub fn is_transient(error: &(dyn StdError + 'static)) -> bool {
    let mut transient = false;
    let mut next = Some(error);
    while let Some(e) = next {
        let text = e.to_string().to_ascii_lowercase();
        if text.contains("permission") || text.contains("authorization violation") {
            return false;
        }
        transient |= transient_here(e);
        next = e.source();
    }
    transient
}

/// One error of a chain, by its kind (async-nats keeps the API error inside its kinds, not
/// as a source).
fn transient_here(e: &(dyn StdError + 'static)) -> bool {
    use async_nats::jetstream::stream::{ConsumerError, ConsumerErrorKind};
    if let Some(r) = e.downcast_ref::<async_nats::RequestError>() {
        return matches!(
            r.kind(),
            async_nats::RequestErrorKind::TimedOut | async_nats::RequestErrorKind::NoResponders
        );
    }
    if let Some(r) = e.downcast_ref::<js::RequestError>() {
        return matches!(
            r.kind(),
            js::RequestErrorKind::TimedOut | js::RequestErrorKind::NoResponders
        );
    }
    if let Some(g) = e.downcast_ref::<js::GetStreamError>() {
        return matches!(g.kind(), js::GetStreamErrorKind::JetStream(j) if leaderless(&j));
    }
    if let Some(c) = e.downcast_ref::<js::CreateStreamError>() {
        return match c.kind() {
            js::CreateStreamErrorKind::TimedOut => true,
            js::CreateStreamErrorKind::JetStream(j) => leaderless(&j),
            _ => false,
        };
    }
    if let Some(c) = e.downcast_ref::<ConsumerError>() {
        return match c.kind() {
            ConsumerErrorKind::TimedOut => true,
            ConsumerErrorKind::JetStream(j) => leaderless(&j),
            _ => false,
        };
    }
    if let Some(c) = e.downcast_ref::<js::ConsumerInfoError>() {
        return match c.kind() {
            js::ConsumerInfoErrorKind::TimedOut
            | js::ConsumerInfoErrorKind::NoResponders
            | js::ConsumerInfoErrorKind::Offline => true,
            js::ConsumerInfoErrorKind::JetStream(j) => leaderless(&j),
            _ => false,
        };
    }
    if let Some(c) = e.downcast_ref::<js::CreateKeyValueError>() {
        return c.kind() == js::CreateKeyValueErrorKind::TimedOut;
    }
    if let Some(j) = e.downcast_ref::<jetstream::Error>() {
        return leaderless(j);
    }
    if let Some(p) = e.downcast_ref::<PublishError>() {
        return p.kind() == PublishErrorKind::Unavailable;
    }
    if let Some(r) = e.downcast_ref::<ReadError>() {
        return r.kind() == ReadErrorKind::TimedOut;
    }
    false
}

/// JetStream's answers while the cluster, a stream or a consumer has no leader for now.
fn leaderless(e: &jetstream::Error) -> bool {
    use jetstream::ErrorCode as C;
    let code = e.error_code();
    if [
        C::JETSTREAM_NOT_ENABLED,
        C::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT,
    ]
    .contains(&code)
    {
        return false;
    }
    [
        C::CLUSTER_NOT_AVAILABLE,
        C::CLUSTER_NOT_LEADER,
        C::CLUSTER_NOT_ACTIVE,
        C::CLUSTER_NOT_ASSIGNED,
        C::CLUSTER_INCOMPLETE,
        C::STREAM_OFFLINE,
        C::CONSUMER_OFFLINE,
        C::CLUSTER_SERVER_MEMBER_CHANGE_INFLIGHT,
    ]
    .contains(&code)
        // "JetStream system temporarily unavailable" and its kin; a request timeout.
        || e.code() == 503
        || e.code() == 408
}

/// How long a service's start-up may wait out transient faults, from when it began.
#[derive(Debug, Clone)]
pub struct Patience {
    until: Instant,
    wait: Duration,
    stop: CancellationToken,
}

impl Patience {
    /// Waits out transient faults for up to `wait` from now, or until `stop` fires (then the
    /// last error is returned; the caller is stopping anyway).
    pub fn new(wait: Duration, stop: CancellationToken) -> Self {
        Self {
            until: Instant::now() + wait,
            wait,
            stop,
        }
    }

    /// The bound this patience was given.
    pub fn wait(&self) -> Duration {
        self.wait
    }

    /// Runs `op` — one start-up step, `what` in the log — until it succeeds, fails for good,
    /// or the bound passes (then with its last error). Pauses start at 100 ms and double up
    /// to 2 s; a log line every 5 s says what the service waits for. The first try costs
    /// nothing extra.
    pub async fn ride_out<T, E, F, Fut>(&self, what: &str, mut op: F) -> Result<T, E>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: StdError + 'static,
    {
        let started = Instant::now();
        let mut pause = FIRST_PAUSE;
        let mut next_log = started + LOG_EVERY;
        let mut waited = false;
        loop {
            let e = match op().await {
                Ok(v) => {
                    if waited {
                        tracing::info!(
                            step = what,
                            waited_seconds = started.elapsed().as_secs_f64(),
                            "JetStream answers again: starting"
                        );
                    }
                    return Ok(v);
                }
                Err(e) => e,
            };
            let now = Instant::now();
            if !is_transient(&e) || now + pause > self.until || self.stop.is_cancelled() {
                return Err(e);
            }
            if !waited || now >= next_log {
                let left = self.until.saturating_duration_since(now);
                tracing::warn!(
                    step = what,
                    error = %crate::error::report(&e),
                    gives_up_in_seconds = left.as_secs(),
                    "JetStream is not answering for now (a cluster node restarting, or a leader election); waiting"
                );
                next_log = now + LOG_EVERY;
            }
            waited = true;
            tokio::select! {
                () = self.stop.cancelled() => return Err(e),
                () = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(MAX_PAUSE);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: u64, err_code: u64) -> jetstream::Error {
        let body = format!(r#"{{"code":{code},"err_code":{err_code},"description":"x"}}"#);
        serde_json::from_str(&body).expect("an API error")
    }

    #[test]
    fn leader_elections_and_timeouts_are_transient_refusals_and_missing_streams_are_not() {
        assert!(is_transient(&api(503, 10008)), "temporarily unavailable");
        assert!(is_transient(&api(500, 10009)), "not leader");
        assert!(is_transient(&api(503, 10118)), "stream offline");
        assert!(!is_transient(&api(404, 10059)), "stream not found");
        assert!(!is_transient(&api(503, 10039)), "JetStream not enabled");
        assert!(!is_transient(&api(400, 10058)), "a bad request");
        let timed_out = js::RequestError::new(js::RequestErrorKind::TimedOut);
        assert!(is_transient(&timed_out));
        let wrapped = crate::ProvisionError::with_source(
            crate::ProvisionErrorKind::Server,
            "reading stream FLOTILLA_TASKS",
            js::GetStreamError::with_source(js::GetStreamErrorKind::Request, timed_out),
        );
        assert!(is_transient(&wrapped), "{wrapped}");
        let refused = crate::ProvisionError::with_source(
            crate::ProvisionErrorKind::Server,
            "permission denied for $JS.API.STREAM.INFO.FLOTILLA_TASKS",
            js::RequestError::new(js::RequestErrorKind::TimedOut),
        );
        assert!(!is_transient(&refused), "a refusal that timed out");
        let incompatible =
            crate::ProvisionError::new(crate::ProvisionErrorKind::Incompatible, "retention");
        assert!(!is_transient(&incompatible));
    }

    #[derive(Debug)]
    struct Permanent;

    impl std::fmt::Display for Permanent {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("incompatible")
        }
    }

    impl StdError for Permanent {}

    #[tokio::test]
    async fn a_step_is_tried_again_while_its_fault_passes_and_not_after_a_permanent_one() {
        let patience = Patience::new(Duration::from_secs(5), CancellationToken::new());
        let mut tries = 0;
        let out: Result<u32, js::RequestError> = patience
            .ride_out("a step", || {
                tries += 1;
                let t = tries;
                async move {
                    if t < 3 {
                        Err(js::RequestError::new(js::RequestErrorKind::TimedOut))
                    } else {
                        Ok(t)
                    }
                }
            })
            .await;
        assert_eq!(out.ok(), Some(3));
        let mut tries = 0;
        let out: Result<(), Permanent> = patience
            .ride_out("another", || {
                tries += 1;
                async { Err(Permanent) }
            })
            .await;
        assert!(out.is_err());
        assert_eq!(tries, 1, "a permanent error is returned at once");
        // The bound passes: the last error (a fault that never passed).
        let short = Patience::new(Duration::from_millis(250), CancellationToken::new());
        let out: Result<(), js::RequestError> = short
            .ride_out("a third", || async {
                Err(js::RequestError::new(js::RequestErrorKind::NoResponders))
            })
            .await;
        assert!(out.is_err());
    }
}
