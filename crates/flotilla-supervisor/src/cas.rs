//! Read-modify-write of one KV value with compare-and-set: replicas never overwrite each
//! other's changes, so the supervisor needs no leader.

use async_nats::jetstream::kv;
use flotilla_telemetry::{InternalEvent, Metrics};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::warn;

use crate::error::SupervisorError;
use flotilla_telemetry::events::SupervisorCasConflict;

/// Attempts before giving up on a value everybody is writing.
const MAX_TRIES: usize = 50;

/// Reads `key` (or starts from `init()` when it does not exist), applies `change`, and writes
/// the result only if nobody wrote the key in between; on a lost race, reads again. `change`
/// returns `false` to leave the value as it is. Returns the value written, or `None` when
/// `change` changed nothing.
pub(crate) async fn modify<T, I, F>(
    kv: &kv::Store,
    key: &str,
    init: I,
    mut change: F,
    metrics: &Metrics,
) -> Result<Option<T>, SupervisorError>
where
    T: Serialize + DeserializeOwned,
    I: Fn() -> T,
    F: FnMut(&mut T) -> bool,
{
    for _ in 0..MAX_TRIES {
        let entry = kv
            .entry(key)
            .await
            .map_err(|e| SupervisorError::store(format!("reading {key}"), e))?;
        let (mut value, revision) = match entry {
            Some(e) if e.operation == kv::Operation::Put => {
                match serde_json::from_slice::<T>(&e.value) {
                    Ok(v) => (v, Some(e.revision)),
                    Err(err) => {
                        // A value this build cannot read is replaced, not left to block
                        // every later change.
                        warn!(key, error = %err, "Replacing an unreadable value");
                        (init(), Some(e.revision))
                    }
                }
            }
            Some(e) => (init(), Some(e.revision)),
            None => (init(), None),
        };
        if !change(&mut value) {
            return Ok(None);
        }
        let bytes = serde_json::to_vec(&value).map_err(|e| SupervisorError::Decode {
            key: key.to_owned(),
            message: e.to_string(),
        })?;
        let written = match revision {
            Some(rev) => match kv.update(key, bytes.into(), rev).await {
                Ok(_) => true,
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => false,
                Err(e) => return Err(SupervisorError::store(format!("writing {key}"), e)),
            },
            None => match kv.create(key, bytes.into()).await {
                Ok(_) => true,
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => false,
                Err(e) => return Err(SupervisorError::store(format!("creating {key}"), e)),
            },
        };
        if written {
            return Ok(Some(value));
        }
        SupervisorCasConflict { key }.emit(metrics);
    }
    Err(SupervisorError::Setup(format!(
        "{key} kept changing under {MAX_TRIES} attempts to update it"
    )))
}
