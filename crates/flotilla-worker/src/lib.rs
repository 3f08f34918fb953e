//! The Flotilla worker: pulls the tasks of one pool, runs agents, publishes results.
//!
//! ```text
//!  FLOTILLA_TASKS ──pull (as many as free slots)──► worker ──► agent
//!        ▲                                            │ every heartbeat: +WPI (in progress)
//!        │                                            ▼
//!        └──────────── ack ◄── result acknowledged ◄── flotilla.runlog.<run> (result)
//! ```
//!
//! * One durable pull consumer per pool (`pool-<name>`), shared by every worker of the pool;
//!   each worker asks for exactly as many messages as it has free slots, so nothing waits in
//!   a client buffer while its ack timer runs.
//! * Prefetch follows the pace of the work: while this worker's recent attempts are short
//!   (under [`PREFETCH_MAX_ATTEMPT`] on average) it holds up to `prefetch` tasks beyond its
//!   slots, so a freed slot starts its next task without a pull round trip. A new worker, and
//!   one whose attempts take longer (model calls), pulls only for free slots: a task never
//!   waits behind a long attempt here while another worker of the pool has a free slot.
//! * While an agent runs, and until its result is stored (a run log without a leader for a
//!   few seconds while a cluster node dies), the worker sends in-progress acknowledgements
//!   twice per heartbeat;
//!   the consumer's ack wait is one and a half heartbeats, so a dead worker's task is
//!   redelivered to another worker within 1.5 heartbeats (7.5 s at the default 5 s), while a
//!   live worker has three chances per ack wait to keep its task.
//! * Cancellation: workers watch the control bucket; when a run is cancelled or aborted, its
//!   running attempts here are cancelled at once (event-driven), and a task of such a run that
//!   is pulled later is answered `cancelled` without running.
//! * A result larger than the server's max payload becomes a `result_too_large` failure
//!   instead of a publish retried forever.
//! * The task is acknowledged only after its result is durably in the run log (ack after
//!   result). Results carry `Nats-Msg-Id: result.<run>.<task>.<attempt>`, and the coordinator
//!   applies each attempt's result once.
//! * A message delivered more than `max-deliveries` times (workers keep dying on it) becomes a
//!   `redeliveries_exhausted` failure instead of another crash.
//! * Graceful stop: stop pulling, let in-flight tasks finish within the grace period, then
//!   cancel the rest and hand them back (NAK) so another worker starts them at once.
//! * Live registry: the worker keeps its entry in the `flotilla-workers` KV bucket (TTL).
//! * Anycast: a worker whose agents fill team roles (their member cards) also pulls each
//!   role's queue (`role-<role>`, shared by every worker hosting a member) while it has a
//!   free slot — or, every slot taken, in line with the tasks waiting for one, so a worker
//!   kept busy by its pool still takes its share — and claims what it takes on the run log
//!   before its member runs it (`claim`). Teammate turns (`turns-<pool>`) are pulled the same
//!   way (`turn`).
//! * Liveness: every pull loop (pool, roles, turns) marks its pulls; one that makes none for
//!   two heartbeats while its consumer holds messages is restarted, with a warning and
//!   `flotilla_consumer_stalls_total{consumer}` (`flotilla_bus::liveness`). A loop waiting
//!   for a free slot is not pulling on purpose and is never taken for stalled.
//!
//! The worker's parts: `worker` (setup, the pull loop, the graceful stop), `attempt` (one
//! delivered task, from checks to the agent's run), `claim` (role queues and claims), `result`
//! (storing results, then the acknowledgement), `cancel` (cancelled runs and the control bucket's notices), `pace`
//! (whether prefetch pays), `registry` (the live registry entry), `shared` (state
//! shared by the worker's tasks) and `error`.

pub mod agent;
pub mod agents;
pub mod options;

mod attempt;
mod cancel;
mod claim;
mod error;
pub mod inbox;
mod pace;
mod pull;
mod registry;
mod result;
mod shared;
pub mod turn;
mod worker;

pub use crate::agents::{AgentDefinition, AgentEntry, AgentRegistry, RoleConfig};
pub use crate::claim::role_consumer;
pub use crate::error::{WorkerError, WorkerErrorKind};
pub use crate::options::WorkerOptions;
pub use crate::pace::PREFETCH_MAX_ATTEMPT;
pub use crate::worker::{Worker, pool_consumer};
pub use flotilla_context::{Agent, AgentReply, Clients, Scope, WorkerSlot};
pub use flotilla_model::worker::WorkerInfo;
