//! Notices and webhooks across processes against a real nats-server: an approval's notice
//! POSTed to a webhook — signed, retried with backoff while the endpoint fails, surviving a
//! supervisor kill, carrying one idempotency id on every attempt and stored once however
//! often it is published; a pause's notice reaching a webhook filtered to pauses, dropped after
//! its last attempt; bad webhook settings refusing to start. `flotilla coordinator`,
//! `flotilla worker` and `flotilla supervisor` run as processes; the agent is the deterministic
//! `scripted` test agent (the tasks here wait for approval and never need a model).

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::control::{ControlRunReply, PauseRunRequest};
use flotilla_model::notify::{NoticeKind, Notification};
use flotilla_model::plan::Subtask;
use flotilla_model::run::RunStatus;
use flotilla_model::submit::SubmitRequest;
use futures::TryStreamExt;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use support::*;

const SECRET: &str = "s3cret-for-tests";

/// One POST as the endpoint saw it.
#[derive(Debug, Clone)]
struct Received {
    hook: String,
    delivery: String,
    attempt: u32,
    kind: String,
    timestamp: Option<String>,
    signature: Option<String>,
    body: Vec<u8>,
    accepted: bool,
}

#[derive(Clone, Default)]
struct Endpoint {
    seen: Arc<Mutex<Vec<Received>>>,
    /// `ops` answers 503 while this holds.
    ops_down: Arc<AtomicBool>,
}

impl Endpoint {
    fn of(&self, hook: &str) -> Vec<Received> {
        self.seen
            .lock()
            .map(|s| s.iter().filter(|r| r.hook == hook).cloned().collect())
            .unwrap_or_default()
    }

    async fn until(
        &self,
        what: &str,
        done: impl Fn(&[Received]) -> bool,
    ) -> anyhow::Result<Vec<Received>> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let seen = self.seen.lock().map(|s| s.clone()).unwrap_or_default();
            if done(&seen) {
                return Ok(seen);
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "never saw {what}; saw {seen:#?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

async fn receive(
    State(e): State<Endpoint>,
    Path(hook): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> StatusCode {
    let h = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let accepted = match hook.as_str() {
        "ops" => !e.ops_down.load(Ordering::SeqCst),
        _ => false,
    };
    if let Ok(mut seen) = e.seen.lock() {
        seen.push(Received {
            hook,
            delivery: h("x-flotilla-delivery").unwrap_or_default(),
            attempt: h("x-flotilla-attempt")
                .and_then(|a| a.parse().ok())
                .unwrap_or(0),
            kind: h("x-flotilla-notice").unwrap_or_default(),
            timestamp: h("x-flotilla-timestamp"),
            signature: h("x-flotilla-signature"),
            body: body.to_vec(),
            accepted,
        });
    }
    if accepted {
        StatusCode::NO_CONTENT
    } else if e.ops_down.load(Ordering::SeqCst) {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::INTERNAL_SERVER_ERROR
    }
}

/// An HTTP endpoint on a free loopback port: `/ops` and `/pauses`.
async fn endpoint() -> anyhow::Result<(Endpoint, String)> {
    let e = Endpoint::default();
    let app = axum::Router::new()
        .route("/{hook}", axum::routing::post(receive))
        .with_state(e.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((e, url))
}

fn config(url: &str) -> String {
    format!(
        r#"
[agents.bot]
kind = "scripted"
reply = "done"

[[supervisor.webhooks]]
name = "ops"
url = "{url}/ops"
secret-env = "TEST_WEBHOOK_SECRET"
timeout = "2s"
backoff = "200ms"
max-backoff = "400ms"
max-attempts = 100

[[supervisor.webhooks]]
name = "pauses"
url = "{url}/pauses"
kinds = ["pause"]
timeout = "2s"
backoff = "200ms"
max-attempts = 2
"#
    )
}

fn verify(r: &Received) -> bool {
    let (Some(ts), Some(sig)) = (&r.timestamp, &r.signature) else {
        return false;
    };
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(SECRET.as_bytes()) else {
        return false;
    };
    mac.update(ts.as_bytes());
    mac.update(b".");
    mac.update(&r.body);
    let hex: String = mac
        .finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    *sig == format!("sha256={hex}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notices_reach_webhooks_signed_retried_across_a_supervisor_kill_and_once()
-> anyhow::Result<()> {
    let (endpoint, url) = endpoint().await?;
    endpoint.ops_down.store(true, Ordering::SeqCst);
    let mut p = Processes::start(&config(&url)).await?;
    let secret = [("TEST_WEBHOOK_SECRET", SECRET)];
    p.coordinator().await?;
    p.worker(&[]).await?;
    let sup = p.supervisor_env(&secret).await?;

    // A sensitive task waits for approval: its notice goes to `ops` (all kinds), which fails
    // and is retried with the same delivery id.
    let mut ship = Subtask::new("ship", "Publish the report").with_agent("bot");
    ship.action = Some("publish".into());
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![ship])))
        .await?;
    let id = format!("approval.{run}.t0a1");
    if let Err(e) = endpoint
        .until("two attempts at the approval notice", |s| {
            s.iter()
                .filter(|r| r.hook == "ops" && r.delivery == id)
                .count()
                >= 2
        })
        .await
    {
        anyhow::bail!("{e}\nsupervisor:\n{}", p.log(sup));
    }

    // The supervisor dies while the endpoint is down; the notice is not lost.
    p.kill(sup);
    endpoint.ops_down.store(false, Ordering::SeqCst);
    p.supervisor_env(&secret).await?;
    endpoint
        .until("the approval notice accepted", |s| {
            s.iter()
                .any(|r| r.hook == "ops" && r.delivery == id && r.accepted)
        })
        .await?;
    let ops: Vec<Received> = endpoint
        .of("ops")
        .into_iter()
        .filter(|r| r.delivery == id)
        .collect();
    assert!(ops.iter().all(|r| r.kind == "approval"), "{ops:#?}");
    assert!(ops.iter().all(verify), "every attempt is signed: {ops:#?}");
    let attempts: Vec<u32> = ops.iter().map(|r| r.attempt).collect();
    assert!(
        attempts.windows(2).all(|w| w[0] < w[1]) && attempts[0] == 1,
        "attempts count up from 1: {attempts:?}"
    );
    assert_eq!(ops.iter().filter(|r| r.accepted).count(), 1);
    let accepted = ops.iter().find(|r| r.accepted).expect("accepted");
    let notice: Notification = serde_json::from_slice(&accepted.body)?;
    assert_eq!(notice.kind, NoticeKind::Approval);
    assert_eq!(notice.id, id);
    assert_eq!(notice.run_id, Some(run));
    let approval = notice.approval.clone().expect("the approval");
    assert_eq!(approval.request.task_id.as_str(), "ship");
    assert_eq!(approval.request.action.as_deref(), Some("publish"));
    // Nothing about approvals reaches the webhook filtered to pauses.
    assert!(endpoint.of("pauses").is_empty());

    // The same notice published again (a step performed again after a crash) is stored once.
    let bus = p.bus.clone();
    bus.publish(bus.names().notify("approval", run), &notice, Some(&id))
        .await?;

    // A pause: both webhooks hear it; `pauses` always fails and drops it after two attempts.
    let paused: ControlRunReply = p
        .client
        .request(
            &PauseRunRequest {
                protocol: PROTOCOL_VERSION,
                run_id: run,
                reason: Some("legal review".into()),
                by: Some("alice".into()),
                timeout_ms: Some(60_000),
                children: true,
                task_id: None,
            },
            Duration::from_secs(10),
        )
        .await?;
    assert!(paused.applied);
    let seen = endpoint
        .until("the pause at both webhooks", |s| {
            s.iter()
                .any(|r| r.hook == "ops" && r.kind == "pause" && r.accepted)
                && s.iter().filter(|r| r.hook == "pauses").count() >= 2
        })
        .await?;
    let pause = seen
        .iter()
        .find(|r| r.hook == "ops" && r.kind == "pause")
        .expect("the pause");
    let notice: Notification = serde_json::from_slice(&pause.body)?;
    assert_eq!(notice.kind, NoticeKind::Pause);
    assert!(
        notice.id.starts_with(&format!("pause.{run}.")),
        "{}",
        notice.id
    );
    let control = notice.control.expect("the control");
    assert_eq!(control.by.as_deref(), Some("alice"));
    assert_eq!(control.reason.as_deref(), Some("legal review"));
    assert_eq!(control.status, RunStatus::Running);
    let lead = control.until.unix_ms() - notice.at.map(|t| t.unix_ms()).unwrap_or(0);
    assert!(
        (59_000..=61_000).contains(&lead),
        "until is the hold's deadline: {lead}"
    );
    let pauses = endpoint.of("pauses");
    assert!(
        pauses
            .iter()
            .all(|r| r.kind == "pause" && r.signature.is_none())
    );
    assert!(pauses.iter().all(|r| r.delivery == notice.id));

    // Nothing more arrives: the dropped pause is not retried, the duplicate approval notice
    // was never stored.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        endpoint.of("pauses").len(),
        2,
        "{:#?}",
        endpoint.of("pauses")
    );
    let approval_posts = endpoint
        .of("ops")
        .iter()
        .filter(|r| r.delivery == id)
        .count();
    assert_eq!(approval_posts, ops.len(), "the duplicate was delivered");
    Ok(())
}

/// A fresh deployment whose first supervisor starts after a notice was published: the
/// webhook still gets it (its consumer, created then, starts `backfill` back), once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notice_published_before_any_supervisor_was_up_reaches_the_webhook() -> anyhow::Result<()>
{
    let (endpoint, url) = endpoint().await?;
    let mut p = Processes::start(&config(&url)).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let mut ship = Subtask::new("ship", "Publish the report").with_agent("bot");
    ship.action = Some("publish".into());
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![ship])))
        .await?;
    let id = format!("approval.{run}.t0a1");
    // The notice is stored before any supervisor exists.
    let stream = p
        .bus
        .names()
        .stream(flotilla_model::subjects::StreamKind::Notify);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let mut s = p.bus.js().get_stream(&stream).await?;
        if s.info().await?.state.messages > 0 {
            break;
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "no notice stored");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let sup = p.supervisor_env(&[("TEST_WEBHOOK_SECRET", SECRET)]).await?;
    if let Err(e) = endpoint
        .until("the early approval notice", |s| {
            s.iter()
                .any(|r| r.hook == "ops" && r.delivery == id && r.accepted)
        })
        .await
    {
        anyhow::bail!("{e}\nsupervisor:\n{}", p.log(sup));
    }
    assert_eq!(endpoint.of("ops").len(), 1, "{:#?}", endpoint.of("ops"));
    Ok(())
}

/// Runs `flotilla supervisor` with `extra` config and no secret in the environment; its
/// exit status and output.
fn supervisor_with(p: &Processes, extra: &str) -> anyhow::Result<(bool, String)> {
    let config = p.dir().join("bad.toml");
    std::fs::write(
        &config,
        format!(
            "[agents.bot]\nkind = \"scripted\"\nreply = \"done\"\n{extra}\n[nats]\nurls = [\"{}\"]\n",
            p.server.url()
        ),
    )?;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .arg("--config")
        .arg(&config)
        .arg("supervisor")
        .env_remove("TEST_WEBHOOK_SECRET")
        .env("FLOTILLA_TELEMETRY__HTTP_ADDR", "off")
        .stdin(std::process::Stdio::null())
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((out.status.success(), text))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_webhook_settings_are_refused_at_start_naming_the_key() -> anyhow::Result<()> {
    let p = Processes::start("").await?;
    for (extra, expected) in [
        (
            "[[supervisor.webhooks]]\nname = \"ops\"\nurl = \"ftp://example.com/x\"\n",
            "webhooks[ops].url",
        ),
        (
            "[[supervisor.webhooks]]\nname = \"ops\"\nurl = \"http://127.0.0.1:9/x\"\nsecret-env = \"TEST_WEBHOOK_SECRET\"\n",
            "TEST_WEBHOOK_SECRET",
        ),
        (
            "[[supervisor.webhooks]]\nname = \"ops\"\nurl = \"http://127.0.0.1:9/x\"\nkinds = [\"bogus\"]\n",
            "bogus",
        ),
        (
            "[[supervisor.webhooks]]\nname = \"ops\"\nurl = \"http://127.0.0.1:9/x\"\n[[supervisor.webhooks]]\nname = \"ops\"\nurl = \"http://127.0.0.1:9/y\"\n",
            "used twice",
        ),
        (
            "[[supervisor.webhooks]]\nname = \"ops\"\nurl = \"http://127.0.0.1:9/x\"\nmax-attempts = 0\n",
            "max-attempts",
        ),
    ] {
        let (ok, text) = supervisor_with(&p, extra)?;
        assert!(!ok, "started with {extra}: {text}");
        assert!(text.contains(expected), "{expected:?} not named in: {text}");
    }
    // Nothing was created for the refused webhooks.
    let stream = p
        .bus
        .js()
        .get_stream(
            p.bus
                .names()
                .stream(flotilla_model::subjects::StreamKind::Notify),
        )
        .await?;
    let names: Vec<String> = stream.consumer_names().try_collect().await?;
    assert!(names.is_empty(), "consumers were created: {names:?}");
    Ok(())
}
