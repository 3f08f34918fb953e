//! The step journal: a model call that already happened is not paid for twice.
//!
//! Each model reply and each round of tool results of an attempt is recorded as an
//! `agent_step` event (step 0, 1, … in the order they happen) and stored before the attempt
//! goes on. A task message delivered again after its worker died carries the same attempt;
//! the new delivery reads the recorded steps ([`flotilla_context::Clients::journal`]) and
//! replays them in order — the conversation is rebuilt from them without calling the model,
//! and tool rounds already run are not run again (their side effects happened once) — then
//! continues live from the first step nobody recorded.
//!
//! Replayed steps emit no events again (their `usage`, `assistant_reply` and `tool_*` events
//! are on the stream already) and reserve no budget (it was settled when they ran); their
//! tokens still count in the attempt's total. The journal is an optimisation, never a
//! correctness condition: a step that could not be recorded is simply done again by a later
//! delivery, and a journal that does not fit the conversation (a different shape of step)
//! is dropped from that point on.

use std::collections::BTreeMap;
use std::time::Duration;

use flotilla_context::journal::{attempt_steps, step_event_id};
use flotilla_context::{AgentContext, AgentError};
use flotilla_model::event::{Event, StepEntry, StepToolCall};
use flotilla_model::task::{TaskEnvelope, TaskErrorKind};

use crate::provider::{Completion, ToolCallRequest};

/// What earlier deliveries recorded, and where this one is.
#[derive(Debug)]
pub(crate) struct Journal {
    recorded: BTreeMap<u32, StepEntry>,
    next: u32,
    /// Model calls and tool rounds taken from the journal instead of being made.
    pub(crate) replayed_calls: u32,
    pub(crate) replayed_rounds: u32,
}

impl Journal {
    /// The journal of the attempt: the recorded steps on a redelivery, else empty. A journal
    /// that cannot be read is treated as empty (the steps are done again).
    ///
    /// A fork at a step (`kept_steps`) starts with the original attempt's steps before it,
    /// which are part of what the fork is, not an optimisation: when they cannot be read the
    /// attempt fails (and is retried) rather than paying for a different conversation.
    pub(crate) async fn open(
        ctx: &AgentContext,
        task: &TaskEnvelope,
        agent: &str,
    ) -> Result<Self, AgentError> {
        let mut recorded = match ctx.clients().journal(task.resume.is_some()).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(agent, error = %e, "Could not read the attempt's step journal; its steps are done again");
                BTreeMap::new()
            }
        };
        if let Some(kept) = &task.kept_steps {
            let original = attempt_steps(ctx.clients().bus(), kept.run_id, kept.attempt_id)
                .await
                .map_err(|e| {
                    AgentError::failed(format!(
                        "agent {agent}: reading the {} kept steps of run {}'s attempt {}: {e}",
                        kept.steps, kept.run_id, kept.attempt_id
                    ))
                })?;
            if let Some(missing) = (0..kept.steps).find(|s| !original.contains_key(s)) {
                return Err(AgentError {
                    kind: TaskErrorKind::BadEnvelope,
                    message: format!(
                        "agent {agent}: the fork keeps steps 0..{} of run {}'s attempt {}, but its journal has no step {missing}",
                        kept.steps, kept.run_id, kept.attempt_id
                    ),
                });
            }
            // This attempt's own steps (a redelivery's) come after the kept ones.
            for (step, entry) in original.into_iter().take_while(|(s, _)| *s < kept.steps) {
                recorded.entry(step).or_insert(entry);
            }
        }
        if !recorded.is_empty() {
            tracing::info!(
                agent,
                steps = recorded.len(),
                kept = task.kept_steps.as_ref().map_or(0, |k| k.steps),
                "Starting the attempt from its step journal"
            );
        }
        Ok(Self {
            recorded,
            next: 0,
            replayed_calls: 0,
            replayed_rounds: 0,
        })
    }

    /// The position of the next step in the attempt (0, 1, …): the same on every delivery.
    pub(crate) fn next_step(&self) -> u32 {
        self.next
    }

    /// The recorded reply to the next model call, if any.
    pub(crate) fn replay_model_reply(&mut self) -> Option<Completion> {
        match self.recorded.get(&self.next) {
            Some(StepEntry::ModelReply {
                content,
                tool_calls,
                prompt_tokens,
                completion_tokens,
                model,
            }) => {
                let c = Completion {
                    content: content.clone(),
                    tool_calls: tool_calls
                        .iter()
                        .map(|t| ToolCallRequest {
                            id: t.id.clone(),
                            name: t.name.clone(),
                            arguments: t.arguments.clone(),
                        })
                        .collect(),
                    prompt_tokens: *prompt_tokens,
                    completion_tokens: *completion_tokens,
                    model: model.clone(),
                    latency: Duration::ZERO,
                };
                self.next += 1;
                self.replayed_calls += 1;
                Some(c)
            }
            Some(_) => {
                self.diverged();
                None
            }
            None => None,
        }
    }

    /// The recorded results of the next round of `calls` tool calls, if any.
    pub(crate) fn replay_tool_results(&mut self, calls: usize) -> Option<Vec<String>> {
        match self.recorded.get(&self.next) {
            Some(StepEntry::ToolResults { results }) if results.len() == calls => {
                let r = results.clone();
                self.next += 1;
                self.replayed_rounds += 1;
                Some(r)
            }
            Some(_) => {
                self.diverged();
                None
            }
            None => None,
        }
    }

    fn diverged(&mut self) {
        tracing::warn!(
            step = self.next,
            "The step journal does not fit the conversation; continuing live"
        );
        self.recorded.split_off(&self.next);
    }

    /// Records a model reply made live.
    pub(crate) async fn record_model_reply(
        &mut self,
        ctx: &AgentContext,
        task: &TaskEnvelope,
        c: &Completion,
    ) {
        let entry = StepEntry::ModelReply {
            content: c.content.clone(),
            tool_calls: c
                .tool_calls
                .iter()
                .map(|t| StepToolCall {
                    id: t.id.clone(),
                    name: t.name.clone(),
                    arguments: t.arguments.clone(),
                })
                .collect(),
            prompt_tokens: c.prompt_tokens,
            completion_tokens: c.completion_tokens,
            model: c.model.clone(),
        };
        self.record(ctx, task, entry).await;
    }

    /// Records a round of tool results made live.
    pub(crate) async fn record_tool_results(
        &mut self,
        ctx: &AgentContext,
        task: &TaskEnvelope,
        results: &[String],
    ) {
        let entry = StepEntry::ToolResults {
            results: results.to_vec(),
        };
        self.record(ctx, task, entry).await;
    }

    async fn record(&mut self, ctx: &AgentContext, task: &TaskEnvelope, entry: StepEntry) {
        let step = self.next;
        self.next += 1;
        // Anything recorded past a live step belongs to a conversation that went differently.
        self.recorded.split_off(&step);
        let id = step_event_id(task.run_id, task.attempt_id, step);
        let event = Event::AgentStep {
            attempt_id: task.attempt_id,
            step,
            entry,
        };
        if let Err(e) = ctx.events.record(id, event).await {
            tracing::warn!(step, error = %e, "Could not journal a step; a redelivery would do it again");
        }
    }
}
