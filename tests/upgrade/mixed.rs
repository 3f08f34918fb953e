//! The mixed deployment of the upgrade tests: `flotilla` processes of two builds on one
//! lived-in deployment, started and stopped one at a time as Kubernetes rolls a Deployment,
//! with the checks made at each step (the history's reads, new runs of every kind, the
//! clients' work, work in flight across a stop) and the final audit (nothing lost or failed).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::approval::{ApprovalDecided, ApprovalListRequest, ApprovalStatus, PlanHitl};
use flotilla_model::ids::{RunId, SessionId};
use flotilla_model::plan::{Plan, PlanConfig, Subtask};
use flotilla_model::run::RunStatus;
use flotilla_model::runlog::RunInput;
use flotilla_model::submit::SubmitRequest;
use flotilla_model::time::Secs;
use flotilla_testkit::lived_in::{self, LivedIn, Reads};
use flotilla_testkit::openai::OpenAiServer;
use serde_json::{Value, json};

use crate::support::{self, Processes};

/// Bulk runs of history beside the runs of every kind.
pub(crate) const BULK: usize = 10;

/// How long a request may take.
pub(crate) const ASK: Duration = Duration::from_secs(10);

/// The console's bearer token for `alice`.
pub(crate) const TOKEN: &str = "upgrade-console-token-0123456789";

/// The previous release's binary, or `None` (saying so) when `FLOTILLA_OLD_BIN` is unset.
pub(crate) fn old_bin() -> anyhow::Result<Option<PathBuf>> {
    let Some(bin) = std::env::var_os("FLOTILLA_OLD_BIN") else {
        eprintln!(
            "FLOTILLA_OLD_BIN is not set: nothing to check (scripts/upgrade-check builds the previous release and runs these tests with it)"
        );
        return Ok(None);
    };
    let bin = PathBuf::from(bin);
    ensure!(
        bin.is_file(),
        "FLOTILLA_OLD_BIN={} is not a file",
        bin.display()
    );
    Ok(Some(bin))
}

/// Which build a process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Version {
    /// `$FLOTILLA_OLD_BIN`.
    Old,
    /// This build.
    New,
}

impl Version {
    pub(crate) fn other(self) -> Self {
        match self {
            Self::Old => Self::New,
            Self::New => Self::Old,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Old => "old",
            Self::New => "new",
        }
    }
}

/// A kind of service, as the Helm chart has one Deployment of each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Coordinator,
    Supervisor,
    Worker,
    Console,
}

impl Kind {
    pub(crate) fn command(self) -> &'static str {
        match self {
            Self::Coordinator => "coordinator",
            Self::Supervisor => "supervisor",
            Self::Worker => "worker",
            Self::Console => "console",
        }
    }
}

/// One running service process.
#[derive(Debug, Clone)]
pub(crate) struct Service {
    pub(crate) kind: Kind,
    pub(crate) version: Version,
    /// Its index in [`Processes`].
    pub(crate) index: usize,
    /// Where its console listens (consoles only).
    pub(crate) console: Option<String>,
}

pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Polls `check` every 50 ms until it says yes, for up to a minute.
pub(crate) async fn until<F, Fut>(what: &str, check: F) -> anyhow::Result<()>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    loop {
        match check().await {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => last = format!("; last error: {e:#}"),
        }
        ensure!(
            Instant::now() < deadline,
            "waited a minute for {what}{last}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The reads about the history alone: approvals and remembered runs of the history's runs,
/// without the deployment-wide tallies (failure records, the roster's counters) that work
/// in flight moves.
pub(crate) fn history_only(mut reads: Reads, history: &LivedIn) -> Reads {
    let ids: BTreeSet<String> = history
        .runs
        .values()
        .chain(&history.bulk)
        .map(ToString::to_string)
        .chain([flotilla_model::rollback::rollback_run_id(history.runs["rolled_back"]).to_string()])
        .collect();
    let of_history = |v: &Value, pointer: &str| {
        v.pointer(pointer)
            .and_then(Value::as_str)
            .is_some_and(|r| ids.contains(r))
    };
    if let Some(Value::Array(list)) = reads
        .0
        .get_mut("approvals")
        .and_then(|a| a.get_mut("approvals"))
    {
        list.retain(|a| of_history(a, "/request/run_id"));
    }
    if let Some(Value::Array(list)) = reads.0.get_mut("memory").and_then(|m| m.get_mut("entries")) {
        list.retain(|e| of_history(e, "/run_id"));
    }
    reads.0.remove("stats");
    reads.0.remove("team");
    reads
}

/// The console's JSON with the fields that move by themselves blanked (a held run's
/// duration).
pub(crate) fn normalise_console(body: &str) -> String {
    let Ok(mut v) = serde_json::from_str::<Value>(body) else {
        return body.to_owned();
    };
    fn walk(v: &mut Value) {
        match v {
            Value::Object(m) => {
                m.retain(|k, _| !matches!(k.as_str(), "duration_ms" | "now" | "worker"));
                m.values_mut().for_each(walk);
            }
            Value::Array(a) => a.iter_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut v);
    v.to_string()
}

/// Whether two consoles' reads say the same: the same paths, and of each path's answers one
/// holds the other ([`holds`]).
pub(crate) fn console_answers_agree(a: &[(String, String)], b: &[(String, String)]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|((pa, va), (pb, vb))| {
            if pa != pb {
                return false;
            }
            match (
                serde_json::from_str::<Value>(va),
                serde_json::from_str::<Value>(vb),
            ) {
                (Ok(x), Ok(y)) => holds(&x, &y) || holds(&y, &x),
                _ => va == vb,
            }
        })
}

/// Whether `big` holds `small`: every field of `small` is in `big` with a value that holds
/// it; arrays element by element; other values equal.
pub(crate) fn holds(big: &Value, small: &Value) -> bool {
    match (big, small) {
        (Value::Object(b), Value::Object(s)) => s
            .iter()
            .all(|(k, v)| b.get(k).is_some_and(|bv| holds(bv, v))),
        (Value::Array(b), Value::Array(s)) => {
            b.len() == s.len() && b.iter().zip(s).all(|(x, y)| holds(x, y))
        }
        _ => big == small,
    }
}

/// A plan of `subtasks` named `name`, its approvals waiting up to `approval_timeout`.
pub(crate) fn plan_named(name: &str, subtasks: Vec<Subtask>, approval_timeout: u64) -> Plan {
    Plan {
        fork: None,
        name: Some(name.into()),
        query: Some(format!("upgrade: {name}")),
        subtasks,
        config: PlanConfig {
            hitl: Some(PlanHitl {
                approval_timeout: Some(Secs::from_secs(approval_timeout)),
                ..PlanHitl::default()
            }),
            ..PlanConfig::default()
        },
    }
}

/// A task that waits for a person (a sensitive action of `echo`, `human_in_the_loop`).
pub(crate) fn gate() -> Subtask {
    let mut s = Subtask::new("gate", "publish the report").with_agent("echo");
    s.action = Some("publish".into());
    s
}

/// Names of the runs meant to fail: the history's, [`LivedIn::exercise`]'s and this test's.
pub(crate) const MEANT_TO_FAIL: &[&str] = &[
    "failed",
    "rejected",
    "new-failed",
    "ops-failed",
    "ops-rejected",
    "flight-expired",
];
/// Names of the runs meant to be cancelled (the history's).
pub(crate) const MEANT_TO_BE_CANCELLED: &[&str] = &["cancelled", "rolled_back"];
/// The history's runs meant to stay unfinished (held by a pause, a takeover or an approval).
pub(crate) const MEANT_TO_BE_HELD: &[&str] = &["pending", "paused", "taken_over", "task_paused"];

/// Work started before a service stops and finished after.
pub(crate) struct InFlight {
    /// A chain whose first task (2 s) runs during the stop.
    pub(crate) chain: RunId,
    /// An approval whose deadline passes during the stop.
    pub(crate) expiring: RunId,
    /// Its deadline as asked.
    pub(crate) deadline: Value,
    /// An approval answered after the stop.
    pub(crate) waiting: RunId,
}

/// A deployment of `flotilla` processes of two versions, with a lived-in history.
pub(crate) struct Mixed {
    pub(crate) p: Processes,
    pub(crate) model: OpenAiServer,
    pub(crate) old: PathBuf,
    pub(crate) history: LivedIn,
    pub(crate) services: Vec<Service>,
    /// Runs this test submitted itself, with the status each must end in.
    pub(crate) ledger: Vec<(RunId, String, RunStatus)>,
    /// The reads of the history and the consoles' answers, as of the last settled moment.
    pub(crate) before: Reads,
    pub(crate) console_before: Vec<(String, String)>,
    pub(crate) ops: usize,
}

impl Mixed {
    /// A deployment of `version`'s services — provisioned first by its `nats provision`, as
    /// the Helm chart's install Job does — with history built through this build's client.
    pub(crate) async fn start(old: PathBuf, version: Version) -> anyhow::Result<Self> {
        let model = OpenAiServer::start().await?;
        let config = format!(
            "{}\n[console]\noperators = [\"alice\"]\n[console.tokens]\nalice = \"{TOKEN}\"\n",
            lived_in::config(&model.base_url())
        );
        let p = Processes::unprovisioned(&config).await?;
        let out = p.cli_of(&Self::bin_of(&old, version), &["nats", "provision"])?;
        ensure!(
            out.status.success(),
            "{} nats provision: {}",
            version.name(),
            String::from_utf8_lossy(&out.stderr)
        );
        let mut this = Self {
            p,
            model,
            old,
            // Built below, once the services run.
            history: LivedIn {
                session: SessionId::new(),
                runs: BTreeMap::new(),
                bulk: Vec::new(),
                team: String::new(),
            },
            services: Vec::new(),
            ledger: Vec::new(),
            before: Reads(BTreeMap::new()),
            console_before: Vec::new(),
            ops: 0,
        };
        for kind in [
            Kind::Coordinator,
            Kind::Worker,
            Kind::Supervisor,
            Kind::Console,
        ] {
            let s = this.launch(kind, version).await?;
            this.services.push(s);
        }
        this.history = match LivedIn::build(&this.p.client, &this.model, BULK).await {
            Ok(h) => h,
            Err(e) => bail!("building the history: {e}\n{}", this.logs()),
        };
        this.snapshot().await?;
        say(&format!(
            "{} deployment with history: {} runs of every kind, {BULK} bulk",
            version.name(),
            this.history.runs.len()
        ));
        Ok(this)
    }

    pub(crate) fn bin(&self, version: Version) -> PathBuf {
        Self::bin_of(&self.old, version)
    }

    pub(crate) fn bin_of(old: &std::path::Path, version: Version) -> PathBuf {
        match version {
            Version::Old => old.to_path_buf(),
            Version::New => PathBuf::from(env!("CARGO_BIN_EXE_flotilla")),
        }
    }

    pub(crate) fn logs(&self) -> String {
        self.services
            .iter()
            .map(|s| {
                format!(
                    "--- {} {} (p{}):\n{}",
                    s.version.name(),
                    s.kind.command(),
                    s.index,
                    self.p.log(s.index)
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// What runs now, e.g. `coordinator old+new, worker old, …`.
    pub(crate) fn mix(&self) -> String {
        [
            Kind::Coordinator,
            Kind::Supervisor,
            Kind::Worker,
            Kind::Console,
        ]
        .iter()
        .map(|k| {
            let versions: Vec<&str> = self
                .services
                .iter()
                .filter(|s| s.kind == *k)
                .map(|s| s.version.name())
                .collect();
            format!("{} {}", k.command(), versions.join("+"))
        })
        .collect::<Vec<_>>()
        .join(", ")
    }

    pub(crate) fn runs_any(&self, version: Version) -> bool {
        self.services.iter().any(|s| s.version == version)
    }

    /// Starts a `kind` process of `version` and waits until it is ready and answering.
    pub(crate) async fn launch(&mut self, kind: Kind, version: Version) -> anyhow::Result<Service> {
        let port = free_port()?;
        let http = format!("127.0.0.1:{port}");
        let console = format!("127.0.0.1:{}", free_port()?);
        let mut env = vec![("FLOTILLA_TELEMETRY__HTTP_ADDR", http.as_str())];
        if kind == Kind::Console {
            env.push(("FLOTILLA_CONSOLE__LISTEN", console.as_str()));
        }
        let bin = self.bin(version);
        let index = self.p.spawn_bin(&bin, &[kind.command()], &env)?;
        let what = format!("{} {}", version.name(), kind.command());
        let log = |p: &Processes| format!("{what} (p{index}):\n{}", p.log(index));
        // Ready as it says (`/readyz`), then answering as its clients need it.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok((200, _)) =
                flotilla_testkit::http::request(&http, "GET", "/readyz", &[], None).await
            {
                break;
            }
            ensure!(Instant::now() < deadline, "never ready: {}", log(&self.p));
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let client = self.p.client.clone();
        let answering = match kind {
            Kind::Coordinator => support::wait_for_api(&self.p.bus).await,
            Kind::Worker => self.p.wait_registered(index).await,
            Kind::Supervisor => {
                until("the team API to answer", || async {
                    Ok(client
                        .request(
                            &flotilla_model::team::TeamListRequest {
                                protocol: PROTOCOL_VERSION,
                                role: None,
                            },
                            ASK,
                        )
                        .await
                        .is_ok())
                })
                .await
            }
            Kind::Console => {
                until("the console to answer", || async {
                    Ok(console_get(&console, "/api/inbox").await.is_ok())
                })
                .await
            }
        };
        answering.with_context(|| log(&self.p))?;
        Ok(Service {
            kind,
            version,
            index,
            console: (kind == Kind::Console).then_some(console),
        })
    }

    /// Surge: a `kind` process of `version` starts beside the running ones. The history
    /// answers as before (the reads and the consoles'), then new runs of every kind and the
    /// clients' work succeed.
    pub(crate) async fn surge(&mut self, kind: Kind, version: Version) -> anyhow::Result<()> {
        let what = format!("{} {} started", version.name(), kind.command());
        self.settle().await?;
        let s = self.launch(kind, version).await?;
        self.services.push(s);
        let after = self.reads().await?;
        self.before
            .ensure_same(&after, &what)
            .with_context(|| self.logs())?;
        self.consoles_same(&what).await?;
        self.work(&what).await?;
        say(&format!(
            "✓ {what} ({}): history reads unchanged, new runs of every kind, clients' work done",
            self.mix()
        ));
        Ok(())
    }

    /// Stop: the `kind` process of `version` gets SIGTERM (and must exit 0) while a chain
    /// runs, an approval is due to expire within seconds and another waits; each ends as it
    /// should after.
    /// The history answers as before; new runs and the clients' work succeed.
    pub(crate) async fn stop(&mut self, kind: Kind, version: Version) -> anyhow::Result<()> {
        let what = format!("{} {} stopped", version.name(), kind.command());
        self.settle().await?;
        let before = history_only(self.before.clone(), &self.history);
        let flight = self.in_flight().await.with_context(|| self.logs())?;
        let at = self
            .services
            .iter()
            .position(|s| s.kind == kind && s.version == version)
            .with_context(|| format!("{what}: no such process ({})", self.mix()))?;
        let s = self.services.remove(at);
        self.p.terminate(s.index);
        let code = self
            .p
            .wait_exit(s.index, Duration::from_secs(60))
            .await
            .with_context(|| format!("{what}: stopping\n{}", self.p.log(s.index)))?;
        ensure!(
            code == Some(0),
            "{what}: exited {code:?} on SIGTERM\n{}",
            self.p.log(s.index)
        );
        self.land(flight, &what)
            .await
            .with_context(|| self.logs())?;
        self.settle().await?;
        let after = history_only(self.reads().await?, &self.history);
        before
            .ensure_same(&after, &what)
            .with_context(|| self.logs())?;
        self.work(&what).await?;
        say(&format!(
            "✓ {what} ({}): work in flight carried over, history reads unchanged, new runs of every kind, clients' work done",
            self.mix()
        ));
        Ok(())
    }

    /// A kind rolled to `version`: a surge of the new process, then the old one stopped.
    pub(crate) async fn roll(&mut self, kind: Kind, version: Version) -> anyhow::Result<()> {
        self.surge(kind, version).await?;
        self.stop(kind, version.other()).await
    }

    pub(crate) async fn settle(&self) -> anyhow::Result<()> {
        self.history
            .settled(&self.p.client)
            .await
            .with_context(|| self.logs())
    }

    pub(crate) async fn reads(&self) -> anyhow::Result<Reads> {
        Ok(self
            .history
            .reads(&self.p.client)
            .await
            .with_context(|| self.logs())?
            .without_presence())
    }

    /// Takes the reads every later step compares with (after new work changed them).
    pub(crate) async fn snapshot(&mut self) -> anyhow::Result<()> {
        self.settle().await?;
        self.before = self.reads().await?;
        let console = self
            .services
            .iter()
            .find_map(|s| s.console.clone())
            .context("no console runs")?;
        self.console_before = console_reads(&console, &self.history).await?;
        Ok(())
    }

    /// Every running console answers about the history as before. A console of a newer
    /// release answers more (0.2.0 added `label`, `progress`, `task_labels` and `timeline` to
    /// a run and `names` to the inbox): answers agree when one holds the other, every field
    /// they share equal.
    pub(crate) async fn consoles_same(&self, what: &str) -> anyhow::Result<()> {
        for s in &self.services {
            if let Some(addr) = &s.console {
                let now = console_reads(addr, &self.history).await?;
                ensure!(
                    console_answers_agree(&now, &self.console_before),
                    "{what}: the {} console answers differently:\nbefore: {:#?}\nafter: {now:#?}",
                    s.version.name(),
                    self.console_before
                );
            }
        }
        Ok(())
    }

    /// New runs of every kind through this build's client, then an operator's work through
    /// the old CLI (while new services run) and this build's CLI (while old ones run); then
    /// the reads are taken again.
    pub(crate) async fn work(&mut self, what: &str) -> anyhow::Result<()> {
        if let Err(e) = self.history.exercise(&self.p.client, &self.model).await {
            bail!("{what}: new runs: {e}\n{}", self.logs());
        }
        for client in [Version::Old, Version::New] {
            if self.runs_any(client.other()) {
                self.operate(client)
                    .await
                    .with_context(|| format!("{what}: the {} CLI", client.name()))
                    .with_context(|| self.logs())?;
            }
        }
        self.snapshot().await
    }

    /// Work that spans a stop: a chain whose first task is running, an approval that
    /// expires in 3 s, one left waiting.
    pub(crate) async fn in_flight(&mut self) -> anyhow::Result<InFlight> {
        let client = self.p.client.clone();
        let submit = |plan: Plan| {
            let client = client.clone();
            async move { client.submit(SubmitRequest::new(plan)).await }
        };
        let chain_plan = plan_named(
            "flight-chain",
            vec![
                Subtask::new("first", "slowly").with_agent("slow"),
                Subtask::new("second", "then").after(&["first"]),
            ],
            3600,
        );
        let chain = submit(chain_plan).await?;
        let expiring = submit(plan_named("flight-expired", vec![gate()], 3)).await?;
        let waiting = submit(plan_named(
            "flight-approved",
            vec![gate(), Subtask::new("after", "announce").after(&["gate"])],
            3600,
        ))
        .await?;
        self.ledger
            .push((chain, "flight-chain".into(), RunStatus::Succeeded));
        self.ledger
            .push((expiring, "flight-expired".into(), RunStatus::Failed));
        self.ledger
            .push((waiting, "flight-approved".into(), RunStatus::Succeeded));
        support::task_started(&client, chain, "first").await?;
        let asked = self.asked(Version::New, expiring).await?;
        self.asked(Version::New, waiting).await?;
        Ok(InFlight {
            chain,
            expiring,
            deadline: asked
                .pointer("/request/deadline")
                .cloned()
                .unwrap_or(Value::Null),
            waiting,
        })
    }

    /// The work in flight ends as it should: the chain succeeds, the expiring approval
    /// expires at the deadline it was asked with (its run fails), and the waiting one,
    /// approved now with the old CLI, lets its run succeed.
    pub(crate) async fn land(&mut self, f: InFlight, what: &str) -> anyhow::Result<()> {
        let client = &self.p.client;
        let done = client.wait(f.chain, support::WAIT).await?;
        ensure!(
            done.status == RunStatus::Succeeded,
            "{what}: the chain in flight ended {:?}: {:?}",
            done.status,
            done.reason
        );
        let expired = client.wait(f.expiring, support::WAIT).await?;
        ensure!(
            expired.status == RunStatus::Failed,
            "{what}: the expiring approval's run ended {:?}",
            expired.status
        );
        let records = support::approvals_of(client, f.expiring, true).await?;
        let record =
            serde_json::to_value(records.first().context("the expiring approval is gone")?)?;
        ensure!(
            record.pointer("/status") == Some(&json!("expired"))
                && record.pointer("/request/deadline") == Some(&f.deadline),
            "{what}: the approval was not expired at its deadline {}: {record}",
            f.deadline
        );
        let said = self.cli_ok(
            Version::Old,
            &[
                "approvals",
                "approve",
                &f.waiting.to_string(),
                "t0a1",
                "--by",
                "ops",
            ],
        )?;
        ensure!(said.starts_with("decided"), "{what}: approve: {said}");
        let done = client.wait(f.waiting, support::WAIT).await?;
        ensure!(
            done.status == RunStatus::Succeeded,
            "{what}: the run approved after the stop ended {:?}",
            done.status
        );
        Ok(())
    }

    /// Nothing lost or failed: every run this test submitted ended as it should; across the
    /// whole deployment only the runs meant to fail failed, only those meant to be cancelled
    /// were, and only the history's held runs are not over; every settled approval was
    /// decided exactly once on its run's log, and only the held runs' are pending.
    pub(crate) async fn audit(&self) -> anyhow::Result<()> {
        let client = &self.p.client;
        for (run, name, want) in &self.ledger {
            let now = client
                .run(*run)
                .await?
                .with_context(|| format!("run {run} ({name}) is gone"))?
                .record
                .status;
            ensure!(now == *want, "run {run} ({name}) is {now:?}, not {want:?}");
        }
        let store = flotilla_client::open_store(client.bus()).await?;
        let held: BTreeSet<RunId> = MEANT_TO_BE_HELD
            .iter()
            .map(|n| self.history.runs[n])
            .collect();
        let mut wrong = Vec::new();
        let ids = store.list().await?;
        for run in &ids {
            let Some(r) = store.record(*run).await? else {
                wrong.push(format!("{run}: no record"));
                continue;
            };
            let name = r.name.clone().unwrap_or_default();
            let ok = match r.status {
                RunStatus::Succeeded => true,
                RunStatus::Failed => MEANT_TO_FAIL.contains(&name.as_str()),
                RunStatus::Cancelled => MEANT_TO_BE_CANCELLED.contains(&name.as_str()),
                RunStatus::Rejected => false,
                _ => held.contains(run),
            };
            if !ok {
                wrong.push(format!("{run} ({name}): {:?} {:?}", r.status, r.outcome));
            }
        }
        ensure!(
            wrong.is_empty(),
            "runs that were lost or failed:\n{}",
            wrong.join("\n")
        );
        let approvals: flotilla_model::approval::ApprovalList = client
            .request(
                &ApprovalListRequest {
                    protocol: PROTOCOL_VERSION,
                    run_id: None,
                    all: true,
                    limit: None,
                },
                ASK,
            )
            .await?;
        ensure!(!approvals.truncated, "more approvals than one list holds");
        // Every answer is its own entry on the run log (0.3; 0.2 appended only the answer that
        // won in the bucket), and the deadline's default one more: the machine took the first
        // answer, or the default.
        let mut decisions: BTreeMap<(RunId, String), Vec<ApprovalDecided>> = BTreeMap::new();
        let runs: BTreeSet<RunId> = approvals
            .approvals
            .iter()
            .map(|a| a.request.run_id)
            .collect();
        for run in &runs {
            for (_, _, entry) in store.history(*run).await? {
                if let RunInput::ApprovalDecided(d) = entry.input {
                    decisions
                        .entry((*run, d.approval_id.clone()))
                        .or_default()
                        .push(*d);
                }
            }
        }
        for a in &approvals.approvals {
            let key = (a.request.run_id, a.request.approval_id.clone());
            let on_log = decisions.get(&key).map(Vec::as_slice).unwrap_or_default();
            let n = on_log.len();
            let expired = on_log
                .iter()
                .filter(|d| d.status == ApprovalStatus::Expired)
                .count();
            let first_answer = on_log.iter().find(|d| d.status == ApprovalStatus::Decided);
            match a.status {
                ApprovalStatus::Pending => ensure!(
                    held.contains(&a.request.run_id) && n == 0,
                    "approval {key:?} is pending ({n} decisions on its log)"
                ),
                // Withdrawn: the run ended first; nothing on its log decided it.
                ApprovalStatus::Withdrawn => ensure!(
                    n <= 1,
                    "approval {key:?} was withdrawn with {n} decisions on its run log"
                ),
                // Expired: the default is on the log once.
                ApprovalStatus::Expired => ensure!(
                    expired == 1,
                    "approval {key:?} expired with {expired} defaults on its run log"
                ),
                // Decided: the first answer on the log is the one recorded.
                _ => {
                    let answer = a.answer.as_ref();
                    ensure!(
                        first_answer
                            .is_some_and(|d| Some(&d.decision) == answer.map(|x| &x.decision)
                                && Some(&d.by) == answer.map(|x| &x.by))
                            && expired == 0,
                        "approval {key:?} reads {:?} but its run log holds {on_log:?}",
                        a.answer
                    );
                }
            }
        }
        say(&format!(
            "✓ nothing lost or failed: {} runs of the deployment, {} this test submitted, each in the state it should be; {} approvals, each answered or expired one decided exactly once",
            ids.len(),
            self.ledger.len(),
            approvals.approvals.len()
        ));
        Ok(())
    }

    /// A request of a newer protocol, and one with a field this side does not know, are
    /// refused by name by the services of `version` (coordinator and supervisor), not misread.
    pub(crate) async fn refuses_what_it_does_not_speak(
        &self,
        version: Version,
    ) -> anyhow::Result<()> {
        let client = &self.p.client;
        let newer = client
            .call(
                &ApprovalListRequest {
                    protocol: PROTOCOL_VERSION + 1,
                    run_id: None,
                    all: false,
                    limit: None,
                },
                ASK,
            )
            .await?;
        ensure!(
            matches!(&newer, Err(e) if e.code == "unsupported_protocol"),
            "the {} coordinator answered a protocol {} request: {newer:?}",
            version.name(),
            PROTOCOL_VERSION + 1
        );
        let newer = client
            .call(
                &flotilla_model::team::TeamListRequest {
                    protocol: PROTOCOL_VERSION + 1,
                    role: None,
                },
                ASK,
            )
            .await?;
        ensure!(
            matches!(&newer, Err(e) if e.code == "unsupported_protocol"),
            "the {} supervisor answered a protocol {} request: {newer:?}",
            version.name(),
            PROTOCOL_VERSION + 1
        );
        // A field a later version might add, set: named in the refusal.
        let subject = self.p.bus.names().api("approval.list");
        let body = json!({"protocol": PROTOCOL_VERSION, "all": true, "priority": "high"});
        let reply = self
            .p
            .bus
            .client()
            .request(subject, serde_json::to_vec(&body)?.into())
            .await?;
        let code = reply
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Service-Error-Code"))
            .map(|c| c.as_str().to_owned());
        let text = String::from_utf8_lossy(&reply.payload);
        ensure!(
            code.as_deref() == Some("400")
                && text.contains("malformed")
                && text.contains("priority"),
            "the {} coordinator did not refuse an unknown request field by name: {code:?} {text}",
            version.name()
        );
        say(&format!(
            "✓ {} services refuse a protocol {} request (unsupported_protocol) and an unknown request field (malformed, naming it)",
            version.name(),
            PROTOCOL_VERSION + 1
        ));
        Ok(())
    }
}

/// A line of the summary `scripts/upgrade-check` prints.
pub(crate) fn say(line: &str) {
    eprintln!("[upgrade] {line}");
}

pub(crate) async fn console_get(addr: &str, path: &str) -> anyhow::Result<String> {
    let auth = format!("Bearer {TOKEN}");
    let (status, body) = flotilla_testkit::http::request(
        addr,
        "GET",
        path,
        &[("Authorization", auth.as_str())],
        None,
    )
    .await?;
    ensure!(status == 200, "console {path}: {status} {body}");
    Ok(body)
}

/// A console's answers about the history: its inbox, each run, and which of the history's
/// runs its runs list misses.
pub(crate) async fn console_reads(
    addr: &str,
    history: &LivedIn,
) -> anyhow::Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    let inbox = console_get(addr, "/api/inbox").await?;
    out.push(("/api/inbox".to_owned(), normalise_console(&inbox)));
    for run in history.runs.values() {
        let path = format!("/api/runs/{run}");
        let body = console_get(addr, &path).await?;
        out.push((path, normalise_console(&body)));
    }
    let list = console_get(addr, "/api/runs?limit=1000").await?;
    let missing: Vec<String> = history
        .runs
        .values()
        .chain(&history.bulk)
        .map(ToString::to_string)
        .filter(|r| !list.contains(r.as_str()))
        .collect();
    out.push(("/api/runs (missing)".into(), missing.join(",")));
    Ok(out)
}
