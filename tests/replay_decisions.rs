//! One decider: a run's log, replayed through the run machine alone, reproduces every
//! decision the coordinator recorded — approvals answered (and a second answer told what
//! decided), an approval expired by its deadline's default, a rejection that skips an
//! optional task, a pause and a resume — and the run's stored state. Services run in-process
//! against a real nats-server; agents are the deterministic `scripted` test agent.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use flotilla_coordinator::CoordinatorOptions;
use flotilla_machine::policy::HitlConfig;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::approval::{
    AnswerOutcome, ApprovalAnswerReply, ApprovalAnswerRequest, ApprovalStatus, Decision,
};
use flotilla_model::control::{ControlRunReply, PauseRunRequest, ResumeRunRequest};
use flotilla_model::ids::RunId;
use flotilla_model::plan::Subtask;
use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::runlog::RunInput;
use flotilla_model::submit::SubmitRequest;
use flotilla_model::time::Secs;
use flotilla_worker::WorkerOptions;
use support::*;

const ASK: Duration = Duration::from_secs(10);

fn sensitive(id: &str, after: &[&str], required: bool) -> Subtask {
    let mut s = Subtask::new(id, "publish the report").after(after);
    s.action = Some("publish".into());
    s.required = required;
    s
}

fn answer(run: RunId, id: &str, decision: Decision, by: &str) -> ApprovalAnswerRequest {
    ApprovalAnswerRequest {
        protocol: PROTOCOL_VERSION,
        run_id: run,
        approval_id: id.into(),
        decision,
        by: by.into(),
        comment: None,
        digest: None,
        always: false,
        incident: false,
    }
}

/// The run's approval `id`, once it is listed with `status`.
async fn approval_reads(
    f: &InProcess,
    run: RunId,
    id: &str,
    status: ApprovalStatus,
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let all = approvals_of(&f.client, run, true).await?;
        if all
            .iter()
            .any(|a| a.request.approval_id == id && a.status == status)
        {
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "approval {id} of run {run} never read {status:?}: {all:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_run_log_replayed_through_the_machine_reproduces_every_decision() -> anyhow::Result<()> {
    let mut agents = BTreeMap::new();
    agents.insert(
        "bot".to_string(),
        flotilla_worker::agents::AgentDefinition::Scripted(
            flotilla_worker::agents::ScriptedConfig {
                reply: "{task_id} done".into(),
                ..Default::default()
            },
        ),
    );
    let opts = CoordinatorOptions {
        hitl: HitlConfig {
            approval_timeout: Secs::from_secs(3),
            ..HitlConfig::default()
        },
        ..CoordinatorOptions::default()
    };
    let f = InProcess::start_configured(
        1,
        agents,
        WorkerOptions {
            started_event_delay: Duration::ZERO,
            ..WorkerOptions::default()
        },
        opts,
    )
    .await?;
    // `go` is approved (a second answer is told what decided), `skip` is rejected (optional:
    // skipped), `late` waits past its deadline (its default, reject: skipped), `last` runs
    // after `go`.
    // Through the intake (an idempotency key): its admission's verdict is the log's first
    // entry, `submitted`. (A durable submission on the run's own subject is admitted by the
    // coordinator that reads it, and its start is recorded in the run's record.)
    let mut request = SubmitRequest::new(plan(vec![
        sensitive("go", &[], true),
        sensitive("skip", &[], false),
        sensitive("late", &["go"], false),
        Subtask::new("last", "sum up").after(&["go"]),
    ]));
    request.idempotency_key = Some(format!("replay-{}", RunId::new()));
    let run = f.client.submit(request).await?;
    approval_reads(&f, run, "t0a1", ApprovalStatus::Pending).await?;
    approval_reads(&f, run, "t1a1", ApprovalStatus::Pending).await?;

    // A pause and a resume while the approvals wait.
    let paused: ControlRunReply = f
        .client
        .request(
            &PauseRunRequest {
                protocol: PROTOCOL_VERSION,
                run_id: run,
                reason: Some("a look first".into()),
                by: Some("alice".into()),
                timeout_ms: None,
                children: true,
                task_id: None,
            },
            ASK,
        )
        .await?;
    assert!(paused.applied, "{paused:?}");
    let resumed: ControlRunReply = f
        .client
        .request(
            &ResumeRunRequest {
                protocol: PROTOCOL_VERSION,
                run_id: run,
                reason: None,
                by: Some("alice".into()),
                children: true,
                task_id: None,
            },
            ASK,
        )
        .await?;
    assert!(resumed.applied, "{resumed:?}");

    let first: ApprovalAnswerReply = f
        .client
        .request(&answer(run, "t0a1", Decision::Approve, "alice"), ASK)
        .await?;
    assert_eq!(first.outcome, AnswerOutcome::Decided);
    let second: ApprovalAnswerReply = f
        .client
        .request(
            &answer(
                run,
                "t0a1",
                Decision::Reject {
                    message: "too late".into(),
                },
                "bob",
            ),
            ASK,
        )
        .await?;
    assert_eq!(second.outcome, AnswerOutcome::AlreadyDecided);
    assert_eq!(
        second.record.answer.as_ref().map(|a| a.by.as_str()),
        Some("alice")
    );
    let rejected: ApprovalAnswerReply = f
        .client
        .request(
            &answer(
                run,
                "t1a1",
                Decision::Reject {
                    message: "not this one".into(),
                },
                "bob",
            ),
            ASK,
        )
        .await?;
    assert_eq!(rejected.outcome, AnswerOutcome::Decided);

    let o = f.client.wait(run, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    approval_reads(&f, run, "t2a1", ApprovalStatus::Expired).await?;

    // The log, replayed through the machine alone.
    let store = flotilla_client::open_store(f.client.bus()).await?;
    let history = store.history(run).await?;
    let log: Vec<(u64, i64, RunInput)> = history
        .into_iter()
        .map(|(seq, at, e)| (seq, at.unix_ms(), e.input))
        .collect();
    let mut decided = Vec::new();
    let replayed = flotilla_machine::replay(
        run,
        log.iter().map(|(s, at, i)| (*s, *at, i)),
        |_, actions| {
            for a in actions {
                if let flotilla_machine::Action::ProjectApproval { task, seq, .. } = a {
                    decided.push((*task, *seq));
                }
            }
        },
    )
    .ok_or_else(|| anyhow::anyhow!("the run's log has no submitted entry: {log:?}"))?;
    let stored = store
        .state(run)
        .await?
        .ok_or_else(|| anyhow::anyhow!("run {run} has no record"))?;

    // Every decision: three approvals decided once each, by the entries the answers and the
    // default are on the log as.
    let by_seq = |seq: u64| {
        log.iter().find_map(|(s, _, i)| match i {
            RunInput::ApprovalDecided(d) if *s == seq => Some((d.status, d.by.clone())),
            _ => None,
        })
    };
    let decided: Vec<(u32, Option<(ApprovalStatus, String)>)> =
        decided.into_iter().map(|(t, s)| (t, by_seq(s))).collect();
    assert_eq!(
        decided,
        vec![
            (0, Some((ApprovalStatus::Decided, "alice".to_owned()))),
            (1, Some((ApprovalStatus::Decided, "bob".to_owned()))),
            (2, Some((ApprovalStatus::Expired, "deadline".to_owned()))),
        ],
        "log: {log:?}"
    );
    let statuses: Vec<TaskStatus> = replayed.state().tasks.iter().map(|t| t.status).collect();
    assert_eq!(
        statuses,
        vec![
            TaskStatus::Succeeded,
            TaskStatus::Skipped,
            TaskStatus::Skipped,
            TaskStatus::Succeeded
        ]
    );
    // The state the coordinator stored, but for the final result it completes from the
    // results' texts after the machine decided the end.
    let mut replayed = replayed.state().clone();
    let mut stored = stored;
    replayed.outcome = None;
    stored.outcome = None;
    assert_eq!(replayed, stored);
    f.stop().await;
    Ok(())
}
