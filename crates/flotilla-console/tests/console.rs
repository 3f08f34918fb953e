//! The console against real services on a real nats-server: a coordinator, a worker of
//! deterministic scripted agents and a supervisor in this process, the console on a free
//! loopback port. `the_api_*` tests speak HTTP; `in_a_real_browser` drives headless
//! Chromium through `browser/console.mjs` (Playwright's protocol client, `playwright-core`)
//! and writes the screenshots of `docs/screenshots/`. Without a browser it says why and
//! passes (install one with `scripts/ensure-browser.sh`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
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
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

#[path = "support/browser.rs"]
mod browser;
use browser::{browser_dir, browser_missing, chromium};

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
        // A task a worker runs for long (until its run is cancelled): it reads `running`.
        agents.insert(
            "slow".to_owned(),
            AgentDefinition::Scripted(ScriptedConfig {
                reply: "crunched".into(),
                delay: Duration::from_secs(300),
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
        fork: None,
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

/// `publish` (a sensitive action, so it waits for a person) then `announce`, in a new
/// session; `announce` only with `announce`.
fn gated_in_a_session(announce: bool) -> SubmitRequest {
    let mut publish = Subtask::new("publish", "publish the report");
    publish.action = Some("publish".into());
    let mut subtasks = vec![publish];
    if announce {
        subtasks.push(Subtask::new("announce", "tell people").after(&["publish"]));
    }
    let mut req = SubmitRequest::new(Plan {
        fork: None,
        name: Some("by-hand".into()),
        query: None,
        subtasks,
        config: PlanConfig::default(),
    });
    req.session_id = Some(flotilla_model::SessionId::new());
    req
}

/// One HTTP/1.1 request to `addr`: the status and the body (the test kit's).
async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> anyhow::Result<(u16, String)> {
    Ok(flotilla_testkit::http::request(&addr.to_string(), method, path, headers, body).await?)
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

/// The `event` frames of a server-sent event stream: their ids and the projected events.
fn sse_events(body: &str) -> Vec<(String, serde_json::Value)> {
    body.split("\n\n")
        .filter_map(|frame| {
            let field = |name: &str| {
                frame
                    .lines()
                    .find_map(|l| l.strip_prefix(name).map(str::trim_start))
            };
            (field("event:")? == "event").then_some(())?;
            let data = serde_json::from_str(field("data:")?).ok()?;
            Some((field("id:")?.to_owned(), data))
        })
        .collect()
}

/// A browser that reconnects to a run's events (`Last-Event-ID`: the `<seq>.<index>` id of
/// the last event it got) is given exactly the events after that one — the rest of its
/// message too, when one message held several — and none twice; so is a page that asks
/// with `since` and `since_index`.
#[tokio::test]
async fn the_api_resumes_a_runs_events_inside_a_message() -> anyhow::Result<()> {
    let f = Fixture::start().await?;
    let bob = format!("Bearer {BOB}");
    let run = f
        .client
        .submit(SubmitRequest::new(Plan {
            fork: None,
            name: None,
            query: None,
            subtasks: vec![
                Subtask::new("one", "write"),
                Subtask::new("two", "write").after(&["one"]),
            ],
            config: PlanConfig::default(),
        }))
        .await?;
    let outcome = f.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let path = format!("/api/runs/{run}/events?profile=debug");
    let (code, body) = http(f.console, "GET", &path, &[("Authorization", &bob)], None).await?;
    assert_eq!(code, 200, "{body}");
    let all = sse_events(&body);
    // The last step's message holds the last task's success and the run's end.
    let seq = |id: &str| id.split('.').next().unwrap_or_default().to_owned();
    let at = all
        .iter()
        .position(|(id, _)| seq(id) == seq(&all[all.len() - 1].0))
        .expect("the last message");
    assert!(
        at + 1 < all.len(),
        "one message holds several events: {all:?}"
    );
    let (id, _) = &all[at];
    let (index, message) = (id.split('.').nth(1).unwrap_or_default().to_owned(), seq(id));
    for (path, headers) in [
        (
            path.clone(),
            vec![
                ("Authorization", bob.as_str()),
                ("Last-Event-ID", id.as_str()),
            ],
        ),
        (
            format!("{path}&since={message}&since_index={index}"),
            vec![("Authorization", bob.as_str())],
        ),
    ] {
        let (code, body) = http(f.console, "GET", &path, &headers, None).await?;
        assert_eq!(code, 200, "{body}");
        assert_eq!(
            sse_events(&body),
            all[at + 1..].to_vec(),
            "{path} {headers:?}"
        );
    }
    f.stop().await;
    Ok(())
}

/// GETs `path` as bob (a viewer) until `done` holds of its JSON answer; the last answer.
async fn poll(
    addr: SocketAddr,
    path: &str,
    what: &str,
    done: impl Fn(&serde_json::Value) -> bool,
) -> anyhow::Result<serde_json::Value> {
    let bob = format!("Bearer {BOB}");
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let (code, body) = http(addr, "GET", path, &[("Authorization", &bob)], None).await?;
        anyhow::ensure!(code == 200, "{path}: {code} {body}");
        let v: serde_json::Value = serde_json::from_str(&body)?;
        if done(&v) {
            return Ok(v);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{path}: never {what}: {v:#}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What a person reads of a run, through the console's API (the labels `flotilla runs show`
/// prints): on a worker of one slot, of two tasks the one a worker started reads `running`,
/// with its worker, and the other `dispatched` (queued) until the worker takes it; a run
/// whose task waits for an approval reads `waiting`, with what it waits for and the command
/// that answers — on its page and in the runs list (`status=waiting` finds it), and the inbox
/// names its run by plan name. A task's panel has its input, result, worker, attempts and
/// events; the timeline lays the tasks out in time. Runs' short ids are their last digits;
/// the favicon answers. Real services; the agents are scripted (deterministic) and take 2 s.
#[tokio::test]
async fn the_api_says_what_a_run_waits_for_and_what_runs() -> anyhow::Result<()> {
    let f = Fixture::start_with(Duration::from_secs(2), 1).await?;
    let addr = f.console;
    let mut one = Subtask::new("one", "write the first part").with_agent("writer");
    one.input = serde_json::json!({"part": 1});
    let run = f
        .client
        .submit(SubmitRequest::new(Plan {
            fork: None,
            name: Some("two-parts".into()),
            query: None,
            subtasks: vec![one, Subtask::new("two", "check").with_agent("checker")],
            config: PlanConfig::default(),
        }))
        .await?;
    let page = format!("/api/runs/{run}");
    let v = poll(addr, &page, "one task running, one queued", |v| {
        let l = &v["task_labels"];
        let running: Vec<_> = ["one", "two"]
            .into_iter()
            .filter(|t| l[*t] == "running")
            .collect();
        running.len() == 1
            && ["one", "two"]
                .iter()
                .any(|t| l[*t] == "dispatched" && v["progress"]["running"][*t].is_null())
    })
    .await?;
    assert_eq!(v["label"], "running", "{v:#}");
    let (task, activity) = v["progress"]["running"]
        .as_object()
        .and_then(|m| m.iter().next())
        .expect("a running task");
    let worker = activity["worker"].as_str().unwrap_or_default().to_owned();
    assert!(!worker.is_empty(), "{v:#}");
    assert!(
        activity["started_at"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z'))
    );
    // The running task's timeline: queued, then started on that worker, not ended.
    let line = v["timeline"]["tasks"]
        .as_array()
        .and_then(|t| t.iter().find(|l| l["task_id"] == task.as_str()))
        .expect("a line");
    assert!(line["queued_at"].is_string(), "{line:#}");
    assert_eq!(line["attempts"][0]["worker"], worker.as_str(), "{line:#}");
    assert_eq!(line["attempts"][0]["outcome"], "running", "{line:#}");
    assert_eq!(f.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);

    // The run ended: its timeline has each attempt from start to end, one after the other
    // (one slot), and a task's panel has what the plan asked, what came back and its events.
    let v = poll(addr, &page, "ended", |v| v["label"] == "succeeded").await?;
    let lines = v["timeline"]["tasks"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    // Instants, not their text: the stamps have as many fraction digits as they need
    // ("…26.18Z" is before "…26.1817Z", though not as text).
    let span = |i: usize, at: &str| {
        let text = lines[i]["attempts"][0][at].as_str().unwrap_or_default();
        time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)
            .unwrap_or_else(|e| panic!("{at} of line {i}: {text:?}: {e}"))
    };
    assert_eq!(lines.len(), 2, "{v:#}");
    assert!(
        lines
            .iter()
            .all(|l| l["ended"] == "succeeded" && l["attempts"][0]["outcome"] == "succeeded"),
        "{v:#}"
    );
    let (first, second) = if span(0, "started_at") < span(1, "started_at") {
        (0, 1)
    } else {
        (1, 0)
    };
    assert!(
        span(first, "ended_at") <= span(second, "started_at"),
        "{v:#}"
    );
    let t = poll(
        addr,
        &format!("/api/runs/{run}/tasks/one"),
        "the task",
        |_| true,
    )
    .await?;
    assert_eq!(t["label"], "succeeded", "{t:#}");
    assert_eq!(t["subtask"]["description"], "write the first part", "{t:#}");
    assert_eq!(t["subtask"]["input"]["part"], 1, "{t:#}");
    assert_eq!(t["result"]["result"]["response"], "one done", "{t:#}");
    assert!(
        t["result"]["worker"]
            .as_str()
            .is_some_and(|w| !w.is_empty()),
        "{t:#}"
    );
    assert_eq!(t["task"]["attempts"], 1, "{t:#}");
    assert_eq!(
        t["timeline"]["attempts"][0]["outcome"], "succeeded",
        "{t:#}"
    );
    let phases: Vec<_> = t["events"]
        .as_array()
        .map(|e| {
            e.iter()
                .filter_map(|e| e["event"]["phase"].as_str())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        phases.contains(&"task_started") && phases.contains(&"task_succeeded"),
        "{t:#}"
    );
    let bob = format!("Bearer {BOB}");
    let (code, body) = http(
        addr,
        "GET",
        &format!("/api/runs/{run}/tasks/nope"),
        &[("Authorization", &bob)],
        None,
    )
    .await?;
    assert_eq!((code, body.contains("not_found")), (404, true), "{body}");
    // The runs list names the agents of a run of several tasks.
    let sums = poll(
        addr,
        &format!("/api/runs/summaries?ids={run}"),
        "summarised",
        |v| v[run.to_string()].is_object(),
    )
    .await?;
    assert_eq!(
        sums[run.to_string()]["agent"],
        "writer, checker",
        "{sums:#}"
    );

    // A run waiting for an approval reads `waiting`, with what for and how to answer.
    let gated = f.client.submit(gated_in_a_session(false)).await?;
    let page = format!("/api/runs/{gated}");
    // (Its record says `running`: to the run machine it is.)
    let v = poll(addr, &page, "waiting", |v| {
        v["label"] == "waiting" && v["view"]["record"]["status"] == "running"
    })
    .await?;
    let w = &v["progress"]["waiting"][0];
    assert_eq!(
        (w["kind"].as_str(), w["task_id"].as_str()),
        (Some("approval"), Some("publish")),
        "{v:#}"
    );
    let approval = w["approval_id"].as_str().unwrap_or_default().to_owned();
    assert_eq!(
        w["answer"],
        format!("flotilla approvals approve {gated} {approval} (or reject)"),
        "{v:#}"
    );
    assert_eq!(v["task_labels"]["publish"], "awaiting_approval", "{v:#}");
    let line = &v["timeline"]["tasks"][0];
    assert_eq!(
        (
            line["waits"][0]["kind"].as_str(),
            line["waits"][0]["to"].as_str()
        ),
        (Some("approval"), None),
        "{v:#}"
    );
    // In the runs list too, and the inbox names the run.
    let list = poll(addr, "/api/runs?status=waiting", "listed as waiting", |v| {
        v["runs"]
            .as_array()
            .is_some_and(|r| r.iter().any(|r| r["handle"]["run_id"] == gated.to_string()))
    })
    .await?;
    let row = list["runs"]
        .as_array()
        .and_then(|r| {
            r.iter()
                .find(|r| r["handle"]["run_id"] == gated.to_string())
        })
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        (row["label"].as_str(), row["status"].as_str()),
        (Some("waiting"), Some("running")),
        "{row:#}"
    );
    assert_eq!(
        row["waiting"][0]["approval_id"],
        approval.as_str(),
        "{row:#}"
    );
    assert!(list["counts"]["waiting"].as_u64() >= Some(1), "{list:#}");
    let short = list["short_len"].as_u64().unwrap_or_default();
    assert!(short >= 8, "{list:#}");
    let inbox = poll(addr, "/api/inbox", "names the run", |v| {
        v["names"][gated.to_string()] == "by-hand"
    })
    .await?;
    assert_eq!(
        inbox["approvals"][0]["request"]["task_id"], "publish",
        "{inbox:#}"
    );
    // Answered: the run goes on and ends; the list says so.
    f.client
        .request(
            &flotilla_model::approval::ApprovalAnswerRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                run_id: gated,
                approval_id: approval.clone(),
                decision: flotilla_model::approval::Decision::Approve,
                by: "alice".into(),
                comment: None,
                digest: None,
                always: false,
                incident: false,
            },
            Duration::from_secs(10),
        )
        .await?;
    let v = poll(addr, &page, "ended", |v| v["label"] == "succeeded").await?;
    let wait = &v["timeline"]["tasks"][0]["waits"][0];
    assert!(wait["to"].is_string(), "{v:#}");
    assert!(
        wait["what"].as_str().is_some_and(|w| w.contains("alice")),
        "{v:#}"
    );
    poll(addr, "/api/runs", "listed as succeeded", |v| {
        v["runs"].as_array().is_some_and(|r| {
            r.iter()
                .any(|r| r["handle"]["run_id"] == gated.to_string() && r["label"] == "succeeded")
        })
    })
    .await?;

    // The favicon browsers ask for on every page.
    for path in ["/favicon.ico", "/favicon.svg"] {
        let (code, body) = http(addr, "GET", path, &[], None).await?;
        assert_eq!(
            (code, body.starts_with("<svg")),
            (200, true),
            "{path}: {body}"
        );
    }
    f.stop().await;
    Ok(())
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
    // A fork (`run.fork`) is an operator's, same-site, of a run that has ended.
    let fork = format!("/api/runs/{run}/fork");
    let at_announce = r#"{"at":"announce","agent":"checker"}"#;
    for (who, headers, status, code_is) in [
        (
            "a viewer",
            vec![("Authorization", bob.as_str()), csrf],
            403,
            "not_operator",
        ),
        (
            "cross-site",
            vec![("Authorization", alice.as_str())],
            403,
            "cross_site",
        ),
        (
            "a run going on",
            vec![("Authorization", alice.as_str()), csrf],
            409,
            "run_not_ended",
        ),
    ] {
        let (code, body) = http(addr, "POST", &fork, &headers, Some(at_announce)).await?;
        assert_eq!(
            (code, body.contains(code_is)),
            (status, true),
            "{who}: {body}"
        );
    }
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
    // The ended run forked at `announce` by another agent: an unknown task is the API's 404;
    // the fork keeps the four results upstream, runs `announce` again and says what it forks.
    let (code, body) = http(
        addr,
        "POST",
        &fork,
        &[("Authorization", &alice), csrf],
        Some(r#"{"at":"nope"}"#),
    )
    .await?;
    assert_eq!((code, body.contains("unknown_task")), (404, true), "{body}");
    let step = Some(r#"{"at":"announce","step":0}"#);
    let (code, body) = http(
        addr,
        "POST",
        &fork,
        &[("Authorization", &alice), csrf],
        step,
    )
    .await?;
    assert!(code == 400 && body.contains("only LLM agents"), "{body}"); // the step reached it
    let (code, body) = http(
        addr,
        "POST",
        &fork,
        &[("Authorization", &alice), csrf],
        Some(at_announce),
    )
    .await?;
    assert_eq!(code, 200, "{body}");
    let reply: flotilla_model::fork::RunForkReply = serde_json::from_str(&body)?;
    let forked = reply.run_id.expect("the fork's id");
    assert_eq!(
        (reply.reused.len(), reply.rerun.len(), reply.at.as_str()),
        (4, 1, "announce"),
        "{body}"
    );
    assert_eq!(
        f.client.wait(forked, WAIT).await?.status,
        RunStatus::Succeeded
    );
    let (code, body) = http(
        addr,
        "GET",
        &format!("/api/runs/{forked}"),
        &[("Authorization", &bob)],
        None,
    )
    .await?;
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(
        v["view"]["record"]["fork_of"],
        serde_json::json!({"run_id": run, "task_id": "announce", "reused": 4}),
        "{body}"
    );
    assert_eq!(v["fork_of_name"], "quarterly-report", "{body}");
    let (_, audit) = http(addr, "GET", "/api/audit", &[("Authorization", &bob)], None).await?;
    let audit: serde_json::Value = serde_json::from_str(&audit)?;
    assert_eq!(
        (
            audit[0]["action"].as_str(),
            audit[0]["target"].as_str(),
            audit[0]["outcome"].as_str()
        ),
        (Some("fork"), Some("announce"), Some("done")),
        "{audit}"
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
    // Bad input to the plan edit and the grant revocation: a structured refusal, audited,
    // nothing changed.
    let plan_json = serde_json::to_string(&plan())?;
    for (action, body, status, code_is) in [
        ("edit", "{}".to_owned(), 400, "invalid_control"),
        (
            "revoke",
            r#"{"tool":""}"#.to_owned(),
            400,
            "invalid_control",
        ),
        ("frobnicate", "{}".to_owned(), 404, "unknown_action"),
        // The run was never taken over: its plan is not a person's to edit.
        ("edit", format!(r#"{{"plan":{plan_json}}}"#), 409, ""),
    ] {
        let (code, answer) = http(
            addr,
            "POST",
            &format!("/api/runs/{run}/{action}"),
            &[("Authorization", &alice), csrf],
            Some(&body),
        )
        .await?;
        assert_eq!(code, status, "{action} {body}: {answer}");
        assert!(answer.contains(code_is), "{action}: {answer}");
    }
    // The session state's keys (`state.list`): a key set through the API is listed and
    // readable from the page's API.
    f.client
        .request(
            &flotilla_model::api::StateSetRequest {
                protocol: flotilla_model::PROTOCOL_VERSION,
                run_id: Some(run),
                session_id: None,
                key: "notes".into(),
                value: serde_json::json!({"checked": true}),
                expected_revision: None,
            },
            Duration::from_secs(10),
        )
        .await?;
    let (code, answer) = http(
        addr,
        "GET",
        &format!("/api/runs/{run}/state"),
        &[("Authorization", &bob)],
        None,
    )
    .await?;
    assert_eq!(code, 200, "{answer}");
    let keys: serde_json::Value = serde_json::from_str(&answer)?;
    assert!(
        keys["keys"]
            .as_array()
            .is_some_and(|k| k.iter().any(|k| k == "notes")),
        "{answer}"
    );
    let (code, answer) = http(
        addr,
        "GET",
        &format!("/api/runs/{run}/state/notes"),
        &[("Authorization", &bob)],
        None,
    )
    .await?;
    assert_eq!(code, 200, "{answer}");
    assert!(answer.contains("\"checked\":true"), "{answer}");
    // The run's session has no grants; revoking one it does not have is the API's 404.
    let (code, answer) = http(
        addr,
        "GET",
        &format!("/api/runs/{run}/grants"),
        &[("Authorization", &bob)],
        None,
    )
    .await?;
    assert_eq!(code, 200, "{answer}");
    assert!(answer.contains("\"grants\":[]"), "{answer}");
    let (code, answer) = http(
        addr,
        "POST",
        &format!("/api/runs/{run}/revoke"),
        &[("Authorization", &alice), csrf],
        Some(r#"{"tool":"no_such_tool"}"#),
    )
    .await?;
    assert_eq!(code, 404, "{answer}");
    assert!(answer.contains("not_found"), "{answer}");

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
    let (mut run, mut run2, mut run3) = (None, None, None);
    // The run forked in the page (SUBMIT6) and the fork the page made (FORKED).
    let (mut run6, mut forked) = (None, None);
    let long = || {
        SubmitRequest::new(Plan {
            fork: None,
            name: Some("long-crunch".into()),
            query: None,
            subtasks: vec![Subtask::new("crunch", "crunch the numbers").with_agent("slow")],
            config: PlanConfig::default(),
        })
    };
    // The script says what it waits for; this side submits when asked.
    let finished = tokio::time::timeout(Duration::from_secs(300), async {
        while let Some(line) = lines.next_line().await? {
            eprintln!("browser: {line}");
            let id = match line.as_str() {
                "SUBMIT" => *run.insert(f.submit_plan().await?),
                "SUBMIT2" => *run2.insert(f.client.submit(gated_in_a_session(true)).await?),
                "SUBMIT3" => *run3.insert(f.client.submit(gated_in_a_session(false)).await?),
                "SUBMIT4" => f.client.submit(long()).await?,
                "SUBMIT5" => {
                    // One task run twice, by agents that answer differently.
                    let mut ids = Vec::new();
                    for agent in ["writer", "checker"] {
                        let plan = Plan {
                            fork: None,
                            name: Some("compare".into()),
                            query: None,
                            subtasks: vec![Subtask::new("check", "check it").with_agent(agent)],
                            config: PlanConfig::default(),
                        };
                        let id = f.client.submit(SubmitRequest::new(plan)).await?;
                        assert_eq!(f.client.wait(id, WAIT).await?.status, RunStatus::Succeeded);
                        ids.push(id.to_string());
                    }
                    stdin
                        .write_all(format!("{}\n", ids.join(" ")).as_bytes())
                        .await?;
                    stdin.flush().await?;
                    continue;
                }
                // Two tasks: `review` runs after `draft`, so a fork at `review` keeps `draft`.
                "SUBMIT6" => {
                    let plan = Plan {
                        fork: None,
                        name: Some("draft-review".into()),
                        query: None,
                        subtasks: vec![
                            Subtask::new("draft", "write it").with_agent("writer"),
                            Subtask::new("review", "review it")
                                .with_agent("checker")
                                .after(&["draft"]),
                        ],
                        config: PlanConfig::default(),
                    };
                    let id = f.client.submit(SubmitRequest::new(plan)).await?;
                    assert_eq!(f.client.wait(id, WAIT).await?.status, RunStatus::Succeeded);
                    *run6.insert(id)
                }
                l if l.starts_with("FORKED ") => {
                    forked = Some(l["FORKED ".len()..].parse::<flotilla_model::RunId>()?);
                    continue;
                }
                "CHECK3" => {
                    // The rejection counted as an incident of the writer, recorded as alice's.
                    let deadline = tokio::time::Instant::now() + WAIT;
                    loop {
                        let trust = f
                            .client
                            .request(
                                &flotilla_model::trust::TrustGetRequest {
                                    protocol: flotilla_model::PROTOCOL_VERSION,
                                    scope: flotilla_model::team::RecordScope::Agent,
                                    name: "writer".into(),
                                },
                                Duration::from_secs(10),
                            )
                            .await;
                        if let Ok(t) = &trust
                            && t.incidents >= 1
                            && t.last_incident.as_ref().is_some_and(|i| {
                                i.reason.contains("rejected by alice as an incident")
                            })
                        {
                            break;
                        }
                        anyhow::ensure!(
                            tokio::time::Instant::now() < deadline,
                            "no incident recorded for the writer: {trust:?}"
                        );
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    stdin.write_all(b"ok\n").await?;
                    stdin.flush().await?;
                    continue;
                }
                _ => continue,
            };
            stdin.write_all(format!("{id}\n").as_bytes()).await?;
            stdin.flush().await?;
        }
        anyhow::Ok(())
    })
    .await;
    if !matches!(finished, Ok(Ok(()))) {
        // Timed out or failed here: the script waits for a line that will not come.
        let _ = node.start_kill();
    }
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
    // The second run: taken over, its plan edited, its tasks completed by alice.
    let run2 = run2.expect("the script asked for a second run");
    let view = f.client.run(run2).await?.expect("recorded");
    assert_eq!(view.record.status, RunStatus::Succeeded);
    let history = flotilla_client::open_store(f.client.bus())
        .await?
        .history(run2)
        .await?;
    let by_alice = |want: &str| {
        history.iter().any(|(_, _, e)| {
            let s = serde_json::to_string(e).unwrap_or_default();
            s.contains(want) && s.contains("\"alice\"")
        })
    };
    assert!(by_alice("takeover"), "{history:?}");
    assert!(
        by_alice("tell everyone, edited in the console"),
        "{history:?}"
    );
    assert!(by_alice("announced by hand"), "{history:?}");
    let run3 = run3.expect("the script asked for a third run");
    assert_eq!(f.client.wait(run3, WAIT).await?.status, RunStatus::Failed);
    // The fork made in the page: of the sixth run at `review`, keeping `draft`'s result, its
    // `review` run by the writer with the instructions typed in the form.
    let (run6, forked) = (
        run6.expect("the script asked for a run to fork"),
        forked.expect("the script forked a run"),
    );
    let view = f.client.run(forked).await?.expect("recorded");
    assert_eq!(view.record.status, RunStatus::Succeeded);
    let of = view.record.fork_of.expect("a fork");
    assert_eq!(
        (of.run_id, of.task_id.as_str(), of.reused),
        (run6, "review", 1)
    );
    let plan = flotilla_client::open_store(f.client.bus())
        .await?
        .plan(forked)
        .await?
        .expect("the fork's plan");
    let review = plan
        .subtasks
        .iter()
        .find(|t| t.id.as_str() == "review")
        .expect("review");
    assert_eq!(
        (review.agent.as_deref(), review.description.as_str()),
        (Some("writer"), "review it again, as the writer")
    );
    f.stop().await;
    Ok(())
}

/// A console stopped while pages hold their event streams open (the runs list's, the inbox's)
/// ends those streams and stops: a graceful stop waited for them forever, so every rolling
/// update with a page open ended in a SIGKILL.
#[tokio::test]
async fn a_console_stops_while_pages_hold_event_streams_open() -> anyhow::Result<()> {
    let server = NatsServer::start().await?;
    let bus = server.provisioned_bus().await?;
    let mut opts = ConsoleOptions::default();
    opts.tokens.insert("alice".into(), ALICE.into());
    let console = Console::bind_to(bus, "127.0.0.1:0".parse()?, opts).await?;
    let addr = console.local_addr();
    let stop = CancellationToken::new();
    let serving = tokio::spawn(console.serve(stop.clone()));
    let mut streams = Vec::new();
    for path in ["/api/runs/stream", "/api/inbox/stream"] {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {ALICE}\r\n\r\n")
                .as_bytes(),
        )
        .await?;
        let mut reader = BufReader::new(s);
        let mut status = String::new();
        reader.read_line(&mut status).await?;
        assert!(status.contains("200"), "{path}: {status}");
        streams.push(reader);
    }
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(10), serving)
        .await
        .map_err(|_| anyhow::anyhow!("the console did not stop while streams were open"))???;
    for mut reader in streams {
        // The stream was ended: the connection reaches its end.
        let mut rest = Vec::new();
        tokio::time::timeout(
            Duration::from_secs(5),
            tokio::io::AsyncReadExt::read_to_end(&mut reader, &mut rest),
        )
        .await
        .map_err(|_| anyhow::anyhow!("an event stream stayed open"))??;
    }
    Ok(())
}
