//! A lead pauses one member, across processes against a real nats-server: the lead of a led
//! run (an LLM agent with `pause_member`) pauses the member's task while that member's LLM
//! attempt runs a tool; the tool finishes, the attempt stops at its next step boundary and gives
//! its slot back (`task_suspended`), while the rest of the run goes on (the run itself stays
//! `running`). An operator resumes the task (`flotilla runs resume RUN --task`); the same attempt
//! continues from its journal — no model call paid twice, the tool not run twice — and the lead
//! finishes the run. Bad pauses of one task are refused with what is wrong and change nothing.
//!
//! Agents are deterministic: the lead's and the member's models are two OpenAI-compatible test
//! doubles (`flotilla_testkit::openai`, scripted replies); `slow_step` is an exec tool
//! (`python3`) that records each run in a file and waits for the test's go; the market analyst
//! is an exec agent that finishes once `slow_step` has started, so the lead hears of it while
//! the member is inside its tool.

mod support;

use std::time::Duration;

use flotilla_model::event::{Event, EventEnvelope, WorkflowPhase};
use flotilla_model::ids::RunId;
use flotilla_model::plan::{PlanConfig, Strategy, Subtask};
use flotilla_model::run::{EndCause, RunStatus, TaskStatus};
use flotilla_model::runlog::{ControlAction, RunInput};
use flotilla_model::submit::SubmitRequest;
use flotilla_testkit::openai::{OpenAiServer, Reply};
use futures::StreamExt;
use serde_json::json;
use support::*;

fn config(lead_url: &str, writer_url: &str, dir: &std::path::Path) -> String {
    let started = dir.join("slow.started");
    let go = dir.join("slow.go");
    format!(
        r#"
[agents.analyst]
kind = "exec"
command = "python3"
args = ["-c", '''
import os, time
while not os.path.exists({started:?}):
    time.sleep(0.05)
print('market sized')
''']

[agents.writer]
kind = "llm"
base-url = "{writer_url}"
model = "scripted-model"

[agents.writer.exec-tools.slow_step]
command = "python3"
args = ["-c", '''
import os, time
open({started:?}, 'a').write('started\n')
while not os.path.exists({go:?}):
    time.sleep(0.05)
print('step done')
''']
description = "A step that takes a while"

[agents.chief]
kind = "llm"
base-url = "{lead_url}"
model = "scripted-model"
max-tool-rounds = 6
tools = ["assign_task", "finish_run", "pause_member", "resume_member"]
roles = ["supervisor"]

[supervisor]
ack-wait = "2s"
"#
    )
}

fn led_plan() -> flotilla_model::plan::Plan {
    let mut plan = plan(vec![
        Subtask::new("draft", "write the draft").with_agent("writer"),
        Subtask::new("market", "size the market").with_agent("analyst"),
    ]);
    plan.query = Some("draft a market note".into());
    plan.config = PlanConfig {
        strategy: Strategy::Supervisor,
        ..PlanConfig::default()
    };
    plan
}

/// Waits for the first workflow event of `phase` for task `task` of `run`.
async fn event(p: &Processes, run: RunId, phase: WorkflowPhase) -> anyhow::Result<EventEnvelope> {
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    tokio::time::timeout(WAIT, async {
        while let Some(e) = events.next().await {
            let e: EventEnvelope = e?;
            if let Event::Workflow(w) = &e.event
                && w.phase == phase
            {
                return Ok(e);
            }
        }
        anyhow::bail!("the event stream ended without {phase:?}")
    })
    .await
    .map_err(|_| anyhow::anyhow!("no {phase:?} within {WAIT:?}"))?
}

/// The workflow phases of `run`'s events so far.
async fn history_phases(p: &Processes, run: RunId) -> anyhow::Result<Vec<WorkflowPhase>> {
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    let mut out = Vec::new();
    // The stream is live: read what is there (the run has ended), then stop.
    while let Ok(Some(e)) = tokio::time::timeout(Duration::from_millis(500), events.next()).await {
        if let Event::Workflow(w) = &e?.event {
            out.push(w.phase);
        }
    }
    Ok(out)
}

async fn draft(p: &Processes, run: RunId) -> anyhow::Result<flotilla_model::run::TaskView> {
    let view = p.client.run(run).await?.expect("the run exists");
    Ok(view
        .tasks
        .into_iter()
        .find(|t| t.task_id.as_str() == "draft")
        .expect("the plan has draft"))
}

fn stdout(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[tokio::test]
async fn a_lead_pauses_a_member_mid_task_and_an_operator_resumes_it() -> anyhow::Result<()> {
    let lead = OpenAiServer::start().await?;
    let writer = OpenAiServer::start().await?;
    // The lead's turns, one at a time: the plan (assign both), market's end (pause the
    // writer's draft), draft's end (finish).
    lead.push_all([
        Reply::tool_call("assign_task", json!({"task_id": "draft"}))
            .when("Assign what should run first"),
        Reply::tool_call("assign_task", json!({"task_id": "market"})),
        Reply::text("both assigned"),
        Reply::tool_call(
            "pause_member",
            json!({"task_id": "draft", "reason": "hold the draft until the market is reviewed", "seconds": 600}),
        )
        .when("Task market succeeded"),
        Reply::text("draft paused"),
        Reply::tool_call("finish_run", json!({"result": "The note is drafted."}))
            .when("Task draft succeeded"),
        Reply::text("done"),
        Reply::text("done"),
    ]);
    writer.push_all([
        Reply::tool_call("slow_step", json!({})),
        Reply::text("draft written"),
    ]);
    let dir = tempfile::tempdir()?;
    let mut p = Processes::start(&config(&lead.base_url(), &writer.base_url(), dir.path())).await?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "4"]).await?;
    p.supervisor().await?;

    let run = p.client.submit(SubmitRequest::new(led_plan())).await?;
    let paused = event(&p, run, WorkflowPhase::TaskPaused).await?;
    let Event::Workflow(w) = &paused.event else {
        unreachable!()
    };
    let detail = w.detail.clone().unwrap_or_default();
    assert!(
        detail.contains("paused by lead: hold the draft until the market is reviewed"),
        "{detail}"
    );
    assert!(
        detail.contains("stops at its next step boundary"),
        "{detail}"
    );
    // Let the worker hear of the task's hold, then let the tool finish: the attempt stops
    // before its next model call.
    tokio::time::sleep(Duration::from_millis(500)).await;
    std::fs::write(dir.path().join("slow.go"), "go")?;
    let suspended = event(&p, run, WorkflowPhase::TaskSuspended).await?;
    assert_eq!(suspended.attempt, Some(1));
    let d = draft(&p, run).await?;
    assert_eq!(d.status, TaskStatus::Waiting, "{d:?}");
    assert!(d.paused_until.is_some(), "{d:?}");
    assert_eq!(writer.requests().len(), 1, "no model call after the pause");
    // The run itself runs on: only the member is paused.
    let view = p.client.run(run).await?.expect("exists");
    assert_eq!(view.record.status, RunStatus::Running);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(draft(&p, run).await?.status, TaskStatus::Waiting);
    assert_eq!(writer.requests().len(), 1);

    // Bad pauses of one task: refused with what is wrong, nothing changes.
    let out = p.cli(&[
        "runs",
        "pause",
        &run.to_string(),
        "--task",
        "ghost",
        "--by",
        "ops",
    ])?;
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(stdout(&out).contains("task_not_found"), "{}", stdout(&out));
    let out = p.cli(&[
        "runs",
        "pause",
        &run.to_string(),
        "--task",
        "draft",
        "--for",
        "100ms",
        "--by",
        "ops",
    ])?;
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(stdout(&out).contains("invalid_timeout"), "{}", stdout(&out));
    // Pausing it again changes nothing, and the run machine says why.
    let out = p.cli(&[
        "runs",
        "pause",
        &run.to_string(),
        "--task",
        "draft",
        "--by",
        "ops",
    ])?;
    assert!(out.status.success(), "{}", stdout(&out));
    assert!(
        stdout(&out).contains("nothing changed: task draft is already paused until"),
        "{}",
        stdout(&out)
    );

    // An operator resumes the member: the same attempt continues from its journal.
    let out = p.cli(&[
        "runs",
        "resume",
        &run.to_string(),
        "--task",
        "draft",
        "--by",
        "ops",
        "--reason",
        "reviewed",
    ])?;
    assert!(out.status.success(), "{}", stdout(&out));
    assert!(
        stdout(&out).contains("Task draft of run") && stdout(&out).contains("resumed"),
        "{}",
        stdout(&out)
    );
    let o = p.client.wait(run, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    assert_eq!(o.cause, Some(EndCause::LeadFinished), "{o:?}");
    assert_eq!(
        writer.requests().len(),
        2,
        "the member's first reply came from its journal"
    );
    let tool_runs = std::fs::read_to_string(dir.path().join("slow.started"))?;
    assert_eq!(tool_runs.lines().count(), 1, "the tool ran once");
    let d = draft(&p, run).await?;
    assert_eq!((d.status, d.attempts), (TaskStatus::Succeeded, 1), "{d:?}");
    assert!(d.paused_until.is_none());

    // On the run log: the lead's pause and the operator's resume, each naming the task.
    let store = flotilla_client::open_store(&p.bus).await?;
    let controls: Vec<(ControlAction, String, String)> = store
        .history(run)
        .await?
        .into_iter()
        .filter_map(|(_, _, e)| match e.input {
            RunInput::Control(c) => Some((
                c.action,
                c.task_id.map(|t| t.to_string()).unwrap_or_default(),
                c.by.unwrap_or_default(),
            )),
            _ => None,
        })
        .collect();
    assert_eq!(
        controls,
        [
            (ControlAction::Pause, "draft".into(), "lead".into()),
            (ControlAction::Pause, "draft".into(), "ops".into()),
            (ControlAction::Resume, "draft".into(), "ops".into()),
        ]
    );
    // Applied once each: the repeated pause changed nothing.
    let phases: Vec<WorkflowPhase> = history_phases(&p, run).await?;
    assert_eq!(
        phases
            .iter()
            .filter(|ph| **ph == WorkflowPhase::TaskPaused)
            .count(),
        1,
        "{phases:?}"
    );
    assert_eq!(
        phases
            .iter()
            .filter(|ph| **ph == WorkflowPhase::TaskResumed)
            .count(),
        1,
        "{phases:?}"
    );
    // The lead's tool result said it took.
    let results: Vec<String> = lead
        .requests()
        .iter()
        .flat_map(|r| r.texts("tool"))
        .filter(|t| t.contains("changed"))
        .collect();
    assert!(
        results.iter().any(|t| t.contains("\"changed\":true")),
        "{results:?}"
    );
    // Ended: a pause of one of its tasks changes nothing.
    let out = p.cli(&[
        "runs",
        "pause",
        &run.to_string(),
        "--task",
        "draft",
        "--by",
        "ops",
    ])?;
    assert!(out.status.success(), "{}", stdout(&out));
    assert!(
        stdout(&out).contains("nothing changed: the run has ended (succeeded)"),
        "{}",
        stdout(&out)
    );
    Ok(())
}
