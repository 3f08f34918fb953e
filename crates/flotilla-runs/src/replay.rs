//! A run replayed from what was recorded (`flotilla runs replay RUN`): its run log through the
//! run machine alone — every task served from its recorded result, so no model is called and
//! no tool runs — checked against what the run recorded: each event the coordinator
//! published, and the state it stored. It says whether the replay reached the same decisions,
//! or where it first did not (which run-log entry, which task, what differed).
//!
//! A run submitted on its own subject (the client library's fast path) has no `submitted`
//! entry: its admission — depth, budgets, anycast, lead, escalation policy — is read from its
//! stored record, where the coordinator fixed it, and its plan from its first message.

use std::collections::BTreeMap;

use flotilla_machine::{Action, RunState};
use flotilla_model::event::{Event, WorkflowPhase};
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::run::RunStatus;
use flotilla_model::runlog::RunInput;
use serde::Serialize;

use crate::{FirstMessage, RunReader, StoreError};

/// What a replay found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayReport {
    /// The run.
    pub run_id: RunId,
    /// Run-log entries replayed.
    pub entries: u32,
    /// The coordinator's events compared.
    pub events: u32,
    /// The run's status as recorded.
    pub recorded: RunStatus,
    /// The run's status as replayed (absent when nothing could be replayed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replayed: Option<RunStatus>,
    /// Whether the replay reached the same decisions and the same state.
    pub same: bool,
    /// The first place it did not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub divergence: Option<Divergence>,
}

/// Where a replay first differs from the record.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Divergence {
    /// The run-log entry whose step differs (stream sequence), when one does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// The kind of that entry (`task_result`, `approval_decided`, …).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input: Option<String>,
    /// The task concerned, when one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub task_id: Option<TaskId>,
    /// What the run recorded there.
    pub recorded: String,
    /// What the replay decided there.
    pub replayed: String,
}

/// One workflow event, as compared: its id, phase, task and attempt.
#[derive(Debug, Clone, PartialEq)]
struct Decided {
    phase: WorkflowPhase,
    task: Option<TaskId>,
    attempt: Option<u32>,
}

impl Decided {
    fn describe(&self) -> String {
        let mut s = format!("{:?}", self.phase);
        if let Some(t) = &self.task {
            s.push_str(&format!(" of task {t}"));
        }
        if let Some(a) = self.attempt.filter(|a| *a > 0) {
            s.push_str(&format!(" (attempt {a})"));
        }
        s
    }
}

/// An event the replay emitted: the step's run-log sequence, the event's id and phase, the
/// task's index in the plan and the attempt.
type Emitted = (u64, String, WorkflowPhase, Option<u32>, Option<u32>);

/// Replays `run`. `Ok(None)` when the run does not exist.
pub async fn replay_run(store: &RunReader, run: RunId) -> Result<Option<ReplayReport>, StoreError> {
    let Some(stored) = store.state(run).await? else {
        return Ok(None);
    };
    let mut history = store.history(run).await?;
    // The fast path's admission is in the record: the history shows its submission with
    // what the request says, and the record adds what the coordinator decided.
    if let Some(crate::First {
        content: FirstMessage::Submission { .. },
        ..
    }) = store.first_message(run).await?
        && let Some((_, _, entry)) = history.first_mut()
        && let RunInput::Submitted(s) = &mut entry.input
    {
        s.depth = stored.depth;
        s.budget_scopes = stored.budget_scopes.clone();
        s.anycast = stored.anycast;
        s.memory = stored.memory.clone();
        s.lead = stored.lead.clone();
        s.hitl = stored.hitl.clone();
        s.warnings = stored.warnings.clone();
        s.trace = stored.trace.clone();
        s.wait_reply_to = stored.wait_reply_to.clone();
    }
    let log: Vec<(u64, i64, RunInput)> = history
        .into_iter()
        .map(|(seq, at, e)| (seq, at.unix_ms(), e.input))
        .collect();
    // What the machine decides, step by step: its events (the task by its index in the
    // plan, named once the plan is known).
    let mut emitted: Vec<Emitted> = Vec::new();
    let replayed = flotilla_machine::replay(
        run,
        log.iter().map(|(s, at, i)| (*s, *at, i)),
        |seq, actions| {
            for a in actions {
                if let Action::Emit(e) = a {
                    emitted.push((seq, e.id.clone(), e.event.phase, e.task, e.attempt));
                }
            }
        },
    );
    let mut report = ReplayReport {
        run_id: run,
        entries: log.len() as u32,
        events: 0,
        recorded: stored.status,
        replayed: replayed.as_ref().map(|m| m.state().status),
        same: false,
        divergence: None,
    };
    let Some(machine) = replayed else {
        report.divergence = Some(Divergence {
            seq: None,
            input: None,
            task_id: None,
            recorded: format!("a run that {}", stored.status.as_str()),
            replayed: "nothing: its log holds no submission to start from".into(),
        });
        return Ok(Some(report));
    };
    let plan = machine.plan().clone();
    let task_id = |i: u32| plan.subtasks.get(i as usize).map(|s| s.id.clone());
    let replayed_events: Vec<(u64, String, Decided)> = emitted
        .into_iter()
        .map(|(seq, id, phase, task, attempt)| {
            (
                seq,
                id,
                Decided {
                    phase,
                    task: task.and_then(task_id),
                    attempt,
                },
            )
        })
        .collect();
    // The coordinator's events of the machine's steps, as recorded: the first of each id,
    // with its place in the stream.
    let mut recorded: BTreeMap<String, (usize, Decided)> = BTreeMap::new();
    crate::tree::each_event(store, run, |e| {
        if e.source != "coordinator" || !machine_event(run, &e.id) {
            return;
        }
        // The run's end (`<run>.end`) is the runtime's, from the machine's `Finish`: its
        // status is compared with the state below.
        if let Event::Workflow(w) = &e.event {
            let n = recorded.len();
            recorded.entry(e.id).or_insert((
                n,
                Decided {
                    phase: w.phase,
                    task: e.task_id,
                    attempt: e.attempt,
                },
            ));
        }
    })
    .await?;
    report.events = recorded.len() as u32;
    let divergence = |seq: u64, task: Option<TaskId>, recorded: String, replayed: String| {
        Some(Divergence {
            seq: Some(seq),
            input: log
                .iter()
                .find(|(s, _, _)| *s == seq)
                .map(|(_, _, i)| input_kind(i)),
            task_id: task,
            recorded,
            replayed,
        })
    };
    for (seq, id, d) in &replayed_events {
        match recorded.remove(id).map(|(_, r)| r) {
            Some(r) if r == *d => {}
            Some(r) => {
                report.divergence = divergence(
                    *seq,
                    d.task.clone().or(r.task.clone()),
                    r.describe(),
                    d.describe(),
                );
                return Ok(Some(report));
            }
            None => {
                report.divergence =
                    divergence(*seq, d.task.clone(), "no such event".into(), d.describe());
                return Ok(Some(report));
            }
        }
    }
    if let Some((id, (_, r))) = recorded.into_iter().min_by_key(|(_, (n, _))| *n) {
        report.divergence = Some(Divergence {
            seq: None,
            input: None,
            task_id: r.task.clone(),
            recorded: format!("{} (event {id})", r.describe()),
            replayed: "no such event".into(),
        });
        return Ok(Some(report));
    }
    if let Some(d) = state_divergence(&stored, machine.state(), &plan) {
        report.divergence = Some(d);
        return Ok(Some(report));
    }
    report.same = true;
    Ok(Some(report))
}

/// Whether `id` is an event the run machine emits (`<run>.start`, `<run>.<step>.<n>`), not one
/// the runtime adds while performing (approvals' records, links).
fn machine_event(run: RunId, id: &str) -> bool {
    let Some(rest) = id.strip_prefix(&format!("{run}.")) else {
        return false;
    };
    if rest == "start" {
        return true;
    }
    let mut parts = rest.split('.');
    matches!(
        (parts.next(), parts.next(), parts.next()),
        (Some(a), Some(b), None) if a.parse::<u64>().is_ok() && b.parse::<u64>().is_ok()
    )
}

/// The first difference between the stored state and the replayed one (the outcome aside:
/// the runtime completes its final result from the results' texts after the machine decided
/// the end).
fn state_divergence(
    stored: &RunState,
    replayed: &RunState,
    plan: &flotilla_model::plan::Plan,
) -> Option<Divergence> {
    let mut a = stored.clone();
    let mut b = replayed.clone();
    a.outcome = None;
    b.outcome = None;
    if a == b {
        return None;
    }
    for (i, (x, y)) in a.tasks.iter().zip(&b.tasks).enumerate() {
        if x != y {
            return Some(Divergence {
                seq: None,
                input: None,
                task_id: plan.subtasks.get(i).map(|s| s.id.clone()),
                recorded: format!("{x:?}"),
                replayed: format!("{y:?}"),
            });
        }
    }
    if a.status != b.status {
        return Some(Divergence {
            seq: None,
            input: None,
            task_id: None,
            recorded: format!("status {}", a.status.as_str()),
            replayed: format!("status {}", b.status.as_str()),
        });
    }
    Some(Divergence {
        seq: None,
        input: None,
        task_id: None,
        recorded: "the stored run state".into(),
        replayed: "a different run state (same tasks and status)".into(),
    })
}

/// A run-log input's kind, as the log names it (`task_result`, …).
fn input_kind(input: &RunInput) -> String {
    serde_json::to_value(input)
        .ok()
        .and_then(|v| v.get("type").and_then(|t| t.as_str()).map(str::to_owned))
        .unwrap_or_default()
}
