//! Message encodings.
//!
//! JSON is the default. A message with the header `Content-Type: application/msgpack` is
//! MessagePack (maps with field names, so the two encodings carry the same documents). Every
//! Flotilla reader accepts both.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::PROTOCOL_VERSION;
use crate::problem::{Problem, ProblemCode};

/// Deepest nesting any decoder accepts: serde_json's own limit, applied to MessagePack too.
pub const MAX_DECODE_DEPTH: usize = 128;

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

    /// Reads the top-level string fields named in `keys` from a document that may not
    /// decode as a whole (too deep, wrong types elsewhere), without recursion: a message that
    /// failed [`Codec::decode`] still says which run it meant and where to answer.
    pub fn skim_strings(
        self,
        bytes: &[u8],
        keys: &[&str],
    ) -> std::collections::BTreeMap<String, String> {
        match self {
            Self::Json => {
                // serde_json skips unknown values iteratively, at any depth.
                let Ok(map) = serde_json::from_slice::<
                    std::collections::BTreeMap<String, MaybeString>,
                >(bytes) else {
                    return Default::default();
                };
                map.into_iter()
                    .filter(|(k, _)| keys.contains(&k.as_str()))
                    .filter_map(|(k, v)| v.0.map(|v| (k, v)))
                    .collect()
            }
            Self::MsgPack => msgpack::top_level_strings(bytes, keys).unwrap_or_default(),
        }
    }

    /// Decodes a value. Nesting is limited to [`MAX_DECODE_DEPTH`] levels in both codecs, so
    /// no message can exhaust a decoder's stack.
    pub fn decode<T: DeserializeOwned>(self, bytes: &[u8]) -> Result<T, CodecError> {
        let r = match self {
            Self::Json => serde_json::from_slice(bytes).map_err(|e| e.to_string()),
            Self::MsgPack => {
                let mut de = rmp_serde::Deserializer::from_read_ref(bytes);
                de.set_max_depth(MAX_DECODE_DEPTH);
                T::deserialize(&mut de).map_err(|e| e.to_string())
            }
        };
        r.map_err(|message| CodecError::Decode {
            codec: self.name(),
            message,
        })
    }
}

/// Rejects versions of a message type newer than `max` (each message type has its own).
pub fn check_protocol_of(kind: &str, version: u32, max: u32) -> Result<(), CodecError> {
    if version == 0 || version > max {
        Err(CodecError::Decode {
            codec: "message",
            message: format!(
                "{kind} version {version} is not supported (this build reads up to {max})"
            ),
        })
    } else {
        Ok(())
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

/// A JSON value kept when it is a string and skipped (iteratively) otherwise.
struct MaybeString(Option<String>);

impl<'de> Deserialize<'de> for MaybeString {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = MaybeString;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("any value")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<MaybeString, E> {
                Ok(MaybeString(Some(v.to_owned())))
            }
            fn visit_bool<E>(self, _: bool) -> Result<MaybeString, E> {
                Ok(MaybeString(None))
            }
            fn visit_i64<E>(self, _: i64) -> Result<MaybeString, E> {
                Ok(MaybeString(None))
            }
            fn visit_u64<E>(self, _: u64) -> Result<MaybeString, E> {
                Ok(MaybeString(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<MaybeString, E> {
                Ok(MaybeString(None))
            }
            fn visit_unit<E>(self) -> Result<MaybeString, E> {
                Ok(MaybeString(None))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<MaybeString, A::Error> {
                while a.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(MaybeString(None))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<MaybeString, A::Error> {
                while a
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(MaybeString(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// A minimal, iterative MessagePack reader: enough to find top-level string fields of a
/// document of any depth without recursion.
mod msgpack {
    use std::collections::BTreeMap;

    struct Reader<'a> {
        b: &'a [u8],
        pos: usize,
    }

    impl<'a> Reader<'a> {
        fn take(&mut self, n: usize) -> Option<&'a [u8]> {
            let end = self.pos.checked_add(n)?;
            let s = self.b.get(self.pos..end)?;
            self.pos = end;
            Some(s)
        }

        fn byte(&mut self) -> Option<u8> {
            self.take(1).map(|s| s[0])
        }

        fn uint(&mut self, n: usize) -> Option<usize> {
            let s = self.take(n)?;
            Some(s.iter().fold(0usize, |acc, &x| (acc << 8) | usize::from(x)))
        }

        /// Reads one value's header: `Ok(Some(text))` for a string, else skips the value's
        /// own bytes and returns how many nested items follow.
        fn header(&mut self) -> Option<(Option<&'a [u8]>, usize)> {
            let m = self.byte()?;
            let skip = |r: &mut Self, n: usize| r.take(n).map(|_| (None, 0));
            match m {
                0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => Some((None, 0)),
                0x80..=0x8f => Some((None, 2 * usize::from(m & 0x0f))),
                0x90..=0x9f => Some((None, usize::from(m & 0x0f))),
                0xa0..=0xbf => self.take(usize::from(m & 0x1f)).map(|s| (Some(s), 0)),
                0xd9 => {
                    let n = self.uint(1)?;
                    self.take(n).map(|s| (Some(s), 0))
                }
                0xda => {
                    let n = self.uint(2)?;
                    self.take(n).map(|s| (Some(s), 0))
                }
                0xdb => {
                    let n = self.uint(4)?;
                    self.take(n).map(|s| (Some(s), 0))
                }
                0xc4 => {
                    let n = self.uint(1)?;
                    skip(self, n)
                }
                0xc5 => {
                    let n = self.uint(2)?;
                    skip(self, n)
                }
                0xc6 => {
                    let n = self.uint(4)?;
                    skip(self, n)
                }
                0xc7 => {
                    let n = self.uint(1)?;
                    skip(self, n + 1)
                }
                0xc8 => {
                    let n = self.uint(2)?;
                    skip(self, n + 1)
                }
                0xc9 => {
                    let n = self.uint(4)?;
                    skip(self, n + 1)
                }
                0xca | 0xce | 0xd2 => skip(self, 4),
                0xcb | 0xcf | 0xd3 => skip(self, 8),
                0xcc | 0xd0 => skip(self, 1),
                0xcd | 0xd1 => skip(self, 2),
                0xd4 => skip(self, 2),
                0xd5 => skip(self, 3),
                0xd6 => skip(self, 5),
                0xd7 => skip(self, 9),
                0xd8 => skip(self, 17),
                0xdc => Some((None, self.uint(2)?)),
                0xdd => Some((None, self.uint(4)?)),
                0xde => Some((None, 2 * self.uint(2)?)),
                0xdf => Some((None, 2usize.checked_mul(self.uint(4)?)?)),
                0xc1 => None,
            }
        }

        /// Skips one complete value, iteratively.
        fn skip_value(&mut self) -> Option<()> {
            let mut pending: usize = 1;
            while pending > 0 {
                pending -= 1;
                let (_, nested) = self.header()?;
                pending = pending.checked_add(nested)?;
            }
            Some(())
        }
    }

    /// The top-level map's string values under `keys`.
    pub(super) fn top_level_strings(
        bytes: &[u8],
        keys: &[&str],
    ) -> Option<BTreeMap<String, String>> {
        let mut r = Reader { b: bytes, pos: 0 };
        let m = r.byte()?;
        let entries = match m {
            0x80..=0x8f => usize::from(m & 0x0f),
            0xde => r.uint(2)?,
            0xdf => r.uint(4)?,
            _ => return None,
        };
        let mut out = BTreeMap::new();
        for _ in 0..entries {
            let (key, nested) = r.header()?;
            let Some(key) = key.filter(|_| nested == 0) else {
                return Some(out);
            };
            let key = String::from_utf8_lossy(key).into_owned();
            let at = r.pos;
            match r.header()? {
                (Some(text), 0) if keys.contains(&key.as_str()) => {
                    out.insert(key, String::from_utf8_lossy(text).into_owned());
                }
                _ => {
                    r.pos = at;
                    r.skip_value()?;
                }
            }
        }
        Some(out)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn finds_top_level_strings_beside_deep_values() {
            #[derive(serde::Serialize)]
            struct Doc<'a> {
                n: u64,
                plan: serde_json::Value,
                run_id: &'a str,
                bin: serde_bytes_shim::Bytes,
                reply_to: &'a str,
            }
            mod serde_bytes_shim {
                pub(super) struct Bytes;
                impl serde::Serialize for Bytes {
                    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                        s.serialize_bytes(&[1, 2, 3])
                    }
                }
            }
            let doc = Doc {
                n: 1 << 40,
                plan: serde_json::json!({"a": [1, -5, 2.5, null, true, "x", {"b": []}]}),
                run_id: "abc",
                bin: serde_bytes_shim::Bytes,
                reply_to: "x.y",
            };
            let mut bytes = rmp_serde::to_vec_named(&doc).expect("encode");
            let found = top_level_strings(&bytes, &["run_id", "reply_to"]).expect("readable");
            assert_eq!(found.get("run_id").map(String::as_str), Some("abc"));
            assert_eq!(found.get("reply_to").map(String::as_str), Some("x.y"));
            // A value nested 100,000 levels deep is skipped without recursion.
            let mut deep = vec![0x82u8];
            deep.extend(rmp_serde::to_vec(&"plan").expect("key"));
            deep.extend(std::iter::repeat_n(0x91u8, 100_000));
            deep.push(0x01);
            deep.extend(rmp_serde::to_vec(&"run_id").expect("key"));
            deep.extend(rmp_serde::to_vec(&"r1").expect("value"));
            let found = top_level_strings(&deep, &["run_id"]).expect("readable");
            assert_eq!(found.get("run_id").map(String::as_str), Some("r1"));
            // Truncated input is refused, not a panic.
            bytes.truncate(bytes.len() / 2);
            let _ = top_level_strings(&bytes, &["reply_to"]);
        }
    }
}
