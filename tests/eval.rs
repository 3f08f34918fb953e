//! `flotilla eval` with a judge and a budget, across real processes: a coordinator and a
//! worker process on a real nats-server run two-task chains, then `flotilla eval` forks them
//! at their last task with another agent — scored by a judge agent, resumed without a new
//! judge call, judged by an agent that answers no score, stopped by a token and a cost
//! budget, and refused bad budget flags before it forks anything.
//!
//! Every agent is a deterministic test double, not a model: the originals' agent `plain` and
//! the judges are small Python exec scripts written by the test, which append each call to
//! `calls.log` so the test counts exactly what ran; the variant's agent `writer` is an LLM
//! agent on the test kit's scripted OpenAI-compatible server (`flotilla_testkit::openai`),
//! whose replies — and their token usage — are scripted here, and whose recorded requests
//! count the model calls.

mod support;

use flotilla_model::ids::RunId;
use flotilla_model::plan::Subtask;
use flotilla_model::run::RunStatus;
use flotilla_model::submit::SubmitRequest;
use flotilla_testkit::openai::{OpenAiServer, Reply};
use serde_json::Value;
use support::*;

/// Answers `<who>:<task>[ <- dependency answers]` and logs the call.
const ANSWER_PY: &str = r#"import json, sys
who = sys.argv[1]
task = json.load(sys.stdin)
deps = task.get("dependency_results") or {}
seen = " ".join("[" + deps[k]["response"] + "]" for k in sorted(deps))
with open("calls.log", "a") as f:
    f.write(who + ":" + task["task_id"] + "\n")
print(json.dumps({"response": who + ":" + task["task_id"] + (" <- " + seen if seen else "")}))
"#;

/// A judge: scores 1 when the fork's final answer is the original's, else 0, and logs the
/// call with the fork it judged. With an argument it answers words instead of a score.
const JUDGE_PY: &str = r#"import json, sys
pair = json.load(sys.stdin)["input"]
with open("calls.log", "a") as f:
    f.write("judge:" + pair["fork"]["run_id"] + "\n")
if len(sys.argv) > 1:
    print("I cannot decide")
else:
    same = pair["original"]["response"] == pair["fork"]["response"]
    verdict = {"score": 1 if same else 0, "reason": "same answer" if same else "another answer"}
    print(json.dumps({"response": json.dumps(verdict)}))
"#;

/// `writer` costs $1,000 per million tokens either way: $0.12 for a 120-token call.
fn agents(base_url: &str) -> String {
    format!(
        r#"
[agents.plain]
kind = "exec"
command = "python3"
args = ["answer.py", "plain"]

[agents.judge]
kind = "exec"
command = "python3"
args = ["judge.py"]

[agents.garbage]
kind = "exec"
command = "python3"
args = ["judge.py", "garbage"]

[agents.writer]
kind = "llm"
base-url = "{base_url}"
model = "scripted-model"
price = {{ input-per-mtok = 1000.0, output-per-mtok = 1000.0 }}
"#
    )
}

/// The deployment, the scripts, and `n` ended runs of the plan `name` (`a` then `b`, both
/// `plain`), oldest first.
async fn runs_of(name: &str, n: usize) -> anyhow::Result<(OpenAiServer, Processes, Vec<RunId>)> {
    let llm = OpenAiServer::start().await?;
    let mut p = Processes::start(&agents(&llm.base_url())).await?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "4"]).await?;
    std::fs::write(p.dir().join("answer.py"), ANSWER_PY)?;
    std::fs::write(p.dir().join("judge.py"), JUDGE_PY)?;
    std::fs::write(
        p.dir().join("writer.toml"),
        "at = \"b\"\nagent = \"writer\"\n",
    )?;
    let mut originals = Vec::new();
    for _ in 0..n {
        let mut pl = plan(vec![
            Subtask::new("a", "answer").with_agent("plain"),
            Subtask::new("b", "answer")
                .with_agent("plain")
                .after(&["a"]),
        ]);
        pl.name = Some(name.into());
        let run = p.client.submit(SubmitRequest::new(pl)).await?;
        assert_eq!(p.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
        originals.push(run);
    }
    Ok((llm, p, originals))
}

fn calls(p: &Processes) -> Vec<String> {
    std::fs::read_to_string(p.dir().join("calls.log"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

fn judge_calls(p: &Processes) -> usize {
    calls(p).iter().filter(|c| c.starts_with("judge:")).count()
}

/// `flotilla eval --variant writer.toml --plan PLAN ARGS…`: its exit code, stdout, stderr.
fn eval(p: &Processes, plan: &str, args: &[&str]) -> anyhow::Result<(Option<i32>, String, String)> {
    let mut all = vec!["eval", "--variant", "writer.toml", "--plan", plan];
    all.extend_from_slice(args);
    let out = p.cli(&all)?;
    Ok((
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

fn json(stdout: &str) -> anyhow::Result<Value> {
    Ok(serde_json::from_str(stdout)?)
}

// Several threads: the scripted model server runs on the test's runtime while the test
// thread waits for a `flotilla eval` process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_judge_scores_each_pair_and_an_eval_run_again_asks_it_nothing_again() -> anyhow::Result<()>
{
    let (llm, p, originals) = runs_of("judged", 2).await?;
    // The first fork's writer answers what the original did, the second something else.
    llm.push(Reply::text("plain:b <- [plain:a]").usage(100, 20));
    llm.push(Reply::text("a rewritten answer").usage(100, 20));
    let (code, out, err) = eval(
        &p,
        "judged",
        &["--judge", "judge", "--concurrency", "1", "--json"],
    )?;
    assert_eq!(code, Some(0), "{err}");
    let report = json(&out)?;
    let rows = report["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2, "{report}");
    // Rows in run order: the originals were made oldest first, as the forks ran.
    assert_eq!(rows[0]["run_id"], originals[0].to_string());
    assert_eq!(
        (&rows[0]["score"], &rows[0]["judge_reason"]),
        (&Value::from(1.0), &Value::from("same answer")),
        "{report}"
    );
    assert_eq!(
        (&rows[1]["score"], &rows[1]["judge_reason"]),
        (&Value::from(0.0), &Value::from("another answer")),
        "{report}"
    );
    assert!(
        rows.iter()
            .all(|r| r["status"] == "compared" && r["judge_error"].is_null()),
        "{report}"
    );
    assert_eq!(report["judge"]["agent"], "judge", "{report}");
    assert_eq!(report["judge"]["judged"], 2, "{report}");
    assert_eq!(report["judge"]["errors"], 0, "{report}");
    assert_eq!(report["judge"]["mean_score"], 0.5, "{report}");
    assert_eq!(rows[0]["fork_usage"]["prompt_tokens"], 100, "{report}");
    assert!(report.get("budget").is_none(), "no budget given: {report}");
    // Each judgement is a run of its own: a one-task run of the judge, labelled with its fork.
    let judged = rows[1]["judge_run_id"].as_str().expect("a judge run id");
    let view = p
        .client
        .run(judged.parse()?)
        .await?
        .expect("the judge run exists");
    assert_eq!(view.record.name.as_deref(), Some("eval-judge"));
    assert_eq!(
        view.record.labels.get("eval.judge-of").map(String::as_str),
        rows[1]["fork_id"].as_str()
    );
    assert_eq!(view.tasks.len(), 1);
    assert_eq!(judge_calls(&p), 2);
    assert_eq!(llm.requests().len(), 2);
    assert!(
        err.contains("score 1.00") && err.contains("score 0.00"),
        "progress: {err}"
    );

    // Run again (as after an interruption): the forks and judgements are found, not paid for
    // again; the table has the score column and the mean.
    let (code, table, err) = eval(&p, "judged", &["--judge", "judge"])?;
    assert_eq!(code, Some(0), "{err}");
    assert!(
        table
            .lines()
            .next()
            .is_some_and(|h| h.ends_with("| score |")),
        "{table}"
    );
    assert!(
        table.contains("| 1.00 |") && table.contains("| 0.00 |"),
        "{table}"
    );
    assert!(
        table.contains("Judge judge: mean score 0.50 over 2 pairs, 0 judge errors"),
        "{table}"
    );
    assert_eq!(judge_calls(&p), 2, "no judge ran again");
    assert_eq!(llm.requests().len(), 2, "no fork ran again");

    // A judge that answers no score: each row says so, the rest of the report stands.
    let (code, out, err) = eval(&p, "judged", &["--judge", "garbage", "--json"])?;
    assert_eq!(code, Some(1), "{err}");
    let report = json(&out)?;
    for row in report["rows"].as_array().expect("rows") {
        let e = row["judge_error"].as_str().unwrap_or_default();
        assert!(e.contains("not a score: \"I cannot decide\""), "{report}");
        assert!(row["score"].is_null(), "{report}");
        assert_eq!(row["fork"], "succeeded", "{report}");
    }
    assert_eq!(report["judge"]["errors"], 2, "{report}");
    assert!(report["judge"]["mean_score"].is_null(), "{report}");
    assert_eq!(report["fork_succeeded"], 2, "{report}");
    assert_eq!(judge_calls(&p), 4, "the other judge ran once per pair");
    // A judge the deployment does not have: its runs are refused, naming the problem.
    let (code, out, _) = eval(&p, "judged", &["--judge", "nobody", "--json"])?;
    assert_eq!(code, Some(1));
    let report = json(&out)?;
    let e = report["rows"][0]["judge_error"]
        .as_str()
        .unwrap_or_default();
    assert!(
        e.contains("rejected") && e.contains("unknown_agent"),
        "{report}"
    );

    // Without --judge nothing of it shows.
    let (code, table, err) = eval(&p, "judged", &[])?;
    assert_eq!(code, Some(0), "{err}");
    assert!(
        !table.contains("score") && !table.contains("Judge"),
        "{table}"
    );
    assert_eq!(llm.requests().len(), 2);
    Ok(())
}

// Several threads: the scripted model server runs on the test's runtime while the test
// thread waits for a `flotilla eval` process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_stops_the_eval_after_the_first_forks_and_bad_budgets_are_refused()
-> anyhow::Result<()> {
    let (llm, p, originals) = runs_of("budgeted", 4).await?;
    for _ in 0..4 {
        llm.push(Reply::text("a rewritten answer").usage(100, 20));
    }
    // 120 tokens per fork: the second reaches 200, so the last two do not start.
    let (code, out, err) = eval(
        &p,
        "budgeted",
        &["--max-tokens", "200", "--concurrency", "1", "--json"],
    )?;
    assert_eq!(code, Some(3), "{err}");
    let report = json(&out)?;
    let rows = report["rows"].as_array().expect("rows");
    let states: Vec<&str> = rows
        .iter()
        .map(|r| r["status"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        states,
        ["compared", "compared", "not_run", "not_run"],
        "{report}"
    );
    assert_eq!(rows[3]["run_id"], originals[3].to_string());
    let why = "eval budget spent (240 tokens / $0.2400 of 200 tokens)";
    assert_eq!(rows[2]["reason"], why, "{report}");
    assert!(rows[2]["fork"].is_null(), "{report}");
    let budget = &report["budget"];
    assert_eq!(budget["max_tokens"], 200, "{report}");
    assert_eq!(budget["stopped"], true, "{report}");
    assert_eq!(budget["not_run"], 2, "{report}");
    assert_eq!(budget["spent"]["prompt_tokens"], 200, "{report}");
    assert_eq!(budget["reason"], why, "{report}");
    assert_eq!(report["errors"], 0, "not run is no error: {report}");
    assert_eq!(
        llm.requests().len(),
        2,
        "no fork started after the budget was spent"
    );
    assert!(err.contains(&format!("{why}: 2 runs not forked")), "{err}");

    // Run again with the same budget: the two forks are found, counted, and it stops at the
    // same run, with no model call.
    let (code, table, err) = eval(
        &p,
        "budgeted",
        &["--max-tokens", "200", "--concurrency", "1"],
    )?;
    assert_eq!(code, Some(3), "{err}");
    assert!(table.contains("| not_run: eval budget spent"), "{table}");
    assert!(
        table.contains("2 of 4 runs forked at b: 2 of 2 forks succeeded"),
        "{table}"
    );
    assert!(
        table.contains(
            "Budget 200 tokens: spent 240 tokens / $0.2400; stopped by the budget, 2 runs not run"
        ),
        "{table}"
    );
    assert_eq!(llm.requests().len(), 2);
    // A cost budget: the first fork found already cost $0.12 of $0.10.
    let (code, out, _) = eval(
        &p,
        "budgeted",
        &["--max-cost", "0.10", "--concurrency", "1", "--json"],
    )?;
    assert_eq!(code, Some(3));
    let report = json(&out)?;
    assert_eq!(report["budget"]["not_run"], 3, "{report}");
    assert_eq!(
        report["budget"]["reason"], "eval budget spent (120 tokens / $0.1200 of $0.1000)",
        "{report}"
    );
    // A larger budget finishes the eval: only the two runs not forked yet call the model.
    let (code, out, err) = eval(&p, "budgeted", &["--max-tokens", "1000", "--json"])?;
    assert_eq!(code, Some(0), "{err}");
    let report = json(&out)?;
    assert_eq!(report["fork_succeeded"], 4, "{report}");
    assert_eq!(report["budget"]["stopped"], false, "{report}");
    assert_eq!(
        report["budget"]["spent"]["completion_tokens"], 80,
        "{report}"
    );
    assert_eq!(llm.requests().len(), 4);

    // Bad budgets are refused before anything is forked (exit 2, naming the flag).
    let ran = calls(&p).len();
    for (flag, value, says) in [
        ("--max-tokens", "0", "more than 0"),
        ("--max-tokens", "-5", "not a number of tokens"),
        ("--max-tokens", "lots", "not a number of tokens"),
        ("--max-cost", "0", "more than $0"),
        ("--max-cost", "-1", "more than $0"),
        ("--max-cost", "cheap", "not an amount in US dollars"),
    ] {
        let (code, _, err) = eval(&p, "budgeted", &[flag, value])?;
        assert_eq!(code, Some(2), "{flag} {value}: {err}");
        assert!(
            err.contains(flag) && err.contains(says),
            "{flag} {value}: {err}"
        );
    }
    assert_eq!(calls(&p).len(), ran);
    assert_eq!(llm.requests().len(), 4);
    Ok(())
}
