//! People in the loop: approvals and the policy that asks for them, earned trust, notices.
//!
//! Each module is re-exported at the crate's root (`flotilla_model::approval`), its public
//! path.

pub mod approval;
pub mod notify;
pub mod trust;
