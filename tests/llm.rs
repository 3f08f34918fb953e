//! LLM agents end to end: `flotilla coordinator` and `flotilla worker` processes with
//! `kind = "llm"` agents in their config file, against the test kit's scripted
//! OpenAI-compatible server — a test double whose answers are scripted here, not a model.

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use flotilla_coordinator::store::RunStore;
use flotilla_model::event::Event;
use flotilla_model::plan::Subtask;
use flotilla_model::run::RunStatus;
use flotilla_model::runlog::RunInput;
use flotilla_model::submit::SubmitRequest;
use flotilla_testkit::openai::{OpenAiServer, Reply};
use futures::StreamExt;
use serde_json::json;
use support::*;

fn agents(base_url: &str) -> String {
    format!(
        r#"
[agents.researcher]
kind = "llm"
base-url = "{base_url}"
model = "scripted-model"
tools = ["workspace_write", "state_set"]
retry-initial-backoff = "50ms"

[agents.writer]
kind = "llm"
base-url = "{base_url}"
model = "scripted-model"
instruction = "The reader is {{audience}}."

[roles.writer]
prompt = "You write short reports for executives."
"#
    )
}

#[tokio::test]
async fn a_plan_of_two_llm_tasks_runs_through_coordinator_and_worker() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    // The researcher writes its notes with two tools at once, is rate limited once, answers.
    llm.push(
        Reply::tool_calls([
            (
                "workspace_write",
                json!({"topic": "notes", "entry": {"revenue": 1250}}),
            ),
            (
                "state_set",
                json!({"key": "audience", "value": "the board"}),
            ),
        ])
        .when("Your task (research)"),
    );
    llm.push(Reply::rate_limited("0.2").when("Your task (research)"));
    llm.push(
        Reply::text("Revenue was 1250.")
            .usage(100, 10)
            .when("Your task (research)"),
    );
    llm.push(
        Reply::text("{\"summary\": \"Revenue reached 1250.\", \"revenue\": 1250}")
            .usage(200, 20)
            .when("Your task (report)"),
    );

    let mut p = Processes::start(&agents(&llm.base_url())).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;

    let mut research =
        Subtask::new("research", "Find the quarter's revenue.").with_agent("researcher");
    research.role = Some("researcher".into());
    research.produces = vec!["notes".into()];
    let mut report = Subtask::new("report", "Write the report.")
        .with_agent("writer")
        .after(&["research"]);
    report.role = Some("writer".into());
    report.output_schema = Some(json!({
        "type": "object",
        "properties": {"summary": {"type": "string"}, "revenue": {"type": "number"}},
        "required": ["summary", "revenue"]
    }));
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![research, report])))
        .await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(
        outcome.status,
        RunStatus::Succeeded,
        "{outcome:?}\n{}",
        p.log(1)
    );
    let final_result = outcome.final_result.expect("final result");
    assert!(
        final_result.response.contains("\"revenue\":1250"),
        "{final_result:?}"
    );

    // Tokens of every model call reach the task results.
    let store = RunStore::open(&p.bus).await?;
    let tokens: BTreeMap<String, u64> = store
        .history(run)
        .await?
        .into_iter()
        .filter_map(|(_, _, e)| match e.input {
            RunInput::TaskResult(r) if r.result.success => {
                Some((r.task_id.to_string(), r.result.tokens))
            }
            _ => None,
        })
        .collect();
    assert_eq!(tokens["report"], 220);
    assert!(tokens["research"] > 110, "{tokens:?}");

    // What the model was told.
    let requests = llm.requests();
    assert_eq!(requests.len(), 4, "{requests:#?}");
    let to_writer = requests
        .iter()
        .find(|r| r.user().contains("Your task (report)"))
        .expect("the writer was asked");
    assert!(
        to_writer
            .system()
            .starts_with("You write short reports for executives.")
    );
    assert!(
        to_writer.system().contains("The reader is the board."),
        "session state written by the researcher's tool: {}",
        to_writer.system()
    );
    assert!(
        to_writer
            .user()
            .contains("## research (succeeded, numeric value 1250)\nRevenue was 1250."),
        "{}",
        to_writer.user()
    );
    assert_eq!(
        to_writer.response_format().map(|f| f["type"].clone()),
        Some(json!("json_schema"))
    );

    // The researcher's entry is in the workspace, beside the automatic produce entry.
    let (entries, _, _) = store
        .topic_entries(run, "notes", 0, usize::MAX, 100)
        .await?;
    assert!(
        entries
            .iter()
            .any(|e| e.entry.get("revenue") == Some(&json!(1250))),
        "{entries:#?}"
    );

    // The run's event stream carries the agent events.
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    let mut seen = BTreeMap::<&str, usize>::new();
    let collect = async {
        while let Some(e) = events.next().await {
            let name = match e?.event {
                Event::Usage { .. } => "usage",
                Event::ToolStart { .. } => "tool_start",
                Event::ToolEnd { ok: true, .. } => "tool_end",
                Event::AssistantReply { is_final: true, .. } => "final_reply",
                _ => continue,
            };
            *seen.entry(name).or_default() += 1;
            if seen.get("usage") == Some(&3) && seen.get("tool_end") == Some(&2) {
                return Ok::<_, anyhow::Error>(());
            }
        }
        anyhow::bail!("the event stream ended")
    };
    tokio::time::timeout(Duration::from_secs(20), collect).await??;
    assert_eq!(seen.get("tool_start"), Some(&2), "{seen:?}");
    Ok(())
}

#[tokio::test]
async fn a_spent_token_budget_fails_the_run_without_retries() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    llm.push(Reply::text("Revenue was 1250.").usage(900, 80));
    let extra = format!(
        "{}\n[agents.researcher.price]\ninput-per-mtok = 0.15\noutput-per-mtok = 0.6\n",
        agents(&llm.base_url())
    );
    let mut p = Processes::start(&extra).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let first = Subtask::new("first", "Find the revenue.").with_agent("researcher");
    let second = Subtask::new("second", "Check it.")
        .with_agent("researcher")
        .after(&["first"]);
    let mut plan = plan(vec![first, second]);
    plan.config.max_tokens = Some(1200);
    let run = p.client.submit(SubmitRequest::new(plan)).await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed, "{outcome:?}");
    let failed = &outcome.failed[0];
    assert_eq!(failed.task_id.as_str(), "second");
    assert_eq!(
        failed.error.kind,
        flotilla_model::task::TaskErrorKind::BudgetExhausted
    );
    assert_eq!(failed.attempts, 1, "budget_exhausted is not retried");
    assert!(
        failed.error.message.contains("max_tokens (1200)"),
        "{failed:?}"
    );
    assert_eq!(llm.requests().len(), 1, "the second call was never made");
    Ok(())
}

#[tokio::test]
async fn a_bad_llm_agent_stops_the_worker_with_the_field_named() -> anyhow::Result<()> {
    let extra = r#"
[agents.writer]
kind = "llm"
base-url = "http://127.0.0.1:9/v1"
model = "m"
temperature = 7.5
"#;
    let mut p = Processes::start(extra).await?;
    let i = p.spawn(&["worker"])?;
    let code = p.wait_exit(i, Duration::from_secs(20)).await?;
    assert_ne!(code, Some(0));
    let log = p.log(i);
    assert!(
        log.contains("agents.writer.temperature: 7.5 is outside 0 to 2"),
        "{log}"
    );
    Ok(())
}

#[test]
fn the_llm_example_config_is_valid() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = tempfile::tempdir()?;
    let plan = dir.path().join("plan.json");
    std::fs::write(
        &plan,
        json!({"subtasks": [
            {"id": "collect", "agent": "researcher", "role": "researcher", "produces": ["notes"]},
            {"id": "analyse", "agent": "analyst", "role": "analyst", "consumes": ["notes"]},
            {"id": "review", "role": "critic", "dependencies": ["analyse"],
             "output_schema": {"type": "object"}}
        ]})
        .to_string(),
    )?;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .current_dir(&root)
        .env_remove("FLOTILLA_CONFIG")
        .args(["--config", "config/examples/llm.toml", "plan", "validate"])
        .arg(&plan)
        .output()?;
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[test]
fn the_research_team_example_and_its_plan_are_valid() -> anyhow::Result<()> {
    // scripts/demo-llm runs them on a real model; here only the config and the plan are checked.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .current_dir(&root)
        .env_remove("FLOTILLA_CONFIG")
        .env(
            "FLOTILLA_AGENTS__RESEARCHER__BASE_URL",
            "http://127.0.0.1:9/v1",
        )
        .args([
            "--config",
            "config/examples/research-team.toml",
            "plan",
            "validate",
            "config/examples/plans/research-team.json",
        ])
        .output()?;
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The example's exec tool answers a search.
    let mut tool = std::process::Command::new("python3")
        .arg(root.join("config/examples/agents/search_corpus.py"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    {
        use std::io::Write;
        let mut stdin = tool.stdin.take().expect("piped stdin");
        stdin.write_all(br#"{"query": "turbine cost"}"#)?;
    }
    let out = tool.wait_with_output()?;
    assert!(out.status.success());
    let found: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert!(
        found["matches"]
            .as_array()
            .is_some_and(|m| m.iter().any(|l| l["file"] == "costs.txt")),
        "{found}"
    );
    Ok(())
}
