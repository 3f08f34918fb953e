//! The vocabulary every message uses: identifiers, times, names and subjects, the codecs and protocol versions, API requests and their errors, validation problems, and the JSON schemas.
//!
//! Each module is re-exported at the crate's root (`flotilla_model::api`), its public
//! path.

pub mod api;
pub mod codec;
pub(crate) mod endpoint;
pub mod error_code;
pub mod ids;
pub mod lenient;
pub mod problem;
pub mod schema;
pub mod subjects;
pub mod time;
pub mod token;
