//! Tenants kept apart by the NATS server, on a real nats-server running the configuration
//! `flotilla tenant nats-config` writes from the shipped `deploy/nats/accounts.conf`: the
//! operator adds tenants `a` and `b` with the CLI, writes the configuration and restarts the
//! server onto it; tenant `a`'s coordinator and worker run a plan on their own users
//! (`coordinator@a`, `worker-default@a`) for `a`'s client, and the default tenant's services
//! one for its client on the same configuration; then every user of tenant `b` —
//! client, worker, coordinator, supervisor, console — the default tenant's client and `b`'s
//! person try `a`'s subjects, streams, buckets, API and inboxes and are refused by the
//! server by name (a permissions violation on their connection), and nothing of `a`
//! changed. `a`'s person and a platform administrator reach `a`'s API.

mod support;

#[path = "permissions/common.rs"]
mod common;

use std::process::Output;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use flotilla_bus::{Bus, NatsAuth, NatsOptions, Secret};
use flotilla_testkit::NatsServer;
use serde_json::Value;

use common::{
    AGENTS, CLIENT, CONSOLE, COORDINATOR, OPERATOR, Role, SUPERVISOR, WORKER, operator_cli, refs,
};

fn json_of(out: &Output) -> anyhow::Result<Value> {
    serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "not JSON: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// The operator's view of tenant `t`'s installation.
async fn operator_bus(server: &NatsServer, t: &str) -> anyhow::Result<Bus> {
    let opts = NatsOptions {
        prefix: format!("flotilla-{t}"),
        auth: NatsAuth::UserPassword {
            user: OPERATOR.0.into(),
            password: Secret::new(OPERATOR.1),
        },
        ..NatsOptions::with_url(server.url())
    };
    Ok(Bus::connect(&opts, "tenants-test").await?)
}

/// What tenant `a` holds, to show that nothing changed: its run log's and runs bucket's
/// message counts and the run's record.
async fn snapshot_of_a(js: &async_nats::jetstream::Context, run: &str) -> anyhow::Result<String> {
    let runlog = common::messages_in(js, "FLOTILLA_A_RUNLOG").await?;
    let runs = common::messages_in(js, "KV_flotilla-a-runs").await?;
    let ws = common::messages_in(js, "FLOTILLA_A_WORKSPACE").await?;
    let record = js
        .get_key_value("flotilla-a-runs")
        .await?
        .get(run)
        .await?
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    Ok(format!("{runlog}/{runs}/{ws}/{record}"))
}

/// `flotilla <args>` as the operator is refused: exit 1, `{"error": code}`, a message that
/// names `names`.
fn assert_refused(
    p: &support::Processes,
    args: &[&str],
    code: &str,
    names: &str,
) -> anyhow::Result<()> {
    let out = operator_cli(p, args)?;
    assert_eq!(out.status.code(), Some(1), "{args:?}");
    let e = json_of(&out)?;
    assert_eq!(e["error"], code, "{args:?}: {e}");
    assert!(
        e["message"].as_str().unwrap_or_default().contains(names),
        "{e}"
    );
    Ok(())
}

/// Runs `flotilla [--tenant T] submit PLAN --wait` with `credentials` to its end: it must
/// succeed. `services` are the processes whose logs explain a failure.
async fn submit_and_wait(
    p: &mut support::Processes,
    tenant: Option<&str>,
    credentials: (&str, &str),
    plan: &std::path::Path,
    extra: &[&str],
    services: &[usize],
) -> anyhow::Result<usize> {
    let env = common::credentials_env(credentials);
    let plan = plan.to_string_lossy();
    let mut args: Vec<&str> = match tenant {
        Some(t) => vec!["--tenant", t],
        None => Vec::new(),
    };
    args.extend(["submit", &plan, "--wait", "--json", "--timeout", "60s"]);
    args.extend(extra);
    let submit = p.spawn_env(&args, &refs(&env))?;
    let code = p.wait_exit(submit, support::WAIT).await?;
    if code != Some(0) {
        let logs: Vec<String> = services.iter().map(|i| p.log(*i)).collect();
        bail!(
            "{tenant:?}: submit exited {code:?}:\n{}\nservices:\n{}",
            p.log(submit),
            logs.join("\n---\n")
        );
    }
    Ok(submit)
}

/// None of `processes` was refused anything by the server (`why` says what that shows).
fn assert_no_violations(p: &support::Processes, processes: &[usize], why: &str) {
    for i in processes {
        assert!(
            !p.log(*i).to_lowercase().contains("permissions violation"),
            "{why}:\n{}",
            p.log(*i)
        );
    }
}

// Multi-threaded: the test waits on CLI processes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_kept_apart_by_the_nats_server() -> anyhow::Result<()> {
    // The server starts on the shipped configuration: no tenants yet.
    let conf_dir = tempfile::tempdir()?;
    let conf = conf_dir.path().join("accounts.conf");
    std::fs::copy(support::root().join("deploy/nats/accounts.conf"), &conf)?;
    let server = NatsServer::builder()
        .config_file(&conf)
        .connect_as(OPERATOR.0, OPERATOR.1)
        .start()
        .await?;
    let mut p = support::Processes::with_server(server, AGENTS).await?;

    // The operator adds two tenants, each with a person.
    let out = operator_cli(&p, &["tenant", "add", "a", "--person", "bob", "--json"])?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let a = json_of(&out)?;
    assert_eq!(a["prefix"], "flotilla-a");
    assert_eq!(a["users"][2], "client@a");
    let out = operator_cli(
        &p,
        &[
            "tenant",
            "add",
            "b",
            "--person",
            "carol",
            "--quota",
            "runs_per_hour=100",
        ],
    )?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Bad input is refused by name and changes nothing.
    for (args, code, names) in [
        (
            vec!["tenant", "add", "a", "--json"],
            "already_exists",
            "tenant a",
        ),
        (
            vec!["tenant", "add", "A", "--json"],
            "invalid_request",
            "\"A\"",
        ),
        (
            vec!["tenant", "add", "default", "--json"],
            "invalid_request",
            "reserved",
        ),
        (
            vec!["tenant", "add", "c", "--quota", "speed=3", "--json"],
            "invalid_request",
            "\"speed\"",
        ),
        (vec!["tenant", "show", "zzz", "--json"], "not_found", "zzz"),
    ] {
        assert_refused(&p, &args, code, names)?;
    }
    let listed = json_of(&operator_cli(&p, &["tenant", "list", "--json"])?)?;
    let names: Vec<&str> = listed
        .as_array()
        .context("a list")?
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert_eq!(names, ["a", "b"]);
    // `add` provisioned each tenant's installation.
    common::messages_in(p.bus.js(), "FLOTILLA_A_RUNLOG").await?;
    common::messages_in(p.bus.js(), "KV_flotilla-b-runs").await?;

    // The configuration with both tenants; the server restarts onto it (same store).
    let out = operator_cli(
        &p,
        &[
            "tenant",
            "nats-config",
            "--admin",
            "root",
            "--out",
            &conf.to_string_lossy(),
        ],
    )?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    p.server.restart().await?;

    // Tenant a's services, each on its own user (`<role>@a`, the role's password).
    let coordinator_env = common::credentials_env(COORDINATOR);
    let worker_env = common::credentials_env(WORKER);
    let c = p.spawn_env(&["--tenant", "a", "coordinator"], &refs(&coordinator_env))?;
    let a_bus = operator_bus(&p.server, "a").await?;
    if let Err(e) = support::wait_for_api(&a_bus).await {
        bail!("{e}\ncoordinator of a:\n{}", p.log(c));
    }
    let w = p.spawn_env(&["--tenant", "a", "worker"], &refs(&worker_env))?;

    // Tenant a's client submits a plan and gets its answer.
    let plan = p.dir().join("plan.json");
    std::fs::write(
        &plan,
        r#"{"name":"tenant-a","subtasks":[
            {"id":"gather","produces":["facts"]},
            {"id":"report","consumes":["facts"],"dependencies":["gather"]}]}"#,
    )?;
    let run = flotilla_model::RunId::new().to_string();
    let submit = submit_and_wait(
        &mut p,
        Some("a"),
        ("client", "client-a-dev-password"),
        &plan,
        &["--run-id", &run],
        &[c, w],
    )
    .await?;
    assert!(p.log(submit).contains("succeeded"), "{}", p.log(submit));
    assert_no_violations(
        &p,
        &[c, w],
        "tenant a's services need nothing outside their tenant",
    );
    // The default tenant keeps working on the same configuration, its rights narrowed to its
    // own streams and services.
    let dc = p.spawn_env(&["coordinator"], &refs(&coordinator_env))?;
    let dw = p.spawn_env(&["worker"], &refs(&worker_env))?;
    submit_and_wait(&mut p, None, CLIENT, &plan, &[], &[dc, dw]).await?;
    assert_no_violations(
        &p,
        &[dc, dw],
        "the default tenant's services keep every right they need",
    );
    let before = snapshot_of_a(p.bus.js(), &run).await?;

    // Every user of tenant b, the default tenant's client, and b's person: refused a's
    // subjects, streams, buckets, API and inboxes by the server.
    let api = "flotilla-a.api.run.get";
    let a_subjects = [
        "flotilla-a.submit".to_owned(),
        format!("flotilla-a.submit.{run}"),
        format!("flotilla-a.runlog.{run}"),
        format!("flotilla-a.event.{run}"),
        format!("flotilla-a.ws.{run}.facts"),
        format!("flotilla-a.mbox.{run}.x.y"),
        "flotilla-a.task.default.r.t".to_owned(),
        "$KV.flotilla-a-state.k".to_owned(),
        "$JS.API.STREAM.INFO.FLOTILLA_A_RUNLOG".to_owned(),
        "$JS.API.STREAM.UPDATE.FLOTILLA_A_RUNLOG".to_owned(),
        "$JS.API.STREAM.PURGE.FLOTILLA_A_WORKSPACE".to_owned(),
        "$JS.API.STREAM.LIST".to_owned(),
        "$JS.API.DIRECT.GET.FLOTILLA_A_EVENTS".to_owned(),
        format!("$JS.API.DIRECT.GET.KV_flotilla-a-runs.$KV.flotilla-a-runs.{run}"),
        "$JS.API.CONSUMER.CREATE.FLOTILLA_A_TASKS.pool-default.flotilla-a.task.default.>"
            .to_owned(),
        "$JS.API.CONSUMER.MSG.NEXT.FLOTILLA_A_RUNLOG.coordinator".to_owned(),
    ];
    let b_users: [(&'static str, &str, &str); 6] = [
        ("client@b", "client-b-dev-password", "_INBOX_b"),
        ("worker-default@b", WORKER.1, "_INBOX_b"),
        ("coordinator@b", COORDINATOR.1, "_INBOX_b"),
        ("supervisor@b", SUPERVISOR.1, "_INBOX_b"),
        ("console@b", CONSOLE.1, "_INBOX_b"),
        (CLIENT.0, CLIENT.1, "_INBOX"),
    ];
    for (user, password, inbox) in b_users {
        let mut role = Role::connect_with_inbox(&p.server, (user, password), inbox).await?;
        for s in &a_subjects {
            role.publish_refused(s)
                .await
                .with_context(|| format!("{user} publishing to {s}"))?;
        }
        for s in [
            "flotilla-a.event.>",
            "flotilla-a.api.>",
            "_INBOX_a.>",
            "flotilla-a.mbox.>",
        ] {
            role.subscribe_refused(s)
                .await
                .with_context(|| format!("{user} subscribing to {s}"))?;
        }
        role.request_refused(api)
            .await
            .with_context(|| format!("{user} calling {api}"))?;
    }
    // b's person: a's API and a's person's inbox are refused; b's own API is not.
    let mut carol =
        Role::connect_with_inbox(&p.server, ("carol", "carol-dev-password"), "_INBOX_carol")
            .await?;
    carol.request_refused(api).await?;
    carol.subscribe_refused("_INBOX_bob.>").await?;
    carol.subscribe_refused("_INBOX.>").await?;
    carol.publish_refused("flotilla.api.run.get").await?;
    // a's person and the platform administrator reach a's API (answered: `not_found` for
    // an unknown run is an answer).
    let get = serde_json::json!({"protocol": 1, "run_id": flotilla_model::RunId::new()});
    for (user, password, inbox) in [
        ("bob", "bob-dev-password", "_INBOX_bob"),
        ("root", "root-dev-password", "_INBOX_root"),
    ] {
        let mut person = Role::connect_with_inbox(&p.server, (user, password), inbox).await?;
        let answer = tokio::time::timeout(
            Duration::from_secs(10),
            person
                .client
                .request(api.to_owned(), serde_json::to_vec(&get)?.into()),
        )
        .await
        .with_context(|| format!("{user}: no answer from {api}"))??;
        ensure!(!answer.payload.is_empty(), "{user}: an empty answer");
        person.no_violations().await?;
    }
    // Nothing of a changed.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(snapshot_of_a(p.bus.js(), &run).await?, before);
    Ok(())
}

/// One coordinator, one supervisor and one worker process serve two tenants
/// (`--tenants a,b`), each tenant on its own users, on the configuration written offline
/// (`tenant nats-config --from-file`) before the server starts: both tenants' plans run, the
/// one worker is registered in each tenant's installation with the shared slots, and no
/// process needs anything outside its tenants.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_set_of_processes_serves_every_tenant() -> anyhow::Result<()> {
    let conf_dir = tempfile::tempdir()?;
    let conf = conf_dir.path().join("accounts.conf");
    let records = conf_dir.path().join("tenants.json");
    std::fs::write(
        &records,
        r#"[{"name":"a","pools":["default"],"created_ms":0},{"name":"b","pools":["default"],"created_ms":0}]"#,
    )?;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["tenant", "nats-config", "--from-file"])
        .arg(&records)
        .arg("--out")
        .arg(&conf)
        .output()?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let server = NatsServer::builder()
        .config_file(&conf)
        .connect_as(OPERATOR.0, OPERATOR.1)
        .start()
        .await?;
    let mut p = support::Processes::with_server(server, AGENTS).await?;
    for t in ["a", "b"] {
        let out = operator_cli(&p, &["tenant", "add", t])?;
        ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let coordinator_env = common::credentials_env(COORDINATOR);
    let worker_env = common::credentials_env(WORKER);
    let supervisor_env = common::credentials_env(SUPERVISOR);
    let c = p.spawn_env(
        &["coordinator", "--tenants", "a,b"],
        &refs(&coordinator_env),
    )?;
    let s = p.spawn_env(&["supervisor", "--tenants", "a,b"], &refs(&supervisor_env))?;
    let w = p.spawn_env(
        &["worker", "--tenants", "a,b", "--concurrency", "3"],
        &refs(&worker_env),
    )?;
    let plan = p.dir().join("plan.json");
    std::fs::write(
        &plan,
        r#"{"subtasks":[{"id":"one"},{"id":"two","dependencies":["one"]}]}"#,
    )?;
    for t in ["a", "b"] {
        let bus = operator_bus(&p.server, t).await?;
        if let Err(e) = support::wait_for_api(&bus).await {
            bail!("{e}\ncoordinator:\n{}", p.log(c));
        }
        let password = format!("client-{t}-dev-password");
        submit_and_wait(&mut p, Some(t), ("client", &password), &plan, &[], &[c, w]).await?;
        // The one worker process is a live worker of each tenant, with the shared slots.
        let workers = bus.kv(flotilla_model::subjects::Bucket::Workers).await?;
        let keys: Vec<String> = futures::TryStreamExt::try_collect(workers.keys().await?).await?;
        ensure!(keys.len() == 1, "tenant {t}'s workers: {keys:?}");
        let info: flotilla_model::worker::WorkerInfo =
            serde_json::from_slice(&workers.get(&keys[0]).await?.context("the worker's entry")?)?;
        assert_eq!(info.concurrency, 3);
    }
    assert_no_violations(
        &p,
        &[c, s, w],
        "a shared process needs nothing outside its tenants",
    );
    // The operator sets a quota; the tenant's usage shows it with the counters (no model
    // calls here: no days). A quota of 0 and an unknown tenant are refused by name.
    let out = operator_cli(
        &p,
        &[
            "tenant",
            "set",
            "a",
            "--quota",
            "runs_per_hour=50",
            "--json",
        ],
    )?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let usage = json_of(&operator_cli(&p, &["tenant", "usage", "a", "--json"])?)?;
    assert_eq!(usage["tenant"], "a", "{usage}");
    assert_eq!(usage["quotas"]["runs_per_hour"], 50, "{usage}");
    assert_eq!(usage["days"], serde_json::json!([]), "{usage}");
    for (args, code, names) in [
        (
            vec![
                "tenant",
                "set",
                "a",
                "--quota",
                "concurrent_runs=0",
                "--json",
            ],
            "invalid_request",
            "concurrent_runs = 0",
        ),
        (vec!["tenant", "usage", "zzz", "--json"], "not_found", "zzz"),
    ] {
        assert_refused(&p, &args, code, names)?;
    }
    let usage = json_of(&operator_cli(&p, &["tenant", "usage", "a", "--json"])?)?;
    assert_eq!(
        usage["quotas"]["runs_per_hour"], 50,
        "a refused change changes nothing"
    );
    // Bad input (a usage error, exit 2, naming it): a bad name, a tenant twice, --tenants
    // with --tenant.
    for args in [
        vec!["worker", "--tenants", "A"],
        vec!["worker", "--tenants", "a,a"],
        vec!["--tenant", "a", "coordinator", "--tenants", "b"],
    ] {
        let out = operator_cli(&p, &args)?;
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--tenant"), "{args:?}: {err}");
    }
    Ok(())
}
