//! What every request of the API is: the endpoint it goes to and the reply it gets
//! ([`ApiRequest`]), and the protocol version it carries ([`HasProtocol`]); re-exported from
//! [`crate::api`]. The requests are defined in `api` and beside what they ask about (`lead`,
//! `tree`, `watch`, …); this module depends on none of them, so each of them can depend on it.

use serde::Serialize;
use serde::de::DeserializeOwned;

/// A request of the API.
pub trait ApiRequest: Serialize + DeserializeOwned {
    /// Endpoint name; the subject is `<prefix>.api.<ENDPOINT>`.
    const ENDPOINT: &'static str;
    /// What the endpoint answers.
    type Reply: Serialize + DeserializeOwned;
}

/// Requests that carry a protocol version (checked before a request is served).
pub trait HasProtocol {
    /// The request's `protocol`.
    fn protocol(&self) -> u32;
}

macro_rules! has_protocol {
    ($($t:ty),* $(,)?) => {$(impl $crate::endpoint::HasProtocol for $t { fn protocol(&self) -> u32 { self.protocol } })*};
}
pub(crate) use has_protocol;
