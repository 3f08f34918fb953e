//! Following a run tree as one audience sees it: profiles, child policies, projected events.
//!
//! A run's event stream holds everything its tasks and the coordinator emitted. A projection
//! chooses what one audience sees of it and of its children:
//!
//! | Profile | Events |
//! |---|---|
//! | `user` | `assistant_reply`, tool calls of the root run's agents (`tool_start` / `tool_end`), child-run cards (`agent_run_started`), awaits (`await_clarification`, `await_external_tools`), the run phases (`run_started`, `run_succeeded`, …), approvals and questions asked and answered (`approval_requested`, `approval_decided`, at every depth), and of the watched run: its tasks started and ended (`task_started`, `task_succeeded`, `task_retrying`, `task_failed`, `task_skipped`), its holds (`run_paused`, `run_resumed`, `run_taken_over`, `task_paused`, `task_resumed`), `run_planned` and `plan_edited` |
//! | `debug` | everything, `agent_step` included |
//! | `metrics` | `usage` and `workflow` events |
//!
//! | Child policy | Children |
//! |---|---|
//! | `off` | hidden: only the parent's own tool call and result show |
//! | `linked` | the `agent_run_started` link only; each child keeps its own stream |
//! | `flatten` | each child's events projected into the parent's, after its link, attributed to the child run (and agent) at depth + 1, recursively |
//!
//! Flatten follows causal order live: each child's events come after its link, and the
//! events of runs running side by side are interleaved in the order the event stream stored
//! them (its sequence orders a whole tree). Every run's `run_started` comes before its other
//! events (the coordinator records a run's start lazily, so a worker's `task_started` may be
//! stored first). The projection ends when the watched run and every child it shows have
//! ended. The same streams always give the same projection, so the client library and the
//! server-side `api.watch` agree event for event.
//!
//! **Cursor.** An event's position is `(seq, index)`: the stream sequence of its message and
//! its place in that message (one message carries every event of a step). A watch resumed
//! with `since: seq, since_index: index` delivers exactly the events after that one.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::api::ApiRequest;
use crate::event::{Event, EventEnvelope, WorkflowPhase};
use crate::ids::RunId;

/// Which events an audience sees.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Profile {
    /// Replies, top-level tool lines, child cards, awaits, run phases.
    #[default]
    User,
    /// Everything.
    Debug,
    /// Usage and workflow events.
    Metrics,
}

/// How children's events are shown.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ChildPolicy {
    /// Children hidden.
    Off,
    /// Only the link to each child.
    #[default]
    Linked,
    /// Children's events in the parent's stream, recursively.
    Flatten,
}

impl std::str::FromStr for Profile {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "user" => Ok(Self::User),
            "debug" => Ok(Self::Debug),
            "metrics" => Ok(Self::Metrics),
            _ => Err(format!("{s:?} is not a profile (user, debug, metrics)")),
        }
    }
}

impl std::str::FromStr for ChildPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(Self::Off),
            "linked" => Ok(Self::Linked),
            "flatten" => Ok(Self::Flatten),
            _ => Err(format!(
                "{s:?} is not a child policy (off, linked, flatten)"
            )),
        }
    }
}

/// Whether an event of a run at `depth` (0: the watched run) is shown under `profile` and
/// `children`.
pub fn shows(profile: Profile, children: ChildPolicy, depth: u32, event: &Event) -> bool {
    if let Event::AgentRunStarted { .. } = event
        && children == ChildPolicy::Off
    {
        return false;
    }
    match profile {
        Profile::Debug => true,
        Profile::Metrics => matches!(event, Event::Usage { .. } | Event::Workflow(_)),
        Profile::User => match event {
            Event::AssistantReply { .. }
            | Event::AgentRunStarted { .. }
            | Event::AwaitClarification { .. }
            | Event::AwaitExternalTools { .. } => true,
            Event::ToolStart { .. } | Event::ToolEnd { .. } => depth == 0,
            Event::Workflow(w) => user_sees(w.phase, depth),
            _ => false,
        },
    }
}

/// Whether the `user` profile shows a workflow event of a run at `depth`: the run's phases
/// at every depth; the watched run's tasks starting and ending and its holds; approvals and
/// questions asked and answered at every depth (a person is waited for wherever it is).
fn user_sees(phase: WorkflowPhase, depth: u32) -> bool {
    use WorkflowPhase as P;
    match phase {
        P::RunStarted | P::ApprovalRequested | P::ApprovalDecided => true,
        p if p.ends_run() => true,
        P::TaskStarted
        | P::TaskSucceeded
        | P::TaskRetrying
        | P::TaskFailed
        | P::TaskSkipped
        | P::RunPlanned
        | P::RunPaused
        | P::RunResumed
        | P::RunTakenOver
        | P::TaskPaused
        | P::TaskResumed
        | P::PlanEdited => depth == 0,
        _ => false,
    }
}

/// One event of a projection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ProjectedEvent {
    /// The run that emitted it (the watched run, or a descendant under `flatten`).
    pub run_id: RunId,
    /// 0 for the watched run, 1 for its children, …
    pub depth: u32,
    /// The agent the run was started for (children), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// Stream sequence of the event's message (`FLOTILLA_EVENTS` holds every run's events,
    /// so it orders a whole tree). With `index`, the event's position: resume a watch after
    /// this event with `since: seq, since_index: index`.
    pub seq: u64,
    /// The event's position in its message, from 0: one message carries every event of a
    /// step, so several events share a `seq`.
    #[serde(default)]
    pub index: u32,
    /// The event.
    pub event: EventEnvelope,
}

/// `<prefix>.api.watch`: start a server-side projection delivered to a subject.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WatchRequest {
    /// Wire protocol version.
    #[serde(default = "crate::protocol_v1")]
    pub protocol: u32,
    /// The run to follow.
    pub run_id: RunId,
    /// Which events (default `user`).
    #[serde(default)]
    pub profile: Profile,
    /// How children show (default `linked`).
    #[serde(default)]
    pub children: ChildPolicy,
    /// Resume after an event received before: its `seq` (default 0: from the run's start).
    #[serde(default)]
    pub since: u64,
    /// With `since`, the `index` of that event: the watch resumes right after it. Without
    /// it (older clients), after the last event of message `since`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since_index: Option<u32>,
    /// Where the projected events are published (one `ProjectedEvent` per message, then one
    /// `{"end": …}` message): a plain subject the watcher subscribes to, e.g. its inbox.
    pub deliver_subject: String,
    /// How long the watch lives without a renewal, in milliseconds (default 30,000; 1,000 to
    /// 600,000).
    #[serde(default = "default_lease_ms")]
    pub lease_ms: u64,
}

fn default_lease_ms() -> u64 {
    30_000
}

impl ApiRequest for WatchRequest {
    const ENDPOINT: &'static str = "watch";
    type Reply = WatchReply;
}

/// The answer to a [`WatchRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WatchReply {
    /// Names the watch.
    pub watch_id: String,
    /// Publish anything to this subject before the lease runs out to renew it.
    pub renew_subject: String,
    /// The lease, in milliseconds.
    pub lease_ms: u64,
}

/// The last message of a server-side watch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WatchEnd {
    /// Why it ended: `ended` (the watched run ended and every shown child with it),
    /// `lease_expired`, `error`, `shutdown`.
    pub end: String,
    /// Details, for `error`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}
