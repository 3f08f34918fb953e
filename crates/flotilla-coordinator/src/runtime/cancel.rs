//! Cancelling the attempts of a stopped run: a notice in the control bucket, which workers
//! watch, and the run's queued tasks purged from the task stream; and withdrawing an anycast
//! task no member claimed in time from its role's queue; starting the rollback run of a run
//! cancelled with `rollback`.

use flotilla_bus::wire;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::codec::Codec;
use flotilla_model::event::{Event, EventEnvelope};
use flotilla_model::ids::RunId;
use flotilla_model::rollback::{
    Compensated, MAX_COMPENSATED_RESULT, ROLLBACK_OF_LABEL, rollback_plan, rollback_run_id,
};
use flotilla_model::run::RunHandle;
use flotilla_model::submit::SubmitRequest;
use flotilla_model::time::Timestamp;

use super::{Cached, Runtime, StepError};

impl Runtime {
    /// Tells the workers running attempts of a stopped run to cancel them: a notice in the
    /// control bucket (workers watch it, so they react at once), and the run's queued tasks
    /// are removed from the task stream so no worker starts them.
    pub(super) async fn cancel_attempts(&self, entry: &Cached) -> Result<(), StepError> {
        let state = entry.machine.state();
        let run = state.run_id;
        let names = self.bus.names();
        let kv = self
            .bus
            .kv(flotilla_model::subjects::Bucket::Control)
            .await
            .map_err(|e| StepError::Failed(e.to_string()))?;
        let notice = serde_json::json!({
            "run_id": run,
            "action": "cancel",
            "reason": state.stop_reason,
        });
        kv.put(names.cancel_key(run), notice.to_string().into())
            .await
            .map_err(|e| StepError::Failed(format!("writing the cancel notice of {run}: {e}")))?;
        let stream_name = names.stream(flotilla_model::subjects::StreamKind::Tasks);
        let stream = self
            .bus
            .js()
            .get_stream(&stream_name)
            .await
            .map_err(|e| StepError::Failed(format!("opening {stream_name}: {e}")))?;
        stream
            .purge()
            .filter(format!("{}.task.*.{run}.*", names.prefix()))
            .await
            .map_err(|e| StepError::Failed(format!("removing the queued tasks of {run}: {e}")))?;
        if state.anycast {
            stream
                .purge()
                .filter(names.role_run_filter(run))
                .await
                .map_err(|e| {
                    StepError::Failed(format!("removing the queued role tasks of {run}: {e}"))
                })?;
        }
        Ok(())
    }

    /// Removes the queued message of an anycast task that no member claimed in time, so a
    /// member coming online later does not start an attempt that already failed.
    pub(super) async fn withdraw(&self, entry: &Cached, task: u32) -> Result<(), StepError> {
        let Some(role) = entry.machine.anycast_role(task) else {
            return Ok(());
        };
        let state = entry.machine.state();
        let names = self.bus.names();
        let subject = names.role_task(
            role,
            state.run_id,
            &entry.machine.plan().subtasks[task as usize].id,
        );
        let stream_name = names.stream(flotilla_model::subjects::StreamKind::Tasks);
        let stream = self
            .bus
            .js()
            .get_stream(&stream_name)
            .await
            .map_err(|e| StepError::Failed(format!("opening {stream_name}: {e}")))?;
        stream
            .purge()
            .filter(subject.as_str())
            .await
            .map_err(|e| StepError::Failed(format!("withdrawing {subject}: {e}")))?;
        Ok(())
    }

    /// The run is held (paused, taken over) or released: its hold key in the control bucket
    /// tells the workers, whose LLM attempts of the run stop at their next step while it is
    /// there. Idempotent: a step performed again writes (or deletes) it again.
    pub(super) async fn hold_attempts(&self, entry: &Cached, held: bool) -> Result<(), StepError> {
        let run = entry.machine.state().run_id;
        let key = self.bus.names().hold_key(run);
        self.write_hold(run, &key, held).await
    }

    /// Writes (held) or deletes the hold key of task `task` alone (`hold.<run>.<task>`):
    /// workers stop its running LLM attempt at its next step boundary while it is there.
    pub(super) async fn hold_task(
        &self,
        entry: &Cached,
        task: u32,
        held: bool,
    ) -> Result<(), StepError> {
        let run = entry.machine.state().run_id;
        let Some(sub) = entry.machine.plan().subtasks.get(task as usize) else {
            return Ok(());
        };
        let key = self.bus.names().task_hold_key(run, &sub.id);
        self.write_hold(run, &key, held).await
    }

    async fn write_hold(&self, run: RunId, key: &str, held: bool) -> Result<(), StepError> {
        let kv = self
            .bus
            .kv(flotilla_model::subjects::Bucket::Control)
            .await
            .map_err(|e| StepError::Failed(e.to_string()))?;
        let failed = |e: String| StepError::Failed(format!("writing the hold of {run}: {e}"));
        if held {
            let notice = serde_json::json!({"run_id": run, "action": "hold"});
            kv.put(key, notice.to_string().into())
                .await
                .map_err(|e| failed(e.to_string()))?;
        } else {
            kv.delete(key).await.map_err(|e| failed(e.to_string()))?;
        }
        Ok(())
    }
}

impl Runtime {
    /// Starts the rollback run of a run cancelled with `rollback`: a child of the run whose
    /// plan undoes `tasks` in reverse dependency order (see [`flotilla_model::rollback`]).
    /// It goes through the durable intake like any submission, under an id derived from the
    /// run and with a message id, so performing this again starts nothing twice (the intake
    /// answers the repeat `duplicate`). Returns the run-tree link for the step's events.
    pub(super) async fn roll_back(
        &self,
        entry: &mut Cached,
        tasks: &[u32],
    ) -> Result<Option<EventEnvelope>, StepError> {
        let mut undo = Vec::with_capacity(tasks.len());
        for &t in tasks {
            let mut result = self.result_of(entry, t).await?.response;
            super::results::shorten_response(&mut result, MAX_COMPENSATED_RESULT);
            undo.push(Compensated {
                index: t as usize,
                result,
            });
        }
        let state = entry.machine.state();
        let run = state.run_id;
        let max = self.bus.max_payload();
        // The texts handed to the compensations shrink until the plan fits in one message.
        let room = max.saturating_sub(flotilla_model::validate::PLAN_ENVELOPE_ROOM);
        let mut fitting = None;
        for max_text in [MAX_COMPENSATED_RESULT, 4096, 1024, 256] {
            let Some(plan) = rollback_plan(run, entry.machine.plan(), &undo, max_text) else {
                return Ok(None);
            };
            if flotilla_model::validate::check_plan_size(&plan, room).is_none() {
                fitting = Some(plan);
                break;
            }
        }
        let Some(plan) = fitting else {
            // Never fits (thousands of compensations): nothing to retry; said loudly.
            tracing::error!(%run, tasks = tasks.len(), "The rollback plan does not fit in one message of this deployment; no rollback run was started");
            return Ok(None);
        };
        let child = rollback_run_id(run);
        let root = crate::lineage::root_of(state);
        let parent = RunHandle {
            run_id: run,
            agent_id: None,
            parent_run_id: None,
            parent_tool_call_id: None,
            parent_task_id: None,
            root_run_id: Some(root),
        };
        let mut request = SubmitRequest::new(plan);
        request.run_id = Some(child);
        request.parent = Some(parent);
        request.labels = [(ROLLBACK_OF_LABEL.to_owned(), run.to_string())].into();
        let out = wire::encode(&request, Codec::Json, Some(&format!("rollback.{run}")))?;
        let subject = self.bus.names().submit();
        let size = out.payload.len();
        self.bus
            .js()
            .publish_with_headers(subject.clone(), out.headers, out.payload)
            .await
            .map_err(|e| flotilla_bus::classify_publish_error(&subject, size, max, e))?
            .await
            .map_err(|e| flotilla_bus::classify_publish_error(&subject, size, max, e))?;
        tracing::info!(%run, rollback = %child, tasks = tasks.len(), "Rolling back the cancelled run");
        Ok(Some(EventEnvelope {
            protocol: PROTOCOL_VERSION,
            id: format!("{run}.child.{child}"),
            run_id: run,
            task_id: None,
            attempt: None,
            ts: Timestamp::from_unix_ms(state.finished_ms.unwrap_or_default()),
            source: "coordinator".into(),
            event: Event::AgentRunStarted {
                child: RunHandle {
                    run_id: child,
                    agent_id: None,
                    parent_run_id: Some(run),
                    parent_tool_call_id: None,
                    parent_task_id: None,
                    root_run_id: Some(root),
                },
                agent: None,
            },
        }))
    }
}
