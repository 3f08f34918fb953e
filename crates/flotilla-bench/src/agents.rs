//! The NATS Agent Protocol (`flotilla bench --only agents`): what speaking it costs next to
//! Flotilla's own client path. Against the bench's nats-server, prefix `flbagents`:
//!
//! * **prompt → first streamed token** — a `flotilla coordinator` (which serves the exposed
//!   agents) and one `flotilla worker`, an LLM agent with `expose = true` against the bench's
//!   simulated OpenAI-compatible provider (`harness::provider`, a test double streaming its
//!   reply word by word, answering after `--agents-delay`). Pairs of samples, interleaved:
//!   - the bench as a client of the protocol, written from the protocol's framing (plain
//!     NATS, no Flotilla code): subscribe a fresh inbox, publish the prompt to the discovered
//!     `agents.prompt.llm.flbagents.default`, time until the first `{"type":"response"}`
//!     chunk; then read the stream to its end (the empty message);
//!   - the same one-task run submitted directly (`Client::submit`, then `Client::watch` with
//!     the user profile, what the exposer itself does), time until its first
//!     `assistant_reply` event; then wait for the run's end.
//!
//!   p50/p99 of both and their ratio (target ≤ 1.2×): the protocol's own hops (the prompt to
//!   the coordinator, each chunk back to the caller) are the difference.
//! * **heartbeats of exposed agents** — a coordinator alone, idle, with 1 and then with
//!   `--agents-exposed` (100) exposed no-op (`scripted`) agents, each beating every
//!   `--agents-heartbeat`: the coordinator's CPU seconds and RSS over `--agents-window`, and
//!   the heartbeats seen on `agents.hb.>` in that window; and how long the coordinator took
//!   from its spawn until every exposed agent answered `$SRV.INFO.agents`.

use std::time::{Duration, Instant};

use anyhow::Context;
use flotilla_client::{Client, WatchOptions};
use flotilla_model::event::Event;
use flotilla_model::plan::{Plan, Subtask};
use flotilla_model::run::RunStatus;
use flotilla_model::submit::SubmitRequest;
use flotilla_model::watch::{ChildPolicy, Profile};
use futures::StreamExt;

use crate::harness::processes::{Processes, cpu_seconds, peak_rss_kib, rss_kib};
use crate::harness::provider::Provider;
use crate::harness::services::{Services, has_listener, section_bus, spawn_service};
use crate::harness::stats::{ms, p50_p99};

/// `flotilla bench --only agents` settings.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct AgentsArgs {
    /// Agents: measured prompt pairs (one over the protocol, one submitted directly), after a
    /// warm-up of 5 pairs.
    #[arg(long, default_value_t = 50)]
    agents_samples: usize,
    /// Agents: the simulated provider's delay before it streams its reply (0: the figures are
    /// Flotilla's and the protocol's own).
    #[arg(long, default_value = "0ms", value_parser = humantime::parse_duration)]
    agents_delay: Duration,
    /// Agents: exposed no-op agents in the heartbeat-cost figure (next to 1).
    #[arg(long, default_value_t = 100)]
    agents_exposed: usize,
    /// Agents: the exposed agents' heartbeat interval in the heartbeat-cost figure (the
    /// protocol's recommendation, the default of `[agents-protocol] heartbeat`, is 30 s).
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    agents_heartbeat: Duration,
    /// Agents: how long the idle coordinator is measured in the heartbeat-cost figure.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    agents_window: Duration,
}

/// The section's prefix (its own streams, apart from the other sections'), also the exposed
/// agents' owner token.
const PREFIX: &str = "flbagents";
/// The exposed LLM agent.
const AGENT: &str = "llm";
/// Pairs dropped before the measurement (connections, streams, caches warm).
const WARM_UP: usize = 5;
/// Longest wait for any one prompt, run or discovery.
const WAIT: Duration = Duration::from_secs(60);

pub(crate) async fn run(args: &AgentsArgs, services: &Services, url: &str) -> anyhow::Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("flotilla-bench-agents-")
        .tempdir()?;
    let exe = &services.exe;
    let listener_off = has_listener(exe);
    let bus = section_bus(url, PREFIX).await?;

    // Figure 1: prompt → first streamed token, over the protocol and directly.
    let provider = Provider::start().await?;
    provider.set_delay(args.agents_delay);
    let config = write_config(
        &dir.path().join("bench-agents-llm.toml"),
        url,
        &llm_agents(&provider.base_url()),
        Duration::from_secs(30),
        listener_off,
    )?;
    let procs = Processes(vec![
        (
            "coordinator".into(),
            spawn_service(exe, &config, &["coordinator"])?,
        ),
        (
            "worker".into(),
            spawn_service(exe, &config, &["worker", "--concurrency", "4"])?,
        ),
    ]);
    let nats = bus.client().clone();
    let prompt_subject = discovered(&nats, 1).await?.into_iter().next().context(
        "the exposed agent was discovered but has no prompt endpoint (the coordinator's build?)",
    )?;
    let client = Client::new(bus.clone());
    outln!(
        "== agents (NATS Agent Protocol; a coordinator + 1 worker process, an exposed LLM agent against the simulated provider, delay {:?}, streaming {} words)",
        args.agents_delay,
        crate::harness::provider::REPLY.split_inclusive(' ').count()
    );
    let (mut over_protocol, mut direct) = (Vec::new(), Vec::new());
    for i in 0..WARM_UP + args.agents_samples.max(1) {
        let p = protocol_sample(&nats, &prompt_subject, i).await?;
        let d = direct_sample(&client, i).await?;
        if i >= WARM_UP {
            over_protocol.push(p);
            direct.push(d);
        }
    }
    let n = direct.len();
    let (p50, p99) = p50_p99(&mut over_protocol);
    let (d50, d99) = p50_p99(&mut direct);
    outln!(
        "   prompt → first token, NATS Agent Protocol (prompt → first response chunk):  p50 {p50:.3} ms   p99 {p99:.3} ms   ({n} prompts)"
    );
    outln!(
        "   submit → first token, direct (submit → first assistant_reply event, watch):  p50 {d50:.3} ms   p99 {d99:.3} ms   ({n} runs)"
    );
    outln!(
        "   ratio protocol / direct: p50 {:.2}×   p99 {:.2}× (target ≤ 1.2×)",
        p50 / d50.max(f64::EPSILON),
        p99 / d99.max(f64::EPSILON)
    );
    drop(procs);
    drop(provider);

    // Figure 2: the idle coordinator with 1, then many exposed agents beating.
    outln!(
        "   idle coordinator, exposed no-op agents beating every {:?}, measured over {:?}:",
        args.agents_heartbeat,
        args.agents_window
    );
    for count in [1, args.agents_exposed.max(1)] {
        let config = write_config(
            &dir.path()
                .join(format!("bench-agents-exposed-{count}.toml")),
            url,
            &noop_agents(count),
            args.agents_heartbeat,
            listener_off,
        )?;
        let cost = idle_cost(&nats, exe, &config, count, args.agents_window).await?;
        outln!(
            "   {count:>4} exposed: coordinator CPU {:.2} s ({:.2} % of a core), RSS {:.1} MiB (peak {:.1} MiB), {} heartbeats seen; spawned → all discovered in {:.1} s",
            cost.cpu_s,
            100.0 * cost.cpu_s / args.agents_window.as_secs_f64(),
            cost.rss_kib as f64 / 1024.0,
            cost.peak_kib as f64 / 1024.0,
            cost.beats,
            cost.startup.as_secs_f64()
        );
    }
    Ok(())
}

/// The `[agents.…]` tables of figure 1: the exposed LLM agent.
fn llm_agents(base_url: &str) -> String {
    format!(
        r#"[agents.{AGENT}]
kind = "llm"
base-url = "{base_url}"
model = "simulated"
tools = []
expose = true
description = "An LLM agent against the bench's simulated provider"
"#
    )
}

/// The `[agents.…]` tables of figure 2: `count` exposed no-op agents.
fn noop_agents(count: usize) -> String {
    (0..count)
        .map(|i| {
            format!(
                "[agents.noop{i}]\nkind = \"scripted\"\nreply = \"ok\"\nexpose = true\nroles = [\"bench\"]\n"
            )
        })
        .collect()
}

/// Writes a configuration with `agents` under the section's prefix, the exposed agents owned
/// by it and beating every `heartbeat`.
fn write_config(
    path: &std::path::Path,
    url: &str,
    agents: &str,
    heartbeat: Duration,
    listener_off: bool,
) -> anyhow::Result<std::path::PathBuf> {
    let telemetry = if listener_off {
        "\n[telemetry]\nhttp-addr = \"off\"\n"
    } else {
        ""
    };
    let heartbeat = humantime::format_duration(heartbeat);
    std::fs::write(
        path,
        format!(
            r#"# Generated by `flotilla bench --only agents`: agents exposed on the NATS Agent Protocol.
pools = ["default"]

[nats]
urls = ["{url}"]
prefix = "{PREFIX}"

[agents-protocol]
owner = "{PREFIX}"
heartbeat = "{heartbeat}"

{agents}{telemetry}"#
        ),
    )
    .with_context(|| format!("writing {}", path.display()))?;
    Ok(path.to_owned())
}

/// The prompt subjects of the `agents` service instances owned by the section, once `count`
/// of them answer `$SRV.INFO.agents` (the protocol's discovery: what a client does first).
async fn discovered(nats: &async_nats::Client, count: usize) -> anyhow::Result<Vec<String>> {
    let until = Instant::now() + WAIT;
    loop {
        let inbox = nats.new_inbox();
        let mut replies = nats.subscribe(inbox.clone()).await?;
        nats.publish_with_reply("$SRV.INFO.agents", inbox, "".into())
            .await?;
        nats.flush().await?;
        let mut subjects = Vec::new();
        let window = tokio::time::Instant::now() + Duration::from_millis(500);
        while let Ok(Some(m)) = tokio::time::timeout_at(window, replies.next()).await {
            let Ok(info) = serde_json::from_slice::<serde_json::Value>(&m.payload) else {
                continue;
            };
            if info.pointer("/metadata/owner").and_then(|o| o.as_str()) != Some(PREFIX) {
                continue;
            }
            if let Some(s) = info
                .get("endpoints")
                .and_then(|e| e.as_array())
                .and_then(|e| {
                    e.iter()
                        .find(|e| e.get("name").and_then(|n| n.as_str()) == Some("prompt"))
                })
                .and_then(|e| e.get("subject"))
                .and_then(|s| s.as_str())
            {
                subjects.push(s.to_owned());
            }
        }
        let _ = replies.unsubscribe().await;
        if subjects.len() >= count {
            return Ok(subjects);
        }
        anyhow::ensure!(
            Instant::now() < until,
            "{} of {count} exposed agents answered $SRV.INFO.agents within {WAIT:?}",
            subjects.len()
        );
    }
}

/// One prompt over the protocol: ms from its publication to the first response chunk; the
/// stream is then read to its end (the empty message), an error frame failing the bench.
async fn protocol_sample(
    nats: &async_nats::Client,
    subject: &str,
    i: usize,
) -> anyhow::Result<f64> {
    let inbox = nats.new_inbox();
    let mut stream = nats.subscribe(inbox.clone()).await?;
    nats.flush().await?;
    let t0 = Instant::now();
    nats.publish_with_reply(subject.to_owned(), inbox, prompt(i).into())
        .await?;
    nats.flush().await?;
    let mut first = None;
    loop {
        let m = tokio::time::timeout(WAIT, stream.next())
            .await
            .context("no chunk of the prompt's stream within a minute")?
            .context("the prompt's inbox subscription ended")?;
        if let Some(h) = &m.headers
            && let Some(code) = h.get("Nats-Service-Error-Code")
        {
            anyhow::bail!(
                "the prompt failed: {code} {}",
                String::from_utf8_lossy(&m.payload)
            );
        }
        if m.payload.is_empty() && m.headers.as_ref().is_none_or(|h| h.is_empty()) {
            break;
        }
        let chunk: serde_json::Value =
            serde_json::from_slice(&m.payload).context("a chunk that is not JSON")?;
        if first.is_none() && chunk.get("type").and_then(|t| t.as_str()) == Some("response") {
            first = Some(ms(t0.elapsed()));
        }
    }
    let _ = stream.unsubscribe().await;
    first.context("the prompt's stream ended without a response chunk")
}

/// The same one-task run submitted directly: ms from the submission to its first
/// `assistant_reply` event on a watch (the path the exposer takes inside the coordinator);
/// then the run must succeed.
async fn direct_sample(client: &Client, i: usize) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    let run = client.submit(SubmitRequest::new(plan(i))).await?;
    let events = client
        .watch(
            run,
            WatchOptions {
                profile: Profile::User,
                children: ChildPolicy::Off,
                since: 0,
                since_index: None,
            },
        )
        .await?;
    futures::pin_mut!(events);
    let first = loop {
        let e = tokio::time::timeout(WAIT, events.next())
            .await
            .context("no event of the direct run within a minute")?
            .context("the direct run's events ended without a reply")??;
        if matches!(e.event.event, Event::AssistantReply { .. }) {
            break ms(t0.elapsed());
        }
    };
    let outcome = client.wait(run, WAIT).await?;
    anyhow::ensure!(outcome.status == RunStatus::Succeeded, "{outcome:?}");
    Ok(first)
}

/// The prompt of sample `i` (distinct, so no cache of any kind answers it).
fn prompt(i: usize) -> String {
    format!("Give the figure, please ({i}).")
}

/// The plan a prompt starts (as the exposer builds it): one task for the agent.
fn plan(i: usize) -> Plan {
    Plan {
        fork: None,
        name: Some(format!("agents.prompt {AGENT} (direct)")),
        query: Some(prompt(i)),
        subtasks: vec![Subtask::new("prompt", &prompt(i)).with_agent(AGENT)],
        config: Default::default(),
    }
}

/// The idle coordinator's costs over a window.
struct IdleCost {
    cpu_s: f64,
    rss_kib: u64,
    peak_kib: u64,
    beats: usize,
    /// Process spawned → every exposed agent answering discovery.
    startup: Duration,
}

/// Starts a coordinator with `config` (`count` exposed agents), waits until every agent is
/// discovered and 2 s more, then reads its CPU seconds and RSS over `window` and counts the
/// heartbeats on `agents.hb.*.<owner>.>` in it.
async fn idle_cost(
    nats: &async_nats::Client,
    exe: &std::path::Path,
    config: &std::path::Path,
    count: usize,
    window: Duration,
) -> anyhow::Result<IdleCost> {
    let procs = Processes(vec![(
        "coordinator".into(),
        spawn_service(exe, config, &["coordinator"])?,
    )]);
    let pid = procs.0[0].1.id();
    let spawned = Instant::now();
    discovered(nats, count).await?;
    let startup = spawned.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut beats = nats.subscribe(format!("agents.hb.*.{PREFIX}.>")).await?;
    nats.flush().await?;
    let cpu0 = cpu_seconds(pid).context("reading the coordinator's CPU time (/proc)")?;
    let until = tokio::time::Instant::now() + window;
    let mut seen = 0;
    while tokio::time::timeout_at(until, beats.next())
        .await
        .is_ok_and(|m| m.is_some())
    {
        seen += 1;
    }
    let cpu1 = cpu_seconds(pid).context("reading the coordinator's CPU time (/proc)")?;
    let cost = IdleCost {
        cpu_s: cpu1 - cpu0,
        rss_kib: rss_kib(pid).unwrap_or(0),
        peak_kib: peak_rss_kib(pid).unwrap_or(0),
        beats: seen,
        startup,
    };
    let _ = beats.unsubscribe().await;
    drop(procs);
    Ok(cost)
}
