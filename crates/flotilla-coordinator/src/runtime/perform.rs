//! Performing a step's actions: workspace and state writes, durable timers (scheduled
//! run-log messages), planner reviews and cancellations, then the step's events as one
//! message, then its task messages, and last the end's answers to waiting submitters (before
//! the acknowledgements are awaited). Every publish carries a
//! deterministic message id, so performing the same actions again publishes nothing twice.

use async_nats::HeaderMap;
use flotilla_bus::wire;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::codec::Codec;
use flotilla_model::event::{Event, EventBatch, EventEnvelope, WorkflowEvent, WorkflowPhase};
use flotilla_model::ids::RunId;
use flotilla_model::run::RunStatus;
use flotilla_model::runlog::{RunInput, RunLogEntry};
use flotilla_model::subjects::WORKFLOW_POOL;
use flotilla_model::submit::SubmitReply;
use flotilla_model::task::TaskAnswer;
use flotilla_model::time::Timestamp;
use flotilla_telemetry::{spans, trace_context};

use crate::machine::{Action, Emission};

use super::{Cached, Runtime, StepError};

/// Whether performing a run's end answers its waiting submitters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Replies {
    /// Yes: the step that decided the end (or its inputs, redelivered).
    Send,
    /// No: an end performed again for its events only.
    Skip,
}

impl Runtime {
    /// How the worker of attempt `attempt` of `task` answers the run's waiting submitters,
    /// when its success would end the run as this task's result alone and this coordinator
    /// knows the run's last log message (one hop less: the answer leaves the worker once its
    /// result is stored). `None`: the coordinator answers, as for any run.
    fn answer_of(&self, entry: &Cached, task: u32, attempt: u32) -> Option<TaskAnswer> {
        let after_seq = entry.last_log_seq?;
        let s = entry.machine.state();
        let reply_to: Vec<String> = [&s.reply_to, &s.wait_reply_to]
            .into_iter()
            .flatten()
            .cloned()
            .collect();
        if reply_to.is_empty()
            || !entry
                .machine
                .success_ends_run(task, attempt, Timestamp::now().unix_ms())
        {
            return None;
        }
        Some(TaskAnswer {
            reply_to,
            after_seq,
            final_result_budget: self.final_result_budget() as u64,
            review_below: entry.machine.review_below(task),
        })
    }

    /// Performs actions: every publish is sent first, then all acknowledgements are awaited.
    /// The step's events (workflow events and the run's end) go out as one message, after its
    /// writes and timers and before its task messages; the outcome's answer to a waiting
    /// submitter goes out last of all.
    pub(super) async fn perform(
        &self,
        entry: &mut Cached,
        actions: &[Action],
        step: &tracing::Span,
        replies: Replies,
    ) -> Result<(), StepError> {
        let js = self.bus.js();
        let names = self.bus.names().clone();
        let run = entry.machine.state().run_id;
        let max = self.bus.max_payload();
        let mut pending: Vec<Pending> = Vec::new();
        let mut events: Vec<EventEnvelope> = Vec::new();
        // The end's answers to waiting submitters: sent last, after every other message of
        // the step is published.
        let mut answers: Vec<(String, SubmitReply)> = Vec::new();
        // Workspace entries and state values this step writes; a dispatch that reads the
        // workspace or state waits for them to be stored first.
        let mut unflushed_writes = false;
        // Task messages, sent after the step's events: a worker's `task_started` then lands
        // on the event stream after the `task_succeeded` of the dependencies that released it
        // (one connection, and the event stream's ingest is in order), so the stream tells
        // the run's story in causal order. It costs no round trip: nothing waits in between.
        let mut dispatches: Vec<(String, wire::Outgoing)> = Vec::new();
        for action in actions {
            let (subject, out) = match action {
                Action::Dispatch { task, attempt } => {
                    let role = entry.machine.anycast_role(*task).map(str::to_owned);
                    let sub = &entry.machine.plan().subtasks[*task as usize];
                    if unflushed_writes
                        && (!sub.consumes.is_empty() || sub.description.contains('{'))
                    {
                        for (subject, size, ack) in pending.drain(..) {
                            ack.await.map_err(|e| {
                                flotilla_bus::classify_publish_error(&subject, size, max, e)
                            })?;
                        }
                        unflushed_writes = false;
                    }
                    let claimed_by = role.as_ref().map(|r| format!("role:{r}"));
                    let span = spans::dispatch(
                        step,
                        run,
                        &sub.id,
                        *attempt,
                        &sub.pool,
                        claimed_by
                            .as_deref()
                            .or(sub.agent.as_deref())
                            .or(self.default_agent.as_deref())
                            .unwrap_or("default"),
                    );
                    let env = match Box::pin(self.envelope(entry, *task, *attempt)).await? {
                        // The attempt's trace parent is this dispatch (when spans are exported).
                        Ok(mut env) => {
                            if let Some(t) = trace_context::span_context(&span) {
                                env.trace = Some(t);
                            }
                            // Workflow agents run on the coordinators' own pool: a workflow
                            // waiting on its children holds no worker slot.
                            if role.is_none()
                                && self
                                    .ctx
                                    .agents
                                    .as_ref()
                                    .is_some_and(|a| a.is_workflow(env.agent.as_deref()))
                            {
                                env.pool = WORKFLOW_POOL.to_owned();
                            } else if role.is_none() {
                                env.answer = self.answer_of(entry, *task, *attempt);
                            }
                            env
                        }
                        Err(failure) => {
                            // The task cannot start (a state key its description needs is
                            // not set): its attempt fails through the run log like any other.
                            let (subject, out) =
                                self.coordinator_failure(entry, *task, *attempt, failure)?;
                            send(js, subject, out, max, &mut pending).await?;
                            continue;
                        }
                    };
                    let mut out = wire::encode(&env, Codec::Json, Some(&env.msg_id()))?;
                    if let Some(t) = &env.trace {
                        out.headers
                            .insert(wire::TRACEPARENT, t.traceparent.as_str());
                    }
                    // An anycast task goes to its role's queue, where one member claims it.
                    let subject = match &role {
                        Some(r) => names.role_task(r, run, &env.task_id),
                        None => names.task(&env.pool, run, &env.task_id),
                    };
                    dispatches.push((subject, out));
                    continue;
                }
                Action::Withdraw { task, .. } => {
                    Box::pin(self.withdraw(entry, *task)).await?;
                    continue;
                }
                Action::Produce { task } => {
                    for (subject, out) in self.produced_entries(entry, *task).await? {
                        send(js, subject, out, max, &mut pending).await?;
                    }
                    unflushed_writes = true;
                    continue;
                }
                Action::StoreOutput { task } => {
                    unflushed_writes = true;
                    self.output_value(entry, *task).await?
                }
                Action::Emit(e) => {
                    events.push(self.event_of(entry, e));
                    continue;
                }
                Action::ArmTimer { generation, due_ms } => {
                    let body = RunLogEntry {
                        protocol: PROTOCOL_VERSION,
                        run_id: run,
                        input: RunInput::TimerFired {
                            generation: *generation,
                        },
                    };
                    let mut out = wire::encode(
                        &body,
                        Codec::Json,
                        Some(&format!("timer.{run}.{generation}")),
                    )?;
                    schedule_headers(&mut out.headers, *due_ms, &names.runlog(run));
                    (names.timer(run, *generation), out)
                }
                Action::RequestApproval {
                    task,
                    attempt,
                    trigger,
                    deadline_ms,
                    notify_only,
                    call,
                    from_seq,
                } => {
                    let wait = super::approvals::Wait {
                        task: *task,
                        attempt: *attempt,
                        call: *call,
                        from_seq: *from_seq,
                    };
                    let record = self
                        .request_approval(entry, wait, *trigger, *deadline_ms, *notify_only)
                        .await?;
                    if let Some(record) = record {
                        events.extend(self.await_event(entry, &record));
                    }
                    continue;
                }
                Action::ExpireApproval {
                    task,
                    attempt,
                    call,
                    default,
                } => {
                    let wait = super::approvals::Wait {
                        task: *task,
                        attempt: *attempt,
                        call: *call,
                        from_seq: 0,
                    };
                    match self.expire_approval(entry, wait, *default).await? {
                        Some(entry) => entry,
                        None => continue,
                    }
                }
                Action::ProjectApproval {
                    task,
                    attempt,
                    call,
                    from_seq,
                    trigger,
                    deadline_ms,
                    seq,
                } => {
                    let wait = super::approvals::Wait {
                        task: *task,
                        attempt: *attempt,
                        call: *call,
                        from_seq: *from_seq,
                    };
                    self.project_approval(entry, wait, *trigger, *deadline_ms, *seq)
                        .await?;
                    continue;
                }
                Action::WithdrawApproval {
                    task,
                    attempt,
                    call,
                } => {
                    events.extend(
                        self.withdraw_approval(entry, *task, *attempt, *call)
                            .await?,
                    );
                    continue;
                }
                Action::CancelAttempts => {
                    Box::pin(self.cancel_attempts(entry)).await?;
                    continue;
                }
                Action::Rollback { tasks } => {
                    if let Some(link) = Box::pin(self.roll_back(entry, tasks)).await? {
                        events.push(link);
                    }
                    continue;
                }
                Action::HoldAttempts { held } => {
                    self.hold_attempts(entry, *held).await?;
                    continue;
                }
                Action::HoldTask { task, held } => {
                    self.hold_task(entry, *task, *held).await?;
                    continue;
                }
                Action::ReviewPlan { round } => {
                    let body = self.review_plan(entry, *round).await?;
                    let out =
                        wire::encode(&body, Codec::Json, Some(&format!("planned.{run}.{round}")))?;
                    (names.runlog(run), out)
                }
                Action::Finish => {
                    // Its slot is given back before its end is told (a client that sees the
                    // end and submits again finds the slot free), and its usage counted.
                    if let Some(quota) = &self.quota {
                        let machine = &entry.machine;
                        quota.ended(run, machine.state().parent.is_none()).await;
                        if quota.counts() {
                            let agents = machine
                                .plan()
                                .subtasks
                                .iter()
                                .map(|t| {
                                    let agent = t
                                        .agent
                                        .clone()
                                        .or_else(|| self.default_agent.clone())
                                        .unwrap_or_else(|| "default".to_owned());
                                    (t.id.clone(), agent)
                                })
                                .collect();
                            let ended_ms = machine
                                .state()
                                .finished_ms
                                .unwrap_or_else(|| Timestamp::now().unix_ms());
                            quota.count_later(run, ended_ms, agents);
                        }
                    }
                    let state = entry.machine.state();
                    let outcome = state.outcome.clone();
                    let phase = match state.status {
                        RunStatus::Succeeded => WorkflowPhase::RunSucceeded,
                        RunStatus::Cancelled => WorkflowPhase::RunCancelled,
                        _ => WorkflowPhase::RunFailed,
                    };
                    if let Some(o) = outcome.as_ref().filter(|_| replies == Replies::Send) {
                        let reply = SubmitReply::finished(o.clone());
                        for to in [&state.reply_to, &state.wait_reply_to]
                            .into_iter()
                            .flatten()
                        {
                            answers.push((to.clone(), reply.clone()));
                        }
                    }
                    let e = Emission {
                        id: format!("{run}.end"),
                        task: None,
                        attempt: None,
                        at_ms: state.finished_ms.unwrap_or_default(),
                        event: WorkflowEvent {
                            outcome: outcome.map(Box::new),
                            // A bare query whose planning failed: the last answer's problems.
                            problems: if state.planning.is_some() {
                                state.errors.clone()
                            } else {
                                Vec::new()
                            },
                            ..WorkflowEvent::phase(phase)
                        },
                    };
                    events.push(self.event_of(entry, &e));
                    continue;
                }
            };
            send(js, subject, out, max, &mut pending).await?;
        }
        // One message per step; split only when it would not fit in one.
        let subject = names.event(run);
        for out in encode_event_batches(run, events, max / 2)? {
            send(js, subject.clone(), out, max, &mut pending).await?;
        }
        for (subject, out) in dispatches {
            send(js, subject, out, max, &mut pending).await?;
        }
        // The answers follow the step's messages on the same connection, so the server has
        // them first; waiting for their acknowledgements before answering would add a
        // round trip to every run's end. Should one fail, the step is handed back and
        // performed again, and answers again under the same message id — the repeat a
        // successor of a dead coordinator sends too.
        let answer_id = SubmitReply::finished_id(run);
        for (to, reply) in &answers {
            self.bus.publish_reply(to, reply, Some(&answer_id)).await;
        }
        for (subject, size, ack) in pending {
            ack.await
                .map_err(|e| flotilla_bus::classify_publish_error(&subject, size, max, e))?;
        }
        Ok(())
    }

    /// The envelope of an emission. Task-level events name the task's agent (or the default
    /// agent; for an anycast task, the member that ran it) and role, so followers such as the
    /// supervisor need not read the plan.
    fn event_of(&self, entry: &Cached, e: &Emission) -> EventEnvelope {
        let plan = entry.machine.plan();
        let mut event = e.event.clone();
        let sub = e.task.map(|i| &plan.subtasks[i as usize]);
        if let Some(sub) = sub {
            // An anycast task's agent is the member that claimed it, as its result says
            // (none before a claim); any other task's is its own or the default.
            if sub.anycast_role(entry.machine.state().anycast).is_none() {
                event.agent = sub.agent.clone().or_else(|| self.default_agent.clone());
            }
            event.role = sub.role.clone();
        }
        EventEnvelope {
            protocol: PROTOCOL_VERSION,
            id: e.id.clone(),
            run_id: entry.machine.state().run_id,
            task_id: sub.map(|s| s.id.clone()),
            attempt: e.attempt,
            ts: Timestamp::from_unix_ms(e.at_ms),
            source: "coordinator".into(),
            event: Event::Workflow(event),
        }
    }
}

/// An acknowledgement awaited with the rest of its step's: the subject and size name a
/// failed publish.
type Pending = (
    String,
    usize,
    async_nats::jetstream::context::PublishAckFuture,
);

/// Publishes `out` on `subject` and keeps its acknowledgement in `pending`, to be awaited
/// with the rest of the step's.
async fn send(
    js: &async_nats::jetstream::Context,
    subject: String,
    out: wire::Outgoing,
    max: usize,
    pending: &mut Vec<Pending>,
) -> Result<(), StepError> {
    let size = out.payload.len();
    let ack = js
        .publish_with_headers(subject.clone(), out.headers, out.payload)
        .await
        .map_err(|e| flotilla_bus::classify_publish_error(&subject, size, max, e))?;
    pending.push((subject, size, ack));
    Ok(())
}

/// Headers that turn a run-log message into a durable timer (JetStream message scheduler).
fn schedule_headers(headers: &mut HeaderMap, due_ms: i64, target: &str) {
    let at = Timestamp::from_unix_ms(due_ms).to_rfc3339();
    headers.insert("Nats-Schedule", format!("@at {at}").as_str());
    headers.insert("Nats-Schedule-Target", target);
}

/// Encodes a step's events as few messages as fit `budget` bytes each (one, normally): the
/// whole step is encoded once, and only a step too large for one message is split by the
/// sizes of its events (measuring every event of every step would cost more than sending it).
fn encode_event_batches(
    run: RunId,
    events: Vec<EventEnvelope>,
    budget: usize,
) -> Result<Vec<wire::Outgoing>, flotilla_bus::PublishError> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let whole = EventBatch::new(run, events);
    let out = wire::encode(&whole, Codec::Json, Some(&whole.msg_id()))?;
    if out.payload.len() <= budget || whole.events.len() == 1 {
        return Ok(vec![out]);
    }
    split_batches(run, whole.events, budget)
        .iter()
        .map(|batch| wire::encode(batch, Codec::Json, Some(&batch.msg_id())))
        .collect()
}

/// Groups a step's events into as few messages as fit `budget` bytes each.
fn split_batches(run: RunId, events: Vec<EventEnvelope>, budget: usize) -> Vec<EventBatch> {
    if events.is_empty() {
        return Vec::new();
    }
    let mut batches = Vec::new();
    let mut current = Vec::new();
    let mut size = 0;
    for e in events {
        let e_size = serde_json::to_vec(&e).map(|v| v.len()).unwrap_or(0);
        if !current.is_empty() && size + e_size > budget {
            batches.push(EventBatch::new(run, std::mem::take(&mut current)));
            size = 0;
        }
        size += e_size;
        current.push(e);
    }
    batches.push(EventBatch::new(run, current));
    batches
}
