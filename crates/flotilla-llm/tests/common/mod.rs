//! Shared set-up: a real nats-server from the test kit, the scripted OpenAI-compatible test
//! server (a test double: every model answer is scripted by the test), and attempts as the
//! worker runs them.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use flotilla_bus::Bus;
use flotilla_context::{Agent, AgentContext, AgentError, AgentReply, Clients, EventEmitter, Scope};
use flotilla_llm::{LlmAgent, LlmConfig, Providers, Roles};
use flotilla_model::RunId;
use flotilla_model::event::{Event, decode_events};
use flotilla_model::subjects::StreamKind;
use flotilla_model::task::TaskEnvelope;
use flotilla_testkit::NatsServer;
use flotilla_testkit::openai::OpenAiServer;
use tokio_util::sync::CancellationToken;

pub struct Harness {
    pub nats: NatsServer,
    pub bus: Bus,
    pub llm: OpenAiServer,
}

impl Harness {
    pub async fn start() -> anyhow::Result<Self> {
        let nats = NatsServer::start().await?;
        let bus = nats.provisioned_bus().await?;
        let llm = OpenAiServer::start().await?;
        Ok(Self { nats, bus, llm })
    }

    /// A configuration pointing at the scripted server, with short retry waits.
    pub fn config(&self) -> LlmConfig {
        let mut c = LlmConfig::new(self.llm.base_url(), "scripted-model");
        c.retry_initial_backoff = Duration::from_millis(50);
        c.retry_max_backoff = Duration::from_millis(200);
        c
    }

    pub fn agent(&self, config: &LlmConfig) -> anyhow::Result<LlmAgent> {
        Ok(LlmAgent::new(
            "test_agent",
            config,
            Arc::new(Roles::default()),
            &Providers::default(),
            std::path::Path::new("."),
        )?)
    }

    /// Runs one attempt of `task` with `timeout`.
    pub async fn run(
        &self,
        agent: &LlmAgent,
        task: &TaskEnvelope,
        timeout: Duration,
    ) -> anyhow::Result<Result<AgentReply, AgentError>> {
        let (ctx, _cancel) = self.context(task, timeout)?;
        Ok(agent.run(task, ctx).await)
    }

    /// The context of delivery 1 of `task`, as the worker builds it.
    pub fn context(
        &self,
        task: &TaskEnvelope,
        timeout: Duration,
    ) -> anyhow::Result<(AgentContext, CancellationToken)> {
        self.context_of_delivery(task, timeout, 1)
    }

    /// The context of delivery `delivery` of `task` (2 and up: its worker died before).
    pub fn context_of_delivery(
        &self,
        task: &TaskEnvelope,
        timeout: Duration,
        delivery: i64,
    ) -> anyhow::Result<(AgentContext, CancellationToken)> {
        let scope = Scope::from_envelope(task, delivery, self.bus.names().clone());
        let clients = Clients::new(self.bus.clone(), scope)?;
        let cancel = CancellationToken::new();
        let events = EventEmitter::new(Some(self.bus.clone()), task, "test-worker", delivery);
        Ok((
            AgentContext::new(
                clients,
                cancel.clone(),
                Instant::now() + timeout,
                events,
                "test-worker",
            ),
            cancel,
        ))
    }

    /// Clients of an operator on `run` (to read what the agent wrote).
    pub fn operator(&self, run: RunId) -> anyhow::Result<Clients> {
        let scope = Scope::operator(self.bus.names().clone(), run, run, run.to_string());
        Ok(Clients::new(self.bus.clone(), scope)?)
    }

    /// The events of `run` once `done` holds for them (events are published without
    /// waiting, so they may trail the attempt a little).
    pub async fn events(
        &self,
        run: RunId,
        done: impl Fn(&[Event]) -> bool,
    ) -> anyhow::Result<Vec<Event>> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut events = Vec::new();
            let messages = self
                .bus
                .direct_batch(
                    StreamKind::Events,
                    &self.bus.names().event(run),
                    0,
                    1000,
                    None,
                )
                .await?;
            for m in messages {
                for e in decode_events(flotilla_model::codec::Codec::Json, &m.payload)? {
                    events.push(e.event);
                }
            }
            if done(&events) {
                return Ok(events);
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the expected events did not arrive; got {events:#?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A task envelope with `task_id` and `description` in a new run.
pub fn envelope(task_id: &str, description: &str) -> TaskEnvelope {
    let mut t: TaskEnvelope = serde_json::from_value(serde_json::json!({
        "run_id": RunId::new(),
        "task_id": task_id,
        "attempt": 1,
        "attempt_id": flotilla_model::ids::AttemptId::new(),
        "pool": "default",
        "required": true,
        "timeout": 60,
        "dispatched_at": "2026-01-01T00:00:00Z",
        "dataflow_validation": "lenient"
    }))
    .expect("envelope");
    t.description = description.into();
    t
}
