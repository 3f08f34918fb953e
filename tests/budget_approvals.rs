//! Humans in the loop, the cost triggers, across processes against a real nats-server:
//!
//! * `[hitl] on-budget-exhausted = "ask"`: a model call that would pass the run's budget does
//!   not fail the task — the attempt suspends (no worker slot held) with a request to extend
//!   the budget (trigger `budget`) and the run is paused until it is decided; approve extends
//!   the budget by its own limits (`edit` by the amounts given) and the call is made; reject
//!   fails the task `budget_exhausted`.
//! * `[hitl] cost-limit`: a model call estimated above the limit waits for approval (trigger
//!   `cost`) before it is made; reject fails the task `call_declined`, no call made.
//! * A bad `cost-limit` stops a service at start, naming the setting.
//!
//! The model is the OpenAI-compatible test double (`flotilla_testkit::openai`, scripted
//! replies with scripted token usage): deterministic agents testing the machinery.

mod support;

use std::time::Duration;

use flotilla_model::approval::{ApprovalRecord, ApprovalStatus, Trigger};
use flotilla_model::event::{Event, WorkflowPhase};
use flotilla_model::ids::RunId;
use flotilla_model::plan::Subtask;
use flotilla_model::run::{RunStatus, TaskStatus};
use flotilla_model::submit::SubmitRequest;
use flotilla_model::task::TaskErrorKind;
use flotilla_testkit::openai::{OpenAiServer, Reply};
use futures::StreamExt;
use support::*;

/// `researcher` has no price (budgets in tokens only); `pricey` has a price and a 1,000-token
/// output limit, so every call of it is estimated above the cost limit.
fn config(base_url: &str) -> String {
    format!(
        r#"
[hitl]
on-budget-exhausted = "ask"
cost-limit = 0.0002

[agents.researcher]
kind = "llm"
base-url = "{base_url}"
model = "scripted-model"

[agents.pricey]
kind = "llm"
base-url = "{base_url}"
model = "scripted-model"
max-output-tokens = 1000
price = {{ input-per-mtok = 0.15, output-per-mtok = 0.6 }}
"#
    )
}

/// Waits until run `run` has a pending approval and returns it.
async fn pending(p: &Processes, run: RunId) -> anyhow::Result<ApprovalRecord> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let l = approvals_of(&p.client, run, false).await?;
        if let Some(r) = l.into_iter().next() {
            return Ok(r);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "run {run} never asked"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The details of the run's `run_paused` and `run_resumed` events, in order (the run ended).
async fn holds_of(p: &Processes, run: RunId) -> anyhow::Result<Vec<String>> {
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    let mut out = Vec::new();
    tokio::time::timeout(WAIT, async {
        while let Some(e) = events.next().await {
            if let Event::Workflow(w) = e?.event {
                if matches!(
                    w.phase,
                    WorkflowPhase::RunPaused | WorkflowPhase::RunResumed
                ) {
                    out.push(w.detail.unwrap_or_default());
                }
                if w.phase.ends_run() {
                    return anyhow::Ok(());
                }
            }
        }
        anyhow::bail!("the events ended")
    })
    .await??;
    Ok(out)
}

fn two_steps() -> flotilla_model::plan::Plan {
    let first = Subtask::new("first", "Find the revenue.").with_agent("researcher");
    let second = Subtask::new("second", "Check it.")
        .with_agent("researcher")
        .after(&["first"]);
    let mut plan = plan(vec![first, second]);
    plan.config.max_tokens = Some(1200);
    plan
}

fn decide(p: &Processes, args: &[&str]) -> anyhow::Result<()> {
    let out = p.cli(args)?;
    anyhow::ensure!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spent_budget_asks_for_more_and_a_costly_call_asks_first() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    let mut p = Processes::start(&config(&llm.base_url())).await?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "1"]).await?;

    // The first call spends 980 of 1,200 tokens; the second would pass the budget: it asks.
    llm.push(Reply::text("Revenue was 1250.").usage(900, 80));
    let run = p.client.submit(SubmitRequest::new(two_steps())).await?;
    let asked = pending(&p, run).await?;
    assert_eq!(asked.request.trigger, Trigger::Budget, "{asked:?}");
    assert_eq!(asked.request.approval_id, "t1a1c1");
    assert_eq!(
        asked.request.tool_call.as_ref().map(|c| c.tool.as_str()),
        Some("extend_budget")
    );
    let arguments = asked.request.input.clone();
    assert_eq!(arguments["max_tokens"], 1200, "{arguments}");
    assert_eq!(arguments["run_id"], run.to_string());
    assert_eq!(llm.requests().len(), 1, "the second call waits");
    // The run is paused meanwhile (its other attempts would run into the same budget).
    let view = p.client.run(run).await?.expect("the run");
    assert_eq!(view.record.status, RunStatus::Paused, "{view:?}");
    // The waiting attempt holds no slot: the only slot runs another run meanwhile.
    llm.push(Reply::text("Quick answer.").usage(10, 5));
    let other = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("quick", "Say hi.").with_agent("researcher"),
        ])))
        .await?;
    assert_eq!(
        p.client.wait(other, WAIT).await?.status,
        RunStatus::Succeeded
    );
    // Approved: the budget grows by its own limits and the call is made.
    llm.push(Reply::text("Checked: 1250 is right.").usage(300, 20));
    decide(
        &p,
        &[
            "approvals",
            "approve",
            &run.to_string(),
            "t1a1c1",
            "--by",
            "alice",
        ],
    )?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    assert_eq!(llm.requests().len(), 3);
    let holds = holds_of(&p, run).await?;
    assert_eq!(holds.len(), 2, "{holds:?}");
    assert!(
        holds[0].contains("the run's budget is spent; approval t1a1c1 asks a person to extend it"),
        "{holds:?}"
    );
    assert_eq!(holds[1], "resumed: the budget request t1a1c1 was decided");

    // Rejected: the task fails budget_exhausted, as without asking, and says who declined.
    llm.push(Reply::text("Revenue was 1250.").usage(900, 80));
    let run = p.client.submit(SubmitRequest::new(two_steps())).await?;
    let asked = pending(&p, run).await?;
    decide(
        &p,
        &[
            "approvals",
            "reject",
            &run.to_string(),
            &asked.request.approval_id,
            "--by",
            "bob",
            "--message",
            "enough for today",
        ],
    )?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed, "{outcome:?}");
    let failed = &outcome.failed[0];
    assert_eq!(failed.error.kind, TaskErrorKind::BudgetExhausted);
    assert!(
        failed
            .error
            .message
            .contains("bob declined to extend the budget: enough for today"),
        "{failed:?}"
    );
    assert_eq!(llm.requests().len(), 4, "no call after the rejection");

    // Edited: extended by the person's amount; too little, and the task fails after all.
    llm.push(Reply::text("Revenue was 1250.").usage(900, 80));
    let run = p.client.submit(SubmitRequest::new(two_steps())).await?;
    let asked = pending(&p, run).await?;
    decide(
        &p,
        &[
            "approvals",
            "edit",
            &run.to_string(),
            &asked.request.approval_id,
            "--by",
            "carol",
            "--input",
            r#"{"max_tokens": 1}"#,
        ],
    )?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed, "{outcome:?}");
    assert!(
        outcome.failed[0]
            .error
            .message
            .contains("after carol extended the budget by 1 tokens"),
        "{outcome:?}"
    );

    // A call estimated above the cost limit waits before it is made.
    let costly = || {
        plan(vec![
            Subtask::new("ask", "Estimate it.").with_agent("pricey"),
        ])
    };
    let before = llm.requests().len();
    let run = p.client.submit(SubmitRequest::new(costly())).await?;
    let asked = pending(&p, run).await?;
    assert_eq!(asked.request.trigger, Trigger::Cost, "{asked:?}");
    assert_eq!(
        asked.request.tool_call.as_ref().map(|c| c.tool.as_str()),
        Some("model_call")
    );
    let arguments = asked.request.input.clone();
    assert!(
        arguments["estimated_cost_usd"].as_f64().unwrap_or(0.0) > 0.0002,
        "{arguments}"
    );
    assert_eq!(llm.requests().len(), before, "not made before the approval");
    let view = p.client.run(run).await?.expect("the run");
    assert_eq!(view.tasks[0].status, TaskStatus::AwaitingApproval);
    llm.push(Reply::text("About 40.").usage(200, 10));
    decide(
        &p,
        &[
            "approvals",
            "approve",
            &run.to_string(),
            "t0a1c1",
            "--by",
            "alice",
        ],
    )?;
    assert_eq!(p.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
    assert_eq!(llm.requests().len(), before + 1);
    let history = approvals_of(&p.client, run, true).await?;
    assert_eq!(history[0].status, ApprovalStatus::Decided);

    // Declined: the task fails call_declined, once, and the call is never made.
    let run = p.client.submit(SubmitRequest::new(costly())).await?;
    let asked = pending(&p, run).await?;
    decide(
        &p,
        &[
            "approvals",
            "reject",
            &run.to_string(),
            &asked.request.approval_id,
            "--by",
            "bob",
        ],
    )?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.failed[0].error.kind, TaskErrorKind::CallDeclined);
    assert_eq!(outcome.failed[0].attempts, 1, "not retried");
    assert_eq!(llm.requests().len(), before + 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_cost_limit_is_refused_by_name() -> anyhow::Result<()> {
    let mut p = Processes::start("[hitl]\ncost-limit = -1.0\n").await?;
    let i = p.spawn(&["coordinator"])?;
    let code = p.wait_exit(i, Duration::from_secs(20)).await?;
    assert_ne!(code, Some(0));
    let log = p.log(i);
    assert!(log.contains("hitl.cost-limit"), "{log}");
    Ok(())
}
