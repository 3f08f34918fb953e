//! `flotilla nats provision`.

use std::process::ExitCode;

use flotilla_bus::Bus;
use flotilla_bus::provision::plan;

use crate::config::Config;

/// Creates missing streams and buckets, updates compatible drift, reports incompatible drift.
pub(crate) async fn provision(
    config: &Config,
    dry_run: bool,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    let p = plan(bus.js(), bus.names(), &config.jetstream).await?;
    let compatible = p.is_compatible();
    let report = if dry_run || !compatible {
        p.report().clone()
    } else {
        p.apply(bus.js()).await?
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{report}");
        if !compatible {
            eprintln!(
                "Nothing was changed: resolve the INCOMPATIBLE differences above (or use another nats.prefix)."
            );
        } else if dry_run {
            eprintln!("Dry run: nothing was changed.");
        }
    }
    Ok(if compatible {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
