//! Run trees across real processes: `flotilla coordinator` and `flotilla worker` processes on
//! a real nats-server, agents calling agents as child runs, grandchildren and deeper.
//!
//! * Exec agents here are small deterministic Python and `sh` scripts written by the tests
//!   (not models): they call other agents with `"$FLOTILLA_BIN" call AGENT …` and answer
//!   with what the child answered.
//! * The multi-agent pattern examples (`config/examples/patterns.toml`) are LLM agents; their
//!   tests point them at the test kit's scripted OpenAI-compatible server — a test double
//!   that answers what each test scripts, not a model.

mod support;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use flotilla_client::Client;
use flotilla_model::RunId;
use flotilla_model::event::Event;
use flotilla_model::plan::{Plan, Subtask};
use flotilla_model::run::{RunHandle, RunOutcome, RunStatus};
use flotilla_model::submit::SubmitRequest;
use flotilla_testkit::openai::{OpenAiServer, RecordedRequest};
use futures::StreamExt;
use serde_json::{Value, json};
use support::*;

/// A deterministic exec agent (not a model): calls the agent named by its first argument as
/// a child run with `flotilla call` (further arguments go to `flotilla call`), keeps what the
/// call printed in `call-<task>-<delivery>.json`, and answers `<task> <- <child's answer>`.
const CALLER_PY: &str = r#"import json, os, subprocess, sys
task = json.load(sys.stdin)
me = task["task_id"]
argv = [os.environ["FLOTILLA_BIN"], "call", sys.argv[1], json.dumps({"asked_by": me}),
        "--description", "help " + me] + sys.argv[2:]
done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
with open("call-%s-%s.json" % (me, os.environ["FLOTILLA_DELIVERY"]), "w") as f:
    f.write(done.stdout)
if done.returncode != 0:
    sys.stderr.write(done.stderr)
    sys.exit(1)
call = json.loads(done.stdout)
print(json.dumps({"response": "%s <- %s" % (me, call["response"])}))
"#;

/// An exec agent of these tests running `python3 caller.py <args>`.
fn caller(name: &str, args: &str) -> String {
    format!(
        "[agents.{name}]\nkind = \"exec\"\ncommand = \"python3\"\nargs = [\"caller.py\", {args}]\n"
    )
}

/// An exec agent of these tests running `sh <name>.sh`.
fn sh(name: &str) -> String {
    format!("[agents.{name}]\nkind = \"exec\"\ncommand = \"sh\"\nargs = [\"{name}.sh\"]\n")
}

fn write(p: &Processes, name: &str, text: &str) -> anyhow::Result<()> {
    std::fs::write(p.dir().join(name), text)?;
    Ok(())
}

fn response(outcome: &RunOutcome) -> String {
    outcome
        .final_result
        .as_ref()
        .map(|f| f.response.clone())
        .unwrap_or_default()
}

/// The children `run` announced (`agent_run_started`, one per child run) with the agent each
/// runs, in order. The run has ended: its stream is read up to its end event.
async fn links(client: &Client, run: RunId) -> anyhow::Result<Vec<(RunHandle, String)>> {
    let events = client.events(run).await?;
    futures::pin_mut!(events);
    let mut out: Vec<(RunHandle, String)> = Vec::new();
    tokio::time::timeout(WAIT, async {
        while let Some(e) = events.next().await {
            match e?.event {
                Event::AgentRunStarted { child, agent }
                    if !out.iter().any(|(c, _)| c.run_id == child.run_id) =>
                {
                    out.push((child, agent.unwrap_or_default()));
                }
                Event::Workflow(w) if w.phase.ends_run() => break,
                _ => {}
            }
        }
        Ok::<_, anyhow::Error>(())
    })
    .await??;
    Ok(out)
}

/// Waits until `run` (still going) announces its first child.
async fn first_link(client: &Client, run: RunId) -> anyhow::Result<RunHandle> {
    let events = client.events(run).await?;
    futures::pin_mut!(events);
    tokio::time::timeout(WAIT, async {
        while let Some(e) = events.next().await {
            if let Event::AgentRunStarted { child, .. } = e?.event {
                return Ok(child);
            }
        }
        anyhow::bail!("the event stream of {run} ended")
    })
    .await?
}

/// The only child `run` announced, checked against its parent and the tree's root, both in
/// the link and in the child's own run record.
async fn only_child(
    client: &Client,
    run: RunId,
    task: &str,
    agent: &str,
    root: RunId,
) -> anyhow::Result<RunId> {
    let children = links(client, run).await?;
    assert_eq!(children.len(), 1, "children of {run}: {children:?}");
    let (link, linked_agent) = &children[0];
    assert_eq!(linked_agent, agent, "{link:?}");
    for (what, handle) in [
        ("link", link.clone()),
        (
            "record",
            client
                .run(link.run_id)
                .await?
                .ok_or_else(|| anyhow::anyhow!("no record of child {}", link.run_id))?
                .record
                .handle,
        ),
    ] {
        assert_eq!(handle.run_id, link.run_id, "{what}");
        assert_eq!(handle.parent_run_id, Some(run), "{what}: {handle:?}");
        assert_eq!(
            handle.parent_task_id.as_ref().map(|t| t.as_str()),
            Some(task),
            "{what}: {handle:?}"
        );
        assert_eq!(handle.root_run_id, Some(root), "{what}: {handle:?}");
    }
    Ok(link.run_id)
}

/// `flotilla runs tree ROOT --json`, as an operator runs it.
fn runs_tree(p: &Processes, root: RunId) -> anyhow::Result<Value> {
    let out = p.cli(&["runs", "tree", &root.to_string(), "--json"])?;
    anyhow::ensure!(
        out.status.success(),
        "runs tree: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Checks that `tree` (a `RunTree`) is the chain `chain[0]` → `chain[1]` → … (one child per
/// level), every run `status`: run ids, nesting, status, and the run count.
fn assert_chain(tree: &Value, chain: &[RunId], status: &str) {
    assert_eq!(tree["runs"], chain.len(), "{tree:#}");
    let mut node = &tree["root"];
    for (depth, run) in chain.iter().enumerate() {
        assert_eq!(node["run_id"], run.to_string(), "depth {depth}: {tree:#}");
        assert_eq!(node["status"], status, "depth {depth}: {tree:#}");
        let children = node["children"].as_array().map_or(0, Vec::len);
        let expected = usize::from(depth + 1 < chain.len());
        assert_eq!(children, expected, "depth {depth}: {tree:#}");
        node = &node["children"][0];
    }
}

/// Agent-as-tool three levels deep: the root task's agent calls alpha, alpha calls beta, beta
/// calls gamma (each a child run of the one before). Gamma's answer comes back through every
/// level; every link names its parent run and task and the root; gamma's workspace write
/// (declared by beta with `flotilla call --produces`) lands in the root's workspace; `runs
/// tree` shows the four levels.
#[tokio::test]
async fn agents_call_agents_three_levels_below_the_root() -> anyhow::Result<()> {
    let config = [
        caller("top", "\"alpha\""),
        caller("alpha", "\"beta\""),
        caller("beta", "\"gamma\", \"--produces\", \"findings\""),
        sh("gamma"),
    ]
    .join("\n");
    let mut p = Processes::start(&config).await?;
    write(&p, "caller.py", CALLER_PY)?;
    write(
        &p,
        "gamma.sh",
        r#"set -e
"$FLOTILLA_BIN" ws write findings '{"fact": "the tide turns four times a day", "depth": 3}' > wrote.json
echo "gamma found 42"
"#,
    )?;
    p.coordinator().await?;
    // Each waiting caller holds a slot while its child runs: four levels, two workers with
    // enough slots between them (the levels land on either).
    p.worker(&["--concurrency", "4"]).await?;
    p.worker(&["--concurrency", "4"]).await?;

    let started = Instant::now();
    let root = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("main", "ask down the tree").with_agent("top"),
        ])))
        .await?;
    let outcome = p.client.wait(root, WAIT).await?;
    eprintln!("four-level tree finished in {:?}", started.elapsed());
    assert_eq!(
        outcome.status,
        RunStatus::Succeeded,
        "{outcome:?}\n{}\n{}",
        p.log(1),
        p.log(2)
    );
    assert_eq!(
        response(&outcome),
        "main <- alpha <- beta <- gamma found 42"
    );

    // The links, level by level: each child's parent run and task, and the same root.
    let alpha = only_child(&p.client, root, "main", "alpha", root).await?;
    let beta = only_child(&p.client, alpha, "alpha", "beta", root).await?;
    let gamma = only_child(&p.client, beta, "beta", "gamma", root).await?;
    assert!(
        links(&p.client, gamma).await?.is_empty(),
        "gamma is the leaf"
    );
    for run in [alpha, beta, gamma] {
        let child = p.client.wait(run, WAIT).await?;
        assert_eq!(child.status, RunStatus::Succeeded, "{child:?}");
    }
    // Each `flotilla call` made its child (no re-attach in an undisturbed run).
    for task in ["main", "alpha", "beta"] {
        let call: Value =
            serde_json::from_slice(&std::fs::read(p.dir().join(format!("call-{task}-1.json")))?)?;
        assert_eq!(call["created"], true, "{task}: {call}");
        assert_eq!(call["status"], "succeeded", "{task}: {call}");
    }

    // The deepest agent's write is in the root run's workspace, by gamma's run.
    let wrote: Value = serde_json::from_slice(&std::fs::read(p.dir().join("wrote.json"))?)?;
    assert_eq!(wrote["topic"], "findings", "{wrote}");
    let out = p.cli(&["ws", "read", "findings", "--run", &root.to_string()])?;
    anyhow::ensure!(
        out.status.success(),
        "ws read: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page: Value = serde_json::from_slice(&out.stdout)?;
    let entries = page["entries"].as_array().cloned().unwrap_or_default();
    let written = entries
        .iter()
        .find(|e| e["entry"]["depth"] == 3)
        .ok_or_else(|| anyhow::anyhow!("gamma's entry is not in the root's workspace: {page}"))?;
    assert_eq!(written["seq"], wrote["seq"], "{page}");
    assert_eq!(
        written["entry"]["fact"], "the tide turns four times a day",
        "{page}"
    );
    assert_eq!(written["writer"]["run_id"], gamma.to_string(), "{page}");
    assert_eq!(written["writer"]["task_id"], "gamma", "{page}");

    // The operator's view: four levels, one run each, all succeeded.
    assert_chain(
        &runs_tree(&p, root)?,
        &[root, alpha, beta, gamma],
        "succeeded",
    );
    Ok(())
}

/// An exec agent's `flotilla call` whose child run is rejected (its agent is not defined):
/// the call prints the child's status `rejected` with the problems and fails with code
/// `child_rejected` naming them; the agent gives up (its script exits non-zero), and its task
/// fails with `child_rejected` after one attempt — not retried into a fresh subtree that
/// would be rejected again.
#[tokio::test]
async fn a_rejected_flotilla_call_fails_the_exec_agent_for_good() -> anyhow::Result<()> {
    let mut p = Processes::start(&caller("asker", "\"ghost\"")).await?;
    write(&p, "caller.py", CALLER_PY)?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let mut ask = plan(vec![Subtask::new("ask", "ask a ghost").with_agent("asker")]);
    ask.config.max_retries = 3;
    let run = p.client.submit(SubmitRequest::new(ask)).await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed, "{outcome:?}");
    let failed = &outcome.failed[0];
    assert_eq!(
        failed.error.kind,
        flotilla_model::task::TaskErrorKind::ChildRejected,
        "{failed:?}\n{}",
        p.log(1)
    );
    assert_eq!(failed.attempts, 1, "not retried: {failed:?}");
    assert!(
        failed.error.message.contains("child_rejected")
            && failed.error.message.contains("unknown_agent"),
        "{failed:?}"
    );
    // What `flotilla call` printed: the rejected child and why.
    let call: Value = serde_json::from_slice(&std::fs::read(p.dir().join("call-ask-1.json"))?)?;
    assert_eq!(call["status"], "rejected", "{call}");
    assert_eq!(call["problems"][0]["code"], "unknown_agent", "{call}");
    let child: RunId = serde_json::from_value(call["run_id"].clone())?;
    assert_eq!(
        p.client.run(child).await?.map(|v| v.record.status),
        Some(RunStatus::Rejected)
    );
    Ok(())
}

/// A worker is killed (`kill -9`) while its task waits in `flotilla call` for a slow child on
/// another pool's worker. The attempt is redelivered to another worker of the parent's pool;
/// its `flotilla call` makes the same call and re-attaches to the running child
/// (`created: false`) instead of starting a second one; the root succeeds with the child's
/// answer, and the child ran once.
#[tokio::test]
async fn a_parent_whose_worker_is_killed_reattaches_to_its_child() -> anyhow::Result<()> {
    let config = format!(
        "pools = [\"default\", \"helpers\"]\n{}\n{}",
        caller("asker", "\"slowpoke\", \"--pool\", \"helpers\""),
        sh("slowpoke")
    );
    let mut p = Processes::start(&config).await?;
    write(&p, "caller.py", CALLER_PY)?;
    // The child takes a few seconds; it notes each start.
    write(
        &p,
        "slowpoke.sh",
        "echo \"$FLOTILLA_RUN_ID\" >> slowpoke-starts\nsleep 6\necho \"slowpoke answer\"\n",
    )?;
    p.coordinator().await?;
    let first = p.worker(&["--concurrency", "1"]).await?;
    p.worker(&["--pool", "helpers", "--concurrency", "1"])
        .await?;

    let started = Instant::now();
    let root = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("ask", "ask the slow helper").with_agent("asker"),
        ])))
        .await?;
    let victim = task_started(&p.client, root, "ask").await?;
    let child = first_link(&p.client, root).await?.run_id;
    task_started(&p.client, child, "slowpoke").await?;
    // The child runs; the parent waits for it. Crash the parent's worker, start another.
    p.kill(first);
    eprintln!(
        "killed the parent's worker {:?} after submission",
        started.elapsed()
    );
    let second = p.worker(&["--concurrency", "1"]).await?;

    let outcome = p.client.wait(root, WAIT).await?;
    eprintln!("the root ended {:?} after submission", started.elapsed());
    assert_eq!(
        outcome.status,
        RunStatus::Succeeded,
        "{outcome:?}\n{}",
        p.log(second)
    );
    assert_eq!(response(&outcome), "ask <- slowpoke answer");

    // The redelivered attempt re-attached: its `flotilla call` found the child existing.
    // The killed delivery's call never returned (its processes died with its worker).
    assert!(
        !p.dir().join("call-ask-1.json").exists(),
        "the first delivery saw its call end"
    );
    let mut calls = Vec::new();
    for entry in std::fs::read_dir(p.dir())? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.starts_with("call-ask-") {
            calls.push(serde_json::from_slice::<Value>(&std::fs::read(
                p.dir().join(&name),
            )?)?);
        }
    }
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0]["created"], false, "{}", calls[0]);
    assert_eq!(calls[0]["run_id"], child.to_string(), "{}", calls[0]);
    assert_eq!(calls[0]["response"], "slowpoke answer", "{}", calls[0]);

    // One child run for the parent, which ran its task once.
    let children = links(&p.client, root).await?;
    let distinct: BTreeSet<RunId> = children.iter().map(|(c, _)| c.run_id).collect();
    assert_eq!(distinct, BTreeSet::from([child]), "{children:?}");
    let starts = std::fs::read_to_string(p.dir().join("slowpoke-starts"))?;
    assert_eq!(starts.lines().collect::<Vec<_>>(), [child.to_string()]);
    let child_results = results_of(&p.bus, child).await?;
    assert_eq!(child_results, [("slowpoke".to_owned(), 1, true)]);
    // The parent's attempt was redelivered, not retried, and finished on the new worker.
    let root_results = results_of(&p.bus, root).await?;
    assert_eq!(root_results, [("ask".to_owned(), 1, true)]);
    let view = p.client.run(root).await?.expect("root record");
    assert_eq!(view.tasks[0].attempts, 1, "{view:?}");
    let history = flotilla_coordinator::store::RunStore::open(&p.bus)
        .await?
        .history(root)
        .await?;
    let worker = history
        .iter()
        .find_map(|(_, _, e)| match &e.input {
            flotilla_model::runlog::RunInput::TaskResult(r) => Some(r.worker.clone()),
            _ => None,
        })
        .expect("a result");
    assert_ne!(worker, victim, "the result came from the surviving worker");
    Ok(())
}

/// Whether process `pid` still runs (a zombie waiting to be reaped does not).
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => false,
        // The state follows the command name in parentheses: `pid (comm) S …`.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| !matches!(state, 'Z' | 'X')),
    }
}

/// Cancelling the root of a running tree (root → child → grandchild, on two worker processes)
/// with `flotilla runs cancel`: all three end `cancelled`, the reason is on the root's
/// outcome, and the leaf's process is gone.
#[tokio::test]
async fn cancelling_the_root_cancels_a_tree_running_on_two_workers() -> anyhow::Result<()> {
    let config = format!(
        "pools = [\"default\", \"middle\"]\n{}\n{}\n{}",
        caller("top", "\"mid\", \"--pool\", \"middle\""),
        caller("mid", "\"leaf\""),
        sh("leaf")
    );
    let mut p = Processes::start(&config).await?;
    write(&p, "caller.py", CALLER_PY)?;
    // The leaf notes its pid and blocks (`exec`: the pid is the sleeping process's).
    write(
        &p,
        "leaf.sh",
        "echo $$ > leaf.pid.tmp\nmv leaf.pid.tmp leaf.pid\nexec sleep 300\n",
    )?;
    p.coordinator().await?;
    // The root and the leaf on one worker (default pool), the middle on the other.
    p.worker(&["--concurrency", "2"]).await?;
    p.worker(&["--pool", "middle", "--concurrency", "1"])
        .await?;

    let root = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("main", "wait all the way down").with_agent("top"),
        ])))
        .await?;
    let child = first_link(&p.client, root).await?.run_id;
    let grandchild = first_link(&p.client, child).await?.run_id;
    let on = [
        task_started(&p.client, root, "main").await?,
        task_started(&p.client, child, "mid").await?,
        task_started(&p.client, grandchild, "leaf").await?,
    ];
    assert!(
        on[0] == on[2] && on[0] != on[1],
        "root and leaf on one worker, the middle on the other: {on:?}"
    );
    let pid_file = p.dir().join("leaf.pid");
    let deadline = Instant::now() + WAIT;
    while !pid_file.exists() {
        anyhow::ensure!(Instant::now() < deadline, "the leaf never wrote its pid");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pid: i32 = std::fs::read_to_string(&pid_file)?.trim().parse()?;
    assert!(alive(pid), "the leaf runs");

    let started = Instant::now();
    let reason = "operator stop: the whole tree";
    let out = p.cli(&["runs", "cancel", &root.to_string(), "--reason", reason])?;
    anyhow::ensure!(
        out.status.success(),
        "runs cancel: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let outcome = p.client.wait(root, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Cancelled, "{outcome:?}");
    assert!(
        outcome
            .reason
            .as_deref()
            .is_some_and(|r| r.contains(reason)),
        "{outcome:?}"
    );
    for (what, run) in [("child", child), ("grandchild", grandchild)] {
        let o = p.client.wait(run, WAIT).await?;
        assert_eq!(o.status, RunStatus::Cancelled, "{what}: {o:?}");
    }
    eprintln!(
        "root, child and grandchild cancelled {:?} after `runs cancel` started",
        started.elapsed()
    );
    let deadline = Instant::now() + WAIT;
    while alive(pid) {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the leaf's process {pid} still runs"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "the leaf's process was gone {:?} after `runs cancel` started",
        started.elapsed()
    );
    assert_chain(
        &runs_tree(&p, root)?,
        &[root, child, grandchild],
        "cancelled",
    );
    Ok(())
}

// --- The multi-agent pattern examples (config/examples/patterns.toml) ----------------------

const PATTERNS: &str = "config/examples/patterns.toml";
const PATTERN_AGENTS: [&str; 6] = [
    "helpdesk",
    "billing",
    "technical",
    "reporter",
    "researcher",
    "verifier",
];

/// Coordinator and worker processes on the example config as shipped, every agent pointed at
/// `llm` (the scripted test double) with the override variables `scripts/demo-llm` uses.
async fn pattern_services(llm: &OpenAiServer, workers: usize) -> anyhow::Result<Processes> {
    let url = llm.base_url();
    let vars: Vec<(String, String)> = PATTERN_AGENTS
        .iter()
        .map(|a| {
            (
                format!("FLOTILLA_AGENTS__{}__BASE_URL", a.to_ascii_uppercase()),
                url.clone(),
            )
        })
        .collect();
    let env: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut p = Processes::with_config_file(&root().join(PATTERNS), &env).await?;
    p.coordinator().await?;
    for _ in 0..workers {
        p.worker(&[]).await?;
    }
    Ok(p)
}

fn example_plan(name: &str) -> anyhow::Result<Plan> {
    let path = root().join("config/examples/plans").join(name);
    Ok(serde_json::from_slice(&std::fs::read(&path)?)?)
}

/// The agents `transfer_to_agent` offered in `request`.
fn transfer_targets(request: &RecordedRequest) -> Value {
    request.body["tools"]
        .as_array()
        .and_then(|t| {
            t.iter()
                .find(|t| t["function"]["name"] == "transfer_to_agent")
        })
        .map(|t| t["function"]["parameters"]["properties"]["agent_name"]["enum"].clone())
        .unwrap_or_default()
}

/// The tool results the model was sent in `request`, in order.
fn tool_results(request: &RecordedRequest) -> Vec<String> {
    request
        .messages()
        .iter()
        .filter(|m| m["role"] == "tool")
        .filter_map(|m| m["content"].as_str().map(str::to_owned))
        .collect()
}

/// The requests whose body contains `needle`, in arrival order.
fn asked(requests: &[RecordedRequest], needle: &str) -> Vec<RecordedRequest> {
    requests
        .iter()
        .filter(|r| r.body.to_string().contains(needle))
        .cloned()
        .collect()
}

#[test]
fn the_pattern_examples_and_their_plans_are_valid() -> anyhow::Result<()> {
    for plan in ["helpdesk.json", "report.json"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
            .current_dir(root())
            .env_remove("FLOTILLA_CONFIG")
            // No NATS there: the plan is checked against the example config itself.
            .args(["--nats-url", "nats://127.0.0.1:9", "--config", PATTERNS])
            .args(["plan", "validate", "--json"])
            .arg(Path::new("config/examples/plans").join(plan))
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{plan}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: Value = serde_json::from_slice(&out.stdout)?;
        assert_eq!(report["valid"], true, "{plan}: {report}");
        assert_eq!(report["checked"], "offline", "{plan}: {report}");
        assert_eq!(report["subtasks"], 1, "{plan}: {report}");
    }
    Ok(())
}

/// Coordinator/dispatcher: the help desk hands the customer's conversation to billing with
/// `transfer_to_agent`; billing continues it as a child run and its answer is the ticket's.
#[tokio::test]
async fn the_dispatcher_example_routes_the_ticket_to_a_specialist() -> anyhow::Result<()> {
    // The scripted test double plays the models with the example's script
    // (`config/examples/models/helpdesk.json`): the desk transfers, billing answers with
    // `answer`. Billing's request carries the desk's conversation too, so its reply is listed
    // first and matched by what only billing is told.
    let answer = "I have refunded the second debit of 84.20 euros; expect it within five days.";
    let llm = OpenAiServer::start().await?;
    llm.push_all(example_script("helpdesk")?);
    let p = pattern_services(&llm, 1).await?;
    let root = p
        .client
        .submit(SubmitRequest::new(example_plan("helpdesk.json")?))
        .await?;
    let outcome = p.client.wait(root, WAIT).await?;
    assert_eq!(
        outcome.status,
        RunStatus::Succeeded,
        "{outcome:?}\n{}",
        p.log(1)
    );
    assert_eq!(response(&outcome), answer, "the specialist's answer");

    // Two model calls: the desk (offered its sub-agents), then billing (offered its peer
    // only: the example forbids transfers back to the desk). Technical was never asked.
    let requests = llm.requests();
    assert_eq!(requests.len(), 2, "{requests:#?}");
    assert_eq!(
        transfer_targets(&requests[0]),
        json!(["billing", "technical"])
    );
    assert!(
        requests[0]
            .system()
            .contains("Do not answer the customer yourself"),
        "the example's instruction: {}",
        requests[0].system()
    );
    assert_eq!(transfer_targets(&requests[1]), json!(["technical"]));
    assert!(
        requests[1].user().contains("charged twice"),
        "billing continues the customer's conversation: {}",
        requests[1].user()
    );

    // Billing ran as a child run of the ticket, linked twice on the desk's stream.
    let billing = only_child(&p.client, root, "ticket", "billing", root).await?;
    let child = p.client.wait(billing, WAIT).await?;
    assert_eq!(child.status, RunStatus::Succeeded, "{child:?}");
    assert_eq!(response(&child), answer);
    let transferred = transfer_link(&p.client, root).await?;
    assert_eq!(transferred, billing);
    assert_chain(&runs_tree(&p, root)?, &[root, billing], "succeeded");
    Ok(())
}

/// Hierarchical decomposition: the reporter calls the researcher as a tool, the researcher
/// searches the example corpus and calls the verifier as a tool — a grandchild run — and each
/// answer comes back up as its caller's tool result.
#[tokio::test]
async fn the_hierarchical_example_runs_a_grandchild_and_answers_propagate_up() -> anyhow::Result<()>
{
    let verdict = "Confirmed: costs.txt says the pilot cost 6.1 million euros to build.";
    let facts = "The pilot cost 6.1 million euros (verified) and earned about 249,000 euros in its first year, less than its 410,000 euros of running costs.";
    let report = "Report: the Brindle Harbour pilot cost 6.1 million euros; its electricity does not yet cover its running costs.";
    // The scripted test double plays the three models with the example's script
    // (`config/examples/models/report.json`, whose answers are these), each reply matched by
    // its task: the reporter's (`report`, from the plan) and the child tasks named after their
    // agents.
    let llm = OpenAiServer::start().await?;
    llm.push_all(example_script("report")?);
    let p = pattern_services(&llm, 2).await?;
    let root = p
        .client
        .submit(SubmitRequest::new(example_plan("report.json")?))
        .await?;
    let outcome = p.client.wait(root, WAIT).await?;
    assert_eq!(
        outcome.status,
        RunStatus::Succeeded,
        "{outcome:?}\n{}\n{}",
        p.log(1),
        p.log(2)
    );
    assert_eq!(response(&outcome), report);
    assert_eq!(llm.remaining(), 0, "every scripted reply was used");

    // What each model was offered and told.
    let requests = llm.requests();
    assert_eq!(requests.len(), 7, "{requests:#?}");
    let (reporter, researcher, verifier) = (
        asked(&requests, "Your task (report)"),
        asked(&requests, "Your task (researcher)"),
        asked(&requests, "Your task (verifier)"),
    );
    assert_eq!(
        (reporter.len(), researcher.len(), verifier.len()),
        (2, 3, 2)
    );
    assert_eq!(reporter[0].tool_names(), ["call_agent"]);
    let mut offered = researcher[0].tool_names();
    offered.sort();
    assert_eq!(offered, ["call_agent", "search_corpus"]);
    assert_eq!(verifier[0].tool_names(), ["search_corpus"]);
    // The example's exec tool ran from the example's directory and searched its corpus.
    let searched = tool_results(&verifier[1]).join("\n");
    assert!(
        searched.contains("costs.txt") && searched.contains("6.1 million"),
        "{searched}"
    );
    // Answers up the tree: the verifier's verdict is the researcher's tool result, the
    // researcher's facts the reporter's.
    let to_researcher = tool_results(&researcher[2]).join("\n");
    assert!(to_researcher.contains(verdict), "{to_researcher}");
    let to_reporter = tool_results(&reporter[1]).join("\n");
    assert!(to_reporter.contains(facts), "{to_reporter}");

    // The tree: report → researcher (child) → verifier (grandchild), all under the root.
    let researcher_run = only_child(&p.client, root, "report", "researcher", root).await?;
    let verifier_run =
        only_child(&p.client, researcher_run, "researcher", "verifier", root).await?;
    assert!(links(&p.client, verifier_run).await?.is_empty());
    for (run, answer) in [(researcher_run, facts), (verifier_run, verdict)] {
        let o = p.client.wait(run, WAIT).await?;
        assert_eq!(o.status, RunStatus::Succeeded, "{o:?}");
        assert_eq!(response(&o), answer);
    }
    let tree = runs_tree(&p, root)?;
    assert_chain(&tree, &[root, researcher_run, verifier_run], "succeeded");
    // Every level made model calls (one `usage` event each), summed up the tree.
    let calls = |node: &Value, key: &str| node[key]["calls"].as_u64().unwrap_or(0);
    let (top, mid) = (&tree["root"], &tree["root"]["children"][0]);
    let leaf = &mid["children"][0];
    for node in [top, mid, leaf] {
        assert!(calls(node, "usage") >= 1, "{node:#}");
    }
    assert_eq!(
        calls(top, "subtree_usage"),
        calls(top, "usage") + calls(mid, "usage") + calls(leaf, "usage"),
        "{tree:#}"
    );
    Ok(())
}
