//! The `supervisor` strategy across processes against a real nats-server: a led run whose
//! lead — an LLM agent with the role `supervisor`, a persistent teammate of the run spawned
//! by the supervisor service — assigns a task, recruits a patent analyst mid-run when the
//! first result is in, and finishes the run with its answer; tasks it never assigned are
//! skipped. `auto` picks the strategy for a recruiting plan where a lead exists. Every
//! refusal of `team.assign` / `team.finish` is structured and changes nothing.
//!
//! The first test runs the shipped example (`config/examples/supervised-team.toml` and its
//! plan). Agents are deterministic: the lead's model is the OpenAI-compatible test double
//! (`flotilla_testkit::openai`, the example's scripted replies, matched on the mail the lead
//! was sent), and the members are `scripted` agents.

mod support;

use std::time::Duration;

use flotilla_model::api::ApiError;
use flotilla_model::ids::RunId;
use flotilla_model::lead::{AssignRequest, FinishRequest, LeadReply};
use flotilla_model::plan::{PlanConfig, Strategy, Subtask};
use flotilla_model::run::{EndCause, RunStatus, TaskStatus};
use flotilla_model::runlog::RunInput;
use flotilla_model::subjects::Bucket;
use flotilla_model::submit::SubmitRequest;
use flotilla_model::teammate::{Teammate, TeammateStatus, teammate_key};
use flotilla_testkit::openai::OpenAiServer;
use support::*;

const ASK: Duration = Duration::from_secs(15);

fn config(base_url: &str) -> String {
    format!(
        r#"
default-agent = "analyst"

[agents.analyst]
kind = "scripted"
reply = "{{task_id}}: the competitor grew 12% last year"
roles = ["analyst"]

[agents.patents]
kind = "scripted"
reply = "{{task_id}}: three relevant patents"
roles = ["patents"]

[agents.chief]
kind = "llm"
base-url = "{base_url}"
model = "scripted-model"
max-tool-rounds = 6
tools = ["assign_task", "finish_run", "recruit"]
roles = ["supervisor"]

[supervisor]
ack-wait = "2s"

[supervisor.recruit]
allowed-roles = ["patents"]
"#
    )
}

async fn services(base_url: &str) -> anyhow::Result<Processes> {
    up(Processes::start(&config(base_url)).await?).await
}

/// Starts a coordinator, a worker and a supervisor; waits until the team API answers.
async fn up(mut p: Processes) -> anyhow::Result<Processes> {
    p.coordinator().await?;
    p.worker(&[]).await?;
    p.supervisor().await?;
    Ok(p)
}

fn analysis_plan(strategy: Strategy) -> flotilla_model::plan::Plan {
    let mut plan = plan(vec![
        Subtask::new("market", "size the competitor's market").with_agent("analyst"),
        Subtask::new("pricing", "compare prices")
            .with_agent("analyst")
            .after(&["market"]),
        Subtask::new("hiring", "look at their hiring").with_agent("analyst"),
    ]);
    plan.query = Some("analyse the competitor".into());
    plan.config = PlanConfig {
        strategy,
        ..PlanConfig::default()
    };
    plan
}

async fn history_kinds(p: &Processes, run: RunId) -> anyhow::Result<Vec<RunInput>> {
    let store = flotilla_client::open_store(&p.bus).await?;
    Ok(store
        .history(run)
        .await?
        .into_iter()
        .map(|(_, _, e)| e.input)
        .collect())
}

#[tokio::test]
async fn a_lead_assigns_recruits_mid_run_and_finishes_the_run() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    // The example's script (`config/examples/models/supervised-team.json`, which `flotilla
    // example supervised-team` serves too): each reply answers the first request that
    // contains its needle (the mail so far); the unmatched ones end a turn after its tool
    // call. The lead asks a teammate, assigns `market`, recruits a patent analyst once it
    // succeeded and finishes the run with the recruit's result.
    llm.push_all(example_script("supervised-team")?);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let base_url = llm.base_url();
    let p = up(Processes::with_config_file(
        &root.join("config/examples/supervised-team.toml"),
        &[("FLOTILLA_AGENTS__CHIEF__BASE_URL", base_url.as_str())],
    )
    .await?)
    .await?;
    let plan: flotilla_model::Plan = serde_json::from_str(&std::fs::read_to_string(
        root.join("config/examples/plans/supervised-team.json"),
    )?)?;
    let run = p.client.submit(SubmitRequest::new(plan)).await?;
    let outcome = p.client.wait(run, Duration::from_secs(90)).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    assert_eq!(outcome.cause, Some(EndCause::LeadFinished), "{outcome:?}");
    let result = outcome
        .final_result
        .clone()
        .ok_or_else(|| anyhow::anyhow!("no final result"))?;
    assert_eq!(
        result.response,
        "The competitor grew 12% and holds three relevant patents."
    );

    // What ran: the assigned task and the recruit; the two never assigned were skipped.
    let store = flotilla_client::open_store(&p.bus).await?;
    let view = store
        .view(run, 0, usize::MAX)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no run {run}"))?;
    assert_eq!(
        view.record.strategy.as_ref().map(|s| s.strategy),
        Some(Strategy::Supervisor)
    );
    let status_of = |id: &str| {
        view.tasks
            .iter()
            .find(|t| t.task_id.as_str() == id)
            .map(|t| t.status)
    };
    assert_eq!(status_of("market"), Some(TaskStatus::Succeeded));
    assert_eq!(status_of("pricing"), Some(TaskStatus::Cancelled));
    assert_eq!(status_of("hiring"), Some(TaskStatus::Cancelled));
    let recruit = view
        .tasks
        .iter()
        .find(|t| t.task_id.as_str().starts_with("recruit-"))
        .ok_or_else(|| anyhow::anyhow!("no recruit in {:?}", view.tasks))?;
    assert_eq!(recruit.status, TaskStatus::Succeeded);
    assert_eq!(view.team.len(), 1, "{:?}", view.team);
    assert_eq!(view.team[0].by, "lead");

    // The decisions are inputs on the run log: one assignment, one finish.
    let inputs = history_kinds(&p, run).await?;
    let assigned: Vec<String> = inputs
        .iter()
        .filter_map(|i| match i {
            RunInput::Assigned(a) => Some(format!("{} by {}", a.task_id, a.by)),
            _ => None,
        })
        .collect();
    assert_eq!(assigned, ["market by lead"]);
    assert_eq!(
        inputs
            .iter()
            .filter(|i| matches!(i, RunInput::Finished(_)))
            .count(),
        1
    );

    // The lead was a teammate of the run, and is shut down now that the run ended.
    let kv = p.bus.kv(Bucket::Team).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let entry = kv
            .get(teammate_key(&run.to_string(), "lead"))
            .await?
            .ok_or_else(|| anyhow::anyhow!("no lead entry"))?;
        let lead: Teammate = serde_json::from_slice(&entry)?;
        assert_eq!(
            (lead.agent.as_str(), lead.role.as_str()),
            ("chief", "supervisor")
        );
        assert_eq!(lead.run, Some(run));
        if lead.status == TeammateStatus::Shutdown {
            assert!(lead.turns >= 2, "{lead:?}");
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the lead was never shut down: {lead:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The plan's agent and the recruit's were its teammates: the analyst answered the lead
    // (a turn of the scripted agent), and both were shut down with the run.
    for (name, role, turns) in [("analyst", "analyst", 1), ("patents", "patents", 0)] {
        let entry = kv
            .get(teammate_key(&run.to_string(), name))
            .await?
            .ok_or_else(|| anyhow::anyhow!("no teammate {name}"))?;
        let mate: Teammate = serde_json::from_slice(&entry)?;
        assert_eq!((mate.agent.as_str(), mate.role.as_str()), (name, role));
        assert_eq!(mate.run, Some(run));
        assert!(mate.turns >= turns, "{mate:?}");
        assert!(
            mate.status == TeammateStatus::Shutdown || mate.shutdown_requested,
            "{mate:?}"
        );
    }
    // The lead was offered its tools, and only them.
    let mut offered = llm.requests()[0].tool_names();
    offered.sort();
    assert_eq!(
        offered,
        [
            "assign_task",
            "finish_run",
            "list_team",
            "recruit",
            "send_message"
        ]
    );
    Ok(())
}

#[tokio::test]
async fn auto_leads_a_recruiting_plan_and_refusals_change_nothing() -> anyhow::Result<()> {
    // The lead's model never answers here: the test drives the run through the API as an
    // operator would.
    let llm = OpenAiServer::start().await?;
    let p = services(&llm.base_url()).await?;

    // A plain plan is not led: assignments and finishes are refused.
    let plain = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("slow", "wait").with_agent("analyst"),
            Subtask::new("next", "then")
                .with_agent("analyst")
                .after(&["slow"]),
        ])))
        .await?;
    let ask_assign = |run: RunId, task: &str| AssignRequest {
        protocol: 1,
        run_id: run,
        task_id: task.into(),
        reason: String::new(),
        by: None,
    };
    let finish = |run: RunId, result: &str| FinishRequest {
        protocol: 1,
        run_id: run,
        result: result.into(),
        by: None,
    };
    let e: Result<LeadReply, ApiError> = p.client.call(&ask_assign(plain, "next"), ASK).await?;
    let e = e
        .err()
        .ok_or_else(|| anyhow::anyhow!("a plain run took an assignment"))?;
    assert!(e.code == "not_led" || e.code == "run_not_running", "{e:?}");

    // A recruiting plan with strategy auto is led: the deployment has a lead.
    let mut recruiting = analysis_plan(Strategy::Auto);
    recruiting.config.recruit_roles = Some(vec!["patents".into()]);
    let run = p.client.submit(SubmitRequest::new(recruiting)).await?;
    let store = flotilla_client::open_store(&p.bus).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let choice = loop {
        if let Some(v) = store.view(run, 0, usize::MAX).await?
            && let Some(s) = v.record.strategy.clone()
        {
            break s;
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "never recorded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(choice.strategy, Strategy::Supervisor, "{choice:?}");
    assert!(choice.reason.contains("recruit"), "{choice:?}");

    // Bad input: an unknown task (the answer lists those waiting), an empty or oversized
    // result, a malformed `by`.
    let e: Result<LeadReply, ApiError> = p.client.call(&ask_assign(run, "nope"), ASK).await?;
    let e = e
        .err()
        .ok_or_else(|| anyhow::anyhow!("an unknown task was assigned"))?;
    assert_eq!(e.code, "unknown_task", "{e:?}");
    assert!(e.message.contains("market"), "{e:?}");
    let e: Result<LeadReply, ApiError> = p.client.call(&finish(run, "  "), ASK).await?;
    assert_eq!(e.err().map(|e| e.code), Some("invalid_request".into()));
    let big = "x".repeat(64 * 1024 + 1);
    let e: Result<LeadReply, ApiError> = p.client.call(&finish(run, &big), ASK).await?;
    assert_eq!(e.err().map(|e| e.code), Some("result_too_large".into()));
    let mut bad = ask_assign(run, "market");
    bad.by = Some("two words".into());
    let e: Result<LeadReply, ApiError> = p.client.call(&bad, ASK).await?;
    assert_eq!(e.err().map(|e| e.code), Some("invalid_request".into()));
    let inputs = history_kinds(&p, run).await?;
    assert!(
        !inputs
            .iter()
            .any(|i| matches!(i, RunInput::Assigned(_) | RunInput::Finished(_))),
        "a refusal wrote to the run log: {inputs:?}"
    );

    // An operator assigns (the CLI) and finishes through the same endpoints; a repeat is
    // answered, never doubled.
    let out = p.cli(&[
        "team",
        "assign",
        "hiring",
        "--run",
        &run.to_string(),
        "--reason",
        "by hand",
    ])?;
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("assigned: task hiring"), "{text}");
    let out = p.cli(&[
        "team",
        "assign",
        "nope",
        "--run",
        &run.to_string(),
        "--json",
    ])?;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(json["error"], "unknown_task", "{json}");
    let again: LeadReply = p
        .client
        .call(&ask_assign(run, "hiring"), ASK)
        .await?
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    assert_eq!(again.status.as_str(), "accepted", "{again:?}");
    let out = p.cli(&[
        "team",
        "finish",
        "--run",
        &run.to_string(),
        "--result",
        "finished by hand",
    ])?;
    assert!(out.status.success(), "{out:?}");
    let outcome = p.client.wait(run, Duration::from_secs(30)).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    assert_eq!(
        outcome.final_result.map(|r| r.response).as_deref(),
        Some("finished by hand")
    );
    let inputs = history_kinds(&p, run).await?;
    let assigned = inputs
        .iter()
        .filter(|i| matches!(i, RunInput::Assigned(_)))
        .count();
    assert_eq!(assigned, 1, "{inputs:?}");
    // After the end: not running.
    let e: Result<LeadReply, ApiError> = p.client.call(&ask_assign(run, "market"), ASK).await?;
    assert_eq!(e.err().map(|e| e.code), Some("run_not_running".into()));
    Ok(())
}
