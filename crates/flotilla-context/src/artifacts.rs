//! Artifacts: payloads too large for a message (a long report, a file an agent produced), in
//! the object store `<prefix>-artifacts` under `runs/<root-run>/<name>`.
//!
//! Messages carry an [`ArtifactRef`] (`{bucket, name, size, sha256}`) instead of the bytes;
//! [`Artifacts::get_ref`] checks the SHA-256 on the way back, so a reader knows it got exactly
//! what was referenced. Artifacts expire with the store's age limit (`artifacts-max-age`).

use async_nats::jetstream::object_store::{GetErrorKind, ObjectMetadata};
use bytes::Bytes;
use flotilla_model::artifact::ArtifactRef;
use sha2::{Digest, Sha256};
use tokio::io::AsyncReadExt;

use crate::Clients;
use crate::canonical::hex;
use crate::error::{ContextError, ErrorKind, unavailable};

/// Longest artifact name (within the run), in bytes.
pub const MAX_NAME_LEN: usize = 256;

/// Checks an artifact name: `/`-separated segments of letters, digits, `.`, `_` and `-`; no
/// leading or trailing `/`, no empty, `.` or `..` segments; at most 256 bytes.
pub fn check_name(name: &str) -> Result<(), ContextError> {
    let invalid = |why: String| ContextError::new(ErrorKind::InvalidName, why);
    if name.is_empty() {
        return Err(invalid("the artifact name is empty".into()));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(invalid(format!(
            "artifact name {name:?} is {} bytes; at most {MAX_NAME_LEN}",
            name.len()
        )));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/')))
    {
        return Err(invalid(format!(
            "artifact name {name:?} contains {c:?}; names use letters, digits, `.`, `_`, `-` and `/`"
        )));
    }
    if name
        .split('/')
        .any(|seg| seg.is_empty() || seg == "." || seg == "..")
    {
        return Err(invalid(format!(
            "artifact name {name:?} has an empty, `.` or `..` segment (or a leading or trailing `/`)"
        )));
    }
    Ok(())
}

/// The artifacts of one run tree.
#[derive(Debug, Clone)]
pub struct Artifacts {
    c: Clients,
}

impl Artifacts {
    pub(crate) fn new(c: Clients) -> Self {
        Self { c }
    }

    /// The object name of artifact `name` of this run tree.
    pub fn object_name(&self, name: &str) -> Result<String, ContextError> {
        check_name(name)?;
        Ok(format!("runs/{}/{name}", self.c.scope().root_run_id))
    }

    /// Stores `bytes` as artifact `name` (replacing an earlier one of that name) and returns
    /// its reference.
    pub async fn put(&self, name: &str, bytes: Bytes) -> Result<ArtifactRef, ContextError> {
        let object = self.object_name(name)?;
        let store = self.c.objects().await?;
        let sha256 = hex(&Sha256::digest(&bytes));
        let mut reader: &[u8] = &bytes;
        store
            .put(
                ObjectMetadata {
                    name: object.clone(),
                    ..Default::default()
                },
                &mut reader,
            )
            .await
            .map_err(|e| unavailable(format!("storing artifact {object}"), e))?;
        Ok(ArtifactRef {
            bucket: self.c.bus().names().artifacts_bucket(),
            name: object,
            size: bytes.len() as u64,
            sha256,
        })
    }

    /// The bytes of artifact `name` of this run tree.
    pub async fn get(&self, name: &str) -> Result<Bytes, ContextError> {
        let object = self.object_name(name)?;
        let bucket = self.c.bus().names().artifacts_bucket();
        self.read(&bucket, &object).await
    }

    /// The bytes a reference points to, checked against its size and SHA-256 (`malformed`
    /// when they differ: the object was replaced or damaged).
    pub async fn get_ref(&self, reference: &ArtifactRef) -> Result<Bytes, ContextError> {
        let bytes = self.read(&reference.bucket, &reference.name).await?;
        let sha256 = hex(&Sha256::digest(&bytes));
        if bytes.len() as u64 != reference.size || sha256 != reference.sha256 {
            return Err(ContextError::new(
                ErrorKind::Malformed,
                format!(
                    "artifact {} holds {} bytes with sha256 {sha256}; the reference says {} bytes with sha256 {}",
                    reference.name,
                    bytes.len(),
                    reference.size,
                    reference.sha256
                ),
            ));
        }
        Ok(bytes)
    }

    async fn read(&self, bucket: &str, object: &str) -> Result<Bytes, ContextError> {
        let own = self.c.bus().names().artifacts_bucket();
        let store = if bucket == own {
            self.c.objects().await?.clone()
        } else {
            self.c
                .bus()
                .js()
                .get_object_store(bucket)
                .await
                .map_err(|e| unavailable(format!("opening object store {bucket}"), e))?
        };
        let mut obj = store.get(object).await.map_err(|e| match e.kind() {
            GetErrorKind::NotFound => ContextError::new(
                ErrorKind::NotFound,
                format!("artifact {object} does not exist in {bucket} (or has expired)"),
            ),
            _ => unavailable(format!("reading artifact {object}"), e),
        })?;
        let mut out = Vec::with_capacity(obj.info().size);
        obj.read_to_end(&mut out)
            .await
            .map_err(|e| unavailable(format!("reading artifact {object}"), e))?;
        Ok(Bytes::from(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in ["report.md", "q3/figures-v2.json", "a_b"] {
            assert!(check_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "/etc/passwd",
            "a/../b",
            "..",
            "a//b",
            "a/",
            "a b",
            "a\\b",
            "ü",
        ] {
            assert_eq!(
                check_name(bad).expect_err(bad).code(),
                "invalid_name",
                "{bad}"
            );
        }
        assert!(check_name(&"a".repeat(MAX_NAME_LEN + 1)).is_err());
    }
}
