//! Anycast to a role, across processes on a real nats-server: a subtask that names a `role`
//! and no `agent` is claimed by exactly one free member of the role — two workers hosting a
//! member share a role's tasks and each attempt runs once; with no member online the task
//! waits in its role's queue until one starts; the wait is bounded (`role_unclaimed`, the
//! queued message withdrawn); a role no member has is refused (`unknown_role`) by `flotilla
//! plan validate` and at submission, changing nothing; pool tasks run as before, and in a
//! deployment without roles a role still only names a prompt.
//!
//! The members are deterministic agents (an `exec` agent logging each execution, the
//! `scripted` agent): they exercise the machinery, not a model.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use flotilla_coordinator::store::RunStore;
use flotilla_model::event::{Event, WorkflowPhase};
use flotilla_model::plan::{PlanConfig, Subtask};
use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::runlog::RunInput;
use flotilla_model::submit::{SubmitRequest, SubmitStatus};
use flotilla_model::task::TaskErrorKind;
use flotilla_model::time::Secs;
use flotilla_model::validate::ProblemCode;
use futures::{StreamExt, TryStreamExt};
use support::*;

/// The deployment: `echo` (the default agent, for pool tasks) and `analyst`, the one member
/// of role `research`, which logs every execution to `log`.
fn config(log: &ExecutionLog) -> String {
    format!(
        r#"
default-agent = "echo"
[agents.echo]
kind = "scripted"
reply = "{{task_id}} by echo"

[agents.analyst]
kind = "exec"
command = "sh"
args = ["-c", "echo $FLOTILLA_TASK_ID >> {}; sleep 0.05; echo $FLOTILLA_TASK_ID by analyst"]
roles = ["research"]
description = "Researches one question"
"#,
        log.path().display()
    )
}

/// A config for a worker that hosts the same agents but no member of any role (another
/// pool's config, as the Helm chart gives each pool its own).
fn without_roles(p: &Processes) -> anyhow::Result<std::path::PathBuf> {
    let text = std::fs::read_to_string(&p.config)?;
    let path = p.dir().join("no-roles.toml");
    std::fs::write(
        &path,
        text.lines()
            .filter(|l| !l.starts_with("roles ="))
            .collect::<Vec<_>>()
            .join("\n"),
    )?;
    Ok(path)
}

fn role_task(id: &str, role: &str) -> Subtask {
    let mut t = Subtask::new(id, "research one thing");
    t.role = Some(role.into());
    t
}

/// Messages waiting on `run`'s role queue subjects.
async fn queued_role_tasks(p: &Processes, run: flotilla_model::RunId) -> anyhow::Result<usize> {
    let names = p.bus.names();
    let stream = p
        .bus
        .js()
        .get_stream(names.stream(flotilla_model::subjects::StreamKind::Tasks))
        .await?;
    let counts: Vec<(String, usize)> = stream
        .info_with_subjects(names.role_run_filter(run))
        .await?
        .try_collect()
        .await?;
    Ok(counts.into_iter().map(|(_, n)| n).sum())
}

/// The run's log entries, by kind.
async fn history(
    p: &Processes,
    run: flotilla_model::RunId,
) -> anyhow::Result<Vec<flotilla_model::runlog::RunLogEntry>> {
    let store = RunStore::open(&p.bus).await?;
    Ok(store
        .history(run)
        .await?
        .into_iter()
        .map(|(_, _, e)| e)
        .collect())
}

fn warnings(p: &Processes, processes: usize) -> String {
    (0..processes)
        .flat_map(|k| {
            p.log(k)
                .lines()
                .filter(|l| l.contains("WARN") || l.contains("ERROR"))
                .map(|l| format!("p{k}: {l}"))
                .collect::<Vec<_>>()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test]
async fn two_members_share_a_roles_tasks_and_each_attempt_runs_once() -> anyhow::Result<()> {
    let log = ExecutionLog::new()?;
    let mut p = Processes::start(&config(&log)).await?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "4"]).await?;
    p.worker(&["--concurrency", "4"]).await?;
    let mut tasks: Vec<Subtask> = (0..40)
        .map(|i| role_task(&format!("r{i}"), "research"))
        .collect();
    // A pool task beside them, and one that depends on a role task.
    tasks.push(Subtask::new("pooled", "summarise").after(&["r0", "r1"]));
    let run = p.client.submit(SubmitRequest::new(plan(tasks))).await?;
    let outcome = p
        .client
        .wait(run, WAIT)
        .await
        .map_err(|e| anyhow::anyhow!("{e}\nwarnings:\n{}", warnings(&p, 3)))?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");

    // Each role task ran exactly once, by the member of the role.
    let mut runs: BTreeMap<String, usize> = BTreeMap::new();
    for id in log.executions()? {
        *runs.entry(id).or_default() += 1;
    }
    assert_eq!(runs.len(), 40, "{runs:?}");
    assert!(runs.values().all(|&n| n == 1), "{runs:?}");

    // On the run log: one claim and one result per role task, naming the member; the pool
    // task was claimed by nobody and its result names no agent.
    let mut claims: BTreeMap<String, usize> = BTreeMap::new();
    let mut workers = std::collections::BTreeSet::new();
    for e in history(&p, run).await? {
        match e.input {
            RunInput::Claimed(c) => {
                assert_eq!(
                    (c.agent.as_str(), c.role.as_str(), c.attempt),
                    ("analyst", "research", 1)
                );
                *claims.entry(c.task_id.to_string()).or_default() += 1;
            }
            RunInput::TaskResult(r) if r.task_id.as_str() == "pooled" => {
                assert_eq!(r.agent, None);
                assert!(r.result.success);
                assert_eq!(r.result.response, "pooled by echo");
            }
            RunInput::TaskResult(r) => {
                assert_eq!(r.agent.as_deref(), Some("analyst"));
                assert_eq!(
                    r.result.response.trim(),
                    format!("{} by analyst", r.task_id)
                );
                workers.insert(r.worker);
            }
            _ => {}
        }
    }
    assert_eq!(claims.len(), 40, "{claims:?}");
    assert!(claims.values().all(|&n| n == 1), "{claims:?}");
    assert_eq!(workers.len(), 2, "both members took some: {workers:?}");

    // The events name the member and the role.
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    let mut started = 0;
    let mut succeeded = 0;
    tokio::time::timeout(WAIT, async {
        while let Some(e) = events.next().await {
            let e = e?;
            let (Event::Workflow(w), Some(task)) = (&e.event, &e.task_id) else {
                if matches!(&e.event, Event::Workflow(w) if w.phase == WorkflowPhase::RunSucceeded)
                {
                    break;
                }
                continue;
            };
            let expected = if task.as_str() == "pooled" {
                (Some("echo"), None)
            } else {
                (Some("analyst"), Some("research"))
            };
            match w.phase {
                WorkflowPhase::TaskStarted => started += 1,
                WorkflowPhase::TaskSucceeded => succeeded += 1,
                _ => continue,
            }
            assert_eq!((w.agent.as_deref(), w.role.as_deref()), expected, "{e:?}");
        }
        Ok::<_, anyhow::Error>(())
    })
    .await??;
    assert_eq!((started, succeeded), (41, 41));
    assert_eq!(queued_role_tasks(&p, run).await?, 0);
    Ok(())
}

#[tokio::test]
async fn a_role_task_waits_for_a_member_then_one_that_starts_claims_it() -> anyhow::Result<()> {
    let log = ExecutionLog::new()?;
    let mut p = Processes::start(&config(&log)).await?;
    p.coordinator().await?;
    // A worker that hosts no member of the role: it runs the pool task, never the role's.
    let plain = without_roles(&p)?;
    p.worker_with_config(&plain, &[]).await?;
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            role_task("research", "research"),
            Subtask::new("pooled", ""),
        ])))
        .await?;
    task_started(&p.client, run, "pooled").await?;
    // The pool task ends; the role task waits in its queue, unclaimed.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let view = p.client.run(run).await?.expect("run");
        let pooled = view.tasks.iter().find(|t| t.task_id.as_str() == "pooled");
        if pooled.is_some_and(|t| t.status == TaskStatus::Succeeded) {
            let research = view.tasks.iter().find(|t| t.task_id.as_str() == "research");
            assert_eq!(research.map(|t| t.status), Some(TaskStatus::Dispatched));
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "pooled never finished"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(queued_role_tasks(&p, run).await?, 1, "still queued");
    assert!(log.executions()?.is_empty(), "nobody ran it");
    assert!(
        !history(&p, run)
            .await?
            .iter()
            .any(|e| matches!(e.input, RunInput::Claimed(_))),
        "nobody claimed it"
    );
    assert_eq!(
        p.client.run(run).await?.expect("run").record.status,
        RunStatus::Running
    );

    // A member comes online: it claims the waiting task at once.
    p.worker(&[]).await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    assert_eq!(log.executions()?, vec!["research".to_string()]);
    assert_eq!(queued_role_tasks(&p, run).await?, 0);
    Ok(())
}

#[tokio::test]
async fn an_unclaimed_role_task_fails_role_unclaimed_and_is_withdrawn() -> anyhow::Result<()> {
    let log = ExecutionLog::new()?;
    let mut p = Processes::start(&config(&log)).await?;
    p.coordinator().await?;
    let plain = without_roles(&p)?;
    p.worker_with_config(&plain, &[]).await?;
    let mut bounded = plan(vec![
        role_task("research", "research"),
        Subtask::new("report", "").after(&["research"]),
    ]);
    bounded.config = PlanConfig {
        dependency_timeout: Secs::from_secs(2),
        ..PlanConfig::default()
    };
    let run = p.client.submit(SubmitRequest::new(bounded)).await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed, "{outcome:?}");
    let failed = &outcome.failed[0];
    assert_eq!(failed.task_id.as_str(), "research");
    assert_eq!(
        failed.error.kind,
        TaskErrorKind::RoleUnclaimed,
        "{}",
        failed.error
    );
    assert!(
        failed.error.message.contains("\"research\""),
        "{}",
        failed.error
    );
    assert_eq!(outcome.skipped[0].task_id.as_str(), "report");
    // The decision is the machine's, on the run log: a timer firing, no claim, no result
    // from a worker.
    let entries = history(&p, run).await?;
    assert!(
        entries
            .iter()
            .any(|e| matches!(e.input, RunInput::TimerFired { .. }))
    );
    assert!(
        !entries
            .iter()
            .any(|e| matches!(e.input, RunInput::Claimed(_) | RunInput::TaskResult(_)))
    );
    // The queued message was withdrawn: a member starting now finds nothing to run.
    assert_eq!(queued_role_tasks(&p, run).await?, 0);
    p.worker(&[]).await?;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(log.executions()?.is_empty(), "{:?}", log.executions()?);
    Ok(())
}

#[tokio::test]
async fn an_unknown_role_is_refused_with_the_roles_that_exist_and_changes_nothing()
-> anyhow::Result<()> {
    let log = ExecutionLog::new()?;
    let mut p = Processes::start(&config(&log)).await?;
    let file = p.dir().join("plan.json");
    std::fs::write(
        &file,
        serde_json::json!({"subtasks": [
            {"id": "a", "role": "research"},
            {"id": "b", "role": "editing"},
            // A role beside an agent is that agent's prompt: any name will do.
            {"id": "c", "role": "synthesis", "agent": "echo"}
        ]})
        .to_string(),
    )?;
    let file = file.to_str().expect("utf-8 path");
    // `flotilla plan validate`: against the local config while no coordinator answers,
    // then asking the coordinator.
    for online in [false, true] {
        if online {
            p.coordinator().await?;
            p.worker(&[]).await?;
        }
        let out = p.cli(&["plan", "validate", "--json", file])?;
        assert_eq!(
            out.status.code(),
            Some(1),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let errors = v["errors"].as_array().expect("errors");
        assert_eq!(errors.len(), 1, "{v}");
        assert_eq!(errors[0]["code"], "unknown_role");
        assert_eq!(errors[0]["path"], "subtasks[1].role");
        assert!(
            errors[0]["message"]
                .as_str()
                .is_some_and(|m| m.contains("(roles: research)")),
            "{v}"
        );
    }

    // Submitted, on both ways: rejected with the same problem, and no task queued.
    let bad = flotilla_model::Plan {
        subtasks: vec![role_task("a", "research"), role_task("b", "editing")],
        ..plan(Vec::new())
    };
    let reply = p
        .client
        .submit_request(&SubmitRequest::new(bad.clone()), Duration::from_secs(10))
        .await?;
    assert_eq!(reply.status, SubmitStatus::Rejected);
    assert_eq!(reply.errors[0].code, ProblemCode::UnknownRole);
    let run = p.client.submit(SubmitRequest::new(bad)).await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Rejected);
    let record = p.client.run(run).await?.expect("run").record;
    assert!(
        record
            .errors
            .iter()
            .any(|e| e.code == ProblemCode::UnknownRole),
        "{record:?}"
    );
    let out = p.cli(&["submit", file])?;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("[unknown_role]"));
    for run in [run, reply.run_id.expect("run id")] {
        assert_eq!(queued_role_tasks(&p, run).await?, 0);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(log.executions()?.is_empty());
    Ok(())
}

/// A deployment whose member cards define no roles keeps a role's old meaning: the system
/// prompt of the agent that runs the task — here the default agent, on the task's pool.
#[tokio::test]
async fn without_roles_a_role_names_a_prompt_and_the_task_runs_on_its_pool() -> anyhow::Result<()> {
    let mut p = Processes::start(
        r#"
default-agent = "echo"
[agents.echo]
kind = "scripted"
reply = "{task_id} by echo"
"#,
    )
    .await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![role_task("a", "research")])))
        .await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    assert_eq!(outcome.final_result.expect("result").response, "a by echo");
    assert!(
        !history(&p, run)
            .await?
            .iter()
            .any(|e| matches!(e.input, RunInput::Claimed(_)))
    );
    Ok(())
}

/// The shipped example (`config/examples/team-roles.toml` and its plan) runs as documented:
/// the research and checking tasks are claimed by their roles' members, on two workers; the
/// run log shows the claims (`flotilla runs history`).
#[tokio::test]
async fn the_shipped_team_roles_example_runs() -> anyhow::Result<()> {
    let mut p =
        Processes::with_config_file(&root().join("config/examples/team-roles.toml"), &[]).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    p.worker(&[]).await?;
    let plan_file = root().join("config/examples/plans/team-roles.json");
    let plan: flotilla_model::Plan = serde_json::from_str(&std::fs::read_to_string(&plan_file)?)?;
    let run = p.client.submit(SubmitRequest::new(plan)).await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    assert_eq!(
        outcome.final_result.expect("result").response,
        "Report on check"
    );
    let mut members: BTreeMap<String, String> = BTreeMap::new();
    for e in history(&p, run).await? {
        if let RunInput::Claimed(c) = e.input {
            members.insert(c.task_id.to_string(), c.agent);
        }
    }
    assert_eq!(
        members,
        BTreeMap::from([
            ("check".to_string(), "checker".to_string()),
            ("sources_policy".to_string(), "researcher".to_string()),
            ("sources_trade".to_string(), "researcher".to_string()),
            ("sources_volume".to_string(), "researcher".to_string()),
        ])
    );
    let out = p.cli(&["runs", "history", &run.to_string()])?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("claimed") && text.contains("by researcher (role research)"),
        "{text}"
    );
    let out = p.cli(&["plan", "validate", plan_file.to_str().expect("utf-8")])?;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(())
}

/// A mailbox message to `role:research` is read by exactly one of the run's tasks playing
/// the role: two research tasks (claimed by members on two workers) both read their mailbox
/// with `flotilla mbox read --wait`, as exec agents; one gets the message, the other nothing.
#[tokio::test]
async fn a_message_to_a_role_reaches_exactly_one_task_playing_it() -> anyhow::Result<()> {
    let mut p = Processes::start(
        r#"
default-agent = "echo"
[agents.echo]
kind = "scripted"
reply = "{task_id} by echo"

[agents.asker]
kind = "exec"
command = "sh"
args = ["-c", "\"$FLOTILLA_BIN\" mbox send role:research --type request '{\"question\": 42}' >/dev/null && echo asked"]

[agents.reader]
kind = "exec"
command = "sh"
args = ["-c", "\"$FLOTILLA_BIN\" mbox read --wait 3s"]
roles = ["research"]
"#,
    )
    .await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    p.worker(&[]).await?;
    let mut ask = Subtask::new("ask", "").with_agent("asker");
    ask.description = "ask the researchers".into();
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            ask,
            role_task("north", "research").after(&["ask"]),
            role_task("south", "research").after(&["ask"]),
        ])))
        .await?;
    let outcome = p
        .client
        .wait(run, WAIT)
        .await
        .map_err(|e| anyhow::anyhow!("{e}\nwarnings:\n{}", warnings(&p, 3)))?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let mut received = Vec::new();
    for e in history(&p, run).await? {
        if let RunInput::TaskResult(r) = e.input
            && r.task_id.as_str() != "ask"
        {
            let page: flotilla_model::mailbox::MailboxPage =
                serde_json::from_str(r.result.response.trim())?;
            received.extend(
                page.messages
                    .into_iter()
                    .map(|m| (r.task_id.to_string(), m)),
            );
        }
    }
    assert_eq!(received.len(), 1, "{received:?}");
    let (_, m) = &received[0];
    assert_eq!((m.from.as_str(), m.to.as_str()), ("ask", "role:research"));
    assert_eq!(m.payload["question"], 42);
    Ok(())
}
