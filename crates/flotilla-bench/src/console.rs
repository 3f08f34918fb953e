//! The web console (`flotilla console`): what the page adds to what the CLI sees, and what
//! the page costs. Services are a coordinator (with its workflow worker), one worker process
//! with the no-op `scripted` agent, and the console, each a child process; the bench reads
//! the console over HTTP like a browser, and drives a real headless Chromium when it can
//! (`--console-browser`, below).
//!
//! * **Lag**: a fan-out of `--console-fan` tasks behind an approval. Once the bench, the page
//!   and a `Client::watch` (the engine of `flotilla watch`) all follow the run, the bench
//!   approves it in the console, and each of them takes, for every event stored after the
//!   approval, its timestamp → the moment it arrived: the console's server-sent events as
//!   they reach an HTTP reader (the service's share), the page's draw (the event handled,
//!   then the next frame: visible), and the watch. Target: the page ≤ 2× the watch, p50.
//! * **Runs list**: `--console-runs` one-task runs; the list API's first page
//!   (`GET /api/runs?limit=500`, filtered, sorted and paged in the console's memory), and in
//!   the page: navigation → first rows, scroll to the end (the last page fetched and drawn),
//!   rows in the DOM (virtualised), the next frame.
//! * **Tree**: a run whose `--console-tree` − 1 tasks each start a child run (a `parallel`
//!   workflow of one step): `GET /api/runs/RUN/tree`, and in the page: navigation → the
//!   tree's first rows, rows in the DOM, scroll to its end.
//! * **Memory**: the console's RSS before and after `--console-pages` open pages, each
//!   holding what a run's page holds: the runs stream, the inbox stream and a run's events.
//!
//! The page figures come from `measure.mjs` (in `crates/flotilla-console/browser`, with
//! `playwright-core` installed by `scripts/ensure-browser.sh`) driving Debian's Chromium; the
//! bench and the script talk over the script's stdin and stdout (`OPEN`, `GO`, `TREE`,
//! `RESULT {json}`). Without node, the script's modules or a Chromium, the page figures are
//! skipped, saying why, and the service's are printed.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use flotilla_client::{Client, WatchOptions};
use flotilla_model::approval::ApprovalListRequest;
use flotilla_model::ids::RunId;
use flotilla_model::plan::{Plan, PlanConfig, Subtask};
use flotilla_model::submit::SubmitRequest;
use flotilla_model::time::Timestamp;
use flotilla_model::watch::{ChildPolicy, Profile};
use futures::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::harness::processes::{Processes, rss_kib};
use crate::harness::services::{Services, section_bus, section_config, spawn_service};
use crate::harness::stats::p50_p99;
use crate::harness::submit::submit_via;

/// `flotilla bench --only console` settings.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ConsoleArgs {
    /// Console: one-task runs in the list (its load and scroll).
    #[arg(long, default_value_t = 10_000)]
    console_runs: usize,
    /// Console: tasks of the fan-out whose events the lag is measured on.
    #[arg(long, default_value_t = 200)]
    console_fan: usize,
    /// Console: runs in the tree measured (the root and its child runs).
    #[arg(long, default_value_t = 1_000)]
    console_tree: usize,
    /// Console: open pages in the memory measurement (each: the runs stream, the inbox
    /// stream and a run's events).
    #[arg(long, default_value_t = 100)]
    console_pages: usize,
    /// Console: the browser scripts' directory (`measure.mjs`, with `playwright-core`
    /// installed: `scripts/ensure-browser.sh`); default `crates/flotilla-console/browser`
    /// under the current directory. The page figures need it, node and a Chromium
    /// (`CHROMIUM`, default `/usr/bin/chromium`).
    #[arg(long, value_name = "DIR")]
    console_browser: Option<PathBuf>,
}

const PREFIX: &str = "flconsole";
const TOKEN: &str = "bench-console-token-0123456789abcdef";
const WAIT: Duration = Duration::from_secs(600);

type Http = HttpClient<HttpConnector, Full<Bytes>>;

/// The console as a browser reaches it: its address and a signed-in HTTP client.
struct Console {
    addr: SocketAddr,
    http: Http,
}

impl Console {
    fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> anyhow::Result<http::Request<Full<Bytes>>> {
        let mut r = http::Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.addr))
            .header("authorization", format!("Bearer {TOKEN}"));
        if body.is_some() {
            r = r
                .header("content-type", "application/json")
                .header("x-flotilla-console", "1");
        }
        Ok(r.body(Full::new(Bytes::from(body.unwrap_or_default().to_owned())))?)
    }

    /// One request: the status and the whole body.
    async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> anyhow::Result<(u16, Bytes)> {
        let resp = self.http.request(self.request(method, path, body)?).await?;
        let status = resp.status().as_u16();
        Ok((status, resp.into_body().collect().await?.to_bytes()))
    }

    async fn json(&self, path: &str) -> anyhow::Result<serde_json::Value> {
        let (status, body) = self.call("GET", path, None).await?;
        anyhow::ensure!(
            status == 200,
            "GET {path}: {status} {}",
            String::from_utf8_lossy(&body)
        );
        Ok(serde_json::from_slice(&body)?)
    }
}

pub(crate) async fn run(args: &ConsoleArgs, services: &Services, url: &str) -> anyhow::Result<()> {
    let (_dir, config) = section_config(services, url, PREFIX, "console")?;
    let exe = &services.exe;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    // A workflow of one step: each task of the tree's plan starts a child run. The bench
    // signs in with a token and is an operator (it approves the fan-out).
    let mut text = std::fs::read_to_string(&config)?;
    text.push_str(&format!(
        r#"
[agents.fan]
kind = "parallel"
sub-agents = ["noop"]

[coordinator]
max-runs-per-tree = {tree}

[console]
listen = "{addr}"
operators = ["bench"]

[console.tokens]
bench = "{TOKEN}"
"#,
        tree = args.console_tree.max(1)
    ));
    std::fs::write(&config, text)?;
    let bus = section_bus(url, PREFIX).await?;
    let mut procs = Processes(vec![(
        "coordinator".into(),
        spawn_service(exe, &config, &["coordinator"])?,
    )]);
    procs
        .0
        .push(("worker".into(), spawn_service(exe, &config, &["worker"])?));
    procs
        .0
        .push(("console".into(), spawn_service(exe, &config, &["console"])?));
    let console_pid = procs.0[2].1.id();
    let console = Console {
        addr,
        http: HttpClient::builder(TokioExecutor::new()).build_http(),
    };
    let client = Client::new(bus.clone());
    let deadline = Instant::now() + Duration::from_secs(60);
    while console
        .call("GET", "/healthz", None)
        .await
        .map(|r| r.0)
        .ok()
        != Some(200)
    {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the console did not start on {addr}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let warm = submit_via(&bus, SubmitRequest::new(one_task()), services.via).await?;
    client.wait(warm, WAIT).await?;
    outln!(
        "== console (a coordinator, 1 worker process × {} slots, no-op agent, the console service; the bench reads it over HTTP)",
        services.concurrency
    );

    // Memory: pages' streams held open on a run waiting for a person.
    let waiting = submit_via(&bus, SubmitRequest::new(fan_plan(1)), services.via).await?;
    let _ = pending(&client, waiting).await?;
    let before = rss_kib(console_pid).unwrap_or(0);
    let mut held = Vec::new();
    for _ in 0..args.console_pages {
        for path in [
            "/api/runs/stream".to_owned(),
            "/api/inbox/stream".to_owned(),
            format!("/api/runs/{waiting}/events?profile=user&children=linked"),
        ] {
            let resp = console
                .http
                .request(console.request("GET", &path, None)?)
                .await?;
            anyhow::ensure!(resp.status() == 200, "GET {path}: {}", resp.status());
            held.push(resp);
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = rss_kib(console_pid).unwrap_or(0);
    drop(held);
    outln!(
        "   {} open pages ({} server-sent event streams, {} projections): console RSS {:.1} → {:.1} MiB ({:.0} KiB a page)",
        args.console_pages,
        args.console_pages * 3,
        args.console_pages,
        before as f64 / 1024.0,
        after as f64 / 1024.0,
        after.saturating_sub(before) as f64 / args.console_pages.max(1) as f64
    );
    client.cancel(waiting, Some("bench".into())).await?;

    // Many runs in the list.
    let started = Instant::now();
    futures::stream::iter(0..args.console_runs)
        .map(|_| submit_via(&bus, SubmitRequest::new(one_task()), services.via))
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    let want = args.console_runs as u64;
    let deadline = Instant::now() + WAIT;
    loop {
        let page = console.json("/api/runs?status=succeeded&limit=1").await?;
        if page["total"].as_u64().unwrap_or(0) >= want {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "the runs did not finish");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let submitted = started.elapsed();
    let mut list_ms = Vec::new();
    let mut list_bytes = 0;
    for _ in 0..20 {
        let t = Instant::now();
        let (status, body) = console.call("GET", "/api/runs?limit=500", None).await?;
        anyhow::ensure!(status == 200, "GET /api/runs: {status}");
        list_ms.push(t.elapsed().as_secs_f64() * 1e3);
        list_bytes = body.len();
    }
    let (l50, l99) = p50_p99(&mut list_ms);
    outln!(
        "   {} runs (submitted and finished in {:.1} s): GET /api/runs?limit=500 p50 {l50:.1} ms p99 {l99:.1} ms, {} KB",
        args.console_runs,
        submitted.as_secs_f64(),
        list_bytes / 1000
    );

    // A tree of many runs.
    let tree_run = submit_via(
        &bus,
        SubmitRequest::new(tree_plan(args.console_tree.saturating_sub(1).max(1))),
        services.via,
    )
    .await?;
    client.wait(tree_run, WAIT).await?;
    let mut tree_ms = Vec::new();
    let mut tree_runs = 0;
    for _ in 0..5 {
        let t = Instant::now();
        let tree = console.json(&format!("/api/runs/{tree_run}/tree")).await?;
        tree_ms.push(t.elapsed().as_secs_f64() * 1e3);
        tree_runs = tree["runs"].as_u64().unwrap_or(0);
    }
    let (t50, t99) = p50_p99(&mut tree_ms);
    outln!(
        "   a tree of {tree_runs} runs: GET /api/runs/RUN/tree p50 {t50:.0} ms p99 {t99:.0} ms (the page reads it again at most every 4× that)"
    );

    // The lag, with the page when a browser can be driven.
    let fan = submit_via(
        &bus,
        SubmitRequest::new(fan_plan(args.console_fan)),
        services.via,
    )
    .await?;
    let gate = pending(&client, fan).await?;
    let page = match browser(args) {
        Ok((script, chromium)) => {
            Some(Page::start(&script, &chromium, addr, args.console_runs).await?)
        }
        Err(why) => {
            outln!("   page figures skipped: {why}");
            None
        }
    };
    let mut page = match page {
        Some(mut p) => {
            p.expect("OPEN").await?;
            p.send(&fan.to_string()).await?;
            p.expect("GO").await?;
            Some(p)
        }
        None => None,
    };
    let sse = tokio::spawn(sse_lags(
        console.http.clone(),
        console.request(
            "GET",
            &format!("/api/runs/{fan}/events?profile=debug&children=linked"),
            None,
        )?,
    ));
    let watch = client
        .watch(
            fan,
            WatchOptions {
                profile: Profile::Debug,
                children: ChildPolicy::Linked,
                since: 0,
                since_index: None,
            },
        )
        .await?;
    // Both readers are following once their first (already stored) event arrived.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let approved_at = Timestamp::now().0.unix_timestamp_nanos();
    let (status, body) = console
        .call(
            "POST",
            &format!("/api/approvals/{fan}/{gate}"),
            Some(r#"{"decision":"approve","comment":"bench"}"#),
        )
        .await?;
    anyhow::ensure!(
        status == 200,
        "approving: {status} {}",
        String::from_utf8_lossy(&body)
    );
    let mut watch_lags = Vec::new();
    futures::pin_mut!(watch);
    while let Some(e) = watch.next().await {
        let e = e?;
        if e.event.ts.0.unix_timestamp_nanos() >= approved_at {
            watch_lags.push(lag_ms(&e.event.ts));
        }
    }
    let mut sse_lags: Vec<f64> = sse
        .await??
        .into_iter()
        .filter(|(ts, _)| *ts >= approved_at)
        .map(|(_, l)| l)
        .collect();
    let (w50, w99) = p50_p99(&mut watch_lags);
    let (s50, s99) = p50_p99(&mut sse_lags);
    outln!(
        "   event stored → arrived, debug profile, {} events of a {}-task fan-out:",
        watch_lags.len(),
        args.console_fan
    );
    outln!("     flotilla watch (Client::watch):             p50 {w50:.1} ms   p99 {w99:.1} ms");
    outln!(
        "     the console's event stream (HTTP reader):   p50 {s50:.1} ms   p99 {s99:.1} ms: {:.2}× the watch",
        s50 / w50.max(0.001)
    );
    if let Some(mut p) = page.take() {
        p.send("done").await?;
        p.expect("TREE").await?;
        p.send(&tree_run.to_string()).await?;
        let r = p.result().await?;
        let lags = |k: &str| -> Vec<f64> {
            r[k].as_array()
                .map(|a| a.iter().filter_map(|v| v.as_f64()).collect())
                .unwrap_or_default()
        };
        // The page also drew the events stored before the approval: the same tail as the watch.
        let tail = |mut v: Vec<f64>| {
            let n = v.len().saturating_sub(watch_lags.len());
            v.drain(..n);
            v
        };
        let (h50, h99) = p50_p99(&mut tail(lags("handled_lags_ms")));
        let (v50, v99) = p50_p99(&mut tail(lags("page_lags_ms")));
        outln!(
            "     the page, event handled:                    p50 {h50:.1} ms   p99 {h99:.1} ms"
        );
        outln!(
            "     the page, visible (the next frame drawn):   p50 {v50:.1} ms   p99 {v99:.1} ms: {:.2}× the watch (target ≤ 2×); longest frame meanwhile {} ms",
            v50 / w50.max(0.001),
            r["events_longest_frame_ms"]
        );
        outln!(
            "   the runs page with {} runs: first rows {} ms, scroll to the end {} ms, {} rows in the DOM, next frame {} ms",
            r["runs_total"],
            r["runs_first_rows_ms"],
            r["runs_scroll_to_end_ms"],
            r["runs_dom_rows"],
            r["runs_next_frame_ms"]
        );
        outln!(
            "   a run's page with a tree of {}: tree drawn {} ms after navigation, {} tree rows in the DOM, scroll to its end {} ms, longest frame over 3 s {} ms",
            r["tree_count"],
            r["tree_first_rows_ms"],
            r["tree_dom_rows"],
            r["tree_scroll_to_end_ms"],
            r["tree_longest_frame_ms"]
        );
        p.finish().await?;
    }
    drop(procs);
    Ok(())
}

fn lag_ms(ts: &Timestamp) -> f64 {
    (Timestamp::now().0 - ts.0).as_seconds_f64().max(0.0) * 1e3
}

fn one_task() -> Plan {
    Plan {
        fork: None,
        name: Some("bulk".into()),
        query: None,
        subtasks: vec![Subtask::new("only", "one step")],
        config: PlanConfig::default(),
    }
}

/// `n` tasks behind a task whose action (`publish`) needs a person's approval.
fn fan_plan(n: usize) -> Plan {
    let mut gate = Subtask::new("gate", "publish the plan");
    gate.action = Some("publish".into());
    let mut subtasks = vec![gate];
    for i in 0..n {
        subtasks.push(Subtask::new(&format!("t{i}"), "work").after(&["gate"]));
    }
    Plan {
        fork: None,
        name: Some("fan-out".into()),
        query: None,
        subtasks,
        config: PlanConfig::default(),
    }
}

/// `n` tasks, each a one-step workflow: each starts one child run.
fn tree_plan(n: usize) -> Plan {
    Plan {
        fork: None,
        name: Some("tree".into()),
        query: None,
        subtasks: (0..n)
            .map(|i| Subtask::new(&format!("c{i}"), "start a child").with_agent("fan"))
            .collect(),
        config: PlanConfig::default(),
    }
}

/// The first pending approval of `run`, once it is asked.
async fn pending(client: &Client, run: RunId) -> anyhow::Result<String> {
    let deadline = Instant::now() + WAIT;
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
        if let Some(a) = l.approvals.first() {
            return Ok(a.request.approval_id.clone());
        }
        anyhow::ensure!(Instant::now() < deadline, "run {run} asked for no approval");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Reads the console's event stream until its `end`: each event's time and its lag.
async fn sse_lags(http: Http, req: http::Request<Full<Bytes>>) -> anyhow::Result<Vec<(i128, f64)>> {
    let resp = http.request(req).await?;
    anyhow::ensure!(resp.status() == 200, "the event stream: {}", resp.status());
    let mut body = resp.into_body();
    let mut buf = String::new();
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        buf.push_str(&String::from_utf8_lossy(&data));
        while let Some(end) = buf.find("\n\n") {
            let message: String = buf.drain(..end + 2).collect();
            if message.lines().any(|l| l == "event: end") {
                return Ok(out);
            }
            for line in message.lines() {
                let Some(json) = line
                    .strip_prefix("data: ")
                    .or_else(|| line.strip_prefix("data:"))
                else {
                    continue;
                };
                let Ok(v) = serde_json::from_str::<serde_json::Value>(json) else {
                    continue;
                };
                if let Ok(ts) = serde_json::from_value::<Timestamp>(v["event"]["ts"].clone()) {
                    out.push((ts.0.unix_timestamp_nanos(), lag_ms(&ts)));
                }
            }
        }
    }
    Ok(out)
}

/// `measure.mjs` and the Chromium it drives, or why the page cannot be measured.
fn browser(args: &ConsoleArgs) -> Result<(PathBuf, PathBuf), String> {
    let dir = args
        .console_browser
        .clone()
        .unwrap_or_else(|| PathBuf::from("crates/flotilla-console/browser"));
    let script = dir.join("measure.mjs");
    if !script.is_file() {
        return Err(format!(
            "no {} (give --console-browser DIR)",
            script.display()
        ));
    }
    if !dir.join("node_modules/playwright-core").is_dir() {
        return Err(format!(
            "playwright-core is not installed in {} (run scripts/ensure-browser.sh)",
            dir.display()
        ));
    }
    let chromium = std::env::var_os("CHROMIUM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
    if !chromium.is_file() {
        return Err(format!(
            "no Chromium at {} (set CHROMIUM)",
            chromium.display()
        ));
    }
    if std::process::Command::new("node")
        .arg("--version")
        .output()
        .is_err()
    {
        return Err("node is not installed".into());
    }
    Ok((script, chromium))
}

/// `measure.mjs` driving a headless Chromium: lines in both directions.
struct Page {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

impl Page {
    async fn start(
        script: &Path,
        chromium: &Path,
        addr: SocketAddr,
        runs: usize,
    ) -> anyhow::Result<Self> {
        let mut child = tokio::process::Command::new("node")
            .arg(script)
            .env("CONSOLE_URL", format!("http://{addr}"))
            .env("CONSOLE_TOKEN", TOKEN)
            .env("RUNS", runs.to_string())
            .env("CHROMIUM", chromium)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("starting node")?;
        let stdin = child.stdin.take().context("node's stdin")?;
        let stdout = child.stdout.take().context("node's stdout")?;
        Ok(Self {
            child,
            stdin,
            lines: BufReader::new(stdout).lines(),
        })
    }

    async fn next(&mut self) -> anyhow::Result<String> {
        let line = tokio::time::timeout(WAIT, self.lines.next_line())
            .await
            .context("the browser script is silent")??;
        line.context("the browser script ended early")
    }

    async fn expect(&mut self, what: &str) -> anyhow::Result<()> {
        loop {
            let line = self.next().await?;
            if line == what {
                return Ok(());
            }
            anyhow::ensure!(!line.starts_with("FAILED"), "the browser script: {line}");
        }
    }

    async fn send(&mut self, line: &str) -> anyhow::Result<()> {
        self.stdin.write_all(format!("{line}\n").as_bytes()).await?;
        Ok(())
    }

    async fn result(&mut self) -> anyhow::Result<serde_json::Value> {
        loop {
            let line = self.next().await?;
            if let Some(json) = line.strip_prefix("RESULT ") {
                return Ok(serde_json::from_str(json)?);
            }
            anyhow::ensure!(!line.starts_with("FAILED"), "the browser script: {line}");
        }
    }

    async fn finish(mut self) -> anyhow::Result<()> {
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await??;
        anyhow::ensure!(status.success(), "the browser script failed: {status}");
        Ok(())
    }
}
