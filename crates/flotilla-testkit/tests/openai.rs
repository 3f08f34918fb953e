//! The scripted OpenAI-compatible test server, spoken to over plain HTTP: SSE framing, tool
//! call chunks, usage, error statuses and request recording.

use std::time::Duration;

use flotilla_testkit::openai::{OpenAiServer, Reply};
use serde_json::{Value, json};

fn request(stream: bool) -> Value {
    json!({
        "model": "test-model",
        "stream": stream,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        "tools": [{"type": "function", "function": {"name": "state_get", "parameters": {"type": "object"}}}],
    })
}

async fn post(server: &OpenAiServer, body: &Value) -> anyhow::Result<reqwest::Response> {
    Ok(reqwest::Client::new()
        .post(format!("{}/chat/completions", server.base_url()))
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-test")
        .body(body.to_string())
        .send()
        .await?)
}

/// The `data:` payloads of an SSE body, in order.
fn events(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn streams_text_then_usage_then_done_and_records_the_request() -> anyhow::Result<()> {
    let server = OpenAiServer::start().await?;
    server.push(Reply::text("Hello there, world").usage(11, 3));
    let response = post(&server, &request(true)).await?;
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.headers()["content-type"].to_str()?,
        "text/event-stream"
    );
    let events = events(&response.text().await?);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e))
        .collect::<Result<_, _>>()?;
    let text: String = chunks
        .iter()
        .filter_map(|c| {
            c.pointer("/choices/0/delta/content")
                .and_then(Value::as_str)
        })
        .collect();
    assert_eq!(text, "Hello there, world");
    let usage = chunks.last().and_then(|c| c.get("usage")).expect("usage");
    assert_eq!(usage["prompt_tokens"], 11);
    assert_eq!(usage["completion_tokens"], 3);
    assert!(
        chunks
            .iter()
            .any(|c| c.pointer("/choices/0/finish_reason") == Some(&json!("stop")))
    );

    let recorded = server.requests();
    assert_eq!(recorded.len(), 1);
    assert!(recorded[0].stream());
    assert_eq!(recorded[0].model(), "test-model");
    assert_eq!(recorded[0].system(), "be brief");
    assert_eq!(recorded[0].user(), "hello");
    assert_eq!(recorded[0].tool_names(), vec!["state_get".to_string()]);
    assert_eq!(recorded[0].header("Authorization"), Some("Bearer sk-test"));
    Ok(())
}

#[tokio::test]
async fn parallel_tool_calls_arrive_as_indexed_chunks() -> anyhow::Result<()> {
    let server = OpenAiServer::start().await?;
    server.push(Reply::tool_calls([
        ("workspace_write", json!({"topic": "a", "entry": {"x": 1}})),
        ("workspace_write", json!({"topic": "b", "entry": {"y": 2}})),
    ]));
    let events = events(&post(&server, &request(true)).await?.text().await?);
    let mut args = [String::new(), String::new()];
    let mut ids = Vec::new();
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let c: Value = serde_json::from_str(e)?;
        for call in c
            .pointer("/choices/0/delta/tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let i = call["index"].as_u64().expect("index") as usize;
            if let Some(id) = call.get("id").and_then(Value::as_str) {
                ids.push(id.to_owned());
            }
            if let Some(a) = call.pointer("/function/arguments").and_then(Value::as_str) {
                args[i].push_str(a);
            }
        }
    }
    assert_eq!(ids.len(), 2);
    assert_ne!(ids[0], ids[1]);
    assert_eq!(
        serde_json::from_str::<Value>(&args[1])?,
        json!({"topic": "b", "entry": {"y": 2}})
    );
    Ok(())
}

#[tokio::test]
async fn non_streaming_replies_carry_message_and_usage() -> anyhow::Result<()> {
    let server = OpenAiServer::start().await?;
    server.push(Reply::tool_call("state_get", json!({"key": "k"})).with_text("checking"));
    let body: Value = post(&server, &request(false)).await?.json_text().await?;
    assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(body["choices"][0]["message"]["content"], "checking");
    assert_eq!(
        body["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
        "state_get"
    );
    assert!(body["usage"]["prompt_tokens"].as_u64().unwrap_or(0) > 0);
    Ok(())
}

#[tokio::test]
async fn failures_rate_limits_and_an_exhausted_script() -> anyhow::Result<()> {
    let server = OpenAiServer::start().await?;
    server.push(Reply::rate_limited("2"));
    server.push(Reply::status(503));
    server.push(Reply::malformed_chunk("partial"));
    let r = post(&server, &request(true)).await?;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"].to_str()?, "2");
    assert_eq!(post(&server, &request(true)).await?.status(), 503);
    let events = events(&post(&server, &request(true)).await?.text().await?);
    assert!(
        events
            .last()
            .is_some_and(|e| serde_json::from_str::<Value>(e).is_err()),
        "{events:?}"
    );
    let r = post(&server, &request(true)).await?;
    assert_eq!(r.status(), 500);
    assert!(r.text().await?.contains("no reply left"));
    assert_eq!(server.requests().len(), 4);
    assert_eq!(server.requests()[3].reply_index, None);
    Ok(())
}

#[tokio::test]
async fn matchers_hangs_and_delays() -> anyhow::Result<()> {
    let server = OpenAiServer::start().await?;
    server.push(Reply::text("for b").when("task b"));
    server.push(Reply::text("for anyone").delay(Duration::from_millis(50)));
    server.push(Reply::hang());
    let mut b = request(false);
    b["messages"][1]["content"] = json!("this is task b");
    let answer: Value = post(&server, &b).await?.json_text().await?;
    assert_eq!(answer["choices"][0]["message"]["content"], "for b");
    let started = std::time::Instant::now();
    let answer: Value = post(&server, &request(false)).await?.json_text().await?;
    assert_eq!(answer["choices"][0]["message"]["content"], "for anyone");
    assert!(started.elapsed() >= Duration::from_millis(50));
    let hung =
        tokio::time::timeout(Duration::from_millis(300), post(&server, &request(true))).await;
    assert!(hung.is_err(), "a hanging reply never answers");
    server.wait_for_requests(3, Duration::from_secs(5)).await?;
    Ok(())
}

trait JsonText {
    async fn json_text(self) -> anyhow::Result<Value>;
}

impl JsonText for reqwest::Response {
    async fn json_text(self) -> anyhow::Result<Value> {
        Ok(serde_json::from_str(&self.text().await?)?)
    }
}

/// The examples' script files (`config/examples/models/`) read as the replies they list, the
/// same as scripted by hand; a file that is not a script is refused with what is wrong.
#[tokio::test]
async fn script_files_read_as_scripted_replies() -> anyhow::Result<()> {
    use flotilla_testkit::openai::{ScriptFileError, parse_script, read_script};
    use std::path::Path;
    let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config/examples/models");
    let mut files = 0;
    for entry in std::fs::read_dir(&models)? {
        let path = entry?.path();
        let listed: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
        let replies = read_script(&path)?;
        assert_eq!(replies.len(), listed.len(), "{}", path.display());
        files += 1;
    }
    assert!(files >= 5, "the examples' model files: {files}");

    let script = r#"[
        {"when": "Your task (a)", "tool_calls": [{"name": "state_get", "arguments": {"key": "q"}}]},
        {"text": "before", "tool_calls": [{"name": "state_get"}]},
        {"when": "Your task (b)", "text": "b's answer"}
    ]"#;
    let here = Path::new("inline.json");
    let replies = parse_script(script, here)?;
    assert_eq!(
        replies,
        [
            Reply::tool_call("state_get", json!({"key": "q"})).when("Your task (a)"),
            Reply::tool_call("state_get", json!({})).with_text("before"),
            Reply::text("b's answer").when("Your task (b)"),
        ]
    );
    // Served like any script: the first reply whose `when` the request contains (or that has
    // none) answers it, so the request naming task b skips a's reply and gets the next.
    let server = OpenAiServer::start().await?;
    server.push_all(replies);
    let mut body = request(false);
    body["messages"][1]["content"] = json!("Your task (b): answer");
    let answer: Value = serde_json::from_str(&post(&server, &body).await?.text().await?)?;
    assert_eq!(
        answer.pointer("/choices/0/message/content"),
        Some(&json!("before")),
        "{answer}"
    );
    assert_eq!(
        answer.pointer("/choices/0/message/tool_calls/0/function/arguments"),
        Some(&json!("{}")),
        "{answer}"
    );
    assert_eq!(server.remaining(), 2);

    let e = parse_script(r#"[{"text": "fine"}, {"when": "x"}]"#, here).expect_err("empty");
    assert!(matches!(e, ScriptFileError::Empty { number: 2, .. }), "{e}");
    assert_eq!(
        e.to_string(),
        "inline.json: reply 2 has neither text nor tool_calls"
    );
    let e = parse_script(r#"[{"txt": "typo"}]"#, here).expect_err("an unknown field");
    assert!(matches!(e, ScriptFileError::Malformed { .. }), "{e}");
    assert!(
        e.to_string()
            .starts_with("inline.json: not a list of scripted replies")
            && e.to_string().contains("unknown field `txt`"),
        "{e}"
    );
    assert!(matches!(
        read_script(&models.join("no-such.json")),
        Err(ScriptFileError::Read { .. })
    ));
    Ok(())
}
