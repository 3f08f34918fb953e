//! Shared set-up: a real nats-server from the test kit, and scopes as the worker builds them.

#![allow(dead_code, unreachable_pub)]

use flotilla_bus::{Bus, JetStreamOptions};
use flotilla_context::{Clients, Scope};
use flotilla_model::ids::{AttemptId, RunId, TaskId};
use flotilla_model::plan::DataflowValidation;
use flotilla_testkit::NatsServer;

/// A server with Flotilla's streams and buckets.
pub async fn server() -> anyhow::Result<(NatsServer, Bus)> {
    let server = NatsServer::start().await?;
    let bus = server.provisioned_bus().await?;
    Ok((server, bus))
}

/// A server provisioned with `opts`.
pub async fn server_with(opts: &JetStreamOptions) -> anyhow::Result<(NatsServer, Bus)> {
    let server = NatsServer::start().await?;
    let bus = server.bus().await?;
    bus.provision(opts).await?;
    Ok((server, bus))
}

/// The scope of delivery 1 of attempt 1 of `task` in root run `run`, unrestricted topics.
pub fn task_scope(bus: &Bus, run: RunId, task: &str) -> Scope {
    Scope {
        names: bus.names().clone(),
        run_id: run,
        root_run_id: run,
        session: run.to_string(),
        task_id: Some(TaskId::new(task)),
        attempt: Some(1),
        attempt_id: Some(AttemptId::new()),
        delivery: Some(1),
        produces: None,
        dataflow: DataflowValidation::Lenient,
        by: None,
        trace: None,
        role: None,
    }
}

/// Clients of `scope`.
pub fn clients(bus: &Bus, scope: Scope) -> anyhow::Result<Clients> {
    Ok(Clients::new(bus.clone(), scope)?)
}

/// Clients of a fresh attempt of `task`.
pub fn task(bus: &Bus, run: RunId, task: &str) -> anyhow::Result<Clients> {
    clients(bus, task_scope(bus, run, task))
}

/// A JSON object from a `json!` value.
pub fn obj(v: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
    match v {
        serde_json::Value::Object(m) => m,
        other => panic!("not an object: {other}"),
    }
}
