//! Point-to-point mailboxes between the agents of a run tree
//! (`<prefix>.mbox.<root-run>.<to>.<from>`, stream `<PREFIX>_MAILBOX`).
//!
//! The sender is a subject token so NATS permissions can pin it (a worker may publish only as
//! its own tasks). A message on that subject carries a [`MailboxPost`]; readers get
//! [`MailboxMessage`]s with the stream sequence (`seq`) and server time (`ts`). A broadcast
//! goes to [`BROADCAST`] in the `to` position and reaches every reader of the run tree.
//!
//! Each `(to, from)` pair numbers its posts `n = 1, 2, …` (the sender appends with an
//! expected last subject sequence, so the numbering has no gaps or repeats). The stream keeps
//! the newest N posts per pair; the numbering makes any loss countable: `dropped = first
//! retained n − 1`.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::time::Timestamp;
use crate::workspace::Writer;

/// The `to` token of a broadcast: every task of the run tree reads it. Task ids cannot start
/// with `_`, so no task has this address.
pub const BROADCAST: &str = "_all";

/// How a broadcast's `to` is recorded in the body.
pub const BROADCAST_TO: &str = "*";

/// How a role's address is written: `role:<name>`. A message to a role is read by exactly
/// one of the run tree's tasks playing that role (the first to read it claims it).
pub const ROLE_ADDRESS: &str = "role:";

/// The `to` token of a role's box starts with this: `_role-<name>` (task ids cannot start
/// with `_`, so no task has such an address).
pub const ROLE_BOX: &str = "_role-";

/// The role an address names (`role:<name>`), if it names one.
pub fn addressed_role(address: &str) -> Option<&str> {
    address.strip_prefix(ROLE_ADDRESS)
}

/// The `to` token of `role`'s box.
pub fn role_box(role: &str) -> String {
    format!("{ROLE_BOX}{role}")
}

/// Largest mailbox payload (the encoded post), in bytes.
pub const MAX_PAYLOAD_BYTES: usize = 1024 * 1024;

/// Messages returned by one read when the reader names no limit.
pub const DEFAULT_READ_LIMIT: usize = 100;

/// Most messages returned by one read.
pub const MAX_READ_LIMIT: usize = 1000;

/// Mailbox message types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum MailboxKind {
    /// Asks for something (in a negotiation: a call for offers).
    Request,
    /// Proposes to do something (with a confidence, in a negotiation).
    Offer,
    /// Accepts an offer or request.
    Accept,
    /// Hands a piece of work over.
    Delegation,
    /// Shares information.
    Info,
}

impl MailboxKind {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Request => "request",
            Self::Offer => "offer",
            Self::Accept => "accept",
            Self::Delegation => "delegation",
            Self::Info => "info",
        }
    }
}

impl std::str::FromStr for MailboxKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "request" => Self::Request,
            "offer" => Self::Offer,
            "accept" => Self::Accept,
            "delegation" => Self::Delegation,
            "info" => Self::Info,
            other => {
                return Err(format!(
                    "unknown mailbox message type {other:?} (request, offer, accept, delegation, info)"
                ));
            }
        })
    }
}

/// The body of a mailbox message, as published.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MailboxPost {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// Message type.
    #[serde(rename = "type")]
    pub kind: MailboxKind,
    /// Sender address (a task id); must equal the subject's `from` token.
    pub from: String,
    /// Recipient address (a task id), `*` for a broadcast, or `role:<name>` for whichever
    /// task playing the role reads it first.
    pub to: String,
    /// Body (JSON).
    #[serde(default)]
    pub payload: serde_json::Value,
    /// Ties a conversation together: request → offers → accept → delegation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<String>,
    /// The post's number within its `(to, from)` pair (1, 2, …); 0 when the publisher did
    /// not number it.
    #[serde(default)]
    pub n: u64,
    /// Who sent it (run, task, attempt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sender: Option<Writer>,
}

/// A mailbox message, as read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MailboxMessage {
    /// Stream sequence (the reader's cursor moves past it).
    pub seq: u64,
    /// Server time it was stored.
    pub ts: Timestamp,
    /// Message type.
    #[serde(rename = "type")]
    pub kind: MailboxKind,
    /// Sender address.
    pub from: String,
    /// Recipient address, `*` for a broadcast, or `role:<name>` for a role's message (claimed
    /// by this reader).
    pub to: String,
    /// Body.
    #[serde(default)]
    pub payload: serde_json::Value,
    /// Conversation id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<String>,
    /// Number within its `(to, from)` pair.
    #[serde(default)]
    pub n: u64,
    /// Who sent it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sender: Option<Writer>,
}

/// One page of a mailbox read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MailboxPage {
    /// The messages, in stream order.
    pub messages: Vec<MailboxMessage>,
    /// The cursor after this page (pass as `since_seq`, or commit it).
    pub next_since_seq: u64,
    /// Whether more messages were already stored.
    pub more: bool,
    /// Malformed messages skipped (raw publishes that are not posts, or whose body
    /// contradicts the subject).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub skipped: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// What one sender left in one mailbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SenderStats {
    /// The sender.
    pub from: String,
    /// Posts numbered so far (the newest `n`).
    pub sent: u64,
    /// Posts still stored.
    pub retained: u64,
    /// Posts lost to the cap or the age limit (`sent − retained`, counted by numbering).
    pub dropped: u64,
}

/// A mailbox's counts (`flotilla mbox stats`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct MailboxStats {
    /// The mailbox (a task id, or `*` for the broadcast box).
    pub mailbox: String,
    /// Per sender.
    pub senders: Vec<SenderStats>,
    /// Sum of `sent`.
    pub sent: u64,
    /// Sum of `retained`.
    pub retained: u64,
    /// Sum of `dropped`: never silent.
    pub dropped: u64,
    /// The reader's committed cursor (stream sequence), 0 when it never committed.
    pub committed: u64,
    /// Retained messages after the committed cursor.
    pub unread: u64,
}
