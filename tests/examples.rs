//! Every example runs: `flotilla example NAME --approve`, run from the repository's root for
//! each example of `config/examples/examples.toml`, one after another, ends with the exit code
//! and prints a line of the result its plan gives on its config (LLM examples on the
//! scripted OpenAI-compatible test double, with the replies of `config/examples/models/`).
//! Every plan of `config/examples/plans/` is an example; an unknown name is refused, naming
//! the known ones; a run that waits for a person says how to answer it, and that answer
//! ends it.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// How long one example may take.
const EXAMPLE_TIMEOUT: Duration = Duration::from_secs(60);

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `flotilla <args>` from the repository's root, without the caller's config.
fn flotilla(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_flotilla"));
    c.current_dir(root())
        .env_remove("FLOTILLA_CONFIG")
        .env_remove("FLOTILLA_NATS__URLS")
        .args(args);
    c
}

/// Runs `command` to its end, killing it after `timeout`.
fn run(mut command: Command, timeout: Duration) -> anyhow::Result<Output> {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let started = Instant::now();
    while child.try_wait()?.is_none() {
        if started.elapsed() > timeout {
            child.kill()?;
            let out = child.wait_with_output()?;
            anyhow::bail!(
                "still running after {timeout:?}:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(child.wait_with_output()?)
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// What each example ends with: its exit code, and a line of its result (on stdout) — or,
/// for a plan refused on purpose, of its problems (on stderr).
const EXPECTED: &[(&str, i32, &str)] = &[
    ("earnings", 0, "ACME quarterly earnings report"),
    ("fan-out-fan-in", 0, "merge: done (inputs: region_central"),
    ("broken-cycle", 1, "[cycle]"),
    ("broken-missing-producer", 1, "[missing_producer]"),
    ("editorial", 0, "\"verdict\": \"ready\""),
    ("team-roles", 0, "Report on check"),
    (
        "helpdesk",
        0,
        "I have refunded the second debit of 84.20 euros",
    ),
    (
        "report",
        0,
        "Report: the Brindle Harbour pilot cost 6.1 million euros",
    ),
    (
        "research-team",
        0,
        "\"title\":\"Five more tidal turbines: promising, not yet paying\"",
    ),
    (
        "market-analysis",
        0,
        "Published \"Norland cargo e-bikes: a market worth entering\"",
    ),
    (
        "supervised-team",
        0,
        "The competitor grew 12% and holds three relevant patents.",
    ),
];

/// The examples of the index, as `flotilla example --json` lists them.
fn listed() -> anyhow::Result<Vec<serde_json::Value>> {
    let out = run(flotilla(&["example", "--json"]), EXAMPLE_TIMEOUT)?;
    anyhow::ensure!(out.status.success(), "{}", text(&out));
    Ok(serde_json::from_slice(&out.stdout)?)
}

#[test]
fn every_plan_is_an_example_and_the_list_names_them() -> anyhow::Result<()> {
    let examples = listed()?;
    let names: Vec<&str> = examples.iter().filter_map(|e| e["name"].as_str()).collect();
    let expected: Vec<&str> = EXPECTED.iter().map(|(n, ..)| *n).collect();
    assert_eq!(
        names, expected,
        "every example of the index has its expectation here"
    );
    let mut plans: Vec<String> = std::fs::read_dir(root().join("config/examples/plans"))?
        .map(|e| e.map(|e| format!("config/examples/plans/{}", e.file_name().to_string_lossy())))
        .collect::<Result<_, _>>()?;
    plans.sort();
    let mut named: Vec<String> = examples
        .iter()
        .filter_map(|e| e["plan"].as_str().map(str::to_owned))
        .collect();
    named.sort();
    assert_eq!(
        named, plans,
        "every plan of config/examples/plans is an example"
    );
    for e in &examples {
        for key in ["config", "plan"] {
            let path = e[key].as_str().unwrap_or_default();
            assert!(root().join(path).is_file(), "{e}: {key} {path}");
        }
        if let Some(model) = e["model"].as_str() {
            assert!(root().join(model).is_file(), "{e}: model {model}");
        }
    }
    // The list a person reads: a line per example with its config, and what the model is.
    let out = run(flotilla(&["example"]), EXAMPLE_TIMEOUT)?;
    assert!(out.status.success(), "{}", text(&out));
    let list = String::from_utf8_lossy(&out.stdout);
    for name in expected {
        assert!(
            list.lines().any(|l| l.starts_with(&format!("{name} "))),
            "{name}: {list}"
        );
    }
    assert!(
        list.contains("config/examples/market-analysis.toml"),
        "{list}"
    );
    assert!(
        list.contains("scripted OpenAI-compatible test double"),
        "{list}"
    );
    Ok(())
}

#[test]
fn every_example_runs_with_one_command() -> anyhow::Result<()> {
    let mut failures = Vec::new();
    for (name, code, line) in EXPECTED {
        let started = Instant::now();
        let out = run(flotilla(&["example", name, "--approve"]), EXAMPLE_TIMEOUT)?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let said = if *code == 0 { &stdout } else { &stderr };
        if out.status.code() != Some(*code) || !said.contains(line) {
            failures.push(format!(
                "{name}: exit {:?} (expected {code}), expected {line:?} in its {}:\n{stdout}{stderr}",
                out.status.code(),
                if *code == 0 { "result" } else { "errors" }
            ));
            continue;
        }
        // Where an LLM answered, the output says the model was a scripted test double, and
        // every reply scripted for the example was used.
        if stderr.contains("  model   ") {
            assert!(
                stderr.contains("a scripted OpenAI-compatible test double, not a model"),
                "{name}: {stderr}"
            );
            assert!(
                !stderr.contains("found no scripted reply left"),
                "{name}: {stderr}"
            );
        }
        eprintln!("{name}: exit {code} in {:.1?}", started.elapsed());
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    Ok(())
}

#[test]
fn an_unknown_example_is_refused_naming_the_known_ones() -> anyhow::Result<()> {
    let out = run(flotilla(&["example", "no-such-example"]), EXAMPLE_TIMEOUT)?;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(
        err.starts_with("error: unknown example \"no-such-example\"; the examples are: earnings, "),
        "{err}"
    );
    for (name, ..) in EXPECTED {
        assert!(err.contains(name), "{name}: {err}");
    }
    // Elsewhere, the index is not found, and the error says where it looked.
    let dir = tempfile::tempdir()?;
    let mut elsewhere = flotilla(&["example"]);
    elsewhere.current_dir(dir.path());
    let out = run(elsewhere, EXAMPLE_TIMEOUT)?;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(
        err.contains("no examples index at config/examples/examples.toml")
            && err.contains("--examples DIR"),
        "{err}"
    );
    Ok(())
}

/// Without `--approve`, the run that waits for a person prints the command that answers it
/// (with the embedded server's URL); run from elsewhere, that command lets the run finish.
#[test]
fn a_waiting_example_says_how_to_answer_it_and_the_answer_ends_it() -> anyhow::Result<()> {
    let mut child = flotilla(&["example", "market-analysis"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let stderr = child
        .stderr
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stderr"))?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let prefix = "example: answer from another terminal: ";
    let deadline = Instant::now() + EXAMPLE_TIMEOUT;
    let mut seen = Vec::new();
    let command = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                if let Some(c) = line.strip_prefix(prefix) {
                    break c.to_owned();
                }
                seen.push(line);
            }
            Err(_) => {
                child.kill()?;
                anyhow::bail!("no answering command printed:\n{}", seen.join("\n"));
            }
        }
    };
    assert!(
        seen.iter().any(|l| l.contains("waits for a person")),
        "{}",
        seen.join("\n")
    );
    // `flotilla --nats-url URL approvals approve RUN ID --by NAME (or reject …)`
    let words: Vec<&str> = command.split_whitespace().collect();
    assert_eq!(&words[..2], ["flotilla", "--nats-url"], "{command}");
    assert_eq!(&words[3..5], ["approvals", "approve"], "{command}");
    let answer = run(
        flotilla(&[
            "--nats-url",
            words[2],
            "approvals",
            "approve",
            words[5],
            words[6],
            "--by",
            "tester",
        ]),
        EXAMPLE_TIMEOUT,
    )?;
    assert!(answer.status.success(), "{}", text(&answer));
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if started.elapsed() > EXAMPLE_TIMEOUT {
            child.kill()?;
            anyhow::bail!("the example did not end after the approval");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // The rest of its output, until its stderr closes.
    let mut rest = Vec::new();
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(10)) {
        rest.push(line);
    }
    assert!(status.success(), "{status:?}\n{}", rest.join("\n"));
    assert!(
        rest.iter()
            .any(|l| l.contains("approval t4a1 of publish_report: approve by tester")),
        "{}",
        rest.join("\n")
    );
    Ok(())
}
