//! Submitting runs the way the bench chooses (`--submit-via`) and observing their ends.

use std::sync::Arc;

use flotilla_bus::Bus;
use flotilla_client::Client;
use flotilla_model::ids::RunId;
use flotilla_model::run::RunOutcome;
use flotilla_model::submit::{SubmitReply, SubmitRequest};
use futures::StreamExt;
use tokio::sync::{Semaphore, mpsc};

use super::plans::independent_plan;

/// Where the bench publishes its durable submissions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum SubmitVia {
    /// `<prefix>.submit.<run>`: the submission is the run's first message.
    RunSubject,
    /// `<prefix>.submit`: the intake stream.
    Intake,
}

/// Publishes a durable submission the chosen way and waits for its PubAck.
pub(crate) async fn submit_via(
    bus: &Bus,
    request: SubmitRequest,
    via: SubmitVia,
) -> anyhow::Result<RunId> {
    match via {
        SubmitVia::RunSubject => Ok(Client::new(bus.clone()).submit(request).await?),
        SubmitVia::Intake => {
            let mut request = request;
            let run = *request.run_id.get_or_insert_with(RunId::new);
            bus.publish(bus.names().submit(), &request, Some(&format!("run.{run}")))
                .await?;
            Ok(run)
        }
    }
}

/// Submits `runs` runs of `per_run` independent tasks with `reply_to = inbox`, each once a
/// permit of `window` is free (the caller adds one per finished run).
pub(crate) fn spawn_submitter(
    bus: &Bus,
    inbox: &str,
    runs: usize,
    per_run: usize,
    via: SubmitVia,
    window: Arc<Semaphore>,
) -> tokio::task::JoinHandle<()> {
    let bus = bus.clone();
    let inbox = inbox.to_owned();
    tokio::spawn(async move {
        let mut acks = futures::stream::FuturesUnordered::new();
        for _ in 0..runs {
            let Ok(permit) = Arc::clone(&window).acquire_owned().await else {
                break;
            };
            permit.forget();
            let mut req = SubmitRequest::new(independent_plan(per_run));
            req.reply_to = Some(inbox.clone());
            let bus = bus.clone();
            acks.push(async move { submit_via(&bus, req, via).await });
            while let Some(Some(_)) = futures::FutureExt::now_or_never(acks.next()) {}
        }
        while acks.next().await.is_some() {}
    })
}

/// Outcomes of runs submitted with `reply_to = inbox`: one core message per finished run,
/// so observing completion costs the server nothing beyond the run itself.
pub(crate) async fn outcomes(
    bus: &Bus,
    inbox: String,
) -> anyhow::Result<mpsc::UnboundedReceiver<RunOutcome>> {
    let mut sub = bus.client().subscribe(inbox).await?;
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            if let Ok(reply) = serde_json::from_slice::<SubmitReply>(&m.payload)
                && let Some(o) = reply.outcome
                && tx.send(o).is_err()
            {
                break;
            }
        }
    });
    Ok(rx)
}

/// How many attempts `run` dispatched, from its record (every task's attempts).
pub(crate) async fn attempts_of(client: &Client, run: RunId) -> anyhow::Result<usize> {
    let view = client
        .run(run)
        .await?
        .ok_or_else(|| anyhow::anyhow!("run {run} does not exist"))?;
    Ok(view.tasks.iter().map(|t| t.attempts as usize).sum())
}
