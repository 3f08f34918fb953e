//! Earned trust (`<prefix>-trust`): one [`TrustRecord`] per agent and per role, re-evaluated
//! by the rules of `[hitl.trust]` each time an outcome is counted into its failure record,
//! and changed by operators (`trust.set` pins a level, `trust.incident` records an incident).
//! Writes are compare-and-set, so replicas never undo each other's changes; each change of
//! level is kept in the record's history with who and why, and exported as
//! `flotilla_trust_level{scope, name}`.

use std::sync::Arc;

use flotilla_model::ErrorCode;
use flotilla_model::api::ApiError;
use flotilla_model::team::{FailureRecord, RecordScope, record_key};
use flotilla_model::time::Timestamp;
use flotilla_model::trust::{
    MAX_TRUST_TEXT, TrustGetRequest, TrustIncidentRequest, TrustList, TrustListRequest,
    TrustRecord, TrustSetRequest, trust_key,
};
use flotilla_telemetry::InternalEvent;
use flotilla_telemetry::events::TrustLevelSet;
use tracing::info;

use crate::Team;
use crate::cas::modify;
use crate::error::SupervisorError;

/// After `record` was written: the earned level of its agent or role, again.
pub(crate) async fn evaluate(team: &Team, record: &FailureRecord) -> Result<(), SupervisorError> {
    let now = Timestamp::now();
    let key = trust_key(record.scope, &record.name);
    let cfg = &team.trust;
    // Most outcomes change no level: decided from the mirror, without a read.
    if let Some(known) = team.trusts.get(&key)
        && flotilla_machine::policy::trust::earned(cfg, record, &known.value, now)
            == known.value.earned
    {
        return Ok(());
    }
    let written = modify(
        &team.trust_kv,
        &key,
        || TrustRecord::new(record.scope, &record.name, now),
        |t| {
            // A new record is written once even when it stays novice: its first-seen time
            // starts the clock of the day rules.
            flotilla_machine::policy::trust::evaluate(t, cfg, record, now) || t.updated_at == now
        },
        &team.metrics,
    )
    .await?;
    if let Some((t, revision)) = written {
        if let Some(change) = t.history.back().filter(|c| c.at == now) {
            info!(scope = t.scope.as_str(), name = %t.name, from = change.from.as_str(), to = change.to.as_str(), reason = %change.reason, "Trust level changed");
        }
        emit(team, &t);
        team.trusts.note(&key, t, now.unix_ms(), revision);
    }
    Ok(())
}

/// Who records the incidents Flotilla itself notices.
const FLOTILLA: &str = "flotilla";

/// Records an incident Flotilla noticed (a rejection marked as one, a failed sensitive
/// action: `incident` on a workflow event) against `scope`/`name`: its level drops to novice
/// as with an operator's `trust.incident`. Once per reason: the events are read at least
/// once, and a reason already in the record's recent history is not counted again.
pub(crate) async fn flotilla_incident(
    team: &Team,
    scope: RecordScope,
    name: &str,
    reason: &str,
) -> Result<(), SupervisorError> {
    let now = Timestamp::now();
    let key = trust_key(scope, name);
    let noted = format!("incident: {reason}");
    let written = modify(
        &team.trust_kv,
        &key,
        || TrustRecord::new(scope, name, now),
        |t| {
            if t.history.iter().any(|c| c.reason == noted) {
                return false;
            }
            t.incident(reason, FLOTILLA, now);
            true
        },
        &team.metrics,
    )
    .await?;
    if let Some((t, revision)) = written {
        info!(
            scope = scope.as_str(),
            name,
            reason,
            level = t.level().as_str(),
            "Trust incident recorded by Flotilla"
        );
        emit(team, &t);
        team.trusts.note(&key, t, now.unix_ms(), revision);
    }
    Ok(())
}

/// Exports every mirrored level (at start: the gauge of each agent and role from any
/// replica, not only from the one that last changed it).
pub(crate) fn export_all(team: &Team) {
    for (_, t) in team.trusts.all() {
        emit(team, &t.value);
    }
}

fn emit(team: &Team, t: &TrustRecord) {
    TrustLevelSet {
        scope: t.scope.as_str(),
        name: &t.name,
        level: t.level().rank(),
    }
    .emit(&team.metrics);
}

fn bad(message: String) -> ApiError {
    ApiError::new(400, ErrorCode::InvalidRequest, message)
}

fn unavailable(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(503, ErrorCode::Unavailable, e.to_string())
}

/// Checks the texts of a change and that `name` is a configured agent or a known role.
fn check(
    team: &Team,
    scope: RecordScope,
    name: &str,
    reason: &str,
    by: &str,
) -> Result<(), ApiError> {
    let mut problems = Vec::new();
    for (field, v) in [("reason", reason), ("by", by)] {
        if v.trim().is_empty() {
            problems.push(format!("{field} is required"));
        } else if v.len() > MAX_TRUST_TEXT {
            problems.push(format!("{field} is longer than {MAX_TRUST_TEXT} bytes"));
        }
    }
    if !problems.is_empty() {
        return Err(bad(problems.join("; ")));
    }
    let known = match scope {
        RecordScope::Agent => team.cards.contains_key(name),
        RecordScope::Role => team
            .cards
            .values()
            .any(|c| c.roles.iter().any(|r| r == name)),
    };
    if !known {
        return Err(ApiError::new(
            404,
            ErrorCode::NotFound,
            format!("no {} {name} in this deployment", scope.as_str()),
        ));
    }
    Ok(())
}

/// The failure record of `scope`/`name` as the supervisor last saw it (empty: nothing
/// counted yet).
fn counted(team: &Team, scope: RecordScope, name: &str) -> FailureRecord {
    team.failures
        .get(&record_key(scope, name))
        .map(|m| m.value)
        .unwrap_or_else(|| FailureRecord::new(scope, name))
}

async fn change(
    team: &Team,
    scope: RecordScope,
    name: &str,
    f: impl Fn(&mut TrustRecord, &FailureRecord, Timestamp),
) -> Result<TrustRecord, ApiError> {
    let now = Timestamp::now();
    let record = counted(team, scope, name);
    let (written, revision) = modify(
        &team.trust_kv,
        &trust_key(scope, name),
        || TrustRecord::new(scope, name, now),
        |t| {
            f(t, &record, now);
            true
        },
        &team.metrics,
    )
    .await
    .map_err(unavailable)?
    .ok_or_else(|| unavailable("the trust record was not written"))?;
    emit(team, &written);
    team.trusts.note(
        &trust_key(scope, name),
        written.clone(),
        now.unix_ms(),
        revision,
    );
    Ok(written)
}

/// `trust.set`.
pub(crate) async fn set(team: Arc<Team>, r: TrustSetRequest) -> Result<TrustRecord, ApiError> {
    check(&team, r.scope, &r.name, &r.reason, &r.by)?;
    let t = change(&team, r.scope, &r.name, |t, _, now| {
        t.pin(r.level, &r.reason, &r.by, now)
    })
    .await?;
    info!(scope = r.scope.as_str(), name = %r.name, level = ?r.level, by = %r.by, reason = %r.reason, "Trust level set");
    Ok(t)
}

/// `trust.incident`.
pub(crate) async fn incident(
    team: Arc<Team>,
    r: TrustIncidentRequest,
) -> Result<TrustRecord, ApiError> {
    check(&team, r.scope, &r.name, &r.reason, &r.by)?;
    let t = change(&team, r.scope, &r.name, |t, _, now| {
        t.incident(&r.reason, &r.by, now)
    })
    .await?;
    info!(scope = r.scope.as_str(), name = %r.name, by = %r.by, reason = %r.reason, level = t.level().as_str(), "Trust incident recorded");
    Ok(t)
}

/// `trust.get`.
pub(crate) async fn get(team: Arc<Team>, r: TrustGetRequest) -> Result<TrustRecord, ApiError> {
    let key = trust_key(r.scope, &r.name);
    match team.trust_kv.get(&key).await.map_err(unavailable)? {
        Some(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
            ApiError::new(
                500,
                ErrorCode::Internal,
                format!("{key} is unreadable: {e}"),
            )
        }),
        None => Err(ApiError::new(
            404,
            ErrorCode::NotFound,
            format!(
                "no trust record for {} {}: nothing was counted for it yet (it is a novice)",
                r.scope.as_str(),
                r.name
            ),
        )),
    }
}

/// `trust.list`: from the mirror the supervisor keeps of the bucket (as the team API answers
/// from its mirrors), not a read of every key per request.
pub(crate) async fn list(team: Arc<Team>, _r: TrustListRequest) -> Result<TrustList, ApiError> {
    let mut records: Vec<TrustRecord> = team
        .trusts
        .all()
        .into_iter()
        .map(|(_, t)| t.value)
        .collect();
    records.sort_by(|a, b| (a.scope, &a.name).cmp(&(b.scope, &b.name)));
    Ok(TrustList {
        enabled: team.trust.enabled,
        records,
    })
}
