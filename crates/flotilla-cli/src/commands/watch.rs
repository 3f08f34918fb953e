//! `flotilla watch RUN`: a run tree as one audience sees it, live, indented by depth.
//!
//! By default the projection runs here (the client library's `Client::watch`); `--server`
//! asks a coordinator to project (`<prefix>.api.watch`) and prints what it delivers — the
//! same events in the same order, the way a browser over NATS WebSocket would follow a run.

use std::process::ExitCode;
use std::time::Duration;

use flotilla_bus::Bus;
use flotilla_client::WatchOptions;
use flotilla_client::{Client, ClientErrorKind};
use flotilla_model::RunId;
use flotilla_model::event::{Event, StepEntry, WorkflowPhase};
use flotilla_model::watch::{
    ChildPolicy, Profile, ProjectedEvent, WatchEnd, WatchReply, WatchRequest,
};
use futures::StreamExt;

use crate::config::Config;

/// How long `--server` waits for a coordinator to accept the watch.
const API_TIMEOUT: Duration = Duration::from_secs(10);

/// `flotilla watch` arguments.
#[derive(Debug, clap::Args)]
pub(crate) struct WatchArgs {
    /// The run to follow.
    run: RunId,
    /// Which events: user (replies, top-level tools, child cards, awaits, run phases),
    /// debug (everything), metrics (usage and workflow).
    #[arg(long, default_value = "user")]
    profile: Profile,
    /// Children: off (hidden), linked (links only), flatten (their events, indented).
    #[arg(long, default_value = "linked")]
    children: ChildPolicy,
    /// Resume after the event with this `seq` (as `--json` prints it) …
    #[arg(long, default_value_t = 0)]
    since: u64,
    /// … and this `index` (without it: after the last event of message `--since`).
    #[arg(long, requires = "since")]
    since_index: Option<u32>,
    /// One JSON `ProjectedEvent` per line.
    #[arg(long)]
    json: bool,
    /// Let a coordinator project (`api.watch`) instead of this process.
    #[arg(long)]
    server: bool,
}

/// Runs `flotilla watch`.
pub(crate) async fn watch(config: &Config, args: WatchArgs) -> anyhow::Result<ExitCode> {
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    let print = |e: &ProjectedEvent| -> anyhow::Result<()> {
        if args.json {
            outln!("{}", serde_json::to_string(e)?);
        } else if let Some(line) = line(e) {
            outln!("{line}");
        }
        Ok(())
    };
    let client = Client::new(bus);
    if args.server {
        return server_side(&client, &args, print).await;
    }
    let stream = match client
        .watch(
            args.run,
            WatchOptions {
                profile: args.profile,
                children: args.children,
                since: args.since,
                since_index: args.since_index,
            },
        )
        .await
    {
        Ok(s) => s,
        // As `--server` says it: the run does not exist, instead of a watch that never ends.
        Err(e) if e.kind() == ClientErrorKind::NotFound => {
            errln!("error: {e}");
            return Ok(ExitCode::from(1));
        }
        Err(e) => return Err(e.into()),
    };
    futures::pin_mut!(stream);
    while let Some(e) = stream.next().await {
        print(&e?)?;
    }
    Ok(ExitCode::SUCCESS)
}

async fn server_side(
    client: &Client,
    args: &WatchArgs,
    print: impl Fn(&ProjectedEvent) -> anyhow::Result<()>,
) -> anyhow::Result<ExitCode> {
    let bus = client.bus();
    let deliver = bus.client().new_inbox();
    let mut delivered = bus.client().subscribe(deliver.clone()).await?;
    let request = WatchRequest {
        protocol: flotilla_model::PROTOCOL_VERSION,
        run_id: args.run,
        profile: args.profile,
        children: args.children,
        since: args.since,
        since_index: args.since_index,
        deliver_subject: deliver,
        lease_ms: 30_000,
    };
    let reply: WatchReply = match client.call(&request, API_TIMEOUT).await? {
        Ok(r) => r,
        Err(refused) => {
            // `not_found: run … does not exist`, as the local path says it.
            errln!("error: {}: {}", refused.code, refused.message);
            return Ok(ExitCode::from(1));
        }
    };
    let mut renew = tokio::time::interval(Duration::from_millis(reply.lease_ms / 3));
    renew.tick().await;
    loop {
        tokio::select! {
            _ = renew.tick() => {
                bus.client().publish(reply.renew_subject.clone(), "".into()).await?;
            }
            msg = delivered.next() => {
                let Some(msg) = msg else { anyhow::bail!("the subscription ended") };
                if let Ok(end) = serde_json::from_slice::<WatchEnd>(&msg.payload) {
                    if end.end == "ended" {
                        return Ok(ExitCode::SUCCESS);
                    }
                    errln!("error: the watch ended: {} {}", end.end, end.message.unwrap_or_default());
                    return Ok(ExitCode::from(1));
                }
                print(&serde_json::from_slice::<ProjectedEvent>(&msg.payload)?)?;
            }
        }
    }
}

/// One readable line, or none for an event not worth a line (a streamed increment).
fn line(e: &ProjectedEvent) -> Option<String> {
    let indent = "  ".repeat(e.depth as usize);
    let who = match (&e.agent, e.depth) {
        // Children side by side interleave: the run's short id tells two runs of one agent
        // apart (child run ids are name-based UUIDs, so their first characters differ).
        (Some(a), d) if d > 0 => format!("{a}·{}", &e.run_id.to_string()[..8]),
        (Some(a), _) => a.clone(),
        (None, 0) => e
            .event
            .task_id
            .as_ref()
            .map_or_else(|| "run".to_owned(), |t| t.to_string()),
        (None, _) => e.run_id.to_string()[..8].to_owned(),
    };
    let what = match &e.event.event {
        Event::AssistantReply { text, is_final } => {
            if !is_final {
                return None;
            }
            format!("says: {}", cut(text, 300))
        }
        Event::ToolStart { tool, input, .. } => {
            format!("→ {tool} {}", cut(&input.to_string(), 200))
        }
        Event::ToolEnd {
            ok,
            tool,
            duration_ms,
            error,
            ..
        } => format!(
            "← {} {}{}{}",
            tool.as_deref().unwrap_or("tool"),
            if *ok { "ok" } else { "failed" },
            duration_ms
                .map(|d| format!(" in {d} ms"))
                .unwrap_or_default(),
            error.as_ref().map(|m| format!(": {m}")).unwrap_or_default()
        ),
        Event::AgentRunStarted { child, agent } => format!(
            "⇢ child run {} ({})",
            child.run_id,
            agent.as_deref().unwrap_or("agent")
        ),
        Event::Usage {
            prompt_tokens,
            completion_tokens,
            model,
            ..
        } => format!(
            "usage {prompt_tokens} + {completion_tokens} tokens{}",
            model
                .as_ref()
                .map(|m| format!(" ({m})"))
                .unwrap_or_default()
        ),
        Event::Workflow(w) => {
            let phase = serde_json::to_value(w.phase)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default();
            let line = match &e.event.task_id {
                Some(t) if e.depth == 0 || e.agent.is_some() => format!("{phase} {t}"),
                _ => phase,
            };
            let run = e.run_id;
            let detail = w
                .detail
                .as_deref()
                .map(|d| format!(": {d}"))
                .unwrap_or_default();
            let line = match w.phase {
                WorkflowPhase::TaskStarted => {
                    format!("{line} on {}", w.worker.as_deref().unwrap_or("a worker"))
                }
                WorkflowPhase::TaskSucceeded => {
                    format!("{line}{}", super::submit::took(w.started_at, e.event.ts))
                }
                WorkflowPhase::TaskFailed | WorkflowPhase::TaskRetrying => format!(
                    "{line}{}",
                    w.error
                        .as_ref()
                        .map(|m| format!(": {m}"))
                        .unwrap_or_default()
                ),
                WorkflowPhase::ApprovalRequested => {
                    let id = w.approval_id.as_deref().unwrap_or("-");
                    format!(
                        "{line}: waits for a person, approval {id}{detail} (answer: flotilla approvals approve {run} {id}, or reject)"
                    )
                }
                WorkflowPhase::ApprovalDecided => match &w.approval_id {
                    Some(id) => format!("{line}: approval {id}{detail}"),
                    None => format!("{line}{detail}"),
                },
                WorkflowPhase::RunPaused | WorkflowPhase::RunTakenOver => {
                    format!("{line}{detail} (resume: flotilla runs resume {run})")
                }
                _ => format!("{line}{detail}"),
            };
            match &w.memory {
                Some(m) => format!("{line} ({})", m.summary()),
                None => line,
            }
        }
        Event::AgentStep { step, entry, .. } => match entry {
            StepEntry::ModelReply { tool_calls, .. } => {
                format!("step {step}: model reply ({} tool calls)", tool_calls.len())
            }
            StepEntry::ToolResults { results } => {
                format!("step {step}: {} tool results", results.len())
            }
        },
        Event::AwaitClarification { question, token } => {
            format!("asks: {question} (answer: flotilla runs answer RUN {token} --text …)")
        }
        Event::AwaitExternalTools { calls } => calls
            .iter()
            .map(|c| {
                format!(
                    "waits for the client's tool {}({}) (token {})",
                    c.tool,
                    cut(&c.input.to_string(), 120),
                    c.token
                )
            })
            .collect::<Vec<_>>()
            .join("; "),
        other => serde_json::to_value(other)
            .ok()
            .and_then(|v| v.get("type").and_then(|t| t.as_str()).map(str::to_owned))
            .unwrap_or_default(),
    };
    Some(format!("{indent}[{who}] {what}"))
}

fn cut(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.replace('\n', " ");
    }
    let t: String = s.chars().take(max).collect();
    format!("{}…", t.replace('\n', " "))
}
