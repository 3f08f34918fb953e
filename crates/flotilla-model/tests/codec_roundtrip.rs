//! Every public message survives JSON and MessagePack unchanged.

use std::collections::BTreeMap;
use std::fmt::Debug;

use flotilla_model::api::{ApiError, GetRunRequest};
use flotilla_model::codec::Codec;
use flotilla_model::event::{
    Event, EventEnvelope, ExternalToolCall, StepEntry, StepToolCall, WorkflowEvent, WorkflowPhase,
};
use flotilla_model::ids::{AttemptId, RunId, SessionId, TaskId};
use flotilla_model::mailbox::{MailboxKind, MailboxMessage, MailboxPost};
use flotilla_model::plan::{
    DataflowValidation, Plan, PlanConfig, Risk, Strategy as PlanStrategy, Subtask,
};
use flotilla_model::run::*;
use flotilla_model::runlog::{RunInput, RunLogEntry, Submitted, TaskResultInput};
use flotilla_model::submit::{SubmitReply, SubmitRequest, SubmitStatus};
use flotilla_model::task::{
    DependencyResult, TaskEnvelope, TaskError, TaskErrorKind, TaskResult, TraceContext,
};
use flotilla_model::time::{Secs, Timestamp};
use flotilla_model::validate::{Problem, ProblemCode};
use flotilla_model::workspace::{WorkspaceEntry, WorkspaceWrite, Writer};
use proptest::collection::{btree_map, vec};
use proptest::option;
use proptest::prelude::*;
use serde::Serialize;
use serde::de::DeserializeOwned;
use uuid::Uuid;

fn roundtrip<T: Serialize + DeserializeOwned + PartialEq + Debug>(
    value: &T,
) -> Result<(), TestCaseError> {
    for codec in [Codec::Json, Codec::MsgPack] {
        let bytes = codec
            .encode(value)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let back: T = codec
            .decode(&bytes)
            .map_err(|e| TestCaseError::fail(format!("{codec:?}: {e}")))?;
        prop_assert_eq!(&back, value, "{:?}", codec);
    }
    Ok(())
}

fn text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9 _.%$売上成長率-]{0,24}"
}
fn token() -> BoxedStrategy<String> {
    "[a-z][a-z0-9_]{0,10}".boxed()
}
fn run_id() -> impl Strategy<Value = RunId> {
    any::<u128>().prop_map(|n| RunId::from_uuid(Uuid::from_u128(n)))
}
fn attempt_id() -> impl Strategy<Value = AttemptId> {
    any::<u128>().prop_map(|n| AttemptId::from_uuid(Uuid::from_u128(n)))
}
fn task_id() -> impl Strategy<Value = TaskId> {
    token().prop_map(TaskId::new)
}
fn ts() -> impl Strategy<Value = Timestamp> {
    (0i64..4_000_000_000_000).prop_map(Timestamp::from_unix_ms)
}
fn secs() -> impl Strategy<Value = Secs> {
    prop_oneof![
        (1u64..100_000).prop_map(Secs::from_secs),
        (1u64..100_000).prop_map(Secs::from_millis)
    ]
}
fn finite() -> impl Strategy<Value = f64> {
    -1.0e12f64..1.0e12
}
fn json() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        finite().prop_map(serde_json::Value::from),
        text().prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
            btree_map(token(), inner, 0..4)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}
fn labels() -> impl Strategy<Value = BTreeMap<String, String>> {
    btree_map(token(), text(), 0..3)
}
fn risk() -> impl Strategy<Value = Risk> {
    prop_oneof![
        Just(Risk::Low),
        Just(Risk::Medium),
        Just(Risk::High),
        Just(Risk::Critical)
    ]
}
fn subtask() -> impl Strategy<Value = Subtask> {
    (
        (
            task_id(),
            text(),
            option::of(token()),
            option::of(token()),
            token(),
        ),
        (vec(task_id(), 0..3), vec(token(), 0..2), vec(token(), 0..2)),
        (
            option::of(token()),
            risk(),
            any::<bool>(),
            option::of(secs()),
            json(),
            option::of(token()),
        ),
    )
        .prop_map(
            |(
                (id, description, role, agent, pool),
                (dependencies, produces, consumes),
                (action, risk, required, timeout, input, output_key),
            )| Subtask {
                id,
                description,
                role,
                agent,
                pool,
                dependencies,
                produces,
                consumes,
                action,
                risk,
                compensate: None,
                required,
                timeout,
                input,
                output_schema: None,
                model: output_key.clone().map(|k| format!("model-{k}")),
                output_key,
            },
        )
}
fn plan_config() -> impl Strategy<Value = PlanConfig> {
    (
        1u32..100,
        secs(),
        secs(),
        any::<bool>(),
        prop_oneof![
            Just(DataflowValidation::Strict),
            Just(DataflowValidation::Lenient)
        ],
        0u32..10,
        0.0f64..1.0,
        prop_oneof![
            Just(PlanStrategy::Auto),
            Just(PlanStrategy::Simple),
            Just(PlanStrategy::Dag),
            Just(PlanStrategy::Supervisor)
        ],
    )
        .prop_map(
            |(
                max_concurrency,
                dependency_timeout,
                task_timeout,
                pass,
                dataflow,
                max_retries,
                failure_ratio,
                strategy,
            )| PlanConfig {
                max_concurrency,
                dependency_timeout,
                task_timeout,
                pass_dependency_results: pass,
                dataflow_validation: dataflow,
                max_retries,
                failure_ratio,
                strategy,
                max_tokens: Some(u64::from(max_retries) * 1000 + 1),
                max_cost: None,
                recruit_roles: None,
                max_recruits: None,
                lead_timeout: task_timeout,
                hitl: (max_retries % 2 == 0).then(|| flotilla_model::approval::PlanHitl {
                    mode: Some(flotilla_model::approval::HitlMode::HumanInCommand),
                    sensitive_actions: vec!["deploy".into()],
                    approval_timeout: Some(task_timeout),
                    low_confidence: Some(0.75),
                }),
                client_tools: if max_retries % 3 == 0 {
                    vec![flotilla_model::plan::ClientTool {
                        name: "pick_file".into(),
                        description: "Asks the user's editor for a file".into(),
                        parameters: serde_json::json!({"type": "object"}),
                    }]
                } else {
                    Vec::new()
                },
            },
        )
}
fn plan() -> impl Strategy<Value = Plan> {
    (
        option::of(text()),
        option::of(text()),
        vec(subtask(), 0..4),
        plan_config(),
    )
        .prop_map(|(name, query, subtasks, config)| Plan {
            fork: None,
            name,
            query,
            subtasks,
            config,
        })
}
fn problem() -> impl Strategy<Value = Problem> {
    (
        prop_oneof![
            Just(ProblemCode::Cycle),
            Just(ProblemCode::MissingProducer),
            Just(ProblemCode::Malformed)
        ],
        text(),
        text(),
        vec(token(), 0..3),
        option::of(token()),
    )
        .prop_map(|(code, path, message, tasks, topic)| Problem {
            code,
            path,
            message,
            tasks,
            topic,
            quota: None,
        })
}
fn error_kind() -> impl Strategy<Value = TaskErrorKind> {
    prop_oneof![
        Just(TaskErrorKind::AgentFailed),
        Just(TaskErrorKind::Timeout),
        Just(TaskErrorKind::DependencyTimeout),
        Just(TaskErrorKind::RedeliveriesExhausted),
        Just(TaskErrorKind::UnknownAgent),
        Just(TaskErrorKind::Internal),
    ]
}
fn task_error() -> impl Strategy<Value = TaskError> {
    (error_kind(), text()).prop_map(|(kind, message)| TaskError { kind, message })
}
fn dep_result() -> impl Strategy<Value = DependencyResult> {
    (
        text(),
        any::<u32>(),
        any::<bool>(),
        vec(token(), 0..2),
        option::of(finite()),
    )
        .prop_map(
            |(response, tokens, success, tools_used, numeric_value)| DependencyResult {
                response,
                tokens: u64::from(tokens),
                success,
                tools_used,
                numeric_value,
            },
        )
}
fn task_result() -> impl Strategy<Value = TaskResult> {
    (dep_result(), option::of(task_error())).prop_map(|(d, error)| TaskResult {
        response: d.response,
        tokens: d.tokens,
        success: d.success,
        tools_used: d.tools_used,
        numeric_value: d.numeric_value,
        confidence: d.tokens.is_multiple_of(2).then_some(0.25),
        error,
    })
}
fn trace() -> impl Strategy<Value = TraceContext> {
    ("00-[0-9a-f]{32}-[0-9a-f]{16}-01", option::of(text())).prop_map(|(traceparent, tracestate)| {
        TraceContext {
            traceparent,
            tracestate,
        }
    })
}
fn handle() -> impl Strategy<Value = RunHandle> {
    (run_id(), option::of(run_id()), option::of(token())).prop_map(|(run_id, parent, call)| {
        RunHandle {
            run_id,
            agent_id: None,
            parent_run_id: parent,
            parent_tool_call_id: call,
            parent_task_id: None,
            root_run_id: parent,
        }
    })
}
fn run_status() -> impl Strategy<Value = RunStatus> {
    prop_oneof![
        Just(RunStatus::Pending),
        Just(RunStatus::Running),
        Just(RunStatus::Succeeded),
        Just(RunStatus::Failed),
        Just(RunStatus::Rejected),
        Just(RunStatus::Cancelled),
    ]
}
fn outcome() -> impl Strategy<Value = RunOutcome> {
    (
        run_id(),
        run_status(),
        option::of((
            text(),
            option::of(finite()),
            btree_map(task_id(), dep_result(), 0..3),
        )),
        vec((task_id(), 1u32..5, task_error()), 0..2),
        vec((task_id(), text()), 0..2),
        option::of(text()),
        (0u32..3, any::<bool>()),
    )
        .prop_map(
            |(run_id, status, fr, failed, skipped, reason, (omitted, partial))| RunOutcome {
                run_id,
                status,
                final_result: fr.map(|(response, numeric_value, results)| FinalResult {
                    response,
                    numeric_value,
                    results,
                    partial,
                    omitted,
                    artifact: (omitted > 0).then(|| flotilla_model::artifact::ArtifactRef {
                        bucket: "flotilla-artifacts".into(),
                        name: format!("runs/{run_id}/final-result.json"),
                        size: 2_000_000,
                        sha256: "ab".repeat(32),
                    }),
                }),
                failed: failed
                    .into_iter()
                    .map(|(task_id, attempts, error)| FailedTask {
                        task_id,
                        attempts,
                        error,
                    })
                    .collect(),
                skipped: skipped
                    .into_iter()
                    .map(|(task_id, reason)| SkippedTask { task_id, reason })
                    .collect(),
                failed_omitted: omitted,
                skipped_omitted: omitted * 2,
                cause: (!partial).then_some(flotilla_model::run::EndCause::BudgetExhausted),
                reason,
                rollback_run_id: partial.then_some(run_id),
            },
        )
}
fn record() -> impl Strategy<Value = RunRecord> {
    (
        handle(),
        option::of(text()),
        run_status(),
        labels(),
        ts(),
        option::of(ts()),
        (0u32..9, 0u32..9),
        vec(problem(), 0..2),
        option::of(outcome()),
    )
        .prop_map(
            |(
                handle,
                name,
                status,
                labels,
                created_at,
                finished_at,
                (total, ok),
                errors,
                outcome,
            )| RunRecord {
                fork_of: None,
                handle,
                name,
                status,
                labels,
                session_id: Some(SessionId::from_uuid(Uuid::from_u128(7))),
                created_at,
                finished_at,
                tasks: TaskCounts {
                    total,
                    succeeded: ok,
                    ..TaskCounts::default()
                },
                errors,
                warnings: Vec::new(),
                outcome,
                strategy: Some(flotilla_model::plan::StrategyChoice {
                    strategy: flotilla_model::plan::Strategy::Dag,
                    reason: "auto: 2 subtasks".into(),
                }),
                planning: None,
                memory: None,
            },
        )
}
fn workflow() -> impl Strategy<Value = Event> {
    (
        prop_oneof![
            Just(WorkflowPhase::RunStarted),
            Just(WorkflowPhase::TaskStarted),
            Just(WorkflowPhase::TaskRetrying),
            Just(WorkflowPhase::RunSucceeded),
            Just(WorkflowPhase::RunPlanned),
            Just(WorkflowPhase::PlanRepairing)
        ],
        option::of(1u32..100),
        option::of(token()),
        option::of(task_error()),
        option::of(ts()),
        option::of(text()),
        option::of(outcome()),
    )
        .prop_map(
            |(phase, tasks_total, worker, error, retry_at, detail, outcome)| {
                Event::Workflow(WorkflowEvent {
                    approval_id: detail.as_ref().map(|_| "t0a1".into()),
                    incident: detail.as_ref().map(|d| format!("incident: {d}")),
                    phase,
                    tasks_total,
                    agent: worker.clone(),
                    role: worker.as_ref().map(|w| format!("{w}-role")),
                    worker,
                    started_at: None,
                    error,
                    retry_at,
                    strategy: detail
                        .as_ref()
                        .map(|d| flotilla_model::plan::StrategyChoice {
                            strategy: flotilla_model::plan::Strategy::Simple,
                            reason: d.clone(),
                        }),
                    problems: if tasks_total.is_some() {
                        vec![flotilla_model::validate::Problem::new(
                            flotilla_model::validate::ProblemCode::Cycle,
                            "subtasks[0]",
                            "a cycle",
                        )]
                    } else {
                        Vec::new()
                    },
                    detail,
                    outcome: outcome.map(Box::new),
                    memory: None,
                })
            },
        )
}
fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        (text(), any::<bool>())
            .prop_map(|(text, is_final)| Event::AssistantReply { text, is_final }),
        text().prop_map(|text| Event::PlannerThought { text }),
        (token(), token(), json()).prop_map(|(call_id, tool, input)| Event::ToolStart {
            call_id,
            tool,
            input
        }),
        (token(), json()).prop_map(|(call_id, output)| Event::ToolUpdate { call_id, output }),
        (
            (token(), any::<bool>(), json(), option::of(handle())),
            (
                option::of(token()),
                option::of(any::<u32>()),
                option::of(text())
            )
        )
            .prop_map(
                |((call_id, ok, output, run_link), (tool, duration, error))| Event::ToolEnd {
                    call_id,
                    ok,
                    output,
                    run_link,
                    tool,
                    duration_ms: duration.map(u64::from),
                    error,
                }
            ),
        (text(), token())
            .prop_map(|(question, token)| Event::AwaitClarification { question, token }),
        vec((token(), token(), json(), token()), 0..3).prop_map(|calls| {
            Event::AwaitExternalTools {
                calls: calls
                    .into_iter()
                    .map(|(call_id, tool, input, token)| ExternalToolCall {
                        call_id,
                        tool,
                        input,
                        token,
                    })
                    .collect(),
            }
        }),
        (
            any::<u32>(),
            any::<u32>(),
            option::of(token()),
            option::of(any::<u32>())
        )
            .prop_map(|(p, c, model, latency)| Event::Usage {
                prompt_tokens: p.into(),
                completion_tokens: c.into(),
                model,
                latency_ms: latency.map(u64::from),
                cost_usd: latency.map(|l| f64::from(l) / 1000.0),
            }),
        workflow(),
        (handle(), option::of(token()))
            .prop_map(|(child, agent)| Event::AgentRunStarted { child, agent }),
        (
            attempt_id(),
            any::<u32>(),
            text(),
            vec((token(), token(), text()), 0..3),
            any::<u32>()
        )
            .prop_map(|(attempt_id, step, content, calls, n)| Event::AgentStep {
                attempt_id,
                step,
                entry: StepEntry::ModelReply {
                    content,
                    tool_calls: calls
                        .into_iter()
                        .map(|(id, name, arguments)| StepToolCall {
                            id,
                            name,
                            arguments
                        })
                        .collect(),
                    prompt_tokens: n.into(),
                    completion_tokens: 1,
                    model: "m".into(),
                },
            }),
        (attempt_id(), vec(text(), 0..3)).prop_map(|(attempt_id, results)| Event::AgentStep {
            attempt_id,
            step: 1,
            entry: StepEntry::ToolResults { results },
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn plan_roundtrips(p in plan()) { roundtrip(&p)?; }

    #[test]
    fn submit_request_roundtrips(p in plan(), run in option::of(run_id()), key in option::of(text()), labels in labels(), wait in any::<bool>(), parent in option::of(handle())) {
        let mut r = SubmitRequest::new(p);
        r.run_id = run;
        r.idempotency_key = key;
        r.labels = labels;
        r.wait = wait;
        r.parent = parent;
        r.reply_to = Some("_INBOX.x".into());
        roundtrip(&r)?;
    }

    #[test]
    fn submit_reply_roundtrips(run in option::of(run_id()), errors in vec(problem(), 0..3), outcome in option::of(outcome()), status in prop_oneof![Just(SubmitStatus::Accepted), Just(SubmitStatus::Duplicate), Just(SubmitStatus::Rejected), Just(SubmitStatus::Finished)]) {
        let run_status = (status == SubmitStatus::Duplicate).then_some(RunStatus::Running);
        roundtrip(&SubmitReply { protocol: 1, run_id: run, status, errors, warnings: Vec::new(), outcome, run_status })?;
    }

    #[test]
    fn task_envelope_roundtrips(
        (run_id, task_id, attempt, attempt_id) in (run_id(), task_id(), 1u32..5, attempt_id()),
        (agent, pool, role, description) in (option::of(token()), token(), option::of(token()), text()),
        (risk, required, input, timeout) in (risk(), any::<bool>(), json(), secs()),
        (prev, deps) in (btree_map(task_id(), dep_result(), 0..3), btree_map(task_id(), dep_result(), 0..3)),
        (dispatched_at, trace) in (ts(), option::of(trace())),
    ) {
        roundtrip(&TaskEnvelope {
            protocol: 1, run_id, root_run_id: Some(run_id), session_id: None, task_id, attempt, attempt_id, agent, pool, role, description,
            action: Some("read".into()), risk, required, query: Some("q".into()), input, timeout,
            previous_results: prev, dependency_results: deps, consumes: vec!["raw".into()],
            produces: Vec::new(),
            output_schema: Some(serde_json::json!({"type": "object"})),
            budget: Some(flotilla_model::task::Budget { max_tokens: Some(500), max_cost: Some(0.25) }),
            budget_scopes: Vec::new(),
            consumed: [("raw".to_string(), flotilla_model::workspace::ConsumedTopic {
                entries: vec![WorkspaceEntry { seq: 3, topic: "raw".into(), entry: Default::default(), writer: None, ts: dispatched_at }],
                next_since_seq: 3, truncated: true,
            })].into_iter().collect(),
            dataflow_validation: flotilla_model::plan::DataflowValidation::Lenient,
            dispatched_at, trace,
            tool_gate: required.then(|| flotilla_model::task::ToolGate { all: attempt % 2 == 0, sensitive: vec!["send_email".into()], out_of_scope: true, cost_limit: Some(0.5), budget_ask: true }),
            resume: (attempt > 1).then(|| flotilla_model::task::Resume { segment: attempt - 1, decisions: vec![flotilla_model::task::ToolDecision {
                approval_id: "t0a1c1".into(), call_id: "call_1".into(), digest: "ab".into(),
                decision: flotilla_model::approval::Decision::Reject { message: "no".into() }, by: "alice".into(),
            }] }),
            client_tools: if required { vec![flotilla_model::plan::ClientTool {
                name: "open_file".into(), description: "Opens a file in the user's editor".into(),
                parameters: serde_json::json!({"type": "object", "properties": {"path": {"type": "string"}}}),
            }] } else { Vec::new() },
            model: required.then(|| "qwen2.5:7b".into()),
            kept_steps: (attempt > 2).then_some(flotilla_model::plan::KeptSteps { run_id, attempt_id, steps: attempt }),
            answer: (attempt == 1).then(|| flotilla_model::task::TaskAnswer { reply_to: vec!["_INBOX.a.b".into()], after_seq: attempt.into(), final_result_budget: 65_536, review_below: Some(0.6) }),
        })?;
    }

    #[test]
    fn task_result_roundtrips(r in task_result()) { roundtrip(&r)?; }

    #[test]
    fn runlog_entry_roundtrips(
        run_id in run_id(),
        which in 0u8..19,
        p in plan(),
        labels in labels(),
        (task_id, attempt, attempt_id, result, started) in (task_id(), 1u32..4, attempt_id(), task_result(), option::of(ts())),
        generation in any::<u64>(),
        trace in option::of(trace()),
    ) {
        let input = match which {
            0 => RunInput::Submitted(Box::new(Submitted { plan: p, labels, session_id: None, parent: None, reply_to: None, wait_reply_to: Some("_INBOX.w".into()), intake_seq: Some(generation), warnings: Vec::new(), trace, planning: None, depth: (generation % 3) as u32, budget_scopes: vec![flotilla_model::task::BudgetScope { run_id, limits: flotilla_model::task::Budget { max_tokens: Some(generation), max_cost: None } }], anycast: generation % 2 == 0, memory: None, lead: (generation % 2 == 1).then(|| "lead".into()), hitl: Some(default_hitl_policy()) })),
            1 => RunInput::TaskResult(Box::new(TaskResultInput { task_id, attempt, attempt_id, worker: "w1".into(), started_at: started, agent: None, result, answered: attempt == 2 })),
            2 => RunInput::Rejected(Box::new(flotilla_model::runlog::Rejected {
                errors: vec![flotilla_model::validate::Problem::new(flotilla_model::validate::ProblemCode::Cycle, "subtasks[0]", "cycle")],
                name: p.name.clone(), labels, reply_to: Some("a.b".into()), intake_seq: None,
            })),
            3 => RunInput::Control(flotilla_model::runlog::Control {
                action: flotilla_model::runlog::ControlAction::Cancel, reason: Some("stop".into()), by: None, timeout_ms: None, rollback: true, task_id: None, reply_to: None,
            }),
            4 => RunInput::TopicWritten { topic: "figures".into(), seq: generation },
            5 => RunInput::Planned(Box::new(flotilla_model::runlog::Planned {
                round: attempt,
                decision: flotilla_model::runlog::PlanDecision::Accepted { plan: p, warnings: Vec::new() },
            })),
            6 => RunInput::Planned(Box::new(flotilla_model::runlog::Planned {
                round: attempt,
                decision: flotilla_model::runlog::PlanDecision::Repair {
                    plan: p,
                    problems: vec![flotilla_model::validate::Problem::new(flotilla_model::validate::ProblemCode::UnknownDependency, "subtasks[0].dependencies[0]", "no such task")],
                },
            })),
            7 => RunInput::Planned(Box::new(flotilla_model::runlog::Planned {
                round: attempt,
                decision: flotilla_model::runlog::PlanDecision::Failed { problems: Vec::new() },
            })),
            8 => RunInput::Submitted(Box::new(Submitted { plan: p, labels, session_id: None, parent: None, reply_to: None, wait_reply_to: None, intake_seq: None, warnings: Vec::new(), trace, planning: Some(flotilla_model::runlog::PlanningSpec { query: "why?".into(), max_repairs: generation as u32 % 5 }), depth: 0, budget_scopes: Vec::new(), anycast: false, memory: None, lead: None, hitl: None })),
            9 => RunInput::Claimed(Box::new(flotilla_model::runlog::Claimed { task_id, attempt, attempt_id, worker: "w1".into(), agent: "analyst".into(), role: "research".into() })),
            10 => RunInput::TaskResult(Box::new(TaskResultInput { task_id, attempt, attempt_id, worker: "w2".into(), started_at: started, agent: Some("analyst".into()), result, answered: false })),
            11 => RunInput::Assigned(Box::new(flotilla_model::runlog::Assigned { task_id, by: "lead".into(), reason: "next".into() })),
            12 => RunInput::Finished(Box::new(flotilla_model::runlog::Finished { result: result.response, by: "lead".into() })),
            13 => RunInput::ApprovalDecided(Box::new(flotilla_model::approval::ApprovalDecided { approval_id: "t0a1".into(), task_id, attempt, status: flotilla_model::approval::ApprovalStatus::Decided, decision: flotilla_model::approval::Decision::Respond { result: result.response }, by: "alice".into(), tool_call: None, digest: None, incident: true, comment: Some("checked".into()), at: Some(flotilla_model::time::Timestamp::from_unix_ms(1_700_000_000_000)), always: true, reply_to: Some("_INBOX.x".into()) })),
            14 => RunInput::ApprovalDecided(Box::new(flotilla_model::approval::ApprovalDecided { approval_id: "t0a1".into(), task_id, attempt, status: flotilla_model::approval::ApprovalStatus::Expired, decision: flotilla_model::approval::Decision::Edit { input: serde_json::json!({"a": [1, 2]}) }, by: "deadline".into(), tool_call: Some(flotilla_model::approval::ToolCallRef { call_id: "call_1".into(), tool: "send_email".into() }), digest: Some("ab".into()), incident: false, comment: None, at: None, always: false, reply_to: None })),
            15 => RunInput::Control(flotilla_model::runlog::Control {
                action: [flotilla_model::runlog::ControlAction::Pause, flotilla_model::runlog::ControlAction::Resume, flotilla_model::runlog::ControlAction::Takeover][generation as usize % 3], reason: Some("look".into()), by: Some("alice".into()), timeout_ms: Some(generation), rollback: false, task_id: (generation % 2 == 0).then(|| TaskId::new("t1")), reply_to: (generation % 3 == 0).then(|| "_INBOX.abc".into()),
            }),
            16 => RunInput::Completed(Box::new(flotilla_model::control::Completed { task_id, result: result.response, by: "alice".into(), comment: Some("done by hand".into()) })),
            17 => RunInput::Suspended(Box::new(flotilla_model::runlog::Suspended { task_id, attempt, attempt_id, worker: "w1".into(), segment: attempt - 1, call: (attempt % 3 != 0).then(|| flotilla_model::runlog::SuspendedCall {
                trigger: flotilla_model::approval::Trigger::Question, call_id: "call_2".into(), tool: "ask_user".into(),
                arguments: serde_json::json!({"question": "which?"}), digest: "cd".into(), question: Some("which?".into()),
            }) })),
            _ => RunInput::TimerFired { generation },
        };
        roundtrip(&RunLogEntry { protocol: 1, run_id, input })?;
    }

    #[test]
    fn event_roundtrips(run_id in run_id(), e in event(), task in option::of(task_id()), attempt in option::of(1u32..4), at in ts(), id in token()) {
        roundtrip(&EventEnvelope { protocol: 1, id, run_id, task_id: task, attempt, ts: at, source: "coordinator".into(), event: e })?;
    }

    #[test]
    fn run_record_and_view_roundtrip(record in record(), tasks in vec((task_id(), 0u32..4, option::of(task_error()), option::of(text()), option::of(ts())), 0..4)) {
        roundtrip(&record)?;
        let view = RunView {
            record,
            tasks: tasks.into_iter().map(|(task_id, attempts, error, skip_reason, dispatched_at)| TaskView {
                task_id, status: TaskStatus::Waiting, attempts, error, skip_reason, dispatched_at, pool: Some("gpu".into()), paused_until: dispatched_at,
            }).collect(),
            tasks_offset: 7,
            plan: None,
            team: vec![flotilla_model::recruit::TeamChange { kind: flotilla_model::recruit::TeamChangeKind::Recruited, id: "r1".into(), member: "role:patents".into(), task_id: Some(TaskId::new("recruit-r1")), reassigned: Vec::new(), failed: Vec::new(), by: "operator".into(), reason: "why".into(), refusal: None, seq: 3, at: Timestamp::from_unix_ms(5) }],
        };
        roundtrip(&view)?;
    }

    #[test]
    fn mailbox_message_roundtrips(run_id in run_id(), from in token(), to in token(), payload in json(), at in ts(), corr in option::of(token()), n in any::<u64>(),
        kind in prop_oneof![Just(MailboxKind::Request), Just(MailboxKind::Offer), Just(MailboxKind::Accept), Just(MailboxKind::Delegation), Just(MailboxKind::Info)]) {
        let sender = Some(Writer { run_id, task_id: Some(TaskId::new(from.as_str())), attempt: Some(2), by: None });
        roundtrip(&MailboxPost { protocol: 1, kind, from: from.clone(), to: to.clone(), payload: payload.clone(), correlation_id: corr.clone(), n, sender: sender.clone() })?;
        roundtrip(&MailboxMessage { seq: n, ts: at, kind, from, to, payload, correlation_id: corr, n, sender })?;
    }

    #[test]
    fn workspace_entry_roundtrips(seq in any::<u64>(), run_id in run_id(), topic in token(), value in json(), producer in option::of(task_id()), at in ts()) {
        let mut entry = serde_json::Map::new();
        entry.insert("value".into(), value);
        let writer = Some(Writer { run_id, task_id: producer, attempt: None, by: Some("operator".into()) });
        roundtrip(&WorkspaceWrite { protocol: 1, entry: entry.clone(), writer: writer.clone() })?;
        roundtrip(&WorkspaceEntry { seq, topic, entry, writer, ts: at })?;
    }

    #[test]
    fn api_messages_roundtrip(run_id in run_id(), status in 400u16..600, code in token(), message in text()) {
        roundtrip(&GetRunRequest { protocol: 1, run_id, tasks_offset: 3, tasks_limit: Some(10), task_id: None })?;
        roundtrip(&flotilla_model::api::CancelRunRequest { protocol: 1, run_id, reason: Some(message.clone()), by: None, rollback: true })?;
        roundtrip(&flotilla_model::api::CancelRunReply { protocol: 1, run_id, cancelling: true, status: RunStatus::Running, rollback_run_id: Some(run_id) })?;
        roundtrip(&flotilla_model::control::PauseRunRequest { protocol: 1, run_id, reason: Some(message.clone()), by: Some(code.clone()), timeout_ms: Some(5000), children: false, task_id: Some(TaskId::new("t1")) })?;
        roundtrip(&flotilla_model::control::ResumeRunRequest { protocol: 1, run_id, reason: None, by: None, children: true, task_id: None })?;
        roundtrip(&flotilla_model::control::TakeoverRunRequest { protocol: 1, run_id, reason: None, by: Some(code.clone()), timeout_ms: None, children: true })?;
        roundtrip(&flotilla_model::control::CompleteTaskRequest { protocol: 1, run_id, task_id: flotilla_model::TaskId::new("t1"), result: message.clone(), by: code.clone(), comment: None })?;
        roundtrip(&flotilla_model::control::ControlRunReply { protocol: 1, run_id, applied: true, status: RunStatus::HumanControl, children: vec![run_id], context: Some(Box::new(flotilla_model::control::TakeoverContext {
            run_id, status: RunStatus::Paused, tasks_total: 3, step: 1,
            completed: vec![flotilla_model::control::ContextResult { task_id: flotilla_model::TaskId::new("a"), by: "human:alice".into(), result: message.clone(), truncated: true }],
            pending: vec![flotilla_model::control::PendingTask { task_id: flotilla_model::TaskId::new("b"), status: flotilla_model::run::TaskStatus::Waiting, waiting_on: vec![flotilla_model::TaskId::new("a")], ready: false }],
            failed: Vec::new(),
            suggested_next: flotilla_model::control::SuggestedAction { action: "resume".into(), task_id: None, detail: message.clone() },
            failure_reason: None, omitted: 2,
        })), task_id: None, detail: None, pending: false })?;
        roundtrip(&flotilla_model::control::ControlRunReply { protocol: 1, run_id, applied: true, status: RunStatus::Running, children: Vec::new(), context: None, task_id: Some(TaskId::new("t1")), detail: Some(message.clone()), pending: true })?;
        roundtrip(&flotilla_model::control::ControlVerdict { protocol: 1, run_id, seq: 7, applied: false, status: RunStatus::Paused, detail: Some(message.clone()) })?;
        roundtrip(&ApiError { status, code: code.clone(), message: message.clone(), current_revision: None, rule: None, problems: Vec::new() })?;
        roundtrip(&ApiError { status, code: code.clone(), message: message.clone(), current_revision: Some(7), rule: Some("team_full".into()), problems: Vec::new() })?;
        roundtrip(&flotilla_model::api::WsReadRequest { protocol: 1, run_id, topic: Some(code.clone()), since_seq: 7, limit: Some(5) })?;
        roundtrip(&flotilla_model::api::MboxReadRequest { protocol: 1, run_id, reader: code.clone(), since_seq: None, limit: None, wait_ms: Some(100), commit: true })?;
        roundtrip(&flotilla_model::api::MboxSendRequest { protocol: 1, run_id, from: code.clone(), to: "*".into(), kind: MailboxKind::Info, payload: serde_json::json!({"m": message}), correlation_id: None, attempt: Some(1), idempotency_key: None })?;
        roundtrip(&flotilla_model::api::StateSetRequest { protocol: 1, run_id: Some(run_id), session_id: None, key: code.clone(), value: serde_json::json!([1, 2]), expected_revision: Some(0) })?;
        roundtrip(&flotilla_model::api::StateGetRequest { protocol: 1, run_id: None, session_id: None, key: code })?;
    }
}

#[test]
fn msgpack_is_selected_by_content_type() {
    assert_eq!(
        Codec::from_content_type(Some("application/msgpack")),
        Codec::MsgPack
    );
    assert_eq!(
        Codec::from_content_type(Some("application/json")),
        Codec::Json
    );
    assert_eq!(Codec::from_content_type(None), Codec::Json);
}

#[test]
fn newer_protocol_versions_are_refused() {
    use flotilla_model::codec::check_protocol;
    assert!(check_protocol(1).is_ok());
    assert!(check_protocol(0).is_err());
    let err = check_protocol(99).expect_err("future version");
    assert_eq!(err.to_problem().code, ProblemCode::UnsupportedProtocol);
}

/// The policy the default `[hitl]` section admits a run with (what
/// `flotilla_machine::policy::hitl::resolve` gives; written out here, as the model's tests do
/// not depend on the machine).
fn default_hitl_policy() -> flotilla_model::approval::HitlPolicy {
    flotilla_model::approval::HitlPolicy {
        mode: flotilla_model::approval::HitlMode::HumanInTheLoop,
        sensitive_actions: ["delete", "publish", "pay", "send_email"]
            .map(str::to_owned)
            .to_vec(),
        sensitive_risk: None,
        timeout: flotilla_model::approval::DEFAULT_APPROVAL_TIMEOUT,
        on_timeout: Default::default(),
        modes: std::collections::BTreeMap::new(),
        default_agent: None,
        consecutive_failures: 0,
        out_of_scope: false,
        low_confidence: 0.6,
        cost_limit: None,
        budget_ask: false,
    }
}
