//! The supervisor service across processes against a real nats-server: the roster with
//! presence (idle, working, stale, offline after a worker kill), failure records counted
//! exactly once across a supervisor crash and two replicas, and the team API's refusals.
//! Agents are deterministic: `scripted` (with scripted failures) and `exec` (a silent sleep).

mod support;

use std::time::Duration;

use anyhow::Context as _;
use flotilla_model::plan::{PlanConfig, Subtask};
use flotilla_model::run::RunStatus;
use flotilla_model::submit::SubmitRequest;
use flotilla_model::team::{
    MemberStatus, MemberView, RecordScope, TeamGetRequest, TeamList, TeamListRequest, TeamStats,
    TeamStatsRequest,
};
use support::*;

const TEAM: &str = r#"
default-agent = "good"

[agents.good]
kind = "scripted"
reply = "{task_id}: done"
roles = ["analyst", "writer"]
description = "answers every task"
capabilities = ["summaries"]

[agents.bad]
kind = "scripted"
reply = "never"
fail-first = 1000
failure = "scripted failure"
roles = ["analyst"]

[agents.slow]
kind = "exec"
command = "sleep"
args = ["4"]

[supervisor]
stale-after = "1500ms"
progress-resolution = "200ms"
presence-interval = "200ms"
ack-wait = "2s"
"#;

const ASK: Duration = Duration::from_secs(10);

fn list_request(role: Option<&str>) -> TeamListRequest {
    TeamListRequest {
        protocol: 1,
        role: role.map(str::to_owned),
    }
}

fn stats_request(name: Option<&str>) -> TeamStatsRequest {
    TeamStatsRequest {
        protocol: 1,
        name: name.map(str::to_owned),
        scope: None,
    }
}

async fn member(p: &Processes, name: &str) -> anyhow::Result<MemberView> {
    Ok(p.client
        .request(
            &TeamGetRequest {
                protocol: 1,
                name: name.into(),
            },
            ASK,
        )
        .await?)
}

/// Waits until `name` has `status` (checked every 50 ms for `within`).
async fn until_status(
    p: &Processes,
    name: &str,
    status: MemberStatus,
    within: Duration,
) -> anyhow::Result<MemberView> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let m = member(p, name).await?;
        if m.status == status {
            return Ok(m);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{name} is {:?}, not {status:?}, after {within:?}: {m:?}",
            m.status
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn stats_of(stats: &TeamStats, scope: RecordScope, name: &str) -> Option<(u64, u64, u64)> {
    stats
        .records
        .iter()
        .find(|r| r.scope == scope && r.name == name)
        .map(|r| (r.total_succeeded, r.total_failed, r.consecutive_failures))
}

#[tokio::test]
async fn roster_presence_and_failure_records() -> anyhow::Result<()> {
    let mut p = Processes::start(TEAM).await?;
    p.coordinator().await?;
    p.supervisor().await?;
    // No worker yet: every configured member is on the roster, offline, with its card.
    let list: TeamList = p.client.request(&list_request(None), ASK).await?;
    let names: Vec<&str> = list.members.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["bad", "good", "slow"]);
    assert!(
        list.members
            .iter()
            .all(|m| m.status == MemberStatus::Offline)
    );
    assert_eq!(list.roles, ["analyst", "writer"]);
    let good = &list.members[1];
    assert_eq!(good.card.description.as_deref(), Some("answers every task"));
    assert_eq!(good.card.capabilities, ["summaries"]);

    let w = p.worker(&[]).await?;
    let good = until_status(&p, "good", MemberStatus::Idle, Duration::from_secs(5)).await?;
    assert_eq!(good.pools, ["default"]);
    assert!(good.last_heartbeat.is_some());

    // One task each of `good` (role analyst) and `bad` (retried once, then failed).
    let mut plan = plan(vec![
        Subtask::new("ok", "works").with_agent("good"),
        Subtask::new("ko", "fails").with_agent("bad"),
    ]);
    plan.subtasks[0].role = Some("analyst".into());
    plan.subtasks[1].role = Some("analyst".into());
    plan.config = PlanConfig {
        max_retries: 1,
        failure_ratio: 1.0,
        ..PlanConfig::default()
    };
    let run = p.client.submit(SubmitRequest::new(plan)).await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed, "{outcome:?}");

    // The records follow within moments: bad failed both attempts, good succeeded once, the
    // role counts both agents.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let stats = loop {
        let s: TeamStats = p.client.request(&stats_request(None), ASK).await?;
        // The role's consecutive count depends on how the two agents' attempts interleave.
        if stats_of(&s, RecordScope::Agent, "bad") == Some((0, 2, 2))
            && stats_of(&s, RecordScope::Role, "analyst").map(|(ok, ko, _)| (ok, ko))
                == Some((1, 2))
        {
            break s;
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "records: {s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        stats_of(&stats, RecordScope::Agent, "good"),
        Some((1, 0, 0))
    );
    let bad = stats
        .records
        .iter()
        .find(|r| r.name == "bad")
        .expect("bad's record");
    let incident = bad.last_incident.as_ref().expect("last incident");
    assert_eq!((incident.run_id, incident.attempt), (run, 2));
    assert!(
        incident.message.contains("scripted failure"),
        "{incident:?}"
    );
    assert_eq!(bad.last_hour.failed, 2);
    let good = member(&p, "good").await?;
    assert_eq!((good.counters.succeeded, good.counters.failed), (1, 0));
    assert_eq!(good.status, MemberStatus::Idle);

    // The CLI shows the same, as an operator reads it.
    let out = p.cli(&["team", "stats", "bad", "--json"])?;
    assert!(out.status.success(), "{out:?}");
    let cli: TeamStats = serde_json::from_slice(&out.stdout)?;
    assert_eq!(stats_of(&cli, RecordScope::Agent, "bad"), Some((0, 2, 2)));
    let out = p.cli(&["team", "--role", "writer"])?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("good") && !text.contains("bad"),
        "{text}"
    );

    // A long silent attempt: working, then stale once it emitted nothing for stale-after.
    let slow_run = p
        .client
        .submit(SubmitRequest::new(plan_of_one("slow")))
        .await?;
    let working = until_status(&p, "slow", MemberStatus::Working, Duration::from_secs(5)).await?;
    assert_eq!(working.tasks.len(), 1);
    assert_eq!(working.tasks[0].run_id, slow_run);
    until_status(&p, "slow", MemberStatus::Stale, Duration::from_secs(5)).await?;
    assert_eq!(
        p.client.wait(slow_run, WAIT).await?.status,
        RunStatus::Succeeded
    );
    until_status(&p, "slow", MemberStatus::Idle, Duration::from_secs(5)).await?;

    // A killed worker: its members go offline within two heartbeats (300 ms each here) and
    // a presence pass.
    p.kill(w);
    let killed = tokio::time::Instant::now();
    until_status(&p, "good", MemberStatus::Offline, Duration::from_secs(5)).await?;
    assert!(
        killed.elapsed() < Duration::from_secs(3),
        "{:?}",
        killed.elapsed()
    );
    Ok(())
}

fn plan_of_one(agent: &str) -> flotilla_model::plan::Plan {
    plan(vec![Subtask::new("only", "one task").with_agent(agent)])
}

#[tokio::test]
async fn outcomes_count_once_across_a_supervisor_crash_and_two_replicas() -> anyhow::Result<()> {
    let mut p = Processes::start(TEAM).await?;
    p.coordinator().await.context("the coordinator")?;
    let first = p.supervisor().await.context("the first supervisor")?;
    p.supervisor().await.context("the second supervisor")?;
    p.worker(&["--concurrency", "8"])
        .await
        .context("the worker")?;
    // 4 runs × 15 tasks of `good`, with one supervisor frozen, then killed, while they run.
    let mut runs = Vec::new();
    for _ in 0..4 {
        let tasks = (0..15)
            .map(|i| Subtask::new(&format!("t{i}"), "count me").with_agent("good"))
            .collect();
        runs.push(
            p.client
                .submit(SubmitRequest::new(plan(tasks)))
                .await
                .context("submitting")?,
        );
    }
    // Frozen mid-stream with messages delivered and not acknowledged (some written, some
    // not), then killed: another replica gets them after the ack wait.
    tokio::time::sleep(Duration::from_millis(100)).await;
    if let Some(pid) = p.pid(first) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGSTOP,
        )?;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    p.kill(first);
    for run in &runs {
        let view = p
            .client
            .wait(*run, WAIT)
            .await
            .context("waiting for a run")?;
        assert_eq!(view.status, RunStatus::Succeeded, "{view:?}");
    }
    // A new replica joins later; nothing is counted twice. The deadline is generous: the
    // redeliveries wait for the ack wait (2 s here), and CI machines are slow; what this
    // checks is that nothing is counted twice or lost.
    p.supervisor().await.context("the third supervisor")?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let s: TeamStats = p
            .client
            .request(&stats_request(Some("good")), ASK)
            .await
            .context("team.stats")?;
        let counted = stats_of(&s, RecordScope::Agent, "good");
        if counted == Some((60, 0, 0)) {
            break;
        }
        anyhow::ensure!(
            counted.is_none_or(|(ok, _, _)| ok < 60),
            "counted more than once: {counted:?}"
        );
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "records: {s:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Stays exact once the stream is drained (a late redelivery changes nothing).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let s: TeamStats = p.client.request(&stats_request(Some("good")), ASK).await?;
    assert_eq!(stats_of(&s, RecordScope::Agent, "good"), Some((60, 0, 0)));
    let good = member(&p, "good").await?;
    // The roster's count too, as the replica answering reads it from its mirror (a late
    // note of a replica's own older write once put a stale count back there).
    assert_eq!(good.counters.succeeded, 60, "{good:?}");
    assert!(good.tasks.is_empty(), "{good:?}");
    // A person reads the attempts that ended, not an undercount of announced starts (an
    // attempt shorter than `started-event-delay` announces none).
    let out = p.cli(&["team", "show", "good"])?;
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.contains("attempts        60 ended: 60 succeeded, 0 failed; 0 running"),
        "{shown}"
    );
    Ok(())
}

#[tokio::test]
async fn team_api_refuses_bad_requests() -> anyhow::Result<()> {
    let mut p = Processes::start(TEAM).await?;
    // Without a supervisor the CLI says which service to start.
    let out = p.cli(&["team"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("flotilla supervisor"), "{err}");

    p.supervisor().await?;
    let out = p.cli(&["team", "show", "nobody"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("not_found") && err.contains("good"), "{err}");

    let out = p.cli(&["team", "find", "astronaut", "--json"])?;
    assert_eq!(out.status.code(), Some(1));
    let body: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(body["error"], "unknown_role");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("analyst, writer")),
        "{body}"
    );

    let out = p.cli(&["team", "stats", "nobody"])?;
    assert_eq!(out.status.code(), Some(1));

    // Raw requests as another language's client sends them.
    let subject = p.bus.names().api("team.list");
    for (body, code) in [
        (&b"{not json"[..], "malformed"),
        (&br#"{"protocol": 99}"#[..], "unsupported_protocol"),
        (&br#"{"protocol": 1, "rolez": "x"}"#[..], "malformed"),
    ] {
        let reply = p
            .bus
            .client()
            .request(subject.clone(), bytes::Bytes::copy_from_slice(body))
            .await?;
        let err: serde_json::Value = serde_json::from_slice(&reply.payload)?;
        assert_eq!(err["code"], code, "{err}");
        assert_eq!(err["status"], 400);
    }
    // Nothing was written by the refusals: the roster still holds the configured members.
    let list: TeamList = p.client.request(&list_request(None), ASK).await?;
    assert_eq!(list.members.len(), 3);
    Ok(())
}

/// "Role" means one thing in every team command: what a plan task's `role` names. A member
/// whose card declares no role but ran a task of role `editor` serves it: `team` lists the
/// role and shows it on the member's row, `team find editor` finds the member (not
/// `unknown_role`), `team --role editor` lists it, `team stats editor` says who served it,
/// and `memory show` names the same role of the plan.
#[tokio::test]
async fn a_role_is_a_plan_tasks_role_in_every_team_command() -> anyhow::Result<()> {
    let mut p = Processes::start(
        r#"
default-agent = "scribe"

[agents.scribe]
kind = "scripted"
reply = "{task_id}: done"

[agents.idle]
kind = "scripted"
reply = "unused"
roles = ["reviewer"]
"#,
    )
    .await?;
    p.coordinator().await?;
    p.supervisor().await?;
    p.worker(&[]).await?;
    until_status(&p, "scribe", MemberStatus::Idle, Duration::from_secs(5)).await?;
    let mut plan = plan_of_one("scribe");
    plan.subtasks[0].role = Some("editor".into());
    let run = p.client.submit(SubmitRequest::new(plan)).await?;
    assert_eq!(p.client.wait(run, WAIT).await?.status, RunStatus::Succeeded);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while stats_of(
        &p.client.request(&stats_request(None), ASK).await?,
        RecordScope::Role,
        "editor",
    )
    .is_none()
    {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "no record of editor"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // `team`: the role the task played and the role a card declares.
    let out = p.cli(&["team", "--json"])?;
    assert!(out.status.success(), "{out:?}");
    let list: TeamList = serde_json::from_slice(&out.stdout)?;
    assert_eq!(list.roles, ["editor", "reviewer"]);
    let scribe = list
        .members
        .iter()
        .find(|m| m.name == "scribe")
        .context("scribe listed")?;
    assert_eq!(
        (scribe.card.roles.len(), scribe.served.as_slice()),
        (0, &["editor".to_owned()][..])
    );
    let text = String::from_utf8_lossy(&p.cli(&["team"])?.stdout).into_owned();
    assert!(text.contains("roles: editor, reviewer"), "{text}");
    let row = text
        .lines()
        .find(|l| l.starts_with("scribe "))
        .with_context(|| format!("no scribe row: {text}"))?;
    assert!(row.contains(" editor "), "{text}");
    let out = p.cli(&["team", "--role", "editor"])?;
    let text = String::from_utf8_lossy(&out.stdout);
    let members: Vec<&str> = text
        .lines()
        .skip(1)
        .take_while(|l| !l.is_empty() && !l.starts_with("roles:"))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(members, ["scribe"], "{text}");

    // `team find editor`: the member that served it, not unknown_role.
    let out = p.cli(&["team", "find", "editor", "--json"])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let found: TeamList = serde_json::from_slice(&out.stdout)?;
    let names: Vec<&str> = found.members.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["scribe"]);
    // A declared role is found as before; one the team never met is still unknown_role.
    let found: TeamList =
        serde_json::from_slice(&p.cli(&["team", "find", "reviewer", "--json"])?.stdout)?;
    assert_eq!(found.members.len(), 1, "{found:?}");
    assert_eq!(found.members[0].name, "idle");
    let out = p.cli(&["team", "find", "astronaut", "--json"])?;
    assert_eq!(out.status.code(), Some(1));
    let body: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(body["error"], "unknown_role", "{body}");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("roles: editor, reviewer")),
        "{body}"
    );

    // `team stats editor` and `memory show`: the same role, and who served it.
    let text = String::from_utf8_lossy(&p.cli(&["team", "stats", "editor"])?.stdout).into_owned();
    assert!(text.contains("role editor served by: scribe"), "{text}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let shown = loop {
        let out = p.cli(&["memory", "show", &run.to_string()])?;
        if out.status.success() {
            break String::from_utf8_lossy(&out.stdout).into_owned();
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "{out:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(shown.contains("roles: editor"), "{shown}");
    Ok(())
}
