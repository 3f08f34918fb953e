//! Observability of real `flotilla` processes: `/healthz`, `/readyz` (including draining on
//! SIGTERM), `/metrics`, and OTLP span export to a test receiver. Agents are the deterministic
//! `scripted` agent with a delay, so a drain lasts long enough to observe.

mod support;

use std::time::Duration;

use flotilla_model::plan::Subtask;
use flotilla_model::run::RunStatus;
use flotilla_model::submit::SubmitRequest;
use flotilla_testkit::otlp::OtlpReceiver;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SLOW: &str = r#"
default-agent = "slow"
[agents.slow]
kind = "scripted"
reply = "{task_id} ok"
delay = "3s"

[telemetry]
consumer-lag-interval = "200ms"
"#;

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// `GET path` over HTTP/1.0: status and body.
async fn get(port: u16, path: &str) -> anyhow::Result<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: test\r\n\r\n").as_bytes())
        .await?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).await?;
    let status = raw
        .split_whitespace()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("no status line: {raw:?}"))?
        .parse()?;
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// Polls `GET path` until `accept(status, body)` or the deadline; returns the accepted body.
async fn until(
    port: u16,
    path: &str,
    what: &str,
    accept: impl Fn(u16, &str) -> bool,
) -> anyhow::Result<String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut last: String;
    loop {
        match get(port, path).await {
            Ok((status, body)) if accept(status, &body) => return Ok(body),
            Ok((status, body)) => last = format!("{status}: {body}"),
            Err(e) => last = e.to_string(),
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{what}: GET {path} on port {port} never matched; last: {last}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn health_readiness_metrics_and_draining() -> anyhow::Result<()> {
    let mut p = Processes::start(SLOW).await?;
    let (cport, wport) = (free_port()?, free_port()?);
    let caddr = format!("127.0.0.1:{cport}");
    let waddr = format!("127.0.0.1:{wport}");
    let c = p.spawn(&["coordinator", "--http-addr", &caddr])?;
    let w = p.spawn(&["worker", "--concurrency", "1", "--http-addr", &waddr])?;

    for (port, i) in [(cport, c), (wport, w)] {
        let log = || p.log(i);
        until(port, "/readyz", "ready", |s, _| s == 200)
            .await
            .map_err(|e| e.context(log()))?;
        assert_eq!(get(port, "/healthz").await?, (200, "ok\n".to_string()));
    }
    let ready: serde_json::Value = serde_json::from_str(&get(wport, "/readyz").await?.1)?;
    for condition in ["nats_connected", "provisioned", "consumer_bound"] {
        assert_eq!(ready["conditions"][condition], true, "{ready}");
    }
    let ready: serde_json::Value = serde_json::from_str(&get(cport, "/readyz").await?.1)?;
    assert_eq!(ready["conditions"]["consumers_bound"], true, "{ready}");

    let (status, metrics) = get(cport, "/metrics").await?;
    assert_eq!(status, 200);
    for line in [
        "# TYPE flotilla_runs_submitted counter",
        "flotilla_runs_finished_total{status=\"succeeded\"} 0",
        "# TYPE flotilla_coordinator_cas_conflicts counter",
        "# TYPE flotilla_dependency_hop_seconds histogram",
        "# TYPE flotilla_build info",
    ] {
        assert!(metrics.contains(line), "{line}:\n{metrics}");
    }

    // One slow task: while it runs, the worker's sampler sees it unacknowledged.
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![Subtask::new("t", "slow")])))
        .await?;
    task_started(&p.client, run, "t").await?;
    until(wport, "/metrics", "consumer lag sampled", |_, m| {
        m.contains("flotilla_pool_consumer_ack_pending_messages{pool=\"default\"} 1\n")
    })
    .await?;

    // SIGTERM: the worker drains (finishes its task) and says so on /readyz meanwhile.
    p.terminate(w);
    let body = until(wport, "/readyz", "draining", |s, b| {
        s == 503 && b.contains("\"draining\":true")
    })
    .await?;
    assert!(body.contains("\"consumer_bound\":true"), "{body}");
    assert_eq!(get(wport, "/healthz").await?.0, 200, "alive while draining");
    assert_eq!(p.wait_exit(w, WAIT).await?, Some(0), "{}", p.log(w));
    assert!(get(wport, "/healthz").await.is_err(), "listener stops last");

    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded);
    until(cport, "/readyz", "coordinator still ready", |s, _| s == 200).await?;
    Ok(())
}

#[tokio::test]
async fn a_second_listener_on_a_taken_port_fails_clearly() -> anyhow::Result<()> {
    let mut p = Processes::start(SLOW).await?;
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = taken.local_addr()?.to_string();
    let w = p.spawn(&["worker", "--http-addr", &addr])?;
    assert_eq!(p.wait_exit(w, WAIT).await?, Some(2));
    let log = p.log(w);
    assert!(
        log.contains(&format!("cannot listen on {addr}: address in use")),
        "{log}"
    );
    Ok(())
}

#[tokio::test]
async fn services_export_their_startup_spans_over_otlp() -> anyhow::Result<()> {
    let receiver = OtlpReceiver::start().await?;
    let endpoint = receiver.endpoint();
    let otel = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        // Export within a tenth of a second instead of the default five.
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let mut p = Processes::start(SLOW).await?;
    let c = p.spawn_env(&["coordinator"], &otel)?;
    let w = p.spawn_env(&["worker"], &otel)?;
    p.wait_registered(w).await?;

    let started = |spans: &[flotilla_testkit::otlp::ReceivedSpan], service: &str, role: &str| {
        spans.iter().any(|s| {
            s.name == "startup"
                && s.service_name.as_deref() == Some(service)
                && s.attribute("flotilla.role") == Some(role)
        })
    };
    let spans = receiver
        .wait_for(
            |s| {
                started(s, "flotilla-coordinator", "coordinator")
                    && started(s, "flotilla-worker", "worker")
            },
            WAIT,
        )
        .await
        .map_err(|e| anyhow::anyhow!("{e}\ncoordinator:\n{}\nworker:\n{}", p.log(c), p.log(w)))?;
    let worker = spans
        .iter()
        .find(|s| s.service_name.as_deref() == Some("flotilla-worker"))
        .ok_or_else(|| anyhow::anyhow!("no worker span"))?;
    assert_eq!(worker.attribute("flotilla.pool"), Some("default"));
    assert_eq!(
        worker.resource.get("service.version").map(String::as_str),
        Some(env!("CARGO_PKG_VERSION"))
    );
    // The exporter's own HTTP requests are not traced.
    assert!(
        spans.iter().all(|s| s.name == "startup"),
        "unexpected spans: {spans:#?}"
    );
    Ok(())
}
