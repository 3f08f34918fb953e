//! `flotilla nats provision`.
//!
//! Streams and buckets first (plan, then apply). With `--pools a,b`, the pool consumers
//! (`pool-<name>` on the tasks stream) are created too, as the pool's workers would create
//! them: an autoscaler that reads a consumer's backlog (KEDA's `nats-jetstream` scaler) needs
//! it to exist before the first worker of the pool starts — older KEDA releases scale a pool
//! with a missing consumer to its maximum. An existing consumer is left as it is (its
//! workers keep it up to date).

use std::process::ExitCode;

use anyhow::Context;
use flotilla_bus::Bus;
use flotilla_bus::provision::plan;
use flotilla_model::subjects::StreamKind;
use serde::Serialize;

use crate::config::Config;

/// What happened to a pool consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum ConsumerAction {
    /// It was missing and was created.
    Create,
    /// It exists (left as it is).
    Exists,
    /// Dry run, or streams could not be provisioned: it is missing and was not created.
    Missing,
}

#[derive(Debug, Serialize)]
struct ConsumerReport {
    pool: String,
    stream: String,
    name: String,
    action: ConsumerAction,
}

/// Checks `--pools` before anything is contacted: names, no duplicates.
fn check_pools(pools: &[String]) -> anyhow::Result<()> {
    let mut seen = std::collections::BTreeSet::new();
    for pool in pools {
        flotilla_model::token::check_name(pool)
            .map_err(|e| anyhow::anyhow!("--pools: pool {pool:?} {e}"))?;
        anyhow::ensure!(
            seen.insert(pool.as_str()),
            "--pools: pool {pool:?} is listed twice"
        );
    }
    Ok(())
}

/// Creates missing streams and buckets, updates compatible drift, reports incompatible drift;
/// then creates the consumers of `pools` that are missing.
pub(crate) async fn provision(
    config: &Config,
    dry_run: bool,
    json: bool,
    pools: &[String],
) -> anyhow::Result<ExitCode> {
    check_pools(pools)?;
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    let p = plan(bus.js(), bus.names(), &config.jetstream).await?;
    let compatible = p.is_compatible();
    let report = if dry_run || !compatible {
        p.report().clone()
    } else {
        p.apply(bus.js()).await?
    };
    let consumers = pool_consumers(&bus, config, pools, dry_run || !compatible).await?;
    if json {
        let mut out = serde_json::to_value(&report)?;
        if let Some(o) = out.as_object_mut() {
            o.insert("consumers".into(), serde_json::to_value(&consumers)?);
        }
        outln!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        if dry_run || !compatible {
            out!("{}", report.planned());
        } else {
            out!("{report}");
        }
        for c in &consumers {
            let what = match c.action {
                ConsumerAction::Create => "created",
                ConsumerAction::Exists => "exists",
                ConsumerAction::Missing if dry_run && compatible => "would create",
                ConsumerAction::Missing => "missing",
            };
            outln!("{:<6} {:<24} {what} (on {})", "pool", c.name, c.stream);
        }
        if !compatible {
            errln!(
                "Nothing was changed: resolve the INCOMPATIBLE differences above (or use another nats.prefix)."
            );
        } else if dry_run {
            errln!("Dry run: nothing was changed.");
        }
    }
    Ok(if compatible {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Looks up each pool's consumer and, unless `look_only`, creates the missing ones.
async fn pool_consumers(
    bus: &Bus,
    config: &Config,
    pools: &[String],
    look_only: bool,
) -> anyhow::Result<Vec<ConsumerReport>> {
    let names = bus.names();
    let stream_name = names.stream(StreamKind::Tasks);
    let mut out = Vec::with_capacity(pools.len());
    if pools.is_empty() {
        return Ok(out);
    }
    // In a dry run on a fresh server the stream does not exist yet: every consumer is missing.
    let stream = bus.js().get_stream_no_info(&stream_name).await.ok();
    for pool in pools {
        let spec = flotilla_worker::pool_consumer(names, pool, &config.worker);
        let exists = match &stream {
            Some(s) => s.consumer_info(&spec.durable).await.is_ok(),
            None => false,
        };
        let action = if exists {
            ConsumerAction::Exists
        } else if look_only {
            ConsumerAction::Missing
        } else {
            let name = spec.durable.clone();
            bus.shared_consumer(spec)
                .await
                .with_context(|| format!("creating the consumer {name} of pool {pool}"))?;
            ConsumerAction::Create
        };
        out.push(ConsumerReport {
            pool: pool.clone(),
            stream: stream_name.clone(),
            name: names.pool_consumer(pool),
            action,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_names_are_checked_before_anything_is_contacted() {
        assert!(check_pools(&["default".into(), "gpu-a".into()]).is_ok());
        for (bad, needle) in [
            (vec!["a.b".to_string()], "pool \"a.b\""),
            (vec!["".to_string()], "pool \"\""),
            (vec!["gpu".to_string(), "gpu".to_string()], "listed twice"),
        ] {
            let e = check_pools(&bad).unwrap_err().to_string();
            assert!(e.starts_with("--pools: ") && e.contains(needle), "{e}");
        }
    }
}
