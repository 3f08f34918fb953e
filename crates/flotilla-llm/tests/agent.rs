//! The LLM agent against a real nats-server and the scripted OpenAI-compatible test server (a
//! test double: the model's answers are scripted here): streaming and events, the prompt,
//! tools against the workspace, invalid arguments, provider failures and retries,
//! cancellation and structured output (that the API key never leaks: `tests/secrets.rs`).

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use flotilla_context::Agent;
use flotilla_llm::ExecToolConfig;
use flotilla_model::TaskId;
use flotilla_model::event::Event;
use flotilla_model::task::{DependencyResult, TaskErrorKind};
use flotilla_testkit::openai::{Reply, ScriptedToolCall};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(20);

fn deltas(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::AssistantReply {
                text,
                is_final: false,
            } => Some(text.clone()),
            _ => None,
        })
        .collect()
}

fn finals(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::AssistantReply {
                text,
                is_final: true,
            } => Some(text.clone()),
            _ => None,
        })
        .collect()
}

fn has_usage(events: &[Event], n: usize) -> bool {
    events
        .iter()
        .filter(|e| matches!(e, Event::Usage { .. }))
        .count()
        >= n
}

#[tokio::test]
async fn a_streamed_reply_becomes_events_tokens_and_the_response() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let answer = "Revenue grew 6.7% in Q3, driven by subscriptions.";
    h.llm.push(
        Reply::text(answer)
            .usage(321, 17)
            .chunk_delay(Duration::from_millis(25)),
    );
    let mut config = h.config();
    config.instruction = Some("Report for {customer}. Mention {extra?}.".into());
    let agent = h.agent(&config)?;
    let mut task = envelope("report", "Summarise the quarter.");
    task.role = Some("analyst".into());
    task.query = Some("How did Q3 go?".into());
    task.input = json!({"quarter": "Q3"});
    task.dependency_results.insert(
        TaskId::new("growth"),
        DependencyResult {
            response: "growth 6.7%".into(),
            tokens: 5,
            success: true,
            tools_used: Vec::new(),
            numeric_value: Some(6.7),
        },
    );
    h.operator(task.run_id)?
        .state()
        .set("customer", &json!("ACME"))
        .await?;

    let reply = h
        .run(&agent, &task, TIMEOUT)
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(reply.response, answer);
    assert_eq!(reply.tokens, 321 + 17);

    let events = h
        .events(task.run_id, |e| has_usage(e, 1) && !finals(e).is_empty())
        .await?;
    let streamed = deltas(&events);
    assert_eq!(streamed.concat(), answer, "increments add up to the reply");
    assert!(
        streamed.len() >= 2 && streamed.len() < 13,
        "13 chunks 25 ms apart are coalesced into a few increments: {streamed:?}"
    );
    assert_eq!(finals(&events), vec![answer.to_string()]);
    let usage = events
        .iter()
        .find_map(|e| match e {
            Event::Usage {
                prompt_tokens,
                completion_tokens,
                model,
                latency_ms,
                ..
            } => Some((
                *prompt_tokens,
                *completion_tokens,
                model.clone(),
                *latency_ms,
            )),
            _ => None,
        })
        .expect("usage");
    assert_eq!(usage.0, 321);
    assert_eq!(usage.1, 17);
    assert_eq!(usage.2.as_deref(), Some("scripted-model"));
    assert!(usage.3.is_some_and(|ms| ms >= 250), "{usage:?}");

    let requests = h.llm.requests();
    assert_eq!(requests.len(), 1);
    let r = &requests[0];
    assert!(r.stream());
    assert_eq!(r.body["stream_options"]["include_usage"], true);
    assert_eq!(r.model(), "scripted-model");
    let system = r.system();
    assert!(system.contains("analyst of a team"), "{system}");
    assert!(system.contains("Report for ACME. Mention ."), "{system}");
    let user = r.user();
    for part in [
        "# Query\nHow did Q3 go?",
        "# Your task (report)\nSummarise the quarter.",
        "\"quarter\": \"Q3\"",
        "## growth (succeeded, numeric value 6.7)\ngrowth 6.7%",
    ] {
        assert!(user.contains(part), "{part:?} in\n{user}");
    }
    assert_eq!(r.tool_names().len(), 6, "all built-in tools are offered");
    assert!(r.response_format().is_none());
    Ok(())
}

#[tokio::test]
async fn a_missing_state_key_in_the_instruction_fails_without_a_call() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let mut config = h.config();
    config.instruction = Some("Work for {customer}.".into());
    let agent = h.agent(&config)?;
    let e = h
        .run(&agent, &envelope("t", "x"), TIMEOUT)
        .await?
        .expect_err("missing key");
    assert_eq!(e.kind, TaskErrorKind::MissingStateKey);
    assert!(e.message.contains("customer"), "{e}");
    assert!(h.llm.requests().is_empty());
    Ok(())
}

#[tokio::test]
async fn parallel_tool_calls_write_the_workspace_and_state() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    h.llm.push(Reply::tool_calls([
        (
            "workspace_write",
            json!({"topic": "Findings", "entry": {"revenue": 1250}}),
        ),
        (
            "workspace_write",
            json!({"topic": "risks", "entry": {"risk": "churn"}}),
        ),
        ("state_set", json!({"key": "headline", "value": "up 6.7%"})),
    ]));
    h.llm.push(Reply::tool_calls([
        ("workspace_read", json!({"topic": "findings"})),
        ("state_get", json!({"key": "headline"})),
    ]));
    h.llm.push(Reply::text("Done: two topics written."));
    let agent = h.agent(&h.config())?;
    let task = envelope("research", "Record what you find.");
    let reply = h
        .run(&agent, &task, TIMEOUT)
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(reply.response, "Done: two topics written.");
    assert_eq!(
        reply.tools_used,
        vec![
            "workspace_write",
            "state_set",
            "workspace_read",
            "state_get"
        ]
    );

    // The entries are really in the workspace stream, written as the task.
    let op = h.operator(task.run_id)?;
    let findings = op.workspace().read("findings", 0, None).await?;
    assert_eq!(findings.entries.len(), 1);
    assert_eq!(findings.entries[0].entry["revenue"], 1250);
    let writer = findings.entries[0].writer.clone().expect("writer");
    assert_eq!(
        writer.task_id.as_ref().map(|t| t.as_str()),
        Some("research")
    );
    assert_eq!(
        op.workspace().read("risks", 0, None).await?.entries.len(),
        1
    );
    assert_eq!(
        op.state().get("headline").await?.map(|v| v.value),
        Some(json!("up 6.7%"))
    );

    // The model got every result, under its call id, in call order.
    let requests = h.llm.requests();
    assert_eq!(requests.len(), 3);
    let tool_messages: Vec<&Value> = requests[1]
        .messages()
        .iter()
        .filter(|m| m["role"] == "tool")
        .collect();
    assert_eq!(tool_messages.len(), 3);
    let assistant = requests[1]
        .messages()
        .iter()
        .find(|m| m["role"] == "assistant")
        .expect("the assistant turn is replayed");
    for (i, tm) in tool_messages.iter().enumerate() {
        assert_eq!(tm["tool_call_id"], assistant["tool_calls"][i]["id"]);
    }
    let written: Value = serde_json::from_str(tool_messages[0]["content"].as_str().unwrap_or(""))?;
    assert_eq!(written["topic"], "findings");
    let read_back = requests[2]
        .messages()
        .iter()
        .filter(|m| m["role"] == "tool")
        .skip(3)
        .map(|m| m["content"].as_str().unwrap_or_default().to_owned())
        .collect::<Vec<_>>();
    assert!(read_back[0].contains("1250"), "{read_back:?}");
    assert!(read_back[1].contains("up 6.7%"), "{read_back:?}");

    let events = h
        .events(task.run_id, |e| {
            e.iter()
                .filter(|x| matches!(x, Event::ToolEnd { .. }))
                .count()
                == 5
        })
        .await?;
    let starts = events
        .iter()
        .filter(|e| matches!(e, Event::ToolStart { .. }))
        .count();
    assert_eq!(starts, 5);
    for e in &events {
        if let Event::ToolEnd {
            ok,
            tool,
            duration_ms,
            error,
            ..
        } = e
        {
            assert!(*ok, "{e:?}");
            assert!(
                tool.is_some() && duration_ms.is_some() && error.is_none(),
                "{e:?}"
            );
        }
    }
    Ok(())
}

#[tokio::test]
async fn invalid_arguments_and_tool_errors_go_back_to_the_model() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    h.llm.push(Reply::raw_tool_calls(vec![
        ScriptedToolCall {
            id: Some("c1".into()),
            name: "workspace_write".into(),
            arguments: json!({"topic": "t", "entry": "not an object"}).to_string(),
        },
        ScriptedToolCall {
            id: Some("c2".into()),
            name: "state_set".into(),
            arguments: "{\"key\": ".into(),
        },
        ScriptedToolCall {
            id: Some("c3".into()),
            name: "launch_rockets".into(),
            arguments: "{}".into(),
        },
        ScriptedToolCall {
            id: Some("c4".into()),
            name: "workspace_write".into(),
            arguments: json!({"topic": "bad.topic", "entry": {}}).to_string(),
        },
    ]));
    h.llm.push(Reply::text("I could not write anything."));
    let agent = h.agent(&h.config())?;
    let task = envelope("t", "write");
    let reply = h
        .run(&agent, &task, TIMEOUT)
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(reply.response, "I could not write anything.");

    let second = &h.llm.requests()[1];
    let results: BTreeMap<String, Value> = second
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
        .collect();
    assert_eq!(results["c1"]["error"]["code"], "invalid_arguments");
    assert!(
        results["c1"]["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("/entry")),
        "{results:?}"
    );
    assert_eq!(results["c2"]["error"]["code"], "invalid_arguments");
    assert!(
        results["c2"]["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("not valid JSON"))
    );
    assert_eq!(results["c3"]["error"]["code"], "unknown_tool");
    assert_eq!(results["c4"]["error"]["code"], "invalid_topic");

    let events = h
        .events(task.run_id, |e| {
            e.iter()
                .filter(|x| matches!(x, Event::ToolEnd { .. }))
                .count()
                == 4
        })
        .await?;
    assert!(events.iter().all(|e| match e {
        Event::ToolEnd { ok, error, .. } => !ok && error.is_some(),
        _ => true,
    }));
    assert!(
        h.operator(task.run_id)?
            .workspace()
            .read("t", 0, None)
            .await?
            .entries
            .is_empty(),
        "nothing was written"
    );
    Ok(())
}

#[tokio::test]
async fn exec_tools_run_concurrently_with_json_on_stdin() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let mut config = h.config();
    config.tools = Vec::new();
    config.exec_tools.insert(
        "echo_slowly".into(),
        ExecToolConfig {
            command: "sh".into(),
            args: vec!["-c".into(), "sleep 1; cat".into()],
            description: "Echoes its arguments after a while".into(),
            parameters: json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
            timeout: Duration::from_secs(10),
            cwd: None,
            env: BTreeMap::new(),
        },
    );
    config.exec_tools.insert(
        "fail".into(),
        ExecToolConfig {
            command: "sh".into(),
            args: vec!["-c".into(), "echo broken >&2; exit 3".into()],
            description: String::new(),
            parameters: json!({"type": "object"}),
            timeout: Duration::from_secs(10),
            cwd: None,
            env: BTreeMap::new(),
        },
    );
    h.llm.push(Reply::tool_calls([
        ("echo_slowly", json!({"n": 1})),
        ("echo_slowly", json!({"n": 2})),
        ("fail", json!({})),
    ]));
    h.llm.push(Reply::text("ok"));
    let agent = h.agent(&config)?;
    let started = Instant::now();
    let reply = h
        .run(&agent, &envelope("t", "x"), TIMEOUT)
        .await?
        .map_err(anyhow::Error::msg)?;
    let took = started.elapsed();
    assert_eq!(reply.response, "ok");
    assert!(
        took < Duration::from_millis(1900),
        "two 1 s tools ran concurrently: {took:?}"
    );
    let second = &h.llm.requests()[1];
    assert_eq!(second.tool_names(), vec!["echo_slowly", "fail"]);
    let contents: Vec<String> = second
        .messages()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| m["content"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&contents[1])?,
        json!({"n": 2})
    );
    assert!(contents[2].contains("broken") && contents[2].contains("tool_failed"));
    Ok(())
}

#[tokio::test]
async fn a_rate_limit_is_retried_after_retry_after() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    h.llm.push(Reply::rate_limited("0.4"));
    h.llm.push(Reply::status(503));
    h.llm.push(Reply::malformed_chunk("half an ans"));
    h.llm.push(Reply::text("finally"));
    let agent = h.agent(&h.config())?;
    let started = Instant::now();
    let reply = h
        .run(&agent, &envelope("t", "x"), TIMEOUT)
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(reply.response, "finally");
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "Retry-After was honoured"
    );
    assert_eq!(h.llm.requests().len(), 4);
    Ok(())
}

#[tokio::test]
async fn server_errors_until_the_deadline_fail_the_attempt_in_time() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    h.llm
        .push_all((0..200).map(|_| Reply::status(500).when("the first task")));
    let mut config = h.config();
    config.max_retries = 100;
    let agent = h.agent(&config)?;
    let started = Instant::now();
    let e = h
        .run(
            &agent,
            &envelope("t", "the first task"),
            Duration::from_millis(1500),
        )
        .await?
        .expect_err("keeps failing");
    let took = started.elapsed();
    assert_eq!(e.kind, TaskErrorKind::AgentFailed);
    assert!(e.message.contains("500"), "{e}");
    assert!(e.message.contains("deadline"), "{e}");
    assert!(took < Duration::from_millis(1600), "{took:?}");
    assert!(h.llm.requests().len() >= 3, "it retried");
    // A client error is not retried.
    h.llm.push(Reply::status_message(400, "unknown model"));
    let before = h.llm.requests().len();
    let e = h
        .run(&agent, &envelope("t", "x"), TIMEOUT)
        .await?
        .expect_err("rejected");
    assert!(e.message.contains("unknown model"), "{e}");
    assert_eq!(h.llm.requests().len(), before + 1);
    Ok(())
}

#[tokio::test]
async fn hangs_time_out_and_cancellation_aborts_the_request() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let mut config = h.config();
    config.request_timeout = Duration::from_millis(300);
    h.llm.push(Reply::hang());
    h.llm.push(Reply::hang_mid_stream("Let me th"));
    h.llm.push(Reply::text("answer"));
    let agent = h.agent(&config)?;
    let reply = h
        .run(&agent, &envelope("t", "x"), TIMEOUT)
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(reply.response, "answer");
    assert_eq!(h.llm.requests().len(), 3);

    // Cancellation in the middle of a stream returns at once and closes the connection.
    config.request_timeout = Duration::from_secs(60);
    let agent = h.agent(&config)?;
    h.llm.push(Reply::hang_mid_stream("thinking"));
    let task = envelope("t", "x");
    let (ctx, cancel) = h.context(&task, TIMEOUT)?;
    let disconnects = h.llm.disconnects();
    let canceller = async {
        h.llm.wait_for_requests(4, TIMEOUT).await?;
        tokio::time::sleep(Duration::from_millis(100)).await;
        cancel.cancel();
        Ok::<_, anyhow::Error>(Instant::now())
    };
    let (result, cancelled_at) = tokio::join!(agent.run(&task, ctx), canceller);
    let after_cancel = cancelled_at?.elapsed();
    let e = result.expect_err("cancelled");
    assert_eq!(e.kind, TaskErrorKind::Cancelled);
    assert!(
        after_cancel < Duration::from_millis(500),
        "{after_cancel:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while h.llm.disconnects() <= disconnects {
        assert!(
            Instant::now() < deadline,
            "the server saw the request go away"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

#[tokio::test]
async fn structured_output_valid_repaired_and_invalid() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let agent = h.agent(&h.config())?;
    let schema = json!({"type": "object", "properties": {"growth": {"type": "number"}}, "required": ["growth"]});
    let mut task = envelope("t", "Give the growth.");
    task.output_schema = Some(schema.clone());

    h.llm.push(Reply::text("{\"growth\": 6.7}"));
    let reply = h
        .run(&agent, &task, TIMEOUT)
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(
        serde_json::from_str::<Value>(&reply.response)?,
        json!({"growth": 6.7})
    );
    let format = h.llm.requests()[0]
        .response_format()
        .cloned()
        .expect("sent");
    assert_eq!(format["type"], "json_schema");
    assert_eq!(format["json_schema"]["schema"], schema);

    h.llm.push(Reply::text("growth was 6.7%"));
    h.llm.push(Reply::text("```json\n{\"growth\": 6.7}\n```"));
    let reply = h
        .run(&agent, &task, TIMEOUT)
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(reply.response, "{\"growth\":6.7}");
    let repair = h.llm.requests()[2].user();
    assert!(
        repair.contains("does not match the required JSON Schema"),
        "{repair}"
    );

    h.llm.push(Reply::text("{\"growth\": \"high\"}"));
    h.llm.push(Reply::text("{}"));
    let e = h
        .run(&agent, &task, TIMEOUT)
        .await?
        .expect_err("invalid twice");
    assert_eq!(e.kind, TaskErrorKind::InvalidOutput);
    assert!(!e.kind.is_retryable());
    assert!(e.message.contains("growth"), "{e}");
    assert_eq!(h.llm.requests().len(), 5);

    task.output_schema = Some(json!({"type": "no-such-type"}));
    let e = h
        .run(&agent, &task, TIMEOUT)
        .await?
        .expect_err("bad schema");
    assert_eq!(e.kind, TaskErrorKind::BadEnvelope);
    Ok(())
}

#[tokio::test]
async fn the_request_cap_is_shared_by_a_providers_agents() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let mut config = h.config();
    config.max_concurrent_requests = 1;
    let providers = flotilla_llm::Providers::default();
    let roles = Arc::new(flotilla_llm::Roles::default());
    let a =
        flotilla_llm::LlmAgent::new("a", &config, Arc::clone(&roles), &providers, ".".as_ref())?;
    let b = flotilla_llm::LlmAgent::new("b", &config, roles, &providers, ".".as_ref())?;
    h.llm
        .push(Reply::text("one").delay(Duration::from_millis(400)));
    h.llm
        .push(Reply::text("two").delay(Duration::from_millis(400)));
    let (ta, tb) = (envelope("a", "x"), envelope("b", "y"));
    let started = Instant::now();
    let (ra, rb) = tokio::join!(h.run(&a, &ta, TIMEOUT), h.run(&b, &tb, TIMEOUT));
    assert!(ra?.is_ok() && rb?.is_ok());
    assert!(
        started.elapsed() >= Duration::from_millis(800),
        "one request at a time"
    );
    Ok(())
}

#[tokio::test]
async fn missing_keys_and_bad_configs_are_named() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let mut config = h.config();
    config.api_key_env = Some("FLOTILLA_TEST_LLM_KEY_THAT_IS_NOT_SET".into());
    let agent = h.agent(&config)?;
    let e = h
        .run(&agent, &envelope("t", "x"), TIMEOUT)
        .await?
        .expect_err("no key");
    assert!(
        e.message.contains("FLOTILLA_TEST_LLM_KEY_THAT_IS_NOT_SET"),
        "{e}"
    );
    assert!(h.llm.requests().is_empty(), "nothing was sent");

    let mut bad = h.config();
    bad.base_url = "not a url".into();
    let e = h.agent(&bad).expect_err("bad url");
    assert_eq!(
        e.to_string().split(':').next(),
        Some("agents.test_agent.base-url")
    );
    Ok(())
}

fn budgeted(
    h: &Harness,
    run: flotilla_model::RunId,
    id: &str,
    max_tokens: Option<u64>,
    max_cost: Option<f64>,
) -> flotilla_model::task::TaskEnvelope {
    let mut t = envelope(id, "Say something short.");
    t.run_id = run;
    t.budget = Some(flotilla_model::task::Budget {
        max_tokens,
        max_cost,
    });
    let _ = h;
    t
}

#[tokio::test]
async fn a_call_that_could_pass_the_runs_token_budget_is_not_made() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let mut config = h.config();
    config.tools = Vec::new();
    config.max_output_tokens = Some(100);
    config.price = Some(flotilla_llm::Price {
        input_per_mtok: 2.0,
        output_per_mtok: 10.0,
    });
    let agent = h.agent(&config)?;
    let run = flotilla_model::RunId::new();
    h.llm.push(Reply::text("one").usage(300, 50));
    h.llm.push(Reply::text("two").usage(500, 50));
    h.llm.push(Reply::text("never sent"));
    let a = budgeted(&h, run, "a", Some(1000), None);
    let b = budgeted(&h, run, "b", Some(1000), None);
    let c = budgeted(&h, run, "c", Some(1000), None);
    assert!(h.run(&agent, &a, TIMEOUT).await?.is_ok());
    assert!(h.run(&agent, &b, TIMEOUT).await?.is_ok());
    let e = h.run(&agent, &c, TIMEOUT).await?.expect_err("over budget");
    assert_eq!(e.kind, TaskErrorKind::BudgetExhausted);
    assert!(!e.kind.is_retryable());
    assert!(e.message.contains("max_tokens (1000)"), "{e}");
    assert!(e.message.contains("900 spent"), "{e}");
    assert_eq!(h.llm.requests().len(), 2, "the third call was not made");

    let events = h.events(run, |e| has_usage(e, 2)).await?;
    let cost = events
        .iter()
        .find_map(|e| match e {
            Event::Usage { cost_usd, .. } => *cost_usd,
            _ => None,
        })
        .expect("priced usage");
    assert!(
        (cost - (300.0 * 2.0 + 50.0 * 10.0) / 1e6).abs() < 1e-12,
        "{cost}"
    );
    Ok(())
}

#[tokio::test]
async fn concurrent_calls_share_the_budget_and_cost_needs_a_price() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let mut config = h.config();
    config.tools = Vec::new();
    config.max_output_tokens = Some(200);
    let agent = h.agent(&config)?;
    let run = flotilla_model::RunId::new();
    h.llm.push(
        Reply::text("first")
            .usage(100, 20)
            .delay(Duration::from_millis(300)),
    );
    h.llm.push(
        Reply::text("second")
            .usage(100, 20)
            .delay(Duration::from_millis(300)),
    );
    // Each call reserves its prompt and 200 output tokens: two do not fit in 400.
    let a = budgeted(&h, run, "a", Some(400), None);
    let b = budgeted(&h, run, "b", Some(400), None);
    let (ra, rb) = tokio::join!(h.run(&agent, &a, TIMEOUT), h.run(&agent, &b, TIMEOUT));
    let results = [ra?, rb?];
    assert_eq!(
        results.iter().filter(|r| r.is_ok()).count(),
        1,
        "{results:?}"
    );
    assert!(
        results
            .iter()
            .any(|r| matches!(r, Err(e) if e.kind == TaskErrorKind::BudgetExhausted))
    );
    assert_eq!(h.llm.requests().len(), 1);

    let c = budgeted(&h, flotilla_model::RunId::new(), "c", None, Some(1.0));
    let e = h.run(&agent, &c, TIMEOUT).await?.expect_err("no price");
    assert_eq!(e.kind, TaskErrorKind::BudgetExhausted);
    assert!(e.message.contains("no price"), "{e}");
    Ok(())
}

#[tokio::test]
async fn tool_choice_required_forces_a_tool_call_in_each_round_then_an_answer() -> anyhow::Result<()>
{
    let h = Harness::start().await?;
    h.llm.push(Reply::tool_calls([(
        "state_set",
        json!({"key": "k", "value": 1}),
    )]));
    h.llm.push(Reply::tool_calls([(
        "state_set",
        json!({"key": "k", "value": 2}),
    )]));
    h.llm.push(Reply::text("Done."));
    let mut config = h.config();
    config.tool_choice = flotilla_llm::ToolChoice::Required;
    config.max_tool_rounds = 2;
    let agent = h.agent(&config)?;
    let reply = h
        .run(&agent, &envelope("t", "set k"), TIMEOUT)
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(reply.response, "Done.");
    let choices: Vec<Value> = h
        .llm
        .requests()
        .iter()
        .map(|r| r.body.get("tool_choice").cloned().unwrap_or(Value::Null))
        .collect();
    assert_eq!(
        choices,
        vec![json!("required"), json!("required"), json!("none")]
    );

    // Without tools, `required` is a configuration error naming the field.
    let mut bad = h.config();
    bad.tool_choice = flotilla_llm::ToolChoice::Required;
    bad.tools.clear();
    let e = bad.validate("lonely").expect_err("no tools");
    assert!(e.to_string().contains("tool-choice"), "{e}");
    // Other agents are tools too: `call_agent` (agent-tools) and `transfer_to_agent`
    // (sub-agents).
    let mut caller = bad.clone();
    caller.agent_tools = vec!["helper".into()];
    caller.validate("caller").map_err(anyhow::Error::msg)?;
    let mut router = bad.clone();
    router.sub_agents = vec!["billing".into()];
    router.validate("router").map_err(anyhow::Error::msg)?;
    Ok(())
}
