//! Persistent teammates across processes against a real nats-server: spawn → message → turn →
//! idle, woken again with its conversation; a worker killed mid-turn (the turn completes on
//! another worker, the stale host's writes refused); shutdown after the current turn;
//! broadcast; every cap and bad input refused, structured, changing nothing; 1,000 idle
//! teammates without a consumer each; a worker kept busy by short pool tasks (after a
//! paused-then-cancelled attempt and a neighbour killed mid-attempt) still taking a turn; a
//! turn whose conversation cannot be read given up after its deliveries, the reason shown;
//! mail taken straight from the inbox by a worker of the teammate's pool, dispatched to the
//! turn queue for another pool's teammate, woken at once by the supervisor while no worker
//! reads the inboxes, and woken after the grace when the only reader was killed; mail to ten
//! teammates at once, a worker killed mid-way, each message read exactly once.
//!
//! The agent is a deterministic exec script (`python3`): it answers `turn N history H` (its
//! turn number and how many conversation lines it was given, which proves the conversation
//! was loaded), logs `start <name> <pid>` to a file, and sleeps when a message says `slow`.

mod support;

use std::time::Duration;

use flotilla_model::subjects::{Bucket, StreamKind};
use flotilla_model::teammate::{
    TeamMates, TeamMatesRequest, TeamSendRequest, TeamSpawnRequest, TeammateStatus, TeammateView,
};
use flotilla_model::worker::WorkerInfo;
use support::*;

const ASK: Duration = Duration::from_secs(10);

fn config(log: &std::path::Path, supervisor: &str) -> String {
    format!(
        r#"
default-agent = "mate"

[agents.mate]
kind = "exec"
command = "python3"
args = ["-c", "import json,sys,os,time\ne=json.load(sys.stdin)\ni=e['input']\nopen('{log}','a').write('start %s %d\\n' % (i['teammate']['name'], os.getppid()))\nif any('slow' in m['text'] for m in i['messages']): time.sleep(3)\nprint('turn %d history %d' % (i['turn'], len(i['conversation'])))"]
roles = ["analyst"]

[supervisor]
ack-wait = "2s"
{supervisor}
"#,
        log = log.display()
    )
}

/// Starts `flotilla supervisor` and waits until the team API answers.
async fn supervisor(p: &mut Processes) -> anyhow::Result<usize> {
    let i = p.spawn(&["supervisor"])?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if p.client.request(&mates(None), ASK).await.is_ok() {
            return Ok(i);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the supervisor never answered:\n{}",
            p.log(i)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn mates(team: Option<&str>) -> TeamMatesRequest {
    TeamMatesRequest {
        protocol: 1,
        team: team.map(str::to_owned),
    }
}

async fn mate(p: &Processes, team: &str, name: &str) -> anyhow::Result<TeammateView> {
    let list: TeamMates = p.client.request(&mates(Some(team)), ASK).await?;
    list.teammates
        .into_iter()
        .find(|m| m.name == name)
        .ok_or_else(|| anyhow::anyhow!("no teammate {name}"))
}

/// Waits until `pred` holds for the teammate.
async fn until(
    p: &Processes,
    team: &str,
    name: &str,
    within: Duration,
    pred: impl Fn(&TeammateView) -> bool,
) -> anyhow::Result<TeammateView> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let m = mate(p, team, name).await?;
        if pred(&m) {
            return Ok(m);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "teammate {name} never got there: {m:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn cli_json(p: &Processes, args: &[&str]) -> anyhow::Result<(i32, serde_json::Value)> {
    let mut all = args.to_vec();
    all.push("--json");
    let out = p.cli(&all)?;
    let body = serde_json::from_slice(&out.stdout).map_err(|e| {
        anyhow::anyhow!(
            "{e}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    Ok((out.status.code().unwrap_or(-1), body))
}

fn send(team: &str, to: &str, text: &str) -> TeamSendRequest {
    TeamSendRequest {
        protocol: 1,
        team: Some(team.into()),
        to: to.into(),
        from: None,
        text: text.into(),
    }
}

/// Spawns teammate `name` of `team` running the `mate` agent (in `pool`, else its agent's).
async fn spawn_mate(
    p: &Processes,
    team: &str,
    name: &str,
    pool: Option<&str>,
) -> anyhow::Result<()> {
    p.client
        .request(
            &TeamSpawnRequest {
                protocol: 1,
                team: Some(team.into()),
                name: name.into(),
                role: "analyst".into(),
                instructions: "work".into(),
                agent: Some("mate".into()),
                pool: pool.map(str::to_owned),
                by: None,
                expose: false,
            },
            ASK,
        )
        .await?;
    Ok(())
}

#[tokio::test]
async fn a_teammate_wakes_remembers_broadcasts_and_shuts_down() -> anyhow::Result<()> {
    let log = tempfile::NamedTempFile::new()?;
    let mut p = Processes::start(&config(log.path(), "")).await?;
    supervisor(&mut p).await?;
    p.worker(&[]).await?;

    let (code, body) = cli_json(
        &p,
        &[
            "team",
            "spawn",
            "ann",
            "--role",
            "analyst",
            "--instructions",
            "answer briefly",
            "--team",
            "t1",
        ],
    )?;
    assert_eq!(code, 0, "{body}");
    assert_eq!(body["status"], "spawned");
    assert_eq!(body["agent"], "mate", "the member filling the role");

    // A message wakes it; the turn runs and it goes back to idle.
    let (code, body) = cli_json(&p, &["team", "send", "ann", "hello", "--team", "t1"])?;
    assert_eq!(code, 0, "{body}");
    let m = until(&p, "t1", "ann", Duration::from_secs(20), |m| {
        m.status == TeammateStatus::Idle && m.turns == 1
    })
    .await?;
    assert_eq!(m.last_reply.as_deref(), Some("turn 1 history 0"));
    assert_eq!(m.host, None, "an idle teammate holds no worker");
    let statuses: Vec<&str> = m.transitions.iter().map(|t| t.status.as_str()).collect();
    assert_eq!(statuses, ["spawned", "working", "working", "idle"], "{m:?}");

    // The second message finds its conversation: the first message and its reply.
    p.client.request(&send("t1", "ann", "again"), ASK).await?;
    let m = until(&p, "t1", "ann", Duration::from_secs(20), |m| m.turns == 2).await?;
    assert_eq!(m.last_reply.as_deref(), Some("turn 2 history 2"));

    // It is listed in the roster with its status, role, team and turns.
    let out = p.cli(&["team"])?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("ann") && text.contains("t1") && text.contains("analyst"),
        "{text}"
    );

    // Broadcast reaches every teammate of the team, not another team's.
    p.client
        .request(
            &TeamSpawnRequest {
                protocol: 1,
                team: Some("t1".into()),
                name: "bob".into(),
                role: "analyst".into(),
                instructions: "check".into(),
                agent: None,
                pool: None,
                by: None,
                expose: false,
            },
            ASK,
        )
        .await?;
    p.client
        .request(
            &TeamSpawnRequest {
                protocol: 1,
                team: Some("t2".into()),
                name: "cid".into(),
                role: "analyst".into(),
                instructions: "elsewhere".into(),
                agent: None,
                pool: None,
                by: None,
                expose: false,
            },
            ASK,
        )
        .await?;
    let (code, body) = cli_json(&p, &["team", "broadcast", "all hands", "--team", "t1"])?;
    assert_eq!(code, 0, "{body}");
    assert_eq!(body["delivered"], serde_json::json!(["ann", "bob"]));
    until(&p, "t1", "ann", Duration::from_secs(20), |m| m.turns == 3).await?;
    until(&p, "t1", "bob", Duration::from_secs(20), |m| m.turns == 1).await?;
    assert_eq!(mate(&p, "t2", "cid").await?.turns, 0);

    // Shutdown during a turn: it ends after the turn, then refuses mail.
    p.client
        .request(&send("t1", "ann", "slow one"), ASK)
        .await?;
    until(&p, "t1", "ann", Duration::from_secs(10), |m| {
        m.host.is_some()
    })
    .await?;
    let (code, body) = cli_json(&p, &["team", "shutdown", "ann", "--team", "t1"])?;
    assert_eq!(code, 0, "{body}");
    assert_eq!(body["status"], "working");
    assert_eq!(body["shutdown_requested"], true);
    let m = until(&p, "t1", "ann", Duration::from_secs(20), |m| {
        m.status == TeammateStatus::Shutdown
    })
    .await?;
    assert_eq!(m.turns, 4, "the current turn finished first");
    let (code, body) = cli_json(&p, &["team", "send", "ann", "still there?", "--team", "t1"])?;
    assert_eq!(
        (code, body["error"].as_str()),
        (1, Some("shut_down")),
        "{body}"
    );
    Ok(())
}

#[tokio::test]
async fn a_worker_killed_mid_turn_hands_the_turn_to_another_and_is_fenced_out() -> anyhow::Result<()>
{
    let log = tempfile::NamedTempFile::new()?;
    let mut p = Processes::start(&config(log.path(), "")).await?;
    supervisor(&mut p).await?;
    let w1 = p.worker(&[]).await?;
    let w2 = p.worker(&[]).await?;
    spawn_mate(&p, "k", "dora", None).await?;
    p.client
        .request(&send("k", "dora", "slow work"), ASK)
        .await?;
    let first = until(&p, "k", "dora", Duration::from_secs(10), |m| {
        m.host.is_some()
    })
    .await?;
    // Kill its host once the agent runs there.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while std::fs::read_to_string(log.path())?.lines().count() < 1 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the turn never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let host = first.host.clone().unwrap_or_default();
    let workers = p.bus.kv(Bucket::Workers).await?;
    let info: WorkerInfo = serde_json::from_slice(
        &workers
            .get(&host)
            .await?
            .ok_or_else(|| anyhow::anyhow!("no worker {host}"))?,
    )?;
    let (victim, survivor) = if p.pid(w1) == Some(info.pid) {
        (w1, w2)
    } else {
        (w2, w1)
    };
    p.kill(victim);

    // The turn is redelivered and completes on the other worker, once.
    let m = until(&p, "k", "dora", Duration::from_secs(30), |m| {
        m.status == TeammateStatus::Idle
    })
    .await?;
    assert_eq!(m.turns, 1, "{m:?}");
    let hosts: Vec<String> = m
        .transitions
        .iter()
        .filter_map(|t| t.host.clone())
        .collect();
    assert_eq!(
        hosts.len(),
        2,
        "claimed by the killed worker, then another: {m:?}"
    );
    assert_ne!(hosts[0], hosts[1]);
    let starts = std::fs::read_to_string(log.path())?;
    assert_eq!(starts.lines().count(), 2, "{starts}");
    let _ = survivor;
    // The turn was taken straight from the inbox, and taken over when its message came again.
    let (inbox, queue) = deliveries(&p, "default").await?;
    assert_eq!((inbox, queue), (2, 0), "inbox and turn-queue deliveries");

    // The stale host's writes are refused: the conversation and the status, directly.
    let team_kv = p.bus.kv(Bucket::Team).await?;
    let stale_epoch = first.epoch;
    let saved = flotilla_worker::turn::save_conversation(
        &team_kv,
        "k",
        "dora",
        stale_epoch,
        None,
        flotilla_model::teammate::Conversation::default(),
    )
    .await;
    assert!(
        matches!(saved, Err(flotilla_worker::turn::TurnError::Fenced(_))),
        "{saved:?}"
    );
    let finished =
        flotilla_worker::turn::finish(&team_kv, "k", "dora", stale_epoch, Some((true, "late")))
            .await;
    assert!(
        matches!(finished, Err(flotilla_worker::turn::TurnError::Fenced(_))),
        "{finished:?}"
    );
    let after = mate(&p, "k", "dora").await?;
    assert_eq!(
        (after.turns, after.epoch),
        (m.turns, m.epoch),
        "nothing changed"
    );
    // Its conversation holds one exchange.
    let conv: flotilla_model::teammate::Conversation = serde_json::from_slice(
        &team_kv
            .get("conv.k.dora")
            .await?
            .ok_or_else(|| anyhow::anyhow!("no conversation"))?,
    )?;
    assert_eq!(conv.lines.len(), 2, "{conv:?}");
    assert_eq!(conv.turns, 1);
    Ok(())
}

#[tokio::test]
async fn caps_and_bad_input_are_refused_and_change_nothing() -> anyhow::Result<()> {
    let log = tempfile::NamedTempFile::new()?;
    let mut p = Processes::start(&config(
        log.path(),
        "team-size = 2\nturns-per-hour = 1\nmax-message-bytes = 100",
    ))
    .await?;
    supervisor(&mut p).await?;
    p.worker(&[]).await?;
    let spawn = |name: &str, agent: Option<&str>| TeamSpawnRequest {
        protocol: 1,
        team: Some("c".into()),
        name: name.into(),
        role: "analyst".into(),
        instructions: "x".into(),
        agent: agent.map(str::to_owned),
        pool: None,
        by: None,
        expose: false,
    };
    p.client.request(&spawn("a1", None), ASK).await?;
    p.client.request(&spawn("a2", None), ASK).await?;
    for (req, code) in [
        (spawn("a3", None), "team_full"),
        (spawn("a1", None), "duplicate_name"),
        (spawn("bad.name", None), "invalid_name"),
        (spawn("_hidden", None), "invalid_name"),
        (spawn("a4", Some("nobody")), "unknown_agent"),
    ] {
        let err = p.client.call(&req, ASK).await?.expect_err("refused");
        assert_eq!(err.code, code, "{err:?}");
    }
    let (code, body) = cli_json(
        &p,
        &[
            "team",
            "spawn",
            "a5",
            "--role",
            "analyst",
            "--instructions",
            "x",
            "--team",
            "c",
        ],
    )?;
    assert_eq!((code, body["error"].as_str()), (1, Some("team_full")));
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("team-size")),
        "{body}"
    );

    // Messages: too large, to nobody, then over the hourly turn cap.
    let big = "x".repeat(101);
    for (req, code) in [
        (send("c", "a1", &big), "message_too_large"),
        (send("c", "nobody", "hi"), "not_found"),
        (send("no.team", "a1", "hi"), "invalid_team"),
    ] {
        let err = p.client.call(&req, ASK).await?.expect_err("refused");
        assert_eq!(err.code, code, "{err:?}");
    }
    p.client.request(&send("c", "a1", "one"), ASK).await?;
    until(&p, "c", "a1", Duration::from_secs(20), |m| m.turns == 1).await?;
    let err = p
        .client
        .call(&send("c", "a1", "two"), ASK)
        .await?
        .expect_err("refused");
    assert_eq!(err.code, "turns_per_hour", "{err:?}");
    assert_eq!(err.status, 429);

    // Nothing changed: two teammates, a1 ran one turn, a2 none, and the refused messages
    // were never stored.
    let list: TeamMates = p.client.request(&mates(Some("c")), ASK).await?;
    let summary: Vec<(String, u64)> = list
        .teammates
        .iter()
        .map(|m| (m.name.clone(), m.turns))
        .collect();
    assert_eq!(summary, [("a1".to_owned(), 1), ("a2".to_owned(), 0)]);
    let stored = stored_in_inboxes(&p).await?;
    assert_eq!(stored, 1, "only the accepted message is in an inbox");
    Ok(())
}

/// Messages stored in the teammates' inboxes, all teams.
async fn stored_in_inboxes(p: &Processes) -> anyhow::Result<usize> {
    use futures::TryStreamExt;
    let stream = p
        .bus
        .js()
        .get_stream(p.bus.names().stream(StreamKind::Mailbox))
        .await?;
    let mut info = stream.info_with_subjects("flotilla.tmbox.>").await?;
    let mut stored = 0;
    while let Some((_, n)) = info.try_next().await? {
        stored += n;
    }
    Ok(stored)
}

/// Consumers on every stream of the installation.
async fn consumers(p: &Processes) -> anyhow::Result<usize> {
    let mut total = 0;
    for kind in StreamKind::ALL {
        let mut s = p.bus.js().get_stream(p.bus.names().stream(kind)).await?;
        total += s.info().await?.state.consumer_count;
    }
    Ok(total)
}

#[tokio::test]
async fn a_thousand_idle_teammates_have_no_consumer_each() -> anyhow::Result<()> {
    let log = tempfile::NamedTempFile::new()?;
    let mut p = Processes::start(&config(log.path(), "team-size = 2000")).await?;
    supervisor(&mut p).await?;
    p.worker(&[]).await?;
    let before = consumers(&p).await?;
    let mut spawns = futures::stream::FuturesUnordered::new();
    for i in 0..1000 {
        let client = p.client.clone();
        spawns.push(async move {
            client
                .request(
                    &TeamSpawnRequest {
                        protocol: 1,
                        team: Some("big".into()),
                        name: format!("m{i}"),
                        role: "analyst".into(),
                        instructions: "idle".into(),
                        agent: None,
                        pool: None,
                        by: None,
                        expose: false,
                    },
                    Duration::from_secs(30),
                )
                .await
        });
        if spawns.len() >= 50 {
            use futures::StreamExt;
            if let Some(r) = spawns.next().await {
                r?;
            }
        }
    }
    {
        use futures::StreamExt;
        while let Some(r) = spawns.next().await {
            r?;
        }
    }
    let list: TeamMates = p.client.request(&mates(Some("big")), ASK).await?;
    assert_eq!(list.teammates.len(), 1000);
    assert_eq!(consumers(&p).await?, before, "no consumer per teammate");
    // One of them still wakes on a message.
    p.client.request(&send("big", "m500", "wake"), ASK).await?;
    until(&p, "big", "m500", Duration::from_secs(20), |m| m.turns == 1).await?;
    assert_eq!(consumers(&p).await?, before);
    Ok(())
}

/// A worker kept busy by short pool tasks — prefetched tasks always waiting for its slot —
/// after it has run a paused-then-cancelled attempt and taken over the task of a neighbour
/// killed mid-attempt, still takes a teammate's turn (issue 38: a live worker left its turns
/// pending for minutes while it ran ordinary tasks; a fresh worker took them at once).
#[tokio::test]
async fn a_worker_busy_with_its_pool_still_takes_teammate_turns() -> anyhow::Result<()> {
    use flotilla_model::plan::Subtask;
    use flotilla_model::run::RunStatus;
    use flotilla_model::submit::SubmitRequest;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let log = tempfile::NamedTempFile::new()?;
    let agents = r#"
[agents.quick]
kind = "scripted"
reply = "ok"
delay = "15ms"

[agents.slow]
kind = "exec"
command = "sh"
args = ["-c", "sleep 2; echo done"]

[agents.stuck]
kind = "exec"
command = "sh"
args = ["-c", "sleep 60"]
"#;
    let mut p = Processes::start(&format!("{}{agents}", config(log.path(), ""))).await?;
    supervisor(&mut p).await?;
    p.coordinator().await?;
    let one =
        |agent: &str| SubmitRequest::new(plan(vec![Subtask::new("t", "x").with_agent(agent)]));

    // A neighbour killed mid-attempt: its task goes to the worker under test.
    let neighbour = p.worker(&["--concurrency", "1"]).await?;
    let handed = p.client.submit(one("slow")).await?;
    task_started(&p.client, handed, "t").await?;
    p.kill(neighbour);
    // One slot, and prefetch: tasks wait here for it, so a slot that frees goes to one of them.
    let w = p.spawn_env(
        &["worker", "--concurrency", "1"],
        &[("FLOTILLA_WORKER__PREFETCH", "4")],
    )?;
    p.wait_registered(w).await?;
    let outcome = p.client.wait(handed, WAIT).await?;
    assert_eq!(
        outcome.status,
        RunStatus::Succeeded,
        "{outcome:?}\n{}",
        p.log(w)
    );

    // A paused, then cancelled attempt on it.
    let held = p.client.submit(one("stuck")).await?;
    task_started(&p.client, held, "t").await?;
    for args in [
        ["pause", "--reason", "look"],
        ["cancel", "--reason", "enough"],
    ] {
        let out = p.cli(&["runs", args[0], &held.to_string(), args[1], args[2]])?;
        anyhow::ensure!(
            out.status.success(),
            "runs {}: {}",
            args[0],
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let outcome = p.client.wait(held, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Cancelled, "{outcome:?}");

    // Its pool kept busy until the turn is taken: a run of eight short tasks every 40 ms,
    // more than its one slot runs, so a task always waits for the slot.
    let stop = tokio_util::sync::CancellationToken::new();
    let finished = Arc::new(AtomicUsize::new(0));
    let feeder = {
        let (client, stop) = (p.client.clone(), stop.clone());
        let finished = Arc::clone(&finished);
        tokio::spawn(async move {
            let mut runs = tokio::task::JoinSet::new();
            let mut every = tokio::time::interval(Duration::from_millis(40));
            while !stop.is_cancelled() {
                every.tick().await;
                let mut load = plan(
                    (0..8)
                        .map(|i| Subtask::new(&format!("q{i}"), "x").with_agent("quick"))
                        .collect(),
                );
                load.config.max_concurrency = 8;
                let run = client.submit(SubmitRequest::new(load)).await?;
                let (client, finished) = (client.clone(), Arc::clone(&finished));
                runs.spawn(async move {
                    let outcome = client.wait(run, Duration::from_secs(600)).await?;
                    anyhow::ensure!(outcome.status == RunStatus::Succeeded, "{outcome:?}");
                    finished.fetch_add(1, Ordering::Relaxed);
                    anyhow::Ok(())
                });
                while let Some(done) = runs.try_join_next() {
                    done??;
                }
            }
            anyhow::Ok(())
        })
    };
    // The load flows before the teammate gets mail: a dozen of its runs finished, so the
    // worker's attempts are short again after the long ones above (it prefetches only
    // then), and its slot has been taken without a break for a while.
    let deadline = tokio::time::Instant::now() + WAIT;
    while finished.load(Ordering::Relaxed) < 12 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the load never ran:\n{}",
            p.log(w)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (code, body) = cli_json(
        &p,
        &[
            "team",
            "spawn",
            "ann",
            "--role",
            "analyst",
            "--instructions",
            "answer briefly",
            "--team",
            "busy",
        ],
    )?;
    assert_eq!(code, 0, "{body}");
    p.client.request(&send("busy", "ann", "hello"), ASK).await?;
    let turned = until(&p, "busy", "ann", Duration::from_secs(30), |m| m.turns == 1).await;
    stop.cancel();
    feeder.await??;
    let m = turned.map_err(|e| anyhow::anyhow!("{e}\n{}", p.log(w)))?;
    assert_eq!(m.last_reply.as_deref(), Some("turn 1 history 0"));
    Ok(())
}

/// A teammate whose conversation cannot be read: its turn is delivered again a bounded number
/// of times (`worker.max-deliveries`), then given up — the teammate is idle again with the
/// reason in the team API and `flotilla team show`, its mail unread, and the turn message
/// terminated, not retried (issue 38: an unreadable conversation key was retried every second
/// without bound). Once the key is readable again, the next message's turn runs and clears
/// the reason.
#[tokio::test]
async fn a_turn_whose_conversation_cannot_be_read_is_given_up_visibly() -> anyhow::Result<()> {
    let log = tempfile::NamedTempFile::new()?;
    let mut p = Processes::start(&config(log.path(), "")).await?;
    supervisor(&mut p).await?;
    let w = p.spawn_env(&["worker"], &[("FLOTILLA_WORKER__MAX_DELIVERIES", "3")])?;
    p.wait_registered(w).await?;
    let (code, body) = cli_json(
        &p,
        &[
            "team",
            "spawn",
            "eve",
            "--role",
            "analyst",
            "--instructions",
            "answer briefly",
            "--team",
            "u",
        ],
    )?;
    assert_eq!(code, 0, "{body}");
    // Its conversation holds what no Flotilla wrote.
    let team_kv = p.bus.kv(Bucket::Team).await?;
    team_kv.put("conv.u.eve", "not json".into()).await?;
    p.client.request(&send("u", "eve", "hello"), ASK).await?;

    // Given up after its deliveries, and the team API says why.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let eve = loop {
        let (_, body) = cli_json(&p, &["team"])?;
        let eve = body["teammates"]
            .as_array()
            .and_then(|l| l.iter().find(|m| m["name"] == "eve").cloned())
            .ok_or_else(|| anyhow::anyhow!("no teammate eve: {body}"))?;
        if eve.get("last_error").is_some() {
            break eve;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the turn was never given up: {eve}\n{}",
            p.log(w)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(eve["status"], "idle", "{eve}");
    assert_eq!(
        (eve["turns"].as_u64(), eve["turns_failed"].as_u64()),
        (Some(0), Some(1))
    );
    let why = eve["last_error"].as_str().unwrap_or_default();
    assert!(
        why.contains("conv.u.eve") && why.contains("3 deliveries"),
        "{why}"
    );
    // The message that carried the turn (taken straight from the inbox) was terminated:
    // delivered three times, nothing left to deliver.
    let turns = p
        .bus
        .js()
        .get_stream_no_info(p.bus.names().stream(StreamKind::Mailbox))
        .await?
        .consumer_info(flotilla_worker::inbox::INBOX_CONSUMER)
        .await?;
    assert_eq!(
        (
            turns.num_pending,
            turns.num_ack_pending,
            turns.delivered.consumer_sequence
        ),
        (0, 0, 3),
        "{turns:?}"
    );
    // `flotilla team show` says it too.
    let out = p.cli(&["team", "show", "eve"])?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("last turn failed") && text.contains("conv.u.eve"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Readable again: the next message's turn runs, and the reason is gone.
    team_kv.delete("conv.u.eve").await?;
    p.client.request(&send("u", "eve", "again"), ASK).await?;
    let m = until(&p, "u", "eve", Duration::from_secs(20), |m| m.turns == 1).await?;
    assert_eq!(m.last_reply.as_deref(), Some("turn 1 history 0"));
    let (_, body) = cli_json(&p, &["team"])?;
    let eve = body["teammates"]
        .as_array()
        .and_then(|l| l.iter().find(|m| m["name"] == "eve").cloned())
        .ok_or_else(|| anyhow::anyhow!("no teammate eve: {body}"))?;
    assert!(eve.get("last_error").is_none(), "{eve}");
    Ok(())
}

/// From the CLI a teammate is not a dead end: `team send --wait` prints its reply to that
/// message, `team log` its conversation, `team show` finds it; a teammate nobody has is
/// `not_found` (exit 1).
#[tokio::test]
async fn a_teammates_reply_and_conversation_read_from_the_cli() -> anyhow::Result<()> {
    let log = tempfile::NamedTempFile::new()?;
    let mut p = Processes::start(&config(log.path(), "")).await?;
    supervisor(&mut p).await?;
    p.worker(&[]).await?;
    let (code, body) = cli_json(
        &p,
        &[
            "team",
            "spawn",
            "ann",
            "--role",
            "analyst",
            "--instructions",
            "answer briefly",
            "--team",
            "t1",
        ],
    )?;
    assert_eq!(code, 0, "{body}");

    let out = p.cli(&["team", "send", "ann", "hello", "--wait", "--timeout", "30s"])?;
    let said = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}{err}");
    assert_eq!(said.trim(), "turn 1 history 0", "{err}");
    assert!(err.contains("sent to ann (seq "), "{err}");

    let out = p.cli(&[
        "team", "send", "ann", "again", "--team", "t1", "--wait", "--json",
    ])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reply: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(reply["reply"], "turn 2 history 2", "{reply}");
    assert_eq!(reply["failed"], false, "{reply}");

    let out = p.cli(&["team", "log", "ann"])?;
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{shown}");
    let lines: Vec<&str> = shown.lines().collect();
    assert_eq!(lines[0], "teammate ann of team t1: 2 turn(s)", "{shown}");
    assert!(lines[1].ends_with("operator → hello"), "{shown}");
    assert!(lines[2].ends_with("ann: turn 1 history 0"), "{shown}");
    assert!(lines[3].ends_with("operator → again"), "{shown}");
    assert!(lines[4].ends_with("ann: turn 2 history 2"), "{shown}");

    let out = p.cli(&["team", "show", "ann"])?;
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && shown.contains("teammate ann of team t1"),
        "{shown}"
    );

    for args in [
        vec!["team", "log", "nobody"],
        vec!["team", "send", "nobody", "hi", "--wait"],
    ] {
        let out = p.cli(&args)?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.starts_with("error: not_found: no teammate \"nobody\""),
            "{args:?}: {err}"
        );
    }
    Ok(())
}

/// Deliveries so far of the workers' inbox consumer and of `pool`'s turn queue.
async fn deliveries(p: &Processes, pool: &str) -> anyhow::Result<(u64, u64)> {
    let js = p.bus.js();
    let inbox = js
        .get_stream_no_info(p.bus.names().stream(StreamKind::Mailbox))
        .await?
        .consumer_info(flotilla_worker::inbox::INBOX_CONSUMER)
        .await?;
    let turns = js
        .get_stream_no_info(p.bus.names().stream(StreamKind::Tasks))
        .await?
        .consumer_info(p.bus.names().turn_consumer(pool))
        .await?;
    Ok((
        inbox.delivered.consumer_sequence,
        turns.delivered.consumer_sequence,
    ))
}

/// The host that claimed the teammate's latest turn.
fn last_host(m: &TeammateView) -> Option<String> {
    m.transitions.iter().rev().find_map(|t| t.host.clone())
}

/// The worker id of process `i`, from the registry.
async fn worker_id(p: &Processes, i: usize) -> anyhow::Result<String> {
    let workers = p.bus.kv(Bucket::Workers).await?;
    let mut keys = workers.keys().await?;
    use futures::StreamExt;
    while let Some(key) = keys.next().await {
        let key = key?;
        if let Some(v) = workers.get(&key).await?
            && serde_json::from_slice::<WorkerInfo>(&v)?.pid == p.pid(i).unwrap_or(0)
        {
            return Ok(key);
        }
    }
    anyhow::bail!("worker {i} is not registered")
}

#[tokio::test]
async fn mail_wakes_a_teammate_through_whichever_path_the_workers_offer() -> anyhow::Result<()> {
    let log = tempfile::NamedTempFile::new()?;
    let mut p = Processes::start(&config(log.path(), "")).await?;
    supervisor(&mut p).await?;
    let queue_only = [("FLOTILLA_WORKER__READ_INBOXES", "false")];
    // Workers that take turns only from their pool's turn queue: `default` and `side`.
    let plain = p.spawn_env(&["worker"], &queue_only)?;
    p.wait_registered(plain).await?;
    let side = p.spawn_env(
        &["worker"],
        &[queue_only[0], ("FLOTILLA_WORKER__POOL", "side")],
    )?;
    p.wait_registered(side).await?;
    let (plain_id, side_id) = (worker_id(&p, plain).await?, worker_id(&p, side).await?);
    spawn_mate(&p, "m", "ann", None).await?;
    spawn_mate(&p, "m", "bo", Some("side")).await?;

    // No worker reads the inboxes: the supervisor wakes the teammate at once, as before.
    let sent = tokio::time::Instant::now();
    p.client.request(&send("m", "ann", "one"), ASK).await?;
    let m = until(&p, "m", "ann", Duration::from_secs(10), |m| m.turns == 1).await?;
    assert!(sent.elapsed() < Duration::from_secs(4), "woken at once");
    assert_eq!(last_host(&m).as_deref(), Some(plain_id.as_str()));
    assert_eq!(
        deliveries(&p, "default").await.ok(),
        None,
        "no inbox consumer yet"
    );

    // A worker that reads the inboxes: mail for its pool's teammate is claimed there,
    // straight from the inbox (the turn queue is not used)...
    let reader = p.worker(&[]).await?;
    let reader_id = worker_id(&p, reader).await?;
    p.client.request(&send("m", "ann", "two"), ASK).await?;
    let m = until(&p, "m", "ann", Duration::from_secs(10), |m| m.turns == 2).await?;
    assert_eq!(last_host(&m).as_deref(), Some(reader_id.as_str()), "{m:?}");
    assert_eq!(deliveries(&p, "default").await?, (1, 1));
    // ... and mail for another pool's teammate goes to that pool's turn queue.
    p.client.request(&send("m", "bo", "three"), ASK).await?;
    let m = until(&p, "m", "bo", Duration::from_secs(10), |m| m.turns == 1).await?;
    assert_eq!(last_host(&m).as_deref(), Some(side_id.as_str()), "{m:?}");
    assert_eq!(deliveries(&p, "side").await?, (2, 1));

    // The only reader is killed; its registry entry still looks live, so the supervisor
    // leaves the wake to the readers, and wakes the mail itself once the grace is over.
    p.kill(reader);
    let sent = tokio::time::Instant::now();
    p.client.request(&send("m", "ann", "four"), ASK).await?;
    let m = until(&p, "m", "ann", Duration::from_secs(30), |m| m.turns == 3).await?;
    assert!(
        sent.elapsed() >= Duration::from_secs(4),
        "woken by the supervisor after the grace, not before"
    );
    assert_eq!(last_host(&m).as_deref(), Some(plain_id.as_str()), "{m:?}");
    let conv: flotilla_model::teammate::Conversation = serde_json::from_slice(
        &p.bus
            .kv(Bucket::Team)
            .await?
            .get("conv.m.ann")
            .await?
            .ok_or_else(|| anyhow::anyhow!("no conversation"))?,
    )?;
    let said: Vec<&str> = conv.lines.iter().map(|l| l.text.as_str()).collect();
    assert_eq!(
        said.len(),
        6,
        "three exchanges, each message read once: {said:?}"
    );
    assert_eq!((said[0], said[2], said[4]), ("one", "two", "four"));
    Ok(())
}

#[tokio::test]
async fn mail_to_many_teammates_is_read_once_while_a_worker_is_killed() -> anyhow::Result<()> {
    // Two workers reading the inboxes with two slots each, ten teammates and three
    // messages to each sent at once: some turns are claimed straight from the inbox, some go
    // through the turn queue (no slot free), some find their teammate working. One worker is
    // killed mid-way; its turns are taken over when their mail comes again.
    let log = tempfile::NamedTempFile::new()?;
    let mut p = Processes::start(&config(log.path(), "")).await?;
    supervisor(&mut p).await?;
    let w1 = p.worker(&["--concurrency", "2"]).await?;
    let _w2 = p.worker(&["--concurrency", "2"]).await?;
    let names: Vec<String> = (0..10).map(|i| format!("m{i}")).collect();
    for name in &names {
        spawn_mate(&p, "c", name, None).await?;
    }
    let client = p.client.clone();
    let sends = |round: usize| {
        let client = &client;
        futures::future::try_join_all(names.iter().map(move |n| {
            let text = if round == 0 {
                format!("slow {n} {round}")
            } else {
                format!("{n} {round}")
            };
            async move { client.request(&send("c", n, &text), ASK).await }
        }))
    };
    sends(0).await?;
    sends(1).await?;
    // Kill a worker once it runs a turn (the first messages are slow).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while std::fs::read_to_string(log.path())?.lines().count() < 2 {
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "no turn started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    p.kill(w1);
    sends(2).await?;

    // Every teammate read each of its three messages exactly once, and is idle.
    let team_kv = p.bus.kv(Bucket::Team).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    for n in &names {
        loop {
            let m = mate(&p, "c", n).await?;
            let conv: flotilla_model::teammate::Conversation =
                match team_kv.get(format!("conv.c.{n}")).await? {
                    Some(v) => serde_json::from_slice(&v)?,
                    None => Default::default(),
                };
            let mut read: Vec<String> = conv
                .lines
                .iter()
                .filter(|l| l.speaker == flotilla_model::teammate::Speaker::User)
                .map(|l| l.text.clone())
                .collect();
            read.sort();
            let mut sent = vec![format!("slow {n} 0"), format!("{n} 1"), format!("{n} 2")];
            sent.sort();
            if m.status == TeammateStatus::Idle && read.len() >= 3 {
                assert_eq!(read, sent, "{n}: each message read once: {conv:?}");
                break;
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "{n} never read its mail: {m:?} {conv:?}\n{}",
                p.log(w1)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

#[tokio::test]
async fn mail_published_straight_to_an_inbox_wakes_its_teammate() -> anyhow::Result<()> {
    // What the supervisor's own mail to a run's lead is: a post on the inbox subject, no
    // `team.send` — taken by the worker it reaches; to a teammate shut down, kept unread.
    let log = tempfile::NamedTempFile::new()?;
    let mut p = Processes::start(&config(log.path(), "")).await?;
    supervisor(&mut p).await?;
    p.worker(&[]).await?;
    for name in ["ann", "bo"] {
        spawn_mate(&p, "d", name, None).await?;
    }
    let post = |text: &str| flotilla_model::teammate::TeammatePost {
        protocol: 1,
        from: "lead".into(),
        text: text.into(),
    };
    for i in 0..3 {
        let text = format!("direct {i}");
        p.bus
            .publish(
                p.bus.names().teammate_inbox("d", "ann", "lead"),
                &post(&text),
                None,
            )
            .await?;
        let m = until(&p, "d", "ann", Duration::from_secs(10), |m| {
            m.turns == i + 1
        })
        .await?;
        assert_eq!(m.status, TeammateStatus::Idle);
    }
    let (inbox, queue) = deliveries(&p, "default").await?;
    assert_eq!((inbox, queue), (3, 0), "taken straight from the inbox");

    // Shut down: its mail is kept, and no turn runs.
    p.client
        .request(
            &flotilla_model::teammate::TeamShutdownRequest {
                protocol: 1,
                team: Some("d".into()),
                name: "bo".into(),
            },
            ASK,
        )
        .await?;
    p.bus
        .publish(
            p.bus.names().teammate_inbox("d", "bo", "lead"),
            &post("late"),
            None,
        )
        .await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let bo = mate(&p, "d", "bo").await?;
    assert_eq!(
        (bo.status, bo.turns),
        (TeammateStatus::Shutdown, 0),
        "{bo:?}"
    );
    Ok(())
}

#[tokio::test]
async fn a_mailer_sends_as_team_send_does_with_no_supervisor_on_the_path() -> anyhow::Result<()> {
    // flotilla-client's Mailer makes team.send's checks itself and stores the message straight
    // in the inbox: the same refusals with the same codes and messages as the supervisor's
    // (nothing stored for them), a teammate spawned a moment ago found, mail that reaches its
    // teammate while no supervisor runs, and an entry without its cap (as an older version
    // writes it) left to team.send. `flotilla team send --direct` is the same from the CLI.
    let log = tempfile::NamedTempFile::new()?;
    let mut p = Processes::start(&config(
        log.path(),
        "turns-per-hour = 2\nmax-message-bytes = 100",
    ))
    .await?;
    let sup = supervisor(&mut p).await?;
    p.worker(&[]).await?;
    for name in ["a1", "a2"] {
        spawn_mate(&p, "m", name, None).await?;
    }
    let mailer = flotilla_client::Mailer::open(p.bus.clone()).await?;
    // Spawned after the mailer's mirror synced, and mailed at once: found.
    spawn_mate(&p, "m", "a3", None).await?;
    mailer.send(&send("m", "a3", "hello")).await?.expect("sent");
    until(&p, "m", "a3", Duration::from_secs(10), |m| m.turns == 1).await?;

    let big = "x".repeat(101);
    let mut bad_sender = send("m", "a1", "hi");
    bad_sender.from = Some("b*".into());
    let mut old_protocol = send("m", "a1", "hi");
    old_protocol.protocol = 0;
    for (req, code, status) in [
        (send("m", "a1", &big), "message_too_large", 413),
        (send("m", "nobody", "hi"), "not_found", 404),
        (send("m", "nobody", &big), "not_found", 404),
        (send("no.team", "a1", "hi"), "invalid_team", 400),
        (send("m", "_a1", "hi"), "invalid_name", 400),
        (bad_sender, "invalid_sender", 400),
        (old_protocol, "unsupported_protocol", 400),
    ] {
        let direct = mailer.send(&req).await?.expect_err("refused");
        let through = p.client.call(&req, ASK).await?.expect_err("refused");
        assert_eq!(
            (direct.code.as_str(), direct.status),
            (code, status),
            "{direct:?}"
        );
        assert_eq!(
            (&direct.code, direct.status, &direct.message),
            (&through.code, through.status, &through.message),
            "the mailer refuses as team.send does"
        );
    }
    let (code, body) = cli_json(
        &p,
        &["team", "send", "nobody", "hi", "--team", "m", "--direct"],
    )?;
    assert_eq!(
        (code, body["error"].as_str()),
        (1, Some("not_found")),
        "{body}"
    );
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("teammates: a1, a2, a3")),
        "{body}"
    );

    // Accepted: stored in the inbox, the turn taken from it by the worker.
    let sent = mailer.send(&send("m", "a2", "one")).await?.expect("sent");
    assert_eq!(sent.delivered, ["a2"]);
    until(&p, "m", "a2", Duration::from_secs(10), |m| m.turns == 1).await?;
    let (code, body) = cli_json(
        &p,
        &["team", "send", "a1", "one", "--team", "m", "--direct"],
    )?;
    assert_eq!(code, 0, "{body}");
    assert_eq!(body["delivered"], serde_json::json!(["a1"]));
    until(&p, "m", "a1", Duration::from_secs(10), |m| m.turns == 1).await?;

    // An entry without its cap, as a worker or supervisor of an older version writes it back:
    // only the supervisor knows the cap to check, so the message goes through team.send.
    let kv = p.bus.kv(Bucket::Team).await?;
    let a2_key = flotilla_model::teammate::teammate_key("m", "a2");
    let mut old = serde_json::from_slice::<serde_json::Value>(
        &kv.get(&a2_key)
            .await?
            .ok_or_else(|| anyhow::anyhow!("a2 has no entry"))?,
    )?;
    assert_eq!(old["max_message_bytes"], 100, "written at spawn: {old}");
    old.as_object_mut().map(|o| o.remove("max_message_bytes"));
    kv.put(&a2_key, serde_json::to_vec(&old)?.into()).await?;
    let reading = flotilla_client::Mailer::reading(p.bus.clone()).await?;
    let refused = reading
        .send(&send("m", "a2", &big))
        .await?
        .expect_err("too large");
    assert_eq!(refused.code, "message_too_large");
    reading
        .send(&send("m", "a2", "short"))
        .await?
        .expect("sent");
    until(&p, "m", "a2", Duration::from_secs(10), |m| m.turns == 2).await?;

    // With no supervisor running, the mail still wakes its teammate; the entry without its
    // cap cannot be checked without one.
    p.kill(sup);
    mailer.send(&send("m", "a1", "two")).await?.expect("sent");
    let key = flotilla_model::teammate::teammate_key("m", "a1");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let entry = kv
            .get(&key)
            .await?
            .ok_or_else(|| anyhow::anyhow!("a1 has no entry"))?;
        let a1: flotilla_model::teammate::Teammate = serde_json::from_slice(&entry)?;
        if a1.turns == 2 && a1.status == TeammateStatus::Idle {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "a1 never ran its second turn: {a1:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let no_supervisor = reading
        .send(&send("m", "a2", "later"))
        .await
        .expect_err("needs team.send");
    assert_eq!(
        no_supervisor.kind(),
        flotilla_client::ClientErrorKind::NoSupervisor
    );
    let (inbox, queue) = deliveries(&p, "default").await?;
    assert_eq!((inbox, queue), (5, 0), "taken straight from the inbox");

    // The hourly cap (2 turns) and a shutdown, refused from the entry as read now.
    let capped = reading
        .send(&send("m", "a1", "three"))
        .await?
        .expect_err("capped");
    assert_eq!(
        (capped.code.as_str(), capped.status),
        ("turns_per_hour", 429)
    );
    let sup = supervisor(&mut p).await?;
    p.client
        .request(
            &flotilla_model::teammate::TeamShutdownRequest {
                protocol: 1,
                team: Some("m".into()),
                name: "a3".into(),
            },
            ASK,
        )
        .await?;
    let shut = reading
        .send(&send("m", "a3", "late"))
        .await?
        .expect_err("shut down");
    assert_eq!((shut.code.as_str(), shut.status), ("shut_down", 409));
    let through = p
        .client
        .call(&send("m", "a3", "late"), ASK)
        .await?
        .expect_err("shut down");
    assert_eq!(shut.message, through.message);
    p.kill(sup);

    // Nothing refused was stored: the five accepted messages are the inboxes' only ones.
    assert_eq!(
        stored_in_inboxes(&p).await?,
        5,
        "only the accepted messages are in the inboxes"
    );
    Ok(())
}
