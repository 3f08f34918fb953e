//! A worker whose slot is never free — every time it frees, a task already waits for it —
//! against a real nats-server: it still takes a teammate's turn (in line with the waiting
//! tasks), and its stall check does not take the loops that wait for a slot for stalled.
//!
//! The pool's agent is a Rust agent that finishes only when the test lets it, one attempt at
//! a time, and only once another task waits for the slot: the saturation is exact, whatever
//! the machine's speed. The teammate's agent answers at once. Tasks, the teammate's entry,
//! its mail and its turn are published directly (no coordinator or supervisor is needed to
//! show what the worker does).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use flotilla_model::ids::RunId;
use flotilla_model::subjects::{Bucket, StreamKind};
use flotilla_model::task::TaskEnvelope;
use flotilla_model::teammate::{
    Teammate, TeammatePost, TeammateStatus, TurnEnvelope, teammate_key,
};
use flotilla_model::time::Timestamp;
use flotilla_telemetry::Metrics;
use flotilla_testkit::NatsServer;
use flotilla_worker::agent::{Agent, AgentContext, AgentError, AgentReply};
use flotilla_worker::{AgentRegistry, Worker, WorkerOptions};
use futures::future::BoxFuture;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// Finishes once the test adds a permit to `go`.
#[derive(Debug)]
struct Gated {
    go: Arc<Semaphore>,
    ran: Arc<AtomicUsize>,
}

impl Agent for Gated {
    fn run<'a>(
        &'a self,
        _task: &'a TaskEnvelope,
        ctx: AgentContext,
    ) -> BoxFuture<'a, Result<AgentReply, AgentError>> {
        Box::pin(async move {
            tokio::select! {
                p = self.go.acquire() => p.map_err(|e| AgentError::failed(e.to_string()))?.forget(),
                () = ctx.cancel.cancelled() => return Err(AgentError::cancelled("stopping")),
            }
            self.ran.fetch_add(1, Ordering::SeqCst);
            Ok(AgentReply::text("done"))
        })
    }
}

/// A teammate that answers at once.
#[derive(Debug)]
struct Mate;

impl Agent for Mate {
    fn run<'a>(
        &'a self,
        _task: &'a TaskEnvelope,
        _ctx: AgentContext,
    ) -> BoxFuture<'a, Result<AgentReply, AgentError>> {
        Box::pin(async { Ok(AgentReply::text("on it")) })
    }
}

fn task(run: RunId, i: usize) -> anyhow::Result<TaskEnvelope> {
    Ok(serde_json::from_value(serde_json::json!({
        "run_id": run,
        "task_id": format!("t{i}"),
        "attempt": 1,
        "attempt_id": flotilla_model::ids::AttemptId::new(),
        "agent": "gated",
        "pool": "default",
        "required": true,
        "timeout": 600,
        "description": "wait for the test",
        "input": {},
        "dispatched_at": Timestamp::now(),
    }))?)
}

/// The state of a durable consumer of the tasks stream.
async fn consumer(
    bus: &flotilla_bus::Bus,
    name: &str,
) -> anyhow::Result<async_nats::jetstream::consumer::Info> {
    let stream = bus
        .js()
        .get_stream_no_info(bus.names().stream(StreamKind::Tasks))
        .await?;
    Ok(stream.consumer_info(name).await?)
}

/// Tasks delivered to the pool's workers and not acknowledged: the running one and those
/// waiting here for the slot.
async fn held(bus: &flotilla_bus::Bus) -> anyhow::Result<usize> {
    Ok(consumer(bus, &bus.names().pool_consumer("default"))
        .await?
        .num_ack_pending)
}

#[tokio::test]
async fn a_worker_whose_slot_is_never_free_still_takes_a_teammates_turn() -> anyhow::Result<()> {
    let server = NatsServer::start().await?;
    let bus = server.provisioned_bus().await?;
    let go = Arc::new(Semaphore::new(0));
    let ran = Arc::new(AtomicUsize::new(0));
    let mut agents = AgentRegistry::default();
    agents.insert(
        "gated",
        Arc::new(Gated {
            go: Arc::clone(&go),
            ran: Arc::clone(&ran),
        }),
    );
    agents.insert("mate", Arc::new(Mate));
    agents.set_default(Some("gated".into()));
    let opts = WorkerOptions {
        concurrency: 1,
        prefetch: 4,
        heartbeat: Duration::from_millis(200),
        started_event_delay: Duration::ZERO,
        ..WorkerOptions::default()
    };
    let metrics = Metrics::new();
    let stop = CancellationToken::new();
    let worker = Worker::new(server.bus().await?, opts, agents).with_metrics(metrics.clone());
    let running = tokio::spawn(worker.run(stop.clone()));

    let run = RunId::new();
    // Ten tasks queued to start with; one more for each that ends, so the pool never runs
    // dry. Each attempt ends only once other tasks wait for the slot: the slot that frees
    // always goes to a waiting task. (The first three end at once: the worker prefetches only
    // once it knows its attempts are short.)
    let publish = move |bus: flotilla_bus::Bus, i: usize| async move {
        let t = task(run, i)?;
        bus.publish(bus.names().task("default", run, &t.task_id), &t, None)
            .await?;
        anyhow::Ok(())
    };
    for i in 0..10 {
        publish(bus.clone(), i).await?;
    }
    let pumping = CancellationToken::new();
    let pump = {
        let (bus, go, ran, pumping) = (
            bus.clone(),
            Arc::clone(&go),
            Arc::clone(&ran),
            pumping.clone(),
        );
        tokio::spawn(async move {
            let mut next = 10;
            while !pumping.is_cancelled() {
                let before = ran.load(Ordering::SeqCst);
                while before >= 3 && held(&bus).await? < 3 {
                    if pumping.is_cancelled() {
                        return Ok(());
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                go.add_permits(1);
                while ran.load(Ordering::SeqCst) == before {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                publish(bus.clone(), next).await?;
                next += 1;
            }
            anyhow::Ok(())
        })
    };
    // Saturated for a while: a few attempts went by, each handing the slot to a waiting task.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while ran.load(Ordering::SeqCst) < 5 {
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "the pool never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // No pull of the turn queue is left from a moment the slot was free (one waits up to a
    // second): what follows depends on pulls made while it is busy.
    let turns = bus.names().turn_consumer("default");
    while consumer(&bus, &turns).await?.num_waiting > 0 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the turn queue kept a pull waiting"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Mail for a teammate, and its turn on the pool's turn queue (what the supervisor does).
    let kv = bus.kv(Bucket::Team).await?;
    let mut mate = Teammate::spawn(
        "t",
        "ann",
        "analyst",
        "mate",
        "default",
        "help",
        Timestamp::now(),
    );
    mate.wake(Timestamp::now(), 100)
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    kv.put(teammate_key("t", "ann"), serde_json::to_vec(&mate)?.into())
        .await?;
    let post = TeammatePost {
        protocol: 1,
        from: "op".into(),
        text: "hello".into(),
    };
    bus.publish(bus.names().teammate_inbox("t", "ann", "op"), &post, None)
        .await?;
    let turn = TurnEnvelope {
        protocol: 1,
        team: "t".into(),
        name: "ann".into(),
        epoch: mate.dispatch,
    };
    bus.publish(
        bus.names().turn("default", "t", "ann"),
        &turn,
        Some(&turn.msg_id()),
    )
    .await?;

    // The turn runs while the pool stays saturated.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let after = loop {
        let entry = kv
            .get(teammate_key("t", "ann"))
            .await?
            .ok_or_else(|| anyhow::anyhow!("no teammate"))?;
        let now: Teammate = serde_json::from_slice(&entry)?;
        if now.turns == 1 {
            break now;
        }
        if tokio::time::Instant::now() >= deadline {
            let queue = consumer(&bus, &turns).await?;
            anyhow::bail!(
                "the turn was never taken while the slot stayed busy ({} pool attempts ran; turn queue: {} pending, {} delivered, {} pulls waiting): {now:?}",
                ran.load(Ordering::SeqCst),
                queue.num_pending,
                queue.num_ack_pending,
                queue.num_waiting
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(after.status, TeammateStatus::Idle, "{after:?}");
    assert_eq!(after.last_reply.as_deref(), Some("on it"));
    assert!(!pump.is_finished(), "the pool was still saturated");

    // Many heartbeats went by with the loops waiting for a slot: none was taken for stalled.
    let text = metrics.encode()?;
    assert!(
        !text.contains("flotilla_consumer_stalls_total{"),
        "a saturated worker is not stalled: {text}"
    );

    pumping.cancel();
    go.add_permits(1000);
    pump.await??;
    stop.cancel();
    running.await??;
    Ok(())
}
