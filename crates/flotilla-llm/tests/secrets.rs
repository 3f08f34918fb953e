//! The API key of an LLM agent never leaks: not in `Debug` output, errors or logs — against a
//! real nats-server and the scripted OpenAI-compatible test server (a test double: every model
//! answer is scripted).
//!
//! A test binary of its own: it captures logs with a thread-local subscriber, and tracing
//! caches each call site's interest process-wide, so a test running beside it on another
//! thread (without a subscriber) can leave the call sites it needs switched off.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use flotilla_testkit::openai::Reply;

const TIMEOUT: Duration = Duration::from_secs(20);

/// A log sink for the key-leak test.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn the_api_key_never_appears_in_debug_output_errors_or_logs() -> anyhow::Result<()> {
    let secret = "sk-flotilla-test-0123456789abcdef";
    let captured = Captured::default();
    let sink = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || sink.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let h = Harness::start().await?;
    let dir = tempfile::tempdir()?;
    let key_file = dir.path().join("key");
    std::fs::write(&key_file, format!("{secret}\n"))?;
    let mut config = h.config();
    config.api_key_file = Some(key_file);
    config.headers.insert("x-team".into(), "blue".into());
    let agent = h.agent(&config)?;
    assert!(!format!("{agent:?}").contains(secret));
    assert!(!format!("{config:?}").contains(secret));

    h.llm.push(Reply::rate_limited("0.05"));
    h.llm.push(Reply::text("fine"));
    let reply = h.run(&agent, &envelope("t", "x"), TIMEOUT).await?;
    assert!(reply.is_ok());
    h.llm.push(Reply::status_message(
        401,
        format!("Incorrect API key provided: {secret}"),
    ));
    let e = h
        .run(&agent, &envelope("t", "x"), TIMEOUT)
        .await?
        .expect_err("401");
    assert!(!e.message.contains(secret), "{e}");
    assert!(e.message.contains("[redacted]"), "{e}");

    let requests = h.llm.requests();
    assert_eq!(
        requests[0].header("authorization"),
        Some(format!("Bearer {secret}").as_str()),
        "the key is sent to the provider"
    );
    assert_eq!(requests[0].header("x-team"), Some("blue"));
    let logs = String::from_utf8_lossy(
        &captured
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    )
    .into_owned();
    assert!(logs.contains("retrying"), "logs were captured:\n{logs}");
    assert!(
        !logs.contains(secret),
        "the key leaked into the logs:\n{logs}"
    );
    Ok(())
}
