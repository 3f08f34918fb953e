//! Persistent teammates in the `team` section, against the section's coordinator, workers and
//! supervisor (child processes; the teammates run the section's no-op `scripted` agent, a
//! deterministic test agent, so a turn costs no model call and no process). In this order:
//!
//! * **idle teammates**: the supervisor's and the workers' resident memory (`VmRSS`) and the
//!   consumers on the installation's streams and buckets with no teammate, then with
//!   `--teammates N` that each ran one turn and went idle. An idle teammate is a KV entry and
//!   a conversation entry, so neither should grow with N beyond the supervisor's mirror of
//!   the entries.
//! * **wake** (one teammate among the idle ones): an idle teammate gets a message (`team.send`) → its turn starts on a worker,
//!   next to the raw mailbox hop measured sample by sample in turn (a JetStream publish,
//!   awaiting its PubAck → an ordered consumer already waiting receives it). The turn's start
//!   is read from the server's timestamps on the teammate's entries (a KV watch of its two
//!   keys, so the watch's own delivery is not counted): *claimed* is the worker's
//!   compare-and-set naming itself the host; *fenced* is its write of the conversation with
//!   the new epoch, after which it reads the inbox (one direct get) and starts the agent.
//!   The steps in between are printed too (the inbox message stored, the teammate woken).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::Context;
use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use async_nats::jetstream::kv;
use async_nats::jetstream::stream::Config as StreamConfig;
use bytes::Bytes;
use flotilla_bus::Bus;
use flotilla_client::Client;
use flotilla_model::subjects::{Bucket, StreamKind};
use flotilla_model::teammate::{
    Conversation, TeamSendRequest, TeamSpawnRequest, Teammate, TeammatePost, TeammateStatus,
    conversation_key, teammate_key,
};
use flotilla_model::time::Timestamp;
use futures::StreamExt;
use tokio::sync::mpsc;

use crate::harness::processes::rss_kib;
use crate::harness::stats::{ms, p50_p99};

/// The raw baseline's stream and subject (deleted afterwards).
const RAW_STREAM: &str = "FLBENCH_TEAM_RAW";
const RAW_SUBJECT: &str = "flbench-team.mbox";
/// Pause before each sample, so the worker's turn pull and the raw consumer are back waiting.
const GAP: Duration = Duration::from_millis(5);
/// Samples of each kind left out at the start (connections and caches warming up).
const WARM_UP: usize = 5;
/// How long one API request or one wait may take.
const ASK: Duration = Duration::from_secs(30);
/// Requests in flight while spawning and waking the idle teammates.
const IN_FLIGHT: usize = 50;
/// The team of the woken teammate, and of the idle ones.
const WAKE_TEAM: &str = "benchwake";
const IDLE_TEAM: &str = "benchidle";

/// The section's processes whose memory is read.
pub(crate) struct Pids {
    pub(crate) supervisor: Option<u32>,
    pub(crate) workers: Vec<u32>,
}

/// Resident memory (KiB) and consumers at one moment.
struct Reading {
    supervisor_kib: Option<u64>,
    workers_kib: Option<u64>,
    consumers: BTreeSet<String>,
}

/// What was read with no teammate, and the watch of the idle team's keys (opened first, so
/// its consumer is in both readings).
pub(crate) struct Baseline {
    reading: Reading,
    watch: kv::Watch,
}

impl Pids {
    fn supervisor_kib(&self) -> Option<u64> {
        self.supervisor.and_then(rss_kib)
    }

    /// The workers' resident memory, summed.
    fn workers_kib(&self) -> Option<u64> {
        self.workers.iter().map(|p| rss_kib(*p)).sum()
    }
}

/// Reads the baseline: call before the first teammate is spawned.
pub(crate) async fn baseline(bus: &Bus, pids: &Pids) -> anyhow::Result<Baseline> {
    let kv = bus.kv(Bucket::Team).await?;
    let watch = kv
        .watch_many([
            teammate_key(IDLE_TEAM, "*"),
            conversation_key(IDLE_TEAM, "*"),
        ])
        .await?;
    Ok(Baseline {
        reading: read(bus, pids).await?,
        watch,
    })
}

async fn read(bus: &Bus, pids: &Pids) -> anyhow::Result<Reading> {
    Ok(Reading {
        supervisor_kib: pids.supervisor_kib(),
        workers_kib: pids.workers_kib(),
        consumers: consumers(bus).await?,
    })
}

/// The consumers on every stream and bucket of the installation (`bus`'s prefix), as
/// `stream/consumer`. Names, not a count: the ordered consumers earlier measurements left
/// behind expire 30 s after their last use, so a count could fall meanwhile and hide a new
/// one; what matters is which consumers were created while the teammates were.
async fn consumers(bus: &Bus) -> anyhow::Result<BTreeSet<String>> {
    let names = bus.names();
    let streams = StreamKind::ALL.iter().map(|k| names.stream(*k)).chain(
        Bucket::ALL
            .iter()
            .map(|b| format!("KV_{}", names.bucket(*b))),
    );
    let mut all = BTreeSet::new();
    for stream in streams {
        // A bucket nothing uses yet may not exist.
        let Ok(s) = bus.js().get_stream(&stream).await else {
            continue;
        };
        let mut list = s.consumer_names();
        while let Some(c) = list.next().await {
            all.insert(format!("{stream}/{}", c?));
        }
    }
    Ok(all)
}

fn spawn_request(team: &str, name: &str, role: &str) -> TeamSpawnRequest {
    TeamSpawnRequest {
        protocol: flotilla_model::PROTOCOL_VERSION,
        team: Some(team.into()),
        name: name.into(),
        role: role.into(),
        instructions: "answer briefly".into(),
        agent: None,
        pool: None,
        by: None,
        expose: false,
    }
}

fn send_request(team: &str, to: &str, text: &str) -> TeamSendRequest {
    TeamSendRequest {
        protocol: flotilla_model::PROTOCOL_VERSION,
        team: Some(team.into()),
        to: to.into(),
        from: Some("bench".into()),
        text: text.into(),
    }
}

/// One wake, as server (and client) times in ns since the epoch.
struct Wake {
    sent: i128,
    answered: i128,
    stored: i128,
    woken: i128,
    claimed: i128,
    fenced: i128,
    idle: i128,
}

/// One span of a [`Wake`], ns.
type Span = fn(&Wake) -> i128;

/// Follows the teammate's two keys through one turn.
struct Watcher {
    watch: kv::Watch,
    turns: u64,
}

impl Watcher {
    /// Spawns teammate `name` of the wake's team and follows it. Each wake measurement has a
    /// teammate of its own, so each starts from a new entry: an entry keeps the start times
    /// of its last hour's turns, and a later measurement on the same teammate would write a
    /// larger entry with every claim.
    async fn spawned(
        kv: &kv::Store,
        client: &Client,
        role: &str,
        name: &str,
    ) -> anyhow::Result<Self> {
        let watch = kv
            .watch_many([
                teammate_key(WAKE_TEAM, name),
                conversation_key(WAKE_TEAM, name),
            ])
            .await?;
        client
            .request(&spawn_request(WAKE_TEAM, name, role), ASK)
            .await
            .context("team.spawn")?;
        Ok(Self { watch, turns: 0 })
    }

    /// The next entry of the watch.
    async fn next(&mut self) -> anyhow::Result<kv::Entry> {
        Ok(tokio::time::timeout(ASK, self.watch.next())
            .await
            .context("the teammate's entries did not change for 30 s")?
            .context("the watch ended")??)
    }

    /// Waits for the turn that ran a message sent at `sent`: woken, claimed, fenced, back
    /// idle (server times). Entries written before `sent` are left out, and a turn that found
    /// nothing to read (a late second wake of the previous message) starts the search again.
    async fn turn(&mut self, key: &str, sent: i128) -> anyhow::Result<(i128, i128, i128, i128)> {
        let (mut woken, mut claimed, mut fenced) = (None, None, None);
        let mut epoch = None;
        loop {
            let e = self.next().await?;
            let at = e.created.unix_timestamp_nanos();
            if at < sent {
                continue;
            }
            if e.key == key {
                let m: Teammate = serde_json::from_slice(&e.value)?;
                match (m.status, &m.host) {
                    (TeammateStatus::Working, None) => {
                        woken.get_or_insert(at);
                    }
                    (TeammateStatus::Working, Some(_)) => {
                        claimed.get_or_insert(at);
                        epoch = Some(m.epoch);
                    }
                    (TeammateStatus::Idle, _) if m.turns > self.turns => {
                        self.turns = m.turns;
                        let claimed = claimed.context("idle again without a claim")?;
                        return Ok((
                            woken.unwrap_or(claimed),
                            claimed,
                            fenced.unwrap_or(claimed),
                            at,
                        ));
                    }
                    (TeammateStatus::Idle, _) => {
                        (woken, claimed, fenced, epoch) = (None, None, None, None)
                    }
                    _ => {}
                }
            } else if let Ok(c) = serde_json::from_slice::<Conversation>(&e.value)
                && Some(c.epoch) == epoch
            {
                fenced.get_or_insert(at);
            }
        }
    }
}

/// Idle teammate → `team.send` → its turn started on a worker, next to the raw mailbox hop.
/// `reader`: a second connection, on which the raw baseline's consumer receives (the
/// teammate's message crosses processes too).
pub(crate) async fn wake(
    bus: &Bus,
    reader: &Bus,
    pids: &Pids,
    role: &str,
    samples: usize,
) -> anyhow::Result<()> {
    let rss_before = (pids.supervisor_kib(), pids.workers_kib());
    let client = Client::new(bus.clone());
    let name = "w";
    let key = teammate_key(WAKE_TEAM, name);
    let kv = bus.kv(Bucket::Team).await?;
    let mut watcher = Watcher::spawned(&kv, &client, role, name).await?;
    let mut raw = RawProbe::new(bus, reader).await?;
    let mailbox = bus
        .js()
        .get_stream(bus.names().stream(StreamKind::Mailbox))
        .await?;
    let mut wakes = Vec::with_capacity(samples);
    let mut raws = Vec::with_capacity(samples);
    for i in 0..WARM_UP + samples.max(1) {
        tokio::time::sleep(GAP).await;
        let sent = Timestamp::now().0.unix_timestamp_nanos();
        let reply = client
            .request(&send_request(WAKE_TEAM, name, &format!("wake {i}")), ASK)
            .await
            .context("team.send")?;
        let answered = Timestamp::now().0.unix_timestamp_nanos();
        let (woken, claimed, fenced, idle) = watcher.turn(&key, sent).await?;
        let seq = *reply.seqs.first().context("team.send delivered nothing")?;
        let stored = mailbox
            .get_raw_message(seq)
            .await?
            .time
            .unix_timestamp_nanos();
        tokio::time::sleep(GAP).await;
        let r = raw.sample().await?;
        if i >= WARM_UP {
            wakes.push(Wake {
                sent,
                answered,
                stored,
                woken,
                claimed,
                fenced,
                idle,
            });
            raws.push(r);
        }
    }
    let (raw50, raw99) = p50_p99(&mut raws);
    let step = |f: Span| {
        let mut v: Vec<f64> = wakes.iter().map(|w| f(w).max(0) as f64 / 1e6).collect();
        p50_p99(&mut v)
    };
    let (claim50, claim99) = step(|w| w.claimed - w.sent);
    let (fence50, fence99) = step(|w| w.fenced - w.sent);
    outln!(
        "   raw mailbox hop (publish → waiting ordered consumer): p50 {raw50:.3} ms   p99 {raw99:.3} ms"
    );
    outln!(
        "   idle teammate woken by team.send → turn claimed by a worker: p50 {claim50:.3} ms   p99 {claim99:.3} ms   ({} turns, no-op scripted agent): {:.2}× the raw mailbox hop (target ≤ 2×)",
        wakes.len(),
        claim50 / raw50
    );
    outln!(
        "      → conversation fenced (the agent starts after one inbox read): p50 {fence50:.3} ms   p99 {fence99:.3} ms: {:.2}×",
        fence50 / raw50
    );
    // Workers reading the inboxes: the send stores the message, and the worker it reaches
    // claims the turn with one compare-and-set (no separate wake). Through the supervisor's
    // wake (workers that do not read the inboxes) the teammate is first marked working, then
    // its turn published, pulled and claimed.
    let parts: [(&str, Span); 6] = [
        ("send → inbox message stored", |w| w.stored - w.sent),
        (
            "stored → claimed (delivered to a worker, its compare-and-set)",
            |w| w.claimed - w.stored,
        ),
        (
            "of which: marked working before the claim (the supervisor's wake)",
            |w| w.claimed - w.woken,
        ),
        ("claimed → conversation fenced", |w| w.fenced - w.claimed),
        ("send → its answer", |w| w.answered - w.sent),
        ("fenced → idle again (agent, save, finish)", |w| {
            w.idle - w.fenced
        }),
    ];
    let breakdown: Vec<String> = parts
        .iter()
        .map(|(what, f)| format!("{what} {:.3}", step(*f).0))
        .collect();
    outln!(
        "      p50 steps (ms, server times): {}",
        breakdown.join("; ")
    );
    // Memory that follows turns, not teammates: the same reading after this teammate's
    // turns (one more teammate, many more turns).
    let turns = WARM_UP + samples.max(1);
    let delta = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (Some(a), Some(b)) => format!(
            "{:+.1} MiB ({:+.2} KiB per turn)",
            (a as f64 - b as f64) / 1024.0,
            (a as f64 - b as f64) / turns as f64
        ),
        _ => "n/a".to_owned(),
    };
    outln!(
        "   RSS over these {turns} turns of one teammate: supervisor {}, workers {}",
        delta(pids.supervisor_kib(), rss_before.0),
        delta(pids.workers_kib(), rss_before.1)
    );
    // The same message through flotilla-client's Mailer: `team.send`'s checks made by the
    // sender from its mirror of the teammates' entries, the message stored straight in the
    // inbox — no supervisor on its path.
    let mailed_to = "m";
    let mailed_key = teammate_key(WAKE_TEAM, mailed_to);
    let mut watcher = Watcher::spawned(&kv, &client, role, mailed_to).await?;
    let mailer = flotilla_client::Mailer::open(bus.clone()).await?;
    let mut mailed = Vec::with_capacity(samples);
    let mut raws = Vec::with_capacity(samples);
    for i in 0..WARM_UP + samples.max(1) {
        tokio::time::sleep(GAP).await;
        let sent = Timestamp::now().0.unix_timestamp_nanos();
        mailer
            .send(&send_request(WAKE_TEAM, mailed_to, &format!("mailed {i}")))
            .await?
            .map_err(|e| anyhow::anyhow!("the mailer refused: {}: {}", e.code, e.message))?;
        let (_, claimed, _, _) = watcher.turn(&mailed_key, sent).await?;
        tokio::time::sleep(GAP).await;
        let r = raw.sample().await?;
        if i >= WARM_UP {
            mailed.push((claimed - sent).max(0) as f64 / 1e6);
            raws.push(r);
        }
    }
    raw.close().await;
    let (m50, m99) = p50_p99(&mut mailed);
    let (mraw50, _) = p50_p99(&mut raws);
    outln!(
        "   idle teammate, the message sent by a Mailer (team.send's checks made by the sender from its mirror, stored straight in the inbox) → turn claimed by a worker: p50 {m50:.3} ms   p99 {m99:.3} ms   ({} turns): {:.2}× the raw mailbox hop p50 of {mraw50:.3} ms sampled in turn (target ≤ 2×)",
        mailed.len(),
        m50 / mraw50
    );
    // Mail published straight to the inbox — the supervisor's own mail to a run's lead, or any
    // sender with publish rights on the inbox — has no request to the supervisor on its path:
    // stored, delivered to a worker, claimed.
    let direct_to = "d";
    let direct_key = teammate_key(WAKE_TEAM, direct_to);
    let mut watcher = Watcher::spawned(&kv, &client, role, direct_to).await?;
    let subject = bus.names().teammate_inbox(WAKE_TEAM, direct_to, "bench");
    let mut direct = Vec::with_capacity(samples);
    for i in 0..WARM_UP + samples.max(1) {
        tokio::time::sleep(GAP).await;
        let post = TeammatePost {
            protocol: flotilla_model::PROTOCOL_VERSION,
            from: "bench".to_owned(),
            text: format!("direct {i}"),
        };
        let sent = Timestamp::now().0.unix_timestamp_nanos();
        bus.publish(subject.clone(), &post, None)
            .await
            .context("publishing to the inbox")?;
        let (_, claimed, _, _) = watcher.turn(&direct_key, sent).await?;
        if i >= WARM_UP {
            direct.push((claimed - sent).max(0) as f64 / 1e6);
        }
    }
    let (d50, d99) = p50_p99(&mut direct);
    outln!(
        "   idle teammate, mail published straight to its inbox (as the supervisor mails a run's lead) → turn claimed by a worker: p50 {d50:.3} ms   p99 {d99:.3} ms   ({} turns): {:.2}× the raw mailbox hop (target ≤ 2×)",
        direct.len(),
        d50 / raw50
    );
    Ok(())
}

/// Spawns `n` teammates, gives each one turn, waits until all are idle, and prints the
/// processes' memory and the consumers next to `before`.
pub(crate) async fn idle(
    bus: &Bus,
    pids: &Pids,
    role: &str,
    n: usize,
    before: Baseline,
) -> anyhow::Result<()> {
    let client = Client::new(bus.clone());
    let t0 = Instant::now();
    let name = |i: usize| format!("m{i}");
    for_each(n, |i| {
        let client = client.clone();
        let req = spawn_request(IDLE_TEAM, &name(i), role);
        async move { client.request(&req, ASK).await.map(|_| ()) }
    })
    .await
    .context("team.spawn")?;
    for_each(n, |i| {
        let client = client.clone();
        let req = send_request(IDLE_TEAM, &name(i), "hello");
        async move { client.request(&req, ASK).await.map(|_| ()) }
    })
    .await
    .context("team.send")?;
    // Each teammate's entries as they change (no team.mates polling: its replies would
    // be the supervisor's memory measured here): done once idle after a turn.
    let Baseline {
        reading: before,
        mut watch,
    } = before;
    let teammate_prefix = teammate_key(IDLE_TEAM, "");
    let mut done: BTreeSet<String> = BTreeSet::new();
    let mut sizes: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    while done.len() < n {
        let e = tokio::time::timeout_at(deadline, watch.next())
            .await
            .with_context(|| {
                format!(
                    "{} of {n} teammates ran their turn and went idle in 5 minutes",
                    done.len()
                )
            })?
            .context("the watch ended")??;
        sizes.insert(e.key.clone(), e.value.len());
        if e.key.starts_with(&teammate_prefix) {
            let m: Teammate = serde_json::from_slice(&e.value)?;
            if m.status == TeammateStatus::Idle && m.turns >= 1 {
                done.insert(e.key);
            }
        }
    }
    let ready = t0.elapsed();
    // Let the last turns' buffers and the supervisor's batches settle before reading memory.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = read(bus, pids).await?;
    drop(watch);
    let stored: usize = sizes.values().sum();
    outln!(
        "   {n} teammates spawned, each ran one turn and went idle in {:.1} s",
        ready.as_secs_f64()
    );
    let mib = |k: Option<u64>| k.map_or("n/a".to_owned(), |k| format!("{:.1}", k as f64 / 1024.0));
    let per = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (Some(a), Some(b)) if n > 0 => {
            format!("{:+.2} KiB per teammate", (a as f64 - b as f64) / n as f64)
        }
        _ => "n/a".to_owned(),
    };
    outln!(
        "   supervisor RSS: {} MiB with no teammate, {} MiB with {n} idle: {}",
        mib(before.supervisor_kib),
        mib(after.supervisor_kib),
        per(after.supervisor_kib, before.supervisor_kib)
    );
    outln!(
        "   worker RSS ({} process(es), summed): {} MiB with no teammate, {} MiB with {n} idle: {}",
        pids.workers.len(),
        mib(before.workers_kib),
        mib(after.workers_kib),
        per(after.workers_kib, before.workers_kib)
    );
    outln!(
        "      (their entries and conversations hold {:.2} KiB per teammate in the bucket)",
        stored as f64 / 1024.0 / n.max(1) as f64
    );
    let created: Vec<&String> = after.consumers.difference(&before.consumers).collect();
    outln!(
        "   JetStream consumers on the installation's streams and buckets: {} with no teammate, {} with {n} idle; created meanwhile: {}",
        before.consumers.len(),
        after.consumers.len(),
        if created.is_empty() {
            "none (no consumer per teammate)".to_owned()
        } else {
            format!("{} ({:?})", created.len(), created)
        }
    );
    Ok(())
}

/// Runs `f(0..n)` with [`IN_FLIGHT`] at once; the first error ends it.
async fn for_each<F, Fut>(n: usize, f: F) -> Result<(), flotilla_client::ClientError>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Result<(), flotilla_client::ClientError>>,
{
    let mut running = futures::stream::FuturesUnordered::new();
    for i in 0..n {
        running.push(f(i));
        if running.len() >= IN_FLIGHT
            && let Some(r) = running.next().await
        {
            r?;
        }
    }
    while let Some(r) = running.next().await {
        r?;
    }
    Ok(())
}

/// Plain JetStream: a publish to [`RAW_SUBJECT`] (awaiting its PubAck) → an ordered consumer
/// already waiting on another connection receives it.
struct RawProbe {
    js: async_nats::jetstream::Context,
    body: Bytes,
    seen: mpsc::UnboundedReceiver<(Instant, bool)>,
    receiver: tokio::task::JoinHandle<()>,
}

impl RawProbe {
    async fn new(bus: &Bus, reader: &Bus) -> anyhow::Result<Self> {
        let js = bus.js().clone();
        let _ = js.delete_stream(RAW_STREAM).await;
        js.create_stream(StreamConfig {
            name: RAW_STREAM.into(),
            subjects: vec![RAW_SUBJECT.into()],
            ..Default::default()
        })
        .await?;
        let consumer = reader
            .js()
            .get_stream(RAW_STREAM)
            .await?
            .create_consumer(pull::OrderedConfig {
                filter_subject: RAW_SUBJECT.into(),
                deliver_policy: DeliverPolicy::New,
                ..Default::default()
            })
            .await?;
        let mut messages = consumer.messages().await?;
        let (tx, seen) = mpsc::unbounded_channel();
        let receiver = tokio::spawn(async move {
            while let Some(m) = messages.next().await {
                if tx.send((Instant::now(), m.is_ok())).is_err() {
                    break;
                }
            }
        });
        // A message the size of a teammate message: a post with a short text.
        let body = Bytes::from(serde_json::to_vec(&serde_json::json!({
            "protocol": 1, "from": "bench", "text": "wake 100"
        }))?);
        Ok(Self {
            js,
            body,
            seen,
            receiver,
        })
    }

    /// One message, one in flight: ms from the publish call to the consumer receiving it.
    async fn sample(&mut self) -> anyhow::Result<f64> {
        let t0 = Instant::now();
        self.js
            .publish(RAW_SUBJECT, self.body.clone())
            .await?
            .await?;
        let (t1, ok) = tokio::time::timeout(Duration::from_secs(10), self.seen.recv())
            .await
            .context("the raw consumer saw no message for 10 s")?
            .context("the raw consumer ended")?;
        anyhow::ensure!(ok, "the raw consumer failed");
        Ok(ms(t1 - t0))
    }

    async fn close(self) {
        self.receiver.abort();
        let _ = self.js.delete_stream(RAW_STREAM).await;
    }
}
