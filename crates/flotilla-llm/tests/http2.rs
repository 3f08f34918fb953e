//! The provider's HTTP transport against the scripted OpenAI-compatible test server (a test
//! double: every answer is scripted): HTTP/2 with prior knowledge (`http2-prior-knowledge`),
//! a cap of requests above one connection's stream limit, and the default HTTP/1.1.

use std::time::Duration;

use async_openai::types::chat::CreateChatCompletionRequest;
use flotilla_llm::provider::{CallError, KeySource, Provider};
use flotilla_llm::{LlmConfig, Providers};
use flotilla_testkit::openai::{OpenAiServer, Reply};
use serde_json::json;
use tokio_util::sync::CancellationToken;

fn request() -> anyhow::Result<CreateChatCompletionRequest> {
    Ok(serde_json::from_value(json!({
        "model": "scripted-model",
        "messages": [{"role": "user", "content": "Say something short."}],
        "stream": true,
    }))?)
}

async fn call(provider: &Provider) -> Result<String, CallError> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    provider
        .complete(
            &request().map_err(|e| CallError::Rejected(e.to_string()))?,
            &mut |_| {},
            &CancellationToken::new(),
            deadline,
            &[],
            0,
        )
        .await
        .map(|c| c.content)
}

#[tokio::test]
async fn more_requests_than_one_connection_streams_all_reach_the_provider() -> anyhow::Result<()> {
    // The server allows 100 streams per HTTP/2 connection, as many providers do; the cap is
    // 250 requests at once. One connection would hold 150 of them back inside the client.
    let server = OpenAiServer::start_h2c(100).await?;
    let n = 250;
    for _ in 0..n {
        server.push(Reply::text("held").delay(Duration::from_secs(3)));
    }
    let mut config = LlmConfig::new(server.base_url(), "scripted-model");
    config.max_concurrent_requests = n;
    config.http2_prior_knowledge = true;
    let provider = Provider::new(&config, KeySource::None, &Providers::default());
    let calls = futures::future::join_all((0..n).map(|_| call(&provider)));
    // Every request is at the server while the first ones are still held there.
    let (replies, arrived) = tokio::join!(
        calls,
        server.wait_for_requests(n, Duration::from_millis(2500))
    );
    let arrived = arrived?;
    assert!(
        arrived.iter().all(|r| r.http2),
        "every request spoke HTTP/2"
    );
    assert_eq!(replies.len(), n);
    for r in replies {
        assert_eq!(r?, "held");
    }
    // Three connections of at most 100 streams each, reused rather than one per request.
    assert_eq!(
        server.connections(),
        3,
        "one connection per 100 requests of the cap"
    );
    Ok(())
}

#[tokio::test]
async fn http1_stays_the_default_on_plain_http() -> anyhow::Result<()> {
    let server = OpenAiServer::start_h2c(100).await?;
    server.push(Reply::text("one"));
    let config = LlmConfig::new(server.base_url(), "scripted-model");
    assert!(!config.http2_prior_knowledge);
    let provider = Provider::new(&config, KeySource::None, &Providers::default());
    assert_eq!(call(&provider).await?, "one");
    let requests = server.requests();
    assert_eq!(requests.len(), 1);
    assert!(!requests[0].http2, "HTTP/1.1 unless asked");
    Ok(())
}

#[tokio::test]
async fn a_restarted_provider_is_reached_again_over_either_protocol() -> anyhow::Result<()> {
    for http2 in [false, true] {
        let mut server = OpenAiServer::start_h2c(100).await?;
        server.push_all([Reply::text("before"), Reply::text("after")]);
        let mut config = LlmConfig::new(server.base_url(), "scripted-model");
        config.http2_prior_knowledge = http2;
        // No retry of the agent's own: the pooled connection the restart closed must not be
        // the one the next call is sent on.
        config.max_retries = 0;
        let provider = Provider::new(&config, KeySource::None, &Providers::default());
        assert_eq!(call(&provider).await?, "before");
        // Every connection closed, the same URL served again.
        server.restart().await?;
        assert_eq!(call(&provider).await?, "after", "HTTP/2: {http2}");
        assert_eq!(server.connections(), 2, "HTTP/2: {http2}: connected again");
        let requests = server.requests();
        assert_eq!(requests.len(), 2);
        assert!(requests.iter().all(|r| r.http2 == http2), "HTTP/2: {http2}");
    }
    Ok(())
}

#[tokio::test]
async fn prior_knowledge_against_an_http1_server_fails_with_the_transports_reason()
-> anyhow::Result<()> {
    // A server that speaks HTTP/1.1 alone: whatever arrives, it answers one HTTP/1.1 reply.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut s, _)) = listener.accept().await {
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await;
            let _ = s
                .write_all(
                    b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                )
                .await;
        }
    });
    let mut config = LlmConfig::new(format!("http://{addr}/v1"), "scripted-model");
    config.http2_prior_knowledge = true;
    config.max_retries = 0;
    let provider = Provider::new(&config, KeySource::None, &Providers::default());
    let e = call(&provider).await.expect_err("an HTTP/1.1 server");
    server.abort();
    assert!(
        matches!(&e, CallError::GaveUp(m) if m.contains("cannot reach the provider")),
        "{e}"
    );
    Ok(())
}

#[test]
fn the_option_is_a_boolean_named_in_errors() {
    let ok: LlmConfig = toml::from_str(
        r#"base-url = "http://127.0.0.1:1/v1"
model = "m"
http2-prior-knowledge = true"#,
    )
    .expect("valid");
    assert!(ok.http2_prior_knowledge);
    let e = toml::from_str::<LlmConfig>(
        r#"base-url = "http://127.0.0.1:1/v1"
model = "m"
http2-prior-knowledge = "yes""#,
    )
    .expect_err("not a boolean");
    assert!(e.to_string().contains("http2-prior-knowledge"), "{e}");
    // Omitted at its default, so older workers read configurations that leave it out.
    let text = toml::to_string(&LlmConfig::new("http://127.0.0.1:1/v1", "m")).expect("encodes");
    assert!(!text.contains("http2"), "{text}");
}
