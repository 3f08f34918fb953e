//! Process-wide logging and (optional) OpenTelemetry trace export.
//!
//! * Log lines go to stderr (stdout is for command output), filtered by `FLOTILLA_LOG`
//!   (`tracing` directives such as `info` or `warn,flotilla_worker=debug`; the caller picks the
//!   default: services `info`, client commands `warn`).
//! * `plain` or `json` ([`LogFormat`]); colours only when stderr is a terminal and `NO_COLOR` is
//!   not set, so files and log collectors never see escape codes.
//! * Spans are exported over OTLP when the standard OpenTelemetry variables ask for it
//!   ([`OtlpConfig::from_env`]); otherwise no exporter, no thread and no per-span cost beyond
//!   `tracing`'s own. Export has its own filter (INFO and above, without the exporter's own
//!   HTTP/gRPC crates), independent of `FLOTILLA_LOG`: quieting logs does not break traces.
//!
//! [`init`] returns a [`TelemetryGuard`]; dropping it flushes buffered spans and stops the
//! exporter. With OTLP over gRPC, call [`init`] inside a Tokio runtime and drop the guard
//! before the runtime, outside `block_on` (the flush waits for the export).

use std::io::IsTerminal;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, SpanExporter, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::level_filters::LevelFilter;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::{SubscriberInitExt, TryInitError};
use tracing_subscriber::{EnvFilter, Layer, Registry};

pub use crate::options::LogFormat;

/// The log filter variable.
pub const LOG_ENV: &str = "FLOTILLA_LOG";

/// How long dropping the guard waits for buffered spans to be exported.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// What [`init`] sets up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoggingConfig {
    /// Filter when `FLOTILLA_LOG` is unset.
    pub default_filter: String,
    /// Line format.
    pub format: LogFormat,
    /// `service.name` of exported spans unless `OTEL_SERVICE_NAME` (or `service.name` in
    /// `OTEL_RESOURCE_ATTRIBUTES`) names one: `flotilla-coordinator`, `flotilla-worker`, …
    pub service_name: String,
}

impl LoggingConfig {
    /// A configuration.
    pub fn new(
        default_filter: impl Into<String>,
        format: LogFormat,
        service_name: impl Into<String>,
    ) -> Self {
        Self {
            default_filter: default_filter.into(),
            format,
            service_name: service_name.into(),
        }
    }
}

/// Logging could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// `FLOTILLA_LOG` (or the default) is not a valid filter.
    #[error("{variable}={value:?} is not a valid log filter: {source}")]
    InvalidFilter {
        /// Where the filter came from.
        variable: &'static str,
        /// The filter.
        value: String,
        /// Why it is invalid.
        #[source]
        source: tracing_subscriber::filter::ParseError,
    },
    /// The `OTEL_*` variables ask for something Flotilla does not do.
    #[error(transparent)]
    Otlp(#[from] OtlpConfigError),
    /// The OTLP exporter could not be built (bad endpoint, bad headers, …).
    #[error("cannot start the OTLP span exporter: {0}")]
    Exporter(#[source] opentelemetry_otlp::ExporterBuildError),
    /// OTLP over gRPC was requested outside a Tokio runtime.
    #[error("OTLP over gRPC needs a Tokio runtime: initialise logging inside one")]
    NoRuntime,
    /// A global subscriber is already installed.
    #[error("logging was already initialised in this process")]
    AlreadyInitialised(#[source] TryInitError),
}

/// The standard OpenTelemetry variables ask for something Flotilla does not support.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OtlpConfigError {
    /// A protocol other than `grpc` or `http/protobuf`.
    #[error("{variable}={value:?} is not supported: use `grpc` or `http/protobuf`")]
    UnsupportedProtocol {
        /// The variable.
        variable: &'static str,
        /// Its value.
        value: String,
    },
    /// An exporter other than `otlp` or `none`.
    #[error("OTEL_TRACES_EXPORTER={value:?} is not supported: use `otlp` or `none`")]
    UnsupportedExporter {
        /// The value.
        value: String,
    },
    /// An `https://` endpoint with OTLP over HTTP (Flotilla's HTTP exporter has no TLS).
    #[error(
        "OTLP endpoint {endpoint} is https: set OTEL_EXPORTER_OTLP_PROTOCOL=grpc (TLS supported), or send to a local collector over http"
    )]
    HttpsNeedsGrpc {
        /// The endpoint.
        endpoint: String,
    },
}

/// OTLP transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// gRPC (default port 4317); TLS for `https://` endpoints.
    Grpc,
    /// Protobuf over HTTP (default port 4318), plain HTTP only.
    HttpProtobuf,
}

/// Where and how spans are exported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpConfig {
    /// Transport.
    pub protocol: OtlpProtocol,
    /// The full traces endpoint (`http://collector:4318/v1/traces`, `http://collector:4317`);
    /// `None` for the exporter's default on localhost.
    pub traces_endpoint: Option<String>,
}

impl OtlpConfig {
    /// From the process environment (see [`from_lookup`](Self::from_lookup)).
    pub fn from_env() -> Result<Option<Self>, OtlpConfigError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// From the standard variables, read through `get`. Export is on when an endpoint is set
    /// (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`) or when
    /// `OTEL_TRACES_EXPORTER=otlp`; it is off when neither is, or with
    /// `OTEL_TRACES_EXPORTER=none` or `OTEL_SDK_DISABLED=true`. The protocol comes from
    /// `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, then `OTEL_EXPORTER_OTLP_PROTOCOL`, default
    /// `http/protobuf` (the specification's default). Headers, timeout, compression, batching
    /// (`OTEL_BSP_*`) and sampling (`OTEL_TRACES_SAMPLER`) are read by the OpenTelemetry SDK.
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, OtlpConfigError> {
        let get = |k: &str| {
            get(k)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        if get("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        let explicit = match get("OTEL_TRACES_EXPORTER") {
            None => false,
            Some(value) => {
                let names: Vec<String> = value
                    .split(',')
                    .map(|s| s.trim().to_ascii_lowercase())
                    .filter(|s| !s.is_empty())
                    .collect();
                if names.iter().any(|n| n == "none") {
                    return Ok(None);
                }
                if names.iter().any(|n| n != "otlp") {
                    return Err(OtlpConfigError::UnsupportedExporter { value });
                }
                true
            }
        };
        let signal = get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
        let generic = get("OTEL_EXPORTER_OTLP_ENDPOINT");
        if signal.is_none() && generic.is_none() && !explicit {
            return Ok(None);
        }
        let (variable, value) = match get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") {
            Some(v) => ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", Some(v)),
            None => (
                "OTEL_EXPORTER_OTLP_PROTOCOL",
                get("OTEL_EXPORTER_OTLP_PROTOCOL"),
            ),
        };
        let protocol = match value.as_deref().map(str::to_ascii_lowercase).as_deref() {
            None | Some("http/protobuf") => OtlpProtocol::HttpProtobuf,
            Some("grpc") => OtlpProtocol::Grpc,
            Some(_) => {
                return Err(OtlpConfigError::UnsupportedProtocol {
                    variable,
                    value: value.unwrap_or_default(),
                });
            }
        };
        // The specification: a signal's own endpoint is used as is; the generic one is a base
        // URL to which OTLP/HTTP appends the signal's path (gRPC has no path).
        let traces_endpoint = match (signal, generic, protocol) {
            (Some(s), _, _) => Some(s),
            (None, Some(g), OtlpProtocol::HttpProtobuf) => {
                Some(format!("{}/v1/traces", g.trim_end_matches('/')))
            }
            (None, g, _) => g,
        };
        if protocol == OtlpProtocol::HttpProtobuf
            && let Some(e) = &traces_endpoint
            && e.get(..8)
                .is_some_and(|s| s.eq_ignore_ascii_case("https://"))
        {
            return Err(OtlpConfigError::HttpsNeedsGrpc {
                endpoint: e.clone(),
            });
        }
        Ok(Some(Self {
            protocol,
            traces_endpoint,
        }))
    }
}

/// Keeps the exporter running; dropping it flushes buffered spans (waiting up to 5 s) and
/// stops the exporter. Hold it for the life of `main`.
#[derive(Debug)]
#[must_use = "dropping the guard stops span export"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl TelemetryGuard {
    /// Whether spans are exported.
    pub fn otlp_enabled(&self) -> bool {
        self.provider.is_some()
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(e) = provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT)
        {
            tracing::warn!(error = %e, "Could not flush spans to the OTLP endpoint");
        }
    }
}

/// Installs the global subscriber: stderr logs, plus OTLP export when the environment asks
/// for it. Fails if a subscriber is already installed.
pub fn init(config: &LoggingConfig) -> Result<TelemetryGuard, InitError> {
    let filter = log_filter(std::env::var(LOG_ENV).ok(), &config.default_filter)?;
    let provider = OtlpConfig::from_env()?
        .map(|otlp| tracer_provider(&otlp, &config.service_name))
        .transpose()?;
    let guard = TelemetryGuard { provider };
    let ansi = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let fmt_layer: Box<dyn Layer<Registry> + Send + Sync> = match config.format {
        LogFormat::Plain => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(ansi)
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
    };
    let otel_layer = guard.provider.as_ref().map(otel_layer);
    tracing_subscriber::registry()
        .with(fmt_layer)
        .with(otel_layer)
        .try_init()
        .map_err(InitError::AlreadyInitialised)?;
    Ok(guard)
}

/// The `FLOTILLA_LOG` filter, or `default` when unset.
fn log_filter(env: Option<String>, default: &str) -> Result<EnvFilter, InitError> {
    let (variable, value) = match env.filter(|v| !v.trim().is_empty()) {
        Some(v) => (LOG_ENV, v),
        None => ("default filter", default.to_owned()),
    };
    EnvFilter::builder()
        .parse(&value)
        .map_err(|source| InitError::InvalidFilter {
            variable,
            value,
            source,
        })
}

/// A tracer provider exporting over OTLP with a batch processor (its own thread). Exposed for
/// embedders and tests that install their own subscriber; [`init`] uses it.
pub fn tracer_provider(
    otlp: &OtlpConfig,
    service_name: &str,
) -> Result<SdkTracerProvider, InitError> {
    let exporter = match otlp.protocol {
        OtlpProtocol::Grpc => {
            // tonic's channel spawns its connection task on the current runtime.
            if tokio::runtime::Handle::try_current().is_err() {
                return Err(InitError::NoRuntime);
            }
            let mut b = SpanExporter::builder().with_tonic();
            if let Some(e) = &otlp.traces_endpoint {
                b = b.with_endpoint(e.clone());
            }
            b.build()
        }
        OtlpProtocol::HttpProtobuf => {
            let mut b = SpanExporter::builder()
                .with_http()
                .with_protocol(Protocol::HttpBinary);
            if let Some(e) = &otlp.traces_endpoint {
                b = b.with_endpoint(e.clone());
            }
            b.build()
        }
    }
    .map_err(InitError::Exporter)?;
    let mut resource = Resource::builder()
        .with_attribute(opentelemetry::KeyValue::new(
            "service.version",
            env!("CARGO_PKG_VERSION"),
        ))
        .with_attribute(opentelemetry::KeyValue::new(
            "service.namespace",
            "flotilla",
        ));
    if !service_named_by_env(|k| std::env::var(k).ok()) {
        resource = resource.with_service_name(service_name.to_owned());
    }
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build())
}

/// The `tracing` layer that turns spans into OpenTelemetry spans of `provider`, with the
/// export filter (INFO and above, without the exporter's own transport crates, which would
/// otherwise trace their own exports). Building it turns on the run spans of this process
/// ([`crate::spans::exporting`]).
pub fn otel_layer<S>(provider: &SdkTracerProvider) -> impl Layer<S> + use<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let quiet = [
        "h2",
        "hyper",
        "hyper_util",
        "tonic",
        "tower",
        "reqwest",
        "opentelemetry",
        "opentelemetry_sdk",
        "opentelemetry_otlp",
        "opentelemetry_http",
    ];
    let filter = quiet.into_iter().fold(
        Targets::new().with_default(LevelFilter::INFO),
        |t, target| t.with_target(target, LevelFilter::OFF),
    );
    // Spans are exported from now on: the coordinator and workers build theirs.
    crate::spans::set_exporting(true);
    tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("flotilla"))
        .with_filter(filter)
}

/// Whether the environment names the service (then it wins over the role's default).
fn service_named_by_env(get: impl Fn(&str) -> Option<String>) -> bool {
    get("OTEL_SERVICE_NAME").is_some_and(|v| !v.trim().is_empty())
        || get("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|attrs| {
            attrs.split(',').any(|kv| {
                kv.split_once('=')
                    .is_some_and(|(k, _)| k.trim() == "service.name")
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn otlp(vars: &[(&str, &str)]) -> Result<Option<OtlpConfig>, OtlpConfigError> {
        let env: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        OtlpConfig::from_lookup(|k| env.get(k).cloned())
    }

    #[test]
    fn export_is_off_unless_asked_for() {
        assert_eq!(otlp(&[]), Ok(None));
        assert_eq!(otlp(&[("OTEL_SERVICE_NAME", "x")]), Ok(None));
        assert_eq!(otlp(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "  ")]), Ok(None));
        for off in [
            ("OTEL_TRACES_EXPORTER", "none"),
            ("OTEL_SDK_DISABLED", "true"),
        ] {
            assert_eq!(
                otlp(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"), off]),
                Ok(None),
                "{off:?}"
            );
        }
    }

    #[test]
    fn endpoints_follow_the_specification() {
        let c = otlp(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318/")])
            .unwrap()
            .unwrap();
        assert_eq!(c.protocol, OtlpProtocol::HttpProtobuf);
        assert_eq!(
            c.traces_endpoint.as_deref(),
            Some("http://c:4318/v1/traces")
        );

        let c = otlp(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://t:9/custom"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(c.traces_endpoint.as_deref(), Some("http://t:9/custom"));

        let c = otlp(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://c:4317"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(c.protocol, OtlpProtocol::Grpc);
        assert_eq!(c.traces_endpoint.as_deref(), Some("https://c:4317"));

        let c = otlp(&[("OTEL_TRACES_EXPORTER", "otlp")]).unwrap().unwrap();
        assert_eq!(c.traces_endpoint, None, "the exporter's default");

        let c = otlp(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(c.protocol, OtlpProtocol::Grpc, "the signal's own wins");
    }

    #[test]
    fn unsupported_settings_are_named() {
        assert_eq!(
            otlp(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
            ]),
            Err(OtlpConfigError::UnsupportedProtocol {
                variable: "OTEL_EXPORTER_OTLP_PROTOCOL",
                value: "http/json".into()
            })
        );
        assert!(matches!(
            otlp(&[("OTEL_TRACES_EXPORTER", "otlp,zipkin")]),
            Err(OtlpConfigError::UnsupportedExporter { .. })
        ));
        assert!(matches!(
            otlp(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "HTTPS://saas.example:443")]),
            Err(OtlpConfigError::HttpsNeedsGrpc { .. })
        ));
    }

    #[test]
    fn the_environment_can_name_the_service() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                vars.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert!(!service_named_by_env(env(&[])));
        assert!(service_named_by_env(env(&[("OTEL_SERVICE_NAME", "w1")])));
        assert!(service_named_by_env(env(&[(
            "OTEL_RESOURCE_ATTRIBUTES",
            "team=a, service.name=w1"
        )])));
        assert!(!service_named_by_env(env(&[(
            "OTEL_RESOURCE_ATTRIBUTES",
            "service.namespace=x"
        )])));
    }

    #[test]
    fn log_filters_default_and_reject_nonsense() {
        assert!(log_filter(None, "info").is_ok());
        assert!(log_filter(Some("warn,flotilla_worker=debug".into()), "info").is_ok());
        let e = log_filter(Some("flotilla=loud".into()), "info").unwrap_err();
        assert!(
            matches!(
                e,
                InitError::InvalidFilter {
                    variable: LOG_ENV,
                    ..
                }
            ),
            "{e}"
        );
    }
}
