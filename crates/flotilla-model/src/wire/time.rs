//! Durations and timestamps on the wire.
//!
//! Durations are written as a number of seconds (`360`, `0.25`) so clients in any language can
//! produce them, and are also accepted as humantime strings (`"6m"`, `"500ms"`). Timestamps
//! are RFC 3339 strings in UTC.

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// A duration serialised as seconds (number) and parsed from seconds or a humantime string.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Secs(pub Duration);

impl Secs {
    /// Whole seconds.
    pub const fn from_secs(secs: u64) -> Self {
        Self(Duration::from_secs(secs))
    }

    /// Milliseconds.
    pub const fn from_millis(ms: u64) -> Self {
        Self(Duration::from_millis(ms))
    }

    /// The wrapped duration.
    pub const fn get(self) -> Duration {
        self.0
    }
}

impl fmt::Debug for Secs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl From<Duration> for Secs {
    fn from(d: Duration) -> Self {
        Self(d)
    }
}

impl Serialize for Secs {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0.subsec_nanos() == 0 {
            s.serialize_u64(self.0.as_secs())
        } else {
            s.serialize_f64(self.0.as_secs_f64())
        }
    }
}

impl<'de> Deserialize<'de> for Secs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Secs;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "a duration: seconds as a number, or a string such as \"90s\" or \"6m\"",
                )
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Secs, E> {
                Ok(Secs(Duration::from_secs(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Secs, E> {
                u64::try_from(v)
                    .map(|v| Secs(Duration::from_secs(v)))
                    .map_err(|_| E::custom("a duration cannot be negative"))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Secs, E> {
                Duration::try_from_secs_f64(v).map(Secs).map_err(|_| {
                    E::custom("a duration must be a finite, non-negative number of seconds")
                })
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Secs, E> {
                humantime::parse_duration(v.trim())
                    .map(Secs)
                    .map_err(|e| E::custom(format!("invalid duration {v:?}: {e}")))
            }
        }
        d.deserialize_any(V)
    }
}

impl JsonSchema for Secs {
    fn schema_name() -> Cow<'static, str> {
        "Seconds".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "A duration: seconds as a number, or a humantime string such as \"90s\" or \"6m\".",
            "oneOf": [
                { "type": "number", "minimum": 0 },
                { "type": "string" }
            ]
        })
    }
}

/// A UTC instant, serialised as an RFC 3339 string.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub OffsetDateTime);

impl Timestamp {
    /// Now, by this machine's clock. Decisions never depend on it: the coordinator uses
    /// JetStream server timestamps instead (DESIGN invariant 5).
    pub fn now() -> Self {
        Self(OffsetDateTime::now_utc())
    }

    /// From Unix milliseconds.
    pub fn from_unix_ms(ms: i64) -> Self {
        Self(
            OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
                .unwrap_or(OffsetDateTime::UNIX_EPOCH),
        )
    }

    /// Unix milliseconds.
    pub fn unix_ms(&self) -> i64 {
        (self.0.unix_timestamp_nanos() / 1_000_000) as i64
    }

    /// RFC 3339 text.
    pub fn to_rfc3339(&self) -> String {
        self.0.format(&Rfc3339).unwrap_or_default()
    }
}

impl fmt::Debug for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_rfc3339())
    }
}

/// What a person reads: RFC 3339 in UTC with milliseconds always (`2026-11-28T08:31:20.200Z`),
/// so times line up in columns; the wire keeps full precision ([`Timestamp::to_rfc3339`]).
impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = self.0.to_offset(time::UtcOffset::UTC);
        write!(
            f,
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second(),
            t.millisecond()
        )
    }
}

impl From<OffsetDateTime> for Timestamp {
    fn from(t: OffsetDateTime) -> Self {
        Self(t)
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let text = self.0.format(&Rfc3339).map_err(serde::ser::Error::custom)?;
        s.serialize_str(&text)
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = Cow::<str>::deserialize(d)?;
        OffsetDateTime::parse(&text, &Rfc3339)
            .map(|t| Self(t.to_offset(time::UtcOffset::UTC)))
            .map_err(|e| de::Error::custom(format!("invalid RFC 3339 timestamp {text:?}: {e}")))
    }
}

impl JsonSchema for Timestamp {
    fn schema_name() -> Cow<'static, str> {
        "Timestamp".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({ "type": "string", "format": "date-time" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secs_accepts_numbers_and_strings() {
        let a: Secs = serde_json::from_str("360").expect("int");
        let b: Secs = serde_json::from_str("\"6m\"").expect("str");
        let c: Secs = serde_json::from_str("0.25").expect("float");
        assert_eq!(a, b);
        assert_eq!(c.get(), Duration::from_millis(250));
        assert!(serde_json::from_str::<Secs>("-1").is_err());
        assert!(serde_json::from_str::<Secs>("\"soon\"").is_err());
        assert_eq!(serde_json::to_string(&a).expect("ser"), "360");
    }

    #[test]
    fn a_person_reads_milliseconds_always() {
        for (ms, shown) in [
            (1_700_000_000_000, "2023-11-14T22:13:20.000Z"),
            (1_700_000_000_200, "2023-11-14T22:13:20.200Z"),
            (1_700_000_000_215, "2023-11-14T22:13:20.215Z"),
        ] {
            assert_eq!(Timestamp::from_unix_ms(ms).to_string(), shown);
        }
    }

    #[test]
    fn timestamp_round_trip() {
        let t = Timestamp::from_unix_ms(1_700_000_000_123);
        let json = serde_json::to_string(&t).expect("ser");
        let back: Timestamp = serde_json::from_str(&json).expect("de");
        assert_eq!(back.unix_ms(), 1_700_000_000_123);
    }
}
