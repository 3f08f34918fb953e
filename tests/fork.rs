//! `run.fork` and `flotilla runs fork` across real processes: a coordinator and a worker
//! process on a real nats-server run a four-task chain, then forks of it — at the last task
//! with another agent, a fork of that fork with other instructions, a fork whose fork point is
//! a sensitive action (it asks a person again) — and the refusals: an unknown run or task, a
//! run still going, a plan that sets `fork` itself, a change the plan cannot take, and a
//! result the fork would keep that is gone from the log.
//!
//! The agents are a small deterministic Python exec script written by the test (not a
//! model): it answers `<who>:<task>` followed by what its dependencies answered, and appends
//! `<who>:<task>` to `calls.log`, so the test counts exactly which tasks ran.

mod support;

use std::time::Duration;

use flotilla_model::ErrorCode;
use flotilla_model::approval::{ApprovalAnswerRequest, Decision};
use flotilla_model::event::{Event, WorkflowPhase};
use flotilla_model::fork::{RunForkReply, RunForkRequest};
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::plan::Subtask;
use flotilla_model::run::RunStatus;
use flotilla_model::subjects::StreamKind;
use flotilla_model::submit::{SubmitRequest, SubmitStatus};
use futures::StreamExt;
use serde_json::{Value, json};
use support::*;

/// Answers `<who>:<task>[<- dependency answers>]` and logs the call.
const ANSWER_PY: &str = r#"import json, sys
who = sys.argv[1]
task = json.load(sys.stdin)
deps = task.get("dependency_results") or {}
seen = " ".join("[" + deps[k]["response"] + "]" for k in sorted(deps))
with open("calls.log", "a") as f:
    f.write(who + ":" + task["task_id"] + "\n")
print(json.dumps({"response": who + ":" + task["task_id"] + (" <- " + seen if seen else "")}))
"#;

const AGENTS: &str = "[agents.plain]\nkind = \"exec\"\ncommand = \"python3\"\nargs = [\"answer.py\", \"plain\"]\n\n\
[agents.careful]\nkind = \"exec\"\ncommand = \"python3\"\nargs = [\"answer.py\", \"careful\"]\n";

fn task(id: &str, deps: &[&str]) -> Subtask {
    Subtask::new(id, "answer").with_agent("plain").after(deps)
}

fn calls(p: &Processes) -> Vec<String> {
    std::fs::read_to_string(p.dir().join("calls.log"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// How many attempts the run's workers started, from its event stream.
async fn started(p: &Processes, run: RunId) -> anyhow::Result<usize> {
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    let mut n = 0;
    while let Some(e) = tokio::time::timeout(WAIT, events.next()).await? {
        if let Event::Workflow(w) = &e?.event {
            n += usize::from(w.phase == WorkflowPhase::TaskStarted);
            if w.phase.ends_run() {
                break;
            }
        }
    }
    Ok(n)
}

async fn fork(p: &Processes, r: &RunForkRequest) -> anyhow::Result<RunForkReply> {
    Ok(p.client.request(r, WAIT).await?)
}

/// A coordinator and a worker process, and the chain a → b → c → d run to its end.
async fn chain_of_four() -> anyhow::Result<(Processes, RunId)> {
    let mut p = Processes::start(AGENTS).await?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "2"]).await?;
    std::fs::write(p.dir().join("answer.py"), ANSWER_PY)?;
    let original = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            task("a", &[]),
            task("b", &["a"]),
            task("c", &["b"]),
            task("d", &["c"]),
        ])))
        .await?;
    let o = p.client.wait(original, WAIT).await?;
    assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
    Ok((p, original))
}

fn ids(v: &[TaskId]) -> Vec<&str> {
    v.iter().map(TaskId::as_str).collect()
}

#[tokio::test]
async fn a_fork_reruns_only_its_fork_point_and_downstream_and_keeps_the_rest() -> anyhow::Result<()>
{
    let (p, original) = chain_of_four().await?;
    assert_eq!(calls(&p), ["plain:a", "plain:b", "plain:c", "plain:d"]);

    // Fork at the last task with another agent, over the wire: one task runs, with the
    // original's c as its dependency; a, b and c are kept.
    let mut r = RunForkRequest::new(original, TaskId::new("d"));
    r.agent = Some("careful".into());
    r.wait = true;
    let f1 = fork(&p, &r).await?;
    assert_eq!(f1.status, SubmitStatus::Finished, "{f1:?}");
    assert_eq!(
        (ids(&f1.reused), ids(&f1.rerun)),
        (vec!["a", "b", "c"], vec!["d"])
    );
    let fork1 = f1.run_id.expect("the fork's id");
    let out = f1.outcome.as_ref().expect("waited for the outcome");
    assert_eq!(out.status, RunStatus::Succeeded, "{out:?}");
    let answer = &out.final_result.as_ref().expect("a final result").response;
    assert_eq!(answer, "careful:d <- [plain:c <- [plain:b <- [plain:a]]]");
    assert_eq!(calls(&p)[4..], ["careful:d"], "only the fork point ran");
    assert_eq!(
        started(&p, fork1).await?,
        1,
        "exactly one attempt dispatched"
    );
    let view = p.client.run(fork1).await?.expect("the fork exists");
    let origin = view.record.fork_of.as_ref().expect("fork_of on the record");
    assert_eq!(
        (origin.run_id, origin.task_id.as_str(), origin.reused),
        (original, "d", 3)
    );
    let kept: Vec<u32> = view.tasks.iter().map(|t| t.attempts).collect();
    assert_eq!(kept, [0, 0, 0, 1], "kept tasks were never attempted");
    assert!(
        p.client
            .run(original)
            .await?
            .expect("original")
            .record
            .fork_of
            .is_none(),
        "the original is not written"
    );
    let line = format!("fork of   {original} at d (3 results kept)");
    for cmd in ["show", "tree"] {
        let out = p.cli(&["runs", cmd, &fork1.to_string()])?;
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains(&line), "runs {cmd}: {text}");
    }

    // Compared with the original: only d changed.
    let d = p
        .client
        .diff(original, fork1)
        .await?
        .expect("both runs exist");
    let changed: Vec<&str> = d
        .tasks
        .iter()
        .filter(|t| t.changed)
        .map(|t| t.task_id.as_str())
        .collect();
    assert_eq!(changed, ["d"]);

    // Replayed from their logs through the machine alone, the original and the fork reach
    // the decisions they recorded (no agent runs: the call log does not grow).
    let out = p.cli(&["runs", "replay", &original.to_string()])?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("the same decisions"), "{text}");
    let out = p.cli(&["runs", "replay", &fork1.to_string(), "--json"])?;
    let report: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(out.status.code(), Some(0), "{report}");
    assert_eq!(report["same"], true, "{report}");
    assert!(report["events"].as_u64() >= Some(5), "{report}");
    assert_eq!(calls(&p).len(), 5, "a replay runs no agent");

    // A fork of the fork, through the CLI, with other instructions for c: c and d rerun.
    std::fs::write(p.dir().join("careful.md"), "answer with care")?;
    let out = p.cli(&[
        "runs",
        "fork",
        &fork1.to_string(),
        "--at",
        "c",
        "--instructions",
        "careful.md",
        "--wait",
        "--json",
    ])?;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let f2: RunForkReply = serde_json::from_slice(&out.stdout)?;
    assert_eq!(
        (ids(&f2.reused), ids(&f2.rerun)),
        (vec!["a", "b"], vec!["c", "d"])
    );
    assert_eq!(f2.fork_of, fork1);
    assert_eq!(calls(&p)[5..], ["plain:c", "careful:d"]);
    let fork2 = f2.run_id.expect("the second fork's id");
    let reader = flotilla_runs::RunReader::open(&p.bus).await?;
    let plan2 = reader.plan(fork2).await?.expect("the fork's plan");
    assert_eq!(plan2.subtasks[2].description, "answer with care");
    assert_eq!(plan2.subtasks[3].agent.as_deref(), Some("careful"));
    // As a person reads it.
    let out = p.cli(&["runs", "fork", &original.to_string(), "--at", "b"])?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains(&format!("of run {original} at b")), "{text}");
    assert!(text.contains("reused: a\n"), "{text}");
    assert!(text.contains("rerun:  b, c, d"), "{text}");
    let third: RunId = text
        .split_whitespace()
        .nth(1)
        .and_then(|id| id.parse().ok())
        .expect("the fork's id printed");
    assert_eq!(
        p.client.wait(third, WAIT).await?.status,
        RunStatus::Succeeded
    );
    // The same fork id again: the same run.
    let mut again = RunForkRequest::new(original, TaskId::new("d"));
    again.fork_run_id = Some(fork1);
    assert_eq!(fork(&p, &again).await?.status, SubmitStatus::Duplicate);

    // Bad input is named and starts nothing.
    let before = calls(&p).len();
    let refused = |r: RunForkRequest| {
        let client = p.client.clone();
        async move {
            client
                .call(&r, WAIT)
                .await?
                .err()
                .ok_or_else(|| anyhow::anyhow!("a bad fork was accepted"))
        }
    };
    let ghost = RunId::new();
    let e = refused(RunForkRequest::new(ghost, TaskId::new("a"))).await?;
    assert_eq!(
        (e.status, e.code.as_str()),
        (404, ErrorCode::UnknownRun.as_str())
    );
    assert!(e.message.contains(&ghost.to_string()), "{}", e.message);
    let e = refused(RunForkRequest::new(original, TaskId::new("zz"))).await?;
    assert_eq!(
        (e.status, e.code.as_str()),
        (404, ErrorCode::UnknownTask.as_str())
    );
    assert!(e.message.contains("its tasks: a, b, c, d"), "{}", e.message);
    let mut bad_agent = RunForkRequest::new(original, TaskId::new("c"));
    bad_agent.agent = Some("nobody".into());
    let e = refused(bad_agent).await?;
    assert_eq!(
        (e.status, e.code.as_str()),
        (400, ErrorCode::InvalidPlan.as_str())
    );
    assert!(
        e.problems
            .iter()
            .any(|p| p.code.as_str() == "unknown_agent"),
        "{e:?}"
    );
    let reply = p
        .bus
        .client()
        .request(
            "flotilla.api.run.fork",
            serde_json::to_vec(&json!({"run_id": original.to_string()}))?.into(),
        )
        .await?;
    let body: Value = serde_json::from_slice(&reply.payload)?;
    assert_eq!(body["code"], "malformed", "{body}");
    let out = p.cli(&["runs", "fork", &ghost.to_string(), "--at", "a"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("unknown_run"), "{err}");
    // A plan that says itself what it reuses is refused: only run.fork writes `fork`.
    let mut forged = plan(vec![task("a", &[])]);
    forged.fork = plan2.fork.clone();
    let reply = p
        .client
        .submit_request(&SubmitRequest::new(forged), WAIT)
        .await?;
    assert_eq!(reply.status, SubmitStatus::Rejected, "{reply:?}");
    assert_eq!(reply.errors[0].code.as_str(), "fork_reserved", "{reply:?}");
    assert_eq!(calls(&p).len(), before, "no refused fork ran anything");

    // A result the fork would keep is gone from the log: refused, naming it.
    let state = reader.state(third).await?.expect("the third fork's state");
    let lost = state.tasks[1].result_seq;
    p.bus
        .js()
        .get_stream(p.bus.names().stream(StreamKind::RunLog))
        .await?
        .delete_message(lost)
        .await?;
    let e = refused(RunForkRequest::new(third, TaskId::new("d"))).await?;
    assert_eq!(
        (e.status, e.code.as_str()),
        (409, ErrorCode::ResultMissing.as_str())
    );
    assert!(
        e.message.contains("task b's result") && e.message.contains(&lost.to_string()),
        "{}",
        e.message
    );
    // Its replay no longer reaches what it recorded, and says where.
    let out = p.cli(&["runs", "replay", &third.to_string(), "--json"])?;
    let report: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(out.status.code(), Some(1), "{report}");
    assert_eq!(report["same"], false, "{report}");
    assert_eq!(report["divergence"]["task_id"], "b", "{report}");
    let out = p.cli(&["runs", "replay", &ghost.to_string()])?;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not exist"));
    Ok(())
}

/// A fork with a plan edit (`--edit FILE`): the edited task runs afresh with what follows
/// it, next to the fork point; an edit of a task the plan does not have is refused.
#[tokio::test]
async fn a_fork_with_a_plan_edit_reruns_the_edited_task_and_what_follows() -> anyhow::Result<()> {
    let (p, original) = chain_of_four().await?;
    // The fork point is d; the edit gives b another agent: b, c and d run, a is kept.
    let edit = serde_json::to_string(&task("b", &["a"]).with_agent("careful"))?;
    std::fs::write(p.dir().join("edit.json"), edit)?;
    let run = original.to_string();
    let out = p.cli(&[
        "runs",
        "fork",
        &run,
        "--at",
        "d",
        "--edit",
        "edit.json",
        "--wait",
        "--json",
    ])?;
    let reply: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(out.status.code(), Some(0), "{reply}");
    assert_eq!(
        (&reply["reused"], &reply["rerun"]),
        (&json!(["a"]), &json!(["b", "c", "d"])),
        "{reply}"
    );
    assert_eq!(calls(&p)[4..], ["careful:b", "plain:c", "plain:d"]);
    assert_eq!(
        reply["outcome"]["final_result"]["response"],
        "plain:d <- [plain:c <- [careful:b <- [plain:a]]]"
    );
    // An edit of a task the plan does not have: refused, naming it, and nothing runs.
    std::fs::write(
        p.dir().join("ghost.json"),
        serde_json::to_string(&[task("ghost", &[])])?,
    )?;
    let out = p.cli(&["runs", "fork", &run, "--at", "d", "--edit", "ghost.json"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("unknown_task") && err.contains("\"ghost\"") && err.contains("an edit"),
        "{err}"
    );
    std::fs::write(p.dir().join("bad.json"), r#"{"id": "b", "colour": 1}"#)?;
    let out = p.cli(&["runs", "fork", &run, "--at", "d", "--edit", "bad.json"])?;
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown field `colour`"));
    assert_eq!(calls(&p).len(), 7, "no refused fork ran anything");

    // More workspace entries from kept tasks than a fork copies: refused, naming the cap.
    // (Written here as a's agent writes them: with a's writer.)
    let write = serde_json::to_vec(&json!({"entry": {"n": 1},
        "writer": {"run_id": original.to_string(), "task_id": "a", "attempt": 1}}))?;
    let subject = p.bus.names().workspace(original, "notes");
    // In rounds whose acks are awaited: the client holds a bounded number unacknowledged.
    for round in 0..=20 {
        let mut acks = Vec::new();
        for _ in 0..(if round < 20 { 500 } else { 1 }) {
            acks.push(
                p.bus
                    .js()
                    .publish(subject.clone(), write.clone().into())
                    .await?,
            );
        }
        futures::future::try_join_all(acks.into_iter().map(|a| a.into_future())).await?;
    }
    let e = p
        .client
        .call(&RunForkRequest::new(original, TaskId::new("d")), WAIT)
        .await?
        .expect_err("refused");
    assert_eq!((e.status, e.code.as_str()), (413, "too_large"), "{e:?}");
    assert!(
        e.message.contains("more than 10000 workspace entries"),
        "{}",
        e.message
    );
    assert_eq!(calls(&p).len(), 7, "the refused fork ran nothing");
    Ok(())
}

#[tokio::test]
async fn a_fork_point_that_is_a_sensitive_action_asks_again_and_a_running_run_is_not_forked()
-> anyhow::Result<()> {
    let mut p = Processes::start(AGENTS).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    std::fs::write(p.dir().join("answer.py"), ANSWER_PY)?;
    let mut publish = task("publish", &["draft"]);
    publish.action = Some("publish".into());
    publish.input = json!({"channel": "news"});
    let original = p
        .client
        .submit(SubmitRequest::new(plan(vec![task("draft", &[]), publish])))
        .await?;
    let pending = wait_approvals(&p, original, 1).await?;
    // Waiting for a person: the run has not ended, so it is not forked.
    let e = p
        .client
        .call(&RunForkRequest::new(original, TaskId::new("publish")), WAIT)
        .await?
        .expect_err("a running run is not forked");
    assert_eq!(
        (e.status, e.code.as_str()),
        (409, ErrorCode::RunNotEnded.as_str())
    );
    p.client
        .request(&answer(original, &pending, Decision::Approve), WAIT)
        .await?;
    assert_eq!(
        p.client.wait(original, WAIT).await?.status,
        RunStatus::Succeeded
    );

    // The fork changes the action's input: the original's approval is not reused.
    let mut r = RunForkRequest::new(original, TaskId::new("publish"));
    r.input = Some(json!({"channel": "internal"}));
    let f = fork(&p, &r).await?;
    assert_eq!(
        (ids(&f.reused), ids(&f.rerun)),
        (vec!["draft"], vec!["publish"])
    );
    let forked = f.run_id.expect("the fork's id");
    let asked = wait_approvals(&p, forked, 1).await?;
    let listed = approvals_of(&p.client, forked, false).await?;
    assert_eq!(listed[0].request.input, json!({"channel": "internal"}));
    p.client
        .request(
            &answer(
                forked,
                &asked,
                Decision::Reject {
                    message: "not on the internal channel".into(),
                },
            ),
            WAIT,
        )
        .await?;
    let o = p.client.wait(forked, WAIT).await?;
    assert_eq!(o.status, RunStatus::Failed, "{o:?}");
    assert_eq!(
        calls(&p),
        ["plain:draft", "plain:publish"],
        "the rejected fork point never ran"
    );
    Ok(())
}

/// The id of the run's first pending approval, once `n` are pending.
async fn wait_approvals(p: &Processes, run: RunId, n: usize) -> anyhow::Result<String> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let l = approvals_of(&p.client, run, false).await?;
        if l.len() >= n {
            return Ok(l[0].request.approval_id.clone());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "no approval asked in run {run}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn answer(run: RunId, id: &str, decision: Decision) -> ApprovalAnswerRequest {
    ApprovalAnswerRequest {
        protocol: flotilla_model::PROTOCOL_VERSION,
        run_id: run,
        approval_id: id.into(),
        decision,
        by: "alice".into(),
        comment: None,
        digest: None,
        always: false,
        incident: false,
    }
}

#[tokio::test]
async fn an_eval_forks_every_selected_run_with_the_variant_and_resumes_without_running_twice()
-> anyhow::Result<()> {
    let mut p = Processes::start(AGENTS).await?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "4"]).await?;
    std::fs::write(p.dir().join("answer.py"), ANSWER_PY)?;
    let mut originals = Vec::new();
    for _ in 0..4 {
        let mut pl = plan(vec![task("a", &[]), task("b", &["a"])]);
        pl.name = Some("evaluated".into());
        let run = p.client.submit(SubmitRequest::new(pl)).await?;
        assert_eq!(p.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
        originals.push(run);
    }
    // A run of another plan is not selected.
    let other = p
        .client
        .submit(SubmitRequest::new(plan(vec![task("a", &[])])))
        .await?;
    p.client.wait(other, WAIT).await?;
    let ran = calls(&p).len();
    std::fs::write(
        p.dir().join("careful.toml"),
        "at = \"b\"\nagent = \"careful\"\n",
    )?;
    let eval = |p: &Processes| {
        p.cli(&[
            "eval",
            "--variant",
            "careful.toml",
            "--plan",
            "evaluated",
            "--json",
        ])
    };
    let out = eval(&p)?;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(report["runs"], 4, "{report}");
    assert_eq!(report["fork_succeeded"], 4, "{report}");
    assert_eq!(report["changed_runs"], 4, "{report}");
    assert_eq!(report["errors"], 0, "{report}");
    let rows = report["rows"].as_array().expect("rows");
    let mut listed: Vec<String> = rows
        .iter()
        .map(|r| r["run_id"].as_str().unwrap_or_default().to_owned())
        .collect();
    listed.sort();
    let mut expected: Vec<String> = originals.iter().map(ToString::to_string).collect();
    expected.sort();
    assert_eq!(listed, expected);
    assert!(
        rows.iter().all(|r| r["changed"] == json!(["b"])),
        "{report}"
    );
    let new_calls = &calls(&p)[ran..];
    assert_eq!(new_calls, vec!["careful:b"; 4], "only the fork points ran");
    // Run again (as after an interruption): the same forks are found, none runs again.
    let out = p.cli(&["eval", "--variant", "careful.toml", "--plan", "evaluated"])?;
    let table = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{table}");
    assert!(
        table.contains("4 runs forked at b: 4 of 4 forks succeeded"),
        "{table}"
    );
    assert_eq!(calls(&p).len(), ran + 4, "no fork ran twice");
    // A variant whose fork point the runs do not have: every row names the refusal.
    std::fs::write(p.dir().join("nowhere.json"), r#"{"at": "zz"}"#)?;
    let out = p.cli(&[
        "eval",
        "--variant",
        "nowhere.json",
        "--runs",
        &originals[0].to_string(),
        "--json",
    ])?;
    assert_eq!(out.status.code(), Some(1));
    let report: Value = serde_json::from_slice(&out.stdout)?;
    assert!(
        report["rows"][0]["error"]
            .as_str()
            .unwrap_or_default()
            .contains("unknown_task"),
        "{report}"
    );
    // A variant that is not one is refused before anything is forked.
    std::fs::write(p.dir().join("bad.json"), r#"{"at": "b", "temperature": 2}"#)?;
    let out = p.cli(&["eval", "--variant", "bad.json", "--plan", "evaluated"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("unknown field `temperature`"), "{err}");
    std::fs::write(p.dir().join("bad.json"), r#"{"at": ":2"}"#)?;
    let out = p.cli(&["eval", "--variant", "bad.json", "--plan", "evaluated"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("names no task"), "{err}");
    assert_eq!(calls(&p).len(), ran + 4);
    Ok(())
}
