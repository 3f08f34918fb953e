//! The `collab` section (`flotilla bench --only collab`): the collaboration layer (workspace topics, topic-gated
//! dispatch, mailboxes) against raw JetStream measured in the same run.
//!
//! Two parts, each against the bench's nats-server (prefix `flbench`):
//!
//! * **with the services** — a `flotilla coordinator` and worker processes with the no-op
//!   `scripted` agent, as in the `flotilla` section. Hops are read from run logs exactly as
//!   the dependency hop is ([`chain_hops`]): a server timestamp → the worker's
//!   `started_at` (same host clock).
//!   - *dependency hop*: chains `s0 → s1 → …`; result stored → dependent started.
//!   - *topic hop*: the same chain where each task consumes the topic its predecessor
//!     produces (automatic produce) instead of depending on it.
//!   - *gated dispatch*: a run of tasks `g<i>` each consuming its own topic `gate_<i>`, which
//!     no task produces; the bench appends each topic's entry as an outside writer
//!     (`Workspace::append`, one at a time, after the previous consumer finished); the entry's
//!     server timestamp → the consumer's agent started. The path: the coordinators' workspace
//!     watcher → `topic_written` in the run log → the run's step → dispatch → a worker.
//! * **client and server only** (the services stopped first, so no coordinator consumes the
//!   entries written here) — each next to the plain JetStream operation it is built on:
//!   - *watch*: `Workspace::append` → the entry out of a live `Workspace::watch`, vs a publish
//!     → an ordered consumer (the consumer kind `watch` uses) receiving it; one in flight.
//!   - *paging*: appending N entries to one topic with 256 in flight vs raw publishes of the
//!     same bytes; then reading them with `Workspace::read` pages (default and maximum limit)
//!     vs an ordered consumer reading the same N stored messages (no decoding). Each is
//!     bracketed by two halves (publishes) or two passes (reads) of its baseline.
//!   - *mailbox*: `Mailbox::send` → `Mailbox::receive` (already waiting) returns it, vs a
//!     JetStream publish → an ordered consumer already waiting, at the same pacing. Both store
//!     the message and deliver it to a waiting reader; a core request/reply would skip the
//!     store, which every mailbox message needs, so it is not the comparable.

use std::time::{Duration, Instant};

use anyhow::Context;
use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use async_nats::jetstream::stream::Config as StreamConfig;
use bytes::Bytes;
use flotilla_bus::{Bus, NatsOptions};
use flotilla_client::Client;
use flotilla_context::{Clients, Scope};
use flotilla_model::event::{Event, WorkflowPhase};
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::mailbox::MailboxKind;
use flotilla_model::plan::{DataflowValidation, Plan, PlanConfig, Subtask};
use flotilla_model::run::RunStatus;
use flotilla_model::runlog::RunInput;
use flotilla_model::subjects::StreamKind;
use flotilla_model::submit::SubmitRequest;
use flotilla_model::workspace::WorkspaceWrite;
use futures::{StreamExt, TryStreamExt};
use serde_json::{Map, Value};
use tokio::sync::mpsc;

use crate::harness::plans::{chain_hops, chain_plan};
use crate::harness::processes::Processes;
use crate::harness::services::{Services, has_listener, noop_config, spawn_service};
use crate::harness::stats::{ms, p50_p99};
use crate::harness::submit::{SubmitVia, submit_via};

/// Sizes of the collaboration section.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct CollabArgs {
    /// Collab: rounds of one dependency chain, one topic chain (both `--chain` long) and one
    /// gated run, back to back so the three see the same machine.
    #[arg(long, default_value_t = 10)]
    collab_rounds: usize,
    /// Collab: tasks per gated run, each waiting for its own topic (one sample each).
    #[arg(long, default_value_t = 100)]
    gated_tasks: usize,
    /// Collab: samples of the append → watcher latency (and of its raw baseline).
    #[arg(long, default_value_t = 3_000)]
    watch_samples: usize,
    /// Collab: entries written to one topic and read back in pages.
    #[arg(long, default_value_t = 100_000)]
    page_entries: usize,
    /// Collab: samples of the mailbox send → receiver latency (and of its raw baseline).
    #[arg(long, default_value_t = 1_000)]
    mailbox_samples: usize,
}

/// Stream of the raw baselines (deleted when done).
const RAW_STREAM: &str = "FLBENCH_COLLAB_RAW";
/// Samples dropped at the start of each latency measurement (connections, consumers warm).
const WARM_UP: usize = 20;
/// Appends and raw publishes in flight while filling the paging topic (fewer than the raw
/// section's 512: on a loaded 2-core machine 512 outstanding PubAcks can outlast the request
/// timeout).
const IN_FLIGHT: usize = 256;
/// Pause before each mailbox sample, so the receiver is back asleep in `receive` (it needs
/// a few hundred µs to re-subscribe and re-read); the raw baseline keeps the same pacing.
const MAILBOX_GAP: Duration = Duration::from_millis(5);

/// An entry the size of an automatic-produce entry with a short summary.
fn entry(i: usize) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("subtask_id".into(), "fetch_data".into());
    m.insert("summary".into(), "x".repeat(200).into());
    m.insert("numeric_value".into(), 6.7.into());
    m.insert("i".into(), i.into());
    m
}

/// The bench acting as an outside writer (an operator scope) on `root`'s workspace.
fn operator(bus: &Bus, root: RunId) -> anyhow::Result<Clients> {
    let scope = Scope::operator(bus.names().clone(), root, root, root.to_string())
        .with_by("flotilla-bench");
    Ok(Clients::new(bus.clone(), scope)?)
}

/// Runs the section: the measurements with the services, then without.
pub(crate) async fn run(args: &CollabArgs, services: &Services, url: &str) -> anyhow::Result<()> {
    let mut opts = NatsOptions::with_url(url);
    opts.prefix = "flbench".into();
    let bus = Bus::connect(&opts, "flotilla-bench").await?;
    bus.provision(&Default::default()).await?;

    let with = with_services(args, services, url, &bus).await?;
    let without = without_services(args, &opts).await?;

    outln!(
        "== collaboration (coordinator + {} worker process(es) × {} slots, no-op scripted agent)",
        services.workers,
        services.concurrency
    );
    let (d50, d99) = with.dependency;
    let (t50, t99) = with.topic;
    let (g50, g99) = with.gated;
    outln!(
        "   dependency hop (result stored → dependent starts):     p50 {d50:.3} ms   p99 {d99:.3} ms   ({} hops)",
        with.hops.0
    );
    outln!(
        "   topic hop (result stored → consumer starts, produce):  p50 {t50:.3} ms   p99 {t99:.3} ms   ({} hops) = {:.2}× / {:.2}× the dependency hop",
        with.hops.1,
        t50 / d50,
        t99 / d99
    );
    outln!(
        "   gated dispatch (outside entry stored → consumer starts): p50 {g50:.3} ms   p99 {g99:.3} ms   ({} tasks) = {:.2}× / {:.2}× the dependency hop (target p50 ≤ 1.5×)",
        with.hops.2,
        g50 / d50,
        g99 / d99
    );
    outln!("   -- services stopped: client and server only --");
    let w = &without;
    outln!(
        "   workspace append → live watcher:          p50 {:.3} ms   p99 {:.3} ms   ({} entries)",
        w.watch.0,
        w.watch.1,
        w.watch_n
    );
    outln!(
        "   raw: publish → ordered consumer receives:  p50 {:.3} ms   p99 {:.3} ms   → {:.2}× / {:.2}× raw",
        w.raw_watch.0,
        w.raw_watch.1,
        w.watch.0 / w.raw_watch.0,
        w.watch.1 / w.raw_watch.1
    );
    outln!(
        "   append {} entries to one topic, {IN_FLIGHT} in flight: {:>8.0} entries/s; raw publish {:>8.0} msgs/s → {:.1} % of raw",
        w.pages_n,
        w.append_rate,
        w.raw_publish_rate,
        100.0 * w.append_rate / w.raw_publish_rate
    );
    for (limit, rate, pages) in &w.read_rates {
        outln!(
            "   read them, Workspace::read pages of {limit:>4}: {rate:>8.0} entries/s ({pages} pages) → {:.1} % of raw",
            100.0 * rate / w.raw_read_rate
        );
    }
    outln!(
        "   raw: ordered consumer reads the same messages: {:>8.0} msgs/s (before and after the pages)",
        w.raw_read_rate
    );
    outln!(
        "   mailbox send → waiting receive returns:    p50 {:.3} ms   p99 {:.3} ms   ({} messages; send alone p50 {:.3} ms)",
        w.mailbox.0,
        w.mailbox.1,
        w.mailbox_n,
        w.send_p50
    );
    outln!(
        "   raw: JetStream publish → waiting ordered consumer (same pacing): p50 {:.3} ms   p99 {:.3} ms   → {:.2}× / {:.2}× raw",
        w.raw_mailbox.0,
        w.raw_mailbox.1,
        w.mailbox.0 / w.raw_mailbox.0,
        w.mailbox.1 / w.raw_mailbox.1
    );
    Ok(())
}

/// The figures measured with the services running.
struct WithServices {
    dependency: (f64, f64),
    topic: (f64, f64),
    gated: (f64, f64),
    /// Samples: dependency hops, topic hops, gated tasks.
    hops: (usize, usize, usize),
}

async fn with_services(
    args: &CollabArgs,
    services: &Services,
    url: &str,
    bus: &Bus,
) -> anyhow::Result<WithServices> {
    let dir = tempfile::Builder::new()
        .prefix("flotilla-bench-collab-")
        .tempdir()?;
    let exe = &services.exe;
    let config = noop_config(dir.path(), url, services.concurrency, has_listener(exe))?;
    let mut procs = Processes(vec![(
        "coordinator".into(),
        spawn_service(exe, &config, &["coordinator"])?,
    )]);
    for i in 0..services.workers {
        procs.0.push((
            format!("worker {i}"),
            spawn_service(exe, &config, &["worker"])?,
        ));
    }
    let client = Client::new(bus.clone());
    let via = services.via;
    let warm = submit_via(bus, SubmitRequest::new(topic_chain_plan(3)), via).await?;
    let outcome = client.wait(warm, Duration::from_secs(60)).await?;
    anyhow::ensure!(
        outcome.status == RunStatus::Succeeded,
        "the warm-up topic chain {}: do the services support consumes/produces?",
        outcome.status
    );
    anyhow::ensure!(
        chain_hops(&client, warm).await?.iter().all(|h| *h >= 0.0),
        "the services started a consumer before its topic had an entry: {} predates gating on consumed topics",
        exe.display()
    );

    // The three measurements alternate, so all see the same (shared, noisy) machine.
    let (mut dependency, mut topic, mut gated) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.collab_rounds.max(1) {
        for (plan, into) in [
            (chain_plan(services.chain), &mut dependency),
            (topic_chain_plan(services.chain), &mut topic),
        ] {
            let run = submit_via(bus, SubmitRequest::new(plan), via).await?;
            let outcome = client.wait(run, Duration::from_secs(300)).await?;
            anyhow::ensure!(
                outcome.status == RunStatus::Succeeded,
                "a chain {}",
                outcome.status
            );
            into.extend(chain_hops(&client, run).await?);
        }
        gated.extend(gated_run(bus, &client, args.gated_tasks.max(1), via).await?);
    }
    drop(procs);
    Ok(WithServices {
        hops: (dependency.len(), topic.len(), gated.len()),
        dependency: p50_p99(&mut dependency),
        topic: p50_p99(&mut topic),
        gated: p50_p99(&mut gated),
    })
}

/// `s0 → s1 → …` where each task consumes the topic its predecessor produces: the data
/// flow, not a dependency, orders the chain.
fn topic_chain_plan(n: usize) -> Plan {
    let subtasks = (0..n)
        .map(|i| {
            let mut t = Subtask::new(&format!("s{i}"), "no-op");
            if i + 1 < n {
                t.produces = vec![format!("hop_{i}")];
            }
            if i > 0 {
                t.consumes = vec![format!("hop_{}", i - 1)];
            }
            t
        })
        .collect();
    Plan {
        fork: None,
        name: Some("bench-topic-chain".into()),
        query: None,
        subtasks,
        config: PlanConfig::default(),
    }
}

/// Tasks `g<i>`, each consuming topic `gate_<i>`, which no task produces (lenient data
/// flow: an outside writer provides it).
fn gated_plan(n: usize) -> Plan {
    let subtasks = (0..n)
        .map(|i| {
            let mut t = Subtask::new(&format!("g{i}"), "no-op");
            t.consumes = vec![format!("gate_{i}")];
            t
        })
        .collect();
    Plan {
        fork: None,
        name: Some("bench-gated".into()),
        query: None,
        subtasks,
        config: PlanConfig {
            dataflow_validation: DataflowValidation::Lenient,
            ..PlanConfig::default()
        },
    }
}

/// One gated run: once it has started, the bench appends each task's topic in turn and
/// waits for that task to succeed. Returns entry stored → agent started, per task (ms).
async fn gated_run(
    bus: &Bus,
    client: &Client,
    tasks: usize,
    via: SubmitVia,
) -> anyhow::Result<Vec<f64>> {
    let run = submit_via(bus, SubmitRequest::new(gated_plan(tasks)), via).await?;
    let events = client.events(run).await?;
    futures::pin_mut!(events);
    // Wait for the run's start to be recorded (its `run_started` event goes out with the
    // record), so every sample is a settled run's step.
    let mut next_event = async |want: Option<&str>| -> anyhow::Result<()> {
        loop {
            let e = tokio::time::timeout(Duration::from_secs(30), events.next())
                .await
                .context("no event of the gated run for 30 s")?
                .context("the event stream ended")??;
            let Event::Workflow(w) = e.event else {
                continue;
            };
            match (w.phase, want) {
                (WorkflowPhase::RunStarted, None) => return Ok(()),
                (WorkflowPhase::TaskSucceeded, Some(task))
                    if e.task_id.as_ref().is_some_and(|t| t.as_str() == task) =>
                {
                    return Ok(());
                }
                (p, _) if p.ends_run() || p == WorkflowPhase::TaskFailed => {
                    anyhow::bail!(
                        "the gated run ended early ({p:?}, error {:?}): its tasks did not wait for their topics",
                        w.error
                    )
                }
                _ => {}
            }
        }
    };
    next_event(None).await?;
    let ws = operator(bus, run)?.workspace();
    let mut appended = Vec::with_capacity(tasks);
    for i in 0..tasks {
        let a = ws.append(&format!("gate_{i}"), entry(i)).await?;
        appended.push((format!("g{i}"), a.seq));
        next_event(Some(&format!("g{i}"))).await?;
    }
    let outcome = client.wait(run, Duration::from_secs(60)).await?;
    anyhow::ensure!(
        outcome.status == RunStatus::Succeeded,
        "a gated run {}",
        outcome.status
    );

    // Entry stored (server time of the workspace message) → agent started (worker clock).
    let micros = |t: &flotilla_model::time::Timestamp| (t.0.unix_timestamp_nanos() / 1000) as i64;
    let store = flotilla_client::open_store(bus).await?;
    let mut started = std::collections::HashMap::new();
    for (_, _, e) in store.history(run).await? {
        if let RunInput::TaskResult(r) = e.input
            && let Some(s) = &r.started_at
        {
            started.insert(r.task_id.to_string(), micros(s));
        }
    }
    let stream = bus
        .js()
        .get_stream(bus.names().stream(StreamKind::Workspace))
        .await?;
    let mut samples = Vec::with_capacity(tasks);
    for (task, seq) in appended {
        let stored = stream.get_raw_message(seq).await?;
        let stored_us = (stored.time.unix_timestamp_nanos() / 1000) as i64;
        let start = started
            .get(&task)
            .with_context(|| format!("no start time of {task}"))?;
        samples.push((start - stored_us) as f64 / 1000.0);
    }
    Ok(samples)
}

/// The figures measured with the services stopped.
struct WithoutServices {
    watch: (f64, f64),
    raw_watch: (f64, f64),
    watch_n: usize,
    pages_n: usize,
    append_rate: f64,
    raw_publish_rate: f64,
    /// Page limit, entries/s, pages.
    read_rates: Vec<(usize, f64, usize)>,
    raw_read_rate: f64,
    mailbox: (f64, f64),
    raw_mailbox: (f64, f64),
    send_p50: f64,
    mailbox_n: usize,
}

async fn without_services(
    args: &CollabArgs,
    opts: &NatsOptions,
) -> anyhow::Result<WithoutServices> {
    let writer = Bus::connect(opts, "flotilla-bench-writer").await?;
    let reader = Bus::connect(opts, "flotilla-bench-reader").await?;
    let raw_js = async_nats::jetstream::new(writer.client().clone());
    let _ = raw_js.delete_stream(RAW_STREAM).await;
    raw_js
        .create_stream(StreamConfig {
            name: RAW_STREAM.into(),
            subjects: vec!["flbench-collab.>".into()],
            ..Default::default()
        })
        .await?;
    let root = RunId::new();
    let ws_body = Bytes::from(serde_json::to_vec(&WorkspaceWrite {
        protocol: flotilla_model::PROTOCOL_VERSION,
        entry: entry(0),
        writer: Some(operator(&writer, root)?.scope().writer()),
    })?);
    let samples = args.watch_samples.max(1);

    // Append → live watcher and its raw baseline, sample by sample in turn.
    let mut watch_probe = WatchProbe::new(&writer, &reader, root).await?;
    let mut raw_probe =
        RawProbe::new(&writer, &reader, "flbench-collab.watch", ws_body.clone()).await?;
    let (mut watch, mut raw_watch) = (Vec::new(), Vec::new());
    for i in 0..WARM_UP + samples {
        let (w, r) = (watch_probe.sample().await?, raw_probe.sample().await?);
        if i >= WARM_UP {
            watch.push(w);
            raw_watch.push(r);
        }
    }
    drop((watch_probe, raw_probe));

    // Paging: fill one topic, then read it back. Each Flotilla measurement is bracketed by
    // two halves of its raw baseline, so a change of machine load mid-way hits both.
    let n = args.page_entries.max(1);
    let ws = operator(&writer, root)?.workspace();
    let raw_publish = async |count: usize| -> anyhow::Result<Duration> {
        let t0 = Instant::now();
        futures::stream::iter(0..count)
            .map(|_| {
                let (js, body) = (raw_js.clone(), ws_body.clone());
                async move {
                    js.publish("flbench-collab.pages", body)
                        .await?
                        .await
                        .map_err(anyhow::Error::from)
                }
            })
            .buffer_unordered(IN_FLIGHT)
            .try_for_each(|_| async { Ok(()) })
            .await?;
        Ok(t0.elapsed())
    };
    let mut raw_publish_time = raw_publish(n / 2).await?;
    let t0 = Instant::now();
    futures::stream::iter(0..n)
        .map(|i| {
            let ws = ws.clone();
            async move { ws.append("pages", entry(i)).await }
        })
        .buffer_unordered(IN_FLIGHT)
        .try_for_each(|_| async { Ok(()) })
        .await?;
    let append_rate = n as f64 / t0.elapsed().as_secs_f64();
    raw_publish_time += raw_publish(n - n / 2).await?;
    let raw_publish_rate = n as f64 / raw_publish_time.as_secs_f64();

    let subject = reader.names().workspace(root, "pages");
    let mut raw_read_rates = vec![raw_read(&reader, &subject, n).await?];
    let read = operator(&reader, root)?.workspace();
    let mut read_rates = Vec::new();
    for limit in [
        flotilla_model::workspace::DEFAULT_READ_LIMIT,
        flotilla_model::workspace::MAX_READ_LIMIT,
    ] {
        let t0 = Instant::now();
        let (mut since, mut total, mut pages) = (0, 0, 0);
        loop {
            let page = read.read("pages", since, Some(limit)).await?;
            total += page.entries.len();
            pages += 1;
            since = page.next_since_seq;
            if !page.more {
                break;
            }
        }
        let rate = total as f64 / t0.elapsed().as_secs_f64();
        anyhow::ensure!(total == n, "read {total} entries of {n}");
        read_rates.push((limit, rate, pages));
    }
    raw_read_rates.push(raw_read(&reader, &subject, n).await?);
    // The harmonic mean: the rate of reading the messages twice.
    let raw_read_rate = 2.0 / raw_read_rates.iter().map(|r| 1.0 / r).sum::<f64>();

    // Mailbox send → a receiver already waiting, and its raw baseline at the same pacing,
    // sample by sample in turn.
    let mailbox_n = args.mailbox_samples.max(1);
    let post = serde_json::json!({
        "protocol": flotilla_model::PROTOCOL_VERSION, "kind": "info", "from": "sender",
        "to": "receiver", "payload": {"note": "x".repeat(200)}, "n": 1,
        "sender": operator(&writer, root)?.scope().writer()
    });
    let mut mailbox_probe = MailboxProbe::new(&writer, &reader, root).await?;
    let mut raw_probe = RawProbe::new(
        &writer,
        &reader,
        "flbench-collab.mbox",
        Bytes::from(serde_json::to_vec(&post)?),
    )
    .await?;
    let (mut mailbox, mut send, mut raw_mailbox) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..WARM_UP + mailbox_n {
        tokio::time::sleep(MAILBOX_GAP).await;
        let (m, s) = mailbox_probe.sample().await?;
        tokio::time::sleep(MAILBOX_GAP).await;
        let r = raw_probe.sample().await?;
        if i >= WARM_UP {
            mailbox.push(m);
            send.push(s);
            raw_mailbox.push(r);
        }
    }
    drop((mailbox_probe, raw_probe));

    // Leave nothing behind for a coordinator of a shared server (--nats-url).
    let _ = raw_js.delete_stream(RAW_STREAM).await;
    for (kind, filter) in [
        (StreamKind::Workspace, writer.names().workspace_all(root)),
        (
            StreamKind::Mailbox,
            format!("{}.mbox.{root}.>", writer.names().prefix()),
        ),
    ] {
        if let Ok(s) = writer.js().get_stream(writer.names().stream(kind)).await {
            let _ = s.purge().filter(filter).await;
        }
    }
    Ok(WithoutServices {
        watch: p50_p99(&mut watch),
        raw_watch: p50_p99(&mut raw_watch),
        watch_n: samples,
        pages_n: n,
        append_rate,
        raw_publish_rate,
        read_rates,
        raw_read_rate,
        mailbox: p50_p99(&mut mailbox),
        raw_mailbox: p50_p99(&mut raw_mailbox),
        send_p50: p50_p99(&mut send).0,
        mailbox_n,
    })
}

/// A background task, aborted when dropped.
struct Background(tokio::task::JoinHandle<()>);

impl Drop for Background {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// `Workspace::append` (on the writer connection) → the entry out of a live
/// `Workspace::watch` (on the reader connection).
struct WatchProbe {
    ws: flotilla_context::Workspace,
    seen: mpsc::UnboundedReceiver<(Instant, Result<u64, flotilla_context::ContextError>)>,
    next: usize,
    _watcher: Background,
}

impl WatchProbe {
    async fn new(writer: &Bus, reader: &Bus, root: RunId) -> anyhow::Result<Self> {
        let mut entries = Box::pin(
            operator(reader, root)?
                .workspace()
                .watch(Some("latency"), 0)
                .await?,
        );
        let (tx, seen) = mpsc::unbounded_channel();
        let watcher = tokio::spawn(async move {
            while let Some(e) = entries.next().await {
                if tx.send((Instant::now(), e.map(|e| e.seq))).is_err() {
                    break;
                }
            }
        });
        Ok(Self {
            ws: operator(writer, root)?.workspace(),
            seen,
            next: 0,
            _watcher: Background(watcher),
        })
    }

    /// One entry, one in flight: ms from the append call to the watcher yielding it.
    async fn sample(&mut self) -> anyhow::Result<f64> {
        self.next += 1;
        let t0 = Instant::now();
        let a = self.ws.append("latency", entry(self.next)).await?;
        let (t1, seq) = tokio::time::timeout(Duration::from_secs(10), self.seen.recv())
            .await
            .context("the watcher saw no entry for 10 s")?
            .context("the watch ended")?;
        anyhow::ensure!(seq? == a.seq, "the watcher saw another entry");
        Ok(ms(t1 - t0))
    }
}

/// Plain JetStream: a publish of `body` to `subject` (awaiting its PubAck) → an ordered
/// consumer already waiting on the reader connection receives it.
struct RawProbe {
    js: async_nats::jetstream::Context,
    subject: &'static str,
    body: Bytes,
    seen: mpsc::UnboundedReceiver<(Instant, bool)>,
    _receiver: Background,
}

impl RawProbe {
    async fn new(
        writer: &Bus,
        reader: &Bus,
        subject: &'static str,
        body: Bytes,
    ) -> anyhow::Result<Self> {
        let consumer = async_nats::jetstream::new(reader.client().clone())
            .get_stream(RAW_STREAM)
            .await?
            .create_consumer(pull::OrderedConfig {
                filter_subject: subject.into(),
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
        Ok(Self {
            js: async_nats::jetstream::new(writer.client().clone()),
            subject,
            body,
            seen,
            _receiver: Background(receiver),
        })
    }

    /// One message, one in flight: ms from the publish call to the consumer receiving it.
    async fn sample(&mut self) -> anyhow::Result<f64> {
        let t0 = Instant::now();
        self.js
            .publish(self.subject, self.body.clone())
            .await?
            .await?;
        let (t1, ok) = tokio::time::timeout(Duration::from_secs(10), self.seen.recv())
            .await
            .context("the raw consumer saw no message for 10 s")?
            .context("the raw consumer ended")?;
        anyhow::ensure!(ok, "the raw consumer failed");
        Ok(ms(t1 - t0))
    }
}

/// `Mailbox::send` (as `sender`, on the writer connection) → `Mailbox::receive` of
/// `receiver` (on the reader connection, already waiting) returns it.
struct MailboxProbe {
    sender: flotilla_context::Mailbox,
    got: mpsc::UnboundedReceiver<(Instant, Result<usize, flotilla_context::ContextError>)>,
    next: usize,
    _receiver: Background,
}

impl MailboxProbe {
    async fn new(writer: &Bus, reader: &Bus, root: RunId) -> anyhow::Result<Self> {
        let as_task = |bus: &Bus, task: &str| {
            Clients::new(
                bus.clone(),
                Scope::operator(bus.names().clone(), root, root, root.to_string())
                    .with_task(TaskId::new(task)),
            )
            .map(|c| c.mailbox())
        };
        let inbox = as_task(reader, "receiver")?;
        let (tx, got) = mpsc::unbounded_channel();
        let receiver = tokio::spawn(async move {
            loop {
                let page = inbox.receive(None, Duration::from_secs(30)).await;
                let got = page.map(|p| p.messages.len());
                let stop = got.is_err();
                if tx.send((Instant::now(), got)).is_err() || stop {
                    break;
                }
            }
        });
        Ok(Self {
            sender: as_task(writer, "sender")?,
            got,
            next: 0,
            _receiver: Background(receiver),
        })
    }

    /// One message: ms from the send call to the receiver's `receive` returning it, and ms
    /// of the send call alone.
    async fn sample(&mut self) -> anyhow::Result<(f64, f64)> {
        self.next += 1;
        let t0 = Instant::now();
        self.sender
            .send(
                "receiver",
                MailboxKind::Info,
                serde_json::json!({"note": "x".repeat(200), "i": self.next}),
                None,
            )
            .await?;
        let sent = t0.elapsed();
        let (t1, got) = tokio::time::timeout(Duration::from_secs(10), self.got.recv())
            .await
            .context("the receiver got nothing for 10 s")?
            .context("the receiver stopped")?;
        anyhow::ensure!(got? == 1, "the receiver should get one message per send");
        Ok((ms(t1 - t0), ms(sent)))
    }
}

/// An ordered consumer reading the `n` stored messages of `subject` from the workspace
/// stream: messages/s.
async fn raw_read(reader: &Bus, subject: &str, n: usize) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    let consumer = reader
        .js()
        .get_stream(reader.names().stream(StreamKind::Workspace))
        .await?
        .create_consumer(pull::OrderedConfig {
            filter_subject: subject.into(),
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let mut got = 0;
    while got < n {
        let m = tokio::time::timeout(Duration::from_secs(30), messages.next())
            .await
            .context("the ordered consumer stalled for 30 s")?
            .context("the ordered consumer ended")?;
        std::hint::black_box(m?);
        got += 1;
    }
    Ok(n as f64 / t0.elapsed().as_secs_f64())
}
