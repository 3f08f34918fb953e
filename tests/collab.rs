//! Collaboration through the coordinator, end to end against a real nats-server: topics gate
//! dispatch (from any writer, bounded by `dependency_timeout`), automatic produce writes each
//! produced topic exactly once (also across a worker kill), and `output_key` feeds `{key}`
//! placeholders. Agents are the deterministic `scripted` agent, standing in for models.

mod support;

/// The agents of `cargo run -p flotilla-cli --example negotiation`.
#[path = "../crates/flotilla-cli/examples/negotiation/agents.rs"]
mod negotiation;

use std::collections::BTreeMap;
use std::time::Duration;

use flotilla_coordinator::store::RunStore;
use flotilla_model::RunId;
use flotilla_model::plan::{DataflowValidation, Subtask};
use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::submit::SubmitRequest;
use flotilla_model::task::TaskErrorKind;
use flotilla_model::time::Secs;
use flotilla_model::workspace::{WorkspaceEntry, WorkspaceWrite, Writer};
use support::*;

fn produces(mut t: Subtask, topics: &[&str]) -> Subtask {
    t.produces = topics.iter().map(|s| (*s).to_owned()).collect();
    t
}

fn consumes(mut t: Subtask, topics: &[&str]) -> Subtask {
    t.consumes = topics.iter().map(|s| (*s).to_owned()).collect();
    t
}

/// Every entry of a topic of a run tree.
async fn entries(
    bus: &flotilla_bus::Bus,
    root: RunId,
    topic: &str,
) -> anyhow::Result<Vec<WorkspaceEntry>> {
    let store = RunStore::open(bus).await?;
    let (entries, _, truncated) = store
        .topic_entries(root, topic, 0, usize::MAX, 10_000)
        .await?;
    assert!(!truncated);
    Ok(entries)
}

/// Publishes a workspace entry the way any NATS client may: plain JetStream, JSON.
async fn write_entry(
    bus: &flotilla_bus::Bus,
    root: RunId,
    topic: &str,
    body: &[u8],
) -> anyhow::Result<u64> {
    let ack = bus
        .js()
        .publish(bus.names().workspace(root, topic), body.to_vec().into())
        .await?
        .await?;
    Ok(ack.sequence)
}

#[tokio::test]
async fn consumers_of_a_topic_start_on_its_first_entry_and_not_after_each_other()
-> anyhow::Result<()> {
    let mut agents = BTreeMap::new();
    agents.insert("echo".to_string(), scripted("{task_id}: revenue grew 6.7%"));
    let f = InProcess::start(2, agents).await?;
    let p = plan(vec![
        produces(
            Subtask::new("fetch", "get the figures"),
            &["Quarterly Figures"],
        ),
        consumes(Subtask::new("growth", "growth"), &["quarterly figures"]),
        consumes(Subtask::new("margin", "margin"), &["quarterly_figures"]),
        Subtask::new("report", "report").after(&["growth", "margin"]),
    ]);
    let run = f.client.submit(SubmitRequest::new(p)).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");

    // Exactly one entry, from automatic produce, with the producer's result.
    let got = entries(&f.bus, run, "quarterly_figures").await?;
    assert_eq!(got.len(), 1, "{got:?}");
    let e = &got[0];
    assert_eq!(e.entry["subtask_id"], "fetch");
    assert_eq!(e.entry["summary"], "fetch: revenue grew 6.7%");
    assert_eq!(e.entry["numeric_value"], 6.7);
    let writer = e.writer.as_ref().expect("writer");
    assert_eq!(writer.task_id.as_ref().map(|t| t.as_str()), Some("fetch"));
    assert_eq!(writer.by.as_deref(), Some("coordinator"));

    // Both consumers were dispatched in the step that applied fetch's result: together,
    // after the entry was stored.
    let view = f.client.run(run).await?.expect("run");
    let at = |id: &str| {
        view.tasks
            .iter()
            .find(|t| t.task_id.as_str() == id)
            .and_then(|t| t.dispatched_at)
            .expect("dispatched")
    };
    assert_eq!(at("growth"), at("margin"));
    let history = RunStore::open(&f.bus).await?.history(run).await?;
    let fetched_at = history
        .iter()
        .find_map(|(_, ts, e)| match &e.input {
            flotilla_model::runlog::RunInput::TaskResult(r) if r.task_id.as_str() == "fetch" => {
                Some(*ts)
            }
            _ => None,
        })
        .expect("fetch result");
    assert_eq!(
        at("growth").unix_ms(),
        fetched_at.unix_ms(),
        "dispatched by the step of fetch's result"
    );
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn any_writer_opens_a_topic_and_malformed_messages_do_not() -> anyhow::Result<()> {
    let mut agents = BTreeMap::new();
    agents.insert("echo".to_string(), scripted("{task_id} read the notes"));
    let f = InProcess::start(1, agents).await?;
    let mut p = plan(vec![
        consumes(Subtask::new("reader", "read notes"), &["notes"]),
        Subtask::new("other", "independent"),
    ]);
    // No task produces `notes`: lenient data flow lets an outside writer provide it.
    p.config.dataflow_validation = DataflowValidation::Lenient;
    let run = f.client.submit(SubmitRequest::new(p)).await?;
    // The independent task runs; the reader waits.
    let started = tokio::time::Instant::now();
    loop {
        let view = f.client.run(run).await?;
        if view.as_ref().is_some_and(|v| {
            v.tasks
                .get(1)
                .is_some_and(|t| t.status == TaskStatus::Succeeded)
        }) {
            break;
        }
        assert!(
            started.elapsed() < WAIT,
            "the independent task never finished"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A message that is not a workspace write does not count as an entry.
    write_entry(&f.bus, run, "notes", b"not json at all").await?;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let view = f.client.run(run).await?.expect("run");
    assert_eq!(view.tasks[0].status, TaskStatus::Waiting, "{view:?}");
    assert_eq!(view.tasks[0].attempts, 0);

    // A plain JetStream publish of a valid entry opens the topic.
    let body = serde_json::to_vec(&WorkspaceWrite {
        protocol: 1,
        entry: serde_json::json!({"note": "figures are in"})
            .as_object()
            .cloned()
            .unwrap_or_default(),
        writer: Some(Writer {
            run_id: run,
            task_id: None,
            attempt: None,
            by: Some("an outside client".into()),
        }),
    })?;
    write_entry(&f.bus, run, "notes", &body).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let written = entries(&f.bus, run, "notes").await?;
    assert_eq!(
        written.len(),
        1,
        "the malformed message is skipped by readers"
    );
    let history = RunStore::open(&f.bus).await?.history(run).await?;
    let announced = history
        .iter()
        .filter(|(_, _, e)| {
            matches!(&e.input, flotilla_model::runlog::RunInput::TopicWritten { topic, .. } if topic == "notes")
        })
        .count();
    assert_eq!(announced, 1, "one announcement of the topic");
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_wait_for_a_topic_ends_at_the_dependency_timeout() -> anyhow::Result<()> {
    let mut agents = BTreeMap::new();
    agents.insert("echo".to_string(), scripted("{task_id} done"));
    let f = InProcess::start(1, agents).await?;
    let mut p = plan(vec![
        consumes(Subtask::new("reader", "read notes"), &["notes"]),
        Subtask::new("other", "independent"),
    ]);
    p.config.dataflow_validation = DataflowValidation::Lenient;
    p.config.dependency_timeout = Secs::from_secs(2);
    let run = f.client.submit(SubmitRequest::new(p)).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed, "{outcome:?}");
    let failed = &outcome.failed[0];
    assert_eq!(failed.task_id.as_str(), "reader");
    assert_eq!(failed.attempts, 0);
    assert_eq!(failed.error.kind, TaskErrorKind::DependencyTimeout);
    assert!(
        failed.error.message.contains("notes") && failed.error.message.contains("2 s"),
        "{}",
        failed.error.message
    );
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn output_keys_fill_placeholders_and_a_missing_key_fails_clearly() -> anyhow::Result<()> {
    let mut agents = BTreeMap::new();
    // Echoes the description it received, so the test sees the filled placeholders.
    agents.insert("echo".to_string(), scripted("{description}"));
    let f = InProcess::start(1, agents).await?;
    let mut growth = Subtask::new("growth", "growth is 6.7%");
    growth.output_key = Some("growth".into());
    let p = plan(vec![
        growth,
        Subtask::new("report", "Report: {growth} / optional: [{margin?}]").after(&["growth"]),
        Subtask::new("orphan", "needs {nope}"),
    ]);
    let mut request = SubmitRequest::new(p);
    request.session_id = Some(flotilla_model::SessionId::new());
    let session = request.session_id.expect("session");
    let mut p2 = request.clone();
    let run = f.client.submit(request).await?;
    let outcome = f.client.wait(run, WAIT).await?;
    // `orphan` fails: the run (whose tasks are all required) fails, with the reason.
    assert_eq!(outcome.status, RunStatus::Failed, "{outcome:?}");
    let view = f.client.run(run).await?.expect("run");
    let report = &view.tasks[1];
    assert_eq!(report.status, TaskStatus::Succeeded);
    let results = results_of(&f.bus, run).await?;
    assert!(results.contains(&("report".into(), 1, true)), "{results:?}");
    let history = RunStore::open(&f.bus).await?.history(run).await?;
    let report_response = history
        .iter()
        .find_map(|(_, _, e)| match &e.input {
            flotilla_model::runlog::RunInput::TaskResult(r) if r.task_id.as_str() == "report" => {
                Some(r.result.response.clone())
            }
            _ => None,
        })
        .expect("report result");
    assert_eq!(report_response, "Report: growth is 6.7% / optional: []");
    let orphan = &view.tasks[2];
    assert_eq!(orphan.status, TaskStatus::Failed);
    assert_eq!(orphan.attempts, 1, "not retried");
    let error = orphan.error.as_ref().expect("error");
    assert_eq!(error.kind, TaskErrorKind::MissingStateKey);
    assert!(error.message.contains("nope"), "{}", error.message);

    // The value is in the session's state, under the session id.
    let state = f.bus.kv(flotilla_model::subjects::Bucket::State).await?;
    let value = state
        .get(format!("{session}.growth"))
        .await?
        .expect("output_key written");
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&value)?,
        "growth is 6.7%"
    );

    // A second run of the same session reads what the first wrote.
    p2.run_id = None;
    p2.plan = Some(plan(vec![Subtask::new("again", "earlier: {growth}")]));
    let run2 = f.client.submit(p2).await?;
    let outcome = f.client.wait(run2, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    assert_eq!(
        outcome.final_result.expect("result").response,
        "earlier: growth is 6.7%"
    );
    f.stop().await;
    Ok(())
}

const SLOW_PRODUCER: &str = r#"
default-agent = "slow"
[agents.slow]
kind = "scripted"
reply = "{task_id} found 42 items"
delay = "1500ms"
"#;

#[tokio::test]
async fn automatic_produce_is_exactly_once_across_a_worker_kill() -> anyhow::Result<()> {
    let mut p = Processes::start(SLOW_PRODUCER).await?;
    p.coordinator().await?;
    let first = p.worker(&["--concurrency", "1"]).await?;
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            produces(Subtask::new("fetch", "fetch"), &["items"]),
            consumes(Subtask::new("count", "count"), &["items"]),
        ])))
        .await?;
    task_started(&p.client, run, "fetch").await?;
    p.worker(&["--concurrency", "1"]).await?;
    p.kill(first);
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let got = entries(&p.bus, run, "items").await?;
    assert_eq!(got.len(), 1, "one entry despite the redelivery: {got:?}");
    assert_eq!(got[0].entry["numeric_value"], 42.0);
    Ok(())
}

/// The negotiation example end to end: three tasks of one run meet in their mailboxes; the
/// more confident analyst gets the work and its answer becomes the lead's result. The
/// analysts' confidences are scripted (see the example).
#[tokio::test]
async fn the_negotiation_example_awards_the_work_to_the_most_confident_analyst()
-> anyhow::Result<()> {
    let mut names = BTreeMap::new();
    // Only the names matter here (validation); the worker runs the example's Rust agents.
    names.insert("analyst".to_string(), scripted("unused"));
    names.insert("lead".to_string(), scripted("unused"));
    let mut f = InProcess::start(0, names).await?;
    f.add_worker_with_registry(
        flotilla_worker::WorkerOptions::default(),
        negotiation::registry(),
    )
    .await?;
    let started = std::time::Instant::now();
    let run = f
        .client
        .submit(SubmitRequest::new(negotiation::plan()))
        .await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let results = &outcome
        .final_result
        .as_ref()
        .expect("a final result")
        .results;
    let response = |t: &str| results[&flotilla_model::TaskId::new(t)].response.clone();
    assert_eq!(
        response("lead"),
        "offers: analyst_a 0.60, analyst_b 0.90; awarded to analyst_b; result: gross margin 39.2%"
    );
    assert_eq!(response("analyst_a"), "offered 0.60; not chosen");
    assert_eq!(
        response("analyst_b"),
        "offered 0.90; awarded; gross margin 39.2%"
    );
    // The loser learns at once that it lost: nobody waits out the 20 s award wait.
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    f.stop().await;
    Ok(())
}
