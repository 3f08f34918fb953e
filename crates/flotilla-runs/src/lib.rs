//! Flotilla's read model of runs: what a run is, as stored and as read.
//!
//! The coordinator writes runs; everything else — the client library, `flotilla runs`,
//! `flotilla watch`, the coordinator's own API — reads them through this crate, so a Rust
//! user of the client does not compile the scheduler. It holds:
//!
//! * [`reader`]: [`RunReader`] — records, first messages, plans, results, histories, session
//!   indexes and workspace pages, from the `flotilla-runs` KV bucket and the run log.
//! * [`snapshot`]: a run's stored record ([`Snapshot`]: the run machine's state and outbox)
//!   and the public [`RunRecord`](flotilla_model::run::RunRecord) and view made from it.
//! * [`first`]: a run's first message, and what can be read of a submission that does not
//!   decode.
//! * [`tree`]: run trees and sessions as read.
//! * [`diff`]: two runs compared, task by task.
//! * [`replay`]: a run replayed from its log through the run machine, checked against what
//!   it recorded.
//! * [`watch`]: the projection engine of a run tree's events per audience.
//!
//! The state it decodes is the run machine's ([`flotilla_machine`]): pure code, the only
//! place a run's decisions are made.

mod conversation;
pub mod diff;
pub mod error;
pub mod first;
pub mod reader;
pub mod replay;
pub mod snapshot;
pub mod tree;
pub mod watch;

pub use error::{StoreError, StoreErrorKind, WatchError, WatchErrorKind};
pub use first::{First, FirstMessage, UnreadableSubmission};
pub use reader::RunReader;
pub use snapshot::{Snapshot, StoredSnapshot, record_of, unix_ms, view_of};
