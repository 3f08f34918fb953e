//! `run.diff` and `flotilla runs diff` across real processes: a coordinator and a worker
//! process on a real nats-server run the same plan twice, the second time with one task's
//! answer changed and one task more; the comparison names what changed.
//!
//! The agent is a small deterministic Python exec script written by the test (not a model):
//! it answers with the text of `<task>.txt` in its working directory, so the test changes an
//! answer by rewriting a file between the runs.

mod support;

use std::time::Duration;

use flotilla_model::ErrorCode;
use flotilla_model::diff::{RunDiff, RunDiffRequest};
use flotilla_model::ids::RunId;
use flotilla_model::plan::Subtask;
use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::submit::SubmitRequest;
use serde_json::{Value, json};
use support::*;

/// Answers with the text of `<task_id>.txt`.
const ANSWER_PY: &str = r#"import json, sys
task = json.load(sys.stdin)
with open(task["task_id"] + ".txt") as f:
    print(json.dumps({"response": f.read()}))
"#;

const AGENTS: &str =
    "[agents.answer]\nkind = \"exec\"\ncommand = \"python3\"\nargs = [\"answer.py\"]\n";

fn task(id: &str, deps: &[&str]) -> Subtask {
    let mut t = Subtask::new(id, "answer from a file").with_agent("answer");
    t.dependencies = deps.iter().map(|d| (*d).into()).collect();
    t
}

async fn run(p: &Processes, tasks: Vec<Subtask>) -> anyhow::Result<RunId> {
    let run = p.client.submit(SubmitRequest::new(plan(tasks))).await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    Ok(run)
}

#[tokio::test]
async fn two_runs_are_compared_task_by_task_over_the_wire_and_the_cli() -> anyhow::Result<()> {
    let mut p = Processes::start(AGENTS).await?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "2"]).await?;
    let write = |name: &str, text: &str| std::fs::write(p.dir().join(name), text);
    write("answer.py", ANSWER_PY)?;
    write("a.txt", "alpha\n")?;
    write("b.txt", "beta\nsecond line\nthird line\n")?;
    write("c.txt", "gamma\n")?;
    let original = run(
        &p,
        vec![task("a", &[]), task("b", &["a"]), task("c", &["b"])],
    )
    .await?;
    // The variant: b answers differently, and the plan has a task more.
    write("b.txt", "beta\nSECOND LINE\nthird line\n")?;
    write("d.txt", "delta\n")?;
    let variant = run(
        &p,
        vec![
            task("a", &[]),
            task("b", &["a"]),
            task("c", &["b"]),
            task("d", &["c"]),
        ],
    )
    .await?;

    // Over the wire.
    let d: RunDiff = p
        .client
        .request(
            &RunDiffRequest::new(original, variant),
            Duration::from_secs(10),
        )
        .await?;
    assert_eq!((d.a.run_id, d.b.run_id), (original, variant));
    assert_eq!((d.a.tasks, d.b.tasks), (3, 4));
    assert_eq!((d.a.succeeded, d.b.succeeded), (3, 4));
    assert_eq!((d.a.attempts, d.b.attempts), (3, 4));
    assert_eq!(
        (d.a.status, d.b.status),
        (RunStatus::Succeeded, RunStatus::Succeeded)
    );
    let ids: Vec<&str> = d.tasks.iter().map(|t| t.task_id.as_str()).collect();
    assert_eq!(ids, ["a", "b", "c", "d"]);
    let changed: Vec<&str> = d
        .tasks
        .iter()
        .filter(|t| t.changed)
        .map(|t| t.task_id.as_str())
        .collect();
    assert_eq!(changed, ["b", "d"]);
    assert_eq!(d.changed, 2);
    let b = &d.tasks[1];
    let diff = b.diff.as_deref().expect("b's results differ");
    assert!(diff.contains("-second line\n"), "{diff}");
    assert!(diff.contains("+SECOND LINE\n"), "{diff}");
    assert!(diff.contains(" third line\n"), "{diff}");
    let (ba, bb) = (b.a.as_ref().expect("a side"), b.b.as_ref().expect("b side"));
    assert_eq!(
        ba.result.as_deref(),
        Some("beta\nsecond line\nthird line\n")
    );
    assert_eq!(
        bb.result.as_deref(),
        Some("beta\nSECOND LINE\nthird line\n")
    );
    assert_eq!((ba.status, ba.attempts), (TaskStatus::Succeeded, 1));
    assert!(ba.latency_ms.is_some() && bb.latency_ms.is_some());
    assert!(d.tasks[0].diff.is_none() && !d.tasks[0].changed);
    let only_b = &d.tasks[3];
    assert!(only_b.a.is_none() && only_b.b.is_some() && only_b.diff.is_none());

    // The CLI: the same answer as JSON, exit 1 because something changed.
    let out = p.cli(&[
        "runs",
        "diff",
        &original.to_string(),
        &variant.to_string(),
        "--json",
    ])?;
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cli: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(cli, serde_json::to_value(&d)?);
    // As a person reads it.
    let out = p.cli(&["runs", "diff", &original.to_string(), &variant.to_string()])?;
    let table = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{table}");
    assert!(table.contains("2 of 4 tasks changed"), "{table}");
    assert!(table.lines().any(|l| l.starts_with("*b ")), "{table}");
    assert!(table.lines().any(|l| l.starts_with(" a ")), "{table}");
    assert!(table.contains("+SECOND LINE"), "{table}");
    // A run compared with itself: nothing changed, exit 0.
    let out = p.cli(&["runs", "diff", &original.to_string(), &original.to_string()])?;
    let same = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{same}");
    assert!(same.contains("0 of 3 tasks changed"), "{same}");

    // Bad input changes nothing and is named.
    let ghost = RunId::new();
    let refused = p
        .client
        .call(
            &RunDiffRequest::new(original, ghost),
            Duration::from_secs(10),
        )
        .await?
        .expect_err("an unknown run");
    assert_eq!(
        (refused.status, refused.code.as_str()),
        (404, ErrorCode::NotFound.as_str())
    );
    assert!(
        refused.message.contains(&ghost.to_string()),
        "{}",
        refused.message
    );
    let out = p.cli(&["runs", "diff", &ghost.to_string(), &original.to_string()])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("run {ghost} does not exist")),
        "{err}"
    );
    let reply = p
        .bus
        .client()
        .request(
            "flotilla.api.run.diff",
            serde_json::to_vec(&json!({"a": original.to_string()}))?.into(),
        )
        .await?;
    let body: Value = serde_json::from_slice(&reply.payload)?;
    assert_eq!(body["code"], "malformed", "{body}");
    assert!(
        body["message"].as_str().unwrap_or_default().contains("b"),
        "{body}"
    );
    let out = p.cli(&["runs", "diff", "not-a-run", &original.to_string()])?;
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}
