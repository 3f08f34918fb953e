//! Humans in the loop, `cancel --rollback`: across processes (coordinator, worker, CLI)
//! against a real nats-server, a run cancelled with `rollback` has its succeeded tasks that
//! declare a compensation undone in reverse dependency order by a rollback run, a child of
//! the cancelled run; a failed compensation fails the rollback run, skips what came before
//! it and makes the CLI exit 1; a plan naming an unknown compensating agent is refused and
//! starts nothing. The agents are small `sh` and `python3` exec scripts.

mod support;

use std::time::Duration;

use flotilla_model::plan::{PlanConfig, Subtask};
use flotilla_model::rollback::rollback_run_id;
use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::submit::SubmitRequest;
use support::*;

/// `work` does its task and notes it; `slow` runs until cancelled; `undo` reverses a task
/// (and cannot undo a task named `q`); `retract` is a second compensating agent.
const CONFIG: &str = "[agents.work]\nkind = \"exec\"\ncommand = \"sh\"\n\
    args = [\"-c\", \"echo did $FLOTILLA_TASK_ID >> did.log; echo $FLOTILLA_TASK_ID done\"]\n\
    compensate = \"undo\"\n\
    [agents.slow]\nkind = \"exec\"\ncommand = \"sh\"\nargs = [\"-c\", \"sleep 60\"]\n\
    [agents.undo]\nkind = \"exec\"\ncommand = \"python3\"\nargs = [\"undo.py\"]\n\
    [agents.retract]\nkind = \"exec\"\ncommand = \"python3\"\nargs = [\"undo.py\", \"retract\"]\n";

const UNDO_PY: &str = r#"import json, sys
envelope = json.load(sys.stdin)
c = envelope["input"]["compensates"]
how = sys.argv[1] if len(sys.argv) > 1 else "undo"
with open("undo.log", "a") as f:
    f.write(f"{how} {c['task_id']} {c['result'].strip()}\n")
if c["task_id"] == "q":
    print("q cannot be undone", file=sys.stderr)
    sys.exit(3)
print(f"{how} of {c['task_id']} done")
"#;

/// `first → second → third(slow)`, and `side` (its own compensation) beside them.
fn chain(first: &str, second: &str, third: &str) -> flotilla_model::plan::Plan {
    let mut side = Subtask::new(&format!("{first}-side"), "note it").with_agent("work");
    side.compensate = Some("retract".into());
    let mut p = plan(vec![
        Subtask::new(first, "fetch").with_agent("work"),
        Subtask::new(second, "transform")
            .with_agent("work")
            .after(&[first]),
        Subtask::new(third, "publish")
            .with_agent("slow")
            .after(&[second]),
        side,
    ]);
    p.config = PlanConfig {
        max_retries: 0,
        ..PlanConfig::default()
    };
    p
}

/// Waits until every task but the slow one succeeded.
async fn until_running_third(p: &Processes, run: flotilla_model::ids::RunId) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some(view) = p.client.run(run).await? {
            let done = view
                .tasks
                .iter()
                .filter(|t| t.status == TaskStatus::Succeeded)
                .count();
            if done == 3 {
                return Ok(());
            }
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "tasks never ran");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn undo_log(p: &Processes) -> Vec<String> {
    std::fs::read_to_string(p.dir().join("undo.log"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_rollback_compensates_in_reverse_dependency_order() -> anyhow::Result<()> {
    let mut p = Processes::start(CONFIG).await?;
    std::fs::write(p.dir().join("undo.py"), UNDO_PY)?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "4"]).await?;

    // Undone in reverse order: b, then a; `a-side` on its own; the slow task is cancelled
    // while running and not undone (it never succeeded).
    let run = p
        .client
        .submit(SubmitRequest::new(chain("a", "b", "c")))
        .await?;
    until_running_third(&p, run).await?;
    let out = p.cli(&[
        "runs",
        "cancel",
        &run.to_string(),
        "--rollback",
        "--reason",
        "wrong figures",
        "--json",
    ])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reply: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let rollback = rollback_run_id(run);
    assert_eq!(reply["outcome"]["status"], "cancelled");
    assert_eq!(reply["outcome"]["rollback_run_id"], rollback.to_string());
    assert_eq!(
        reply["outcome"]["reason"],
        "cancelled: wrong figures; rolling back 3 succeeded tasks"
    );
    assert_eq!(reply["rollback"]["status"], "succeeded", "{reply}");
    let log = undo_log(&p);
    assert_eq!(log.len(), 3, "{log:?}");
    let at = |line: &str| log.iter().position(|l| l == line);
    let (b, a) = (at("undo b b done"), at("undo a a done"));
    assert!(b.is_some() && a.is_some() && b < a, "b before a: {log:?}");
    assert!(at("retract a-side a-side done").is_some(), "{log:?}");

    // The rollback is a child of the cancelled run, recorded like any run.
    let tree = p.client.tree(run, 10).await?.expect("the tree");
    assert_eq!(tree.root.children.len(), 1, "{tree:?}");
    assert_eq!(tree.root.children[0].run_id, rollback);
    let view = p.client.run(rollback).await?.expect("the rollback run");
    assert_eq!(view.record.status, RunStatus::Succeeded);
    assert_eq!(
        view.record.labels.get("rollback_of").map(String::as_str),
        Some(run.to_string().as_str())
    );
    // Cancelling again changes nothing and starts no second rollback.
    let again = p.cli(&["runs", "cancel", &run.to_string(), "--rollback", "--json"])?;
    assert!(again.status.success());
    let again: serde_json::Value = serde_json::from_slice(&again.stdout)?;
    assert_eq!(again["cancelling"], false);
    assert_eq!(again["rollback_run_id"], rollback.to_string());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(undo_log(&p).len(), 3);

    // A compensation that fails is never silent: the rollback run fails, what came before
    // it is not undone, and the CLI says so and exits 1.
    let run = p
        .client
        .submit(SubmitRequest::new(chain("p", "q", "r")))
        .await?;
    until_running_third(&p, run).await?;
    let out = p.cli(&["runs", "cancel", &run.to_string(), "--rollback"])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("Rollback run"), "{stderr}");
    assert!(stderr.contains("compensation undo-q failed"), "{stderr}");
    assert!(stderr.contains("compensation undo-p not run"), "{stderr}");
    let log = undo_log(&p);
    assert!(log.iter().any(|l| l.starts_with("undo q")), "{log:?}");
    assert!(!log.iter().any(|l| l.starts_with("undo p")), "{log:?}");
    assert!(
        log.iter().any(|l| l.starts_with("retract p-side")),
        "{log:?}"
    );
    let view = p.client.run(rollback_run_id(run)).await?.expect("rollback");
    assert_eq!(view.record.status, RunStatus::Failed);

    // Without --rollback nothing is undone.
    let run = p
        .client
        .submit(SubmitRequest::new(chain("x", "y", "z")))
        .await?;
    until_running_third(&p, run).await?;
    let out = p.cli(&["runs", "cancel", &run.to_string(), "--json"])?;
    assert!(out.status.success());
    let outcome: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert!(outcome.get("rollback_run_id").is_none(), "{outcome}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!undo_log(&p).iter().any(|l| l.contains(" x")));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_compensating_agent_is_refused() -> anyhow::Result<()> {
    let mut p = Processes::start(CONFIG).await?;
    p.coordinator().await?;
    let mut bad = Subtask::new("a", "fetch").with_agent("work");
    bad.compensate = Some("nobody".into());
    let path = p.dir().join("bad.json");
    std::fs::write(&path, serde_json::to_vec(&plan(vec![bad]))?)?;
    let out = p.cli(&["plan", "validate", &path.to_string_lossy(), "--json"])?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(stdout.contains("subtasks[0].compensate"), "{stdout}");
    assert!(stdout.contains("unknown_agent"), "{stdout}");
    assert!(stdout.contains("\\\"nobody\\\""), "{stdout}");
    // Cancelling a run that does not exist: not found, exit 1.
    let out = p.cli(&[
        "runs",
        "cancel",
        &flotilla_model::ids::RunId::new().to_string(),
        "--rollback",
    ])?;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not_found"));
    Ok(())
}

/// `runs tree` names a rollback run once, whatever the cancelled plan is called: a plan named
/// `rollback` is shown with its rollback run as `rollback of "rollback"` (the cancelled run's
/// name quoted), never `rollback of rollback`, which read as the rollback of a rollback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_tree_names_a_rollback_run_once() -> anyhow::Result<()> {
    let mut p = Processes::start(CONFIG).await?;
    std::fs::write(p.dir().join("undo.py"), UNDO_PY)?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "4"]).await?;
    let mut named = chain("a", "b", "c");
    named.name = Some("rollback".into());
    let run = p.client.submit(SubmitRequest::new(named)).await?;
    until_running_third(&p, run).await?;
    let out = p.cli(&["runs", "cancel", &run.to_string(), "--rollback"])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = p.cli(&["runs", "tree", &run.to_string()])?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let rollback = rollback_run_id(run).to_string();
    let lines: Vec<&str> = text.lines().collect();
    let root = lines
        .iter()
        .find(|l| l.starts_with(&run.to_string()))
        .unwrap_or_else(|| panic!("no line of the run: {text}"));
    assert!(root.ends_with("  rollback"), "{text}");
    let child = lines
        .iter()
        .find(|l| l.trim_start().starts_with(&rollback))
        .unwrap_or_else(|| panic!("no line of the rollback run: {text}"));
    assert!(child.starts_with("  "), "indented under the run: {text}");
    assert!(child.ends_with(r#"  rollback of "rollback""#), "{text}");
    assert!(!text.contains("rollback of rollback"), "{text}");
    let view = p
        .client
        .run(rollback_run_id(run))
        .await?
        .expect("the rollback run");
    assert_eq!(
        view.record.name.as_deref(),
        Some(r#"rollback of "rollback""#)
    );
    Ok(())
}
