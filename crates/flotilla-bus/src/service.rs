//! Answering requests of a NATS micro service the way every Flotilla API does: JSON (or
//! MessagePack) bodies with a protocol version, errors as an `ApiError` body with the
//! micro-service headers `Nats-Service-Error` and `Nats-Service-Error-Code`. The coordinator's
//! API and the supervisor's share these, so a client meets one convention.

use async_nats::HeaderMap;
use async_nats::service::Request;
use bytes::Bytes;
use flotilla_model::ErrorCode;
use flotilla_model::api::{ApiError, HasProtocol};
use flotilla_model::codec::{CodecError, check_protocol};
use serde::de::DeserializeOwned;

use crate::wire;

/// Answers with an error: `status`, a machine-readable `code` and a message.
pub async fn respond_error(req: &Request, status: u16, code: ErrorCode, message: String) {
    respond_api_error(req, &ApiError::new(status, code, message)).await;
}

/// Answers with an `ApiError` body and the micro-service error headers.
pub async fn respond_api_error(req: &Request, body: &ApiError) {
    let mut headers = HeaderMap::new();
    // Header values cannot hold line breaks.
    headers.insert(
        "Nats-Service-Error",
        body.message.replace(['\r', '\n'], " ").as_str(),
    );
    headers.insert("Nats-Service-Error-Code", body.status.to_string().as_str());
    headers.insert(
        flotilla_model::codec::CONTENT_TYPE,
        flotilla_model::codec::JSON,
    );
    let payload = serde_json::to_vec(body).unwrap_or_default();
    let _ = req
        .respond_with_headers(Ok(Bytes::from(payload)), headers)
        .await;
}

/// Answers `value` as JSON, or `413 too_large` when it would not fit `max_payload` (the
/// message says what to ask for instead: `too_large_hint`).
pub async fn respond_json<T: serde::Serialize>(
    req: &Request,
    max_payload: usize,
    value: &T,
    too_large_hint: &str,
) {
    match wire::encode(value, flotilla_model::codec::Codec::Json, None) {
        Ok(out) if out.payload.len() > max_payload => {
            respond_error(
                req,
                413,
                ErrorCode::TooLarge,
                format!(
                    "the answer is {} bytes, more than this deployment's max payload of {max_payload}; {too_large_hint}",
                    out.payload.len()
                ),
            )
            .await;
        }
        Ok(out) => {
            let _ = req.respond_with_headers(Ok(out.payload), out.headers).await;
        }
        Err(e) => respond_error(req, 500, ErrorCode::Internal, e.to_string()).await,
    }
}

/// Decodes a request body (JSON or MessagePack) and checks its protocol version; answers
/// `400 malformed` (or `400 unsupported_protocol`) and returns `None` when it is not a valid
/// request.
pub async fn parse<T: DeserializeOwned + HasProtocol>(req: &Request) -> Option<T> {
    let parsed = wire::decode::<T>(req.message.headers.as_ref(), &req.message.payload)
        .and_then(|r| check_protocol(r.protocol()).map(|()| r));
    match parsed {
        Ok(r) => Some(r),
        Err(e) => {
            let code = match e {
                CodecError::UnsupportedProtocol { .. } => ErrorCode::UnsupportedProtocol,
                _ => ErrorCode::Malformed,
            };
            respond_error(req, 400, code, e.to_string()).await;
            None
        }
    }
}

/// The header nats-server stamps on a request that crossed a service import marked
/// `share: true` — another account's user calling this one's API — with who sent it.
pub const REQUEST_INFO: &str = "Nats-Request-Info";

/// Longest NATS user name taken from [`REQUEST_INFO`].
const MAX_REQUESTER: usize = 256;

/// Who sent `req`, as the NATS server says: the `user` of its [`REQUEST_INFO`] header
/// (a user name, an NKey or a JWT user's public key), when there is one.
///
/// The server stamps the header itself on requests that reach this account through a shared
/// service import (`share: true`, e.g. the people's account of `deploy/nats/accounts.conf`),
/// replacing anything the client sent, so across the import the name cannot be claimed:
/// Flotilla records it as who answered or acted, whatever the request's own `by` says. A
/// request from inside the account normally carries no header, and its `by` stands; a caller
/// there could write the header itself, so deployments give people users of the importing
/// account (`deploy/nats/accounts.conf`: PEOPLE). A bare token login is `[REDACTED]` by the
/// server and names nobody.
pub fn requester(req: &Request) -> Option<String> {
    let value = req.message.headers.as_ref()?.get(REQUEST_INFO)?;
    let info: serde_json::Value = serde_json::from_str(value.as_str()).ok()?;
    let user = info.get("user")?.as_str()?.trim();
    let usable = !user.is_empty()
        && user != "[REDACTED]"
        && user.len() <= MAX_REQUESTER
        && !user.chars().any(char::is_control);
    usable.then(|| user.to_owned())
}
