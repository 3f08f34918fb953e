//! Calling an agent of the NATS Agent Protocol: discovery, a prompt with its streamed
//! replies, and the watch on the agent's heartbeat that turns a dead agent into an error
//! instead of a wait.
//!
//! ```text
//!  discover ($SRV.INFO.agents) ─► the target's prompt subject (from the discovery record)
//!  subscribe agents.hb.<agent>.<owner>.<session>, then a fresh inbox; publish the prompt
//!  read chunks ─► on_event(Text | Query | Status)   (a query is answered by the caller —
//!                                                     inside an attempt, by a person through
//!                                                     `ask` — or left to the agent's
//!                                                     default, deny; while one waits, no
//!                                                     chunk is no stall)
//!  ends: the terminator (done) · an error frame · no chunk for `inactivity` · no heartbeat
//!        for three intervals (agent_dead) · `timeout`
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::wire::{self, AgentAddress, Chunk, Envelope, Heartbeat, Query};

/// One agent instance found on the `agents` service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Discovered {
    /// The service instance's id.
    pub instance_id: String,
    /// Its tokens (from `metadata`, else from the prompt subject).
    pub address: AgentAddress,
    /// The service's description.
    #[serde(default)]
    pub description: String,
    /// The service instance's metadata, every key kept.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// The prompt endpoint's subject, as discovered (never built from the tokens).
    pub prompt_subject: String,
}

impl Discovered {
    /// The roles and capabilities it advertises (`capabilities`, comma separated).
    pub fn capabilities(&self) -> Vec<String> {
        self.metadata
            .get("capabilities")
            .map(|c| {
                c.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The `$SRV.INFO` record fields read here.
#[derive(Deserialize)]
struct InfoRecord {
    name: String,
    id: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    endpoints: Vec<EndpointRecord>,
}

#[derive(Deserialize)]
struct EndpointRecord {
    name: String,
    subject: String,
}

/// Why a call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// No live instance of the target was discovered.
    #[error("unknown_agent: {0}")]
    UnknownAgent(String),
    /// The target names several agents.
    #[error("ambiguous_agent: {0}")]
    Ambiguous(String),
    /// Nothing serves the prompt subject.
    #[error("no_responders: nothing serves {0}")]
    NoResponders(String),
    /// The agent answered with an error frame.
    #[error("agent_error: {status} {description}")]
    Agent {
        /// `Nats-Service-Error-Code`.
        status: u16,
        /// `Nats-Service-Error`.
        description: String,
        /// The frame's body, when it had one.
        body: Option<String>,
    },
    /// The agent's heartbeat stopped (three intervals without one) before the stream ended.
    #[error("agent_dead: no heartbeat from {agent} for {silent_ms} ms (interval {interval_s} s)")]
    AgentDead {
        /// The agent.
        agent: String,
        /// How long it was silent.
        silent_ms: u64,
        /// Its interval.
        interval_s: u64,
    },
    /// No chunk for the inactivity limit.
    #[error("stalled: no chunk for {0:?}")]
    Stalled(Duration),
    /// The whole call took too long.
    #[error("timeout: no end of stream within {0:?}")]
    Timeout(Duration),
    /// A message of the stream is not a chunk.
    #[error("bad_frame: {0}")]
    BadFrame(String),
    /// NATS failed.
    #[error("nats: {0}")]
    Nats(String),
}

impl CallError {
    /// A code to branch on (the error's first word).
    pub fn code(&self) -> &'static str {
        match self {
            Self::UnknownAgent(_) => "unknown_agent",
            Self::Ambiguous(_) => "ambiguous_agent",
            Self::NoResponders(_) => "no_responders",
            Self::Agent { .. } => "agent_error",
            Self::AgentDead { .. } => "agent_dead",
            Self::Stalled(_) => "stalled",
            Self::Timeout(_) => "timeout",
            Self::BadFrame(_) => "bad_frame",
            Self::Nats(_) => "nats",
        }
    }
}

fn nats(e: impl std::fmt::Display) -> CallError {
    CallError::Nats(e.to_string())
}

/// Every instance of the `agents` service that answers `$SRV.INFO.agents` within `wait`
/// (non-agent services and records without a prompt endpoint are dropped).
pub async fn discover(
    nats_client: &async_nats::Client,
    wait: Duration,
) -> Result<Vec<Discovered>, CallError> {
    let inbox = nats_client.new_inbox();
    let mut replies = nats_client.subscribe(inbox.clone()).await.map_err(nats)?;
    nats_client
        .publish_with_reply(
            format!("$SRV.INFO.{}", wire::SERVICE_NAME),
            inbox,
            "".into(),
        )
        .await
        .map_err(nats)?;
    nats_client.flush().await.map_err(nats)?;
    let mut found = Vec::new();
    let until = Instant::now() + wait;
    while let Ok(Some(msg)) = tokio::time::timeout_at(until, replies.next()).await {
        let Ok(info) = serde_json::from_slice::<InfoRecord>(&msg.payload) else {
            continue;
        };
        if info.name != wire::SERVICE_NAME {
            continue;
        }
        let Some(prompt) = info.endpoints.iter().find(|e| e.name == wire::VERB_PROMPT) else {
            continue;
        };
        let metadata = info.metadata.unwrap_or_default();
        let address = match (
            metadata.get(wire::metadata::AGENT),
            metadata.get(wire::metadata::OWNER),
            metadata.get(wire::metadata::SESSION),
        ) {
            (Some(a), Some(o), s) => {
                AgentAddress::new(a, o, s.map_or(wire::DEFAULT_SESSION, String::as_str)).ok()
            }
            _ => None,
        }
        .or_else(|| AgentAddress::parse(&prompt.subject, wire::VERB_PROMPT));
        let Some(address) = address else { continue };
        found.push(Discovered {
            instance_id: info.id,
            address,
            description: info.description,
            metadata,
            prompt_subject: prompt.subject.clone(),
        });
    }
    let _ = replies.unsubscribe().await;
    found.sort_by(|a, b| (&a.address, &a.instance_id).cmp(&(&b.address, &b.instance_id)));
    Ok(found)
}

/// An external agent named by a Flotilla caller: `agent`, `agent.owner` or
/// `agent.owner.session` (the protocol's tokens).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The agent token.
    pub agent: String,
    /// The owner token, when given.
    pub owner: Option<String>,
    /// The session token, when given.
    pub session: Option<String>,
}

impl std::str::FromStr for Target {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.split('.');
        let agent = parts.next().unwrap_or_default().to_owned();
        let owner = parts.next().map(str::to_owned);
        let session = parts.next().map(str::to_owned);
        if parts.next().is_some() {
            return Err(format!("{s:?}: at most agent.owner.session"));
        }
        AgentAddress::new(
            &agent,
            owner.as_deref().unwrap_or("x"),
            session.as_deref().unwrap_or("x"),
        )
        .map_err(|e| e.to_string())?;
        Ok(Self {
            agent,
            owner,
            session,
        })
    }
}

impl Target {
    /// The one address among `found` this target names (several instances of one address
    /// are one agent).
    pub fn resolve<'a>(&self, found: &'a [Discovered]) -> Result<&'a Discovered, CallError> {
        let matching: Vec<&Discovered> = found
            .iter()
            .filter(|d| {
                d.address.agent == self.agent
                    && self.owner.as_ref().is_none_or(|o| *o == d.address.owner)
                    && self
                        .session
                        .as_ref()
                        .is_none_or(|s| *s == d.address.session)
            })
            .collect();
        let Some(first) = matching.first() else {
            return Err(CallError::UnknownAgent(format!(
                "no agent {} answered $SRV.INFO.agents",
                self.display()
            )));
        };
        if matching.iter().any(|d| d.address != first.address) {
            let names: Vec<String> = matching.iter().map(|d| d.address.display()).collect();
            return Err(CallError::Ambiguous(format!(
                "{} names {}: say agent.owner.session",
                self.display(),
                names.join(", ")
            )));
        }
        Ok(first)
    }

    fn display(&self) -> String {
        [
            Some(&self.agent),
            self.owner.as_ref(),
            self.session.as_ref(),
        ]
        .into_iter()
        .flatten()
        .cloned()
        .collect::<Vec<_>>()
        .join(".")
    }
}

/// Limits of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallOptions {
    /// The whole call.
    pub timeout: Duration,
    /// Longest gap between two chunks (the callers' default is 60 s), except after a query:
    /// the agent then waits for its answer, and only its heartbeat and `timeout` hold.
    pub inactivity: Duration,
    /// The heartbeat interval assumed until the agent's first heartbeat says its own.
    pub assumed_interval: Duration,
}

impl Default for CallOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(10 * 60),
            inactivity: Duration::from_secs(60),
            assumed_interval: Duration::from_secs(wire::DEFAULT_HEARTBEAT_SECS),
        }
    }
}

/// Something the agent sent while working.
#[derive(Debug, Clone, PartialEq)]
pub enum CallEvent {
    /// Text.
    Text(String),
    /// A question; answer it by publishing to its `reply_subject` (inside an attempt:
    /// [`crate::ask::ask_and_answer`], a person's answer), or leave it to the agent's default
    /// (deny).
    Query(Query),
    /// A status token (`ack`).
    Status(String),
}

/// Prompts `agent` with `envelope` and returns everything it said, calling `on_event` for
/// each chunk as it arrives.
pub async fn call<F, Fut>(
    nats_client: &async_nats::Client,
    agent: &Discovered,
    envelope: &Envelope,
    opts: CallOptions,
    mut on_event: F,
) -> Result<String, CallError>
where
    F: FnMut(CallEvent) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut beats = nats_client
        .subscribe(agent.address.heartbeat())
        .await
        .map_err(nats)?;
    // The interval to hold the agent to: its status endpoint says it at once (the first
    // heartbeat may come only after the agent is gone).
    let mut interval = match status(nats_client, &agent.address).await {
        Some(hb) => Duration::from_secs(hb.interval_s.max(1)),
        None => opts.assumed_interval,
    };
    let inbox = nats_client.new_inbox();
    let mut stream = nats_client.subscribe(inbox.clone()).await.map_err(nats)?;
    nats_client.flush().await.map_err(nats)?;
    let body = serde_json::to_vec(envelope).map_err(|e| CallError::BadFrame(e.to_string()))?;
    nats_client
        .publish_with_reply(agent.prompt_subject.clone(), inbox, body.into())
        .await
        .map_err(nats)?;
    nats_client.flush().await.map_err(nats)?;
    let started = Instant::now();
    let deadline = started + opts.timeout;
    let mut last_chunk = started;
    let mut last_beat = started;
    // A query was the last chunk: the agent waits for the caller's answer (a person's,
    // perhaps), so silence is no stall; its heartbeat still tells whether it is alive.
    let mut asked = false;
    let mut said = String::new();
    let mut error: Option<CallError> = None;
    let check = Duration::from_millis(250).min(interval);
    let mut tick = tokio::time::interval(check);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let result = loop {
        tokio::select! {
            msg = stream.next() => {
                let Some(msg) = msg else { break Err(nats("the reply subscription ended")) };
                last_chunk = Instant::now();
                if msg.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
                    break Err(CallError::NoResponders(agent.prompt_subject.clone()));
                }
                let headers = msg.headers.as_ref();
                if let Some(code) = headers.and_then(|h| h.get(wire::ERROR_CODE_HEADER)) {
                    error.get_or_insert(CallError::Agent {
                        status: code.as_str().parse().unwrap_or(500),
                        description: headers
                            .and_then(|h| h.get(wire::ERROR_HEADER))
                            .map(|v| v.as_str().to_owned())
                            .unwrap_or_default(),
                        body: (!msg.payload.is_empty())
                            .then(|| String::from_utf8_lossy(&msg.payload).into_owned()),
                    });
                    continue;
                }
                if msg.payload.is_empty() && headers.is_none_or(|h| h.is_empty()) {
                    break match error.take() {
                        Some(e) => Err(e),
                        None => Ok(std::mem::take(&mut said)),
                    };
                }
                asked = false;
                match wire::decode_chunk(&msg.payload) {
                    Ok(Some(Chunk::Response(d))) => {
                        said.push_str(d.text());
                        on_event(CallEvent::Text(d.text().to_owned())).await;
                    }
                    Ok(Some(Chunk::Query(q))) => {
                        asked = true;
                        on_event(CallEvent::Query(q)).await;
                    }
                    Ok(Some(Chunk::Status(s))) => on_event(CallEvent::Status(s)).await,
                    Ok(None) => {}
                    Err(e) => break Err(CallError::BadFrame(e.to_string())),
                }
            }
            Some(beat) = beats.next() => {
                last_beat = Instant::now();
                if let Ok(hb) = serde_json::from_slice::<Heartbeat>(&beat.payload) {
                    interval = Duration::from_secs(hb.interval_s.max(1));
                }
            }
            _ = tick.tick() => {
                let now = Instant::now();
                if now >= deadline {
                    break Err(CallError::Timeout(opts.timeout));
                }
                if !asked && now.duration_since(last_chunk) > opts.inactivity {
                    break Err(CallError::Stalled(opts.inactivity));
                }
                let silent = now.duration_since(last_beat);
                if silent > interval * wire::LIVENESS_INTERVALS {
                    break Err(CallError::AgentDead {
                        agent: agent.address.display(),
                        silent_ms: silent.as_millis() as u64,
                        interval_s: interval.as_secs(),
                    });
                }
            }
        }
    };
    let _ = stream.unsubscribe().await;
    let _ = beats.unsubscribe().await;
    result
}

/// How long a call waits for the agent's `status` endpoint before it holds the agent to the
/// assumed interval instead.
const STATUS_WAIT: Duration = Duration::from_millis(500);

/// The agent's `status` answer (a heartbeat), when its status endpoint answers in time.
pub async fn status(nats_client: &async_nats::Client, address: &AgentAddress) -> Option<Heartbeat> {
    let request = async_nats::Request::new()
        .payload(bytes::Bytes::new())
        .timeout(Some(STATUS_WAIT));
    let reply = nats_client
        .send_request(address.status(), request)
        .await
        .ok()?;
    serde_json::from_slice(&reply.payload).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(agent: &str, owner: &str) -> Discovered {
        let address = AgentAddress::new(agent, owner, "default").expect("valid");
        Discovered {
            instance_id: format!("{agent}-{owner}"),
            prompt_subject: address.prompt(),
            address,
            description: String::new(),
            metadata: BTreeMap::from([("capabilities".into(), "a, b".into())]),
        }
    }

    #[test]
    fn targets_resolve_to_one_agent() {
        let all = [
            found("coder", "alice"),
            found("coder", "bob"),
            found("pi", "alice"),
        ];
        let t: Target = "pi".parse().expect("target");
        assert_eq!(t.resolve(&all).expect("one").address.owner, "alice");
        let t: Target = "coder".parse().expect("target");
        assert_eq!(t.resolve(&all).expect_err("two").code(), "ambiguous_agent");
        let t: Target = "coder.bob".parse().expect("target");
        assert_eq!(t.resolve(&all).expect("one").address.owner, "bob");
        let t: Target = "nope".parse().expect("target");
        assert_eq!(t.resolve(&all).expect_err("none").code(), "unknown_agent");
        assert!("Bad Name".parse::<Target>().is_err());
        assert!("a.b.c.d".parse::<Target>().is_err());
        assert_eq!(all[0].capabilities(), ["a", "b"]);
    }
}
