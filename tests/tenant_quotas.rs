//! A tenant's quotas beyond its runs, against a real nats-server with real `flotilla`
//! processes, set through `flotilla tenant add|set` as an operator sets them:
//!
//! * `workspace_bytes` and `mailbox_bytes` are held by the NATS server (the streams'
//!   `max_bytes`, discard new): a write past them is refused `quota_exceeded` naming the
//!   quota, its limit and the use, and stores nothing; lifting the quota lets writes in
//!   again, and `tenant usage` shows the bytes.
//! * `model_requests_per_minute` holds across two workers: of three model calls at once two
//!   are made, the third fails naming the tenant's quota (waiting would pass its deadline);
//!   lifting the quota lets the next run's call through.
//! * `persistent_teammates` holds across two supervisors: of five spawns at once exactly the
//!   limit succeed, the rest are refused `quota_exceeded`; a shutdown frees a place.
//! * Nonsense (a workspace quota smaller than one entry, a model quota that "queues") is
//!   refused and changes nothing.
//!
//! The LLM agent runs on the scripted OpenAI-compatible double (deterministic replies), the
//! teammates on a scripted exec agent: the machinery is what is tested.

mod support;

use std::time::Duration;

use flotilla_bus::{Bus, NatsOptions};
use flotilla_client::Client;
use flotilla_context::{Clients, ErrorKind, Scope};
use flotilla_model::ids::RunId;
use flotilla_model::mailbox::MailboxKind;
use flotilla_model::plan::Subtask;
use flotilla_model::run::RunStatus;
use flotilla_model::subjects::StreamKind;
use flotilla_model::submit::SubmitRequest;
use flotilla_model::teammate::{TeamShutdownRequest, TeamSpawnRequest, TeammateView};
use flotilla_model::time::Secs;
use flotilla_testkit::openai::{OpenAiServer, Reply};
use support::*;

const ASK: Duration = Duration::from_secs(10);

/// Runs `flotilla <args>`; its exit code and output.
fn run(p: &Processes, args: &[&str]) -> anyhow::Result<(i32, String)> {
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

/// Runs `flotilla <args>` and requires it to succeed.
fn ok(p: &Processes, args: &[&str]) -> anyhow::Result<String> {
    let (code, out) = run(p, args)?;
    anyhow::ensure!(code == 0, "flotilla {args:?} exited {code}: {out}");
    Ok(out)
}

/// A connection to tenant `tenant`'s installation, as its services connect.
async fn tenant_bus(p: &Processes, tenant: &str) -> anyhow::Result<Bus> {
    let mut opts = NatsOptions::with_url(p.server.url());
    opts.tenant = Some(tenant.into());
    Ok(Bus::connect(&opts, "tenant-quotas-test").await?)
}

/// The stream's `max_bytes` and whether it discards new messages.
async fn limit_of(bus: &Bus, kind: StreamKind) -> anyhow::Result<(i64, bool)> {
    let s = bus.js().get_stream(bus.names().stream(kind)).await?;
    let c = &s.cached_info().config;
    Ok((
        c.max_bytes,
        c.discard == async_nats::jetstream::stream::DiscardPolicy::New,
    ))
}

async fn bytes_of(bus: &Bus, kind: StreamKind) -> anyhow::Result<u64> {
    let s = bus.js().get_stream(bus.names().stream(kind)).await?;
    Ok(s.cached_info().state.bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn byte_quotas_are_held_by_the_server() -> anyhow::Result<()> {
    let p = Processes::start("").await?;
    ok(
        &p,
        &[
            "tenant",
            "add",
            "acme",
            "--quota",
            "workspace_bytes=1500000",
            "--quota",
            "mailbox_bytes=20000",
        ],
    )?;
    let acme = tenant_bus(&p, "acme").await?;
    assert_eq!(
        limit_of(&acme, StreamKind::Workspace).await?,
        (1_500_000, true)
    );
    assert_eq!(limit_of(&acme, StreamKind::Mailbox).await?, (20_000, true));
    // The deployment's own installation is untouched.
    assert_eq!(limit_of(&p.bus, StreamKind::Workspace).await?, (-1, false));

    // Nonsense is refused by name and changes nothing.
    let (code, out) = run(
        &p,
        &["tenant", "set", "acme", "--quota", "workspace_bytes=1000"],
    )?;
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("workspace_bytes = 1000 is less than one entry"),
        "{out}"
    );
    let (code, out) = run(
        &p,
        &[
            "tenant",
            "set",
            "acme",
            "--quota",
            "model_requests_per_minute=5",
            "--queue",
            "model_requests_per_minute",
        ],
    )?;
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("always waits for its turn"), "{out}");
    assert_eq!(
        limit_of(&acme, StreamKind::Workspace).await?,
        (1_500_000, true)
    );
    let shown = ok(&p, &["tenant", "show", "acme", "--json"])?;
    let shown: serde_json::Value = serde_json::from_str(&shown)?;
    assert_eq!(
        shown["quotas"],
        serde_json::json!({"workspace_bytes": 1_500_000, "mailbox_bytes": 20_000}),
        "{shown:#}"
    );

    // The workspace takes entries until the next would pass the quota: that one is refused
    // `quota_exceeded`, naming it, and nothing of it is stored.
    let root = RunId::new();
    let ws = Clients::new(
        acme.clone(),
        Scope::operator(acme.names().clone(), root, root, root.to_string()).with_by("test"),
    )?;
    let mut entry = serde_json::Map::new();
    entry.insert("text".into(), serde_json::json!("x".repeat(200_000)));
    let mut stored = 0;
    let refused = loop {
        match ws.workspace().append("figures", entry.clone()).await {
            Ok(_) => stored += 1,
            Err(e) => break e,
        }
        anyhow::ensure!(stored < 20, "the workspace never filled");
    };
    assert_eq!(refused.kind(), ErrorKind::QuotaExceeded, "{refused}");
    assert_eq!(refused.code(), "quota_exceeded");
    let message = refused.to_string();
    assert!(
        message.contains("tenant acme is over its workspace_bytes quota")
            && message.contains("of 1500000"),
        "{message}"
    );
    assert!((6..=7).contains(&stored), "{stored} entries of 200 kB");
    let held = bytes_of(&acme, StreamKind::Workspace).await?;
    assert!(held <= 1_500_000, "{held}");
    assert_eq!(
        ws.workspace().read("figures", 0, None).await?.entries.len(),
        stored
    );

    // The mailboxes alike (sent as task `writer`).
    let as_writer = Clients::new(
        acme.clone(),
        Scope::operator(acme.names().clone(), root, root, root.to_string())
            .with_task(flotilla_model::ids::TaskId::new("writer"))
            .with_by("test"),
    )?;
    let mbox = as_writer.mailbox();
    let payload = serde_json::json!({ "note": "y".repeat(3_000) });
    let mut sent = 0;
    let refused = loop {
        match mbox
            .send("reviewer", MailboxKind::Request, payload.clone(), None)
            .await
        {
            Ok(_) => sent += 1,
            Err(e) => break e,
        }
        anyhow::ensure!(sent < 50, "the mailboxes never filled");
    };
    assert_eq!(refused.kind(), ErrorKind::QuotaExceeded, "{refused}");
    assert!(
        refused
            .to_string()
            .contains("tenant acme is over its mailbox_bytes quota"),
        "{refused}"
    );
    assert!(sent >= 4, "{sent}");
    assert!(bytes_of(&acme, StreamKind::Mailbox).await? <= 20_000);

    // The usage shows the bytes against their quotas.
    let usage: serde_json::Value =
        serde_json::from_str(&ok(&p, &["tenant", "usage", "acme", "--json"])?)?;
    assert_eq!(usage["current"]["workspace_bytes"], serde_json::json!(held));
    assert!(
        usage["current"]["mailbox_bytes"].as_u64() > Some(10_000),
        "{usage:#}"
    );
    let text = ok(&p, &["tenant", "usage", "acme"])?;
    assert!(text.contains("of 1500000"), "{text}");

    // Lifted: the stream is as provisioned again, and the write goes in.
    ok(
        &p,
        &["tenant", "set", "acme", "--quota", "workspace_bytes=none"],
    )?;
    assert_eq!(limit_of(&acme, StreamKind::Workspace).await?, (-1, false));
    ws.workspace().append("figures", entry).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_requests_per_minute_hold_across_workers() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    let mut p = Processes::start(&researcher(&llm)).await?;
    ok(
        &p,
        &[
            "tenant",
            "add",
            "acme",
            "--quota",
            "model_requests_per_minute=2",
        ],
    )?;
    let c = p.spawn(&["--tenant", "acme", "coordinator"])?;
    let w1 = p.spawn(&["--tenant", "acme", "worker"])?;
    let w2 = p.spawn(&["--tenant", "acme", "worker"])?;
    let acme = tenant_bus(&p, "acme").await?;
    if let Err(e) = wait_for_api(&acme).await {
        anyhow::bail!("{e}\n{}", p.log(c));
    }
    for _ in 0..3 {
        llm.push(Reply::text("done"));
    }
    // Three calls at once, on two workers: two fit the minute's quota; the third would wait
    // 30 s for its turn, past its attempt's 5 s deadline, and fails naming the quota.
    let client = Client::new(acme.clone());
    let task = |id: &str| {
        let mut t = Subtask::new(id, "Look it up.").with_agent("researcher");
        t.timeout = Some(Secs(Duration::from_secs(5)));
        t
    };
    let run = client
        .submit(SubmitRequest::new(plan(vec![
            task("a"),
            task("b"),
            task("c"),
        ])))
        .await?;
    let outcome = client.wait(run, WAIT).await?;
    assert_eq!(
        llm.requests().len(),
        2,
        "{outcome:?}\nworker 1:\n{}\nworker 2:\n{}",
        p.log(w1),
        p.log(w2)
    );
    assert_eq!(outcome.failed.len(), 1, "{outcome:?}");
    let message = &outcome.failed[0].error.message;
    assert!(
        message.contains("tenant acme's quota (model_requests_per_minute = 2)"),
        "{message}"
    );

    // Lifted: within the quotas' refresh (5 s) the next run's call goes through.
    ok(
        &p,
        &[
            "tenant",
            "set",
            "acme",
            "--quota",
            "model_requests_per_minute=none",
        ],
    )?;
    // (flotilla_llm::ratelimit::QUOTAS_REFRESH)
    tokio::time::sleep(Duration::from_millis(5_500)).await;
    llm.push(Reply::text("done"));
    let run = client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("d", "D.").with_agent("researcher"),
        ])))
        .await?;
    let outcome = client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    Ok(())
}

fn mate_config() -> &'static str {
    r#"
default-agent = "mate"

[agents.mate]
kind = "exec"
command = "sh"
args = ["-c", "echo ok"]
roles = ["analyst"]
"#
}

fn spawn_request(name: &str) -> TeamSpawnRequest {
    TeamSpawnRequest {
        protocol: 1,
        team: Some("t1".into()),
        name: name.into(),
        role: "analyst".into(),
        instructions: "help".into(),
        agent: None,
        pool: None,
        by: None,
        expose: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persistent_teammates_hold_across_supervisors() -> anyhow::Result<()> {
    let mut p = Processes::start(mate_config()).await?;
    ok(
        &p,
        &["tenant", "add", "acme", "--quota", "persistent_teammates=2"],
    )?;
    let s1 = p.spawn(&["--tenant", "acme", "supervisor"])?;
    let s2 = p.spawn(&["--tenant", "acme", "supervisor"])?;
    let acme = tenant_bus(&p, "acme").await?;
    let client = Client::new(acme.clone());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while client
        .request(
            &flotilla_model::teammate::TeamMatesRequest {
                protocol: 1,
                team: None,
            },
            ASK,
        )
        .await
        .is_err()
    {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "no supervisor answered:\n{}\n{}",
            p.log(s1),
            p.log(s2)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Both supervisors serve the API (a queue group): five spawns at once reach both.
    let names = ["ann", "bob", "cid", "dee", "eve"];
    let requests: Vec<TeamSpawnRequest> = names.iter().map(|n| spawn_request(n)).collect();
    let answers = futures::future::join_all(requests.iter().map(|r| client.call(r, ASK))).await;
    let mut spawned = Vec::new();
    let mut refused = Vec::new();
    for (name, a) in names.iter().zip(answers) {
        match a? {
            Ok(_) => spawned.push(*name),
            Err(e) => refused.push((name, e)),
        }
    }
    assert_eq!(spawned.len(), 2, "{spawned:?} {refused:?}");
    for (name, e) in &refused {
        assert_eq!(
            (e.status, e.code.as_str()),
            (429, "quota_exceeded"),
            "{name}: {e:?}"
        );
        assert!(
            e.message
                .contains("tenant acme is over its persistent_teammates quota: 2 used of 2"),
            "{e:?}"
        );
    }

    // A shutdown frees a place.
    let _: TeammateView = client
        .request(
            &TeamShutdownRequest {
                protocol: 1,
                team: Some("t1".into()),
                name: spawned[0].into(),
            },
            ASK,
        )
        .await?;
    client.request(&spawn_request("fay"), ASK).await?;
    let e = client
        .call(&spawn_request("gus"), ASK)
        .await?
        .expect_err("over the quota again");
    assert_eq!(e.code.as_str(), "quota_exceeded", "{e:?}");
    let usage: serde_json::Value =
        serde_json::from_str(&ok(&p, &["tenant", "usage", "acme", "--json"])?)?;
    assert_eq!(usage["current"]["persistent_teammates"], 2, "{usage:#}");
    Ok(())
}
