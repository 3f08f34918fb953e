//! Flotilla's tenants: one deployment shared by many teams.
//!
//! - [`store`]: the tenant records (`flotilla tenant add|list|show|remove`).
//! - [`natsconf`]: the NATS users and permissions that keep tenants apart, generated from
//!   the shipped `deploy/nats/accounts.conf` (`flotilla tenant nats-config`).
//! - [`ledger`]: an installation's quotas and what they count (`<prefix>-usage`), held by
//!   its coordinators at admission and at each run's end (`flotilla tenant usage`).
//! - [`space`]: the byte quotas of its workspace and mailboxes, held by the NATS server.
//!
//! A tenant is an installation of its own (prefix `<prefix>-<tenant>`) whose users the NATS
//! server pins to that prefix; see `docs/architecture.md`, "Tenants".

pub mod error;
pub mod ledger;
pub mod natsconf;
pub mod space;
pub mod store;

pub use error::{TenantError, TenantErrorKind};
pub use store::TenantStore;
