//! The team API: a NATS micro service named `<prefix>-supervisor` with endpoints under
//! `<prefix>.api.team.`, answered by whichever replica the service's queue group picks,
//! from its mirrors of the buckets. `team.list`, `team.get` and `team.find` also answer the
//! external members (agents of the NATS Agent Protocol, [`crate::external`]), after the
//! agent definitions.
//!
//! | Subject | Request | Reply |
//! |---|---|---|
//! | `<prefix>.api.team.list` | `TeamListRequest` | `TeamList` |
//! | `<prefix>.api.team.get` | `TeamGetRequest` | `MemberView` (`404 not_found`) |
//! | `<prefix>.api.team.find` | `TeamFindRequest` | `TeamList` (`404 unknown_role`) |
//! | `<prefix>.api.team.stats` | `TeamStatsRequest` | `TeamStats` (`404 not_found` for a name with no record) |
//! | `<prefix>.api.team.recruit` | `RecruitRequest` | `RecruitReply` (`403`/`400 recruit_refused {rule}`) |
//! | `<prefix>.api.team.recruit_status` | `RecruitStatusRequest` | `RecruitReply` |
//! | `<prefix>.api.team.retire` | `RetireRequest` | `RetireReply` (`403 recruit_refused {rule}`) |
//! | `<prefix>.api.team.spawn` / `send` / `broadcast` / `shutdown` / `mates` | teammates ([`crate::teammates`]) | |
//! | `<prefix>.api.memory.list` / `get` / `forget` | remembered runs ([`crate::memory`]) | |
//! | `<prefix>.api.trust.list` / `get` / `set` / `incident` | earned trust ([`crate::trust`]) | `TrustList`, `TrustRecord` |

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use async_nats::service::{Request, Service, ServiceExt, endpoint::Endpoint};
use flotilla_bus::service::{parse, respond_api_error, respond_error, respond_json};
use flotilla_model::ErrorCode;
use flotilla_model::api::ApiRequest;
use flotilla_model::lead::{AssignRequest, FinishRequest};
use flotilla_model::memory::{MemoryForgetRequest, MemoryGetRequest, MemoryListRequest};
use flotilla_model::recruit::{RecruitRequest, RecruitStatusRequest, RetireRequest};
use flotilla_model::team::{
    FailureStats, Member, MemberStatus, MemberView, RecordScope, TeamFindRequest, TeamGetRequest,
    TeamList, TeamListRequest, TeamStats, TeamStatsRequest, member_key, record_key,
};
use flotilla_model::time::Timestamp;
use flotilla_model::trust::{
    TrustGetRequest, TrustIncidentRequest, TrustListRequest, TrustSetRequest,
};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::Team;
use crate::error::SupervisorError;
use crate::presence::hosts;
use crate::teammates;
use flotilla_model::teammate::{
    TeamBroadcastRequest, TeamMatesRequest, TeamSendRequest, TeamShutdownRequest, TeamSpawnRequest,
};

/// The started service and its endpoints.
pub(crate) struct Started {
    service: Service,
    list: Endpoint,
    get: Endpoint,
    find: Endpoint,
    stats: Endpoint,
    recruit: Endpoint,
    recruit_status: Endpoint,
    retire: Endpoint,
    mates: [Endpoint; 5],
    memory: [Endpoint; 3],
    /// `team.assign`, `team.finish`.
    lead: [Endpoint; 2],
    /// `trust.list`, `trust.get`, `trust.set`, `trust.incident`.
    trust: [Endpoint; 4],
}

/// Starts the service (its endpoints answer once [`serve`] runs).
pub(crate) async fn start(team: &Team) -> Result<Started, SupervisorError> {
    let setup =
        |e: async_nats::Error| SupervisorError::Setup(format!("starting the team API: {e}"));
    let names = team.bus.names();
    let service = team
        .bus
        .client()
        .service_builder()
        .description("Flotilla supervisor: team roster, presence and failure records")
        .start(
            format!("{}-supervisor", names.service()),
            env!("CARGO_PKG_VERSION"),
        )
        .await
        .map_err(setup)?;
    let group = service.group(format!("{}.api", names.prefix()));
    let endpoint = |name: &'static str, subject: &'static str| {
        let group = &group;
        async move { group.endpoint_builder().name(name).add(subject).await }
    };
    Ok(Started {
        list: endpoint("team-list", TeamListRequest::ENDPOINT)
            .await
            .map_err(setup)?,
        get: endpoint("team-get", TeamGetRequest::ENDPOINT)
            .await
            .map_err(setup)?,
        find: endpoint("team-find", TeamFindRequest::ENDPOINT)
            .await
            .map_err(setup)?,
        stats: endpoint("team-stats", TeamStatsRequest::ENDPOINT)
            .await
            .map_err(setup)?,
        recruit: endpoint("team-recruit", RecruitRequest::ENDPOINT)
            .await
            .map_err(setup)?,
        recruit_status: endpoint("team-recruit-status", RecruitStatusRequest::ENDPOINT)
            .await
            .map_err(setup)?,
        retire: endpoint("team-retire", RetireRequest::ENDPOINT)
            .await
            .map_err(setup)?,
        lead: [
            endpoint("team-assign", AssignRequest::ENDPOINT)
                .await
                .map_err(setup)?,
            endpoint("team-finish", FinishRequest::ENDPOINT)
                .await
                .map_err(setup)?,
        ],
        mates: [
            endpoint("team-spawn", TeamSpawnRequest::ENDPOINT)
                .await
                .map_err(setup)?,
            endpoint("team-send", TeamSendRequest::ENDPOINT)
                .await
                .map_err(setup)?,
            endpoint("team-broadcast", TeamBroadcastRequest::ENDPOINT)
                .await
                .map_err(setup)?,
            endpoint("team-shutdown", TeamShutdownRequest::ENDPOINT)
                .await
                .map_err(setup)?,
            endpoint("team-mates", TeamMatesRequest::ENDPOINT)
                .await
                .map_err(setup)?,
        ],
        memory: [
            endpoint("memory-list", MemoryListRequest::ENDPOINT)
                .await
                .map_err(setup)?,
            endpoint("memory-get", MemoryGetRequest::ENDPOINT)
                .await
                .map_err(setup)?,
            endpoint("memory-forget", MemoryForgetRequest::ENDPOINT)
                .await
                .map_err(setup)?,
        ],
        trust: [
            endpoint("trust-list", TrustListRequest::ENDPOINT)
                .await
                .map_err(setup)?,
            endpoint("trust-get", TrustGetRequest::ENDPOINT)
                .await
                .map_err(setup)?,
            endpoint("trust-set", TrustSetRequest::ENDPOINT)
                .await
                .map_err(setup)?,
            endpoint("trust-incident", TrustIncidentRequest::ENDPOINT)
                .await
                .map_err(setup)?,
        ],
        service,
    })
}

/// Answers requests until `stop`.
pub(crate) async fn serve(
    team: Arc<Team>,
    started: Started,
    stop: CancellationToken,
) -> Result<(), SupervisorError> {
    let Started {
        service,
        mut list,
        mut get,
        mut find,
        mut stats,
        mut recruit,
        mut recruit_status,
        mut retire,
        mates: [mut spawn, mut send, mut broadcast, mut shut, mut mates],
        memory: [mut memory_list, mut memory_get, mut memory_forget],
        lead: [mut assign, mut finish],
        trust:
            [
                mut trust_list,
                mut trust_get,
                mut trust_set,
                mut trust_incident,
            ],
    } = started;
    loop {
        let team = Arc::clone(&team);
        tokio::select! {
            _ = stop.cancelled() => break,
            Some(req) = list.next() => { tokio::spawn(async move { team_list(&team, req).await }); }
            Some(req) = get.next() => { tokio::spawn(async move { team_get(&team, req).await }); }
            Some(req) = find.next() => { tokio::spawn(async move { team_find(&team, req).await }); }
            Some(req) = stats.next() => { tokio::spawn(async move { team_stats(&team, req).await }); }
            Some(req) = recruit.next() => { tokio::spawn(async move { answer(team, req, crate::recruit::recruit).await }); }
            Some(req) = recruit_status.next() => { tokio::spawn(async move { answer(team, req, crate::recruit::status).await }); }
            Some(req) = retire.next() => { tokio::spawn(async move { answer(team, req, crate::recruit::retire).await }); }
            Some(req) = assign.next() => { tokio::spawn(async move { answer(team, req, crate::lead::assign).await }); }
            Some(req) = finish.next() => { tokio::spawn(async move { answer(team, req, crate::lead::finish).await }); }
            Some(req) = spawn.next() => { tokio::spawn(async move { teammates::spawn(&team, req).await }); }
            Some(req) = send.next() => { tokio::spawn(async move { teammates::send(&team, req).await }); }
            Some(req) = broadcast.next() => { tokio::spawn(async move { teammates::broadcast(&team, req).await }); }
            Some(req) = shut.next() => { tokio::spawn(async move { teammates::shutdown(&team, req).await }); }
            Some(req) = mates.next() => { tokio::spawn(async move { teammates::mates(&team, req).await }); }
            Some(req) = memory_list.next() => { tokio::spawn(async move { answer(team, req, crate::memory::list).await }); }
            Some(req) = memory_get.next() => { tokio::spawn(async move { answer(team, req, crate::memory::get).await }); }
            Some(req) = memory_forget.next() => { tokio::spawn(async move { answer(team, req, crate::memory::forget).await }); }
            Some(req) = trust_list.next() => { tokio::spawn(async move { answer(team, req, crate::trust::list).await }); }
            Some(req) = trust_get.next() => { tokio::spawn(async move { answer(team, req, crate::trust::get).await }); }
            Some(req) = trust_set.next() => { tokio::spawn(async move { answer(team, req, crate::trust::set).await }); }
            Some(req) = trust_incident.next() => { tokio::spawn(async move { answer(team, req, crate::trust::incident).await }); }
            else => break,
        }
    }
    let _ = service.stop().await;
    Ok(())
}

/// Parses a request, runs `handle`, and answers its reply or its `ApiError`.
async fn answer<R, T, F, Fut>(team: Arc<Team>, req: Request, handle: F)
where
    R: serde::de::DeserializeOwned + flotilla_model::api::HasProtocol,
    T: serde::Serialize,
    F: FnOnce(Arc<Team>, R) -> Fut,
    Fut: std::future::Future<Output = Result<T, flotilla_model::api::ApiError>>,
{
    let Some(r) = parse::<R>(&req).await else {
        return;
    };
    let max_payload = team.bus.max_payload();
    match handle(team, r).await {
        Ok(reply) => respond_json(&req, max_payload, &reply, TOO_LARGE).await,
        Err(e) => respond_api_error(&req, &e).await,
    }
}

const TOO_LARGE: &str = "ask for one role (team.list role, team.find) or one member (team.get)";

/// The roster's members as views at `now`: the agent definitions by name, then the
/// external members (`agents:…`) by name.
fn views(team: &Team, now: Timestamp) -> Vec<MemberView> {
    let mut all = own_views(team, now);
    all.extend(team.external.views(now));
    all
}

/// The roles each agent served, by agent: the roles whose failure records name it.
fn served(team: &Team) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (_, r) in team.failures.all() {
        if r.value.scope != RecordScope::Role {
            continue;
        }
        for agent in &r.value.agents {
            out.entry(agent.clone())
                .or_default()
                .push(r.value.name.clone());
        }
    }
    for roles in out.values_mut() {
        roles.sort();
    }
    out
}

fn own_views(team: &Team, now: Timestamp) -> Vec<MemberView> {
    let hosts = hosts(team, now.unix_ms());
    let mut served = served(team);
    team.roster
        .all()
        .into_iter()
        .map(|(_, m)| {
            let beat = hosts
                .get(&m.value.name)
                .and_then(|h| h.iter().map(|h| h.seen_ms).max())
                .map(Timestamp::from_unix_ms);
            let failures = failure_stats(team, RecordScope::Agent, &m.value.name, now);
            let mut m: Member = m.value;
            // What the registry says now wins over what the last presence pass stored.
            if !hosts.contains_key(&m.name) {
                m.workers.clear();
            }
            let mut view = MemberView::of(&m, now, team.stale_after_ms(), beat, failures);
            view.served = served.remove(&view.name).unwrap_or_default();
            view
        })
        .collect()
}

fn failure_stats(
    team: &Team,
    scope: RecordScope,
    name: &str,
    now: Timestamp,
) -> Option<FailureStats> {
    team.failures
        .get(&record_key(scope, name))
        .map(|r| r.value.stats_at(now))
}

/// Every role the team knows, sorted: one that a plan task's `role` named and whose attempts
/// were counted (its failure record), one a member's card declares (configured, on the
/// roster, an external member's), and a teammate's.
fn roles(team: &Team) -> Vec<String> {
    let mut roles: BTreeSet<String> = team
        .cards
        .values()
        .flat_map(|c| c.roles.iter().cloned())
        .collect();
    roles.extend(
        team.failures
            .all()
            .into_iter()
            .filter(|(_, r)| r.value.scope == RecordScope::Role)
            .map(|(_, r)| r.value.name),
    );
    roles.extend(team.mates.all().into_iter().map(|(_, m)| m.value.role));
    roles.extend(
        team.roster
            .all()
            .into_iter()
            .flat_map(|(_, m)| m.value.card.roles),
    );
    roles.extend(
        team.external
            .views(Timestamp::now())
            .into_iter()
            .flat_map(|m| m.card.roles),
    );
    roles.into_iter().collect()
}

async fn team_list(team: &Team, req: Request) {
    let Some(r) = parse::<TeamListRequest>(&req).await else {
        return;
    };
    let mut members = views(team, Timestamp::now());
    if let Some(role) = &r.role {
        members.retain(|m| m.has_role(role));
    }
    let reply = TeamList {
        members,
        roles: roles(team),
        teammates: teammates::views(team, None)
            .into_iter()
            .filter(|t| r.role.as_ref().is_none_or(|role| *role == t.role))
            .collect(),
    };
    respond_json(&req, team.bus.max_payload(), &reply, TOO_LARGE).await;
}

async fn team_get(team: &Team, req: Request) {
    let Some(r) = parse::<TeamGetRequest>(&req).await else {
        return;
    };
    let key = member_key(&r.name);
    let all = views(team, Timestamp::now());
    let exact = all.iter().position(|m| member_key(&m.name) == key);
    // An external member may be named as `flotilla call` names it (`agents:coder`, or
    // `agents:coder.alice`) when that names one agent.
    let external = || {
        let target: flotilla_agents::call::Target = r
            .name
            .strip_prefix(crate::external::NAME_PREFIX)?
            .parse()
            .ok()?;
        let mut matching = all.iter().enumerate().filter(|(_, m)| {
            m.external.as_ref().is_some_and(|e| {
                e.agent == target.agent
                    && target.owner.as_ref().is_none_or(|o| *o == e.owner)
                    && target.session.as_ref().is_none_or(|s| *s == e.session)
            })
        });
        match (matching.next(), matching.next()) {
            (Some((i, _)), None) => Some(i),
            _ => None,
        }
    };
    match exact.or_else(external).and_then(|i| all.get(i)) {
        Some(view) => respond_json(&req, team.bus.max_payload(), &view, TOO_LARGE).await,
        None => {
            let known: Vec<String> = all.into_iter().map(|m| m.name).collect();
            respond_error(
                &req,
                404,
                ErrorCode::NotFound,
                format!(
                    "no team member is named {:?} (members: {})",
                    r.name,
                    if known.is_empty() {
                        "none".to_owned()
                    } else {
                        known.join(", ")
                    }
                ),
            )
            .await;
        }
    }
}

/// Best first: online before offline, idle before working or stale, then by name.
fn rank(s: MemberStatus) -> u8 {
    match s {
        MemberStatus::Idle => 0,
        MemberStatus::Working => 1,
        MemberStatus::Waiting => 2,
        MemberStatus::Stale => 3,
        MemberStatus::Offline => 4,
    }
}

async fn team_find(team: &Team, req: Request) {
    let Some(r) = parse::<TeamFindRequest>(&req).await else {
        return;
    };
    let roles = roles(team);
    if !roles.contains(&r.role) {
        return respond_error(
            &req,
            404,
            ErrorCode::UnknownRole,
            format!(
                "the team knows no role {:?} (roles: {}); a role is what a plan task's role names, known once such a task ran, or declared by a member's card (roles = [{:?}]) or a teammate",
                r.role,
                if roles.is_empty() {
                    "none".to_owned()
                } else {
                    roles.join(", ")
                },
                r.role
            ),
        )
        .await;
    }
    let mut members: Vec<MemberView> = views(team, Timestamp::now())
        .into_iter()
        .filter(|m| m.has_role(&r.role) && m.status != MemberStatus::Offline)
        .collect();
    members.sort_by(|a, b| {
        rank(a.status)
            .cmp(&rank(b.status))
            .then(a.name.cmp(&b.name))
    });
    respond_json(
        &req,
        team.bus.max_payload(),
        &TeamList {
            members,
            roles,
            teammates: teammates::views(team, None)
                .into_iter()
                .filter(|t| t.role == r.role)
                .collect(),
        },
        TOO_LARGE,
    )
    .await;
}

async fn team_stats(team: &Team, req: Request) {
    let Some(r) = parse::<TeamStatsRequest>(&req).await else {
        return;
    };
    let now = Timestamp::now();
    let mut records: Vec<FailureStats> = team
        .failures
        .all()
        .into_iter()
        .map(|(_, r)| r.value.stats_at(now))
        .filter(|s| r.name.as_ref().is_none_or(|n| *n == s.name))
        .filter(|s| r.scope.is_none_or(|scope| scope == s.scope))
        .collect();
    records.sort_by(|a, b| a.scope.cmp(&b.scope).then(a.name.cmp(&b.name)));
    if records.is_empty()
        && let Some(name) = &r.name
    {
        let known =
            team.roster.get(&member_key(name)).is_some() || roles(team).iter().any(|r| r == name);
        if !known {
            return respond_error(
                &req,
                404,
                ErrorCode::NotFound,
                format!("no agent or role is named {name:?}"),
            )
            .await;
        }
    }
    respond_json(
        &req,
        team.bus.max_payload(),
        &TeamStats { records },
        TOO_LARGE,
    )
    .await;
}
