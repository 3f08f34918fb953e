//! One console of several tenants, on a real nats-server running the configuration
//! `flotilla tenant nats-config` writes: the operator adds tenants `a` (person alice) and `b`
//! (person bob); one coordinator, one worker and one `flotilla console --tenants a,b`
//! process serve both, each tenant through its own users (`console@a`, `console@b`; the
//! tenant records as `console`). Each tenant has a run waiting on an approval.
//!
//! alice (a's, an operator) sees only tenant a: her tenants (`/api/me`), a's runs; b's runs,
//! inbox, usage and approval are refused `403 not_in_tenant` naming b, and b's approval is
//! still pending; she answers a's. bob, the converse. The administrator sees both and answers
//! b's. A tenant's usage in the console is `flotilla tenant usage --json`'s document. A
//! change of a tenant's people (`tenant set --person`) shows on the next request, without a
//! restart. In headless Chromium, alice's page lists only her tenant in the picker and only
//! a's run, b's page says she is not in it, and a's usage page shows the model's tokens
//! (docs/screenshots/console-tenants.png, console-tenant-usage.png). Bad input — an unknown
//! tenant, a bad name, an administrator without a name — is refused by name. No console user
//! is refused anything by the server.
//!
//! `--all-tenants` serves a tenant added later once the server has its users (a reload of
//! the configuration with them), and no longer a removed one.

mod support;

#[path = "permissions/common.rs"]
mod common;

use std::path::PathBuf;
use std::process::Output;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use flotilla_bus::{Bus, NatsAuth, NatsOptions, Secret};
use flotilla_client::Client;
use flotilla_model::RunId;
use flotilla_model::plan::Subtask;
use flotilla_model::run::RunStatus;
use flotilla_model::submit::SubmitRequest;
use flotilla_testkit::NatsServer;
use flotilla_testkit::openai::{OpenAiServer, Reply};
use serde_json::Value;

use common::{AGENTS, CONSOLE, COORDINATOR, OPERATOR, WORKER, operator_cli, refs};

const ALICE: &str = "alice-token-of-tenant-a-0123";
const BOB: &str = "bob-token-of-tenant-b-0123456";
const ADMIN: &str = "admin-token-of-every-tenant-01";

/// [`operator_cli`], which must succeed.
fn operator_ok(p: &support::Processes, args: &[&str]) -> anyhow::Result<Output> {
    let out = operator_cli(p, args)?;
    ensure!(
        out.status.success(),
        "flotilla {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(out)
}

/// The operator's connection to tenant `t`'s installation.
async fn operator_bus(server: &NatsServer, t: &str) -> anyhow::Result<Bus> {
    let opts = NatsOptions {
        prefix: format!("flotilla-{t}"),
        auth: NatsAuth::UserPassword {
            user: OPERATOR.0.into(),
            password: Secret::new(OPERATOR.1),
        },
        ..NatsOptions::with_url(server.url())
    };
    Ok(Bus::connect(&opts, "console-tenants-test").await?)
}

/// One request to the console as the identity of `token`: the status and the JSON body (a
/// POST carries the console's CSRF header).
async fn as_(
    addr: &str,
    token: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> anyhow::Result<(u16, Value)> {
    let auth = format!("Bearer {token}");
    let mut headers = vec![("Authorization", auth.as_str())];
    if method == "POST" {
        headers.push(("X-Flotilla-Console", "1"));
    }
    let (code, text) = flotilla_testkit::http::request(addr, method, path, &headers, body).await?;
    let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
    Ok((code, value))
}

/// `method path` as `token` is refused `403 not_in_tenant`, naming `tenant`.
async fn not_in_tenant(
    addr: &str,
    token: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    tenant: &str,
) -> anyhow::Result<()> {
    let (code, v) = as_(addr, token, method, path, body).await?;
    ensure!(
        code == 403 && v["error"] == "not_in_tenant",
        "{method} {path}: {code} {v}"
    );
    let message = v["message"].as_str().unwrap_or_default();
    ensure!(
        message.contains(&format!("tenant \"{tenant}\"")),
        "{method} {path}: the refusal names the tenant: {message}"
    );
    Ok(())
}

/// The id of `run`'s pending approval in tenant `t`, once the console lists it (as `token`).
async fn approval_of(addr: &str, token: &str, t: &str, run: RunId) -> anyhow::Result<String> {
    let deadline = tokio::time::Instant::now() + support::WAIT;
    loop {
        let (code, v) = as_(
            addr,
            token,
            "GET",
            &format!("/t/{t}/api/inbox?run={run}"),
            None,
        )
        .await?;
        ensure!(code == 200, "{t}'s inbox: {code} {v}");
        if let Some(id) = v["approvals"][0]["request"]["approval_id"].as_str() {
            return Ok(id.to_owned());
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "no approval for {run} in {t}: {v}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The run ids the console lists in tenant `t` to `token`.
async fn runs_listed(addr: &str, token: &str, t: &str) -> anyhow::Result<Vec<String>> {
    let (code, v) = as_(addr, token, "GET", &format!("/t/{t}/api/runs"), None).await?;
    ensure!(code == 200, "{t}'s runs: {code} {v}");
    Ok(v["runs"]
        .as_array()
        .context("runs")?
        .iter()
        .filter_map(|r| r["handle"]["run_id"].as_str().map(str::to_owned))
        .collect())
}

/// The tenants `/api/me` lists to `token`.
async fn tenants_of(addr: &str, token: &str) -> anyhow::Result<Value> {
    let (code, v) = as_(addr, token, "GET", "/api/me", None).await?;
    ensure!(code == 200, "me: {code} {v}");
    Ok(v["tenants"].clone())
}

/// A run in tenant `t` that waits for a person's approval (`publish` is a sensitive action),
/// after `gather` by `agent`.
async fn gated_run(server: &NatsServer, t: &str, agent: &str) -> anyhow::Result<RunId> {
    let client = Client::new(operator_bus(server, t).await?);
    let mut publish = Subtask::new("publish", "publish it");
    publish.action = Some("publish".into());
    let mut plan = support::plan(vec![
        Subtask::new("gather", "Gather the figures.").with_agent(agent),
        publish.after(&["gather"]),
    ]);
    plan.name = Some(format!("tenant-{t}-report"));
    Ok(client.submit(SubmitRequest::new(plan)).await?)
}

/// The server's permission violations of `user`.
fn refusals_of(server: &NatsServer, user: &str) -> anyhow::Result<Vec<String>> {
    let log = std::fs::read_to_string(server.dir().join("nats-server.log"))?;
    let (new, old) = (format!("/user:{user}\""), format!("User \"{user}\""));
    Ok(log
        .lines()
        .filter(|l| l.contains("Violation") && (l.contains(&new) || l.contains(&old)))
        .map(str::to_owned)
        .collect())
}

fn browser_dir() -> PathBuf {
    support::root().join("crates/flotilla-console/browser")
}

/// Chromium, node and playwright-core, when installed (`scripts/ensure-browser.sh`).
fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("FLOTILLA_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let found = std::env::split_paths(&std::env::var_os("PATH")?)
        .flat_map(|d| [d.join("chromium"), d.join("chromium-browser")])
        .find(|p| p.is_file())?;
    let node = std::process::Command::new("node").arg("--version").output();
    (node.is_ok() && browser_dir().join("node_modules/playwright-core").is_dir()).then_some(found)
}

/// A deployment on the NATS configuration `tenant nats-config` writes for `tenants` (name,
/// person), the test's configuration with `agents` and the console's identities (tokens of
/// alice, bob and the administrator; alice and bob operators), and where its console listens.
struct Deployment {
    p: support::Processes,
    /// The NATS configuration the server runs (written again by `nats-config`).
    conf: PathBuf,
    _conf_dir: tempfile::TempDir,
    addr: String,
}

impl Deployment {
    async fn start(agents: &str, tenants: &[(&str, &str)]) -> anyhow::Result<Self> {
        let conf_dir = tempfile::tempdir()?;
        let conf = conf_dir.path().join("accounts.conf");
        std::fs::copy(support::root().join("deploy/nats/accounts.conf"), &conf)?;
        let server = NatsServer::builder()
            .config_file(&conf)
            .connect_as(OPERATOR.0, OPERATOR.1)
            .start()
            .await?;
        let addr = format!(
            "127.0.0.1:{}",
            std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port()
        );
        let config = format!(
            r#"{AGENTS}{agents}
[console]
listen = "{addr}"
operators = ["alice", "bob"]
administrators = ["admin"]
[console.tokens]
alice = "{ALICE}"
bob = "{BOB}"
admin = "{ADMIN}"
"#
        );
        let mut p = support::Processes::with_server(server, &config).await?;
        for (t, person) in tenants {
            operator_ok(&p, &["tenant", "add", t, "--person", person])?;
        }
        operator_ok(
            &p,
            &["tenant", "nats-config", "--out", &conf.to_string_lossy()],
        )?;
        p.server.restart().await?;
        Ok(Self {
            p,
            conf,
            _conf_dir: conf_dir,
            addr,
        })
    }

    /// `flotilla console <args>` on the `console` user, once it answers.
    async fn console(&mut self, args: &[&str]) -> anyhow::Result<usize> {
        let env = common::credentials_env(CONSOLE);
        let console = self
            .p
            .spawn_env(&[&["console"], args].concat(), &refs(&env))?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while flotilla_testkit::http::request(&self.addr, "GET", "/healthz", &[], None)
            .await
            .map(|r| r.0)
            .ok()
            != Some(200)
        {
            ensure!(
                tokio::time::Instant::now() < deadline,
                "the console did not start:\n{}",
                self.p.log(console)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(console)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_person_sees_and_answers_only_their_tenants() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    let analyst = support::priced_llm_agent("analyst", &llm);
    let mut d = Deployment::start(&analyst, &[("a", "alice"), ("b", "bob")]).await?;
    let addr = d.addr.clone();

    // One coordinator, one worker and one console serve both tenants.
    let p = &mut d.p;
    let coordinator_env = common::credentials_env(COORDINATOR);
    let c = p.spawn_env(
        &["coordinator", "--tenants", "a,b"],
        &refs(&coordinator_env),
    )?;
    for t in ["a", "b"] {
        if let Err(e) = support::wait_for_api(&operator_bus(&p.server, t).await?).await {
            bail!("{e}\ncoordinator:\n{}", p.log(c));
        }
    }
    let worker_env = common::credentials_env(WORKER);
    let w = p.spawn_env(&["worker", "--tenants", "a,b"], &refs(&worker_env))?;
    let console = d.console(&["--tenants", "a,b"]).await?;
    let p = &mut d.p;

    // A run in each tenant waits for an approval; a's `gather` is a model call.
    llm.push(Reply::text("Revenue was 1250.").usage(900, 200));
    let run_a = gated_run(&p.server, "a", "analyst").await?;
    let run_b = gated_run(&p.server, "b", "echo").await?;
    let approval_a = approval_of(&addr, ALICE, "a", run_a).await?;
    let approval_b = approval_of(&addr, BOB, "b", run_b).await?;

    // alice: her tenant only.
    assert_eq!(tenants_of(&addr, ALICE).await?, serde_json::json!(["a"]));
    let listed = runs_listed(&addr, ALICE, "a").await?;
    ensure!(
        listed.contains(&run_a.to_string()) && !listed.contains(&run_b.to_string()),
        "alice's runs of a: {listed:?}"
    );
    let answer = r#"{"decision":"approve","comment":"from the console"}"#;
    for (method, path, body) in [
        ("GET", "/t/b/api/runs".to_owned(), None),
        ("GET", format!("/t/b/api/runs/{run_b}"), None),
        ("GET", format!("/t/b/api/runs/{run_b}/events"), None),
        ("GET", "/t/b/api/inbox".to_owned(), None),
        ("GET", "/t/b/api/usage".to_owned(), None),
        (
            "POST",
            format!("/t/b/api/approvals/{run_b}/{approval_b}"),
            Some(answer),
        ),
        ("POST", format!("/t/b/api/runs/{run_b}/cancel"), Some("{}")),
    ] {
        not_in_tenant(&addr, ALICE, method, &path, body, "b").await?;
    }
    // A tenant that does not exist reads the same to her: nothing is told of it.
    not_in_tenant(&addr, ALICE, "GET", "/t/zzz/api/runs", None, "zzz").await?;
    // bob: the converse.
    assert_eq!(tenants_of(&addr, BOB).await?, serde_json::json!(["b"]));
    let listed = runs_listed(&addr, BOB, "b").await?;
    ensure!(
        listed.contains(&run_b.to_string()) && !listed.contains(&run_a.to_string()),
        "bob's runs of b: {listed:?}"
    );
    for (method, path, body) in [
        ("GET", format!("/t/a/api/runs/{run_a}"), None),
        ("GET", "/t/a/api/inbox".to_owned(), None),
        (
            "POST",
            format!("/t/a/api/approvals/{run_a}/{approval_a}"),
            Some(answer),
        ),
    ] {
        not_in_tenant(&addr, BOB, method, &path, body, "a").await?;
    }
    // A route without a tenant names none.
    let (code, v) = as_(&addr, ALICE, "GET", "/api/runs", None).await?;
    ensure!(code == 400 && v["error"] == "tenant_required", "{code} {v}");
    // Nothing changed: both approvals still wait, both runs go on.
    assert_eq!(approval_of(&addr, ADMIN, "a", run_a).await?, approval_a);
    assert_eq!(approval_of(&addr, ADMIN, "b", run_b).await?, approval_b);
    for (t, run) in [("a", run_a), ("b", run_b)] {
        let view = Client::new(operator_bus(&p.server, t).await?)
            .run(run)
            .await?
            .context("recorded")?;
        ensure!(
            !view.record.status.is_terminal(),
            "{t}'s run: {:?}",
            view.record.status
        );
    }

    // alice answers a's approval: the run succeeds, answered by her.
    let (code, v) = as_(
        &addr,
        ALICE,
        "POST",
        &format!("/t/a/api/approvals/{run_a}/{approval_a}"),
        Some(answer),
    )
    .await?;
    ensure!(code == 200, "alice approves a's: {code} {v}");
    let a_client = Client::new(operator_bus(&p.server, "a").await?);
    assert_eq!(
        a_client.wait(run_a, support::WAIT).await?.status,
        RunStatus::Succeeded
    );

    // Its usage is counted once its end is told, off the run's path.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (code, v) = as_(&addr, ALICE, "GET", "/t/a/api/usage", None).await?;
        ensure!(code == 200, "usage: {code} {v}");
        if v["days"].as_array().is_some_and(|d| !d.is_empty()) {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "a's run's usage: {v}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // In the browser, alice's page shows only her tenant.
    match chromium() {
        None => eprintln!(
            "SKIPPED: the browser part: no chromium, node or playwright-core (scripts/ensure-browser.sh)"
        ),
        Some(chromium) => {
            let shots = support::root().join("docs/screenshots");
            let out = tokio::time::timeout(
                Duration::from_secs(120),
                tokio::process::Command::new("node")
                    .arg(browser_dir().join("tenants.mjs"))
                    .env("CONSOLE_URL", format!("http://{addr}"))
                    .env("ALICE_TOKEN", ALICE)
                    .env("RUN_A", run_a.to_string())
                    .env("RUN_B", run_b.to_string())
                    .env("CHROMIUM", chromium)
                    .env("SCREENSHOTS", &shots)
                    .kill_on_drop(true)
                    .output(),
            )
            .await??;
            let said = String::from_utf8_lossy(&out.stdout);
            eprintln!("{said}");
            ensure!(
                out.status.success(),
                "the browser: {said}\n{}",
                p.log(console)
            );
        }
    }

    // The administrator sees both tenants and answers b's approval.
    assert_eq!(
        tenants_of(&addr, ADMIN).await?,
        serde_json::json!(["a", "b"])
    );
    let (code, v) = as_(&addr, ADMIN, "GET", "/api/me", None).await?;
    ensure!(
        code == 200 && v["administrator"] == true && v["operator"] == true,
        "{v}"
    );
    for t in ["a", "b"] {
        runs_listed(&addr, ADMIN, t).await?;
    }
    let (code, v) = as_(&addr, ADMIN, "GET", "/t/zzz/api/runs", None).await?;
    ensure!(code == 404 && v["error"] == "unknown_tenant", "{code} {v}");
    let (code, v) = as_(
        &addr,
        ADMIN,
        "POST",
        &format!("/t/b/api/approvals/{run_b}/{approval_b}"),
        Some(r#"{"decision":"approve","comment":"the platform"}"#),
    )
    .await?;
    ensure!(code == 200, "admin approves b's: {code} {v}");
    let b_client = Client::new(operator_bus(&p.server, "b").await?);
    assert_eq!(
        b_client.wait(run_b, support::WAIT).await?.status,
        RunStatus::Succeeded
    );
    let answered = b_client.pending_approvals(Some(run_b)).await?;
    ensure!(answered.is_empty(), "{answered:?}");

    // a's usage in the console is `flotilla tenant usage a --json`'s: the model's tokens by
    // day, agent and model.
    let (code, console_usage) = as_(&addr, ALICE, "GET", "/t/a/api/usage?days=7", None).await?;
    ensure!(code == 200, "usage: {code} {console_usage}");
    let out = operator_ok(p, &["tenant", "usage", "a", "--since", "7d", "--json"])?;
    let cli_usage: Value = serde_json::from_slice(&out.stdout)?;
    for field in ["tenant", "quotas", "days"] {
        assert_eq!(console_usage[field], cli_usage[field], "{field}");
    }
    let by = &console_usage["days"][0]["by"][0];
    assert_eq!(
        (&by["agent"], &by["model"]),
        (&"analyst".into(), &"scripted-model".into())
    );
    assert_eq!(console_usage["days"][0]["total"]["tokens"], 1100);
    let (code, v) = as_(&addr, ALICE, "GET", "/t/a/api/usage?days=0", None).await?;
    ensure!(code == 400 && v["error"] == "invalid_days", "{code} {v}");

    // a's people change: bob now, not alice — on the next requests, without a restart.
    operator_ok(p, &["tenant", "set", "a", "--person", "bob"])?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tenants_of(&addr, BOB).await? != serde_json::json!(["a", "b"]) {
        ensure!(tokio::time::Instant::now() < deadline, "bob is not in a");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(tenants_of(&addr, ALICE).await?, serde_json::json!([]));
    not_in_tenant(&addr, ALICE, "GET", "/t/a/api/runs", None, "a").await?;
    ensure!(
        runs_listed(&addr, BOB, "a")
            .await?
            .contains(&run_a.to_string())
    );

    // Nothing the console did was refused by the server, on any of its users.
    for user in ["console", "console@a", "console@b"] {
        let refused = refusals_of(&p.server, user)?;
        ensure!(
            refused.is_empty(),
            "{user} was refused:\n{}",
            refused.join("\n")
        );
    }
    ensure!(
        !p.log(console).contains("Permissions Violation"),
        "{}",
        p.log(console)
    );

    // Bad input, refused by name (a usage error, exit 2): a tenant that does not exist, a
    // bad name, a tenant twice, both --tenants and --all-tenants, --tenant with --tenants.
    let console_env = common::credentials_env(CONSOLE);
    let console_env = refs(&console_env);
    for (args, names) in [
        (
            vec!["console", "--tenants", "a,zzz"],
            "\"zzz\" does not exist",
        ),
        (vec!["console", "--tenants", "Bad"], "--tenants: \"Bad\""),
        (vec!["console", "--tenants", "a,a"], "\"a\" is listed twice"),
        (
            vec!["console", "--tenants", "a", "--all-tenants"],
            "--all-tenants",
        ),
        (
            vec!["--tenant", "a", "console", "--tenants", "b"],
            "drop --tenant",
        ),
    ] {
        let i = p.spawn_env(
            &[&args[..], &["--listen", "127.0.0.1:0"]].concat(),
            &console_env,
        )?;
        let code = p.wait_exit(i, Duration::from_secs(30)).await?;
        ensure!(code == Some(2), "{args:?} exited {code:?}:\n{}", p.log(i));
        ensure!(p.log(i).contains(names), "{args:?}:\n{}", p.log(i));
    }
    let bad = p.dir().join("bad.toml");
    std::fs::write(
        &bad,
        format!(
            "[nats]\nurls = [\"{}\"]\n[console]\nadministrators = [\"\"]\n",
            p.server.url()
        ),
    )?;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .arg("--config")
        .arg(&bad)
        .args(["console", "--tenants", "a"])
        .env_remove("FLOTILLA_CONFIG")
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(2) && err.contains("console.administrators: \"\""),
        "{:?}: {err}",
        out.status
    );
    let _ = w;
    Ok(())
}

/// Waits until `check` holds (it says what it saw when it does not), for up to `within`.
async fn until<F, Fut>(within: Duration, mut check: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Result<(), String>>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match check().await? {
            Ok(()) => return Ok(()),
            Err(saw) if tokio::time::Instant::now() >= deadline => bail!("{saw}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// `flotilla console --all-tenants` serves every tenant with a record; a tenant added later
/// once the NATS server has its users — until then its page answers `503
/// tenant_unavailable`, and the console tries again —, and no longer a removed one. Its
/// people see it come and go, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_tenant_is_served_as_it_comes_and_goes() -> anyhow::Result<()> {
    let mut d = Deployment::start("", &[("a", "alice")]).await?;
    let console = d.console(&["--all-tenants"]).await?;
    let addr = d.addr.clone();
    assert_eq!(tenants_of(&addr, ADMIN).await?, serde_json::json!(["a"]));
    assert_eq!(tenants_of(&addr, ALICE).await?, serde_json::json!(["a"]));
    runs_listed(&addr, ALICE, "a").await?;

    // Tenant c is added, alice its person: its record is seen at once, its NATS users are not
    // there yet — the console tries and fails.
    operator_ok(&d.p, &["tenant", "add", "c", "--person", "alice"])?;
    until(Duration::from_secs(10), || async {
        let (code, v) = as_(&addr, ADMIN, "GET", "/t/c/api/runs", None).await?;
        let tried =
            d.p.log(console)
                .contains("Cannot reach the tenant's installation yet");
        Ok((code == 503 && v["error"] == "tenant_unavailable" && tried)
            .then_some(())
            .ok_or(format!("c before its users: {code} {v}, tried: {tried}")))
    })
    .await?;
    assert_eq!(tenants_of(&addr, ALICE).await?, serde_json::json!(["a"]));
    // The configuration with c's users; the server reloads it (connections stay).
    operator_ok(
        &d.p,
        &["tenant", "nats-config", "--out", &d.conf.to_string_lossy()],
    )?;
    let pid = d.p.server.pid().context("the server's pid")?.to_string();
    ensure!(
        std::process::Command::new("kill")
            .args(["-HUP", &pid])
            .status()?
            .success(),
        "reload"
    );
    until(Duration::from_secs(20), || async {
        let mine = tenants_of(&addr, ALICE).await?;
        Ok((mine == serde_json::json!(["a", "c"]))
            .then_some(())
            .ok_or(format!("alice's tenants after the reload: {mine}")))
    })
    .await?;
    runs_listed(&addr, ALICE, "c").await?;

    // c is removed: no longer served.
    operator_ok(&d.p, &["tenant", "remove", "c"])?;
    until(Duration::from_secs(10), || async {
        let mine = tenants_of(&addr, ALICE).await?;
        Ok((mine == serde_json::json!(["a"]))
            .then_some(())
            .ok_or(format!("alice's tenants after c's removal: {mine}")))
    })
    .await?;
    not_in_tenant(&addr, ALICE, "GET", "/t/c/api/runs", None, "c").await?;
    let (code, v) = as_(&addr, ADMIN, "GET", "/t/c/api/runs", None).await?;
    ensure!(code == 404 && v["error"] == "unknown_tenant", "{code} {v}");
    for user in ["console", "console@a", "console@c"] {
        let refused = refusals_of(&d.p.server, user)?;
        ensure!(
            refused.is_empty(),
            "{user} was refused:\n{}",
            refused.join("\n")
        );
    }
    Ok(())
}
