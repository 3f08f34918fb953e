//! Writing run state in JetStream: the coordinator's side of the run read model
//! ([`flotilla_runs`], which a client reads through as well).
//!
//! * `flotilla-runs` KV, key `<run>`: the [`Snapshot`] (MessagePack) — scheduling state plus
//!   the actions of the last change (the outbox). Updated with compare-and-set on the KV
//!   revision, so two coordinators can never both apply a change to the same run.
//! * `flotilla-runs` KV, key `idem.<hash>`: idempotency key → run id, claimed once.
//! * `flotilla-runs` KV, key `session.<session>.<run>`: the session index.

use std::ops::Deref;

use async_nats::jetstream::kv;
use bytes::Bytes;
use flotilla_bus::Bus;
use flotilla_model::ids::{RunId, SessionId};
use flotilla_runs::error::{decode_err, nats};
use flotilla_runs::reader::{idempotency_kv_key, session_key};
use serde::Serialize;

pub use flotilla_runs::{
    First, FirstMessage, RunReader, Snapshot, StoredSnapshot, UnreadableSubmission, record_of,
    unix_ms, view_of,
};

use crate::error::{StoreError, StoreErrorKind};
use crate::machine::{Action, RunState};

/// A snapshot to write, borrowed from the live state (same encoding as [`Snapshot`]: the
/// outbox's `ProjectApproval`s go in `projections`, which coordinators of 0.2 ignore).
#[derive(Debug)]
pub struct SnapshotRef<'a> {
    /// The state.
    pub state: &'a RunState,
    /// The outbox.
    pub outbox: &'a [Action],
    /// Inputs that produced it.
    pub outbox_seqs: &'a [u64],
}

impl Serialize for SnapshotRef<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let is_projection = |a: &&Action| matches!(a, Action::ProjectApproval { .. });
        let projections: Vec<&Action> = self.outbox.iter().filter(is_projection).collect();
        let outbox: Vec<&Action> = self.outbox.iter().filter(|a| !is_projection(a)).collect();
        let mut st = s.serialize_struct("Snapshot", 3 + usize::from(!projections.is_empty()))?;
        st.serialize_field("state", self.state)?;
        st.serialize_field("outbox", &outbox)?;
        st.serialize_field("outbox_seqs", self.outbox_seqs)?;
        if !projections.is_empty() {
            st.serialize_field("projections", &projections)?;
        }
        st.end()
    }
}

/// Reads and writes run state. Every read is the read model's ([`RunReader`], reached
/// through `Deref`): a writer reads what every client reads.
#[derive(Clone, Debug)]
pub struct RunStore {
    reader: RunReader,
}

impl Deref for RunStore {
    type Target = RunReader;

    fn deref(&self) -> &RunReader {
        &self.reader
    }
}

impl RunStore {
    /// Opens the bucket and the run-log stream (they must be provisioned).
    pub async fn open(bus: &Bus) -> Result<Self, StoreError> {
        Ok(Self {
            reader: RunReader::open(bus).await?,
        })
    }

    fn encode<T: Serialize>(&self, snapshot: &T) -> Result<bytes::Bytes, StoreError> {
        let bytes = rmp_serde::to_vec_named(snapshot)
            .map(bytes::Bytes::from)
            .map_err(|e| decode_err("encoding a snapshot", e))?;
        let max = self.bus().max_payload().saturating_sub(1024);
        if bytes.len() > max {
            return Err(StoreError::new(
                StoreErrorKind::TooLarge,
                format!(
                    "the run record is {} bytes; this deployment's messages hold at most {max}",
                    bytes.len()
                ),
            ));
        }
        Ok(bytes)
    }

    /// Creates a run's snapshot; fails with `AlreadyExists` if there is one. A run with a
    /// session is entered in the session index first, so no recorded run is missing from it
    /// (a crash in between leaves an index key whose run is recorded on the retry).
    pub async fn create(&self, run: RunId, snapshot: &SnapshotRef<'_>) -> Result<u64, StoreError> {
        if let Some(session) = snapshot.state.session_id {
            self.index_session(session, run).await?;
        }
        self.runs_bucket()
            .create(run.to_string(), self.encode(snapshot)?)
            .await
            .map_err(|e| {
                if e.kind() == kv::CreateErrorKind::AlreadyExists {
                    StoreError::with_source(StoreErrorKind::AlreadyExists, format!("run {run}"), e)
                } else {
                    nats(format!("creating run {run}"), e)
                }
            })
    }

    /// Enters `run` in `session`'s index (`session.<session>.<run>` in the runs bucket). A
    /// repeat (a replayed start) leaves the key where it is, so the index stays in creation
    /// order.
    pub async fn index_session(&self, session: SessionId, run: RunId) -> Result<(), StoreError> {
        match self
            .runs_bucket()
            .create(session_key(session, run), Bytes::new())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(nats(format!("indexing run {run} in session {session}"), e)),
        }
    }

    /// Replaces a run's snapshot if it is still at `revision`; `Conflict` otherwise.
    pub async fn update<T: Serialize>(
        &self,
        run: RunId,
        snapshot: &T,
        revision: u64,
    ) -> Result<u64, StoreError> {
        self.runs_bucket()
            .update(run.to_string(), self.encode(snapshot)?, revision)
            .await
            .map_err(|e| {
                if e.kind() == kv::UpdateErrorKind::WrongLastRevision {
                    StoreError::with_source(StoreErrorKind::Conflict, format!("run {run}"), e)
                } else {
                    nats(format!("updating run {run}"), e)
                }
            })
    }

    /// Maps an idempotency key to a run id: the first caller's `candidate` wins; later callers
    /// get that id back. Returns `(run id, whether it was new)`.
    pub async fn claim_idempotency_key(
        &self,
        key: &str,
        candidate: RunId,
    ) -> Result<(RunId, bool), StoreError> {
        let kv_key = idempotency_kv_key(key);
        match self
            .runs_bucket()
            .create(&kv_key, candidate.to_string().into())
            .await
        {
            Ok(_) => Ok((candidate, true)),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                let existing = self
                    .runs_bucket()
                    .get(&kv_key)
                    .await
                    .map_err(|e| nats("reading an idempotency key", e))?
                    .ok_or_else(|| {
                        StoreError::new(StoreErrorKind::NotFound, "idempotency key vanished")
                    })?;
                let text = String::from_utf8_lossy(&existing).into_owned();
                let id = text
                    .parse::<RunId>()
                    .map_err(|e| decode_err("idempotency key value", e))?;
                Ok((id, false))
            }
            Err(e) => Err(nats("claiming an idempotency key", e)),
        }
    }

    /// Stores `bytes` as object `name` in the artifacts store and returns its reference.
    /// Idempotent: the same name and content give the same reference.
    pub async fn put_artifact(
        &self,
        name: &str,
        bytes: Vec<u8>,
    ) -> Result<flotilla_model::artifact::ArtifactRef, StoreError> {
        use sha2::Digest;
        let bucket = self.bus().names().artifacts_bucket();
        let store = self
            .bus()
            .js()
            .get_object_store(&bucket)
            .await
            .map_err(|e| nats(format!("opening object store {bucket}"), e))?;
        let sha256 = format!("{:x}", sha2::Sha256::digest(&bytes));
        let size = bytes.len() as u64;
        let mut reader = std::io::Cursor::new(bytes);
        store
            .put(name, &mut reader)
            .await
            .map_err(|e| nats(format!("storing artifact {name}"), e))?;
        Ok(flotilla_model::artifact::ArtifactRef {
            bucket,
            name: name.to_owned(),
            size,
            sha256,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use flotilla_model::approval::Trigger;
    use flotilla_model::ids::RunId;
    use flotilla_model::runlog::Submitted;

    use super::*;
    use crate::machine::RunMachine;

    /// The snapshot as a 0.2 coordinator reads it: no `projections` field, and an outbox of
    /// the actions it knows.
    #[derive(serde::Deserialize)]
    struct Snapshot02 {
        #[allow(dead_code)]
        state: RunState,
        outbox: Vec<Action>,
        outbox_seqs: Vec<u64>,
    }

    #[test]
    fn approvals_projections_are_kept_apart_from_the_outbox_older_coordinators_read() {
        let submitted: Submitted = serde_json::from_value(serde_json::json!({
            "plan": {"subtasks": [{"id": "a", "description": "x"}]}
        }))
        .expect("a submission");
        let plan = Arc::new(submitted.plan.clone());
        let (machine, _) = RunMachine::start(RunId::new(), &submitted, plan, 1_000);
        let project = Action::ProjectApproval {
            task: 0,
            attempt: 1,
            call: 0,
            from_seq: 0,
            trigger: Trigger::HumanInCommand,
            deadline_ms: 61_000,
            seq: 4,
        };
        let outbox = vec![Action::Dispatch {
            task: 0,
            attempt: 1,
        }];
        let mut with_projection = outbox.clone();
        with_projection.push(project.clone());
        let bytes = rmp_serde::to_vec_named(&SnapshotRef {
            state: machine.state(),
            outbox: &with_projection,
            outbox_seqs: &[4],
        })
        .expect("encode");
        let read: Snapshot = rmp_serde::from_slice(&bytes).expect("decode");
        assert_eq!(read.outbox, outbox);
        assert_eq!(read.projections, vec![project]);
        assert_eq!(&read.state, machine.state());
        let old: Snapshot02 = rmp_serde::from_slice(&bytes).expect("a 0.2 reader decodes it");
        assert_eq!((old.outbox, old.outbox_seqs), (outbox.clone(), vec![4]));

        // Without a projection the snapshot has the 0.2 shape exactly.
        let bytes = rmp_serde::to_vec_named(&SnapshotRef {
            state: machine.state(),
            outbox: &outbox,
            outbox_seqs: &[4],
        })
        .expect("encode");
        let read: Snapshot = rmp_serde::from_slice(&bytes).expect("decode");
        assert!(read.projections.is_empty());
        assert_eq!(read.outbox, outbox);
    }
}
