//! Outbound HTTP(S) for Flotilla's services: one connector for every client that calls out —
//! the LLM agent's transport to model providers and the supervisor's webhook deliveries.
//!
//! TLS is rustls on the ring provider, named explicitly (no process-wide provider, no C
//! build), with the platform's certificate roots and the webpki roots when the platform has
//! none; plain `http://` works too; HTTP/1.1 and HTTP/2.

use std::sync::Arc;

use hyper_util::client::legacy::connect::HttpConnector;

/// The connector [`https_connector`] builds.
pub type HttpsConnector = hyper_rustls::HttpsConnector<HttpConnector>;

/// A connector for `http://` and `https://` URLs. Build a client on it with
/// `hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(connector)`.
pub fn https_connector() -> HttpsConnector {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = match hyper_rustls::HttpsConnectorBuilder::new()
        .with_provider_and_native_roots(Arc::clone(&provider))
    {
        Ok(b) => b,
        Err(e) => {
            tracing::debug!(error = %e, "No usable platform certificate roots; using the webpki roots");
            match hyper_rustls::HttpsConnectorBuilder::new()
                .with_provider_and_webpki_roots(provider)
            {
                Ok(b) => b,
                // The ring provider supports the default protocol versions; this cannot fail
                // in practice. Fall back to plain defaults rather than panic.
                Err(_) => hyper_rustls::HttpsConnectorBuilder::new().with_webpki_roots(),
            }
        }
    };
    builder
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .build()
}
