//! What the NATS Agent Protocol tests (`agents_protocol.rs`, `agents_protocol_external.rs`)
//! share: the protocol client (`agents_protocol/client.py`), or why it cannot run here, and the
//! team roster as `team.list` answers it.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;

use crate::support::{Processes, root};

/// The protocol client, or why it cannot run here.
pub(crate) fn client_script() -> Result<PathBuf, String> {
    let ok = std::process::Command::new("python3")
        .args(["-c", "import nats"])
        .output()
        .map_err(|e| format!("python3 is not available ({e})"))?;
    if !ok.status.success() {
        return Err(
            "python3 has no nats-py (pip install nats-py, or run scripts/ensure-nats-py.sh)".into(),
        );
    }
    Ok(root().join("tests/agents_protocol/client.py"))
}

/// The team roster for `role` (all of it without), as `team.list` answers it.
pub(crate) async fn roster(p: &Processes, role: Option<&str>) -> anyhow::Result<Value> {
    let list = p
        .client
        .request(
            &flotilla_model::team::TeamListRequest {
                protocol: 1,
                role: role.map(str::to_owned),
            },
            Duration::from_secs(5),
        )
        .await?;
    Ok(serde_json::to_value(list)?)
}

/// The roster entry named `name` in `list`, if listed.
pub(crate) fn member<'a>(list: &'a Value, name: &str) -> Option<&'a Value> {
    list["members"]
        .as_array()?
        .iter()
        .find(|m| m["name"] == name)
}
