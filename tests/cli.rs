//! The `flotilla` binary's client commands, run as a user would run them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use flotilla_testkit::NatsServer;

mod support;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn flotilla(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(args)
        .current_dir(root())
        .env_remove("FLOTILLA_CONFIG")
        .output()
        .expect("the flotilla binary runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn version_is_printed() {
    let out = flotilla(&["--version"]);
    assert!(out.status.success());
    assert!(stdout(&out).starts_with("flotilla "), "{}", stdout(&out));
}

#[test]
fn good_examples_validate() {
    for plan in ["earnings.json", "fan-out-fan-in.json"] {
        let out = flotilla(&["plan", "validate", &format!("config/examples/plans/{plan}")]);
        assert_eq!(out.status.code(), Some(0), "{plan}: {}", stdout(&out));
        assert!(stdout(&out).contains("valid"));
    }
}

#[test]
fn cycle_is_reported_with_its_tasks() {
    let out = flotilla(&[
        "plan",
        "validate",
        "config/examples/plans/broken-cycle.json",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    assert!(text.contains("[cycle]"), "{text}");
    assert!(text.contains("draft → review → draft"), "{text}");
}

#[test]
fn missing_producer_names_topic_and_consumers_in_json() {
    let out = flotilla(&[
        "plan",
        "validate",
        "--json",
        "config/examples/plans/broken-missing-producer.json",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json output");
    assert_eq!(v["valid"], false);
    let err = &v["errors"][0];
    assert_eq!(err["code"], "missing_producer");
    assert_eq!(err["topic"], "market_data");
    assert_eq!(
        err["tasks"],
        serde_json::json!(["calc_growth", "calc_margin"])
    );
}

#[test]
fn malformed_json_and_unknown_pool_are_problems_not_crashes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{\"subtasks\": [ {\"id\": \"a\", }").expect("write");
    let out = flotilla(&["plan", "validate", bad.to_str().expect("utf8")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).contains("[malformed]"), "{}", stdout(&out));

    let gpu = dir.path().join("gpu.json");
    std::fs::write(&gpu, r#"{"subtasks":[{"id":"a","pool":"gpu"}]}"#).expect("write");
    let out = flotilla(&["plan", "validate", gpu.to_str().expect("utf8")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).contains("[unknown_pool]"), "{}", stdout(&out));
    let out = flotilla(&["plan", "validate", "--offline", gpu.to_str().expect("utf8")]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "offline skips installation checks"
    );

    // Type errors hide nothing: each wrong field, and the plan's own problems (a cycle).
    let typed = dir.path().join("typed.json");
    std::fs::write(
        &typed,
        r#"{"subtasks":[{"id":"a","timeout":"banana","dependencies":["b"]},
                        {"id":"b","dependencies":["a"],"required":"no"}]}"#,
    )
    .expect("write");
    let out = flotilla(&[
        "plan",
        "validate",
        "--offline",
        "--json",
        typed.to_str().expect("utf8"),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json output");
    let found: Vec<(String, String)> = v["errors"]
        .as_array()
        .expect("errors")
        .iter()
        .map(|p| {
            (
                p["path"].as_str().unwrap_or_default().to_owned(),
                p["code"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    for want in [
        ("subtasks[0].timeout", "malformed"),
        ("subtasks[1].required", "malformed"),
    ] {
        assert!(
            found.contains(&(want.0.to_owned(), want.1.to_owned())),
            "{want:?} not in {found:?}"
        );
    }
    assert!(found.iter().any(|(_, c)| c == "cycle"), "{found:?}");

    let out = flotilla(&["plan", "validate", "does-not-exist.json"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does-not-exist.json"));
}

#[test]
fn schemas_are_current() {
    let out = flotilla(&["schema", "check"]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
}

#[tokio::test]
async fn provision_creates_then_reports_unchanged() -> anyhow::Result<()> {
    let server = NatsServer::start().await?;
    let url = server.url();
    // A dry run says what it would do, and does nothing.
    let dry = flotilla(&[
        "--nats-url",
        &url,
        "nats",
        "provision",
        "--dry-run",
        "--pools",
        "default",
    ]);
    assert_eq!(dry.status.code(), Some(0));
    let said = stdout(&dry);
    assert!(
        said.lines().all(|l| l.contains("would create")) && !said.contains("created"),
        "{said}"
    );
    assert!(said.contains("pool-default"), "{said}");
    let js = async_nats::jetstream::new(server.client().await?);
    assert!(js.get_stream("FLOTILLA_TASKS").await.is_err(), "{said}");
    let first = flotilla(&["--nats-url", &url, "nats", "provision"]);
    assert_eq!(
        first.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    assert!(stdout(&first).contains("FLOTILLA_TASKS"));
    assert!(stdout(&first).contains("created"));
    let second = flotilla(&["--nats-url", &url, "nats", "provision", "--json"]);
    assert_eq!(second.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&second.stdout)?;
    let resources = v["resources"].as_array().expect("resources");
    assert!(resources.iter().all(|r| r["action"] == "unchanged"), "{v}");
    Ok(())
}

#[tokio::test]
async fn provision_refuses_incompatible_streams() -> anyhow::Result<()> {
    let server = NatsServer::start().await?;
    let js = async_nats::jetstream::new(server.client().await?);
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "FLOTILLA_INTAKE".into(),
        subjects: vec!["flotilla.submit".into()],
        storage: async_nats::jetstream::stream::StorageType::Memory,
        ..Default::default()
    })
    .await?;
    let out = flotilla(&["--nats-url", &server.url(), "nats", "provision"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).contains("INCOMPATIBLE"), "{}", stdout(&out));
    assert!(stdout(&out).contains("storage"));
    // What it did not do is said as what it would do.
    assert!(
        stdout(&out).contains("FLOTILLA_TASKS           would create"),
        "{}",
        stdout(&out)
    );
    assert!(
        js.get_stream("FLOTILLA_TASKS").await.is_err(),
        "nothing else was created"
    );
    Ok(())
}

#[test]
fn bad_config_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("f.toml");
    std::fs::write(&cfg, "[nats]\nprefix = \"a.b\"\n").expect("write");
    let out = flotilla(&[
        "--config",
        cfg.to_str().expect("utf8"),
        "plan",
        "validate",
        "config/examples/plans/earnings.json",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("prefix"), "{err}");
}

#[test]
fn up_runs_the_earnings_example_end_to_end() {
    let data = tempfile::tempdir().expect("tempdir");
    let out = flotilla(&[
        "up",
        "--workers",
        "2",
        "--data-dir",
        data.path().to_str().expect("utf8"),
        "--submit",
        "config/examples/plans/earnings.json",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let report = stdout(&out);
    assert!(
        report.contains("ACME quarterly earnings report"),
        "{report}"
    );
    assert!(report.contains("Revenue growth: +6.7%"), "{report}");
    assert!(report.contains("Net margin: 9.1%"), "{report}");
    for task in ["fetch_data", "calc_growth", "calc_margin", "synthesis"] {
        assert!(
            stderr.contains(&format!("✓ {task} succeeded")),
            "{task}: {stderr}"
        );
    }
    // A run that went well ends without a warning: `up` stopping its own embedded server is
    // not a lost connection.
    assert!(
        !stderr.contains(" WARN ") && !stderr.contains(" ERROR "),
        "{stderr}"
    );
}

/// Outside the repository, with no configuration file, `up` says so before it starts and
/// what to do; the run then fails naming the missing agent and that the worker has none.
#[test]
fn up_without_a_configuration_says_it_has_no_agents() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["up", "--submit"])
        .arg(root().join("config/examples/plans/earnings.json"))
        .current_dir(dir.path())
        .env_remove("FLOTILLA_CONFIG")
        .output()
        .expect("the flotilla binary runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let first = stderr.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("warning: no configuration file found")
            && first.contains("--config FILE")
            && first.contains("unknown_agent"),
        "{stderr}"
    );
    assert!(
        stderr.contains("no agent named \"fetch_data\" (it has no agents"),
        "{stderr}"
    );
}

#[test]
fn up_runs_the_workflow_example_end_to_end() {
    let data = tempfile::tempdir().expect("tempdir");
    let out = flotilla(&[
        "--config",
        "config/examples/workflows.toml",
        "up",
        "--data-dir",
        data.path().to_str().expect("utf8"),
        "--submit",
        "config/examples/plans/editorial.json",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    // Research (nested parallel) → draft and critique (sequential) → polish (loop).
    let result: serde_json::Value = serde_json::from_str(stdout(&out).trim()).expect("json");
    assert_eq!(result["escalate"], true, "{result}");
    assert_eq!(
        result["text"],
        "A light, affordable dinghy in a market that grew 12% last year. It weighs 45 kg."
    );
}

mod against_services {
    //! Client commands against running `flotilla` services (a deterministic `scripted` agent).
    use super::*;

    const AGENTS: &str = r#"
default-agent = "echo"
[agents.echo]
kind = "scripted"
reply = "{task_id} done 42"
[agents.broken]
kind = "scripted"
fail-first = 99
"#;

    fn write_plan(dir: &Path, name: &str, json: serde_json::Value) -> String {
        let path = dir.join(name);
        std::fs::write(&path, serde_json::to_vec(&json).expect("json")).expect("write");
        path.to_str().expect("utf8").to_owned()
    }

    #[tokio::test]
    async fn submit_runs_and_workers_commands() -> anyhow::Result<()> {
        let mut p = support::Processes::start(AGENTS).await?;
        p.coordinator().await?;
        p.worker(&["--concurrency", "2"]).await?;
        let url = p.server.url();
        let dir = tempfile::tempdir()?;
        let good = write_plan(
            dir.path(),
            "good.json",
            serde_json::json!({
                "name": "cli-test",
                "subtasks": [{"id": "a"}, {"id": "b", "dependencies": ["a"]}]
            }),
        );
        let out = flotilla(&[
            "--nats-url",
            &url,
            "submit",
            &good,
            "--wait",
            "--json",
            "--label",
            "team=qa",
        ]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let outcome: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        assert_eq!(outcome["status"], "succeeded");
        assert_eq!(outcome["final_result"]["response"], "b done 42");
        let run = outcome["run_id"].as_str().expect("run id").to_owned();

        let out = flotilla(&["--nats-url", &url, "runs", "list", "--json"]);
        let list: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        assert!(
            list.as_array()
                .expect("array")
                .iter()
                .any(|r| r["handle"]["run_id"] == run)
        );

        let out = flotilla(&["--nats-url", &url, "runs", "show", &run]);
        let text = stdout(&out);
        assert!(
            text.contains("succeeded") && text.contains("team=qa") && text.contains("b done 42"),
            "{text}"
        );

        let out = flotilla(&["--nats-url", &url, "runs", "history", &run, "--json"]);
        let history: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let kinds: Vec<&str> = history
            .as_array()
            .expect("array")
            .iter()
            .filter_map(|e| e["entry"]["input"]["type"].as_str())
            .collect();
        assert_eq!(kinds, vec!["submitted", "task_result", "task_result"]);

        let out = flotilla(&["--nats-url", &url, "workers", "--json"]);
        let workers: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        assert_eq!(workers.as_array().map(Vec::len), Some(1));
        assert_eq!(workers[0]["worker"]["pool"], "default");
        assert!(
            workers[0]["last_seen_secs_ago"]
                .as_f64()
                .is_some_and(|s| s < 30.0)
        );

        // A failing run: exit 1, the reason on stderr.
        let bad = write_plan(
            dir.path(),
            "bad.json",
            serde_json::json!({
                "subtasks": [{"id": "x", "agent": "broken"}], "config": {"max_retries": 0}
            }),
        );
        let out = flotilla(&["--nats-url", &url, "submit", &bad, "--follow"]);
        assert_eq!(out.status.code(), Some(1));
        assert!(String::from_utf8_lossy(&out.stderr).contains("required task x failed"));

        // A rejected run: exit 1 with the problem.
        let cyclic = write_plan(
            dir.path(),
            "cyclic.json",
            serde_json::json!({
                "subtasks": [{"id": "a", "dependencies": ["b"]}, {"id": "b", "dependencies": ["a"]}]
            }),
        );
        let out = flotilla(&["--nats-url", &url, "submit", &cyclic, "--wait"]);
        assert_eq!(out.status.code(), Some(1));
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("cycle"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );

        // Unknown runs and bad ids are clear errors.
        let out = flotilla(&[
            "--nats-url",
            &url,
            "runs",
            "show",
            "0190f0c4-8a3e-7cc1-9a39-6f1c1b7d2e11",
        ]);
        assert_eq!(out.status.code(), Some(1));
        let out = flotilla(&["--nats-url", &url, "runs", "show", "not-a-uuid"]);
        assert_eq!(out.status.code(), Some(2));
        Ok(())
    }

    #[tokio::test]
    async fn submit_exit_codes_say_accepted_or_rejected() -> anyhow::Result<()> {
        let mut p = support::Processes::start(AGENTS).await?;
        p.coordinator().await?;
        p.worker(&["--concurrency", "2"]).await?;
        let url = p.server.url();
        let dir = tempfile::tempdir()?;
        // Rejected without --wait: exit 1, one problem per line.
        let bad = write_plan(
            dir.path(),
            "bad.json",
            serde_json::json!({
                "subtasks": [
                    {"id": "a", "dependencies": ["b"]}, {"id": "b", "dependencies": ["a"]},
                    {"id": "c", "dependencies": ["ghost"]}
                ]
            }),
        );
        let out = flotilla(&["--nats-url", &url, "submit", &bad]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        let problems: Vec<&str> = err
            .lines()
            .filter(|l| l.trim_start().starts_with("error"))
            .collect();
        assert_eq!(problems.len(), 2, "{err}");
        assert!(problems.iter().any(|l| l.contains("[cycle]")), "{err}");
        assert!(
            problems.iter().any(|l| l.contains("[unknown_dependency]")),
            "{err}"
        );
        // Accepted: exit 0, the run id on stdout.
        let good = write_plan(
            dir.path(),
            "good.json",
            serde_json::json!({"subtasks": [{"id": "a"}]}),
        );
        let out = flotilla(&["--nats-url", &url, "submit", &good]);
        assert_eq!(out.status.code(), Some(0));
        let run = stdout(&out).trim().to_owned();
        assert!(run.parse::<flotilla_model::RunId>().is_ok(), "{run}");

        // runs list: newest first by submission time, also for client-chosen UUIDv4 ids.
        let mut ids = Vec::new();
        for _ in 0..3 {
            let id = uuid::Uuid::new_v4().to_string();
            let out = flotilla(&[
                "--nats-url",
                &url,
                "submit",
                &good,
                "--run-id",
                &id,
                "--wait",
            ]);
            assert_eq!(out.status.code(), Some(0));
            ids.push(id);
        }
        let out = flotilla(&["--nats-url", &url, "runs", "list", "--json", "--limit", "3"]);
        let list: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let listed: Vec<String> = list
            .as_array()
            .expect("array")
            .iter()
            .map(|r| {
                r["handle"]["run_id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned()
            })
            .collect();
        ids.reverse();
        assert_eq!(listed, ids);
        // The STATUS column lines up under its header.
        let out = flotilla(&["--nats-url", &url, "runs", "list"]);
        let text = stdout(&out);
        let mut lines = text.lines();
        let header = lines.next().expect("header");
        let col = header.find("STATUS").expect("STATUS");
        for line in lines {
            assert!(
                ["succeeded", "rejected", "running"]
                    .iter()
                    .any(|s| line[col..].starts_with(s)),
                "{text}"
            );
        }

        // A plan over the deployment's message size: a clear plan_too_large.
        let huge = write_plan(
            dir.path(),
            "huge.json",
            serde_json::json!({
                "subtasks": (0..5_000).map(|i| serde_json::json!({
                    "id": format!("task_{i:0>6}"), "description": "x".repeat(300)
                })).collect::<Vec<_>>()
            }),
        );
        let out = flotilla(&["--nats-url", &url, "plan", "validate", &huge]);
        assert_eq!(out.status.code(), Some(1));
        assert!(
            stdout(&out).contains("[plan_too_large]"),
            "{}",
            stdout(&out)
        );
        let out = flotilla(&["plan", "validate", "--offline", &huge]);
        assert_eq!(out.status.code(), Some(1));
        assert!(
            stdout(&out).contains("[plan_too_large]"),
            "{}",
            stdout(&out)
        );
        let out = flotilla(&["--nats-url", &url, "submit", &huge]);
        assert_ne!(out.status.code(), Some(0));
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("plan_too_large"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );

        // An agent the deployment does not define is caught by plan validate (the coordinator
        // knows its catalog), and says it checked the deployment.
        let ghost = write_plan(
            dir.path(),
            "ghost.json",
            serde_json::json!({"subtasks": [{"id": "a", "agent": "ghost"}]}),
        );
        let out = flotilla(&["--nats-url", &url, "plan", "validate", "--json", &ghost]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        assert_eq!(v["checked"], "deployment");
        assert_eq!(v["errors"][0]["code"], "unknown_agent");
        // One field of the wrong type hides nothing: it is reported, and the rest of the plan
        // is still checked against the deployment, whose agents are not the local config's
        // (`broken` is the deployment's only, `ghost` nobody's).
        let typed = write_plan(
            dir.path(),
            "typed.json",
            serde_json::json!({"subtasks": [
                {"id": "a", "timeout": "banana"},
                {"id": "b", "agent": "ghost", "dependencies": ["a"]},
                {"id": "c", "agent": "broken"}
            ]}),
        );
        let out = flotilla(&["--nats-url", &url, "plan", "validate", "--json", &typed]);
        assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        assert_eq!(v["checked"], "deployment", "{v}");
        assert_eq!(v["subtasks"], 3, "{v}");
        let found: Vec<(&str, &str)> = v["errors"]
            .as_array()
            .expect("errors")
            .iter()
            .map(|p| {
                (
                    p["path"].as_str().unwrap_or_default(),
                    p["code"].as_str().unwrap_or_default(),
                )
            })
            .collect();
        assert_eq!(
            found,
            [
                ("subtasks[0].timeout", "malformed"),
                ("subtasks[1].agent", "unknown_agent")
            ],
            "{v}"
        );
        assert!(
            v["note"].as_str().is_some_and(|n| n.contains("left out")),
            "{v}"
        );

        // A pool nobody serves: the submission warns, runs show says what the tasks wait on.
        let gpu = write_plan(
            dir.path(),
            "gpu.json",
            serde_json::json!({"subtasks": [{"id": "a"}]}),
        );
        let out = flotilla(&["--nats-url", &url, "submit", &gpu]);
        assert_eq!(out.status.code(), Some(0));
        Ok(())
    }

    #[tokio::test]
    async fn cancel_and_waiting_pools_are_shown() -> anyhow::Result<()> {
        let mut p =
            support::Processes::start(&format!("pools = [\"default\", \"gpu\"]\n{AGENTS}")).await?;
        p.coordinator().await?;
        let url = p.server.url();
        let dir = tempfile::tempdir()?;
        let gpu = write_plan(
            dir.path(),
            "gpu.json",
            serde_json::json!({"subtasks": [{"id": "a", "pool": "gpu"}]}),
        );
        let out = flotilla(&["--nats-url", &url, "submit", &gpu]);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(0), "{err}");
        assert!(
            err.contains("no_live_worker") && err.contains("gpu"),
            "{err}"
        );
        let run = stdout(&out).trim().to_owned();
        let out = flotilla(&["--nats-url", &url, "runs", "show", &run]);
        let text = stdout(&out);
        assert!(text.contains("NO live worker serves this pool"), "{text}");
        let out = flotilla(&[
            "--nats-url",
            &url,
            "runs",
            "cancel",
            &run,
            "--reason",
            "no gpu today",
        ]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = flotilla(&["--nats-url", &url, "runs", "show", &run, "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        assert_eq!(v["record"]["status"], "cancelled");
        assert_eq!(v["record"]["outcome"]["reason"], "cancelled: no gpu today");
        // Cancelling an unknown run is a clear error.
        let out = flotilla(&[
            "--nats-url",
            &url,
            "runs",
            "cancel",
            "0190f0c4-8a3e-7cc1-9a39-6f1c1b7d2e11",
        ]);
        assert_eq!(out.status.code(), Some(1));
        assert!(String::from_utf8_lossy(&out.stderr).contains("not_found"));
        Ok(())
    }
}

#[test]
fn foreign_flotilla_variables_do_not_break_start_up() {
    // What Kubernetes injects for a Service named `flotilla`.
    let out = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args([
            "plan",
            "validate",
            "--offline",
            "config/examples/plans/earnings.json",
        ])
        .current_dir(root())
        .env_remove("FLOTILLA_CONFIG")
        .env("FLOTILLA_PORT", "tcp://10.0.0.1:4222")
        .env("FLOTILLA_PORT_4222_TCP", "tcp://10.0.0.1:4222")
        .env("FLOTILLA_SERVICE_HOST", "10.0.0.1")
        .env("FLOTILLA_RUN_ID", "not-config")
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(
        err.matches("Ignoring environment variables").count(),
        1,
        "{err}"
    );
    assert!(
        err.contains("FLOTILLA_PORT") && !err.contains("FLOTILLA_RUN_ID"),
        "{err}"
    );
    assert!(
        !err.contains('\u{1b}'),
        "no ANSI colours when stderr is not a terminal: {err:?}"
    );
}

#[tokio::test]
async fn nats_urls_from_the_environment_are_a_list() -> anyhow::Result<()> {
    let server = NatsServer::start().await?;
    server.provisioned_bus().await?;
    let urls = format!("nats://127.0.0.1:1,{}", server.url());
    let out = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["workers", "--json"])
        .current_dir(root())
        .env_remove("FLOTILLA_CONFIG")
        .env("FLOTILLA_NATS__URLS", &urls)
        .output()?;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[tokio::test]
async fn submitting_before_provisioning_says_what_to_do() -> anyhow::Result<()> {
    let server = NatsServer::start().await?;
    let out = flotilla(&[
        "--nats-url",
        &server.url(),
        "submit",
        "config/examples/plans/earnings.json",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("flotilla nats provision"), "{err}");
    Ok(())
}

#[test]
fn up_publishes_its_url_for_commands_in_the_same_directory() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut up = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        // No HTTP listener: port 9464 may be taken by another service on the machine.
        .args(["up", "--workers", "1", "--http-addr", "off"])
        .current_dir(dir.path())
        .env_remove("FLOTILLA_CONFIG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let url_file = dir.path().join(".flotilla/nats-url");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !url_file.exists() {
        if std::time::Instant::now() > deadline {
            let _ = up.kill();
            anyhow::bail!("flotilla up never wrote {}", url_file.display());
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // `runs list` in the same directory, with no --nats-url and no config, finds it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let out = Command::new(env!("CARGO_BIN_EXE_flotilla"))
            .args(["runs", "list"])
            .current_dir(dir.path())
            .env_remove("FLOTILLA_CONFIG")
            .output()?;
        if out.status.success() {
            break;
        }
        if std::time::Instant::now() > deadline {
            let _ = up.kill();
            anyhow::bail!("runs list failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(up.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )?;
    up.wait()?;
    assert!(!url_file.exists(), "removed when up stops");
    Ok(())
}

/// `up --nats-port` and `--console-listen` put the embedded server and the console on the
/// ports asked for; `--nats-port` with `--nats-url` (no embedded server) is refused.
#[test]
fn up_listens_where_it_is_told() -> anyhow::Result<()> {
    let free = || -> anyhow::Result<u16> {
        Ok(std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port())
    };
    let (nats, console) = (free()?, free()?);
    let dir = tempfile::tempdir()?;
    let up = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["up", "--workers", "1", "--http-addr", "off"])
        .args(["--nats-port", &nats.to_string()])
        .args(["--console-listen", &format!("127.0.0.1:{console}")])
        .current_dir(dir.path())
        .env_remove("FLOTILLA_CONFIG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let url_file = dir.path().join(".flotilla/nats-url");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    // `up` writes its URL file before the console listens; waiting for both keeps another
    // process that briefly holds the console's port (the ports were free a moment ago, not
    // reserved) from reading as the console.
    let (mut answered, mut url) = (false, String::new());
    while std::time::Instant::now() < deadline && (url.is_empty() || !answered) {
        std::thread::sleep(std::time::Duration::from_millis(100));
        if url.is_empty() {
            url = std::fs::read_to_string(&url_file).unwrap_or_default();
        } else {
            answered = std::net::TcpStream::connect(("127.0.0.1", console)).is_ok();
        }
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(up.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )?;
    let out = up.wait_with_output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        url.lines().next().unwrap_or_default(),
        format!("nats://127.0.0.1:{nats}"),
        "{err}"
    );
    assert!(answered, "no console on port {console}: {err}");
    // The NATS client's own info lines (connected, an IO error at shutdown) are not shown,
    // nor each in-process service's "Connected to NATS": `up` names its server once.
    assert!(!err.contains("async_nats"), "{err}");
    assert!(!err.contains("Connected to NATS"), "{err}");
    assert_eq!(
        err.matches(&format!("nats://127.0.0.1:{nats}")).count(),
        2,
        "the embedded server's line names it (and where else to use it): {err}"
    );
    assert!(
        err.contains(&format!("Console: http://127.0.0.1:{console}/")),
        "{err}"
    );

    let refused = flotilla(&[
        "--nats-url",
        "nats://127.0.0.1:4222",
        "up",
        "--nats-port",
        "4333",
    ]);
    assert_eq!(refused.status.code(), Some(2));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains("--nats-port") && err.contains("--nats-url"),
        "{err}"
    );
    Ok(())
}

mod first_use {
    //! What a new user meets first: a reader that goes away, a run that does not exist,
    //! errors that say their cause once and what to do, and `up` against a NATS another
    //! deployment uses.
    use std::process::Stdio;
    use std::time::{Duration, Instant};

    use flotilla_model::RunId;
    use flotilla_model::plan::Subtask;
    use flotilla_model::submit::SubmitRequest;

    use super::*;

    const ECHO: &str = r#"
default-agent = "echo"
[agents.echo]
kind = "scripted"
reply = "{task_id} done"
"#;

    /// `flotilla <args>` from the repository root, run to the end within `limit` (killed and
    /// failed otherwise: a command that hangs is the bug some of these tests catch).
    fn run_within(args: &[&str], stdout: Stdio, limit: Duration) -> anyhow::Result<Output> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_flotilla"))
            .args(args)
            .current_dir(root())
            .env_remove("FLOTILLA_CONFIG")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(Stdio::piped())
            .spawn()?;
        let deadline = Instant::now() + limit;
        while child.try_wait()?.is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                let out = child.wait_with_output()?;
                anyhow::bail!(
                    "`flotilla {}` still ran after {limit:?}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(child.wait_with_output()?)
    }

    fn stderr(o: &Output) -> String {
        String::from_utf8_lossy(&o.stderr).into_owned()
    }

    /// `flotilla runs list | head -1` and friends: a closed stdout ends every command that
    /// prints quietly (exit 0, nothing on stderr) instead of a panic (exit 101). The pipe's
    /// read end is closed before the command starts, so its first line already fails.
    #[tokio::test]
    async fn a_closed_stdout_ends_printing_commands_quietly() -> anyhow::Result<()> {
        let mut p = support::Processes::start(ECHO).await?;
        p.coordinator().await?;
        p.worker(&[]).await?;
        let run = p
            .client
            .submit(SubmitRequest::new(support::plan(vec![Subtask::new(
                "t", "one",
            )])))
            .await?;
        p.client.wait(run, support::WAIT).await?;
        let (run, url) = (run.to_string(), p.server.url());
        let commands: Vec<Vec<&str>> = vec![
            vec!["runs", "list"],
            vec!["runs", "list", "--json"],
            vec!["runs", "show", &run],
            vec!["runs", "history", &run],
            vec!["runs", "tree", &run],
            vec!["watch", &run],
            vec!["watch", &run, "--json"],
            vec!["watch", &run, "--server"],
            vec!["workers"],
            vec!["ws", "read-all", "--run", &run],
            vec!["plan", "validate", "config/examples/plans/earnings.json"],
        ];
        for args in commands {
            let (reader, writer) = std::io::pipe()?;
            drop(reader);
            let mut all = vec!["--nats-url", url.as_str()];
            all.extend_from_slice(&args);
            let out = run_within(&all, Stdio::from(writer), Duration::from_secs(30))?;
            let err = stderr(&out);
            assert_eq!(out.status.code(), Some(0), "{args:?}: {err}");
            assert!(
                !err.contains("panicked") && !err.contains("Broken pipe"),
                "{args:?}: {err}"
            );
        }
        Ok(())
    }

    /// `flotilla watch <unknown run>` says `not_found` (exit 1), locally as with `--server`,
    /// instead of waiting forever.
    #[tokio::test]
    async fn watching_an_unknown_run_says_not_found() -> anyhow::Result<()> {
        let mut p = support::Processes::start(ECHO).await?;
        p.coordinator().await?;
        let (ghost, url) = (RunId::new().to_string(), p.server.url());
        for extra in [None, Some("--server"), Some("--json")] {
            let mut args = vec!["--nats-url", url.as_str(), "watch", ghost.as_str()];
            args.extend(extra);
            let out = run_within(&args, Stdio::piped(), Duration::from_secs(20))?;
            let err = stderr(&out);
            assert_eq!(out.status.code(), Some(1), "{extra:?}: {err}");
            assert!(
                err.contains(&format!("not_found: run {ghost} does not exist")),
                "{extra:?}: {err}"
            );
            assert!(out.stdout.is_empty(), "{extra:?}");
        }
        Ok(())
    }

    /// Whether `message` says some part twice (`no responders: no responders`).
    fn repeats(message: &str) -> Option<&str> {
        let parts: Vec<&str> = message.split([':', ';']).map(str::trim).collect();
        parts
            .iter()
            .enumerate()
            .find(|(i, p)| p.len() > 3 && parts[..*i].contains(p))
            .map(|(_, p)| *p)
    }

    /// An error is one line: the cause once, then what to do — for a NATS that is not
    /// there, one nobody provisioned, and a deployment without a coordinator.
    #[tokio::test]
    async fn errors_say_their_cause_once_and_what_to_do() -> anyhow::Result<()> {
        let bare = NatsServer::start().await?;
        let provisioned = NatsServer::start().await?;
        provisioned.provisioned_bus().await?;
        let (bare, provisioned) = (bare.url(), provisioned.url());
        let ghost = RunId::new().to_string();
        let plan = "config/examples/plans/earnings.json";
        let cases: Vec<(Vec<&str>, &[&str])> = vec![
            (
                vec!["--nats-url", "nats://127.0.0.1:1", "runs", "list"],
                &[
                    "NATS server unreachable",
                    "nats://127.0.0.1:1",
                    "`flotilla up`",
                ],
            ),
            (
                vec!["--nats-url", &bare, "runs", "list"],
                &["`flotilla coordinator`", "`flotilla nats provision`"],
            ),
            (
                vec!["--nats-url", &bare, "submit", plan],
                &["`flotilla coordinator`", "`flotilla nats provision`"],
            ),
            (
                vec!["--nats-url", &bare, "watch", &ghost],
                &["`flotilla coordinator`", "`flotilla nats provision`"],
            ),
            (
                vec!["--nats-url", &bare, "workers"],
                &["`flotilla coordinator`", "`flotilla nats provision`"],
            ),
            (
                vec!["--nats-url", &provisioned, "runs", "cancel", &ghost],
                &[
                    "flotilla.api.run.cancel",
                    "start `flotilla coordinator` or `flotilla up`",
                ],
            ),
            (
                vec!["--nats-url", &provisioned, "watch", &ghost, "--server"],
                &[
                    "flotilla.api.watch",
                    "start `flotilla coordinator` or `flotilla up`",
                ],
            ),
        ];
        for (args, says) in cases {
            let out = run_within(&args, Stdio::piped(), Duration::from_secs(30))?;
            let err = stderr(&out);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
            let lines: Vec<&str> = err.lines().collect();
            assert_eq!(lines.len(), 1, "{args:?}: one line: {err}");
            assert!(lines[0].starts_with("error: "), "{args:?}: {err}");
            assert_eq!(repeats(lines[0]), None, "{args:?}: said twice: {err}");
            for s in says {
                assert!(lines[0].contains(s), "{args:?}: {s}: {err}");
            }
        }
        Ok(())
    }

    /// With no `--by`, no `$USER` or `$LOGNAME`, and a user id the system has no name for (a
    /// container's), a decision asks for `--by` (exit 2) instead of sending an answer by
    /// nobody. It runs the command as uid 65532 through `setpriv`, so it needs the tests to
    /// run as root (CI does); elsewhere it says so and passes.
    #[tokio::test]
    async fn a_decision_with_nobody_to_name_asks_for_by() -> anyhow::Result<()> {
        const NAMELESS: u32 = 65532;
        if !nix::unistd::getuid().is_root()
            || Command::new("setpriv").arg("--version").output().is_err()
            || nix::unistd::User::from_uid(NAMELESS.into())?.is_some()
        {
            eprintln!("skipped: needs root, setpriv and a uid {NAMELESS} without a name");
            return Ok(());
        }
        let server = NatsServer::start().await?;
        server.provisioned_bus().await?;
        // A copy of the binary that uid can run, whatever the checkout's permissions.
        let dir = tempfile::tempdir()?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        let bin = dir.path().join("flotilla");
        std::fs::copy(env!("CARGO_BIN_EXE_flotilla"), &bin)?;
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755))?;
        let run = RunId::new().to_string();
        let id = NAMELESS.to_string();
        let out = Command::new("setpriv")
            .args(["--reuid", &id, "--regid", &id, "--clear-groups"])
            .arg(&bin)
            .args([
                "--nats-url",
                &server.url(),
                "approvals",
                "approve",
                &run,
                "t0a1",
            ])
            .env_remove("USER")
            .env_remove("LOGNAME")
            .env_remove("FLOTILLA_CONFIG")
            .current_dir("/")
            .stdin(Stdio::null())
            .output()?;
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            err.starts_with("error: who decides is unknown: pass --by NAME")
                && err.contains(&format!("user id {NAMELESS} has no name")),
            "{err}"
        );
        Ok(())
    }

    /// The collaboration commands answer in JSON, and an unreachable NATS exits 2 there too
    /// (nothing was asked, nothing changed), with code `unavailable` naming the URL.
    #[test]
    fn collaboration_commands_exit_2_when_nats_is_unreachable() -> anyhow::Result<()> {
        let run = RunId::new().to_string();
        for args in [
            vec!["ws", "read", "--run", &run, "notes"],
            vec!["state", "get", "--run", &run, "key"],
            vec!["mbox", "read", "--run", &run],
        ] {
            let mut all = vec!["--nats-url", "nats://127.0.0.1:1"];
            all.extend(args.iter().copied());
            let out = run_within(&all, Stdio::piped(), Duration::from_secs(30))?;
            let err = stderr(&out);
            assert_eq!(out.status.code(), Some(2), "{all:?}: {err}");
            let error: serde_json::Value = serde_json::from_str(err.trim())?;
            assert_eq!(error["error"]["code"], "unavailable", "{all:?}: {err}");
            let message = error["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains("nats://127.0.0.1:1"), "{all:?}: {err}");
        }
        Ok(())
    }

    /// `up --nats-url` against a NATS whose prefix another deployment serves stops before it
    /// provisions or submits anything, naming the other deployment's fingerprint and what to
    /// do; with the same configuration it is the same deployment and runs.
    #[tokio::test]
    async fn up_refuses_a_prefix_another_deployment_serves() -> anyhow::Result<()> {
        let mut p = support::Processes::start(ECHO).await?;
        p.coordinator().await?;
        let url = p.server.url();
        let info = p
            .bus
            .client()
            .request("$SRV.INFO.flotilla", "".into())
            .await?;
        let info: serde_json::Value = serde_json::from_slice(&info.payload)?;
        let theirs = info["metadata"]["fingerprint"]
            .as_str()
            .ok_or_else(|| anyhow::anyhow!("no fingerprint advertised: {info}"))?
            .to_owned();
        assert_eq!(theirs.len(), 12, "{info}");

        // The shipped configuration is another deployment's.
        let data = tempfile::tempdir()?;
        let data_dir = data.path().to_str().expect("utf8");
        let out = run_within(
            &[
                "--nats-url",
                &url,
                "up",
                "--workers",
                "1",
                "--data-dir",
                data_dir,
                "--submit",
                "config/examples/plans/earnings.json",
            ],
            Stdio::piped(),
            Duration::from_secs(60),
        )?;
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        for s in [
            "another deployment already serves prefix `flotilla`",
            &format!("fingerprint {theirs}"),
            "FLOTILLA_NATS__PREFIX",
        ] {
            assert!(err.contains(s), "{s}: {err}");
        }
        assert!(!err.contains("✓"), "nothing ran: {err}");
        let list = p.cli(&["runs", "list", "--json"])?;
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&list.stdout)?,
            serde_json::json!([]),
            "nothing was submitted"
        );

        // The same configuration: the same deployment, so `up` runs its plan.
        let plan = data.path().join("one.json");
        std::fs::write(&plan, r#"{"subtasks": [{"id": "t"}]}"#)?;
        let config = p.config.to_str().expect("utf8").to_owned();
        let out = run_within(
            &[
                "--config",
                &config,
                "--nats-url",
                &url,
                "up",
                "--workers",
                "1",
                "--data-dir",
                data_dir,
                "--submit",
                plan.to_str().expect("utf8"),
            ],
            Stdio::piped(),
            Duration::from_secs(60),
        )?;
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        Ok(())
    }
}
