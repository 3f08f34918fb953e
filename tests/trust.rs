//! Earned trust across processes against a real nats-server: with `[hitl.trust] enabled`,
//! a novice agent's every task waits for approval; once the supervisor has counted enough
//! successes it is proficient and its tasks run without asking; an operator's incident drops
//! it to novice at once; a pinned level wins; bad requests are refused and change nothing.
//! `flotilla coordinator`, `flotilla worker` and `flotilla supervisor` run as processes and
//! are driven through the CLI (`flotilla trust …`) and the API; the agent is the
//! deterministic `scripted` test agent. The rules are lowered (3 tasks for proficient, no day
//! rules) so the test runs in seconds; the defaults are checked by the model's unit tests.

mod support;

use std::time::Duration;

use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::approval::{
    AnswerOutcome, ApprovalAnswerReply, ApprovalAnswerRequest, Decision,
};
use flotilla_model::ids::RunId;
use flotilla_model::plan::Subtask;
use flotilla_model::run::RunStatus;
use flotilla_model::submit::SubmitRequest;
use flotilla_model::team::RecordScope;
use flotilla_model::trust::{TrustGetRequest, TrustLevel, TrustRecord};
use support::*;

const CONFIG: &str = r#"
[agents.good]
kind = "scripted"
reply = "done"

[hitl]
sensitive-actions = []

[hitl.trust]
enabled = true
proficient = { min-tasks = 3, min-success-percent = 90, min-days = 0, incident-free-days = 0 }
expert = { min-tasks = 1000, min-success-percent = 99, min-days = 30, incident-free-days = 30 }
"#;

const ASK: Duration = Duration::from_secs(10);

async fn submit(p: &Processes) -> anyhow::Result<RunId> {
    Ok(p.client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("work", "do the work").with_agent("good"),
        ])))
        .await?)
}

/// Approves the run's one approval once it is asked (trigger `human_in_command`).
async fn approve(p: &Processes, run: RunId) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let l = approvals_of(&p.client, run, false).await?;
        if let Some(a) = l.first() {
            assert_eq!(a.request.trigger.as_str(), "human_in_command");
            let r: ApprovalAnswerReply = p
                .client
                .request(
                    &ApprovalAnswerRequest {
                        protocol: PROTOCOL_VERSION,
                        run_id: run,
                        approval_id: a.request.approval_id.clone(),
                        decision: Decision::Approve,
                        by: "alice".into(),
                        comment: None,
                        digest: None,
                        always: false,
                        incident: false,
                    },
                    ASK,
                )
                .await?;
            assert_eq!(r.outcome, AnswerOutcome::Decided);
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "run {run} never asked for approval"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn trust_of(p: &Processes) -> anyhow::Result<Option<TrustRecord>> {
    let r = p
        .client
        .request(
            &TrustGetRequest {
                protocol: PROTOCOL_VERSION,
                scope: RecordScope::Agent,
                name: "good".into(),
            },
            ASK,
        )
        .await;
    match r {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.to_string().contains("not_found") => Ok(None),
        Err(e) => Err(e.into()),
    }
}

async fn level_becomes(p: &Processes, level: TrustLevel) -> anyhow::Result<TrustRecord> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some(t) = trust_of(p).await?
            && t.level() == level
        {
            // The coordinators mirror the bucket: give the change a moment to reach them.
            tokio::time::sleep(Duration::from_millis(500)).await;
            return Ok(t);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "never {}: {:?}",
            level.as_str(),
            trust_of(p).await?
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether the run finishes on its own (no approval asked) within a few seconds.
async fn runs_unasked(p: &Processes, run: RunId) -> anyhow::Result<()> {
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded);
    let l = approvals_of(&p.client, run, true).await?;
    assert!(l.is_empty(), "{l:?}");
    Ok(())
}

fn cli(p: &Processes, args: &[&str]) -> anyhow::Result<(i32, String)> {
    let out = p.cli(args)?;
    Ok((
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trust_is_earned_lost_by_an_incident_and_pinned() -> anyhow::Result<()> {
    let mut p = Processes::start(CONFIG).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    // Without a supervisor the CLI says which service to start.
    let (code, out) = cli(&p, &["trust", "show"])?;
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("flotilla supervisor"), "{out}");
    p.supervisor().await?;

    // A novice: every dispatch waits for a person, until three successes are counted.
    assert!(trust_of(&p).await?.is_none(), "nothing counted yet");
    for _ in 0..3 {
        let run = submit(&p).await?;
        approve(&p, run).await?;
        assert_eq!(p.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
    }
    let t = level_becomes(&p, TrustLevel::Proficient).await?;
    assert_eq!(t.earned, TrustLevel::Proficient);
    assert!(
        t.history
            .iter()
            .any(|c| c.to == TrustLevel::Proficient && c.by == "supervisor"),
        "{t:?}"
    );
    // Proficient: its tasks run without asking.
    runs_unasked(&p, submit(&p).await?).await?;

    // An incident through the CLI: novice at once, asking again.
    let (code, out) = cli(
        &p,
        &[
            "trust",
            "incident",
            "good",
            "--reason",
            "leaked a draft",
            "--by",
            "alice",
        ],
    )?;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("good: novice"), "{out}");
    let t = level_becomes(&p, TrustLevel::Novice).await?;
    assert_eq!(t.incidents, 1);
    assert_eq!(
        t.last_incident.as_ref().map(|i| i.reason.as_str()),
        Some("leaked a draft")
    );
    let run = submit(&p).await?;
    approve(&p, run).await?;
    assert_eq!(p.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);

    // Pinned expert: on the loop, never waiting.
    let (code, out) = cli(
        &p,
        &[
            "trust",
            "set",
            "good",
            "expert",
            "--reason",
            "vendor certified",
            "--by",
            "bob",
        ],
    )?;
    assert_eq!(code, 0, "{out}");
    let t = level_becomes(&p, TrustLevel::Expert).await?;
    assert_eq!(t.pinned, Some(TrustLevel::Expert));
    runs_unasked(&p, submit(&p).await?).await?;
    let (code, out) = cli(&p, &["trust", "show"])?;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("good") && out.contains("expert"), "{out}");

    // Bad requests: refused, naming the problem, changing nothing.
    let before = trust_of(&p).await?;
    for (args, code_wanted, needle) in [
        (
            vec![
                "trust", "set", "nosuch", "expert", "--reason", "x", "--by", "bob",
            ],
            1,
            "no agent nosuch",
        ),
        (
            vec![
                "trust", "set", "good", "novice", "--reason", " ", "--by", "bob",
            ],
            1,
            "reason is required",
        ),
        (
            vec!["trust", "incident", "good", "--reason", "x", "--by", ""],
            1,
            "by is required",
        ),
        (
            vec!["trust", "set", "good", "master", "--reason", "x"],
            2,
            "novice, proficient, expert or auto",
        ),
    ] {
        let (code, out) = cli(&p, &args)?;
        assert_eq!(code, code_wanted, "{args:?}: {out}");
        assert!(out.contains(needle), "{args:?}: {out}");
    }
    assert_eq!(
        trust_of(&p).await?,
        before,
        "a refused request changed the record"
    );

    // Back to the earned level: the incident's run was counted since, and these rules need
    // no incident-free day, so it earned proficient again.
    let (code, out) = cli(
        &p,
        &[
            "trust", "set", "good", "auto", "--reason", "audit", "--by", "bob",
        ],
    )?;
    assert_eq!(code, 0, "{out}");
    let t = level_becomes(&p, TrustLevel::Proficient).await?;
    assert_eq!(t.pinned, None);
    let reasons: Vec<&str> = t.history.iter().map(|c| c.reason.as_str()).collect();
    assert!(
        reasons.contains(&"incident: leaked a draft")
            && reasons.contains(&"pinned expert: vendor certified")
            && reasons.contains(&"unpinned: audit"),
        "{reasons:?}"
    );
    Ok(())
}

/// The trust record of agent `name`, once it has recorded `n` incidents.
async fn incidents_of(p: &Processes, name: &str, n: u64) -> anyhow::Result<TrustRecord> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let r: Result<TrustRecord, _> = p
            .client
            .request(
                &TrustGetRequest {
                    protocol: PROTOCOL_VERSION,
                    scope: RecordScope::Agent,
                    name: name.into(),
                },
                ASK,
            )
            .await;
        if let Ok(t) = &r
            && t.incidents >= n
        {
            return Ok(t.clone());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{name} never had {n} incidents: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits for the run's pending approval and returns its id.
async fn asked(p: &Processes, run: RunId) -> anyhow::Result<String> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some(a) = approvals_of(&p.client, run, false).await?.first() {
            return Ok(a.request.approval_id.clone());
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "{run} never asked");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flotilla_records_incidents_itself() -> anyhow::Result<()> {
    let config = "[agents.good]\nkind = \"scripted\"\nreply = \"done\"\n\
        [agents.clumsy]\nkind = \"exec\"\ncommand = \"sh\"\nargs = [\"-c\", \"echo broke >&2; exit 3\"]\n\
        [hitl]\nsensitive-actions = [\"publish\"]\n";
    let mut p = Processes::start(config).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    p.supervisor().await?;
    let publish = |agent: &str| {
        let mut t = Subtask::new("release", "publish the report").with_agent(agent);
        t.action = Some("publish".into());
        let mut plan = plan(vec![t]);
        plan.config.max_retries = 0;
        plan
    };

    // A sensitive action that fails after it was approved is an incident of its agent.
    let run = p
        .client
        .submit(SubmitRequest::new(publish("clumsy")))
        .await?;
    let id = asked(&p, run).await?;
    let (code, out) = cli(
        &p,
        &[
            "approvals",
            "approve",
            &run.to_string(),
            &id,
            "--by",
            "alice",
        ],
    )?;
    assert_eq!(code, 0, "{out}");
    assert_eq!(p.client.wait(run, WAIT).await?.status, RunStatus::Failed);
    let t = incidents_of(&p, "clumsy", 1).await?;
    let last = t.last_incident.as_ref().expect("the incident");
    assert_eq!(last.by, "flotilla");
    assert!(
        last.reason
            .contains("sensitive action publish of task release")
            && last.reason.contains("failed"),
        "{last:?}"
    );
    assert_eq!(t.level(), TrustLevel::Novice);

    // A rejection marked as an incident is one; a plain rejection is not.
    let run = p.client.submit(SubmitRequest::new(publish("good"))).await?;
    let id = asked(&p, run).await?;
    let (code, out) = cli(
        &p,
        &[
            "approvals",
            "reject",
            &run.to_string(),
            &id,
            "--by",
            "alice",
            "--message",
            "it should never have asked to publish",
            "--incident",
        ],
    )?;
    assert_eq!(code, 0, "{out}");
    let t = incidents_of(&p, "good", 1).await?;
    let last = t.last_incident.as_ref().expect("the incident");
    assert!(
        last.reason
            .contains("rejected by alice as an incident: it should never have asked"),
        "{last:?}"
    );
    let run = p.client.submit(SubmitRequest::new(publish("good"))).await?;
    let id = asked(&p, run).await?;
    // `incident` goes with reject only: refused, and the approval is still pending.
    let r: Result<ApprovalAnswerReply, _> = p
        .client
        .request(
            &ApprovalAnswerRequest {
                protocol: PROTOCOL_VERSION,
                run_id: run,
                approval_id: id.clone(),
                decision: Decision::Approve,
                by: "alice".into(),
                comment: None,
                digest: None,
                always: false,
                incident: true,
            },
            ASK,
        )
        .await;
    let e = r.expect_err("refused").to_string();
    assert!(
        e.contains("invalid_answer") && e.contains("incident"),
        "{e}"
    );
    assert_eq!(approvals_of(&p.client, run, false).await?.len(), 1);
    let (code, out) = cli(
        &p,
        &[
            "approvals",
            "reject",
            &run.to_string(),
            &id,
            "--by",
            "alice",
        ],
    )?;
    assert_eq!(code, 0, "{out}");
    assert_eq!(p.client.wait(run, WAIT).await?.status, RunStatus::Failed);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(incidents_of(&p, "good", 1).await?.incidents, 1);
    Ok(())
}
