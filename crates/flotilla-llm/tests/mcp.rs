//! MCP tools: an LLM agent (against the scripted OpenAI-compatible test server, a test double)
//! calls the tools of a real MCP server — `tests/mcp_server.py`, a small standard-library
//! server speaking MCP over stdio and streamable HTTP — through the `rmcp` client.

mod common;

use std::io::BufRead;
use std::path::PathBuf;
use std::time::Duration;

use common::*;
use flotilla_llm::McpServerConfig;
use flotilla_model::event::Event;
use flotilla_model::task::TaskErrorKind;
use flotilla_testkit::openai::Reply;
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(30);

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/mcp_server.py")
}

fn stdio_server(log: &std::path::Path, tools: Option<Vec<String>>) -> McpServerConfig {
    McpServerConfig {
        command: Some("python3".into()),
        args: vec![script().display().to_string(), "stdio".into()],
        env: [("MCP_LOG".to_string(), log.display().to_string())]
            .into_iter()
            .collect(),
        cwd: None,
        url: None,
        tools,
        timeout: Duration::from_secs(20),
    }
}

fn tool_results(request: &flotilla_testkit::openai::RecordedRequest) -> Vec<Value> {
    request
        .messages()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            // A JSON result as JSON; a text result is handed to the model as plain text.
            let text = m["content"].as_str().unwrap_or_default();
            serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))
        })
        .collect()
}

#[tokio::test]
async fn the_model_calls_tools_of_a_stdio_mcp_server() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("calls.jsonl");
    let mut config = h.config();
    config.tools = vec!["state_get".into()];
    config.mcp_servers.insert(
        "calc".into(),
        stdio_server(
            &log,
            Some(vec!["add".into(), "shout".into(), "fail".into()]),
        ),
    );
    h.llm.push(Reply::tool_calls([
        ("calc__add", json!({"a": 2, "b": 3})),
        ("calc__shout", json!({"text": "quiet"})),
        ("calc__fail", json!({})),
        ("calc__add", json!({"a": "two"})),
    ]));
    h.llm.push(Reply::text("2 + 3 = 5"));
    h.llm
        .push(Reply::tool_call("calc__add", json!({"a": 1, "b": 1})));
    h.llm.push(Reply::text("1 + 1 = 2"));
    let agent = h.agent(&config)?;

    let task = envelope("sum", "Add things.");
    let reply = h
        .run(&agent, &task, TIMEOUT)
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(reply.response, "2 + 3 = 5");
    let first = &h.llm.requests()[0];
    assert_eq!(
        first.tool_names(),
        vec!["calc__add", "calc__fail", "calc__shout", "state_get"],
        "the allow-list hides `hidden`"
    );
    let add = first.body["tools"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["function"]["name"] == "calc__add"))
        .expect("offered");
    assert_eq!(add["function"]["description"], "Adds two numbers");
    assert_eq!(add["function"]["parameters"]["required"], json!(["a", "b"]));

    let results = tool_results(&h.llm.requests()[1]);
    assert_eq!(results[0], json!({"sum": 5}), "structured content");
    assert_eq!(results[1], json!("QUIET"), "text content");
    assert_eq!(results[2]["error"]["code"], "tool_failed");
    assert!(
        results[2]["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("disk on fire"))
    );
    assert_eq!(
        results[3]["error"]["code"], "invalid_arguments",
        "checked against the server's schema"
    );
    let calls: Vec<Value> = std::fs::read_to_string(&log)?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    assert_eq!(
        calls.len(),
        3,
        "the invalid call never reached the server: {calls:?}"
    );

    let events = h
        .events(task.run_id, |e| {
            e.iter()
                .filter(|x| matches!(x, Event::ToolEnd { .. }))
                .count()
                == 4
        })
        .await?;
    assert!(events.iter().any(
        |e| matches!(e, Event::ToolEnd { ok: false, tool: Some(t), .. } if t == "calc__fail")
    ));

    // The worker keeps the connection: the next attempt reuses the running server.
    let reply = h
        .run(&agent, &envelope("again", "Add."), TIMEOUT)
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(reply.response, "1 + 1 = 2");
    assert_eq!(tool_results(&h.llm.requests()[3])[0], json!({"sum": 2}));
    Ok(())
}

#[tokio::test]
async fn the_model_calls_tools_of_a_streamable_http_mcp_server() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let mut child = std::process::Command::new("python3")
        .arg(script())
        .arg("http")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop_guard()?;
    let port = {
        let out = child.0.stdout.take().expect("stdout");
        let mut line = String::new();
        std::io::BufReader::new(out).read_line(&mut line)?;
        line.trim().trim_start_matches("PORT ").parse::<u16>()?
    };
    let mut config = h.config();
    config.tools = Vec::new();
    config.mcp_servers.insert(
        "web".into(),
        McpServerConfig {
            command: None,
            args: Vec::new(),
            env: Default::default(),
            cwd: None,
            url: Some(format!("http://127.0.0.1:{port}/mcp")),
            tools: None,
            timeout: Duration::from_secs(20),
        },
    );
    h.llm
        .push(Reply::tool_call("web__shout", json!({"text": "over http"})));
    h.llm.push(Reply::text("done"));
    let agent = h.agent(&config)?;
    let reply = h
        .run(&agent, &envelope("t", "x"), TIMEOUT)
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(reply.response, "done");
    assert_eq!(h.llm.requests()[0].tool_names().len(), 4);
    assert_eq!(tool_results(&h.llm.requests()[1])[0], json!("OVER HTTP"));
    Ok(())
}

#[tokio::test]
async fn an_unreachable_mcp_server_fails_the_attempt_before_any_model_call() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let mut config = h.config();
    config.mcp_servers.insert(
        "ghost".into(),
        McpServerConfig {
            command: Some("/nonexistent/mcp-server".into()),
            args: Vec::new(),
            env: Default::default(),
            cwd: None,
            url: None,
            tools: None,
            timeout: Duration::from_secs(5),
        },
    );
    let agent = h.agent(&config)?;
    let e = h
        .run(&agent, &envelope("t", "x"), TIMEOUT)
        .await?
        .expect_err("no server");
    assert_eq!(e.kind, TaskErrorKind::AgentFailed);
    assert!(e.message.contains("MCP server ghost"), "{e}");
    assert!(h.llm.requests().is_empty());
    Ok(())
}

/// Kills a spawned process when the test ends.
struct Guard(std::process::Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

trait SpawnGuarded {
    fn kill_on_drop_guard(&mut self) -> std::io::Result<Guard>;
}

impl SpawnGuarded for std::process::Command {
    fn kill_on_drop_guard(&mut self) -> std::io::Result<Guard> {
        self.spawn().map(Guard)
    }
}
