//! What a person reads, through the CLI as a person runs it, against real processes and a
//! real nats-server: a run waiting for a person reads `waiting` — with what it waits for and
//! the command that answers — in `runs list`, `runs show` and `submit --follow`; a task a
//! worker runs reads `running` with the worker and how long, `dispatched` only until then;
//! `watch` (default profile) shows tasks starting and ending and the approval asked and
//! answered. A paused run reads `waiting` with the command that resumes it.
//!
//! Agents are deterministic: `bot` is the scripted test agent, `slow` an exec agent that
//! sleeps.

mod support;

use std::io::BufRead;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flotilla_model::ids::RunId;
use support::*;

const CONFIG: &str = r#"
default-agent = "bot"
[agents.bot]
kind = "scripted"
reply = "{task_id} done"

[agents.slow]
kind = "exec"
command = "sleep"
args = ["6"]
"#;

const PLAN: &str = r#"{
  "name": "readable",
  "subtasks": [
    {"id": "crunch", "description": "take a while", "agent": "slow"},
    {"id": "publish", "description": "publish the report", "action": "publish",
     "input": {"channel": "news"}},
    {"id": "announce", "description": "tell", "dependencies": ["crunch", "publish"]}
  ]
}"#;

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `flotilla <args>` until `check` accepts its stdout (which it returns), or the wait's end.
async fn until(
    p: &Processes,
    args: &[&str],
    check: impl Fn(&str) -> bool,
) -> anyhow::Result<String> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let out = p.cli(args)?;
        let shown = text(&out);
        if out.status.success() && check(&shown) {
            return Ok(shown);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "flotilla {args:?} never read as expected:\n{shown}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The line of `shown` that starts with `start`.
fn line_of<'a>(shown: &'a str, start: &str) -> &'a str {
    shown
        .lines()
        .find(|l| l.starts_with(start))
        .unwrap_or_default()
}

#[tokio::test]
async fn a_run_waiting_for_a_person_reads_waiting_with_the_command_that_answers()
-> anyhow::Result<()> {
    let mut p = Processes::start(CONFIG).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let plan = p.dir().join("readable.json");
    std::fs::write(&plan, PLAN)?;

    // `submit --follow` as a person runs it: its progress lines on stderr.
    let mut follow = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .arg("--config")
        .arg(&p.config)
        .args(["submit", "--follow", "--timeout", "60s"])
        .arg(&plan)
        .env_remove("FLOTILLA_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let said = Arc::new(Mutex::new(String::new()));
    let reader = {
        let said = Arc::clone(&said);
        let stderr = follow.stderr.take().expect("piped");
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                let mut s = said
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                s.push_str(&line);
                s.push('\n');
            }
        })
    };

    // `runs list`: the run reads `waiting`, and below the table what it waits for and how
    // to answer.
    let listed = until(&p, &["runs", "list"], |s| {
        s.contains("waiting for a person:") && s.contains("approval t1a1 of task publish")
    })
    .await?;
    let row = listed
        .lines()
        .find(|l| l.contains("readable"))
        .unwrap_or_default();
    let run: RunId = row
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .parse()
        .map_err(|e| anyhow::anyhow!("no run id in {row:?}: {e}\n{listed}"))?;
    assert!(row.contains(" waiting "), "{listed}");
    assert!(
        listed.contains(&format!(
            "answer: flotilla approvals approve {run} t1a1 (or reject)"
        )),
        "{listed}"
    );

    // `runs show`: the status says waiting and why; the slow task reads running on its
    // worker, the sensitive one awaiting approval.
    let run_s = run.to_string();
    let shown = until(&p, &["runs", "show", &run_s], |s| {
        line_of(s, "crunch").contains("running")
    })
    .await?;
    assert_eq!(
        line_of(&shown, "status").trim_end(),
        "status    waiting (the run is running)",
        "{shown}"
    );
    assert!(
        line_of(&shown, "waits for").starts_with("waits for approval t1a1 of task publish"),
        "{shown}"
    );
    let crunch = line_of(&shown, "crunch");
    assert!(
        crunch.contains(" on ") && crunch.contains(" for "),
        "{shown}"
    );
    let publish = line_of(&shown, "publish ");
    assert!(
        publish.contains("awaiting_approval")
            && publish.contains(&format!("flotilla approvals approve {run} t1a1")),
        "{shown}"
    );
    assert!(line_of(&shown, "announce").contains("waiting"), "{shown}");
    eprintln!("runs list:\n{listed}\nruns show:\n{shown}");

    // `submit --follow` said the run waits, and how to answer, instead of a silence.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let s = said.lock().map(|s| s.clone()).unwrap_or_default();
        if s.contains("publish waits for a person: approval t1a1")
            && s.contains(&format!("answer: flotilla approvals approve {run} t1a1"))
            && s.contains("crunch started on")
        {
            break;
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "follow said:\n{s}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Approved, the run ends and reads succeeded; nothing waits.
    let out = p.cli(&["approvals", "approve", &run_s, "t1a1", "--by", "ann"])?;
    assert!(out.status.success(), "{}", text(&out));
    let status = tokio::task::spawn_blocking(move || follow.wait_with_output()).await??;
    let _ = reader.join();
    let s = said.lock().map(|s| s.clone()).unwrap_or_default();
    assert!(status.status.success(), "follow: {s}");
    assert!(s.contains("approval t1a1 of publish:"), "follow: {s}");
    let listed = p.cli(&["runs", "list"])?;
    let listed = text(&listed);
    assert!(!listed.contains("waiting for a person"), "{listed}");
    assert!(line_of(&listed, &run_s).contains(" succeeded "), "{listed}");

    // `watch` with the default profile tells the story a person needs.
    let out = p.cli(&["watch", &run_s])?;
    let watched = text(&out);
    assert!(out.status.success(), "{watched}");
    eprintln!("submit --follow:\n{s}\nwatch:\n{watched}");
    for says in [
        "run_started",
        "task_started crunch on ",
        "task_succeeded crunch in ",
        "approval_requested publish: waits for a person, approval t1a1",
        "approval_decided publish: approval t1a1",
        "task_succeeded announce",
        "run_succeeded",
    ] {
        assert!(watched.contains(says), "watch lacks {says:?}:\n{watched}");
    }
    Ok(())
}

#[tokio::test]
async fn a_paused_run_reads_waiting_with_the_command_that_resumes_it() -> anyhow::Result<()> {
    let mut p = Processes::start(CONFIG).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let plan = p.dir().join("slow.json");
    std::fs::write(
        &plan,
        r#"{"name": "held", "subtasks": [
            {"id": "crunch", "description": "take a while", "agent": "slow"},
            {"id": "after", "description": "then", "dependencies": ["crunch"]}]}"#,
    )?;
    let plan = plan.to_string_lossy().into_owned();
    let out = p.cli(&["submit", &plan, "--json"])?;
    anyhow::ensure!(out.status.success(), "{}", text(&out));
    let submitted: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let run = submitted["run_id"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("no run id: {submitted}"))?
        .to_owned();
    let out = p.cli(&["runs", "pause", &run, "--by", "ann", "--reason", "a look"])?;
    assert!(out.status.success(), "{}", text(&out));
    let listed = until(&p, &["runs", "list"], |s| {
        s.contains("waiting for a person:")
    })
    .await?;
    assert!(line_of(&listed, &run).contains(" waiting "), "{listed}");
    assert!(
        listed.contains("pause: paused by a person")
            && listed.contains(&format!("answer: flotilla runs resume {run}")),
        "{listed}"
    );
    let shown = p.cli(&["runs", "show", &run])?;
    let shown = text(&shown);
    assert_eq!(
        line_of(&shown, "status").trim_end(),
        "status    waiting (the run is paused)",
        "{shown}"
    );
    let out = p.cli(&["runs", "resume", &run, "--by", "ann"])?;
    assert!(out.status.success(), "{}", text(&out));
    until(&p, &["runs", "list"], |s| {
        line_of(s, &run).contains(" succeeded ")
    })
    .await?;
    Ok(())
}

/// `flotilla status`: which services answer, the pools and their workers, pending approvals,
/// and what needs attention (exit 1), on a deployment that changes under it; exit 2 for an
/// unreachable NATS.
#[tokio::test]
async fn status_says_what_answers_and_what_needs_attention() -> anyhow::Result<()> {
    let mut p = Processes::start(CONFIG).await?;
    p.coordinator().await?;
    let worker = p.worker(&[]).await?;

    // No supervisor: attention, exit 1.
    let out = p.cli(&["status"])?;
    let shown = text(&out);
    assert_eq!(out.status.code(), Some(1), "{shown}");
    assert!(
        line_of(&shown, "coordinator")
            .contains(&format!("1 answering ({})", env!("CARGO_PKG_VERSION"))),
        "{shown}"
    );
    assert!(
        line_of(&shown, "supervisor").contains("none answers"),
        "{shown}"
    );
    assert!(
        shown.contains("attention:    no supervisor answers"),
        "{shown}"
    );
    assert!(
        line_of(&shown, "pool").contains("default: 1 live worker(s), 0/"),
        "{shown}"
    );

    // Everything answers: ok, exit 0; a waiting approval is counted.
    p.supervisor().await?;
    let plan = p.dir().join("ask.json");
    std::fs::write(
        &plan,
        r#"{"name": "ask", "subtasks": [{"id": "publish", "description": "publish",
            "action": "publish", "input": {"channel": "news"}}]}"#,
    )?;
    let out = p.cli(&["submit", &plan.to_string_lossy()])?;
    assert!(out.status.success(), "{}", text(&out));
    let shown = until(&p, &["status"], |s| s.contains("1 pending")).await?;
    assert!(shown.trim_end().ends_with("ok"), "{shown}");
    assert!(
        line_of(&shown, "approvals").contains("1 pending (flotilla approvals list)"),
        "{shown}"
    );
    let json: serde_json::Value = serde_json::from_slice(&p.cli(&["status", "--json"])?.stdout)?;
    assert_eq!(json["pending_approvals"], 1, "{json}");
    assert_eq!(json["attention"], serde_json::json!([]), "{json}");

    // The pool's only worker gone: its tasks wait, and status says so.
    p.kill(worker);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let out = p.cli(&["status"])?;
        let shown = text(&out);
        if shown.contains("attention:    pool default has no live worker") {
            assert_eq!(out.status.code(), Some(1), "{shown}");
            break;
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "{shown}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    // No NATS: exit 2, one line naming the URL.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["--nats-url", "nats://127.0.0.1:1", "status"])
        .env_remove("FLOTILLA_CONFIG")
        .current_dir(p.dir())
        .stdin(Stdio::null())
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("nats://127.0.0.1:1"), "{err}");
    Ok(())
}

/// `flotilla init` outside any repository writes a starter configuration and a plan that
/// `flotilla up --submit` runs to its end there; a second `init` refuses to overwrite them by
/// name (exit 2) and changes nothing.
#[test]
fn init_writes_a_starter_that_up_runs() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let bin = env!("CARGO_BIN_EXE_flotilla");
    let run = |args: &[&str]| {
        std::process::Command::new(bin)
            .args(args)
            .current_dir(dir.path())
            .env_remove("FLOTILLA_CONFIG")
            .env_remove("FLOTILLA_LOG")
            .stdin(Stdio::null())
            .output()
    };
    let out = run(&["init"])?;
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("Next: flotilla up --submit hello.json"),
        "{}",
        text(&out)
    );
    let config = std::fs::read_to_string(dir.path().join("flotilla.toml"))?;

    let out = run(&["up", "--workers", "1", "--submit", "hello.json"])?;
    let said = text(&out);
    assert_eq!(out.status.code(), Some(0), "{said}");
    assert!(!said.contains("warning: no configuration"), "{said}");
    assert!(
        said.contains("summarise: done (inputs: count,gather)"),
        "{said}"
    );
    assert!(said.contains("✓ count succeeded"), "{said}");

    std::fs::write(dir.path().join("hello.json"), "mine")?;
    let out = run(&["init"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("flotilla.toml and ./hello.json already exist") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("hello.json"))?,
        "mine"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("flotilla.toml"))?,
        config
    );
    Ok(())
}

/// A deployment with no agents — `up` outside the repository before `init` — says so at
/// `plan validate` and at `submit`, naming each task's agent that no live worker runs,
/// instead of `✓ valid` and runs whose every task fails.
#[tokio::test]
async fn a_deployment_without_the_plans_agents_says_so_at_validate_and_submit() -> anyhow::Result<()>
{
    let mut p = Processes::start("").await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let plan = p.dir().join("two.json");
    std::fs::write(
        &plan,
        r#"{"name": "two", "subtasks": [
            {"id": "fetch", "description": "fetch", "agent": "fetcher"},
            {"id": "sum", "description": "sum", "dependencies": ["fetch"]}]}"#,
    )?;
    let plan = plan.to_string_lossy().into_owned();
    let expected = [
        "warning [unknown_agent] subtasks.fetch.agent: no live worker of pool \"default\" runs agent \"fetcher\" (they run: no agents",
        "warning [unknown_agent] subtasks.sum.agent: the live workers of pool \"default\" have no agents",
    ];
    let out = until(&p, &["plan", "validate", &plan], |s| {
        s.contains("unknown_agent")
    })
    .await?;
    for line in expected {
        assert!(out.contains(line), "{line}\n{out}");
    }
    let out = p.cli(&["submit", &plan])?;
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    for line in expected {
        assert!(said.contains(line), "{line}\n{said}");
    }
    Ok(())
}
