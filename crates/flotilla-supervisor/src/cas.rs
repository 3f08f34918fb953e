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
/// returns `false` to leave the value as it is. Returns the value written with its revision
/// (for [`flotilla_bus::mirror::KvMirror::note`]), or `None` when `change` changed nothing.
pub(crate) async fn modify<T, I, F>(
    kv: &kv::Store,
    key: &str,
    init: I,
    change: F,
    metrics: &Metrics,
) -> Result<Option<(T, u64)>, SupervisorError>
where
    T: Serialize + DeserializeOwned,
    I: Fn() -> T,
    F: FnMut(&mut T) -> bool,
{
    modify_from(kv, key, None, init, change, metrics).await
}

/// [`modify`] starting from a value the caller has just read at `revision` (`known`): the
/// first attempt writes without reading the key again — one round trip instead of two on a
/// path that already read it — and a lost race reads as usual.
pub(crate) async fn modify_from<T, I, F>(
    kv: &kv::Store,
    key: &str,
    mut known: Option<(T, u64)>,
    init: I,
    mut change: F,
    metrics: &Metrics,
) -> Result<Option<(T, u64)>, SupervisorError>
where
    T: Serialize + DeserializeOwned,
    I: Fn() -> T,
    F: FnMut(&mut T) -> bool,
{
    for _ in 0..MAX_TRIES {
        let (mut value, revision) = if let Some((v, rev)) = known.take() {
            (v, Some(rev))
        } else {
            read(kv, key, &init).await?
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
                Ok(rev) => Some(rev),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => None,
                Err(e) => return Err(SupervisorError::store(format!("writing {key}"), e)),
            },
            None => match kv.create(key, bytes.into()).await {
                Ok(rev) => Some(rev),
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => None,
                Err(e) => return Err(SupervisorError::store(format!("creating {key}"), e)),
            },
        };
        if let Some(rev) = written {
            return Ok(Some((value, rev)));
        }
        SupervisorCasConflict { key }.emit(metrics);
    }
    Err(SupervisorError::Setup(format!(
        "{key} kept changing under {MAX_TRIES} attempts to update it"
    )))
}

/// The value at `key` with its revision (`init()` for a missing or unreadable value).
async fn read<T, I>(
    kv: &kv::Store,
    key: &str,
    init: &I,
) -> Result<(T, Option<u64>), SupervisorError>
where
    T: DeserializeOwned,
    I: Fn() -> T,
{
    let entry = kv
        .entry(key)
        .await
        .map_err(|e| SupervisorError::store(format!("reading {key}"), e))?;
    Ok(match entry {
        Some(e) if e.operation == kv::Operation::Put => match serde_json::from_slice::<T>(&e.value)
        {
            Ok(v) => (v, Some(e.revision)),
            Err(err) => {
                // A value this build cannot read is replaced, not left to block every later
                // change.
                warn!(key, error = %err, "Replacing an unreadable value");
                (init(), Some(e.revision))
            }
        },
        Some(e) => (init(), Some(e.revision)),
        None => (init(), None),
    })
}

#[cfg(test)]
mod tests {
    //! `modify_from` against a real nats-server: a known value at the current revision is
    //! written without a read; a known value that is stale (written since) loses the race
    //! and the change is applied to what is there now, never to the stale value.

    use flotilla_model::subjects::Bucket;
    use flotilla_testkit::NatsServer;

    use super::*;

    #[tokio::test]
    async fn a_known_value_is_written_at_once_or_the_change_redone_on_a_fresh_read()
    -> anyhow::Result<()> {
        let server = NatsServer::start().await?;
        let bus = server.provisioned_bus().await?;
        let kv = bus.kv(Bucket::Team).await?;
        let metrics = Metrics::new();
        let rev = kv.put("n", b"[1]".to_vec().into()).await?;

        let written = modify_from(
            &kv,
            "n",
            Some((vec![1u32], rev)),
            Vec::new,
            |v: &mut Vec<u32>| {
                v.push(2);
                true
            },
            &metrics,
        )
        .await?;
        assert_eq!(written.map(|w| w.0), Some(vec![1, 2]));

        // Someone wrote since the caller's read: the change lands on their value.
        let current = kv.put("n", b"[1,2,9]".to_vec().into()).await?;
        let written = modify_from(
            &kv,
            "n",
            Some((vec![1u32, 2], current - 1)),
            Vec::new,
            |v: &mut Vec<u32>| {
                v.push(3);
                true
            },
            &metrics,
        )
        .await?;
        assert_eq!(written.map(|w| w.0), Some(vec![1, 2, 9, 3]));
        let e = kv
            .entry("n")
            .await?
            .ok_or_else(|| anyhow::anyhow!("gone"))?;
        assert_eq!(
            serde_json::from_slice::<Vec<u32>>(&e.value)?,
            vec![1, 2, 9, 3]
        );

        // A change that changes nothing writes nothing.
        let before = e.revision;
        let unchanged = modify_from(
            &kv,
            "n",
            Some((vec![1u32, 2, 9, 3], before)),
            Vec::new,
            |_: &mut Vec<u32>| false,
            &metrics,
        )
        .await?;
        assert_eq!(unchanged, None);
        assert_eq!(kv.entry("n").await?.map(|e| e.revision), Some(before));
        Ok(())
    }
}
