//! The task message of an attempt: dependency results within the message's budget, the
//! description with its session-state placeholders filled in, consumed workspace topics and
//! the trace context; or the failed result of an attempt that cannot start.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use flotilla_bus::wire;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::codec::Codec;
use flotilla_model::ids::RunId;
use flotilla_model::runlog::{RunInput, RunLogEntry};
use flotilla_model::task::{DependencyResult, TaskEnvelope, TaskError, TaskResult, TraceContext};
use flotilla_model::template::{fill, placeholders};
use flotilla_model::time::Timestamp;
use tracing::warn;

use crate::lineage::{root_of, session_of};
use crate::machine::attempt_id;

use super::results::shorten_response;
use super::{Cached, Runtime, StepError};

impl Runtime {
    /// The task message of an attempt, or — when the task cannot start (its description
    /// names a state key that is not set) — the error its attempt fails with.
    pub(super) async fn envelope(
        &self,
        entry: &mut Cached,
        task: u32,
        attempt: u32,
    ) -> Result<Result<TaskEnvelope, TaskError>, StepError> {
        let plan = Arc::clone(entry.machine.plan());
        let graph = Arc::clone(entry.machine.graph());
        let sub = &plan.subtasks[task as usize];
        let (run_id, dispatched_ms, attempt_ms, trace) = {
            let s = entry.machine.state();
            (
                s.run_id,
                s.tasks[task as usize].dispatched_ms,
                s.tasks[task as usize].attempt_started_ms(),
                s.trace.clone(),
            )
        };
        // An attempt continuing after it suspended carries the decisions about its calls.
        let resume = {
            let t = &entry.machine.state().tasks[task as usize];
            if t.suspensions == 0 {
                None
            } else {
                let mut decisions = Vec::with_capacity(t.decisions.len());
                for &seq in &t.decisions {
                    let d = self.store.approval_at(seq).await?;
                    let Some(call) = d.tool_call else { continue };
                    decisions.push(flotilla_model::task::ToolDecision {
                        approval_id: d.approval_id,
                        call_id: call.call_id,
                        digest: d.digest.unwrap_or_default(),
                        decision: d.decision,
                        by: d.by,
                    });
                }
                Some(flotilla_model::task::Resume {
                    segment: t.suspensions,
                    decisions,
                })
            }
        };
        let tool_gate = entry
            .machine
            .state()
            .hitl
            .as_ref()
            .and_then(|p| flotilla_machine::policy::hitl::tool_gate(p, sub));
        let mut previous_results = std::collections::BTreeMap::new();
        let mut dependency_results = std::collections::BTreeMap::new();
        if plan.config.pass_dependency_results {
            let direct = graph.deps(task).to_vec();
            for &d in &direct {
                let r = self.result_of(entry, d).await?.as_dependency();
                let id = plan.subtasks[d as usize].id.clone();
                previous_results.insert(id.clone(), r.clone());
                dependency_results.insert(id, r);
            }
            let mut budget = self.opts.previous_results_budget;
            // Direct dependencies' results are always passed; when together they would not
            // fit in a task message, each is cut to an equal share, marked as cut.
            let share = (self.bus.max_payload() / 2) / direct.len().max(1);
            for r in dependency_results
                .values_mut()
                .chain(previous_results.values_mut())
            {
                shorten_response(&mut r.response, share);
            }
            for a in graph.ancestors(task) {
                if direct.contains(&a) {
                    continue;
                }
                let r: DependencyResult = self.result_of(entry, a).await?.as_dependency();
                let size = r.response.len() + 64;
                if size > budget {
                    break;
                }
                budget -= size;
                previous_results.insert(plan.subtasks[a as usize].id.clone(), r);
            }
        }
        let root = root_of(entry.machine.state());
        let session = session_of(entry.machine.state());
        let description = match self.fill_placeholders(&sub.description, &session).await? {
            Ok(d) => d,
            Err(e) => return Ok(Err(e)),
        };
        let mut consumed = flotilla_model::workspace::ConsumedTopics::new();
        let mut budget = self.opts.consumed_budget;
        for topic in &sub.consumes {
            let (entries, next_since_seq, truncated) = self
                .store
                .topic_entries(
                    root,
                    topic,
                    0,
                    budget,
                    flotilla_model::workspace::MAX_READ_LIMIT,
                )
                .await?;
            let used: usize = entries
                .iter()
                .map(|e| serde_json::to_vec(&e.entry).map_or(0, |v| v.len()) + 128)
                .sum();
            budget = budget.saturating_sub(used);
            consumed.insert(
                topic.clone(),
                flotilla_model::workspace::ConsumedTopic {
                    entries,
                    next_since_seq,
                    truncated,
                },
            );
        }
        // A person approved this attempt with an edited input: it runs with theirs.
        let input = {
            let t = &entry.machine.state().tasks[task as usize];
            if t.edit_seq != 0 && t.approved == attempt {
                match self.store.approval_at(t.edit_seq).await?.decision {
                    flotilla_model::approval::Decision::Edit { input } => input,
                    _ => sub.input.clone(),
                }
            } else {
                sub.input.clone()
            }
        };
        Ok(Ok(TaskEnvelope {
            protocol: PROTOCOL_VERSION,
            run_id,
            root_run_id: (root != run_id).then_some(root),
            session_id: entry.machine.state().session_id,
            task_id: sub.id.clone(),
            attempt,
            attempt_id: attempt_id(run_id, task, attempt, attempt_ms),
            agent: sub.agent.clone(),
            pool: sub.pool.clone(),
            role: sub.role.clone(),
            description,
            action: sub.action.clone(),
            risk: sub.risk,
            required: sub.required,
            query: plan.query.clone(),
            input,
            timeout: sub.timeout.unwrap_or(plan.config.task_timeout),
            previous_results,
            dependency_results,
            consumes: sub.consumes.clone(),
            produces: sub.produces.clone(),
            budget: plan.config.budget(),
            budget_scopes: entry.machine.state().budget_scopes.clone(),
            output_schema: sub.output_schema.clone(),
            consumed,
            dataflow_validation: plan.config.dataflow_validation,
            dispatched_at: Timestamp::from_unix_ms(dispatched_ms),
            trace: trace.map(|t| child_trace(&t, run_id, task, attempt)),
            tool_gate,
            resume,
            client_tools: plan.config.client_tools.clone(),
            model: sub.model.clone(),
            // A fork at a step: every attempt of its fork point starts with the kept steps.
            kept_steps: plan
                .fork
                .as_ref()
                .filter(|f| f.task_id == sub.id)
                .and_then(|f| f.conversation.clone()),
            answer: None,
        }))
    }

    /// Fills `{key}` placeholders of a description from session state (`{key?}`: empty when
    /// unset). A missing required key is the task's `missing_state_key` failure.
    async fn fill_placeholders(
        &self,
        description: &str,
        session: &str,
    ) -> Result<Result<String, TaskError>, StepError> {
        let keys = placeholders(description);
        if keys.is_empty() {
            return Ok(Ok(description.to_owned()));
        }
        let mut values = HashMap::new();
        let mut missing = Vec::new();
        for (key, optional) in &keys {
            if values.contains_key(*key) {
                continue;
            }
            match self.store.state_value(session, key).await? {
                Some(v) => {
                    let text = match v {
                        serde_json::Value::String(s) => s,
                        other => other.to_string(),
                    };
                    values.insert(*key, text);
                }
                None if *optional => {
                    values.insert(*key, String::new());
                }
                None => missing.push(*key),
            }
        }
        if !missing.is_empty() {
            return Ok(Err(TaskError {
                kind: flotilla_model::task::TaskErrorKind::MissingStateKey,
                message: format!(
                    "the description needs session-state key(s) {} (session {session}), which are not set; a task's output_key sets one, as do `flotilla state set` and the state.set endpoint; write {{key?}} for an optional value",
                    missing.join(", ")
                ),
            }));
        }
        Ok(Ok(fill(description, &values)))
    }

    /// A failed result the coordinator records for an attempt it could not start.
    pub(super) fn coordinator_failure(
        &self,
        entry: &Cached,
        task: u32,
        attempt: u32,
        error: TaskError,
    ) -> Result<(String, wire::Outgoing), StepError> {
        let s = entry.machine.state();
        let run = s.run_id;
        let task_id = entry.machine.plan().subtasks[task as usize].id.clone();
        warn!(%run, task = %task_id, attempt, error = %error, "Task cannot start");
        let body = RunLogEntry {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            input: RunInput::TaskResult(Box::new(flotilla_model::runlog::TaskResultInput {
                task_id: task_id.clone(),
                attempt,
                attempt_id: attempt_id(
                    run,
                    task,
                    attempt,
                    s.tasks[task as usize].attempt_started_ms(),
                ),
                worker: "coordinator".into(),
                started_at: None,
                agent: None,
                result: TaskResult {
                    response: String::new(),
                    tokens: 0,
                    success: false,
                    tools_used: Vec::new(),
                    numeric_value: None,
                    error: Some(error),
                    confidence: None,
                },
                answered: false,
            })),
        };
        let out = wire::encode(
            &body,
            Codec::Json,
            Some(&flotilla_model::task::result_msg_id(run, &task_id, attempt)),
        )?;
        Ok((self.bus.names().runlog(run), out))
    }
}

/// The trace context of a task: same trace, a span id derived from run, task and attempt.
fn child_trace(parent: &TraceContext, run: RunId, task: u32, attempt: u32) -> TraceContext {
    let mut parts = parent.traceparent.split('-');
    let (version, trace_id) = (
        parts.next().unwrap_or("00"),
        parts.next().unwrap_or_default(),
    );
    let flags = parts.nth(1).unwrap_or("01");
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (run, task, attempt).hash(&mut h);
    TraceContext {
        traceparent: format!("{version}-{trace_id}-{:016x}-{flags}", h.finish() | 1),
        tracestate: parent.tracestate.clone(),
    }
}
