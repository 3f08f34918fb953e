//! The `flotilla ws | mbox | state | artifacts` commands, end to end against a real
//! nats-server: exec agents (small deterministic `sh` scripts, standing in for agents in any
//! language) call `"$FLOTILLA_BIN" …` with no flags inside real runs through a coordinator
//! and a worker (separate `flotilla` processes), and operators call the same commands with
//! `--run`.

mod support;

use std::path::Path;
use std::process::{Command, Output};

use flotilla_coordinator::store::RunStore;
use flotilla_model::RunId;
use flotilla_model::plan::Subtask;
use flotilla_model::run::{RunOutcome, RunStatus};
use flotilla_model::submit::SubmitRequest;
use flotilla_model::workspace::WorkspaceEntry;
use futures::StreamExt;
use serde_json::{Value, json};
use support::*;

/// Agents of these tests: each runs `sh <name>.sh` in the test's directory.
const AGENTS: &str = r#"
default-agent = "writer"
[agents.writer]
kind = "exec"
command = "sh"
args = ["writer.sh"]
[agents.reader]
kind = "exec"
command = "sh"
args = ["reader.sh"]
[agents.sender]
kind = "exec"
command = "sh"
args = ["sender.sh"]
[agents.inbox]
kind = "exec"
command = "sh"
args = ["inbox.sh"]
[agents.bad]
kind = "exec"
command = "sh"
args = ["bad.sh"]
[agents.caller]
kind = "exec"
command = "sh"
args = ["caller.sh"]
[agents.echo]
kind = "scripted"
reply = "{task_id}: echoed {description}"
"#;

fn task(id: &str, agent: &str) -> Subtask {
    Subtask::new(id, id).with_agent(agent)
}

fn produces(mut t: Subtask, topics: &[&str]) -> Subtask {
    t.produces = topics.iter().map(|s| (*s).to_owned()).collect();
    t
}

fn consumes(mut t: Subtask, topics: &[&str]) -> Subtask {
    t.consumes = topics.iter().map(|s| (*s).to_owned()).collect();
    t
}

fn script(p: &Processes, name: &str, text: &str) -> anyhow::Result<()> {
    std::fs::write(p.dir().join(name), text)?;
    Ok(())
}

/// `flotilla --config <test config> <args>`, as an operator (no agent environment).
fn cli(p: &Processes, args: &[&str]) -> anyhow::Result<Output> {
    cli_in(p.dir(), &p.config, args, None)
}

fn cli_in(
    dir: &Path,
    config: &Path,
    args: &[&str],
    stdin: Option<&[u8]>,
) -> anyhow::Result<Output> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_flotilla"));
    cmd.arg("--config").arg(config).args(args).current_dir(dir);
    for (k, _) in std::env::vars() {
        if k.starts_with("FLOTILLA_") {
            cmd.env_remove(k);
        }
    }
    cmd.stdin(if stdin.is_some() {
        std::process::Stdio::piped()
    } else {
        std::process::Stdio::null()
    })
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn()?;
    if let (Some(bytes), Some(mut pipe)) = (stdin, child.stdin.take()) {
        use std::io::Write;
        pipe.write_all(bytes)?;
    }
    Ok(child.wait_with_output()?)
}

/// The JSON document a successful command printed.
fn ok_json(out: &Output) -> anyhow::Result<Value> {
    anyhow::ensure!(
        out.status.success(),
        "exit {:?}: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// The `{"error": …}` object a command printed on stderr (log lines may precede it).
fn error_of(stderr: &[u8]) -> anyhow::Result<Value> {
    let text = String::from_utf8_lossy(stderr);
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with("{\"error\""))
        .ok_or_else(|| anyhow::anyhow!("no JSON error on stderr: {text}"))?;
    Ok(serde_json::from_str::<Value>(line)?["error"].clone())
}

/// The failure a command reported: its exit code and error code.
fn failure(out: &Output) -> anyhow::Result<(i32, String)> {
    let err = error_of(&out.stderr)?;
    Ok((
        out.status.code().unwrap_or(-1),
        err["code"].as_str().unwrap_or_default().to_owned(),
    ))
}

async fn start() -> anyhow::Result<Processes> {
    let mut p = Processes::start(AGENTS).await?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "4"]).await?;
    Ok(p)
}

async fn run_plan(p: &Processes, tasks: Vec<Subtask>) -> anyhow::Result<(RunId, RunOutcome)> {
    let run = p.client.submit(SubmitRequest::new(plan(tasks))).await?;
    let outcome = p.client.wait(run, WAIT).await?;
    Ok((run, outcome))
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

async fn entries(p: &Processes, run: RunId, topic: &str) -> anyhow::Result<Vec<WorkspaceEntry>> {
    let store = RunStore::open(&p.bus).await?;
    Ok(store
        .topic_entries(run, topic, 0, usize::MAX, 10_000)
        .await?
        .0)
}

#[tokio::test]
async fn an_exec_agent_writes_with_no_flags_and_a_consumer_reads_it() -> anyhow::Result<()> {
    let p = start().await?;
    script(
        &p,
        "writer.sh",
        r#"set -e
"$FLOTILLA_BIN" ws write "Quarterly Figures" '{"quarter": "2026-Q3", "revenue": 1334.2}' > wrote.json
echo '{"response": "wrote the figures"}'
"#,
    )?;
    script(
        &p,
        "reader.sh",
        "set -e\n\"$FLOTILLA_BIN\" ws read quarterly_figures\n",
    )?;
    // No dependency: the reader is gated on the topic's first entry only.
    let (run, outcome) = run_plan(
        &p,
        vec![
            produces(task("fetch", "writer"), &["quarterly figures"]),
            consumes(task("analyse", "reader"), &["quarterly figures"]),
        ],
    )
    .await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");

    let wrote: Value = serde_json::from_slice(&std::fs::read(p.dir().join("wrote.json"))?)?;
    assert_eq!(wrote["topic"], "quarterly_figures");
    assert_eq!(wrote["duplicate"], false);
    let seq = wrote["seq"].as_u64().expect("seq");

    // What the consumer read through the CLI: the agent's entry first, with its writer.
    let page: Value = serde_json::from_str(&response_of(&outcome, "analyse")?)?;
    let first = &page["entries"][0];
    assert_eq!(first["seq"], seq, "{page}");
    assert_eq!(
        first["entry"],
        json!({"quarter": "2026-Q3", "revenue": 1334.2})
    );
    assert_eq!(first["writer"]["task_id"], "fetch");
    assert_eq!(first["writer"]["attempt"], 1);
    assert_eq!(first["writer"]["run_id"], run.to_string());
    assert!(page["next_since_seq"].as_u64() >= Some(seq), "{page}");
    assert!(page.get("more").is_some(), "{page}");

    // The topic: the agent's entry, then automatic produce's.
    let stored = entries(&p, run, "quarterly_figures").await?;
    assert_eq!(stored.len(), 2, "{stored:?}");
    assert_eq!(stored[0].seq, seq);
    assert_eq!(stored[1].entry["subtask_id"], "fetch");
    Ok(())
}

#[tokio::test]
async fn mailbox_reads_continue_across_calls_repeat_after_a_failure_and_commit_on_success()
-> anyhow::Result<()> {
    let p = start().await?;
    script(
        &p,
        "sender.sh",
        r#"set -e
"$FLOTILLA_BIN" mbox send reader --type request --correlation-id c1 '{"n": 1}' > sent-1.json
"$FLOTILLA_BIN" mbox send '*' '{"n": 2}' > sent-2.json
echo sent
"#,
    )?;
    // Two reads per attempt; the first attempt fails after reading.
    script(
        &p,
        "inbox.sh",
        r#"set -e
a="$FLOTILLA_ATTEMPT"
"$FLOTILLA_BIN" mbox read --limit 1 --wait 30 > "read-$a-1.json"
"$FLOTILLA_BIN" mbox read --wait 30 > "read-$a-2.json"
if [ "$a" = 1 ]; then echo "failing after reading" >&2; exit 1; fi
echo "read both"
"#,
    )?;
    let (run, outcome) =
        run_plan(&p, vec![task("sender", "sender"), task("reader", "inbox")]).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let read = |name: &str| -> anyhow::Result<Value> {
        Ok(serde_json::from_slice(&std::fs::read(p.dir().join(name))?)?)
    };
    let (sent1, sent2) = (read("sent-1.json")?, read("sent-2.json")?);
    assert_eq!(
        (sent1["n"].as_u64(), sent2["n"].as_u64()),
        (Some(1), Some(1))
    );
    let (s1, s2) = (sent1["seq"].as_u64(), sent2["seq"].as_u64());

    for attempt in [1, 2] {
        // The second call of an execution continues where the first stopped...
        let first = read(&format!("read-{attempt}-1.json"))?;
        let messages = first["messages"].as_array().expect("messages");
        assert_eq!(messages.len(), 1, "attempt {attempt}: {first}");
        assert_eq!(messages[0]["seq"].as_u64(), s1);
        assert_eq!(messages[0]["from"], "sender");
        assert_eq!(messages[0]["type"], "request");
        assert_eq!(messages[0]["correlation_id"], "c1");
        assert_eq!(messages[0]["payload"], json!({"n": 1}));
        let second = read(&format!("read-{attempt}-2.json"))?;
        let messages = second["messages"].as_array().expect("messages");
        assert_eq!(messages.len(), 1, "attempt {attempt}: {second}");
        assert_eq!(messages[0]["seq"].as_u64(), s2);
        assert_eq!(messages[0]["to"], "*");
        // ...and attempt 2 read both again: attempt 1 failed, so nothing was committed.
    }

    // Attempt 2 succeeded: its position is committed, nothing is unread, and a new reader
    // of the same task id starts after it.
    let run_s = run.to_string();
    let stats = ok_json(&cli(&p, &["mbox", "stats", "reader", "--run", &run_s])?)?;
    assert_eq!(stats["committed"].as_u64(), s2, "{stats}");
    assert_eq!(stats["unread"], 0, "{stats}");
    assert_eq!(stats["sent"], 1, "{stats}");
    let again = ok_json(&cli(
        &p,
        &["mbox", "read", "--run", &run_s, "--as", "reader"],
    )?)?;
    assert_eq!(again["messages"], json!([]), "{again}");
    // Peeking from the start still shows them: at-least-once, never lost.
    let peek = ok_json(&cli(
        &p,
        &[
            "mbox", "read", "--run", &run_s, "--as", "reader", "--since", "0",
        ],
    )?)?;
    assert_eq!(peek["messages"].as_array().map(Vec::len), Some(2), "{peek}");
    Ok(())
}

#[tokio::test]
async fn bad_input_from_an_agent_exits_2_with_the_code_and_stores_nothing() -> anyhow::Result<()> {
    let p = start().await?;
    script(
        &p,
        "bad.sh",
        r#"try() { name="$1"; shift; "$FLOTILLA_BIN" "$@" > "$name.out" 2> "$name.err"; echo $? > "$name.code"; }
try undeclared ws write undeclared '{"x": 1}'
try invalid_topic ws write 'a.b' '{"x": 1}'
try not_json ws write out 'not json'
head -c 1100000 /dev/zero | tr '\0' a > pad
{ printf '{"x": "'; cat pad; printf '"}'; } > big.json
try too_large ws write out --file big.json
try bad_key state set 'bad key' '{"a": 1}'
try big_value state set ok_key --file big.json
try bad_address mbox send 'a.b' '{}'
echo checked
"#,
    )?;
    let (run, outcome) = run_plan(&p, vec![produces(task("bad", "bad"), &["out"])]).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    for (name, code) in [
        ("undeclared", "undeclared_topic"),
        ("invalid_topic", "invalid_topic"),
        ("not_json", "invalid_json"),
        ("too_large", "entry_too_large"),
        ("bad_key", "invalid_key"),
        ("big_value", "value_too_large"),
        ("bad_address", "invalid_address"),
    ] {
        let exit = std::fs::read_to_string(p.dir().join(format!("{name}.code")))?;
        let err = error_of(&std::fs::read(p.dir().join(format!("{name}.err")))?)?;
        assert_eq!(
            (exit.trim(), err["code"].as_str()),
            ("2", Some(code)),
            "{name}: {err}"
        );
        assert!(!err["message"].as_str().unwrap_or_default().is_empty());
        let out = std::fs::read(p.dir().join(format!("{name}.out")))?;
        assert!(out.is_empty(), "{name}: nothing on stdout");
    }
    let err = error_of(&std::fs::read(p.dir().join("undeclared.err"))?)?;
    assert!(
        err["message"].as_str().is_some_and(|m| m.contains("out")),
        "names the declared topics: {err}"
    );

    // Nothing stored: no entry on the undeclared topic, only automatic produce's on `out`,
    // no state, no mail.
    assert!(entries(&p, run, "undeclared").await?.is_empty());
    let out = entries(&p, run, "out").await?;
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(out[0].entry["subtask_id"], "bad");
    let run_s = run.to_string();
    let keys = ok_json(&cli(&p, &["state", "list", "--run", &run_s])?)?;
    assert_eq!(keys["keys"], json!([]), "{keys}");
    let stats = ok_json(&cli(&p, &["mbox", "stats", "*", "--run", &run_s])?)?;
    assert_eq!(stats["sent"], 0, "{stats}");
    Ok(())
}

#[tokio::test]
async fn operators_reach_a_runs_workspace_state_mail_and_artifacts_with_run() -> anyhow::Result<()>
{
    let p = start().await?;
    script(&p, "writer.sh", "echo '{\"response\": \"done\"}'\n")?;
    let (run, outcome) = run_plan(&p, vec![task("t", "writer")]).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let r = run.to_string();
    let r = r.as_str();

    // Workspace: write (argument, stdin, idempotency key), read, read --all, watch.
    let w1 = ok_json(&cli(
        &p,
        &["ws", "write", "Notes", r#"{"note": 1}"#, "--run", r],
    )?)?;
    assert_eq!(w1["topic"], "notes");
    let w2 = ok_json(&cli_in(
        p.dir(),
        &p.config,
        &["ws", "write", "notes", "--run", r],
        Some(br#"{"note": 2}"#),
    )?)?;
    let keyed = [
        "ws",
        "write",
        "notes",
        r#"{"note": 3}"#,
        "--run",
        r,
        "--idempotency-key",
        "k1",
    ];
    let w3 = ok_json(&cli(&p, &keyed)?)?;
    let w3_again = ok_json(&cli(&p, &keyed)?)?;
    assert_eq!(w3_again["duplicate"], true);
    assert_eq!(w3_again["seq"], w3["seq"]);
    let page = ok_json(&cli(&p, &["ws", "read", "notes", "--run", r])?)?;
    let notes: Vec<&Value> = page["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| &e["entry"]["note"])
        .collect();
    assert_eq!(notes, [&json!(1), &json!(2), &json!(3)], "{page}");
    assert_eq!(page["entries"][0]["writer"]["by"], "operator");
    assert_eq!(page["more"], false);
    let paged = ok_json(&cli(
        &p,
        &[
            "ws",
            "read",
            "notes",
            "--run",
            r,
            "--limit",
            "1",
            "--since",
            &w1["seq"].to_string(),
        ],
    )?)?;
    assert_eq!(paged["entries"][0]["seq"], w2["seq"]);
    assert_eq!(paged["more"], true);
    let all = ok_json(&cli(&p, &["ws", "read", "--all", "--run", r])?)?;
    assert_eq!(all["entries"].as_array().map(Vec::len), Some(3), "{all}");
    let all2 = ok_json(&cli(
        &p,
        &[
            "ws",
            "read-all",
            "--run",
            r,
            "--since",
            &w1["seq"].to_string(),
        ],
    )?)?;
    assert_eq!(all2["entries"].as_array().map(Vec::len), Some(2), "{all2}");
    let watched = cli(
        &p,
        &[
            "ws",
            "watch",
            "notes",
            "--run",
            r,
            "--count",
            "2",
            "--timeout",
            "20",
        ],
    )?;
    assert!(
        watched.status.success(),
        "{}",
        String::from_utf8_lossy(&watched.stderr)
    );
    let lines: Vec<Value> = String::from_utf8(watched.stdout)?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[1]["seq"], w2["seq"]);
    let last = w3["seq"].to_string();
    let idle = cli(
        &p,
        &[
            "ws",
            "watch",
            "notes",
            "--run",
            r,
            "--since",
            &last,
            "--count",
            "1",
            "--timeout",
            "300ms",
        ],
    )?;
    assert_eq!(failure(&idle)?, (1, "timeout".to_owned()));

    // Session state, with compare-and-set.
    let set = ok_json(&cli(
        &p,
        &["state", "set", "plan_version", r#"{"v": 1}"#, "--run", r],
    )?)?;
    let rev = set["revision"].as_u64().expect("revision");
    let got = ok_json(&cli(&p, &["state", "get", "plan_version", "--run", r])?)?;
    assert_eq!(got["value"], json!({"v": 1}));
    assert_eq!(got["revision"].as_u64(), Some(rev));
    let lost = cli(
        &p,
        &[
            "state",
            "set",
            "plan_version",
            "2",
            "--if-revision",
            &(rev + 7).to_string(),
            "--run",
            r,
        ],
    )?;
    assert_eq!(failure(&lost)?, (1, "conflict".to_owned()));
    assert_eq!(
        error_of(&lost.stderr)?["current_revision"].as_u64(),
        Some(rev)
    );
    let won = ok_json(&cli(
        &p,
        &[
            "state",
            "set",
            "plan_version",
            "2",
            "--if-revision",
            &rev.to_string(),
            "--run",
            r,
        ],
    )?)?;
    assert!(won["revision"].as_u64() > Some(rev));
    let keys = ok_json(&cli(&p, &["state", "list", "--run", r])?)?;
    assert_eq!(keys["keys"], json!(["plan_version"]));
    assert_eq!(keys["session"], r);
    // Through the API, a page at a time.
    for k in ["a_key", "z_key"] {
        ok_json(&cli(&p, &["state", "set", k, "1", "--run", r])?)?;
    }
    let page = |after: Option<&str>, limit| flotilla_model::api::StateListRequest {
        protocol: 1,
        run_id: Some(run),
        session_id: None,
        after: after.map(str::to_owned),
        limit,
    };
    let first = p
        .client
        .call(&page(None, Some(2)), std::time::Duration::from_secs(10))
        .await?
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    assert_eq!(
        (first.keys.as_slice(), first.more),
        (
            ["a_key".to_owned(), "plan_version".to_owned()].as_slice(),
            true
        )
    );
    let rest = p
        .client
        .call(
            &page(first.keys.last().map(String::as_str), Some(2)),
            std::time::Duration::from_secs(10),
        )
        .await?
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    assert_eq!(
        (rest.keys.as_slice(), rest.more),
        (["z_key".to_owned()].as_slice(), false)
    );
    let bad = p
        .client
        .call(&page(None, Some(0)), std::time::Duration::from_secs(10))
        .await?
        .expect_err("limit 0");
    assert_eq!(
        (bad.status, bad.code.as_str()),
        (400, "invalid_limit"),
        "{bad:?}"
    );
    for k in ["a_key", "z_key"] {
        ok_json(&cli(&p, &["state", "delete", k, "--run", r])?)?;
    }
    ok_json(&cli(&p, &["state", "delete", "plan_version", "--run", r])?)?;
    let gone = cli(&p, &["state", "get", "plan_version", "--run", r])?;
    assert_eq!(failure(&gone)?, (1, "not_found".to_owned()));

    // Artifacts: raw bytes in and out.
    let blob: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(p.dir().join("blob.bin"), &blob)?;
    let put = ok_json(&cli(
        &p,
        &[
            "artifacts",
            "put",
            "reports/blob.bin",
            "blob.bin",
            "--run",
            r,
        ],
    )?)?;
    assert_eq!(put["size"], blob.len());
    let got = cli(&p, &["artifacts", "get", "reports/blob.bin", "--run", r])?;
    assert!(got.status.success());
    assert!(got.stdout == blob, "the same bytes");
    let to_file = ok_json(&cli(
        &p,
        &[
            "artifacts",
            "get",
            "reports/blob.bin",
            "-o",
            "copy.bin",
            "--run",
            r,
        ],
    )?)?;
    assert_eq!(to_file["size"], blob.len());
    assert!(std::fs::read(p.dir().join("copy.bin"))? == blob);
    let missing = cli(&p, &["artifacts", "get", "nope", "--run", r])?;
    assert_eq!(failure(&missing)?.1, "not_found");
    let shared = ok_json(&cli(
        &p,
        &[
            "ws",
            "put-artifact",
            "notes",
            "reports/again.bin",
            "blob.bin",
            "--run",
            r,
        ],
    )?)?;
    assert_eq!(shared["artifact"]["size"], blob.len());
    assert_eq!(shared["topic"], "notes");

    // Mail as a chosen identity.
    let sent = ok_json(&cli(
        &p,
        &[
            "mbox",
            "send",
            "t",
            r#"{"hi": 1}"#,
            "--run",
            r,
            "--as",
            "ops",
        ],
    )?)?;
    assert_eq!(sent["n"], 1);
    let mail = ok_json(&cli(
        &p,
        &["mbox", "read", "--run", r, "--as", "t", "--commit"],
    )?)?;
    assert_eq!(mail["messages"][0]["from"], "ops");
    assert_eq!(mail["committed"], sent["seq"]);
    let after = ok_json(&cli(&p, &["mbox", "read", "--run", r, "--as", "t"])?)?;
    assert_eq!(after["messages"], json!([]));

    // Mistakes are named.
    let unknown = RunId::new().to_string();
    let none = cli(&p, &["ws", "read", "notes", "--run", &unknown])?;
    assert_eq!(failure(&none)?, (1, "not_found".to_owned()));
    let who = cli(&p, &["mbox", "read", "--run", r])?;
    assert_eq!(failure(&who)?, (2, "invalid_scope".to_owned()));
    let outside = cli(&p, &["ws", "read", "notes"])?;
    assert_eq!(failure(&outside)?, (2, "invalid_scope".to_owned()));
    let bad_type = cli(
        &p,
        &[
            "mbox", "send", "t", "{}", "--type", "gossip", "--run", r, "--as", "ops",
        ],
    )?;
    assert_eq!(failure(&bad_type)?, (2, "invalid_argument".to_owned()));
    Ok(())
}

#[tokio::test]
async fn an_exec_agent_calls_another_agent_as_a_child_run() -> anyhow::Result<()> {
    let p = start().await?;
    script(
        &p,
        "caller.sh",
        r#"set -e
"$FLOTILLA_BIN" call echo '{"q": "revenue"}' --description "look up Q3"
"#,
    )?;
    let (run, outcome) = run_plan(&p, vec![task("ask", "caller")]).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    // `flotilla call` prints the child's outcome with its `response`, so a script that passes
    // the output through answers with the child's answer.
    assert_eq!(response_of(&outcome, "ask")?, "echo: echoed look up Q3");
    // The parent's stream announced the child.
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    let mut child = None;
    while let Ok(Some(e)) =
        tokio::time::timeout(std::time::Duration::from_millis(500), events.next()).await
    {
        if let flotilla_model::event::Event::AgentRunStarted { child: c, .. } = e?.event {
            child = Some(c.run_id);
        }
    }
    let child = child.ok_or_else(|| anyhow::anyhow!("no agent_run_started event"))?;
    let view = p.client.run(child).await?.expect("child record");
    assert_eq!(view.record.handle.parent_run_id, Some(run));
    assert_eq!(
        view.record
            .handle
            .parent_task_id
            .as_ref()
            .map(|t| t.as_str()),
        Some("ask")
    );

    // The tree, as an operator sees it.
    let answer = ok_json(&cli(&p, &["runs", "tree", &run.to_string(), "--json"])?)?;
    assert_eq!(answer["runs"], 2, "{answer}");
    let tree = &answer["root"];
    assert_eq!(tree["run_id"], run.to_string(), "{tree}");
    assert_eq!(tree["agent"], "caller");
    assert_eq!(tree["children"][0]["agent"], "echo");
    assert_eq!(tree["status"], "succeeded");
    assert_eq!(tree["children"][0]["run_id"], child.to_string(), "{tree}");
    assert_eq!(tree["children"][0]["parent_task_id"], "ask");
    assert_eq!(tree["children"][0]["status"], "succeeded");

    // Outside an agent there is no attempt to be the parent: refused, nothing started.
    let out = cli(&p, &["call", "echo"])?;
    let (code, error) = failure(&out)?;
    assert_eq!((code, error.as_str()), (2, "invalid_scope"));
    Ok(())
}
