//! `{key}` / `{key?}` placeholders filled from session state: the coordinator's rule for
//! task descriptions and the LLM agent's for its instruction, kept in one place so the two
//! can never read the same text differently.

use std::collections::HashMap;

/// The `{key}` and `{key?}` placeholders of `text`, in order (`true`: optional): a key is a
/// state-key name (letters, digits, `_`, `-`). Other braces (JSON, prose) are left alone.
pub fn placeholders(text: &str) -> Vec<(&str, bool)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        let name_len = after
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
            .unwrap_or(after.len());
        let (name, tail) = after.split_at(name_len);
        let (optional, tail) = match tail.strip_prefix('?') {
            Some(t) => (true, t),
            None => (false, tail),
        };
        if !name.is_empty() && tail.starts_with('}') {
            out.push((name, optional));
            rest = &tail[1..];
        } else {
            rest = after;
        }
    }
    out
}

/// Replaces the placeholders found by [`placeholders`] with their values.
pub fn fill(text: &str, values: &HashMap<&str, String>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let name_len = after
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
            .unwrap_or(after.len());
        let (name, tail) = after.split_at(name_len);
        let tail_after_mark = tail.strip_prefix('?').unwrap_or(tail);
        match (values.get(name), tail_after_mark.strip_prefix('}')) {
            (Some(v), Some(next)) if !name.is_empty() => {
                out.push_str(v);
                rest = next;
            }
            _ => {
                out.push('{');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_state_key_names_in_braces() {
        let text = r#"Compare {growth} with {margin?}; return {"json": 1} or {not a key} {x-y}"#;
        assert_eq!(
            placeholders(text),
            vec![("growth", false), ("margin", true), ("x-y", false)]
        );
        let values: HashMap<&str, String> = [
            ("growth", "6.7%".to_string()),
            ("margin", String::new()),
            ("x-y", "z".to_string()),
        ]
        .into_iter()
        .collect();
        assert_eq!(
            fill(text, &values),
            r#"Compare 6.7% with ; return {"json": 1} or {not a key} z"#
        );
        assert!(placeholders("no braces { here").is_empty());
        assert_eq!(fill("tail {", &values), "tail {");
    }

    #[test]
    fn placeholders_fill_from_values() {
        let text = "Work for {customer} on {topic?}; keep {\"json\": 1}";
        assert_eq!(
            placeholders(text),
            vec![("customer", false), ("topic", true)]
        );
        let mut values = HashMap::new();
        values.insert("customer", "ACME".to_string());
        values.insert("topic", String::new());
        assert_eq!(fill(text, &values), "Work for ACME on ; keep {\"json\": 1}");
    }
}
