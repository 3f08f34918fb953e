//! Humans in the loop, approvals: a sensitive task waits for a person without holding a
//! worker slot; approve, reject (required fails the run, optional is skipped), edit,
//! respond; the deadline's default applied once; racing answers; bound to the digest; bad
//! answers refused and changing nothing; a cancelled run withdraws its approvals; modes.
//! Services run in-process against a real nats-server; agents are the deterministic
//! `scripted` test agent.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use flotilla_coordinator::CoordinatorOptions;
use flotilla_machine::policy::HitlConfig;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::approval::{
    AnswerOutcome, ApprovalAnswerReply, ApprovalAnswerRequest, ApprovalGetRequest, ApprovalRecord,
    ApprovalStatus, Decision, DefaultDecision, HitlMode, OnTimeout, Trigger,
};
use flotilla_model::ids::RunId;
use flotilla_model::plan::Subtask;
use flotilla_model::run::{EndCause, RunStatus, TaskStatus};
use flotilla_model::submit::SubmitRequest;
use flotilla_model::time::Secs;
use flotilla_worker::WorkerOptions;
use futures::StreamExt;
use support::*;

const ASK: Duration = Duration::from_secs(5);

async fn services(hitl: HitlConfig) -> anyhow::Result<InProcess> {
    let mut agents = BTreeMap::new();
    // Always fails (the deterministic test double's scripted failure).
    agents.insert(
        "flaky".to_string(),
        flotilla_worker::agents::AgentDefinition::Scripted(
            flotilla_worker::agents::ScriptedConfig {
                reply: "never".into(),
                fail_first: 1000,
                failure: "the source is down".into(),
                ..Default::default()
            },
        ),
    );
    agents.insert(
        "bot".to_string(),
        flotilla_worker::agents::AgentDefinition::Scripted(
            flotilla_worker::agents::ScriptedConfig {
                reply: "{task_id} done with {input} after [{dependency_numbers}]".into(),
                ..Default::default()
            },
        ),
    );
    // Answers with its input: a JSON input with a `confidence` states how sure it is.
    agents.insert(
        "echo".to_string(),
        flotilla_worker::agents::AgentDefinition::Scripted(
            flotilla_worker::agents::ScriptedConfig {
                reply: "{input}".into(),
                ..Default::default()
            },
        ),
    );
    let opts = CoordinatorOptions {
        hitl,
        ..CoordinatorOptions::default()
    };
    InProcess::start_configured(
        1,
        agents,
        WorkerOptions {
            started_event_delay: Duration::ZERO,
            ..WorkerOptions::default()
        },
        opts,
    )
    .await
}

fn sensitive(id: &str, after: &[&str]) -> Subtask {
    let mut s = Subtask::new(id, "publish the report").after(after);
    s.action = Some("publish".into());
    s.input = serde_json::json!({"channel": "news"});
    s
}

/// The run's approvals, once `n` are listed (pending only unless `all`).
async fn approvals(
    f: &InProcess,
    run: RunId,
    all: bool,
    n: usize,
) -> anyhow::Result<Vec<ApprovalRecord>> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let l = approvals_of(&f.client, run, all).await?;
        if l.len() >= n {
            return Ok(l);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "run {run} has {} approvals, not {n}",
            l.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn answer(run: RunId, id: &str, decision: Decision) -> ApprovalAnswerRequest {
    ApprovalAnswerRequest {
        protocol: PROTOCOL_VERSION,
        run_id: run,
        approval_id: id.into(),
        decision,
        by: "alice".into(),
        comment: Some("looked at it".into()),
        digest: None,
        always: false,
        incident: false,
    }
}

/// A task's status in the run's view (once the run's start is recorded).
async fn task_status(f: &InProcess, run: RunId, task: &str) -> anyhow::Result<TaskStatus> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let view = f.client.run(run).await?.expect("the run exists");
        if let Some(t) = view.tasks.iter().find(|t| t.task_id.as_str() == task) {
            return Ok(t.status);
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "no task {task}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_sensitive_task_waits_until_approved_and_a_second_answer_is_told_what_decided()
-> anyhow::Result<()> {
    let f = services(HitlConfig::default()).await?;
    let mut notices = f
        .bus
        .client()
        .subscribe(format!("{}.notify.approval.*", f.bus.names().prefix()))
        .await?;
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("draft", "write it"),
            sensitive("publish", &["draft"]),
            Subtask::new("announce", "tell people").after(&["publish"]),
        ])))
        .await?;
    let pending = approvals(&f, run, false, 1).await?;
    let a = &pending[0];
    assert_eq!(a.request.task_id.as_str(), "publish");
    assert_eq!(a.request.approval_id, "t1a1");
    assert_eq!(a.request.trigger.as_str(), "sensitive_action");
    assert_eq!(a.request.input, serde_json::json!({"channel": "news"}));
    // Notified, and the task holds no slot: it is waiting for a person, not dispatched.
    let notice = tokio::time::timeout(ASK, notices.next())
        .await?
        .expect("a notice");
    let notice: flotilla_model::notify::Notification = serde_json::from_slice(&notice.payload)?;
    assert_eq!(
        notice.approval.map(|a| a.request.approval_id).as_deref(),
        Some("t1a1")
    );
    assert_eq!(notice.id, format!("approval.{run}.t1a1"));
    assert_eq!(
        task_status(&f, run, "publish").await?,
        TaskStatus::AwaitingApproval
    );
    assert_eq!(task_status(&f, run, "announce").await?, TaskStatus::Waiting);
    // Bound to the arguments: an answer for another digest does not apply.
    let mut wrong = answer(run, "t1a1", Decision::Approve);
    wrong.digest = Some("0".repeat(64));
    let refused = f.client.call(&wrong, ASK).await?.expect_err("refused");
    assert_eq!(
        (refused.status, refused.code.as_str()),
        (409, "digest_mismatch")
    );
    let mut right = answer(run, "t1a1", Decision::Approve);
    right.digest = Some(a.request.digest.clone());
    let reply: ApprovalAnswerReply = f.client.request(&right, ASK).await?;
    assert_eq!(reply.outcome, AnswerOutcome::Decided);
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let later: ApprovalAnswerReply = f
        .client
        .request(
            &answer(
                run,
                "t1a1",
                Decision::Reject {
                    message: "no".into(),
                },
            ),
            ASK,
        )
        .await?;
    assert_eq!(later.outcome, AnswerOutcome::AlreadyDecided);
    assert_eq!(
        later.record.answer.expect("answer").decision,
        Decision::Approve
    );
    // The audit trail: requested, then decided by alice with her comment.
    let view = f
        .client
        .request(
            &ApprovalGetRequest {
                protocol: PROTOCOL_VERSION,
                run_id: run,
                approval_id: "t1a1".into(),
            },
            ASK,
        )
        .await?;
    assert_eq!(view.record.status, ApprovalStatus::Decided);
    let last = view.history.last().expect("a revision");
    assert_eq!(last.status, ApprovalStatus::Decided);
    assert!(last.at >= view.record.request.requested_at);
    let by = view.record.answer.as_ref().expect("answer");
    assert_eq!(
        (by.by.as_str(), by.comment.as_deref()),
        ("alice", Some("looked at it"))
    );
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_rejected_required_task_fails_the_run_and_an_optional_one_is_skipped()
-> anyhow::Result<()> {
    let f = services(HitlConfig::default()).await?;
    let required = f
        .client
        .submit(SubmitRequest::new(plan(vec![sensitive("publish", &[])])))
        .await?;
    let mut optional_task = sensitive("publish", &[]);
    optional_task.required = false;
    let optional = f
        .client
        .submit(SubmitRequest::new(plan(vec![
            optional_task,
            {
                let mut t = Subtask::new("after_publish", "x").after(&["publish"]);
                t.required = false;
                t
            },
            Subtask::new("other", "y"),
        ])))
        .await?;
    for run in [required, optional] {
        approvals(&f, run, false, 1).await?;
        let r: ApprovalAnswerReply = f
            .client
            .request(
                &answer(
                    run,
                    "t0a1",
                    Decision::Reject {
                        message: "not today".into(),
                    },
                ),
                ASK,
            )
            .await?;
        assert_eq!(r.outcome, AnswerOutcome::Decided);
    }
    let o = f.client.wait(required, WAIT).await?;
    assert_eq!(o.status, RunStatus::Failed);
    assert_eq!(o.cause, Some(EndCause::ApprovalRejected));
    let reason = o.reason.unwrap_or_default();
    assert!(
        reason.contains("publish") && reason.contains("not today"),
        "{reason}"
    );
    let o = f.client.wait(optional, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    assert_eq!(
        task_status(&f, optional, "publish").await?,
        TaskStatus::Skipped
    );
    assert_eq!(
        task_status(&f, optional, "after_publish").await?,
        TaskStatus::Skipped
    );
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn an_edit_runs_with_the_persons_input_and_a_response_stands_for_the_result()
-> anyhow::Result<()> {
    let f = services(HitlConfig::default()).await?;
    let edited = f
        .client
        .submit(SubmitRequest::new(plan(vec![sensitive("publish", &[])])))
        .await?;
    let responded = f
        .client
        .submit(SubmitRequest::new(plan(vec![
            sensitive("publish", &[]),
            Subtask::new("announce", "tell").after(&["publish"]),
        ])))
        .await?;
    approvals(&f, edited, false, 1).await?;
    approvals(&f, responded, false, 1).await?;
    f.client
        .request(
            &answer(
                edited,
                "t0a1",
                Decision::Edit {
                    input: serde_json::json!({"channel": "internal"}),
                },
            ),
            ASK,
        )
        .await?;
    f.client
        .request(
            &answer(
                responded,
                "t0a1",
                Decision::Respond {
                    result: "42 items published by hand".into(),
                },
            ),
            ASK,
        )
        .await?;
    let o = f.client.wait(edited, WAIT).await?;
    let response = o.final_result.expect("a result").response;
    assert!(response.contains(r#"{"channel":"internal"}"#), "{response}");
    let o = f.client.wait(responded, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded);
    // The dependent got the person's result as its dependency's.
    assert_eq!(
        o.final_result.expect("a result").response,
        "announce done with null after [publish=42]"
    );
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn the_deadline_applies_its_default_once_and_a_late_answer_is_told() -> anyhow::Result<()> {
    let hitl = HitlConfig {
        approval_timeout: Secs::from_secs(1),
        ..HitlConfig::default()
    };
    let f = services(hitl).await?;
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![sensitive("publish", &[])])))
        .await?;
    let o = f.client.wait(run, WAIT).await?;
    assert_eq!(o.status, RunStatus::Failed);
    assert_eq!(o.cause, Some(EndCause::ApprovalRejected));
    assert!(o.reason.unwrap_or_default().contains("deadline"));
    let all = approvals(&f, run, true, 1).await?;
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].status, ApprovalStatus::Expired);
    let late: ApprovalAnswerReply = f
        .client
        .request(&answer(run, "t0a1", Decision::Approve), ASK)
        .await?;
    assert_eq!(late.outcome, AnswerOutcome::AlreadyDecided);
    assert_eq!(late.record.status, ApprovalStatus::Expired);
    f.stop().await;

    // A deployment whose sensitive actions default to approve runs the task at the deadline.
    let hitl = HitlConfig {
        approval_timeout: Secs::from_secs(1),
        on_timeout: OnTimeout {
            sensitive_action: DefaultDecision::Approve,
            ..OnTimeout::default()
        },
        ..HitlConfig::default()
    };
    let f = services(hitl).await?;
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![sensitive("publish", &[])])))
        .await?;
    let o = f.client.wait(run, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded);
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn consecutive_failures_ask_a_person_before_the_next_retry() -> anyhow::Result<()> {
    let f = services(HitlConfig {
        consecutive_failures: 2,
        ..HitlConfig::default()
    })
    .await?;
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("fetch", "fetch the feed").with_agent("flaky"),
        ])))
        .await?;
    // Two failed attempts, then the third waits for a person instead of the retry policy.
    let pending = approvals(&f, run, false, 1).await?;
    let a = &pending[0];
    assert_eq!(a.request.approval_id, "t0a3");
    assert_eq!(a.request.trigger, Trigger::ConsecutiveFailures);
    assert_eq!(a.request.attempt, 3);
    assert_eq!(
        task_status(&f, run, "fetch").await?,
        TaskStatus::AwaitingApproval
    );
    // Approved: the third attempt runs (and fails); the fourth asks again.
    let r: ApprovalAnswerReply = f
        .client
        .request(&answer(run, "t0a3", Decision::Approve), ASK)
        .await?;
    assert_eq!(r.outcome, AnswerOutcome::Decided);
    let all = approvals(&f, run, true, 2).await?;
    assert!(
        all.iter().any(|a| a.request.approval_id == "t0a4"),
        "{all:?}"
    );
    // Rejected: the task is not tried again and the run fails, saying why.
    let _: ApprovalAnswerReply = f
        .client
        .request(
            &answer(
                run,
                "t0a4",
                Decision::Reject {
                    message: "the feed is gone for good".into(),
                },
            ),
            ASK,
        )
        .await?;
    let o = f.client.wait(run, WAIT).await?;
    assert_eq!(o.status, RunStatus::Failed);
    assert_eq!(o.cause, Some(EndCause::ApprovalRejected));
    let view = f.client.run(run).await?.expect("the run");
    assert_eq!(view.tasks[0].attempts, 3, "no fourth attempt ran");
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn racing_answers_decide_once() -> anyhow::Result<()> {
    let f = services(HitlConfig::default()).await?;
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![sensitive("publish", &[])])))
        .await?;
    approvals(&f, run, false, 1).await?;
    let mut racers = tokio::task::JoinSet::new();
    for i in 0..8 {
        let client = f.client.clone();
        let d = if i % 2 == 0 {
            Decision::Approve
        } else {
            Decision::Reject {
                message: format!("racer {i}"),
            }
        };
        racers.spawn(async move {
            client
                .request(&answer(run, "t0a1", d), ASK)
                .await
                .map(|r: ApprovalAnswerReply| r)
        });
    }
    let mut decided = Vec::new();
    let mut records = Vec::new();
    while let Some(r) = racers.join_next().await {
        let r = r??;
        if r.outcome == AnswerOutcome::Decided {
            decided.push(r.record.clone());
        }
        records.push(r.record);
    }
    assert_eq!(decided.len(), 1, "exactly one answer decides");
    // Everyone is told the same winner, and the run follows it.
    let winner = decided[0].answer.clone().expect("answer");
    assert!(records.iter().all(|r| r.answer.as_ref() == Some(&winner)));
    let o = f.client.wait(run, WAIT).await?;
    let expected = match winner.decision {
        Decision::Approve => RunStatus::Succeeded,
        _ => RunStatus::Failed,
    };
    assert_eq!(o.status, expected);
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn bad_answers_are_refused_and_change_nothing() -> anyhow::Result<()> {
    let f = services(HitlConfig::default()).await?;
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![sensitive("publish", &[])])))
        .await?;
    approvals(&f, run, false, 1).await?;
    let mut nobody = answer(run, "t0a1", Decision::Approve);
    nobody.by = " ".into();
    let e = f.client.call(&nobody, ASK).await?.expect_err("refused");
    assert_eq!((e.status, e.code.as_str()), (400, "invalid_answer"));
    assert_eq!(e.problems[0].path, "by");
    let e = f
        .client
        .call(&answer(run, "t9a1", Decision::Approve), ASK)
        .await?
        .expect_err("refused");
    assert_eq!((e.status, e.code.as_str()), (404, "not_found"));
    let e = f
        .client
        .call(&answer(run, "no.such", Decision::Approve), ASK)
        .await?
        .expect_err("refused");
    assert_eq!(e.code, "invalid_answer");
    let e = f
        .client
        .call(&answer(RunId::new(), "t0a1", Decision::Approve), ASK)
        .await?
        .expect_err("refused");
    assert_eq!(e.code, "not_found");
    let huge = answer(
        run,
        "t0a1",
        Decision::Respond {
            result: "x".repeat(70 * 1024),
        },
    );
    let e = f.client.call(&huge, ASK).await?.expect_err("refused");
    assert_eq!(e.code, "invalid_answer");
    // Malformed JSON.
    let raw = f
        .bus
        .client()
        .request(
            format!("{}.api.approval.answer", f.bus.names().prefix()),
            "{not json".into(),
        )
        .await?;
    let body: flotilla_model::api::ApiError = serde_json::from_slice(&raw.payload)?;
    assert_eq!(body.code, "malformed");
    // Still waiting, still pending.
    let pending = approvals(&f, run, false, 1).await?;
    assert_eq!(pending[0].status, ApprovalStatus::Pending);
    assert_eq!(
        task_status(&f, run, "publish").await?,
        TaskStatus::AwaitingApproval
    );
    // A cancelled run withdraws what it waited for.
    f.client.cancel(run, Some("changed my mind".into())).await?;
    let o = f.client.wait(run, WAIT).await?;
    assert_eq!(o.status, RunStatus::Cancelled);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let all = approvals(&f, run, true, 1).await?;
        if all[0].status == ApprovalStatus::Withdrawn {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            all[0].status
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(approvals(&f, run, false, 0).await?.is_empty());
    f.stop().await;
    Ok(())
}

#[tokio::test]
async fn human_in_command_asks_for_every_task_and_on_the_loop_only_notifies() -> anyhow::Result<()>
{
    let mut hitl = HitlConfig::default();
    hitl.agents.insert("bot".into(), HitlMode::HumanInCommand);
    let f = services(hitl).await?;
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("a", "x"),
            Subtask::new("b", "y"),
        ])))
        .await?;
    // Both are asked at once (asking holds no slot), as human_in_command.
    let pending = approvals(&f, run, false, 2).await?;
    assert!(
        pending
            .iter()
            .all(|p| p.request.trigger.as_str() == "human_in_command")
    );
    for p in &pending {
        f.client
            .request(&answer(run, &p.request.approval_id, Decision::Approve), ASK)
            .await?;
    }
    assert_eq!(f.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
    f.stop().await;

    let hitl = HitlConfig {
        mode: HitlMode::HumanOnTheLoop,
        ..HitlConfig::default()
    };
    let f = services(hitl).await?;
    let mut notices = f
        .bus
        .client()
        .subscribe(format!("{}.notify.approval.*", f.bus.names().prefix()))
        .await?;
    let run = f
        .client
        .submit(SubmitRequest::new(plan(vec![sensitive("publish", &[])])))
        .await?;
    assert_eq!(f.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
    let notice = tokio::time::timeout(ASK, notices.next())
        .await?
        .expect("a notice");
    let notice: flotilla_model::notify::Notification = serde_json::from_slice(&notice.payload)?;
    assert!(notice.notify_only);
    assert!(
        approvals(&f, run, true, 0).await?.is_empty(),
        "nothing waited"
    );
    f.stop().await;
    Ok(())
}

const PROCESSES: &str = r#"
default-agent = "bot"
[agents.bot]
kind = "scripted"
reply = "{task_id} done with {input}"

[hitl]
approval-timeout = "4s"
"#;

fn json_of(out: &std::process::Output) -> anyhow::Result<serde_json::Value> {
    anyhow::ensure!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Across processes, through the CLI: the coordinator that asked is killed and NATS
/// restarted while the task waits; the operator's approval, given while no coordinator
/// runs, is applied exactly once by the next one. A second run's deadline passes while its
/// coordinator is down: the default is applied once by the next coordinator.
#[tokio::test]
async fn approvals_survive_coordinator_kills_and_a_nats_restart_through_the_cli()
-> anyhow::Result<()> {
    let mut p = Processes::start(PROCESSES).await?;
    let c1 = p.coordinator().await?;
    p.worker(&[]).await?;
    let mut patient = plan(vec![
        sensitive("publish", &[]),
        Subtask::new("announce", "tell").after(&["publish"]),
    ]);
    patient.config.hitl = Some(flotilla_model::approval::PlanHitl {
        approval_timeout: Some(Secs::from_secs(120)),
        ..Default::default()
    });
    let approved = p.client.submit(SubmitRequest::new(patient)).await?;
    let mut expiring = plan(vec![sensitive("publish", &[])]);
    expiring.config.hitl = Some(flotilla_model::approval::PlanHitl {
        approval_timeout: Some(Secs::from_secs(3)),
        ..Default::default()
    });
    let expiring = p.client.submit(SubmitRequest::new(expiring)).await?;
    // Both wait, listed in the operator's inbox.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let list = json_of(&p.cli(&["approvals", "list", "--json"])?)?;
        let n = list["approvals"].as_array().map_or(0, Vec::len);
        if n >= 2 {
            break;
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "inbox: {list}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let shown =
        json_of(&p.cli(&["approvals", "show", &approved.to_string(), "t0a1", "--json"])?)?;
    let digest = shown["record"]["request"]["digest"]
        .as_str()
        .expect("a digest")
        .to_owned();
    p.kill(c1);
    p.server.restart().await?;
    // No coordinator serves the API: an answer now is refused, and nothing changes.
    let out = p.cli(&[
        "approvals",
        "approve",
        &approved.to_string(),
        "t0a1",
        "--by",
        "carol",
        "--digest",
        &digest,
        "--json",
    ])?;
    assert!(!out.status.success());
    tokio::time::sleep(Duration::from_secs(4)).await;
    p.coordinator().await?;
    let answered = json_of(&p.cli(&[
        "approvals",
        "approve",
        &approved.to_string(),
        "t0a1",
        "--by",
        "carol",
        "--digest",
        &digest,
        "--json",
    ])?)?;
    // The expiring run's 3 s deadline passed while no coordinator ran.
    assert_eq!(answered["outcome"], "decided", "{answered}");
    let o = p.client.wait(approved, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    let o = p.client.wait(expiring, WAIT).await?;
    assert_eq!(o.status, RunStatus::Failed);
    assert_eq!(o.cause, Some(EndCause::ApprovalRejected));
    // Each decision was applied once: one approval_decided input each on the run logs.
    let store = flotilla_coordinator::store::RunStore::open(&p.bus).await?;
    for run in [approved, expiring] {
        let history = store.history(run).await?;
        let decided = history
            .iter()
            .filter(|(_, _, e)| {
                matches!(
                    e.input,
                    flotilla_model::runlog::RunInput::ApprovalDecided(_)
                )
            })
            .count();
        assert_eq!(decided, 1, "run {run}");
    }
    let history = p.cli(&["approvals", "history", &approved.to_string()])?;
    let text = String::from_utf8_lossy(&history.stdout);
    assert!(text.contains("decided approve by carol"), "{text}");
    let history = p.cli(&["approvals", "history", &expiring.to_string()])?;
    let text = String::from_utf8_lossy(&history.stdout);
    assert!(text.contains("expired reject by deadline"), "{text}");
    Ok(())
}

/// A result stating a confidence below `[hitl] low-confidence` (0.6 by default) is held for
/// review before its dependents run: the task waits (`t<i>a<n>r`, trigger `low_confidence`,
/// the result as what is asked about) holding no slot. Approved, the dependent gets the
/// worker's result; responded, the person's; rejected, a required task fails the run. A
/// confident result and one stating none are never held; a bad threshold is refused.
#[tokio::test]
async fn a_low_confidence_result_is_held_for_review_before_its_dependents_run() -> anyhow::Result<()>
{
    let f = services(HitlConfig::default()).await?;
    let guess = |confidence: f64| {
        let mut s = Subtask::new("guess", "estimate the market").with_agent("echo");
        s.input = serde_json::json!({"answer": "about 42", "confidence": confidence});
        s
    };
    let two_step = |confidence: f64| {
        plan(vec![
            guess(confidence),
            Subtask::new("use", "use it")
                .with_agent("bot")
                .after(&["guess"]),
        ])
    };

    // Approved: the worker's result goes on.
    let run = f.client.submit(SubmitRequest::new(two_step(0.3))).await?;
    let held = approvals(&f, run, false, 1).await?;
    let q = &held[0].request;
    assert_eq!(q.approval_id, "t0a1r");
    assert_eq!(q.trigger, Trigger::LowConfidence);
    assert!(
        q.input.as_str().is_some_and(|t| t.contains("about 42")),
        "{q:?}"
    );
    assert!(q.description.contains("confidence 0.30"), "{q:?}");
    let view = f.client.run(run).await?.expect("exists");
    assert_eq!(view.tasks[0].status, TaskStatus::AwaitingApproval);
    assert_eq!(
        view.tasks[1].status,
        TaskStatus::Waiting,
        "the dependent waits"
    );
    let a: ApprovalAnswerReply = f
        .client
        .request(&answer(run, "t0a1r", Decision::Approve), ASK)
        .await?;
    assert_eq!(a.outcome, AnswerOutcome::Decided);
    let o = f.client.wait(run, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    let used = o
        .final_result
        .as_ref()
        .map(|r| r.response.clone())
        .unwrap_or_default();
    assert!(used.starts_with("use done"), "{used}");

    // Responded: the person's result replaces it.
    let run = f.client.submit(SubmitRequest::new(two_step(0.1))).await?;
    approvals(&f, run, false, 1).await?;
    f.client
        .request(
            &answer(
                run,
                "t0a1r",
                Decision::Respond {
                    result: "exactly 40".into(),
                },
            ),
            ASK,
        )
        .await?;
    let o = f.client.wait(run, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    let used = o
        .final_result
        .as_ref()
        .map(|r| r.response.clone())
        .unwrap_or_default();
    assert!(
        used.contains("40") && !used.contains("42"),
        "the person's result: {used}"
    );

    // Rejected: a required task fails the run.
    let run = f.client.submit(SubmitRequest::new(two_step(0.2))).await?;
    approvals(&f, run, false, 1).await?;
    f.client
        .request(
            &answer(
                run,
                "t0a1r",
                Decision::Reject {
                    message: "a guess".into(),
                },
            ),
            ASK,
        )
        .await?;
    let o = f.client.wait(run, WAIT).await?;
    assert_eq!(o.status, RunStatus::Failed, "{o:?}");
    assert_eq!(o.cause, Some(EndCause::ApprovalRejected));

    // Confident, or stating nothing: never held.
    let run = f.client.submit(SubmitRequest::new(two_step(0.9))).await?;
    let o = f.client.wait(run, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    let mut plain = two_step(0.1);
    plain.subtasks[0].input = serde_json::json!({"answer": "no confidence stated"});
    let run = f.client.submit(SubmitRequest::new(plain)).await?;
    let o = f.client.wait(run, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    let l = approvals_of(&f.client, run, true).await?;
    assert!(l.is_empty());

    // A threshold outside 0 to 1 is refused, naming the field.
    let mut bad = two_step(0.5);
    bad.config.hitl = Some(flotilla_model::approval::PlanHitl {
        low_confidence: Some(1.5),
        ..Default::default()
    });
    let reply = f.client.validate(&bad).await?;
    assert_eq!(
        reply.errors.first().map(|e| e.path.as_str()),
        Some("config.hitl.low_confidence"),
        "{:?}",
        reply.errors
    );
    let problems = HitlConfig {
        low_confidence: -0.1,
        ..HitlConfig::default()
    }
    .problems();
    assert_eq!(
        problems.first().map(|p| p.path.as_str()),
        Some("hitl.low-confidence")
    );
    Ok(())
}

/// The run's `approval_decided` events of approval `id`, with their details, once the run
/// ended (read up to its end).
async fn decided_events(p: &Processes, run: RunId, id: &str) -> anyhow::Result<Vec<String>> {
    use flotilla_model::event::{Event, WorkflowPhase};
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    let mut out = Vec::new();
    while let Ok(Some(e)) = tokio::time::timeout(Duration::from_secs(2), events.next()).await {
        // Read past the run's end: what the ended run still asked is withdrawn after it.
        if let Event::Workflow(w) = e?.event
            && w.phase == WorkflowPhase::ApprovalDecided
            && w.approval_id.as_deref() == Some(id)
        {
            out.push(w.detail.unwrap_or_default());
        }
    }
    Ok(out)
}

/// The run's approvals as `approvals list --run RUN --all --json` prints them, once none of
/// them is pending.
async fn settled_through_the_cli(p: &Processes, run: RunId) -> anyhow::Result<serde_json::Value> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let all = json_of(&p.cli(&[
            "approvals",
            "list",
            "--run",
            &run.to_string(),
            "--all",
            "--json",
        ])?)?;
        let pending = all["approvals"]
            .as_array()
            .is_none_or(|a| a.iter().any(|r| r["status"] == "pending"));
        if !pending {
            return Ok(all);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "still pending: {all}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Through the CLI: a person takes over a run whose task waits for an approval and completes
/// its tasks by hand; another run is cancelled. Nothing of either run is left pending in
/// `approvals list`: each approval reads `withdrawn` with why (the task completed by hand,
/// the run's end), the run's events say `approval_decided … withdrawn`, and a late answer is
/// refused naming it withdrawn (exit 1). An approval of the cancelled run its tasks no longer
/// waited for (an external agent's question, or any request left behind) is withdrawn with
/// the run's end too, not left to a sweep.
#[tokio::test]
async fn an_ended_run_withdraws_its_pending_approvals_through_the_cli() -> anyhow::Result<()> {
    let mut p = Processes::start(PROCESSES).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let patient = || {
        let mut plan = plan(vec![
            sensitive("publish", &[]),
            Subtask::new("announce", "tell").after(&["publish"]),
        ]);
        plan.config.hitl = Some(flotilla_model::approval::PlanHitl {
            approval_timeout: Some(Secs::from_secs(300)),
            ..Default::default()
        });
        SubmitRequest::new(plan)
    };
    let taken = p.client.submit(patient()).await?;
    let cancelled = p.client.submit(patient()).await?;
    for run in [taken, cancelled] {
        let deadline = tokio::time::Instant::now() + WAIT;
        while approvals_of(&p.client, run, false).await?.is_empty() {
            anyhow::ensure!(tokio::time::Instant::now() < deadline, "{run} asked nobody");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let run = taken.to_string();

    // Taken over and completed by hand, task by task.
    json_of(&p.cli(&["runs", "takeover", &run, "--by", "bob", "--json"])?)?;
    for task in ["publish", "announce"] {
        json_of(&p.cli(&[
            "runs",
            "complete",
            &run,
            task,
            "--result",
            "done by hand",
            "--by",
            "bob",
            "--json",
        ])?)?;
    }
    let o = p.client.wait(taken, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    let all = settled_through_the_cli(&p, taken).await?;
    assert_eq!(all["approvals"].as_array().map(Vec::len), Some(1), "{all}");
    let pending = json_of(&p.cli(&["approvals", "list", "--run", &run, "--json"])?)?;
    assert_eq!(pending["approvals"], serde_json::json!([]), "{pending}");
    let shown = json_of(&p.cli(&["approvals", "show", &run, "t0a1", "--json"])?)?;
    let record = &shown["record"];
    assert_eq!(record["status"], "withdrawn", "{shown}");
    assert_eq!(record["answer"]["by"], "run", "{shown}");
    assert_eq!(
        record["answer"]["message"], "task publish was completed by hand",
        "{shown}"
    );
    let text =
        String::from_utf8_lossy(&p.cli(&["approvals", "show", &run, "t0a1"])?.stdout).into_owned();
    assert!(
        text.contains("status    withdrawn at ")
            && text.contains(": task publish was completed by hand; nothing waits for an answer"),
        "{text}"
    );
    // The run's events say so, once.
    assert_eq!(
        decided_events(&p, taken, "t0a1").await?,
        ["withdrawn: task publish was completed by hand"]
    );
    // A late answer is refused, naming the withdrawal.
    let late = p.cli(&["approvals", "approve", &run, "t0a1", "--by", "carol"])?;
    assert_eq!(late.status.code(), Some(1));
    let err = String::from_utf8_lossy(&late.stderr);
    assert!(
        err.contains("already_decided: withdrawn at ")
            && err.contains("task publish was completed by hand; nothing waits for an answer"),
        "{err}"
    );
    let late = p.cli(&[
        "approvals",
        "approve",
        &run,
        "t0a1",
        "--by",
        "carol",
        "--json",
    ])?;
    assert_eq!(late.status.code(), Some(1));
    let late: serde_json::Value = serde_json::from_slice(&late.stdout)?;
    assert_eq!(
        (&late["outcome"], &late["record"]["status"]),
        (
            &serde_json::json!("already_decided"),
            &serde_json::json!("withdrawn")
        ),
        "{late}"
    );

    // Cancelled, with a request left behind that no task of the run waits for: an external
    // agent's question its attempt asked (stored as the coordinator's approval.ask stores it).
    let mut question = approvals_of(&p.client, cancelled, false).await?[0].clone();
    question.request.approval_id = "t0a1q1".into();
    question.request.trigger = Trigger::ExternalAgent;
    question.request.description = "agents:gate.ext.default asks: may I?".into();
    let kv = p
        .bus
        .kv(flotilla_model::subjects::Bucket::Escalations)
        .await?;
    kv.create(
        flotilla_model::approval::approval_key(cancelled, "t0a1q1"),
        serde_json::to_vec(&question)?.into(),
    )
    .await?;
    let run = cancelled.to_string();
    let out = p.cli(&["runs", "cancel", &run, "--reason", "not this week"])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let all = settled_through_the_cli(&p, cancelled).await?;
    let statuses: Vec<(String, String, String)> = all["approvals"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|r| {
                    (
                        r["request"]["approval_id"]
                            .as_str()
                            .unwrap_or_default()
                            .to_owned(),
                        r["status"].as_str().unwrap_or_default().to_owned(),
                        r["answer"]["message"]
                            .as_str()
                            .unwrap_or_default()
                            .to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    // The task's approval is withdrawn by the run's end; the question no task waits for, by
    // the coordinators' sweep of external questions (within 15 s).
    let why = "the run ended: cancelled: not this week".to_owned();
    let swept = "the run ended (Cancelled) before anyone answered".to_owned();
    assert_eq!(
        statuses,
        [
            ("t0a1".to_owned(), "withdrawn".to_owned(), why.clone()),
            ("t0a1q1".to_owned(), "withdrawn".to_owned(), swept.clone()),
        ],
        "{all}"
    );
    for (id, reason) in [("t0a1", &why), ("t0a1q1", &swept)] {
        assert_eq!(
            decided_events(&p, cancelled, id).await?,
            [format!("withdrawn: {reason}")],
            "{id}"
        );
    }
    let late = p.cli(&["approvals", "reject", &run, "t0a1", "--by", "carol"])?;
    assert_eq!(late.status.code(), Some(1));
    let err = String::from_utf8_lossy(&late.stderr);
    assert!(err.contains("withdrawn at ") && err.contains(&why), "{err}");
    Ok(())
}
