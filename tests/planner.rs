//! Bare queries end to end: `flotilla coordinator` and `flotilla worker` processes whose
//! planner is an LLM agent, against the test kit's scripted OpenAI-compatible server — a test
//! double whose answers (the planner's plans included) are scripted here, not a model.

mod support;

use std::time::{Duration, Instant};

use flotilla_coordinator::store::RunStore;
use flotilla_model::event::WorkflowPhase;
use flotilla_model::ids::RunId;
use flotilla_model::plan::{PlanConfig, Strategy, Subtask};
use flotilla_model::run::{PlanningStatus, RunStatus};
use flotilla_model::runlog::{PlanDecision, RunInput};
use flotilla_model::submit::{SubmitReply, SubmitRequest, SubmitStatus};
use flotilla_model::validate::ProblemCode;
use flotilla_testkit::openai::{OpenAiServer, Reply};
use futures::StreamExt;
use serde_json::json;
use support::*;

/// A deployment with a planner agent and a writer, planning with at most `max_repairs`
/// repairs.
fn config(base_url: &str, max_repairs: u32) -> String {
    format!(
        r#"default-agent = "writer"

[agents.planner]
kind = "llm"
base-url = "{base_url}"
model = "scripted-model"
tools = []

[agents.writer]
kind = "llm"
base-url = "{base_url}"
model = "scripted-model"
tools = []

[coordinator.planner]
agent = "planner"
max-repairs = {max_repairs}
"#
    )
}

/// Submits through the API, retrying while the coordinator has not yet seen the worker the
/// planner needs (it rejects a bare query with `no_planner` until it has).
async fn submit(p: &Processes, request: &SubmitRequest) -> anyhow::Result<SubmitReply> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let reply = p
            .client
            .submit_request(request, Duration::from_secs(10))
            .await?;
        let no_planner = reply
            .errors
            .iter()
            .any(|e| e.code == ProblemCode::NoPlanner);
        if !no_planner || Instant::now() > deadline {
            return Ok(reply);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn submit_query(p: &Processes, query: &str) -> anyhow::Result<RunId> {
    let reply = submit(p, &SubmitRequest::query(query)).await?;
    assert_eq!(reply.status, SubmitStatus::Accepted, "{reply:?}");
    reply
        .run_id
        .ok_or_else(|| anyhow::anyhow!("accepted without a run id"))
}

/// The `planned` decisions of a run's log, in order.
async fn decisions(p: &Processes, run: RunId) -> anyhow::Result<Vec<PlanDecision>> {
    let store = RunStore::open(&p.bus).await?;
    Ok(store
        .history(run)
        .await?
        .into_iter()
        .filter_map(|(_, _, e)| match e.input {
            RunInput::Planned(p) => Some(p.decision),
            _ => None,
        })
        .collect())
}

#[tokio::test]
async fn a_query_is_planned_and_the_plan_runs_in_the_same_run() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    llm.push(
        Reply::text(
            json!({"name": "revenue report", "subtasks": [
                {"id": "research", "description": "Find the quarter's revenue.", "role": "researcher"},
                {"id": "analyse", "description": "Compare it with last year.", "role": "analyst",
                 "dependencies": ["research"]},
                {"id": "report", "description": "Write the answer.", "role": "synthesis",
                 "agent": "writer", "dependencies": ["analyse"]}
            ]})
            .to_string(),
        )
        .when("_plan-1"),
    );
    llm.push(Reply::text("Revenue was 1250.").when("Your task (research)"));
    llm.push(Reply::text("Up 25% on last year.").when("Your task (analyse)"));
    llm.push(Reply::text("Revenue reached 1250, up 25%.").when("Your task (report)"));

    let mut p = Processes::start(&config(&llm.base_url(), 2)).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let run = submit_query(&p, "How did revenue develop this quarter?").await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(
        outcome.status,
        RunStatus::Succeeded,
        "{outcome:?}\n{}",
        p.log(1)
    );
    let answer = outcome.final_result.expect("final result").response;
    assert_eq!(answer, "Revenue reached 1250, up 25%.");

    // The planner was asked for JSON of the plan schema restricted to this deployment.
    let requests = llm.requests();
    assert_eq!(requests.len(), 4, "{requests:#?}");
    let to_planner = &requests[0];
    assert!(
        to_planner
            .user()
            .contains("How did revenue develop this quarter?"),
        "{}",
        to_planner.user()
    );
    let format = to_planner.response_format().expect("response_format");
    assert_eq!(format["type"], json!("json_schema"));
    let schema = format.to_string();
    assert!(
        schema.contains(r#""enum":["planner","writer"]"#),
        "{schema}"
    );

    // The run shows the planned plan, the chosen strategy and the tasks of the plan.
    let view = p.client.run(run).await?.expect("run view");
    let planned = view.plan.expect("the planned plan is shown");
    let ids: Vec<&str> = planned.subtasks.iter().map(|t| t.id.as_str()).collect();
    assert_eq!(ids, ["research", "analyse", "report"]);
    assert_eq!(view.record.name.as_deref(), Some("revenue report"));
    let strategy = view.record.strategy.expect("strategy recorded");
    assert_eq!(strategy.strategy, Strategy::Dag);
    assert!(strategy.reason.contains("3 subtasks"), "{strategy:?}");
    let planning = view.record.planning.expect("planning recorded");
    assert_eq!(
        (planning.status, planning.round),
        (PlanningStatus::Planned, 1)
    );
    assert_eq!(view.tasks.len(), 3);

    // The run log records the planned plan.
    let decisions = decisions(&p, run).await?;
    assert!(
        matches!(&decisions[..], [PlanDecision::Accepted { plan, .. }] if plan.subtasks.len() == 3),
        "{decisions:?}"
    );

    // `runs show` shows the planned plan and the strategy.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .env_remove("FLOTILLA_CONFIG")
        .arg("--config")
        .arg(&p.config)
        .args(["runs", "show", &run.to_string()])
        .output()?;
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{shown}");
    assert!(shown.contains("strategy  dag (auto: 3 subtasks"), "{shown}");
    assert!(shown.contains("planned plan:"), "{shown}");
    assert!(
        shown.contains("  analyse [analyst] after research"),
        "{shown}"
    );
    Ok(())
}

#[tokio::test]
async fn a_plan_with_problems_is_repaired_with_the_problems() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    // First answer: a dependency on a task that does not exist.
    llm.push(
        Reply::text(
            json!({"subtasks": [
                {"id": "answer", "description": "Answer.", "dependencies": ["research"]}
            ]})
            .to_string(),
        )
        .when("_plan-1"),
    );
    llm.push(
        Reply::text(json!({"subtasks": [{"id": "answer", "description": "Answer."}]}).to_string())
            .when("_plan-2"),
    );
    llm.push(Reply::text("42.").when("Your task (answer)"));

    let mut p = Processes::start(&config(&llm.base_url(), 2)).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    wait_for_live_worker(&p).await?;
    // Through the command line: `flotilla submit --query … --wait --json`.
    // Off the test's runtime thread: the scripted model server runs on it.
    let config_path = p.config.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
            .env_remove("FLOTILLA_CONFIG")
            .arg("--config")
            .arg(&config_path)
            .args([
                "submit",
                "--query",
                "What is the answer?",
                "--wait",
                "--json",
            ])
            .args(["--timeout", "60s"])
            .output()
    })
    .await??;
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let outcome: flotilla_model::run::RunOutcome = serde_json::from_slice(&out.stdout)?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    assert_eq!(
        outcome.final_result.map(|r| r.response).as_deref(),
        Some("42.")
    );
    let run = outcome.run_id;

    // The second request to the model carries the first answer's problems.
    let requests = llm.requests();
    assert_eq!(requests.len(), 3, "{requests:#?}");
    let repair = requests[1].user();
    assert!(repair.contains("unknown_dependency"), "{repair}");
    assert!(repair.contains("previous_answer"), "{repair}");

    let decisions = decisions(&p, run).await?;
    assert!(
        matches!(&decisions[..], [PlanDecision::Repair { problems, .. }, PlanDecision::Accepted { .. }]
            if problems[0].code == ProblemCode::UnknownDependency),
        "{decisions:?}"
    );
    // One subtask: answered directly.
    let view = p.client.run(run).await?.expect("run view");
    let strategy = view.record.strategy.expect("strategy recorded");
    assert_eq!(strategy.strategy, Strategy::Simple);
    assert_eq!(view.record.planning.map(|p| p.round), Some(2));
    Ok(())
}

#[tokio::test]
async fn a_planner_without_a_valid_plan_fails_the_run_with_its_problems() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    let cycle = json!({"subtasks": [
        {"id": "a", "description": "A.", "dependencies": ["b"]},
        {"id": "b", "description": "B.", "dependencies": ["a"]}
    ]})
    .to_string();
    llm.push(Reply::text(cycle.clone()).when("_plan-1"));
    llm.push(Reply::text(cycle).when("_plan-2"));

    let mut p = Processes::start(&config(&llm.base_url(), 1)).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let run = submit_query(&p, "Loop forever?").await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed, "{outcome:?}");
    let reason = outcome.reason.unwrap_or_default();
    assert!(reason.starts_with("planning_failed"), "{reason}");
    assert!(reason.contains("[cycle]"), "{reason}");
    assert!(outcome.final_result.is_none(), "no hidden default plan ran");
    assert_eq!(llm.requests().len(), 2, "one answer and one repair");

    let view = p.client.run(run).await?.expect("run view");
    assert!(
        view.record
            .errors
            .iter()
            .any(|e| e.code == ProblemCode::Cycle),
        "{:?}",
        view.record.errors
    );
    assert_eq!(
        view.record.planning.map(|p| p.status),
        Some(PlanningStatus::Failed)
    );
    assert!(view.plan.is_none());
    assert!(view.record.strategy.is_none());

    // The events say what happened: one repair, then the failure with the problems.
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    let mut phases = Vec::new();
    while let Some(e) = events.next().await {
        if let flotilla_model::event::Event::Workflow(w) = e?.event {
            let ends = w.phase.ends_run();
            if matches!(
                w.phase,
                WorkflowPhase::PlanRepairing | WorkflowPhase::RunFailed
            ) {
                assert!(
                    w.problems.iter().any(|p| p.code == ProblemCode::Cycle),
                    "{w:?}"
                );
            }
            phases.push(w.phase);
            if ends {
                break;
            }
        }
    }
    assert!(phases.contains(&WorkflowPhase::PlanRepairing), "{phases:?}");
    assert!(!phases.contains(&WorkflowPhase::RunPlanned), "{phases:?}");
    Ok(())
}

#[tokio::test]
async fn malformed_submissions_and_missing_planners_are_rejected() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    // No `[coordinator.planner]`: bare queries cannot be planned here.
    let no_planner = config(&llm.base_url(), 2).replace(
        "[coordinator.planner]\nagent = \"planner\"\nmax-repairs = 2\n",
        "",
    );
    let mut p = Processes::start(&no_planner).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;

    let one = plan(vec![Subtask::new("a", "A.")]);
    let mut both = SubmitRequest::new(one.clone());
    both.query = Some("and a query".into());
    let mut neither = SubmitRequest::new(one);
    neither.plan = None;
    let store = RunStore::open(&p.bus).await?;
    // The wrong shape: answered at once, nothing stored under the run id the client chose.
    for (mut request, code) in [
        (both, ProblemCode::PlanAndQuery),
        (neither, ProblemCode::MissingPlan),
        (SubmitRequest::query("   "), ProblemCode::EmptyQuery),
    ] {
        let run = RunId::new();
        request.run_id = Some(run);
        let reply = p
            .client
            .submit_request(&request, Duration::from_secs(10))
            .await?;
        assert_eq!(reply.status, SubmitStatus::Rejected, "{code}: {reply:?}");
        assert_eq!(
            reply.errors.iter().map(|e| e.code).collect::<Vec<_>>(),
            [code]
        );
        assert_eq!(reply.run_id, None, "no run was created");
        assert!(p.client.run(run).await?.is_none(), "{code}: no record");
        assert!(store.history(run).await?.is_empty(), "{code}: no run log");
    }
    // No planner here: a rejection like an invalid plan's, without tasks.
    let reply = p
        .client
        .submit_request(&SubmitRequest::query("Plan this."), Duration::from_secs(10))
        .await?;
    assert_eq!(reply.status, SubmitStatus::Rejected, "{reply:?}");
    assert_eq!(
        reply.errors.iter().map(|e| e.code).collect::<Vec<_>>(),
        [ProblemCode::NoPlanner]
    );
    let run = reply.run_id.expect("the rejection names its run");
    let view = p.client.run(run).await?.expect("rejection recorded");
    assert_eq!(view.record.status, RunStatus::Rejected);
    assert_eq!(view.record.tasks.total, 0);
    assert!(llm.requests().is_empty(), "no model was asked");
    Ok(())
}

#[tokio::test]
async fn strategy_auto_is_recorded_for_plans() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    llm.push_all((0..3).map(|_| Reply::text("done")));
    let mut p = Processes::start(&config(&llm.base_url(), 2)).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;

    let single = plan(vec![Subtask::new("only", "Answer.")]);
    let multi = plan(vec![
        Subtask::new("a", "A."),
        Subtask::new("b", "B.").after(&["a"]),
    ]);
    for (plan, strategy, reason) in [
        (
            single,
            Strategy::Simple,
            "auto: one subtask, answered directly",
        ),
        (
            multi,
            Strategy::Dag,
            "auto: 2 subtasks, scheduled by their dependencies",
        ),
    ] {
        assert_eq!(plan.config, PlanConfig::default());
        let run = p.client.submit(SubmitRequest::new(plan)).await?;
        let outcome = p.client.wait(run, WAIT).await?;
        assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
        let view = p.client.run(run).await?.expect("run view");
        let chosen = view.record.strategy.expect("strategy recorded");
        assert_eq!(
            (chosen.strategy, chosen.reason.as_str()),
            (strategy, reason)
        );
        assert!(view.record.planning.is_none());
        assert!(view.plan.is_none(), "a client's plan is not repeated");
    }
    Ok(())
}

/// Waits until the coordinator knows a live worker in the default pool (where the planner
/// runs), so a durable bare query is not rejected with `no_planner`.
async fn wait_for_live_worker(p: &Processes) -> anyhow::Result<()> {
    let probe = plan(vec![Subtask::new("probe", "")]);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let reply = p.client.validate(&probe).await?;
        if !reply
            .warnings
            .iter()
            .any(|w| w.code == ProblemCode::NoLiveWorker)
        {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "no live worker: {reply:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn planning_survives_coordinator_crashes() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    let slow = Duration::from_millis(1500);
    llm.push(
        Reply::text(
            json!({"subtasks": [
                {"id": "research", "description": "Find the revenue."},
                {"id": "report", "description": "Report it.", "role": "synthesis",
                 "dependencies": ["research"]}
            ]})
            .to_string(),
        )
        .delay(slow)
        .when("_plan-1"),
    );
    llm.push(
        Reply::text("Revenue was 1250.")
            .delay(slow)
            .when("Your task (research)"),
    );
    llm.push(Reply::text("Revenue reached 1250.").when("Your task (report)"));

    let mut p = Processes::start(&config(&llm.base_url(), 2)).await?;
    let first = p.coordinator().await?;
    p.worker(&[]).await?;
    wait_for_live_worker(&p).await?;
    // Durable, through the intake (the Rust client routes bare queries there).
    let run = p
        .client
        .submit(SubmitRequest::query("How much revenue?"))
        .await?;
    // The planner's model call is in flight: the coordinator dies.
    llm.wait_for_requests(1, WAIT).await?;
    p.kill(first);
    let second = p.coordinator().await?;
    // The next coordinator reviewed the answer and dispatched the planned plan's first task;
    // it dies too, so the third rebuilds the run from the `planned` entry.
    llm.wait_for_requests(2, WAIT).await?;
    p.kill(second);
    p.coordinator().await?;

    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(
        outcome.status,
        RunStatus::Succeeded,
        "{outcome:?}\n{}",
        p.log(3)
    );
    assert_eq!(
        outcome.final_result.map(|r| r.response).as_deref(),
        Some("Revenue reached 1250.")
    );
    let decisions = decisions(&p, run).await?;
    assert!(
        matches!(&decisions[..], [PlanDecision::Accepted { .. }]),
        "one review, recorded once: {decisions:?}"
    );
    assert_eq!(llm.requests().len(), 3, "no model call was repeated");
    let view = p.client.run(run).await?.expect("run view");
    assert_eq!(view.plan.map(|p| p.subtasks.len()), Some(2));
    Ok(())
}

/// A coordinator restarted while the planner's pool has a live worker admits a bare query at
/// once. Its view of the live workers starts from the registry's history: before, it watched
/// from "now", and the first heartbeat it saw — here another pool's worker, heartbeating
/// every 100 ms — made it "synced" with that worker alone, so bare queries were refused
/// `no_planner` until the planner pool's worker wrote its entry again.
#[tokio::test]
async fn a_restarted_coordinator_knows_the_live_workers_at_once() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    let mut p = Processes::start(&config(&llm.base_url(), 2)).await?;
    let mut coordinator = p.coordinator().await?;
    // The planner's pool's worker writes its entry every 10 s (the registry keeps it 30 s),
    // the other pool's every 100 ms.
    let planner_pool = p.spawn_env(&["worker"], &[("FLOTILLA_WORKER__HEARTBEAT", "10s")])?;
    p.wait_registered(planner_pool).await?;
    let other = p.spawn_env(
        &["worker", "--pool", "elsewhere"],
        &[("FLOTILLA_WORKER__HEARTBEAT", "100ms")],
    )?;
    p.wait_registered(other).await?;
    wait_for_live_worker(&p).await?;

    for round in 0..3 {
        p.kill(coordinator);
        let started = Instant::now();
        coordinator = p.coordinator().await?;
        let reply = p
            .client
            .submit_request(
                &SubmitRequest::query("What was the revenue?"),
                Duration::from_secs(10),
            )
            .await?;
        anyhow::ensure!(
            reply.status == SubmitStatus::Accepted,
            "round {round}: a bare query {:?} after the coordinator's restart, {:?} after its start: {reply:?}",
            reply.status,
            started.elapsed()
        );
    }
    Ok(())
}
