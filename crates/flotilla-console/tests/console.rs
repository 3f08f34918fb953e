//! The console against real services on a real nats-server: a coordinator, a worker of
//! deterministic scripted agents and a supervisor in this process, the console on a free
//! loopback port. `the_api_*` tests speak HTTP; `in_a_real_browser` drives headless
//! Chromium through `browser/console.mjs` (Playwright's protocol client, `playwright-core`)
//! and writes the screenshots of `docs/screenshots/`. Without a browser it says why and
//! passes (install one with `scripts/ensure-browser.sh`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use flotilla_bus::{Bus, JetStreamOptions};
use flotilla_client::Client;
use flotilla_console::{Console, ConsoleOptions};
use flotilla_coordinator::{Coordinator, CoordinatorOptions};
use flotilla_model::approval::ApprovalListRequest;
use flotilla_model::plan::{Plan, PlanConfig, Subtask};
use flotilla_model::run::RunStatus;
use flotilla_model::runlog::{ControlAction, RunInput};
use flotilla_model::submit::SubmitRequest;
use flotilla_model::team::MemberCard;
use flotilla_model::validate::{AgentCatalog, ValidationContext};
use flotilla_supervisor::{Supervisor, SupervisorOptions};
use flotilla_testkit::NatsServer;
use flotilla_testkit::openai::{OpenAiServer, Reply};
use flotilla_worker::agents::{AgentDefinition, ScriptedConfig};
use flotilla_worker::{AgentRegistry, Worker, WorkerOptions};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

const ALICE: &str = "alice-token-for-the-console-test";
const BOB: &str = "bob-token-for-the-console-test";
const WAIT: Duration = Duration::from_secs(60);

/// Services and the console, stopped on drop of `shutdown`.
struct Fixture {
    server: NatsServer,
    /// The scripted OpenAI-compatible server the `analyst` LLM agent calls (a test double).
    llm: OpenAiServer,
    client: Client,
    console: SocketAddr,
    shutdown: CancellationToken,
    services: JoinSet<()>,
}

impl Fixture {
    async fn start() -> anyhow::Result<Self> {
        Self::start_with(
            Duration::from_millis(300),
            WorkerOptions::default().concurrency,
        )
        .await
    }

    /// With the writer taking `delay` per task, on a worker of `concurrency` slots.
    async fn start_with(delay: Duration, concurrency: usize) -> anyhow::Result<Self> {
        let server = NatsServer::start().await?;
        let bus = server.provisioned_bus().await?;
        let llm = OpenAiServer::start().await?;
        let mut agents = BTreeMap::new();
        // An LLM agent: its replies stream in, its tool calls and usage are events.
        agents.insert(
            "analyst".to_owned(),
            serde_json::from_value(serde_json::json!({
                "kind": "llm",
                "base-url": llm.base_url(),
                "model": "scripted-model",
                "tools": ["workspace_write"],
            }))?,
        );
        agents.insert(
            "writer".to_owned(),
            AgentDefinition::Scripted(ScriptedConfig {
                reply: "{task_id} done".into(),
                delay,
                tokens: 42,
                ..ScriptedConfig::default()
            }),
        );
        agents.insert(
            "checker".to_owned(),
            AgentDefinition::Scripted(ScriptedConfig {
                reply: "checked".into(),
                delay,
                ..ScriptedConfig::default()
            }),
        );
        // A parallel workflow: each of its steps is a child run (the tree has children).
        let workflows: BTreeMap<String, AgentDefinition> = [(
            "survey".to_owned(),
            serde_json::from_value(serde_json::json!({
                "kind": "parallel",
                "sub-agents": ["writer", "checker"],
            }))?,
        )]
        .into();
        let context = ValidationContext {
            pools: Some(["default".to_owned()].into()),
            agents: Some(AgentCatalog {
                names: agents.keys().chain(workflows.keys()).cloned().collect(),
                default: Some("writer".into()),
                workflows: workflows.keys().cloned().collect(),
                roles: Default::default(),
                compensations: Default::default(),
            }),
            ..ValidationContext::default()
        };
        let shutdown = CancellationToken::new();
        let mut services = JoinSet::new();
        let c = Coordinator::new(
            server.bus().await?,
            CoordinatorOptions::default(),
            context.clone(),
            JetStreamOptions::default(),
        );
        let token = shutdown.clone();
        services.spawn(async move {
            if let Err(e) = c.run(token).await {
                panic!("coordinator failed: {e}");
            }
        });
        let registry =
            AgentRegistry::from_definitions(&agents, Some("writer".into()), Path::new("."))
                .map_err(anyhow::Error::msg)?;
        let w = Worker::new(
            server.bus().await?,
            WorkerOptions {
                started_event_delay: Duration::ZERO,
                concurrency,
                ..WorkerOptions::default()
            },
            registry,
        );
        let token = shutdown.clone();
        services.spawn(async move {
            if let Err(e) = w.run(token).await {
                panic!("worker failed: {e}");
            }
        });
        // The coordinator's embedded worker of the workflow pool, as `flotilla coordinator` runs it.
        let wf = Worker::new(
            server.bus().await?,
            WorkerOptions {
                pool: flotilla_model::subjects::WORKFLOW_POOL.to_owned(),
                concurrency: 64,
                started_event_delay: Duration::ZERO,
                ..WorkerOptions::default()
            },
            AgentRegistry::workflows(&agents.clone().into_iter().chain(workflows).collect())
                .map_err(anyhow::Error::msg)?,
        );
        let token = shutdown.clone();
        services.spawn(async move {
            if let Err(e) = wf.run(token).await {
                panic!("workflow worker failed: {e}");
            }
        });
        let mut cards = BTreeMap::new();
        cards.insert(
            "writer".to_owned(),
            MemberCard {
                roles: vec!["writer".into()],
                description: Some("Writes and publishes the report".into()),
                ..MemberCard::default()
            },
        );
        let s = Supervisor::new(
            server.bus().await?,
            SupervisorOptions::default(),
            cards,
            Duration::from_secs(5),
        )
        .with_validation(context);
        let (ready, supervisor_ready) = tokio::sync::oneshot::channel();
        let s = s.on_ready(ready);
        let token = shutdown.clone();
        services.spawn(async move {
            if let Err(e) = s.run(token).await {
                panic!("supervisor failed: {e}");
            }
        });
        wait_for_api(&bus).await?;
        // The team API answers once the supervisor is ready.
        tokio::time::timeout(Duration::from_secs(30), supervisor_ready).await??;
        let mut opts = ConsoleOptions::default();
        opts.tokens.insert("alice".into(), ALICE.into());
        opts.tokens.insert("bob".into(), BOB.into());
        opts.operators = vec!["alice".into()];
        let console = Console::bind_to(server.bus().await?, "127.0.0.1:0".parse()?, opts).await?;
        let addr = console.local_addr();
        let token = shutdown.clone();
        services.spawn(async move {
            if let Err(e) = console.serve(token).await {
                panic!("console failed: {e}");
            }
        });
        Ok(Self {
            client: Client::new(bus),
            server,
            llm,
            console: addr,
            shutdown,
            services,
        })
    }

    /// Submits [`plan`], with the analyst's model replies scripted: a tool call, then a
    /// reply streamed in small chunks, with its token usage.
    async fn submit_plan(&self) -> anyhow::Result<flotilla_model::RunId> {
        self.llm.push(
            Reply::tool_call(
                "workspace_write",
                serde_json::json!({"topic": "figures", "entry": {"revenue": 1250}}),
            )
            .usage(90, 12)
            .when("Your task (research)"),
        );
        self.llm.push(
            Reply::text("Revenue was 1250 this quarter, up 6.7% on the last one.")
                .chunk_delay(Duration::from_millis(30))
                .usage(120, 18)
                .when("Your task (research)"),
        );
        Ok(self.client.submit(SubmitRequest::new(plan())).await?)
    }

    /// Another console on the same deployment, with `opts`, on a free loopback port.
    async fn console_with(&mut self, opts: ConsoleOptions) -> anyhow::Result<SocketAddr> {
        let console =
            Console::bind_to(self.server.bus().await?, "127.0.0.1:0".parse()?, opts).await?;
        let addr = console.local_addr();
        let token = self.shutdown.clone();
        self.services.spawn(async move {
            if let Err(e) = console.serve(token).await {
                panic!("console failed: {e}");
            }
        });
        Ok(addr)
    }

    async fn stop(mut self) {
        self.shutdown.cancel();
        while self.services.join_next().await.is_some() {}
    }
}

/// Waits until a coordinator answers the micro-service ping.
async fn wait_for_api(bus: &Bus) -> anyhow::Result<()> {
    let subject = format!("$SRV.PING.{}", bus.names().service());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(Ok(_)) = tokio::time::timeout(
            Duration::from_millis(500),
            bus.client().request(subject.clone(), "".into()),
        )
        .await
        {
            return Ok(());
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "no coordinator");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A plan whose `publish` task waits for a person's approval (the default HITL policy
/// makes the `publish` action sensitive).
fn plan() -> Plan {
    let mut publish = Subtask::new("publish", "publish the report").after(&["draft"]);
    publish.action = Some("publish".into());
    publish.input = serde_json::json!({"channel": "news"});
    Plan {
        name: Some("quarterly-report".into()),
        query: Some("write and publish the quarterly report".into()),
        subtasks: vec![
            {
                let mut research =
                    Subtask::new("research", "Gather the quarter's figures.").with_agent("analyst");
                research.produces = vec!["figures".into()];
                research
            },
            {
                let mut survey = Subtask::new("survey", "ask around");
                survey.agent = Some("survey".into());
                survey
            },
            Subtask::new("draft", "write the report").after(&["research", "survey"]),
            publish,
            Subtask::new("announce", "tell people").after(&["publish"]),
        ],
        config: PlanConfig::default(),
    }
}

/// One HTTP/1.1 request: the status and the body. `Host` is the address unless `headers`
/// name one.
async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> anyhow::Result<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let mut req = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    let body = body.unwrap_or_default();
    if method == "POST" {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).await?;
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_string(&mut out)).await??;
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b)
        .unwrap_or_default();
    Ok((status, body.to_owned()))
}

/// The pending approvals of `run`, once there are some.
async fn pending(client: &Client, run: flotilla_model::RunId) -> anyhow::Result<Vec<String>> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let l = client
            .request(
                &ApprovalListRequest {
                    protocol: flotilla_model::PROTOCOL_VERSION,
                    run_id: Some(run),
                    all: false,
                    limit: None,
                },
                Duration::from_secs(10),
            )
            .await?;
        if !l.approvals.is_empty() {
            return Ok(l
                .approvals
                .iter()
                .map(|a| a.request.approval_id.clone())
                .collect());
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "no approval");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn the_api_needs_an_identity_and_only_operators_act() -> anyhow::Result<()> {
    let mut f = Fixture::start().await?;
    let addr = f.console;
    let alice = format!("Bearer {ALICE}");
    let bob = format!("Bearer {BOB}");
    // No identity: refused; the page itself loads (it says to sign in).
    assert_eq!(http(addr, "GET", "/api/runs", &[], None).await?.0, 401);
    assert_eq!(http(addr, "GET", "/", &[], None).await?.0, 200);
    assert_eq!(http(addr, "GET", "/?token=wrong", &[], None).await?.0, 401);
    let (code, me) = http(addr, "GET", "/api/me", &[("Authorization", &bob)], None).await?;
    assert_eq!(code, 200);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&me)?,
        serde_json::json!({"name": "bob", "operator": false})
    );

    let run = f.submit_plan().await?;
    let ids = pending(&f.client, run).await?;
    let path = format!("/api/approvals/{run}/{}", ids[0]);
    let approve = r#"{"decision":"approve","comment":"ok"}"#;
    // The run is listed.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let (code, body) = http(addr, "GET", "/api/runs", &[("Authorization", &bob)], None).await?;
        assert_eq!(code, 200);
        if body.contains(&run.to_string()) {
            break;
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "run not listed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A viewer cannot approve; nor can a cross-site request of an operator.
    let csrf = ("X-Flotilla-Console", "1");
    let (code, body) = http(
        addr,
        "POST",
        &path,
        &[("Authorization", &bob), csrf],
        Some(approve),
    )
    .await?;
    assert_eq!((code, body.contains("not_operator")), (403, true), "{body}");
    let (code, body) = http(
        addr,
        "POST",
        &path,
        &[("Authorization", &alice)],
        Some(approve),
    )
    .await?;
    assert_eq!((code, body.contains("cross_site")), (403, true), "{body}");
    let (code, _) = http(
        addr,
        "POST",
        &path,
        &[
            ("Authorization", &alice),
            csrf,
            ("Origin", "https://evil.example"),
        ],
        Some(approve),
    )
    .await?;
    assert_eq!(code, 403);
    assert_eq!(pending(&f.client, run).await?, ids, "still pending");
    // One task's pause and resume (`run.pause`/`run.resume` with `task_id`): a viewer is
    // refused; the operator's are recorded, `by` her, and the task shows its pause.
    let pause = format!("/api/runs/{run}/pause");
    let resume = format!("/api/runs/{run}/resume");
    let announce = r#"{"task":"announce","reason":"hold it"}"#;
    let (code, body) = http(
        addr,
        "POST",
        &pause,
        &[("Authorization", &bob), csrf],
        Some(announce),
    )
    .await?;
    assert_eq!((code, body.contains("not_operator")), (403, true), "{body}");
    let (code, body) = http(
        addr,
        "POST",
        &pause,
        &[("Authorization", &alice), csrf],
        Some(announce),
    )
    .await?;
    assert_eq!(code, 200, "{body}");
    let reply: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(reply["applied"], true, "{body}");
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let (code, body) = http(
            addr,
            "GET",
            &format!("/api/runs/{run}"),
            &[("Authorization", &bob)],
            None,
        )
        .await?;
        assert_eq!(code, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body)?;
        let tasks = v["view"]["tasks"].as_array().cloned().unwrap_or_default();
        if tasks
            .iter()
            .any(|t| t["task_id"] == "announce" && t["paused_until"].is_string())
        {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "no paused_until: {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (code, body) = http(
        addr,
        "POST",
        &resume,
        &[("Authorization", &alice), csrf],
        Some(r#"{"task":"announce"}"#),
    )
    .await?;
    assert_eq!(code, 200, "{body}");
    let reply: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(reply["applied"], true, "{body}");
    let (_, audit) = http(addr, "GET", "/api/audit", &[("Authorization", &bob)], None).await?;
    let audit: serde_json::Value = serde_json::from_str(&audit)?;
    assert_eq!(
        (
            audit[0]["by"].as_str(),
            audit[0]["action"].as_str(),
            audit[0]["target"].as_str(),
            audit[0]["outcome"].as_str()
        ),
        (
            Some("alice"),
            Some("resume"),
            Some("announce"),
            Some("done")
        ),
        "{audit}"
    );
    let store = flotilla_client::open_store(&f.server.bus().await?).await?;
    let controls: Vec<(ControlAction, Option<String>, Option<String>)> = store
        .history(run)
        .await?
        .into_iter()
        .filter_map(|(_, _, e)| match e.input {
            RunInput::Control(c) => {
                Some((c.action, c.by, c.task_id.map(|t| t.as_str().to_owned())))
            }
            _ => None,
        })
        .collect();
    let announce = Some("announce".to_owned());
    let alice_by = Some("alice".to_owned());
    assert_eq!(
        controls,
        vec![
            (ControlAction::Pause, alice_by.clone(), announce.clone()),
            (ControlAction::Resume, alice_by, announce),
        ]
    );
    // The operator's answer is the API's, recorded as hers, and audited.
    let (code, body) = http(
        addr,
        "POST",
        &path,
        &[("Authorization", &alice), csrf],
        Some(approve),
    )
    .await?;
    assert_eq!(code, 200, "{body}");
    let reply: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(reply["outcome"], "decided");
    assert_eq!(reply["record"]["answer"]["by"], "alice");
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded);
    let (_, audit) = http(addr, "GET", "/api/audit", &[("Authorization", &bob)], None).await?;
    let audit: serde_json::Value = serde_json::from_str(&audit)?;
    assert_eq!(audit[0]["by"], "alice");
    assert_eq!(audit[0]["action"], "approval.approve");
    assert_eq!(audit[0]["outcome"], "done");
    // Controls are operators' too.
    let control = format!("/api/runs/{run}/pause");
    let (code, _) = http(
        addr,
        "POST",
        &control,
        &[("Authorization", &bob), csrf],
        Some("{}"),
    )
    .await?;
    assert_eq!(code, 403);
    // An operator's pause is the API's `run.pause` (the run has ended: nothing changes).
    let (code, body) = http(
        addr,
        "POST",
        &control,
        &[("Authorization", &alice), csrf],
        Some(r#"{"reason":"checking"}"#),
    )
    .await?;
    assert_eq!(code, 200, "{body}");
    let reply: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(
        (reply["status"].as_str(), reply["applied"].as_bool()),
        (Some("succeeded"), Some(false)),
        "{body}"
    );
    let (_, audit) = http(addr, "GET", "/api/audit", &[("Authorization", &bob)], None).await?;
    let audit: serde_json::Value = serde_json::from_str(&audit)?;
    assert_eq!(
        (audit[0]["by"].as_str(), audit[0]["action"].as_str()),
        (Some("alice"), Some("pause"))
    );
    // The list's agent, tokens and cost of a run.
    let (code, body) = http(
        addr,
        "GET",
        &format!("/api/runs/summaries?ids={run}"),
        &[("Authorization", &bob)],
        None,
    )
    .await?;
    let sums: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(code, 200, "{body}");
    // The analyst's two model calls, as its usage events say.
    assert_eq!(sums[run.to_string()]["usage"]["calls"], 2, "{body}");
    assert_eq!(
        sums[run.to_string()]["usage"]["prompt_tokens"],
        210,
        "{body}"
    );
    // The tree, the workers and the team answer.
    for p in [
        format!("/api/runs/{run}/tree"),
        format!("/api/runs/{run}"),
        "/api/workers".to_owned(),
        "/api/team".to_owned(),
    ] {
        let (code, body) = http(addr, "GET", &p, &[("Authorization", &bob)], None).await?;
        assert_eq!(code, 200, "{p}: {body}");
    }

    // The proxy identity header counts only on connections from `trusted-proxies`: this
    // test connects from 127.0.0.1, a proxy to the second console, not to the first.
    let proxied = |trusted: &str| {
        let mut opts = ConsoleOptions {
            identity_header: Some("X-Forwarded-User".into()),
            trusted_proxies: vec![trusted.parse().expect("a network")],
            operators: vec!["alice".into()],
            ..ConsoleOptions::default()
        };
        opts.tokens.insert("bob".into(), BOB.into());
        opts
    };
    let around = f.console_with(proxied("192.0.2.0/24")).await?;
    let through = f.console_with(proxied("127.0.0.1")).await?;
    let as_alice = ("X-Forwarded-User", "alice");
    let (code, body) = http(around, "GET", "/api/me", &[as_alice], None).await?;
    assert_eq!(
        (code, body.contains("unauthenticated")),
        (401, true),
        "{body}"
    );
    let (code, _) = http(around, "GET", "/api/runs", &[as_alice], None).await?;
    assert_eq!(code, 401);
    let (code, body) = http(
        around,
        "POST",
        &control,
        &[as_alice, csrf],
        Some(r#"{"reason":"as alice"}"#),
    )
    .await?;
    assert_eq!(code, 401, "{body}");
    // A token still signs in there; the header does not turn bob into alice.
    let (code, me) = http(
        around,
        "GET",
        "/api/me",
        &[as_alice, ("Authorization", &bob)],
        None,
    )
    .await?;
    assert_eq!((code, me.contains(r#""name":"bob""#)), (200, true), "{me}");
    let (code, me) = http(through, "GET", "/api/me", &[as_alice], None).await?;
    assert_eq!(code, 200, "{me}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&me)?,
        serde_json::json!({"name": "alice", "operator": true})
    );

    // Local mode (no tokens, no proxy: everyone is `local`, an operator) answers only
    // requests addressed to localhost or a loopback address: a DNS-rebinding page
    // (evil.test resolved to 127.0.0.1) is refused, reads and actions alike.
    let local = f.console_with(ConsoleOptions::default()).await?;
    let port = local.port();
    let evil = format!("evil.test:{port}");
    let origin = format!("http://{evil}");
    for (method, path, headers, body) in [
        ("GET", "/api/me", vec![("Host", evil.as_str())], None),
        ("GET", "/api/runs", vec![("Host", evil.as_str())], None),
        ("GET", "/", vec![("Host", evil.as_str())], None),
        (
            "POST",
            control.as_str(),
            vec![("Host", evil.as_str()), csrf, ("Origin", origin.as_str())],
            Some("{}"),
        ),
    ] {
        let (code, answer) = http(local, method, path, &headers, body).await?;
        assert_eq!(
            (code, answer.contains("bad_host")),
            (403, true),
            "{method} {path}: {answer}"
        );
    }
    let localhost = format!("localhost:{port}");
    for host in [local.to_string(), localhost] {
        let (code, me) = http(local, "GET", "/api/me", &[("Host", &host)], None).await?;
        assert_eq!(code, 200, "{host}: {me}");
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&me)?,
            serde_json::json!({"name": "local", "operator": true})
        );
    }
    f.stop().await;
    Ok(())
}

/// Where the browser tests live.
fn browser_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("browser")
}

/// Chromium, when installed: `$FLOTILLA_CHROMIUM`, else `chromium` or
/// `chromium-browser` on the PATH.
fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("FLOTILLA_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|d| [d.join("chromium"), d.join("chromium-browser")])
        .find(|p| p.is_file())
}

/// Why the browser test cannot run here, if it cannot.
fn browser_missing() -> Option<String> {
    if chromium().is_none() {
        return Some("no chromium on the PATH (scripts/ensure-browser.sh installs it)".into());
    }
    if std::process::Command::new("node")
        .arg("--version")
        .output()
        .is_err()
    {
        return Some("no node on the PATH".into());
    }
    if !browser_dir().join("node_modules/playwright-core").is_dir() {
        return Some(format!(
            "playwright-core is not installed in {} (scripts/ensure-browser.sh runs npm ci there)",
            browser_dir().display()
        ));
    }
    None
}

#[tokio::test]
async fn in_a_real_browser() -> anyhow::Result<()> {
    if let Some(why) = browser_missing() {
        eprintln!("SKIPPED: the console's browser test cannot run: {why}");
        return Ok(());
    }
    let f = Fixture::start().await?;
    let shots = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/screenshots");
    std::fs::create_dir_all(&shots)?;
    let mut node = tokio::process::Command::new("node")
        .arg(browser_dir().join("console.mjs"))
        .env("CONSOLE_URL", format!("http://{}", f.console))
        .env("ALICE_TOKEN", ALICE)
        .env("BOB_TOKEN", BOB)
        .env("CHROMIUM", chromium().unwrap_or_default())
        .env("SCREENSHOTS", &shots)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut stdin = node.stdin.take().expect("piped");
    let mut lines = BufReader::new(node.stdout.take().expect("piped")).lines();
    let mut run = None;
    // The script says what it waits for; this side submits when asked.
    let finished = tokio::time::timeout(Duration::from_secs(240), async {
        while let Some(line) = lines.next_line().await? {
            eprintln!("browser: {line}");
            if line == "SUBMIT" {
                let id = f.submit_plan().await?;
                run = Some(id);
                stdin.write_all(format!("{id}\n").as_bytes()).await?;
                stdin.flush().await?;
            }
        }
        anyhow::Ok(())
    })
    .await;
    let status = node.wait().await?;
    finished??;
    anyhow::ensure!(status.success(), "the browser test failed: {status}");
    // What the page did is what the deployment recorded: approved by alice, run succeeded.
    let run = run.expect("the script asked for a run");
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded);
    let all = f
        .client
        .request(
            &ApprovalListRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                run_id: Some(run),
                all: true,
                limit: None,
            },
            Duration::from_secs(10),
        )
        .await?;
    let answer = all.approvals[0].answer.as_ref().expect("answered");
    assert_eq!(answer.by, "alice");
    assert_eq!(answer.comment.as_deref(), Some("checked in the console"));
    f.stop().await;
    Ok(())
}

/// The p-th percentile of sorted `v`.
fn percentile(v: &[u64], p: f64) -> u64 {
    if v.is_empty() {
        return 0;
    }
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

/// This process's resident memory in KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|n| n.parse().ok()))
        })
        .unwrap_or(0)
}

/// Figures for docs/console.md, printed, not asserted (beyond the page working): the runs
/// page with 10,000 runs, event stored → visible in the page against `Client::watch` in the
/// same run, and the memory of 100 open pages' streams. `cargo test -p flotilla-console
/// --test console -- --ignored --nocapture measurements` (CONSOLE_RUNS sets the run count).
#[tokio::test]
#[ignore = "a measurement: minutes of work, run on demand"]
async fn measurements() -> anyhow::Result<()> {
    use futures::StreamExt;
    if let Some(why) = browser_missing() {
        eprintln!("SKIPPED: {why}");
        return Ok(());
    }
    let runs: usize = std::env::var("CONSOLE_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let f = Fixture::start_with(Duration::ZERO, 64).await?;
    let alice = format!("Bearer {ALICE}");
    // First, on a fresh process: the memory 100 open pages' streams take.
    // 100 open pages: each holds the runs stream, the inbox stream and a run's events.
    let waiting = f.submit_plan().await?;
    pending(&f.client, waiting).await?;
    let before = rss_kib();
    let mut held = Vec::new();
    let mut by_kind = Vec::new();
    for path in [
        "/api/runs/stream".to_owned(),
        "/api/inbox/stream".to_owned(),
        format!("/api/runs/{waiting}/events?profile=user&children=linked"),
    ] {
        let at = rss_kib();
        for _ in 0..100 {
            let mut s = tokio::net::TcpStream::connect(f.console).await?;
            s.write_all(
                format!(
                    "GET {path} HTTP/1.1\r\nHost: {}\r\nAuthorization: {alice}\r\nAccept: text/event-stream\r\n\r\n",
                    f.console
                )
                .as_bytes(),
            )
            .await?;
            // Open: the answer's head has arrived.
            let mut head = [0u8; 12];
            s.read_exact(&mut head).await?;
            anyhow::ensure!(head.starts_with(b"HTTP/1.1 200"), "{path}: {head:?}");
            held.push(s);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        by_kind.push(format!(
            "{}: +{} KiB",
            path.split('?').next().unwrap_or_default(),
            rss_kib().saturating_sub(at)
        ));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = rss_kib();
    eprintln!("100 streams each: {}", by_kind.join(", "));
    eprintln!(
        "100 open pages (300 SSE streams, 100 projections): RSS of the test process {} MiB → {} MiB (+{} MiB)",
        before / 1024,
        after / 1024,
        after.saturating_sub(before) / 1024
    );
    drop(held);
    // Many runs: one task each, submitted 64 at a time.
    let started = std::time::Instant::now();
    let one = Plan {
        name: Some("bulk".into()),
        query: None,
        subtasks: vec![Subtask::new("only", "one step")],
        config: PlanConfig::default(),
    };
    futures::stream::iter(0..runs)
        .map(|_| {
            let c = f.client.clone();
            let p = one.clone();
            async move { c.submit(SubmitRequest::new(p)).await }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(900);
    loop {
        let (_, body) = http(
            f.console,
            "GET",
            "/api/runs?status=succeeded&limit=1",
            &[("Authorization", &alice)],
            None,
        )
        .await?;
        let page: serde_json::Value = serde_json::from_str(&body)?;
        if page["total"].as_u64().unwrap_or(0) >= runs as u64 {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "runs did not finish"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!(
        "{runs} runs submitted and finished in {:?}",
        started.elapsed()
    );
    let t = std::time::Instant::now();
    let (_, body) = http(
        f.console,
        "GET",
        "/api/runs?limit=500",
        &[("Authorization", &alice)],
        None,
    )
    .await?;
    eprintln!(
        "GET /api/runs?limit=500 over {runs} runs: {:?}, {} bytes",
        t.elapsed(),
        body.len()
    );

    // A fan-out behind an approval: the page and a `Client::watch` follow it from the start.
    let mut tasks = vec![{
        let mut gate = Subtask::new("gate", "publish the plan");
        gate.action = Some("publish".into());
        gate
    }];
    for i in 0..200 {
        tasks.push(Subtask::new(&format!("t{i}"), "work").after(&["gate"]));
    }
    let fan = Plan {
        name: Some("fan-out".into()),
        query: None,
        subtasks: tasks,
        config: PlanConfig::default(),
    };
    let run = f.client.submit(SubmitRequest::new(fan)).await?;
    let gate = pending(&f.client, run).await?;
    let mut node = tokio::process::Command::new("node")
        .arg(browser_dir().join("measure.mjs"))
        .env("CONSOLE_URL", format!("http://{}", f.console))
        .env("ALICE_TOKEN", ALICE)
        .env("RUNS", runs.to_string())
        .env("CHROMIUM", chromium().unwrap_or_default())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut stdin = node.stdin.take().expect("piped");
    let mut lines = BufReader::new(node.stdout.take().expect("piped")).lines();
    let mut result = None;
    let mut watch_lags: Vec<u64> = Vec::new();
    while let Some(line) = lines.next_line().await? {
        if line == "OPEN" {
            stdin.write_all(format!("{run}\n").as_bytes()).await?;
        } else if line == "GO" {
            let stream = f
                .client
                .watch(
                    run,
                    flotilla_client::WatchOptions {
                        profile: flotilla_model::watch::Profile::Debug,
                        children: flotilla_model::watch::ChildPolicy::Linked,
                        since: 0,
                        since_index: None,
                    },
                )
                .await?;
            let answer = r#"{"decision":"approve","comment":"measure"}"#;
            http(
                f.console,
                "POST",
                &format!("/api/approvals/{run}/{}", gate[0]),
                &[("Authorization", &alice), ("X-Flotilla-Console", "1")],
                Some(answer),
            )
            .await?;
            futures::pin_mut!(stream);
            let approved_at = flotilla_model::time::Timestamp::now().0;
            while let Some(e) = stream.next().await {
                let e = e?;
                // Only events stored after the page and this watch were following.
                if e.event.ts.0 < approved_at {
                    continue;
                }
                let lag = (flotilla_model::time::Timestamp::now().0 - e.event.ts.0)
                    .whole_milliseconds()
                    .max(0) as u64;
                watch_lags.push(lag);
            }
            stdin.write_all(b"done\n").await?;
        } else if let Some(json) = line.strip_prefix("RESULT ") {
            result = Some(serde_json::from_str::<serde_json::Value>(json)?);
        } else {
            eprintln!("browser: {line}");
        }
    }
    anyhow::ensure!(
        node.wait().await?.success(),
        "the measurement script failed"
    );
    let result = result.expect("a result");
    let mut page_lags: Vec<u64> = result["page_lags_ms"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_u64()).collect())
        .unwrap_or_default();
    page_lags.sort_unstable();
    // The page also shows the events stored before it opened: compare the same tail.
    let n = watch_lags.len().min(page_lags.len());
    watch_lags.sort_unstable();
    eprintln!(
        "runs page, {runs} runs: first rows {} ms, scroll to the end {} ms, {} rows in the DOM, next frame {} ms",
        result["runs_first_rows_ms"],
        result["runs_scroll_to_end_ms"],
        result["runs_dom_rows"],
        result["runs_next_frame_ms"]
    );
    eprintln!(
        "event stored → visible (debug profile, {} events): page p50 {} ms p99 {} ms; flotilla watch (Client::watch) p50 {} ms p99 {} ms",
        n,
        percentile(&page_lags[page_lags.len() - n..], 0.5),
        percentile(&page_lags[page_lags.len() - n..], 0.99),
        percentile(&watch_lags, 0.5),
        percentile(&watch_lags, 0.99)
    );

    f.stop().await;
    Ok(())
}
