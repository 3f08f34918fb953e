//! The supervisor service (`flotilla supervisor`): the management layer's keeper of facts.
//!
//! It follows the event stream and the worker registry and keeps two buckets:
//!
//! - **`<prefix>-team`**, the roster: one entry per member (a configured agent definition
//!   with its card), with its presence — the live workers hosting it, the attempts it runs,
//!   its last progress — and counters. Watchable, so a console can show it live.
//! - **`<prefix>-failures`**, failure records per agent and per role: consecutive failures,
//!   sliding windows (1 h, 24 h, 30 d), last incident; each attempt outcome counted once
//!   across restarts and replicas.
//!
//! It answers the team API (`<prefix>.api.team.list|get|find|stats`, a NATS micro service
//! named `<prefix>-supervisor`); it decides recruitment and retirement under policy
//! (`team.recruit|recruit_status|retire`, [`recruit`]) and keeps **persistent teammates**
//! (`teammates`): spawned by `team.spawn`, woken by mail to their inboxes (`team.send`,
//! `team.broadcast`), ended by `team.shutdown`.
//!
//! Teammates spawned with `expose` (or all, `[agents-protocol] expose-teammates`) are served
//! as agents of the NATS Agent Protocol by every replica ([`exposed`]): a prompt is a
//! message to the teammate, answered with its turn's reply.
//!
//! Agents of the NATS Agent Protocol on the same NATS (not this deployment's own exposed
//! ones) are listed as **external members** ([`external`]): from `$SRV.INFO.agents` and their
//! heartbeats, in memory on every replica.
//!
//! It **remembers** every finished root run once in `<prefix>-memory` (query, plan shape,
//! team, outcome, duration, cost) for the coordinators' planners, and answers
//! `memory.list|get|forget` ([`memory`]).
//!
//! **It decides no run.** The run machine in the coordinator stays the only decider; the
//! supervisor records facts and answers policy questions — a recruit allowed, a member
//! retired — as inputs on the run log, which the machine applies. It is stateless: N replicas share one durable
//! consumer of the event stream (each event message goes to one of them) and write with
//! compare-and-set, so a killed supervisor loses nothing — its unacknowledged messages go to
//! another replica, and a repeated outcome is recognised and not counted twice.

mod api;
mod cas;
mod error;
mod exposed;
mod external;
mod follow;
mod lead;
mod memory;
mod messages;
mod options;
mod presence;
mod recruit;
mod teammates;
mod trust;
mod webhooks;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv;
use flotilla_bus::Bus;
use flotilla_bus::liveness::{Stall, Watchdog};
use flotilla_model::subjects::Bucket;
use flotilla_model::team::{FailureRecord, Member, MemberCard};
use flotilla_model::validate::ValidationContext;
use flotilla_model::worker::WorkerInfo;
use flotilla_runs::RunReader;
use flotilla_telemetry::events::ConsumerStalled;
use flotilla_telemetry::{InternalEvent, Metrics};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

pub use error::SupervisorError;
pub use options::{MemoryOptions, RecruitPolicy, SupervisorOptions, WebhookOptions};

use flotilla_bus::mirror::KvMirror;

/// The durable consumer the replicas share on the event stream.
pub const CONSUMER: &str = "supervisor";

/// Deliveries of an event or inbox message that keeps failing (its write refused, delivery
/// after delivery, pausing 1 s doubling to [`MAX_REDELIVERY_DELAY`]: about two and a half
/// minutes in all) before it is set aside with an error line instead of retried forever.
/// Webhook notices have their own bound (`max-attempts`).
pub(crate) const MAX_DELIVERIES: i64 = 10;

/// The longest pause before such a message is delivered again.
pub(crate) const MAX_REDELIVERY_DELAY: Duration = Duration::from_secs(30);

/// What every part of the supervisor reads and writes.
pub(crate) struct Team {
    pub(crate) bus: Bus,
    pub(crate) opts: SupervisorOptions,
    /// The configured members' cards, by agent name.
    pub(crate) cards: BTreeMap<String, MemberCard>,
    pub(crate) presence_timeout: Duration,
    pub(crate) team_kv: kv::Store,
    pub(crate) failures_kv: kv::Store,
    pub(crate) roster: KvMirror<Member>,
    /// Persistent teammates (`teammate.<team>.<name>`).
    pub(crate) mates: KvMirror<flotilla_model::teammate::Teammate>,
    pub(crate) failures: KvMirror<FailureRecord>,
    pub(crate) workers: KvMirror<WorkerInfo>,
    pub(crate) metrics: Metrics,
    /// Run records and plans (recruitment checks the run it changes).
    pub(crate) runs: RunReader,
    /// Budgets spent (`budget.<run>` in the cursors bucket), read by recruitment.
    pub(crate) cursors_kv: kv::Store,
    /// What a recruit's amended plan is validated against: the deployment's agents, roles
    /// and pools, as the coordinators validate submissions.
    pub(crate) validation: ValidationContext,
    /// Remembered runs (`run.<run>`), written once per finished root run ([`memory`]).
    pub(crate) memory_kv: kv::Store,
    /// Trust records (`<scope>.<name>`), kept by [`trust`].
    pub(crate) trust_kv: kv::Store,
    pub(crate) trusts: KvMirror<flotilla_model::trust::TrustRecord>,
    /// The rules levels are earned by (`[hitl.trust]`).
    pub(crate) trust: flotilla_machine::policy::TrustConfig,
    /// External members: agents of the NATS Agent Protocol, kept in memory
    /// ([`external`]).
    pub(crate) external: external::External,
    /// `[agents-protocol]`: which teammates are served as agents of the protocol, under
    /// which owner ([`exposed`]).
    pub(crate) agents: flotilla_agents::AgentsProtocolOptions,
    /// The addresses of the agent definitions the coordinators expose: a teammate whose
    /// address is one of them is not served (the definition keeps it).
    pub(crate) exposed_definitions: std::collections::BTreeSet<flotilla_agents::wire::AgentAddress>,
    /// The installation's quotas, followed from its usage bucket: `persistent_teammates`
    /// is held here ([`teammates`]).
    pub(crate) quotas: flotilla_tenants::ledger::Ledger,
}

impl Team {
    pub(crate) fn stale_after_ms(&self) -> i64 {
        i64::try_from(self.opts.stale_after.as_millis()).unwrap_or(i64::MAX)
    }
}

/// How long the supervisor waits at start for the installation's quotas.
const QUOTA_SYNC_WAIT: Duration = Duration::from_secs(5);

/// The supervisor service.
pub struct Supervisor {
    bus: Bus,
    opts: SupervisorOptions,
    cards: BTreeMap<String, MemberCard>,
    heartbeat: Duration,
    metrics: Metrics,
    validation: ValidationContext,
    trust: flotilla_machine::policy::TrustConfig,
    agents: flotilla_agents::AgentsProtocolOptions,
    exposed_definitions: std::collections::BTreeSet<flotilla_agents::wire::AgentAddress>,
    /// Whether it takes part in the NATS Agent Protocol (external members, exposed
    /// teammates): not for a tenant, whose users have no rights on the protocol's shared
    /// subjects.
    agents_protocol: bool,
    ready: Option<oneshot::Sender<()>>,
}

impl std::fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervisor")
            .field("prefix", &self.bus.names().prefix())
            .field("members", &self.cards.len())
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl Supervisor {
    /// A supervisor of the members `cards` (agent name → card), for workers that refresh
    /// their registry entry every `heartbeat` (the default presence timeout is two of them).
    pub fn new(
        bus: Bus,
        opts: SupervisorOptions,
        cards: BTreeMap<String, MemberCard>,
        heartbeat: Duration,
    ) -> Self {
        Self {
            bus,
            opts,
            cards,
            heartbeat,
            metrics: Metrics::new(),
            validation: ValidationContext::default(),
            trust: flotilla_machine::policy::TrustConfig::default(),
            agents: flotilla_agents::AgentsProtocolOptions::default(),
            exposed_definitions: Default::default(),
            agents_protocol: true,
            ready: None,
        }
    }

    /// Serves persistent teammates as agents of the NATS Agent Protocol under `opts`
    /// (`[agents-protocol]`: `expose-teammates`, owner, heartbeat, keep-alives, timeout);
    /// `definitions`: the addresses of the agent definitions the coordinators expose, which
    /// no teammate takes.
    pub fn with_agents_protocol(
        mut self,
        opts: flotilla_agents::AgentsProtocolOptions,
        definitions: impl IntoIterator<Item = flotilla_agents::wire::AgentAddress>,
    ) -> Self {
        self.agents = opts;
        self.exposed_definitions = definitions.into_iter().collect();
        self
    }

    /// Takes no part in the NATS Agent Protocol: no external members, no exposed teammates
    /// (a tenant's supervisor: the protocol's subjects are shared by the whole account).
    pub fn without_agents_protocol(mut self) -> Self {
        self.agents_protocol = false;
        self
    }

    /// Validates recruits' subtasks against `validation` (the deployment's agents, roles,
    /// pools and limits — what the coordinators check submissions against). Without it only
    /// the plan's structure is checked.
    pub fn with_validation(mut self, validation: ValidationContext) -> Self {
        self.validation = validation;
        self
    }

    /// Earns trust levels by `trust` (`[hitl.trust]`; the default rules without it).
    pub fn with_trust(mut self, trust: flotilla_machine::policy::TrustConfig) -> Self {
        self.trust = trust;
        self
    }

    /// Records metrics in `metrics` (the process's registry).
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Signals `ready` once the consumer is bound, the mirrors are in sync and the API
    /// answers.
    pub fn on_ready(mut self, ready: oneshot::Sender<()>) -> Self {
        self.ready = Some(ready);
        self
    }

    /// Runs until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), SupervisorError> {
        self.opts.validate().map_err(SupervisorError::Setup)?;
        self.agents
            .validate()
            .map_err(|e| SupervisorError::Setup(format!("[agents-protocol] {e}")))?;
        // Opening rides out a cluster's leader election (`startup-wait`).
        let patience =
            flotilla_bus::startup::Patience::new(self.opts.startup_wait, shutdown.clone());
        let open = |b: Bucket| {
            let (bus, patience) = (self.bus.clone(), patience.clone());
            async move {
                patience
                    .ride_out("opening a bucket", || bus.kv(b))
                    .await
                    .map_err(|e| SupervisorError::Setup(e.to_string()))
            }
        };
        let team_kv = open(Bucket::Team).await?;
        let failures_kv = open(Bucket::Failures).await?;
        let workers_kv = open(Bucket::Workers).await?;
        let cursors_kv = open(Bucket::Cursors).await?;
        let memory_kv = open(Bucket::Memory).await?;
        let trust_kv = open(Bucket::Trust).await?;
        let runs = patience
            .ride_out("opening the run store", || RunReader::open(&self.bus))
            .await
            .map_err(|e| SupervisorError::Setup(e.to_string()))?;
        let mut quotas = patience
            .ride_out("opening the usage bucket", || {
                flotilla_tenants::ledger::Ledger::open(&self.bus)
            })
            .await
            .map_err(|e| SupervisorError::Setup(e.to_string()))?
            .with_tenant(
                self.bus
                    .tenant()
                    .and_then(|t| flotilla_model::tenant::TenantName::new(t).ok()),
            );
        quotas.follow_quotas(shutdown.clone());
        let team = Arc::new(Team {
            bus: self.bus.clone(),
            presence_timeout: self.opts.presence_timeout_or(self.heartbeat),
            opts: self.opts,
            cards: self.cards,
            team_kv: team_kv.clone(),
            failures_kv: failures_kv.clone(),
            roster: KvMirror::new(),
            mates: KvMirror::new(),
            failures: KvMirror::new(),
            workers: KvMirror::new(),
            metrics: self.metrics,
            runs,
            cursors_kv,
            validation: self.validation,
            memory_kv,
            trust_kv: trust_kv.clone(),
            trusts: KvMirror::new(),
            trust: self.trust,
            external: external::External::default(),
            agents: self.agents,
            exposed_definitions: self.exposed_definitions,
            quotas,
        });
        // The team bucket holds members, teammates and conversations: each mirror takes its
        // own keys (conversations are read by the workers only).
        team.roster
            .follow_keys(team_kv.clone(), "agent.>", shutdown.clone());
        team.mates
            .follow_keys(team_kv, "teammate.>", shutdown.clone());
        team.failures.follow(failures_kv, shutdown.clone());
        team.workers.follow(workers_kv, shutdown.clone());
        team.trusts.follow(trust_kv, shutdown.clone());
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = async {
                team.roster.synced().await;
                team.mates.synced().await;
                team.failures.synced().await;
                team.workers.synced().await;
                team.trusts.synced().await;
            } => {}
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = team.quotas.synced() => {}
            _ = tokio::time::sleep(QUOTA_SYNC_WAIT) => {
                // NATS permissions of an older deployment (no usage bucket): the watch keeps
                // trying, and the quotas apply once it reads them.
                warn!(
                    "The installation's quotas cannot be read yet (the supervisor's NATS user needs the usage bucket, see deploy/nats/accounts.conf); spawning teammates without them until they can"
                );
            }
        }
        trust::export_all(&team);
        // Every configured member is on the roster before the API answers (readiness): a
        // client that lists the team at once sees all of it, not the part written so far.
        if let Err(e) = presence::refresh(&team).await {
            warn!(error = %e, "Could not write the roster at start; the presence pass will retry");
        }
        let consumer = follow::consumer(&team, &patience).await?;
        let inbox = teammates::consumer(&team, &patience).await?;
        // Before the API answers (readiness): a notice published once the supervisor is
        // ready reaches every webhook.
        let hooks = webhooks::prepare(&team, &patience).await?;
        let service = api::start(&team).await?;
        // Every endpoint's subscription is at the server before the supervisor says it is
        // ready: a request sent once it is ready finds its endpoint.
        team.bus
            .client()
            .flush()
            .await
            .map_err(|e| SupervisorError::Setup(format!("starting the team API: {e}")))?;
        // Every pull loop marks its pulls; one that stops pulling while its consumer holds
        // messages is restarted (`flotilla_bus::liveness`), checked every heartbeat.
        let metrics = team.metrics.clone();
        let watchdog = Watchdog::new(
            self.heartbeat,
            Arc::new(move |s: &Stall| {
                ConsumerStalled {
                    stream: &s.stream,
                    consumer: &s.consumer,
                    pending: s.pending,
                    since_pull: s.since_pull,
                }
                .emit(&metrics);
            }),
        );
        let events_pulse = watchdog.watch(&consumer);
        let inbox_pulse = watchdog.watch(&inbox);
        let hooks: Vec<_> = hooks
            .into_iter()
            .map(|(hook, c)| (watchdog.watch(&c), hook, c))
            .collect();
        let mut tasks = tokio::task::JoinSet::new();
        {
            let stop = shutdown.clone();
            tasks.spawn(async move {
                watchdog.run(stop).await;
                Ok(())
            });
        }
        {
            let (team, stop) = (Arc::clone(&team), shutdown.clone());
            tasks.spawn(async move { presence::run(team, stop).await });
        }
        {
            let (team, stop) = (Arc::clone(&team), shutdown.clone());
            tasks.spawn(async move { follow::run(team, consumer, events_pulse, stop).await });
        }
        if team.opts.external_agents && self.agents_protocol {
            let (team, stop) = (Arc::clone(&team), shutdown.clone());
            tasks.spawn(async move { external::run(team, stop).await });
        }
        {
            let (team, stop) = (Arc::clone(&team), shutdown.clone());
            tasks.spawn(async move { api::serve(team, service, stop).await });
        }
        {
            let (team, stop) = (Arc::clone(&team), shutdown.clone());
            tasks.spawn(async move { teammates::follow(team, inbox, inbox_pulse, stop).await });
        }
        if self.agents_protocol {
            let (team, stop) = (Arc::clone(&team), shutdown.clone());
            tasks.spawn(async move { exposed::run(team, stop).await });
        }
        for (pulse, hook, consumer) in hooks {
            let (team, stop) = (Arc::clone(&team), shutdown.clone());
            tasks.spawn(async move { webhooks::deliver(team, hook, consumer, pulse, stop).await });
        }
        info!(members = team.cards.len(), "Supervisor started");
        if let Some(ready) = self.ready {
            let _ = ready.send(());
        }
        let mut result = Ok(());
        while let Some(r) = tasks.join_next().await {
            match r {
                Ok(Err(e)) if result.is_ok() => {
                    shutdown.cancel();
                    result = Err(e);
                }
                Err(e) if result.is_ok() => {
                    shutdown.cancel();
                    result = Err(SupervisorError::Setup(format!(
                        "a supervisor task ended: {e}"
                    )));
                }
                _ => {}
            }
        }
        result
    }
}
