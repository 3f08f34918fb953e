//! Stuck consumers: the installation's durable consumers sampled every few seconds
//! (`$JS.API.CONSUMER.INFO` through the stream's consumer list), and a consumer counted
//! *stuck* while messages wait for it (`num_pending > 0`), no pull request waits on it
//! (`num_waiting == 0`) and its ack floor has not moved for longer than `--stuck-after` (two
//! worker heartbeats by default) — all while the services that consume it are up: the clock
//! starts no earlier than the moment the last of them said it was ready (`/readyz`), and does
//! not run while one of them is down or not ready yet. A backlog that drains (acks move) is not stuck, nor is a consumer whose services
//! are restarting; one that nobody pulls from after they are back is.

use std::collections::HashMap;

use flotilla_bus::Bus;
use flotilla_model::subjects::StreamKind;
use futures::StreamExt;
use serde::Serialize;

use super::deployment::Kind;

/// One durable consumer at one moment.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ConsumerSample {
    pub(crate) stream: StreamKind,
    pub(crate) name: String,
    /// Messages not delivered yet.
    pub(crate) pending: u64,
    /// Delivered, not acknowledged.
    pub(crate) ack_pending: usize,
    /// Pull requests waiting.
    pub(crate) waiting: usize,
    /// Stream sequence of the ack floor.
    pub(crate) ack_floor: u64,
}

impl ConsumerSample {
    /// `STREAM_SUFFIX/name`.
    pub(crate) fn key(&self) -> String {
        format!("{}/{}", self.stream.suffix(), self.name)
    }
}

/// The services that consume a durable consumer.
pub(crate) fn owners(stream: StreamKind, name: &str) -> Vec<Kind> {
    match stream {
        StreamKind::Intake | StreamKind::RunLog | StreamKind::Workspace => vec![Kind::Coordinator],
        StreamKind::Tasks if name.ends_with(&format!("-{}", super::config::LLM_POOL)) => {
            vec![Kind::LlmWorker]
        }
        // A role's queue is shared by every worker hosting a member of the role.
        StreamKind::Tasks if name.starts_with("role-") => vec![Kind::Worker, Kind::LlmWorker],
        StreamKind::Tasks => vec![Kind::Worker],
        StreamKind::Events | StreamKind::Mailbox | StreamKind::Notify => vec![Kind::Supervisor],
    }
}

/// The installation's durable consumers now.
pub(crate) async fn sample(bus: &Bus) -> anyhow::Result<Vec<ConsumerSample>> {
    let mut out = Vec::new();
    for kind in StreamKind::ALL {
        let stream = bus.js().get_stream(bus.names().stream(kind)).await?;
        let mut infos = stream.consumers();
        while let Some(info) = infos.next().await {
            let info = info?;
            let Some(name) = info.config.durable_name.clone() else {
                continue;
            };
            out.push(ConsumerSample {
                stream: kind,
                name,
                pending: info.num_pending,
                ack_pending: info.num_ack_pending,
                waiting: info.num_waiting,
                ack_floor: info.ack_floor.stream_sequence,
            });
        }
    }
    Ok(out)
}

/// A time a consumer was stuck.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct StuckEpisode {
    /// `STREAM_SUFFIX/name`.
    pub(crate) consumer: String,
    /// When its clock started (unix ms): the last ack progress, or its services' last start.
    pub(crate) since_ms: i64,
    /// When it was first seen stuck.
    pub(crate) seen_ms: i64,
    /// When it moved again; absent: still stuck at the end.
    pub(crate) until_ms: Option<i64>,
    /// Most messages pending meanwhile.
    pub(crate) max_pending: u64,
    /// Its ack floor while stuck.
    pub(crate) ack_floor: u64,
}

#[derive(Debug, Default)]
struct Track {
    /// Pending, nobody pulling, no ack progress: since when.
    since_ms: Option<i64>,
    ack_floor: u64,
    /// Index of its open episode.
    open: Option<usize>,
}

/// Turns consumer samples into stuck episodes.
#[derive(Debug)]
pub(crate) struct StuckTracker {
    threshold_ms: i64,
    tracks: HashMap<String, Track>,
    pub(crate) episodes: Vec<StuckEpisode>,
    /// Rounds of sampling that read every stream's consumers, and those that failed: a
    /// figure of 0 stuck is worth what was sampled.
    pub(crate) rounds: u64,
    pub(crate) failed_rounds: u64,
}

impl StuckTracker {
    pub(crate) fn new(threshold: std::time::Duration) -> Self {
        Self {
            threshold_ms: threshold.as_millis() as i64,
            tracks: HashMap::new(),
            episodes: Vec::new(),
            rounds: 0,
            failed_rounds: 0,
        }
    }

    /// The consumers seen so far (`STREAM_SUFFIX/name`), in order.
    pub(crate) fn consumers(&self) -> Vec<String> {
        let mut v: Vec<String> = self.tracks.keys().cloned().collect();
        v.sort();
        v
    }

    /// Takes one sample at `at_ms`. `quiet_since_ms`: since when every service consuming it
    /// has been up (`at_ms` itself while one is down).
    pub(crate) fn observe(&mut self, at_ms: i64, s: &ConsumerSample, quiet_since_ms: i64) {
        let key = s.key();
        let t = self.tracks.entry(key.clone()).or_default();
        let progressed = s.ack_floor != t.ack_floor;
        t.ack_floor = s.ack_floor;
        let candidate = s.pending > 0 && s.waiting == 0;
        if !candidate || progressed {
            t.since_ms = candidate.then_some(at_ms);
            if let Some(i) = t.open.take() {
                self.episodes[i].until_ms = Some(at_ms);
            }
            return;
        }
        let since = *t.since_ms.get_or_insert(at_ms);
        let clock = since.max(quiet_since_ms);
        match t.open {
            Some(i) => {
                let e = &mut self.episodes[i];
                e.max_pending = e.max_pending.max(s.pending);
            }
            None if at_ms - clock > self.threshold_ms => {
                t.open = Some(self.episodes.len());
                self.episodes.push(StuckEpisode {
                    consumer: key,
                    since_ms: clock,
                    seen_ms: at_ms,
                    until_ms: None,
                    max_pending: s.pending,
                    ack_floor: s.ack_floor,
                });
            }
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn sample(pending: u64, waiting: usize, floor: u64) -> ConsumerSample {
        ConsumerSample {
            stream: StreamKind::Tasks,
            name: "pool-default".into(),
            pending,
            ack_pending: 0,
            waiting,
            ack_floor: floor,
        }
    }

    #[test]
    fn pending_without_a_pull_or_progress_past_the_threshold_is_stuck() {
        let mut t = StuckTracker::new(Duration::from_secs(10));
        t.observe(0, &sample(3, 0, 5), 0);
        t.observe(10_000, &sample(3, 0, 5), 0);
        assert!(
            t.episodes.is_empty(),
            "exactly the threshold is not past it"
        );
        t.observe(12_000, &sample(4, 0, 5), 0);
        t.observe(14_000, &sample(9, 0, 5), 0);
        assert_eq!(t.episodes.len(), 1);
        assert_eq!(t.episodes[0].since_ms, 0);
        assert_eq!(t.episodes[0].seen_ms, 12_000);
        assert_eq!(t.episodes[0].max_pending, 9);
        assert_eq!(t.episodes[0].until_ms, None);
        // Acks move: the episode ends.
        t.observe(16_000, &sample(9, 0, 6), 0);
        assert_eq!(t.episodes[0].until_ms, Some(16_000));
        assert_eq!(t.episodes.len(), 1);
    }

    #[test]
    fn a_backlog_that_drains_or_is_pulled_is_not_stuck() {
        let mut t = StuckTracker::new(Duration::from_secs(10));
        for (i, at) in (0..20).map(|i| (i, i * 2_000)).collect::<Vec<_>>() {
            // Acks advance every sample.
            t.observe(at, &sample(50, 0, 100 + i as u64), 0);
        }
        for at in (40_000..80_000).step_by(2_000) {
            // Nothing acks, but a pull waits: the consumer is idle, not stuck.
            t.observe(at, &sample(5, 1, 200), 0);
        }
        for at in (80_000..120_000).step_by(2_000) {
            // Nothing pending.
            t.observe(at, &sample(0, 0, 200), 0);
        }
        assert!(t.episodes.is_empty());
    }

    #[test]
    fn the_clock_waits_for_its_services() {
        let mut t = StuckTracker::new(Duration::from_secs(10));
        // A worker restarted at 20 s: stuck only 10 s after that, whatever came before.
        for at in (0..=30_000).step_by(2_000) {
            t.observe(at, &sample(3, 0, 5), 20_000.min(at));
        }
        assert!(t.episodes.is_empty());
        t.observe(32_000, &sample(3, 0, 5), 20_000);
        assert_eq!(t.episodes.len(), 1);
        assert_eq!(t.episodes[0].since_ms, 20_000);
    }

    #[test]
    fn consumers_belong_to_their_services() {
        assert_eq!(
            owners(StreamKind::RunLog, "runlog"),
            vec![Kind::Coordinator]
        );
        assert_eq!(owners(StreamKind::Tasks, "pool-llm"), vec![Kind::LlmWorker]);
        assert_eq!(
            owners(StreamKind::Tasks, "turns-default"),
            vec![Kind::Worker]
        );
        assert_eq!(
            owners(StreamKind::Tasks, "role-mate"),
            vec![Kind::Worker, Kind::LlmWorker]
        );
        assert_eq!(
            owners(StreamKind::Events, "supervisor"),
            vec![Kind::Supervisor]
        );
    }
}
