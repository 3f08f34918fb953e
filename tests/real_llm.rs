//! Opt-in: LLM agents on a real model, end to end through `flotilla coordinator` and
//! `flotilla worker` processes. The default suite never runs these tests (`#[ignore]`); it
//! covers the LLM agent with the test kit's scripted OpenAI-compatible server (`tests/llm.rs`).
//!
//! ```sh
//! scripts/local-llm build && scripts/local-llm start   # SmolLM2-135M on llama-server
//! cargo nextest run -p flotilla-cli --test real_llm --run-ignored only
//! # or: cargo test -p flotilla-cli --test real_llm -- --ignored --nocapture
//! ```
//!
//! The endpoint is `$FLOTILLA_LLM_BASE_URL` (model `$FLOTILLA_LLM_MODEL`, key
//! `$FLOTILLA_LLM_API_KEY`), else the server `scripts/local-llm start` left in
//! `.flotilla/llm/base-url`. Asked to run without either, the tests fail and say how to start
//! one — they never pass without having talked to a model.
//!
//! A 135M-parameter model is weak, so the tests check the plumbing, not the answers: every
//! task ends, successfully or with a well-formed model-quality failure (`invalid_output`, or
//! `agent_failed` for a model that will not stop calling tools); every task that ran made
//! model calls that left `usage` and final `assistant_reply` events; succeeded tasks count
//! their tokens; tool calls, when the model makes them, run with paired `tool_start` /
//! `tool_end` events (the agents ask for them with `tool-choice = "required"`, which
//! llama-server does not enforce for this model: it may still answer in text).

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use flotilla_coordinator::store::RunStore;
use flotilla_model::event::Event;
use flotilla_model::plan::Subtask;
use flotilla_model::run::RunStatus;
use flotilla_model::runlog::RunInput;
use flotilla_model::submit::SubmitRequest;
use flotilla_model::task::TaskErrorKind;
use futures::StreamExt;
use serde_json::json;
use support::*;

/// How long a run on a small CPU model may take.
const REAL_WAIT: Duration = Duration::from_secs(600);

/// The model endpoint: base URL, model name, and whether an API key is set.
struct Endpoint {
    base_url: String,
    model: String,
    api_key: bool,
}

fn endpoint() -> anyhow::Result<Endpoint> {
    let from_env = std::env::var("FLOTILLA_LLM_BASE_URL")
        .ok()
        .filter(|u| !u.trim().is_empty());
    let base_url = match from_env {
        Some(u) => u,
        None => {
            let file = root().join(".flotilla/llm/base-url");
            match std::fs::read_to_string(&file) {
                Ok(u) if !u.trim().is_empty() => u,
                _ => anyhow::bail!(
                    "no model endpoint: set FLOTILLA_LLM_BASE_URL (and FLOTILLA_LLM_MODEL, \
                     FLOTILLA_LLM_API_KEY), or run `scripts/local-llm build && \
                     scripts/local-llm start` (which writes {})",
                    file.display()
                ),
            }
        }
    };
    Ok(Endpoint {
        base_url: base_url.trim().trim_end_matches('/').to_owned(),
        model: std::env::var("FLOTILLA_LLM_MODEL").unwrap_or_else(|_| "smollm2".into()),
        api_key: std::env::var_os("FLOTILLA_LLM_API_KEY").is_some(),
    })
}

/// Three LLM agents: a researcher with an exec tool and workspace_write, an analyst that
/// reads the workspace, a writer that answers in JSON. Short replies, few tool rounds, and
/// tool calls asked of the first two.
fn agents(e: &Endpoint) -> String {
    let search = root().join("config/examples/agents/search_corpus.py");
    let key = if e.api_key {
        "api-key-env = \"FLOTILLA_LLM_API_KEY\"\n"
    } else {
        ""
    };
    let common = format!(
        "kind = \"llm\"\nbase-url = \"{}\"\nmodel = \"{}\"\n{key}temperature = 0.1\n\
         max-output-tokens = 200\nmax-tool-rounds = 2\nrequest-timeout = \"90s\"\n\
         max-retries = 2\n",
        e.base_url, e.model
    );
    format!(
        r#"
[agents.researcher]
{common}tools = ["workspace_write"]
tool-choice = "required"

[agents.researcher.exec-tools.search_corpus]
command = "python3"
args = ["{search}"]
description = "Searches the Brindle Harbour documents for lines containing the keywords of the query"
parameters = {{ type = "object", properties = {{ query = {{ type = "string" }} }}, required = ["query"] }}
timeout = "10s"

[agents.analyst]
{common}tools = ["workspace_read"]
tool-choice = "required"

[agents.writer]
{common}tools = []
"#,
        search = search.display()
    )
}

fn three_tasks() -> Vec<Subtask> {
    let mut research = Subtask::new(
        "research",
        "Search the Brindle Harbour documents with search_corpus for the tidal pilot's output and costs. Save the key facts with workspace_write to topic \"notes\", then list them.",
    )
    .with_agent("researcher");
    research.role = Some("researcher".into());
    research.produces = vec!["notes".into()];
    let mut analyse = Subtask::new(
        "analyse",
        "Using the notes, weigh the pilot's benefits against its costs in three sentences.",
    )
    .with_agent("analyst")
    .after(&["research"]);
    analyse.role = Some("analyst".into());
    analyse.consumes = vec!["notes".into()];
    let mut write = Subtask::new(
        "write",
        "Write a one-paragraph brief for the town council from the analysis.",
    )
    .with_agent("writer")
    .after(&["analyse"]);
    write.role = Some("writer".into());
    write.output_schema = Some(json!({
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 80},
            "summary": {"type": "string", "maxLength": 400}
        },
        "required": ["title", "summary"]
    }));
    vec![research, analyse, write]
}

#[tokio::test]
#[ignore = "needs a real model: scripts/local-llm build && scripts/local-llm start, or FLOTILLA_LLM_BASE_URL; run with --run-ignored only"]
async fn three_llm_agents_run_a_plan_on_a_real_model() -> anyhow::Result<()> {
    let e = endpoint()?;
    eprintln!("model {} at {}", e.model, e.base_url);
    let mut p = Processes::start(&agents(&e)).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;

    let mut plan = plan(three_tasks());
    plan.query = Some("Is the Brindle Harbour tidal pilot worth extending?".into());
    plan.config.max_retries = 0;
    plan.config.task_timeout = flotilla_model::time::Secs::from_secs(300);
    let started = std::time::Instant::now();
    let run = p.client.submit(SubmitRequest::new(plan)).await?;
    let outcome = p.client.wait(run, REAL_WAIT).await?;
    eprintln!(
        "run {run}: {} in {:.1}s",
        outcome.status,
        started.elapsed().as_secs_f64()
    );

    // The run ended, and every failure is the model's, well formed — never the plumbing's.
    assert!(
        matches!(outcome.status, RunStatus::Succeeded | RunStatus::Failed),
        "{outcome:?}\n{}",
        p.log(1)
    );
    for f in &outcome.failed {
        assert!(
            matches!(
                f.error.kind,
                TaskErrorKind::InvalidOutput | TaskErrorKind::AgentFailed
            ),
            "task {} failed for a reason other than the model's answer: {}\n{}",
            f.task_id,
            f.error,
            p.log(1)
        );
        assert!(
            f.error.message.starts_with("agent "),
            "the error names the agent: {}",
            f.error
        );
    }
    if outcome.status == RunStatus::Succeeded {
        let fr = outcome.final_result.as_ref().expect("a final result");
        let v: serde_json::Value = serde_json::from_str(&fr.response)
            .map_err(|err| anyhow::anyhow!("the writer's answer is not JSON ({err}): {fr:?}"))?;
        assert!(v["title"].is_string() && v["summary"].is_string(), "{v}");
    }

    // Every task result in the run log: succeeded ones count their tokens.
    let store = RunStore::open(&p.bus).await?;
    let mut results = BTreeMap::new();
    for (_, _, entry) in store.history(run).await? {
        if let RunInput::TaskResult(r) = entry.input {
            results.insert(r.task_id.to_string(), r.result);
        }
    }
    for (task, r) in &results {
        eprintln!(
            "{task}: {} {} tokens, tools {:?}: {}",
            if r.success { "succeeded" } else { "failed" },
            r.tokens,
            r.tools_used,
            r.error
                .as_ref()
                .map_or_else(|| r.response.clone(), ToString::to_string)
        );
        if r.success {
            assert!(r.tokens > 0, "{task} succeeded without tokens: {r:?}");
        }
    }
    assert!(results.contains_key("research"), "{results:?}");

    // The event stream: usage and final replies of every task that ran, tool calls paired.
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    #[derive(Default, Debug)]
    struct Seen {
        usage: usize,
        usage_tokens: u64,
        final_replies: usize,
        tool_starts: usize,
        tool_ends: usize,
    }
    let mut seen = BTreeMap::<String, Seen>::new();
    let mut ended = false;
    // The stream replays the run's events, then waits for more: a short idle time ends it.
    while let Ok(Some(e)) = tokio::time::timeout(Duration::from_secs(5), events.next()).await {
        let e = e?;
        let task = e.task_id.map(|t| t.to_string()).unwrap_or_default();
        let s = seen.entry(task).or_default();
        match e.event {
            Event::Usage {
                prompt_tokens,
                completion_tokens,
                model,
                latency_ms,
                ..
            } => {
                assert!(prompt_tokens > 0, "a prompt of no tokens");
                assert!(model.is_some() && latency_ms.is_some());
                s.usage += 1;
                s.usage_tokens += prompt_tokens + completion_tokens;
            }
            Event::AssistantReply { is_final: true, .. } => s.final_replies += 1,
            Event::ToolStart { .. } => s.tool_starts += 1,
            Event::ToolEnd { .. } => s.tool_ends += 1,
            Event::Workflow(w) if w.phase.ends_run() => ended = true,
            _ => {}
        }
    }
    eprintln!("events by task: {seen:#?}");
    assert!(ended, "the run's end event is in the stream");
    for task in results.keys() {
        let s = seen.get(task.as_str());
        assert!(
            s.is_some_and(|s| s.usage >= 1 && s.final_replies >= 1),
            "{task}: no usage or final assistant_reply event: {s:?}"
        );
        let s = s.expect("checked above");
        assert_eq!(s.tool_starts, s.tool_ends, "{task}: tool calls paired");
        // No assertion that tools were called: the small model often answers without, and
        // llama-server lets text precede a required tool call (so `required` does not force
        // one there). When it does call them, they must have run and ended.
        if s.tool_starts > 0 {
            assert!(!results[task].tools_used.is_empty() || !results[task].success);
        }
        if results[task].success {
            assert_eq!(
                results[task].tokens, s.usage_tokens,
                "{task}: the result's tokens are the sum of its usage events"
            );
        }
    }
    Ok(())
}

// ── Planner (`--query`) on a real model ────────────────────────────────────────────────

/// A bare query on the real model: the planner agent plans it (its answer constrained by the
/// plan schema of this deployment), and the plan runs in the same run. A 135M model may not
/// produce a valid plan: then the run must fail with the planner's problems (never a hidden
/// default plan). Either way the plumbing is checked: the planner's model calls left usage
/// events, and the run record says how planning went.
#[tokio::test]
#[ignore = "needs a real model: scripts/local-llm build && scripts/local-llm start, or FLOTILLA_LLM_BASE_URL; run with --run-ignored only"]
async fn a_bare_query_is_planned_on_a_real_model() -> anyhow::Result<()> {
    let e = endpoint()?;
    let key = if e.api_key {
        "api-key-env = \"FLOTILLA_LLM_API_KEY\"\n"
    } else {
        ""
    };
    let config = format!(
        "{}\n[agents.planner]\nkind = \"llm\"\nbase-url = \"{}\"\nmodel = \"{}\"\n{key}temperature = 0.0\nmax-output-tokens = 400\nrequest-timeout = \"120s\"\nmax-retries = 2\ntools = []\n\n[coordinator.planner]\nagent = \"planner\"\nmax-repairs = 1\nmax-subtasks = 3\n",
        agents(&e),
        e.base_url,
        e.model
    );
    let mut p = Processes::start(&config).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    // The coordinator plans only once it has seen a live worker in the planner's pool.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let run = loop {
        let reply = p
            .client
            .submit_request(
                &SubmitRequest::query("Is the Brindle Harbour tidal pilot worth extending?"),
                Duration::from_secs(20),
            )
            .await?;
        match reply.run_id {
            Some(run) if reply.errors.is_empty() => break run,
            _ if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            _ => anyhow::bail!("the query was not accepted: {reply:?}"),
        }
    };
    let started = std::time::Instant::now();
    let outcome = p.client.wait(run, REAL_WAIT).await?;
    eprintln!(
        "query run {run}: {} in {:.1}s; reason {:?}",
        outcome.status,
        started.elapsed().as_secs_f64(),
        outcome.reason
    );
    let view = p.client.run(run).await?.expect("the run exists");
    let planning = view
        .record
        .planning
        .clone()
        .expect("a planned run says how planning went");
    eprintln!(
        "planning: {planning:?}; plan: {:?}",
        view.plan.as_ref().map(|pl| pl
            .subtasks
            .iter()
            .map(|t| t.id.to_string())
            .collect::<Vec<_>>())
    );
    use flotilla_model::run::PlanningStatus;
    match planning.status {
        PlanningStatus::Planned => {
            // The plan ran: the run ended with the model's usual, well-formed outcomes.
            assert!(
                matches!(outcome.status, RunStatus::Succeeded | RunStatus::Failed),
                "{outcome:?}"
            );
        }
        PlanningStatus::Failed => {
            assert_eq!(outcome.status, RunStatus::Failed, "{outcome:?}");
            assert!(
                outcome
                    .reason
                    .as_deref()
                    .is_some_and(|r| r.contains("planning_failed") || r.contains("plan")),
                "a planning failure says so: {outcome:?}"
            );
        }
        other => anyhow::bail!("planning still {other:?} after the run ended"),
    }
    // The planner's calls are in the run's events.
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    let mut planner_usage = 0;
    while let Ok(Some(ev)) = tokio::time::timeout(Duration::from_secs(5), events.next()).await {
        let ev = ev?;
        if matches!(ev.event, Event::Usage { .. })
            && ev
                .task_id
                .as_ref()
                .is_some_and(|t| t.as_str().starts_with("_plan-"))
        {
            planner_usage += 1;
        }
    }
    assert!(planner_usage >= 1, "the planner called the model");
    Ok(())
}
