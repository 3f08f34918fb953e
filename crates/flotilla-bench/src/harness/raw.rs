//! The plain JetStream baseline (section `raw`): the bench's own task round trip — publish a
//! task to a work-queue stream → a worker pulls it → publishes a result → a collector pulls
//! that. Throughput with 512 in flight; latency (p50/p99) with 1 in flight. The `flotilla`
//! and `tree` sections print their figures as ratios to it, measured on the same server in
//! the same run.

use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use async_nats::jetstream::consumer::{AckPolicy, pull};
use async_nats::jetstream::stream::{Config as StreamConfig, RetentionPolicy};
use flotilla_bus::NatsOptions;
use flotilla_model::ids::RunId;
use futures::StreamExt;
use tokio::sync::{Semaphore, mpsc};

use super::processes::cpu_seconds;
use super::stats::{ms, percentile};

/// A payload the size of a typical task envelope.
fn payload() -> bytes::Bytes {
    let body = serde_json::json!({
        "protocol": 1, "run_id": RunId::new(), "task_id": "calc_growth", "attempt": 1,
        "attempt_id": RunId::new(), "pool": "default", "description": "Compute quarter-over-quarter revenue growth.",
        "required": true, "timeout": 600, "dispatched_at": "2026-01-01T00:00:00Z",
        "dependency_results": {"fetch_data": {"response": "x".repeat(200), "tokens": 0, "success": true}}
    });
    bytes::Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
}

/// The raw round trip's figures, which the Flotilla figures are compared with.
pub(crate) struct RawFigures {
    /// Tasks/s with 512 in flight.
    pub(crate) throughput: f64,
    /// Round-trip latency with 1 in flight, p50 (ms).
    pub(crate) p50_ms: f64,
    /// Round-trip latency with 1 in flight, p99 (ms).
    pub(crate) p99_ms: f64,
}

/// The raw JetStream task round trip, measured and printed. `server_pid`: the embedded
/// nats-server, whose CPU seconds are printed too.
pub(crate) async fn round_trip(
    opts: &NatsOptions,
    tasks: usize,
    round_trips: usize,
    server_pid: Option<u32>,
) -> anyhow::Result<RawFigures> {
    let connect = || flotilla_bus::connect::connect(opts, "flotilla-bench");
    let producer = connect().await?;
    let worker_conn = connect().await?;
    let collector_conn = connect().await?;
    let js = async_nats::jetstream::new(producer.clone());
    for name in ["FLBENCH_RAW_TASKS", "FLBENCH_RAW_RESULTS"] {
        let _ = js.delete_stream(name).await;
    }
    js.create_stream(StreamConfig {
        name: "FLBENCH_RAW_TASKS".into(),
        subjects: vec!["flbench-raw.task.>".into()],
        retention: RetentionPolicy::WorkQueue,
        ..Default::default()
    })
    .await?;
    js.create_stream(StreamConfig {
        name: "FLBENCH_RAW_RESULTS".into(),
        subjects: vec!["flbench-raw.result.>".into()],
        ..Default::default()
    })
    .await?;
    let consumer_config = |name: &str| pull::Config {
        durable_name: Some(name.into()),
        ack_policy: AckPolicy::Explicit,
        max_ack_pending: 10_000,
        ..Default::default()
    };
    let wjs = async_nats::jetstream::new(worker_conn);
    let task_consumer = wjs
        .get_stream("FLBENCH_RAW_TASKS")
        .await?
        .create_consumer(consumer_config("w"))
        .await?;
    let cjs = async_nats::jetstream::new(collector_conn);
    let result_consumer = cjs
        .get_stream("FLBENCH_RAW_RESULTS")
        .await?
        .create_consumer(consumer_config("c"))
        .await?;

    // Worker: pull a task, publish its result, ack the task.
    let worker = tokio::spawn(async move {
        let Ok(messages) = task_consumer
            .stream()
            .max_messages_per_batch(512)
            .messages()
            .await
        else {
            return;
        };
        messages
            .for_each_concurrent(512, |m| {
                let wjs = wjs.clone();
                async move {
                    let Ok(m) = m else { return };
                    let subject = format!(
                        "flbench-raw.result.{}",
                        m.subject.rsplit('.').next().unwrap_or("x")
                    );
                    if let Ok(ack) = wjs.publish(subject, m.payload.clone()).await {
                        let _ = ack.await;
                    }
                    let _ = m.ack().await;
                }
            })
            .await;
    });
    // Collector: pull results, ack, report.
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<()>();
    let collector = tokio::spawn(async move {
        let Ok(messages) = result_consumer
            .stream()
            .max_messages_per_batch(512)
            .messages()
            .await
        else {
            return;
        };
        messages
            .for_each_concurrent(512, |m| {
                let done_tx = done_tx.clone();
                async move {
                    if let Ok(m) = m {
                        let _ = m.ack().await;
                        let _ = done_tx.send(());
                    }
                }
            })
            .await;
    });
    let body = payload();

    // Latency: one in flight.
    let mut samples = Vec::with_capacity(round_trips);
    for i in 0..round_trips {
        let t0 = Instant::now();
        js.publish(format!("flbench-raw.task.l{i}"), body.clone())
            .await?
            .await?;
        done_rx.recv().await.context("collector stopped")?;
        samples.push(ms(t0.elapsed()));
    }
    samples.sort_by(f64::total_cmp);

    // Throughput: 512 in flight.
    let window = Arc::new(Semaphore::new(512));
    let cpu_before = (
        server_pid.and_then(cpu_seconds),
        cpu_seconds(std::process::id()),
    );
    let start = Instant::now();
    let feeder = {
        let js = js.clone();
        let window = Arc::clone(&window);
        let body = body.clone();
        tokio::spawn(async move {
            let mut acks = futures::stream::FuturesUnordered::new();
            for i in 0..tasks {
                let Ok(p) = Arc::clone(&window).acquire_owned().await else {
                    break;
                };
                p.forget();
                if let Ok(ack) = js
                    .publish(format!("flbench-raw.task.t{i}"), body.clone())
                    .await
                {
                    acks.push(ack.into_future());
                }
                while let Some(Some(_)) = futures::FutureExt::now_or_never(acks.next()) {}
            }
            while acks.next().await.is_some() {}
        })
    };
    for _ in 0..tasks {
        done_rx.recv().await.context("collector stopped")?;
        window.add_permits(1);
    }
    let elapsed = start.elapsed();
    let cpu_server = server_pid
        .and_then(cpu_seconds)
        .zip(cpu_before.0)
        .map(|(a, b)| a - b);
    let cpu_bench = cpu_seconds(std::process::id())
        .zip(cpu_before.1)
        .map(|(a, b)| a - b);
    let _ = feeder.await;
    worker.abort();
    collector.abort();
    for name in ["FLBENCH_RAW_TASKS", "FLBENCH_RAW_RESULTS"] {
        let _ = js.delete_stream(name).await;
    }
    let f = RawFigures {
        throughput: tasks as f64 / elapsed.as_secs_f64(),
        p50_ms: percentile(&samples, 0.50),
        p99_ms: percentile(&samples, 0.99),
    };
    outln!("== raw JetStream task round trip (publish → pull → result publish → pull)");
    outln!(
        "   throughput, 512 in flight: {:>10.0} tasks/s   ({tasks} tasks)",
        f.throughput
    );
    outln!(
        "   latency, 1 in flight:      p50 {:.3} ms   p99 {:.3} ms   ({round_trips} round trips)",
        f.p50_ms,
        f.p99_ms
    );
    if let (Some(s), Some(b)) = (cpu_server, cpu_bench) {
        outln!(
            "   CPU seconds during throughput: nats-server {s:.2}, bench (producer, worker, collector) {b:.2}"
        );
    }
    Ok(f)
}
