//! Idempotent provisioning of Flotilla's streams and KV buckets.
//!
//! [`plan`] reads what exists and compares it with what this configuration wants, without
//! changing anything. [`ProvisionPlan::apply`] then creates what is missing and updates
//! compatible drift (longer retention, new subjects, direct get…). Drift that cannot be
//! changed in place without losing data — another retention policy or storage type, a shorter
//! age or per-subject limit — is reported and **nothing** is changed, not even the compatible
//! parts: an operator decides.
//!
//! ```no_run
//! # async fn example(js: async_nats::jetstream::Context) -> Result<(), Box<dyn std::error::Error>> {
//! use flotilla_bus::provision::{JetStreamOptions, provision};
//! let report = provision(&js, &flotilla_model::Names::default(), &JetStreamOptions::default()).await?;
//! println!("{report}");
//! # Ok(()) }
//! ```

use std::fmt;
use std::time::Duration;

use async_nats::jetstream::stream::{self, DiscardPolicy, RetentionPolicy, StorageType};
use async_nats::jetstream::{self, kv, object_store};
use flotilla_model::subjects::{Bucket, Names, StreamKind};
use serde::{Deserialize, Serialize};

use crate::error::{ProvisionError, ProvisionErrorKind};

/// Storage backend of streams and buckets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Storage {
    /// On disk: survives server restarts (the only choice for production).
    #[default]
    File,
    /// In memory: lost on restart.
    Memory,
}

impl From<Storage> for StorageType {
    fn from(s: Storage) -> Self {
        match s {
            Storage::File => StorageType::File,
            Storage::Memory => StorageType::Memory,
        }
    }
}

/// Stream and bucket settings (`[jetstream]` in `flotilla.toml`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct JetStreamOptions {
    /// Replicas of every stream and bucket: 1 for a single server, 3 (or 5) in a cluster.
    pub replicas: usize,
    /// Storage backend.
    pub storage: Storage,
    /// How long run logs and run records are kept.
    #[serde(with = "humantime_serde")]
    pub runlog_max_age: Duration,
    /// How long run events are kept.
    #[serde(with = "humantime_serde")]
    pub events_max_age: Duration,
    /// How long unprocessed submissions are kept.
    #[serde(with = "humantime_serde")]
    pub intake_max_age: Duration,
    /// How long workspace entries are kept.
    #[serde(with = "humantime_serde")]
    pub workspace_max_age: Duration,
    /// How long mailbox messages are kept.
    #[serde(with = "humantime_serde")]
    pub mailbox_max_age: Duration,
    /// How long notices (`<prefix>.notify.*.*`: approvals requested, runs paused or taken
    /// over) are kept for webhooks and late readers.
    #[serde(with = "humantime_serde")]
    pub notify_max_age: Duration,
    /// Messages kept per mailbox and sender (the newest win): a flooding sender evicts only
    /// its own old messages. Losses are counted (`flotilla mbox stats`).
    #[serde(alias = "mailbox-max-per-agent")]
    pub mailbox_max_per_sender: i64,
    /// Window in which JetStream drops messages with a repeated `Nats-Msg-Id`.
    #[serde(with = "humantime_serde")]
    pub duplicate_window: Duration,
    /// How long a worker stays listed without refreshing its registration.
    #[serde(with = "humantime_serde")]
    pub worker_ttl: Duration,
    /// How long artifacts (large results and files, in the object store) are kept.
    #[serde(with = "humantime_serde")]
    pub artifacts_max_age: Duration,
    /// How long remembered runs (`<prefix>-memory`) are kept; zero keeps them until forgotten.
    /// Set from `[supervisor.memory] max-age` (not a `[jetstream]` key), so every process
    /// that provisions the bucket gives it the same age.
    #[serde(skip)]
    pub memory_max_age: Duration,
    /// Consumers each stream allows. nats-server (2.15 and later) gives a stream without a
    /// limit of its own a default of 1,000; every live `flotilla watch`, event follower and
    /// workspace watcher holds one (on the events or workspace stream) while it runs.
    pub max_consumers: i32,
}

const DAY: Duration = Duration::from_secs(24 * 3600);

impl Default for JetStreamOptions {
    fn default() -> Self {
        Self {
            replicas: 1,
            storage: Storage::File,
            // A week of history for audits and `flotilla runs history`.
            runlog_max_age: 7 * DAY,
            events_max_age: 7 * DAY,
            // Submissions are normally consumed in milliseconds; a week covers a long outage.
            intake_max_age: 7 * DAY,
            // The source material's workspace TTL.
            workspace_max_age: 2 * DAY,
            mailbox_max_age: 2 * DAY,
            // A webhook endpoint down for a weekend still gets its notices.
            notify_max_age: 7 * DAY,
            // Mailbox cap: keep the newest N per recipient and sender.
            mailbox_max_per_sender: 1000,
            // JetStream's default; results and tasks carry deterministic ids within it.
            duplicate_window: Duration::from_secs(120),
            // Workers refresh every heartbeat (5 s); six missed refreshes mean it is gone.
            worker_ttl: Duration::from_secs(30),
            // As long as the run logs that refer to them.
            artifacts_max_age: 7 * DAY,
            // Room for thousands of concurrent watchers; the server's default is 1,000.
            max_consumers: 10_000,
            // A month of runs to learn from.
            memory_max_age: 30 * DAY,
        }
    }
}

impl JetStreamOptions {
    /// Checks the options without doing I/O.
    pub fn validate(&self) -> Result<(), String> {
        if ![1, 3, 5].contains(&self.replicas) {
            return Err(format!(
                "jetstream.replicas must be 1, 3 or 5, got {}",
                self.replicas
            ));
        }
        for (name, d) in [
            ("runlog-max-age", self.runlog_max_age),
            ("events-max-age", self.events_max_age),
            ("intake-max-age", self.intake_max_age),
            ("workspace-max-age", self.workspace_max_age),
            ("mailbox-max-age", self.mailbox_max_age),
            ("notify-max-age", self.notify_max_age),
            ("worker-ttl", self.worker_ttl),
            ("artifacts-max-age", self.artifacts_max_age),
        ] {
            if d < Duration::from_secs(1) {
                return Err(format!("jetstream.{name} must be at least 1s"));
            }
        }
        if self.max_consumers < 1 {
            return Err(format!(
                "jetstream.max-consumers must be at least 1, got {} (the server has no unlimited setting per stream)",
                self.max_consumers
            ));
        }
        if self.duplicate_window > self.runlog_max_age || self.duplicate_window.is_zero() {
            return Err(
                "jetstream.duplicate-window must be more than 0 and at most runlog-max-age".into(),
            );
        }
        if self.mailbox_max_per_sender < 1 {
            return Err("jetstream.mailbox-max-per-sender must be at least 1".into());
        }
        Ok(())
    }
}

/// The stream configurations this installation wants.
pub fn desired_streams(names: &Names, opts: &JetStreamOptions) -> Vec<stream::Config> {
    StreamKind::ALL
        .iter()
        .map(|&kind| {
            let mut c = stream::Config {
                name: names.stream(kind),
                subjects: names.stream_subjects(kind),
                storage: opts.storage.into(),
                num_replicas: opts.replicas,
                duplicate_window: opts.duplicate_window,
                discard: DiscardPolicy::Old,
                allow_direct: true,
                max_consumers: opts.max_consumers,
                ..Default::default()
            };
            match kind {
                StreamKind::Intake => {
                    c.description = Some("Flotilla plan submissions".into());
                    c.retention = RetentionPolicy::WorkQueue;
                    c.max_age = opts.intake_max_age;
                }
                StreamKind::Tasks => {
                    c.description = Some("Flotilla tasks, one work-queue consumer per pool".into());
                    c.retention = RetentionPolicy::WorkQueue;
                    // Queued work never expires: losing it would lose accepted runs.
                }
                StreamKind::RunLog => {
                    c.description = Some("Flotilla run logs and durable timers".into());
                    c.max_age = opts.runlog_max_age;
                    c.allow_message_schedules = true;
                }
                StreamKind::Events => {
                    c.description = Some("Flotilla run events".into());
                    c.max_age = opts.events_max_age;
                }
                StreamKind::Workspace => {
                    c.description = Some("Flotilla workspace topics".into());
                    c.max_age = opts.workspace_max_age;
                    // 1 MiB entry plus its envelope.
                    c.max_message_size =
                        (flotilla_model::workspace::MAX_ENTRY_BYTES + 64 * 1024) as i32;
                }
                StreamKind::Mailbox => {
                    c.description = Some("Flotilla agent mailboxes".into());
                    c.max_age = opts.mailbox_max_age;
                    c.max_messages_per_subject = opts.mailbox_max_per_sender;
                }
                StreamKind::Notify => {
                    c.description = Some(
                        "Flotilla notices: approvals, pauses, takeovers (for webhooks)".into(),
                    );
                    c.max_age = opts.notify_max_age;
                }
            }
            c
        })
        .collect()
}

/// The object store this installation wants (`<prefix>-artifacts`).
pub fn desired_object_store(names: &Names, opts: &JetStreamOptions) -> object_store::Config {
    object_store::Config {
        bucket: names.artifacts_bucket(),
        description: Some("Flotilla artifacts: payloads too large for a message".into()),
        max_age: opts.artifacts_max_age,
        storage: opts.storage.into(),
        num_replicas: opts.replicas,
        ..Default::default()
    }
}

/// The KV bucket configurations this installation wants.
pub fn desired_buckets(names: &Names, opts: &JetStreamOptions) -> Vec<kv::Config> {
    Bucket::ALL
        .iter()
        .map(|&b| kv::Config {
            bucket: names.bucket(b),
            description: format!("Flotilla {}", b.suffix()),
            history: 1,
            max_age: match b {
                Bucket::Workers => opts.worker_ttl,
                Bucket::Runs => opts.runlog_max_age,
                Bucket::Cursors => opts.mailbox_max_age,
                Bucket::Memory => opts.memory_max_age,
                _ => Duration::ZERO,
            },
            // Per-message TTLs: the usage bucket's `end.<run>` markers (a run's usage counted
            // once) expire on their own, while its quotas and counters stay.
            limit_markers: (b == Bucket::Usage).then_some(USAGE_MARKER_TTL),
            storage: opts.storage.into(),
            num_replicas: opts.replicas,
            ..Default::default()
        })
        .collect()
}

/// How long the delete marker of a usage-bucket entry that expired stays (the bucket's
/// `subject_delete_marker_ttl`; the server's minimum is one second).
const USAGE_MARKER_TTL: Duration = Duration::from_secs(60);

/// Stream or bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ResourceKind {
    /// A stream.
    Stream,
    /// A KV bucket.
    Bucket,
    /// An object store.
    ObjectStore,
}

/// One setting that differs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Difference {
    /// The setting.
    pub field: &'static str,
    /// What the configuration wants.
    pub expected: String,
    /// What the server has.
    pub actual: String,
    /// Why it cannot be changed in place, for incompatible differences.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// What provisioning does (or would do) with one resource.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// It is missing and is created.
    Create,
    /// It exists and matches.
    Unchanged,
    /// It exists with compatible drift that is updated.
    Update {
        /// The changes.
        changes: Vec<Difference>,
    },
    /// It exists with drift that cannot be changed without losing data.
    Incompatible {
        /// The blocking differences.
        differences: Vec<Difference>,
    },
}

/// One resource's line of the report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ResourceReport {
    /// Stream or bucket.
    pub kind: ResourceKind,
    /// Its name.
    pub name: String,
    /// What happens to it.
    #[serde(flatten)]
    pub action: Action,
}

/// The outcome of provisioning.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProvisionReport {
    /// One line per resource.
    pub resources: Vec<ResourceReport>,
}

impl ProvisionReport {
    /// Whether anything would be or was created or updated.
    pub fn changed(&self) -> bool {
        self.resources
            .iter()
            .any(|r| matches!(r.action, Action::Create | Action::Update { .. }))
    }

    /// The incompatible resources.
    pub fn incompatible(&self) -> impl Iterator<Item = &ResourceReport> {
        self.resources
            .iter()
            .filter(|r| matches!(r.action, Action::Incompatible { .. }))
    }
}

/// A report read as a plan (a dry run, or nothing applied because of incompatible drift):
/// "would create", "would update".
#[derive(Debug)]
pub struct Planned<'a>(&'a ProvisionReport);

impl ProvisionReport {
    /// This report as what provisioning would do, for a dry run.
    pub fn planned(&self) -> Planned<'_> {
        Planned(self)
    }

    fn write(&self, f: &mut fmt::Formatter<'_>, applied: bool) -> fmt::Result {
        let (created, updated) = if applied {
            ("created", "updated")
        } else {
            ("would create", "would update")
        };
        for r in &self.resources {
            let kind = match r.kind {
                ResourceKind::Stream => "stream",
                ResourceKind::Bucket => "bucket",
                ResourceKind::ObjectStore => "object",
            };
            match &r.action {
                Action::Create => writeln!(f, "{kind:<6} {:<24} {created}", r.name)?,
                Action::Unchanged => writeln!(f, "{kind:<6} {:<24} unchanged", r.name)?,
                Action::Update { changes } => {
                    writeln!(f, "{kind:<6} {:<24} {updated}", r.name)?;
                    for c in changes {
                        writeln!(f, "         {}: {} -> {}", c.field, c.actual, c.expected)?;
                    }
                }
                Action::Incompatible { differences } => {
                    writeln!(f, "{kind:<6} {:<24} INCOMPATIBLE", r.name)?;
                    for d in differences {
                        writeln!(
                            f,
                            "         {}: server has {}, configuration wants {} ({})",
                            d.field,
                            d.actual,
                            d.expected,
                            d.reason.as_deref().unwrap_or("cannot change in place")
                        )?;
                    }
                }
            }
        }
        Ok(())
    }
}

impl fmt::Display for ProvisionReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write(f, true)
    }
}

impl fmt::Display for Planned<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.write(f, false)
    }
}

enum Step {
    CreateStream(stream::Config),
    UpdateStream(stream::Config),
    CreateBucket(kv::Config),
    UpdateBucket(kv::Config),
    CreateObjectStore(object_store::Config),
}

/// A read-only comparison of the server with the configuration, ready to apply.
pub struct ProvisionPlan {
    report: ProvisionReport,
    steps: Vec<Step>,
}

impl fmt::Debug for ProvisionPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProvisionPlan")
            .field("report", &self.report)
            .finish()
    }
}

fn server_error(
    detail: String,
    e: impl std::error::Error + Send + Sync + 'static,
) -> ProvisionError {
    ProvisionError::with_source(ProvisionErrorKind::Server, detail, e)
}

async fn existing_stream(
    js: &jetstream::Context,
    name: &str,
) -> Result<Option<stream::Info>, ProvisionError> {
    match js.get_stream(name).await {
        Ok(s) => Ok(Some(s.cached_info().clone())),
        Err(e) => match e.kind() {
            jetstream::context::GetStreamErrorKind::JetStream(inner)
                if inner.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
            {
                Ok(None)
            }
            jetstream::context::GetStreamErrorKind::JetStream(inner)
                if inner.error_code() == jetstream::ErrorCode::JETSTREAM_NOT_ENABLED
                    || inner.error_code()
                        == jetstream::ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT =>
            {
                Err(ProvisionError::with_source(
                    ProvisionErrorKind::JetStreamUnavailable,
                    "JetStream is not enabled on this server/account (start nats-server with -js)",
                    e,
                ))
            }
            _ => Err(server_error(format!("reading stream {name}"), e)),
        },
    }
}

/// Compares the server with the configuration. Changes nothing.
pub async fn plan(
    js: &jetstream::Context,
    names: &Names,
    opts: &JetStreamOptions,
) -> Result<ProvisionPlan, ProvisionError> {
    opts.validate()
        .map_err(|e| ProvisionError::new(ProvisionErrorKind::Incompatible, e))?;
    let mut report = ProvisionReport {
        resources: Vec::new(),
    };
    let mut steps = Vec::new();
    for want in desired_streams(names, opts) {
        let action = match existing_stream(js, &want.name).await? {
            None => {
                steps.push(Step::CreateStream(want.clone()));
                Action::Create
            }
            Some(info) => {
                let (changes, blocking) = compare_stream(&want, &info.config, info.state.messages);
                if !blocking.is_empty() {
                    Action::Incompatible {
                        differences: blocking,
                    }
                } else if changes.is_empty() {
                    Action::Unchanged
                } else {
                    steps.push(Step::UpdateStream(merge_stream(&want, info.config)));
                    Action::Update { changes }
                }
            }
        };
        report.resources.push(ResourceReport {
            kind: ResourceKind::Stream,
            name: want.name.clone(),
            action,
        });
    }
    for want in desired_buckets(names, opts) {
        let stream_name = format!("KV_{}", want.bucket);
        let action = match existing_stream(js, &stream_name).await? {
            None => {
                steps.push(Step::CreateBucket(want.clone()));
                Action::Create
            }
            Some(info) => {
                let (changes, blocking) = compare_bucket(&want, &info.config);
                if !blocking.is_empty() {
                    Action::Incompatible {
                        differences: blocking,
                    }
                } else if changes.is_empty() {
                    Action::Unchanged
                } else {
                    steps.push(Step::UpdateBucket(want.clone()));
                    Action::Update { changes }
                }
            }
        };
        report.resources.push(ResourceReport {
            kind: ResourceKind::Bucket,
            name: want.bucket.clone(),
            action,
        });
    }
    let want = desired_object_store(names, opts);
    let action = match existing_stream(js, &format!("OBJ_{}", want.bucket)).await? {
        None => {
            steps.push(Step::CreateObjectStore(want.clone()));
            Action::Create
        }
        // Artifacts are plain objects: any existing store serves; its limits are the
        // operator's to change.
        Some(_) => Action::Unchanged,
    };
    report.resources.push(ResourceReport {
        kind: ResourceKind::ObjectStore,
        name: want.bucket.clone(),
        action,
    });
    Ok(ProvisionPlan { report, steps })
}

impl ProvisionPlan {
    /// What applying would do.
    pub fn report(&self) -> &ProvisionReport {
        &self.report
    }

    /// Whether the plan can be applied.
    pub fn is_compatible(&self) -> bool {
        self.report.incompatible().next().is_none()
    }

    /// Creates and updates. Refuses, changing nothing, when anything is incompatible.
    pub async fn apply(self, js: &jetstream::Context) -> Result<ProvisionReport, ProvisionError> {
        if !self.is_compatible() {
            return Err(ProvisionError::new(
                ProvisionErrorKind::Incompatible,
                format!(
                    "existing JetStream resources differ in ways that would lose data; nothing was changed:\n{}",
                    self.report
                ),
            ));
        }
        for step in self.steps {
            match step {
                Step::CreateStream(c) => {
                    let name = c.name.clone();
                    // Another process may have created it a moment ago.
                    if let Err(e) = js.create_stream(c).await
                        && existing_stream(js, &name).await?.is_none()
                    {
                        return Err(server_error(format!("creating stream {name}"), e));
                    }
                }
                Step::UpdateStream(c) => {
                    let name = c.name.clone();
                    js.update_stream(c)
                        .await
                        .map_err(|e| server_error(format!("updating stream {name}"), e))?;
                }
                Step::CreateBucket(c) => {
                    let name = c.bucket.clone();
                    if let Err(e) = js.create_key_value(c).await
                        && existing_stream(js, &format!("KV_{name}")).await?.is_none()
                    {
                        return Err(server_error(format!("creating bucket {name}"), e));
                    }
                }
                Step::UpdateBucket(c) => {
                    let name = c.bucket.clone();
                    js.update_key_value(c)
                        .await
                        .map_err(|e| server_error(format!("updating bucket {name}"), e))?;
                }
                Step::CreateObjectStore(c) => {
                    let name = c.bucket.clone();
                    if let Err(e) = js.create_object_store(c).await
                        && existing_stream(js, &format!("OBJ_{name}")).await?.is_none()
                    {
                        return Err(server_error(format!("creating object store {name}"), e));
                    }
                }
            }
        }
        Ok(self.report)
    }
}

/// Plans and applies: the one call services make at start-up.
pub async fn provision(
    js: &jetstream::Context,
    names: &Names,
    opts: &JetStreamOptions,
) -> Result<ProvisionReport, ProvisionError> {
    plan(js, names, opts).await?.apply(js).await
}

fn diff(field: &'static str, expected: impl fmt::Debug, actual: impl fmt::Debug) -> Difference {
    Difference {
        field,
        expected: format!("{expected:?}"),
        actual: format!("{actual:?}"),
        reason: None,
    }
}

fn blocking(mut d: Difference, reason: &str) -> Difference {
    d.reason = Some(reason.to_owned());
    d
}

/// A limit where 0 or -1 means unlimited, compared by what it keeps.
fn keeps(limit: i64) -> i64 {
    if limit <= 0 { i64::MAX } else { limit }
}

fn keeps_age(d: Duration) -> Duration {
    if d.is_zero() { Duration::MAX } else { d }
}

/// Splits the differences of a stream into (compatible changes, blocking differences).
fn compare_stream(
    want: &stream::Config,
    have: &stream::Config,
    messages: u64,
) -> (Vec<Difference>, Vec<Difference>) {
    let mut changes = Vec::new();
    let mut block = Vec::new();
    if want.retention != have.retention {
        block.push(blocking(
            diff("retention", want.retention, have.retention),
            "the retention policy of a stream cannot change",
        ));
    }
    if want.storage != have.storage {
        block.push(blocking(
            diff("storage", want.storage, have.storage),
            "the storage type of a stream cannot change",
        ));
    }
    if want.max_age != have.max_age {
        let d = diff("max_age", want.max_age, have.max_age);
        if keeps_age(want.max_age) < keeps_age(have.max_age) {
            block.push(blocking(d, "a shorter max age would delete older messages"));
        } else {
            changes.push(d);
        }
    }
    if keeps(want.max_messages_per_subject) != keeps(have.max_messages_per_subject) {
        let d = diff(
            "max_msgs_per_subject",
            want.max_messages_per_subject,
            have.max_messages_per_subject,
        );
        if keeps(want.max_messages_per_subject) < keeps(have.max_messages_per_subject) {
            block.push(blocking(
                d,
                "a lower per-subject limit would delete messages",
            ));
        } else {
            changes.push(d);
        }
    }
    if want.allow_message_schedules && !have.allow_message_schedules {
        let d = diff("allow_msg_schedules", true, false);
        if messages > 0 {
            block.push(blocking(
                d,
                "message schedules can only be enabled on an empty stream",
            ));
        } else {
            changes.push(d);
        }
    }
    let mut want_subjects = want.subjects.clone();
    let mut have_subjects = have.subjects.clone();
    want_subjects.sort();
    have_subjects.sort();
    if want_subjects != have_subjects {
        changes.push(diff("subjects", want_subjects, have_subjects));
    }
    if want.num_replicas != have.num_replicas.max(1) {
        changes.push(diff("num_replicas", want.num_replicas, have.num_replicas));
    }
    if want.duplicate_window != have.duplicate_window {
        changes.push(diff(
            "duplicate_window",
            want.duplicate_window,
            have.duplicate_window,
        ));
    }
    if want.allow_direct != have.allow_direct {
        changes.push(diff("allow_direct", want.allow_direct, have.allow_direct));
    }
    if keeps(i64::from(want.max_message_size)) != keeps(i64::from(have.max_message_size)) {
        changes.push(diff(
            "max_msg_size",
            want.max_message_size,
            have.max_message_size,
        ));
    }
    if want.description != have.description {
        changes.push(diff("description", &want.description, &have.description));
    }
    if want.max_consumers != have.max_consumers {
        changes.push(diff(
            "max_consumers",
            want.max_consumers,
            have.max_consumers,
        ));
    }
    (changes, block)
}

/// The existing configuration with the compatible settings of `want` applied.
fn merge_stream(want: &stream::Config, mut have: stream::Config) -> stream::Config {
    have.subjects = want.subjects.clone();
    have.max_age = want.max_age;
    have.max_messages_per_subject = want.max_messages_per_subject;
    have.num_replicas = want.num_replicas;
    have.duplicate_window = want.duplicate_window;
    have.allow_direct = want.allow_direct;
    have.max_message_size = want.max_message_size;
    have.description = want.description.clone();
    have.max_consumers = want.max_consumers;
    have.allow_message_schedules = want.allow_message_schedules || have.allow_message_schedules;
    have
}

fn compare_bucket(want: &kv::Config, have: &stream::Config) -> (Vec<Difference>, Vec<Difference>) {
    let mut changes = Vec::new();
    let mut block = Vec::new();
    let want_storage: StorageType = want.storage;
    if want_storage != have.storage {
        block.push(blocking(
            diff("storage", want_storage, have.storage),
            "the storage type of a bucket cannot change",
        ));
    }
    if want.history != have.max_messages_per_subject {
        let d = diff("history", want.history, have.max_messages_per_subject);
        if want.history < have.max_messages_per_subject {
            block.push(blocking(d, "less history would delete older revisions"));
        } else {
            changes.push(d);
        }
    }
    if want.max_age != have.max_age {
        let d = diff("max_age", want.max_age, have.max_age);
        if keeps_age(want.max_age) < keeps_age(have.max_age) {
            block.push(blocking(d, "a shorter max age would delete entries"));
        } else {
            changes.push(d);
        }
    }
    if want.num_replicas.max(1) != have.num_replicas.max(1) {
        changes.push(diff("num_replicas", want.num_replicas, have.num_replicas));
    }
    // Per-message TTLs can be allowed on an existing bucket (never taken back).
    if want.limit_markers.is_some() && !have.allow_message_ttl {
        changes.push(diff("allow_msg_ttl", true, false));
    }
    (changes, block)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shrinking_retention_blocks_and_growing_updates() {
        let names = Names::default();
        let opts = JetStreamOptions::default();
        let want = desired_streams(&names, &opts)
            .into_iter()
            .find(|c| c.name == "FLOTILLA_EVENTS")
            .expect("events stream");
        let mut have = want.clone();
        have.max_age = Duration::from_secs(30 * 24 * 3600);
        let (changes, block) = compare_stream(&want, &have, 10);
        assert!(changes.is_empty());
        assert_eq!(block[0].field, "max_age");

        have.max_age = Duration::from_secs(3600);
        have.allow_direct = false;
        let (changes, block) = compare_stream(&want, &have, 10);
        assert!(block.is_empty());
        let fields: Vec<_> = changes.iter().map(|c| c.field).collect();
        assert_eq!(fields, vec!["max_age", "allow_direct"]);
    }

    #[test]
    fn retention_change_is_incompatible() {
        let names = Names::default();
        let want = desired_streams(&names, &JetStreamOptions::default())
            .into_iter()
            .find(|c| c.name == "FLOTILLA_TASKS")
            .expect("tasks stream");
        let mut have = want.clone();
        have.retention = RetentionPolicy::Limits;
        let (_, block) = compare_stream(&want, &have, 0);
        assert_eq!(block.len(), 1);
        assert_eq!(block[0].field, "retention");
    }

    #[test]
    fn options_validate() {
        assert!(JetStreamOptions::default().validate().is_ok());
        let bad = JetStreamOptions {
            replicas: 2,
            ..JetStreamOptions::default()
        };
        assert!(bad.validate().is_err());
    }
}
