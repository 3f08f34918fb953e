//! Message encodings.
//!
//! JSON is the default. A message with the header `Content-Type: application/msgpack` is
//! MessagePack (maps with field names, so the two encodings carry the same documents). Every
//! Flotilla reader accepts both.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::PROTOCOL_VERSION;
use crate::validate::{Problem, ProblemCode};

/// The header naming the encoding.
pub const CONTENT_TYPE: &str = "Content-Type";
/// JSON content type.
pub const JSON: &str = "application/json";
/// MessagePack content type.
pub const MSGPACK: &str = "application/msgpack";

/// An encoding.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Codec {
    /// JSON (default).
    #[default]
    Json,
    /// MessagePack.
    MsgPack,
}

/// Encoding or decoding failed.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The value could not be encoded.
    #[error("cannot encode as {codec}: {message}")]
    Encode {
        /// Codec name.
        codec: &'static str,
        /// Detail.
        message: String,
    },
    /// The bytes are not a valid document of the expected type.
    #[error("malformed {codec} message: {message}")]
    Decode {
        /// Codec name.
        codec: &'static str,
        /// Detail (what field, what line).
        message: String,
    },
    /// The message's protocol version is not spoken here.
    #[error("protocol version {got} is not supported (this build speaks {PROTOCOL_VERSION})")]
    UnsupportedProtocol {
        /// The version in the message.
        got: u32,
    },
}

impl CodecError {
    /// The error as a validation problem for structured rejections.
    pub fn to_problem(&self) -> Problem {
        let code = match self {
            Self::UnsupportedProtocol { .. } => ProblemCode::UnsupportedProtocol,
            _ => ProblemCode::Malformed,
        };
        Problem::new(code, "", self.to_string())
    }
}

impl Codec {
    /// Picks the codec from a `Content-Type` header value (JSON when absent or unknown).
    pub fn from_content_type(value: Option<&str>) -> Self {
        match value.map(str::trim) {
            Some(v)
                if v.eq_ignore_ascii_case(MSGPACK)
                    || v.eq_ignore_ascii_case("application/x-msgpack") =>
            {
                Self::MsgPack
            }
            _ => Self::Json,
        }
    }

    /// The `Content-Type` value.
    pub fn content_type(self) -> &'static str {
        match self {
            Self::Json => JSON,
            Self::MsgPack => MSGPACK,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Json => "JSON",
            Self::MsgPack => "MessagePack",
        }
    }

    /// Encodes a value.
    pub fn encode<T: Serialize + ?Sized>(self, value: &T) -> Result<Vec<u8>, CodecError> {
        let r = match self {
            Self::Json => serde_json::to_vec(value).map_err(|e| e.to_string()),
            Self::MsgPack => rmp_serde::to_vec_named(value).map_err(|e| e.to_string()),
        };
        r.map_err(|message| CodecError::Encode {
            codec: self.name(),
            message,
        })
    }

    /// Decodes a value.
    pub fn decode<T: DeserializeOwned>(self, bytes: &[u8]) -> Result<T, CodecError> {
        let r = match self {
            Self::Json => serde_json::from_slice(bytes).map_err(|e| e.to_string()),
            Self::MsgPack => rmp_serde::from_slice(bytes).map_err(|e| e.to_string()),
        };
        r.map_err(|message| CodecError::Decode {
            codec: self.name(),
            message,
        })
    }
}

/// Rejects protocol versions this build does not speak (0 or newer than
/// [`PROTOCOL_VERSION`]).
pub fn check_protocol(version: u32) -> Result<(), CodecError> {
    if version == 0 || version > PROTOCOL_VERSION {
        Err(CodecError::UnsupportedProtocol { got: version })
    } else {
        Ok(())
    }
}
