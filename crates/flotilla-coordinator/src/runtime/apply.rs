//! Applying a step: loads the run (cache, KV, or its first message), performs a stored
//! outbox again when it may not have been, feeds the step's inputs to the pure
//! [`RunMachine`], writes the new state and outbox with compare-and-set, and performs the
//! actions. The machine decides; this only applies and performs.

use std::collections::HashMap;
use std::sync::Arc;

use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::control::ControlVerdict;
use flotilla_model::ids::RunId;
use flotilla_model::run::RunStatus;
use flotilla_model::runlog::{ControlAction, RunInput, RunLogEntry};
use flotilla_model::submit::SubmitRequest;
use flotilla_telemetry::{spans, trace_context};
use tracing::{debug, info, warn};

use crate::error::StoreErrorKind;
use crate::machine::{Action, Input, RunMachine};
use crate::store::{SnapshotRef, UnreadableSubmission};

use super::perform::Replies;
use super::{Cached, Decoded, Inbound, Runtime, StepError, Stepped, Unflushed};

impl Runtime {
    /// Applies `inputs` to the run and performs the resulting actions. With `abort`, the run
    /// is ended with that reason instead (after a terminal failure). `from_leader` reads the
    /// run from the bucket's leader rather than any replica: inputs that change nothing are
    /// acknowledged only against that copy ([`StepError::Stale`] otherwise).
    pub(super) async fn step(
        &self,
        run: RunId,
        cached: Option<Cached>,
        inputs: &[Decoded],
        abort: Option<&str>,
        from_leader: bool,
    ) -> Result<Stepped, StepError> {
        let now_ms = inputs.iter().map(|d| d.ts_ms).max().unwrap_or_default();
        // Submissions on a subject that names no run: refused under the derived id.
        if inputs
            .iter()
            .any(|d| matches!(d.inbound, Inbound::Misaddressed(_)))
        {
            for d in inputs {
                if let Inbound::Misaddressed(rejected) = &d.inbound {
                    self.refuse_misaddressed(run, rejected, d.ts_ms).await?;
                }
            }
            return Ok(Stepped::Done(None));
        }
        let mut reperform = Vec::new();
        // Started below as a child of the run's trace (or, for a run admitted now without a
        // client trace, as its root).
        let span = spans::step(run, inputs.len());
        // Dispatches made ready by a result: (task, when the result was stored).
        let mut hops: Vec<(u32, i128)> = Vec::new();
        let mut admitted = false;
        // A run's first message, delivered for the first time, starts a run nobody has seen:
        // there is nothing to load (its record is written only after this step).
        let fresh_start = inputs.first().is_some_and(|d| {
            d.delivered == 1
                && match &d.inbound {
                    Inbound::Submission { first, .. } => *first,
                    Inbound::Entry(RunLogEntry {
                        input: RunInput::Submitted(_),
                        ..
                    }) => d.msg.subject.starts_with(self.submit_prefix.as_str()),
                    _ => false,
                }
        });
        let mut entry = match cached {
            Some(c) => Some(c),
            None if fresh_start => None,
            None => match Box::pin(async {
                if from_leader {
                    self.store.load_from_leader(run).await
                } else {
                    self.store.load(run).await
                }
            })
            .await?
            {
                None => match Box::pin(self.replay(run, inputs)).await? {
                    Some((entry, start)) => {
                        reperform = start;
                        Some(entry)
                    }
                    None => None,
                },
                Some(stored) => {
                    let state = stored.snapshot.state;
                    if state.tasks.is_empty() {
                        // Rejected, or ended before it could start: nothing more to apply.
                        for d in inputs {
                            if let Inbound::Submission { request, .. } = &d.inbound
                                && state.first_seq != d.seq
                            {
                                self.answer_duplicate(run, reply_to_of(request), state.status)
                                    .await;
                            }
                        }
                        return Ok(Stepped::Done(None));
                    }
                    let plan = match self.store.plan_for(run, &state).await {
                        Ok(Some(plan)) => plan,
                        Ok(None) => {
                            return Err(StepError::Failed(format!(
                                "run {run} has a snapshot but no submission in its run log"
                            )));
                        }
                        Err(e) if e.kind() == StoreErrorKind::Decode => {
                            return Err(StepError::Terminal(e.to_string()));
                        }
                        Err(e) => return Err(e.into()),
                    };
                    let mut loaded = Cached {
                        machine: RunMachine::restore(Arc::new(plan), state),
                        revision: stored.revision,
                        results: HashMap::new(),
                        last_used: 0,
                        touched: tokio::time::Instant::now(),
                        unflushed: None,
                        last_log_seq: None,
                    };
                    // The stored outbox may not have been performed: its writer may have died
                    // after the write (its inputs come back), or other inputs of the run may
                    // arrive first (a recent write). It is performed again now, as it was —
                    // the same messages under the same ids, which JetStream drops — and before
                    // anything new, so the next record's outbox holds only the next step's
                    // actions: a step's events are never carried into later steps' messages.
                    // The answers to waiting submitters go out again only when the inputs
                    // that decided the end come back (their coordinator may have died before
                    // answering): a late input of an ended run never repeats the answer.
                    let produced_by_these = inputs
                        .iter()
                        .any(|d| d.delivered > 1 && stored.snapshot.outbox_seqs.contains(&d.seq));
                    let recent = now_ms - stored.written_ms < self.duplicate_window_ms / 2;
                    if produced_by_these || recent {
                        let outbox: Vec<Action> = stored
                            .snapshot
                            .outbox
                            .into_iter()
                            .chain(stored.snapshot.projections)
                            .filter(|a| still_relevant(a, &loaded.machine))
                            .collect();
                        if !outbox.is_empty() {
                            let replies = if produced_by_these && !answered_by_worker(inputs) {
                                Replies::Send
                            } else {
                                Replies::Skip
                            };
                            Box::pin(self.perform(&mut loaded, &outbox, &span, replies)).await?;
                        }
                    }
                    Some(loaded)
                }
            },
        };
        let applied_before = entry.as_ref().map(|e| e.machine.state().applied);
        let mut started = false;
        let mut actions = Vec::new();
        // What the machine made of the controls whose askers wait: answered once the step
        // is committed.
        let mut verdicts: Vec<(String, ControlVerdict)> = Vec::new();
        for d in inputs {
            let input = match &d.inbound {
                Inbound::Entry(e) => &e.input,
                Inbound::Misaddressed(_) => continue,
                Inbound::Submission { request, first } => {
                    if let Some(e) = &entry {
                        if e.machine.state().first_seq != d.seq {
                            let status = e.machine.state().status;
                            self.answer_duplicate(run, reply_to_of(request), status)
                                .await;
                        }
                        continue;
                    }
                    if !first && !self.is_first(run, d.seq).await? {
                        // A second submission of the run whose first message is elsewhere.
                        self.answer_duplicate(run, reply_to_of(request), RunStatus::Pending)
                            .await;
                        continue;
                    }
                    let request = request.as_deref().map_err(|e| &**e);
                    let Some(submitted) = Box::pin(self.admit(run, request, d, &span)).await?
                    else {
                        return Ok(Stepped::Done(None));
                    };
                    admitted = true;
                    let mut submitted = submitted;
                    let plan = Arc::new(std::mem::replace(
                        &mut submitted.plan,
                        flotilla_model::Plan {
                            fork: None,
                            name: None,
                            query: None,
                            subtasks: Vec::new(),
                            config: Default::default(),
                        },
                    ));
                    let (mut machine, a) = RunMachine::start(run, &submitted, plan, d.ts_ms);
                    machine.set_first_seq(d.seq);
                    info!(%run, tasks = machine.plan().subtasks.len(), "Run started");
                    entry = Some(Cached {
                        machine,
                        revision: 0,
                        results: HashMap::new(),
                        last_used: 0,
                        touched: tokio::time::Instant::now(),
                        unflushed: None,
                        last_log_seq: Some(0),
                    });
                    started = true;
                    actions.extend(a);
                    continue;
                }
                Inbound::Unreadable(reason) => {
                    match entry.as_mut() {
                        Some(e) => {
                            actions.extend(e.machine.apply(Input::Abort { reason }, d.ts_ms))
                        }
                        None => {
                            Box::pin(self.record_unstartable(run, reason, d.ts_ms)).await?;
                            return Ok(Stepped::Done(None));
                        }
                    }
                    continue;
                }
            };
            match input {
                RunInput::Rejected(r) => match entry.as_mut() {
                    None => {
                        // The intake records its rejections; this covers an intake that
                        // stopped between the append and the record.
                        crate::intake::record_rejection(
                            &self.store,
                            &self.metrics,
                            run,
                            r,
                            d.ts_ms,
                            false,
                        )
                        .await?;
                        return Ok(Stepped::Done(None));
                    }
                    Some(e) => {
                        // A coordinator rejected the run's submission after another started
                        // it (their configurations differ): the run log says rejected, so
                        // the run stops.
                        let reason = flotilla_machine::rejected_reason(r);
                        warn!(%run, %reason, "A started run's submission was rejected; stopping it");
                        actions.extend(e.machine.apply(Input::Abort { reason: &reason }, d.ts_ms));
                    }
                },
                RunInput::Submitted(s) => {
                    if entry.is_none() {
                        let (mut machine, a) =
                            RunMachine::start(run, s, Arc::new(s.plan.clone()), d.ts_ms);
                        machine.set_first_seq(d.seq);
                        info!(%run, tasks = s.plan.subtasks.len(), "Run started");
                        entry = Some(Cached {
                            machine,
                            revision: 0,
                            results: HashMap::new(),
                            last_used: 0,
                            touched: tokio::time::Instant::now(),
                            unflushed: None,
                            last_log_seq: Some(0),
                        });
                        started = true;
                        actions.extend(a);
                    }
                }
                other => {
                    let Some(e) = entry.as_mut() else { continue };
                    if d.seq < e.machine.state().first_seq {
                        // Stored before the run's submission (a fork's copied workspace entry
                        // wakes nothing yet): the run log is replayed from the submission on,
                        // so the machine applies nothing older — met out of order (the start
                        // rebuilt from the first message, then this redelivered), it would
                        // number every later step differently from the log's replay.
                        continue;
                    }
                    let Some(input) = Input::from_log(other, d.seq) else {
                        continue;
                    };
                    // A person's pause, takeover or resume is answered with what it did, and
                    // why it changed nothing (the rule `apply` follows).
                    let control = match other {
                        RunInput::Control(c) if !matches!(c.action, ControlAction::Cancel) => {
                            let state = e.machine.state();
                            let unchanged = e
                                .machine
                                .check_control(c.action, c.task_id.as_ref(), c.by.as_deref())
                                .err();
                            Some((c, state.status, state.applied, unchanged))
                        }
                        _ => None,
                    };
                    // A person's answer to an approval is answered with whether it decided.
                    let answer = match other {
                        RunInput::ApprovalDecided(a) => a
                            .reply_to
                            .as_ref()
                            .map(|to| (to, e.machine.state().status, e.machine.state().applied)),
                        _ => None,
                    };
                    let a = e.machine.apply(input, d.ts_ms);
                    // What the machine made of the entry, for whoever waits on `to`.
                    let verdict = |to: &String, applied, status, detail| {
                        let v = ControlVerdict {
                            protocol: PROTOCOL_VERSION,
                            run_id: run,
                            seq: d.seq,
                            applied,
                            status,
                            detail,
                        };
                        (to.clone(), v)
                    };
                    if let Some((to, status, counted)) = answer {
                        let applied = e.machine.state().applied != counted;
                        let detail = (!applied).then(|| {
                            "the approval was decided before this answer, or the run no longer waits for it".to_owned()
                        });
                        verdicts.push(verdict(to, applied, status, detail));
                    }
                    if let Some((c, status, counted, unchanged)) = control {
                        let applied = e.machine.state().applied != counted;
                        if applied {
                            info!(%run, action = c.action.as_str(), task = c.task_id.as_ref().map_or("-", |t| t.as_str()), by = c.by.as_deref().unwrap_or("-"), status = %e.machine.state().status, "Run control applied");
                        }
                        if let Some(to) = &c.reply_to {
                            let detail = unchanged.filter(|_| !applied).map(|u| u.to_string());
                            verdicts.push(verdict(to, applied, status, detail));
                        }
                    }
                    applied_from_log(run, other, &a, e, d, &mut hops);
                    actions.extend(a);
                }
            }
        }
        let Some(mut entry) = entry else {
            if inputs
                .iter()
                .all(|d| matches!(d.inbound, Inbound::Submission { .. }))
            {
                return Ok(Stepped::Done(None));
            }
            if !from_leader {
                // Any replica answered "no record": the leader may know better.
                return Err(StepError::Stale);
            }
            warn!(%run, "Run-log input for a run that does not exist; dropping");
            return Ok(Stepped::Done(None));
        };
        if let Some(reason) = abort {
            actions.extend(entry.machine.apply(Input::Abort { reason }, now_ms));
        }
        trace_context::set_parent(&span, entry.machine.state().trace.as_ref());
        let unrecorded = entry.revision == 0;
        let changed =
            started || unrecorded || applied_before != Some(entry.machine.state().applied);
        if !changed && !from_leader {
            // A no-op is only trustworthy against the current state: another coordinator may
            // have moved the run on since it was cached, and a direct get may be answered by
            // a replica still catching up (a cluster node back from a crash) — a result then
            // looks stale to an old state. Without a write there is no compare-and-set to
            // catch that, so confirm against the leader's copy before acknowledging.
            return Err(StepError::Stale);
        }
        // The start alone changed the run: perform it now, record it later. Only when the
        // The run's log subject as far as applied here: a dispatch whose success ends the run
        // tells its worker what must still be the subject's last message when it stores its
        // result (and answers the submitters itself).
        if let Some(last) = entry.last_log_seq {
            let subject = self.bus.names().runlog(run);
            entry.last_log_seq = Some(
                inputs
                    .iter()
                    .filter(|d| d.msg.subject.as_str() == subject)
                    .map(|d| d.seq)
                    .fold(last, u64::max),
            );
        }
        // A worker that answered the submitters itself (its result says so): the end this
        // step performs does not answer them again.
        let replies = if answered_by_worker(inputs) {
            Replies::Skip
        } else {
            Replies::Send
        };
        // step holds nothing but the start's messages: they are acknowledged once the start
        // is recorded — by this coordinator or, found already recorded, by another — so an
        // input that changed nothing here (a result for a later task, seen against a start
        // rebuilt from a stale read) must go the way of every input, through the record.
        let only_start = started
            && inputs.iter().all(|d| match &d.inbound {
                Inbound::Submission { .. } => true,
                Inbound::Entry(e) => matches!(e.input, RunInput::Submitted(_)),
                _ => false,
            })
            && applied_before.is_none()
            && entry.machine.state().applied == 1
            && !entry.machine.state().status.is_terminal()
            // A fork's start also settles the results it keeps: recorded first, and its
            // events published before its first task, so they read in the order they
            // happened.
            && entry.machine.plan().fork.is_none();
        if only_start {
            let (events, now): (Vec<Action>, Vec<Action>) = actions
                .into_iter()
                .partition(|a| matches!(a, Action::Emit(_)));
            Box::pin(self.perform(&mut entry, &now, &span, Replies::Send)).await?;
            self.record(&entry, now.iter().chain(&events), admitted);
            self.record_hops(run, &entry, &hops);
            entry.unflushed = Some(Unflushed {
                events,
                msgs: Vec::new(),
            });
            return Ok(Stepped::Deferred(entry));
        }
        let mut to_perform: Vec<Action> =
            entry.unflushed.take().map(|u| u.events).unwrap_or_default();
        to_perform.extend(
            reperform
                .into_iter()
                .filter(|a| still_relevant(a, &entry.machine)),
        );
        let new_from = to_perform.len();
        to_perform.extend(actions);
        if to_perform.contains(&Action::Finish) {
            Box::pin(self.complete_outcome(&mut entry)).await?;
        }
        if changed {
            let seqs: Vec<u64> = inputs.iter().map(|d| d.seq).collect();
            let snapshot = SnapshotRef {
                state: entry.machine.state(),
                outbox: &to_perform,
                outbox_seqs: &seqs,
            };
            let written = if unrecorded {
                self.store.create(run, &snapshot).await
            } else {
                self.store.update(run, &snapshot, entry.revision).await
            };
            entry.revision = match written {
                Ok(revision) => revision,
                Err(e) if e.kind() == StoreErrorKind::TooLarge => {
                    // The outbox's events made the record too large. Keep the actions that
                    // matter for progress; those events are lost only if this coordinator
                    // dies before publishing them.
                    warn!(%run, error = %e, "Run record too large with its events; storing it without them");
                    let slim: Vec<Action> = to_perform
                        .iter()
                        .filter(|a| !matches!(a, Action::Emit(_)))
                        .cloned()
                        .collect();
                    let snapshot = SnapshotRef {
                        state: entry.machine.state(),
                        outbox: &slim,
                        outbox_seqs: &seqs,
                    };
                    if unrecorded {
                        self.store.create(run, &snapshot).await?
                    } else {
                        self.store.update(run, &snapshot, entry.revision).await?
                    }
                }
                Err(e) => return Err(e.into()),
            };
        }
        // Committed: what this step decided is counted once, however often it is performed.
        self.record(&entry, &to_perform[new_from..], admitted);
        Box::pin(self.perform(&mut entry, &to_perform, &span, replies)).await?;
        self.record_hops(run, &entry, &hops);
        self.answer_controls(&verdicts).await;
        if entry.machine.state().status.is_terminal() {
            return Ok(Stepped::Done(None));
        }
        Ok(Stepped::Done(Some(entry)))
    }
}

impl Runtime {
    /// Tells the askers waiting for controls of this step what the machine made of them
    /// (the API answering a person). Best effort: an asker that has gone needs no answer,
    /// and one that gets none answers `pending` (the run log holds the control either way).
    async fn answer_controls(&self, verdicts: &[(String, ControlVerdict)]) {
        for (to, verdict) in verdicts {
            if flotilla_model::token::check_subject(to).is_err() {
                continue;
            }
            let body = match serde_json::to_vec(verdict) {
                Ok(b) => b,
                Err(e) => {
                    warn!(error = %e, "Could not encode a control's verdict");
                    continue;
                }
            };
            if let Err(e) = self.bus.client().publish(to.clone(), body.into()).await {
                debug!(run = %verdict.run_id, error = %e, "Could not answer a control");
            }
        }
    }
}

/// Whether a stored outbox action still applies to the current state.
fn still_relevant(action: &Action, machine: &RunMachine) -> bool {
    let s = machine.state();
    match action {
        Action::Dispatch { task, attempt } => s.tasks.get(*task as usize).is_some_and(|t| {
            t.status == flotilla_model::run::TaskStatus::Dispatched && t.attempt == *attempt
        }),
        Action::ArmTimer { generation, .. } => s.timer.is_some_and(|t| t.generation == *generation),
        Action::Emit(_)
        | Action::Withdraw { .. }
        | Action::CancelAttempts
        | Action::Rollback { .. }
        | Action::Produce { .. }
        | Action::StoreOutput { .. } => true,
        Action::Finish => s.status.is_terminal(),
        // A hold written again after the run was resumed would stop its attempts for nothing.
        Action::HoldAttempts { held } => s.status.is_held() == *held,
        Action::HoldTask { task, held } => s
            .tasks
            .get(*task as usize)
            .is_some_and(|t| t.paused() == *held),
        Action::RequestApproval {
            task,
            attempt,
            notify_only,
            call,
            ..
        } => {
            *notify_only
                || s.tasks.get(*task as usize).is_some_and(|t| {
                    t.approval
                        .is_some_and(|p| p.attempt == *attempt && p.call == *call)
                })
        }
        Action::ExpireApproval {
            task,
            attempt,
            call,
            ..
        } => s.tasks.get(*task as usize).is_some_and(|t| {
            t.approval
                .is_some_and(|p| p.attempt == *attempt && p.call == *call)
        }),
        Action::WithdrawApproval { .. } | Action::ProjectApproval { .. } => true,
        Action::ReviewPlan { round } => s.planning.as_ref().is_some_and(|p| {
            p.round == *round && p.status == flotilla_model::run::PlanningStatus::Reviewing
        }),
    }
}

/// Whether one of `inputs` is a result whose worker answered the run's submitters itself
/// (`TaskResultInput::answered`).
fn answered_by_worker(inputs: &[Decoded]) -> bool {
    inputs.iter().any(|d| {
        matches!(&d.inbound, Inbound::Entry(e)
            if matches!(&e.input, RunInput::TaskResult(r) if r.answered))
    })
}

/// Where a durable submission's submitter waits for answers, as far as it can be read.
fn reply_to_of(request: &Result<Box<SubmitRequest>, Box<UnreadableSubmission>>) -> Option<&str> {
    match request {
        Ok(r) => r.reply_to.as_deref(),
        Err(u) => u.reply_to.as_deref(),
    }
}

/// What the runtime keeps and tells of a run-log input the machine applied (`acts`: what it
/// decided): a result's dispatches to time as hops and the result to cache, a new plan's
/// cleared result cache, and a log line for what changed the run.
fn applied_from_log(
    run: RunId,
    input: &RunInput,
    acts: &[Action],
    e: &mut Cached,
    d: &Decoded,
    hops: &mut Vec<(u32, i128)>,
) {
    let changed = !acts.is_empty();
    match input {
        RunInput::TaskResult(r) => {
            hops.extend(acts.iter().filter_map(|a| match a {
                Action::Dispatch { task, attempt: 1 } => Some((*task, d.published_ns)),
                _ => None,
            }));
            // Cached as the task's result only when it is (a result held for review is not,
            // yet; a person may replace it).
            if changed
                && r.result.success
                && let Some(i) = e.machine.graph().index_of(&r.task_id)
                && e.machine.state().tasks[i as usize].result_seq == d.seq
            {
                e.results.insert(i, r.result.clone());
            }
        }
        RunInput::Control(c) if matches!(c.action, ControlAction::Cancel) => {
            info!(%run, reason = c.reason.as_deref().unwrap_or_default(), by = c.by.as_deref().unwrap_or("-"), rollback = c.rollback, "Cancelling the run");
        }
        RunInput::Planned(p) if changed => {
            // Task indices now name the new plan's tasks.
            e.results.clear();
            info!(%run, round = p.round, decision = p.decision.as_str(), tasks = e.machine.plan().subtasks.len(), "Planner answer reviewed");
        }
        RunInput::Recruited(r) if changed => {
            info!(%run, recruit = %r.recruit_id, task = %r.subtask.id, by = %r.by, "Recruit applied");
        }
        RunInput::Retired(r) if changed => {
            info!(%run, member = %r.member, policy = r.policy.as_str(), by = %r.by, "Member retired");
        }
        RunInput::Assigned(a) if changed => {
            info!(%run, task = %a.task_id, by = %a.by, "Task assigned by the lead");
        }
        RunInput::Finished(f) if changed => {
            info!(%run, by = %f.by, "Run finished by its lead");
        }
        RunInput::ApprovalDecided(a) if changed => {
            info!(%run, approval = %a.approval_id, task = %a.task_id, decision = a.decision.as_str(), by = %a.by, "Approval applied");
        }
        RunInput::Suspended(su) if changed => match &su.call {
            Some(c) => {
                info!(%run, task = %su.task_id, attempt = su.attempt, tool = %c.tool, trigger = c.trigger.as_str(), "Attempt suspended: a tool call waits for a person")
            }
            None => {
                info!(%run, task = %su.task_id, attempt = su.attempt, "Attempt suspended: its run is held")
            }
        },
        RunInput::PlanEdited(edited) => {
            info!(%run, by = %edited.by, tasks = e.machine.graph().len(), "Plan edit applied or refused");
        }
        RunInput::Completed(c) if changed => {
            info!(%run, task = %c.task_id, by = %c.by, "Task completed by hand");
        }
        _ => {}
    }
}
