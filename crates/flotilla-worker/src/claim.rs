//! Anycast: claiming tasks that name a team role and no agent.
//!
//! ```text
//!  coordinator ── <prefix>.role.<role>.<run>.<task> ──► FLOTILLA_TASKS (work queue)
//!                                                          │ consumer "role-<role>", shared by
//!                                                          │ every worker hosting a member
//!            a free slot here? ── pull (up to the free slots) ◄┘
//!                 │
//!                 ▼
//!  claim ── runlog.<run>: claimed {agent, worker} (msg id claimed.<run>.<task>.<attempt>)
//!    └──► the member (first agent of the role here, by name) runs it; result, then ack
//! ```
//!
//! A worker pulls from one role consumer per role its agents fill, beside its pool's
//! consumer, sharing its agent slots with it: a role pull is made while a slot is free, and
//! asks for at most as many tasks as there are free slots, so the member that claims a task
//! is a free one. A worker whose slots are all taken waits in line with the tasks already
//! waiting for a slot here, then pulls one task, which waits for a slot in turn (kept alive,
//! like a prefetched task): a worker kept busy by its pool still takes its share of the
//! role's work. Two pulls made at the same moment (the pool's and a role's) may bring more
//! tasks than slots: the extra ones wait here the same way — rare, and bounded by the free
//! slots of one pull. The pool's own pull loop is unchanged, and a worker whose agents fill
//! no role has no role consumer at all.
//!
//! The work queue gives each message to one consumer and each delivery to one worker; the
//! acknowledgement after the stored result makes the attempt run once, as for pool tasks
//! (a redelivery after a worker's death asks whether the attempt already has a result).
//! The claim tells the run machine that the attempt's wait for a member is over: an anycast
//! attempt that no member claims within the plan's `dependency_timeout` fails
//! `role_unclaimed` (a decision of the machine, in run-log order). The claim is sent before
//! the agent starts and its acknowledgement awaited alongside the run, so it costs the
//! attempt no round trip.

use std::time::Duration;

use flotilla_bus::{SharedConsumer, wire};
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::codec::Codec;
use flotilla_model::runlog::{Claimed, RunInput, RunLogEntry, claimed_msg_id};
use flotilla_model::subjects::StreamKind;
use flotilla_model::task::TaskEnvelope;
use tracing::warn;

use crate::options::WorkerOptions;
use crate::shared::Shared;

/// How long a claim that could not be stored is sent again before the worker gives up on it
/// (the run log without a leader for a few seconds while a cluster node dies).
const CLAIM_RIDE_OUT: Duration = Duration::from_secs(20);

/// What a worker claimed a role task as: the role, and the member of it that runs the task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Claim {
    /// The role whose queue delivered the task.
    pub(crate) role: String,
    /// The agent definition here that fills the role and runs the task.
    pub(crate) agent: String,
}

/// The shared durable consumer of `role`'s queue (`role-<role>` on the tasks stream), as the
/// workers hosting a member of the role create it.
pub fn role_consumer(
    names: &flotilla_model::Names,
    role: &str,
    opts: &WorkerOptions,
) -> SharedConsumer {
    SharedConsumer {
        stream: StreamKind::Tasks,
        durable: names.role_consumer(role),
        description: format!("Flotilla members of role {role}"),
        filters: vec![names.role_filter(role)],
        ack_wait: opts.ack_wait(),
        max_ack_pending: 100_000,
        only_new: false,
    }
}

/// Sends the claim of `task`'s attempt to its run log now, and returns a future that stores
/// it for sure (waiting for the acknowledgement, sending again while the run log is briefly
/// unavailable): the caller runs the agent meanwhile.
pub(crate) async fn send_claim(
    shared: &Shared,
    task: &TaskEnvelope,
    claim: &Claim,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let entry = RunLogEntry {
        protocol: PROTOCOL_VERSION,
        run_id: task.run_id,
        input: RunInput::Claimed(Box::new(Claimed {
            task_id: task.task_id.clone(),
            attempt: task.attempt,
            attempt_id: task.attempt_id,
            worker: shared.id.clone(),
            agent: claim.agent.clone(),
            role: claim.role.clone(),
        })),
    };
    let msg_id = claimed_msg_id(task.run_id, &task.task_id, task.attempt);
    let bus = shared.bus.clone();
    let subject = bus.names().runlog(task.run_id);
    let (run, task_id) = (task.run_id, task.task_id.clone());
    let out = wire::encode(&entry, Codec::Json, Some(&msg_id));
    // Sent at once, on the connection the result will follow on: the claim is stored first.
    let first = match &out {
        Ok(out) => Some(
            bus.js()
                .publish_with_headers(subject.clone(), out.headers.clone(), out.payload.clone())
                .await,
        ),
        Err(_) => None,
    };
    async move {
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                warn!(%run, task = %task_id, error = %e, "Cannot encode a claim");
                return;
            }
        };
        if let Some(Ok(ack)) = first
            && ack.await.is_ok()
        {
            return;
        }
        let until = tokio::time::Instant::now() + CLAIM_RIDE_OUT;
        if let Err(e) = bus.publish_retrying(subject, out, until).await {
            warn!(%run, task = %task_id, error = %e, "The claim of a role task could not be stored; its attempt may be failed as unclaimed");
        }
    }
}
