//! The request/reply API: a NATS micro service named after the prefix, discoverable with
//! standard NATS tooling (`$SRV.PING`, `$SRV.INFO`).
//!
//! | Subject | Request | Reply |
//! |---|---|---|
//! | `<prefix>.api.submit` | `SubmitRequest` | `SubmitReply` (at acceptance, or at the end with `wait: true`) |
//! | `<prefix>.api.run.get` | `GetRunRequest` | `RunView`, or `ApiError` with `Nats-Service-Error` headers |

use std::sync::Arc;

use async_nats::HeaderMap;
use async_nats::service::{Request, ServiceExt};
use bytes::Bytes;
use flotilla_bus::wire;
use flotilla_model::api::{ApiError, ApiRequest, GetRunRequest};
use flotilla_model::codec::check_protocol;
use flotilla_model::submit::SubmitRequest;
use flotilla_model::time::Timestamp;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::error::{CoordinatorError, CoordinatorErrorKind};
use crate::intake::{Answer, Intake};
use crate::store::RunStore;

async fn respond_error(req: &Request, status: u16, code: &str, message: String) {
    let body = ApiError {
        status,
        code: code.to_owned(),
        message: message.clone(),
    };
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Service-Error", message.as_str());
    headers.insert("Nats-Service-Error-Code", status.to_string().as_str());
    headers.insert(
        flotilla_model::codec::CONTENT_TYPE,
        flotilla_model::codec::JSON,
    );
    let payload = serde_json::to_vec(&body).unwrap_or_default();
    let _ = req
        .respond_with_headers(Ok(Bytes::from(payload)), headers)
        .await;
}

async fn respond_json<T: serde::Serialize>(req: &Request, value: &T) {
    match wire::encode(value, flotilla_model::codec::Codec::Json, None) {
        Ok(out) => {
            let _ = req.respond_with_headers(Ok(out.payload), out.headers).await;
        }
        Err(e) => respond_error(req, 500, "internal", e.to_string()).await,
    }
}

/// Serves the API until `shutdown`.
pub(crate) async fn serve(
    store: RunStore,
    intake: Arc<Intake>,
    shutdown: CancellationToken,
) -> Result<(), CoordinatorError> {
    let bus = store.bus().clone();
    let setup = |e: async_nats::Error| {
        CoordinatorError::new(
            CoordinatorErrorKind::Setup,
            format!("starting the API service: {e}"),
        )
    };
    let service = bus
        .client()
        .service_builder()
        .description("Flotilla coordinator API: submit plans, read runs")
        .start(bus.names().service(), env!("CARGO_PKG_VERSION"))
        .await
        .map_err(setup)?;
    let group = service.group(format!("{}.api", bus.names().prefix()));
    let mut submit = group
        .endpoint_builder()
        .name("submit")
        .add(SubmitRequest::ENDPOINT)
        .await
        .map_err(setup)?;
    let mut get = group
        .endpoint_builder()
        .name("run-get")
        .add(GetRunRequest::ENDPOINT)
        .await
        .map_err(setup)?;
    let store = Arc::new(store);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            Some(req) = submit.next() => {
                let intake = Arc::clone(&intake);
                tokio::spawn(async move {
                    let reply_subject = req.message.reply.as_ref().map(ToString::to_string);
                    let now = Timestamp::now().unix_ms();
                    match intake.submit(req.message.headers.as_ref(), &req.message.payload, reply_subject.as_deref(), now).await {
                        Ok(Answer::Now(reply)) => respond_json(&req, &reply).await,
                        Ok(Answer::AtEnd) => {}
                        Err(e) => {
                            warn!(error = %e, "Submission failed");
                            respond_error(&req, 503, "unavailable", e.to_string()).await;
                        }
                    }
                });
            }
            Some(req) = get.next() => {
                let store = Arc::clone(&store);
                tokio::spawn(async move {
                    let parsed = wire::decode::<GetRunRequest>(req.message.headers.as_ref(), &req.message.payload)
                        .and_then(|r| check_protocol(r.protocol).map(|()| r));
                    match parsed {
                        Err(e) => respond_error(&req, 400, "malformed", e.to_string()).await,
                        Ok(r) => match store.view(r.run_id).await {
                            Ok(Some(view)) => respond_json(&req, &view).await,
                            Ok(None) => respond_error(&req, 404, "not_found", format!("run {} does not exist", r.run_id)).await,
                            Err(e) => respond_error(&req, 500, "internal", e.to_string()).await,
                        },
                    }
                });
            }
            else => break,
        }
    }
    let _ = service.stop().await;
    Ok(())
}
