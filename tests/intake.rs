//! Submissions: idempotency, and bad input on the intake stream and the submit endpoint.
//! Bad input gets a structured rejection, nothing is dispatched, and the coordinator keeps
//! working. The agent is the deterministic `scripted` agent.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use flotilla_coordinator::store::RunStore;
use flotilla_model::api::{ApiError, GetRunRequest};
use flotilla_model::ids::RunId;
use flotilla_model::plan::Subtask;
use flotilla_model::run::{RunStatus, RunView};
use flotilla_model::subjects::StreamKind;
use flotilla_model::submit::{SubmitReply, SubmitRequest, SubmitStatus};
use flotilla_model::validate::ProblemCode;
use support::*;

async fn start(workers: usize) -> anyhow::Result<InProcess> {
    let mut agents = BTreeMap::new();
    agents.insert("echo".to_string(), scripted("{task_id} ok"));
    InProcess::start(workers, agents).await
}

fn one_task() -> flotilla_model::Plan {
    plan(vec![Subtask::new("only", "x")])
}

fn cyclic() -> flotilla_model::Plan {
    plan(vec![
        Subtask::new("a", "").after(&["b"]),
        Subtask::new("b", "").after(&["a"]),
    ])
}

async fn tasks_queued(f: &InProcess) -> anyhow::Result<u64> {
    let mut s = f
        .bus
        .js()
        .get_stream(f.bus.names().stream(StreamKind::Tasks))
        .await?;
    Ok(s.info().await?.state.messages)
}

async fn request(
    f: &InProcess,
    subject: &str,
    body: Vec<u8>,
) -> anyhow::Result<async_nats::Message> {
    Ok(tokio::time::timeout(
        Duration::from_secs(10),
        f.bus.client().request(subject.to_owned(), body.into()),
    )
    .await??)
}

#[tokio::test]
async fn same_run_id_or_idempotency_key_yields_one_run() -> anyhow::Result<()> {
    let f = start(1).await?;
    let run = RunId::new();
    let mut req = SubmitRequest::new(one_task());
    req.run_id = Some(run);
    // Twice through the intake stream with different message ids: JetStream cannot dedupe,
    // the coordinator must.
    for key in ["first", "second"] {
        f.bus
            .publish(f.bus.names().submit(), &req, Some(key))
            .await?;
    }
    assert_eq!(f.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
    // And once more through the endpoint, after the run finished.
    let again = f
        .client
        .submit_request(&req, Duration::from_secs(10))
        .await?;
    assert_eq!(again.status, SubmitStatus::Duplicate);
    assert_eq!(again.run_id, Some(run));
    let results = results_of(&f.bus, run).await?;
    assert_eq!(results.len(), 1, "the task ran once: {results:?}");
    let store = RunStore::open(&f.bus).await?;
    let submitted = store
        .history(run)
        .await?
        .into_iter()
        .filter(|(_, _, e)| matches!(e.input, flotilla_model::runlog::RunInput::Submitted(_)))
        .count();
    assert_eq!(submitted, 1);

    // The same idempotency key with different run ids: the second maps to the first run.
    let mut a = SubmitRequest::new(one_task());
    a.idempotency_key = Some("order-42".into());
    a.run_id = Some(RunId::new());
    let mut b = a.clone();
    b.run_id = Some(RunId::new());
    let ra = f.client.submit_request(&a, Duration::from_secs(10)).await?;
    let rb = f.client.submit_request(&b, Duration::from_secs(10)).await?;
    assert_eq!(ra.status, SubmitStatus::Accepted);
    assert_eq!(rb.status, SubmitStatus::Duplicate);
    assert_eq!(rb.run_id, a.run_id, "the key names the first run");
    assert!(
        store.load(b.run_id.expect("id")).await?.is_none(),
        "no second run exists"
    );
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn bad_input_on_the_intake_stream_is_rejected_and_nothing_runs() -> anyhow::Result<()> {
    // No workers: anything dispatched would stay queued and be seen.
    let f = start(0).await?;
    let store = RunStore::open(&f.bus).await?;

    // Malformed JSON. The message id makes the rejection findable.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "garbage-1");
    f.bus
        .js()
        .publish_with_headers(f.bus.names().submit(), headers, "{\"plan\": [oops".into())
        .await?
        .await?;
    // A cycle, with a run id.
    let cyclic_run = RunId::new();
    let mut req = SubmitRequest::new(cyclic());
    req.run_id = Some(cyclic_run);
    f.client.submit(req).await?;
    let outcome = f.client.wait(cyclic_run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Rejected);

    let view = store
        .view(cyclic_run, 0, usize::MAX)
        .await?
        .expect("rejected record");
    assert_eq!(view.record.status, RunStatus::Rejected);
    let cycle = &view.record.errors[0];
    assert_eq!(cycle.code, ProblemCode::Cycle);
    assert_eq!(cycle.tasks, vec!["a".to_string(), "b".to_string()]);
    let history = store.history(cyclic_run).await?;
    assert_eq!(
        history.len(),
        2,
        "the submission, then its rejection: {history:?}"
    );
    assert!(
        matches!(
            history[1].2.input,
            flotilla_model::runlog::RunInput::Rejected(_)
        ),
        "{history:?}"
    );

    // The malformed one is a rejected run too.
    let deadline = tokio::time::Instant::now() + WAIT;
    let malformed = loop {
        let mut found = None;
        for id in store.list().await? {
            let v = store.view(id, 0, usize::MAX).await?.expect("listed");
            if v.record
                .errors
                .iter()
                .any(|p| p.code == ProblemCode::Malformed)
            {
                found = Some(v);
            }
        }
        if let Some(v) = found {
            break v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no rejection recorded for the malformed submission"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(malformed.record.status, RunStatus::Rejected);
    assert!(
        malformed.record.errors[0].message.contains("malformed"),
        "{:?}",
        malformed.record.errors
    );
    assert_eq!(tasks_queued(&f).await?, 0, "nothing was dispatched");

    // The coordinator keeps working.
    let mut plan = one_task();
    plan.config.max_concurrency = 1;
    let ok = SubmitRequest::new(plan);
    let good = f.client.submit(ok).await?;
    let deadline = tokio::time::Instant::now() + WAIT;
    while tasks_queued(&f).await? == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the valid plan was not dispatched"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Its start is recorded with its next step or after the flush delay (until then it reads
    // `pending`): with no worker, after the delay.
    loop {
        let status = store
            .view(good, 0, usize::MAX)
            .await?
            .expect("run")
            .record
            .status;
        if status == RunStatus::Running {
            break;
        }
        assert_eq!(status, RunStatus::Pending);
        assert!(
            tokio::time::Instant::now() < deadline,
            "the valid plan's start was not recorded"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn the_submit_endpoint_answers_bad_input_with_every_problem() -> anyhow::Result<()> {
    let f = start(1).await?;
    let subject = f.bus.names().api("submit");
    let answer = |m: async_nats::Message| -> anyhow::Result<SubmitReply> {
        Ok(serde_json::from_slice(&m.payload)?)
    };

    let r = answer(request(&f, &subject, b"not json".to_vec()).await?)?;
    assert_eq!(r.status, SubmitStatus::Rejected);
    assert_eq!(r.errors[0].code, ProblemCode::Malformed);

    let r = answer(
        request(
            &f,
            &subject,
            br#"{"plan":{"subtasks":[{"id":"a","depends_on":["b"]}]}}"#.to_vec(),
        )
        .await?,
    )?;
    assert_eq!(r.errors[0].code, ProblemCode::Malformed);
    assert!(
        r.errors[0].message.contains("depends_on"),
        "names the unknown field: {}",
        r.errors[0].message
    );

    let r = answer(
        request(
            &f,
            &subject,
            br#"{"protocol": 99, "plan":{"subtasks":[{"id":"a"}]}}"#.to_vec(),
        )
        .await?,
    )?;
    assert_eq!(r.errors[0].code, ProblemCode::UnsupportedProtocol);

    let mut bad = one_task();
    bad.subtasks.push(Subtask::new("x.y", "").after(&["ghost"]));
    bad.subtasks[0].pool = "nowhere".into();
    bad.subtasks[0].agent = Some("nobody".into());
    let r = f
        .client
        .submit_request(&SubmitRequest::new(bad), Duration::from_secs(10))
        .await?;
    assert_eq!(r.status, SubmitStatus::Rejected);
    let codes: Vec<ProblemCode> = r.errors.iter().map(|p| p.code).collect();
    for c in [
        ProblemCode::InvalidTaskId,
        ProblemCode::UnknownDependency,
        ProblemCode::UnknownPool,
        ProblemCode::UnknownAgent,
    ] {
        assert!(codes.contains(&c), "{c} missing from {codes:?}");
    }
    let run = r.run_id.expect("a rejected run has an id");
    assert_eq!(
        f.client.run(run).await?.expect("record").record.status,
        RunStatus::Rejected
    );

    // A valid plan, waiting for the end: the reply carries the outcome.
    let mut wait = SubmitRequest::new(one_task());
    wait.wait = true;
    let r = f
        .client
        .submit_request(&wait, Duration::from_secs(30))
        .await?;
    assert_eq!(r.status, SubmitStatus::Finished);
    let outcome = r.outcome.expect("outcome");
    assert_eq!(outcome.status, RunStatus::Succeeded);
    assert_eq!(outcome.final_result.expect("result").response, "only ok");
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn run_get_endpoint_answers_views_and_structured_errors() -> anyhow::Result<()> {
    let f = start(1).await?;
    let subject = f.bus.names().api("run.get");
    let run = f.client.submit(SubmitRequest::new(one_task())).await?;
    f.client.wait(run, WAIT).await?;
    let body = serde_json::to_vec(&GetRunRequest::new(run))?;
    let view: RunView = serde_json::from_slice(&request(&f, &subject, body).await?.payload)?;
    assert_eq!(view.record.status, RunStatus::Succeeded);
    assert_eq!(view.tasks[0].task_id.as_str(), "only");

    let body = serde_json::to_vec(&GetRunRequest::new(RunId::new()))?;
    let reply = request(&f, &subject, body).await?;
    let headers = reply.headers.clone().expect("error headers");
    assert_eq!(
        headers.get("Nats-Service-Error-Code").map(|v| v.as_str()),
        Some("404")
    );
    let err: ApiError = serde_json::from_slice(&reply.payload)?;
    assert_eq!((err.status, err.code.as_str()), (404, "not_found"));

    let reply = request(&f, &subject, b"{\"run\": 1}".to_vec()).await?;
    let err: ApiError = serde_json::from_slice(&reply.payload)?;
    assert_eq!((err.status, err.code.as_str()), (400, "malformed"));

    // A page size out of range is refused by name, as ws.read refuses one, not lowered.
    for limit in [0, 1001, u32::MAX] {
        let body = serde_json::to_vec(&GetRunRequest {
            tasks_limit: Some(limit),
            ..GetRunRequest::new(run)
        })?;
        let err: ApiError = serde_json::from_slice(&request(&f, &subject, body).await?.payload)?;
        assert_eq!((err.status, err.code.as_str()), (400, "invalid_limit"));
        assert!(
            err.message.contains("tasks_limit") && err.message.contains("1 to 1000"),
            "{}",
            err.message
        );
    }
    for limit in [1, 1000] {
        let body = serde_json::to_vec(&GetRunRequest {
            tasks_limit: Some(limit),
            ..GetRunRequest::new(run)
        })?;
        let view: RunView = serde_json::from_slice(&request(&f, &subject, body).await?.payload)?;
        assert_eq!(view.tasks.len(), 1);
    }
    f.stop().await;
    Ok(())
}

/// A plan with type errors and a cycle: every path reports every problem at once — the
/// intake stream's rejection, the submit endpoint (JSON and MessagePack) and the validate
/// endpoint — instead of one `malformed` for the first wrong field.
#[tokio::test]
async fn type_errors_and_plan_errors_are_reported_together_on_every_path() -> anyhow::Result<()> {
    use flotilla_model::api::ValidatePlanReply;
    use flotilla_model::validate::Problem;
    let f = start(0).await?;
    let bad_plan = serde_json::json!({
        "subtasks": [
            {"id": "a", "timeout": "banana", "dependencies": ["b"]},
            {"id": "b", "dependencies": ["a"], "required": "no"}
        ],
        "config": {"max_retries": "many"}
    });
    let expected = |problems: &[Problem], what: &str| {
        let found: Vec<(&str, ProblemCode)> =
            problems.iter().map(|p| (p.path.as_str(), p.code)).collect();
        for want in [
            ("subtasks[0].timeout", ProblemCode::Malformed),
            ("subtasks[1].required", ProblemCode::Malformed),
            ("config.max_retries", ProblemCode::Malformed),
        ] {
            assert!(found.contains(&want), "{what}: {want:?} not in {found:?}");
        }
        assert!(
            problems.iter().any(|p| p.code == ProblemCode::Cycle),
            "{what}: no cycle in {found:?}"
        );
    };

    // The durable intake: the rejection is the run's record.
    let run = RunId::new();
    let body = serde_json::json!({"run_id": run, "plan": bad_plan});
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", format!("typed-{run}").as_str());
    f.bus
        .js()
        .publish_with_headers(
            f.bus.names().submit(),
            headers,
            serde_json::to_vec(&body)?.into(),
        )
        .await?
        .await?;
    assert_eq!(f.client.wait(run, WAIT).await?.status, RunStatus::Rejected);
    let store = RunStore::open(&f.bus).await?;
    let view = store.view(run, 0, usize::MAX).await?.expect("rejected");
    expected(&view.record.errors, "intake");

    // The submit endpoint, in JSON and in MessagePack.
    let subject = f.bus.names().api("submit");
    let body = serde_json::json!({"plan": bad_plan});
    let reply: SubmitReply = serde_json::from_slice(
        &request(&f, &subject, serde_json::to_vec(&body)?)
            .await?
            .payload,
    )?;
    assert_eq!(reply.status, SubmitStatus::Rejected);
    expected(&reply.errors, "api.submit");
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Content-Type", "application/msgpack");
    let answer = tokio::time::timeout(
        Duration::from_secs(10),
        f.bus.client().request_with_headers(
            subject,
            headers,
            rmp_serde::to_vec_named(&body)?.into(),
        ),
    )
    .await??;
    let reply: SubmitReply = serde_json::from_slice(&answer.payload)?;
    expected(&reply.errors, "api.submit (MessagePack)");

    // The validate endpoint answers the plan's problems; a malformed request is still 400.
    let subject = f.bus.names().api("plan.validate");
    let body = serde_json::json!({"plan": bad_plan});
    let reply: ValidatePlanReply = serde_json::from_slice(
        &request(&f, &subject, serde_json::to_vec(&body)?)
            .await?
            .payload,
    )?;
    expected(&reply.errors, "api.plan.validate");
    let body = serde_json::json!({"plans": bad_plan});
    let err: ApiError = serde_json::from_slice(
        &request(&f, &subject, serde_json::to_vec(&body)?)
            .await?
            .payload,
    )?;
    assert_eq!((err.status, err.code.as_str()), (400, "malformed"));
    assert!(err.message.contains("plans"), "{}", err.message);
    assert_eq!(tasks_queued(&f).await?, 0, "nothing was dispatched");
    f.stop().await;
    Ok(())
}
