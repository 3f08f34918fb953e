//! Contract-net from every agent, end to end against a real nats-server with `flotilla
//! coordinator` and `flotilla worker` processes: exec agents (small deterministic `sh`
//! scripts) negotiate and answer through `flotilla mbox negotiate | next-request | offer |
//! await-award`, an LLM agent (the test kit's scripted OpenAI-compatible double, not a
//! model) calls the `negotiate` tool with a `role:<name>` candidate, and bad input is refused
//! with structured errors that change nothing.

mod support;

use std::process::{Command, Output};

use flotilla_model::RunId;
use flotilla_model::plan::Subtask;
use flotilla_model::run::{RunOutcome, RunStatus};
use flotilla_model::submit::SubmitRequest;
use flotilla_testkit::openai::{OpenAiServer, Reply};
use serde_json::{Value, json};
use support::*;

/// A bidder: takes the next call for offers, offers 0.9 when its task id ends in 2 (else
/// 0.4), waits for the award, then checks that no second request is waiting for it.
const BIDDER: &str = r#"set -e
t="$FLOTILLA_TASK_ID"
req=$("$FLOTILLA_BIN" mbox next-request --wait 30)
c=$(printf '%s' "$req" | sed -n 's/.*"correlation_id":"\([^"]*\)".*/\1/p')
case "$t" in *2) conf=0.9 ;; *) conf=0.4 ;; esac
"$FLOTILLA_BIN" mbox offer --correlation "$c" --confidence "$conf" --payload '{"eta": "1h"}' > "offer-$t.json"
"$FLOTILLA_BIN" mbox await-award --correlation "$c" --wait 30 > "award-$t.json"
"$FLOTILLA_BIN" mbox next-request > "next-$t.json"
cat "award-$t.json"
"#;

fn agents(extra: &str) -> String {
    format!(
        r#"
[agents.lead]
kind = "exec"
command = "sh"
args = ["lead.sh"]
[agents.bidder]
kind = "exec"
command = "sh"
args = ["bidder.sh"]
roles = ["bidder"]
{extra}
"#
    )
}

fn task(id: &str, agent: &str) -> Subtask {
    Subtask::new(id, id).with_agent(agent)
}

fn cli(p: &Processes, args: &[&str]) -> anyhow::Result<Output> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_flotilla"));
    cmd.arg("--config")
        .arg(&p.config)
        .args(args)
        .current_dir(p.dir());
    for (k, _) in std::env::vars() {
        if k.starts_with("FLOTILLA_") {
            cmd.env_remove(k);
        }
    }
    Ok(cmd.stdin(std::process::Stdio::null()).output()?)
}

fn ok_json(out: &Output) -> anyhow::Result<Value> {
    anyhow::ensure!(
        out.status.success(),
        "exit {:?}: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// The exit code and the `{"error": …}` object a command printed on stderr.
fn failure(out: &Output) -> anyhow::Result<(i32, Value)> {
    let text = String::from_utf8_lossy(&out.stderr);
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with("{\"error\""))
        .ok_or_else(|| anyhow::anyhow!("no JSON error on stderr: {text}"))?;
    Ok((
        out.status.code().unwrap_or(-1),
        serde_json::from_str::<Value>(line)?["error"].clone(),
    ))
}

fn read(p: &Processes, name: &str) -> anyhow::Result<Value> {
    Ok(serde_json::from_slice(&std::fs::read(p.dir().join(name))?)?)
}

fn response_of(outcome: &RunOutcome, task: &str) -> anyhow::Result<String> {
    let fr = outcome
        .final_result
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("no final result: {outcome:?}"))?;
    fr.results
        .iter()
        .find(|(id, _)| id.as_str() == task)
        .map(|(_, r)| r.response.clone())
        .ok_or_else(|| anyhow::anyhow!("no result of {task}: {fr:?}"))
}

async fn run_plan(p: &Processes, tasks: Vec<Subtask>) -> anyhow::Result<(RunId, RunOutcome)> {
    let run = p.client.submit(SubmitRequest::new(plan(tasks))).await?;
    let outcome = p.client.wait(run, WAIT).await?;
    Ok((run, outcome))
}

/// Messages sent to `mailbox` so far (every sender), from `mbox stats`.
fn sent_to(p: &Processes, run: &str, mailbox: &str) -> anyhow::Result<u64> {
    let stats = ok_json(&cli(p, &["mbox", "stats", mailbox, "--run", run])?)?;
    stats["sent"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("no sent count: {stats}"))
}

/// One exec task negotiates with two others through the CLI, each a separate process per
/// call: the more confident wins and receives the work; the other learns it lost at once;
/// the request cursor persists across a responder's calls (its second `next-request` finds
/// nothing new). Then, as an operator on the finished run: bad input is refused with
/// structured errors and sends nothing; a negotiation nobody answers ends `no_offers`; and
/// `role:bidder` expands, through the member cards, to both bidders.
#[tokio::test]
async fn an_exec_task_negotiates_with_two_others_and_the_winner_gets_the_work() -> anyhow::Result<()>
{
    let mut p = Processes::start(&agents("")).await?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "4"]).await?;
    std::fs::write(
        p.dir().join("lead.sh"),
        r#"set -e
"$FLOTILLA_BIN" mbox negotiate --candidates b1,b2 --request '{"job": "summarise"}' --work '{"text": "the quarter"}' --deadline 30s
"#,
    )?;
    std::fs::write(p.dir().join("bidder.sh"), BIDDER)?;
    let (run, outcome) = run_plan(
        &p,
        vec![
            task("lead", "lead"),
            task("b1", "bidder"),
            task("b2", "bidder"),
        ],
    )
    .await?;
    assert_eq!(
        outcome.status,
        RunStatus::Succeeded,
        "{outcome:?}\n{}",
        p.log(1)
    );

    let award: Value = serde_json::from_str(&response_of(&outcome, "lead")?)?;
    assert_eq!(award["outcome"], "awarded", "{award}");
    assert_eq!(award["winner"], "b2", "{award}");
    assert_eq!(award["confidence"], 0.9, "{award}");
    assert_eq!(award["candidates"], json!(["b1", "b2"]), "{award}");
    let offers = award["offers"].as_array().expect("offers");
    assert_eq!(offers.len(), 2, "{award}");
    assert_eq!(offers[0]["from"], "b1");
    assert_eq!(
        offers[0]["payload"],
        json!({"eta": "1h", "confidence": 0.4})
    );
    let correlation = award["correlation_id"].as_str().expect("correlation");
    assert!(correlation.contains(".neg-"), "{correlation}");

    let won = read(&p, "award-b2.json")?;
    assert_eq!(won["awarded"], true, "{won}");
    assert_eq!(won["delegation"]["type"], "delegation");
    assert_eq!(won["delegation"]["from"], "lead");
    assert_eq!(won["delegation"]["payload"], json!({"text": "the quarter"}));
    assert_eq!(won["delegation"]["correlation_id"], correlation);
    assert_eq!(award["delegation_seq"], won["delegation"]["seq"]);
    let lost = read(&p, "award-b1.json")?;
    assert_eq!(lost, json!({"awarded": false, "delegation": null}));
    // The request cursor persisted between the responder's processes.
    for t in ["b1", "b2"] {
        assert_eq!(
            read(&p, &format!("next-{t}.json"))?,
            json!({"request": null})
        );
    }

    // Bad input, as an operator acting as the lead: structured, exit 2, nothing sent.
    let run_s = run.to_string();
    let before = (sent_to(&p, &run_s, "b1")?, sent_to(&p, &run_s, "b2")?);
    let negotiate = |candidates: &str, request: &str| {
        cli(
            &p,
            &[
                "mbox",
                "negotiate",
                "--run",
                &run_s,
                "--as",
                "lead",
                "--candidates",
                candidates,
                "--request",
                request,
                "--work",
                "{}",
                "--deadline",
                "300ms",
            ],
        )
    };
    for (candidates, request, code) in [
        ("", "{}", "invalid_address"),
        (" , ", "{}", "invalid_address"),
        ("role:nobody", "{}", "unknown_role"),
        ("b1,role:nobody", "{}", "unknown_role"),
        ("role:no body", "{}", "invalid_address"),
        ("lead", "{}", "invalid_address"),
        ("b1", "{oops", "invalid_json"),
    ] {
        let (exit, e) = failure(&negotiate(candidates, request)?)?;
        assert_eq!(
            (exit, e["code"].as_str()),
            (2, Some(code)),
            "{candidates:?}: {e}"
        );
        assert!(!e["message"].as_str().unwrap_or_default().is_empty());
    }
    let (_, e) = failure(&negotiate("role:nobody", "{}")?)?;
    assert!(
        e["message"].as_str().unwrap_or_default().contains("bidder"),
        "the roles that exist are listed: {e}"
    );
    let offer = |correlation: &str, confidence: &str| {
        cli(
            &p,
            &[
                "mbox",
                "offer",
                "--run",
                &run_s,
                "--as",
                "b1",
                "--correlation",
                correlation,
                "--confidence",
                confidence,
            ],
        )
    };
    let (exit, e) = failure(&offer(correlation, "high")?)?;
    assert_eq!(
        (exit, e["code"].as_str()),
        (2, Some("invalid_argument")),
        "{e}"
    );
    let (exit, e) = failure(&offer(correlation, "NaN")?)?;
    assert_eq!(
        (exit, e["code"].as_str()),
        (2, Some("invalid_argument")),
        "{e}"
    );
    let (exit, e) = failure(&offer("no-such-request", "0.5")?)?;
    assert_eq!((exit, e["code"].as_str()), (1, Some("not_found")), "{e}");
    let (exit, e) = failure(&cli(
        &p,
        &[
            "mbox",
            "offer",
            "--run",
            &run_s,
            "--as",
            "b1",
            "--correlation",
            correlation,
            "--confidence",
            "0.5",
            "--payload",
            "{nope",
        ],
    )?)?;
    assert_eq!((exit, e["code"].as_str()), (2, Some("invalid_json")), "{e}");
    assert_eq!(
        (sent_to(&p, &run_s, "b1")?, sent_to(&p, &run_s, "b2")?),
        before,
        "refused input sent nothing"
    );
    assert_eq!(sent_to(&p, &run_s, "lead")?, 2, "the two offers only");

    // Nobody answers now: no_offers (exit 1) with the correlation id and the candidates,
    // whom `role:bidder` names through the bidder agent's member card.
    let out = negotiate("role:bidder", r#"{"job": "again"}"#)?;
    let (exit, e) = failure(&out)?;
    assert_eq!((exit, e["code"].as_str()), (1, Some("no_offers")), "{e}");
    assert_eq!(e["candidates"], json!(["b1", "b2"]), "{e}");
    let late = e["correlation_id"]
        .as_str()
        .expect("correlation")
        .to_owned();
    // Each candidate got the call for offers and was told it is closed.
    assert_eq!(
        (sent_to(&p, &run_s, "b1")?, sent_to(&p, &run_s, "b2")?),
        (before.0 + 2, before.1 + 2)
    );
    let closed = ok_json(&cli(
        &p,
        &[
            "mbox",
            "await-award",
            "--run",
            &run_s,
            "--as",
            "b1",
            "--correlation",
            &late,
        ],
    )?)?;
    assert_eq!(closed, json!({"awarded": false, "delegation": null}));

    // The API: mbox.role expands by the member cards; mbox.negotiate runs a negotiation for
    // a client outside the plan; bad input is a structured error that sends nothing.
    let role = api(&p, "mbox.role", json!({"run_id": run_s, "role": "bidder"})).await?;
    assert_eq!(
        role,
        Ok(json!({"protocol": 1, "role": "bidder", "tasks": ["b1", "b2"]}))
    );
    let e = api(&p, "mbox.role", json!({"run_id": run_s, "role": "nobody"})).await?;
    assert_eq!(
        e.clone().err().map(|e| e["code"].clone()),
        Some(json!("unknown_role")),
        "{e:?}"
    );
    let before = (sent_to(&p, &run_s, "b1")?, sent_to(&p, &run_s, "b2")?);
    for (body, code) in [
        (
            json!({"run_id": run_s, "from": "dashboard", "candidates": ["b1"], "deadline_ms": 0}),
            "invalid_deadline",
        ),
        (
            json!({"run_id": run_s, "from": "dashboard", "candidates": [], "deadline_ms": 100}),
            "invalid_address",
        ),
        (
            json!({"run_id": run_s, "from": "dashboard", "candidates": ["role:nobody"], "deadline_ms": 100}),
            "unknown_role",
        ),
        (
            json!({"run_id": run_s, "from": "_x", "candidates": ["b1"], "deadline_ms": 100}),
            "invalid_address",
        ),
    ] {
        let e = api(&p, "mbox.negotiate", body.clone()).await?;
        assert_eq!(
            e.clone().err().map(|e| e["code"].clone()),
            Some(json!(code)),
            "{body}: {e:?}"
        );
    }
    assert_eq!(
        (sent_to(&p, &run_s, "b1")?, sent_to(&p, &run_s, "b2")?),
        before
    );
    let reply = api(
        &p,
        "mbox.negotiate",
        json!({"run_id": run_s, "from": "dashboard", "candidates": ["role:bidder"],
               "request": {"job": "late"}, "work": {}, "deadline_ms": 200, "correlation_id": "dash-1"}),
    )
    .await?
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    assert_eq!(reply["outcome"], "no_offers", "{reply}");
    assert_eq!(reply["correlation_id"], "dash-1");
    assert_eq!(reply["candidates"], json!(["b1", "b2"]));
    assert_eq!(
        (sent_to(&p, &run_s, "b1")?, sent_to(&p, &run_s, "b2")?),
        (before.0 + 2, before.1 + 2)
    );
    Ok(())
}

/// One API request: `Ok(answer)` or `Err(ApiError)`.
async fn api(p: &Processes, endpoint: &str, body: Value) -> anyhow::Result<Result<Value, Value>> {
    let reply = p
        .bus
        .client()
        .request(
            p.bus.names().api(endpoint),
            serde_json::to_vec(&body)?.into(),
        )
        .await?;
    let value: Value = serde_json::from_slice(&reply.payload)?;
    let failed = reply
        .headers
        .as_ref()
        .is_some_and(|h| h.get("Nats-Service-Error-Code").is_some());
    Ok(if failed { Err(value) } else { Ok(value) })
}

/// An LLM agent calls the `negotiate` tool: first with a role nobody plays (the tool result
/// is the structured `unknown_role` error, and nothing is sent), then with `role:seller`,
/// which expands to the two tasks whose subtask names that role; the exec bidders answer
/// and the more confident wins. The model is the scripted test double.
#[tokio::test]
async fn an_llm_agent_negotiates_with_a_role_through_the_tool() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    llm.push(Reply::tool_call(
        "negotiate",
        json!({"candidates": ["role:nobody"], "request": {"job": "x"}, "work": {}}),
    ));
    llm.push(Reply::tool_call(
        "negotiate",
        json!({
            "candidates": ["role:seller"],
            "request": {"job": "translate"},
            "work": {"text": "bonjour"},
            "deadline_ms": 30000
        }),
    ));
    llm.push(Reply::text("delegated"));
    let mut p = Processes::start(&agents(&format!(
        r#"
[agents.negotiator]
kind = "llm"
base-url = "{}"
model = "scripted-model"
tools = ["negotiate"]
"#,
        llm.base_url()
    )))
    .await?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "4"]).await?;
    std::fs::write(p.dir().join("bidder.sh"), BIDDER)?;
    let seller = |id: &str| {
        let mut t = task(id, "bidder");
        t.role = Some("seller".into());
        t
    };
    let (run, outcome) = run_plan(
        &p,
        vec![task("lead", "negotiator"), seller("s1"), seller("s2")],
    )
    .await?;
    assert_eq!(
        outcome.status,
        RunStatus::Succeeded,
        "{outcome:?}\n{}",
        p.log(1)
    );
    assert_eq!(response_of(&outcome, "lead")?, "delegated");

    let requests = llm.requests();
    assert_eq!(requests.len(), 3, "{requests:?}");
    let tool_result = |i: usize| -> anyhow::Result<Value> {
        let text = requests[i]
            .messages()
            .iter()
            .rev()
            .find(|m| m["role"] == "tool")
            .and_then(|m| m["content"].as_str())
            .ok_or_else(|| anyhow::anyhow!("no tool message"))?;
        Ok(serde_json::from_str(text)?)
    };
    let refused = tool_result(1)?;
    assert_eq!(refused["error"]["code"], "unknown_role", "{refused}");
    let award = tool_result(2)?;
    assert_eq!(award["outcome"], "awarded", "{award}");
    assert_eq!(award["candidates"], json!(["s1", "s2"]), "{award}");
    assert_eq!(award["winner"], "s2", "{award}");
    assert_eq!(
        read(&p, "award-s2.json")?["delegation"]["payload"],
        json!({"text": "bonjour"})
    );
    assert_eq!(read(&p, "award-s1.json")?["awarded"], false);
    // The refused call sent nothing: each seller got one request, then one accept and one
    // delegation (s2) or one closing info (s1).
    let run_s = run.to_string();
    assert_eq!(sent_to(&p, &run_s, "s1")?, 2);
    assert_eq!(sent_to(&p, &run_s, "s2")?, 3);
    Ok(())
}
