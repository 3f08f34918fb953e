//! Collaboration between agents: workspace topics, mailboxes, session state, artifacts.
//!
//! Each module is re-exported at the crate's root (`flotilla_model::workspace`), its public
//! path.

pub mod artifact;
pub mod mailbox;
pub mod state;
pub mod workspace;
