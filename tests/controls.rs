//! Humans in the loop, controls: pause (nothing new dispatched, running attempts finish),
//! resume (dispatch continues where it stopped), takeover (the run's context, tasks completed
//! by hand, handed back), each hold's deadline and default, bad input refused and changing
//! nothing, and — across processes, through the CLI — a pause that reaches a child run and
//! survives a coordinator kill. In-process services against a real nats-server run the
//! deterministic `scripted` test agent; the process test runs small `sh` exec agents.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use flotilla_coordinator::CoordinatorOptions;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::control::{
    CompleteTaskRequest, ControlRunReply, PauseRunRequest, ResumeRunRequest, TakeoverRunRequest,
};
use flotilla_model::event::{Event, WorkflowPhase};
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::plan::Subtask;
use flotilla_model::run::{EndCause, RunStatus, TaskStatus};
use flotilla_model::runlog::RunInput;
use flotilla_model::submit::SubmitRequest;
use flotilla_worker::WorkerOptions;
use futures::StreamExt;
use support::*;

const ASK: Duration = Duration::from_secs(5);

/// One worker whose scripted agent takes `delay` per attempt and answers with what it got.
async fn services(delay: Duration) -> anyhow::Result<InProcess> {
    let mut agents = BTreeMap::new();
    agents.insert(
        "bot".to_string(),
        flotilla_worker::agents::AgentDefinition::Scripted(
            flotilla_worker::agents::ScriptedConfig {
                reply: "{task_id} done after [{dependencies}]".into(),
                delay,
                ..Default::default()
            },
        ),
    );
    InProcess::start_configured(
        1,
        agents,
        WorkerOptions {
            started_event_delay: Duration::ZERO,
            ..WorkerOptions::default()
        },
        CoordinatorOptions::default(),
    )
    .await
}

fn pause(run: RunId) -> PauseRunRequest {
    PauseRunRequest {
        protocol: PROTOCOL_VERSION,
        run_id: run,
        reason: Some("checking the draft".into()),
        by: Some("alice".into()),
        timeout_ms: None,
        children: true,
        task_id: None,
    }
}

fn resume(run: RunId) -> ResumeRunRequest {
    ResumeRunRequest {
        protocol: PROTOCOL_VERSION,
        run_id: run,
        reason: None,
        by: Some("alice".into()),
        children: true,
        task_id: None,
    }
}

fn takeover(run: RunId) -> TakeoverRunRequest {
    TakeoverRunRequest {
        protocol: PROTOCOL_VERSION,
        run_id: run,
        reason: Some("the agents are stuck".into()),
        by: Some("bob".into()),
        timeout_ms: None,
        children: true,
    }
}

fn complete(run: RunId, task: &str, result: &str) -> CompleteTaskRequest {
    CompleteTaskRequest {
        protocol: PROTOCOL_VERSION,
        run_id: run,
        task_id: TaskId::new(task),
        result: result.into(),
        by: "bob".into(),
        comment: Some("did it myself".into()),
    }
}

/// Waits until the run's view says `status`, and returns its tasks' statuses.
async fn run_status(
    f: &InProcess,
    run: RunId,
    status: RunStatus,
) -> anyhow::Result<Vec<(String, TaskStatus)>> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some(view) = f.client.run(run).await?
            && view.record.status == status
        {
            return Ok(view
                .tasks
                .iter()
                .map(|t| (t.task_id.to_string(), t.status))
                .collect());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "run {run} never became {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until task `task` has `status`.
async fn task_is(f: &InProcess, run: RunId, task: &str, status: TaskStatus) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some(view) = f.client.run(run).await?
            && view
                .tasks
                .iter()
                .any(|t| t.task_id.as_str() == task && t.status == status)
        {
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "task {task} of {run} never became {}",
            status.as_str()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The run's workflow phases so far, in order (read until the run's end when it ended).
async fn phases(f: &InProcess, run: RunId) -> anyhow::Result<Vec<(WorkflowPhase, String)>> {
    let events = f.client.events(run).await?;
    futures::pin_mut!(events);
    let mut out = Vec::new();
    while let Ok(Some(e)) = tokio::time::timeout(Duration::from_millis(500), events.next()).await {
        if let Event::Workflow(w) = e?.event {
            let end = w.phase.ends_run();
            out.push((w.phase, w.detail.unwrap_or_default()));
            if end {
                break;
            }
        }
    }
    Ok(out)
}

/// The run log's entries of one kind.
async fn entries(f: &InProcess, run: RunId) -> anyhow::Result<Vec<RunInput>> {
    let store = flotilla_coordinator::store::RunStore::open(&f.bus).await?;
    Ok(store
        .history(run)
        .await?
        .into_iter()
        .map(|(_, _, e)| e.input)
        .collect())
}

#[tokio::test]
async fn a_paused_run_dispatches_nothing_new_and_resumes_where_it_stopped() -> anyhow::Result<()> {
    let f = services(Duration::from_millis(800)).await?;
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("draft", "write it").with_agent("bot"),
            Subtask::new("review", "read it")
                .with_agent("bot")
                .after(&["draft"]),
            Subtask::new("publish", "send it")
                .with_agent("bot")
                .after(&["review"]),
        ])))
        .await?;
    task_started(&f.client, run, "draft").await?;
    let reply: ControlRunReply = f.client.request(&pause(run), ASK).await?;
    assert!(reply.applied, "{reply:?}");
    // Running (or `pending` while its start is performed but not recorded yet).
    assert!(
        !reply.status.is_terminal() && !reply.status.is_held(),
        "{reply:?}"
    );
    run_status(&f, run, RunStatus::Paused).await?;
    // Pausing again changes nothing.
    let again: ControlRunReply = f.client.request(&pause(run), ASK).await?;
    assert!(!again.applied, "{again:?}");

    // The running attempt finishes; nothing after it starts while paused.
    task_is(&f, run, "draft", TaskStatus::Succeeded).await?;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let tasks = run_status(&f, run, RunStatus::Paused).await?;
    assert_eq!(
        tasks,
        vec![
            ("draft".into(), TaskStatus::Succeeded),
            ("review".into(), TaskStatus::Waiting),
            ("publish".into(), TaskStatus::Waiting),
        ]
    );

    let reply: ControlRunReply = f.client.request(&resume(run), ASK).await?;
    assert!(reply.applied, "{reply:?}");
    assert_eq!(reply.status, RunStatus::Paused);
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let seen: Vec<WorkflowPhase> = phases(&f, run).await?.into_iter().map(|p| p.0).collect();
    let paused = seen.iter().position(|p| *p == WorkflowPhase::RunPaused);
    let resumed = seen.iter().position(|p| *p == WorkflowPhase::RunResumed);
    assert!(
        paused.is_some() && paused < resumed,
        "paused then resumed, once each: {seen:?}"
    );
    assert_eq!(
        seen.iter()
            .filter(|p| **p == WorkflowPhase::RunPaused)
            .count(),
        1
    );
    // Resuming an ended run changes nothing and says how it ended.
    let late: ControlRunReply = f.client.request(&resume(run), ASK).await?;
    assert!(!late.applied);
    assert_eq!(late.status, RunStatus::Succeeded);
    f.stop().await;
    Ok(())
}

/// How many notices of `kind` (`pause`, `takeover`) the notice stream holds for `run`.
async fn notices(f: &InProcess, kind: &str, run: RunId) -> anyhow::Result<u64> {
    use futures::TryStreamExt;
    let stream = f
        .bus
        .js()
        .get_stream(
            f.bus
                .names()
                .stream(flotilla_model::subjects::StreamKind::Notify),
        )
        .await?;
    let mut info = stream
        .info_builder()
        .subjects(f.bus.names().notify(kind, run))
        .fetch()
        .await?;
    let mut count = 0;
    while let Some((_, n)) = info.try_next().await? {
        count += n as u64;
    }
    Ok(count)
}

/// The same control sent twice at once — two people, or a double click — is decided once, by
/// the run machine: one answer `applied: true`, the other `applied: false` saying why, one
/// event and one notice. For the run's pause, resume and takeover, and a task's pause and
/// resume.
#[tokio::test]
async fn a_control_sent_twice_at_once_applies_once_and_the_second_says_why() -> anyhow::Result<()> {
    let f = services(Duration::from_millis(1500)).await?;
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("slow", "take time").with_agent("bot"),
            Subtask::new("next", "then")
                .with_agent("bot")
                .after(&["slow"]),
        ])))
        .await?;
    task_started(&f.client, run, "slow").await?;
    // Both answers, the applied one first.
    async fn twice<R>(f: &InProcess, request: &R) -> anyhow::Result<[ControlRunReply; 2]>
    where
        R: flotilla_model::api::ApiRequest<Reply = ControlRunReply>,
    {
        let (a, b) = tokio::join!(
            f.client.request(request, ASK),
            f.client.request(request, ASK)
        );
        let (a, b) = (a?, b?);
        anyhow::ensure!(a.applied != b.applied, "applied once: {a:?} {b:?}");
        Ok(if a.applied { [a, b] } else { [b, a] })
    }
    let says = |r: &ControlRunReply, what: &str| {
        assert!(
            !r.pending && r.detail.as_deref().is_some_and(|d| d.contains(what)),
            "{what:?}: {r:?}"
        );
    };

    let [first, second] = twice(&f, &pause(run)).await?;
    assert_eq!(first.status, RunStatus::Running, "{first:?}");
    assert_eq!(second.status, RunStatus::Paused, "{second:?}");
    says(&second, "already paused by alice until");
    assert_eq!(notices(&f, "pause", run).await?, 1, "one notice");

    let [_, second] = twice(&f, &resume(run)).await?;
    says(&second, "nothing holds it");

    let [first, second] = twice(&f, &takeover(run)).await?;
    assert_eq!(first.status, RunStatus::Running, "{first:?}");
    says(&second, "already under human control by bob");
    assert!(first.context.is_some() && second.context.is_some());
    assert_eq!(notices(&f, "takeover", run).await?, 1, "one notice");
    f.client.request(&resume(run), ASK).await?;

    // One task's pause and resume.
    let mut hold = pause(run);
    hold.task_id = Some(TaskId::new("next"));
    let [first, second] = twice(&f, &hold).await?;
    assert_eq!(first.task_id, Some(TaskId::new("next")));
    says(&second, "task next is already paused");
    let mut release = resume(run);
    release.task_id = Some(TaskId::new("next"));
    let [_, second] = twice(&f, &release).await?;
    says(&second, "task next is not paused");

    let counts = |phase: WorkflowPhase, seen: &[(WorkflowPhase, String)]| {
        seen.iter().filter(|(p, _)| *p == phase).count()
    };
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let seen = phases(&f, run).await?;
    for (phase, n) in [
        (WorkflowPhase::RunPaused, 1),
        (WorkflowPhase::RunTakenOver, 1),
        (WorkflowPhase::RunResumed, 2),
        (WorkflowPhase::TaskPaused, 1),
        (WorkflowPhase::TaskResumed, 1),
    ] {
        assert_eq!(counts(phase, &seen), n, "{phase:?} in {seen:?}");
    }
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_person_takes_over_completes_a_task_by_hand_and_hands_the_run_back() -> anyhow::Result<()>
{
    let f = services(Duration::from_millis(600)).await?;
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("research", "find facts").with_agent("bot"),
            Subtask::new("analyse", "weigh them")
                .with_agent("bot")
                .after(&["research"]),
            Subtask::new("report", "write it up")
                .with_agent("bot")
                .after(&["analyse"]),
        ])))
        .await?;
    task_started(&f.client, run, "research").await?;
    let reply: ControlRunReply = f.client.request(&takeover(run), ASK).await?;
    assert!(reply.applied, "{reply:?}");
    task_is(&f, run, "research", TaskStatus::Succeeded).await?;
    run_status(&f, run, RunStatus::HumanControl).await?;

    // A second takeover changes nothing and answers where the run stands.
    let reply: ControlRunReply = f.client.request(&takeover(run), ASK).await?;
    assert!(!reply.applied);
    assert_eq!(reply.status, RunStatus::HumanControl);
    let context = reply.context.expect("a takeover answers its context");
    assert_eq!((context.step, context.tasks_total), (1, 3));
    assert_eq!(context.completed.len(), 1);
    assert_eq!(context.completed[0].task_id.as_str(), "research");
    assert!(
        context.completed[0].result.contains("research done"),
        "{context:?}"
    );
    let pending: Vec<(&str, bool)> = context
        .pending
        .iter()
        .map(|t| (t.task_id.as_str(), t.ready))
        .collect();
    assert_eq!(pending, vec![("analyse", true), ("report", false)]);
    assert_eq!(context.pending[1].waiting_on, vec![TaskId::new("analyse")]);
    assert_eq!(context.suggested_next.action, "complete");
    assert_eq!(
        context.suggested_next.task_id.as_ref().map(TaskId::as_str),
        Some("analyse")
    );

    // The person does the analysis; the report still waits: the run is theirs.
    let done = f
        .client
        .request(&complete(run, "analyse", "margins fell 3 points"), ASK)
        .await?;
    assert!(done.completing);
    task_is(&f, run, "analyse", TaskStatus::Succeeded).await?;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let tasks = run_status(&f, run, RunStatus::HumanControl).await?;
    assert_eq!(tasks[2], ("report".into(), TaskStatus::Waiting));
    // A second completion of the same task is refused.
    let twice = f
        .client
        .call(&complete(run, "analyse", "again"), ASK)
        .await?;
    assert_eq!(twice.err().map(|e| e.code), Some("task_not_pending".into()));

    // Handed back: the agent writes the report with the person's result injected.
    f.client.request(&resume(run), ASK).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let store = flotilla_coordinator::store::RunStore::open(&f.bus).await?;
    let history = store.history(run).await?;
    let report = history
        .iter()
        .find_map(|(_, _, e)| match &e.input {
            RunInput::TaskResult(r) if r.task_id.as_str() == "report" => Some(r.clone()),
            _ => None,
        })
        .expect("the report's result");
    assert_eq!(report.result.response, "report done after [analyse]");
    let seqs: Vec<u64> = history
        .iter()
        .filter(|(_, _, e)| matches!(e.input, RunInput::Completed(_)))
        .map(|(seq, _, _)| *seq)
        .collect();
    let analyse = store.result_at(seqs[0]).await?;
    assert_eq!(analyse.worker, "human:bob");
    assert_eq!(analyse.result.response, "margins fell 3 points");
    let completed = seqs.len();
    assert_eq!(completed, 1, "one completion recorded");
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn every_hold_has_a_deadline_a_pause_resumes_and_a_takeover_cancels() -> anyhow::Result<()> {
    let f = services(Duration::from_millis(300)).await?;
    let tasks = || {
        plan(vec![
            Subtask::new("a", "first").with_agent("bot"),
            Subtask::new("b", "second").with_agent("bot").after(&["a"]),
        ])
    };
    let paused = f.client.submit(SubmitRequest::new(tasks())).await?;
    let taken = f.client.submit(SubmitRequest::new(tasks())).await?;
    task_started(&f.client, paused, "a").await?;
    task_started(&f.client, taken, "a").await?;
    let mut p = pause(paused);
    p.timeout_ms = Some(2_000);
    let mut t = takeover(taken);
    t.timeout_ms = Some(2_000);
    f.client.request(&p, ASK).await?;
    f.client.request(&t, ASK).await?;

    let resumed = f.client.wait(paused, WAIT).await?;
    assert_eq!(resumed.status, RunStatus::Succeeded, "{resumed:?}");
    let detail = phases(&f, paused)
        .await?
        .into_iter()
        .find(|(p, _)| *p == WorkflowPhase::RunResumed)
        .map(|(_, d)| d);
    assert_eq!(
        detail.as_deref(),
        Some("resumed: the pause's deadline passed")
    );

    let cancelled = f.client.wait(taken, WAIT).await?;
    assert_eq!(cancelled.status, RunStatus::Cancelled, "{cancelled:?}");
    assert_eq!(cancelled.cause, Some(EndCause::Cancelled));
    assert!(
        cancelled
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("takeover's deadline")),
        "{cancelled:?}"
    );
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn bad_controls_are_refused_with_what_is_wrong_and_change_nothing() -> anyhow::Result<()> {
    let f = services(Duration::from_millis(1500)).await?;
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("slow", "take time").with_agent("bot"),
            Subtask::new("next", "then")
                .with_agent("bot")
                .after(&["slow"]),
        ])))
        .await?;
    task_started(&f.client, run, "slow").await?;
    // Completing a task of a run whose start is not recorded yet is refused: nothing says
    // which of its tasks run.
    let e = f
        .client
        .call(&complete(run, "next", "x"), ASK)
        .await?
        .expect_err("refused");
    assert_eq!((e.status, e.code.as_str()), (409, "not_started"));
    let mut t = takeover(run);
    t.timeout_ms = Some(60_000);
    let taken: ControlRunReply = f.client.request(&t, ASK).await?;
    assert!(taken.context.is_some(), "{taken:?}");
    run_status(&f, run, RunStatus::HumanControl).await?;
    let before = entries(&f, run).await?.len();

    let unknown = RunId::new();
    let e = f.client.call(&pause(unknown), ASK).await?.err();
    assert_eq!(
        e.map(|e| (e.status, e.code)),
        Some((404, "not_found".into()))
    );

    let mut short = pause(run);
    short.timeout_ms = Some(10);
    let e = f.client.call(&short, ASK).await?.expect_err("refused");
    assert_eq!((e.status, e.code.as_str()), (400, "invalid_timeout"));
    assert!(e.message.contains("timeout_ms 10"), "{}", e.message);

    let mut long = takeover(run);
    long.reason = Some("x".repeat(2000));
    let e = f.client.call(&long, ASK).await?.expect_err("refused");
    assert_eq!((e.status, e.code.as_str()), (400, "invalid_request"));
    assert!(e.message.contains("reason"), "{}", e.message);

    let mut nobody = complete(run, "next", "by hand");
    nobody.by = " ".into();
    nobody.result = "y".repeat(70_000);
    let e = f.client.call(&nobody, ASK).await?.expect_err("refused");
    assert_eq!((e.status, e.code.as_str()), (400, "invalid_request"));
    let paths: Vec<&str> = e.problems.iter().map(|p| p.path.as_str()).collect();
    assert_eq!(paths, vec!["by", "result"], "every problem at once");

    let e = f
        .client
        .call(&complete(run, "nope", "x"), ASK)
        .await?
        .expect_err("refused");
    assert_eq!((e.status, e.code.as_str()), (404, "task_not_found"));

    let e = f
        .client
        .call(&complete(run, "slow", "x"), ASK)
        .await?
        .expect_err("refused");
    assert_eq!((e.status, e.code.as_str()), (409, "task_not_pending"));
    assert!(e.message.contains("running"), "{}", e.message);

    // Unknown fields are malformed.
    let reply = f
        .bus
        .client()
        .request(
            f.bus.names().api("run.pause"),
            format!(r#"{{"run_id":"{run}","pause_forever":true}}"#).into(),
        )
        .await?;
    let body: serde_json::Value = serde_json::from_slice(&reply.payload)?;
    assert_eq!(body["code"], "malformed", "{body}");

    // Pausing a run under human control changes nothing: the run machine says why (the
    // control is on the run log, where it changed nothing).
    let r: ControlRunReply = f.client.request(&pause(run), ASK).await?;
    assert!(!r.applied, "{r:?}");
    assert_eq!(r.status, RunStatus::HumanControl);
    assert!(
        r.detail
            .as_deref()
            .is_some_and(|d| d.contains("a pause does not apply")),
        "{r:?}"
    );
    assert_eq!(
        entries(&f, run).await?.len(),
        before + 1,
        "only the pause was recorded"
    );
    run_status(&f, run, RunStatus::HumanControl).await?;
    f.client.request(&resume(run), ASK).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded);
    f.stop().await;
    Ok(())
}

/// A deterministic exec agent (not a model): calls `kid` as a child run and answers with what
/// it answered.
const PARENT_SH: &str = r#"set -e
answer=$("$FLOTILLA_BIN" call kid '{"from": "parent"}' --description "help")
echo "parent <- $answer"
"#;

/// The child's agent: takes its time, so the pause finds it running.
const KID_SH: &str = "sleep 6\necho kid-answer\n";

/// Across processes through the CLI: a pause of the root reaches its running child run; with
/// the coordinator killed and started again while paused, the runs stay paused, nothing new
/// is dispatched, and a resume lets both finish.
#[tokio::test]
async fn a_pause_reaches_child_runs_and_survives_a_coordinator_kill() -> anyhow::Result<()> {
    let config = "[agents.parent]\nkind = \"exec\"\ncommand = \"sh\"\nargs = [\"parent.sh\"]\n\
                  [agents.kid]\nkind = \"exec\"\ncommand = \"sh\"\nargs = [\"kid.sh\"]\n\
                  [agents.quick]\nkind = \"exec\"\ncommand = \"sh\"\nargs = [\"-c\", \"echo quick\"]\n";
    let mut p = Processes::start(config).await?;
    std::fs::write(p.dir().join("parent.sh"), PARENT_SH)?;
    std::fs::write(p.dir().join("kid.sh"), KID_SH)?;
    let coordinator = p.coordinator().await?;
    p.worker(&["--concurrency", "4"]).await?;

    let root = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("ask", "ask the kid").with_agent("parent"),
            Subtask::new("after", "then")
                .with_agent("quick")
                .after(&["ask"]),
        ])))
        .await?;
    let child = {
        let events = p.client.events(root).await?;
        futures::pin_mut!(events);
        tokio::time::timeout(WAIT, async {
            while let Some(e) = events.next().await {
                if let Event::AgentRunStarted { child, .. } = e?.event {
                    return Ok(child.run_id);
                }
            }
            anyhow::bail!("no child")
        })
        .await??
    };
    let out = p.cli(&[
        "runs",
        "pause",
        &root.to_string(),
        "--reason",
        "look first",
        "--json",
    ])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reply: ControlRunReply = serde_json::from_slice(&out.stdout)?;
    assert!(reply.applied, "{reply:?}");
    assert_eq!(reply.children, vec![child], "the child is paused too");

    // Killed while paused: the holds are in the runs' state, not in a process.
    p.kill(coordinator);
    p.coordinator().await?;
    let paused = |run: RunId| {
        let client = p.client.clone();
        async move {
            let deadline = tokio::time::Instant::now() + WAIT;
            loop {
                let view = client.run(run).await?.expect("exists");
                if view.record.status == RunStatus::Paused {
                    return anyhow::Ok(view);
                }
                anyhow::ensure!(tokio::time::Instant::now() < deadline, "{run} not paused");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    paused(child).await?;
    // The parent's attempt finishes once the child's running task does (a running attempt
    // is not stopped); its dependent is not dispatched.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let view = paused(root).await?;
        if view.tasks[0].status == TaskStatus::Succeeded {
            assert_eq!(view.tasks[1].status, TaskStatus::Waiting, "{view:?}");
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the ask never ended"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        paused(root).await?.tasks[1].status,
        TaskStatus::Waiting,
        "still nothing dispatched"
    );

    let out = p.cli(&["runs", "resume", &root.to_string()])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("resumed (it was paused)"), "{text}");
    let outcome = p.client.wait(root, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let child_outcome = p.client.wait(child, WAIT).await?;
    assert_eq!(child_outcome.status, RunStatus::Succeeded);

    // The run log says who did what.
    let out = p.cli(&["runs", "history", &root.to_string()])?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("pause: look first"), "{text}");
    assert!(text.contains("resume"), "{text}");
    Ok(())
}

#[tokio::test]
async fn a_person_edits_the_plan_of_a_taken_over_run_and_hands_it_back() -> anyhow::Result<()> {
    use flotilla_model::control::{EditPlanReply, EditPlanRequest};
    let f = services(Duration::from_millis(600)).await?;
    let original = plan(vec![
        Subtask::new("research", "find facts").with_agent("bot"),
        Subtask::new("analyse", "weigh them")
            .with_agent("bot")
            .after(&["research"]),
        Subtask::new("report", "write it up")
            .with_agent("bot")
            .after(&["analyse"]),
    ]);
    let run = f
        .client
        .submit(SubmitRequest::new(original.clone()))
        .await?;
    let edit = |plan: flotilla_model::plan::Plan| EditPlanRequest {
        protocol: PROTOCOL_VERSION,
        run_id: run,
        plan,
        by: "bob".into(),
        reason: Some("a fact check first".into()),
    };
    // Not taken over: refused.
    let early = f.client.call(&edit(original.clone()), ASK).await?;
    assert_eq!(early.err().map(|e| e.code), Some("not_taken_over".into()));
    task_started(&f.client, run, "research").await?;
    f.client.request(&takeover(run), ASK).await?;
    task_is(&f, run, "research", TaskStatus::Succeeded).await?;
    run_status(&f, run, RunStatus::HumanControl).await?;

    // Bad edits: each refused with what is wrong, and nothing changes.
    let mut started = original.clone();
    started.subtasks[0].description = "find other facts".into();
    let mut cycle = original.clone();
    cycle.subtasks[1].dependencies = vec![TaskId::new("report")];
    let mut dropped = original.clone();
    dropped.subtasks.pop();
    for (bad, code, field) in [
        (started, "invalid_edit", "subtasks[0]"),
        (cycle, "invalid_plan", "cycle"),
        (dropped, "invalid_edit", "keeps every task"),
    ] {
        let e = f.client.call(&edit(bad), ASK).await?.expect_err("refused");
        assert_eq!(e.code, code, "{e:?}");
        assert!(
            e.message.contains(field) || e.problems.iter().any(|p| p.to_string().contains(field)),
            "{e:?}"
        );
    }
    assert_eq!(run_status(&f, run, RunStatus::HumanControl).await?.len(), 3);

    // The edit: a new `check` task after research, and the report waits for it too.
    let mut edited = original.clone();
    edited.subtasks[2].dependencies.push(TaskId::new("check"));
    edited.subtasks.push(
        Subtask::new("check", "check the facts")
            .with_agent("bot")
            .after(&["research"]),
    );
    let reply: EditPlanReply = f.client.request(&edit(edited), ASK).await?;
    assert_eq!((reply.tasks_total, reply.added), (4, 1));
    assert_eq!(reply.changed, vec![TaskId::new("report")]);
    let tasks = run_status(&f, run, RunStatus::HumanControl).await?;
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut tasks = tasks;
    while tasks.len() != 4 {
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "never edited");
        tokio::time::sleep(Duration::from_millis(50)).await;
        tasks = run_status(&f, run, RunStatus::HumanControl).await?;
    }
    assert_eq!(tasks[3], ("check".into(), TaskStatus::Waiting));

    // Handed back: the new task runs and the report gets both results.
    f.client.request(&resume(run), ASK).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let store = flotilla_coordinator::store::RunStore::open(&f.bus).await?;
    let history = store.history(run).await?;
    let report = history
        .iter()
        .find_map(|(_, _, e)| match &e.input {
            RunInput::TaskResult(r) if r.task_id.as_str() == "report" => Some(r.clone()),
            _ => None,
        })
        .expect("the report's result");
    assert!(
        report.result.response.contains("check") && report.result.response.contains("analyse"),
        "{report:?}"
    );
    assert!(
        history
            .iter()
            .any(|(_, _, e)| matches!(e.input, RunInput::PlanEdited(_)))
    );
    // An edit of an ended run: refused.
    let late = f.client.call(&edit(original), ASK).await?;
    assert_eq!(late.err().map(|e| e.code), Some("not_taken_over".into()));
    f.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_edit_through_the_cli_survives_a_coordinator_kill() -> anyhow::Result<()> {
    let config = "[agents.step]\nkind = \"exec\"\ncommand = \"sh\"\n\
                  args = [\"-c\", \"sleep 0.3; echo $FLOTILLA_TASK_ID done\"]\n";
    let mut p = Processes::start(config).await?;
    let coordinator = p.coordinator().await?;
    p.worker(&[]).await?;
    let original = plan(vec![
        Subtask::new("first", "one").with_agent("step"),
        Subtask::new("second", "two")
            .with_agent("step")
            .after(&["first"]),
    ]);
    let run = p
        .client
        .submit(SubmitRequest::new(original.clone()))
        .await?;
    let out = p.cli(&["runs", "takeover", &run.to_string(), "--by", "bob"])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut edited = original.clone();
    edited.subtasks.push(
        Subtask::new("third", "three")
            .with_agent("step")
            .after(&["second"]),
    );
    let file = p.dir().join("edited.json");
    std::fs::write(&file, serde_json::to_vec(&edited)?)?;
    let out = p.cli(&[
        "runs",
        "edit",
        &run.to_string(),
        "--plan",
        &file.to_string_lossy(),
        "--by",
        "bob",
        "--reason",
        "one more step",
    ])?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("3 tasks, 1 added"), "{stdout}");
    // A bad edit through the CLI: exit 1, the problem named.
    let mut bad = edited.clone();
    bad.subtasks[2].dependencies = vec![TaskId::new("nowhere")];
    std::fs::write(&file, serde_json::to_vec(&bad)?)?;
    let out = p.cli(&[
        "runs",
        "edit",
        &run.to_string(),
        "--plan",
        &file.to_string_lossy(),
        "--by",
        "bob",
    ])?;
    assert_eq!(out.status.code(), Some(1));
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("nowhere"), "{said}");

    // The edited plan is the run's, in its log: a new coordinator runs it.
    let deadline = tokio::time::Instant::now() + WAIT;
    while p.client.run(run).await?.map_or(0, |v| v.tasks.len()) != 3 {
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "never edited");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    p.kill(coordinator);
    p.coordinator().await?;
    let out = p.cli(&["runs", "resume", &run.to_string(), "--by", "bob"])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let view = p.client.run(run).await?.expect("the run");
    let ids: Vec<&str> = view.tasks.iter().map(|t| t.task_id.as_str()).collect();
    assert_eq!(ids, ["first", "second", "third"]);
    assert!(
        view.tasks.iter().all(|t| t.status == TaskStatus::Succeeded),
        "{view:?}"
    );
    Ok(())
}
