//! Session state (the ADK's shared state): small JSON values shared by the runs of a session,
//! in KV bucket `<prefix>-state` under `<session>.<key>`.
//!
//! * Keys use letters, digits, `_` and `-`, at most 128 bytes (`invalid_key`).
//! * Values are JSON, at most 256 KiB encoded (`value_too_large`).
//! * Every write returns the key's new revision; [`State::compare_and_set`] writes only if the
//!   key is still at the revision the caller read (0: only if it does not exist), and a lost
//!   race is a `conflict` carrying the current revision — the way parallel writers avoid
//!   overwriting each other.
//! * Reads return the server's write time, never a worker's clock.
//! * Keys starting with `_` are Flotilla's own (a tool approved for the session,
//!   `_grant.<tool>`): everyone reads them, only Flotilla writes them
//!   ([`State::grant_tool`], [`State::revoke_tool`]); `set`, `compare_and_set` and `delete`
//!   refuse them (`invalid_key`), so an agent cannot approve its own tools.

use std::collections::BTreeMap;

use async_nats::jetstream::kv::{CreateErrorKind, Operation, UpdateErrorKind};
use bytes::Bytes;
use flotilla_model::state::{MAX_KEY_LEN, MAX_VALUE_BYTES, StateValue};
use flotilla_model::subjects::Bucket;
use flotilla_model::time::Timestamp;
use serde_json::Value;

use crate::Clients;
use crate::error::{ContextError, ErrorKind, unavailable};

/// Checks a state key: letters, digits, `_` and `-`, 1 to 128 bytes.
pub fn check_key(key: &str) -> Result<(), ContextError> {
    let invalid = |why: String| ContextError::new(ErrorKind::InvalidKey, why);
    if key.is_empty() {
        return Err(invalid("the key is empty".into()));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(invalid(format!(
            "key {key:?} is {} bytes; keys hold at most {MAX_KEY_LEN}",
            key.len()
        )));
    }
    if let Some(c) = key
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-'))
    {
        return Err(invalid(format!(
            "key {key:?} contains {c:?}; keys may only use letters, digits, `_` and `-`"
        )));
    }
    Ok(())
}

/// Session state of one session.
#[derive(Debug, Clone)]
pub struct State {
    c: Clients,
}

impl State {
    pub(crate) fn new(c: Clients) -> Self {
        Self { c }
    }

    /// The session this state belongs to.
    pub fn session(&self) -> &str {
        &self.c.scope().session
    }

    fn full_key(&self, key: &str) -> Result<String, ContextError> {
        check_key(key)?;
        let scope = self.c.scope();
        Ok(scope.names.state_key(&scope.session, key))
    }

    /// The key, for a write by an agent or a client: not one of Flotilla's own.
    fn writable_key(&self, key: &str) -> Result<String, ContextError> {
        if key.starts_with(flotilla_model::approval::RESERVED_STATE_PREFIX) {
            return Err(ContextError::new(
                ErrorKind::InvalidKey,
                format!(
                    "key {key:?} starts with `_`: such keys are Flotilla's own (tools approved for the session); read them, revoke a grant with `flotilla approvals revoke`"
                ),
            ));
        }
        self.full_key(key)
    }

    /// The value stored under bucket key `full`, unless it is unset or deleted.
    async fn current(
        &self,
        full: &str,
    ) -> Result<Option<async_nats::jetstream::kv::Entry>, ContextError> {
        let kv = self.c.state_kv().await?;
        let entry = kv
            .entry(full)
            .await
            .map_err(|e| unavailable(format!("reading state {full}"), e))?;
        Ok(entry.filter(|e| e.operation == Operation::Put))
    }

    /// The bucket key of `tool`'s grant in this session (`<session>._grant.<tool>`).
    fn grant_full_key(&self, tool: &str) -> Result<String, ContextError> {
        if !flotilla_model::plan::is_tool_name(tool) {
            return Err(ContextError::new(
                ErrorKind::InvalidKey,
                format!("{tool:?} is not a tool name (1 to 64 letters, digits, `_` or `-`)"),
            ));
        }
        let scope = self.c.scope();
        Ok(scope
            .names
            .state_key(&scope.session, &flotilla_model::approval::grant_key(tool)))
    }

    /// The grant of `tool` in this session, if a person approved it for the session. A value
    /// that is not a grant is no grant (the call waits for a person).
    pub async fn tool_grant(
        &self,
        tool: &str,
    ) -> Result<Option<flotilla_model::approval::ToolGrant>, ContextError> {
        let full = self.grant_full_key(tool)?;
        let Some(entry) = self.current(&full).await? else {
            return Ok(None);
        };
        match serde_json::from_slice(&entry.value) {
            Ok(g) => Ok(Some(g)),
            Err(e) => {
                tracing::warn!(key = %full, error = %e, "A grant key holds no grant; ignored");
                Ok(None)
            }
        }
    }

    /// Records that `grant.tool` is approved for the rest of this session.
    pub async fn grant_tool(
        &self,
        grant: &flotilla_model::approval::ToolGrant,
    ) -> Result<u64, ContextError> {
        let full = self.grant_full_key(&grant.tool)?;
        let value = serde_json::to_vec(grant).map_err(|e| {
            ContextError::with_source(ErrorKind::Malformed, "encoding a tool grant", e)
        })?;
        let kv = self.c.state_kv().await?;
        kv.put(&full, value.into())
            .await
            .map_err(|e| unavailable(format!("writing state {full}"), e))
    }

    /// Withdraws `tool`'s grant in this session; returns it (`None`: there was none). A value
    /// there that is not a grant is deleted too.
    pub async fn revoke_tool(
        &self,
        tool: &str,
    ) -> Result<Option<flotilla_model::approval::ToolGrant>, ContextError> {
        let full = self.grant_full_key(tool)?;
        let Some(entry) = self.current(&full).await? else {
            return Ok(None);
        };
        self.c
            .state_kv()
            .await?
            .delete(&full)
            .await
            .map_err(|e| unavailable(format!("deleting state {full}"), e))?;
        Ok(serde_json::from_slice(&entry.value).ok().or_else(|| {
            Some(flotilla_model::approval::ToolGrant {
                tool: tool.to_owned(),
                by: "unknown (the value was not a grant)".into(),
                run_id: flotilla_model::ids::RunId::from_uuid(uuid::Uuid::nil()),
                approval_id: String::new(),
                at: Timestamp::from(entry.created),
                comment: None,
            })
        }))
    }

    /// Every tool granted in this session (values that are not grants are skipped).
    pub async fn tool_grants(
        &self,
    ) -> Result<Vec<flotilla_model::approval::ToolGrant>, ContextError> {
        let mut out = Vec::new();
        for key in self.list().await? {
            if let Some(tool) = key.strip_prefix(flotilla_model::approval::GRANT_PREFIX)
                && let Ok(Some(g)) = self.tool_grant(tool).await
            {
                out.push(g);
            }
        }
        Ok(out)
    }

    fn encode(&self, key: &str, value: &Value) -> Result<Bytes, ContextError> {
        let bytes = serde_json::to_vec(value).map_err(|e| {
            ContextError::with_source(ErrorKind::Malformed, "encoding the value", e)
        })?;
        let cap = self.c.write_cap(MAX_VALUE_BYTES);
        if bytes.len() > cap {
            return Err(ContextError::new(
                ErrorKind::ValueTooLarge,
                format!(
                    "the value of {key:?} is {} bytes; values hold at most {cap} bytes (store large data as an artifact and keep its reference)",
                    bytes.len()
                ),
            ));
        }
        Ok(Bytes::from(bytes))
    }

    /// The value of `key`, if set.
    pub async fn get(&self, key: &str) -> Result<Option<StateValue>, ContextError> {
        let full = self.full_key(key)?;
        let Some(entry) = self.current(&full).await? else {
            return Ok(None);
        };
        let value = serde_json::from_slice(&entry.value).map_err(|e| {
            ContextError::with_source(
                ErrorKind::Malformed,
                format!("state {full} does not hold JSON"),
                e,
            )
        })?;
        Ok(Some(StateValue {
            key: key.to_owned(),
            value,
            revision: entry.revision,
            ts: Timestamp::from(entry.created),
        }))
    }

    /// Sets `key` to `value`; returns the new revision.
    pub async fn set(&self, key: &str, value: &Value) -> Result<u64, ContextError> {
        let full = self.writable_key(key)?;
        let bytes = self.encode(key, value)?;
        let kv = self.c.state_kv().await?;
        kv.put(&full, bytes)
            .await
            .map_err(|e| unavailable(format!("writing state {full}"), e))
    }

    /// Sets `key` to `value` only if it is at `expected_revision` (0: only if it does not
    /// exist); returns the new revision. A lost race is a `conflict` with the current
    /// revision ([`ContextError::current_revision`]).
    pub async fn compare_and_set(
        &self,
        key: &str,
        value: &Value,
        expected_revision: u64,
    ) -> Result<u64, ContextError> {
        let full = self.writable_key(key)?;
        let bytes = self.encode(key, value)?;
        let kv = self.c.state_kv().await?;
        let written = if expected_revision == 0 {
            kv.create(&full, bytes)
                .await
                .map_err(|e| (e.kind() == CreateErrorKind::AlreadyExists, e.to_string()))
        } else {
            kv.update(&full, bytes, expected_revision)
                .await
                .map_err(|e| {
                    (
                        e.kind() == UpdateErrorKind::WrongLastRevision,
                        e.to_string(),
                    )
                })
        };
        match written {
            Ok(revision) => return Ok(revision),
            Err((false, e)) => {
                return Err(ContextError::new(
                    ErrorKind::Unavailable,
                    format!("writing state {full}: {e}"),
                ));
            }
            // Lost the race: report the revision the key is at now.
            Err((true, _)) => {}
        }
        let current = self.get(key).await?.map_or(0, |v| v.revision);
        Err(ContextError::conflict(
            format!(
                "state {key:?} is at revision {current}, not {expected_revision}; read it again and retry"
            ),
            current,
        ))
    }

    /// Deletes `key` (a no-op when it is not set).
    pub async fn delete(&self, key: &str) -> Result<(), ContextError> {
        let full = self.writable_key(key)?;
        let kv = self.c.state_kv().await?;
        kv.delete(&full)
            .await
            .map_err(|e| unavailable(format!("deleting state {full}"), e))
    }

    /// The keys set in this session, sorted. Lossless: pages through every stored key.
    pub async fn list(&self) -> Result<Vec<String>, ContextError> {
        let scope = self.c.scope();
        let bus = self.c.bus();
        let bucket = bus.names().bucket(Bucket::State);
        let stream = format!("KV_{bucket}");
        let prefix = format!("$KV.{bucket}.{}.", scope.session);
        let filter = format!("{prefix}>");
        // Latest operation per key: a later delete marker hides an earlier value.
        let mut keys: BTreeMap<String, bool> = BTreeMap::new();
        let mut after = 0;
        loop {
            let page = bus
                .direct_batch_stream(&stream, &filter, after, 1000, Some(crate::PAGE_MAX_BYTES))
                .await?;
            let Some(last) = page.last() else { break };
            after = last.seq;
            let more = last.num_pending > 0;
            for m in &page {
                let Some(key) = m.subject.strip_prefix(&prefix) else {
                    continue;
                };
                let deleted = m
                    .headers
                    .get("KV-Operation")
                    .is_some_and(|op| matches!(op.as_str(), "DEL" | "PURGE"));
                keys.insert(key.to_owned(), !deleted);
            }
            if !more {
                break;
            }
        }
        Ok(keys
            .into_iter()
            .filter_map(|(k, live)| live.then_some(k))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        assert!(check_key("summary_q3").is_ok());
        assert!(check_key(&"k".repeat(MAX_KEY_LEN)).is_ok());
        for bad in ["", "a.b", "a b", "a/b", "ü"] {
            assert_eq!(
                check_key(bad).expect_err(bad).code(),
                "invalid_key",
                "{bad}"
            );
        }
        let long = check_key(&"k".repeat(MAX_KEY_LEN + 1)).expect_err("long");
        assert!(long.message().contains("128"), "{long}");
    }
}
