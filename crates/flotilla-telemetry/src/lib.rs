//! Flotilla's observability: what an operator sees of a running installation.
//!
//! Flotilla runs as many small processes (coordinators, workers per pool) that come and go
//! with load, so each process has to explain itself without a person at its terminal:
//!
//! * [`logging`]: stderr logs (plain or JSON, `FLOTILLA_LOG` filter) plus, when the standard
//!   `OTEL_*` variables ask for it, OpenTelemetry trace export over OTLP. Off by default: no
//!   exporter and no background thread unless configured.
//! * [`trace_context`]: W3C `traceparent` in and out, so one run is one trace across the client,
//!   the coordinator and every worker (task envelopes carry the context).
//! * [`spans`]: the spans of that trace (`submit`, `step`, `dispatch`, `invoke_agent`), built
//!   only while spans are exported.
//! * [`health`]: liveness, and readiness as a set of named conditions (`nats_connected`,
//!   `provisioned`, `consumer_bound`, …) plus a draining flag.
//! * [`metrics`]: the Prometheus metric families, with low-cardinality labels only.
//! * [`events`]: internal events — one struct per thing that happens, whose `emit` writes
//!   the log line and updates the metric together, so the two never drift apart.
//! * [`server`]: the HTTP listener serving `/healthz`, `/readyz` and `/metrics`.
//! * [`options`]: the `[telemetry]` section of `flotilla.toml`.
//!
//! ```text
//!  service start ──► Health (conditions false) ──► HttpServer::bind (/healthz 200, /readyz 503)
//!       │
//!       ├─ connect NATS ──► nats_connected ✓
//!       ├─ provision    ──► provisioned ✓
//!       ├─ bind consumer ─► consumer_bound ✓ ───────────────► /readyz 200
//!       ├─ SIGTERM ──────► draining ─────────────────────────► /readyz 503 while work finishes
//!       └─ stopped ──────► HttpServer stops; TelemetryGuard flushes spans
//! ```
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use flotilla_telemetry::{Health, HttpServer, Metrics};
//! use flotilla_telemetry::logging::{self, LogFormat, LoggingConfig};
//!
//! let _guard = logging::init(&LoggingConfig::new("info", LogFormat::Plain, "flotilla-worker"))?;
//! let health = Health::new();
//! let connected = health.condition("nats_connected");
//! let metrics = Metrics::new();
//! let stop = tokio_util::sync::CancellationToken::new();
//! let server = HttpServer::bind(
//!     "127.0.0.1:9464".parse()?,
//!     health.clone(),
//!     metrics.clone(),
//!     stop.clone(),
//! )
//! .await?;
//! connected.set(true);
//! // … run the service …
//! stop.cancel();
//! server.stopped().await?;
//! # Ok(()) }
//! ```

pub mod events;
pub mod health;
pub mod logging;
pub mod metrics;
pub mod options;
pub mod semconv;
pub mod server;
pub mod spans;
pub mod trace_context;

pub use events::InternalEvent;
pub use health::{Condition, Health, Readiness};
pub use logging::{LogFormat, LoggingConfig, TelemetryGuard};
pub use metrics::{AttemptOutcome, Metrics};
pub use options::{HttpAddr, TelemetryOptions};
pub use server::{HttpServer, ServeError};
