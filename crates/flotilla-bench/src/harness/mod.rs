//! What the sections share, so that each section is one module that imports only this:
//! output, processes and their costs, the services and their configurations, submitting and
//! observing runs, shared plans, statistics, and the raw JetStream round trip the Flotilla
//! figures are compared with. Nothing here imports a section.

#[macro_use]
pub(crate) mod output;
pub(crate) mod plans;
pub(crate) mod processes;
pub(crate) mod provider;
pub(crate) mod raw;
pub(crate) mod services;
pub(crate) mod stats;
pub(crate) mod submit;
