//! Subject, stream, bucket and consumer names.
//!
//! Everything is derived from one configurable prefix (default `flotilla`), so several
//! installations can share a NATS account. With prefix `p`:
//!
//! | What | Name |
//! |---|---|
//! | intake stream / subject | `P_INTAKE` / `p.submit` |
//! | task stream / subjects | `P_TASKS` / `p.task.<pool>.<run>.<task>`, role queues `p.role.<role>.<run>.<task>`, teammate turns `p.turn.<pool>.<team>.<name>` |
//! | run log stream / subjects | `P_RUNLOG` / `p.submit.<run>` (durable submissions), `p.runlog.<run>`, timers `p.timer.<run>.<generation>` |
//! | event stream / subjects | `P_EVENTS` / `p.event.<run>` |
//! | workspace stream / subjects | `P_WORKSPACE` / `p.ws.<root-run>.<topic>` |
//! | mailbox stream / subjects | `P_MAILBOX` / `p.mbox.<root-run>.<to>.<from>`, teammate inboxes `p.tmbox.<team>.<to>.<from>` |
//! | KV buckets | `p-runs`, `p-control`, `p-state`, `p-workers`, `p-cursors`, `p-team`, `p-failures` and `p-memory` (the supervisor's), `p-escalations` (approvals, `<run>.<approval>`), `p-usage` (quotas and what they count: `quotas`, `concurrent`, `runs.h.<yyyymmddhh>`, `tokens.d.<yyyymmdd>`, `cost.m.<yyyymm>`, `use.d.<yyyymmdd>`, `end.<run>`); reserved for the human-in-the-loop work (provisioned, unused): `p-trust` |
//! | notice stream / subjects | `P_NOTIFY` / `p.notify.<kind>.<run>` (`approval`, `pause`, `takeover`) |
//! | request/reply API | `p.api.<endpoint>` (NATS micro service `p`) |

use std::fmt;

use crate::ids::{AttemptId, RunId, TaskId};
use crate::token::{TokenError, check_name};

/// The default prefix.
pub const DEFAULT_PREFIX: &str = "flotilla";

/// The pool of tasks whose agent is a workflow agent (`sequential`, `parallel`, `loop`): the
/// coordinators serve it themselves, so a workflow waiting on its child runs holds no worker
/// slot.
pub const WORKFLOW_POOL: &str = "_workflow";

/// Names of one installation.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Names {
    prefix: String,
    upper: String,
}

impl fmt::Debug for Names {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Names({})", self.prefix)
    }
}

impl Default for Names {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.to_owned(),
            upper: DEFAULT_PREFIX.to_ascii_uppercase(),
        }
    }
}

/// A KV bucket of the installation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Bucket {
    /// Run snapshots and plans.
    Runs,
    /// Team roster with presence (`agent.<name>`), written by the supervisor.
    Team,
    /// Failure records per agent and role (`agent.<name>`, `role.<name>`), written by the
    /// supervisor.
    Failures,
    /// Approvals (`<run>.<approval>`): each revision whole — requested, then decided,
    /// expired or withdrawn, written with compare-and-set so the first settles it.
    Escalations,
    /// Run controls (pause, cancel).
    Control,
    /// Trust levels. Reserved for the human-in-the-loop work: provisioned, unused.
    Trust,
    /// Session state.
    State,
    /// Live workers (TTL).
    Workers,
    /// Durable reader cursors (mailboxes), expiring with the mailboxes.
    Cursors,
    /// Remembered finished root runs (`run.<run>`), written by the supervisor, read by the
    /// coordinators' planners ([`crate::memory`]).
    Memory,
    /// The installation's quotas (`quotas`, set by `flotilla tenant add|set`) and what they
    /// count: runs held (`concurrent`), runs per hour, tokens per day, cost per month, and
    /// tokens and cost per day by agent and model — kept by the coordinators
    /// (`flotilla_tenants::ledger`).
    Usage,
}

impl Bucket {
    /// Every bucket.
    pub const ALL: [Bucket; 11] = [
        Self::Runs,
        Self::Team,
        Self::Failures,
        Self::Escalations,
        Self::Control,
        Self::Trust,
        Self::State,
        Self::Workers,
        Self::Cursors,
        Self::Memory,
        Self::Usage,
    ];

    /// Suffix after the prefix.
    pub fn suffix(self) -> &'static str {
        match self {
            Self::Runs => "runs",
            Self::Team => "team",
            Self::Failures => "failures",
            Self::Escalations => "escalations",
            Self::Control => "control",
            Self::Trust => "trust",
            Self::State => "state",
            Self::Workers => "workers",
            Self::Cursors => "cursors",
            Self::Memory => "memory",
            Self::Usage => "usage",
        }
    }
}

/// A stream of the installation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StreamKind {
    /// Plan submissions (work queue).
    Intake,
    /// Tasks (work queue).
    Tasks,
    /// Run log (limits, by age).
    RunLog,
    /// Events (limits, by age).
    Events,
    /// Workspace entries.
    Workspace,
    /// Mailboxes.
    Mailbox,
    /// Notices for people and webhooks (limits, by age).
    Notify,
}

impl StreamKind {
    /// Every stream.
    pub const ALL: [StreamKind; 7] = [
        Self::Intake,
        Self::Tasks,
        Self::RunLog,
        Self::Events,
        Self::Workspace,
        Self::Mailbox,
        Self::Notify,
    ];

    /// Suffix after the upper-case prefix.
    pub fn suffix(self) -> &'static str {
        match self {
            Self::Intake => "INTAKE",
            Self::Tasks => "TASKS",
            Self::RunLog => "RUNLOG",
            Self::Events => "EVENTS",
            Self::Workspace => "WORKSPACE",
            Self::Mailbox => "MAILBOX",
            Self::Notify => "NOTIFY",
        }
    }
}

impl Names {
    /// Names for `prefix`, which must be a name (`A-Z a-z 0-9 _ -`).
    pub fn new(prefix: &str) -> Result<Self, TokenError> {
        check_name(prefix)?;
        Ok(Self {
            prefix: prefix.to_owned(),
            upper: prefix.to_ascii_uppercase().replace('-', "_"),
        })
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// A stream's name.
    pub fn stream(&self, kind: StreamKind) -> String {
        format!("{}_{}", self.upper, kind.suffix())
    }

    /// The subjects a stream captures.
    pub fn stream_subjects(&self, kind: StreamKind) -> Vec<String> {
        let p = &self.prefix;
        match kind {
            StreamKind::Intake => vec![format!("{p}.submit")],
            StreamKind::Tasks => vec![
                format!("{p}.task.>"),
                format!("{p}.role.>"),
                format!("{p}.turn.>"),
            ],
            StreamKind::RunLog => vec![
                format!("{p}.submit.*"),
                format!("{p}.runlog.*"),
                format!("{p}.timer.*.*"),
            ],
            StreamKind::Events => vec![format!("{p}.event.*")],
            StreamKind::Workspace => vec![format!("{p}.ws.*.*")],
            StreamKind::Mailbox => vec![format!("{p}.mbox.*.*.*"), format!("{p}.tmbox.*.*.*")],
            StreamKind::Notify => vec![format!("{p}.notify.*.*")],
        }
    }

    /// A KV bucket's name.
    pub fn bucket(&self, bucket: Bucket) -> String {
        format!("{}-{}", self.prefix, bucket.suffix())
    }

    /// The object store of artifacts (large payloads).
    pub fn artifacts_bucket(&self) -> String {
        format!("{}-artifacts", self.prefix)
    }

    /// Key of a run's cancellation notice in the control bucket: workers watch these to
    /// cancel the run's running attempts.
    pub fn cancel_key(&self, run: RunId) -> String {
        format!("cancel.{run}")
    }

    /// Key of a run's hold in the control bucket, present while the run is paused or taken
    /// over: workers watch these to stop the run's LLM attempts at their next step.
    pub fn hold_key(&self, run: RunId) -> String {
        format!("hold.{run}")
    }

    /// Key of one task's own hold in the control bucket (`hold.<run>.<task>`, the task id
    /// written with [`kv_key_token`]), present while that task alone is paused: workers stop
    /// its running LLM attempt at its next step.
    pub fn task_hold_key(&self, run: RunId, task: &TaskId) -> String {
        format!("hold.{run}.{}", kv_key_token(task.as_str()))
    }

    /// Intake subject.
    pub fn submit(&self) -> String {
        format!("{}.submit", self.prefix)
    }

    /// The durable submission subject of one run (captured by the run-log stream, so the
    /// submission is the first message of the run's history).
    pub fn submit_run(&self, run: RunId) -> String {
        format!("{}.submit.{run}", self.prefix)
    }

    /// Filter for every run's durable submission.
    pub fn submit_all(&self) -> String {
        format!("{}.submit.*", self.prefix)
    }

    /// What the coordinators consume from the run-log stream: every run's submission and run
    /// log (timers have one more token and do not match).
    pub fn run_inputs_all(&self) -> String {
        format!("{}.*.*", self.prefix)
    }

    /// Subject of one task attempt.
    pub fn task(&self, pool: &str, run: RunId, task: &TaskId) -> String {
        format!("{}.task.{pool}.{run}.{task}", self.prefix)
    }

    /// Filter for a pool's tasks.
    pub fn pool_filter(&self, pool: &str) -> String {
        format!("{}.task.{pool}.>", self.prefix)
    }

    /// Durable consumer shared by a pool's workers.
    pub fn pool_consumer(&self, pool: &str) -> String {
        format!("pool-{pool}")
    }

    /// Subject of one attempt of an anycast task: a task naming a `role` and no `agent`,
    /// claimed by exactly one free member of the role (see [`Names::role_consumer`]).
    pub fn role_task(&self, role: &str, run: RunId, task: &TaskId) -> String {
        format!("{}.role.{role}.{run}.{task}", self.prefix)
    }

    /// Filter for a role's queue.
    pub fn role_filter(&self, role: &str) -> String {
        format!("{}.role.{role}.>", self.prefix)
    }

    /// Filter for every role queue's tasks of one run (a stopped run's queued tasks are
    /// purged with it).
    pub fn role_run_filter(&self, run: RunId) -> String {
        format!("{}.role.*.{run}.*", self.prefix)
    }

    /// Durable consumer of a role's queue, shared by every worker hosting a member of the
    /// role (whatever its pool).
    pub fn role_consumer(&self, role: &str) -> String {
        format!("role-{role}")
    }

    /// A run's log subject.
    pub fn runlog(&self, run: RunId) -> String {
        format!("{}.runlog.{run}", self.prefix)
    }

    /// Filter for every run log.
    pub fn runlog_all(&self) -> String {
        format!("{}.runlog.*", self.prefix)
    }

    /// Subject holding one timer schedule of a run.
    pub fn timer(&self, run: RunId, generation: u64) -> String {
        format!("{}.timer.{run}.{generation}", self.prefix)
    }

    /// Where people and webhooks hear that something of run `run` waits for them (`kind`:
    /// `approval`, `pause`, `takeover`). Kept on the notice stream; a notice, not a record
    /// (the record is the escalations bucket or the run log).
    pub fn notify(&self, kind: &str, run: RunId) -> String {
        format!("{}.notify.{kind}.{run}", self.prefix)
    }

    /// Filter for every notice.
    pub fn notify_all(&self) -> String {
        format!("{}.notify.>", self.prefix)
    }

    /// Filter for every notice of one kind.
    pub fn notify_kind(&self, kind: &str) -> String {
        format!("{}.notify.{kind}.*", self.prefix)
    }

    /// A run's event subject.
    pub fn event(&self, run: RunId) -> String {
        format!("{}.event.{run}", self.prefix)
    }

    /// Filter for every run's events.
    pub fn event_all(&self) -> String {
        format!("{}.event.*", self.prefix)
    }

    /// A workspace topic of a run tree (`root` is the tree's root run).
    pub fn workspace(&self, root: RunId, topic: &str) -> String {
        format!("{}.ws.{root}.{topic}", self.prefix)
    }

    /// Filter for every topic of a run tree's workspace.
    pub fn workspace_all(&self, root: RunId) -> String {
        format!("{}.ws.{root}.*", self.prefix)
    }

    /// Filter for every workspace entry of every run.
    pub fn workspace_everything(&self) -> String {
        format!("{}.ws.*.*", self.prefix)
    }

    /// The subject of a mailbox post: to `to` (a task id, or [`crate::mailbox::BROADCAST`])
    /// from `from`, in a run tree.
    pub fn mailbox(&self, root: RunId, to: &str, from: &str) -> String {
        format!("{}.mbox.{root}.{to}.{from}", self.prefix)
    }

    /// Filter for every post to `to` in a run tree, from anyone.
    pub fn mailbox_inbox(&self, root: RunId, to: &str) -> String {
        format!("{}.mbox.{root}.{to}.*", self.prefix)
    }

    /// The subject of a message to teammate `to` of `team` from `from`.
    pub fn teammate_inbox(&self, team: &str, to: &str, from: &str) -> String {
        format!("{}.tmbox.{team}.{to}.{from}", self.prefix)
    }

    /// Filter for every message to teammate `to` of `team`.
    pub fn teammate_inbox_filter(&self, team: &str, to: &str) -> String {
        format!("{}.tmbox.{team}.{to}.*", self.prefix)
    }

    /// Filter for every teammate inbox (the workers' and the supervisors' consumers of
    /// them).
    pub fn teammate_inbox_all(&self) -> String {
        format!("{}.tmbox.*.*.*", self.prefix)
    }

    /// The team and the teammate a teammate inbox subject
    /// ([`teammate_inbox`](Self::teammate_inbox)) is addressed to; `None` for any other
    /// subject.
    pub fn teammate_inbox_parts<'a>(&self, subject: &'a str) -> Option<(&'a str, &'a str)> {
        let rest = subject
            .strip_prefix(self.prefix.as_str())?
            .strip_prefix(".tmbox.")?;
        let mut parts = rest.split('.');
        match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some(team), Some(to), Some(_from), None) if !team.is_empty() && !to.is_empty() => {
                Some((team, to))
            }
            _ => None,
        }
    }

    /// The subject of a turn of teammate `name` of `team`, run by `pool`.
    pub fn turn(&self, pool: &str, team: &str, name: &str) -> String {
        format!("{}.turn.{pool}.{team}.{name}", self.prefix)
    }

    /// Filter for every turn of `pool`.
    pub fn turn_filter(&self, pool: &str) -> String {
        format!("{}.turn.{pool}.>", self.prefix)
    }

    /// The workers' shared durable consumer of `pool`'s turns.
    pub fn turn_consumer(&self, pool: &str) -> String {
        format!("turns-{pool}")
    }

    /// Key of a reader's committed mailbox cursor in the cursors bucket. The reader is
    /// written with [`kv_key_token`], since task ids may use characters KV keys cannot.
    pub fn mailbox_cursor_key(&self, root: RunId, reader: &str) -> String {
        format!("mbox.{root}.{}", kv_key_token(reader))
    }

    /// Key of the read position of one execution of an attempt (`delivery` of `attempt`) in
    /// the cursors bucket: exec agents read their mailbox from separate processes, so the
    /// position of the running execution is kept here until the worker commits it.
    pub fn mailbox_position_key(
        &self,
        root: RunId,
        reader: &str,
        attempt: AttemptId,
        delivery: i64,
    ) -> String {
        format!(
            "mbox.{root}.{}.pos.{attempt}.{delivery}",
            kv_key_token(reader)
        )
    }

    /// Key of the claim of a role's mailbox message (stream sequence `seq`) in the cursors
    /// bucket: created by the first task playing the role that reads it, which alone gets it.
    /// `_claim` cannot be a reader's token (task ids do not start with `_`).
    pub fn mailbox_claim_key(&self, root: RunId, seq: u64) -> String {
        format!("mbox.{root}._claim.{seq}")
    }

    /// Key of a session-state value in the state bucket (`session` is a session id or the
    /// root run id).
    pub fn state_key(&self, session: &str, key: &str) -> String {
        format!("{session}.{key}")
    }

    /// Durable consumer of the workspace stream shared by coordinators (it turns entries
    /// into `topic_written` inputs for runs whose tasks wait on a topic).
    pub fn workspace_consumer(&self) -> &'static str {
        "coordinator-ws"
    }

    /// Request/reply endpoint subject.
    pub fn api(&self, endpoint: &str) -> String {
        format!("{}.api.{endpoint}", self.prefix)
    }

    /// The micro service's name.
    pub fn service(&self) -> &str {
        &self.prefix
    }

    /// Durable consumer of the intake stream, shared by coordinators.
    pub fn intake_consumer(&self) -> &'static str {
        "coordinator"
    }

    /// Durable consumer of the run log, shared by coordinators.
    pub fn runlog_consumer(&self) -> &'static str {
        "coordinator"
    }
}

/// A subject token as one KV key token. KV keys allow only `A-Z a-z 0-9 - _ / = .`, while
/// task ids may use any subject-safe character (`売上`): bytes other than ASCII letters,
/// digits, `-` and `_` are written `=XX` (upper-case hex), so distinct tokens stay distinct
/// and ordinary ids are unchanged.
pub fn kv_key_token(token: &str) -> String {
    let mut out = String::with_capacity(token.len());
    for b in token.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("={b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_prefix() {
        let n = Names::new("acme-ai").expect("valid");
        assert_eq!(n.stream(StreamKind::Tasks), "ACME_AI_TASKS");
        assert_eq!(n.bucket(Bucket::Runs), "acme-ai-runs");
        let run = RunId::new();
        assert_eq!(
            n.task("gpu", run, &TaskId::new("t1")),
            format!("acme-ai.task.gpu.{run}.t1")
        );
        assert_eq!(
            n.role_task("analyst", run, &TaskId::new("t1")),
            format!("acme-ai.role.analyst.{run}.t1")
        );
        assert_eq!(n.role_consumer("analyst"), "role-analyst");
        assert!(Names::new("a.b").is_err());
        let inbox = n.teammate_inbox("t", "ann", "bo");
        assert_eq!(n.teammate_inbox_parts(&inbox), Some(("t", "ann")));
        for other in [
            "acme-ai.tmbox.t.ann",
            "acme-ai.tmbox.t.ann.bo.x",
            "acme.tmbox.t.ann.bo",
            "acme-ai.mbox.t.ann.bo",
            "acme-ai.tmbox..ann.bo",
        ] {
            assert_eq!(n.teammate_inbox_parts(other), None, "{other}");
        }
    }

    #[test]
    fn cursor_keys_are_kv_safe() {
        let n = Names::default();
        let run = RunId::new();
        assert_eq!(
            n.mailbox_cursor_key(run, "calc_growth"),
            format!("mbox.{run}.calc_growth")
        );
        assert_eq!(kv_key_token("売"), "=E5=A3=B2");
        assert_eq!(kv_key_token("a=b"), "a=3Db");
        assert_ne!(kv_key_token("a=3Db"), kv_key_token("a=b"));
    }
}
