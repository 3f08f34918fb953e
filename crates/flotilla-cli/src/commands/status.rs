//! `flotilla status`: the deployment at a glance — NATS, the streams, which services answer,
//! the pools and their workers, pending approvals, and durable consumers nobody pulls from —
//! the same on a laptop (`flotilla up`) and on a cluster.
//!
//! Exit code: 0 when nothing needs attention, 1 when something does (each said on a line
//! starting `attention:`), 2 when NATS cannot be reached or the deployment was never
//! provisioned (the error says what to do).

use std::collections::{BTreeMap, HashMap};
use std::process::ExitCode;
use std::time::Duration;

use flotilla_bus::Bus;
use flotilla_client::Client;
use flotilla_model::subjects::StreamKind;
use futures::StreamExt;
use serde::Serialize;

use crate::config::Config;

/// How long the services' answers to a ping are collected.
const PING_WINDOW: Duration = Duration::from_millis(600);
/// Between the two looks at the consumers: one that has work, no pull waiting and no ack
/// progress on both is not being pulled.
const CONSUMER_GAP: Duration = Duration::from_millis(1500);

/// One instance of a service that answered its ping.
#[derive(Debug, Clone, Serialize)]
struct Instance {
    id: String,
    version: String,
}

/// A durable consumer with work and nobody pulling.
#[derive(Debug, Clone, Serialize)]
struct Unpulled {
    stream: String,
    consumer: String,
    pending: u64,
}

/// A pool: its live workers and their slots.
#[derive(Debug, Clone, Default, Serialize)]
struct PoolStatus {
    workers: usize,
    busy: usize,
    slots: usize,
}

/// The whole answer (`--json`).
#[derive(Debug, Serialize)]
struct Status {
    nats: NatsStatus,
    coordinators: Vec<Instance>,
    supervisors: Vec<Instance>,
    pools: BTreeMap<String, PoolStatus>,
    /// Pending approvals, when a coordinator answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pending_approvals: Option<usize>,
    unpulled: Vec<Unpulled>,
    attention: Vec<String>,
}

#[derive(Debug, Serialize)]
struct NatsStatus {
    url: String,
    server: String,
    version: String,
    prefix: String,
}

/// Collects the answers to `$SRV.PING.<name>` for a short while.
async fn ping(bus: &Bus, name: &str) -> anyhow::Result<Vec<Instance>> {
    let inbox = bus.client().new_inbox();
    let mut sub = bus.client().subscribe(inbox.clone()).await?;
    bus.client()
        .publish_with_reply(format!("$SRV.PING.{name}"), inbox, "".into())
        .await?;
    bus.client().flush().await?;
    let mut out = Vec::new();
    let until = tokio::time::Instant::now() + PING_WINDOW;
    while let Ok(Some(msg)) = tokio::time::timeout_at(until, sub.next()).await {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&msg.payload) else {
            continue;
        };
        out.push(Instance {
            id: v["id"].as_str().unwrap_or_default().to_owned(),
            version: v["version"].as_str().unwrap_or_default().to_owned(),
        });
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

/// Every durable consumer: `(stream, consumer) → (pending, waiting pulls, ack floor)`.
async fn consumers(bus: &Bus) -> anyhow::Result<HashMap<(String, String), (u64, usize, u64)>> {
    let mut out = HashMap::new();
    for kind in StreamKind::ALL {
        let name = bus.names().stream(kind);
        let stream = bus.js().get_stream(&name).await?;
        let mut infos = stream.consumers();
        while let Some(info) = infos.next().await {
            let info = info?;
            let Some(durable) = info.config.durable_name.clone() else {
                continue;
            };
            out.insert(
                (name.clone(), durable),
                (
                    info.num_pending,
                    info.num_waiting,
                    info.ack_floor.stream_sequence,
                ),
            );
        }
    }
    Ok(out)
}

fn versions(instances: &[Instance]) -> String {
    let mut v: Vec<&str> = instances.iter().map(|i| i.version.as_str()).collect();
    v.sort_unstable();
    v.dedup();
    v.join(", ")
}

pub(crate) async fn status(config: &Config, json: bool) -> anyhow::Result<ExitCode> {
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    // A deployment never provisioned is said once, with what to do (exit 2).
    flotilla_client::open_store(&bus).await?;
    let info = bus.client().server_info();
    let nats = NatsStatus {
        url: config.nats.urls.join(","),
        // An unnamed server's name is its id: not worth a person's reading.
        server: if info.server_name == info.server_id {
            String::new()
        } else {
            info.server_name.clone()
        },
        version: info.version.clone(),
        prefix: bus.names().prefix().to_owned(),
    };
    let service = bus.names().service().to_owned();
    let before = consumers(&bus).await?;
    let coordinators = ping(&bus, &service).await?;
    let supervisors = ping(&bus, &format!("{service}-supervisor")).await?;
    let client = Client::new(bus.clone());
    let mut pools: BTreeMap<String, PoolStatus> = config
        .pools
        .iter()
        .map(|p| (p.clone(), PoolStatus::default()))
        .collect();
    for (w, _) in client.live_workers().await? {
        let p = pools.entry(w.pool.clone()).or_default();
        p.workers += 1;
        p.busy += w.in_flight;
        p.slots += w.concurrency;
    }
    let pending_approvals = if coordinators.is_empty() {
        None
    } else {
        client.pending_approvals(None).await.ok().map(|a| a.len())
    };
    // Look again: a consumer that still has work, no pull waiting and the same ack floor is
    // not being pulled.
    tokio::time::sleep(CONSUMER_GAP).await;
    let after = consumers(&bus).await?;
    let mut unpulled: Vec<Unpulled> = after
        .iter()
        .filter(|(key, (pending, waiting, floor))| {
            *pending > 0
                && *waiting == 0
                && before
                    .get(*key)
                    .is_some_and(|(p, w, f)| *p > 0 && *w == 0 && f == floor)
        })
        .map(|((stream, consumer), (pending, _, _))| Unpulled {
            stream: stream.clone(),
            consumer: consumer.clone(),
            pending: *pending,
        })
        .collect();
    unpulled.sort_by(|a, b| (&a.stream, &a.consumer).cmp(&(&b.stream, &b.consumer)));

    let mut attention = Vec::new();
    if coordinators.is_empty() {
        attention.push(
            "no coordinator answers: nothing is admitted or scheduled (start `flotilla coordinator` or `flotilla up`)"
                .to_owned(),
        );
    }
    if supervisors.is_empty() {
        attention.push(
            "no supervisor answers: team, trust, recruits, teammates and webhooks wait (start `flotilla supervisor`)"
                .to_owned(),
        );
    }
    for (name, p) in &pools {
        if p.workers == 0 {
            attention.push(format!(
                "pool {name} has no live worker: its tasks wait (start `flotilla worker --pool {name}`)"
            ));
        }
    }
    for u in &unpulled {
        attention.push(format!(
            "consumer {} of {} has {} message(s) and nobody pulling",
            u.consumer, u.stream, u.pending
        ));
    }
    let status = Status {
        nats,
        coordinators,
        supervisors,
        pools,
        pending_approvals,
        unpulled,
        attention,
    };
    if json {
        outln!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print(&status);
    }
    Ok(if status.attention.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn print(s: &Status) {
    let named = if s.nats.server.is_empty() {
        String::new()
    } else {
        format!("{}, ", s.nats.server)
    };
    outln!(
        "nats          {} ({named}nats-server {}, prefix {})",
        s.nats.url,
        s.nats.version,
        s.nats.prefix
    );
    let answering = |v: &[Instance]| match v.len() {
        0 => "none answers".to_owned(),
        n => format!("{n} answering ({})", versions(v)),
    };
    outln!("coordinator   {}", answering(&s.coordinators));
    outln!("supervisor    {}", answering(&s.supervisors));
    for (name, p) in &s.pools {
        outln!(
            "pool          {name}: {} live worker(s), {}/{} slots busy",
            p.workers,
            p.busy,
            p.slots
        );
    }
    match s.pending_approvals {
        Some(0) => outln!("approvals     none pending"),
        Some(n) => outln!("approvals     {n} pending (flotilla approvals list)"),
        None => outln!("approvals     unknown (no coordinator answers)"),
    }
    if s.unpulled.is_empty() {
        outln!("consumers     every consumer with work is being pulled");
    }
    for a in &s.attention {
        outln!("attention:    {a}");
    }
    if s.attention.is_empty() {
        outln!("ok");
    }
}
