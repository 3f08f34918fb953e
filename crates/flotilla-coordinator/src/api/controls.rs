//! `run.pause`, `run.resume`, `run.takeover`, `run.complete`, `run.edit`: a person's hand on a running
//! run. Each appends one input to the run's log — the run machine decides what it does — and
//! a pause, resume or takeover is also appended for the run's descendants (found through
//! their links on the run's events, breadth first, at most [`MAX_CONTROLLED_RUNS`]).
//!
//! A pause, resume or takeover is answered with the machine's decision, not with a guess from
//! the run's record (which may be a step behind its log: a second pause sent right after the
//! first would find the run still running). The entry names an inbox as its `reply_to`; the
//! coordinator that applies it publishes there whether it changed the run and, if not, why
//! ([`ControlVerdict`]). Only that changes the answer's `applied`; a notice goes out only for
//! a control that applied. A verdict that does not come within [`VERDICT_WAIT`] (no
//! coordinator applies the run's log right now) is answered `pending`: the control is on the
//! log and applies when one does.

use async_nats::service::Request;
use flotilla_model::ErrorCode;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::control::{
    CompleteTaskReply, CompleteTaskRequest, Completed, ContextResult, ControlRunReply,
    ControlVerdict, DEFAULT_PAUSE_TIMEOUT, DEFAULT_TAKEOVER_TIMEOUT, EditPlanReply,
    EditPlanRequest, MAX_CONTEXT_RESULT, MAX_CONTEXT_TASKS, MAX_CONTROL_TEXT, MAX_CONTROLLED_RUNS,
    PauseRunRequest, PendingTask, PlanEdited, ResumeRunRequest, SuggestedAction, TakeoverContext,
    TakeoverRunRequest, changed_tasks, completed_msg_id, edit_problems, hold_timeout,
};
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::notify::{ControlNotice, NoticeKind, Notification, control_notice_id};
use flotilla_model::run::{FailedTask, RunStatus, TaskStatus};
use flotilla_model::runlog::{Control, ControlAction, RunInput, RunLogEntry};
use flotilla_model::task::{TaskError, TaskErrorKind};
use flotilla_model::time::Timestamp;
use futures::StreamExt;
use tracing::{info, warn};

use super::{Api, parse, respond_error, respond_json, run_not_found};

/// How long a pause, resume or takeover waits for the run machine's verdict before it is
/// answered `pending` (recorded, not applied yet). A coordinator applies an entry within
/// milliseconds; this covers a busy one, not a missing one.
pub(crate) const VERDICT_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// What became of a control appended to a run's log.
struct Decided {
    /// The entry's run-log sequence.
    seq: u64,
    /// It changed the run (or, `pending`, it is recorded).
    applied: bool,
    /// The run's status before it applied.
    status: RunStatus,
    /// Why it changed nothing, or that it is not applied yet.
    detail: Option<String>,
    /// No verdict came in time.
    pending: bool,
}

/// What a control asks, after its request was read.
struct Asked {
    run: RunId,
    action: ControlAction,
    by: Option<String>,
    reason: Option<String>,
    timeout_ms: Option<u64>,
    children: bool,
    /// A pause or resume of this task alone.
    task: Option<TaskId>,
}

/// The control descendants get: a takeover pauses them (the person holds the root).
fn for_children(action: ControlAction) -> ControlAction {
    match action {
        ControlAction::Takeover => ControlAction::Pause,
        a => a,
    }
}

/// Whether `action` would change a run in `status`.
fn changes(action: ControlAction, status: RunStatus) -> bool {
    match action {
        ControlAction::Pause => status == RunStatus::Running,
        ControlAction::Takeover => matches!(status, RunStatus::Running | RunStatus::Paused),
        ControlAction::Resume => status.is_held(),
        ControlAction::Cancel => !status.is_terminal(),
    }
}

/// Refuses text over [`MAX_CONTROL_TEXT`] (`400 invalid_request` naming the field).
async fn text_too_long(req: &Request, fields: &[(&str, &Option<String>)]) -> bool {
    for (name, value) in fields {
        if value.as_ref().is_some_and(|v| v.len() > MAX_CONTROL_TEXT) {
            respond_error(
                req,
                400,
                ErrorCode::InvalidRequest,
                format!("{name} is longer than {MAX_CONTROL_TEXT} bytes"),
            )
            .await;
            return true;
        }
    }
    false
}

impl Api {
    pub(super) async fn run_pause(&self, req: Request) {
        let Some(mut r) = parse::<PauseRunRequest>(&req).await else {
            return;
        };
        // A person calling through a shared import is who the NATS server says.
        if let Some(who) = flotilla_bus::service::requester(&req) {
            r.by = Some(who);
        }
        if text_too_long(&req, &[("reason", &r.reason), ("by", &r.by)]).await {
            return;
        }
        if let Err(m) = hold_timeout(r.timeout_ms, DEFAULT_PAUSE_TIMEOUT) {
            return respond_error(&req, 400, ErrorCode::InvalidTimeout, m).await;
        }
        let asked = Asked {
            run: r.run_id,
            action: ControlAction::Pause,
            by: r.by,
            reason: r.reason,
            timeout_ms: r.timeout_ms,
            children: r.children,
            task: r.task_id,
        };
        self.control(&req, asked).await;
    }

    pub(super) async fn run_resume(&self, req: Request) {
        let Some(mut r) = parse::<ResumeRunRequest>(&req).await else {
            return;
        };
        // A person calling through a shared import is who the NATS server says.
        if let Some(who) = flotilla_bus::service::requester(&req) {
            r.by = Some(who);
        }
        if text_too_long(&req, &[("reason", &r.reason), ("by", &r.by)]).await {
            return;
        }
        let asked = Asked {
            run: r.run_id,
            action: ControlAction::Resume,
            by: r.by,
            reason: r.reason,
            timeout_ms: None,
            children: r.children,
            task: r.task_id,
        };
        self.control(&req, asked).await;
    }

    pub(super) async fn run_takeover(&self, req: Request) {
        let Some(mut r) = parse::<TakeoverRunRequest>(&req).await else {
            return;
        };
        // A person calling through a shared import is who the NATS server says.
        if let Some(who) = flotilla_bus::service::requester(&req) {
            r.by = Some(who);
        }
        if text_too_long(&req, &[("reason", &r.reason), ("by", &r.by)]).await {
            return;
        }
        if let Err(m) = hold_timeout(r.timeout_ms, DEFAULT_TAKEOVER_TIMEOUT) {
            return respond_error(&req, 400, ErrorCode::InvalidTimeout, m).await;
        }
        let asked = Asked {
            run: r.run_id,
            action: ControlAction::Takeover,
            by: r.by,
            reason: r.reason,
            timeout_ms: r.timeout_ms,
            children: r.children,
            task: None,
        };
        self.control(&req, asked).await;
    }

    /// Appends the control to the run's log (unless the run has ended) and to its
    /// descendants' logs, and answers with what the run machine made of it.
    async fn control(&self, req: &Request, asked: Asked) {
        let run = asked.run;
        let Some(state) = self.control_state(req, run).await else {
            return;
        };
        if asked.task.is_some() {
            return self.task_control(req, asked, state).await;
        }
        let status = state.status;
        // An ended run changes no more; anything else is the machine's to decide, in log
        // order (a run whose start is not recorded yet decides once it is).
        let decided = if status.is_terminal() {
            None
        } else {
            match self.decide(run, &asked, status).await {
                Ok(d) => Some(d),
                Err(e) => return respond_error(req, 503, ErrorCode::Unavailable, e).await,
            }
        };
        let mut children = Vec::new();
        if asked.children && !status.is_terminal() {
            match self.descendants(run).await {
                Ok(runs) => {
                    let action = for_children(asked.action);
                    for (child, child_status) in runs {
                        // A child that ended or is already so changes nothing: skip it (one
                        // whose start is not recorded yet gets it: its machine decides).
                        if child_status != RunStatus::Pending && !changes(action, child_status) {
                            continue;
                        }
                        match self.append_control(child, &asked, action, None).await {
                            Ok(_) => children.push(child),
                            Err(e) => {
                                warn!(%run, %child, error = %e, "Could not pass a control to a child run")
                            }
                        }
                    }
                }
                Err(e) => warn!(%run, error = %e, "Could not read the run's children"),
            }
        }
        let applied = decided.as_ref().is_some_and(|d| d.applied);
        info!(%run, action = asked.action.as_str(), applied, pending = decided.as_ref().is_some_and(|d| d.pending), children = children.len(), by = asked.by.as_deref().unwrap_or("-"), "Run control requested");
        if let Some(d) = decided.as_ref().filter(|d| d.applied) {
            self.notify_control(&asked, d.seq, d.status, &children)
                .await;
        }
        // A takeover answers where the run stands now: read again once the control is in
        // the record (a run whose start was not recorded yet is awaited a few seconds).
        let context = if asked.action == ControlAction::Takeover && !status.is_terminal() {
            let recorded = if applied || status == RunStatus::Pending {
                self.recorded_state(run).await
            } else {
                Some(state)
            };
            match recorded {
                Some(state) => match self.takeover_context(run, &state).await {
                    Ok(c) => Some(Box::new(c)),
                    Err(e) => return respond_error(req, 503, ErrorCode::Unavailable, e).await,
                },
                None => None,
            }
        } else {
            None
        };
        let (status, detail, pending) = match decided {
            Some(d) => (d.status, d.detail, d.pending),
            None => (
                status,
                Some(flotilla_machine::Unchanged::Ended(status).to_string()),
                false,
            ),
        };
        let reply = ControlRunReply {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            applied,
            status,
            children,
            context,
            task_id: None,
            detail,
            pending,
        };
        respond_json(req, self.max_payload(), &reply).await;
    }

    /// Appends the control to `run`'s log with an inbox of this request as its `reply_to`,
    /// and waits (at most [`VERDICT_WAIT`]) for the run machine's verdict; without one, the
    /// control is `pending` (recorded, applied when a coordinator gets to it). `status`: the
    /// run's status as read, for a control still pending.
    async fn decide(
        &self,
        run: RunId,
        asked: &Asked,
        status: RunStatus,
    ) -> Result<Decided, String> {
        let nats = self.store.bus().client();
        let inbox = nats.new_inbox();
        // Subscribed before the append: the verdict cannot come before anyone listens.
        let mut verdicts = nats
            .subscribe(inbox.clone())
            .await
            .map_err(|e| e.to_string())?;
        let seq = self
            .append_control(run, asked, asked.action, Some(inbox))
            .await?;
        let verdict = tokio::time::timeout(VERDICT_WAIT, async {
            while let Some(m) = verdicts.next().await {
                match serde_json::from_slice::<ControlVerdict>(&m.payload) {
                    Ok(v) if v.run_id == run && v.seq == seq => return Some(v),
                    _ => {}
                }
            }
            None
        })
        .await
        .ok()
        .flatten();
        Ok(match verdict {
            Some(v) => Decided {
                seq,
                applied: v.applied,
                status: v.status,
                detail: v.detail,
                pending: false,
            },
            None => {
                warn!(%run, seq, action = asked.action.as_str(), "No coordinator applied a control in time; answering pending");
                Decided {
                    seq,
                    applied: true,
                    status,
                    detail: Some(format!(
                        "recorded on the run log (sequence {seq}), but no coordinator applied it within {} s: it applies when one does, and the run's events say what it did",
                        VERDICT_WAIT.as_secs()
                    )),
                    pending: true,
                }
            }
        })
    }

    /// A pause or resume of one task (a member) of a running run: checked against the run's
    /// plan, appended to its log unless the task or the run has ended, and answered with
    /// what the run machine made of it (a task already so: `applied: false`, saying why). No
    /// descendants, no notice: the rest of the run goes on and nobody is asked for anything.
    async fn task_control(&self, req: &Request, asked: Asked, state: flotilla_machine::RunState) {
        let run = asked.run;
        let Some(task) = asked.task.clone() else {
            return;
        };
        let status = state.status;
        let plan = if status == RunStatus::Pending {
            // Its start is not recorded yet (a coordinator records it with the run's next
            // input): the task is checked against the submission's plan, and the machine
            // decides once the start is recorded (the run log keeps the order).
            match self.store.first_message(run).await {
                Ok(Some(first)) => match first.content {
                    flotilla_runs::first::FirstMessage::Submission { request, .. } => request.plan,
                    flotilla_runs::first::FirstMessage::Entry(RunLogEntry {
                        input: RunInput::Submitted(s),
                        ..
                    }) => Some(s.plan),
                    _ => None,
                },
                Ok(None) => return run_not_found(req, run).await,
                Err(e) => {
                    return respond_error(req, 503, ErrorCode::Unavailable, e.to_string()).await;
                }
            }
        } else {
            match self.store.plan_for(run, &state).await {
                Ok(p) => p,
                Err(e) => {
                    return respond_error(req, 503, ErrorCode::Unavailable, e.to_string()).await;
                }
            }
        };
        let Some(plan) = plan else {
            return respond_error(
                req,
                409,
                ErrorCode::NotStarted,
                format!(
                    "run {run} has no plan yet (a query being planned, or a submission not yet read), so its tasks are not known: pause or resume task {task} once it is planned"
                ),
            )
            .await;
        };
        let Some(i) = plan.subtasks.iter().position(|s| s.id == task) else {
            return respond_error(
                req,
                404,
                ErrorCode::TaskNotFound,
                format!("run {run} has no task {task}"),
            )
            .await;
        };
        let t = state.tasks.get(i);
        if asked.action == ControlAction::Resume
            && t.is_some_and(|t| {
                t.paused()
                    && !flotilla_machine::policy::control::may_resume_task(t, asked.by.as_deref())
            })
        {
            return respond_error(
                req,
                409,
                ErrorCode::PausedByPerson,
                format!(
                    "task {task} of run {run} was paused by a person: only a person resumes it (or its deadline does)"
                ),
            )
            .await;
        }
        // An ended run or task changes no more; whether the task is already so is the
        // machine's to decide (the record read here may be a step behind the run log).
        let ended = if status.is_terminal() {
            Some(flotilla_machine::Unchanged::Ended(status))
        } else {
            t.filter(|t| t.status.is_terminal())
                .map(|t| flotilla_machine::Unchanged::TaskEnded(task.clone(), t.status))
        };
        let decided = match ended {
            Some(why) => Decided {
                seq: 0,
                applied: false,
                status,
                detail: Some(why.to_string()),
                pending: false,
            },
            None => match self.decide(run, &asked, status).await {
                Ok(d) => d,
                Err(e) => return respond_error(req, 503, ErrorCode::Unavailable, e).await,
            },
        };
        info!(%run, %task, action = asked.action.as_str(), applied = decided.applied, pending = decided.pending, by = asked.by.as_deref().unwrap_or("-"), "Task control requested");
        let reply = ControlRunReply {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            applied: decided.applied,
            status: decided.status,
            children: Vec::new(),
            context: None,
            task_id: Some(task),
            detail: decided.detail,
            pending: decided.pending,
        };
        respond_json(req, self.max_payload(), &reply).await;
    }

    /// The run's state (its record, or its start rebuilt while not recorded yet; `pending`
    /// when its submission's start is not recorded yet — a coordinator records a start with
    /// the run's next input), or an answer: `404` for no such run.
    async fn control_state(&self, req: &Request, run: RunId) -> Option<flotilla_machine::RunState> {
        match self.store.state(run).await {
            Ok(Some(s)) => Some(s),
            Ok(None) => {
                run_not_found(req, run).await;
                None
            }
            Err(e) => {
                respond_error(req, 503, ErrorCode::Unavailable, e.to_string()).await;
                None
            }
        }
    }

    /// The run's state once its start is recorded (the control just appended records it),
    /// waiting at most a few seconds.
    async fn recorded_state(&self, run: RunId) -> Option<flotilla_machine::RunState> {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            if let Ok(Some(stored)) = self.store.load(run).await {
                return Some(stored.snapshot.state);
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// A pause or takeover is a person's hand on the run: others (webhooks, an operator's
    /// inbox) hear of it on `<prefix>.notify.<pause|takeover>.<run>`. A resume is not a
    /// request to anyone and has no notice.
    async fn notify_control(&self, asked: &Asked, seq: u64, status: RunStatus, children: &[RunId]) {
        let (kind, default) = match asked.action {
            ControlAction::Pause => (NoticeKind::Pause, DEFAULT_PAUSE_TIMEOUT),
            ControlAction::Takeover => (NoticeKind::Takeover, DEFAULT_TAKEOVER_TIMEOUT),
            ControlAction::Cancel | ControlAction::Resume => return,
        };
        let hold = hold_timeout(asked.timeout_ms, default).unwrap_or(default);
        let now = Timestamp::now();
        let until = Timestamp::from_unix_ms(
            now.unix_ms()
                .saturating_add(i64::try_from(hold.as_millis()).unwrap_or(i64::MAX)),
        );
        let notice = Notification {
            protocol: PROTOCOL_VERSION,
            id: control_notice_id(kind, asked.run, seq),
            kind,
            run_id: Some(asked.run),
            at: Some(now),
            notify_only: false,
            approval: None,
            control: Some(ControlNotice {
                action: asked.action,
                by: asked.by.clone(),
                reason: asked.reason.clone().filter(|r| !r.is_empty()),
                until,
                status,
                children: children.to_vec(),
            }),
        };
        crate::notices::publish(self.store.bus(), &notice).await;
    }

    /// Appends the control to `run`'s log (its verdict to `reply_to`, when given); the
    /// entry's sequence.
    async fn append_control(
        &self,
        run: RunId,
        asked: &Asked,
        action: ControlAction,
        reply_to: Option<String>,
    ) -> Result<u64, String> {
        let bus = self.store.bus();
        let entry = RunLogEntry {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            input: RunInput::Control(Control {
                action,
                reason: asked.reason.clone().filter(|r| !r.is_empty()),
                by: asked.by.clone(),
                timeout_ms: asked.timeout_ms,
                rollback: false,
                task_id: asked.task.clone(),
                reply_to,
            }),
        };
        bus.publish(bus.names().runlog(run), &entry, None)
            .await
            .map(|ack| ack.sequence)
            .map_err(|e| e.to_string())
    }

    /// The run's descendants with their status, breadth first (the run itself left out).
    async fn descendants(&self, run: RunId) -> Result<Vec<(RunId, RunStatus)>, String> {
        let tree = flotilla_runs::tree::run_tree(&self.store, run, MAX_CONTROLLED_RUNS)
            .await
            .map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        let Some(tree) = tree else {
            return Ok(out);
        };
        let mut level: Vec<&flotilla_model::tree::RunTreeNode> =
            tree.root.children.iter().collect();
        while !level.is_empty() {
            let mut next = Vec::new();
            for node in level {
                out.push((node.run_id, node.status));
                next.extend(node.children.iter());
            }
            level = next;
        }
        Ok(out)
    }

    /// Where the run stands, for the person taking it over.
    async fn takeover_context(
        &self,
        run: RunId,
        state: &flotilla_machine::RunState,
    ) -> Result<TakeoverContext, String> {
        let plan = self
            .store
            .plan_for(run, state)
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("run {run} has no plan"))?;
        let index: std::collections::HashMap<&str, usize> = plan
            .subtasks
            .iter()
            .enumerate()
            .map(|(i, s)| (s.id.as_str(), i))
            .collect();
        let succeeded =
            |i: usize| state.tasks.get(i).map(|t| t.status) == Some(TaskStatus::Succeeded);
        let mut completed = Vec::new();
        let mut pending = Vec::new();
        let mut failed = Vec::new();
        let mut omitted = 0u32;
        let mut step = 0u32;
        let mut failure_reason = None;
        for (sub, t) in plan.subtasks.iter().zip(&state.tasks) {
            if t.status.is_terminal() {
                step += 1;
            }
            match t.status {
                TaskStatus::Succeeded if completed.len() < MAX_CONTEXT_TASKS => {
                    let r = self
                        .store
                        .result_at(t.result_seq)
                        .await
                        .map_err(|e| e.to_string())?;
                    let mut result = r.result.response;
                    let truncated = result.len() > MAX_CONTEXT_RESULT;
                    if truncated {
                        let mut end = MAX_CONTEXT_RESULT;
                        while !result.is_char_boundary(end) {
                            end -= 1;
                        }
                        result.truncate(end);
                    }
                    completed.push(ContextResult {
                        task_id: sub.id.clone(),
                        by: r.worker,
                        result,
                        truncated,
                    });
                }
                TaskStatus::Failed => {
                    let error = t.error.clone().unwrap_or(TaskError {
                        kind: TaskErrorKind::Internal,
                        message: "failed".into(),
                    });
                    failure_reason = Some(format!("task {} failed: {error}", sub.id));
                    if failed.len() < MAX_CONTEXT_TASKS {
                        failed.push(FailedTask {
                            task_id: sub.id.clone(),
                            attempts: t.attempt,
                            error,
                        });
                    } else {
                        omitted += 1;
                    }
                }
                s if !s.is_terminal() && pending.len() < MAX_CONTEXT_TASKS => {
                    let waiting_on: Vec<_> = sub
                        .dependencies
                        .iter()
                        .filter(|d| !index.get(d.as_str()).is_some_and(|&j| succeeded(j)))
                        .cloned()
                        .collect();
                    pending.push(PendingTask {
                        task_id: sub.id.clone(),
                        status: s,
                        ready: s == TaskStatus::Waiting && waiting_on.is_empty(),
                        waiting_on,
                    });
                }
                TaskStatus::Succeeded => omitted += 1,
                s if !s.is_terminal() => omitted += 1,
                _ => {}
            }
        }
        let suggested_next = suggest(&pending, run);
        Ok(TakeoverContext {
            run_id: run,
            status: state.status,
            tasks_total: plan.subtasks.len() as u32,
            step,
            completed,
            pending,
            failed,
            suggested_next,
            failure_reason: failure_reason.or_else(|| state.stop_reason.clone()),
            omitted,
        })
    }

    pub(super) async fn run_complete(&self, req: Request) {
        let Some(mut r) = parse::<CompleteTaskRequest>(&req).await else {
            return;
        };
        // A person calling through a shared import is who the NATS server says.
        if let Some(who) = flotilla_bus::service::requester(&req) {
            r.by = who;
        }
        let problems = r.problems();
        if !problems.is_empty() {
            return super::respond_problems(&req, ErrorCode::InvalidRequest, problems).await;
        }
        let run = r.run_id;
        let Some(state) = self.control_state(&req, run).await else {
            return;
        };
        if state.status == RunStatus::Pending {
            return respond_error(
                &req,
                409,
                ErrorCode::NotStarted,
                format!(
                    "run {run}'s start is not recorded yet, so its tasks' state is not known: take the run over (or pause it) first, then complete the task"
                ),
            )
            .await;
        }
        if state.status.is_terminal() {
            return respond_error(
                &req,
                409,
                ErrorCode::RunEnded,
                format!("run {run} has ended ({})", state.status),
            )
            .await;
        }
        let plan = match self.store.plan_for(run, &state).await {
            Ok(Some(p)) => p,
            Ok(None) => return run_not_found(&req, run).await,
            Err(e) => return respond_error(&req, 503, ErrorCode::Unavailable, e.to_string()).await,
        };
        let Some(i) = plan.subtasks.iter().position(|s| s.id == r.task_id) else {
            return respond_error(
                &req,
                404,
                ErrorCode::TaskNotFound,
                format!("run {run} has no task {}", r.task_id),
            )
            .await;
        };
        let status = state.tasks.get(i).map_or(TaskStatus::Waiting, |t| t.status);
        if !matches!(
            status,
            TaskStatus::Waiting | TaskStatus::Retrying | TaskStatus::AwaitingApproval
        ) {
            let why = if status == TaskStatus::Dispatched {
                "it is running on a worker: wait for its result, or cancel the run"
            } else {
                "it has ended"
            };
            return respond_error(
                &req,
                409,
                ErrorCode::TaskNotPending,
                format!(
                    "task {} of run {run} is {}: {why}",
                    r.task_id,
                    status.as_str()
                ),
            )
            .await;
        }
        let bus = self.store.bus();
        let msg_id = completed_msg_id(run, &r.task_id);
        let entry = RunLogEntry {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            input: RunInput::Completed(Box::new(Completed {
                task_id: r.task_id.clone(),
                result: r.result,
                by: r.by,
                comment: r.comment.filter(|c| !c.is_empty()),
            })),
        };
        if let Err(e) = bus
            .publish(bus.names().runlog(run), &entry, Some(&msg_id))
            .await
        {
            return respond_error(&req, 503, ErrorCode::Unavailable, e.to_string()).await;
        }
        info!(%run, task = %r.task_id, "Task completion requested");
        let reply = CompleteTaskReply {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            task_id: r.task_id,
            completing: true,
        };
        respond_json(&req, self.max_payload(), &reply).await;
    }

    /// `run.edit`: checks an edit of a taken-over run's plan (what may change, and the plan
    /// as a submission) and appends it to the run log; the run machine applies it.
    pub(super) async fn run_edit(&self, req: Request) {
        let Some(mut r) = parse::<EditPlanRequest>(&req).await else {
            return;
        };
        // A person calling through a shared import is who the NATS server says.
        if let Some(who) = flotilla_bus::service::requester(&req) {
            r.by = who;
        }
        if r.by.trim().is_empty() {
            return respond_error(
                &req,
                400,
                ErrorCode::InvalidRequest,
                "by is required: who edits".into(),
            )
            .await;
        }
        if text_too_long(&req, &[("reason", &r.reason), ("by", &Some(r.by.clone()))]).await {
            return;
        }
        let run = r.run_id;
        let Some(state) = self.control_state(&req, run).await else {
            return;
        };
        if state.status != RunStatus::HumanControl {
            return respond_error(
                &req,
                409,
                ErrorCode::NotTakenOver,
                format!(
                    "run {run} is {}: take it over first (flotilla runs takeover), then edit its plan",
                    state.status
                ),
            )
            .await;
        }
        let current = match self.store.plan_for(run, &state).await {
            Ok(Some(p)) => p,
            Ok(None) => return run_not_found(&req, run).await,
            Err(e) => return respond_error(&req, 503, ErrorCode::Unavailable, e.to_string()).await,
        };
        let ctx = self.ctx.for_payload(self.max_payload());
        let edited = match flotilla_model::validate::prepare_plan(&r.plan, &ctx) {
            Ok((plan, _)) => plan,
            Err(report) => {
                return super::respond_problems(&req, ErrorCode::InvalidPlan, report.errors).await;
            }
        };
        let started = |i: usize| state.tasks.get(i).is_some_and(|t| t.started());
        let problems = edit_problems(&current, &edited, started);
        if !problems.is_empty() {
            return super::respond_problems(&req, ErrorCode::InvalidEdit, problems).await;
        }
        let reply = EditPlanReply {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            tasks_total: edited.subtasks.len() as u32,
            added: (edited.subtasks.len() - current.subtasks.len()) as u32,
            changed: changed_tasks(&current, &edited),
        };
        let by = r.by.trim().to_owned();
        // The same edit sent again (a client's retry) is stored once.
        let digest = flotilla_model::approval::digest_of(
            &by,
            &serde_json::to_value(&edited).unwrap_or_default(),
        );
        let entry = RunLogEntry {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            input: RunInput::PlanEdited(Box::new(PlanEdited {
                plan: edited,
                by,
                reason: r.reason.filter(|x| !x.is_empty()),
            })),
        };
        let bus = self.store.bus();
        if let Err(e) = bus
            .publish(
                bus.names().runlog(run),
                &entry,
                Some(&format!("edited.{run}.{digest}")),
            )
            .await
        {
            return respond_error(&req, 503, ErrorCode::Unavailable, e.to_string()).await;
        }
        info!(%run, added = reply.added, changed = reply.changed.len(), "Plan edit requested");
        respond_json(&req, self.max_payload(), &reply).await;
    }
}

/// The next step for the person: a ready task first (do it, or resume), then one that waits
/// for a person, then one running; otherwise hand the run back.
fn suggest(pending: &[PendingTask], run: RunId) -> SuggestedAction {
    if let Some(t) = pending.iter().find(|t| t.ready) {
        return SuggestedAction {
            action: "complete".into(),
            task_id: Some(t.task_id.clone()),
            detail: format!(
                "task {id} is ready: complete it yourself (flotilla runs complete {run} {id} --result …), or resume the run and its agent runs it",
                id = t.task_id
            ),
        };
    }
    if let Some(t) = pending
        .iter()
        .find(|t| t.status == TaskStatus::AwaitingApproval)
    {
        return SuggestedAction {
            action: "answer_approval".into(),
            task_id: Some(t.task_id.clone()),
            detail: format!(
                "task {} waits for an approval: answer it (flotilla approvals list --run {run}), or complete the task yourself",
                t.task_id
            ),
        };
    }
    if let Some(t) = pending.iter().find(|t| t.status == TaskStatus::Dispatched) {
        return SuggestedAction {
            action: "wait".into(),
            task_id: Some(t.task_id.clone()),
            detail: format!(
                "task {} is running on a worker: wait for its result",
                t.task_id
            ),
        };
    }
    SuggestedAction {
        action: "resume".into(),
        task_id: None,
        detail:
            "nothing is ready to do by hand: resume the run (flotilla runs resume) or cancel it"
                .into(),
    }
}
