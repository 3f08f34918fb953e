//! Permission refusals are named, on a real nats-server running the shipped
//! `deploy/nats/accounts.conf`: the server reports a permissions violation on the side and
//! the refused request itself would only time out; Flotilla answers `permission_denied`
//! at once instead, naming the subject and the NATS user, and for a consumer the user may
//! not create, the lines its permissions need.
//!
//! Each refused call is given a request timeout far longer than the test waits, so only the
//! refusal can end it in time.

mod support;

use std::time::Duration;

use anyhow::{Context, ensure};
use flotilla_bus::{Bus, JetStreamOptions, NatsAuth, NatsOptions, Secret};
use flotilla_client::{Client, ClientErrorKind};
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::approval::{ApprovalAnswerRequest, Decision};
use flotilla_model::ids::RunId;
use flotilla_testkit::NatsServer;

const OPERATOR: (&str, &str) = ("operator", "operator-dev-password");
const WORKER: (&str, &str) = ("worker-default", "worker-default-dev-password");

/// Longer than any wait of these tests: a refused call that ended before it was ended by
/// the refusal, not by its timeout.
const LONG_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a refusal may take to arrive on a shared machine.
const WAIT: Duration = Duration::from_secs(30);

/// A server with the shipped accounts, provisioned by the operator.
async fn server() -> anyhow::Result<NatsServer> {
    let server = NatsServer::builder()
        .config_file(support::root().join("deploy/nats/accounts.conf"))
        .connect_as(OPERATOR.0, OPERATOR.1)
        .start()
        .await?;
    server
        .bus()
        .await?
        .provision(&JetStreamOptions::default())
        .await?;
    Ok(server)
}

fn answer() -> ApprovalAnswerRequest {
    ApprovalAnswerRequest {
        protocol: PROTOCOL_VERSION,
        run_id: RunId::new(),
        approval_id: "t0a1".into(),
        decision: Decision::Approve,
        by: "agent".into(),
        comment: None,
        digest: None,
        always: false,
        incident: false,
    }
}

/// `flotilla <args>` with `(user, password)`'s credentials, the way the Helm chart hands
/// them to a pod, to the end.
async fn flotilla_as(
    server: &NatsServer,
    (user, password): (&str, &str),
    config: &str,
    args: &[&str],
) -> anyhow::Result<std::process::Output> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("flotilla.toml");
    std::fs::write(
        &path,
        format!("{config}\n[nats]\nurls = [\"{}\"]\n", server.url()),
    )?;
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .arg("--config")
        .arg(&path)
        .args(args)
        .env("FLOTILLA_NATS__AUTH__KIND", "user-password")
        .env("FLOTILLA_NATS__AUTH__USER", user)
        .env("FLOTILLA_NATS__AUTH__PASSWORD", password)
        .env("FLOTILLA_NATS__REQUEST_TIMEOUT", "120s")
        .env("FLOTILLA_LOG", "warn")
        .env("FLOTILLA_TELEMETRY__HTTP_ADDR", "off")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    Ok(tokio::time::timeout(WAIT, run)
        .await
        .with_context(|| format!("`flotilla {}` did not end when refused", args.join(" ")))??)
}

/// A worker's NATS user may not answer an approval (`flotilla.api.approval.answer` is in
/// its deny list): the client says so at once, naming the subject and the user, instead of
/// timing out.
#[tokio::test]
async fn answering_an_approval_as_a_worker_is_permission_denied() -> anyhow::Result<()> {
    let server = server().await?;
    let opts = NatsOptions {
        auth: NatsAuth::UserPassword {
            user: WORKER.0.into(),
            password: Secret::new(WORKER.1),
        },
        request_timeout: LONG_TIMEOUT,
        ..NatsOptions::with_url(server.url())
    };
    let client = Client::new(Bus::connect(&opts, "refusals-test").await?);
    let refused = tokio::time::timeout(WAIT, client.call(&answer(), LONG_TIMEOUT))
        .await
        .context("the refused request waited for its timeout")?;
    let err = refused.expect_err("a worker answered an approval");
    ensure!(err.kind() == ClientErrorKind::PermissionDenied, "{err}");
    let text = err.to_string();
    ensure!(
        text.contains("\"flotilla.api.approval.answer\"")
            && text.contains("user \"worker-default\""),
        "{text}"
    );
    // The connection remembers it, and the next refusal is answered at once too.
    ensure!(
        client
            .bus()
            .link()
            .refused_since(std::time::Instant::now() - WAIT, |s| s
                == "flotilla.api.approval.answer")
            .is_some()
    );
    let again = tokio::time::timeout(WAIT, client.call(&answer(), LONG_TIMEOUT)).await?;
    ensure!(
        again.is_err_and(|e| e.kind() == ClientErrorKind::PermissionDenied),
        "a second refusal"
    );
    Ok(())
}

/// The same from the command line: one line on stderr, `error: permission_denied: …`,
/// exit 2.
#[tokio::test]
async fn the_cli_names_the_refusal_in_one_line() -> anyhow::Result<()> {
    let server = server().await?;
    let run = RunId::new().to_string();
    let out = flotilla_as(&server, WORKER, "", &["approvals", "approve", &run, "t0a1"]).await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.code() == Some(2), "{:?}: {stderr}", out.status);
    eprint!("{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    ensure!(lines.len() == 1, "one line: {stderr}");
    ensure!(
        lines[0].starts_with("error: permission_denied: ")
            && lines[0].contains("\"flotilla.api.approval.answer\"")
            && lines[0].contains("user \"worker-default\""),
        "{stderr}"
    );
    ensure!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(())
}

/// A worker whose agent fills a role its NATS user has no consumer for (the shipped file
/// grants pool `default` only `role-research`) stops at start-up as soon as the server
/// refuses the consumer — not after the request timeout — and says which lines to add to
/// `deploy/nats/accounts.conf` for that user.
#[tokio::test]
async fn a_worker_refused_its_role_consumer_stops_at_once_saying_what_to_allow()
-> anyhow::Result<()> {
    let server = server().await?;
    let agents = r#"
[agents.editor]
kind = "scripted"
reply = "edited"
roles = ["editing"]
"#;
    let out = flotilla_as(&server, WORKER, agents, &["worker"]).await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.code() == Some(2), "{:?}: {stderr}", out.status);
    eprint!("{stderr}");
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("error: "))
        .collect();
    ensure!(errors.len() == 1, "one error line: {stderr}");
    let line = errors[0];
    ensure!(
        line.contains("permission_denied")
            && line.contains("role editing")
            && line.contains("user \"worker-default\"")
            && line.contains("deploy/nats/accounts.conf"),
        "{stderr}"
    );
    for needed in [
        "\"$JS.API.CONSUMER.CREATE.FLOTILLA_TASKS.role-editing.flotilla.role.editing.>\"",
        "\"$JS.API.CONSUMER.INFO.FLOTILLA_TASKS.role-editing\"",
        "\"$JS.API.CONSUMER.MSG.NEXT.FLOTILLA_TASKS.role-editing\"",
        "\"$JS.ACK.FLOTILLA_TASKS.role-editing.>\"",
    ] {
        ensure!(line.contains(needed), "{needed} missing: {stderr}");
    }
    Ok(())
}

/// An LLM agent's tool whose request its worker's NATS user may not make is answered
/// `permission_denied` at once, naming the endpoint, the subject and the user, and the agent
/// carries on with that answer — not "no answer from the supervisor" after the tool's 10 s
/// timeout. Here the deployment's `accounts.conf` takes `team.recruit` from pool `default`'s
/// workers (a copy of the shipped file with one more deny line). The model is the test kit's
/// scripted OpenAI-compatible server (a test double): it calls `recruit`, then answers.
#[tokio::test]
async fn an_agents_tool_refused_by_nats_is_told_so_by_name() -> anyhow::Result<()> {
    let shipped = std::fs::read_to_string(support::root().join("deploy/nats/accounts.conf"))?;
    let at = shipped
        .find("WORKER_DEFAULT = {")
        .context("the worker's permissions")?;
    let (head, tail) = shipped.split_at(at);
    let deny = "\"flotilla.api.approval.revoke\"\n";
    ensure!(tail.contains(deny), "the worker's deny list");
    let conf = format!(
        "{head}{}",
        tail.replacen(
            deny,
            &format!("{deny}      \"flotilla.api.team.recruit\"\n"),
            1
        )
    );
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("accounts.conf");
    std::fs::write(&path, conf)?;
    let server = NatsServer::builder()
        .config_file(&path)
        .connect_as(OPERATOR.0, OPERATOR.1)
        .start()
        .await?;

    let llm = flotilla_testkit::openai::OpenAiServer::start().await?;
    llm.push(flotilla_testkit::openai::Reply::tool_call(
        "recruit",
        serde_json::json!({"role": "editor", "description": "Edit the draft.", "reason": "help"}),
    ));
    llm.push(flotilla_testkit::openai::Reply::text("Carried on alone."));
    let mut p = support::Processes::with_server(
        server,
        &format!(
            "default-agent = \"writer\"\n\n[agents.writer]\nkind = \"llm\"\nbase-url = \"{}\"\nmodel = \"scripted-model\"\ntools = [\"recruit\"]\n",
            llm.base_url()
        ),
    )
    .await?;
    let as_user = |(user, password): (&'static str, &'static str)| {
        [
            ("FLOTILLA_NATS__AUTH__KIND", "user-password"),
            ("FLOTILLA_NATS__AUTH__USER", user),
            ("FLOTILLA_NATS__AUTH__PASSWORD", password),
        ]
    };
    let coordinator = p.spawn_env(
        &["coordinator"],
        &as_user(("coordinator", "coordinator-dev-password")),
    )?;
    support::wait_for_api(&p.bus).await?;
    let worker = p.spawn_env(&["worker"], &as_user(WORKER))?;
    p.wait_registered(worker).await?;

    let started = std::time::Instant::now();
    let run = p
        .client
        .submit(flotilla_model::submit::SubmitRequest::new(support::plan(
            vec![flotilla_model::plan::Subtask::new(
                "draft",
                "Write the draft.",
            )],
        )))
        .await?;
    let outcome = p.client.wait(run, WAIT).await?;
    let took = started.elapsed();
    ensure!(
        outcome.status == flotilla_model::run::RunStatus::Succeeded,
        "{outcome:?}\n{}\n{}",
        p.log(coordinator),
        p.log(worker)
    );
    let requests = llm.requests();
    let told = requests
        .get(1)
        .map(|r| r.texts("tool").join("\n"))
        .unwrap_or_default();
    let told: serde_json::Value =
        serde_json::from_str(&told).with_context(|| format!("the tool's answer: {told}"))?;
    let message = told
        .pointer("/error/message")
        .and_then(serde_json::Value::as_str)
        .unwrap_or_default();
    ensure!(
        told.pointer("/error/code") == Some(&serde_json::json!("permission_denied"))
            && message.starts_with("team.recruit: ")
            && message.contains("\"flotilla.api.team.recruit\"")
            && message.contains("user \"worker-default\""),
        "the tool's answer: {told}"
    );
    ensure!(
        took < Duration::from_secs(8),
        "the refusal waited for the tool's timeout: {took:?}"
    );
    Ok(())
}
