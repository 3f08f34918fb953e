//! Flotilla on the NATS Agent Protocol: agents that register as the NATS micro service
//! `agents`, are discovered with `$SRV.INFO.agents`, beat on `agents.hb.…`, and take a
//! streaming `prompt`. Platform teams run such agents next to Flotilla on the same NATS;
//! this crate lets each side use the other.
//!
//! * [`wire`]: the protocol's subjects, metadata and message shapes (no I/O).
//! * [`Exposer`]: Flotilla's agent definitions that opt in (`expose = true`, or
//!   `[agents-protocol] expose-all`) as agents of the protocol. A prompt starts a Flotilla
//!   run of the agent and streams its replies back; its questions become the protocol's
//!   `query`; a caller that goes away cancels the run. Started by `flotilla coordinator`
//!   (and `flotilla up`) once its coordinator is ready, stateless, one service instance per
//!   agent per process.
//! * [`serve`]: what every Flotilla agent of the protocol shares (the service instance,
//!   heartbeats, `status`, refusals, keep-alives, error frames, the end); a [`serve::Prompter`]
//!   says what a prompt does.
//! * [`teammate`]: persistent teammates as agents of the protocol (served by the
//!   supervisors): their addresses and metadata, and how the reply to a prompt is read from
//!   the teammate's conversation.
//! * [`call`]: calling an agent of the protocol (`flotilla call agents:…`, an LLM agent's
//!   `call_agent`), and [`ask`]: the question such an agent asks a calling attempt, put to a
//!   person as a Flotilla approval.
//!
//! ```no_run
//! # async fn demo(bus: flotilla_bus::Bus) -> Result<(), flotilla_agents::AgentsError> {
//! use flotilla_agents::{AgentsProtocolOptions, ExposedAgent, Exposer};
//! let agents = vec![ExposedAgent { name: "writer".into(), card: Default::default() }];
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! Exposer::new(bus, AgentsProtocolOptions::default(), agents).run(shutdown).await?;
//! # Ok(()) }
//! ```

pub mod ask;
pub mod call;
pub mod expose;
pub mod options;
pub mod serve;
pub mod teammate;
pub mod wire;

pub use expose::{ExposedAgent, Exposer};
pub use options::AgentsProtocolOptions;
pub use serve::Registration;

flotilla_bus::error_kinds!(
    /// Why speaking the protocol failed.
    AgentsErrorKind {
        /// The configuration cannot be served (a name that is no agent token, two names
        /// with one token, a bad owner or session).
        Config => "invalid agents-protocol configuration", Terminal;
        /// NATS failed.
        Nats => "NATS request failed", Retryable;
    }
);

/// Speaking the protocol failed.
pub type AgentsError = flotilla_bus::error::Error<AgentsErrorKind>;
