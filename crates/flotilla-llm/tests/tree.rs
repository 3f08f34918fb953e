//! The LLM agent inside a run tree, against a real nats-server and the scripted
//! OpenAI-compatible test server (a test double: the model's answers are scripted here):
//! budgets that bind the whole tree (task envelopes built here with `budget_scopes`, as a
//! coordinator fills them), transfers that would loop, and the trace context a `child.start`
//! request carries.
//!
//! No coordinator runs here. Where a child run would be asked for, a plain NATS responder on
//! the `child.start` subject stands in for the coordinator's endpoint: it records the request
//! and answers `503 unavailable`, so no child is started.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use flotilla_llm::budget::Spent;
use flotilla_model::ErrorCode;
use flotilla_model::RunId;
use flotilla_model::api::{ApiError, ApiRequest, ChildStartRequest};
use flotilla_model::event::Event;
use flotilla_model::subjects::Bucket;
use flotilla_model::task::{Budget, BudgetScope, TaskEnvelope, TaskErrorKind, TraceContext};
use flotilla_testkit::openai::Reply;
use futures::StreamExt;
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(20);

/// Task `id` of run `run` in the tree of `root`, whose model calls count against `scopes`
/// (root first), as a coordinator fills them.
fn scoped(run: RunId, root: RunId, id: &str, scopes: &[(RunId, Option<u64>)]) -> TaskEnvelope {
    let mut t = envelope(id, "Say something short.");
    t.run_id = run;
    t.root_run_id = (run != root).then_some(root);
    t.budget_scopes = scopes
        .iter()
        .map(|&(run_id, max_tokens)| BudgetScope {
            run_id,
            limits: Budget {
                max_tokens,
                max_cost: None,
            },
        })
        .collect();
    t
}

/// What `budget.<run>` holds (`None`: nothing was ever reserved on it).
async fn spent(h: &Harness, run: RunId) -> anyhow::Result<Option<Spent>> {
    let kv = h.bus.kv(Bucket::Cursors).await?;
    Ok(match kv.get(format!("budget.{run}")).await? {
        Some(v) => Some(serde_json::from_slice(&v)?),
        None => None,
    })
}

/// The tool messages of a recorded request, by call id, as JSON.
fn tool_results(request: &flotilla_testkit::openai::RecordedRequest) -> Vec<(String, Value)> {
    request
        .messages()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            (
                m["tool_call_id"].as_str().unwrap_or_default().to_owned(),
                serde_json::from_str(m["content"].as_str().unwrap_or_default())
                    .unwrap_or(Value::Null),
            )
        })
        .collect()
}

/// Twelve child runs of one root, none with a budget of its own, each making one model call
/// at once: together they may spend only the root's 1,000 tokens. Each call reserves its
/// prompt estimate plus 100 output tokens under the root's key and uses 100, so the calls
/// that fit are made, the others end `budget_exhausted` naming the root, and what the tree
/// spent stays within the budget.
#[tokio::test]
async fn children_spend_under_their_roots_budget_and_stay_within_it() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let mut config = h.config();
    config.tools = Vec::new();
    config.max_output_tokens = Some(100);
    let agent = h.agent(&config)?;
    const CHILDREN: usize = 12;
    for _ in 0..CHILDREN {
        h.llm.push(
            Reply::text("ok")
                .usage(40, 60)
                .delay(Duration::from_millis(200)),
        );
    }
    let root = RunId::new();
    let children: Vec<RunId> = (0..CHILDREN).map(|_| RunId::new()).collect();
    let tasks: Vec<TaskEnvelope> = children
        .iter()
        .map(|&c| scoped(c, root, "ask", &[(root, Some(1000))]))
        .collect();
    let results = futures::future::join_all(tasks.iter().map(|t| h.run(&agent, t, TIMEOUT))).await;
    let mut made = 0u64;
    let mut refused = Vec::new();
    for r in results {
        match r? {
            Ok(reply) => {
                assert_eq!(reply.tokens, 100);
                made += 1;
            }
            Err(e) => {
                assert_eq!(e.kind, TaskErrorKind::BudgetExhausted, "{e}");
                refused.push(e.message);
            }
        }
    }
    assert!(made >= 1, "some calls fit");
    assert!(!refused.is_empty(), "12 × 100 tokens do not fit in 1,000");
    assert!(
        refused[0].contains(&format!("run {root} (the tree's root)"))
            && refused[0].contains("max_tokens (1000)"),
        "{}",
        refused[0]
    );
    assert_eq!(
        h.llm.requests().len() as u64,
        made,
        "refused calls were not made"
    );
    // The root's entry holds what the calls used; every reservation was settled or released.
    let at_root = spent(&h, root).await?.expect("the root's budget entry");
    assert_eq!(at_root.tokens, made * 100);
    assert!(at_root.tokens <= 1000, "{at_root:?}");
    // The children kept no entries of their own: they have no budget.
    for c in &children {
        assert_eq!(spent(&h, *c).await?, None);
    }

    // A task without scopes counts against its own run's `budget` only, as before.
    h.llm.push(Reply::text("alone").usage(40, 60));
    let mut alone = envelope("alone", "Say something short.");
    alone.budget = Some(Budget {
        max_tokens: Some(1000),
        max_cost: None,
    });
    h.run(&agent, &alone, TIMEOUT)
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(spent(&h, alone.run_id).await?.map(|s| s.tokens), Some(100));
    Ok(())
}

/// A child's own budget narrows its root's: a call that fits the root's budget but not the
/// child's is refused, naming the child, and what it reserved on the root is given back. A
/// `max_cost` anywhere in the tree needs a price.
#[tokio::test]
async fn a_childs_own_budget_narrows_the_roots() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let mut config = h.config();
    config.tools = Vec::new();
    config.max_output_tokens = Some(100);
    let agent = h.agent(&config)?;
    h.llm.push(Reply::text("never sent"));
    let (root, child) = (RunId::new(), RunId::new());
    let task = scoped(
        child,
        root,
        "ask",
        &[(root, Some(100_000)), (child, Some(50))],
    );
    let e = h
        .run(&agent, &task, TIMEOUT)
        .await?
        .expect_err("over the child's budget");
    assert_eq!(e.kind, TaskErrorKind::BudgetExhausted);
    assert!(
        e.message
            .contains(&format!("max_tokens (50) of run {child} (this run)")),
        "{e}"
    );
    assert!(h.llm.requests().is_empty(), "no call was made");
    assert_eq!(
        spent(&h, root).await?.map(|s| s.tokens),
        Some(0),
        "the root's reservation was released"
    );

    // The root's max_cost binds a child whose agent has no price.
    let mut costly = scoped(RunId::new(), root, "ask", &[]);
    costly.budget_scopes = vec![BudgetScope {
        run_id: root,
        limits: Budget {
            max_tokens: None,
            max_cost: Some(1.0),
        },
    }];
    let e = h
        .run(&agent, &costly, TIMEOUT)
        .await?
        .expect_err("no price");
    assert_eq!(e.kind, TaskErrorKind::BudgetExhausted);
    assert!(
        e.message.contains(&format!("run {root} (the tree's root)"))
            && e.message.contains("no price"),
        "{e}"
    );
    Ok(())
}

/// A conversation handed over `dispatcher → billing` reaches this agent; the model tries to
/// hand it back to billing. That would loop: the call ends with `transfer_loop` for the model
/// to read, no child run is asked for, and the model answers itself. A handover from an
/// agent that passed on no chain counts that agent. An attempt that gives up after such a
/// refusal fails with `child_rejected`, which is not retried.
#[tokio::test]
async fn a_transfer_back_along_the_chain_is_refused_and_the_model_goes_on() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let mut config = h.config();
    config.tools = Vec::new();
    let agent = h
        .agent(&config)?
        .with_transfer_targets(vec!["billing".into(), "dispatcher".into()]);
    let handed = |chain: Option<Value>| {
        let mut t = envelope("help", "I was charged twice.");
        t.input = json!({
            "transferred_from": "billing",
            "reason": "a technical question",
            "conversation": [{"role": "user", "content": "I was charged twice."}],
            "input": {"ticket": 7},
        });
        if let Some(c) = chain {
            t.input["transfer_chain"] = c;
        }
        t
    };

    h.llm.push(Reply::tool_call(
        "transfer_to_agent",
        json!({"agent_name": "billing", "reason": "it is about money"}),
    ));
    h.llm.push(Reply::text(
        "I will answer myself: the refund is on its way.",
    ));
    let task = handed(Some(json!(["dispatcher", "billing"])));
    let reply = h
        .run(&agent, &task, TIMEOUT)
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(
        reply.response,
        "I will answer myself: the refund is on its way."
    );
    let requests = h.llm.requests();
    assert_eq!(requests.len(), 2);
    let results = tool_results(&requests[1]);
    assert_eq!(results.len(), 1, "{results:?}");
    let error = &results[0].1["error"];
    assert_eq!(error["code"], "transfer_loop", "{results:?}");
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|m| m.contains("dispatcher → billing → test_agent → billing")),
        "{error}"
    );
    let events = h
        .events(task.run_id, |e| {
            e.iter().any(|x| matches!(x, Event::ToolEnd { .. }))
        })
        .await?;
    let ended = events.iter().find_map(|e| match e {
        Event::ToolEnd {
            ok,
            error,
            run_link,
            ..
        } => Some((*ok, error.clone(), run_link.clone())),
        _ => None,
    });
    let (ok, error, run_link) = ended.expect("tool_end");
    assert!(!ok);
    assert!(error.is_some_and(|e| e.starts_with("transfer_loop")));
    assert_eq!(run_link, None, "no child run");

    // A handover without a chain: the agent that handed over is in it.
    h.llm.push(Reply::tool_call(
        "transfer_to_agent",
        json!({"agent_name": "billing"}),
    ));
    h.llm.push(Reply::text("Answered here."));
    let reply = h
        .run(&agent, &handed(None), TIMEOUT)
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(reply.response, "Answered here.");
    let results = tool_results(&h.llm.requests()[3]);
    assert_eq!(results[0].1["error"]["code"], "transfer_loop");

    // The model insists until its tool rounds are spent: the attempt gives up for good.
    let mut strict = config.clone();
    strict.max_tool_rounds = 1;
    let insisting = h
        .agent(&strict)?
        .with_transfer_targets(vec!["billing".into()]);
    for _ in 0..2 {
        h.llm.push(Reply::tool_call(
            "transfer_to_agent",
            json!({"agent_name": "billing"}),
        ));
    }
    let e = h
        .run(&insisting, &handed(None), TIMEOUT)
        .await?
        .expect_err("gave up");
    assert_eq!(e.kind, TaskErrorKind::ChildRejected, "{e}");
    assert!(!e.kind.is_retryable());
    assert!(e.message.contains("was refused"), "{e}");
    Ok(())
}

/// Headers of the `child.start` requests received, answered `503 unavailable` (a stand-in for
/// the coordinator's endpoint; no child is started).
async fn child_start_headers(
    h: &Harness,
) -> anyhow::Result<Arc<Mutex<Vec<async_nats::HeaderMap>>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let client = h.bus.client().clone();
    let mut requests = client
        .subscribe(h.bus.names().api(ChildStartRequest::ENDPOINT))
        .await?;
    client.flush().await?;
    let kept = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Some(m) = requests.next().await {
            if let Ok(mut s) = kept.lock() {
                s.push(m.headers.clone().unwrap_or_default());
            }
            let Some(reply) = m.reply else { continue };
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Service-Error-Code", "503");
            headers.insert("Nats-Service-Error", "no coordinator in this test");
            let body = serde_json::to_vec(&ApiError::new(
                503,
                ErrorCode::Unavailable,
                "no coordinator in this test",
            ))
            .unwrap_or_default();
            let _ = client
                .publish_with_headers(reply, headers, body.into())
                .await;
        }
    });
    Ok(seen)
}

/// Spans are not exported in this test process, so the child run's `child.start` carries the
/// attempt's own trace context (the envelope's `trace`), for the coordinator to put on the
/// child's submission: the child joins the parent's trace.
#[tokio::test]
async fn a_child_start_carries_the_attempts_trace_context() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let seen = child_start_headers(&h).await?;
    let mut config = h.config();
    config.tools = Vec::new();
    config.agent_tools = vec!["helper".into()];
    let agent = h.agent(&config)?;
    h.llm.push(Reply::tool_call(
        "call_agent",
        json!({"agent": "helper", "request": "look it up"}),
    ));
    h.llm.push(Reply::text("The helper is not there."));
    let mut task = envelope("ask", "Ask the helper.");
    let trace = TraceContext {
        traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
        tracestate: Some("vendor=a".into()),
    };
    task.trace = Some(trace.clone());
    let reply = h
        .run(&agent, &task, TIMEOUT)
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(reply.response, "The helper is not there.");
    let results = tool_results(&h.llm.requests()[1]);
    assert_eq!(results[0].1["error"]["code"], "unavailable", "{results:?}");
    let seen = seen.lock().map_err(|e| anyhow::anyhow!("{e}"))?.clone();
    assert_eq!(seen.len(), 1, "one child.start request");
    let header = |name: &str| seen[0].get(name).map(|v| v.as_str().to_owned());
    assert_eq!(header("traceparent"), Some(trace.traceparent));
    assert_eq!(header("tracestate"), trace.tracestate);
    Ok(())
}
