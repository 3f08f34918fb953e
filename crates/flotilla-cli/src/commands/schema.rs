//! `flotilla schema write|check`: the JSON Schemas of the public messages.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;
use flotilla_model::schema::render;
use schemars::{Schema, schema_for};

/// Every published schema: the wire's, and the deployment configuration's sections that a
/// config file is checked against.
fn public_schemas() -> Vec<(&'static str, Schema)> {
    let mut out = flotilla_model::schema::public_schemas();
    out.push((
        "hitl-config.json",
        schema_for!(flotilla_machine::policy::HitlConfig),
    ));
    out
}

/// Writes every schema into `dir`.
pub(crate) fn write(dir: &Path) -> anyhow::Result<ExitCode> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for (name, schema) in public_schemas() {
        let path = dir.join(name);
        std::fs::write(&path, render(&schema))
            .with_context(|| format!("writing {}", path.display()))?;
        outln!("wrote {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// Exit 1 when a checked-in schema differs from the code.
pub(crate) fn check(dir: &Path) -> anyhow::Result<ExitCode> {
    let stale = stale(dir);
    for s in &stale {
        outln!("stale: {s}");
    }
    if stale.is_empty() {
        outln!("schemas in {} are up to date", dir.display());
        Ok(ExitCode::SUCCESS)
    } else {
        errln!("run `flotilla schema write --dir {}`", dir.display());
        Ok(ExitCode::from(1))
    }
}

/// Names of schema files that are missing or differ.
pub(crate) fn stale(dir: &Path) -> Vec<String> {
    public_schemas()
        .into_iter()
        .filter(|(name, schema)| {
            std::fs::read_to_string(dir.join(name)).ok().as_deref() != Some(render(schema).as_str())
        })
        .map(|(name, _)| name.to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn checked_in_schemas_are_current() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/schema");
        let stale = super::stale(&dir);
        assert!(
            stale.is_empty(),
            "docs/schema is stale ({stale:?}); run `cargo run -p flotilla-cli -- schema write`"
        );
    }
}
