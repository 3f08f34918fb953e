//! What every Flotilla agent of the protocol shares, whatever a prompt does: one instance of
//! the `agents` micro service (the `prompt` and `status` endpoints in the queue group
//! `agents`, the heartbeat), the decoding of a prompt and its refusals, keep-alives, error
//! frames and the end of the stream, and the `404 unknown_agent` answer for addresses of
//! this deployment's owner that nobody serves.
//!
//! What a prompt *does* is a [`Prompter`]'s: the coordinators' exposer runs a one-task plan
//! ([`crate::expose`]); the supervisors post a message to a persistent teammate and wait for
//! its turn (`flotilla-supervisor`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::service::ServiceExt;
use bytes::Bytes;
use flotilla_model::ids::RunId;
use flotilla_model::time::Timestamp;
use futures::StreamExt;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::wire::{
    self, AgentAddress, Chunk, Envelope, ErrorBody, Heartbeat, decode_envelope, header_description,
};
use crate::{AgentsError, AgentsErrorKind};

/// The queue group of the subscription that answers prompts naming no exposed agent: every
/// process serving the deployment has one, and one of them answers.
const UNKNOWN_QUEUE: &str = "flotilla-agents-unknown";

/// How long a keep-alive waits to learn that nobody listens on the caller's inbox (the
/// server answers "no responders" at once; a listening caller never answers). Also how long
/// the unknown-agent answer asks whether another process serves an address.
const PROBE_WAIT: Duration = Duration::from_secs(1);

/// How long a stopping process gives its running prompts to say so to their callers.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// One exposed agent as registered: what a caller discovers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// The Flotilla name it serves (an agent definition's, a teammate's).
    pub name: String,
    /// Its subjects' tokens.
    pub address: AgentAddress,
    /// The service instance's id (`$SRV.INFO`, heartbeats' `instance_id`).
    pub instance_id: String,
}

/// What one service instance advertises.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceSpec {
    /// The Flotilla name it serves (the registration's `name`).
    pub name: String,
    /// Its address.
    pub address: AgentAddress,
    /// The service's `description`.
    pub description: String,
    /// The service's metadata (the protocol's keys and Flotilla's).
    pub metadata: HashMap<String, String>,
}

/// How a prompt's stream ends, once the prompter is done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// The end of the stream, nothing before it.
    End,
    /// An error frame, then the end.
    Error(Failure),
    /// The caller went away: nothing more is sent.
    Gone,
}

/// An error frame's contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// `Nats-Service-Error-Code` and the body's `status`.
    pub status: u16,
    /// The body's `code`.
    pub code: &'static str,
    /// Why, in a sentence.
    pub message: String,
    /// The Flotilla run concerned, if any.
    pub run: Option<RunId>,
}

impl Ending {
    /// An error frame then the end.
    pub fn error(status: u16, code: &'static str, message: impl Into<String>) -> Self {
        Self::Error(Failure {
            status,
            code,
            message: message.into(),
            run: None,
        })
    }
}

/// What a prompt does: everything between its decoding (refusals of malformed prompts and
/// attachments are shared) and the end of its stream, including the leading `ack`.
pub trait Prompter: Clone + Send + Sync + 'static {
    /// Answers `envelope`, a prompt for `agent`, on `out`; the returned [`Ending`] is sent
    /// after.
    fn prompt(
        &self,
        agent: Registration,
        envelope: Envelope,
        out: Outbox,
    ) -> impl Future<Output = Ending> + Send;
}

/// The caller's reply inbox: chunks, error frames and the end go there.
#[derive(Clone, Debug)]
pub struct Outbox {
    nats: async_nats::Client,
    reply: String,
}

impl Outbox {
    /// The stream to `reply`.
    pub fn new(nats: async_nats::Client, reply: String) -> Self {
        Self { nats, reply }
    }

    /// The connection the stream goes out on.
    pub fn nats(&self) -> &async_nats::Client {
        &self.nats
    }

    /// Sends one chunk.
    pub async fn chunk(&self, chunk: &Chunk) {
        if let Err(e) = self.nats.publish(self.reply.clone(), chunk.encode()).await {
            debug!(error = %e, "A chunk was not sent");
        }
    }

    /// The leading `ack`, flushed: the caller knows at once that the prompt was taken.
    pub async fn ack(&self) {
        self.chunk(&Chunk::ack()).await;
        let _ = self.nats.flush().await;
    }

    /// An error frame: the micro-service error headers and an [`ErrorBody`]. Not the end.
    pub async fn error(&self, status: u16, code: &str, message: &str, run: Option<RunId>) {
        let mut headers = HeaderMap::new();
        headers.insert(wire::ERROR_HEADER, header_description(message).as_str());
        headers.insert(wire::ERROR_CODE_HEADER, status.to_string().as_str());
        headers.insert(
            flotilla_model::codec::CONTENT_TYPE,
            flotilla_model::codec::JSON,
        );
        let body = ErrorBody {
            status,
            code: code.to_owned(),
            message: message.to_owned(),
            run_id: run.map(|r| r.to_string()),
        };
        let payload = serde_json::to_vec(&body).unwrap_or_default();
        if let Err(e) = self
            .nats
            .publish_with_headers(self.reply.clone(), headers, payload.into())
            .await
        {
            debug!(error = %e, "An error frame was not sent");
        }
    }

    /// The end of the stream: an empty message without headers.
    pub async fn end(&self) {
        let _ = self.nats.publish(self.reply.clone(), Bytes::new()).await;
        let _ = self.nats.flush().await;
    }

    /// Sends `ending`: an error frame then the end, the end, or nothing (a caller gone).
    pub async fn finish(&self, ending: Ending) {
        match ending {
            Ending::Gone => return,
            Ending::End => {}
            Ending::Error(f) => {
                self.error(f.status, f.code, &f.message, f.run).await;
            }
        }
        self.end().await;
    }

    /// A keep-alive `ack`, sent as a request: the server answers "no responders" when
    /// nothing listens on the inbox any more — the caller went away (the protocol has no
    /// cancel message: a caller cancels by unsubscribing). A listening caller just sees the
    /// ack.
    pub async fn still_listening(&self) -> bool {
        let request = async_nats::Request::new()
            .payload(Chunk::ack().encode())
            .timeout(Some(PROBE_WAIT));
        match self.nats.send_request(self.reply.clone(), request).await {
            Err(e) => e.kind() != async_nats::RequestErrorKind::NoResponders,
            Ok(_) => true,
        }
    }

    /// Sends a keep-alive `ack` every `every` until the returned guard is dropped; the
    /// receiver resolves when the caller went away.
    pub fn keepalive(&self, every: Duration) -> (KeepAlive, tokio::sync::oneshot::Receiver<()>) {
        let (gone_tx, gone) = tokio::sync::oneshot::channel::<()>();
        let out = self.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if !out.still_listening().await {
                    let _ = gone_tx.send(());
                    return;
                }
            }
        });
        (KeepAlive(task), gone)
    }
}

/// Keep-alives of one stream: they stop when this is dropped.
#[derive(Debug)]
pub struct KeepAlive(tokio::task::JoinHandle<()>);

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One registered instance of the `agents` service: its endpoints, not yet served.
pub struct Instance {
    service: async_nats::service::Service,
    prompts: async_nats::service::endpoint::Endpoint,
    statuses: async_nats::service::endpoint::Endpoint,
    registration: Registration,
    beat: Heartbeat,
    every: Duration,
    nats: async_nats::Client,
}

impl std::fmt::Debug for Instance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Instance")
            .field("registration", &self.registration)
            .finish_non_exhaustive()
    }
}

impl Instance {
    /// Registers `spec` as an instance of the `agents` service on `nats`: a caller can
    /// discover it from now on. `max_payload`: the server's, advertised on the prompt
    /// endpoint; `every`: the heartbeat interval.
    pub async fn start(
        nats: &async_nats::Client,
        spec: InstanceSpec,
        max_payload: usize,
        every: Duration,
    ) -> Result<Self, AgentsError> {
        let setup = |e: async_nats::Error| {
            AgentsError::new(
                AgentsErrorKind::Nats,
                format!("registering the agents service: {e}"),
            )
        };
        let service = nats
            .service_builder()
            .description(spec.description)
            .metadata(spec.metadata)
            .start(wire::SERVICE_NAME, env!("CARGO_PKG_VERSION"))
            .await
            .map_err(setup)?;
        let prompts = service
            .endpoint_builder()
            .name(wire::VERB_PROMPT)
            .queue_group(wire::QUEUE_GROUP)
            .metadata(HashMap::from([
                (
                    wire::metadata::MAX_PAYLOAD.to_owned(),
                    human_bytes(max_payload),
                ),
                (
                    wire::metadata::ATTACHMENTS_OK.to_owned(),
                    "false".to_owned(),
                ),
            ]))
            .add(spec.address.prompt())
            .await
            .map_err(setup)?;
        let statuses = service
            .endpoint_builder()
            .name(wire::VERB_STATUS)
            .queue_group(wire::QUEUE_GROUP)
            .add(spec.address.status())
            .await
            .map_err(setup)?;
        let registration = Registration {
            name: spec.name,
            address: spec.address,
            instance_id: service.info().await.id,
        };
        let beat = Heartbeat {
            agent: registration.address.agent.clone(),
            owner: registration.address.owner.clone(),
            session: Some(registration.address.session.clone()),
            instance_id: registration.instance_id.clone(),
            ts: String::new(),
            interval_s: every.as_secs().max(1),
            extra: BTreeMap::new(),
        };
        Ok(Self {
            service,
            prompts,
            statuses,
            registration,
            beat,
            every,
            nats: nats.clone(),
        })
    }

    /// What a caller discovers.
    pub fn registration(&self) -> &Registration {
        &self.registration
    }

    /// Beats, answers `status`, and hands prompts to `prompter` until `stop` (the instance
    /// leaves the service) or `shutdown` (the process stops).
    ///
    /// On `shutdown` the running prompts see the same token (their prompter says so to the
    /// callers) and get [`STOP_GRACE`]; then the instance leaves. On `stop` alone the instance
    /// leaves at once and the running prompts go on to their end (or to `shutdown`).
    pub async fn serve<P: Prompter>(
        mut self,
        prompter: P,
        stop: CancellationToken,
        shutdown: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(self.every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut running = JoinSet::new();
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = shutdown.cancelled() => break,
                _ = tick.tick() => {
                    let body = self.heartbeat_now();
                    if let Err(e) = self.nats.publish(self.registration.address.heartbeat(), body).await {
                        debug!(error = %e, agent = %self.registration.name, "A heartbeat was not sent");
                    }
                }
                Some(request) = self.prompts.next() => {
                    let (prompter, agent, nats) = (prompter.clone(), self.registration.clone(), self.nats.clone());
                    running.spawn(answer(prompter, agent, nats, request.message));
                }
                Some(request) = self.statuses.next() => {
                    let body = self.heartbeat_now();
                    let _ = request.respond(Ok(body)).await;
                }
                Some(_) = running.join_next(), if !running.is_empty() => {}
            }
        }
        if shutdown.is_cancelled() {
            // Running prompts saw the same token: give them a moment to tell their callers.
            let _ = tokio::time::timeout(STOP_GRACE, async {
                while running.join_next().await.is_some() {}
            })
            .await;
            running.abort_all();
            let _ = self.service.stop().await;
        } else {
            let _ = self.service.stop().await;
            let _ = self.nats.flush().await;
            let done = async { while running.join_next().await.is_some() {} };
            tokio::select! {
                _ = done => {}
                _ = shutdown.cancelled() => {
                    let _ = tokio::time::timeout(STOP_GRACE, async {
                        while running.join_next().await.is_some() {}
                    })
                    .await;
                    running.abort_all();
                }
            }
        }
        let _ = self.nats.flush().await;
    }

    /// The heartbeat payload stamped now (the `status` endpoint answers it too).
    fn heartbeat_now(&self) -> Bytes {
        let beat = Heartbeat {
            ts: Timestamp::now().to_rfc3339(),
            ..self.beat.clone()
        };
        serde_json::to_vec(&beat).unwrap_or_default().into()
    }
}

/// Answers one prompt: the shared refusals, then the prompter, then its ending.
async fn answer<P: Prompter>(
    prompter: P,
    agent: Registration,
    nats: async_nats::Client,
    msg: async_nats::Message,
) {
    let Some(reply) = msg.reply.clone() else {
        debug!(subject = %msg.subject, "A prompt without a reply subject: nobody to answer");
        return;
    };
    let out = Outbox::new(nats, reply.to_string());
    let ending = match decode_envelope(&msg.payload) {
        Err(e) => Ending::error(400, "malformed_prompt", e.to_string()),
        Ok(envelope) if !envelope.attachments.is_empty() => Ending::error(
            400,
            "attachments_unsupported",
            "attachments are not supported by this endpoint (attachments_ok is false)",
        ),
        Ok(envelope) => prompter.prompt(agent, envelope, out.clone()).await,
    };
    out.finish(ending).await;
}

/// Answers `404 unknown_agent` to prompts for `owner` that no instance serves.
///
/// Every serving process subscribes in one queue group, so one of them sees each prompt for
/// the owner. A prompt for an address in its own `known` set is served by its instances; for
/// another address it asks the address's `status` endpoint first: when some instance
/// answers (another process serves it — a supervisor's teammate, a coordinator's
/// definition) it stays silent, and only "no responders" makes it answer `unknown_agent`.
pub struct UnknownAgents {
    nats: async_nats::Client,
    known: BTreeSet<String>,
    sub: async_nats::Subscriber,
}

impl std::fmt::Debug for UnknownAgents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnknownAgents")
            .field("known", &self.known)
            .finish_non_exhaustive()
    }
}

impl UnknownAgents {
    /// Subscribes to the prompts of `owner`; `known`: the prompt subjects this process
    /// serves.
    pub async fn subscribe(
        nats: &async_nats::Client,
        owner: &str,
        known: BTreeSet<String>,
    ) -> Result<Self, AgentsError> {
        let sub = nats
            .queue_subscribe(
                format!("{}.{}.*.{owner}.*", wire::ROOT, wire::VERB_PROMPT),
                UNKNOWN_QUEUE.to_owned(),
            )
            .await
            .map_err(|e| {
                AgentsError::with_source(AgentsErrorKind::Nats, "subscribing to prompts", e)
            })?;
        Ok(Self {
            nats: nats.clone(),
            known,
            sub,
        })
    }

    /// Answers until `shutdown`.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut answering = JoinSet::new();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                Some(msg) = self.sub.next() => {
                    if self.known.contains(msg.subject.as_str()) {
                        continue;
                    }
                    let Some(reply) = msg.reply.clone() else { continue };
                    let nats = self.nats.clone();
                    answering.spawn(async move {
                        let address = AgentAddress::parse(&msg.subject, wire::VERB_PROMPT);
                        if let Some(a) = &address
                            && served_elsewhere(&nats, a).await
                        {
                            return;
                        }
                        let name = address
                            .map(|a| a.display())
                            .unwrap_or_else(|| msg.subject.to_string());
                        let out = Outbox::new(nats, reply.to_string());
                        out.finish(Ending::error(
                            404,
                            "unknown_agent",
                            format!("no agent {name} is exposed here"),
                        ))
                        .await;
                    });
                }
                Some(_) = answering.join_next(), if !answering.is_empty() => {}
            }
        }
        answering.abort_all();
        let _ = self.sub.unsubscribe().await;
    }
}

/// Whether an instance (of any process) answers `address`'s `status` endpoint. Only "no
/// responders" says no: an instance that is slow to answer still serves the address.
async fn served_elsewhere(nats: &async_nats::Client, address: &AgentAddress) -> bool {
    let request = async_nats::Request::new()
        .payload(Bytes::new())
        .timeout(Some(PROBE_WAIT));
    match nats.send_request(address.status(), request).await {
        Ok(_) => true,
        Err(e) => e.kind() != async_nats::RequestErrorKind::NoResponders,
    }
}

/// `1MB`, `512KB`, `64B`: a size the way the protocol's `max_payload` says it (base 1024).
pub(crate) fn human_bytes(n: usize) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}MB", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{}KB", n >> 10)
    } else {
        format!("{n}B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_said_in_base_1024() {
        assert_eq!(human_bytes(1 << 20), "1MB");
        assert_eq!(human_bytes(8 << 20), "8MB");
        assert_eq!(human_bytes(512 << 10), "512KB");
        assert_eq!(human_bytes(1000), "1000B");
    }
}
