//! Peer-to-peer messages between agents (`<prefix>.mbox.<run>.<agent>`).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::ids::RunId;
use crate::time::Timestamp;

/// A typed message from one agent of a run to another. Sending never blocks on the receiver:
/// the message is stored in the mailbox stream and read by sequence cursor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MailboxMessage {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// Message id.
    pub id: Uuid,
    /// The run both agents belong to.
    pub run_id: RunId,
    /// Sender (agent key within the run).
    pub from: String,
    /// Recipient (agent key within the run).
    pub to: String,
    /// Message type.
    pub kind: MailboxKind,
    /// Body.
    #[serde(default)]
    pub content: serde_json::Value,
    /// The message this one answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_reply_to: Option<Uuid>,
    /// When it was sent.
    pub sent_at: Timestamp,
}

/// Mailbox message types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum MailboxKind {
    /// Asks for something.
    Request,
    /// Proposes to do something.
    Offer,
    /// Accepts an offer or request.
    Accept,
    /// Hands a piece of work over.
    Delegation,
    /// Shares information.
    Info,
}
