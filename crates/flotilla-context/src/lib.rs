//! The agent context: what an agent can reach besides its task envelope, scoped to its run
//! tree, its session and its identity (DESIGN §6).
//!
//! | Capability | Backed by | Client |
//! |---|---|---|
//! | workspace topics | stream `<PREFIX>_WORKSPACE`, `<prefix>.ws.<root>.<topic>` | [`Workspace`] |
//! | mailboxes | stream `<PREFIX>_MAILBOX`, `<prefix>.mbox.<root>.<to>.<from>` | [`Mailbox`] |
//! | session state | KV `<prefix>-state`, `<session>.<key>` | [`State`] |
//! | artifacts | object store `<prefix>-artifacts`, `runs/<root>/<name>` | [`Artifacts`] |
//!
//! Every kind of agent reaches the same capabilities: Rust agents through [`AgentContext`],
//! exec agents through the `flotilla ws|mbox|state|artifacts` commands (which build the same
//! clients from the environment the worker sets, [`Scope::from_env`]), and any NATS client
//! through the subjects and message formats of `docs/protocol.md`.
//!
//! Rules every client keeps:
//! * writes are idempotent per attempt (message ids derived from the attempt id and the
//!   content), so a redelivered attempt does not duplicate what its predecessor wrote;
//! * time is the server's (JetStream timestamps), never the agent's clock;
//! * reads never lose data: workspace reads page by sequence, mailbox readers have durable
//!   cursors (at-least-once across crashes);
//! * sizes and names are checked where a write enters, with a [`ContextError`] naming the
//!   problem.
//!
//! ```no_run
//! # async fn example(ctx: flotilla_context::AgentContext) -> Result<(), flotilla_context::ContextError> {
//! let mut entry = serde_json::Map::new();
//! entry.insert("revenue".into(), 1250.into());
//! ctx.workspace().append("quarterly figures", entry).await?;
//! let page = ctx.workspace().read("quarterly_figures", 0, None).await?;
//! let mail = ctx.mailbox().receive(None, std::time::Duration::from_secs(5)).await?;
//! # let _ = (page, mail); Ok(()) }
//! ```

pub mod agent;
pub mod artifacts;
mod canonical;
pub mod children;
pub mod env;
pub mod error;
pub mod journal;
pub mod mailbox;
pub mod negotiate;
pub mod scope;
pub mod slot;
pub mod state;
pub mod workspace;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use async_nats::jetstream::{kv, object_store};
use flotilla_bus::Bus;
use flotilla_model::subjects::Bucket;
use tokio::sync::{Mutex, OnceCell};

pub use agent::{Agent, AgentContext, AgentError, AgentReply, EventEmitter};
pub use artifacts::Artifacts;
pub use children::{ChildCall, ChildRun, RejectedChild, binding_failure};
pub use env::{connection_env, connection_from_env};
pub use error::{ContextError, ErrorKind};
pub use mailbox::{Mailbox, Sent};
pub use negotiate::{Award, Offer};
pub use scope::Scope;
pub use slot::WorkerSlot;
pub use state::State;
pub use workspace::{Appended, Workspace};

/// Most bytes one read page asks the server for: a page of large entries holds fewer than
/// its limit (and says `more`), so a reader never receives hundreds of MiB at once.
pub const PAGE_MAX_BYTES: usize = 4 * 1024 * 1024;

/// Room kept below the server's max payload for headers when checking a write's size.
pub const HEADER_ROOM: usize = 4 * 1024;

/// How long a write rides out a stream that has no leader for a moment (a cluster node died
/// and a new leader is being elected: 4–7 s measured on three nodes) before it fails
/// `unavailable`: an agent's write does not fail on a transient fault of the cluster.
pub const RIDE_OUT: std::time::Duration = std::time::Duration::from_secs(20);

/// Handles opened once and shared by every client of one scope.
#[derive(Default)]
pub(crate) struct Handles {
    // Boxed: a store handle holds its stream's whole info (about 1.5 KiB each) and most
    // attempts never open one, while thousands of attempts wait at once.
    state_kv: OnceCell<Box<kv::Store>>,
    cursors_kv: OnceCell<Box<kv::Store>>,
    objects: OnceCell<Box<object_store::ObjectStore>>,
    /// The mailbox reader's position: one per attempt, kept across `mailbox()` calls.
    pub(crate) reader: Mutex<mailbox::ReaderState>,
    /// Negotiations started by this scope (deterministic correlation ids per attempt).
    pub(crate) negotiations: AtomicU64,
    /// Child runs started by this scope without a call id (numbered per attempt).
    pub(crate) child_calls: AtomicU64,
}

/// The clients of one scope: cheap to clone, sharing their handles and the mailbox read
/// position.
#[derive(Clone)]
pub struct Clients {
    bus: Bus,
    scope: Arc<Scope>,
    handles: Arc<Handles>,
    persist_position: bool,
}

impl fmt::Debug for Clients {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Clients")
            .field("scope", &self.scope)
            .field("persist_position", &self.persist_position)
            .finish()
    }
}

impl Clients {
    /// Clients for `scope` over `bus`. Their prefixes must agree (both come from the same
    /// installation).
    pub fn new(bus: Bus, scope: Scope) -> Result<Self, ContextError> {
        if bus.names() != &scope.names {
            return Err(ContextError::new(
                ErrorKind::InvalidScope,
                format!(
                    "the scope's prefix {:?} differs from the connection's {:?}",
                    scope.names.prefix(),
                    bus.names().prefix()
                ),
            ));
        }
        Ok(Self {
            bus,
            scope: Arc::new(scope),
            handles: Arc::new(Handles::default()),
            persist_position: false,
        })
    }

    /// Keeps the mailbox read position of this execution in the cursors bucket after every
    /// read, so the next process of the same execution continues from it: what the CLI does
    /// inside an exec agent, where each `flotilla mbox read` is a new process.
    pub fn persist_read_position(mut self, on: bool) -> Self {
        self.persist_position = on;
        self
    }

    /// The connection.
    pub fn bus(&self) -> &Bus {
        &self.bus
    }

    /// The scope.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The scope, shared.
    pub fn scope_arc(&self) -> Arc<Scope> {
        Arc::clone(&self.scope)
    }

    /// Workspace topics of the run tree.
    pub fn workspace(&self) -> Workspace {
        Workspace::new(self.clone())
    }

    /// The scope's mailbox (its read position is shared by every handle of these clients).
    pub fn mailbox(&self) -> Mailbox {
        Mailbox::new(self.clone())
    }

    /// Session state.
    pub fn state(&self) -> State {
        State::new(self.clone())
    }

    /// Artifacts of the run tree.
    pub fn artifacts(&self) -> Artifacts {
        Artifacts::new(self.clone())
    }

    /// The environment an exec agent needs to reach these capabilities through the CLI: the
    /// scope ([`Scope::to_env`]) and the connection ([`connection_env`]). Its trace context
    /// (`TRACEPARENT`) is the current span's while spans are exported, so the child runs the
    /// command starts nest under the attempt (or tool call) that runs it.
    pub fn agent_env(&self) -> Vec<(&'static str, String)> {
        let mut env = self.scope.to_env();
        if let Some(current) = flotilla_telemetry::trace_context::current() {
            env.retain(|(k, _)| *k != scope::ENV_TRACEPARENT && *k != scope::ENV_TRACESTATE);
            env.push((scope::ENV_TRACEPARENT, current.traceparent));
            if let Some(state) = current.tracestate {
                env.push((scope::ENV_TRACESTATE, state));
            }
        }
        env.extend(connection_env(self.bus.options()));
        env
    }

    pub(crate) async fn state_kv(&self) -> Result<&kv::Store, ContextError> {
        self.handles
            .state_kv
            .get_or_try_init(|| async {
                self.bus
                    .kv(Bucket::State)
                    .await
                    .map(Box::new)
                    .map_err(|e| error::unavailable("opening the session-state bucket", e))
            })
            .await
            .map(|s| &**s)
    }

    pub(crate) async fn cursors_kv(&self) -> Result<&kv::Store, ContextError> {
        self.handles
            .cursors_kv
            .get_or_try_init(|| async {
                self.bus
                    .kv(Bucket::Cursors)
                    .await
                    .map(Box::new)
                    .map_err(|e| error::unavailable("opening the cursors bucket", e))
            })
            .await
            .map(|s| &**s)
    }

    pub(crate) async fn objects(&self) -> Result<&object_store::ObjectStore, ContextError> {
        self.handles
            .objects
            .get_or_try_init(|| async {
                let name = self.bus.names().artifacts_bucket();
                self.bus
                    .js()
                    .get_object_store(&name)
                    .await
                    .map(Box::new)
                    .map_err(|e| {
                        error::unavailable(
                            format!("opening object store {name} (run `flotilla nats provision`?)"),
                            e,
                        )
                    })
            })
            .await
            .map(|s| &**s)
    }

    /// Largest encoded write the deployment takes: `cap`, lowered to the server's max
    /// payload minus room for headers.
    pub(crate) fn write_cap(&self, cap: usize) -> usize {
        cap.min(self.bus.max_payload().saturating_sub(HEADER_ROOM))
    }
}
