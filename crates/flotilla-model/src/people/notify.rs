//! Notices: something waits for a person, or a person should know.
//!
//! A notice goes out on `<prefix>.notify.<kind>.<run>` whenever a run asks for a person — an
//! approval requested (or, under `human_on_the_loop`, a dispatch a person should know
//! about), a run paused or taken over. The subject is captured by the notice stream
//! (`<PREFIX>_NOTIFY`, limits, by age), so a notice is kept even when nobody listens at the
//! moment: the supervisor's webhook deliverers read it from there, and `flotilla approvals
//! list --watch` or any client may subscribe to the subject directly.
//!
//! A notice is never the record: the escalations bucket and the run log are. It is published
//! after the record is stored, with its [`Notification::id`] as `Nats-Msg-Id`: the same
//! notice published twice (a step performed again after a crash) within the stream's
//! duplicate window is stored once, and a webhook receiver de-duplicates by the id after
//! (notices are delivered at least once, always with the same id).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::approval::ApprovalRecord;
use crate::ids::RunId;
use crate::run::RunStatus;
use crate::runlog::ControlAction;
use crate::time::Timestamp;

/// What a notice is about.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum NoticeKind {
    /// An approval was requested (or, `notify_only`, a gated dispatch went ahead).
    Approval,
    /// An LLM agent asked the user a question (an approval of trigger `question`).
    Question,
    /// An LLM agent called a tool the client runs (an approval of trigger `client_tool`).
    ClientTool,
    /// A run was paused.
    Pause,
    /// A run was taken over by a person.
    Takeover,
}

impl NoticeKind {
    /// The kind of the notice of an approval requested by `trigger`.
    pub fn of_trigger(trigger: crate::approval::Trigger) -> Self {
        match trigger {
            crate::approval::Trigger::Question => Self::Question,
            crate::approval::Trigger::ClientTool => Self::ClientTool,
            _ => Self::Approval,
        }
    }

    /// The kind as it appears on the wire and in the subject.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Approval => "approval",
            Self::Question => "question",
            Self::ClientTool => "client_tool",
            Self::Pause => "pause",
            Self::Takeover => "takeover",
        }
    }
}

/// A notice on `<prefix>.notify.<kind>.<run>` (stored on the notice stream).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Notification {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The notice's id, the same however often it is published (its `Nats-Msg-Id`; a
    /// webhook's `X-Flotilla-Delivery`): `approval.<run>.<approval_id>`,
    /// `pause.<run>.<run-log sequence>`, `takeover.<run>.<run-log sequence>`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub id: String,
    /// What it is about.
    pub kind: NoticeKind,
    /// The run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<RunId>,
    /// When it was published.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<Timestamp>,
    /// Nothing waits: the task was dispatched (`human_on_the_loop`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub notify_only: bool,
    /// Kind `approval`: the approval as stored (for a `notify_only` notice: as it would have
    /// been asked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalRecord>,
    /// Kinds `pause` and `takeover`: who took the run's hand, why, and until when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control: Option<ControlNotice>,
}

/// A pause or takeover, as a notice tells it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ControlNotice {
    /// `pause` or `takeover`.
    pub action: ControlAction,
    /// Who, as the request said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// Why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// When the hold's default applies (a pause resumes, a takeover cancels) unless a person
    /// acts first.
    pub until: Timestamp,
    /// The run's status when the control was recorded.
    pub status: RunStatus,
    /// Descendant runs the control was also recorded for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<RunId>,
}

/// `Nats-Msg-Id` (and [`Notification::id`]) of an approval's request notice.
pub fn approval_notice_id(run: RunId, approval: &str) -> String {
    format!("approval.{run}.{approval}")
}

/// `Nats-Msg-Id` (and [`Notification::id`]) of a control's notice: the control's run-log
/// sequence makes it unique per control and the same on every publish.
pub fn control_notice_id(kind: NoticeKind, run: RunId, seq: u64) -> String {
    format!("{}.{run}.{seq}", kind.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_are_named_on_the_wire_as_in_subjects() {
        for k in [
            NoticeKind::Approval,
            NoticeKind::Question,
            NoticeKind::ClientTool,
            NoticeKind::Pause,
            NoticeKind::Takeover,
        ] {
            assert_eq!(
                serde_json::to_value(k).ok(),
                Some(serde_json::json!(k.as_str()))
            );
            assert_eq!(
                serde_json::from_value::<NoticeKind>(serde_json::json!(k.as_str())).ok(),
                Some(k)
            );
        }
        assert_eq!(NoticeKind::ClientTool.as_str(), "client_tool");
        assert!(serde_json::from_value::<NoticeKind>(serde_json::json!("approvals")).is_err());
    }
}
