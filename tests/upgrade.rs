//! Rolling upgrades: an older release's `flotilla` processes and this build's side by side on
//! one deployment, as a Helm rolling update runs them.
//!
//! A deployment of one coordinator, worker, supervisor and console of one version is given a
//! history ([`flotilla_testkit::lived_in`]: runs of every ending, approvals pending and
//! decided, a grant, trust, memory, teammates, failure records, a recruit, paused and
//! taken-over runs, workspace, mailbox and session state), then rolled to the other version
//! one kind of service at a time, as Kubernetes rolls a Deployment: a process of the new
//! version is started beside the old one (a surge: both serve at once), then the old one is
//! stopped with SIGTERM while work is in flight. At every step:
//!
//! - every read about the history answers as before (the lived-in reads, and the console's);
//! - new runs of every kind end as they should ([`LivedIn::exercise`], which speaks this
//!   build's wire types: a new client);
//! - the old `flotilla` CLI does an operator's work against the mix — submit and wait, runs
//!   show and tree, approvals approve and reject (a second answer is refused), pause and
//!   resume, team spawn and send, ws, mbox and state — and, while old services run, this
//!   build's CLI does the same;
//! - at a stop, the work in flight carries over: a running chain ends, an approval whose
//!   deadline passes expires at that deadline, a pending one is answered afterwards.
//!
//! At the end nothing is lost or failed: every run of the deployment is in the state it
//! should be (only the runs meant to fail failed, only the held ones are not over) and every
//! settled approval was decided exactly once on its run log. A last test checks that a real
//! difference between the versions — a configuration key the older release does not know — is
//! refused by name, and that a request of a protocol the older release does not speak is too.
//!
//! The older binary is `$FLOTILLA_OLD_BIN` (`scripts/upgrade-check` builds it from the
//! previous release's commit, recorded in `CHANGELOG.md`). The tests are `#[ignore]`d, so
//! `./scripts/test` runs none of them; run without the variable, each says so and returns.
//!
//! The services are `flotilla` processes on a real nats-server; the agents are deterministic
//! (`scripted`, `exec`, workflow agents, and an LLM agent on the test kit's scripted
//! OpenAI-compatible server — a test double).

#[path = "upgrade/mixed.rs"]
mod mixed;
#[path = "upgrade/operator.rs"]
mod operator;
mod support;

use std::time::Duration;

use anyhow::ensure;
use flotilla_model::subjects::StreamKind;
use futures::StreamExt;
use mixed::{Kind, Mixed, Version, old_bin, say};
use support::Processes;

/// The order of a roll, by kind.
async fn roll(d: &mut Mixed, kinds: &[Kind], to: Version) -> anyhow::Result<()> {
    for kind in kinds {
        d.roll(*kind, to).await?;
    }
    d.audit().await
}

/// The recommended order (docs/deploy.md): coordinators first — a new coordinator beside
/// the old one, then new coordinators with old workers and supervisors —, then supervisors
/// (old and new together), workers, and the console.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs FLOTILLA_OLD_BIN: scripts/upgrade-check"]
async fn upgrade_coordinators_first() -> anyhow::Result<()> {
    let Some(old) = old_bin()? else {
        return Ok(());
    };
    say("upgrading, coordinators first:");
    let mut d = Mixed::start(old, Version::Old).await?;
    d.refuses_what_it_does_not_speak(Version::Old).await?;
    // `helm upgrade` provisions first (the chart's pre-upgrade Job), with the new build.
    let provisioned = d.cli_json(Version::New, &["nats", "provision", "--json"])?;
    let mut actions = std::collections::BTreeMap::<String, usize>::new();
    for r in provisioned
        .pointer("/resources")
        .and_then(serde_json::Value::as_array)
        .into_iter()
        .flatten()
    {
        let action = r.pointer("/action").and_then(serde_json::Value::as_str);
        *actions.entry(action.unwrap_or("?").to_owned()).or_default() += 1;
    }
    say(&format!(
        "new `nats provision` on the old deployment (the chart's pre-upgrade Job): {actions:?} resources"
    ));
    roll(
        &mut d,
        &[
            Kind::Coordinator,
            Kind::Supervisor,
            Kind::Worker,
            Kind::Console,
        ],
        Version::New,
    )
    .await
}

/// Workers first: old coordinators with new workers (Helm rolls every Deployment at once,
/// so any order happens).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs FLOTILLA_OLD_BIN: scripts/upgrade-check"]
async fn upgrade_workers_first() -> anyhow::Result<()> {
    let Some(old) = old_bin()? else {
        return Ok(());
    };
    say("upgrading, workers first:");
    let mut d = Mixed::start(old, Version::Old).await?;
    d.cli_ok(Version::New, &["nats", "provision"])?;
    roll(
        &mut d,
        &[
            Kind::Worker,
            Kind::Console,
            Kind::Supervisor,
            Kind::Coordinator,
        ],
        Version::New,
    )
    .await
}

/// Kinds of service an older release cannot be rolled back to on a deployment with history,
/// by its `flotilla --version`, and why: its own processes do not start on such a deployment,
/// whichever version wrote the history (a second 0.1.0 supervisor started beside a running one
/// on 0.1.0's own history never becomes ready either). Rolling back to it is not supported
/// (docs/deploy.md); the other kinds are rolled back and checked.
const CANNOT_START_ON_HISTORY: &[(&str, &[Kind], &str)] = &[(
    "flotilla 0.1.0",
    &[Kind::Supervisor, Kind::Coordinator],
    "on a deployment with history its supervisor never becomes ready, and its coordinator (trust enabled) never starts, until a new failure or trust record is written — and then they miss the earlier ones: 0.1.0's bucket mirrors watch from \"now\" (fixed in 0.2.0)",
)];

/// Rolling back: a deployment of this build with history rolled to the older release, in
/// the reverse order (the kinds the older release can start on history at all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs FLOTILLA_OLD_BIN: scripts/upgrade-check"]
async fn roll_back_to_the_old_release() -> anyhow::Result<()> {
    let Some(old) = old_bin()? else {
        return Ok(());
    };
    let version = version_of(&old)?;
    let (cannot, why) = CANNOT_START_ON_HISTORY
        .iter()
        .find(|(v, _, _)| *v == version)
        .map_or((&[][..], ""), |(_, kinds, why)| (*kinds, *why));
    say("rolling back, console first:");
    let mut d = Mixed::start(old, Version::New).await?;
    for kind in [
        Kind::Console,
        Kind::Worker,
        Kind::Supervisor,
        Kind::Coordinator,
    ] {
        if !cannot.contains(&kind) {
            d.roll(kind, Version::Old).await?;
        }
    }
    if !cannot.is_empty() {
        let kinds: Vec<&str> = cannot.iter().map(|k| k.command()).collect();
        say(&format!(
            "✗ not rolled back: {} — {version} cannot be rolled back to: {why}",
            kinds.join(", ")
        ));
    }
    d.audit().await?;
    if cannot.is_empty() {
        d.refuses_what_it_does_not_speak(Version::Old).await?;
    }
    Ok(())
}

/// Settings of this build that an older release does not know, by the release's
/// `flotilla --version`: the key and a configuration that sets it. Every process of that
/// release refuses such a file by name (its configuration denies unknown keys).
const NEW_SETTINGS: &[(&str, &str, &str)] = &[(
    "flotilla 0.1.0",
    "backfill",
    "[[supervisor.webhooks]]\nname = \"ops\"\nurl = \"http://127.0.0.1:9/flotilla\"\nbackfill = \"10m\"\n",
)];

/// A setting this build documents and the older release does not know (for 0.1.0:
/// `[[supervisor.webhooks]] backfill`): every old process — services and CLI — refuses the
/// file naming the key, before it connects or changes anything; the new ones run on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs FLOTILLA_OLD_BIN: scripts/upgrade-check"]
async fn a_setting_the_old_release_does_not_know_is_refused_by_name() -> anyhow::Result<()> {
    let Some(old) = old_bin()? else {
        return Ok(());
    };
    let version = version_of(&old)?;
    let Some((_, key, setting)) = NEW_SETTINGS.iter().find(|(v, _, _)| *v == version) else {
        say(&format!(
            "no setting of this build is listed as new to {version} (NEW_SETTINGS): nothing to refuse"
        ));
        return Ok(());
    };
    say(&format!("a setting new to {version}:"));
    let mut p = Processes::unprovisioned(&format!(
        "default-agent = \"echo\"\n[agents.echo]\nkind = \"scripted\"\nreply = \"done\"\n\n{setting}"
    ))
    .await?;
    for command in ["coordinator", "supervisor", "worker", "console"] {
        let i = p.spawn_bin(&old, &[command], &[])?;
        let code = p.wait_exit(i, Duration::from_secs(30)).await?;
        let log = p.log(i);
        ensure!(
            code.is_some_and(|c| c != 0) && log.contains("unknown field") && log.contains(key),
            "the old {command} did not refuse `{key}` by name (exit {code:?}):\n{log}"
        );
    }
    let out = p.cli_of(&old, &["runs", "list"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success() && err.contains("unknown field") && err.contains(key),
        "the old CLI did not refuse `{key}` by name: {err}"
    );
    ensure!(
        p.bus.js().stream_names().next().await.is_none(),
        "an old process that refused its configuration created streams"
    );
    say(&format!(
        "✓ old processes refuse the new `{key}` setting by name, changing nothing: {}",
        err.lines()
            .find(|l| l.contains(key))
            .unwrap_or_default()
            .trim()
    ));
    // The new processes run on it: the webhook's consumer exists once the supervisor is up.
    p.coordinator().await?;
    p.supervisor().await?;
    let notify = p
        .bus
        .js()
        .get_stream(p.bus.names().stream(StreamKind::Notify))
        .await?;
    let consumer: Result<async_nats::jetstream::consumer::PullConsumer, _> =
        notify.get_consumer("webhook-ops").await;
    ensure!(
        consumer.is_ok(),
        "the new supervisor did not create the webhook's consumer on this configuration: {:?}",
        consumer.err()
    );
    say("✓ new processes run on the same configuration");
    Ok(())
}

/// `flotilla --version` of `bin`.
fn version_of(bin: &std::path::Path) -> anyhow::Result<String> {
    let out = std::process::Command::new(bin).arg("--version").output()?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}
