//! Tenants: one deployment shared by many teams.
//!
//! A tenant is an installation of its own inside the deployment's NATS account — its own
//! prefix (`<prefix>-<tenant>`: subjects, streams, buckets), its own users pinned to that
//! prefix by the server's permissions, and its own inbox prefix (`_INBOX_<tenant>`) — so the
//! NATS server, not Flotilla, keeps tenants apart. Re-exported as `flotilla_model::tenant`.

pub mod tenant;
