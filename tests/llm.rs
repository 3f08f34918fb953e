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

/// The step journal under a real crash: a worker is killed (`kill -9`) while its LLM agent
/// waits for its third model reply; the redelivered attempt on another worker replays the two
/// replies and the two tool rounds it finds journaled and makes only the missing call.
#[tokio::test]
async fn a_redelivered_llm_attempt_resumes_from_its_step_journal() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    llm.push(
        Reply::tool_call(
            "workspace_write",
            json!({"topic": "notes", "entry": {"step": 1}}),
        )
        .usage(1000, 50),
    );
    llm.push(
        Reply::tool_call("state_set", json!({"key": "audience", "value": "ops"})).usage(1200, 40),
    );
    // The first delivery's third call never gets an answer: its worker is killed meanwhile.
    llm.push(Reply::hang());
    llm.push(Reply::text("Done after two tool rounds.").usage(1300, 30));

    let mut p = Processes::start(&agents(&llm.base_url())).await?;
    p.coordinator().await?;
    let env = [("FLOTILLA_WORKER__HEARTBEAT", "1s")];
    let first = p.spawn_env(&["worker", "--concurrency", "1"], &env)?;
    p.wait_registered(first).await?;
    let mut research = Subtask::new("research", "Find things.").with_agent("researcher");
    research.produces = vec!["notes".into()];
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![research])))
        .await?;
    llm.wait_for_requests(3, Duration::from_secs(30)).await?;
    let second = p.spawn_env(&["worker", "--concurrency", "1"], &env)?;
    p.wait_registered(second).await?;
    p.kill(first);
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(
        outcome.status,
        RunStatus::Succeeded,
        "{outcome:?}\n{}",
        p.log(second)
    );

    // Four model requests in all: three by the dead delivery, one by the resumed one, which
    // would have made three without the journal.
    let requests = llm.requests();
    assert_eq!(requests.len(), 4, "{requests:#?}");
    let last = &requests[3];
    assert_eq!(
        last.messages()
            .iter()
            .filter(|m| m["role"] == "tool")
            .count(),
        2,
        "the replayed conversation carries both tool results: {:#?}",
        last.messages()
    );
    // The tools ran once: one entry written by the agent (plus the automatic produce).
    let store = RunStore::open(&p.bus).await?;
    let (entries, _, _) = store
        .topic_entries(run, "notes", 0, usize::MAX, 100)
        .await?;
    let written = entries
        .iter()
        .filter(|e| e.entry.get("step") == Some(&json!(1)))
        .count();
    assert_eq!(written, 1, "{entries:#?}");
    // The result counts the tokens of all three calls, the replayed ones included.
    let tokens: u64 = store
        .history(run)
        .await?
        .into_iter()
        .filter_map(|(_, _, e)| match e.input {
            RunInput::TaskResult(r) if r.result.success => Some(r.result.tokens),
            _ => None,
        })
        .sum();
    assert_eq!(tokens, 1050 + 1240 + 1330);
    eprintln!(
        "step journal: the resumed delivery made 1 model call instead of 3, saving 2,290 of 3,620 tokens and 2 tool rounds"
    );
    Ok(())
}

/// Agent-as-tool from an LLM agent: the model calls `call_agent`, the named agent runs as a
/// child run on a worker, and its answer comes back as the tool result, linked in `tool_end`.
#[tokio::test]
async fn an_llm_agent_calls_another_agent_as_a_tool() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    llm.push(Reply::tool_call(
        "call_agent",
        json!({"agent": "helper", "request": "Find the number."}),
    ));
    llm.push(Reply::text("The helper says 42."));
    let config = format!(
        r#"
[agents.lead]
kind = "llm"
base-url = "{}"
model = "scripted-model"
tools = []
agent-tools = ["helper"]

[agents.helper]
kind = "scripted"
reply = "helper found 42"
"#,
        llm.base_url()
    );
    // One slot: the child needs it while the lead waits — two workers, one slot each.
    let (p, run, _outcome) = run_one_task(
        &config,
        2,
        Some(1),
        Subtask::new("lead_task", "Get the number.").with_agent("lead"),
    )
    .await?;
    let requests = llm.requests();
    assert_eq!(requests.len(), 2);
    let offered = requests[0].tool_names();
    assert_eq!(offered, vec!["call_agent"]);
    let tool_result = first_tool_result(&requests[1]);
    assert!(tool_result.contains("helper found 42"), "{tool_result}");

    // The parent's stream links the child twice: agent_run_started and tool_end.run_link.
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    let (mut started, mut linked) = (None, None);
    tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(e) = events.next().await {
            match e?.event {
                Event::AgentRunStarted { child, .. } => started = Some(child.run_id),
                Event::ToolEnd {
                    run_link: Some(h), ..
                } => linked = Some(h.run_id),
                _ => {}
            }
            if started.is_some() && linked.is_some() {
                break;
            }
        }
        Ok::<_, anyhow::Error>(())
    })
    .await??;
    assert!(
        started.is_some() && started == linked,
        "{started:?} {linked:?}"
    );

    // The tree replays from what it recorded: the lead's conversation from its journal (two
    // model replies, one tool round), the child run below it — and the model is not called.
    let report = p.client.replay(run).await?.expect("the run exists");
    assert!(report.same, "{report:#?}");
    assert_eq!(
        (
            report.conversations,
            report.model_replies,
            report.tool_rounds
        ),
        (1, 2, 1),
        "{report:#?}"
    );
    assert_eq!(report.children.len(), 1, "{report:#?}");
    assert!(report.children[0].same && Some(report.children[0].run_id) == started);
    assert_eq!(llm.requests().len(), 2, "a replay calls no model");
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

/// `transfer_to_agent`: the dispatcher hands the conversation to a sub-agent, which continues
/// it as a child run; its answer is the dispatcher's task result. The offered targets follow
/// the agent tree (ADK scope rules): the dispatcher may go to its sub-agents, billing — which
/// may not go to its peers — only back to its parent.
#[tokio::test]
async fn an_llm_agent_transfers_the_conversation_within_the_agent_tree() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    llm.push(
        Reply::tool_call(
            "transfer_to_agent",
            json!({"agent_name": "billing", "reason": "a refund question"}),
        )
        .when("Your task (help)"),
    );
    llm.push(Reply::text("Your refund is on its way.").when("handed this conversation"));
    let config = format!(
        r#"
[agents.dispatcher]
kind = "llm"
base-url = "{url}"
model = "scripted-model"
tools = []
sub-agents = ["billing", "support"]

[agents.billing]
kind = "llm"
base-url = "{url}"
model = "scripted-model"
tools = []
disallow-transfer-to-peers = true

[agents.support]
kind = "scripted"
reply = "support here"
"#,
        url = llm.base_url()
    );
    let (p, run, outcome) = run_one_task(
        &config,
        2,
        Some(1),
        Subtask::new("help", "I was charged twice for my order.").with_agent("dispatcher"),
    )
    .await?;
    assert_eq!(
        outcome.final_result.map(|r| r.response).as_deref(),
        Some("Your refund is on its way.")
    );
    let requests = llm.requests();
    assert_eq!(requests.len(), 2, "{requests:#?}");
    let targets = |r: &flotilla_testkit::openai::RecordedRequest| -> serde_json::Value {
        r.body["tools"]
            .as_array()
            .and_then(|t| {
                t.iter()
                    .find(|t| t["function"]["name"] == "transfer_to_agent")
            })
            .map(|t| t["function"]["parameters"]["properties"]["agent_name"]["enum"].clone())
            .unwrap_or_default()
    };
    assert_eq!(targets(&requests[0]), json!(["billing", "support"]));
    assert_eq!(
        targets(&requests[1]),
        json!(["dispatcher"]),
        "billing: no peers"
    );
    // Billing continues the dispatcher's conversation.
    let to_billing = requests[1].texts("user").join("\n");
    assert!(
        to_billing.contains("I was charged twice")
            && to_billing
                .contains("dispatcher handed this conversation to you (a refund question)"),
        "{to_billing}"
    );
    // The dispatcher's stream links the child that took over.
    let linked = transfer_link(&p.client, run).await?;
    assert_ne!(linked, run);
    Ok(())
}

/// Transfers that would loop are refused. The dispatcher hands the conversation to billing,
/// billing to its peer technical, and technical tries to hand it back to the dispatcher — an
/// agent the conversation already went through since the user's message (the chain travels
/// in each child's input, `transfer_chain`). No child run starts for it: the model reads
/// `transfer_loop` as the call's result and answers itself, and its answer is the ticket's.
#[tokio::test]
async fn a_transfer_back_along_the_chain_is_refused_with_transfer_loop() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    let transfer = |to: &str| {
        Reply::tool_call(
            "transfer_to_agent",
            json!({"agent_name": to, "reason": "not mine"}),
        )
    };
    llm.push(transfer("billing").when("Your task (help)"));
    llm.push(transfer("technical").when("dispatcher handed this conversation"));
    llm.push(transfer("dispatcher").when("billing handed this conversation"));
    llm.push(Reply::text("Technical here: reinstall the app.").when("transfer_loop"));
    let config = format!(
        r#"
[agents.dispatcher]
kind = "llm"
base-url = "{url}"
model = "scripted-model"
tools = []
sub-agents = ["billing", "technical"]

[agents.billing]
kind = "llm"
base-url = "{url}"
model = "scripted-model"
tools = []

[agents.technical]
kind = "llm"
base-url = "{url}"
model = "scripted-model"
tools = []
"#,
        url = llm.base_url()
    );
    let (p, run, outcome) = run_one_task(
        &config,
        1,
        Some(3),
        Subtask::new("help", "The app crashes after I paid.").with_agent("dispatcher"),
    )
    .await?;
    assert_eq!(
        outcome.final_result.map(|r| r.response).as_deref(),
        Some("Technical here: reinstall the app.")
    );
    let requests = llm.requests();
    assert_eq!(requests.len(), 4, "{requests:#?}");
    let refused: serde_json::Value = serde_json::from_str(&first_tool_result(&requests[3]))?;
    assert_eq!(refused["error"]["code"], "transfer_loop", "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("dispatcher → billing → technical → dispatcher")),
        "{refused}"
    );
    // Two handovers, each a child run; the refused one started none.
    let billing = transfer_link(&p.client, run).await?;
    let technical = transfer_link(&p.client, billing).await?;
    let tree = p.client.tree(run, 100).await?.expect("the tree");
    assert_eq!(tree.runs, 3, "{tree:?}");
    let leaf = &tree.root.children[0].children[0];
    assert_eq!(leaf.run_id, technical);
    assert!(leaf.children.is_empty(), "{tree:?}");
    Ok(())
}

/// A child run the coordinator rejects (here: `call_agent` names an agent that is not
/// defined) fails the tool call, not the attempt: the model reads the rejection's problems
/// (`unknown_agent`) and answers. An agent that then gives up (its tool rounds spent) fails
/// with `child_rejected`, which is not retried: one attempt, no new subtree.
#[tokio::test]
async fn a_rejected_child_fails_the_tool_call_and_giving_up_is_final() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    let ask_ghost = || {
        Reply::tool_call(
            "call_agent",
            json!({"agent": "ghost", "request": "look it up"}),
        )
    };
    llm.push(ask_ghost().when("Your task (ask)"));
    llm.push(
        Reply::text("The ghost is not on the team; here is my own answer.").when("unknown_agent"),
    );
    llm.push(ask_ghost().when("Your task (insist)"));
    llm.push(ask_ghost().when("unknown_agent"));
    let config = format!(
        r#"
[agents.boss]
kind = "llm"
base-url = "{url}"
model = "scripted-model"
tools = []
agent-tools = ["ghost"]

[agents.stubborn]
kind = "llm"
base-url = "{url}"
model = "scripted-model"
tools = []
agent-tools = ["ghost"]
max-tool-rounds = 1
"#,
        url = llm.base_url()
    );
    let mut p = Processes::start(&config).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;

    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("ask", "Ask the ghost.").with_agent("boss"),
        ])))
        .await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(
        outcome.status,
        RunStatus::Succeeded,
        "{outcome:?}
{}",
        p.log(1)
    );
    let requests = llm.requests();
    let result: serde_json::Value = serde_json::from_str(&first_tool_result(&requests[1]))?;
    let error = &result["error"];
    assert_eq!(error["code"], "unknown_agent", "{result}");
    assert_eq!(error["problems"][0]["code"], "unknown_agent", "{result}");
    let child: flotilla_model::RunId = serde_json::from_value(error["run_id"].clone())?;
    let view = p
        .client
        .run(child)
        .await?
        .expect("the rejected child's record");
    assert_eq!(view.record.status, RunStatus::Rejected);
    // The tool call's end links the rejected child.
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    let mut linked = None;
    while let Ok(Some(e)) = tokio::time::timeout(Duration::from_millis(500), events.next()).await {
        if let Event::ToolEnd { ok, run_link, .. } = e?.event {
            assert!(!ok);
            linked = run_link.map(|h| h.run_id);
        }
    }
    assert_eq!(linked, Some(child));

    let mut insist = plan(vec![
        Subtask::new("insist", "Ask the ghost.").with_agent("stubborn"),
    ]);
    insist.config.max_retries = 3;
    let run = p.client.submit(SubmitRequest::new(insist)).await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed, "{outcome:?}");
    let failed = &outcome.failed[0];
    assert_eq!(
        failed.error.kind,
        flotilla_model::task::TaskErrorKind::ChildRejected,
        "{failed:?}"
    );
    assert_eq!(failed.attempts, 1, "not retried: {failed:?}");
    assert_eq!(
        llm.requests().len(),
        4,
        "no second attempt called the model"
    );
    Ok(())
}

/// A failure that binds the whole tree travels up: `asker` (an exec agent) gives up after its
/// own child run was rejected, so its run fails with `child_rejected`. The LLM agent that
/// asked it through `call_agent` reads that code as the tool's error; the one that handed it
/// the conversation (`transfer_to_agent`, whose answer would have been the target's) fails
/// with it too — once, not retried.
#[tokio::test]
async fn a_childs_binding_failure_reaches_the_caller() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    llm.push(
        Reply::tool_call(
            "call_agent",
            json!({"agent": "asker", "request": "find it"}),
        )
        .when("Your task (ask)"),
    );
    llm.push(Reply::text("The asker could not help.").when("child_rejected"));
    llm.push(
        Reply::tool_call("transfer_to_agent", json!({"agent_name": "asker"}))
            .when("Your task (hand)"),
    );
    let config = format!(
        r#"
[agents.boss]
kind = "llm"
base-url = "{url}"
model = "scripted-model"
tools = []
agent-tools = ["asker"]

[agents.desk]
kind = "llm"
base-url = "{url}"
model = "scripted-model"
tools = []
sub-agents = ["asker"]

[agents.asker]
kind = "exec"
command = "sh"
args = ["-c", "\"$FLOTILLA_BIN\" call ghost"]
"#,
        url = llm.base_url()
    );
    let mut p = Processes::start(&config).await?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "4"]).await?;

    let mut ask = plan(vec![Subtask::new("ask", "Ask around.").with_agent("boss")]);
    ask.config.max_retries = 3;
    let run = p.client.submit(SubmitRequest::new(ask)).await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(
        outcome.status,
        RunStatus::Succeeded,
        "{outcome:?}\n{}",
        p.log(1)
    );
    let result: serde_json::Value = serde_json::from_str(&first_tool_result(&llm.requests()[1]))?;
    assert_eq!(result["error"]["code"], "child_rejected", "{result}");

    let mut hand = plan(vec![
        Subtask::new("hand", "Hand it over.").with_agent("desk"),
    ]);
    hand.config.max_retries = 3;
    let run = p.client.submit(SubmitRequest::new(hand)).await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed, "{outcome:?}");
    let failed = &outcome.failed[0];
    assert_eq!(
        failed.error.kind,
        flotilla_model::task::TaskErrorKind::ChildRejected,
        "{failed:?}"
    );
    assert_eq!(failed.attempts, 1, "not retried: {failed:?}");
    assert_eq!(llm.requests().len(), 3, "one attempt of the desk");
    Ok(())
}

/// MCP tools inside a distributed plan: the worker process starts the agent's stdio MCP
/// server (`crates/flotilla-llm/tests/mcp_server.py`, a small standard-library server) and
/// the model's call reaches it.
#[tokio::test]
async fn an_llm_agent_uses_an_mcp_server_started_by_its_worker() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    llm.push(Reply::tool_call("calc__add", json!({"a": 40, "b": 2})));
    llm.push(Reply::text("The sum is 42."));
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("calls.jsonl");
    let server = root().join("crates/flotilla-llm/tests/mcp_server.py");
    let config = format!(
        r#"
[agents.adder]
kind = "llm"
base-url = "{}"
model = "scripted-model"
tools = []

[agents.adder.mcp-servers.calc]
command = "python3"
args = ["{}", "stdio"]
env = {{ MCP_LOG = "{}" }}
tools = ["add"]
"#,
        llm.base_url(),
        server.display(),
        log.display()
    );
    let (_p, _run, _outcome) = run_one_task(
        &config,
        1,
        None,
        Subtask::new("sum", "Add 40 and 2.").with_agent("adder"),
    )
    .await?;
    let requests = llm.requests();
    assert_eq!(requests[0].tool_names(), vec!["calc__add"]);
    let result = first_tool_result(&requests[1]);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&result)?,
        json!({"sum": 42})
    );
    let calls = std::fs::read_to_string(&log)?;
    assert_eq!(calls.lines().count(), 1, "{calls}");
    Ok(())
}

/// Starts a coordinator and `workers` worker processes (`slots` each, else the default) on
/// `config`, runs a plan of `task`, and returns them with the run and its successful outcome.
async fn run_one_task(
    config: &str,
    workers: usize,
    slots: Option<usize>,
    task: Subtask,
) -> anyhow::Result<(
    Processes,
    flotilla_model::RunId,
    flotilla_model::run::RunOutcome,
)> {
    let mut p = Processes::start(config).await?;
    p.coordinator().await?;
    let slots = slots.map(|n| n.to_string());
    for _ in 0..workers {
        match &slots {
            Some(n) => p.worker(&["--concurrency", n]).await?,
            None => p.worker(&[]).await?,
        };
    }
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![task])))
        .await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(
        outcome.status,
        RunStatus::Succeeded,
        "{outcome:?}\n{}",
        p.log(1)
    );
    Ok((p, run, outcome))
}

/// The content of the first tool message the model was sent in `request`.
fn first_tool_result(request: &flotilla_testkit::openai::RecordedRequest) -> String {
    request
        .messages()
        .iter()
        .find(|m| m["role"] == "tool")
        .and_then(|m| m["content"].as_str())
        .map(str::to_owned)
        .unwrap_or_default()
}

/// Budgets bind the whole tree: the lead's run has `max_tokens = 1000`; the helpers it calls
/// are child runs with no budget of their own, so every model call of the tree — the lead's
/// and the helpers' — counts against the root's budget. The third round would pass it: the
/// lead's call is refused (`budget_exhausted`), the run ends with that cause, and the tree
/// spent no more than the budget. Without the tree's budget the helpers would spend freely
/// and the run would succeed at 1,380 tokens.
#[tokio::test]
async fn a_budget_binds_the_child_runs_of_its_tree() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    for (i, word) in ["one", "two", "three"].iter().enumerate() {
        llm.push(
            Reply::tool_call(
                "call_agent",
                json!({"agent": "helper", "request": format!("Find number {word}.")}),
            )
            .usage(50, 10)
            .when("Get the numbers."),
        );
        llm.push(
            Reply::text(format!("number {}", i + 1))
                .usage(300, 100)
                .when(format!("Find number {word}.")),
        );
    }
    llm.push(
        Reply::text("1, 2, 3")
            .usage(50, 10)
            .when("Get the numbers."),
    );
    let config = format!(
        r#"
[agents.lead]
kind = "llm"
base-url = "{url}"
model = "scripted-model"
tools = []
agent-tools = ["helper"]

[agents.helper]
kind = "llm"
base-url = "{url}"
model = "scripted-model"
tools = []
max-output-tokens = 100
"#,
        url = llm.base_url()
    );
    let mut p = Processes::start(&config).await?;
    p.coordinator().await?;
    for _ in 0..2 {
        p.worker(&["--concurrency", "1"]).await?;
    }
    let mut plan = plan(vec![
        Subtask::new("lead_task", "Get the numbers.").with_agent("lead"),
    ]);
    plan.config.max_tokens = Some(1000);
    plan.config.max_retries = 0;
    let run = p.client.submit(SubmitRequest::new(plan)).await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed, "{outcome:?}");
    assert_eq!(
        outcome.cause,
        Some(flotilla_model::run::EndCause::BudgetExhausted),
        "{outcome:?}"
    );
    assert!(
        outcome
            .reason
            .as_deref()
            .is_some_and(|r| r.starts_with("budget_exhausted")),
        "{outcome:?}"
    );
    let tree = p.client.tree(run, 100).await?.expect("the tree");
    assert_eq!(tree.runs, 3, "the lead and two helpers: {tree:?}");
    let spent = tree.root.subtree_usage.tokens();
    assert!(
        spent <= 1000,
        "the tree spent {spent} tokens of a budget of 1,000"
    );
    assert_eq!(spent, 920, "{tree:?}");
    Ok(())
}
