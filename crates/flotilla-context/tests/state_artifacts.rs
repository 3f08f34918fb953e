//! Session state and artifacts against a real nats-server.

mod common;

use bytes::Bytes;
use common::{clients, server, task, task_scope};
use flotilla_context::Scope;
use flotilla_model::artifact::ArtifactRef;
use flotilla_model::ids::RunId;
use serde_json::json;
use sha2::{Digest, Sha256};

#[tokio::test]
async fn state_get_set_compare_and_set_delete_list() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let run = RunId::new();
    let c = task(&bus, run, "t")?;
    let state = c.state();
    assert!(state.get("summary").await?.is_none());
    let r1 = state.set("summary", &json!({"growth": 0.12})).await?;
    let got = state.get("summary").await?.expect("set");
    assert_eq!(got.value, json!({"growth": 0.12}));
    assert_eq!((got.key.as_str(), got.revision), ("summary", r1));
    assert!(got.ts.unix_ms() > 0);
    // Compare-and-set: the right revision wins, a stale one is a conflict naming the current.
    let r2 = state.compare_and_set("summary", &json!(2), r1).await?;
    let err = state
        .compare_and_set("summary", &json!(3), r1)
        .await
        .expect_err("stale");
    assert_eq!(err.code(), "conflict");
    assert_eq!(err.current_revision(), Some(r2));
    assert_eq!(state.get("summary").await?.map(|v| v.value), Some(json!(2)));
    // Revision 0: only if absent.
    let err = state
        .compare_and_set("summary", &json!(4), 0)
        .await
        .expect_err("exists");
    assert_eq!(err.current_revision(), Some(r2));
    state.compare_and_set("fresh", &json!("new"), 0).await?;
    state.set("other", &json!(null)).await?;
    // List: this session's keys only, without deleted ones.
    let elsewhere = task(&bus, RunId::new(), "t")?;
    elsewhere.state().set("foreign", &json!(1)).await?;
    state.delete("other").await?;
    state.delete("never-set").await?;
    assert!(state.get("other").await?.is_none());
    assert_eq!(state.list().await?, vec!["fresh", "summary"]);
    // A deleted key can be created again with revision 0.
    state.compare_and_set("other", &json!("again"), 0).await?;
    assert_eq!(state.list().await?, vec!["fresh", "other", "summary"]);
    // Tasks of one session share state; the session is the key prefix.
    let sibling = clients(
        &bus,
        Scope {
            session: run.to_string(),
            ..task_scope(&bus, run, "sibling")
        },
    )?;
    assert_eq!(
        sibling.state().get("fresh").await?.map(|v| v.value),
        Some(json!("new"))
    );
    Ok(())
}

#[tokio::test]
async fn bad_keys_and_oversize_values_are_refused() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let c = task(&bus, RunId::new(), "t")?;
    let state = c.state();
    for bad in ["", "a.b", "a b", "a*", "ключ", &"k".repeat(129)] {
        let err = state.set(bad, &json!(1)).await.expect_err(bad);
        assert_eq!(err.code(), "invalid_key", "{bad}");
        assert!(state.get(bad).await.is_err());
    }
    let big = json!("v".repeat(256 * 1024));
    let err = state.set("big", &big).await.expect_err("too large");
    assert_eq!(err.code(), "value_too_large");
    let text = err.to_string();
    assert!(
        text.contains(&(256 * 1024 + 2).to_string()) && text.contains(&(256 * 1024).to_string()),
        "names size and cap: {text}"
    );
    assert!(state.list().await?.is_empty());
    Ok(())
}

#[tokio::test]
async fn artifacts_round_trip_with_their_checksum() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let run = RunId::new();
    let c = task(&bus, run, "t")?;
    let artifacts = c.artifacts();
    let data: Bytes = (0..2_500_000u32).map(|i| (i % 251) as u8).collect();
    let reference = artifacts.put("reports/q3.bin", data.clone()).await?;
    let expected_sha: String = Sha256::digest(&data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        reference,
        ArtifactRef {
            bucket: "flotilla-artifacts".into(),
            name: format!("runs/{run}/reports/q3.bin"),
            size: data.len() as u64,
            sha256: expected_sha,
        }
    );
    assert_eq!(artifacts.get("reports/q3.bin").await?, data);
    assert_eq!(artifacts.get_ref(&reference).await?, data);
    // A reference whose checksum does not match what is stored is refused.
    let tampered = ArtifactRef {
        sha256: "0".repeat(64),
        ..reference.clone()
    };
    assert_eq!(
        artifacts
            .get_ref(&tampered)
            .await
            .expect_err("mismatch")
            .code(),
        "malformed"
    );
    // Replacing an artifact: the old reference no longer verifies.
    artifacts
        .put("reports/q3.bin", Bytes::from_static(b"v2"))
        .await?;
    assert_eq!(
        artifacts
            .get_ref(&reference)
            .await
            .expect_err("replaced")
            .code(),
        "malformed"
    );
    assert_eq!(
        artifacts.get("missing").await.expect_err("absent").code(),
        "not_found"
    );
    // Another run tree does not see this one's artifacts.
    let other = task(&bus, RunId::new(), "t")?;
    assert_eq!(
        other
            .artifacts()
            .get("reports/q3.bin")
            .await
            .expect_err("scoped")
            .code(),
        "not_found"
    );
    for bad in ["", "/abs", "../escape", "a/../../b", "sp ace"] {
        assert_eq!(
            artifacts
                .put(bad, Bytes::from_static(b"x"))
                .await
                .expect_err(bad)
                .code(),
            "invalid_name",
            "{bad}"
        );
    }
    Ok(())
}
