//! The pace of a worker's attempts, which decides whether prefetching tasks beyond its free
//! slots pays (see the crate docs).

use std::sync::atomic::Ordering;
use std::time::Duration;

/// Attempts shorter than this on average make prefetching pay: it saves a pull round trip
/// (about 1 ms) per task, and costs at most one attempt's duration of waiting while another
/// worker may be idle. Model calls take seconds; no-op and cached agents take microseconds.
pub const PREFETCH_MAX_ATTEMPT: Duration = Duration::from_millis(50);

/// The recent duration of this worker's attempts, as an exponentially weighted average
/// (weight 1/5 for each new attempt): one atomic update per attempt.
#[derive(Debug)]
pub(crate) struct Pace(std::sync::atomic::AtomicU64);

impl Pace {
    /// No attempt has ended yet.
    const UNKNOWN: u64 = u64::MAX;

    /// No attempts seen.
    pub(crate) fn new() -> Self {
        Self(std::sync::atomic::AtomicU64::new(Self::UNKNOWN))
    }

    /// An attempt's agent ran for `d`.
    pub(crate) fn record(&self, d: Duration) {
        let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX - 1);
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                Some(if old == Self::UNKNOWN {
                    micros
                } else {
                    (old.saturating_mul(4)).saturating_add(micros) / 5
                })
            });
    }

    /// Whether prefetching pays: attempts have been seen and are short on average. Until the
    /// first attempt ends, the pace is unknown and the answer is no.
    pub(crate) fn short(&self) -> bool {
        let v = self.0.load(Ordering::Relaxed);
        v != Self::UNKNOWN && v < PREFETCH_MAX_ATTEMPT.as_micros() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefetch_waits_for_short_attempts_and_stops_at_a_long_one() {
        let pace = Pace::new();
        assert!(!pace.short(), "unknown pace: no prefetch");
        pace.record(Duration::from_micros(300));
        assert!(pace.short());
        for _ in 0..20 {
            pace.record(Duration::from_millis(2));
        }
        assert!(pace.short(), "quick attempts keep prefetching");
        // One model call ends it at once …
        pace.record(Duration::from_secs(2));
        assert!(!pace.short());
        // … and it takes a run of quick attempts to come back.
        let mut quick = 0;
        while !pace.short() {
            pace.record(Duration::from_millis(1));
            quick += 1;
            assert!(quick < 100, "never came back");
        }
        assert!(quick >= 5, "{quick}");
        let slow = Pace::new();
        slow.record(PREFETCH_MAX_ATTEMPT);
        assert!(!slow.short(), "{PREFETCH_MAX_ATTEMPT:?} is not short");
    }
}
