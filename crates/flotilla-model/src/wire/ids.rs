//! Typed identifiers.
//!
//! Every id that Flotilla mints is a UUIDv7 wrapped in its own newtype, so a run id can never
//! be passed where an attempt id is expected, and ids sort by creation time. Task ids are the
//! exception: they are chosen by the client inside a plan (`fetch_data`, `synthesis`) and are
//! validated as subject-safe tokens by [`crate::validate`].

use std::fmt;
use std::str::FromStr;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// An id string that is not a UUID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{input}` is not a valid {kind}: expected a UUID such as 0190f0c4-8a3e-7cc1-9a39-6f1c1b7d2e11"
)]
pub struct IdParseError {
    /// Which id type was being parsed.
    pub kind: &'static str,
    /// The rejected input.
    pub input: String,
}

macro_rules! uuid_id {
    ($(#[$meta:meta])* $name:ident, $kind:literal) => {
        $(#[$meta])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, JsonSchema)]
        #[schemars(transparent)]
        pub struct $name(Uuid);

        /// Always the canonical text form (lower-case, hyphenated), in JSON and MessagePack
        /// alike, so a document means the same in both codecs.
        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let mut buf = Uuid::encode_buffer();
                s.serialize_str(self.0.hyphenated().encode_lower(&mut buf))
            }
        }

        /// Accepts the text form in every codec, and the 16-byte binary form that MessagePack
        /// writers of UUIDs produce.
        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                d.deserialize_any(UuidVisitor($kind)).map(Self)
            }
        }

        impl $name {
            /// A fresh, time-ordered (UUIDv7) id.
            pub fn new() -> Self {
                Self(Uuid::now_v7())
            }

            /// Wraps an existing UUID (for example one chosen by a client).
            pub const fn from_uuid(uuid: Uuid) -> Self {
                Self(uuid)
            }

            /// The underlying UUID.
            pub const fn as_uuid(&self) -> &Uuid {
                &self.0
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0.hyphenated(), f)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({})"), self.0.hyphenated())
            }
        }

        impl FromStr for $name {
            type Err = IdParseError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Uuid::parse_str(s.trim()).map(Self).map_err(|_| IdParseError {
                    kind: $kind,
                    input: s.to_owned(),
                })
            }
        }
    };
}

uuid_id!(
    /// One execution of a plan or of an agent: the node of the run tree.
    RunId,
    "run id"
);
uuid_id!(
    /// One attempt at one task of a run (a retry gets a new attempt id).
    AttemptId,
    "attempt id"
);
uuid_id!(
    /// A persistent agent identity (teammate, recruited member, run owner).
    AgentId,
    "agent id"
);
uuid_id!(
    /// Groups the runs of one conversation or job.
    SessionId,
    "session id"
);
uuid_id!(
    /// A request for human approval.
    EscalationId,
    "escalation id"
);

/// Reads a UUID from a string or from 16 bytes.
struct UuidVisitor(&'static str);

impl<'de> serde::de::Visitor<'de> for UuidVisitor {
    type Value = Uuid;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "a {} (a UUID string such as 0190f0c4-8a3e-7cc1-9a39-6f1c1b7d2e11)",
            self.0
        )
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Uuid, E> {
        Uuid::parse_str(v.trim()).map_err(|_| E::custom(format!("`{v}` is not a valid {}", self.0)))
    }

    fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Uuid, E> {
        Uuid::from_slice(v).map_err(|_| {
            E::custom(format!(
                "a {} in binary form must be 16 bytes, got {}",
                self.0,
                v.len()
            ))
        })
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Uuid, A::Error> {
        // Some MessagePack writers encode byte strings as arrays of integers.
        let mut bytes = [0u8; 16];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = seq
                .next_element()?
                .ok_or_else(|| serde::de::Error::invalid_length(i, &self))?;
        }
        if seq.next_element::<u8>()?.is_some() {
            return Err(serde::de::Error::invalid_length(17, &self));
        }
        Ok(Uuid::from_bytes(bytes))
    }
}

/// A task id inside a plan, chosen by the client (`fetch_data`).
///
/// Deserialisation accepts any string so that plan validation can report
/// every invalid id at once; use the validator before trusting it as a subject token.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(transparent)]
pub struct TaskId(String);

impl TaskId {
    /// Wraps a string without validating it.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TaskId({:?})", self.0)
    }
}

impl From<&str> for TaskId {
    fn from(s: &str) -> Self {
        Self(s.to_owned())
    }
}

impl std::borrow::Borrow<str> for TaskId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

/// A run id derived from `run` and `salt`: a UUIDv7 with `run`'s timestamp (so it sorts next
/// to it) and bits hashed from both — the same on every coordinator, client and replay. The
/// rollback run of a run, a fork of it for one variant, are such ids.
pub fn derived_run_id(run: RunId, salt: u64) -> RunId {
    let bytes = run.as_uuid().as_bytes();
    let hi = u64::from_le_bytes(bytes[..8].try_into().unwrap_or([0; 8]));
    let lo = u64::from_le_bytes(bytes[8..].try_into().unwrap_or([0; 8]));
    let a = splitmix64(hi ^ salt);
    let b = splitmix64(lo ^ a);
    let mut random = [0u8; 10];
    random[..8].copy_from_slice(&a.to_le_bytes());
    random[8..].copy_from_slice(&b.to_le_bytes()[..2]);
    let ms = run
        .as_uuid()
        .get_timestamp()
        .map(|t| {
            let (secs, nanos) = t.to_unix();
            secs * 1000 + u64::from(nanos) / 1_000_000
        })
        .unwrap_or(0);
    RunId::from_uuid(uuid::Builder::from_unix_timestamp_millis(ms, &random).into_uuid())
}

/// splitmix64 finaliser: a cheap, well-mixed hash step, for ids and jitter derived
/// deterministically from other ids (the same on every coordinator and replay).
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_v7_and_round_trip_through_text() {
        let id = RunId::new();
        assert_eq!(id.as_uuid().get_version_num(), 7);
        let back: RunId = id.to_string().parse().expect("parse");
        assert_eq!(back, id);
    }

    #[test]
    fn bad_id_names_its_kind() {
        let err = "nope".parse::<AttemptId>().expect_err("must fail");
        assert_eq!(err.kind, "attempt id");
    }

    #[test]
    fn msgpack_accepts_text_and_binary_ids() {
        let id = RunId::new();
        // Written by Flotilla: the text form.
        let packed = rmp_serde::to_vec(&id).expect("encode");
        let text: String = rmp_serde::from_slice(&packed).expect("a string");
        assert_eq!(text, id.to_string());
        // A foreign writer's text form and binary form both read back.
        let from_text: RunId =
            rmp_serde::from_slice(&rmp_serde::to_vec(&id.to_string()).expect("encode"))
                .expect("text");
        assert_eq!(from_text, id);
        let from_bin: RunId = rmp_serde::from_slice(
            &rmp_serde::to_vec(&serde_bytes_like(id.as_uuid().as_bytes())).expect("encode"),
        )
        .expect("binary");
        assert_eq!(from_bin, id);
        let bad = rmp_serde::from_slice::<RunId>(&rmp_serde::to_vec("nope").expect("encode"));
        assert!(bad.expect_err("invalid").to_string().contains("run id"));
    }

    /// A value that MessagePack encodes as `bin`.
    fn serde_bytes_like(b: &[u8]) -> Bin<'_> {
        Bin(b)
    }

    struct Bin<'a>(&'a [u8]);

    impl Serialize for Bin<'_> {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(self.0)
        }
    }

    #[test]
    fn ids_serialise_as_plain_strings() {
        let id = RunId::new();
        let json = serde_json::to_string(&id).expect("json");
        assert_eq!(json, format!("\"{id}\""));
    }
}
