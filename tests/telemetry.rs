//! Observability of real `flotilla` processes: `/healthz`, `/readyz` (including draining on
//! SIGTERM), `/metrics` recorded by the coordinator and workers, and OTLP span export to a
//! test receiver (one trace per run across processes). Agents are the deterministic
//! `scripted` agent (with a delay where a test needs time to observe).

mod support;

use std::time::Duration;

use flotilla_model::RunId;
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

/// A quick deterministic agent, for runs that only need to finish.
const QUICK: &str = r#"
default-agent = "echo"
[agents.echo]
kind = "scripted"
reply = "{task_id} ok"
"#;

/// `a → b, a → c, b + c → d`.
fn diamond() -> Vec<Subtask> {
    vec![
        Subtask::new("a", "root"),
        Subtask::new("b", "left").after(&["a"]),
        Subtask::new("c", "right").after(&["a"]),
        Subtask::new("d", "join").after(&["b", "c"]),
    ]
}

/// The value of the sample line `series` (name and labels exactly as exposed).
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix(' '))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
    })
}

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

/// Waits until `/metrics` on `port` shows every `(series, value)`; returns the text.
async fn metrics_show(port: u16, expected: &[(&str, f64)]) -> anyhow::Result<String> {
    until(port, "/metrics", "expected samples", |s, m| {
        s == 200
            && expected
                .iter()
                .all(|(series, value)| sample(m, series) == Some(*value))
    })
    .await
    .map_err(|e| {
        let missing: Vec<&str> = expected.iter().map(|(s, _)| *s).collect();
        e.context(format!("expected {missing:?}"))
    })
}

#[tokio::test]
async fn the_coordinator_and_workers_record_what_a_run_did() -> anyhow::Result<()> {
    let mut p = Processes::start(QUICK).await?;
    let (cport, wport) = (free_port()?, free_port()?);
    let caddr = format!("127.0.0.1:{cport}");
    let waddr = format!("127.0.0.1:{wport}");
    let c = p.spawn(&["coordinator", "--http-addr", &caddr])?;
    let w = p.spawn(&["worker", "--concurrency", "3", "--http-addr", &waddr])?;
    for port in [cport, wport] {
        until(port, "/readyz", "ready", |s, _| s == 200).await?;
    }
    // A chain of three: three dispatches, two dependency hops.
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("a", "first"),
            Subtask::new("b", "second").after(&["a"]),
            Subtask::new("c", "third").after(&["b"]),
        ])))
        .await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded);

    let coordinator = metrics_show(
        cport,
        &[
            ("flotilla_runs_submitted_total{outcome=\"accepted\"}", 1.0),
            ("flotilla_runs_finished_total{status=\"succeeded\"}", 1.0),
            (
                "flotilla_tasks_dispatched_total{pool=\"default\",agent=\"echo\"}",
                3.0,
            ),
            (
                "flotilla_tasks_finished_total{pool=\"default\",agent=\"echo\",status=\"succeeded\"}",
                3.0,
            ),
            ("flotilla_dependency_hop_seconds_count", 2.0),
        ],
    )
    .await
    .map_err(|e| e.context(p.log(c)))?;
    assert_eq!(
        sample(
            &coordinator,
            "flotilla_runs_finished_total{status=\"failed\"}"
        ),
        Some(0.0)
    );
    // Hops are real durations: above zero, and (locally) well under the 10 s bucket.
    let hop_sum = sample(&coordinator, "flotilla_dependency_hop_seconds_sum")
        .ok_or_else(|| anyhow::anyhow!("no hop sum:\n{coordinator}"))?;
    assert!(hop_sum > 0.0 && hop_sum < 20.0, "{coordinator}");
    // The coordinator records no worker series, and no id becomes a label.
    assert!(
        !coordinator.contains("flotilla_task_attempt_duration_seconds_count"),
        "{coordinator}"
    );
    assert!(!coordinator.contains(&run.to_string()), "{coordinator}");

    let worker = metrics_show(
        wport,
        &[
            (
                "flotilla_task_attempt_duration_seconds_count{pool=\"default\",agent=\"echo\",outcome=\"succeeded\"}",
                3.0,
            ),
            ("flotilla_worker_in_flight_attempts{pool=\"default\"}", 0.0),
            ("flotilla_worker_free_slots{pool=\"default\"}", 3.0),
        ],
    )
    .await
    .map_err(|e| e.context(p.log(w)))?;
    assert!(
        !worker.contains("flotilla_tasks_dispatched_total{"),
        "{worker}"
    );
    Ok(())
}

#[tokio::test]
async fn up_shows_coordinator_and_worker_metrics_on_one_endpoint() -> anyhow::Result<()> {
    let mut p = Processes::start(QUICK).await?;
    let port = free_port()?;
    let addr = format!("127.0.0.1:{port}");
    let url = p.server.url();
    let up = p.spawn(&[
        "--nats-url",
        &url,
        "up",
        "--workers",
        "2",
        "--concurrency",
        "2",
        "--http-addr",
        &addr,
    ])?;
    until(port, "/readyz", "ready", |s, _| s == 200)
        .await
        .map_err(|e| e.context(p.log(up)))?;
    let run = p.client.submit(SubmitRequest::new(plan(diamond()))).await?;
    assert_eq!(p.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
    metrics_show(
        port,
        &[
            ("flotilla_runs_finished_total{status=\"succeeded\"}", 1.0),
            (
                "flotilla_tasks_dispatched_total{pool=\"default\",agent=\"echo\"}",
                4.0,
            ),
            ("flotilla_dependency_hop_seconds_count", 3.0),
            (
                "flotilla_task_attempt_duration_seconds_count{pool=\"default\",agent=\"echo\",outcome=\"succeeded\"}",
                4.0,
            ),
            // Two workers of two slots each, summed.
            ("flotilla_worker_free_slots{pool=\"default\"}", 4.0),
        ],
    )
    .await
    .map_err(|e| e.context(p.log(up)))?;
    Ok(())
}

#[tokio::test]
async fn a_run_is_one_trace_across_client_coordinator_and_workers() -> anyhow::Result<()> {
    let receiver = OtlpReceiver::start().await?;
    let endpoint = receiver.endpoint();
    let otel = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        // One task at a time per worker, none held back: the diamond's two middle tasks run
        // on different workers.
        ("FLOTILLA_WORKER__PREFETCH", "0"),
    ];
    let config = format!("{QUICK}delay = \"300ms\"\n");
    let mut p = Processes::start(&config).await?;
    let c = p.spawn_env(&["coordinator"], &otel)?;
    let w1 = p.spawn_env(&["worker", "--concurrency", "1"], &otel)?;
    let w2 = p.spawn_env(&["worker", "--concurrency", "1"], &otel)?;
    p.wait_registered(w1).await?;
    p.wait_registered(w2).await?;
    wait_for_api(&p.bus).await?;

    // The client is `flotilla submit`, exporting its own `submit` span.
    let run = RunId::new();
    let plan_file = p.dir().join("diamond.json");
    std::fs::write(&plan_file, serde_json::to_vec(&plan(diamond()))?)?;
    let plan_path = plan_file.to_string_lossy().into_owned();
    let run_arg = run.to_string();
    let s = p.spawn_env(&["submit", &plan_path, "--run-id", &run_arg], &otel)?;
    assert_eq!(p.wait_exit(s, WAIT).await?, Some(0), "{}", p.log(s));
    assert_eq!(p.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);

    let run_id = run.to_string();
    let of_run = |s: &flotilla_testkit::otlp::ReceivedSpan| {
        s.attribute("flotilla.run_id") == Some(run_id.as_str())
    };
    let spans = receiver
        .wait_for(
            |spans| {
                spans
                    .iter()
                    .filter(|s| of_run(s) && s.name.starts_with("invoke_agent"))
                    .count()
                    == 4
                    && spans
                        .iter()
                        .filter(|s| of_run(s) && s.name == "dispatch")
                        .count()
                        == 4
                    && spans.iter().any(|s| of_run(s) && s.name == "submit")
            },
            WAIT,
        )
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "{e}\ncoordinator:\n{}\nworkers:\n{}\n{}",
                p.log(c),
                p.log(w1),
                p.log(w2)
            )
        })?;
    let submit = spans
        .iter()
        .find(|s| of_run(s) && s.name == "submit")
        .ok_or_else(|| anyhow::anyhow!("no submit span"))?;
    assert_eq!(submit.service_name.as_deref(), Some("flotilla-cli"));
    assert_eq!(submit.parent_span_id, None, "the client's span is the root");
    let trace: Vec<_> = spans
        .iter()
        .filter(|s| s.trace_id == submit.trace_id)
        .collect();
    // Every span of the run is in the client's trace.
    for s in spans.iter().filter(|s| of_run(s)) {
        assert_eq!(s.trace_id, submit.trace_id, "{s:#?}");
    }
    let by_id = |id: &Option<String>| {
        id.as_ref()
            .and_then(|id| trace.iter().find(|s| &s.span_id == id))
    };
    let steps: Vec<_> = trace.iter().filter(|s| s.name == "step").collect();
    assert!(!steps.is_empty(), "{trace:#?}");
    for step in &steps {
        assert_eq!(step.service_name.as_deref(), Some("flotilla-coordinator"));
        assert_eq!(
            step.parent_span_id.as_ref(),
            Some(&submit.span_id),
            "a step is a child of the submission"
        );
    }
    let mut workers = std::collections::BTreeSet::new();
    for task in ["a", "b", "c", "d"] {
        let dispatch = trace
            .iter()
            .find(|s| s.name == "dispatch" && s.attribute("flotilla.task_id") == Some(task))
            .ok_or_else(|| anyhow::anyhow!("no dispatch of {task}: {trace:#?}"))?;
        let parent = by_id(&dispatch.parent_span_id)
            .ok_or_else(|| anyhow::anyhow!("dispatch of {task} has no parent in the trace"))?;
        assert_eq!(parent.name, "step", "{dispatch:#?}");
        assert_eq!(dispatch.attribute("flotilla.pool"), Some("default"));
        let attempt = trace
            .iter()
            .find(|s| {
                s.name == "invoke_agent echo" && s.attribute("flotilla.task_id") == Some(task)
            })
            .ok_or_else(|| anyhow::anyhow!("no invoke_agent of {task}: {trace:#?}"))?;
        assert_eq!(
            attempt.parent_span_id.as_ref(),
            Some(&dispatch.span_id),
            "{attempt:#?}"
        );
        assert_eq!(attempt.service_name.as_deref(), Some("flotilla-worker"));
        assert_eq!(
            attempt.attribute("gen_ai.operation.name"),
            Some("invoke_agent")
        );
        assert_eq!(attempt.attribute("gen_ai.agent.name"), Some("echo"));
        assert_eq!(attempt.attribute("flotilla.attempt"), Some("1"));
        assert_eq!(attempt.attribute("flotilla.run_id"), Some(run_id.as_str()));
        workers.insert(
            attempt
                .attribute("flotilla.worker_id")
                .unwrap_or_default()
                .to_owned(),
        );
    }
    assert_eq!(workers.len(), 2, "both workers ran tasks: {workers:?}");

    // A client without a trace: the coordinator's span that admitted the run is the root,
    // and the run is still one trace.
    let second = p.client.submit(SubmitRequest::new(plan(diamond()))).await?;
    assert_eq!(
        p.client.wait(second, WAIT).await?.status,
        RunStatus::Succeeded
    );
    let second_id = second.to_string();
    let of_second = |s: &flotilla_testkit::otlp::ReceivedSpan| {
        s.attribute("flotilla.run_id") == Some(second_id.as_str())
    };
    let spans = receiver
        .wait_for(
            |spans| {
                spans
                    .iter()
                    .filter(|s| of_second(s) && s.name.starts_with("invoke_agent"))
                    .count()
                    == 4
            },
            WAIT,
        )
        .await?;
    let run_spans: Vec<_> = spans.iter().filter(|s| of_second(s)).collect();
    let roots: Vec<_> = run_spans
        .iter()
        .filter(|s| s.parent_span_id.is_none())
        .collect();
    assert_eq!(roots.len(), 1, "{run_spans:#?}");
    assert_eq!(roots[0].name, "step");
    for s in &run_spans {
        assert_eq!(s.trace_id, roots[0].trace_id, "{s:#?}");
    }
    Ok(())
}

/// One trace spans a run tree: a task whose exec agent calls another agent with
/// `flotilla call` starts a child run, and every span of the child — its coordinator steps
/// and dispatches, its worker's `invoke_agent` — is in the parent's trace, which the client's
/// `submit` span roots.
#[tokio::test]
async fn a_run_tree_is_one_trace() -> anyhow::Result<()> {
    let receiver = OtlpReceiver::start().await?;
    let endpoint = receiver.endpoint();
    let otel = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let config = format!(
        "{QUICK}\n[agents.caller]\nkind = \"exec\"\ncommand = \"sh\"\nargs = [\"-c\", \"\\\"$FLOTILLA_BIN\\\" call echo '{{\\\"q\\\": 1}}' > /dev/null && echo called\"]\n"
    );
    let mut p = Processes::start(&config).await?;
    let c = p.spawn_env(&["coordinator"], &otel)?;
    let w = p.spawn_env(&["worker", "--concurrency", "2"], &otel)?;
    p.wait_registered(w).await?;
    wait_for_api(&p.bus).await?;
    let run = RunId::new();
    let plan_file = p.dir().join("caller.json");
    std::fs::write(
        &plan_file,
        serde_json::to_vec(&plan(vec![Subtask::new("ask", "").with_agent("caller")]))?,
    )?;
    let plan_path = plan_file.to_string_lossy().into_owned();
    let run_arg = run.to_string();
    let s = p.spawn_env(&["submit", &plan_path, "--run-id", &run_arg], &otel)?;
    assert_eq!(p.wait_exit(s, WAIT).await?, Some(0), "{}", p.log(s));
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(
        outcome.status,
        RunStatus::Succeeded,
        "{outcome:?}\n{}",
        p.log(w)
    );
    let tree = p.client.tree(run, 10).await?.expect("a tree");
    let child = tree
        .root
        .children
        .first()
        .ok_or_else(|| anyhow::anyhow!("no child run: {tree:?}"))?
        .run_id
        .to_string();
    let (run_id, child_id) = (run.to_string(), child.clone());
    let spans = receiver
        .wait_for(
            |spans| {
                ["invoke_agent echo", "step", "dispatch"]
                    .iter()
                    .all(|name| {
                        spans.iter().any(|s| {
                            s.attribute("flotilla.run_id") == Some(child_id.as_str())
                                && s.name == *name
                        })
                    })
                    && spans.iter().any(|s| {
                        s.attribute("flotilla.run_id") == Some(run_id.as_str())
                            && s.name == "submit"
                    })
            },
            WAIT,
        )
        .await
        .map_err(|e| anyhow::anyhow!("{e}\ncoordinator:\n{}\nworker:\n{}", p.log(c), p.log(w)))?;
    let submit = spans
        .iter()
        .find(|s| s.attribute("flotilla.run_id") == Some(run_id.as_str()) && s.name == "submit")
        .ok_or_else(|| anyhow::anyhow!("no submit span"))?;
    let of_child: Vec<_> = spans
        .iter()
        .filter(|s| s.attribute("flotilla.run_id") == Some(child.as_str()))
        .collect();
    assert!(
        of_child.iter().any(|s| s.name == "step") && of_child.iter().any(|s| s.name == "dispatch"),
        "{of_child:#?}"
    );
    for s in &of_child {
        assert_eq!(
            s.trace_id, submit.trace_id,
            "the child's span {} is in the parent's trace",
            s.name
        );
    }
    Ok(())
}

/// The port of the listener a service's log says it started.
fn listening_port(log: &str) -> Option<u16> {
    log.lines()
        .find(|l| l.contains("HTTP listener started"))
        .and_then(|l| l.split("addr=").nth(1))
        .and_then(|a| a.split_whitespace().next())
        .and_then(|a| a.rsplit(':').next())
        .and_then(|p| p.parse().ok())
}

/// The README's "Running it" on one host: `flotilla coordinator`, then `flotilla worker`, both
/// with the default listener. The second takes the next free port instead of failing on 9464,
/// says so, and both answer their probes.
#[tokio::test]
async fn two_services_on_one_host_with_the_default_listener() -> anyhow::Result<()> {
    let mut p = Processes::start(QUICK).await?;
    let c = p.spawn_listening(&["coordinator"], &[])?;
    let w = p.spawn_listening(&["worker"], &[])?;
    let deadline = tokio::time::Instant::now() + WAIT;
    let (cport, wport) = loop {
        for i in [c, w] {
            if let Some(status) = p.wait_exit(i, Duration::ZERO).await.ok().flatten() {
                anyhow::bail!("process {i} exited with {status}:\n{}", p.log(i));
            }
        }
        if let (Some(a), Some(b)) = (listening_port(&p.log(c)), listening_port(&p.log(w))) {
            break (a, b);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "no listener:\n{}\n{}",
            p.log(c),
            p.log(w)
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    assert_ne!(cport, wport);
    for (port, i) in [(cport, c), (wport, w)] {
        assert!((9464..9564).contains(&port), "{port}");
        until(port, "/readyz", "ready", |s, _| s == 200)
            .await
            .map_err(|e| e.context(p.log(i)))?;
    }
    // Whichever started second says why its port is not 9464 (unless something else had it).
    let (later, port) = if wport > cport {
        (w, wport)
    } else {
        (c, cport)
    };
    assert!(
        p.log(later).contains(&format!("on port {port} instead")),
        "{}",
        p.log(later)
    );
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![Subtask::new("t", "one")])))
        .await?;
    assert_eq!(p.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
    Ok(())
}

/// A worker started before any coordinator (a fresh install's race on Kubernetes) waits for
/// the streams, not ready and saying what it waits for, then serves once a coordinator has
/// created them.
#[tokio::test]
async fn a_worker_started_before_provisioning_waits_then_serves() -> anyhow::Result<()> {
    let mut p = Processes::unprovisioned(QUICK).await?;
    let port = free_port()?;
    let addr = format!("127.0.0.1:{port}");
    let w = p.spawn_env(
        &["worker", "--http-addr", &addr],
        &[("FLOTILLA_WORKER__PROVISION_WAIT", "2m")],
    )?;
    let body = until(port, "/readyz", "waiting, not ready", |s, b| {
        s == 503 && b.contains("\"provisioned\":false") && b.contains("\"nats_connected\":true")
    })
    .await
    .map_err(|e| e.context(p.log(w)))?;
    assert!(body.contains("\"consumer_bound\":false"), "{body}");
    let deadline = tokio::time::Instant::now() + WAIT;
    while !p.log(w).contains("waiting for a coordinator") {
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "{}", p.log(w));
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let log = p.log(w);
    assert!(log.contains("FLOTILLA_TASKS"), "{log}");
    assert!(log.contains("giving up in"), "{log}");
    // Still waiting a moment later: not exited, not ready.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(p.wait_exit(w, Duration::ZERO).await.ok(), None);
    assert_eq!(get(port, "/readyz").await?.0, 503);

    p.coordinator().await?;
    until(port, "/readyz", "ready once provisioned", |s, _| s == 200)
        .await
        .map_err(|e| e.context(p.log(w)))?;
    p.wait_registered(w).await?;
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![Subtask::new("t", "one")])))
        .await?;
    assert_eq!(p.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
    Ok(())
}

/// The wait is bounded: with no coordinator, the worker gives up after
/// `worker.provision-wait` with what is missing and what to do.
#[tokio::test]
async fn a_worker_gives_up_waiting_for_provisioning_after_the_bound() -> anyhow::Result<()> {
    let mut p = Processes::unprovisioned(QUICK).await?;
    let started = std::time::Instant::now();
    let w = p.spawn_env(&["worker"], &[("FLOTILLA_WORKER__PROVISION_WAIT", "2s")])?;
    assert_eq!(p.wait_exit(w, WAIT).await?, Some(2), "{}", p.log(w));
    let waited = started.elapsed();
    assert!(waited >= Duration::from_secs(2), "{waited:?}");
    let log = p.log(w);
    let error = log
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_default();
    for part in [
        "missing",
        "FLOTILLA_TASKS",
        "waiting 2s did not bring them",
        "start `flotilla coordinator`",
        "`flotilla nats provision`",
        "worker.provision-wait",
    ] {
        assert!(error.contains(part), "{part}: {log}");
    }
    Ok(())
}

/// A run that waits costs its coordinator no memory: a run waiting for a person is held in
/// the coordinator's run cache (`flotilla_coordinator_cached_runs`) only until `cache-idle`
/// passes without an input, then dropped; the person's answer reads it back from its record
/// and the run ends as it would have.
#[tokio::test]
async fn a_waiting_run_leaves_the_coordinators_memory_and_comes_back_on_its_answer()
-> anyhow::Result<()> {
    let mut p = Processes::start(QUICK).await?;
    let port = free_port()?;
    let addr = format!("127.0.0.1:{port}");
    let c = p.spawn_env(
        &["coordinator", "--http-addr", &addr],
        &[("FLOTILLA_COORDINATOR__CACHE_IDLE", "2s")],
    )?;
    p.worker(&[]).await?;
    until(port, "/readyz", "ready", |s, _| s == 200).await?;
    let mut ask = Subtask::new("publish", "publish the report");
    ask.action = Some("publish".into());
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            ask,
            Subtask::new("tell", "tell").after(&["publish"]),
        ])))
        .await?;
    // Held while it is touched, then let go.
    metrics_show(port, &[("flotilla_coordinator_cached_runs", 1.0)])
        .await
        .map_err(|e| e.context(p.log(c)))?;
    metrics_show(port, &[("flotilla_coordinator_cached_runs", 0.0)])
        .await
        .map_err(|e| e.context(p.log(c)))?;
    // The answer brings it back from its record; it ends, and leaves the cache at once.
    let out = p.cli(&[
        "approvals",
        "approve",
        &run.to_string(),
        "t0a1",
        "--by",
        "ann",
    ])?;
    anyhow::ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded);
    metrics_show(
        port,
        &[
            ("flotilla_coordinator_cached_runs", 0.0),
            ("flotilla_runs_finished_total{status=\"succeeded\"}", 1.0),
        ],
    )
    .await
    .map_err(|e| e.context(p.log(c)))?;
    Ok(())
}
