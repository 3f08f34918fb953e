//! Workspace and mailbox bytes: the quotas `workspace_bytes` and `mailbox_bytes` are the
//! `max_bytes` of the installation's workspace and mailbox streams, with discard policy
//! `new`. The NATS server then refuses a write that would pass the limit — for every worker,
//! coordinator and supervisor of the installation at once, with no overshoot at all and no
//! counting of ours — and the writer answers `quota_exceeded`
//! (`flotilla_context::ErrorKind::QuotaExceeded`). Space frees as entries pass the streams'
//! `max_age` or runs are purged.
//!
//! Without the quota a stream is as provisioned: no `max_bytes`, discard `old` (only its
//! age and per-subject limits remove messages). Re-provisioning keeps both settings
//! (`flotilla_bus::provision` never changes them).

use async_nats::jetstream::stream::DiscardPolicy;
use flotilla_bus::Bus;
use flotilla_model::subjects::StreamKind;
use flotilla_model::tenant::{QuotaKind, Quotas, installation};
use serde::{Deserialize, Serialize};

use crate::error::TenantError;

/// The bytes an installation's workspace and mailboxes hold now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Space {
    /// Bytes held by the workspace stream.
    pub workspace_bytes: u64,
    /// Bytes held by the mailbox stream.
    pub mailbox_bytes: u64,
}

/// The streams the byte quotas limit, with the quota of each.
fn limited(quotas: &Quotas) -> [(StreamKind, Option<u64>); 2] {
    [
        (StreamKind::Workspace, quotas.workspace_bytes),
        (StreamKind::Mailbox, quotas.mailbox_bytes),
    ]
}

/// Why a write to the installation's stream of `kind` was refused for its size (the bus's
/// `PublishErrorKind::StreamFull`): the installation over its byte quota, with the quota's
/// limit and the bytes held as the stream says when it answers — the message of the
/// `quota_exceeded` a writer answers.
pub async fn refusal(bus: &Bus, kind: StreamKind) -> String {
    let quota = match kind {
        StreamKind::Mailbox => QuotaKind::MailboxBytes,
        _ => QuotaKind::WorkspaceBytes,
    };
    let numbers = match stream_of(bus, kind).await {
        Ok((_, s)) => {
            let i = s.cached_info();
            format!(
                ": {} bytes used of {}",
                i.state.bytes,
                i.config.max_bytes.max(0)
            )
        }
        Err(_) => String::new(),
    };
    format!(
        "{} is over its {quota} quota{numbers}; space frees as entries age out or runs are purged",
        installation(bus.tenant())
    )
}

/// Sets the workspace and mailbox streams of `bus`'s installation to `quotas`' byte limits
/// (or lifts them); a stream already so is not changed. Lowering a limit below what a
/// stream holds removes nothing: new writes are refused until it holds less.
pub async fn apply(bus: &Bus, quotas: &Quotas) -> Result<(), TenantError> {
    for (kind, limit) in limited(quotas) {
        let (name, stream) = stream_of(bus, kind).await?;
        let mut config = stream.cached_info().config.clone();
        let (max_bytes, discard) = match limit {
            Some(n) => (i64::try_from(n).unwrap_or(i64::MAX), DiscardPolicy::New),
            None => (-1, DiscardPolicy::Old),
        };
        if config.max_bytes == max_bytes && config.discard == discard {
            continue;
        }
        config.max_bytes = max_bytes;
        config.discard = discard;
        bus.js().update_stream(&config).await.map_err(|e| {
            TenantError::nats(format!("setting the byte quota of stream {name}"), e)
        })?;
    }
    Ok(())
}

/// The bytes the installation's workspace and mailboxes hold now.
pub async fn used(bus: &Bus) -> Result<Space, TenantError> {
    let mut space = Space::default();
    for (kind, slot) in [
        (StreamKind::Workspace, &mut space.workspace_bytes),
        (StreamKind::Mailbox, &mut space.mailbox_bytes),
    ] {
        *slot = stream_of(bus, kind).await?.1.cached_info().state.bytes;
    }
    Ok(space)
}

/// The installation's stream of `kind`, with its name, as it is now (its info read).
async fn stream_of(
    bus: &Bus,
    kind: StreamKind,
) -> Result<(String, async_nats::jetstream::stream::Stream), TenantError> {
    let name = bus.names().stream(kind);
    let stream = bus
        .js()
        .get_stream(&name)
        .await
        .map_err(|e| TenantError::nats(format!("reading stream {name}"), e))?;
    Ok((name, stream))
}
