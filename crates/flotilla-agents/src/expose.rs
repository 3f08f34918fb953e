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
//!                             keep-alive ack every `keepalive` (no listener left ─► cancel the run,
//!                             tried again while no coordinator answers, up to 2 min)
//!          ──► run succeeded: its answer when nothing was streamed, then the end
//!              run failed, cancelled, rejected, timed out: an error frame, then the end
//! ```
//!
//! A prompt for this deployment's owner that names no exposed agent (or another session) is
//! answered `404 unknown_agent`; prompts for other owners are not this process's to answer.
//!
//! The service instances, heartbeats, `status`, the shared refusals, keep-alives, error frames
//! and the end are [`crate::serve`]'s; this module says what a prompt for a definition does
//! (the supervisors' exposed teammates use the same machinery).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use flotilla_bus::Bus;
use flotilla_client::{Client, WatchOptions};
use flotilla_model::approval::{ApprovalAnswerRequest, Decision};
use flotilla_model::event::Event;
use flotilla_model::ids::RunId;
use flotilla_model::plan::{Plan, Subtask};
use flotilla_model::run::{RunOutcome, RunStatus};
use flotilla_model::submit::SubmitRequest;
use flotilla_model::team::MemberCard;
use flotilla_model::watch::{ChildPolicy, Profile};
use futures::StreamExt;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::options::AgentsProtocolOptions;
use crate::serve::{Ending, Failure, Instance, InstanceSpec, Outbox, Prompter, UnknownAgents};
use crate::wire::{self, AgentAddress, Chunk, Envelope, Query, decode_envelope};
use crate::{AgentsError, AgentsErrorKind, Registration};

/// The id of the one task of a prompt's run.
pub const PROMPT_TASK: &str = "prompt";

/// The run label naming the agent a prompt was for.
pub const AGENT_LABEL: &str = "agents-protocol.agent";

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

/// What a prompt for an agent definition does: a one-task run of the agent.
#[derive(Clone)]
struct RunPrompter(Arc<Shared>);

/// What the prompt handlers share.
struct Shared {
    client: Client,
    opts: AgentsProtocolOptions,
    shutdown: CancellationToken,
}

impl Prompter for RunPrompter {
    fn prompt(
        &self,
        agent: Registration,
        envelope: Envelope,
        out: Outbox,
    ) -> impl std::future::Future<Output = Ending> + Send {
        prompt(Arc::clone(&self.0), agent, envelope, out)
    }
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
        let prefix = self.bus.names().prefix();
        let addresses = Self::addresses(&self.opts, prefix, &self.agents)?;
        let nats = self.bus.client().clone();
        let mut instances = Vec::with_capacity(self.agents.len());
        for (agent, address) in self.agents.iter().zip(&addresses) {
            let spec = InstanceSpec {
                name: agent.name.clone(),
                address: address.clone(),
                description: agent
                    .card
                    .description
                    .clone()
                    .unwrap_or_else(|| format!("Flotilla agent {}", agent.name)),
                metadata: service_metadata(agent, address, prefix),
            };
            instances.push(
                Instance::start(&nats, spec, self.bus.max_payload(), self.opts.heartbeat).await?,
            );
        }
        let registrations: Vec<Registration> =
            instances.iter().map(|i| i.registration().clone()).collect();
        let owner = self.opts.owner_for(prefix);
        let known: BTreeSet<String> = addresses.iter().map(AgentAddress::prompt).collect();
        let unknown = UnknownAgents::subscribe(&nats, &owner, known).await?;
        let prompter = RunPrompter(Arc::new(Shared {
            client: Client::new(self.bus.clone()),
            opts: self.opts.clone(),
            shutdown: shutdown.clone(),
        }));
        let mut serving = JoinSet::new();
        for instance in instances {
            serving.spawn(instance.serve(prompter.clone(), shutdown.clone(), shutdown.clone()));
        }
        serving.spawn(unknown.run(shutdown.clone()));
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
            let _ = tx.send(registrations);
        }
        while serving.join_next().await.is_some() {}
        let _ = nats.flush().await;
        info!("Agents left the NATS Agent Protocol service");
        Ok(())
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
    let mut m = protocol_metadata(address, prefix);
    m.insert("flotilla_agent".to_owned(), agent.name.clone());
    if !capabilities.is_empty() {
        m.insert("capabilities".to_owned(), capabilities.join(","));
    }
    if !agent.card.roles.is_empty() {
        m.insert("roles".to_owned(), agent.card.roles.join(","));
    }
    m
}

/// The metadata every Flotilla agent of the protocol carries: the protocol's keys and the
/// deployment's prefix (`flotilla_prefix`, which tells the supervisor's roster its own
/// agents apart from external ones).
pub(crate) fn protocol_metadata(address: &AgentAddress, prefix: &str) -> HashMap<String, String> {
    HashMap::from([
        (wire::metadata::AGENT.to_owned(), address.agent.clone()),
        (wire::metadata::OWNER.to_owned(), address.owner.clone()),
        (wire::metadata::SESSION.to_owned(), address.session.clone()),
        (
            wire::metadata::PROTOCOL_VERSION.to_owned(),
            wire::PROTOCOL_VERSION.to_owned(),
        ),
        ("flotilla_prefix".to_owned(), prefix.to_owned()),
    ])
}

/// The one-task plan a prompt runs.
fn prompt_plan(agent: &str, prompt: &str, pool: &str) -> Plan {
    let mut task = Subtask::new(PROMPT_TASK, prompt).with_agent(agent);
    task.pool = pool.to_owned();
    Plan {
        fork: None,
        name: Some(format!("agents.prompt {agent}")),
        query: Some(prompt.to_owned()),
        subtasks: vec![task],
        config: Default::default(),
    }
}

/// Answers one prompt: see the module's diagram.
async fn prompt(
    shared: Arc<Shared>,
    agent: Registration,
    envelope: Envelope,
    out: Outbox,
) -> Ending {
    out.ack().await;
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
            return failure(500, "submit_failed", e.to_string(), run);
        }
    };
    debug!(%run, agent = %agent.name, "Prompt started a run");
    futures::pin_mut!(events);
    // Keep-alives, and the news that the caller went away.
    let (keepalive, mut gone) = out.keepalive(shared.opts.keepalive);
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
    drop(keepalive);
    questions.abort_all();
    match end {
        End::Gone => {
            info!(%run, agent = %agent.name, "The caller went away: cancelling its run");
            cancel(
                &shared.client,
                run,
                "the caller of agents.prompt went away",
                &shared.shutdown,
            )
            .await;
            Ending::Gone
        }
        End::TimedOut => {
            cancel(
                &shared.client,
                run,
                "agents-protocol prompt-timeout",
                &shared.shutdown,
            )
            .await;
            failure(
                500,
                "timeout",
                format!(
                    "run {run} took longer than {:?} (prompt-timeout) and was cancelled",
                    shared.opts.prompt_timeout
                ),
                run,
            )
        }
        End::Stopping => failure(
            500,
            "unavailable",
            format!("the process serving this prompt is stopping; run {run} goes on in Flotilla"),
            run,
        ),
        End::Error(status, code, message) => failure(status, code, message, run),
        End::Outcome(o) => finish(&out, *o, said).await,
    }
}

/// An error frame about `run`.
fn failure(status: u16, code: &'static str, message: String, run: RunId) -> Ending {
    Ending::Error(Failure {
        status,
        code,
        message,
        run: Some(run),
    })
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
async fn finish(out: &Outbox, o: RunOutcome, said: bool) -> Ending {
    let run = o.run_id;
    match o.status {
        RunStatus::Succeeded => {
            if !said
                && let Some(answer) = o.final_result.as_ref().map(|f| f.response.as_str())
                && !answer.is_empty()
            {
                out.chunk(&Chunk::text(answer)).await;
            }
            Ending::End
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
            failure(code, label, reason, run)
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
    let inbox = out.nats().new_inbox();
    let answers = out.nats().subscribe(inbox.clone()).await?;
    out.chunk(&Chunk::Query(Query {
        id: token.to_owned(),
        reply_subject: inbox,
        prompt: question.to_owned(),
        attachments: Vec::new(),
    }))
    .await;
    let _ = out.nats().flush().await;
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

/// How long the cancel of an abandoned prompt's run is tried again while no coordinator
/// answers it (one restarting, all of them busy): a run nobody reads any more should not
/// run to its end for want of one answer.
const CANCEL_RETRY_FOR: Duration = Duration::from_secs(120);
/// The first pause between two tries; it doubles up to [`CANCEL_RETRY_MAX_PAUSE`].
const CANCEL_RETRY_PAUSE: Duration = Duration::from_millis(250);
/// The longest pause between two tries.
const CANCEL_RETRY_MAX_PAUSE: Duration = Duration::from_secs(5);

/// Cancels `run`, saying why. A cancel no coordinator could answer (none answered, no
/// answer in time, NATS failed, a `5xx` refusal) is tried again with growing pauses for up
/// to [`CANCEL_RETRY_FOR`], or until this process stops; if it still fails, or a
/// coordinator refuses it for good, that is logged as an error naming the run, which is
/// then left to its own deadlines (each task's `task_timeout`), or to `flotilla runs
/// cancel`.
async fn cancel(client: &Client, run: RunId, reason: &str, shutdown: &CancellationToken) {
    use flotilla_bus::error::Retry;
    use flotilla_model::api::CancelRunRequest;
    let request = CancelRunRequest {
        protocol: flotilla_model::PROTOCOL_VERSION,
        run_id: run,
        reason: Some(reason.to_owned()),
        by: None,
        rollback: false,
    };
    let give_up = tokio::time::Instant::now() + CANCEL_RETRY_FOR;
    let mut pause = CANCEL_RETRY_PAUSE;
    let mut tries = 0u32;
    let why = loop {
        tries += 1;
        let why = match client.call(&request, Duration::from_secs(10)).await {
            Ok(Ok(reply)) => {
                if tries > 1 {
                    info!(%run, tries, status = %reply.status, "The run of an abandoned prompt is cancelled after all");
                }
                return;
            }
            Ok(Err(refused)) if refused.status < 500 => {
                break format!("{} ({}): {}", refused.code, refused.status, refused.message);
            }
            Ok(Err(refused)) => {
                format!("{} ({}): {}", refused.code, refused.status, refused.message)
            }
            Err(e) if e.kind().retry() == Retry::Terminal => break e.to_string(),
            Err(e) => e.to_string(),
        };
        let now = tokio::time::Instant::now();
        if now + pause > give_up {
            break format!(
                "{why} (tried {tries} times over {} s)",
                CANCEL_RETRY_FOR.as_secs()
            );
        }
        warn!(%run, tries, error = %why, "The run of an abandoned prompt could not be cancelled yet; trying again");
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            () = shutdown.cancelled() => break format!("{why} (this process stopped before a coordinator answered)"),
        }
        pause = (pause * 2).min(CANCEL_RETRY_MAX_PAUSE);
    };
    error!(%run, error = %why, "The run of an abandoned prompt could not be cancelled: it runs until its own deadlines, or `flotilla runs cancel`");
}

#[cfg(test)]
mod tests {
    use super::*;

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
