//! Approvals in the escalations bucket: asking, the run machine's decisions written as the
//! approvals' records, withdrawals, and the external agents' questions settled here.
//!
//! An approval is one key, `<run>.<approval>`; every revision holds the whole record. It is
//! created `pending` (create-if-absent: a step performed again asks once). A wait of the run
//! machine (a dispatch, a tool call, a result's review) is decided on the run log — every
//! answer and the deadline's timer are entries there, and the machine applies the first —
//! and its decision is written here after ([`ApprovalStore::project`]): the bucket is the
//! projection people read, rebuilt from the log. An external agent's question is the
//! calling attempt's wait, not the machine's: it is settled here by one update at the
//! pending revision ([`ApprovalStore::settle`]), as is a withdrawal (the run no longer waits).

use async_nats::jetstream::kv;
use flotilla_bus::Bus;
use flotilla_model::ErrorCode;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::approval::{
    ApprovalAnswer, ApprovalRecord, ApprovalRevision, ApprovalStatus, approval_key,
};
use flotilla_model::ids::RunId;
use flotilla_model::notify::{NoticeKind, Notification, approval_notice_id};
use flotilla_model::subjects::Bucket;
use flotilla_model::time::Timestamp;
use futures::StreamExt;
use tokio::sync::OnceCell;
use tracing::debug;

/// Why an approval operation failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ApprovalError {
    /// No such approval.
    #[error("{0}")]
    NotFound(String),
    /// A stored record could not be read.
    #[error("{0}")]
    Unreadable(String),
    /// NATS did not answer; try again.
    #[error("{0}")]
    Unavailable(String),
}

impl ApprovalError {
    /// The API error code an approval endpoint answers it with.
    pub(crate) fn code(&self) -> ErrorCode {
        match self {
            Self::NotFound(_) => ErrorCode::NotFound,
            Self::Unreadable(_) => ErrorCode::Internal,
            Self::Unavailable(_) => ErrorCode::Unavailable,
        }
    }

    /// Its status: the code's (`404`, `500`, `503`).
    pub(crate) fn status(&self) -> u16 {
        self.code().status()
    }
}

/// How often a compare-and-set is retried after losing a race before giving up.
const MAX_RACES: usize = 8;

/// The approvals' records in the escalations bucket (`flotilla-escalations`, named so on the
/// wire since 0.1; the concept is the approval), opened on first use.
#[derive(Debug)]
pub(crate) struct ApprovalStore {
    bus: Bus,
    kv: OnceCell<kv::Store>,
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> ApprovalError {
    ApprovalError::Unavailable(format!("{what}: {e}"))
}

fn decode(key: &str, bytes: &[u8]) -> Result<ApprovalRecord, ApprovalError> {
    serde_json::from_slice(bytes)
        .map_err(|e| ApprovalError::Unreadable(format!("approval {key} could not be read: {e}")))
}

impl ApprovalStore {
    pub(crate) fn new(bus: Bus) -> Self {
        Self {
            bus,
            kv: OnceCell::new(),
        }
    }

    async fn kv(&self) -> Result<&kv::Store, ApprovalError> {
        self.kv
            .get_or_try_init(|| async {
                self.bus
                    .kv(Bucket::Escalations)
                    .await
                    .map_err(|e| unavailable("opening the escalations bucket", e))
            })
            .await
    }

    /// Stores a new request and publishes its notice. When it exists (asked already —
    /// perhaps by a coordinator that died before its notice went out) the stored request's
    /// notice is published again while it is still pending: the same id, so it is stored
    /// once within the duplicate window and a receiver de-duplicates it after.
    pub(crate) async fn request(
        &self,
        record: &ApprovalRecord,
        notify_only: bool,
    ) -> Result<bool, ApprovalError> {
        let run = record.request.run_id;
        let mut stored = None;
        if !notify_only {
            let key = approval_key(run, &record.request.approval_id);
            let body =
                serde_json::to_vec(record).map_err(|e| ApprovalError::Unreadable(e.to_string()))?;
            match self.kv().await?.create(&key, body.into()).await {
                Ok(_) => {}
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                    match self.get(run, &record.request.approval_id).await? {
                        Some((r, _)) if r.status == ApprovalStatus::Pending => {
                            debug!(%run, %key, "Approval already requested; its notice is published again");
                            stored = Some(r);
                        }
                        _ => {
                            debug!(%run, %key, "Approval already requested and settled");
                            return Ok(false);
                        }
                    }
                }
                Err(e) => return Err(unavailable("storing an approval request", e)),
            }
        }
        let notice = Notification {
            protocol: PROTOCOL_VERSION,
            id: approval_notice_id(run, &record.request.approval_id),
            kind: NoticeKind::of_trigger(record.request.trigger),
            run_id: Some(run),
            at: Some(Timestamp::now()),
            notify_only,
            approval: Some(stored.unwrap_or_else(|| record.clone())),
            control: None,
        };
        crate::notices::publish(&self.bus, &notice).await;
        Ok(true)
    }

    /// The approval and its revision.
    pub(crate) async fn get(
        &self,
        run: RunId,
        approval: &str,
    ) -> Result<Option<(ApprovalRecord, u64)>, ApprovalError> {
        let key = approval_key(run, approval);
        match self.kv().await?.entry(&key).await {
            Ok(Some(e)) if e.operation == kv::Operation::Put => {
                Ok(Some((decode(&key, &e.value)?, e.revision)))
            }
            Ok(_) => Ok(None),
            Err(e) => Err(unavailable("reading an approval", e)),
        }
    }

    /// Settles a pending approval with `settle` (given the pending record), unless something
    /// settled it first. Returns the settled record and whether this call settled it. When
    /// the request is missing (its step was not performed), `missing` is stored settled.
    /// `known` is the approval as just read (saves a read; a stale one loses the race and is
    /// read again).
    pub(crate) async fn settle(
        &self,
        run: RunId,
        approval: &str,
        missing: Option<&ApprovalRecord>,
        mut known: Option<(ApprovalRecord, u64)>,
        settle: impl Fn(&ApprovalRecord) -> ApprovalRecord,
    ) -> Result<(ApprovalRecord, bool), ApprovalError> {
        let key = approval_key(run, approval);
        let kv = self.kv().await?;
        for _ in 0..MAX_RACES {
            let read = match known.take() {
                Some(k) => Some(k),
                None => self.get(run, approval).await?,
            };
            let Some((current, revision)) = read else {
                let Some(m) = missing else {
                    return Err(ApprovalError::NotFound(format!(
                        "run {run} has no approval {approval}"
                    )));
                };
                let settled = settle(m);
                let body = serde_json::to_vec(&settled)
                    .map_err(|e| ApprovalError::Unreadable(e.to_string()))?;
                match kv.create(&key, body.into()).await {
                    Ok(_) => return Ok((settled, true)),
                    Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => continue,
                    Err(e) => return Err(unavailable("settling an approval", e)),
                }
            };
            if current.status != ApprovalStatus::Pending {
                return Ok((current, false));
            }
            let settled = settle(&current);
            let body = serde_json::to_vec(&settled)
                .map_err(|e| ApprovalError::Unreadable(e.to_string()))?;
            match kv.update(&key, body.into(), revision).await {
                Ok(_) => return Ok((settled, true)),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                Err(e) => return Err(unavailable("settling an approval", e)),
            }
        }
        Err(ApprovalError::Unavailable(format!(
            "approval {key} kept changing while it was settled"
        )))
    }

    /// Writes `decided`, the run machine's decision of approval `approval` of `run`, as the
    /// approval's record: the bucket is a projection of the run log. A record that already
    /// reads so is left alone (a step performed again writes nothing); a pending one, or one
    /// settled otherwise (a coordinator before 0.3 settled answers in the bucket), is
    /// overwritten, for the log decided; a missing one is created. Returns whether it wrote.
    pub(crate) async fn project(
        &self,
        run: RunId,
        approval: &str,
        decided: &ApprovalRecord,
    ) -> Result<bool, ApprovalError> {
        let key = approval_key(run, approval);
        let kv = self.kv().await?;
        let body =
            serde_json::to_vec(decided).map_err(|e| ApprovalError::Unreadable(e.to_string()))?;
        for _ in 0..MAX_RACES {
            match self.get(run, approval).await? {
                None => match kv.create(&key, body.clone().into()).await {
                    Ok(_) => return Ok(true),
                    Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => continue,
                    Err(e) => return Err(unavailable("writing an approval's decision", e)),
                },
                Some((current, _))
                    if current.status == decided.status && current.answer == decided.answer =>
                {
                    return Ok(false);
                }
                Some((_, revision)) => match kv.update(&key, body.clone().into(), revision).await {
                    Ok(_) => return Ok(true),
                    Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                    Err(e) => return Err(unavailable("writing an approval's decision", e)),
                },
            }
        }
        Err(ApprovalError::Unavailable(format!(
            "approval {key} kept changing while its decision was written"
        )))
    }

    /// Every revision of an approval, oldest first.
    pub(crate) async fn history(
        &self,
        run: RunId,
        approval: &str,
    ) -> Result<Vec<ApprovalRevision>, ApprovalError> {
        let key = approval_key(run, approval);
        let mut entries = self
            .kv()
            .await?
            .history(&key)
            .await
            .map_err(|e| unavailable("reading an approval's history", e))?;
        let mut out = Vec::new();
        while let Some(e) = entries.next().await {
            let e = e.map_err(|e| unavailable("reading an approval's history", e))?;
            if e.operation != kv::Operation::Put {
                continue;
            }
            let r = decode(&key, &e.value)?;
            out.push(ApprovalRevision {
                revision: e.revision,
                at: Timestamp(e.created),
                status: r.status,
                answer: r.answer,
            });
            if e.delta == 0 {
                break;
            }
        }
        Ok(out)
    }

    /// Approvals of one run or of all, pending only unless `all`, oldest request first, at
    /// most `limit` (and whether more matched).
    pub(crate) async fn list(
        &self,
        run: Option<RunId>,
        all: bool,
        limit: usize,
    ) -> Result<(Vec<ApprovalRecord>, bool), ApprovalError> {
        use async_nats::jetstream::consumer::{DeliverPolicy, pull};
        let kv = self.kv().await?;
        let filter = match run {
            Some(r) => format!("{}{r}.>", kv.prefix),
            None => format!("{}>", kv.prefix),
        };
        // An ordered consumer over the last revision of each matching key: one pass, however
        // many approvals wait, and an empty answer at once when none matches.
        let consumer = kv
            .stream
            .create_consumer(pull::OrderedConfig {
                filter_subject: filter,
                deliver_policy: DeliverPolicy::LastPerSubject,
                ..Default::default()
            })
            .await
            .map_err(|e| unavailable("listing approvals", e))?;
        let mut out = Vec::new();
        let mut truncated = false;
        if consumer.cached_info().num_pending == 0 {
            return Ok((out, truncated));
        }
        let mut messages = consumer
            .messages()
            .await
            .map_err(|e| unavailable("listing approvals", e))?;
        while let Some(msg) = messages.next().await {
            let msg = msg.map_err(|e| unavailable("listing approvals", e))?;
            let pending = msg.info().map(|i| i.pending).unwrap_or(0);
            let deleted = msg
                .headers
                .as_ref()
                .and_then(|h| h.get("KV-Operation"))
                .is_some();
            if !deleted {
                let r = decode(&msg.subject, &msg.payload)?;
                if all || r.status == ApprovalStatus::Pending {
                    if out.len() < limit {
                        out.push(r);
                    } else {
                        truncated = true;
                    }
                }
            }
            if pending == 0 {
                break;
            }
        }
        out.sort_by_key(|r| r.request.requested_at);
        Ok((out, truncated))
    }
}

/// The record of an approval that run-log entry `decided` (stored at `at_ms`, Unix ms)
/// decided: `pending` settled with the entry's answer. Entries before 0.3 carry no `at`: the
/// entry's time stands for it.
pub(crate) fn decided_record(
    pending: &ApprovalRecord,
    decided: flotilla_model::approval::ApprovalDecided,
    at_ms: i64,
) -> ApprovalRecord {
    let answer = ApprovalAnswer {
        decision: decided.decision,
        by: decided.by,
        comment: decided.comment,
        at: decided.at.unwrap_or_else(|| Timestamp::from_unix_ms(at_ms)),
        always: decided.always,
        incident: decided.incident,
    };
    settled(pending, decided.status, answer)
}

/// The tool grant a decided approval writes into its session: an answer with `always` to a
/// grantable tool call; `None` for any other.
pub(crate) fn grant_of(record: &ApprovalRecord) -> Option<flotilla_model::approval::ToolGrant> {
    let a = record.answer.as_ref().filter(|a| a.always)?;
    let call = record.request.tool_call.as_ref()?;
    (record.status == ApprovalStatus::Decided && grantable(record)).then(|| {
        flotilla_model::approval::ToolGrant {
            tool: call.tool.clone(),
            by: a.by.clone(),
            run_id: record.request.run_id,
            approval_id: record.request.approval_id.clone(),
            at: a.at,
            comment: a.comment.clone(),
        }
    })
}

/// Whether `always` may go with an answer to this approval: a tool call that waits because of
/// what the tool is or who calls it. Questions, client tools and out-of-scope calls are
/// answered call by call.
pub(crate) fn grantable(record: &ApprovalRecord) -> bool {
    record
        .request
        .tool_call
        .as_ref()
        .is_some_and(|c| flotilla_model::plan::is_tool_name(&c.tool))
        && matches!(
            record.request.trigger,
            flotilla_model::approval::Trigger::SensitiveAction
                | flotilla_model::approval::Trigger::HumanInCommand
        )
}

/// A settled copy of `pending`: `status` with `answer`.
pub(crate) fn settled(
    pending: &ApprovalRecord,
    status: ApprovalStatus,
    answer: ApprovalAnswer,
) -> ApprovalRecord {
    ApprovalRecord {
        protocol: PROTOCOL_VERSION,
        status,
        request: pending.request.clone(),
        answer: Some(answer),
    }
}

/// The id of the run's event for an approval settled (`phase` `decided`) or asked
/// (`requested`) outside the run machine — withdrawn, or an external agent's question: one
/// per approval and phase, so publishing it again is dropped as a duplicate.
pub(crate) fn approval_event_id(run: RunId, approval: &str, phase: &str) -> String {
    format!("{run}.approval.{approval}.{phase}")
}

/// What a settled approval's `approval_decided` event says: `approve by alice`,
/// `withdrawn: the run ended cancelled: …` (why the run stopped waiting), `reject (expired):
/// deadline`.
pub(crate) fn settled_detail(record: &ApprovalRecord) -> String {
    use flotilla_model::approval::Decision;
    match (&record.status, &record.answer) {
        (status, None) => status.as_str().to_owned(),
        (ApprovalStatus::Decided, Some(a)) => format!("{} by {}", a.decision.as_str(), a.by),
        (ApprovalStatus::Withdrawn, Some(a)) => match &a.decision {
            Decision::Reject { message } if !message.is_empty() => {
                format!("withdrawn: {message}")
            }
            _ => "withdrawn".to_owned(),
        },
        (status, Some(a)) => format!("{} ({}): {}", a.decision.as_str(), status.as_str(), a.by),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn approval_errors_answer_their_codes() {
        let answer = |e: ApprovalError| (e.status(), e.code().as_str());
        assert_eq!(
            answer(ApprovalError::NotFound("x".into())),
            (404, "not_found")
        );
        assert_eq!(
            answer(ApprovalError::Unreadable("x".into())),
            (500, "internal")
        );
        assert_eq!(
            answer(ApprovalError::Unavailable("x".into())),
            (503, "unavailable")
        );
    }
}
