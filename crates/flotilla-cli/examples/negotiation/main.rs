//! Contract-net negotiation between agents of one run, over durable mailboxes.
//!
//! ```sh
//! cargo run -p flotilla-cli --example negotiation              # embedded nats-server
//! cargo run -p flotilla-cli --example negotiation -- nats://127.0.0.1:4222
//! ```
//!
//! One process runs a nats-server (unless a URL is given), a coordinator and a worker with two
//! Rust agents (`agents.rs`): the `lead` task calls for offers from `analyst_a` and
//! `analyst_b`, which run at the same time as it; the more confident analyst gets the work and
//! sends its result back; the lead's result names the offers, the winner and the answer. The
//! analysts bid fixed confidences from their input, standing in for a model's judgement.

mod agents;

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::Context;
use flotilla_bus::server::{LocalNatsServer, LocalServerOptions};
use flotilla_bus::{Bus, JetStreamOptions, NatsOptions};
use flotilla_client::Client;
use flotilla_coordinator::{Coordinator, CoordinatorOptions};
use flotilla_model::submit::SubmitRequest;
use flotilla_model::validate::{AgentCatalog, ValidationContext};
use flotilla_worker::{Worker, WorkerOptions};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (_server, url) = match std::env::args().nth(1) {
        Some(url) => (None, url),
        None => {
            let server = LocalNatsServer::start(LocalServerOptions::in_dir(dir.path()))
                .await
                .context(
                    "starting nats-server (install it with ./scripts/ensure-nats-server.sh)",
                )?;
            let url = server.url();
            (Some(server), url)
        }
    };
    let opts = NatsOptions::with_url(&url);
    let bus = Bus::connect(&opts, "example").await?;
    bus.provision(&JetStreamOptions::default()).await?;

    let shutdown = CancellationToken::new();
    let ctx = ValidationContext {
        agents: Some(AgentCatalog {
            names: BTreeSet::from(["lead".to_string(), "analyst".to_string()]),
            default: None,
            workflows: BTreeSet::new(),
            roles: Default::default(),
            compensations: Default::default(),
        }),
        ..ValidationContext::default()
    };
    let coordinator = Coordinator::new(
        Bus::connect(&opts, "coordinator").await?,
        CoordinatorOptions::default(),
        ctx,
        JetStreamOptions::default(),
    );
    let worker = Worker::new(
        Bus::connect(&opts, "worker").await?,
        WorkerOptions::default(),
        agents::registry(),
    );
    let services = tokio::spawn({
        let token = shutdown.clone();
        async move {
            let (c, w) = tokio::join!(coordinator.run(token.clone()), worker.run(token));
            c?;
            w?;
            anyhow::Ok(())
        }
    });

    let client = Client::new(bus);
    let run = client.submit(SubmitRequest::new(agents::plan())).await?;
    println!("run {run}: lead, analyst_a and analyst_b start together");
    let outcome = client.wait(run, Duration::from_secs(60)).await?;
    println!("status: {:?}", outcome.status);
    if let Some(result) = &outcome.final_result {
        for (task, r) in &result.results {
            println!("  {task}: {}", r.response);
        }
    }
    shutdown.cancel();
    services.await??;
    anyhow::ensure!(
        outcome.status == flotilla_model::run::RunStatus::Succeeded,
        "the run did not succeed: {outcome:?}"
    );
    Ok(())
}
