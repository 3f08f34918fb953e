//! The market-analysis example (`config/examples/market-analysis.toml` and
//! `config/examples/plans/market-analysis.json`), unchanged, across processes against a real
//! nats-server: a researcher, an analyst and a writer (LLM agents) prepare a market report,
//! and its publication (`"action": "publish"`) waits for a person. Approved through the CLI,
//! the publisher (an exec agent) writes the writer's report to a file and the run succeeds;
//! rejected, nothing is published and the run fails (`approval_rejected`). The example plan
//! validates against the example deployment.
//!
//! The model is not a model: it is `flotilla_testkit::openai`, a deterministic
//! OpenAI-compatible test double whose replies (tool calls and texts) are the example's script,
//! `config/examples/models/market-analysis.json`. The `market_data` tool and the publisher are
//! the example's real scripts (`python3`).

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use flotilla_model::ids::RunId;
use flotilla_model::run::{EndCause, RunStatus, TaskStatus};
use flotilla_model::submit::SubmitRequest;
use flotilla_testkit::openai::OpenAiServer;
use support::*;

const CONFIG: &str = "config/examples/market-analysis.toml";
const PLAN: &str = "config/examples/plans/market-analysis.json";
/// `publish_report` is task 4 of the plan; its first attempt asks.
const APPROVAL: &str = "t4a1";
const TITLE: &str = "Norland cargo e-bikes: a market worth entering";
const SUMMARY: &str = "Sales grew from 8,200 bikes in 2022 to 15,400 in 2025; \
                       Oxbow grows fastest online, Hemlin is weakened by a recall.";

/// The example's processes (a coordinator and a worker) with every LLM agent pointed at the
/// test double, and the file the publisher writes (inside `dir`).
async fn example(llm: &OpenAiServer, dir: &Path) -> anyhow::Result<(Processes, PathBuf)> {
    let report = dir.join("published").join("market-report.md");
    let base_url = llm.base_url();
    let report_path = report.to_string_lossy().into_owned();
    let mut p = Processes::with_config_file(
        &root().join(CONFIG),
        &[
            ("FLOTILLA_AGENTS__RESEARCHER__BASE_URL", base_url.as_str()),
            ("FLOTILLA_AGENTS__ANALYST__BASE_URL", base_url.as_str()),
            ("FLOTILLA_AGENTS__WRITER__BASE_URL", base_url.as_str()),
            ("MARKET_REPORT_PATH", report_path.as_str()),
        ],
    )
    .await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    Ok((p, report))
}

/// What "the model" says, task by task (each reply answers the first request whose prompt
/// names its task): the example's own script (`config/examples/models/market-analysis.json`,
/// which `flotilla example market-analysis` serves too) — the researcher calls `market_data`
/// and then lists the figures, the analyst answers its two tasks, the writer answers in the
/// plan's output schema with [`TITLE`] and [`SUMMARY`].
fn script(llm: &OpenAiServer) -> anyhow::Result<()> {
    llm.push_all(example_script("market-analysis")?);
    Ok(())
}

fn plan() -> anyhow::Result<flotilla_model::Plan> {
    Ok(serde_json::from_str(&std::fs::read_to_string(
        root().join(PLAN),
    )?)?)
}

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `flotilla <args> --json`, which must succeed, as JSON.
fn cli_json(p: &Processes, args: &[&str]) -> anyhow::Result<serde_json::Value> {
    let mut args = args.to_vec();
    args.push("--json");
    let out = p.cli(&args)?;
    anyhow::ensure!(out.status.success(), "flotilla {args:?}: {}", text(&out));
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Waits until the operator's inbox (`flotilla approvals list`) shows the run's publication
/// approval; returns the request as `approvals show` gives it.
async fn pending_publication(p: &Processes, run: RunId) -> anyhow::Result<serde_json::Value> {
    let run = run.to_string();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let list = cli_json(p, &["approvals", "list", "--run", &run])?;
        let listed = list["approvals"]
            .as_array()
            .is_some_and(|a| a.iter().any(|r| r["request"]["approval_id"] == APPROVAL));
        if listed {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "run {run} never asked to publish: {list}\n{}",
            p.log(1)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let shown = cli_json(p, &["approvals", "show", &run, APPROVAL])?;
    Ok(shown["record"]["request"].clone())
}

async fn task_status(p: &Processes, run: RunId, task: &str) -> anyhow::Result<TaskStatus> {
    let view = p
        .client
        .run(run)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no run {run}"))?;
    view.tasks
        .iter()
        .find(|t| t.task_id.as_str() == task)
        .map(|t| t.status)
        .ok_or_else(|| anyhow::anyhow!("run {run} has no task {task}"))
}

/// Submits the example plan and waits until its publication asks a person: by then the
/// four tasks before it ran on the scripted model, and nothing is published yet.
async fn until_publication_asks(
    p: &Processes,
    llm: &OpenAiServer,
    report: &Path,
) -> anyhow::Result<(RunId, serde_json::Value)> {
    let run = p.client.submit(SubmitRequest::new(plan()?)).await?;
    let asked = pending_publication(p, run).await?;
    assert_eq!(asked["task_id"], "publish_report", "{asked}");
    assert_eq!(asked["trigger"], "sensitive_action", "{asked}");
    assert_eq!(asked["action"], "publish", "{asked}");
    assert_eq!(asked["agent"], "publisher", "{asked}");
    assert_eq!(
        task_status(p, run, "publish_report").await?,
        TaskStatus::AwaitingApproval
    );
    for task in ["gather_data", "competitors", "trends", "write_report"] {
        assert_eq!(
            task_status(p, run, task).await?,
            TaskStatus::Succeeded,
            "{task}"
        );
    }
    assert!(!report.exists(), "nothing is published before a decision");
    // The person reads the report before deciding: the writer's result is on topic "report".
    let out = p.cli(&["ws", "read", "report", "--run", &run.to_string()])?;
    assert!(out.status.success(), "{}", text(&out));
    let topic: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(
        topic["entries"][0]["writer"]["task_id"], "write_report",
        "{topic}"
    );
    assert!(topic.to_string().contains(TITLE), "{topic}");
    // Every scripted reply was used, and the researcher's tool (the example's script) ran:
    // its figures came back to the model as the tool's result.
    assert_eq!(llm.remaining(), 0, "unused replies");
    let requests = llm.requests();
    assert_eq!(requests.len(), 5, "one model call per reply");
    let tool_results: Vec<String> = requests.iter().flat_map(|r| r.texts("tool")).collect();
    assert!(
        tool_results
            .iter()
            .any(|t| t.contains("Larkspur Cargo") && t.contains("15400")),
        "{tool_results:?}"
    );
    Ok((run, asked))
}

/// The example plan validates against the example deployment (its coordinator), with no
/// problems.
#[tokio::test]
async fn the_example_plan_validates_against_the_example_config() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    let dir = tempfile::tempdir()?;
    let (p, _) = example(&llm, dir.path()).await?;
    let plan_file = root().join(PLAN);
    let plan_file = plan_file.to_string_lossy();
    let report = cli_json(&p, &["plan", "validate", &plan_file])?;
    assert_eq!(report["valid"], true, "{report}");
    // Checked by the coordinator against its deployment (agents, pools), not offline.
    assert_eq!(report["checked"], "deployment", "{report}");
    assert_eq!(report["subtasks"], 5, "{report}");
    for list in ["errors", "warnings"] {
        assert!(
            report[list].as_array().is_some_and(Vec::is_empty),
            "{list}: {report}"
        );
    }
    let out = p.cli(&["plan", "validate", &plan_file])?;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    // The publication is the plan's sensitive step: action "publish", and the plan itself
    // insists it waits (config.hitl), whatever the deployment's [hitl] says.
    let plan = plan()?;
    let publish = plan
        .subtasks
        .iter()
        .find(|t| t.id.as_str() == "publish_report")
        .ok_or_else(|| anyhow::anyhow!("no publish_report"))?;
    assert_eq!(publish.action.as_deref(), Some("publish"));
    assert_eq!(publish.agent.as_deref(), Some("publisher"));
    let hitl = plan
        .config
        .hitl
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("no config.hitl"))?;
    assert!(hitl.sensitive_actions.iter().any(|a| a == "publish"));
    Ok(())
}

/// Approved: the publisher writes the writer's report to the file, the run succeeds with
/// the publication as its result, and the audit trail names who approved.
#[tokio::test]
async fn an_approved_report_is_published_and_the_run_succeeds() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    script(&llm)?;
    let dir = tempfile::tempdir()?;
    let (p, report) = example(&llm, dir.path()).await?;
    let (run, asked) = until_publication_asks(&p, &llm, &report).await?;
    let digest = asked["digest"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("no digest in {asked}"))?;
    let run_id = run.to_string();
    // Without --by, $USER or $LOGNAME (a container, CI), the answer is the operating
    // system user's.
    let out = p.cli_without(
        &["USER", "LOGNAME"],
        &[
            "approvals",
            "approve",
            &run_id,
            APPROVAL,
            "--comment",
            "figures checked",
            "--digest",
            digest,
            "--json",
        ],
    )?;
    assert!(out.status.success(), "{}", text(&out));
    let answered: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(answered["outcome"], "decided", "{answered}");
    let me = nix::unistd::User::from_uid(nix::unistd::getuid())?
        .map(|u| u.name)
        .unwrap_or_default();
    assert_eq!(
        answered["record"]["answer"]["by"],
        me.as_str(),
        "{answered}"
    );

    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(
        outcome.status,
        RunStatus::Succeeded,
        "{outcome:?}\n{}",
        p.log(1)
    );
    let published = std::fs::read_to_string(&report)?;
    assert!(published.contains(&format!("# {TITLE}")), "{published}");
    assert!(published.contains(SUMMARY), "{published}");
    assert!(
        published.contains("**Recommendation:** Launch online in 2026"),
        "{published}"
    );
    assert!(published.contains(&run_id), "{published}");
    let result = outcome
        .final_result
        .as_ref()
        .map(|f| f.response.clone())
        .unwrap_or_default();
    assert!(
        result.contains("Published") && result.contains(&*report.to_string_lossy()),
        "{outcome:?}"
    );
    // The publisher ran exactly once, after the approval.
    let published_results = results_of(&p.bus, run)
        .await?
        .into_iter()
        .filter(|(task, _, ok)| task == "publish_report" && *ok)
        .count();
    assert_eq!(published_results, 1);

    let history = p.cli(&["approvals", "history", &run_id])?;
    assert!(history.status.success(), "{}", text(&history));
    let trail = text(&history);
    assert!(trail.contains(APPROVAL), "{trail}");
    assert!(
        trail.contains(&format!("decided approve by {me}")),
        "{trail}"
    );
    Ok(())
}

/// Rejected with a message: the publisher never runs (no file), and, publish_report being
/// required, the run fails with cause `approval_rejected` and the person's message.
#[tokio::test]
async fn a_rejected_report_is_never_published_and_the_run_fails() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    script(&llm)?;
    let dir = tempfile::tempdir()?;
    let (p, report) = example(&llm, dir.path()).await?;
    let (run, _) = until_publication_asks(&p, &llm, &report).await?;
    let run_id = run.to_string();
    let answered = cli_json(
        &p,
        &[
            "approvals",
            "reject",
            &run_id,
            APPROVAL,
            "--by",
            "bob",
            "--message",
            "not before the board meets",
        ],
    )?;
    assert_eq!(answered["outcome"], "decided", "{answered}");

    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed, "{outcome:?}");
    assert_eq!(
        outcome.cause,
        Some(EndCause::ApprovalRejected),
        "{outcome:?}"
    );
    let reason = outcome.reason.clone().unwrap_or_default();
    assert!(
        reason.contains("publish_report") && reason.contains("not before the board meets"),
        "{reason}"
    );
    assert!(!report.exists(), "a rejected report is never published");
    assert!(
        results_of(&p.bus, run)
            .await?
            .iter()
            .all(|(task, _, _)| task != "publish_report"),
        "the publisher never ran"
    );
    // A later approval changes nothing: the first answer decided.
    // It is told what decided, and exits 1: it decided nothing.
    let late = p.cli(&[
        "approvals",
        "approve",
        &run_id,
        APPROVAL,
        "--by",
        "carol",
        "--json",
    ])?;
    assert_eq!(late.status.code(), Some(1), "{}", text(&late));
    let late: serde_json::Value = serde_json::from_slice(&late.stdout)?;
    assert_eq!(late["outcome"], "already_decided", "{late}");
    let said = p.cli(&["approvals", "reject", &run_id, APPROVAL, "--by", "carol"])?;
    assert_eq!(said.status.code(), Some(1), "{}", text(&said));
    let err = String::from_utf8_lossy(&said.stderr);
    assert!(
        err.starts_with("already_decided: decided reject by bob"),
        "{}",
        text(&said)
    );
    assert!(!report.exists());

    let history = p.cli(&["approvals", "history", &run_id])?;
    assert!(history.status.success(), "{}", text(&history));
    let trail = text(&history);
    assert!(trail.contains("decided reject by bob"), "{trail}");

    // A run with nothing waiting lists nothing (exit 0); a run that does not exist is
    // `not_found` (exit 1), not an empty list.
    let listed = p.cli(&["approvals", "list", "--run", &run_id])?;
    assert!(listed.status.success(), "{}", text(&listed));
    let ghost = RunId::new().to_string();
    for args in [
        vec!["approvals", "list", "--run", &ghost],
        vec!["approvals", "history", &ghost],
    ] {
        let out = p.cli(&args)?;
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", text(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            err.trim(),
            format!("error: not_found: run {ghost} does not exist"),
            "{args:?}"
        );
        let mut json = args.clone();
        json.push("--json");
        let out = p.cli(&json)?;
        assert_eq!(out.status.code(), Some(1), "{json:?}: {}", text(&out));
        let said: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        assert_eq!(said["error"], "not_found", "{said}");
    }
    Ok(())
}
