//! The NATS Agent Protocol's wire format (protocol version 0.3), as both sides speak it: no
//! I/O here, only names, subjects and message shapes.
//!
//! ```text
//!  caller ── agents.prompt.<agent>.<owner>.<session> (request, reply inbox) ──► agent
//!    ◄── {"type":"status","data":"ack"}            first, at once
//!    ◄── {"type":"response","data":"…"}            zero or more
//!    ◄── {"type":"query","data":{id, reply_subject, prompt}}   a question; the caller
//!         answers on reply_subject (plain text or {"prompt": …})
//!    ◄── {"type":"status","data":"ack"}            keep-alive while work goes on
//!    ◄── headers Nats-Service-Error-Code/-Error     on failure (not the end)
//!    ◄── empty body, no headers                    the end of the stream, always
//!  agent ── agents.hb.<agent>.<owner>.<session> every interval_s ──► anyone
//! ```
//!
//! Agents register as instances of the NATS micro service `agents` (discovered with
//! `$SRV.INFO.agents`); the `prompt` and `status` endpoints use the queue group `agents`, so
//! several instances of one agent share its prompts. An agent is alive while its last
//! heartbeat is younger than three of its intervals.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The micro-service name every agent registers under.
pub const SERVICE_NAME: &str = "agents";
/// `metadata.protocol_version`: MAJOR.MINOR of the protocol spoken.
pub const PROTOCOL_VERSION: &str = "0.3";
/// The queue group of the `prompt` and `status` endpoints.
pub const QUEUE_GROUP: &str = "agents";
/// The first token of every protocol subject.
pub const ROOT: &str = "agents";
/// The verb of the prompt endpoint's subject (also the endpoint's name).
pub const VERB_PROMPT: &str = "prompt";
/// The verb of the heartbeat subject.
pub const VERB_HEARTBEAT: &str = "hb";
/// The verb of the status endpoint's subject (also the endpoint's name).
pub const VERB_STATUS: &str = "status";
/// The session token of an agent that serves no particular session.
pub const DEFAULT_SESSION: &str = "default";
/// The heartbeat interval the protocol recommends.
pub const DEFAULT_HEARTBEAT_SECS: u64 = 30;
/// An agent is alive while its last heartbeat is younger than this many intervals.
pub const LIVENESS_INTERVALS: u32 = 3;
/// The header carrying an error's description.
pub const ERROR_HEADER: &str = "Nats-Service-Error";
/// The header carrying an error's status code (400 the caller's mistake, 500 the agent's).
pub const ERROR_CODE_HEADER: &str = "Nats-Service-Error-Code";
/// Longest error description put in a header (headers are single lines).
pub const MAX_ERROR_DESCRIPTION: usize = 200;

/// The metadata keys of an agent's service instance.
pub mod metadata {
    /// The harness identifier, the subject's third token.
    pub const AGENT: &str = "agent";
    /// The operator or account namespace, the fourth token.
    pub const OWNER: &str = "owner";
    /// The session served, the fifth token.
    pub const SESSION: &str = "session";
    /// MAJOR.MINOR of the protocol.
    pub const PROTOCOL_VERSION: &str = "protocol_version";
    /// The prompt endpoint's largest request (`1MB`, base 1024).
    pub const MAX_PAYLOAD: &str = "max_payload";
    /// Whether the prompt endpoint takes attachments (`"true"` / `"false"`).
    pub const ATTACHMENTS_OK: &str = "attachments_ok";
}

/// Why a subject token was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} {token:?} {reason}")]
pub struct TokenError {
    /// Which token (`agent`, `owner`, `session`).
    pub field: &'static str,
    /// The token as given.
    pub token: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// Whether `token` is a valid `agent` token: lowercase letters, digits and hyphens.
fn is_agent_token(token: &str) -> bool {
    !token.is_empty()
        && token
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// Whether `token` is a valid `owner` or `session` token: lowercase letters, digits, hyphens
/// and underscores.
fn is_name_token(token: &str) -> bool {
    !token.is_empty()
        && token
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// The protocol's `agent` token for a Flotilla agent name (`A-Z a-z 0-9 _ -`): lowercase,
/// underscores as hyphens. Two names may map to one token; the exposer refuses that.
pub fn agent_token(name: &str) -> Result<String, TokenError> {
    let token = name.to_ascii_lowercase().replace('_', "-");
    if is_agent_token(&token) {
        Ok(token)
    } else {
        Err(TokenError {
            field: "agent",
            token: name.to_owned(),
            reason: "cannot be an agent token (lowercase letters, digits, hyphens)",
        })
    }
}

/// An agent's three identifying tokens, checked: its subjects follow from them.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct AgentAddress {
    /// The harness identifier (`[a-z0-9-]+`).
    pub agent: String,
    /// The owner (`[a-z0-9_-]+`).
    pub owner: String,
    /// The session (`[a-z0-9_-]+`).
    pub session: String,
}

impl AgentAddress {
    /// An address, once every token is valid.
    pub fn new(agent: &str, owner: &str, session: &str) -> Result<Self, TokenError> {
        if !is_agent_token(agent) {
            return Err(TokenError {
                field: "agent",
                token: agent.to_owned(),
                reason: "must be lowercase letters, digits and hyphens",
            });
        }
        for (field, token) in [("owner", owner), ("session", session)] {
            if !is_name_token(token) {
                return Err(TokenError {
                    field,
                    token: token.to_owned(),
                    reason: "must be lowercase letters, digits, hyphens and underscores",
                });
            }
        }
        Ok(Self {
            agent: agent.to_owned(),
            owner: owner.to_owned(),
            session: session.to_owned(),
        })
    }

    fn subject(&self, verb: &str) -> String {
        format!(
            "{ROOT}.{verb}.{}.{}.{}",
            self.agent, self.owner, self.session
        )
    }

    /// `agents.prompt.<agent>.<owner>.<session>`.
    pub fn prompt(&self) -> String {
        self.subject(VERB_PROMPT)
    }

    /// `agents.hb.<agent>.<owner>.<session>`.
    pub fn heartbeat(&self) -> String {
        self.subject(VERB_HEARTBEAT)
    }

    /// `agents.status.<agent>.<owner>.<session>`.
    pub fn status(&self) -> String {
        self.subject(VERB_STATUS)
    }

    /// The address in a subject `agents.<verb>.<agent>.<owner>.<session>`, when it is one.
    pub fn parse(subject: &str, verb: &str) -> Option<Self> {
        let mut parts = subject.split('.');
        let (root, v, agent, owner, session) = (
            parts.next()?,
            parts.next()?,
            parts.next()?,
            parts.next()?,
            parts.next()?,
        );
        if parts.next().is_some() || root != ROOT || v != verb {
            return None;
        }
        Self::new(agent, owner, session).ok()
    }

    /// `agent/owner/session`, the way people name one agent.
    pub fn display(&self) -> String {
        format!("{}/{}/{}", self.agent, self.owner, self.session)
    }
}

/// A file sent with a prompt or a query.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    /// Its base name.
    pub filename: String,
    /// Its bytes, standard base64 (padded).
    pub content: String,
}

/// A prompt request: plain UTF-8 text (shorthand for `{"prompt": text}`) or this JSON
/// object. Fields this side does not know are kept, as the protocol asks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// The prompt.
    pub prompt: String,
    /// Files sent with it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attachments: Vec<Attachment>,
    /// Everything else the caller sent.
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl Envelope {
    /// An envelope holding only `prompt`.
    pub fn text(prompt: impl Into<String>) -> Self {
        Self {
            prompt: prompt.into(),
            attachments: Vec::new(),
            extra: BTreeMap::new(),
        }
    }
}

/// Why a request body is not a prompt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    /// The body is not UTF-8 text.
    #[error("the prompt is not UTF-8 text")]
    NotText,
    /// A JSON object that is not an envelope (no string `prompt`, bad `attachments`).
    #[error("malformed envelope: {0}")]
    Malformed(String),
    /// The prompt is empty.
    #[error("prompt missing or empty")]
    Empty,
}

/// Reads a prompt request (or the answer to a query): a JSON object is an envelope, any
/// other text is the prompt itself.
pub fn decode_envelope(body: &[u8]) -> Result<Envelope, EnvelopeError> {
    let text = std::str::from_utf8(body).map_err(|_| EnvelopeError::NotText)?;
    let envelope = if text.trim_start().starts_with('{') {
        match serde_json::from_str::<serde_json::Value>(text) {
            Ok(v @ serde_json::Value::Object(_)) => serde_json::from_value::<Envelope>(v)
                .map_err(|e| EnvelopeError::Malformed(e.to_string()))?,
            // Text that merely starts with a brace is a prompt.
            _ => Envelope::text(text),
        }
    } else {
        Envelope::text(text)
    };
    if envelope.prompt.trim().is_empty() {
        return Err(EnvelopeError::Empty);
    }
    Ok(envelope)
}

/// A response chunk's `data`: text, or text with attachments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ResponseData {
    /// Text.
    Text(String),
    /// Text and files.
    Rich {
        /// The text.
        #[serde(default)]
        text: String,
        /// The files.
        #[serde(default)]
        attachments: Vec<Attachment>,
    },
}

impl ResponseData {
    /// The text.
    pub fn text(&self) -> &str {
        match self {
            Self::Text(t) | Self::Rich { text: t, .. } => t,
        }
    }
}

/// A question the agent asks its caller in the middle of a stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Query {
    /// Identifies the question within the stream.
    pub id: String,
    /// Where the caller publishes its answer (plain text or an envelope).
    pub reply_subject: String,
    /// The question.
    pub prompt: String,
    /// Files sent with it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attachments: Vec<Attachment>,
}

/// The `status` token of the chunk every stream opens with (and of keep-alives).
pub const STATUS_ACK: &str = "ack";

/// One chunk of a response stream (not the terminator, not an error frame).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "data", rename_all = "snake_case")]
pub enum Chunk {
    /// Content.
    Response(ResponseData),
    /// A status token: `ack` first and as keep-alive.
    Status(String),
    /// A question to the caller.
    Query(Query),
}

impl Chunk {
    /// A text response chunk.
    pub fn text(text: impl Into<String>) -> Self {
        Self::Response(ResponseData::Text(text.into()))
    }

    /// The `ack` status chunk.
    pub fn ack() -> Self {
        Self::Status(STATUS_ACK.to_owned())
    }

    /// The chunk as sent: one JSON object.
    pub fn encode(&self) -> bytes::Bytes {
        serde_json::to_vec(self).unwrap_or_default().into()
    }
}

/// Why a stream message is not a chunk this side can read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed chunk: {0}")]
pub struct ChunkError(pub String);

/// Reads a chunk: `None` for a chunk type this side does not know (the protocol says to
/// skip those), an error for anything that is not a typed JSON object.
pub fn decode_chunk(body: &[u8]) -> Result<Option<Chunk>, ChunkError> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| ChunkError(e.to_string()))?;
    let kind = value
        .get("type")
        .and_then(serde_json::Value::as_str)
        .ok_or_else(|| ChunkError("no string `type`".into()))?;
    if !matches!(kind, "response" | "status" | "query") {
        return Ok(None);
    }
    serde_json::from_value(value)
        .map(Some)
        .map_err(|e| ChunkError(e.to_string()))
}

/// A heartbeat, also the `status` endpoint's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// The agent token.
    pub agent: String,
    /// The owner token.
    pub owner: String,
    /// The session token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// The service instance that beats (its `$SRV.INFO` id).
    pub instance_id: String,
    /// When, RFC 3339.
    pub ts: String,
    /// Seconds until the next one.
    pub interval_s: u64,
    /// Fields this side does not know.
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// An error frame's description, fit for a header: one line, at most
/// [`MAX_ERROR_DESCRIPTION`] ASCII-safe bytes.
pub fn header_description(text: &str) -> String {
    let flat = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" | ");
    if flat.len() <= MAX_ERROR_DESCRIPTION {
        return flat;
    }
    let mut cut = MAX_ERROR_DESCRIPTION - 3;
    while !flat.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}...", &flat[..cut])
}

/// An error frame's JSON body: a code to branch on and the words, plus the Flotilla run
/// the prompt started when there is one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The status code, as in the header.
    pub status: u16,
    /// A machine-readable code (`malformed_prompt`, `unknown_agent`, `run_failed`, …).
    pub code: String,
    /// What went wrong.
    pub message: String,
    /// The Flotilla run of the prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_follow_the_verb_first_layout() {
        let a = AgentAddress::new("analyst", "flotilla", "default").expect("valid");
        assert_eq!(a.prompt(), "agents.prompt.analyst.flotilla.default");
        assert_eq!(a.heartbeat(), "agents.hb.analyst.flotilla.default");
        assert_eq!(a.status(), "agents.status.analyst.flotilla.default");
        assert_eq!(
            AgentAddress::parse(&a.prompt(), VERB_PROMPT),
            Some(a.clone())
        );
        assert_eq!(AgentAddress::parse(&a.prompt(), VERB_HEARTBEAT), None);
        assert_eq!(AgentAddress::parse("agents.prompt.a.b", VERB_PROMPT), None);
        assert!(AgentAddress::new("Analyst", "o", "s").is_err());
        assert!(AgentAddress::new("a_b", "o", "s").is_err());
        assert!(AgentAddress::new("a", "o.x", "s").is_err());
        assert_eq!(agent_token("Data_Analyst").as_deref(), Ok("data-analyst"));
    }

    #[test]
    fn prompts_are_text_or_envelopes() {
        assert_eq!(
            decode_envelope(b"hello").map(|e| e.prompt),
            Ok("hello".into())
        );
        let e = decode_envelope(br#"{"prompt":"hi","x":1}"#).expect("envelope");
        assert_eq!(e.prompt, "hi");
        assert_eq!(e.extra["x"], 1);
        assert_eq!(
            decode_envelope(b"{not json").map(|e| e.prompt),
            Ok("{not json".into())
        );
        assert_eq!(decode_envelope(b"  "), Err(EnvelopeError::Empty));
        assert_eq!(
            decode_envelope(br#"{"prompt":""}"#),
            Err(EnvelopeError::Empty)
        );
        assert!(matches!(
            decode_envelope(br#"{"prompt":3}"#),
            Err(EnvelopeError::Malformed(_))
        ));
        assert_eq!(decode_envelope(&[0xff, 0xfe]), Err(EnvelopeError::NotText));
    }

    #[test]
    fn chunks_encode_as_the_protocol_writes_them() {
        assert_eq!(
            &Chunk::ack().encode()[..],
            br#"{"type":"status","data":"ack"}"#
        );
        assert_eq!(
            &Chunk::text("hi").encode()[..],
            br#"{"type":"response","data":"hi"}"#
        );
        let q = Chunk::Query(Query {
            id: "q1".into(),
            reply_subject: "_INBOX.x".into(),
            prompt: "which?".into(),
            attachments: Vec::new(),
        });
        assert_eq!(
            &q.encode()[..],
            br#"{"type":"query","data":{"id":"q1","reply_subject":"_INBOX.x","prompt":"which?"}}"#
        );
        assert_eq!(decode_chunk(&q.encode()), Ok(Some(q)));
        let rich = decode_chunk(br#"{"type":"response","data":{"text":"t","attachments":[]}}"#)
            .expect("chunk");
        assert!(matches!(rich, Some(Chunk::Response(ref d)) if d.text() == "t"));
        assert_eq!(decode_chunk(br#"{"type":"thinking","data":"x"}"#), Ok(None));
        assert!(decode_chunk(b"plain").is_err());
    }

    #[test]
    fn error_descriptions_fit_a_header() {
        assert_eq!(header_description("a\nb\r\n\nc"), "a | b | c");
        let long = "é".repeat(300);
        let d = header_description(&long);
        assert!(d.len() <= MAX_ERROR_DESCRIPTION && d.ends_with("..."));
    }
}
