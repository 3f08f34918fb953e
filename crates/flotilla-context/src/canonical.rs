//! Deterministic message ids: the same logical write of the same attempt always gets the same
//! `Nats-Msg-Id`, so JetStream stores it once however often a redelivered attempt repeats it.

use serde_json::Value;
use sha2::{Digest, Sha256};

/// Writes `value` as JSON with object keys sorted at every level: one text per value, whatever
/// order the keys were inserted in.
pub(crate) fn canonical_json(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push(b'{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_string(k, out);
                out.push(b':');
                if let Some(v) = map.get(k) {
                    canonical_json(v, out);
                }
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                canonical_json(v, out);
            }
            out.push(b']');
        }
        other => out.extend_from_slice(other.to_string().as_bytes()),
    }
}

fn write_string(s: &str, out: &mut Vec<u8>) {
    out.extend_from_slice(Value::from(s).to_string().as_bytes());
}

/// The first 16 hex digits of the SHA-256 of `parts`, each canonicalised and separated, so
/// `("ab", "c")` and `("a", "bc")` differ.
pub(crate) fn digest16(parts: &[&Value]) -> String {
    let mut buf = Vec::new();
    for p in parts {
        canonical_json(p, &mut buf);
        buf.push(0);
    }
    let hash = Sha256::digest(&buf);
    hex(&hash[..8])
}

/// Lower-case hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn key_order_does_not_matter() {
        let a: Value =
            serde_json::from_str(r#"{"b": 1, "a": {"y": [1, "x"], "x": null}}"#).expect("json");
        let b: Value =
            serde_json::from_str(r#"{"a": {"x": null, "y": [1, "x"]}, "b": 1}"#).expect("json");
        assert_eq!(digest16(&[&a]), digest16(&[&b]));
        assert_eq!(digest16(&[&a]).len(), 16);
        assert_ne!(
            digest16(&[&json!("ab"), &json!("c")]),
            digest16(&[&json!("a"), &json!("bc")])
        );
        let mut out = Vec::new();
        canonical_json(&b, &mut out);
        assert_eq!(
            String::from_utf8(out).expect("utf8"),
            r#"{"a":{"x":null,"y":[1,"x"]},"b":1}"#
        );
    }
}
