//! Typed messages on NATS: encoding with the right headers, and decoding by `Content-Type`.

use async_nats::HeaderMap;
use async_nats::header::NATS_MESSAGE_ID;
use bytes::Bytes;
use flotilla_model::codec::{CONTENT_TYPE, Codec, CodecError};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{PublishError, PublishErrorKind};

/// W3C trace context header.
pub const TRACEPARENT: &str = "traceparent";

/// Marks a message on a run's submission subject (`<prefix>.submit.<run>`) that is a run-log
/// entry written by a coordinator (`submitted` or `rejected`), not a client's submission.
pub const KIND_HEADER: &str = "Flotilla-Kind";
/// The [`KIND_HEADER`] value of such an entry.
pub const KIND_RUNLOG_ENTRY: &str = "runlog-entry";

/// The header that makes a publish succeed only if it is the first message on its subject
/// (an exact subject: the server checks it in constant time, unlike a wildcard filter).
pub fn expect_first(headers: &mut HeaderMap) {
    headers.insert(async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, "0");
}

/// An encoded message ready to publish.
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// Headers (content type, protocol, message id, trace).
    pub headers: HeaderMap,
    /// Encoded body.
    pub payload: Bytes,
}

/// Encodes `value` with `codec`. `msg_id` becomes `Nats-Msg-Id`, so JetStream drops a
/// repeated publish of the same logical message. JSON, the default, carries no
/// `Content-Type`; MessagePack is marked `Content-Type: application/msgpack`. The protocol
/// version travels in the body's `protocol` field. Every header costs parsing on the server
/// and in each client, on every message, so only meaningful ones are sent.
pub fn encode<T: Serialize + ?Sized>(
    value: &T,
    codec: Codec,
    msg_id: Option<&str>,
) -> Result<Outgoing, PublishError> {
    let payload = codec
        .encode(value)
        .map_err(|e| PublishError::with_source(PublishErrorKind::Encode, "encoding", e))?;
    let mut headers = HeaderMap::new();
    if codec != Codec::Json {
        headers.insert(CONTENT_TYPE, codec.content_type());
    }
    if let Some(id) = msg_id {
        headers.insert(NATS_MESSAGE_ID, id);
    }
    Ok(Outgoing {
        headers,
        payload: Bytes::from(payload),
    })
}

/// The codec a message was written with.
pub fn codec_of(headers: Option<&HeaderMap>) -> Codec {
    Codec::from_content_type(
        headers
            .and_then(|h| h.get(CONTENT_TYPE))
            .map(|v| v.as_str()),
    )
}

/// Decodes a message body according to its `Content-Type`.
pub fn decode<T: DeserializeOwned>(
    headers: Option<&HeaderMap>,
    payload: &[u8],
) -> Result<T, CodecError> {
    codec_of(headers).decode(payload)
}

/// A header value as text.
pub fn header<'a>(headers: Option<&'a HeaderMap>, name: &str) -> Option<&'a str> {
    headers.and_then(|h| h.get(name)).map(|v| v.as_str())
}
