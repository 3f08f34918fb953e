//! Recruitment and retirement across processes against a real nats-server: an exec agent
//! recruits a patent analyst mid-run with `flotilla team recruit` and the run waits for it;
//! every policy rule refuses with a structured error and changes nothing; a recruit asked
//! again (also of another supervisor replica) is answered, never doubled; a retirement hands
//! a member's unstarted task to its role. Agents are deterministic: `scripted` replies and
//! `exec` commands (the `flotilla` binary itself, or `sleep`).

mod support;

use std::time::Duration;

use flotilla_model::api::ApiError;
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::plan::{PlanConfig, Subtask};
use flotilla_model::recruit::{
    RecruitReply, RecruitRequest, RecruitStatus, RecruitStatusRequest, RetirePolicy, RetireReply,
    RetireRequest, TeamChangeKind,
};
use flotilla_model::run::{RunStatus, RunView};
use flotilla_model::submit::SubmitRequest;
use support::*;

const ASK: Duration = Duration::from_secs(15);

fn config() -> String {
    format!(
        r#"
default-agent = "analyst"

[agents.analyst]
kind = "scripted"
reply = "{{task_id}}: analysed"
roles = ["analyst"]

[agents.patents]
kind = "scripted"
reply = "{{task_id}}: three relevant patents"
roles = ["patents"]

[agents.writer]
kind = "scripted"
reply = "{{task_id}}: written"
roles = ["writer"]

[agents.slow]
kind = "exec"
command = "sleep"
args = ["8"]

[agents.lead]
kind = "exec"
command = "{flotilla}"
args = ["team", "recruit", "--role", "patents", "--description", "find the competitor's patents", "--reason", "the analysis needs a patent analyst", "--id", "pat1"]

[supervisor.recruit]
allowed-roles = ["patents", "analyst", "writer"]
max-recruits = 3
max-team = 3
"#,
        flotilla = env!("CARGO_BIN_EXE_flotilla")
    )
}

/// Starts a coordinator, a worker and a supervisor; waits until the team API answers.
async fn services() -> anyhow::Result<Processes> {
    services_with("").await
}

/// As [`services`], with `extra` configuration (more agents).
async fn services_with(extra: &str) -> anyhow::Result<Processes> {
    let mut p = Processes::start(&format!("{}{extra}", config())).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    p.supervisor().await?;
    Ok(p)
}

async fn submit(p: &Processes, tasks: Vec<Subtask>, config: PlanConfig) -> anyhow::Result<RunId> {
    let mut plan = plan(tasks);
    plan.config = config;
    Ok(p.client.submit(SubmitRequest::new(plan)).await?)
}

fn recruit(run: RunId, id: &str, role: &str) -> RecruitRequest {
    RecruitRequest {
        protocol: 1,
        run_id: run,
        recruit_id: id.into(),
        role: role.into(),
        description: format!("help as {role}"),
        reason: "the team needs it".into(),
        task_id: None,
        dependencies: Vec::new(),
        produces: Vec::new(),
        consumes: Vec::new(),
        required: false,
        by_task: None,
    }
}

async fn ask(p: &Processes, r: &RecruitRequest) -> anyhow::Result<Result<RecruitReply, ApiError>> {
    Ok(p.client.call(r, ASK).await?)
}

/// A recruit that must be answered (not refused).
async fn accepted(p: &Processes, r: &RecruitRequest) -> anyhow::Result<RecruitReply> {
    ask(p, r)
        .await?
        .map_err(|e| anyhow::anyhow!("refused: {e:?}"))
}

async fn view(p: &Processes, run: RunId) -> anyhow::Result<RunView> {
    let store = flotilla_client::open_store(&p.bus).await?;
    store
        .view(run, 0, usize::MAX)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no run {run}"))
}

fn refusal(answer: Result<RecruitReply, ApiError>, rule: &str) -> anyhow::Result<ApiError> {
    match answer {
        Ok(reply) => anyhow::bail!("expected a {rule} refusal, got {reply:?}"),
        Err(e) => {
            anyhow::ensure!(
                e.code == "recruit_refused" && e.rule.as_deref() == Some(rule),
                "expected {rule}, got {e:?}"
            );
            Ok(e)
        }
    }
}

#[tokio::test]
async fn an_agent_recruits_mid_run_and_the_run_waits_for_the_recruit() -> anyhow::Result<()> {
    let p = services().await?;
    let run = submit(
        &p,
        vec![
            Subtask::new("lead", "lead the competitor analysis").with_agent("lead"),
            Subtask::new("summary", "summarise").after(&["lead"]),
        ],
        PlanConfig::default(),
    )
    .await?;
    let outcome = p.client.wait(run, Duration::from_secs(60)).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let v = view(&p, run).await?;
    let ids: Vec<&str> = v.tasks.iter().map(|t| t.task_id.as_str()).collect();
    assert_eq!(ids, ["lead", "summary", "recruit-pat1"]);
    assert!(v.tasks.iter().all(|t| t.status.is_terminal()));
    assert_eq!(v.team.len(), 1);
    let change = &v.team[0];
    assert_eq!(change.kind, TeamChangeKind::Recruited);
    assert_eq!(change.member, "role:patents");
    assert_eq!(change.by, "task:lead");
    assert_eq!(change.reason, "the analysis needs a patent analyst");
    // The lead's own output is the CLI's answer; the recruit ran as a member of its role.
    let results = results_of(&p.bus, run).await?;
    assert!(
        results.contains(&("recruit-pat1".into(), 1, true)),
        "{results:?}"
    );
    let history = flotilla_coordinator::store::RunStore::open(&p.bus)
        .await?
        .history(run)
        .await?;
    let claimed: Vec<String> = history
        .iter()
        .filter_map(|(_, _, e)| match &e.input {
            flotilla_model::runlog::RunInput::Claimed(c) => Some(c.agent.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(claimed, ["patents"]);
    // `runs show` lists the change with its reason.
    let out = p.cli(&["runs", "show", &run.to_string()])?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("recruited role:patents as task recruit-pat1 (pat1), by task:lead: the analysis needs a patent analyst"),
        "{text}"
    );
    // Asking again (the lead's attempt redelivered, say) answers the recorded outcome.
    let again = accepted(&p, &recruit(run, "pat1", "patents")).await?;
    assert_eq!(again.status, RecruitStatus::Accepted);
    assert_eq!(again.task_id, TaskId::new("recruit-pat1"));
    // The run has ended: a new recruit is refused.
    refusal(
        ask(&p, &recruit(run, "late", "patents")).await?,
        "run_not_running",
    )?;
    Ok(())
}

#[tokio::test]
async fn every_policy_rule_refuses_with_its_name_and_changes_nothing() -> anyhow::Result<()> {
    let mut p = services().await?;
    let run = submit(
        &p,
        vec![Subtask::new("hold", "hold the run open").with_agent("slow")],
        PlanConfig {
            max_tokens: Some(50),
            ..PlanConfig::default()
        },
    )
    .await?;
    task_started(&p.client, run, "hold").await?;

    // Bad input: 400, nothing written.
    let mut bad = recruit(run, "has space", "patents");
    let e = ask(&p, &bad).await?.expect_err("bad id");
    assert_eq!(
        (e.status, e.code.as_str()),
        (400, "invalid_request"),
        "{e:?}"
    );
    bad = recruit(run, "b1", "patents");
    bad.reason = " ".into();
    let e = ask(&p, &bad).await?.expect_err("no reason");
    assert!(e.message.contains("reason"), "{e:?}");
    let e = ask(&p, &recruit(RunId::new(), "b2", "patents"))
        .await?
        .expect_err("unknown run");
    assert_eq!((e.status, e.code.as_str()), (404, "not_found"));
    let mut dangling = recruit(run, "b3", "analyst");
    dangling.dependencies = vec![TaskId::new("nope")];
    let e = refusal(ask(&p, &dangling).await?, "invalid_subtask")?;
    assert_eq!(e.status, 400);
    assert!(
        e.problems.iter().any(|pr| pr.to_string().contains("nope")),
        "{e:?}"
    );
    let mut ghost = recruit(run, "b4", "analyst");
    ghost.by_task = Some(TaskId::new("ghost"));
    refusal(ask(&p, &ghost).await?, "unknown_recruiter")?;
    refusal(
        ask(&p, &recruit(run, "b5", "chef")).await?,
        "role_not_allowed",
    )?;

    // Accepted, then asked again: one task.
    let first = accepted(&p, &recruit(run, "a1", "patents")).await?;
    assert_eq!(first.status, RecruitStatus::Accepted, "{first:?}");
    let again = accepted(&p, &recruit(run, "a1", "patents")).await?;
    assert_eq!(again.seq, first.seq);

    // A spent budget refuses, until it is not spent.
    let cursors = p.bus.kv(flotilla_model::subjects::Bucket::Cursors).await?;
    let key = format!("budget.{run}");
    cursors
        .put(&key, r#"{"tokens":50,"cost":0.0}"#.into())
        .await?;
    refusal(
        ask(&p, &recruit(run, "b6", "analyst")).await?,
        "budget_exhausted",
    )?;
    cursors.delete(&key).await?;

    // The team: slow, role:patents; an analyst makes three (max-team), a writer would be four.
    let second = accepted(&p, &recruit(run, "a2", "analyst")).await?;
    assert_eq!(second.status, RecruitStatus::Accepted);
    refusal(ask(&p, &recruit(run, "b7", "writer")).await?, "team_full")?;
    // Another of a role already in the team fits; then max-recruits is reached.
    accepted(&p, &recruit(run, "a3", "patents")).await?;
    refusal(
        ask(&p, &recruit(run, "b8", "patents")).await?,
        "too_many_recruits",
    )?;

    // The CLI says the same, structured, exit 1.
    let out = p.cli(&[
        "team",
        "recruit",
        "--run",
        &run.to_string(),
        "--role",
        "chef",
        "--description",
        "cook",
        "--reason",
        "hungry",
        "--json",
    ])?;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(json["error"], "recruit_refused");
    assert_eq!(json["rule"], "role_not_allowed");

    // Nothing refused changed the run: three recruits, no refusal recorded.
    let v = view(&p, run).await?;
    let ids: Vec<&str> = v.tasks.iter().map(|t| t.task_id.as_str()).collect();
    assert_eq!(ids, ["hold", "recruit-a1", "recruit-a2", "recruit-a3"]);
    assert!(v.team.iter().all(|c| c.kind == TeamChangeKind::Recruited));
    assert_eq!(v.team.len(), 3);

    // Status of a recruit: accepted, and unknown for one never made.
    let status: RecruitReply = p
        .client
        .request(
            &RecruitStatusRequest {
                protocol: 1,
                run_id: run,
                recruit_id: "a2".into(),
            },
            ASK,
        )
        .await?;
    assert_eq!(status.status, RecruitStatus::Accepted);
    let out = p.cli(&["team", "recruit-status", &run.to_string(), "b7"])?;
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("unknown:"),
        "{out:?}"
    );

    // Another supervisor replica answers the same recruit the same way.
    let second_supervisor = p.spawn(&["supervisor"])?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    for _ in 0..4 {
        let a = accepted(&p, &recruit(run, "a1", "patents")).await?;
        assert_eq!((a.status, a.seq), (RecruitStatus::Accepted, first.seq));
    }
    p.kill(second_supervisor);

    let outcome = p.client.wait(run, Duration::from_secs(60)).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    Ok(())
}

/// The opt-in `recruit` tool of an LLM agent (the OpenAI-compatible test double replies from a
/// script): the first call is accepted and the recruit runs; the second names a role the
/// policy does not allow, and the model gets the rule as the tool's error.
#[tokio::test]
async fn an_llm_agent_recruits_with_its_tool_and_hears_refusals() -> anyhow::Result<()> {
    use flotilla_testkit::openai::{OpenAiServer, Reply};
    use serde_json::json;
    let llm = OpenAiServer::start().await?;
    llm.push(Reply::tool_call(
        "recruit",
        json!({"role": "patents", "description": "find the patents", "reason": "a skill we lack"}),
    ));
    llm.push(Reply::tool_call(
        "recruit",
        json!({"role": "chef", "description": "cook", "reason": "hungry"}),
    ));
    llm.push(Reply::text("The patent analyst is on it."));
    let p = services_with(&format!(
        r#"
[agents.lead-llm]
kind = "llm"
base-url = "{}"
model = "scripted-model"
tools = ["recruit"]
"#,
        llm.base_url()
    ))
    .await?;
    let run = submit(
        &p,
        vec![Subtask::new("lead", "analyse the competitor").with_agent("lead-llm")],
        PlanConfig::default(),
    )
    .await?;
    let outcome = p.client.wait(run, Duration::from_secs(60)).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let requests = llm.requests();
    assert_eq!(requests.len(), 3);
    assert_eq!(requests[0].tool_names(), vec!["recruit"]);
    let results: Vec<String> = requests[2]
        .messages()
        .iter()
        .filter(|m| m["role"] == "tool")
        .filter_map(|m| m["content"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(results.len(), 2, "{results:?}");
    assert!(results[0].contains("accepted"), "{}", results[0]);
    assert!(results[1].contains("role_not_allowed"), "{}", results[1]);
    let v = view(&p, run).await?;
    assert_eq!(v.tasks.len(), 2, "{:?}", v.tasks);
    assert_eq!(v.team.len(), 1);
    assert_eq!(v.team[0].by, "task:lead");
    Ok(())
}

/// A supervisor that died after appending a recruit and before answering: the input is on the
/// run log (appended here exactly as the supervisor does), the caller never heard back and
/// asks again with the same recruit id — of the surviving replica, after the run applied it —
/// and gets the recorded outcome; the run has the recruit once.
#[tokio::test]
async fn a_recruit_whose_answer_was_lost_is_answered_again_never_doubled() -> anyhow::Result<()> {
    use flotilla_model::runlog::{Recruited, RunInput, RunLogEntry};
    let p = services().await?;
    let run = submit(
        &p,
        vec![Subtask::new("hold", "hold the run open").with_agent("slow")],
        PlanConfig::default(),
    )
    .await?;
    task_started(&p.client, run, "hold").await?;
    let request = recruit(run, "lost1", "patents");
    let mut subtask = flotilla_model::recruit::recruit_subtask(&request);
    subtask.pool = "default".into();
    let entry = RunLogEntry {
        protocol: 1,
        run_id: run,
        input: RunInput::Recruited(Box::new(Recruited {
            recruit_id: "lost1".into(),
            subtask,
            by: "operator".into(),
            reason: request.reason.clone(),
        })),
    };
    let msg_id = flotilla_model::recruit::recruited_msg_id(run, "lost1");
    let out =
        flotilla_bus::wire::encode(&entry, flotilla_model::codec::Codec::Json, Some(&msg_id))?;
    // Twice, as a supervisor retrying its publish would: stored once.
    for _ in 0..2 {
        p.bus
            .js()
            .publish_with_headers(
                p.bus.names().runlog(run),
                out.headers.clone(),
                out.payload.clone(),
            )
            .await?
            .await?;
    }
    // The caller asks again with the same id until the run has applied it: the recorded
    // outcome, the same task, never a second recruit.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let answer = loop {
        let a = accepted(&p, &request).await?;
        if a.status == RecruitStatus::Accepted {
            break a;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "never applied: {a:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(answer.task_id, TaskId::new("recruit-lost1"));
    let v = view(&p, run).await?;
    let recruited: Vec<_> = v
        .team
        .iter()
        .filter(|c| c.kind == TeamChangeKind::Recruited)
        .collect();
    assert_eq!(recruited.len(), 1, "{:?}", v.team);
    assert_eq!(v.tasks.len(), 2);
    let outcome = p.client.wait(run, Duration::from_secs(60)).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    Ok(())
}

#[tokio::test]
async fn retiring_a_member_hands_its_unstarted_task_to_the_role() -> anyhow::Result<()> {
    let p = services().await?;
    let mut next = Subtask::new("next", "write it up")
        .after(&["hold"])
        .with_agent("writer");
    next.role = Some("writer".into());
    let run = submit(
        &p,
        vec![
            Subtask::new("hold", "hold the run open").with_agent("slow"),
            next,
        ],
        PlanConfig::default(),
    )
    .await?;
    task_started(&p.client, run, "hold").await?;
    let retire = |member: &str| RetireRequest {
        protocol: 1,
        run_id: run,
        member: member.into(),
        reason: "moved to another team".into(),
        policy: RetirePolicy::Reassign,
        by_task: None,
    };
    // A member the run does not name: refused.
    let e = p
        .client
        .call(&retire("patents"), ASK)
        .await?
        .expect_err("not a member");
    assert_eq!(e.rule.as_deref(), Some("not_a_member"), "{e:?}");
    let reply: RetireReply = p.client.request(&retire("writer"), ASK).await?;
    assert_eq!(reply.status, RecruitStatus::Accepted);
    let change = reply.change.expect("applied");
    assert_eq!(change.reassigned, vec![TaskId::new("next")]);
    let outcome = p.client.wait(run, Duration::from_secs(60)).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    // `next` ran as an anycast task: claimed from the writer role's queue.
    let history = flotilla_coordinator::store::RunStore::open(&p.bus)
        .await?
        .history(run)
        .await?;
    assert!(history.iter().any(|(_, _, e)| matches!(
        &e.input,
        flotilla_model::runlog::RunInput::Claimed(c) if c.task_id.as_str() == "next" && c.role == "writer"
    )));
    let out = p.cli(&["runs", "show", &run.to_string()])?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(
            "retired writer (1 reassigned, 0 failed), by operator: moved to another team"
        ),
        "{text}"
    );
    Ok(())
}
