//! What task results turn into: the results of a run's tasks (cached or read from the run
//! log), the workspace entries and session-state values a succeeded task writes, the final
//! result of a finished run (shrunk to the budget, the whole as an artifact), and the run-log
//! entry that records the review of a planner's answer.

use std::sync::Arc;

use async_nats::HeaderMap;
use flotilla_bus::wire;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::codec::Codec;
use flotilla_model::run::FinalResult;
use flotilla_model::runlog::{PlanDecision, Planned, RunInput, RunLogEntry};
use flotilla_model::task::TaskResult;
use tracing::{info, warn};

use crate::lineage::{root_of, session_of};

use super::{Cached, Runtime, StepError};

impl Runtime {
    pub(super) async fn result_of(
        &self,
        entry: &mut Cached,
        task: u32,
    ) -> Result<TaskResult, StepError> {
        if let Some(r) = entry.results.get(&task) {
            return Ok(r.clone());
        }
        let seq = entry.machine.state().tasks[task as usize].result_seq;
        let r = self.store.result_at(seq).await?.result;
        entry.results.insert(task, r.clone());
        Ok(r)
    }

    /// Fills in the final result of a finished run: the synthesis task's (or the sinks')
    /// results, or — for a run that stopped early — every result it got. A final result
    /// larger than the budget is stored whole as an artifact, and the outcome carries a
    /// shortened copy with the reference.
    pub(super) async fn complete_outcome(&self, entry: &mut Cached) -> Result<(), StepError> {
        let Some(mut outcome) = entry.machine.state().outcome.clone() else {
            return Ok(());
        };
        if outcome.final_result.is_some() {
            return Ok(());
        }
        let partial = entry.machine.stopped_early();
        let finals = if partial {
            entry.machine.succeeded_tasks()
        } else {
            entry.machine.final_tasks()
        };
        if finals.is_empty() {
            return Ok(());
        }
        let plan = Arc::clone(entry.machine.plan());
        let mut results = Vec::with_capacity(finals.len());
        for &i in &finals {
            let r = self.result_of(entry, i).await?;
            results.push((plan.subtasks[i as usize].id.clone(), r));
        }
        let mut final_result = FinalResult::of(results.iter().map(|(id, r)| (id, r)), partial);
        let budget = self.final_result_budget();
        // Only a final result that may be near the budget is encoded to measure it.
        if final_result.estimated_len() > budget / 2
            && let encoded = serde_json::to_vec(&final_result)
                .map_err(|e| StepError::Terminal(format!("encoding the final result: {e}")))?
            && encoded.len() > budget
        {
            let run = entry.machine.state().run_id;
            let artifact = self
                .store
                .put_artifact(&format!("runs/{run}/final-result.json"), encoded)
                .await?;
            shrink_final_result(&mut final_result, budget);
            final_result.artifact = Some(artifact);
        }
        outcome.final_result = Some(final_result);
        entry.machine.set_outcome(outcome);
        Ok(())
    }

    /// Bytes of final result carried inline in outcomes, events and replies.
    pub(super) fn final_result_budget(&self) -> usize {
        self.opts
            .final_result_budget
            .min(self.bus.max_payload() / 4)
    }

    /// Reviews the planner's answer of `round` (see [`crate::planner`]): the run-log entry
    /// that records the decision.
    pub(super) async fn review_plan(
        &self,
        entry: &mut Cached,
        round: u32,
    ) -> Result<RunLogEntry, StepError> {
        let answer = self.result_of(entry, 0).await?;
        let state = entry.machine.state();
        let run = state.run_id;
        let max_repairs = state.planning.as_ref().map_or(0, |p| p.max_repairs);
        let planning = Arc::clone(entry.machine.plan());
        let query = planning.query.clone().unwrap_or_default();
        let ctx = self.ctx.for_payload(self.bus.max_payload());
        let decision = crate::planner::review(
            &answer.response,
            &query,
            round,
            max_repairs,
            &self.opts.planner,
            &ctx,
            &planning,
        );
        match &decision {
            PlanDecision::Accepted { plan, .. } => {
                info!(%run, round, tasks = plan.subtasks.len(), "Planner answer accepted")
            }
            PlanDecision::Repair { problems, .. } | PlanDecision::Failed { problems } => {
                warn!(%run, round, problems = problems.len(), first = %problems.first().map(ToString::to_string).unwrap_or_default(), decision = decision.as_str(), "Planner answer has problems")
            }
        }
        Ok(RunLogEntry {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            input: RunInput::Planned(Box::new(Planned { round, decision })),
        })
    }

    /// Automatic produce: the succeeded task's result as an entry on each topic it produces.
    pub(super) async fn produced_entries(
        &self,
        entry: &mut Cached,
        task: u32,
    ) -> Result<Vec<(String, wire::Outgoing)>, StepError> {
        let result = self.result_of(entry, task).await?;
        let plan = Arc::clone(entry.machine.plan());
        let sub = &plan.subtasks[task as usize];
        let s = entry.machine.state();
        let (run, root) = (s.run_id, root_of(s));
        let mut summary = result.response;
        // Leave room for the entry's other fields and the writer.
        let room = flotilla_model::workspace::MAX_ENTRY_BYTES
            .min(self.bus.max_payload())
            .saturating_sub(8 * 1024);
        shorten_response(&mut summary, room);
        let write = flotilla_model::workspace::WorkspaceWrite {
            protocol: PROTOCOL_VERSION,
            entry: flotilla_model::workspace::produced_entry(
                &sub.id,
                &summary,
                result.numeric_value,
            ),
            writer: Some(flotilla_model::workspace::Writer {
                run_id: run,
                task_id: Some(sub.id.clone()),
                attempt: Some(s.tasks[task as usize].attempt),
                by: Some("coordinator".into()),
            }),
        };
        let mut out = Vec::with_capacity(sub.produces.len());
        for topic in &sub.produces {
            let mut msg = wire::encode(
                &write,
                Codec::Json,
                Some(&format!("produce.{run}.{}.{topic}", sub.id)),
            )?;
            msg.headers.insert(
                flotilla_model::workspace::PRODUCED_BY_HEADER,
                sub.id.as_str(),
            );
            out.push((self.bus.names().workspace(root, topic), msg));
        }
        Ok(out)
    }

    /// The succeeded task's response as its `output_key` value in session state: a KV put
    /// with a message id, so a re-performed step does not write it again.
    pub(super) async fn output_value(
        &self,
        entry: &mut Cached,
        task: u32,
    ) -> Result<(String, wire::Outgoing), StepError> {
        let result = self.result_of(entry, task).await?;
        let plan = Arc::clone(entry.machine.plan());
        let sub = &plan.subtasks[task as usize];
        let s = entry.machine.state();
        let run = s.run_id;
        let key = sub.output_key.clone().unwrap_or_default();
        let mut response = result.response;
        let room = flotilla_model::state::MAX_VALUE_BYTES - 64;
        if response.len() > room {
            warn!(%run, task = %sub.id, key, bytes = response.len(), "The response is larger than a state value; its output_key value is cut");
            shorten_response(&mut response, room);
        }
        let value = serde_json::Value::String(response);
        let body = serde_json::to_vec(&value)
            .map_err(|e| StepError::Failed(format!("encoding state value: {e}")))?;
        let mut headers = HeaderMap::new();
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            format!("output.{run}.{}", sub.id).as_str(),
        );
        let names = self.bus.names();
        let subject = format!(
            "$KV.{}.{}",
            names.bucket(flotilla_model::subjects::Bucket::State),
            names.state_key(&session_of(s), &key)
        );
        Ok((
            subject,
            wire::Outgoing {
                headers,
                payload: body.into(),
            },
        ))
    }
}

/// Cuts a response to at most `max` bytes, saying so in the text.
pub(super) fn shorten_response(response: &mut String, max: usize) {
    if response.len() > max {
        let total = response.len();
        crate::machine::truncate_message(response, max.saturating_sub(96));
        response.push_str(&format!(" (response cut from {total} bytes)"));
    }
}

/// Shrinks a final result to about `budget` bytes: the text is cut and results are left out
/// (counted in `omitted`) until it fits.
fn shrink_final_result(fr: &mut FinalResult, budget: usize) {
    shorten_response(&mut fr.response, budget / 2);
    let mut room = budget / 2;
    let mut kept = std::collections::BTreeMap::new();
    let total = fr.results.len();
    for (id, mut r) in std::mem::take(&mut fr.results) {
        shorten_response(&mut r.response, room.min(budget / 8));
        let size = r.response.len() + id.as_str().len() + 128;
        if size > room {
            continue;
        }
        room -= size;
        kept.insert(id, r);
    }
    fr.omitted = (total - kept.len()) as u32;
    fr.results = kept;
}
