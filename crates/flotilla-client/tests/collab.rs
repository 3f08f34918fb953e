//! The client's collaboration calls against a real nats-server and coordinator: workspace,
//! mailboxes and session state of a run (no worker runs it: the calls need only the run).

use std::time::Duration;

use flotilla_client::{Client, ClientErrorKind};
use flotilla_coordinator::{Coordinator, CoordinatorOptions};
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::api::{
    MboxReadRequest, MboxSendRequest, StateGetRequest, StateSetRequest, WsAppendRequest,
    WsReadRequest,
};
use flotilla_model::ids::{RunId, SessionId};
use flotilla_model::mailbox::MailboxKind;
use flotilla_model::plan::Plan;
use flotilla_model::submit::SubmitRequest;
use flotilla_testkit::NatsServer;
use serde_json::json;
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn collaboration_calls_reach_workspace_mailboxes_and_state() -> anyhow::Result<()> {
    let server = NatsServer::start().await?;
    let bus = server.provisioned_bus().await?;
    let shutdown = CancellationToken::new();
    let (ready, started) = tokio::sync::oneshot::channel();
    let coordinator = Coordinator::new(
        server.bus().await?,
        CoordinatorOptions::default(),
        Default::default(),
        Default::default(),
    )
    .on_ready(ready);
    let service = tokio::spawn(coordinator.run(shutdown.clone()));
    started.await?;
    let client = Client::new(bus);

    let session = SessionId::new();
    let plan: Plan = serde_json::from_value(json!({"subtasks": [{"id": "draft"}]}))?;
    let mut submission = SubmitRequest::new(plan);
    submission.session_id = Some(session);
    let run: RunId = client.submit(submission).await?;

    // The API service starts with the coordinator; answer once it does.
    let append = WsAppendRequest {
        protocol: PROTOCOL_VERSION,
        run_id: run,
        topic: "Notes".into(),
        entry: serde_json::from_value(json!({"text": "hello"}))?,
        task_id: None,
        attempt: None,
        by: Some("client".into()),
        idempotency_key: None,
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let appended = loop {
        match client.ws_append(&append).await {
            Err(e)
                if e.kind() == ClientErrorKind::NoCoordinator
                    && tokio::time::Instant::now() < deadline =>
            {
                tokio::task::yield_now().await;
            }
            other => break other?,
        }
    };
    assert_eq!(appended.topic, "notes");
    let page = client
        .ws_read(&WsReadRequest {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            topic: Some("notes".into()),
            since_seq: 0,
            limit: None,
        })
        .await?;
    assert_eq!(page.entries.len(), 1);
    assert_eq!(
        page.entries[0]
            .writer
            .as_ref()
            .and_then(|w| w.by.as_deref()),
        Some("client")
    );

    let sent = client
        .mbox_send(&MboxSendRequest {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            from: "dashboard".into(),
            to: "draft".into(),
            kind: MailboxKind::Info,
            payload: json!({"hint": 1}),
            correlation_id: None,
            attempt: None,
            idempotency_key: None,
        })
        .await?;
    assert_eq!(sent.n, 1);
    let mail = client
        .mbox_read(&MboxReadRequest {
            protocol: PROTOCOL_VERSION,
            run_id: run,
            reader: "draft".into(),
            since_seq: None,
            limit: None,
            wait_ms: Some(1000),
            commit: false,
        })
        .await?;
    assert_eq!(mail.messages.len(), 1);
    assert_eq!(mail.messages[0].seq, sent.seq);

    let set = |expected_revision| StateSetRequest {
        protocol: PROTOCOL_VERSION,
        run_id: None,
        session_id: Some(session),
        key: "plan".into(),
        value: json!({"step": 1}),
        expected_revision,
    };
    let first = client.state_set(&set(Some(0))).await?;
    let got = client
        .state_get(&StateGetRequest {
            protocol: PROTOCOL_VERSION,
            run_id: Some(run),
            session_id: None,
            key: "plan".into(),
        })
        .await?;
    assert_eq!(
        (got.value, got.revision),
        (json!({"step": 1}), first.revision)
    );
    // A lost compare-and-set: `call` hands over the refusal with the current revision.
    let refused = client
        .call(&set(Some(first.revision + 1)), Duration::from_secs(5))
        .await?
        .expect_err("a conflict");
    assert_eq!(
        (
            refused.status,
            refused.code.as_str(),
            refused.current_revision
        ),
        (409, "conflict", Some(first.revision))
    );
    let err = client
        .state_set(&set(Some(0)))
        .await
        .expect_err("a conflict");
    assert_eq!(err.kind(), ClientErrorKind::Api);

    shutdown.cancel();
    service.await??;
    Ok(())
}
