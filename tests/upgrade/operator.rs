//! An operator's work through the `flotilla` CLI of either build — the old client against
//! new services, the new client against old ones: submit and wait, runs show and tree,
//! approvals, pause and resume, teammates, workspace, mailbox and session state.

use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::ids::{RunId, SessionId};
use flotilla_model::plan::{Plan, Subtask};
use flotilla_model::run::RunStatus;
use flotilla_model::teammate::{TeamMatesRequest, TeammateStatus};
use serde_json::{Value, json};

use crate::mixed::{ASK, Mixed, Version, gate, plan_named, until};
use crate::support;

impl Mixed {
    /// `flotilla <args>` of `version`, to the end: exit code, stdout, stderr.
    pub(crate) fn cli(
        &self,
        version: Version,
        args: &[&str],
    ) -> anyhow::Result<(Option<i32>, String, String)> {
        let out = self.p.cli_of(&self.bin(version), args)?;
        Ok((
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ))
    }

    /// As [`Mixed::cli`], which must exit 0; its stdout.
    pub(crate) fn cli_ok(&self, version: Version, args: &[&str]) -> anyhow::Result<String> {
        let (code, out, err) = self.cli(version, args)?;
        ensure!(
            code == Some(0),
            "{} flotilla {}: exit {code:?}\nstdout: {out}\nstderr: {err}",
            version.name(),
            args.join(" ")
        );
        Ok(out)
    }

    /// As [`Mixed::cli_ok`], its stdout as JSON.
    pub(crate) fn cli_json(&self, version: Version, args: &[&str]) -> anyhow::Result<Value> {
        let out = self.cli_ok(version, args)?;
        serde_json::from_str(&out)
            .with_context(|| format!("flotilla {}: not JSON: {out}", args.join(" ")))
    }

    /// Writes `plan` where the CLI can read it.
    pub(crate) fn plan_file(&self, plan: &Plan) -> anyhow::Result<String> {
        self.ops_file(
            &format!("{}.json", plan.name.as_deref().unwrap_or("plan")),
            &serde_json::to_string_pretty(plan)?,
        )
    }

    pub(crate) fn ops_file(&self, name: &str, text: &str) -> anyhow::Result<String> {
        let path = self.p.dir().join(format!("ops-{}-{name}", self.ops));
        std::fs::write(&path, text)?;
        Ok(path.display().to_string())
    }

    /// `flotilla submit PLAN` of `version`: the run id it printed, recorded with the status
    /// it must end in.
    pub(crate) fn submit(
        &mut self,
        version: Version,
        plan: &Plan,
        extra: &[&str],
        want: RunStatus,
    ) -> anyhow::Result<RunId> {
        let file = self.plan_file(plan)?;
        let mut args = vec!["submit", file.as_str()];
        args.extend_from_slice(extra);
        let out = self.cli_ok(version, &args)?;
        let run: RunId = out
            .trim()
            .parse()
            .map_err(|e| anyhow::anyhow!("submit printed {out:?}: {e}"))?;
        self.ledger
            .push((run, plan.name.clone().unwrap_or_default(), want));
        Ok(run)
    }

    /// The run's status as `flotilla runs show RUN --json` of `version` reads it.
    pub(crate) fn status(&self, version: Version, run: RunId) -> anyhow::Result<RunStatus> {
        let view = self.cli_json(version, &["runs", "show", &run.to_string(), "--json"])?;
        Ok(serde_json::from_value(
            view.pointer("/record/status")
                .cloned()
                .unwrap_or(Value::Null),
        )?)
    }

    /// Waits until `flotilla runs show` of `version` says `run` is `want`.
    pub(crate) async fn status_becomes(
        &self,
        version: Version,
        run: RunId,
        want: RunStatus,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let now = self.status(version, run)?;
            if now == want {
                return Ok(());
            }
            ensure!(
                !now.is_terminal() && Instant::now() < deadline,
                "run {run} is {now:?}, not {want:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until `flotilla approvals list --run RUN` of `version` lists `t0a1`.
    pub(crate) async fn asked(&self, version: Version, run: RunId) -> anyhow::Result<Value> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let list = self.cli_json(
                version,
                &["approvals", "list", "--run", &run.to_string(), "--json"],
            )?;
            if let Some(a) = list
                .pointer("/approvals")
                .and_then(Value::as_array)
                .and_then(|a| {
                    a.iter()
                        .find(|a| a.pointer("/request/approval_id") == Some(&json!("t0a1")))
                })
            {
                return Ok(a.clone());
            }
            ensure!(
                Instant::now() < deadline,
                "run {run}'s approval was never listed"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// An operator's work through the `flotilla` CLI of `version`: a DAG submitted and
    /// waited for, with workspace, mailbox and session state; a failing run; a workflow with
    /// its tree; approvals approved and rejected, and a second answer refused; a run paused
    /// and resumed; a teammate spawned and messaged.
    pub(crate) async fn operate(&mut self, v: Version) -> anyhow::Result<()> {
        self.ops += 1;
        let started = Instant::now();
        // A DAG in a session, waited for through its events.
        let session = SessionId::new().to_string();
        let mut dag = plan_named(
            "ops-dag",
            vec![
                Subtask::new("a", "first"),
                Subtask::new("b", "left").after(&["a"]),
                Subtask::new("c", "right").after(&["a"]),
            ],
            3600,
        );
        dag.subtasks[1].role = Some("analyst".into());
        let file = self.plan_file(&dag)?;
        let outcome = self.cli_json(
            v,
            &["submit", &file, "--wait", "--json", "--session", &session],
        )?;
        ensure!(
            outcome.pointer("/status") == Some(&json!("succeeded")),
            "the DAG ended {outcome}"
        );
        let run: RunId =
            serde_json::from_value(outcome.pointer("/run_id").cloned().unwrap_or(Value::Null))
                .with_context(|| format!("the DAG's outcome names no run: {outcome}"))?;
        self.ledger
            .push((run, "ops-dag".into(), RunStatus::Succeeded));
        let r = run.to_string();
        let tree = self.cli_json(v, &["runs", "tree", &r, "--json"])?;
        ensure!(tree.pointer("/runs").is_some(), "runs tree: {tree}");
        // Collaboration on it.
        self.cli_ok(v, &["ws", "write", "--run", &r, "notes", r#"{"n":1}"#])?;
        let page = self.cli_json(v, &["ws", "read", "--run", &r, "notes"])?;
        ensure!(
            page.pointer("/entries/0/entry/n") == Some(&json!(1)),
            "ws read: {page}"
        );
        self.cli_ok(
            v,
            &[
                "mbox",
                "send",
                "--run",
                &r,
                "--as",
                "ops",
                "b",
                r#"{"hint":1}"#,
            ],
        )?;
        let inbox = self.cli_json(v, &["mbox", "read", "--run", &r, "--as", "b"])?;
        ensure!(
            inbox.to_string().contains(r#""hint":1"#),
            "mbox read: {inbox}"
        );
        self.cli_ok(v, &["state", "set", "--run", &r, "plan", r#"{"step":2}"#])?;
        let value = self.cli_json(v, &["state", "get", "--run", &r, "plan"])?;
        ensure!(
            value.pointer("/value/step") == Some(&json!(2)),
            "state get: {value}"
        );
        // A failing run: exit 1, `failed`.
        let mut failing = plan_named(
            "ops-failed",
            vec![Subtask::new("x", "fails").with_agent("broken")],
            3600,
        );
        failing.config.max_retries = 0;
        let file = self.plan_file(&failing)?;
        let (code, out, err) = self.cli(v, &["submit", &file, "--wait", "--json"])?;
        let outcome: Value = serde_json::from_str(&out)
            .with_context(|| format!("submit --wait of a failing run: {out}\n{err}"))?;
        ensure!(
            code == Some(1) && outcome.pointer("/status") == Some(&json!("failed")),
            "the failing run: exit {code:?}, {outcome}"
        );
        let failed: RunId =
            serde_json::from_value(outcome.pointer("/run_id").cloned().unwrap_or(Value::Null))?;
        self.ledger
            .push((failed, "ops-failed".into(), RunStatus::Failed));
        // A workflow with its child runs.
        let workflow = self.submit(
            v,
            &plan_named(
                "ops-workflow",
                vec![Subtask::new("main", "the launch plan").with_agent("review")],
                3600,
            ),
            &[],
            RunStatus::Succeeded,
        )?;
        // Approvals: one approved, one rejected; a second answer is refused.
        let approved = self.submit(
            v,
            &plan_named(
                "ops-approved",
                vec![gate(), Subtask::new("after", "announce").after(&["gate"])],
                3600,
            ),
            &[],
            RunStatus::Succeeded,
        )?;
        let rejected = self.submit(
            v,
            &plan_named("ops-rejected", vec![gate()], 3600),
            &[],
            RunStatus::Failed,
        )?;
        self.asked(v, approved).await?;
        self.asked(v, rejected).await?;
        let said = self.cli_ok(
            v,
            &[
                "approvals",
                "approve",
                &approved.to_string(),
                "t0a1",
                "--by",
                "ops",
                "--comment",
                "looked at it",
            ],
        )?;
        ensure!(said.starts_with("decided"), "approve: {said}");
        let said = self.cli_ok(
            v,
            &[
                "approvals",
                "reject",
                &rejected.to_string(),
                "t0a1",
                "--by",
                "ops",
                "--message",
                "not now",
            ],
        )?;
        ensure!(said.starts_with("decided"), "reject: {said}");
        let (_, again, err) = self.cli(
            v,
            &[
                "approvals",
                "reject",
                &approved.to_string(),
                "t0a1",
                "--by",
                "someone-else",
            ],
        )?;
        // Told on stdout with exit 0 by 0.1.0; on stderr with exit 1 since 0.2.0.
        let told = format!("{again}{err}");
        ensure!(
            told.contains("already_decided") && told.contains("approve"),
            "a second answer was not refused as already_decided: {told}"
        );
        // A run paused while its first task runs, then resumed.
        let paused = self.submit(
            v,
            &plan_named(
                "ops-paused",
                vec![
                    Subtask::new("first", "slowly").with_agent("slow"),
                    Subtask::new("second", "then").after(&["first"]),
                ],
                3600,
            ),
            &[],
            RunStatus::Succeeded,
        )?;
        support::task_started(&self.p.client, paused, "first").await?;
        let p = paused.to_string();
        self.cli_ok(
            v,
            &["runs", "pause", &p, "--for", "1h", "--reason", "upgrade"],
        )?;
        self.status_becomes(v, paused, RunStatus::Paused).await?;
        self.cli_ok(v, &["runs", "resume", &p, "--reason", "upgraded"])?;
        // A teammate spawned and woken by a message.
        let team = format!("ops-{}-{}", v.name(), self.ops);
        self.cli_ok(
            v,
            &[
                "team",
                "spawn",
                "dee",
                "--role",
                "analyst",
                "--instructions",
                "answer briefly",
                "--agent",
                "echo",
                "--team",
                &team,
            ],
        )?;
        self.cli_ok(
            v,
            &[
                "team", "send", "dee", "hello", "--team", &team, "--from", "ops",
            ],
        )?;
        let client = self.p.client.clone();
        until("the spawned teammate's turn", || async {
            let mates = client
                .request(
                    &TeamMatesRequest {
                        protocol: PROTOCOL_VERSION,
                        team: Some(team.clone()),
                    },
                    ASK,
                )
                .await?;
            Ok(mates
                .teammates
                .iter()
                .any(|m| m.name == "dee" && m.status == TeammateStatus::Idle && m.turns == 1))
        })
        .await?;
        for (run, want) in [
            (workflow, RunStatus::Succeeded),
            (approved, RunStatus::Succeeded),
            (rejected, RunStatus::Failed),
            (paused, RunStatus::Succeeded),
        ] {
            self.status_becomes(v, run, want).await?;
        }
        let tree = self.cli_json(v, &["runs", "tree", &workflow.to_string(), "--json"])?;
        ensure!(
            tree.pointer("/runs").and_then(Value::as_u64) >= Some(3),
            "the workflow's tree lacks its child runs: {tree}"
        );
        eprintln!(
            "the {} CLI's work against {}: {:?}",
            v.name(),
            self.mix(),
            started.elapsed()
        );
        Ok(())
    }
}
