//! The agent team: members and their roster, persistent teammates, recruits, a run's lead, memory of past runs, live workers.
//!
//! Each module is re-exported at the crate's root (`flotilla_model::team`), its public
//! path.

pub mod lead;
pub mod memory;
pub mod recruit;
pub mod team;
pub mod teammate;
pub mod teammate_mail;
pub mod worker;
