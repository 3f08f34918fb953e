//! Regression tests for what first use, a foreign client and fault injection found in the
//! DAG spine: oversize results, silent reply subjects, duplicates, cancellation, the failure
//! policy, bad and huge input, MessagePack ids. Services run in this process against a real
//! nats-server; agents are the deterministic `scripted` agent and small `exec` commands.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use flotilla_coordinator::store::RunStore;
use flotilla_model::api::{GetRunRequest, MAX_TASKS_PER_VIEW};
use flotilla_model::codec::Codec;
use flotilla_model::event::{Event, WorkflowPhase};
use flotilla_model::ids::RunId;
use flotilla_model::plan::{PlanConfig, Subtask};
use flotilla_model::run::{RunStatus, RunView, TaskStatus};
use flotilla_model::runlog::RunInput;
use flotilla_model::submit::{SubmitReply, SubmitRequest, SubmitStatus};
use flotilla_model::task::TaskErrorKind;
use flotilla_model::validate::ProblemCode;
use flotilla_worker::agents::{AgentDefinition, ExecConfig, ScriptedConfig};
use futures::StreamExt;
use support::*;

fn agents() -> BTreeMap<String, AgentDefinition> {
    let mut a = BTreeMap::new();
    a.insert("echo".to_string(), scripted("{task_id} ok"));
    a.insert(
        "slow".to_string(),
        AgentDefinition::Scripted(ScriptedConfig {
            delay: Duration::from_secs(20),
            ..ScriptedConfig::default()
        }),
    );
    a.insert(
        "second".to_string(),
        AgentDefinition::Scripted(ScriptedConfig {
            delay: Duration::from_millis(800),
            ..ScriptedConfig::default()
        }),
    );
    a.insert(
        "flaky".to_string(),
        AgentDefinition::Scripted(ScriptedConfig {
            fail_first: 1,
            ..ScriptedConfig::default()
        }),
    );
    a.insert(
        "failing".to_string(),
        AgentDefinition::Scripted(ScriptedConfig {
            fail_first: 100,
            ..ScriptedConfig::default()
        }),
    );
    a.insert(
        "big".to_string(),
        AgentDefinition::Exec(ExecConfig {
            command: "python3".into(),
            args: vec!["-c".into(), "print('x' * 2_000_000)".into()],
            env: BTreeMap::new(),
            cwd: None,
        }),
    );
    a
}

async fn start(workers: usize) -> anyhow::Result<InProcess> {
    InProcess::start(workers, agents()).await
}

fn task(id: &str, agent: &str) -> Subtask {
    Subtask::new(id, "").with_agent(agent)
}

/// Subscribes to `subject` and returns the first message decoded as a `SubmitReply`.
async fn next_reply(sub: &mut async_nats::Subscriber) -> anyhow::Result<SubmitReply> {
    let msg = tokio::time::timeout(WAIT, sub.next())
        .await?
        .ok_or_else(|| anyhow::anyhow!("subscription ended"))?;
    Ok(serde_json::from_slice(&msg.payload)?)
}

/// Every event of a run until its end.
async fn events_until_end(
    f: &InProcess,
    run: RunId,
) -> anyhow::Result<Vec<flotilla_model::event::EventEnvelope>> {
    let events = f.client.events(run).await?;
    futures::pin_mut!(events);
    let mut out = Vec::new();
    tokio::time::timeout(WAIT, async {
        while let Some(e) = events.next().await {
            let e = e?;
            let end = matches!(&e.event, Event::Workflow(w) if w.phase.ends_run());
            out.push(e);
            if end {
                return Ok::<_, anyhow::Error>(());
            }
        }
        anyhow::bail!("event stream ended")
    })
    .await??;
    Ok(out)
}

async fn submit_api(f: &InProcess, request: &SubmitRequest) -> anyhow::Result<SubmitReply> {
    Ok(f.client.submit_request(request, WAIT).await?)
}

// 1. A result over the max payload fails the attempt with `result_too_large` instead of
//    hanging the run.
#[tokio::test]
async fn oversize_result_fails_the_attempt_and_the_run_ends() -> anyhow::Result<()> {
    let f = start(1).await?;
    let mut p = plan(vec![task("huge", "big")]);
    p.config.max_retries = 3;
    let run = f.client.submit(SubmitRequest::new(p)).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed);
    let failed = &outcome.failed[0];
    assert_eq!(failed.error.kind, TaskErrorKind::ResultTooLarge);
    assert_eq!(failed.attempts, 1, "result_too_large is final");
    assert!(
        failed.error.message.contains("artifact") && failed.error.message.contains("bytes"),
        "{}",
        failed.error.message
    );
    f.stop().await;
    Ok(())
}

// 4. Every submission with a reply_to gets exactly one terminal answer there.
#[tokio::test]
async fn reply_to_is_answered_on_rejection_and_duplicates() -> anyhow::Result<()> {
    let f = start(1).await?;
    let mut sub = f.bus.client().subscribe("app.outcomes").await?;

    // Rejected durable submission.
    let mut bad = SubmitRequest::new(plan(vec![
        Subtask::new("a", "").after(&["b"]),
        Subtask::new("b", "").after(&["a"]),
    ]));
    bad.reply_to = Some("app.outcomes".into());
    let bad_run = f.client.submit(bad).await?;
    let reply = next_reply(&mut sub).await?;
    assert_eq!(reply.status, SubmitStatus::Rejected);
    assert_eq!(reply.run_id, Some(bad_run));
    assert_eq!(reply.errors[0].code, ProblemCode::Cycle);

    // A run keyed by an idempotency key only; then a duplicate with the same key.
    let mut first = SubmitRequest::new(plan(vec![task("x", "echo")]));
    first.idempotency_key = Some("order-42".into());
    first.reply_to = Some("app.outcomes".into());
    f.bus
        .publish(f.bus.names().submit(), &first, Some("first-publish"))
        .await?;
    let finished = next_reply(&mut sub).await?;
    assert_eq!(finished.status, SubmitStatus::Finished);
    let original = finished.run_id.expect("run id");
    f.bus
        .publish(f.bus.names().submit(), &first, Some("second-publish"))
        .await?;
    let dup = next_reply(&mut sub).await?;
    assert_eq!(dup.status, SubmitStatus::Duplicate);
    assert_eq!(dup.run_id, Some(original), "the original run's id");
    assert_eq!(dup.run_status, Some(RunStatus::Succeeded));
    f.stop().await;
    Ok(())
}

// 5. A waiting duplicate waits for the original's end, or answers at once if it ended.
#[tokio::test]
async fn waiting_duplicates_get_the_outcome() -> anyhow::Result<()> {
    let f = start(1).await?;
    let mut req = SubmitRequest::new(plan(vec![task("t", "second")]));
    req.run_id = Some(RunId::new());
    req.wait = true;
    let (a, b) = tokio::join!(submit_api(&f, &req), async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        submit_api(&f, &req).await
    });
    for r in [a?, b?] {
        assert_eq!(r.status, SubmitStatus::Finished, "{r:?}");
        assert_eq!(
            r.outcome.as_ref().map(|o| o.status),
            Some(RunStatus::Succeeded)
        );
        assert_eq!(r.run_id, req.run_id);
    }
    // After the end: answered at once.
    let again = submit_api(&f, &req).await?;
    assert_eq!(again.status, SubmitStatus::Finished);
    f.stop().await;
    Ok(())
}

// 6. An invalid reply_to is refused; wait and reply_to together both get the outcome.
#[tokio::test]
async fn reply_to_is_validated_and_honoured_with_wait() -> anyhow::Result<()> {
    let f = start(1).await?;
    let mut req = SubmitRequest::new(plan(vec![task("t", "echo")]));
    req.reply_to = Some("out b *".into());
    let r = submit_api(&f, &req).await?;
    assert_eq!(r.status, SubmitStatus::Rejected);
    assert_eq!(r.errors[0].code, ProblemCode::InvalidReplyTo);
    assert!(r.errors[0].message.contains("out b *"));

    let mut sub = f.bus.client().subscribe("app.both").await?;
    let mut req = SubmitRequest::new(plan(vec![task("t", "echo")]));
    req.reply_to = Some("app.both".into());
    req.wait = true;
    let r = submit_api(&f, &req).await?;
    assert_eq!(r.status, SubmitStatus::Finished);
    let also = next_reply(&mut sub).await?;
    assert_eq!(also.status, SubmitStatus::Finished);
    assert_eq!(also.run_id, r.run_id);
    f.stop().await;
    Ok(())
}

// 7. Cancellation: dispatch stops, running attempts are cancelled on their workers, the run
//    ends `cancelled`; a pool without live workers is warned about at submit.
#[tokio::test]
async fn cancel_stops_a_running_run() -> anyhow::Result<()> {
    let f = start(2).await?;
    let p = plan(vec![
        task("long1", "slow"),
        task("long2", "slow"),
        Subtask::new("after", "")
            .with_agent("echo")
            .after(&["long1"]),
    ]);
    let mut req = SubmitRequest::new(p);
    req.run_id = Some(RunId::new());
    let run = req.run_id.expect("id");
    f.client.submit(req).await?;
    task_started(&f.client, run, "long1").await?;
    task_started(&f.client, run, "long2").await?;
    let started = std::time::Instant::now();
    let reply = f.client.cancel(run, Some("not needed".into())).await?;
    assert!(reply.cancelling);
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Cancelled);
    assert_eq!(outcome.reason.as_deref(), Some("cancelled: not needed"));
    // The attempts were cancelled on the workers (not left to run their 20 s).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let results = results_of(&f.bus, run).await?;
        if results.len() == 2 {
            assert!(results.iter().all(|(_, _, ok)| !ok), "{results:?}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "attempts not cancelled: {results:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(started.elapsed() < Duration::from_secs(15));
    let view = f.client.run(run).await?.expect("run");
    assert!(view.tasks.iter().all(|t| t.status == TaskStatus::Cancelled));
    // Cancelling again says it already ended.
    let again = f.client.cancel(run, None).await?;
    assert!(!again.cancelling);
    assert_eq!(again.status, RunStatus::Cancelled);
    // Unknown run: a structured 404.
    let err = f
        .client
        .cancel(RunId::new(), None)
        .await
        .expect_err("unknown run");
    assert!(err.to_string().contains("not_found"), "{err}");

    // A pool nobody serves is warned about.
    let mut gpu = Subtask::new("g", "");
    gpu.pool = "gpu".into();
    let r = submit_api(&f, &SubmitRequest::new(plan(vec![gpu]))).await?;
    assert_eq!(r.status, SubmitStatus::Accepted);
    assert!(
        r.warnings
            .iter()
            .any(|w| w.code == ProblemCode::NoLiveWorker && w.message.contains("gpu")),
        "{:?}",
        r.warnings
    );
    f.stop().await;
    Ok(())
}

// 8. failure_ratio: 0 aborts at the first failure, keeping partial results.
#[tokio::test]
async fn failure_ratio_aborts_the_run() -> anyhow::Result<()> {
    let f = start(2).await?;
    let mut p = plan(vec![
        task("ok", "echo"),
        task("bad", "failing"),
        task("long", "slow"),
        Subtask::new("later", "")
            .with_agent("echo")
            .after(&["long"]),
    ]);
    for t in &mut p.subtasks {
        t.required = false;
    }
    p.config = PlanConfig {
        failure_ratio: 0.0,
        max_retries: 0,
        ..PlanConfig::default()
    };
    let run = f.client.submit(SubmitRequest::new(p)).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed);
    let reason = outcome.reason.clone().unwrap_or_default();
    assert!(
        reason.starts_with("aborted: 1 of 4 tasks failed"),
        "{reason}"
    );
    let view = f.client.run(run).await?.expect("run");
    let status = |id: &str| {
        view.tasks
            .iter()
            .find(|t| t.task_id.as_str() == id)
            .map(|t| t.status)
    };
    assert_eq!(status("bad"), Some(TaskStatus::Failed));
    assert_eq!(status("later"), Some(TaskStatus::Cancelled));
    assert_eq!(status("long"), Some(TaskStatus::Cancelled));
    if status("ok") == Some(TaskStatus::Succeeded) {
        let fr = outcome.final_result.expect("partial results");
        assert!(fr.partial);
        assert!(fr.results.contains_key(&flotilla_model::TaskId::new("ok")));
    }
    f.stop().await;
    Ok(())
}

// 9. A configuration error is final: an unknown agent is not retried.
#[tokio::test]
async fn unknown_agent_is_not_retried() -> anyhow::Result<()> {
    // The coordinator's catalog knows "ghost"; the only worker does not.
    let mut agents = agents();
    agents.insert("ghost".into(), scripted("never"));
    let mut g = InProcess::start(0, agents).await?;
    let mut worker_agents = BTreeMap::new();
    worker_agents.insert("echo".to_string(), scripted("x"));
    g.agents = worker_agents;
    g.add_worker(Default::default()).await?;
    let mut p = plan(vec![task("t", "ghost")]);
    p.config.max_retries = 3;
    let run = g.client.submit(SubmitRequest::new(p)).await?;
    let outcome = g.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed);
    assert_eq!(outcome.failed[0].error.kind, TaskErrorKind::UnknownAgent);
    assert_eq!(outcome.failed[0].attempts, 1);
    g.stop().await;
    Ok(())
}

// 14. Each attempt's events have their own ids: a retried attempt's task_started is kept.
#[tokio::test]
async fn every_attempt_announces_its_start() -> anyhow::Result<()> {
    let f = start(1).await?;
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![task("t", "flaky")])))
        .await?;
    let events = events_until_end(&f, run).await?;
    let starts: Vec<u32> = events
        .iter()
        .filter(|e| matches!(&e.event, Event::Workflow(w) if w.phase == WorkflowPhase::TaskStarted))
        .filter_map(|e| e.attempt)
        .collect();
    assert_eq!(starts, vec![1, 2], "{events:#?}");
    f.stop().await;
    Ok(())
}

// 18. A claimed idempotency key whose submission never reached the run log (the coordinator
//     died in between) does not make later deliveries `duplicate` of a run that never exists.
#[tokio::test]
async fn a_dangling_idempotency_key_is_completed() -> anyhow::Result<()> {
    let f = start(1).await?;
    let store = RunStore::open(&f.bus).await?;
    let claimed = RunId::new();
    let (id, fresh) = store.claim_idempotency_key("job-7", claimed).await?;
    assert!(fresh && id == claimed);
    // The submission is redelivered after the crash.
    let mut req = SubmitRequest::new(plan(vec![task("t", "echo")]));
    req.idempotency_key = Some("job-7".into());
    let r = submit_api(&f, &req).await?;
    assert_eq!(r.status, SubmitStatus::Accepted, "{r:?}");
    assert_eq!(r.run_id, Some(claimed), "the run the key was claimed for");
    let outcome = f.client.wait(claimed, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded);
    f.stop().await;
    Ok(())
}

// 19. Deep nesting is refused at intake; an unreadable stored entry ends its run visibly.
#[tokio::test]
async fn deep_input_and_unreadable_entries_end_visibly() -> anyhow::Result<()> {
    let f = start(1).await?;
    let nested = |levels: usize| {
        let mut v = serde_json::json!(1);
        for _ in 0..levels {
            v = serde_json::json!([v]);
        }
        v
    };
    // JSON, 120 levels: decodes, but the limit refuses it.
    let mut t = task("t", "echo");
    t.input = nested(120);
    let r = submit_api(&f, &SubmitRequest::new(plan(vec![t]))).await?;
    assert_eq!(r.status, SubmitStatus::Rejected);
    assert_eq!(r.errors[0].code, ProblemCode::InputTooDeep);
    // MessagePack, 200 and 1,000 levels, through the durable intake. The deep input is
    // written byte by byte (fixarray of one, repeated), as a foreign client would send it.
    for levels in [200, 1_000] {
        let mut t = task("t", "echo");
        t.input = serde_json::json!("DEEP-PLACEHOLDER");
        let mut req = SubmitRequest::new(plan(vec![t]));
        let run = RunId::new();
        req.run_id = Some(run);
        let mut out =
            flotilla_bus::wire::encode(&req, Codec::MsgPack, Some(&format!("deep-{levels}")))?;
        let placeholder = rmp_serde::to_vec(&"DEEP-PLACEHOLDER")?;
        let mut deep = vec![0x91u8; levels];
        deep.push(0x01);
        let bytes = out.payload.to_vec();
        let at = bytes
            .windows(placeholder.len())
            .position(|w| w == placeholder.as_slice())
            .expect("placeholder");
        let mut patched = bytes[..at].to_vec();
        patched.extend_from_slice(&deep);
        patched.extend_from_slice(&bytes[at + placeholder.len()..]);
        out.payload = patched.into();
        f.bus.publish_encoded(f.bus.names().submit(), out).await?;
        let outcome = f.client.wait(run, WAIT).await?;
        assert_eq!(outcome.status, RunStatus::Rejected, "{levels} levels");
        let view = f.client.run(run).await?.expect("record");
        assert!(
            view.record
                .errors
                .iter()
                .any(|p| p.code == ProblemCode::InputTooDeep || p.code == ProblemCode::Malformed),
            "{levels}: {:?}",
            view.record.errors
        );
    }
    // A garbage entry on a running run's log.
    let mut req = SubmitRequest::new(plan(vec![task("t", "slow")]));
    let run = RunId::new();
    req.run_id = Some(run);
    f.client.submit(req).await?;
    task_started(&f.client, run, "t").await?;
    f.bus
        .js()
        .publish(f.bus.names().runlog(run), "{not json".into())
        .await?
        .await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed);
    assert!(
        outcome
            .reason
            .as_deref()
            .unwrap_or_default()
            .contains("could not be read"),
        "{outcome:?}"
    );
    // A garbage first entry: the run is recorded failed, not silently missing.
    let ghost = RunId::new();
    f.bus
        .js()
        .publish(f.bus.names().runlog(ghost), "\u{0}garbage".into())
        .await?
        .await?;
    let outcome = f.client.wait(ghost, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed);
    f.stop().await;
    Ok(())
}

// 20. Concurrent valid and invalid submissions of one run id: one fate, decided once.
#[tokio::test]
async fn concurrent_submissions_of_one_run_decide_once() -> anyhow::Result<()> {
    let f = start(1).await?;
    for i in 0..10 {
        let run = RunId::new();
        let mut good = SubmitRequest::new(plan(vec![task("t", "echo")]));
        good.run_id = Some(run);
        let mut bad = SubmitRequest::new(plan(vec![Subtask::new("t", "").after(&["t"])]));
        bad.run_id = Some(run);
        let (a, b) = if i % 2 == 0 {
            // Both through the API.
            let (a, b) = tokio::join!(submit_api(&f, &good), submit_api(&f, &bad));
            (a?, b?)
        } else {
            // One durable, one through the API.
            let mut sub = f.bus.client().subscribe(format!("race.{i}")).await?;
            good.reply_to = Some(format!("race.{i}"));
            let (_, b) = tokio::join!(f.client.submit(good.clone()), submit_api(&f, &bad));
            let mut a = next_reply(&mut sub).await?;
            if a.status == SubmitStatus::Finished {
                a.status = SubmitStatus::Accepted;
            }
            (a, b?)
        };
        let statuses = [a.status, b.status];
        assert!(
            statuses.contains(&SubmitStatus::Duplicate),
            "exactly one winner: {statuses:?}"
        );
        let winner = if a.status == SubmitStatus::Duplicate {
            &b
        } else {
            &a
        };
        let loser = if a.status == SubmitStatus::Duplicate {
            &a
        } else {
            &b
        };
        assert!(
            loser.run_status.is_some(),
            "the loser learns the winner's status"
        );
        let outcome = f.client.wait(run, WAIT).await?;
        match winner.status {
            SubmitStatus::Accepted => assert_eq!(outcome.status, RunStatus::Succeeded),
            SubmitStatus::Rejected => assert_eq!(outcome.status, RunStatus::Rejected),
            s => panic!("unexpected winner status {s:?}"),
        }
    }
    f.stop().await;
    Ok(())
}

// 21. Large plans and large outcomes stay within the deployment's message size.
#[tokio::test]
async fn large_plans_and_outcomes_are_bounded() -> anyhow::Result<()> {
    let f = start(2).await?;
    let long_id = |i: usize| format!("{i:0>128}");
    // 2,000 independent tasks with 128-byte ids: the final result joins 2,000 sinks.
    let mut p = plan(
        (0..2_000)
            .map(|i| Subtask::new(&long_id(i), "").with_agent("echo"))
            .collect(),
    );
    p.config.max_concurrency = 500;
    let run = f.client.submit(SubmitRequest::new(p)).await?;
    let outcome = f.client.wait(run, Duration::from_secs(120)).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded);
    let fr = outcome.final_result.expect("final result");
    let artifact = fr.artifact.expect("stored whole as an artifact");
    assert!(fr.omitted > 0);
    assert!(artifact.size > 256 * 1024);
    let stored = f
        .bus
        .js()
        .get_object_store(&artifact.bucket)
        .await?
        .get(&artifact.name)
        .await?;
    let mut bytes = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut { stored }, &mut bytes).await?;
    assert_eq!(bytes.len() as u64, artifact.size);
    let whole: flotilla_model::run::FinalResult = serde_json::from_slice(&bytes)?;
    assert_eq!(whole.results.len(), 2_000);
    // run.get answers, a page at a time.
    let subject = f.bus.names().api("run.get");
    let body = serde_json::to_vec(&GetRunRequest::new(run))?;
    let reply = f.bus.client().request(subject.clone(), body.into()).await?;
    let view: RunView = serde_json::from_slice(&reply.payload)?;
    assert_eq!(view.tasks.len(), MAX_TASKS_PER_VIEW as usize);
    assert_eq!(view.record.tasks.total, 2_000);
    let body = serde_json::to_vec(&GetRunRequest {
        tasks_offset: 1_500,
        ..GetRunRequest::new(run)
    })?;
    let reply = f.bus.client().request(subject.clone(), body.into()).await?;
    let view: RunView = serde_json::from_slice(&reply.payload)?;
    assert_eq!((view.tasks_offset, view.tasks.len()), (1_500, 500));

    // 2,000 and 6,000 invalid subtasks: a bounded rejection, run.get answers, no poison.
    for n in [2_000, 6_000] {
        let p = plan(
            (0..n)
                .map(|i| {
                    let id = if n == 2_000 {
                        long_id(i)
                    } else {
                        i.to_string()
                    };
                    Subtask::new(&format!("{id}.bad"), "")
                })
                .collect(),
        );
        let mut req = SubmitRequest::new(p);
        let run = RunId::new();
        req.run_id = Some(run);
        f.client.submit(req).await?;
        let outcome = f.client.wait(run, WAIT).await?;
        assert_eq!(outcome.status, RunStatus::Rejected);
        let body = serde_json::to_vec(&GetRunRequest::new(run))?;
        let reply = f.bus.client().request(subject.clone(), body.into()).await?;
        let view: RunView = serde_json::from_slice(&reply.payload)?;
        let errors = &view.record.errors;
        assert_eq!(
            errors.len(),
            flotilla_model::validate::MAX_REPORTED_PROBLEMS
        );
        let last = errors.last().expect("summary");
        assert_eq!(last.code, ProblemCode::TooManyProblems);
    }
    // Nothing left on the intake: no poison message redelivered forever.
    let mut intake = f
        .bus
        .js()
        .get_stream(
            f.bus
                .names()
                .stream(flotilla_model::subjects::StreamKind::Intake),
        )
        .await?;
    assert_eq!(intake.info().await?.state.messages, 0);
    f.stop().await;
    Ok(())
}

// 22. MessagePack submissions carry ids as strings, as JSON does.
#[tokio::test]
async fn msgpack_submission_with_string_run_id_is_accepted() -> anyhow::Result<()> {
    let f = start(1).await?;
    let run = RunId::new();
    let doc = serde_json::json!({
        "run_id": run.to_string(),
        "plan": { "subtasks": [ { "id": "t", "agent": "echo" } ] },
    });
    let bytes = rmp_serde::to_vec_named(&doc)?;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Content-Type", "application/msgpack");
    let reply = f
        .bus
        .client()
        .request_with_headers(f.bus.names().api("submit"), headers, bytes.into())
        .await?;
    let reply: SubmitReply = serde_json::from_slice(&reply.payload)?;
    assert_eq!(reply.status, SubmitStatus::Accepted, "{reply:?}");
    assert_eq!(reply.run_id, Some(run));
    assert_eq!(f.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
    // The history shows the submission as the run's first entry.
    let history = RunStore::open(&f.bus).await?.history(run).await?;
    assert!(matches!(history[0].2.input, RunInput::Submitted(_)));
    f.stop().await;
    Ok(())
}
