//! Flotilla's agents as agents of the NATS Agent Protocol.
//!
//! Each exposed agent definition is one instance of the `agents` micro service per serving
//! process, with `prompt` and `status` endpoints in the queue group `agents` and a heartbeat
//! on `agents.hb.<agent>.<owner>.<session>`. Nothing is kept between prompts: any process
//! serving the same configuration answers any prompt, so coordinators scale by replica
//! count.
//!
//! A prompt's life:
//!
//! ```text
//!  request ──► decode (400 malformed_prompt / attachments_unsupported, then the end)
//!          ──► ack ──► submit a one-task plan for the agent (a Flotilla run)
//!          ──► watch the run: assistant_reply ─► response chunks
//!                             await_clarification ─► query; the caller's answer ─► approval.answer
//!                             keep-alive ack every `keepalive` (no listener left ─► cancel the run)
//!          ──► run succeeded: its answer when nothing was streamed, then the end
//!              run failed, cancelled, rejected, timed out: an error frame, then the end
//! ```
//!
//! A prompt for this deployment's owner that names no exposed agent (or another session) is
//! answered `404 unknown_agent`; prompts for other owners are not this process's to answer.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::service::ServiceExt;
use bytes::Bytes;
use flotilla_bus::Bus;
use flotilla_client::{Client, WatchOptions};
use flotilla_model::approval::{ApprovalAnswerRequest, Decision};
use flotilla_model::event::Event;
use flotilla_model::ids::RunId;
use flotilla_model::plan::{Plan, Subtask};
use flotilla_model::run::{RunOutcome, RunStatus};
use flotilla_model::submit::SubmitRequest;
use flotilla_model::team::MemberCard;
use flotilla_model::time::Timestamp;
use flotilla_model::watch::{ChildPolicy, Profile};
use futures::StreamExt;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::options::AgentsProtocolOptions;
use crate::wire::{
    self, AgentAddress, Chunk, ErrorBody, Heartbeat, Query, decode_envelope, header_description,
};
use crate::{AgentsError, AgentsErrorKind};

/// The id of the one task of a prompt's run.
pub const PROMPT_TASK: &str = "prompt";

/// The run label naming the agent a prompt was for.
pub const AGENT_LABEL: &str = "agents-protocol.agent";

/// The queue group of the subscription that answers prompts naming no exposed agent: every
/// process serving the deployment has one, and one of them answers.
const UNKNOWN_QUEUE: &str = "flotilla-agents-unknown";

/// How long a keep-alive waits to learn that nobody listens on the caller's inbox (the
/// server answers "no responders" at once; a listening caller never answers).
const PROBE_WAIT: Duration = Duration::from_secs(1);

/// How long a stopping process gives its running prompts to say so to their callers.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// An agent definition to expose, with what the team knows of it.
#[derive(Debug, Clone, PartialEq)]
pub struct ExposedAgent {
    /// Its name in `[agents]`.
    pub name: String,
    /// Its member card: the description and roles advertised.
    pub card: MemberCard,
}

/// Serves the exposed agents until shut down.
#[derive(Debug)]
pub struct Exposer {
    bus: Bus,
    opts: AgentsProtocolOptions,
    agents: Vec<ExposedAgent>,
    ready: Option<tokio::sync::oneshot::Sender<Vec<Registration>>>,
}

/// One exposed agent as registered: what a caller discovers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// The agent definition.
    pub name: String,
    /// Its subjects' tokens.
    pub address: AgentAddress,
    /// The service instance's id (`$SRV.INFO`, heartbeats' `instance_id`).
    pub instance_id: String,
}

/// What the prompt handlers share.
struct Shared {
    client: Client,
    nats: async_nats::Client,
    opts: AgentsProtocolOptions,
    shutdown: CancellationToken,
}

impl Exposer {
    /// Exposes `agents` on `bus` with `opts`.
    pub fn new(bus: Bus, opts: AgentsProtocolOptions, agents: Vec<ExposedAgent>) -> Self {
        Self {
            bus,
            opts,
            agents,
            ready: None,
        }
    }

    /// Sends the registrations once every agent is registered and beating (tests, and the
    /// CLI's start-up line).
    pub fn on_ready(mut self, tx: tokio::sync::oneshot::Sender<Vec<Registration>>) -> Self {
        self.ready = Some(tx);
        self
    }

    /// The addresses of `agents` under `opts`, checked: every name must make a distinct
    /// agent token.
    pub fn addresses(
        opts: &AgentsProtocolOptions,
        prefix: &str,
        agents: &[ExposedAgent],
    ) -> Result<Vec<AgentAddress>, AgentsError> {
        let owner = opts.owner_for(prefix);
        let mut taken: BTreeMap<String, &str> = BTreeMap::new();
        let mut out = Vec::with_capacity(agents.len());
        for a in agents {
            let config = |e: String| {
                AgentsError::new(
                    AgentsErrorKind::Config,
                    format!("[agents.{}] cannot be exposed: {e}", a.name),
                )
            };
            let token = wire::agent_token(&a.name).map_err(|e| config(e.to_string()))?;
            if let Some(other) = taken.insert(token.clone(), &a.name) {
                return Err(config(format!(
                    "its agent token {token:?} is also agent {other:?}'s"
                )));
            }
            out.push(
                AgentAddress::new(&token, &owner, &opts.session)
                    .map_err(|e| config(e.to_string()))?,
            );
        }
        Ok(out)
    }

    /// Registers every agent, beats, and answers prompts until `shutdown`; then running
    /// prompts get an error frame saying the process stopped (their runs go on) and the
    /// instances leave the service.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), AgentsError> {
        self.opts
            .validate()
            .map_err(|e| AgentsError::new(AgentsErrorKind::Config, e))?;
        let addresses = Self::addresses(&self.opts, self.bus.names().prefix(), &self.agents)?;
        let nats = self.bus.client().clone();
        let setup = |e: async_nats::Error| {
            AgentsError::new(
                AgentsErrorKind::Nats,
                format!("registering the agents service: {e}"),
            )
        };
        let max_payload = human_bytes(self.bus.max_payload());
        let mut services = Vec::with_capacity(self.agents.len());
        let mut prompts = futures::stream::SelectAll::new();
        let mut statuses = futures::stream::SelectAll::new();
        let mut registrations = Vec::with_capacity(self.agents.len());
        for (i, (agent, address)) in self.agents.iter().zip(&addresses).enumerate() {
            let service = nats
                .service_builder()
                .description(
                    agent
                        .card
                        .description
                        .clone()
                        .unwrap_or_else(|| format!("Flotilla agent {}", agent.name)),
                )
                .metadata(service_metadata(agent, address, self.bus.names().prefix()))
                .start(wire::SERVICE_NAME, env!("CARGO_PKG_VERSION"))
                .await
                .map_err(setup)?;
            let prompt = service
                .endpoint_builder()
                .name(wire::VERB_PROMPT)
                .queue_group(wire::QUEUE_GROUP)
                .metadata(HashMap::from([
                    (wire::metadata::MAX_PAYLOAD.to_owned(), max_payload.clone()),
                    (
                        wire::metadata::ATTACHMENTS_OK.to_owned(),
                        "false".to_owned(),
                    ),
                ]))
                .add(address.prompt())
                .await
                .map_err(setup)?;
            let status = service
                .endpoint_builder()
                .name(wire::VERB_STATUS)
                .queue_group(wire::QUEUE_GROUP)
                .add(address.status())
                .await
                .map_err(setup)?;
            prompts.push(prompt.map(move |r| (i, r)));
            statuses.push(status.map(move |r| (i, r)));
            registrations.push(Registration {
                name: agent.name.clone(),
                address: address.clone(),
                instance_id: service.info().await.id,
            });
            services.push(service);
        }
        let owner = self.opts.owner_for(self.bus.names().prefix());
        let known: BTreeSet<String> = addresses.iter().map(AgentAddress::prompt).collect();
        let mut unknown = nats
            .queue_subscribe(
                format!("{}.{}.*.{owner}.*", wire::ROOT, wire::VERB_PROMPT),
                UNKNOWN_QUEUE.to_owned(),
            )
            .await
            .map_err(|e| {
                AgentsError::with_source(AgentsErrorKind::Nats, "subscribing to prompts", e)
            })?;
        let beats = heartbeats(&registrations, self.opts.heartbeat);
        let beating = tokio::spawn(beat(nats.clone(), beats.clone(), self.opts.heartbeat, {
            shutdown.clone()
        }));
        nats.flush().await.map_err(|e| {
            AgentsError::with_source(AgentsErrorKind::Nats, "registering the agents", e)
        })?;
        info!(
            agents = registrations.len(),
            owner = %owner,
            session = %self.opts.session,
            "Agents exposed on the NATS Agent Protocol"
        );
        if let Some(tx) = self.ready {
            let _ = tx.send(registrations.clone());
        }
        let shared = Arc::new(Shared {
            client: Client::new(self.bus.clone()),
            nats: nats.clone(),
            opts: self.opts.clone(),
            shutdown: shutdown.clone(),
        });
        let mut running = JoinSet::new();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                Some((i, request)) = prompts.next() => {
                    let agent = registrations[i].clone();
                    running.spawn(prompt(shared.clone(), agent, request.message));
                }
                Some((i, request)) = statuses.next() => {
                    let beat = Heartbeat { ts: Timestamp::now().to_rfc3339(), ..beats[i].1.clone() };
                    let body = serde_json::to_vec(&beat).unwrap_or_default();
                    let _ = request.respond(Ok(body.into())).await;
                }
                Some(msg) = unknown.next() => {
                    if !known.contains(msg.subject.as_str())
                        && let Some(reply) = msg.reply.clone()
                    {
                        let out = Outbox { nats: nats.clone(), reply: reply.to_string() };
                        let name = AgentAddress::parse(&msg.subject, wire::VERB_PROMPT)
                            .map(|a| a.display())
                            .unwrap_or_else(|| msg.subject.to_string());
                        out.error(404, "unknown_agent", &format!("no agent {name} is exposed here"), None).await;
                        out.end().await;
                    }
                }
                Some(_) = running.join_next(), if !running.is_empty() => {}
            }
        }
        // Running prompts saw the same token: give them a moment to tell their callers.
        let _ = tokio::time::timeout(STOP_GRACE, async {
            while running.join_next().await.is_some() {}
        })
        .await;
        running.abort_all();
        let _ = beating.await;
        let _ = unknown.unsubscribe().await;
        for s in services {
            let _ = s.stop().await;
        }
        let _ = nats.flush().await;
        info!("Agents left the NATS Agent Protocol service");
        Ok(())
    }
}

/// `1MB`, `512KB`, `64B`: a size the way the protocol's `max_payload` says it (base 1024).
fn human_bytes(n: usize) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}MB", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{}KB", n >> 10)
    } else {
        format!("{n}B")
    }
}

/// The service instance's metadata: the protocol's keys, then what Flotilla adds (unknown
/// keys are kept by callers): the roles as capabilities, the definition's name, the prefix.
fn service_metadata(
    agent: &ExposedAgent,
    address: &AgentAddress,
    prefix: &str,
) -> HashMap<String, String> {
    let mut capabilities: Vec<&str> = agent.card.roles.iter().map(String::as_str).collect();
    for c in &agent.card.capabilities {
        if !capabilities.contains(&c.as_str()) {
            capabilities.push(c);
        }
    }
    let mut m = HashMap::from([
        (wire::metadata::AGENT.to_owned(), address.agent.clone()),
        (wire::metadata::OWNER.to_owned(), address.owner.clone()),
        (wire::metadata::SESSION.to_owned(), address.session.clone()),
        (
            wire::metadata::PROTOCOL_VERSION.to_owned(),
            wire::PROTOCOL_VERSION.to_owned(),
        ),
        ("flotilla_agent".to_owned(), agent.name.clone()),
        ("flotilla_prefix".to_owned(), prefix.to_owned()),
    ]);
    if !capabilities.is_empty() {
        m.insert("capabilities".to_owned(), capabilities.join(","));
    }
    if !agent.card.roles.is_empty() {
        m.insert("roles".to_owned(), agent.card.roles.join(","));
    }
    m
}

/// Each registration's heartbeat subject and payload (its `ts` set when sent).
fn heartbeats(registrations: &[Registration], every: Duration) -> Vec<(String, Heartbeat)> {
    registrations
        .iter()
        .map(|r| {
            (
                r.address.heartbeat(),
                Heartbeat {
                    agent: r.address.agent.clone(),
                    owner: r.address.owner.clone(),
                    session: Some(r.address.session.clone()),
                    instance_id: r.instance_id.clone(),
                    ts: String::new(),
                    interval_s: every.as_secs().max(1),
                    extra: BTreeMap::new(),
                },
            )
        })
        .collect()
}

/// Publishes every agent's heartbeat now and then every `every` until `shutdown`: one timer
/// for all of them.
async fn beat(
    nats: async_nats::Client,
    beats: Vec<(String, Heartbeat)>,
    every: Duration,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let ts = Timestamp::now().to_rfc3339();
        for (subject, beat) in &beats {
            let beat = Heartbeat {
                ts: ts.clone(),
                ..beat.clone()
            };
            let body = serde_json::to_vec(&beat).unwrap_or_default();
            if let Err(e) = nats.publish(subject.clone(), body.into()).await {
                debug!(error = %e, %subject, "A heartbeat was not sent");
            }
        }
    }
}

/// The caller's reply inbox: chunks, error frames and the end go there.
#[derive(Clone)]
struct Outbox {
    nats: async_nats::Client,
    reply: String,
}

impl Outbox {
    async fn chunk(&self, chunk: &Chunk) {
        if let Err(e) = self.nats.publish(self.reply.clone(), chunk.encode()).await {
            debug!(error = %e, "A chunk was not sent");
        }
    }

    /// An error frame: the micro-service error headers and an [`ErrorBody`]. Not the end.
    async fn error(&self, status: u16, code: &str, message: &str, run: Option<RunId>) {
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
    async fn end(&self) {
        let _ = self.nats.publish(self.reply.clone(), Bytes::new()).await;
        let _ = self.nats.flush().await;
    }

    /// A keep-alive `ack`, sent as a request: the server answers "no responders" when
    /// nothing listens on the inbox any more — the caller went away (the protocol has no
    /// cancel message: a caller cancels by unsubscribing). A listening caller just sees the
    /// ack.
    async fn still_listening(&self) -> bool {
        let request = async_nats::Request::new()
            .payload(Chunk::ack().encode())
            .timeout(Some(PROBE_WAIT));
        match self.nats.send_request(self.reply.clone(), request).await {
            Err(e) => e.kind() != async_nats::RequestErrorKind::NoResponders,
            Ok(_) => true,
        }
    }
}

/// The one-task plan a prompt runs.
fn prompt_plan(agent: &str, prompt: &str, pool: &str) -> Plan {
    let mut task = Subtask::new(PROMPT_TASK, prompt).with_agent(agent);
    task.pool = pool.to_owned();
    Plan {
        name: Some(format!("agents.prompt {agent}")),
        query: Some(prompt.to_owned()),
        subtasks: vec![task],
        config: Default::default(),
    }
}

/// Answers one prompt: see the module's diagram.
async fn prompt(shared: Arc<Shared>, agent: Registration, msg: async_nats::Message) {
    let Some(reply) = msg.reply.clone() else {
        debug!(subject = %msg.subject, "A prompt without a reply subject: nobody to answer");
        return;
    };
    let out = Outbox {
        nats: shared.nats.clone(),
        reply: reply.to_string(),
    };
    let envelope = match decode_envelope(&msg.payload) {
        Ok(e) => e,
        Err(e) => {
            out.error(400, "malformed_prompt", &e.to_string(), None)
                .await;
            out.end().await;
            return;
        }
    };
    if !envelope.attachments.is_empty() {
        out.error(
            400,
            "attachments_unsupported",
            "attachments are not supported by this endpoint (attachments_ok is false)",
            None,
        )
        .await;
        out.end().await;
        return;
    }
    out.chunk(&Chunk::ack()).await;
    let _ = out.nats.flush().await;
    let run = RunId::new();
    let mut request = SubmitRequest::new(prompt_plan(
        &agent.name,
        &envelope.prompt,
        &shared.opts.pool,
    ));
    request.run_id = Some(run);
    request
        .labels
        .insert(AGENT_LABEL.to_owned(), agent.name.clone());
    let submitted = shared.client.submit(request).await;
    let events = match submitted {
        Ok(_) => {
            shared
                .client
                .watch(
                    run,
                    WatchOptions {
                        profile: Profile::User,
                        children: ChildPolicy::Off,
                        since: 0,
                        since_index: None,
                    },
                )
                .await
        }
        Err(e) => Err(e),
    };
    let events = match events {
        Ok(events) => events,
        Err(e) => {
            warn!(error = %e, agent = %agent.name, "A prompt's run could not start");
            out.error(500, "submit_failed", &e.to_string(), Some(run))
                .await;
            out.end().await;
            return;
        }
    };
    debug!(%run, agent = %agent.name, "Prompt started a run");
    futures::pin_mut!(events);
    // Keep-alives, and the news that the caller went away.
    let (gone_tx, mut gone) = tokio::sync::oneshot::channel::<()>();
    let keepalive = tokio::spawn({
        let out = out.clone();
        let every = shared.opts.keepalive;
        async move {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if !out.still_listening().await {
                    let _ = gone_tx.send(());
                    return;
                }
            }
        }
    });
    let mut questions: JoinSet<()> = JoinSet::new();
    let deadline = tokio::time::sleep(shared.opts.prompt_timeout);
    tokio::pin!(deadline);
    // An increment of the current model turn was sent (its final repeat is not).
    let mut streaming = false;
    // Any text was sent (else the run's answer is, at the end).
    let mut said = false;
    let end: End = loop {
        tokio::select! {
            event = events.next() => match event {
                None => break End::Error(500, "watch_ended", format!("the events of run {run} ended before the run")),
                Some(Err(e)) => break End::Error(500, "watch_failed", e.to_string()),
                Some(Ok(p)) => match p.event.event {
                    Event::AssistantReply { text, is_final: false } if !text.is_empty() => {
                        out.chunk(&Chunk::text(text)).await;
                        streaming = true;
                        said = true;
                    }
                    Event::AssistantReply { text, is_final: true } => {
                        if !streaming && !text.is_empty() {
                            out.chunk(&Chunk::text(text)).await;
                            said = true;
                        }
                        streaming = false;
                    }
                    Event::AwaitClarification { question, token } if !token.is_empty() => {
                        match ask(&out, &question, &token).await {
                            Ok(answers) => {
                                questions.spawn(answer(shared.client.clone(), run, token, answers));
                            }
                            Err(e) => warn!(error = %e, %run, "A question could not be asked"),
                        }
                    }
                    Event::Workflow(w) if w.phase.ends_run() && p.run_id == run => {
                        break match w.outcome {
                            Some(o) => End::Outcome(o),
                            None => End::Error(500, "run_failed", format!("run {run} ended without an outcome")),
                        };
                    }
                    _ => {}
                },
            },
            _ = &mut gone => break End::Gone,
            _ = &mut deadline => break End::TimedOut,
            _ = shared.shutdown.cancelled() => break End::Stopping,
        }
    };
    keepalive.abort();
    let _ = keepalive.await;
    questions.abort_all();
    match end {
        End::Gone => {
            info!(%run, agent = %agent.name, "The caller went away: cancelling its run");
            cancel(&shared.client, run, "the caller of agents.prompt went away").await;
            return;
        }
        End::TimedOut => {
            cancel(&shared.client, run, "agents-protocol prompt-timeout").await;
            out.error(
                500,
                "timeout",
                &format!(
                    "run {run} took longer than {:?} (prompt-timeout) and was cancelled",
                    shared.opts.prompt_timeout
                ),
                Some(run),
            )
            .await;
        }
        End::Stopping => {
            out.error(
                500,
                "unavailable",
                &format!(
                    "the process serving this prompt is stopping; run {run} goes on in Flotilla"
                ),
                Some(run),
            )
            .await;
        }
        End::Error(status, code, message) => out.error(status, code, &message, Some(run)).await,
        End::Outcome(o) => finish(&out, *o, said).await,
    }
    out.end().await;
}

/// How a prompt's stream ends.
enum End {
    Outcome(Box<RunOutcome>),
    Error(u16, &'static str, String),
    Gone,
    TimedOut,
    Stopping,
}

/// The run ended: its answer when nothing was said yet, or the error frame of a run that did
/// not succeed.
async fn finish(out: &Outbox, o: RunOutcome, said: bool) {
    let run = o.run_id;
    match o.status {
        RunStatus::Succeeded => {
            if !said
                && let Some(answer) = o.final_result.as_ref().map(|f| f.response.as_str())
                && !answer.is_empty()
            {
                out.chunk(&Chunk::text(answer)).await;
            }
        }
        status => {
            let (code, label) = match status {
                RunStatus::Cancelled => (409, "run_cancelled"),
                RunStatus::Rejected => (500, "run_rejected"),
                _ => (500, "run_failed"),
            };
            let reason = o
                .reason
                .clone()
                .unwrap_or_else(|| format!("run {run} ended {}", status.as_str()));
            out.error(code, label, &reason, Some(run)).await;
        }
    }
}

/// Asks the caller a question (`query`): subscribes to a fresh inbox first, so an answer
/// cannot arrive before anyone listens, then sends the chunk. The approval's token is the
/// query's id.
async fn ask(
    out: &Outbox,
    question: &str,
    token: &str,
) -> Result<async_nats::Subscriber, async_nats::SubscribeError> {
    let inbox = out.nats.new_inbox();
    let answers = out.nats.subscribe(inbox.clone()).await?;
    out.chunk(&Chunk::Query(Query {
        id: token.to_owned(),
        reply_subject: inbox,
        prompt: question.to_owned(),
        attachments: Vec::new(),
    }))
    .await;
    let _ = out.nats.flush().await;
    Ok(answers)
}

/// The caller's answer to a question becomes the question's approval answer (`respond`).
/// An answer that is not a prompt is ignored; the approval's own deadline decides when none
/// comes.
async fn answer(client: Client, run: RunId, token: String, mut answers: async_nats::Subscriber) {
    while let Some(msg) = answers.next().await {
        let text = match decode_envelope(&msg.payload) {
            Ok(e) => e.prompt,
            Err(e) => {
                debug!(error = %e, %run, "An unreadable answer to a question was ignored");
                continue;
            }
        };
        let request = ApprovalAnswerRequest {
            protocol: flotilla_model::PROTOCOL_VERSION,
            run_id: run,
            approval_id: token.clone(),
            decision: Decision::Respond { result: text },
            by: "agents-protocol caller".to_owned(),
            comment: Some("answered through the NATS Agent Protocol".to_owned()),
            digest: None,
            always: false,
            incident: false,
        };
        match client.request(&request, Duration::from_secs(10)).await {
            Ok(_) => {}
            Err(e) => warn!(error = %e, %run, %token, "The caller's answer was not recorded"),
        }
        return;
    }
}

/// Cancels `run`, saying why; a failure is logged (the run's own deadlines still end it).
async fn cancel(client: &Client, run: RunId, reason: &str) {
    if let Err(e) = client.cancel(run, Some(reason.to_owned())).await {
        warn!(error = %e, %run, "The run of an abandoned prompt could not be cancelled");
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

    #[test]
    fn names_that_collide_as_tokens_are_refused() {
        let agent = |name: &str| ExposedAgent {
            name: name.into(),
            card: MemberCard::default(),
        };
        let opts = AgentsProtocolOptions::default();
        let ok = Exposer::addresses(&opts, "flotilla", &[agent("writer"), agent("data_bot")])
            .expect("distinct");
        assert_eq!(ok[1].prompt(), "agents.prompt.data-bot.flotilla.default");
        let clash = Exposer::addresses(&opts, "flotilla", &[agent("data_bot"), agent("Data-Bot")])
            .expect_err("collision");
        assert_eq!(clash.kind(), AgentsErrorKind::Config);
    }
}
