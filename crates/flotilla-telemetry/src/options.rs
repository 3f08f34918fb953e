//! `[telemetry]` settings: the HTTP listener, the log format and the consumer-lag sampler.
//!
//! OpenTelemetry export is deliberately not here: it is configured by the standard `OTEL_*`
//! environment variables (see [`crate::logging`]), which every collector, operator and Helm
//! chart already knows how to set.

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The port services listen on by default: the one OpenTelemetry's Prometheus exporters use,
/// so scrape configs written for them work unchanged.
pub const DEFAULT_HTTP_PORT: u16 = 9464;

/// How many ports from [`DEFAULT_HTTP_PORT`] on [`HttpAddr::Auto`] tries (9464 – 9563).
pub const AUTO_HTTP_PORTS: u16 = 100;

/// Settings shared by every service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct TelemetryOptions {
    /// Where services serve `/healthz`, `/readyz` and `/metrics`: `auto` (the default: port
    /// 9464, or the next free one when another service on the host has it), an address, or
    /// `off`. Client commands never listen.
    pub http_addr: HttpAddr,
    /// Format of the log lines on stderr.
    pub log_format: LogFormat,
    /// How often a worker reads its pool consumer's backlog (pending and unacknowledged tasks)
    /// for the consumer-lag gauges.
    #[serde(with = "humantime_serde")]
    pub consumer_lag_interval: Duration,
}

impl Default for TelemetryOptions {
    fn default() -> Self {
        Self {
            // 9464 in a container; the next free port when `flotilla coordinator` and
            // `flotilla worker` share a host. Deployments that probe a fixed port (the Helm
            // chart) configure an address, which is never moved.
            http_addr: HttpAddr::Auto,
            // Plain for people at a terminal; log shippers ask for JSON.
            log_format: LogFormat::Plain,
            // One small JetStream API request per pool every few seconds; Prometheus scrapes
            // every 15–60 s, so fresher samples would not be seen.
            consumer_lag_interval: Duration::from_secs(5),
        }
    }
}

/// A `[telemetry]` setting is out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TelemetryOptionsError {
    /// The sampler would query JetStream too often.
    #[error("telemetry.consumer-lag-interval must be at least {min:?}, got {actual:?}")]
    ConsumerLagIntervalTooShort {
        /// The smallest accepted interval.
        min: Duration,
        /// What was configured.
        actual: Duration,
    },
}

impl TelemetryOptions {
    /// Smallest accepted [`consumer_lag_interval`](Self::consumer_lag_interval).
    pub const MIN_CONSUMER_LAG_INTERVAL: Duration = Duration::from_millis(100);

    /// Checks the settings without I/O.
    pub fn validate(&self) -> Result<(), TelemetryOptionsError> {
        if self.consumer_lag_interval < Self::MIN_CONSUMER_LAG_INTERVAL {
            return Err(TelemetryOptionsError::ConsumerLagIntervalTooShort {
                min: Self::MIN_CONSUMER_LAG_INTERVAL,
                actual: self.consumer_lag_interval,
            });
        }
        Ok(())
    }
}

/// Where the HTTP listener binds: `auto`, an `ip:port`, or `off`.
///
/// In TOML, environment variables and flags it is a string: `"auto"`, `"0.0.0.0:9464"`,
/// `"127.0.0.1:0"` (any free port; the bound address is logged) or `"off"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpAddr {
    /// No listener.
    Off,
    /// Every interface, port [`DEFAULT_HTTP_PORT`] or — when another process has it, such as
    /// a second Flotilla service on the same host — the next free port up to
    /// [`AUTO_HTTP_PORTS`] further (logged). The default.
    Auto,
    /// Listen on exactly this address; a taken address is an error.
    Bind(SocketAddr),
}

impl HttpAddr {
    /// The exact address to bind, if one is configured (`None` for `off` and `auto`).
    pub fn addr(self) -> Option<SocketAddr> {
        match self {
            Self::Off | Self::Auto => None,
            Self::Bind(a) => Some(a),
        }
    }

    /// The addresses `auto` tries, in order: `0.0.0.0:9464`, `0.0.0.0:9465`, ….
    pub fn auto_candidates() -> impl Iterator<Item = SocketAddr> {
        (0..AUTO_HTTP_PORTS).map(|i| {
            SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::UNSPECIFIED,
                DEFAULT_HTTP_PORT + i,
            ))
        })
    }
}

/// A listener address that is neither `ip:port`, `auto` nor `off`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected `auto`, an address such as 0.0.0.0:9464 or 127.0.0.1:0, or `off`; got {input:?}")]
pub struct ParseHttpAddrError {
    /// What was given.
    pub input: String,
}

impl FromStr for HttpAddr {
    type Err = ParseHttpAddrError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("off") {
            return Ok(Self::Off);
        }
        if s.eq_ignore_ascii_case("auto") {
            return Ok(Self::Auto);
        }
        s.parse().map(Self::Bind).map_err(|_| ParseHttpAddrError {
            input: s.to_owned(),
        })
    }
}

impl fmt::Display for HttpAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Off => f.write_str("off"),
            Self::Auto => f.write_str("auto"),
            Self::Bind(a) => a.fmt(f),
        }
    }
}

impl Serialize for HttpAddr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HttpAddr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    /// One human-readable line per event; colours only when stderr is a terminal.
    #[default]
    Plain,
    /// One JSON object per line (`timestamp`, `level`, `target`, `message`, the event's fields,
    /// and the current span), for log shippers.
    Json,
}

/// A log format other than `plain` or `json`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected `plain` or `json`, got {input:?}")]
pub struct ParseLogFormatError {
    /// What was given.
    pub input: String,
}

impl FromStr for LogFormat {
    type Err = ParseLogFormatError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "plain" => Ok(Self::Plain),
            "json" => Ok(Self::Json),
            _ => Err(ParseLogFormatError { input: s.into() }),
        }
    }
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Plain => "plain",
            Self::Json => "json",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize)]
    struct File {
        telemetry: TelemetryOptions,
    }

    fn parse(toml_text: &str) -> Result<TelemetryOptions, toml::de::Error> {
        toml::from_str::<File>(toml_text).map(|f| f.telemetry)
    }

    #[test]
    fn defaults_listen_on_9464_or_the_next_free_port_with_plain_logs() {
        let d = TelemetryOptions::default();
        assert_eq!(d.http_addr, HttpAddr::Auto);
        let ports: Vec<u16> = HttpAddr::auto_candidates().map(|a| a.port()).collect();
        assert_eq!(ports.first(), Some(&9464));
        assert_eq!(ports.last(), Some(&9563));
        assert!(HttpAddr::auto_candidates().all(|a| a.ip().is_unspecified()));
        assert_eq!(d.log_format, LogFormat::Plain);
        assert_eq!(d.validate(), Ok(()));
        assert_eq!(parse("[telemetry]\n").unwrap(), d);
    }

    #[test]
    fn keys_are_kebab_case_and_addresses_or_off() {
        let t = parse(
            "[telemetry]\nhttp-addr = \"127.0.0.1:0\"\nlog-format = \"json\"\nconsumer-lag-interval = \"250ms\"\n",
        )
        .unwrap();
        assert_eq!(t.http_addr, HttpAddr::Bind("127.0.0.1:0".parse().unwrap()));
        assert_eq!(t.log_format, LogFormat::Json);
        assert_eq!(t.consumer_lag_interval, Duration::from_millis(250));
        let off = parse("[telemetry]\nhttp-addr = \"off\"\n").unwrap();
        assert_eq!(off.http_addr, HttpAddr::Off);
        assert_eq!(off.http_addr.addr(), None);
    }

    #[test]
    fn bad_values_and_unknown_keys_are_rejected() {
        let e = parse("[telemetry]\nhttp-addr = \"localhost\"\n").unwrap_err();
        assert!(e.to_string().contains("`off`"), "{e}");
        assert!(e.to_string().contains("`auto`"), "{e}");
        assert!(parse("[telemetry]\nlog-format = \"xml\"\n").is_err());
        let e = parse("[telemetry]\nhttp-address = \"off\"\n").unwrap_err();
        assert!(e.to_string().contains("http-address"), "{e}");
    }

    #[test]
    fn validate_rejects_a_too_eager_lag_sampler() {
        let t = TelemetryOptions {
            consumer_lag_interval: Duration::from_millis(10),
            ..TelemetryOptions::default()
        };
        assert!(matches!(
            t.validate(),
            Err(TelemetryOptionsError::ConsumerLagIntervalTooShort { .. })
        ));
    }

    #[test]
    fn flag_values_round_trip() {
        for s in ["off", "auto", "0.0.0.0:9464", "[::1]:9000"] {
            let a: HttpAddr = s.parse().unwrap();
            assert_eq!(a.to_string(), s);
        }
        assert_eq!("OFF".parse::<HttpAddr>(), Ok(HttpAddr::Off));
        assert_eq!("Auto".parse::<HttpAddr>(), Ok(HttpAddr::Auto));
        assert_eq!(HttpAddr::Auto.addr(), None);
        assert_eq!("JSON".parse::<LogFormat>(), Ok(LogFormat::Json));
        assert!("9464".parse::<HttpAddr>().is_err());
    }
}
