//! The step journal and the deployment-wide rate limits, against a real nats-server and the
//! scripted OpenAI-compatible test server (a test double: every model answer is scripted).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use flotilla_context::Agent;
use flotilla_model::event::{Event, StepEntry};
use flotilla_model::task::TaskErrorKind;
use flotilla_testkit::openai::Reply;
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(30);

fn steps(events: &[Event]) -> Vec<(u32, &StepEntry)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::AgentStep { step, entry, .. } => Some((*step, entry)),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_second_delivery_replays_journaled_steps_and_goes_on_live() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let mut config = h.config();
    config.tools = vec!["state_set".into()];
    let agent = h.agent(&config)?;
    let task = envelope("t", "Remember the audience, then answer.");

    // Delivery 1: a tool round, then the next call hangs until the delivery is abandoned
    // (as when its worker dies).
    h.llm.push(
        Reply::tool_call("state_set", json!({"key": "audience", "value": "ops"})).usage(100, 10),
    );
    h.llm.push(Reply::hang());
    let (ctx, cancel) = h.context(&task, TIMEOUT)?;
    let first = tokio::spawn({
        let task = task.clone();
        let agent = h.agent(&config)?;
        async move { agent.run(&task, ctx).await }
    });
    h.llm.wait_for_requests(2, TIMEOUT).await?;
    cancel.cancel();
    let e = first.await?.expect_err("abandoned");
    assert_eq!(e.kind, TaskErrorKind::Cancelled);
    let journaled = h.events(task.run_id, |e| steps(e).len() == 2).await?;
    let kinds: Vec<_> = steps(&journaled)
        .into_iter()
        .map(|(n, e)| (n, matches!(e, StepEntry::ModelReply { .. })))
        .collect();
    assert_eq!(
        kinds,
        vec![(0, true), (1, false)],
        "a reply, then a tool round"
    );

    // Delivery 2 of the same attempt: one live call, the rest from the journal.
    h.llm.push(Reply::text("Told ops.").usage(150, 5));
    let (ctx, _cancel) = h.context_of_delivery(&task, TIMEOUT, 2)?;
    let reply = agent.run(&task, ctx).await.map_err(anyhow::Error::msg)?;
    assert_eq!(reply.response, "Told ops.");
    assert_eq!(reply.tokens, 110 + 155, "replayed tokens count");
    let requests = h.llm.requests();
    assert_eq!(requests.len(), 3, "one call by delivery 2: {requests:#?}");
    let tool_results: Vec<_> = requests[2]
        .messages()
        .iter()
        .filter(|m| m["role"] == "tool")
        .collect();
    assert_eq!(
        tool_results.len(),
        1,
        "the journaled tool result is in the conversation"
    );
    // The journal now holds the live step too; the tool's usage event is not repeated.
    let events = h.events(task.run_id, |e| steps(e).len() == 3).await?;
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e, Event::ToolStart { .. }))
            .count(),
        1,
        "the tool ran once"
    );
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e, Event::Usage { .. }))
            .count(),
        2,
        "usage once per call made"
    );
    Ok(())
}

#[tokio::test]
async fn a_first_delivery_ignores_other_attempts_journals() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let mut config = h.config();
    config.tools = Vec::new();
    let agent = h.agent(&config)?;
    let task = envelope("t", "Answer.");
    h.llm.push(Reply::text("first"));
    h.llm.push(Reply::text("second"));
    assert_eq!(
        h.run(&agent, &task, TIMEOUT)
            .await?
            .map_err(anyhow::Error::msg)?
            .response,
        "first"
    );
    // A retry is a new attempt (new attempt id): it starts from scratch.
    let mut retry = task.clone();
    retry.attempt = 2;
    retry.attempt_id = flotilla_model::ids::AttemptId::new();
    let (ctx, _c) = h.context_of_delivery(&retry, TIMEOUT, 2)?;
    assert_eq!(
        agent
            .run(&retry, ctx)
            .await
            .map_err(anyhow::Error::msg)?
            .response,
        "second"
    );
    assert_eq!(h.llm.requests().len(), 2);
    Ok(())
}

/// Two agents built for two different workers (separate `Providers`, so no per-process cap
/// is shared) still share the provider's requests-per-minute through KV.
#[tokio::test]
async fn requests_per_minute_hold_across_workers() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let mut config = h.config();
    config.tools = Vec::new();
    config.requests_per_minute = Some(2);
    let roles = Arc::new(flotilla_llm::Roles::default());
    let on_worker = |name: &str| {
        flotilla_llm::LlmAgent::new(
            name,
            &config,
            Arc::clone(&roles),
            &flotilla_llm::Providers::default(),
            ".".as_ref(),
        )
    };
    let (a, b) = (on_worker("a")?, on_worker("b")?);
    h.llm.push(Reply::text("one"));
    h.llm.push(Reply::text("two"));
    h.llm.push(Reply::text("never sent"));
    assert!(h.run(&a, &envelope("a1", "x"), TIMEOUT).await?.is_ok());
    assert!(h.run(&b, &envelope("b1", "x"), TIMEOUT).await?.is_ok());
    // The third request of the minute would go in ~30 s: past a 3 s deadline, so the call
    // fails at once (retryably) and nothing is sent.
    let started = Instant::now();
    let e = h
        .run(&a, &envelope("a2", "x"), Duration::from_secs(3))
        .await?
        .expect_err("rate limited");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "no waiting in vain"
    );
    assert_eq!(e.kind, TaskErrorKind::AgentFailed);
    assert!(e.kind.is_retryable());
    assert!(e.message.contains("2 requests per minute"), "{e}");
    assert_eq!(h.llm.requests().len(), 2);
    Ok(())
}

#[tokio::test]
async fn tokens_per_minute_wait_then_admit() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let mut config = h.config();
    config.tools = Vec::new();
    // 600,000 tokens per minute (0.1 ms a token). The first call reserves its estimate (a few
    // hundred tokens); its reply reports 700,000, charged after it — a whole minute's worth.
    config.tokens_per_minute = Some(600_000);
    config.max_output_tokens = Some(200);
    let agent = h.agent(&config)?;
    h.llm.push(Reply::text("big").usage(400_000, 300_000));
    h.llm.push(Reply::text("after a wait"));
    assert!(h.run(&agent, &envelope("a", "x"), TIMEOUT).await?.is_ok());
    // The minute's tokens are spent: the next call waits until its own estimate fits (tens
    // of milliseconds), not a whole minute.
    let started = Instant::now();
    let reply = h
        .run(&agent, &envelope("b", "x"), TIMEOUT)
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(reply.response, "after a wait");
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(10), "{waited:?}");
    assert!(waited < Duration::from_secs(20), "{waited:?}");
    Ok(())
}

#[tokio::test]
async fn zero_rates_are_refused_by_name() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let mut config = h.config();
    config.requests_per_minute = Some(0);
    let e = h.agent(&config).expect_err("zero rpm");
    assert!(e.to_string().contains("requests-per-minute"), "{e}");
    Ok(())
}
