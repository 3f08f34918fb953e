//! "A run's fate is decided once" and "exactly one terminal answer", on the fast path
//! (`<prefix>.submit.<run>`, the client's own first message) with one and two coordinators:
//! non-canonical and invalid run ids on the subject, `run.get` before the first step is
//! recorded, undecodable bodies, duplicate terminal answers under cancel, abort and
//! redelivery, repeated events with two coordinators, and invalid plans that another
//! coordinator must not start. Agents are the deterministic `scripted` agent.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use flotilla_bus::wire;
use flotilla_coordinator::store::RunStore;
use flotilla_model::event::EventBatch;
use flotilla_model::ids::RunId;
use flotilla_model::plan::Subtask;
use flotilla_model::run::RunStatus;
use flotilla_model::runlog::{Control, ControlAction, RunInput, RunLogEntry};
use flotilla_model::subjects::StreamKind;
use flotilla_model::submit::{SubmitReply, SubmitRequest, SubmitStatus};
use flotilla_model::validate::ProblemCode;
use flotilla_worker::agents::{AgentDefinition, ScriptedConfig};
use futures::StreamExt;
use support::*;

fn agents() -> BTreeMap<String, AgentDefinition> {
    let mut agents = BTreeMap::new();
    agents.insert("echo".to_string(), scripted("{task_id} ok"));
    agents.insert(
        "slow".to_string(),
        AgentDefinition::Scripted(ScriptedConfig {
            reply: "slow ok".into(),
            delay: Duration::from_secs(30),
            ..ScriptedConfig::default()
        }),
    );
    agents.insert(
        "broken".to_string(),
        AgentDefinition::Scripted(ScriptedConfig {
            fail_first: 100,
            ..ScriptedConfig::default()
        }),
    );
    agents
}

/// Publishes `body` as a client's own first message on `subject` (expected last subject
/// sequence 0, as the protocol asks).
async fn publish_first(
    f: &InProcess,
    subject: String,
    body: Vec<u8>,
) -> anyhow::Result<async_nats::jetstream::publish::PublishAck> {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Expected-Last-Subject-Sequence", "0");
    Ok(f.bus
        .js()
        .publish_with_headers(subject, headers, body.into())
        .await?
        .await?)
}

/// The answers published on `subject`, collected until `quiet` passes without one.
async fn answers(sub: &mut async_nats::Subscriber, quiet: Duration) -> Vec<SubmitReply> {
    let mut out = Vec::new();
    while let Ok(Some(msg)) = tokio::time::timeout(quiet, sub.next()).await {
        if let Ok(reply) = serde_json::from_slice::<SubmitReply>(&msg.payload) {
            out.push(reply);
        }
    }
    out
}

/// Waits for the first answer on `sub`.
async fn first_answer(sub: &mut async_nats::Subscriber) -> anyhow::Result<SubmitReply> {
    let msg = tokio::time::timeout(WAIT, sub.next())
        .await?
        .ok_or_else(|| anyhow::anyhow!("reply subscription ended"))?;
    Ok(serde_json::from_slice(&msg.payload)?)
}

async fn tasks_queued(f: &InProcess) -> anyhow::Result<u64> {
    let mut s = f
        .bus
        .js()
        .get_stream(f.bus.names().stream(StreamKind::Tasks))
        .await?;
    Ok(s.info().await?.state.messages)
}

fn request(tasks: Vec<Subtask>, run: RunId, reply_to: &str) -> SubmitRequest {
    let mut req = SubmitRequest::new(plan(tasks));
    req.run_id = Some(run);
    req.reply_to = Some(reply_to.to_owned());
    req
}

#[tokio::test]
async fn a_run_id_has_one_subject_and_a_subject_names_a_run() -> anyhow::Result<()> {
    let f = InProcess::start(1, agents()).await?;
    let run = RunId::new();
    let upper = run.to_string().to_uppercase();
    let inbox = f.bus.client().new_inbox();
    let mut sub = f.bus.client().subscribe(inbox.clone()).await?;

    // The upper-case spelling: refused, naming the canonical form; nothing runs.
    let req = request(vec![Subtask::new("a", "").with_agent("echo")], run, &inbox);
    publish_first(
        &f,
        format!("{}.submit.{upper}", f.bus.names().prefix()),
        serde_json::to_vec(&req)?,
    )
    .await?;
    let refused = first_answer(&mut sub).await?;
    assert_eq!(refused.status, SubmitStatus::Rejected, "{refused:?}");
    assert_eq!(refused.errors[0].code, ProblemCode::NonCanonicalRunId);
    assert!(
        refused.errors[0].message.contains(&run.to_string()),
        "the message names the canonical form: {}",
        refused.errors[0].message
    );
    let derived = refused.run_id.expect("the refusal names its record");
    assert_ne!(derived, run, "recorded under an id derived from the token");
    let store = RunStore::open(&f.bus).await?;
    let record = store
        .record(derived)
        .await?
        .expect("a record of the refusal");
    assert_eq!(record.status, RunStatus::Rejected);
    assert!(
        store.load(run).await?.is_none(),
        "the canonical run does not exist"
    );

    // The canonical subject: the run runs once, and gets one terminal answer.
    publish_first(&f, f.bus.names().submit_run(run), serde_json::to_vec(&req)?).await?;
    let finished = first_answer(&mut sub).await?;
    assert_eq!(finished.status, SubmitStatus::Finished, "{finished:?}");
    assert_eq!(
        finished.outcome.as_ref().map(|o| o.status),
        Some(RunStatus::Succeeded)
    );
    assert!(
        answers(&mut sub, Duration::from_millis(1500))
            .await
            .is_empty()
    );
    assert_eq!(results_of(&f.bus, run).await?.len(), 1, "the task ran once");

    // A token that is no run id at all: refused visibly, under the derived id.
    let mut bad = req.clone();
    bad.run_id = None;
    publish_first(
        &f,
        format!("{}.submit.not-a-uuid", f.bus.names().prefix()),
        serde_json::to_vec(&bad)?,
    )
    .await?;
    let refused = first_answer(&mut sub).await?;
    assert_eq!(refused.status, SubmitStatus::Rejected);
    assert_eq!(refused.errors[0].code, ProblemCode::InvalidRunId);
    let derived = refused.run_id.expect("derived id");
    assert_eq!(
        store.record(derived).await?.map(|r| r.status),
        Some(RunStatus::Rejected)
    );
    assert!(
        answers(&mut sub, Duration::from_millis(500))
            .await
            .is_empty()
    );
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn before_its_first_step_a_fast_path_run_reads_pending() -> anyhow::Result<()> {
    // No coordinator consumes yet: what `run.get` answers comes from the first message alone.
    let server = flotilla_testkit::NatsServer::start().await?;
    let bus = server.provisioned_bus().await?;
    let store = RunStore::open(&bus).await?;
    let mut cases: Vec<(RunId, serde_json::Value)> = Vec::new();
    let cycle = serde_json::json!({"subtasks": [
        {"id": "a", "dependencies": ["b"]}, {"id": "b", "dependencies": ["a"]}]});
    for body in [
        serde_json::json!({"query": "what is up?"}),
        serde_json::json!({"plan": cycle}),
        serde_json::json!({"plan": {"subtasks": [{"id": "a"}, {"id": "a"}]}}),
        serde_json::json!({"run_id": RunId::new(), "plan": {"subtasks": [{"id": "a"}]}}),
        serde_json::json!({"idempotency_key": "k", "plan": {"subtasks": [{"id": "a"}]}}),
        serde_json::json!({"plan": {"subtasks": 5}}),
        serde_json::json!({"plan": {"subtasks": [{"id": "ok"}]}}),
    ] {
        let run = RunId::new();
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Expected-Last-Subject-Sequence", "0");
        bus.js()
            .publish_with_headers(
                bus.names().submit_run(run),
                headers,
                serde_json::to_vec(&body)?.into(),
            )
            .await?
            .await?;
        cases.push((run, body));
    }
    for (run, body) in cases {
        let view = store
            .view(run, 0, 100)
            .await?
            .ok_or_else(|| anyhow::anyhow!("no view of {run} ({body})"))?;
        assert_eq!(
            view.record.status,
            RunStatus::Pending,
            "{body}: a status computed from an unvalidated body"
        );
        assert!(view.tasks.is_empty(), "{body}: no tasks before validation");
        assert!(view.record.outcome.is_none());
    }
    Ok(())
}

#[tokio::test]
async fn an_undecodable_fast_path_body_is_rejected_with_one_answer() -> anyhow::Result<()> {
    let f = InProcess::start(0, agents()).await?;
    let run = RunId::new();
    let inbox = f.bus.client().new_inbox();
    let mut sub = f.bus.client().subscribe(inbox.clone()).await?;
    let body = serde_json::json!({
        "run_id": run, "reply_to": inbox, "plan": {"subtasks": 5}, "labels": 7
    });
    publish_first(
        &f,
        f.bus.names().submit_run(run),
        serde_json::to_vec(&body)?,
    )
    .await?;
    let answer = first_answer(&mut sub).await?;
    assert_eq!(answer.status, SubmitStatus::Rejected, "{answer:?}");
    assert_eq!(answer.run_id, Some(run));
    // Every problem at once, each with its path.
    let paths: BTreeSet<&str> = answer
        .errors
        .iter()
        .filter(|p| p.code == ProblemCode::Malformed)
        .map(|p| p.path.as_str())
        .collect();
    assert!(paths.len() >= 2, "{:?}", answer.errors);
    assert!(
        answers(&mut sub, Duration::from_millis(1500))
            .await
            .is_empty()
    );
    let store = RunStore::open(&f.bus).await?;
    let record = store.record(run).await?.expect("recorded");
    assert_eq!(record.status, RunStatus::Rejected);
    assert!(!record.errors.is_empty(), "the record names the problems");
    assert_eq!(tasks_queued(&f).await?, 0);
    f.stop().await;
    Ok(())
}

/// Waits until `run`'s record says `status`.
async fn wait_status(f: &InProcess, run: RunId, status: RunStatus) -> anyhow::Result<()> {
    let store = RunStore::open(&f.bus).await?;
    tokio::time::timeout(WAIT, async {
        loop {
            if store.record(run).await?.map(|r| r.status) == Some(status) {
                return Ok::<_, anyhow::Error>(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await?
}

#[tokio::test]
async fn cancel_abort_and_redelivery_answer_once() -> anyhow::Result<()> {
    let f = InProcess::start(2, agents()).await?;
    let inbox = f.bus.client().new_inbox();
    let mut sub = f.bus.client().subscribe(inbox.clone()).await?;

    // Cancel with two running attempts: their late `cancelled` results must not answer again.
    let run = RunId::new();
    let req = request(
        vec![
            Subtask::new("a", "").with_agent("slow"),
            Subtask::new("b", "").with_agent("slow"),
        ],
        run,
        &inbox,
    );
    f.client.submit(req).await?;
    task_started(&f.client, run, "a").await?;
    task_started(&f.client, run, "b").await?;
    f.client.cancel(run, Some("enough".into())).await?;
    wait_status(&f, run, RunStatus::Cancelled).await?;
    // Both attempts report back (cancelled) after the end.
    tokio::time::timeout(WAIT, async {
        while results_of(&f.bus, run).await?.len() < 2 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok::<_, anyhow::Error>(())
    })
    .await??;
    let got = answers(&mut sub, Duration::from_millis(1500)).await;
    assert_eq!(got.len(), 1, "one terminal answer under cancel: {got:?}");
    assert_eq!(
        got[0].outcome.as_ref().map(|o| o.status),
        Some(RunStatus::Cancelled)
    );

    // Abort by the failure policy (ratio 0: the first failure), with a running attempt.
    let run = RunId::new();
    let mut req = request(
        vec![
            Subtask::new("bad", "").with_agent("broken"),
            Subtask::new("long", "").with_agent("slow"),
        ],
        run,
        &inbox,
    );
    if let Some(p) = req.plan.as_mut() {
        p.config.failure_ratio = 0.0;
        p.config.max_retries = 0;
    }
    f.client.submit(req).await?;
    wait_status(&f, run, RunStatus::Failed).await?;
    tokio::time::timeout(WAIT, async {
        while results_of(&f.bus, run).await?.len() < 2 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok::<_, anyhow::Error>(())
    })
    .await??;
    let got = answers(&mut sub, Duration::from_millis(1500)).await;
    assert_eq!(got.len(), 1, "one terminal answer under abort: {got:?}");

    // A result delivered again after the end (a worker's redelivered publish under another
    // message id): no second answer.
    let run = RunId::new();
    f.client
        .submit(request(
            vec![Subtask::new("a", "").with_agent("echo")],
            run,
            &inbox,
        ))
        .await?;
    wait_status(&f, run, RunStatus::Succeeded).await?;
    let store = RunStore::open(&f.bus).await?;
    let result = store
        .history(run)
        .await?
        .into_iter()
        .find_map(|(_, _, e)| match e.input {
            RunInput::TaskResult(r) => Some(r),
            _ => None,
        })
        .expect("a result");
    let entry = RunLogEntry {
        protocol: flotilla_model::PROTOCOL_VERSION,
        run_id: run,
        input: RunInput::TaskResult(result),
    };
    f.bus
        .publish(f.bus.names().runlog(run), &entry, Some("again-1"))
        .await?;
    let got = answers(&mut sub, Duration::from_millis(1500)).await;
    assert_eq!(
        got.len(),
        1,
        "one terminal answer with a repeated result: {got:?}"
    );
    f.stop().await;
    Ok(())
}

/// Reads every event message stored for `run` and checks that no event is stored in two of
/// them; returns how many events are stored.
async fn events_stored_once(bus: &flotilla_bus::Bus, run: RunId) -> anyhow::Result<usize> {
    let stream = bus
        .js()
        .get_stream(bus.names().stream(StreamKind::Events))
        .await?;
    let subject = bus.names().event(run);
    let mut seen = BTreeSet::new();
    let mut seq = 0u64;
    while let Ok(msg) = stream
        .direct_get_next_for_subject(&subject, Some(seq + 1))
        .await
    {
        seq = msg.sequence;
        let batch = wire::decode::<EventBatch>(Some(&msg.headers), &msg.payload)?;
        for e in batch.events {
            anyhow::ensure!(
                seen.insert(e.id.clone()),
                "event {} of run {run} is stored twice",
                e.id
            );
        }
    }
    Ok(seen.len())
}

#[tokio::test]
async fn two_coordinators_store_each_event_once() -> anyhow::Result<()> {
    let mut f = InProcess::start(2, agents()).await?;
    f.add_coordinator().await?;
    let mut runs = Vec::new();
    for _ in 0..6 {
        let tasks: Vec<Subtask> = (0..5)
            .map(|i| {
                let t = Subtask::new(&format!("t{i}"), "").with_agent("echo");
                if i == 0 {
                    t
                } else {
                    t.after(&[&format!("t{}", i - 1)])
                }
            })
            .collect();
        let mut req = SubmitRequest::new(plan(tasks));
        let run = RunId::new();
        req.run_id = Some(run);
        f.client.submit(req).await?;
        runs.push(run);
    }
    for &run in &runs {
        assert_eq!(f.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
    }
    for &run in &runs {
        assert!(events_stored_once(&f.bus, run).await? >= 11);
    }
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_run_handed_to_another_coordinator_stores_each_event_once() -> anyhow::Result<()> {
    // Coordinator A performs the first steps of a chain, then stops; B loads the run from its
    // record (and performs A's last outbox again, in case A died before performing it). No
    // event may be stored twice: A's events must not travel on in B's messages.
    let server = flotilla_testkit::NatsServer::start().await?;
    let bus = server.provisioned_bus().await?;
    let mut agents = BTreeMap::new();
    agents.insert(
        "half".to_string(),
        AgentDefinition::Scripted(ScriptedConfig {
            reply: "done".into(),
            delay: Duration::from_millis(400),
            ..ScriptedConfig::default()
        }),
    );
    let registry = flotilla_worker::AgentRegistry::from_definitions(
        &agents,
        Some("half".into()),
        &root().join("config"),
    )
    .map_err(anyhow::Error::msg)?;
    let worker_stop = tokio_util::sync::CancellationToken::new();
    let worker = flotilla_worker::Worker::new(
        server.bus().await?,
        flotilla_worker::WorkerOptions::default(),
        registry,
    );
    let w = worker_stop.clone();
    let worker = tokio::spawn(async move {
        let _ = worker.run(w).await;
    });
    let (stop_a, a) = coordinator(&bus).await?;
    let tasks: Vec<Subtask> = (0..4)
        .map(|i| {
            let t = Subtask::new(&format!("t{i}"), "");
            if i == 0 {
                t
            } else {
                t.after(&[&format!("t{}", i - 1)])
            }
        })
        .collect();
    let client = flotilla_client::Client::new(bus.clone());
    let mut req = SubmitRequest::new(plan(tasks));
    let run = RunId::new();
    req.run_id = Some(run);
    client.submit(req).await?;
    task_started(&client, run, "t1").await?;
    stop_a.cancel();
    a.await?;
    let (stop_b, b) = coordinator(&bus).await?;
    assert_eq!(client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
    let stored = events_stored_once(&bus, run).await?;
    assert!(stored >= 9, "the chain's events are stored: {stored}");
    stop_b.cancel();
    b.await?;
    worker_stop.cancel();
    worker.await?;
    Ok(())
}

/// A coordinator of the test's deployment (the agents of [`agents`]) on `bus`, until the
/// token is cancelled.
async fn coordinator(
    bus: &flotilla_bus::Bus,
) -> anyhow::Result<(
    tokio_util::sync::CancellationToken,
    tokio::task::JoinHandle<()>,
)> {
    let ctx = flotilla_model::validate::ValidationContext {
        pools: Some(["default".to_string()].into()),
        agents: Some(flotilla_model::validate::AgentCatalog {
            names: agents().keys().cloned().collect(),
            default: Some("echo".into()),
            workflows: Default::default(),
            roles: Default::default(),
            compensations: Default::default(),
        }),
        ..Default::default()
    };
    let c = flotilla_coordinator::Coordinator::new(
        bus.clone(),
        flotilla_coordinator::CoordinatorOptions::default(),
        ctx,
        flotilla_bus::JetStreamOptions::default(),
    );
    let token = tokio_util::sync::CancellationToken::new();
    let t = token.clone();
    let handle = tokio::spawn(async move {
        if let Err(e) = c.run(t).await {
            panic!("coordinator failed: {e}");
        }
    });
    wait_for_api(bus).await?;
    Ok((token, handle))
}

#[tokio::test]
async fn an_invalid_fast_path_plan_is_never_started_by_another_coordinator() -> anyhow::Result<()> {
    // One coordinator binds the shared run-log consumer, then stops; the test takes each
    // client's invalid submission from that consumer and holds it, so the next coordinator
    // meets the run through another input first and must rebuild it from its first message
    // (what a second coordinator does when another input of a run reaches it first).
    let server = flotilla_testkit::NatsServer::start().await?;
    let bus = server.provisioned_bus().await?;
    let (stop, handle) = coordinator(&bus).await?;
    stop.cancel();
    handle.await?;
    let consumer: async_nats::jetstream::consumer::PullConsumer = bus
        .js()
        .get_stream(bus.names().stream(StreamKind::RunLog))
        .await?
        .get_consumer(bus.names().runlog_consumer())
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let cases = [
        (
            "blank task id",
            serde_json::json!({"subtasks": [{"id": " "}]}),
        ),
        (
            "self dependency",
            serde_json::json!({"subtasks": [{"id": "a", "dependencies": ["a"]}]}),
        ),
        (
            "unknown agent",
            serde_json::json!({"subtasks": [{"id": "a", "agent": "nobody"}]}),
        ),
    ];
    let mut runs = Vec::new();
    for (what, plan) in &cases {
        let run = RunId::new();
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Expected-Last-Subject-Sequence", "0");
        let body = serde_json::json!({"run_id": run, "plan": plan});
        bus.js()
            .publish_with_headers(
                bus.names().submit_run(run),
                headers,
                serde_json::to_vec(&body)?.into(),
            )
            .await?
            .await?;
        runs.push((run, *what));
    }
    // Take the submissions and hold them (unacknowledged; the ack wait is 10 s).
    let mut held = Vec::new();
    let mut batch = consumer.fetch().max_messages(runs.len()).messages().await?;
    while held.len() < runs.len() {
        let msg = batch
            .next()
            .await
            .ok_or_else(|| anyhow::anyhow!("not every submission was delivered"))?
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        held.push(msg);
    }
    // Another input of each run arrives first.
    for (run, _) in &runs {
        let entry = RunLogEntry {
            protocol: flotilla_model::PROTOCOL_VERSION,
            run_id: *run,
            input: RunInput::Control(Control {
                action: ControlAction::Cancel,
                reason: Some("probe".into()),
                by: None,
                timeout_ms: None,
                rollback: false,
                task_id: None,
                reply_to: None,
            }),
        };
        bus.publish(bus.names().runlog(*run), &entry, None).await?;
    }
    // A coordinator of the same deployment now meets those inputs.
    let (stop, handle) = coordinator(&bus).await?;
    let store = RunStore::open(&bus).await?;
    for (run, what) in &runs {
        let record = tokio::time::timeout(WAIT, async {
            loop {
                if let Some(r) = store.record(*run).await?
                    && r.status.is_terminal()
                {
                    return Ok::<_, anyhow::Error>(r);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await??;
        assert_eq!(record.status, RunStatus::Rejected, "{what}: {record:?}");
    }
    let mut tasks = bus
        .js()
        .get_stream(bus.names().stream(StreamKind::Tasks))
        .await?;
    assert_eq!(
        tasks.info().await?.state.messages,
        0,
        "nothing was dispatched"
    );
    drop(held);
    stop.cancel();
    handle.await?;
    Ok(())
}

/// Validation is the same on every path: an unknown agent or pool is refused at submission on
/// the fast path (the run's own first message) as on the intake stream and the endpoint,
/// with the same problems in the same order — a plan that is wrong and names a parent that
/// is no run is told of its plan alone on every path (the parent is read once the rest
/// holds).
#[tokio::test]
async fn unknown_agents_and_pools_are_refused_on_every_path() -> anyhow::Result<()> {
    let f = InProcess::start(0, agents()).await?;
    let store = RunStore::open(&f.bus).await?;
    let no_parent = Some(flotilla_model::run::RunHandle::root(RunId::new()));
    for (what, task, parent, code) in [
        (
            "unknown agent",
            Subtask::new("a", "").with_agent("nobody"),
            None,
            ProblemCode::UnknownAgent,
        ),
        (
            "unknown pool",
            {
                let mut t = Subtask::new("a", "").with_agent("echo");
                t.pool = "nowhere".into();
                t
            },
            None,
            ProblemCode::UnknownPool,
        ),
        (
            "unknown agent and parent",
            Subtask::new("a", "").with_agent("nobody"),
            no_parent.clone(),
            ProblemCode::UnknownAgent,
        ),
    ] {
        let codes = |errors: &[flotilla_model::problem::Problem]| -> Vec<ProblemCode> {
            errors.iter().map(|p| p.code).collect()
        };
        // The endpoint answers at once.
        let mut req = SubmitRequest::new(plan(vec![task.clone()]));
        req.parent = parent.clone();
        let reply = f.client.submit_request(&req, WAIT).await?;
        assert_eq!(reply.status, SubmitStatus::Rejected, "{what}: {reply:?}");
        assert_eq!(codes(&reply.errors), [code], "{what}");
        // The intake stream (with an idempotency key) and the fast path record a rejection.
        req.idempotency_key = Some(format!("key-{what}"));
        let keyed = RunId::new();
        req.run_id = Some(keyed);
        f.bus
            .publish(f.bus.names().submit(), &req, Some(&format!("k-{what}")))
            .await?;
        let fast = RunId::new();
        let mut req = SubmitRequest::new(plan(vec![task]));
        req.run_id = Some(fast);
        req.parent = parent;
        f.client.submit(req).await?;
        for run in [keyed, fast] {
            let record = tokio::time::timeout(WAIT, async {
                loop {
                    if let Some(r) = store.record(run).await?
                        && r.status.is_terminal()
                    {
                        return Ok::<_, anyhow::Error>(r);
                    }
                    tokio::time::sleep(Duration::from_millis(25)).await;
                }
            })
            .await??;
            assert_eq!(record.status, RunStatus::Rejected, "{what}: {record:?}");
            assert_eq!(codes(&record.errors), [code], "{what}: {record:?}");
        }
    }
    assert_eq!(tasks_queued(&f).await?, 0, "nothing was dispatched");
    f.stop().await;
    Ok(())
}
