//! A run replayed from what was recorded (`flotilla runs replay RUN`): its run log through the
//! run machine alone — every task served from its recorded result, so no model is called and
//! no tool runs — checked against what the run recorded: each event the coordinator
//! published, and the state it stored. It says whether the replay reached the same decisions,
//! or where it first did not (which run-log entry, which task, what differed).
//!
//! Each LLM attempt that succeeded is replayed too, from its step journal
//! ([`crate::conversation`]): its model replies and tool results are served from the
//! `agent_step` events it recorded, and the walk must reach the answer and the tokens the
//! attempt recorded — a step missing from the journal is a divergence, never a call. A fork at
//! a step reads the steps it kept from the run it forked. And the run's child runs — the links
//! on its event stream — are replayed the same way, the whole tree down.
//!
//! A run submitted on its own subject (the client library's fast path) has no `submitted`
//! entry: its admission — depth, budgets, anycast, lead, escalation policy — is read from its
//! stored record, where the coordinator fixed it, and its plan from its first message.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;

use flotilla_machine::{Action, RunState};
use flotilla_model::event::{Event, StepEntry, WorkflowPhase};
use flotilla_model::ids::{AttemptId, RunId, TaskId};
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
    /// The first place it did not (in this run; a child's is in its report).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub divergence: Option<Divergence>,
    /// LLM conversations replayed from their step journals (one per succeeded attempt).
    pub conversations: u32,
    /// Model replies served from the journals: model calls the replay did not make.
    pub model_replies: u32,
    /// Rounds of tool results served from the journals: tool runs the replay did not make.
    pub tool_rounds: u32,
    /// The child runs, replayed the same way (`same` holds only when every one is).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<ReplayReport>,
    /// Child runs past the cap on runs replayed at once, not replayed.
    #[serde(skip_serializing_if = "is_zero")]
    pub omitted: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Most runs one replay covers (the run and its descendants, breadth first).
pub const MAX_REPLAYED_RUNS: usize = 1000;

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
    /// The step of the task's LLM conversation, when the divergence is in one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<u32>,
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

/// Replays `run` and the tree under it. `Ok(None)` when the run does not exist.
pub async fn replay_run(store: &RunReader, run: RunId) -> Result<Option<ReplayReport>, StoreError> {
    let mut budget = MAX_REPLAYED_RUNS;
    replay_tree(store, run, &mut budget).await
}

type Replaying<'a> =
    Pin<Box<dyn Future<Output = Result<Option<ReplayReport>, StoreError>> + Send + 'a>>;

/// `run`, then its children depth first, while `budget` runs remain.
fn replay_tree<'a>(store: &'a RunReader, run: RunId, budget: &'a mut usize) -> Replaying<'a> {
    Box::pin(async move {
        *budget = budget.saturating_sub(1);
        let Some((mut report, children)) = replay_one(store, run).await? else {
            return Ok(None);
        };
        for child in children {
            if *budget == 0 {
                report.omitted += 1;
                continue;
            }
            if let Some(r) = replay_tree(store, child, budget).await? {
                report.same &= r.same;
                report.children.push(r);
            }
        }
        Ok(Some(report))
    })
}

/// What a run's events hold for its replay, from one read.
#[derive(Default)]
struct Recorded {
    /// The coordinator's machine events: the first of each id, with its place in the stream.
    decided: BTreeMap<String, (usize, Decided)>,
    /// Each attempt's journaled steps.
    steps: HashMap<AttemptId, BTreeMap<u32, StepEntry>>,
    /// Child runs, in the order their links were stored.
    children: Vec<RunId>,
}

/// Replays `run` alone: its report and its children. `Ok(None)` when it does not exist.
async fn replay_one(
    store: &RunReader,
    run: RunId,
) -> Result<Option<(ReplayReport, Vec<RunId>)>, StoreError> {
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
        conversations: 0,
        model_replies: 0,
        tool_rounds: 0,
        children: Vec::new(),
        omitted: 0,
    };
    // One read of the run's events: the machine's events, the journals, the children.
    let mut rec = Recorded::default();
    let mut seen_children = HashSet::new();
    crate::tree::each_event(store, run, |e| match e.event {
        Event::Workflow(w) if e.source == "coordinator" && machine_event(run, &e.id) => {
            // The run's end (`<run>.end`) is the runtime's, from the machine's `Finish`: its
            // status is compared with the state below.
            let n = rec.decided.len();
            rec.decided.entry(e.id).or_insert((
                n,
                Decided {
                    phase: w.phase,
                    task: e.task_id,
                    attempt: e.attempt,
                },
            ));
        }
        Event::AgentStep {
            attempt_id,
            step,
            entry,
        } => {
            // The first record of a step wins; a repeat is the same step.
            rec.steps
                .entry(attempt_id)
                .or_default()
                .entry(step)
                .or_insert(entry);
        }
        Event::AgentRunStarted { child, .. } if seen_children.insert(child.run_id) => {
            rec.children.push(child.run_id);
        }
        _ => {}
    })
    .await?;
    let children = std::mem::take(&mut rec.children);
    let Some(machine) = replayed else {
        report.divergence = Some(Divergence {
            seq: None,
            input: None,
            task_id: None,
            step: None,
            recorded: format!("a run that {}", stored.status.as_str()),
            replayed: "nothing: its log holds no submission to start from".into(),
        });
        return Ok(Some((report, children)));
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
    let mut recorded = std::mem::take(&mut rec.decided);
    report.events = recorded.len() as u32;
    let divergence = |seq: u64, task: Option<TaskId>, recorded: String, replayed: String| {
        Some(Divergence {
            seq: Some(seq),
            input: log
                .iter()
                .find(|(s, _, _)| *s == seq)
                .map(|(_, _, i)| input_kind(i)),
            task_id: task,
            step: None,
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
                return Ok(Some((report, children)));
            }
            None => {
                report.divergence =
                    divergence(*seq, d.task.clone(), "no such event".into(), d.describe());
                return Ok(Some((report, children)));
            }
        }
    }
    if let Some((id, (_, r))) = recorded.into_iter().min_by_key(|(_, (n, _))| *n) {
        report.divergence = Some(Divergence {
            seq: None,
            input: None,
            task_id: r.task.clone(),
            step: None,
            recorded: format!("{} (event {id})", r.describe()),
            replayed: "no such event".into(),
        });
        return Ok(Some((report, children)));
    }
    if let Some(d) = state_divergence(&stored, machine.state(), &plan) {
        report.divergence = Some(d);
        return Ok(Some((report, children)));
    }
    // Each LLM attempt that succeeded, from its journal.
    let kept = match plan.fork.as_ref().and_then(|f| f.conversation.as_ref()) {
        Some(k) => {
            let mut steps = BTreeMap::new();
            crate::tree::each_event(store, k.run_id, |e| {
                if let Event::AgentStep {
                    attempt_id,
                    step,
                    entry,
                } = e.event
                    && attempt_id == k.attempt_id
                    && step < k.steps
                {
                    steps.entry(step).or_insert(entry);
                }
            })
            .await?;
            Some(steps)
        }
        None => None,
    };
    for (seq, _, input) in &log {
        let RunInput::TaskResult(r) = input else {
            continue;
        };
        if !r.result.success {
            continue;
        }
        let Some(own) = rec.steps.remove(&r.attempt_id) else {
            continue;
        };
        let sub = plan.subtasks.iter().find(|s| s.id == r.task_id);
        let fork_point = plan.fork.as_ref().is_some_and(|f| f.task_id == r.task_id);
        let mut steps = match (&kept, fork_point) {
            (Some(kept), true) => kept.clone(),
            _ => BTreeMap::new(),
        };
        steps.extend(own);
        match crate::conversation::replay_conversation(
            &steps,
            &r.result,
            sub.and_then(|s| s.output_schema.as_ref()),
        ) {
            Ok(served) => {
                report.conversations += 1;
                report.model_replies += served.replies;
                report.tool_rounds += served.rounds;
            }
            Err(d) => {
                report.divergence = Some(Divergence {
                    seq: Some(*seq),
                    input: Some(input_kind(input)),
                    task_id: Some(r.task_id.clone()),
                    step: d.step,
                    recorded: d.recorded,
                    replayed: d.replayed,
                });
                return Ok(Some((report, children)));
            }
        }
    }
    report.same = true;
    Ok(Some((report, children)))
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
                step: None,
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
            step: None,
            recorded: format!("status {}", a.status.as_str()),
            replayed: format!("status {}", b.status.as_str()),
        });
    }
    Some(Divergence {
        seq: None,
        input: None,
        task_id: None,
        step: None,
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
