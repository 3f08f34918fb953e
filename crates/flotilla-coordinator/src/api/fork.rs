//! `run.fork`: a new run of an ended run's plan, from a task on ([`flotilla_model::fork`]).
//!
//! The handler reads the original (its state and the plan it followed), works out which
//! tasks keep their results — those that succeeded and are not downstream of the fork
//! point — and checks that each of those results can still be read. It then submits the
//! changed plan, with its `fork` naming the kept results, through the intake like any
//! submission: the fork is admitted, budgeted, gated by approvals and controlled as every run
//! is. The run machine starts it with the kept results as its tasks' (no dispatch) and runs
//! the rest. Nothing of the original is written.

use async_nats::service::Request;
use flotilla_model::ErrorCode;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::fork::{
    ForkOrigin, KeptSteps, MAX_FORK_DESCRIPTION, ReusedResult, RunForkReply, RunForkRequest,
    apply_edits,
};
use flotilla_model::ids::TaskId;
use flotilla_model::run::TaskStatus;
use flotilla_model::submit::{SubmitReply, SubmitRequest, SubmitStatus};
use flotilla_model::time::Timestamp;
use futures::StreamExt;
use tracing::{info, warn};

use super::{Api, parse, respond_error, respond_json};
use crate::intake::{Answer, Source};

/// Why a fork is refused before anything is submitted.
enum Refused {
    /// An error answer: status, code, message.
    Error(u16, ErrorCode, String),
    /// The changed plan does not validate: `400 invalid_plan` with every problem.
    Problems(Vec<flotilla_model::problem::Problem>),
}

impl Api {
    pub(super) async fn fork(&self, req: Request) {
        let Some(r) = parse::<RunForkRequest>(&req).await else {
            return;
        };
        let run = r.run_id;
        let unavailable = |e: String| Refused::Error(503, ErrorCode::Unavailable, e);
        let built = async {
            // The request's own bounds first: a bad request reads nothing.
            if r.edits.len() > self.ctx.limits.max_subtasks {
                return Err(Refused::Error(
                    400,
                    ErrorCode::InvalidRequest,
                    format!(
                        "{} edits; a plan has at most {} tasks",
                        r.edits.len(),
                        self.ctx.limits.max_subtasks
                    ),
                ));
            }
            if r.description
                .as_ref()
                .is_some_and(|d| d.len() > MAX_FORK_DESCRIPTION)
            {
                return Err(Refused::Error(
                    400,
                    ErrorCode::InvalidRequest,
                    format!("description is longer than {MAX_FORK_DESCRIPTION} bytes"),
                ));
            }
            let Some(state) = self
                .store
                .state(run)
                .await
                .map_err(|e| unavailable(e.to_string()))?
            else {
                return Err(Refused::Error(
                    404,
                    ErrorCode::UnknownRun,
                    format!("run {run} does not exist"),
                ));
            };
            if !state.status.is_terminal() {
                return Err(Refused::Error(
                    409,
                    ErrorCode::RunNotEnded,
                    format!(
                        "run {run} is {}: a run is forked once it has ended (cancel it first to fork it now)",
                        state.status.as_str()
                    ),
                ));
            }
            let plan = self
                .store
                .plan_for(run, &state)
                .await
                .map_err(|e| unavailable(e.to_string()))?
                .ok_or_else(|| {
                    Refused::Error(
                        409,
                        ErrorCode::ResultMissing,
                        format!("the plan of run {run} can no longer be read from its log"),
                    )
                })?;
            // The plan with its edits; what runs afresh: downstream of the fork point and of
            // every edited task, in the edited plan.
            let mut plan = plan;
            let mask = match apply_edits(&mut plan, &r.at, &r.edits) {
                Ok(mask) => mask,
                Err(missing) => {
                    // Edits keep their ids: the plan's tasks are the original's.
                    let ids: Vec<&str> = plan.subtasks.iter().map(|s| s.id.as_str()).collect();
                    return Err(Refused::Error(
                        404,
                        ErrorCode::UnknownTask,
                        format!(
                            "run {run} has no task {:?} (its tasks: {}){}",
                            missing.as_str(),
                            ids.join(", "),
                            if missing == r.at {
                                ""
                            } else {
                                "; an edit replaces a task of the plan"
                            }
                        ),
                    ));
                }
            };
            // The fork point, which `apply_edits` found.
            let at = plan_index(&plan, &r.at).unwrap_or_default();
            // A change no live worker of its pool would carry out is refused before any read.
            self.check_workers(&r, &plan.subtasks[at].pool)?;
            // A kept result must still be readable: the fork's tasks read it where the
            // original stored it. Read several at a time.
            // Per task of the plan: the run-log sequence of the result it keeps, if it does.
            let keep: Vec<Option<u64>> = (0..plan.subtasks.len())
                .map(|i| {
                    state
                        .tasks
                        .get(i)
                        .filter(|t| {
                            !mask[i] && t.status == TaskStatus::Succeeded && t.result_seq != 0
                        })
                        .map(|t| t.result_seq)
                })
                .collect();
            let kept: Vec<(TaskId, u64)> = plan
                .subtasks
                .iter()
                .zip(&keep)
                .filter_map(|(sub, seq)| seq.map(|seq| (sub.id.clone(), seq)))
                .collect();
            // A fork at a step: the kept steps, and when the first new one was stored.
            let (conversation, resumed_ms) = match r.step {
                None => (None, None),
                Some(step) => {
                    let (kept, at_ms) = self.kept_steps(&state, &plan, at, step).await?;
                    (Some(kept), Some(at_ms))
                }
            };
            // The fork's id is fixed here: its workspace, mailboxes and session are filled
            // before it is submitted.
            let fork_id = r.fork_run_id.unwrap_or_else(flotilla_model::RunId::new);
            let fork_point = state.tasks.get(at);
            let copy = CopyPlan {
                root: crate::lineage::root_of(&state),
                session: crate::lineage::session_of(&state),
                kept: kept.iter().map(|(t, _)| t.clone()).collect(),
                // At a step, what the fork point's kept steps did is the fork's too: its writes
                // and the state up to its first new step.
                cutoff_ms: resumed_ms.unwrap_or_else(|| {
                    fork_point
                        .map(|t| t.dispatched_ms)
                        .filter(|ms| *ms > 0)
                        .unwrap_or(i64::MAX)
                }),
                fork_point: resumed_ms
                    .and(fork_point)
                    .map(|t| (r.at.clone(), t.attempt)),
            };
            let store = &self.store;
            let results = futures::stream::iter(kept.into_iter().map(|(task, seq)| async move {
                let result = store.result_at(seq).await.map(|_| ());
                (task, seq, result)
            }))
            .buffered(16)
            .collect::<Vec<_>>();
            // What the fork is given of the original's collaboration is read meanwhile.
            let (read, gathered) = tokio::join!(results, self.gather_copy(run, fork_id, &copy));
            let gathered = gathered.map_err(|e| match e {
                super::fork_copy::CopyError::Unavailable(e) => unavailable(e),
                super::fork_copy::CopyError::TooMany(what) => Refused::Error(
                    413,
                    ErrorCode::TooLarge,
                    format!(
                        "run {run}'s kept tasks left more than {} {what}, which a fork would copy; a fork copies at most {}",
                        super::fork_copy::MAX_COPIED,
                        super::fork_copy::MAX_COPIED
                    ),
                ),
            })?;
            let mut reused = Vec::with_capacity(read.len());
            for (task, seq, result) in read {
                if let Err(e) = result {
                    return Err(Refused::Error(
                        409,
                        ErrorCode::ResultMissing,
                        format!(
                            "task {task}'s result in run {run} (run-log entry {seq}) cannot be read, so the fork cannot keep it: {e}"
                        ),
                    ));
                }
                reused.push(ReusedResult { task_id: task, seq });
            }
            let sub = &mut plan.subtasks[at];
            if let Some(model) = &r.model {
                sub.model = Some(model.clone());
            }
            if let Some(agent) = &r.agent {
                sub.agent = Some(agent.clone());
            }
            if let Some(description) = &r.description {
                sub.description = description.clone();
            }
            if let Some(input) = &r.input {
                sub.input = input.clone();
            }
            // A change the plan cannot take (an unknown agent, an input too deep) is refused
            // here, naming every problem, and nothing is stored.
            if let Err(report) = flotilla_model::validate::prepare_plan(&plan, &self.ctx) {
                return Err(Refused::Problems(report.errors));
            }
            let rerun: Vec<TaskId> = plan
                .subtasks
                .iter()
                .zip(&keep)
                .filter(|(_, seq)| seq.is_none())
                .map(|(s, _)| s.id.clone())
                .collect();
            let kept: Vec<TaskId> = reused.iter().map(|k| k.task_id.clone()).collect();
            plan.fork = Some(ForkOrigin {
                run_id: run,
                task_id: r.at.clone(),
                reused,
                conversation,
            });
            let mut submit = SubmitRequest::new(plan);
            submit.run_id = Some(fork_id);
            // The original's labels (not a rollback's mark: a fork is no rollback), and a
            // session of its own: its tasks' state writes must not reach the original's
            // session, nor another fork's.
            submit.labels = state.labels.clone();
            submit
                .labels
                .remove(flotilla_model::rollback::ROLLBACK_OF_LABEL);
            Ok((submit, kept, rerun, gathered))
        };
        let (submit, kept, rerun, gathered) = match built.await {
            Ok(b) => b,
            Err(Refused::Error(status, code, message)) => {
                return respond_error(&req, status, code, message).await;
            }
            Err(Refused::Problems(problems)) => {
                return super::respond_problems(&req, ErrorCode::InvalidPlan, problems).await;
            }
        };
        if let (Some(fork), Some(gathered)) = (submit.run_id, gathered)
            && let Err(e) = self.copy_collaboration(run, fork, gathered).await
        {
            warn!(%run, %fork, error = %e, "A fork's copy of its original's collaboration failed");
            return respond_error(&req, 503, ErrorCode::Unavailable, e).await;
        }
        let payload = match serde_json::to_vec(&submit) {
            Ok(p) => p,
            Err(e) => return respond_error(&req, 500, ErrorCode::Internal, e.to_string()).await,
        };
        let source = Source::Api {
            inbox: None,
            now_ms: Timestamp::now().unix_ms(),
            fork: true,
        };
        let reply: SubmitReply = match self.intake.submit(None, &payload, source).await {
            Ok(Answer::Now(reply)) => *reply,
            Ok(other) => {
                // A submission without `wait` is answered at once; anything else is a bug.
                warn!(?other, "A fork's submission was not answered at once");
                return respond_error(
                    &req,
                    500,
                    ErrorCode::Internal,
                    "the fork's submission was not answered".to_owned(),
                )
                .await;
            }
            Err(e) => {
                warn!(error = %e, "A fork's submission failed");
                return respond_error(&req, 503, ErrorCode::Unavailable, e.to_string()).await;
            }
        };
        let mut answer = RunForkReply {
            protocol: PROTOCOL_VERSION,
            run_id: reply.run_id,
            status: reply.status,
            errors: reply.errors,
            warnings: reply.warnings,
            outcome: None,
            fork_of: run,
            at: r.at.clone(),
            reused: kept,
            rerun,
        };
        if let (Some(fork), SubmitStatus::Accepted) = (answer.run_id, answer.status) {
            info!(%run, %fork, at = %r.at, reused = answer.reused.len(), "Run forked");
        }
        if r.wait
            && let (Some(fork), SubmitStatus::Accepted | SubmitStatus::Duplicate) =
                (answer.run_id, answer.status)
        {
            match self.wait_for_end(fork).await {
                Ok(outcome) => {
                    answer.status = SubmitStatus::Finished;
                    answer.outcome = Some(outcome);
                }
                Err((status, code, message)) => {
                    return respond_error(&req, status, code, message).await;
                }
            }
        }
        respond_json(&req, self.max_payload(), &answer).await;
    }
}

impl Api {
    /// What a fork at step `step` of `at` keeps: the steps before it of the fork point's last
    /// attempt, once the journal is seen to hold every one and `step` to be a model call.
    async fn kept_steps(
        &self,
        state: &flotilla_machine::RunState,
        plan: &flotilla_model::plan::Plan,
        index: usize,
        step: u32,
    ) -> Result<(KeptSteps, i64), Refused> {
        let run = state.run_id;
        let at = &plan.subtasks[index].id;
        // The run is itself a fork at a step of this task: its attempt journaled only the
        // steps after the ones it kept, which live in the run it forked.
        if let Some(origin) = plan
            .fork
            .as_ref()
            .filter(|f| &f.task_id == at && f.conversation.is_some())
        {
            return Err(Refused::Error(
                400,
                ErrorCode::InvalidRequest,
                format!(
                    "run {run} is a fork at a step of task {at}, whose earlier steps are in run {}: fork that run at {at}:{step} instead, or fork this one at the task",
                    origin.run_id
                ),
            ));
        }
        let bad = |message: String| Refused::Error(400, ErrorCode::InvalidRequest, message);
        let Some(task) = state.tasks.get(index).filter(|t| t.attempt > 0) else {
            return Err(bad(format!(
                "task {at} never ran in run {run}: it has no conversation to fork inside (fork at the task, without a step)"
            )));
        };
        // The attempt as its result recorded it; minted again only for a task without one.
        let recorded = match task.result_seq {
            0 => None,
            seq => self
                .store
                .result_at(seq)
                .await
                .ok()
                .filter(|r| &r.task_id == at)
                .map(|r| r.attempt_id),
        };
        let attempt_id = recorded.unwrap_or_else(|| {
            flotilla_machine::attempt_id(run, index as u32, task.attempt, task.attempt_started_ms())
        });
        let steps =
            flotilla_context::journal::attempt_steps_timed(self.store.bus(), run, attempt_id)
                .await
                .map_err(|e| Refused::Error(503, ErrorCode::Unavailable, e.to_string()))?;
        let Some((&last, _)) = steps.last_key_value() else {
            return Err(bad(format!(
                "task {at}'s last attempt in run {run} (attempt {}, {attempt_id}) recorded no conversation steps: only LLM agents journal theirs (fork at the task, without a step)",
                task.attempt
            )));
        };
        if let Some(missing) = (0..=step.min(last)).find(|s| !steps.contains_key(s)) {
            let held: Vec<String> = steps.keys().map(u32::to_string).collect();
            return Err(Refused::Error(
                409,
                ErrorCode::JournalIncomplete,
                format!(
                    "the step journal of task {at}'s attempt {} in run {run} ({attempt_id}) has no step {missing}, so a fork cannot keep steps 0..{step} (it holds steps {})",
                    task.attempt,
                    held.join(", ")
                ),
            ));
        }
        let resumed_ms = match steps.get(&step) {
            Some((flotilla_model::event::StepEntry::ModelReply { .. }, at_ms)) => *at_ms,
            Some((flotilla_model::event::StepEntry::ToolResults { .. }, _)) => {
                return Err(bad(format!(
                    "step {step} of task {at}'s conversation is a round of tool results; fork at a model call (step {} or {})",
                    step.saturating_sub(1),
                    step + 1
                )));
            }
            None => {
                return Err(bad(format!(
                    "task {at}'s conversation in run {run} has steps 0..={last}; step {step} is not one of them"
                )));
            }
        };
        Ok((
            KeptSteps {
                run_id: run,
                attempt_id,
                steps: step,
            },
            resumed_ms,
        ))
    }

    /// Refuses a change a live worker of the fork point's pool would ignore (it runs a
    /// version from before the change existed), naming the workers.
    fn check_workers(&self, r: &RunForkRequest, pool: &str) -> Result<(), Refused> {
        use flotilla_model::worker::{FEATURE_KEPT_STEPS, FEATURE_TASK_MODEL};
        let now = Timestamp::now().unix_ms();
        for (asked, feature, what) in [
            (r.model.is_some(), FEATURE_TASK_MODEL, "a task's model"),
            (
                r.step.is_some(),
                FEATURE_KEPT_STEPS,
                "a conversation's kept steps",
            ),
        ] {
            if !asked {
                continue;
            }
            let old = self.live.lacking(pool, feature, now);
            if !old.is_empty() {
                return Err(Refused::Error(
                    409,
                    ErrorCode::WorkersOutdated,
                    format!(
                        "live worker(s) {} of pool {pool} run a version that does not know {what} ({feature}) and would ignore it; upgrade them first",
                        old.join(", ")
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// What a fork copies from its original's collaboration ([`super::fork_copy`]).
struct CopyPlan {
    root: flotilla_model::RunId,
    session: String,
    kept: std::collections::HashSet<TaskId>,
    cutoff_ms: i64,
    /// A fork at a step: the fork point and its attempt, whose writes before the cutoff are
    /// copied too.
    fork_point: Option<(TaskId, u32)>,
}

fn plan_index(plan: &flotilla_model::plan::Plan, task: &TaskId) -> Option<usize> {
    plan.subtasks.iter().position(|s| &s.id == task)
}

impl Api {
    /// Reads what a new fork is given of its original's collaboration
    /// ([`super::fork_copy`]); `None` when the fork exists already (a repeated request: the
    /// submission answers `duplicate`, and nothing is copied again).
    async fn gather_copy(
        &self,
        run: flotilla_model::RunId,
        fork: flotilla_model::RunId,
        copy: &CopyPlan,
    ) -> Result<Option<super::fork_copy::Gathered>, super::fork_copy::CopyError> {
        let source = super::fork_copy::Source {
            run,
            root: copy.root,
            session: copy.session.clone(),
            kept: &copy.kept,
            cutoff_ms: copy.cutoff_ms,
            fork_point: copy.fork_point.as_ref().map(|(t, a)| (t, *a)),
        };
        // Whether the fork exists, and what it would be given, at once.
        let (exists, gathered) = tokio::join!(
            self.store.state(fork),
            super::fork_copy::gather(self.store.bus(), &source, fork)
        );
        if exists
            .map_err(|e| super::fork_copy::CopyError::Unavailable(e.to_string()))?
            .is_some()
        {
            return Ok(None);
        }
        gathered.map(Some)
    }

    /// Writes what was gathered into the fork, before it is submitted.
    async fn copy_collaboration(
        &self,
        run: flotilla_model::RunId,
        fork: flotilla_model::RunId,
        gathered: super::fork_copy::Gathered,
    ) -> Result<(), String> {
        let copied = super::fork_copy::publish(self.store.bus(), gathered, run, fork).await?;
        if copied != super::fork_copy::Copied::default() {
            info!(%run, %fork, entries = copied.entries, posts = copied.posts, state_keys = copied.state_keys, "Copied the original's collaboration into the fork");
        }
        Ok(())
    }
}
