//! One hop less: a run whose last task's success decides it is answered by that task's
//! worker once its result is stored, not by a coordinator after a second hop — against a
//! real nats-server with real `flotilla` processes (scripted agents: deterministic replies).
//!
//! * A one-task run and a diamond's last task are answered from the worker: the stored
//!   result is marked `answered`, the answer carries the message id `finished.<run>` and the
//!   outcome the coordinator records, and no second answer follows. A last task that writes
//!   a workspace topic (work after its success) is answered by the coordinator.
//! * An input reaching the run between the dispatch and the result (a pause and a resume)
//!   makes the worker store its result unmarked, and the coordinator answers, once.
//! * With two coordinators and two workers, killed and replaced while hundreds of runs go
//!   through, every run's `reply_to` gets its answer, every answer of a run carries its one
//!   message id and the recorded outcome, and some answers came from workers.

mod support;

use std::collections::HashMap;
use std::time::Duration;

use flotilla_bus::wire;
use flotilla_model::ids::RunId;
use flotilla_model::plan::Subtask;
use flotilla_model::run::RunStatus;
use flotilla_model::runlog::{RunInput, RunLogEntry};
use flotilla_model::subjects::StreamKind;
use flotilla_model::submit::{SubmitReply, SubmitRequest, SubmitStatus};
use futures::StreamExt;
use support::*;

const QUICK: &str = r#"
default-agent = "quick"
[agents.quick]
kind = "scripted"
reply = "{task_id} ok"
delay = "5ms"

[agents.slow]
kind = "scripted"
reply = "{task_id} done slowly"
delay = "1500ms"
"#;

/// Whether the stored result of `task` in `run`'s log is marked answered by its worker.
async fn answered_by_worker(p: &Processes, run: RunId, task: &str) -> anyhow::Result<bool> {
    let msgs = p
        .bus
        .direct_batch(
            StreamKind::RunLog,
            &p.bus.names().runlog(run),
            0,
            1000,
            None,
        )
        .await?;
    for m in msgs {
        let entry: RunLogEntry = wire::decode(Some(&m.headers), &m.payload)?;
        if let RunInput::TaskResult(r) = entry.input
            && r.task_id.as_str() == task
            && r.result.success
        {
            return Ok(r.answered);
        }
    }
    anyhow::bail!("no result of {task} in run {run}'s log")
}

/// The answers received, by the reply subject's last token: message id and body.
type Answers = HashMap<String, Vec<(String, SubmitReply)>>;

/// An answer on a reply subject: its message id and body.
fn answer_of(m: &async_nats::Message) -> anyhow::Result<(String, SubmitReply)> {
    let id = m
        .headers
        .as_ref()
        .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
        .map(|v| v.as_str().to_owned())
        .unwrap_or_default();
    Ok((id, serde_json::from_slice(&m.payload)?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_answers_when_its_success_decides_the_run() -> anyhow::Result<()> {
    let mut p = Processes::start(QUICK).await?;
    let c = p.coordinator().await?;
    let w = p.worker(&[]).await?;
    let inbox = p.bus.client().new_inbox();
    let mut answers = p.bus.client().subscribe(format!("{inbox}.>")).await?;

    let diamond = plan(vec![
        Subtask::new("a", "A."),
        Subtask::new("b", "B.").after(&["a"]),
        Subtask::new("c", "C.").after(&["a"]),
        Subtask::new("d", "D.").after(&["b", "c"]),
    ]);
    let mut writes = Subtask::new("w", "Write.");
    writes.produces = vec!["notes".into()];
    let cases = [
        (
            "one task",
            plan(vec![Subtask::new("only", "Only.")]),
            "only",
            true,
        ),
        ("diamond", diamond, "d", true),
        (
            "a last task that writes a topic",
            plan(vec![writes]),
            "w",
            false,
        ),
    ];
    for (i, (name, plan, last, by_worker)) in cases.into_iter().enumerate() {
        let mut req = SubmitRequest::new(plan);
        req.reply_to = Some(format!("{inbox}.{i}"));
        let run = p.client.submit(req).await?;
        let m = tokio::time::timeout(WAIT, answers.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("the answers ended"))?;
        let (id, reply) = answer_of(&m)?;
        assert_eq!(id, format!("finished.{run}"), "{name}");
        assert_eq!(reply.status, SubmitStatus::Finished, "{name}: {reply:?}");
        assert_eq!(reply.run_id, Some(run), "{name}");
        // The outcome the coordinator records from the log.
        p.client.wait(run, WAIT).await?;
        let recorded = p.client.run(run).await?.expect("its record").record;
        assert_eq!(recorded.status, RunStatus::Succeeded, "{name}");
        assert_eq!(reply.outcome, recorded.outcome, "{name}");
        assert_eq!(
            answered_by_worker(&p, run, last).await?,
            by_worker,
            "{name}: who answered\ncoordinator:\n{}\nworker:\n{}",
            p.log(c),
            p.log(w)
        );
    }
    // Exactly one answer each: nothing follows.
    let more = tokio::time::timeout(Duration::from_millis(1500), answers.next()).await;
    assert!(more.is_err(), "a second answer: {more:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_run_is_answered_once_through_kills_of_coordinators_and_workers() -> anyhow::Result<()>
{
    let mut p = Processes::start(QUICK).await?;
    let c1 = p.coordinator().await?;
    p.coordinator().await?;
    let w1 = p.worker(&["--concurrency", "16"]).await?;
    p.worker(&["--concurrency", "16"]).await?;
    let inbox = p.bus.client().new_inbox();
    let mut sub = p.bus.client().subscribe(format!("{inbox}.>")).await?;
    let collected: std::sync::Arc<std::sync::Mutex<Answers>> = Default::default();
    let collector = {
        let collected = collected.clone();
        let prefix = format!("{inbox}.");
        tokio::spawn(async move {
            while let Some(m) = sub.next().await {
                let key = m.subject.as_str().trim_start_matches(&prefix).to_owned();
                if let Ok(a) = answer_of(&m)
                    && let Ok(mut c) = collected.lock()
                {
                    c.entry(key).or_default().push(a);
                }
            }
        })
    };
    let mut runs = Vec::new();
    for i in 0..300 {
        if i == 100 {
            // Mid-stream: a coordinator and a worker die; replacements start later.
            p.kill(c1);
            p.kill(w1);
        }
        if i == 200 {
            p.coordinator().await?;
            p.worker(&["--concurrency", "16"]).await?;
        }
        let run = RunId::new();
        let mut req = SubmitRequest::new(plan(vec![Subtask::new("t", "Go.")]));
        req.run_id = Some(run);
        req.reply_to = Some(format!("{inbox}.{run}"));
        p.client.submit(req).await?;
        runs.push(run);
        if i % 10 == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    for run in &runs {
        let outcome = p.client.wait(*run, Duration::from_secs(120)).await?;
        assert_eq!(outcome.status, RunStatus::Succeeded, "{run}");
    }
    // Answers of a worker killed after storing its result come with the redelivery of its
    // task (one ack wait later).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let n = collected.lock().map(|c| c.len()).unwrap_or_default();
        if n >= runs.len() || tokio::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    collector.abort();
    let collected = collected
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .clone();
    let mut by_workers = 0;
    let mut repeats = 0;
    for run in &runs {
        let got = collected
            .get(&run.to_string())
            .ok_or_else(|| anyhow::anyhow!("run {run} got no answer"))?;
        let recorded = p.client.run(*run).await?.expect("a record").record;
        for (id, reply) in got {
            assert_eq!(id, &format!("finished.{run}"), "one message id per run");
            assert_eq!(
                reply.outcome, recorded.outcome,
                "{run}: the recorded outcome"
            );
        }
        repeats += got.len() - 1;
        if answered_by_worker(&p, *run, "t").await? {
            by_workers += 1;
        }
    }
    assert!(by_workers > 100, "{by_workers} of 300 answered by workers");
    // A repeat only where a process died between answering and acknowledging.
    assert!(repeats <= 4, "{repeats} repeated answers");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_input_before_the_result_leaves_the_answer_to_the_coordinator() -> anyhow::Result<()> {
    use flotilla_model::control::{PauseRunRequest, ResumeRunRequest};
    let mut p = Processes::start(QUICK).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let inbox = p.bus.client().new_inbox();
    let mut answers = p.bus.client().subscribe(inbox.clone()).await?;
    let mut req = SubmitRequest::new(plan(vec![
        Subtask::new("long", "Take a while.").with_agent("slow"),
    ]));
    req.reply_to = Some(inbox);
    let run = p.client.submit(req).await?;
    task_started(&p.client, run, "long").await?;
    // A pause and a resume reach the run's log while its only task runs.
    let _: flotilla_model::control::ControlRunReply = p
        .client
        .request(
            &PauseRunRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                run_id: run,
                reason: None,
                by: Some("alice".into()),
                timeout_ms: None,
                children: true,
                task_id: None,
            },
            WAIT,
        )
        .await?;
    let _: flotilla_model::control::ControlRunReply = p
        .client
        .request(
            &ResumeRunRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                run_id: run,
                reason: None,
                by: Some("alice".into()),
                children: true,
                task_id: None,
            },
            WAIT,
        )
        .await?;
    let m = tokio::time::timeout(WAIT, answers.next())
        .await?
        .ok_or_else(|| anyhow::anyhow!("the answers ended"))?;
    let (id, reply) = answer_of(&m)?;
    assert_eq!(id, format!("finished.{run}"));
    p.client.wait(run, WAIT).await?;
    let recorded = p.client.run(run).await?.expect("its record").record;
    assert_eq!(recorded.status, RunStatus::Succeeded);
    assert_eq!(reply.outcome, recorded.outcome);
    assert!(
        !answered_by_worker(&p, run, "long").await?,
        "the log moved on: the coordinator answered"
    );
    let more = tokio::time::timeout(Duration::from_millis(1500), answers.next()).await;
    assert!(more.is_err(), "a second answer: {more:?}");
    Ok(())
}
